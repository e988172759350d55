"""One graph of `cosyvoice-export all`: reused from an earlier export into the same OUT when nothing it is
made from changed, else exported from the networks, converted to its precision and validated, and recorded
(`GraphRecord`, in OUT/.export) for the next export."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from cosyvoice_graphs import GraphSpec, ModelDims, Precision
from cosyvoice_graphs.bundle_layout import graph_file
from cosyvoice_graphs.manifest import (
    FileEntry,
    GateCheck,
    GraphInputs,
    GraphRecord,
    OutputCheck,
    TrtPlanEntry,
    Validation,
)
from cosyvoice_graphs.recipes import RECIPES
from cosyvoice_runtime.bundle import file_sha256

from ..bundle.layout import QWEN_DIR, YAML
from ..memory import stage
from .conversions import CONVERSIONS
from .decode_gates import decode_figures, decode_reference
from .errors import ExportError
from .graphs import EXPORT_RECIPES
from .lazy_networks import LazyNetworks, checkpoints_of
from .output_dir import STATE_DIR, file_entry, graph_record_file, link_into, write_json
from .solve_gates import validate_solve
from .trace import EXPORTER_VERSION, traced
from .validate import Figure, GraphValidation, torch_reference, validate_against

QWEN_CONFIG = "config.json"
CONFIG_SOURCES = (YAML, f"{QWEN_DIR}/{QWEN_CONFIG}")
"""Hyperparameters every graph depends on, besides its checkpoint's weights."""


@dataclass
class GraphResult:
    """One graph of the runtime bundle: its record (files, sources, how it was made and validated), and
    the figures of its validation."""

    spec: GraphSpec
    record: GraphRecord
    validation: GraphValidation
    """Every figure, for a graph exported now; for a reused one, those its record keeps (each output's
    worst, the gates)."""
    reused: bool
    precision: str
    """A key of `PRECISIONS` (`Precision.rewrite` says how its body differs from fp32's); the I/O is the
    spec's in every one."""
    trt: TrtPlanEntry | None = None
    """The TensorRT plan (--trt), as the manifest records it."""
    trt_validation: GraphValidation | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def files(self) -> Mapping[str, FileEntry]:
        """Bundle-relative path -> entry of the ONNX files; the graph first."""
        return self.record.files

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files.values())

    def validations(self) -> list[GraphValidation]:
        return [self.validation, *([self.trt_validation] if self.trt_validation else [])]


def validation_record(v: GraphValidation) -> Validation:
    """`v` as the manifest and a graph's record keep it: each output's worst figure, the cases, the gates."""
    outputs = {o: OutputCheck(f.metric, f.measured, f.bound, f.passed, f.case) for o, f in v.worst().items()}
    gates = {f.metric: GateCheck(f.output, f.measured, f.bound, f.passed, f.case) for f in v.gates}
    return Validation(v.provider, v.against, v.passed, outputs, tuple(sorted({f.case for f in v.figures})),
                      gates)


def _recorded_figures(graph: str, v: Validation) -> GraphValidation:
    """The figures `validation_record` keeps of a validation."""
    figures = tuple(Figure(c.worst_case, o, c.metric, c.measured, c.bound) for o, c in v.outputs.items())
    gates = tuple(Figure(g.case, g.output, metric, g.measured, g.bound) for metric, g in v.gates.items())
    return GraphValidation(graph, v.provider, v.against, figures, gates)


def for_onnxruntime(graph: str, precision: str, trt: bool) -> bool:
    """Whether `graph`'s export in `precision` is written for onnxruntime alone (`Precision.onnxruntime_only`,
    with the graph's `GraphRecipe.float32_cuda_form`); `trt`: the export builds TensorRT plans."""
    return Precision.named(precision).onnxruntime_only(trt_plans=trt,
                                                        float32_cuda_form=RECIPES[graph].float32_cuda_form)


def graph_inputs(s: GraphSpec, sources: Mapping[str, str], precision: str, trt: bool) -> GraphInputs:
    """What a graph is a function of: when none of it changed, the graph need not be exported again. The
    sources by name, so that a fresh graph's record and manifest entry list them as a reused one's do.
    `trt`: whether the export builds TensorRT plans, on which the graph's form may depend
    (`for_onnxruntime`)."""
    conversion = CONVERSIONS.get(precision)
    made = precision if conversion is None else f"{precision} rev {conversion.revision}"
    if for_onnxruntime(s.name, precision, trt):
        made += ", for onnxruntime"
    return GraphInputs(s.name, s.version, EXPORTER_VERSION, dict(sorted(sources.items())), made)


def _read_record(out: Path, graph: str) -> GraphRecord | None:
    """`graph`'s record in `out`; None without one, or with one this exporter cannot read (an earlier
    exporter's format: the graph is exported again)."""
    path = out / graph_record_file(graph)
    try:
        return GraphRecord.from_json(json.loads(path.read_text()), str(path))
    except (OSError, ValueError):  # ManifestError, JSONDecodeError and UnicodeDecodeError among them
        return None


def reuse_graph(out: Path, s: GraphSpec, source_sha: Mapping[str, FileEntry], precision: str, trt: bool
                ) -> GraphResult | None:
    """The graph from an earlier run, if its inputs are unchanged, it passed, and its files are intact."""
    record = _reusable_record(out, s, source_sha, precision, trt)
    if record is None:
        return None
    return GraphResult(s, record, _recorded_figures(s.name, record.validation), reused=True,
                       precision=precision)


