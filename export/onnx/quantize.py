"""Quantized graphs: an exported fp32 graph whose weight matmuls read int8 or 4-bit weights, everything else
float32.

Two operators, chosen per graph by measurement on this project's CPU (docs/performance-log.md, int8 LLM,
int8 DiT and int4 LLM) and recorded in its recipe (`GraphRecipe.quantization`):

- `NBITS`, for the llm, whose decode multiplies one row at a time (memory-bound): each MatMul with a
  constant weight becomes onnxruntime's `MatMulNBits` with `bits`-bit weights, one float32 scale (and, when
  not symmetric, a zero point) per block of `block_size` input channels of each output column, and
  `accuracy_level` 4, under which onnxruntime's CPU kernels quantize the activations to int8 per block too
  and multiply in integers. Per-block activation scales keep an outlier in one channel from costing the
  others their precision. int8 and int4 differ only in the bits and the block.
- `DYNAMIC`, for the graphs that multiply hundreds of rows at once (compute-bound): the DiT estimators and
  the llm's prefill body (`llm_prefill`), where `MatMulNBits`' kernels run far below the CPU's int8 rate
  (below float32 on AVX2): onnxruntime's dynamic quantization (weights
  int8 per output channel with 7-bit range, activations uint8 per tensor at run time,
  `DynamicQuantizeMatMul` after graph optimisation). 7 bits because AVX2 without VNNI multiplies u8 x s8
  pairs into saturating 16-bit sums. The DiT has no 4-bit body: its spec bounds no int4.

Attention's activation matmuls, the KV caches, norms, rotary embedding, softmax and the graph's I/O stay
float32, and so do the nodes of each scheme's float32 scopes. Quantized graphs are validated against the
torch fp32 wrapper with their spec's bounds and gates for their precision.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx

from cosyvoice_graphs import GraphSpec
from cosyvoice_graphs.recipes import ACCURACY_LEVEL, DYNAMIC, NBITS, RECIPES, QuantScheme

from .errors import ExportError
from .flash_attention import flash_when_unmasked
from .output_dir import PARTIAL, link_or_copy
from .trace import replace_graph

REVISIONS = {"int8": 2, "int4": 1}
"""Precision -> its quantization's revision: bump one when its quantization changes (it forces its graphs to
be exported again)."""


class QuantizeError(ExportError):
    """A graph cannot be quantized as this module promises."""


@contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """onnxruntime's quantization modules call `logging.basicConfig` at INFO on import and warn through
    the root logger (a line per node, advice on pre-processing): keep the root logger as it was, at
    ERROR while inside."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _quantizer_class() -> Any:
    """onnxruntime's `MatMulNBitsQuantizer`."""
    with _quiet_root_logger():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    return MatMulNBitsQuantizer


def scheme_of(graph: str, precision: str) -> QuantScheme:
    """How `graph`'s weight matmuls are quantized in `precision` (its recipe's); `QuantizeError` where it has
    no body in it."""
    recipe = RECIPES.get(graph)
    if recipe is None or precision not in recipe.quantization:
        quantized = [r.name for r in RECIPES.values() if precision in r.quantization]
        raise QuantizeError(f"{graph}: not exported in {precision} ({precision} graphs: "
                            f"{', '.join(quantized) or 'none'})")
    return recipe.quantization[precision]


def quantize(path: Path, graph: str, precision: str) -> onnx.ModelProto:
    """The fp32 graph `graph` at `path` with its weight MatMuls quantized by its scheme in `precision`
    (`scheme_of`), except in its float32 scopes."""
    scheme = scheme_of(graph, precision)
    model = onnx.load(str(path))
    kept = re.compile("|".join(scheme.fp32_scopes))
    excluded = [n.name for n in model.graph.node if kept.search(n.name)]
    if scheme.operator == NBITS:
        out = _nbits(model, excluded, scheme)
    else:
        chosen = _dynamic_nodes(model, excluded)
        del model  # onnxruntime's quantizer reads the graph from `path`: one copy of the weights, not three
        out = _dynamic(path, chosen)
    if not any(n.op_type in QUANTIZED_OPS[scheme.operator] for n in out.graph.node):
        raise QuantizeError(f"{graph}: no MatMul with a constant weight was quantized")
    return out


QUANTIZED_OPS = {NBITS: {"MatMulNBits"}, DYNAMIC: {"MatMulInteger", "DynamicQuantizeMatMul"}}
"""Operators a scheme's quantized matmuls are written as."""


def _nbits(model: onnx.ModelProto, excluded: list[str], scheme: QuantScheme) -> onnx.ModelProto:
    quantizer = _quantizer_class()(model, bits=scheme.bits, block_size=scheme.block_size,
                                   is_symmetric=scheme.symmetric, accuracy_level=ACCURACY_LEVEL,
                                   nodes_to_exclude=excluded)
    quantizer.process()
    out: onnx.ModelProto = quantizer.model.model
    return out


def _dynamic_nodes(model: onnx.ModelProto, excluded: list[str]) -> list[str]:
    """The MatMuls with a constant weight outside `excluded`: an allow-list, not an exclusion list, as the
    quantizer rewrites Gemms as MatMuls under new names."""
    weights = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in weights and n.name not in excluded]


def _dynamic(path: Path, chosen: list[str]) -> onnx.ModelProto:
    with _quiet_root_logger():
        from onnxruntime.quantization import QuantType, quantize_dynamic
    # the quantizer writes its shape-inferred copy beside its input: a temporary folder (beside `path`,
    # named as any interrupted export's leftovers are) holds links to the graph and its data
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.quantize-", suffix=PARTIAL,
                                     dir=path.parent) as tmp, _quiet_root_logger():
        for file in (path, path.with_name(path.name + ".data")):
            if file.exists():
                link_or_copy(file, Path(tmp) / file.name)
        out = Path(tmp) / "int8.onnx"
        quantize_dynamic(Path(tmp) / path.name, out, op_types_to_quantize=["MatMul"], per_channel=True,
                         reduce_range=True, weight_type=QuantType.QInt8, nodes_to_quantize=chosen,
                         use_external_data_format=True)
        return onnx.load(str(out))


def write_quantized(path: Path, s: GraphSpec, precision: str) -> Path:
    """Replace the fp32 graph at `path` (and its external data) by its quantization in `precision`, its
    float32 attention given onnxruntime's flash kernel where a call allows it (`flash_when_unmasked`: a
    quantized graph runs on onnxruntime's CPU provider alone), checked and with the I/O `s` says,
    atomically; returns `path`."""
    model = quantize(path, s.name, precision)
    flash_when_unmasked(model)
    return replace_graph(path, model, s, {"precision": precision,
                                          f"{precision}_revision": str(REVISIONS[precision]),
                                          f"{precision}_scheme": scheme_of(s.name, precision).describe()})
