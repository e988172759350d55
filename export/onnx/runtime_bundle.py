"""`cosyvoice-export all`: a CosyVoice3 model bundle -> a self-contained, torch-free runtime bundle.

The layout is `cosyvoice_graphs.bundle_layout`'s; besides it, OUT/.export/ holds one record per
exported graph, which is what lets a later run skip it.

Every file is written to a temporary name and renamed, and an existing manifest is removed before
anything in OUT changes, so an interrupted export never leaves a manifest that claims files that are
not complete. An export holds OUT.lock, beside OUT, while it runs: two exports never write into one OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import numpy as np
from filelock import FileLock, Timeout
from torch import nn
from tqdm import tqdm

from cosyvoice_graphs import PRECISIONS, GraphSpec, ModelDims, spec
from cosyvoice_graphs.bundle_layout import (
    FLOW_NOISE,
    FRONTEND_DIR,
    GRAPHS_DIR,
    MANIFEST,
    NOISE_TABLES,
    PROMPT_TEXT,
    PROMPT_WAV,
    RETIRED_GRAPHS,
    SINE_NOISE,
    SPEECH_EMBEDDING,
    TEXT_EMBEDDING,
    TOKENIZER_DIR,
    TRT_DIR,
    generated_table_file,
    graph_file,
    table_file,
)
from cosyvoice_graphs.manifest import (
    FileEntry,
    Frontend,
    GateCheck,
    GraphEntry,
    Manifest,
    ModelConstants,
    OutputCheck,
    Prompt,
    TableEntry,
    Tokenizer,
    TrtPlanEntry,
    Validation,
)
from cosyvoice_graphs.precision import BF16, FP16, FP32, INT4, INT8, TF32
from cosyvoice_graphs.precision_plan import PrecisionPlan
from cosyvoice_graphs.providers import OPENVINO
from cosyvoice_runtime.noise import MT19937, UniformNoise

from ..bundle.check import check_bundle
from ..bundle.errors import BundleError
from ..bundle.layout import CAMPPLUS, LLM_CHECKPOINTS, QWEN_DIR, SPEECH_TOKENIZER, YAML
from ..bundle.model_dir import ModelBundle
from ..bundle.tokenizer_files import ENDOFPROMPT, TOKENIZER_FILES, load_cosyvoice3_tokenizer
from ..config import ModelConfig
from ..manifest import NETWORKS
from ..memory import free_memory, stage
from ..nets.flow import CausalMaskedDiffWithDiT
from ..nets.hift import CausalHiFTGenerator, hift_layout
from ..nets.llm import CosyVoice3LM
from ..noise import noise_tables
from .bf16 import BF16_REVISION, bf16_metadata, require_openvino
from .decode_gates import SEQUENCES, decode_figures, decode_reference
from .dims import model_dims
from .fp16 import FP16_REVISION, write_fp16
from .graphs import WRAPPERS
from .quantize import REVISIONS, write_quantized
from .solve_gates import validate_solve
from .trace import EXPORTER_VERSION, PARTIAL, file_sha256, traced
from .validate import Figure, GraphValidation, ValidationError, torch_reference, validate_against

if TYPE_CHECKING:
    from .trt import TrtEnv

STATE_DIR = ".export"
PRECISION_FILE = "precision"
"""In STATE_DIR: the precision plan OUT was exported with (`PrecisionPlan.name`); one OUT holds one."""
QWEN_CONFIG = "config.json"
TOKENIZER_COPY = (*TOKENIZER_FILES, QWEN_CONFIG)
"""What the runtime's tokenizer loads, copied from CosyVoice-BlankEN/."""
CONFIG_SOURCES = (YAML, f"{QWEN_DIR}/{QWEN_CONFIG}")
"""Hyperparameters every graph depends on, besides its checkpoint's weights."""


class OutputDirError(BundleError):
    """OUT cannot be used: a foreign non-empty directory, or not writable."""


def _file_entry(path: Path) -> FileEntry:
    return FileEntry(path.stat().st_size, file_sha256(path))


