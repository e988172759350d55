"""`cosyvoice-export all --providers`: a bundle of the graphs the runtime opens on those providers
(`cosyvoice_graphs.pipeline`), which speaks there as the whole bundle does, and is refused in one line where
it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

from click.testing import CliRunner, Result

from cosyvoice_export.bundle.tiny import config_for_size
from cosyvoice_export.cli import main
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.export_plan import bundle_graphs
from cosyvoice_export.onnx.output_dir import graph_record_file
from cosyvoice_graphs import LLM, spec
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.pipeline import PipelineError
from cosyvoice_graphs.precision_plan import PrecisionPlan
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.errors import RuntimeBundleError

REST = ["flow_encoder", "flow_estimator_cached", "hift_f0", "hift_decoder"]


def _export(model: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["all", "--model-dir", str(model), "--out", str(out),
                                     "--precision", "cpu-fast", *args])


def _speak(bundle: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(run_main, ["--model", str(bundle), "--text", "Hello there.", "--out", str(out),
                                         *args])


def _runs(result: Result) -> dict[str, str]:
    """Graph -> "exported" or "reused", from the export's summary table."""
    rows = [line.split() for line in result.output.splitlines()]
    return {row[0]: row[-2] for row in rows if len(row) > 2 and row[-2] in ("exported", "reused")
            and not row[1].startswith("[")}


def test_a_bundle_for_the_cpu_leaves_llm_out_and_speaks_as_the_whole_one(tiny_bundle: Path,
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "fast"
    whole = _export(tiny_bundle, out)
    assert whole.exit_code == 0, whole.output
    assert _speak(out, tmp_path / "whole.wav").exit_code == 0

    for_cpu = _export(tiny_bundle, out, "--providers", "cpu")
    assert for_cpu.exit_code == 0, for_cpu.output
    assert _runs(for_cpu) == dict.fromkeys([*REST, "llm_prefill", "llm_decode"], "reused")
    assert "6 graphs in " in for_cpu.output and " s, for cpu; manifest: " in for_cpu.output
    manifest = json.loads((out / MANIFEST).read_text())
    assert LLM not in manifest["graphs"] and not any("llm.onnx" in f for f in manifest["files"])
    assert not (out / "graphs" / "llm.onnx").exists() and not (out / graph_record_file(LLM)).exists()
    spoken = _speak(out, tmp_path / "cpu.wav")
    assert spoken.exit_code == 0, spoken.output
    assert (tmp_path / "cpu.wav").read_bytes() == (tmp_path / "whole.wav").read_bytes()
    info = CliRunner().invoke(run_main, ["--model", str(out), "--info"])
    assert info.exit_code == 0 and "providers: cpu\n" in info.output

    refused = _speak(out, tmp_path / "openvino.wav", "--provider", "openvino")
    assert refused.exit_code != 0 and not (tmp_path / "openvino.wav").exists()
    assert (f"error: {out}: its decode steps on 'openvino' would run on llm, which it was exported without "
            "(cosyvoice-export all --providers); its llm_decode runs on onnxruntime's cpu provider"
            in refused.output)

    again = _export(tiny_bundle, out)  # every provider's graphs again: llm alone is exported
    assert again.exit_code == 0, again.output
    assert _runs(again) == {LLM: "exported", **dict.fromkeys([*REST, "llm_prefill", "llm_decode"], "reused")}
    assert " s, for cpu, cuda, tensorrt; manifest: " in again.output
    assert "providers: cpu, cuda, tensorrt\n" in CliRunner().invoke(run_main, ["--model", str(out), "--info"]
                                                                    ).output


def test_a_provider_that_cannot_run_the_precision_is_refused_before_anything_is_written(
        tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = _export(tiny_bundle, out, "--providers", "cpu,openvino")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --providers openvino: a --precision cpu-fast bundle cannot run there: its llm is in int4, "
        "which runs on onnxruntime (4-bit operators, which TensorRT does not build), not on 'openvino'")
    assert not out.exists()
    for value, why in (("cpu,gpu", "unknown provider 'gpu'; known: cpu, cuda, tensorrt, trt, openvino"),
                       ("cpu,cpu", "'cpu,cpu' names a provider twice")):
        result = _export(tiny_bundle, out, "--providers", value)
        assert result.exit_code == 2 and f"Invalid value for '--providers': {why}" in result.output
    assert not out.exists()


@pytest.mark.parametrize(("plan", "providers", "left_out"), [
    ("decode=fp16,dit=tf32", ("cuda",), {LLM}),
    ("decode=fp16,dit=tf32", ("cpu", "cuda"), {LLM}),
    ("decode=fp16", ("cuda", "tensorrt"), set()),  # TensorRT decodes on the fp32 llm
    ("gpu-fp16", ("cuda",), {LLM}),
    ("decode=fp16,prefill=int8", ("cuda",), {LLM, "llm_prefill"}),  # the prefill writes the GPU's caches
    ("decode=fp16,prefill=int8", ("cpu",), {LLM}),
    ("cpu-fast", ("cpu", "cuda"), set()),
    ("fp32", ("cpu",), set()),
])
def test_each_plan_keeps_what_its_providers_open(plan: str, providers: tuple[str, ...], left_out: set[str]
                                                 ) -> None:
    parsed = PrecisionPlan.parse(plan)
    dims = model_dims(config_for_size("tiny"))
    specs = {name: spec(name, dims) for name in parsed.graph_names}
    assert bundle_graphs(parsed, specs, providers, trt=False) == [g for g in specs if g not in left_out]
    assert bundle_graphs(parsed, specs, None, trt=False) == list(specs)


def test_an_fp16_llm_goes_into_a_bundle_for_tensorrt_only_as_a_plan() -> None:
    parsed = PrecisionPlan.parse("gpu-fp16")
    dims = model_dims(config_for_size("tiny"))
    specs = {name: spec(name, dims) for name in parsed.graph_names}
    with pytest.raises(PipelineError, match="^--providers tensorrt: a --precision gpu-fp16 bundle cannot run "
                                            "there: its fp16 llm attends with"):
        bundle_graphs(parsed, specs, ("tensorrt",), trt=False)
    assert bundle_graphs(parsed, specs, ("trt",), trt=True) == [LLM, *REST]


def test_the_runtime_opens_a_bundle_without_llm_only_beside_llm_decode(runtime_bundle: Path,
                                                                       tmp_path: Path) -> None:
    manifest = json.loads((runtime_bundle / MANIFEST).read_text())
    del manifest["graphs"][LLM]
    manifest["files"] = {rel: f for rel, f in manifest["files"].items() if not rel.startswith("graphs/llm.")}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RuntimeBundleError, match=r"graphs are \[.*\], expected \[.*\] \(llm only beside "
                                                 r"llm_decode\) and optionally"):
        RuntimeBundle.open(tmp_path)
