"""`cosyvoice-export all --precision tf32`: the float32 graphs, marked tf32 in the manifest and their
metadata, the DiT written for onnxruntime alone (its attention and RoPE as onnxruntime's operators, which its
CUDA provider computes in float32), validated as fp32, which the runtime's CUDA sessions run with TF32 math;
on the CPU they give fp32's tokens and its audio to float32's rounding, and golden judges them by their mel
bound."""

from __future__ import annotations

import json
from dataclasses import replace
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
from cosyvoice_graphs import DIT, SPECS
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
        same = _graph_body(tf32.graph_path(name)) == _graph_body(fp32.graph_path(name))
        assert same == (name != DIT), name
        assert tf32.graph_precision(name).cuda_tf32


def test_the_tf32_dit_is_written_for_onnxruntime(tf32_bundle: Path, runtime_bundle: Path) -> None:
    """Per DiT block, one `MultiHeadAttention` and two `RotaryEmbedding`s where fp32's graph has its softmax
    and a few dozen standard operators: under half the nodes, each a kernel launch on a GPU."""
    graphs = {root: onnx.load(str(RuntimeBundle.open(root).graph_path(DIT)), load_external_data=False).graph
              for root in (tf32_bundle, runtime_bundle)}
    ops = {root: [n.op_type for n in g.node] for root, g in graphs.items()}
    blocks = ops[tf32_bundle].count("MultiHeadAttention")
    assert blocks == ops[runtime_bundle].count("Softmax") > 0
    assert ops[tf32_bundle].count("RotaryEmbedding") == 2 * blocks and "Softmax" not in ops[tf32_bundle]
    assert len(ops[tf32_bundle]) < len(ops[runtime_bundle]) * 0.7
    for graph in graphs.values():  # both forms: the step's modulation row, one Split into its pieces
        readers = _readers(graph, "modulations")
        assert [n.op_type for n in readers] == ["Gather", "Gather", "Split"]
        assert len(readers[-1].output) == 6 * blocks + 2


def test_the_tf32_dit_computes_nothing_from_shapes_or_positions(tf32_bundle: Path) -> None:
    """onnxruntime's CUDA provider places nodes that compute on shapes or small integer tensors on the CPU,
    and a graph with nodes there cannot be replayed from a CUDA graph: the DiT takes its positions and mask
    as inputs, reads the positions only to turn them into RoPE's angles and the mask only as the attention's
    bias, and reads no shape."""
    graph = onnx.load(str(RuntimeBundle.open(tf32_bundle).graph_path(DIT)), load_external_data=False).graph
    assert not {"Shape", "Size", "Range", "ConstantOfShape", "Expand"} & {n.op_type for n in graph.node}
    assert [n.op_type for n in _readers(graph, "positions")] == ["Cast"]
    assert [n.op_type for n in _readers(graph, "attention_mask")] == ["Unsqueeze"]


def _readers(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    """The nodes that read `name` and, while they are one Gather after another, what reads theirs."""
    found, tensor = [], name
    while True:
        nodes = [n for n in graph.node if tensor in n.input]
        found += nodes
        if len(nodes) != 1 or nodes[0].op_type != "Gather":
            return found
        tensor = nodes[0].output[0]


def test_on_the_cpu_a_tf32_bundle_speaks_as_fp32(tf32_bundle: Path, runtime_bundle: Path,
                                                 prompt: PromptFeatures) -> None:
    """TF32 is CUDA's math: onnxruntime's CPU provider computes the float32 graphs, the same ones but the
    DiT, whose attention kernel sums in another order: the tokens equal, the mel and audio within float32's
    rounding."""
    request = LlmRequest(text_ids=(515, *range(20, 30)))
    spoken = []
    for root in (tf32_bundle, runtime_bundle):
        with Synthesizer(RuntimeBundle.open(root), threads=1) as synth:
            decoding = synth.lm.decode(request, GreedySampler(), max_tokens=30, ignore_stop=True)
            spoken.append(synth.synthesize_tokens(decoding, prompt))
    assert spoken[0].speech_tokens == spoken[1].speech_tokens
    (mel, audio), (fp32_mel, fp32_audio) = ((s.mel, s.audio) for s in spoken)
    assert not np.array_equal(mel, fp32_mel)
    assert np.max(np.abs(mel - fp32_mel)) <= 1e-5 * np.max(np.abs(fp32_mel))
    # the vocoder's f0 phase magnifies the mel's last bits into the waveform
    snr_db = 10 * np.log10(np.sum(fp32_audio.astype(np.float64) ** 2) / np.sum((audio - fp32_audio) ** 2.0))
    assert snr_db >= 60, snr_db


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


def test_an_export_links_the_graphs_another_precisions_bundle_made_alike(
        tiny_bundle: Path, fp16_decode_bundle: Path, tmp_path: Path) -> None:
    """`--reuse-from`: `decode=fp16,prefill=int8` with the DiT in tf32 takes every other graph from that
    plan's bundle, the same files (hard links), and exports the DiT; the bundle opens and its manifest
    lists what the other's does for them. A folder that is not there is refused before anything runs."""
    out = tmp_path / "dit-tf32"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", "decode=fp16,prefill=int8,dit=tf32",
                                       "--reuse-from", str(fp16_decode_bundle)])
    assert result.exit_code == 0, result.output
    ours, theirs = RuntimeBundle.open(out), RuntimeBundle.open(fp16_decode_bundle)
    for name in ours.specs:
        linked = ours.graph_path(name).samefile(theirs.graph_path(name))
        assert linked == (name != DIT), name
        assert ours.manifest.graphs[name].reused == linked
        if linked:
            assert ours.manifest.graphs[name] == replace(theirs.manifest.graphs[name], reused=True)
    assert ours.graph_precision(DIT).cuda_tf32 and not theirs.graph_precision(DIT).cuda_tf32
    missing = tmp_path / "not-there"
    refused = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(tmp_path / "x"),
                                        "--reuse-from", str(missing)])
    assert refused.exit_code == 2 and "does not exist" in refused.output
    assert not (tmp_path / "x").exists()
