"""`cosyvoice-export all --precision tf32`: the float32 graphs, marked tf32 in the manifest and their
metadata, validated as fp32 (the CPU computes them exactly so), which the runtime's CUDA sessions run with
TF32 math; on the CPU they give fp32's audio bit for bit, and golden judges them by their mel bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
from click.testing import CliRunner

from cosyvoice_export.cli import main
from cosyvoice_export.onnx.bundle_assembly import export_all
from cosyvoice_export.onnx.trt import TrtUnavailable
from cosyvoice_golden.cli import main as golden_main
from cosyvoice_graphs import SPECS
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_runtime.bundle import RuntimeBundle, read_onnx_metadata
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.llm import LlmRequest
from cosyvoice_runtime.sampling import GreedySampler
from cosyvoice_runtime.synthesis import Synthesizer


@pytest.fixture(scope="module")
def tf32_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "tiny-tf32"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", "tf32"])
    assert result.exit_code == 0, result.output
    return out


def _graph_body(path: Path) -> bytes:
    """The graph without the model's metadata: what onnxruntime computes."""
    return onnx.load(str(path)).graph.SerializeToString()


def test_every_graph_is_the_float32_export_marked_tf32(tf32_bundle: Path, runtime_bundle: Path) -> None:
    manifest = json.loads((tf32_bundle / MANIFEST).read_text())
    assert manifest["precision"] == "tf32"
    assert {name: g["precision"] for name, g in manifest["graphs"].items()} == dict.fromkeys(SPECS, "tf32")
    tf32, fp32 = RuntimeBundle.open(tf32_bundle), RuntimeBundle.open(runtime_bundle)
    for name in SPECS:
        assert read_onnx_metadata(tf32.graph_path(name))["precision"] == "tf32"
        assert _graph_body(tf32.graph_path(name)) == _graph_body(fp32.graph_path(name)), name
        assert tf32.graph_precision(name).cuda_tf32


def test_on_the_cpu_a_tf32_bundle_speaks_as_fp32(tf32_bundle: Path, runtime_bundle: Path,
                                                 prompt: PromptFeatures) -> None:
    """TF32 is CUDA's math: onnxruntime's CPU provider computes the same float32 graphs bit for bit."""
    request = LlmRequest(text_ids=(515, *range(20, 30)))
    spoken = []
    for root in (tf32_bundle, runtime_bundle):
        with Synthesizer(RuntimeBundle.open(root), threads=1) as synth:
            decoding = synth.lm.decode(request, GreedySampler(), max_tokens=30, ignore_stop=True)
            spoken.append(synth.synthesize_tokens(decoding, prompt))
    assert spoken[0].speech_tokens == spoken[1].speech_tokens
    assert np.array_equal(spoken[0].mel, spoken[1].mel) and np.array_equal(spoken[0].audio, spoken[1].audio)


def test_golden_judges_a_tf32_bundle_by_its_mel_bound(tf32_bundle: Path) -> None:
    judged = CliRunner().invoke(golden_main, ["check", "--model", str(tf32_bundle), "--precision", "tf32",
                                              "--case", "zero-shot-en-greedy"])
    assert judged.exit_code == 0, judged.output
    assert "tolerance (tf32 graphs, recorded on fp32) · mel snr" in judged.output
    assert "≥ 60 dB" in judged.output


def test_tf32_has_no_tensorrt_plans(tiny_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(TrtUnavailable, match="--trt with --precision tf32: tf32 graphs run on onnxruntime's "
                                             r"CPU \(as fp32\) and CUDA providers, not as TensorRT plans"):
        export_all(tiny_bundle, tmp_path / "out", trt=True, precision="tf32", progress=False)
    assert not (tmp_path / "out").exists()
