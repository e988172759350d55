"""fp16 graphs, correct by construction: an exported fp32 graph rewritten so that its weights and its
matmul/conv compute are float16, while numerically fragile ops stay float32 and the I/O has the dtypes
of the spec's fp16 body (`GraphSpec.io_at`: float32, but for the float16 caches of `llm_decode`).

A node is converted only if its op type is on an allowlist of ops whose float inputs and outputs share
one type (so float16 in means float16 out) and its module scope is not a fragile one (its graph's
`GraphRecipe.fp16_fp32_scopes`); every other node stays float32. Each float value then has one home
precision, and a Cast is inserted wherever a node reads a value of the other precision. fp16 graphs are
validated against the torch fp32 wrapper with its spec's fp16 bounds (`GraphSpec.precision_tolerances`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyvoice_graphs import GraphSpec
from cosyvoice_graphs.precision import FP16
from cosyvoice_graphs.recipes import RECIPES

from .errors import ExportError
from .trace import replace_graph

FP16_REVISION = 1
"""Bump when the conversion changes (it forces fp16 graphs to be exported again)."""

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16

CONVERTIBLE_OPS = frozenset({
    # the compute worth halving
    "MatMul", "Gemm", "Conv", "ConvTranspose",
    # elementwise ops that are safe in fp16 (no exp/log/pow/sqrt, no reductions)
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "Where",
    # data movement: exact in any precision
    "Reshape", "Transpose", "Slice", "Gather", "Concat", "Unsqueeze", "Squeeze", "Split", "Expand", "Tile",
    "Pad", "Identity", "Flatten", "Cast",
    # onnxruntime's own operators in the graphs written for it (`llm_decode`, and `llm` and the DiT where no
    # TensorRT plans are built): their float inputs and outputs share one type
    "GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding",
})
"""Ops a converted node may have. Anything else (LayerNormalization, Softmax, LogSoftmax, Sin, Cos, Exp,
Pow, Sqrt, reductions, comparisons, Range, ConstantOfShape, ...) stays float32."""
ANY_INPUT_OPS = frozenset({"Shape", "Size", "Cast"})
"""Ops that read any input dtype: their inputs are never cast."""


class Fp16Error(ExportError):
    """A graph cannot be converted to fp16 as this module promises."""


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value, from type inference on a weightless copy (initializers as typed
    inputs), which works for graphs of any size. onnx cannot infer onnxruntime's own operators: the float
    outputs of those that convert (one float type `T`) take their first input's type, and inference runs
    again past them (once per such operator in a chain: a pass per `llm_decode` layer)."""
    g = model.graph
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer]
    contrib = [n for n in g.node if n.op_type in CONVERTIBLE_OPS and n.domain not in ("", "ai.onnx")]
    given: list[onnx.ValueInfoProto] = []
    while True:
        graph = helper.make_graph(list(g.node), g.name, [*g.input, *weights], list(g.output),
                                  value_info=given)
        probe = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        inferred = onnx.shape_inference.infer_shapes(probe)
        values = (*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info)
        types = {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}
        found = [helper.make_tensor_value_info(out, types[n.input[0]], None) for n in contrib
                 if n.input[0] in types for out in n.output if out and out not in types]
        if not found:
            return types
        given += found


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for node in model.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]


