"""`python -m cosyvoice_bench.decode_variants`: `llm_decode`'s step as the runtime makes it, bound once,
from a CUDA graph and with XQA on and off, the same steps each. On the CPU the first two run and give the same
log-probs to the bit; the CUDA variants say why they were skipped. With a CUDA provider they run (the fp16
body, CUDA's), each reported or failed, never ending the measurement."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="needs torch (the export extra): the fixture exports a bundle")
pytestmark = pytest.mark.torch

import cosyvoice_bench.decode_variants as decode_variants
from cosyvoice_bench.decode_variants import (
    BOUND_ONCE,
    CUDA_GRAPH,
    RUNTIME,
    VARIANTS,
    XQA_OFF,
    XQA_ON,
    main,
    make_steps,
    measure,
    open_variant,
)
from cosyvoice_graphs import LLM_DECODE, cache_pairs
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_the_steps_start_each_row_at_its_own_length_with_room_for_all(fp16_decode_bundle: Path) -> None:
    spec = RuntimeBundle.open(fp16_decode_bundle).specs[LLM_DECODE]
    steps = make_steps(spec, 3, 20, 6)
    assert [list(lengths) for lengths in steps.lengths[:2]] == [[20, 27, 34], [21, 28, 35]]
    assert len(steps.embeds) == 6 and steps.embeds[0].shape[:2] == (3, 1)
    assert not np.array_equal(steps.embeds[0], steps.embeds[1])
    for past, _ in cache_pairs(spec):
        assert steps.caches[past].shape[0] == 3 and steps.caches[past].shape[2] == 34 + 6
        assert steps.caches[past].dtype == np.float16  # the fp16 body's caches


def test_on_the_cpu_the_binding_made_once_gives_the_runtimes_log_probs(fp16_decode_bundle: Path) -> None:
    """The step bound once (only the embeddings and the lengths written per step) computes what the runtime's
    call computes, to the bit, over steps whose rows grow; the CUDA variants are listed with the reason."""
    result = measure(RuntimeBundle.open(fp16_decode_bundle), "cpu", 3, past=20, steps=6)
    assert result["rows"] == 3 and list(result["variants"]) == list(VARIANTS)
    for variant in (RUNTIME, BOUND_ONCE):
        r = result["variants"][variant]
        assert r["max_abs_diff"] == 0 and r["steps_with_another_best_id"] == 0
        assert r["step_ms"] > 0 and r["first_step_ms"] > 0
    assert result["variants"][CUDA_GRAPH] == {
        "skipped": "needs the cuda provider: onnxruntime's CUDA graphs are a CUDA provider option"}
    assert result["variants"][XQA_ON]["skipped"].startswith("needs the cuda provider: XQA")


def test_the_xqa_variants_set_their_variable_only_while_their_session_is_made(
        fp16_decode_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []
    monkeypatch.setattr(decode_variants, "OrtRunner",
                        lambda *args, **kwargs: seen.append(os.environ.get("ORT_ENABLE_XQA")))
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    monkeypatch.delenv("ORT_ENABLE_XQA", raising=False)
    open_variant(bundle, "cpu", XQA_ON)
    assert "ORT_ENABLE_XQA" not in os.environ
    monkeypatch.setenv("ORT_ENABLE_XQA", "7")
    open_variant(bundle, "cpu", XQA_OFF)
    open_variant(bundle, "cpu", RUNTIME)
    assert seen == ["1", "0", "7"] and os.environ["ORT_ENABLE_XQA"] == "7"


def test_the_command_writes_its_json_and_refuses_what_it_cannot_measure(fp16_decode_bundle: Path,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "variants.json"
    done = CliRunner().invoke(main, ["--model", str(fp16_decode_bundle), "--rows", "1,2", "--past", "10",
                                     "--steps", "4", "--json", str(out)])
    assert done.exit_code == 0, done.output
    written = json.loads(out.read_text())
    assert written["provider"] == "cpu" and written["precision"] == "fp16"
    assert [run["rows"] for run in written["runs"]] == [1, 2]
    assert "  2 rows, bound once " in done.output and "largest difference 0.00e+00" in done.output
    without = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE)])
    assert without.exit_code == 2
    assert without.output.startswith("error: ") and "do not run on llm_decode" in without.output
    for rows in ("0", "2,x", "17"):
        bad = CliRunner().invoke(main, ["--model", str(fp16_decode_bundle), "--rows", rows])
        assert bad.exit_code == 2 and "comma-separated row counts from 1 to 16" in bad.output
    short = CliRunner().invoke(main, ["--model", str(fp16_decode_bundle), "--steps", "2"])
    assert short.exit_code == 2 and "--steps" in short.output


def test_a_cuda_variant_that_fails_is_reported_and_any_other_failure_ends_it(
        fp16_decode_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime refusing or failing a CUDA graph or XQA session is a finding: its first line is kept and
    the other variants are measured; the runtime's or the bound step's failing is an error."""
    real = decode_variants.run_variant
    failing = {CUDA_GRAPH}

    def run_variant(bundle: RuntimeBundle, provider: str, variant: str, steps: decode_variants.Steps
                    ) -> tuple[list[np.ndarray], list[float]]:
        if variant in failing:
            raise RuntimeError("CUDA graph is not supported: nodes placed on the CPU\nthe rest of the log")
        return real(bundle, "cpu", variant, steps)  # the CUDA session's work, done on the CPU here

    monkeypatch.setattr(decode_variants, "run_variant", run_variant)
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    result = measure(bundle, "cuda", 2, past=10, steps=4)["variants"]
    assert result[CUDA_GRAPH] == {"failed": "CUDA graph is not supported: nodes placed on the CPU"}
    assert result[XQA_ON]["max_abs_diff"] == 0 and result[XQA_OFF]["steps_with_another_best_id"] == 0
    failing = {BOUND_ONCE}
    with pytest.raises(RuntimeError, match="CUDA graph is not supported"):
        measure(bundle, "cuda", 2, past=10, steps=4)


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime's CUDA provider (onnxruntime-gpu and a GPU)")
def test_on_cuda_every_variant_is_measured_or_says_why_it_failed(fp16_decode_bundle: Path) -> None:
    """The bound step and its CUDA graph (which `llm_decode` version 3 allows: its lengths are inputs) agree
    with the runtime's step; XQA's sessions are measured or say why they failed."""
    result = measure(RuntimeBundle.open(fp16_decode_bundle), "cuda", 2, past=20, steps=6)
    for variant in (BOUND_ONCE, CUDA_GRAPH):  # other sessions: cuBLAS may pick other kernels
        r = result["variants"][variant]
        assert "failed" not in r, r
        assert r["max_abs_diff"] < 1e-2 and r["steps_with_another_best_id"] == 0, (variant, r)
    for variant in (XQA_ON, XQA_OFF):
        r = result["variants"][variant]
        assert "failed" in r or np.isfinite(r["max_abs_diff"]), (variant, r)