def adopt_graph(source: Path, out: Path, s: GraphSpec, source_sha: Mapping[str, FileEntry], precision: str,
                trt: bool) -> GraphResult | None:
    """The graph another export made in `source` (another runtime bundle of the model), where this export
    would make it the same (`reuse_graph`'s conditions there): its files linked into `out` (copied where
    they cannot be), then its record, as a reused graph of `out`."""
    record = _reusable_record(source, s, source_sha, precision, trt)
    if record is None:
        return None
    (out / graph_record_file(s.name)).unlink(missing_ok=True)  # the record must never outlive its file
    for rel in reversed(record.files):  # the graph last: it names its data file
        link_into(out, rel, source / rel)
    write_json(out, graph_record_file(s.name), record.to_json())
    return GraphResult(s, record, _recorded_figures(s.name, record.validation), reused=True,
                       precision=precision)


def shares_sources(source: Path, source_sha: Mapping[str, FileEntry]) -> bool:
    """Whether a graph record in `source` (an export's folder) was made from files whose hashes
    `source_sha` has: an export of the same model, which may lend graphs."""
    for path in sorted((source / STATE_DIR).glob("graph-*.json")):
        record = _read_record(source, path.stem.removeprefix("graph-"))
        sources = record.inputs.sources if record is not None else {}
        if sources and all(n in source_sha and source_sha[n].sha256 == sha for n, sha in sources.items()):
            return True
    return False


def _reusable_record(out: Path, s: GraphSpec, source_sha: Mapping[str, FileEntry], precision: str, trt: bool
                     ) -> GraphRecord | None:
    """`s`'s record in `out` if its inputs are this export's, it passed, and its files are intact."""
    record = _read_record(out, s.name)
    if record is None or not record.validation.passed:
        return None
    sources = record.inputs.sources
    if not set(sources) <= set(source_sha):
        return None
    current = {n: source_sha[n].sha256 for n in sources}
    if record.inputs != graph_inputs(s, current, precision, trt):
        return None
    for rel, entry in record.files.items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != entry.size or file_sha256(path) != entry.sha256:
            return None
    return record


def export_and_validate(out: Path, s: GraphSpec, dims: ModelDims, nets: LazyNetworks,
                        source_sha: Mapping[str, FileEntry], bar: tqdm, precision: str, trt: bool
                        ) -> GraphResult:
    """Export and validate one graph (a reduced-precision graph: against its bounds for that precision,
    and its decode or solve gates where the spec has them), then record it for later runs. `trt`: the
    export builds TensorRT plans, which read standard operators only (`for_onnxruntime`).

    The torch side of the validation runs first and the networks are freed once the graph is traced, so
    that neither the torch networks nor the ONNX graph's copies of their weights (the checker's, onnxslim's,
    the writer's, onnxruntime's) are in memory beside each other; the solve gates load the flow again.
    """
    (out / graph_record_file(s.name)).unlink(missing_ok=True)  # the record must never outlive its file
    _label(bar, s.name, "load networks")
    recipe = EXPORT_RECIPES[s.name]
    wrapper = recipe.wrapper(nets, onnxruntime_only=for_onnxruntime(s.name, precision, trt))
    checkpoints = checkpoints_of(wrapper, nets)
    sources = {n: source_sha[n].sha256 for n in (*CONFIG_SOURCES, *checkpoints)}
    meta = {"source_checkpoint": ",".join(checkpoints),
            "source_sha256": ",".join(sources[c] for c in checkpoints),
            "model_yaml_sha256": sources[YAML]}
    conversion = CONVERSIONS.get(precision)
    if conversion is not None:
        meta |= conversion.metadata()
    _label(bar, s.name, "torch reference")
    start = time.perf_counter()
    reference = torch_reference(wrapper, s.at_precision(precision))
    decoded = None
    if precision in s.decode_gates:
        if recipe.sequence is None:
            raise ExportError(f"{s.name}: its {precision} gates decode, but its recipe has no sequence")
        decoded = decode_reference(wrapper, s, precision, recipe.sequence(nets))
    reference_s = time.perf_counter() - start
    bar.set_postfix_str(f"{s.name}: export")  # `traced` and `finish` begin their own stages
    with traced(wrapper, s, out / graph_file(s.name)) as graph:
        del wrapper
        nets.release()
        result = graph.finish(dims, extra_metadata=meta)
    paths = result.files
    if conversion is not None and conversion.rewrite is not None:
        _label(bar, s.name, precision)
        paths = (conversion.rewrite(result.path, s),)
    _label(bar, s.name, "validate")
    start = time.perf_counter()
    validation = validate_against(result.path, reference, precision=precision)
    if decoded is not None:
        _label(bar, s.name, "decode gates")
        validation = replace(validation, gates=decode_figures(result.path, s, precision, decoded))
    if precision in s.solve_gates:
        _label(bar, s.name, "solve gates")
        validation = replace(validation, gates=validate_solve(result.path, nets, s, precision))
    timings = {"export_s": round(result.seconds, 3),
               "validate_s": round(reference_s + time.perf_counter() - start, 3)}
    _label(bar, s.name, "record")
    record = GraphRecord(graph_inputs(s, sources, precision, trt),
                         {str(p.relative_to(out)): file_entry(p) for p in reversed(paths)},
                         result.simplified, result.simplify_error, timings, validation_record(validation))
    write_json(out, graph_record_file(s.name), record.to_json())
    return GraphResult(s, record, validation, reused=False, precision=precision)


def _label(bar: tqdm, graph: str, step: str) -> None:
    """Show `graph`'s step on the progress bar and begin it as a stage of the memory report."""
    bar.set_postfix_str(f"{graph}: {step}")
    stage(f"{graph}: {step}")
