"""`cosyvoice-export all --precision fp16`: fp16 bodies with float32 I/O and fragile ops, validated with
their own bounds; one precision per runtime bundle."""

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
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from tqdm import tqdm

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.bundle.tiny import config_for_size
from cosyvoice_export.cli import main
from cosyvoice_export.onnx import fp16
from cosyvoice_export.onnx.bundle_assembly import _hash_sources, _source_files, export_all
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.graph_export import export_and_validate, reuse_graph
from cosyvoice_export.onnx.graphs import EXPORT_RECIPES, Networks
from cosyvoice_export.onnx.lazy_networks import LazyNetworks
from cosyvoice_export.onnx.output_dir import OutputDirError, graph_record_file
from cosyvoice_export.onnx.trace import check_contract
from cosyvoice_export.onnx.validate import ValidationError, validate_graph
from cosyvoice_graphs import SPECS, ModelDims, Tolerance, spec
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.recipes import RECIPES

FRAGILE_OPS = ("LayerNormalization", "Softmax", "LogSoftmax", "Sin", "Cos", "Exp", "Pow", "Sqrt",
               "ReduceMean", "ReduceL2")
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@pytest.fixture(scope="module")
def fp16_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "tiny-fp16"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", "fp16"])
    assert result.exit_code == 0, result.output
    return out


def tiny_dims() -> ModelDims:
    return model_dims(config_for_size("tiny"))


def graph_types(path: Path) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = onnx.load(str(path))
    return model, fp16._value_types(model)


def test_fp16_bundle_validates_with_fp16_bounds(fp16_bundle: Path) -> None:
    manifest = json.loads((fp16_bundle / MANIFEST).read_text())
    assert manifest["precision"] == "fp16"
    for name, g in manifest["graphs"].items():
        assert g["precision"] == ("fp16" if RECIPES[name].fp16_fp32_scopes is not None else "fp32")
        assert g["validation"]["passed"]
        for output, figure in g["validation"]["outputs"].items():
            want = spec(name, tiny_dims()).tolerances_for(g["precision"])[output]
            assert (figure["metric"], figure["bound"]) == (want.metric, want.bound)


@pytest.mark.parametrize("name", list(SPECS))
def test_io_is_the_spec_and_fragile_ops_stay_float32(fp16_bundle: Path, name: str) -> None:
    model, types = graph_types(fp16_bundle / "graphs" / f"{name}.onnx")
    check_contract(model, spec(name, tiny_dims()))  # names, order, dtypes (float32), ranks
    halves = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT16}
    if RECIPES[name].fp16_fp32_scopes is None:
        assert not halves and TensorProto.FLOAT16 not in types.values()
        return
    assert halves, "no weight was converted"
    assert any(n.op_type in ("MatMul", "Gemm", "Conv") and types[n.output[0]] == TensorProto.FLOAT16
               for n in model.graph.node), "no matmul/conv computes in fp16"
    fragile = [n for n in model.graph.node if n.op_type in FRAGILE_OPS]
    assert fragile
    for n in fragile:
        float_values = [v for v in (*n.input, *n.output) if v and types.get(v) in FLOATS]
        assert all(types[v] == TensorProto.FLOAT for v in float_values), f"{n.name} ({n.op_type})"


def test_blocked_scopes_stay_float32(fp16_bundle: Path) -> None:
    model, types = graph_types(fp16_bundle / "graphs" / "llm.onnx")
    # the converter's Casts into fp16 carry the scope of the value they read
    head = [n for n in model.graph.node if n.op_type != "Cast"
            and ("/llm_decoder/" in n.name or "layernorm/" in n.name)]
    assert head
    for n in head:
        assert all(types[v] != TensorProto.FLOAT16 for v in n.output if v), n.name


def test_without_tensorrt_plans_the_dit_and_llm_use_onnxruntimes_operators_in_float16(fp16_bundle: Path
                                                                                       ) -> None:
    """An fp16 export that builds no TensorRT plans writes the DiT and the llm for onnxruntime alone
    (`Precision.onnxruntime_only`): their attention and RoPE are its operators, computing in float16."""
    expected = {"flow_estimator_cached": {"MultiHeadAttention", "RotaryEmbedding"},
                "llm": {"GroupQueryAttention"}}
    for name, ops in expected.items():
        model, types = graph_types(fp16_bundle / "graphs" / f"{name}.onnx")
        fused = [n for n in model.graph.node if n.op_type in ops]
        assert {n.op_type for n in fused} == ops and all(n.domain == "com.microsoft" for n in fused)
        assert all(types[n.output[0]] == TensorProto.FLOAT16 for n in fused), name
        record = json.loads((fp16_bundle / graph_record_file(name)).read_text())
        assert record["inputs"]["precision"] == f"fp16 rev {fp16.FP16_REVISION}, for onnxruntime"