@dataclass
class GraphResult:
    """One graph of the runtime bundle: its files, how it was made, and how it validated."""

    name: str
    spec: GraphSpec
    files: dict[str, FileEntry]
    """Bundle-relative path -> entry of the ONNX files; the graph first."""
    sources: dict[str, str]
    """Model-bundle file -> sha256 of what the graph was made from."""
    validation: GraphValidation
    reused: bool
    simplified: bool
    simplify_error: str | None
    timings: dict[str, float]
    trt: TrtPlanEntry | None = None
    """The TensorRT plan (--trt), as the manifest records it."""
    trt_validation: GraphValidation | None = None
    precision: str = FP32.name
    """A key of `PRECISIONS` (`Precision.rewrite` says how its body differs from fp32's); the I/O is the
    spec's in every one."""

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files.values())

    def validations(self) -> list[GraphValidation]:
        return [self.validation, *([self.trt_validation] if self.trt_validation else [])]


@dataclass(frozen=True)
class Report:
    """What `export_all` did."""

    out: Path
    graphs: tuple[GraphResult, ...]
    manifest: Path | None
    """None when a graph failed validation: a bundle with a failing graph gets no manifest."""
    seconds: float
    files: dict[str, FileEntry]
    """Every file of the bundle (the manifest's `files`)."""

    @property
    def failures(self) -> list[ValidationError]:
        return [e for g in self.graphs for v in g.validations() for e in v.failures]

    @property
    def passed(self) -> bool:
        return not self.failures

    def table(self) -> str:
        """The summary table: one row per graph (and per gate set and TensorRT plan), its worst
        output or gate."""
        rows = [("graph", "size", "output", "error", "tolerance", "run", "ok")]

        def row(label: str, figures: Iterable[Figure], size: str, run: str) -> None:
            f = max(figures, key=lambda fig: fig.ratio)
            error = f.problem[:24] if f.problem else f"{f.measured:.2e}"
            rows.append((label, size, f.output, error, f"{f.metric} <= {f.bound:.0e}", run,
                         "✓" if f.passed else "✗"))

        for g in self.graphs:
            run = "reused" if g.reused else "exported"
            row(g.name, g.validation.worst().values(), _human(g.size), run)
            if g.validation.gates:  # the gate closest to (or furthest past) its bound
                kind = "decode" if g.precision in g.spec.decode_gates else "solve"
                row(f"{g.name} [{g.precision} {kind}]", g.validation.gates, "", run)
            if g.trt_validation is not None:
                row(f"{g.name} [trt]", g.trt_validation.worst().values(), _human(_plan_size(g)), _plan_run(g))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        status = f"manifest: {self.manifest}" if self.manifest else "no manifest written: validation failed"
        return "\n".join([*lines, f"{len(self.graphs)} graphs in {self.seconds:.1f} s; {status}"])


def _plan_size(g: GraphResult) -> int:
    return g.trt.size if g.trt else 0


def _plan_run(g: GraphResult) -> str:
    return "cached" if g.trt and g.trt.cached else "built"


def _human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


# --- writing into OUT --------------------------------------------------------------------------------

