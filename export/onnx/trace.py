"""One torch wrapper -> one checked, simplified, self-describing ONNX file, all from its `GraphSpec`.

The spec names the inputs and outputs, gives the opset, the symbolic dims (dynamic axes) and the point
to trace at; the written graph is checked against it (names, order, dtypes, ranks, fixed dims) and
carries it in `metadata_props`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import chdir, contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import onnxslim
import torch
from torch import nn

from cosyvoice_graphs import GraphSpec, ModelDims, TensorSpec, metadata

from ..memory import free_memory, stage
from .errors import ExportError
from .output_dir import PARTIAL

EXPORT_REVISION = 12
"""Bump when what is written for an unchanged spec changes (this module, a wrapper or a network's traced
graph; 3: the DiT's additive attention mask; 4: HiFT's polyphase upsampling; 5: the LLM's q/k/v and
gate/up projections as one matmul each; 6: the DiT's attention scaling its queries only; 7: the DiT's GELU
as onnxruntime fuses it, no query rows masked; 8: the DiT's RoPE and attention as onnxruntime's operators
in its int8 graph; 9: that graph's RoPE over the whole q/k, norms with the modulation as their scale and
bias, Mish without Softplus; 10: the int8/int4 llm and llm_prefill's attention as GroupQueryAttention; 11:
that Mish finite in float16, for the fp16 graphs written for onnxruntime; 12: the DiT's modulation split in
one node): it forces a re-export."""
EXPORTER_VERSION = (
    f"cosyvoice-onnx {version('cosyvoice-onnx')} rev {EXPORT_REVISION}; torch {torch.__version__}; "
    f"onnx {onnx.__version__}; onnxslim {onnxslim.__version__}"
)
"""Stored in every graph; part of what decides whether a graph must be exported again."""
MAX_IR_VERSION = 10
"""onnx >= 1.23 writes IR 14 by default, which onnxruntime 1.31 refuses to load."""
EXTERNAL_DATA_BYTES = 1_500_000_000
"""Graphs larger than this keep their weights in `<name>.onnx.data` (protobuf stops at 2 GiB)."""
MOVED_WEIGHT_BYTES = 1 << 20
"""Initializers of at least this size wait on disk, as external data, while onnxslim works on a graph."""
WEIGHTS = "weights.bin"
"""Where they wait, in the graph's staging folder."""

ONNX_DTYPES: dict[str, int] = {
    "float32": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "int64": onnx.TensorProto.INT64,
    "int32": onnx.TensorProto.INT32,
    "bool": onnx.TensorProto.BOOL,
}


class GraphContractError(ExportError):
    """A written graph's I/O disagrees with the spec."""

    def __init__(self, graph: str, tensor: str, problem: str) -> None:
        super().__init__(f"{graph}: {tensor}: {problem}")
        self.graph = graph
        self.tensor = tensor


@dataclass(frozen=True)
class ExportResult:
    """What `export_graph` wrote."""

    path: Path
    files: tuple[Path, ...]
    """The graph and, for large graphs, its external-data file."""
    simplified: bool
    simplify_error: str | None
    """Why onnxslim's output was not used (it raised, or it changed the graph's I/O); None if it was."""
    seconds: float