def test_with_tensorrt_plans_the_fp16_dit_keeps_standard_operators(tiny_bundle: Path, tmp_path: Path) -> None:
    """An export that builds TensorRT plans (`--trt`, which needs a GPU: the graph step alone here) writes the
    standard operators TensorRT parses, and records the form apart, so neither export reuses the other's."""
    bundle = ModelBundle.open(tiny_bundle)
    s = spec("flow_estimator_cached", model_dims(bundle.config))
    source_sha = _hash_sources(_source_files(bundle), False)
    with tqdm(disable=True) as bar:
        result = export_and_validate(tmp_path, s, model_dims(bundle.config), LazyNetworks(bundle), source_sha,
                                     bar, "fp16", trt=True)
    assert result.validation.passed
    ops = {n.op_type for n in onnx.load(tmp_path / "graphs" / f"{s.name}.onnx").graph.node}
    assert "MultiHeadAttention" not in ops and "RotaryEmbedding" not in ops and "Softmax" in ops
    assert result.record.inputs.precision == f"fp16 rev {fp16.FP16_REVISION}"
    assert reuse_graph(tmp_path, s, source_sha, "fp16", trt=True) is not None
    assert reuse_graph(tmp_path, s, source_sha, "fp16", trt=False) is None


def test_the_dits_mish_stays_finite_in_float16(fp16_bundle: Path) -> None:
    """The conv position embedding's Mish as the fp16 DiT computes it on a GPU, every operation rounded to
    float16 (onnx's reference evaluator; onnxruntime's CPU provider runs a float16 chain of elementwise
    operators in float32, so it cannot show this): finite where its intermediate values overflow (from
    x = 5.5), and within float16's rounding of x tanh(softplus(x))."""
    model = onnx.load(fp16_bundle / "graphs" / "flow_estimator_cached.onnx")
    mish, y = _first_mish(model)
    x = np.linspace(-30, 30, 601).astype(np.float16)
    with np.errstate(over="ignore", divide="ignore"):  # the overflows under test
        got = ReferenceEvaluator(mish).run(None, {y: x})[0]
    exact = x.astype(np.float64) * np.tanh(np.log1p(np.exp(x.astype(np.float64))))
    assert got.dtype == np.float16 and np.isfinite(got).all()
    assert np.max(np.abs(got - exact) / np.maximum(1, np.abs(exact))) < 2e-3


def _first_mish(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """The nodes from the first Mish's input (what its `Clip` reads) to its output (the `Div` of that input),
    as a model of their own, and that input's name."""
    nodes = list(model.graph.node)
    y = next(n for n in nodes if n.op_type == "Clip").input[0]
    out = next(n for n in nodes if n.op_type == "Div" and n.input[0] == y).output[0]
    producers = {o: n for n in nodes for o in n.output}
    keep, todo = [], [out]
    while todo:
        node = producers.get(todo.pop())
        if node is not None and node not in keep and y not in node.output:
            keep.append(node)
            todo += [i for i in node.input if i and i != y]
    names = {i for n in keep for i in n.input}
    weights = [t for t in model.graph.initializer if t.name in names]
    io = [onnx.helper.make_tensor_value_info(v, TensorProto.FLOAT16, None) for v in (y, out)]
    graph = onnx.helper.make_graph(sorted(keep, key=nodes.index), "mish", io[:1], io[1:], weights)
    opsets = list(model.opset_import)
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version), y


def test_mixing_precisions_in_one_out_is_refused(fp16_bundle: Path, tiny_bundle: Path) -> None:
    with pytest.raises(OutputDirError, match="fp16 runtime bundle; --precision fp32"):
        export_all(tiny_bundle, fp16_bundle, progress=False)
    assert (fp16_bundle / MANIFEST).is_file()  # refused before anything changed


def test_bad_bound_fails_naming_graph_and_output(fp16_bundle: Path, tiny_bundle: Path) -> None:
    bundle = ModelBundle.open(tiny_bundle)
    nets = Networks(bundle.config, *(bundle.load_network(n) for n in ("llm", "flow", "hift")))
    loose = spec("flow_encoder", model_dims(bundle.config))
    bounds = loose.precision_tolerances["fp16"]
    tight = replace(loose, precision_tolerances={"fp16": {**bounds, "mu": Tolerance("rel_max_abs", 1e-9)}})
    s = tight.at_precision("fp16")
    wrapper = EXPORT_RECIPES["flow_encoder"].wrapper(nets)
    validation = validate_graph(fp16_bundle / "graphs" / "flow_encoder.onnx", wrapper, s)
    with pytest.raises(ValidationError, match=r"flow_encoder: output mu at .*rel_max_abs") as e:
        validation.raise_for_failure()
    assert (e.value.graph, e.value.output) == ("flow_encoder", "mu")


def test_a_graph_without_fp16_bounds_has_no_fp16_spec() -> None:
    """Which graphs have an fp16 body: tests/test_graph_recipes.py."""
    dims = tiny_dims()
    with pytest.raises(ValueError, match="hift_f0: its spec has no fp16 tolerances"):
        spec("hift_f0", dims).at_precision("fp16")