def _install(out: Path, rel: str, write: Callable[[IO[bytes]], object]) -> FileEntry:
    """Write `out/rel` through a temporary name; returns its entry."""
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        entry = _file_entry(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return entry


def _write_json(out: Path, rel: str, data: Mapping[str, Any]) -> FileEntry:
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    return _install(out, rel, lambda f: f.write(text.encode()))


def _prepare_out(out: Path, precision: str) -> None:
    """Refuse a foreign or unwritable OUT, or one exported with another precision plan (`precision`, a
    `PrecisionPlan.name`); mark it as ours (and its plan) and drop its manifest before changing it."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out}: exists and is not a directory")
    ours = (out / MANIFEST).is_file() or (out / STATE_DIR).is_dir()
    if out.is_dir() and not ours and any(out.iterdir()):
        raise OutputDirError(f"{out}: not empty and not a runtime bundle (no {MANIFEST}); "
                                 "choose a new or empty directory")
    marker = out / STATE_DIR / PRECISION_FILE
    # bundles written before precisions were recorded are fp32
    found = marker.read_text().strip() if marker.is_file() else FP32.name if ours else precision
    if found != precision:
        raise OutputDirError(f"{out}: holds a {found} runtime bundle; --precision {precision} needs "
                                 "a new or empty --out (one precision plan per bundle)")
    try:
        (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{precision}\n")
        probe = out / STATE_DIR / f".probe{PARTIAL}"
        probe.write_bytes(b"")
        probe.unlink()
        (out / MANIFEST).unlink(missing_ok=True)
    except OSError as e:
        raise OutputDirError(f"{out}: cannot write there ({e.strerror or type(e).__name__})") from None
    for leftover in sorted(out.rglob(f".*{PARTIAL}"), reverse=True):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _drop_retired_graphs(out: Path) -> None:
    """Delete what an earlier export wrote for `RETIRED_GRAPHS` (the graph and its external data, its
    record, its TensorRT plans): the runtime never opens them and the new manifest does not list them."""
    for name in RETIRED_GRAPHS:
        for path in (*(out / GRAPHS_DIR).glob(f"{name}.onnx*"), *(out / TRT_DIR).glob(f"{name}.*.plan"),
                     out / _record_rel(f"graph-{name}")):
            path.unlink(missing_ok=True)


def _record_rel(name: str) -> str:
    return f"{STATE_DIR}/{name}.json"


def _read_record(out: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((out / _record_rel(name)).read_text())
    except (OSError, ValueError):
        return None


# --- inputs --------------------------------------------------------------------------------------------

def _source_files(bundle: ModelBundle) -> dict[str, Path]:
    """Every model-bundle file the runtime bundle is made from, by its path in the model bundle."""
    names = [*CONFIG_SOURCES, *(bundle.checkpoint_file(n) for n in NETWORKS), CAMPPLUS, SPEECH_TOKENIZER,
             *(f"{QWEN_DIR}/{n}" for n in TOKENIZER_FILES)]
    return {n: bundle.root / n for n in names}


def _hash_sources(files: Mapping[str, Path], progress: bool) -> dict[str, FileEntry]:
    total = sum(p.stat().st_size for p in files.values())
    with tqdm(total=total, desc="hashing sources", unit="B", unit_scale=True, disable=not progress) as bar:
        return {n: FileEntry(p.stat().st_size, file_sha256(p, bar.update)) for n, p in files.items()}


_Net = TypeVar("_Net", bound=nn.Module)


class _Networks:
    """The bundle's networks (a `NetworkSource`), each loaded when first read, one task's at a time.

    A task (the tables, a graph's export and validation) reads the networks it needs; reading one that is
    not loaded first frees those the current task has not read, so that a full-size LLM and DiT are never
    in memory together, and `release` frees them all (a graph's, once it is traced). A run that reuses
    every graph loads only the LLM, for its tables.
    """

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self._loaded: dict[str, nn.Module] = {}
        self._read: set[str] = set()

    @property
    def config(self) -> ModelConfig:
        return self.bundle.config

    @property
    def llm(self) -> CosyVoice3LM:
        return self._get("llm", CosyVoice3LM)

    @property
    def flow(self) -> CausalMaskedDiffWithDiT:
        return self._get("flow", CausalMaskedDiffWithDiT)

    @property
    def hift(self) -> CausalHiFTGenerator:
        return self._get("hift", CausalHiFTGenerator)

    def next_task(self) -> None:
        """Begin a task: the networks read so far are freed when it reads one that is not loaded (and what
        the last task freed is returned to the system now)."""
        self._read.clear()
        free_memory()

    def release(self) -> None:
        """Free every loaded network (once nothing else refers to it); reading one loads it again."""
        self._loaded.clear()
        free_memory()

    def loaded(self) -> dict[str, nn.Module]:
        """The networks in memory, by name, in `NETWORKS` order."""
        return {n: self._loaded[n] for n in NETWORKS if n in self._loaded}

    def _get(self, name: str, kind: type[_Net]) -> _Net:
        self._read.add(name)
        if name not in self._loaded:
            for unread in set(self._loaded) - self._read:
                del self._loaded[unread]
            free_memory()  # the last task's modules, before the next network is read
            self._loaded[name] = self.bundle.load_network(name)
        net = self._loaded[name]
        assert isinstance(net, kind)
        return net


def _checkpoints_of(wrapper: nn.Module, nets: _Networks) -> list[str]:
    """The checkpoints whose tensors `wrapper` holds (all of them if it holds copies we cannot trace). It was
    built from loaded networks, and reading one loads it: the networks not loaded are not among them."""
    held = {t.data_ptr() for t in wrapper.state_dict().values() if t.numel()}
    used = [n for n, net in nets.loaded().items()
            if any(t.data_ptr() in held for t in net.state_dict().values() if t.numel())]
    return [nets.bundle.checkpoint_file(n) for n in (used or NETWORKS)]


@dataclass(frozen=True)
class Conversion:
    """How the exporter makes a reduced-precision graph from the graph it exported in float32."""

    revision: int
    """Bumped when what its graphs are changes (it forces them to be exported again)."""
    rewrite: Callable[[Path, GraphSpec], Path] | None = None
    """Rewrites the exported graph into the precision (`Precision.rewrite` says how); None where the
    precision's graph is the float32 export itself."""
    metadata: Callable[[], dict[str, str]] = dict
    """What the exported graph's `metadata_props` gain (a rewrite adds its own)."""


CONVERSIONS = {
    FP16.name: Conversion(FP16_REVISION, write_fp16),
    INT8.name: Conversion(REVISIONS[INT8.name], partial(write_quantized, precision=INT8.name)),
    INT4.name: Conversion(REVISIONS[INT4.name], partial(write_quantized, precision=INT4.name)),
    BF16.name: Conversion(BF16_REVISION, metadata=bf16_metadata),
    TF32.name: Conversion(1, metadata=lambda: {"precision": TF32.name}),
}
"""Every precision but fp32 -> its conversion (see `fp16`, `quantize`, `bf16`; a tf32 graph is the float32
export marked tf32, which the runtime's CUDA sessions run with TF32 on)."""


def _graph_inputs(s: GraphSpec, sources: Mapping[str, str], precision: str) -> dict[str, Any]:
    """What a graph is a function of: when none of it changed, the graph need not be exported again."""
    conversion = CONVERSIONS.get(precision)
    made = precision if conversion is None else f"{precision} rev {conversion.revision}"
    return {"spec_name": s.name, "spec_version": s.version, "exporter_version": EXPORTER_VERSION,
            "sources": dict(sorted(sources.items())), "precision": made}


# --- steps ---------------------------------------------------------------------------------------------

def _reuse(out: Path, s: GraphSpec, source_sha: Mapping[str, FileEntry], precision: str
           ) -> GraphResult | None:
    """The graph from an earlier run, if its inputs are unchanged, it passed, and its files are intact."""
    record = _read_record(out, f"graph-{s.name}")
    if record is None or not record.get("passed"):
        return None
    sources = record["inputs"]["sources"]
    if not set(sources) <= set(source_sha):
        return None
    current = {n: source_sha[n].sha256 for n in sources}
    if record["inputs"] != _graph_inputs(s, current, precision):
        return None
    files = {rel: FileEntry(**e) for rel, e in record["files"].items()}
    for rel, entry in files.items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != entry.size or file_sha256(path) != entry.sha256:
            return None
    v = record["validation"]
    validation = GraphValidation(s.name, v["provider"], v["against"],
                                 tuple(Figure.from_json(f) for f in v["figures"]),
                                 tuple(Figure.from_json(f) for f in v.get("gates", ())))
    return GraphResult(s.name, s, files, current, validation, reused=True, simplified=record["simplified"],
                       simplify_error=record["simplify_error"], timings=record["timings"],
                       precision=precision)


def _export(out: Path, s: GraphSpec, dims: ModelDims, nets: _Networks, source_sha: Mapping[str, FileEntry],
            bar: tqdm, precision: str) -> GraphResult:
    """Export and validate one graph (a reduced-precision graph: against its bounds for that precision,
    and its decode or solve gates where the spec has them), then record it for later runs.

    The torch side of the validation runs first and the networks are freed once the graph is traced, so
    that neither the torch networks nor the ONNX graph's copies of their weights (the checker's, onnxslim's,
    the writer's, onnxruntime's) are in memory beside each other; the solve gates load the flow again.
    """
    (out / _record_rel(f"graph-{s.name}")).unlink(missing_ok=True)  # the record must never outlive its file
    _label(bar, s.name, "load networks")
    wrapper = WRAPPERS[s.name](nets)
    checkpoints = _checkpoints_of(wrapper, nets)
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
        decoded = decode_reference(wrapper, s, precision, SEQUENCES[s.name](nets))
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
    files = {str(p.relative_to(out)): _file_entry(p) for p in reversed(paths)}
    _write_json(out, _record_rel(f"graph-{s.name}"), {
        "inputs": _graph_inputs(s, sources, precision),
        "files": {rel: e.to_json() for rel, e in files.items()},
        "passed": validation.passed,
        "simplified": result.simplified,
        "simplify_error": result.simplify_error,
        "validation": {"provider": validation.provider, "against": validation.against,
                       "figures": [f.to_json() for f in validation.figures],
                       "gates": [f.to_json() for f in validation.gates]},
        "timings": timings,
    })
    return GraphResult(s.name, s, files, sources, validation, reused=False, simplified=result.simplified,
                       simplify_error=result.simplify_error, timings=timings, precision=precision)


def _label(bar: tqdm, graph: str, step: str) -> None:
    """Show `graph`'s step on the progress bar and begin it as a stage of the memory report."""
    bar.set_postfix_str(f"{graph}: {step}")
    stage(f"{graph}: {step}")


def _max_size(s: GraphSpec, dim: str) -> int:
    return s.sizes({n: r.max for n, r in s.dims.items()})[dim]


def _write_tables(out: Path, bundle: ModelBundle, nets: _Networks, dims: ModelDims
                  ) -> tuple[dict[str, TableEntry], dict[str, FileEntry]]:
    """The lookup tables and flow noise as float32 .npy files, and the MT19937 state that the sine noise
    table is drawn from (checked to redraw torch's table bit for bit)."""
    llm = nets.llm
    noise = noise_tables(bundle.config)
    full = {FLOW_NOISE: noise.flow_noise, SINE_NOISE: noise.sine_waves}  # (1, mel, F), (1, S, H)
    axis = {FLOW_NOISE: 2, SINE_NOISE: 1}  # the time axis of each table
    tables: dict[str, tuple[np.ndarray, str]] = {
        TEXT_EMBEDDING: (llm.backbone.embed_tokens.weight.detach().numpy(),
                         "Qwen embed_tokens rows, by text token id"),
        SPEECH_EMBEDDING: (llm.speech_embedding.weight.detach().numpy(),
                           "speech_embedding rows, by speech id (sos, eos, task_id included)"),
    }
    for name, (graph, dim) in NOISE_TABLES.items():
        length = _max_size(spec(graph, dims), dim)
        table = full[name].numpy()
        cut = table[(slice(None),) * axis[name] + (slice(0, length),)]
        tables[name] = (cut, f"cut from {table.shape[axis[name]]} to {length} along axis {axis[name]}: "
                             f"{graph}'s profile allows at most {length} {dim}; read from 0")
    sine, sine_note = tables.pop(SINE_NOISE)
    info: dict[str, TableEntry] = {}
    files: dict[str, FileEntry] = {}
    for name, (array, note) in tables.items():
        rel = table_file(name)
        array = np.ascontiguousarray(array, dtype=np.float32)
        files[rel] = _install(out, rel, partial(np.save, arr=array, allow_pickle=False))
        info[name] = TableEntry(rel, array.shape, "float32", note)
    drawn = UniformNoise(noise.sine_waves_state, sine.shape[1], sine.shape[2]).window(0, sine.shape[1])
    if not np.array_equal(drawn, sine):
        raise BundleError("the sine noise drawn from its MT19937 state differs from torch's table")
    rel = generated_table_file(SINE_NOISE)
    files[rel] = _install(out, rel, partial(np.save, arr=noise.sine_waves_state, allow_pickle=False))
    info[SINE_NOISE] = TableEntry(
        rel, sine.shape, "float32", f"torch.rand's stream from this MT19937 state; {sine_note}",
        generator=MT19937, values_sha256=hashlib.sha256(sine.astype("<f4").tobytes()).hexdigest())
    return info, files


def _copy_files(out: Path, bundle: ModelBundle, source_sha: Mapping[str, FileEntry]) -> dict[str, FileEntry]:
    """The frontend models, tokenizer files and yaml, copied and checked against their source hashes."""
    copies = {f"{FRONTEND_DIR}/{CAMPPLUS}": CAMPPLUS, f"{FRONTEND_DIR}/{SPEECH_TOKENIZER}": SPEECH_TOKENIZER,
              YAML: YAML, **{f"{TOKENIZER_DIR}/{n}": f"{QWEN_DIR}/{n}" for n in TOKENIZER_COPY}}
    files = {}
    for rel, src in copies.items():
        with open(bundle.root / src, "rb") as source:
            entry = _install(out, rel, partial(shutil.copyfileobj, source))
        if entry.sha256 != source_sha[src].sha256:
            raise BundleError(f"{bundle.root / src}: changed while the export was running")
        files[rel] = entry
    return files


def _copy_prompt(out: Path, bundle: ModelBundle) -> tuple[Prompt | None, dict[str, FileEntry]]:
    """The model bundle's demo prompt and transcript, when it has both (ours do; upstream's has none)."""
    if not all((bundle.root / rel).is_file() for rel in (PROMPT_WAV, PROMPT_TEXT)):
        return None, {}
    files = {}
    for rel in (PROMPT_WAV, PROMPT_TEXT):
        with open(bundle.root / rel, "rb") as source:
            files[rel] = _install(out, rel, partial(shutil.copyfileobj, source))
    return Prompt(PROMPT_WAV, PROMPT_TEXT), files


def _build_plans(out: Path, results: list[GraphResult], env: TrtEnv, progress: bool) -> None:
    """A TensorRT plan per graph (from the cache where it has one), validated against onnxruntime; none for a
    graph of onnxruntime's own operators (`decode=fp32`'s `llm_decode`), which TensorRT cannot parse and the
    runtime runs on onnxruntime's CPU only."""
    from .trt import build_plan, validate_plan

    planned = [g for g in results if not g.spec.custom_opsets]
    for g in tqdm(planned, desc="tensorrt", unit="graph", disable=not progress):
        onnx_path = out / graph_file(g.name)
        plan = build_plan(onnx_path, g.spec, out / TRT_DIR, env)
        start = time.perf_counter()
        g.trt_validation = validate_plan(plan.path, onnx_path, g.spec)
        entry = _file_entry(plan.path)
        g.trt = TrtPlanEntry(str(plan.path.relative_to(out)), entry.size, entry.sha256, plan.key, plan.cached,
                             env.gpu_name, env.trt_version, round(plan.seconds, 3),
                             round(time.perf_counter() - start, 3), _validation(g.trt_validation))


# --- the manifest --------------------------------------------------------------------------------------

def _validation(v: GraphValidation) -> Validation:
    outputs = {o: OutputCheck(f.metric, f.measured, f.bound, f.passed, f.case) for o, f in v.worst().items()}
    gates = {f.metric: GateCheck(f.output, f.measured, f.bound, f.passed, f.case) for f in v.gates}
    return Validation(v.provider, v.against, v.passed, outputs, tuple(sorted({f.case for f in v.figures})),
                      gates)


def _graph_entry(g: GraphResult) -> GraphEntry:
    return GraphEntry(file=next(iter(g.files)), precision=g.precision, spec_name=g.spec.name,
                      spec_version=g.spec.version, opset=g.spec.opset, sources=g.sources,
                      simplified=g.simplified, simplify_error=g.simplify_error, reused=g.reused,
                      timings=g.timings, validation=_validation(g.validation), trt=g.trt)


def _model_constants(bundle: ModelBundle, dims: ModelDims) -> ModelConstants:
    llm = bundle.config.llm
    tokenizer = load_cosyvoice3_tokenizer(bundle.qwen_dir)
    return ModelConstants(dims, sos=llm.sos, eos=llm.eos, task_id=llm.task_id,
                          endofprompt_id=tokenizer.token_id(ENDOFPROMPT),
                          hift=hift_layout(bundle.config.hift))


@contextmanager
def _step(bar: tqdm, label: str) -> Iterator[None]:
    bar.set_postfix_str(label)
    stage(label)
    yield
    bar.update()


def export_all(model_dir: Path | str, out: Path | str, *, llm: str = "base", force: bool = False,
               trt: bool = False, precision: str = FP32.name, wait: bool = False, progress: bool = True
               ) -> Report:
    """Export, check and validate every graph of the model bundle at `model_dir` and assemble the
    runtime bundle in `out`.

    The LLM is `llm`'s checkpoint (a key of `LLM_CHECKPOINTS`: `llm.pt`, or the release's `llm.rl.pt`),
    which the manifest records; a missing one is a `BundleError` before anything else is read.

    A graph whose inputs (spec version, source hashes, exporter version) are unchanged since an
    earlier run into `out`, that passed then and whose files are intact, is reused unless `force`; the
    files of graphs an earlier exporter made that this one no longer does (`RETIRED_GRAPHS`) are deleted.
    Bad bundles raise `BundleError` (the one-line errors of `check-bundle`); a foreign or unwritable
    `out` raises `OutputDirError`; with `trt` and no CUDA device or TensorRT, or a precision without
    TensorRT plans (`Precision.trt_plans`: int8, int4, bf16), `TrtUnavailable` is raised before anything is
    read or written, and so is `Bf16Unavailable` for a precision validated on OpenVINO (bf16) on a CPU
    without its instructions. Validation failures do not raise: they are in the report, and no manifest is
    written.

    `precision` is a `PrecisionPlan` (a precision, a profile, or `graph=precision,...`); one that names
    something unknown, or gives a graph a precision its spec does not bound, raises `PrecisionPlanError`
    once the model's config is read, before any weights are. A graph in a reduced precision (a key of
    `CONVERSIONS`) gets a body in it (float32 I/O; see `fp16`, `quantize`, `bf16`), validated with its spec's
    bounds for it and, where the spec has them, its decode or solve gates. `out` must not hold a bundle of
    another plan.

    One export writes into `out` at a time: each holds `lock_path(out)` while it runs. When another export
    holds it, this one raises `OutputDirError` before reading anything, or with `wait` says so on stderr and
    waits for it to end (then reuses the graphs it exported).
    """
    plan = PrecisionPlan.parse(precision)
    if llm not in LLM_CHECKPOINTS:
        raise ValueError(f"unknown llm {llm!r}; expected one of {', '.join(LLM_CHECKPOINTS)}")
    start = time.perf_counter()
    trt_env = None
    if trt:
        from .trt import TrtUnavailable, require_trt

        for record in plan.named:
            if not record.trt_plans:
                planned = [name for name, p in PRECISIONS.items() if p.trt_plans]
                raise TrtUnavailable(f"--trt with --precision {plan.name}: {record.name} graphs run on "
                                     f"{record.runs_on}, not as TensorRT plans; --trt takes --precision "
                                     f"{' or '.join(planned)}")
        trt_env = require_trt()
    for record in plan.named:
        if record.cpu_provider == OPENVINO:
            require_openvino(record)
    bundle = ModelBundle.open(model_dir, LLM_CHECKPOINTS[llm])
    plan.check({name: spec(name, model_dims(bundle.config)) for name in plan.graph_names})
    if not bundle.checkpoint("llm").is_file():
        raise BundleError(f"{bundle.checkpoint('llm')}: file not found; --llm {llm} exports it "
                          f"(`cosyvoice-export download --llm {llm}` fetches it)")
    out = Path(out)
    with _locked(out, wait):
        return _assemble(bundle, out, force, plan, trt_env, progress, start)


def lock_path(out: Path) -> Path:
    """The lock file of exports into `out`: beside the folder, never in the bundle (nor its manifest);
    left in place, as a lock file may be in use when it would be deleted."""
    out = out.resolve()
    return out.with_name(f"{out.name}.lock")


@contextmanager
def _locked(out: Path, wait: bool) -> Iterator[None]:
    """Hold `out`'s lock; `OutputDirError` if another export holds it (unless `wait`)."""
    path = lock_path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not wait:
                raise OutputDirError(f"{out}: another export into it is running (it holds {path}); run "
                                     "again when it has finished, or pass --wait") from None
            print(f"waiting for another export into {out} to finish (it holds {path})", file=sys.stderr,
                  flush=True)
            lock.acquire()
    except OSError as e:
        raise OutputDirError(f"{out}: cannot write there (its lock {path}: {e.strerror or type(e).__name__})"
                             ) from None
    try:
        yield
    finally:
        lock.release()


def _assemble(bundle: ModelBundle, out: Path, force: bool, plan: PrecisionPlan, trt_env: TrtEnv | None,
              progress: bool, start: float) -> Report:
    """The work of `export_all`, under `out`'s lock."""
    stage("check bundle")
    check_bundle(bundle.root, report=lambda line: None, llm_checkpoints=(bundle.llm_checkpoint,))
    _prepare_out(out, plan.name)
    _drop_retired_graphs(out)
    dims = model_dims(bundle.config)
    specs = {name: spec(name, dims) for name in plan.graph_names}
    stage("hash sources")
    source_sha = _hash_sources(_source_files(bundle), progress)
    nets = _Networks(bundle)

    results: list[GraphResult] = []
    with tqdm(total=len(specs) + 2, desc="runtime bundle", unit="step", disable=not progress) as bar:
        with _step(bar, "tables"):  # first: the LLM they are read from is the first graph's network
            tables, table_files = _write_tables(out, bundle, nets, dims)
        for s in specs.values():
            with _step(bar, f"{s.name}: reuse check"):
                nets.next_task()
                p = plan.precision_of(s)
                reused = None if force else _reuse(out, s, source_sha, p)
                results.append(reused or _export(out, s, dims, nets, source_sha, bar, p))
        with _step(bar, "frontend, tokenizer"):
            copied = _copy_files(out, bundle, source_sha)
            prompt, prompt_files = _copy_prompt(out, bundle)
    if trt_env is not None and all(g.validation.passed for g in results):
        stage("tensorrt")
        _build_plans(out, results, trt_env, progress)

    files = {rel: e for g in results for rel, e in g.files.items()} | table_files | copied | prompt_files
    files |= {g.trt.file: FileEntry(g.trt.size, g.trt.sha256) for g in results if g.trt}
    report = Report(out, tuple(results), None, time.perf_counter() - start, files)
    if not report.passed:
        return report
    stage("manifest")
    manifest = Manifest(
        exporter_version=EXPORTER_VERSION,
        precision=plan.name,
        llm_checkpoint=bundle.llm_checkpoint,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        model=_model_constants(bundle, dims),
        sources=source_sha,
        graphs={g.name: _graph_entry(g) for g in results},
        tables=tables,
        frontend=Frontend(campplus=f"{FRONTEND_DIR}/{CAMPPLUS}",
                          speech_tokenizer=f"{FRONTEND_DIR}/{SPEECH_TOKENIZER}"),
        tokenizer=Tokenizer(TOKENIZER_DIR, TOKENIZER_COPY),
        config=YAML,
        prompt=prompt,
        files=dict(sorted(files.items())),
        timings={"total_s": round(time.perf_counter() - start, 3)},
    )
    _write_json(out, MANIFEST, manifest.to_json())
    return Report(out, tuple(results), out / MANIFEST, time.perf_counter() - start, files)
