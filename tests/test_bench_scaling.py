"""`cosyvoice-bench`'s CPU class, per-precision bounds, thread scaling, latency policy and plots, on the tiny
bundle: one quick run at 2 threads with every option, and the pieces it is made of. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from test_bench import bench_args, check_common

from cosyvoice_bench import cli as bench_cli
from cosyvoice_bench.bounds import (
    ModelShapes,
    dit_flops_per_step,
    dit_int8_flops_per_step,
    hift_flops,
    llm_bytes_per_token,
    llm_weight_count,
    needs_bf16_rate,
    stage_bounds,
)
from cosyvoice_bench.cli import main
from cosyvoice_bench.machine import (
    Rates,
    bf16_matmul_gflops,
    cpu_class,
    int8_matmul_gflops,
    int8_matmul_model,
    vector_features,
)
from cosyvoice_bench.report import SCALING_FIGURES
from cosyvoice_graphs.precision import BF16, FP32, INT8, PRECISIONS
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners.openvino import unsupported_reason

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIRST_CHUNK_TOKENS = 10


# --- the CPU class ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "fma"}, "avx2"),
    ({"avx2", "fma", "avx_vnni"}, "avx2+vnni"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "avx512+vnni+bf16"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
     "avx512+vnni+bf16+amx"),
])
def test_cpu_class_names_the_vector_features(flags: set[str], expected: str) -> None:
    features = vector_features(flags)
    assert set(features) == {"AVX2", "AVX-512", "VNNI", "BF16", "AMX"}
    assert cpu_class(features) == expected


# --- the int8 rate and the bounds ------------------------------------------------------------------------


def test_int8_matmul_is_a_dynamic_quantize_matmul_of_constant_int8_weights() -> None:
    m, k, n = 8, 32, 16
    session = ort.InferenceSession(int8_matmul_model(m, k, n), providers=["CPUExecutionProvider"])
    a = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
    weights = np.random.default_rng(0).integers(-64, 64, size=(k, n), dtype=np.int8)  # as the model's
    (y,) = session.run(None, {"a": a})
    reference = a @ (weights.astype(np.float32) * 1e-2)
    assert np.abs(y - reference).max() < 0.02 * np.abs(reference).max()  # uint8 activations' rounding
    assert int8_matmul_gflops(m, k, n, threads=1, repeats=1) > 0


def rates(int8_gflops: float | None) -> Rates:
    return Rates(threads=2, bandwidth_gbs=40.0, matmul_shape=(100, 64, 128), matmul_gflops=100.0,
                 int8_matmul_gflops=int8_gflops)


def test_an_int8_dit_is_bounded_at_the_int8_rate(runtime_bundle: Path) -> None:
    shapes = ModelShapes.of(RuntimeBundle.open(runtime_bundle))
    assert shapes.dit_precision == shapes.llm_precision == FP32
    frames, figures = 120, {"llm_per_token_s": 1.0, "flow_per_step_s": 1.0, "hift_s": 1.0}
    total, quantized = dit_flops_per_step(shapes.dit, frames), dit_int8_flops_per_step(shapes.dit, frames)
    assert 0 < quantized < total
    fp32 = stage_bounds(shapes, frames, 40, 30, rates(None), figures, None)
    assert fp32["dit_bound_s_per_step"] == pytest.approx(total / 100e9) == fp32["dit_fraction_runtime"]
    int8 = replace(shapes, dit_precision=INT8)
    for gflops in (200.0, 400.0):
        b = stage_bounds(int8, frames, 40, 30, rates(gflops), figures, figures)
        assert b["dit_precision"] == "int8" and b["int8_matmul_gflops"] == gflops
        assert b["dit_int8_flops_per_step"] == quantized
        expected = (total - quantized) / 100e9 + quantized / (gflops * 1e9)
        assert b["dit_bound_s_per_step"] == pytest.approx(expected)
        assert b["dit_bound_fp32_s_per_step"] == fp32["dit_bound_s_per_step"]  # torch's, float32
        assert b["dit_fraction_torch"] == pytest.approx(fp32["dit_bound_s_per_step"])
        assert b["hift_bound_s"] == fp32["hift_bound_s"]
    with pytest.raises(ValueError, match="int8 matmul rate"):
        stage_bounds(int8, frames, 40, 30, rates(None), figures, None)


def test_a_bf16_graph_is_bounded_at_openvinos_bf16_rate(runtime_bundle: Path) -> None:
    shapes = ModelShapes.of(RuntimeBundle.open(runtime_bundle))
    assert not needs_bf16_rate(shapes)
    frames, vocoded, figures = 120, 40, {"flow_per_step_s": 1.0, "hift_s": 1.0}
    measured = replace(rates(None), precision_gflops={BF16.name: 400.0})
    for bf16 in (replace(shapes, hift_precision=BF16), replace(shapes, dit_precision=BF16)):
        assert needs_bf16_rate(bf16)
        b = stage_bounds(bf16, frames, vocoded, 30, measured, figures, None)
        dit_rate, hift_rate = (4e11 if p == BF16 else 1e11 for p in (bf16.dit_precision, bf16.hift_precision))
        assert b["dit_bound_s_per_step"] == pytest.approx(dit_flops_per_step(shapes.dit, frames) / dit_rate)
        assert b["hift_bound_s"] == pytest.approx(hift_flops(shapes.hift, vocoded) / hift_rate)
        assert b["precision_gflops"] == {"bf16": 400.0}
    unmeasured = stage_bounds(replace(shapes, hift_precision=BF16), frames, vocoded, 30, rates(None), figures,
                              None)
    assert unmeasured["hift_rate"] == "float32 MatMul (no bf16 rate measured)"


NO_BF16 = unsupported_reason(BF16)


@pytest.mark.skipif(NO_BF16 is not None, reason=f"OpenVINO's bf16 rate is not measured here: {NO_BF16}")
def test_the_bf16_rate_is_openvinos_on_a_constant_weight() -> None:
    assert bf16_matmul_gflops(64, 128, 256, threads=1, repeats=1) > 0


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_the_llm_bound_reads_weights_at_the_precision_records_bytes(runtime_bundle: Path, precision: str
                                                                     ) -> None:
    shapes = replace(ModelShapes.of(RuntimeBundle.open(runtime_bundle)), llm_precision=PRECISIONS[precision])
    weights = llm_weight_count(shapes.qwen, shapes.speech_vocab)
    assert (llm_bytes_per_token(shapes, 0) == weights * PRECISIONS[precision].weight_bytes
            == stage_bounds(shapes, 50, 20, 0, rates(None), {}, None)["llm_bytes_per_token"])


# --- a quick run with every option -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_with_options(runtime_bundle: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> tuple[dict[str, Any], Path]:
    """A quick run at 2 threads with every option: its JSON and the JSON's path."""
    pytest.importorskip("matplotlib", reason="--plots needs matplotlib (the dev extra)")
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = [*bench_args(runtime_bundle, out), "--threads", "2", "--lengths", "medium", "--concurrency", "1",
            "--thread-scaling", "--first-chunk-tokens", str(FIRST_CHUNK_TOKENS), "--plots"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "thread scaling" in done.stdout and "CPU class" in done.stdout and "of bound" in done.stdout
    return json.loads(out.read_text()), out


def test_the_json_carries_the_cpu_class_policy_and_thread_scaling(
        run_with_options: tuple[dict[str, Any], Path]) -> None:
    result, _ = run_with_options
    check_common(result, ["medium"], [1], threads=2, policy=True)
    assert result["settings"]["first_chunk_tokens"] == FIRST_CHUNK_TOKENS
    runtime = result["cases"][0]["runtime"]
    assert runtime["first_chunk_policy_audio_s"] < runtime["first_chunk_audio_s"]  # it fires earlier
    scaling = result["thread_scaling"]
    assert scaling["length"] == "medium" and scaling["cpu_class"] == result["cpu_class"]
    assert [r["threads"] for r in scaling["rows"]] == [1, 2]
    for row in scaling["rows"]:
        assert all(row[key] > 0 for key in SCALING_FIGURES), row
        bounds = row["bounds"]
        assert bounds["threads"] == row["threads"]
        for key in ("memory_bandwidth_gbs", "matmul_gflops", "llm_fraction_runtime", "dit_fraction_runtime",
                    "hift_fraction_runtime"):
            assert bounds[key] > 0, key
    assert scaling["rows"][1]["bounds"] == result["cases"][0]["bounds"]  # --threads' row: the warm rounds'
    assert scaling["rows"][1]["llm_per_token_s"] == runtime["llm_per_token_s"]


def test_the_plots_are_pngs_beside_the_json(run_with_options: tuple[dict[str, Any], Path]) -> None:
    import matplotlib.image

    result, out = run_with_options
    paths = [out.with_name("bench-stages.png"), out.with_name("bench-first-chunk.png")]
    assert result["plots"] == [str(p) for p in paths]
    for path in paths:
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100


_BLOCK_MATPLOTLIB = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _Block())
"""


def test_plots_without_matplotlib_refuse_before_measuring(runtime_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    script = _BLOCK_MATPLOTLIB + textwrap.dedent(f"""
        from cosyvoice_bench.cli import main
        main({[*bench_args(runtime_bundle, out), "--plots"]!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: --plots needs matplotlib, which is not installed: "
                           "pip install 'cosyvoice-onnx[dev]'\n")
    assert not out.exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--plots"], "error: --plots writes its PNGs beside the JSON: give --json FILE too"),
    (["--first-chunk-tokens", "1"], "error: first_chunk_tokens must be >= "),
    (["--chunk-slots", "2", "--concurrency", "1,2"], "error: --chunk-slots: the slots are the batched runs', "
                                                    "and there are none: "),  # the bundle has no llm_decode
])
def test_bad_options_are_one_line(runtime_bundle: Path, tmp_path: Path, extra: list[str], message: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything is measured: a first chunk below the vocoder's look-ahead is held to the bundle."""
    monkeypatch.setattr(bench_cli, "run", lambda *_, **__: pytest.fail("the run started"))
    args = [*bench_args(runtime_bundle, tmp_path / "x.json"), *extra]
    if extra == ["--plots"]:
        args = [a for a in args if a not in ("--json", str(tmp_path / "x.json"))]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith(message)
    assert not (tmp_path / "x.json").exists()
