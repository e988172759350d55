"""`cosyvoice-export all --precision llm=int4,prefill=int8,dit=int8`: a bundle of mixed precisions. The llm's
weight matmuls in 4 bits (`MatMulNBits` bits=4), validated with its int4 bounds and decode gates, its prefill
body (`llm_prefill`) in int8 with onnxruntime's dynamic quantization, the DiT in int8 with its solve gates,
the other graphs float32; each graph's precision recorded in the manifest and its
metadata, and each opened in its own by the runtime. Refusals of what `--precision` cannot give come before
any work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import soundfile as sf
from click.testing import CliRunner
from onnx import TensorProto, helper

from cosyvoice_export.bundle.tiny import config_for_size
from cosyvoice_export.cli import main
from cosyvoice_export.onnx.bundle_assembly import export_all
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.trt import TrtUnavailable
from cosyvoice_golden.cases import Bounds, loosest
from cosyvoice_golden.cli import main as golden_main
from cosyvoice_graphs import SPECS, ModelDims, spec
from cosyvoice_graphs.bundle_layout import MANIFEST, PROMPT_TEXT, PROMPT_WAV
from cosyvoice_graphs.recipes import RECIPES
from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle, read_onnx_metadata
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.llm import PREFILL_BODY_FROM
from cosyvoice_runtime.runners import open_runner
from cosyvoice_runtime.synthesis import Mode

DIT = "flow_estimator_cached"
PLAN = "llm=int4,prefill=int8,dit=int8"
MIXED = "llm=int4,flow_estimator_cached=int8,llm_prefill=int8"
PRECISIONS = {**dict.fromkeys(SPECS, "fp32"), "llm": "int4", DIT: "int8", "llm_prefill": "int8"}


@pytest.fixture(scope="module")
def mixed_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "tiny-mixed"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", PLAN])
    assert result.exit_code == 0, result.output
    assert "llm [int4 decode]" in result.output and f"{DIT} [int8 solve]" in result.output
    assert "llm_prefill [int8 decode]" in result.output
    assert "[INFO]" not in result.output and "WARNING" not in result.output  # no quantizer chatter
    return out


def tiny_dims() -> ModelDims:
    return model_dims(config_for_size("tiny"))


def test_manifest_and_metadata_record_each_graphs_precision(mixed_bundle: Path) -> None:
    manifest = json.loads((mixed_bundle / MANIFEST).read_text())
    assert manifest["precision"] == MIXED
    assert {name: g["precision"] for name, g in manifest["graphs"].items()} == PRECISIONS
    for name, g in manifest["graphs"].items():
        meta = read_onnx_metadata(mixed_bundle / g["file"])
        assert meta.get("precision", "fp32") == g["precision"]
        s = spec(name, tiny_dims())
        assert g["validation"]["passed"]
        for output, figure in g["validation"]["outputs"].items():
            want = s.tolerances_for(g["precision"])[output]
            assert (figure["metric"], figure["bound"]) == (want.metric, want.bound)
    llm_meta = read_onnx_metadata(mixed_bundle / manifest["graphs"]["llm"]["file"])
    assert llm_meta["int4_scheme"] == RECIPES["llm"].quantization["int4"].describe()
    assert llm_meta["int4_scheme"].startswith("MatMulNBits bits=4 ")
    gates = manifest["graphs"]["llm"]["validation"]["gates"]
    assert {m: g["bound"] for m, g in gates.items()} == spec("llm", tiny_dims()).decode_gates["int4"].bounds()
    assert all(g["passed"] and g["measured"] <= g["bound"] for g in gates.values())


def test_the_llm_projections_are_4_bit_matmulnbits(mixed_bundle: Path) -> None:
    model = onnx.load(str(mixed_bundle / "graphs" / "llm.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    layers = tiny_dims().llm_layers
    assert len(nbits) == 4 * layers  # q|k|v stacked, o, gate|up stacked, down
    scheme = RECIPES["llm"].quantization["int4"]
    for node in nbits:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, scheme.block_size, 4)
    inits = {t.name: t for t in model.graph.initializer}
    float_matmuls = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                     and any(i in inits and inits[i].data_type == TensorProto.FLOAT for i in n.input)]
    assert float_matmuls == ["/llm_decoder/MatMul"]  # the output head stays float32
    dit = onnx.load(str(mixed_bundle / "graphs" / f"{DIT}.onnx"))
    assert any(n.op_type == "MatMulInteger" for n in dit.graph.node)


def test_the_prefill_body_is_the_llm_with_dynamically_quantized_matmuls(mixed_bundle: Path) -> None:
    manifest = json.loads((mixed_bundle / MANIFEST).read_text())
    entry = manifest["graphs"]["llm_prefill"]
    assert entry["file"] == "graphs/llm_prefill.onnx"
    meta = read_onnx_metadata(mixed_bundle / entry["file"])
    assert meta["spec_name"] == "llm_prefill"
    assert meta["int8_scheme"] == RECIPES["llm_prefill"].quantization["int8"].describe()
    assert meta["int8_scheme"].startswith("DynamicQuantizeMatMul ")
    gates = entry["validation"]["gates"]
    assert {m: g["bound"] for m, g in gates.items()} == spec("llm_prefill", tiny_dims()).decode_gates[
        "int8"].bounds()
    assert all(g["passed"] for g in gates.values())
    model = onnx.load(str(mixed_bundle / entry["file"]))
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulInteger" in ops and "MatMulNBits" not in ops
    # only onnxruntime runs it: each layer attends with its GroupQueryAttention, whose output the
    # quantizer reads without a type from onnxslim
    assert ops.count("GroupQueryAttention") == tiny_dims().llm_layers and "Softmax" not in ops
    inits = {t.name: t for t in model.graph.initializer}
    float_matmuls = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                     and any(i in inits and inits[i].data_type == TensorProto.FLOAT for i in n.input)]
    assert float_matmuls == ["/llm_decoder/MatMul"]


def test_the_runtime_prefills_on_the_prefill_body_and_decodes_on_the_llm(mixed_bundle: Path) -> None:
    """Every call over several positions goes to `llm_prefill`, every decode step to `llm`, which takes
    the prefill's caches as they are."""
    voice = CosyVoice3(RuntimeBundle.open(mixed_bundle), threads=1)
    lm = voice.synth.lm
    calls: list[tuple[str, int]] = []
    for name, runner in (("llm", lm.runner), ("llm_prefill", lm.prefill)):
        assert runner is not None
        infer = runner.infer_kept

        def logged(feeds, keep, name=name, infer=infer):  # type: ignore[no-untyped-def]
            calls.append((name, feeds["inputs_embeds"].shape[1]))
            return infer(feeds, keep)
        runner.infer_kept = logged  # type: ignore[method-assign]
    try:
        (piece,) = voice.segments(Mode.ZERO_SHOT, "Hello there.", prompt_text="A prompt.<|endofprompt|>")
        prompt = voice.prompt_features(mixed_bundle / PROMPT_WAV)
        speech = voice.speak(piece, prompt, Mode.ZERO_SHOT, stream=False, max_tokens=6, ignore_stop=True)
        (chunk,) = list(speech)
        assert calls[0][0] == "llm_prefill" and calls[0][1] >= PREFILL_BODY_FROM
        assert calls[1:] == [("llm", 1)] * 5  # the prefill samples the first token
        assert np.isfinite(chunk.samples).all() and len(speech.speech_tokens) == 6
        calls.clear()
        rows = lm.speech_embedding[:PREFILL_BODY_FROM][None]
        for n in (PREFILL_BODY_FROM - 1, PREFILL_BODY_FROM):  # the body by the call's positions
            lm.step(rows[:, :n], lm.empty_cache())
        assert calls == [("llm", PREFILL_BODY_FROM - 1), ("llm_prefill", PREFILL_BODY_FROM)]
    finally:
        voice.close()


