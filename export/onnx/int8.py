"""int8 graphs: an exported fp32 graph whose weight matmuls read int8 weights, everything else float32.

Each MatMul with a constant weight becomes onnxruntime's `MatMulNBits` with 8-bit weights: symmetric,
one float32 scale per block of `BLOCK_SIZE` input channels of each output column, and
`accuracy_level` 4, under which onnxruntime's CPU kernels quantize the activations to int8 per block too
and multiply in integers. Per-block activation scales are what keep an outlier in one channel from
costing the others their precision. Attention's activation matmuls, the KV cache, RMSNorm, rotary
embedding, softmax and the graph's I/O stay float32, and so do the nodes of `INT8_GRAPHS`' scopes (the
llm's output head). Why this operator and not `quantize_dynamic`'s: docs/performance.md, int8.

int8 graphs are validated against the torch fp32 wrapper with their spec's int8 bounds and decode gates.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import onnx

from cosyvoice_graphs import GraphSpec

from .trace import ExportError, replace_graph

INT8_REVISION = 1
"""Bump when the quantization changes (it forces int8 graphs to be exported again)."""
BITS = 8
BLOCK_SIZE = 32
"""Input channels per weight scale (and per activation scale)."""
ACCURACY_LEVEL = 4
"""`MatMulNBits.accuracy_level`: 4 = int8 activations and integer compute (0/1 = float32 compute, 12x
slower here)."""

INT8_GRAPHS: dict[str, tuple[str, ...]] = {
    # llm_decoder: 2% of the full-size weights, and its output is the log-probs themselves
    "llm": (r"/llm_decoder/",),
}
"""Graphs exported with int8 weights -> regexes of node names (module scopes) kept float32."""


class Int8Error(ExportError):
    """A graph cannot be quantized as this module promises."""


def _quantizer_class() -> Any:
    """onnxruntime's `MatMulNBitsQuantizer`, its module imported without the root-logger setup it does at
    import (`logging.basicConfig` at INFO, which would print a line for every node it visits)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return MatMulNBitsQuantizer


def quantize(model: onnx.ModelProto, graph: str) -> onnx.ModelProto:
    """The fp32 `model` of `graph` (a key of `INT8_GRAPHS`) with its weight MatMuls as 8-bit
    `MatMulNBits`, except in the graph's float32 scopes."""
    if graph not in INT8_GRAPHS:
        raise Int8Error(f"{graph}: not exported in int8 (int8 graphs: {', '.join(INT8_GRAPHS)})")
    kept = re.compile("|".join(INT8_GRAPHS[graph]))
    excluded = [n.name for n in model.graph.node if kept.search(n.name)]
    quantizer = _quantizer_class()(model, bits=BITS, block_size=BLOCK_SIZE, is_symmetric=True,
                                   accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=excluded)
    quantizer.process()
    out: onnx.ModelProto = quantizer.model.model
    if not any(n.op_type == "MatMulNBits" for n in out.graph.node):
        raise Int8Error(f"{graph}: no MatMul with a constant weight was quantized")
    return out


def write_int8(path: Path, s: GraphSpec) -> Path:
    """Replace the fp32 graph at `path` (and its external data) by its int8 quantization, checked and with
    the I/O `s` says, atomically; returns `path`."""
    model = quantize(onnx.load(str(path)), s.name)
    return replace_graph(path, model, s, {"precision": "int8", "int8_revision": str(INT8_REVISION),
                                          "int8_scheme": f"MatMulNBits bits={BITS} block_size={BLOCK_SIZE} "
                                                         f"symmetric accuracy_level={ACCURACY_LEVEL}"})