def dynamic_axes(spec: GraphSpec) -> dict[str, dict[int, str]]:
    """`torch.onnx.export`'s `dynamic_axes`: every symbolic dim of every input, by name.

    Outputs are left to the exporter's shape inference (naming their axes would overwrite whatever it
    found), so that an output dim the trace baked in shows up as fixed and fails `check_contract`;
    `export_graph` gives the output dims the spec's names afterwards."""
    axes: dict[str, dict[int, str]] = {}
    for t in spec.inputs:
        named = {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
        if named:
            axes[t.name] = named
    return axes


def torch_inputs(spec: GraphSpec, feeds: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    """The spec's inputs, in order, as torch tensors (the positional arguments of a wrapper); float16 feeds
    (the caches of an fp16 body, `GraphSpec.io_at`) as float32, which the wrapper computes in."""
    return tuple(torch.from_numpy(feeds[name].astype(np.float32) if feeds[name].dtype == np.float16
                                  else feeds[name]) for name in spec.input_names)


def _check_value(graph: str, v: onnx.ValueInfoProto, t: TensorSpec, output: bool) -> None:
    tt = v.type.tensor_type
    if tt.elem_type != ONNX_DTYPES[t.dtype]:
        found = onnx.TensorProto.DataType.Name(tt.elem_type).lower()
        raise GraphContractError(graph, t.name, f"dtype {found}, spec says {t.dtype}")
    dims = tt.shape.dim
    if not tt.HasField("shape") or len(dims) != len(t.shape):
        rank = len(dims) if tt.HasField("shape") else "unknown"
        raise GraphContractError(graph, t.name, f"rank {rank}, spec says {len(t.shape)} {t.shape}")
    for i, (d, want) in enumerate(zip(dims, t.shape, strict=True)):
        # shape inference may leave an output's fixed dim unnamed-symbolic; validation checks the real size
        unknown_output_dim = output and not d.HasField("dim_value")
        if isinstance(want, int) and d.dim_value != want and not unknown_output_dim:
            found = d.dim_value if d.HasField("dim_value") else repr(d.dim_param or "?")
            raise GraphContractError(graph, t.name, f"dim {i} is {found}, spec says {want}")
        if isinstance(want, str) and d.HasField("dim_value"):
            # a traced shape baked into the graph: it would only run at the trace point
            raise GraphContractError(graph, t.name, f"dim {i} ({want}) is fixed to {d.dim_value}; "
                                                    "the spec says it is symbolic")


def check_contract(model: onnx.ModelProto, spec: GraphSpec) -> None:
    """Raise `GraphContractError` unless the graph's inputs and outputs are the spec's: same names in
    the same order, same dtypes and ranks, fixed dims equal (an output's may be left symbolic) and
    symbolic dims not fixed."""
    for kind, values, tensors in (("inputs", model.graph.input, spec.inputs),
                                  ("outputs", model.graph.output, spec.outputs)):
        names = [v.name for v in values]
        want = [t.name for t in tensors]
        if names != want:
            raise GraphContractError(spec.name, kind, f"graph has {names}, spec says {want}")
        for v, t in zip(values, tensors, strict=True):
            _check_value(spec.name, v, t, output=kind == "outputs")


def _declare_spec_dims(model: onnx.ModelProto, spec: GraphSpec) -> None:
    """Declare the I/O dims as the spec has them: its sizes and its symbol names (shape inference may
    have invented others)."""
    for values, tensors in ((model.graph.input, spec.inputs), (model.graph.output, spec.outputs)):
        for v, t in zip(values, tensors, strict=True):
            for d, want in zip(v.type.tensor_type.shape.dim, t.shape, strict=True):
                if isinstance(want, str):
                    d.dim_param = want
                else:
                    d.dim_value = want


def _simplify(model: onnx.ModelProto, spec: GraphSpec) -> tuple[onnx.ModelProto, str | None]:
    """onnxslim's graph if it succeeds and keeps the I/O contract, else the input graph and why not.

    onnxslim can leave an output of one of onnxruntime's own operators with a value_info of no type (seen
    on the first of an int8 prefill's `GroupQueryAttention`s); such an entry says nothing, and onnxruntime's
    quantizer refuses a matmul that reads it, so it is dropped (the quantizer then takes the value as
    float32, as it is)."""
    try:
        slim = onnxslim.slim(model)
        check_contract(slim, spec)
    except Exception as e:  # any failure of the optional simplifier: keep the plain export
        return model, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    typed = [v for v in slim.graph.value_info if v.type.HasField("tensor_type")]
    del slim.graph.value_info[:]
    slim.graph.value_info.extend(typed)
    return slim, None


def _simplify_light(light: onnx.ModelProto, spec: GraphSpec, folder: Path
                    ) -> tuple[onnx.ModelProto, str | None]:
    """`_simplify` of the graph whose large initializers `_move_weights_out` moved to `folder`, with its
    weights back in (`_move_weights_in`).

    onnxslim runs in `folder`, where onnx and onnxruntime find the moved bytes when it needs a tensor's
    values. A moved tensor whose values it read, it writes back as `EXTERNAL` with no place, and reading
    that one again fails, or fails quietly inside its constant folding: when that happened (the graph has
    such a tensor, or onnxslim failed), the graph is simplified again with its weights in memory, which is
    what onnxslim would have been given without them moved out.
    """
    with chdir(folder):
        slim, error = _simplify(light, spec)
    if error is None and all(_moved(t) or t.data_location != onnx.TensorProto.EXTERNAL
                             for t in _tensors(slim.graph)):
        _move_weights_in(slim, folder)
        return slim, None
    del slim
    _move_weights_in(light, folder)
    return _simplify(light, spec)


def _moved(t: onnx.TensorProto) -> bool:
    """`t` refers to its bytes in the file `_move_weights_out` wrote."""
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == WEIGHTS for e in t.external_data)


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of `graph`: its initializers and its nodes' tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for g in (*([a.g] if a.HasField("g") else []), *a.graphs):
                yield from _tensors(g)


def _move_weights_out(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """A copy of `model` whose initializers of at least `MOVED_WEIGHT_BYTES` keep their bytes in `folder /
    WEIGHTS`, as ONNX external data. `model` is left without those bytes too; a protobuf's memory is freed
    only with the whole message, so the caller drops it.

    onnxslim copies the whole model several times (per pass, per shape inference); without its weights the
    model is a few MB. Identical contents share one place in the file, so that onnxslim, which compares
    constants field by field, finds equal exactly the tensors it would find equal by their bytes."""
    places: dict[bytes, tuple[int, int]] = {}
    with open(folder / WEIGHTS, "wb") as f:
        for t in model.graph.initializer:
            if len(t.raw_data) < MOVED_WEIGHT_BYTES or t.HasField("data_location") or t.external_data:
                continue
            key = hashlib.sha256(t.raw_data).digest()
            if key not in places:
                places[key] = (f.tell(), len(t.raw_data))
                f.write(t.raw_data)
            offset, length = places[key]
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
    return onnx.ModelProto.FromString(model.SerializeToString())


def _move_weights_in(model: onnx.ModelProto, folder: Path) -> None:
    """Put back into `model` the bytes `_move_weights_out` moved to `folder`: its tensors are then the ones
    that went out, field for field."""
    with open(folder / WEIGHTS, "rb") as f:
        for t in _tensors(model.graph):
            if not _moved(t):
                continue
            place = {e.key: e.value for e in t.external_data}
            f.seek(int(place["offset"]))
            t.raw_data = f.read(int(place["length"]))
            t.ClearField("data_location")
            del t.external_data[:]


def _trace(wrapper: nn.Module, spec: GraphSpec, path: Path) -> None:
    feeds = spec.sample_inputs(spec.trace)
    with torch.no_grad(), warnings.catch_warnings():
        # TracerWarnings flag Python-side shape logic; baked shapes are caught by check_contract and
        # the validation cases instead
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper.eval(), torch_inputs(spec, feeds), str(path), dynamo=False,
            opset_version=spec.opset, input_names=spec.input_names, output_names=spec.output_names,
            dynamic_axes=dynamic_axes(spec), do_constant_folding=True,
            custom_opsets=dict(spec.custom_opsets),
        )


def _save(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write `model` to `path` (plus `path.data` when large); returns the files written."""
    if model.ByteSize() > EXTERNAL_DATA_BYTES:
        data = path.with_name(path.name + ".data")
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
        return [data, path] if data.exists() else [path]
    onnx.save_model(model, str(path))
    return [path]


@dataclass(frozen=True)
class TracedGraph:
    """A wrapper traced into a staging folder beside the graph's final path (see `traced`)."""

    spec: GraphSpec
    raw: Path
    """The tracer's graph, in the staging folder."""
    out: Path
    started: float
    wrapper_metadata: Mapping[str, str]
    """What the wrapper itself adds to the graph's metadata (its `metadata()`, where it has one: a
    constant baked into the graph that a runtime must know, such as `llm_decode`'s RoPE positions)."""

    def finish(self, dims: ModelDims, extra_metadata: Mapping[str, object] | None = None) -> ExportResult:
        """Check, simplify, describe and write the traced graph to its final path (see `export_graph`)."""
        spec, out, tmp = self.spec, self.out, self.raw.parent
        stage(f"{spec.name}: check")
        onnx.checker.check_model(str(self.raw))  # by path: works for graphs past protobuf's 2 GiB too
        model = onnx.load(str(self.raw))
        check_contract(model, spec)
        stage(f"{spec.name}: onnxslim")
        light = _move_weights_out(model, tmp)
        del model
        free_memory()
        model, simplify_error = _simplify_light(light, spec, tmp)
        del light
        stage(f"{spec.name}: save")
        _declare_spec_dims(model, spec)
        model.ir_version = min(model.ir_version, MAX_IR_VERSION)
        model.doc_string = spec.doc
        del model.metadata_props[:]
        meta = metadata(spec, dims, {"exporter_version": EXPORTER_VERSION, **self.wrapper_metadata,
                                     **(extra_metadata or {})})
        onnx.helper.set_model_props(model, meta)

        staged = _save(model, tmp / out.name)
        del model
        free_memory()
        onnx.checker.check_model(str(tmp / out.name))
        final = [out.parent / p.name for p in staged]
        for src, dst in zip(staged, final, strict=True):  # the graph last: it names its data file
            os.replace(src, dst)
        stale_data = out.with_name(out.name + ".data")
        if stale_data not in final:
            stale_data.unlink(missing_ok=True)
        return ExportResult(path=out, files=tuple(final), simplified=simplify_error is None,
                            simplify_error=simplify_error, seconds=time.perf_counter() - self.started)


@contextmanager
def traced(wrapper: nn.Module, spec: GraphSpec, out: Path) -> Iterator[TracedGraph]:
    """Trace `wrapper` as the graph `spec` describes into a temporary folder beside `out`, which is removed
    when the block ends; `TracedGraph.finish` inside the block writes `out`.

    Nothing here refers to `wrapper` once it is traced, so the block may free its networks before the
    graph is checked, simplified and saved (each of which holds copies of the weights).
    """
    started = time.perf_counter()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTIAL, dir=out.parent))
    try:
        raw = tmp / "traced.onnx"
        stage(f"{spec.name}: trace")
        _trace(wrapper, spec, raw)
        own: dict[str, str] = getattr(wrapper, "metadata", dict)()
        del wrapper
        yield TracedGraph(spec, raw, out, started, own)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_graph(wrapper: nn.Module, spec: GraphSpec, dims: ModelDims, out: Path, *,
                 extra_metadata: Mapping[str, object] | None = None) -> ExportResult:
    """Export `wrapper` to `out` as the graph `spec` describes.

    Traced with the legacy TorchScript exporter at `spec.trace`, then `onnx.checker`, onnxslim (on the graph
    with its large weights on disk; falling back to the plain graph if it fails), the I/O contract check and
    `metadata_props`
    (`cosyvoice_graphs.metadata` plus `exporter_version` and `extra_metadata`). Written atomically:
    into a temporary folder beside `out`, then renamed; on any error nothing is left behind.
    """
    with traced(wrapper, spec, out) as graph:
        return graph.finish(dims, extra_metadata)


def replace_graph(path: Path, model: onnx.ModelProto, spec: GraphSpec, props: Mapping[str, str]) -> Path:
    """Replace the graph at `path` (and its external data) by `model`, a rewrite of it (fp16, int8): its
    I/O checked against `spec`, `props` added to its metadata, saved as one file and checked with full
    type inference, atomically; returns `path`."""
    check_contract(model, spec)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **props})
    if model.ByteSize() > EXTERNAL_DATA_BYTES:  # reduced precisions shrink the weights: the LLM is <= 1 GB
        raise ExportError(f"{spec.name}: rewritten graph over {EXTERNAL_DATA_BYTES} bytes; external data "
                          "unsupported")
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    try:
        onnx.save_model(model, str(tmp))
        onnx.checker.check_model(str(tmp), full_check=True)  # strict type inference must agree too
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    path.with_name(path.name + ".data").unlink(missing_ok=True)  # the fp32 graph's weights, if large
    return path