def convert(model: onnx.ModelProto, graph: str, half_io: Collection[str] = ()) -> onnx.ModelProto:
    """Rewrite the fp32 `model` of `graph` (one whose recipe has fp16 scopes) in place as an fp16 graph with
    float32 I/O but for the inputs and outputs named in `half_io`, which are float16; returns it. A float16
    output that a converted node computes is that node's own output, not a Cast's copy of it (so an output
    written in place into its input's memory stays so)."""
    scopes = RECIPES[graph].fp16_fp32_scopes if graph in RECIPES else None
    if scopes is None:
        fp16 = [r.name for r in RECIPES.values() if r.fp16_fp32_scopes is not None]
        raise Fp16Error(f"{graph}: not exported in fp16 (fp16 graphs: {', '.join(fp16)})")
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node
           for a in n.attribute):
        raise Fp16Error(f"{graph}: has control-flow subgraphs, which the fp16 conversion does not handle")
    fragile = re.compile("|".join(scopes))
    types = _value_types(model)
    converted = [n.op_type in CONVERTIBLE_OPS and not fragile.search(n.name) for n in g.node]
    # a float output keeps its I/O dtype: its producer writes a twin, cast to that dtype at the end, unless
    # the producer computes it in that dtype already
    outputs = {o.name: HALF if o.name in half_io else FLOAT for o in g.output}
    cast_outputs = [name for n, half in zip(g.node, converted, strict=True) for name in n.output
                    if name in outputs and types.get(name) == FLOAT
                    and not (half and outputs[name] == HALF)]
    for name in cast_outputs:
        _rename(model, name, f"{name}.twin")
        types[f"{name}.twin"] = FLOAT
    home: dict[str, int] = {}
    for node, half in zip(g.node, converted, strict=True):
        for out in node.output:
            if out not in types:
                raise Fp16Error(f"{graph}: cannot infer the type of {out} ({node.op_type} {node.name})")
            if types[out] == FLOAT:
                home[out] = HALF if half else FLOAT
    readers: dict[str, list[bool]] = defaultdict(list)
    for node, half in zip(g.node, converted, strict=True):
        for name in node.input:
            readers[name].append(half and node.op_type not in ANY_INPUT_OPS)
    for t in g.initializer:
        if t.data_type != FLOAT:
            continue
        w = numpy_helper.to_array(t)
        # a weight read only by converted nodes, and representable in fp16, is stored in fp16
        fits = (np.isfinite(w.astype(np.float16)) == np.isfinite(w)).all()
        if readers[t.name] and all(readers[t.name]) and fits:
            t.CopyFrom(numpy_helper.from_array(w.astype(np.float16), t.name))
            home[t.name] = HALF
        else:
            home[t.name] = FLOAT
    for value in (*g.input, *g.output):
        if value.type.tensor_type.elem_type == FLOAT and value.name in half_io:
            value.type.tensor_type.elem_type = HALF
    home.update({i.name: i.type.tensor_type.elem_type for i in g.input
                 if i.type.tensor_type.elem_type in (FLOAT, HALF)})

    nodes: list[onnx.NodeProto] = []
    casts: dict[tuple[str, int], str] = {}
    for node, half in zip(g.node, converted, strict=True):
        want = HALF if half else FLOAT
        if node.op_type not in ANY_INPUT_OPS:
            for i, name in enumerate(node.input):
                if name in home and home[name] != want:
                    if (name, want) not in casts:
                        cast = f"{name}.{'fp16' if want == HALF else 'fp32'}"
                        nodes.append(helper.make_node("Cast", [name], [cast], name=f"{cast}/Cast", to=want))
                        casts[name, want] = cast
                    node.input[i] = casts[name, want]
        if half and node.op_type == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i == FLOAT:
                    a.i = HALF
        nodes.append(node)
    for name in cast_outputs:
        twin = f"{name}.twin"
        nodes.append(helper.make_node("Cast", [twin], [name], name=f"{name}/Cast", to=outputs[name]))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]  # fp32 types of converted values are stale; the runtime infers them again
    return model


def write_fp16(path: Path, s: GraphSpec) -> Path:
    """Replace the fp32 graph at `path` (and its external data) by its fp16 conversion, checked and with
    the I/O `s` says, atomically; returns `path`."""
    model = onnx.load(str(path))
    body = s.io_at(FP16.name)
    half_io = [t.name for t in (*body.inputs, *body.outputs) if t.dtype == "float16"]
    convert(model, s.name, half_io)
    return replace_graph(path, model, body, {"precision": FP16.name, "fp16_revision": str(FP16_REVISION)})