def test_the_runtime_opens_each_graph_in_its_precision(mixed_bundle: Path, tiny_bundle: Path, tmp_path: Path
                                                       ) -> None:
    bundle = RuntimeBundle.open(mixed_bundle)
    assert {name: bundle.graph_precision(name).name for name in bundle.specs} == PRECISIONS
    with open_runner(bundle, "llm", threads=1) as runner:
        assert runner.metadata["precision"] == "int4"
    info = CliRunner().invoke(run_main, ["--model", str(mixed_bundle), "--info"])
    assert info.exit_code == 0, info.output
    assert f"precision: {MIXED}" in info.output
    for name, precision in PRECISIONS.items():
        assert re.search(rf"^  {name}: {precision}, ", info.output, re.M), info.output
    out = tmp_path / "out.wav"
    result = CliRunner().invoke(run_main, [
        "--model", str(mixed_bundle), "--text", "Hello there.", "--prompt-wav", str(tiny_bundle / PROMPT_WAV),
        "--prompt-text", (tiny_bundle / PROMPT_TEXT).read_text().strip(), "--sampling", "greedy", "--stream",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    audio, sr = sf.read(str(out), dtype="float32")
    assert sr == 24000 and np.isfinite(audio).all() and audio.std() > 1e-3


def test_golden_judges_a_mixed_bundle_by_each_precisions_bounds(mixed_bundle: Path) -> None:
    """The fp32 cases on a mixed bundle are judged by cases.toml's bounds of every reduced precision it
    holds; it gives none for int4, whose tokens leave torch's on the random weights (its export gates
    judge it), so the verdict names that precision."""
    golden = ["check", "--model", str(mixed_bundle), "--case", "cross-lingual-en-greedy"]
    refused = CliRunner().invoke(golden_main, golden)
    assert refused.exit_code == 2 and f"(to judge it by tolerance: --precision {MIXED})" in refused.output
    judged = CliRunner().invoke(golden_main, [*golden, "--precision", PLAN])
    assert judged.exit_code == 1, judged.output
    assert "int4: no tolerance — cases.toml gives no bounds for int4 graphs" in judged.output
    bad = CliRunner().invoke(golden_main, [*golden, "--precision", "llm=int3"])
    assert bad.exit_code == 2 and bad.output.startswith("error: --precision: llm=int3: unknown precision")


def test_a_mixed_bundles_golden_bounds_are_the_loosest_of_its_precisions() -> None:
    int8, fp16 = Bounds(max_abs=0.6, l1=0.05, snr_db=10.0, mel_snr_db=60.0), Bounds(0.15, 0.01, 25.0, 55.0)
    assert loosest([int8, fp16]) == Bounds(max_abs=0.6, l1=0.05, snr_db=10.0, mel_snr_db=55.0)
    assert loosest([int8, Bounds(mel_snr_db=45.0)]) == Bounds(mel_snr_db=45.0)


def test_another_plan_into_the_same_out_is_refused(mixed_bundle: Path, tiny_bundle: Path) -> None:
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(mixed_bundle),
                                       "--precision", "int4"])
    assert result.exit_code == 2
    assert f"holds a {MIXED} runtime bundle; --precision int4 needs a new or empty --out" in result.output


@pytest.mark.parametrize(("precision", "message"), [
    ("llm=int3", "error: --precision: llm=int3: unknown precision 'int3'; known: fp32, fp16, int8, int4, "),
    ("flow=int8", "error: --precision: unknown graph 'flow'; known: llm, flow_encoder, "),
    ("dit=int4", f"error: --precision {DIT}=int4: {DIT} has no int4 body; its spec bounds fp32, tf32, "),
])
def test_cli_refuses_a_plan_in_one_line_before_any_work(tiny_bundle: Path, tmp_path: Path, precision: str,
                                                        message: str) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", precision])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(message) and result.output.count("\n") == 1, result.output
    assert not out.exists() and not out.with_name("out.lock").exists()


def test_tensorrt_plans_of_a_4_bit_llm_are_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(TrtUnavailable, match=rf"--trt with --precision {MIXED}: int4 graphs run on "):
        export_all(tiny_bundle, tmp_path / "out", trt=True, precision=PLAN, progress=False)
    assert not (tmp_path / "out").exists()
