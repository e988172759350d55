"""OpenVINO: the `openvino` provider (every graph on OpenVINO's CPU plugin in float32) and bf16 bundles
(`--precision bf16`: the DiT and HiFT's decoder compiled for bf16 by OpenVINO).

The bf16 arithmetic itself is tested only on a CPU with bf16 instructions (`test_bf16_bundle_on_a_bf16_cpu`,
skipped elsewhere with the reason). Everything around it runs on any CPU: the refusals, and a bf16 export
and synthesis with OpenVINO's bf16 hint pinned to f32, which exercises every step but the rounding."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("openvino", reason="the openvino extra is not installed")
pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
from click.testing import CliRunner

from cosyvoice_export.cli import main as export_main
from cosyvoice_export.onnx import bf16 as export_bf16
from cosyvoice_export.onnx.bundle_assembly import export_all
from cosyvoice_export.onnx.trt import TrtUnavailable
from cosyvoice_golden.cli import main as golden_main
from cosyvoice_graphs import DIT, HIFT_DECODER, PRECISIONS, SPECS
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_runtime.bundle import RuntimeBundle, read_onnx_metadata
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import ProviderError, RuntimeBundleError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import OpenVinoRunner, open_runner
from cosyvoice_runtime.runners.openvino import unsupported_reason
from cosyvoice_runtime.sampling import GreedySampler
from cosyvoice_runtime.synthesis import Synthesizer

NO_BF16 = unsupported_reason(PRECISIONS["bf16"])
BF16_GRAPHS = (DIT, HIFT_DECODER)
"""The graphs a bf16 bundle computes in bf16: those whose specs bound bf16."""
REL_TO_ONNXRUNTIME = 1e-5
"""OpenVINO float32 against onnxruntime on one call, relative to the output's largest value (measured on
the demo bundle: 3.5e-6 at most, hift_decoder's waveform)."""


@pytest.fixture(scope="module")
def demo() -> RuntimeBundle:
    return RuntimeBundle.open(DEMO_BUNDLE)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_graph_runs_on_openvino_as_on_onnxruntime(demo: RuntimeBundle, name: str) -> None:
    spec = demo.specs[name]
    for case in spec.validate:
        feeds = spec.sample_inputs(case)
        with (open_runner(demo, name, "cpu", threads=1) as ort,
              open_runner(demo, name, "openvino", threads=1) as ov):
            assert isinstance(ov, OpenVinoRunner) and ov.precision == "fp32"
            want, got = ort.infer(feeds), ov.infer(feeds)
        for t in spec.outputs:
            assert got[t.name].shape == want[t.name].shape and got[t.name].dtype == t.np_dtype, t.name
            scale = float(np.abs(want[t.name]).max())
            error = float(np.abs(got[t.name] - want[t.name]).max())
            assert error <= REL_TO_ONNXRUNTIME * scale, (t.name, case)


def test_openvino_synthesis_gives_onnxruntimes_tokens_and_audio(demo: RuntimeBundle) -> None:
    """Greedy synthesis end to end (the LLM's KV cache through plain `infer`): the same speech tokens, and
    audio within 50 dB of onnxruntime's (measured: 70 dB)."""
    d, rng = demo.dims, np.random.default_rng(5)
    prompt = PromptFeatures(rng.integers(0, d.speech_token_size, (1, 20)),
                            rng.uniform(-8, 2, (1, d.token_mel_ratio * 20, d.mel_bins)).astype(np.float32),
                            rng.standard_normal((1, 192), dtype=np.float32))
    results = []
    for provider in ("cpu", "openvino"):
        with Synthesizer(demo, provider, threads=1) as synth:
            results.append(synth.synthesize((demo.endofprompt_id, *range(20, 40)), prompt,
                                            sampler=GreedySampler(), max_tokens=60))
    want, got = results
    assert got.speech_tokens == want.speech_tokens and got.audio.shape == want.audio.shape
    noise = float(np.sum((got.audio - want.audio) ** 2))
    assert 10 * np.log10(float(np.sum(want.audio ** 2)) / noise) > 50.0


def test_one_runner_serves_threads_at_once(demo: RuntimeBundle) -> None:
    """Each thread has its own infer request: concurrent calls give each caller its own outputs."""
    spec = demo.specs["flow_encoder"]
    feeds = [spec.sample_inputs(case) for case in spec.validate]
    with open_runner(demo, "flow_encoder", "openvino", threads=1) as runner:
        want = [runner.infer(f)["mu"] for f in feeds]
        got: dict[int, list[np.ndarray]] = {i: [] for i in range(len(feeds))}

        def work(i: int) -> None:
            for _ in range(5):
                got[i].append(runner.infer(feeds[i])["mu"])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, outputs in got.items():
        assert len(outputs) == 5 and all(np.array_equal(o, want[i]) for o in outputs)


def test_openvino_runs_only_fp32_and_bf16_graphs(demo: RuntimeBundle) -> None:
    with pytest.raises(ProviderError, match="a int8 graph does not run on OpenVINO .*use --provider cpu"):
        OpenVinoRunner(demo.graph_path("llm"), demo.specs["llm"], "int8")


@pytest.mark.skipif(NO_BF16 is None, reason="this CPU has bf16: the refusals below do not happen on it")
def test_bf16_is_refused_on_a_cpu_without_bf16(demo: RuntimeBundle, tiny_bundle: Path, tmp_path: Path
                                                ) -> None:
    with pytest.raises(ProviderError, match="a bf16 graph: this CPU has no bf16 instructions .*AVX512-BF16"):
        OpenVinoRunner(demo.graph_path(DIT), demo.specs[DIT], "bf16")
    out = tmp_path / "bf16"
    result = CliRunner().invoke(export_main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                              "--precision", "bf16"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: --precision bf16: {NO_BF16}"]
    assert not out.exists()


def test_a_profile_with_bf16_is_refused_on_a_cpu_without_bf16(tiny_bundle: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`cpu-fast-bf16` names bf16 for HiFT's decoder alone: the CPU is still checked before anything is read
    (whatever this CPU has: its capabilities are OpenVINO's answer, pinned here)."""
    from cosyvoice_runtime.runners import openvino

    monkeypatch.setattr(openvino, "cpu_capabilities", lambda: ("FP32", "INT8"))
    out = tmp_path / "fast-bf16"
    result = CliRunner().invoke(export_main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                              "--precision", "cpu-fast-bf16"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --precision bf16: this CPU has no bf16 instructions (OpenVINO reports FP32, INT8); bf16 is "
        "for CPUs with AVX512-BF16 or AMX: the DiT and HiFT's decoder computed in bfloat16, by OpenVINO; "
        "use another --precision here"]
    assert not out.exists()


def test_bf16_with_tensorrt_plans_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(TrtUnavailable, match="--trt with --precision bf16: bf16 graphs run on the CPU"):
        export_all(tiny_bundle, tmp_path / "out", trt=True, precision="bf16", progress=False)
    assert not (tmp_path / "out").exists()


def _pin_bf16_to_f32(patch: pytest.MonkeyPatch) -> None:
    """OpenVINO's bf16 hint pinned to f32, which needs no CPU check: the bf16 path on a CPU without bf16."""
    patch.setitem(PRECISIONS, "bf16", replace(PRECISIONS["bf16"], openvino_hint="f32"))


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    _pin_bf16_to_f32(monkeypatch)


@pytest.fixture(scope="module")
def pinned_bf16_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 export of the tiny model made under `_pin_bf16_to_f32`."""
    with pytest.MonkeyPatch.context() as patch:
        _pin_bf16_to_f32(patch)
        report = export_all(tiny_bundle, tmp_path_factory.mktemp("runtime") / "tiny-bf16", precision="bf16",
                            progress=False)
    assert report.manifest is not None, report.table()
    return report.out


def test_a_bf16_bundle_marks_its_bf16_graphs_and_validates_them_on_openvino(pinned_bf16_bundle: Path,
                                                                            runtime_bundle: Path) -> None:
    manifest = json.loads((pinned_bf16_bundle / MANIFEST).read_text())
    assert manifest["precision"] == "bf16"
    for name, g in manifest["graphs"].items():
        assert g["precision"] == ("bf16" if name in BF16_GRAPHS else "fp32"), name
        meta = read_onnx_metadata(pinned_bf16_bundle / g["file"])
        assert meta.get("precision", "fp32") == g["precision"]
        assert g["validation"]["passed"]
    graphs = manifest["graphs"]
    assert graphs[DIT]["validation"]["gates"]["mel_rel_rms"]["bound"] == pytest.approx(10 ** (-45 / 20))
    waveform = graphs[HIFT_DECODER]["validation"]["outputs"]["waveform"]
    assert (waveform["metric"], waveform["bound"]) == ("rel_mean_abs", 2e-2)
    for name in BF16_GRAPHS:
        assert graphs[name]["validation"]["provider"] == "OpenVINO CPU bf16", name
        meta = read_onnx_metadata(pinned_bf16_bundle / graphs[name]["file"])
        assert meta["bf16_revision"] == str(export_bf16.BF16_REVISION)
        assert "INFERENCE_PRECISION_HINT=bf16" in meta["bf16_execution"]
        # the body is the float32 export's: the same graph, other metadata
        bf16, fp32 = (onnx.load(str(root / graphs[name]["file"]))
                      for root in (pinned_bf16_bundle, runtime_bundle))
        assert bf16.graph == fp32.graph and bf16.metadata_props != fp32.metadata_props, name


def test_a_bf16_bundle_runs_its_bf16_graphs_on_openvino(pinned_bf16_bundle: Path, pinned: None) -> None:
    bundle = RuntimeBundle.open(pinned_bf16_bundle, verify=True)
    for name in BF16_GRAPHS:
        with open_runner(bundle, name, "cpu") as runner:
            assert isinstance(runner, OpenVinoRunner) and runner.precision == "bf16", name
    with open_runner(bundle, "llm", "cpu") as runner:
        assert not isinstance(runner, OpenVinoRunner)
    with pytest.raises(ProviderError, match=f"{DIT} is a bf16 graph, which runs on the CPU .*not on 'cuda'"):
        open_runner(bundle, DIT, "cuda")
    result = CliRunner().invoke(golden_main, ["check", "--model", str(pinned_bf16_bundle), "--precision",
                                              "bf16", "--case", "cross-lingual-en-greedy"])
    assert result.exit_code == 0, result.output
    assert "tolerance (bf16 graphs, recorded on fp32)" in result.output


@pytest.mark.skipif(NO_BF16 is None, reason="this CPU has bf16: it runs bf16 graphs")
def test_a_bf16_bundle_is_refused_on_a_cpu_without_bf16(pinned_bf16_bundle: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(run_main, ["--model", str(pinned_bf16_bundle), "--text", "Hello there.",
                                           "--out", str(tmp_path / "out.wav")])
    assert result.exit_code == 2 and not (tmp_path / "out.wav").exists()
    assert f"{DIT}.onnx: a bf16 graph: {NO_BF16}" in result.output


@pytest.mark.skipif(NO_BF16 is not None, reason=f"bf16 arithmetic is not tested here: {NO_BF16}")
def test_bf16_bundle_on_a_bf16_cpu(tiny_bundle: Path, tmp_path: Path) -> None:
    """The real thing, where the CPU has bf16: export (gates measured in bf16), run, judge."""
    out = tmp_path / "bf16"
    result = CliRunner().invoke(export_main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                              "--precision", "bf16"])
    assert result.exit_code == 0, result.output
    assert f"{DIT} [bf16 solve]" in result.output
    manifest = json.loads((out / MANIFEST).read_text())
    for name in BF16_GRAPHS:
        assert manifest["graphs"][name]["precision"] == "bf16", name
        assert manifest["graphs"][name]["validation"]["provider"] == "OpenVINO CPU bf16", name
    judged = CliRunner().invoke(golden_main, ["check", "--model", str(out), "--precision", "bf16", "--case",
                                              "cross-lingual-en-greedy"])
    assert judged.exit_code == 0, judged.output


def test_a_copied_bundle_keeps_its_bf16_marks(pinned_bf16_bundle: Path, tmp_path: Path) -> None:
    """A manifest that calls the bf16 DiT fp32 is caught by the graph's own metadata."""
    copy = tmp_path / "bundle"
    shutil.copytree(pinned_bf16_bundle, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["graphs"][DIT]["precision"] = "fp32"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RuntimeBundleError, match="metadata precision is 'bf16', the manifest says 'fp32'"):
        open_runner(RuntimeBundle.open(copy), DIT)


def test_the_bench_marks_no_onnxruntime_row_for_a_bf16_dit(pinned_bf16_bundle: Path) -> None:
    """The runtime runs a bf16 DiT on OpenVINO: its onnxruntime lever rows are for comparison only."""
    from cosyvoice_bench.levers import onnxruntime_levers

    bundle = RuntimeBundle.open(pinned_bf16_bundle)
    rows = onnxruntime_levers(bundle, frames=20, past_len=4, runtime_threads=1, repeats=1)
    assert {r["graph"] for r in rows} == {DIT, "llm"}
    assert [r["graph"] for r in rows if r["runtime_default"]] == ["llm"]
