"""A runtime bundle's manifest.json as one typed record: `cosyvoice-export all` builds a `Manifest` and
writes `to_json()`; the runtime reads it with `Manifest.from_json`.

Reading checks the format and its version first (the keys are that version's), then every key's type,
that every path stays inside the bundle and that every file the manifest uses is listed in its `files`;
a problem is one `ManifestError` line naming the manifest and the key, what was expected and what was
found. Whether the bundle matches the reader (spec versions, files on disk) is the reader's to check.

`GraphRecord`, what an export keeps beside the bundle about each graph it made so that a later export into
the same folder can reuse it, is written and read with the same records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import PurePosixPath
from typing import Any

from .bundle_layout import FORMAT, FORMAT_VERSION
from .hift_layout import HiftLayout
from .registry import ModelDims

FRONTEND_MODELS = ("campplus", "speech_tokenizer")
"""The front-end ONNX models a bundle carries, by the name `Frontend` and the runtime give them."""


class ManifestError(ValueError):
    """A manifest that is not shaped as `Manifest`: one line naming the manifest and the key."""


@dataclass(frozen=True)
class FileEntry:
    """A file's size and sha256."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def read(cls, r: _Object) -> FileEntry:
        return cls(r.integer("size"), r.text("sha256"))


@dataclass(frozen=True)
class OutputCheck:
    """A graph output's worst figure over the validation cases."""

    metric: str
    measured: float
    bound: float
    passed: bool
    worst_case: str

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "measured": self.measured, "bound": self.bound, "passed": self.passed,
                "worst_case": self.worst_case}

    @classmethod
    def read(cls, r: _Object) -> OutputCheck:
        return cls(r.text("metric"), r.number("measured"), r.number("bound"), r.flag("passed"),
                   r.text("worst_case"))


@dataclass(frozen=True)
class GateCheck:
    """A reduced precision's decode or solve gate, by its metric."""

    output: str
    measured: float
    bound: float
    passed: bool
    case: str

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "measured": self.measured, "bound": self.bound, "passed": self.passed,
                "case": self.case}

    @classmethod
    def read(cls, r: _Object) -> GateCheck:
        return cls(r.text("output"), r.number("measured"), r.number("bound"), r.flag("passed"),
                   r.text("case"))


@dataclass(frozen=True)
class Validation:
    """How a graph (or its TensorRT plan) validated at export."""

    provider: str
    against: str
    """What its outputs were compared with: "torch", or "onnxruntime" for a TensorRT plan."""
    passed: bool
    outputs: Mapping[str, OutputCheck]
    cases: tuple[str, ...]
    gates: Mapping[str, GateCheck] = field(default_factory=dict)
    """Metric -> its gate, for a precision the spec gates (written only when there are some)."""

    def to_json(self) -> dict[str, Any]:
        out = {"provider": self.provider, "against": self.against, "passed": self.passed,
               "outputs": {o: c.to_json() for o, c in self.outputs.items()}, "cases": list(self.cases)}
        if self.gates:
            out["gates"] = {m: g.to_json() for m, g in self.gates.items()}
        return out

    @classmethod
    def read(cls, r: _Object) -> Validation:
        gates = r.objects("gates") if "gates" in r else {}
        return cls(r.text("provider"), r.text("against"), r.flag("passed"),
                   {o: OutputCheck.read(c) for o, c in r.objects("outputs").items()}, r.texts("cases"),
                   {m: GateCheck.read(g) for m, g in gates.items()})


@dataclass(frozen=True)
class TrtPlanEntry:
    """A graph's TensorRT plan (`--trt`): it runs only with this TensorRT version on this GPU."""

    file: str
    size: int
    sha256: str
    cache_key: str
    cached: bool
    """Taken from the plan cache rather than built by this export."""
    gpu: str
    tensorrt: str
    build_s: float
    validate_s: float
    validation: Validation

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size, "sha256": self.sha256, "cache_key": self.cache_key,
                "cached": self.cached, "gpu": self.gpu, "tensorrt": self.tensorrt, "build_s": self.build_s,
                "validate_s": self.validate_s, "validation": self.validation.to_json()}

    @classmethod
    def read(cls, r: _Object) -> TrtPlanEntry:
        return cls(r.path("file"), r.integer("size"), r.text("sha256"), r.text("cache_key"), r.flag("cached"),
                   r.text("gpu"), r.text("tensorrt"), r.number("build_s"), r.number("validate_s"),
                   Validation.read(r.obj("validation")))


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the bundle: its file, spec, precision, sources and validation."""

    file: str
    """The ONNX file (its external data, if any, lies beside it)."""
    precision: str
    """A key of `PRECISIONS` (read with `Precision.named`, which refuses an unknown one)."""
    spec_name: str
    spec_version: int
    opset: int
    sources: Mapping[str, str]
    """Model-bundle file -> sha256 of what the graph was made from."""
    simplified: bool
    simplify_error: str | None
    reused: bool
    """Taken from an earlier export into the same folder."""
    timings: Mapping[str, float]
    validation: Validation
    trt: TrtPlanEntry | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "precision": self.precision, "spec_name": self.spec_name,
               "spec_version": self.spec_version, "opset": self.opset, "sources": dict(self.sources),
               "simplified": self.simplified, "simplify_error": self.simplify_error, "reused": self.reused,
               "timings": dict(self.timings), "validation": self.validation.to_json()}
        if self.trt is not None:
            out["trt"] = self.trt.to_json()
        return out

    @classmethod
    def read(cls, r: _Object) -> GraphEntry:
        trt = TrtPlanEntry.read(r.obj("trt")) if "trt" in r else None
        return cls(r.path("file"), r.text("precision"), r.text("spec_name"), r.integer("spec_version"),
                   r.integer("opset"), r.text_map("sources"), r.flag("simplified"),
                   r.optional_text("simplify_error"), r.flag("reused"), r.number_map("timings"),
                   Validation.read(r.obj("validation")), trt)


@dataclass(frozen=True)
class TableEntry:
    """A table of `bundle_layout` (.npy): its values, or the generator state they are drawn from."""

    file: str
    shape: tuple[int, ...]
    """The table's shape (of the values a generator draws, for a generated table)."""
    dtype: str
    note: str
    generator: str | None = None
    """The generator whose state `file` holds (`cosyvoice_runtime.noise`); None for stored values."""
    values_sha256: str | None = None
    """sha256 of the drawn values (little-endian), for a generated table."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "shape": list(self.shape), "dtype": self.dtype}
        if self.generator is not None:
            out["generator"] = self.generator
        if self.values_sha256 is not None:
            out["values_sha256"] = self.values_sha256
        return out | {"note": self.note}

    @classmethod
    def read(cls, r: _Object) -> TableEntry:
        return cls(r.path("file"), r.integers("shape"), r.text("dtype"), r.text("note"),
                   r.text("generator") if "generator" in r else None,
                   r.text("values_sha256") if "values_sha256" in r else None)


@dataclass(frozen=True)
class ModelConstants:
    """The model's constants: the dims every graph's shapes follow and the ids the runtime feeds."""

    dims: ModelDims
    sos: int
    """Speech-table row that starts the LLM's speech sequence."""
    eos: int
    """Speech id that ends generation."""
    task_id: int
    """Speech-table row between the text and the prompt speech tokens."""
    endofprompt_id: int
    """Text token id of `<|endofprompt|>` in the bundle's tokenizer."""
    hift: HiftLayout
    """What the streaming vocoder's margins are derived from."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.dims), "sos": self.sos, "eos": self.eos, "task_id": self.task_id,
                "endofprompt_id": self.endofprompt_id, "hift": _hift_json(self.hift)}

    @classmethod
    def read(cls, r: _Object) -> ModelConstants:
        dims = ModelDims(**{f.name: r.integer(f.name) for f in fields(ModelDims)})
        hift = _read_hift(r.obj("hift"))
        if hift.samples_per_frame != dims.samples_per_frame:
            raise ManifestError(f"{r.where}: model.hift gives {hift.samples_per_frame} samples per frame, "
                                f"model.samples_per_frame is {dims.samples_per_frame}")
        return cls(dims, r.integer("sos"), r.integer("eos"), r.integer("task_id"),
                   r.integer("endofprompt_id"), hift)


def _hift_json(h: HiftLayout) -> dict[str, Any]:
    return {"upsample_rates": list(h.upsample_rates), "upsample_kernel_sizes": list(h.upsample_kernel_sizes),
            "resblock_kernel_sizes": list(h.resblock_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in h.resblock_dilation_sizes],
            "source_resblock_kernel_sizes": list(h.source_resblock_kernel_sizes),
            "source_resblock_dilation_sizes": [list(d) for d in h.source_resblock_dilation_sizes],
            "istft_n_fft": h.istft_n_fft, "istft_hop_len": h.istft_hop_len,
            "conv_pre_look_right": h.conv_pre_look_right, "conv_post_kernel_size": h.conv_post_kernel_size,
            "f0_look_right": h.f0_look_right, "f0_causal_kernel_sizes": list(h.f0_causal_kernel_sizes)}


def _read_hift(r: _Object) -> HiftLayout:
    layout = HiftLayout(
        upsample_rates=r.integers("upsample_rates"),
        upsample_kernel_sizes=r.integers("upsample_kernel_sizes"),
        resblock_kernel_sizes=r.integers("resblock_kernel_sizes"),
        resblock_dilation_sizes=r.integer_lists("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=r.integers("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=r.integer_lists("source_resblock_dilation_sizes"),
        istft_n_fft=r.integer("istft_n_fft"), istft_hop_len=r.integer("istft_hop_len"),
        conv_pre_look_right=r.integer("conv_pre_look_right"),
        conv_post_kernel_size=r.integer("conv_post_kernel_size"), f0_look_right=r.integer("f0_look_right"),
        f0_causal_kernel_sizes=r.integers("f0_causal_kernel_sizes"))
    stages = {len(layout.upsample_rates), len(layout.upsample_kernel_sizes),
              len(layout.source_resblock_kernel_sizes), len(layout.source_resblock_dilation_sizes)}
    if len(stages) != 1 or len(layout.resblock_kernel_sizes) != len(layout.resblock_dilation_sizes):
        raise ManifestError(f"{r.where}: {r.key} has lists of different lengths where they pair up (one "
                            "entry per upsampling stage, one dilation list per resblock kernel)")
    return layout


@dataclass(frozen=True)
class Frontend:
    """The front-end ONNX models (`FRONTEND_MODELS`)."""

    campplus: str
    speech_tokenizer: str

    def paths(self) -> dict[str, str]:
        """Front-end model name -> its file."""
        return {"campplus": self.campplus, "speech_tokenizer": self.speech_tokenizer}

    def to_json(self) -> dict[str, Any]:
        return self.paths()

    @classmethod
    def read(cls, r: _Object) -> Frontend:
        return cls(*(r.path(name) for name in FRONTEND_MODELS))


@dataclass(frozen=True)
class Tokenizer:
    """The Qwen2 tokenizer's folder and the files in it."""

    dir: str
    files: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.dir, "files": list(self.files)}

    @classmethod
    def read(cls, r: _Object) -> Tokenizer:
        return cls(r.path("dir"), r.texts("files"))


@dataclass(frozen=True)
class Prompt:
    """The default prompt a bundle carries: a recording and its transcript."""

    wav: str
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"wav": self.wav, "text": self.text}

    @classmethod
    def read(cls, r: _Object) -> Prompt:
        return cls(r.path("wav"), r.path("text"))


@dataclass(frozen=True)
class Manifest:
    """Everything a runtime bundle says about itself: provenance, model constants, graphs, tables, front
    end, tokenizer, prompt, and every file with its size and sha256 (it is written with `bundle_layout`'s
    format and version, the only ones it reads)."""

    exporter_version: str
    precision: str
    """What `--precision` named (`PrecisionPlan.name`: a precision, a profile, or `graph=precision,...`);
    each graph records its own, which is what the runtime reads."""
    llm_checkpoint: str
    """The model-bundle file the LLM's weights came from (upstream's `llm.pt`, or the release's
    reinforcement-learned `llm.rl.pt`), one of `sources`."""
    created: str
    """UTC time of the export, ISO 8601."""
    model: ModelConstants
    sources: Mapping[str, FileEntry]
    """Model-bundle file -> its entry: every file the bundle was made from."""
    graphs: Mapping[str, GraphEntry]
    """Graph name -> its entry, in pipeline order."""
    tables: Mapping[str, TableEntry]
    frontend: Frontend
    tokenizer: Tokenizer
    config: str
    """The copy of the model's yaml, for provenance."""
    prompt: Prompt | None
    files: Mapping[str, FileEntry]
    """Every file of the bundle but the manifest, by its path in the bundle."""
    timings: Mapping[str, float]

    def used_files(self) -> list[str]:
        """The files the other sections name (each must be listed in `files`)."""
        used = [g.file for g in self.graphs.values()]
        used += [g.trt.file for g in self.graphs.values() if g.trt is not None]
        used += [t.file for t in self.tables.values()]
        used += [*self.frontend.paths().values(), self.config]
        used += [f"{self.tokenizer.dir}/{name}" for name in self.tokenizer.files]
        used += [self.prompt.wav, self.prompt.text] if self.prompt is not None else []
        return used

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "exporter_version": self.exporter_version,
            "precision": self.precision,
            "llm_checkpoint": self.llm_checkpoint,
            "created": self.created,
            "model": self.model.to_json(),
            "sources": {n: e.to_json() for n, e in self.sources.items()},
            "graphs": {n: g.to_json() for n, g in self.graphs.items()},
            "tables": {n: t.to_json() for n, t in self.tables.items()},
            "frontend": self.frontend.to_json(),
            "tokenizer": self.tokenizer.to_json(),
            "config": self.config,
            "prompt": None if self.prompt is None else self.prompt.to_json(),
            "files": {rel: e.to_json() for rel, e in self.files.items()},
            "timings": dict(self.timings),
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> Manifest:
        """The manifest in `data` (parsed JSON); `where` (its path) starts every error."""
        r = _Object(data, where, "")
        for key, want in (("format", FORMAT), ("format_version", FORMAT_VERSION)):
            if r.value.get(key) != want:
                raise ManifestError(f"{where}: {key} is {r.value.get(key)!r}, expected {want!r} "
                                    "(re-export the model with `cosyvoice-export all`)")
        prompt = r.optional_obj("prompt")
        files = r.objects("files")
        for rel in files:
            _check_path(rel, where, f"files key {rel!r}")
        manifest = cls(
            exporter_version=r.text("exporter_version"),
            precision=r.text("precision"),
            llm_checkpoint=r.text("llm_checkpoint"),
            created=r.text("created"),
            model=ModelConstants.read(r.obj("model")),
            sources={n: FileEntry.read(e) for n, e in r.objects("sources").items()},
            graphs={n: GraphEntry.read(g) for n, g in r.objects("graphs").items()},
            tables={n: TableEntry.read(t) for n, t in r.objects("tables").items()},
            frontend=Frontend.read(r.obj("frontend")),
            tokenizer=Tokenizer.read(r.obj("tokenizer")),
            config=r.path("config"),
            prompt=None if prompt is None else Prompt.read(prompt),
            files={rel: FileEntry.read(e) for rel, e in files.items()},
            timings=r.number_map("timings"),
        )
        for rel in manifest.used_files():
            if rel not in manifest.files:
                raise ManifestError(f"{where}: {rel} is used but not listed in files")
        if manifest.llm_checkpoint not in manifest.sources:
            raise ManifestError(f"{where}: llm_checkpoint is {manifest.llm_checkpoint!r}, which sources does "
                                "not list")
        return manifest

    @property
    def llm_source(self) -> FileEntry:
        """The size and sha256 of the LLM's checkpoint (`llm_checkpoint`)."""
        return self.sources[self.llm_checkpoint]


# --- an export's record of one graph --------------------------------------------------------------------

@dataclass(frozen=True)
class GraphInputs:
    """What an exported graph is a function of: while none of it changes, the graph need not be exported
    again."""

    spec_name: str
    spec_version: int
    exporter_version: str
    sources: Mapping[str, str]
    """Model-bundle file -> sha256 of what the graph was made from."""
    precision: str
    """The graph's precision, with the revision of its conversion where it has one and the form of a graph
    written for onnxruntime alone (`fp16 rev 1, for onnxruntime`)."""

    def to_json(self) -> dict[str, Any]:
        return {"spec_name": self.spec_name, "spec_version": self.spec_version,
                "exporter_version": self.exporter_version, "sources": dict(sorted(self.sources.items())),
                "precision": self.precision}

    @classmethod
    def read(cls, r: _Object) -> GraphInputs:
        return cls(r.text("spec_name"), r.integer("spec_version"), r.text("exporter_version"),
                   r.text_map("sources"), r.text("precision"))


@dataclass(frozen=True)
class GraphRecord:
    """One graph as the export that made it records it beside the bundle (no manifest lists the record):
    what it was made from, its files and how it validated, which lets a later export into the same folder
    reuse it."""

    inputs: GraphInputs
    files: Mapping[str, FileEntry]
    """Path in the bundle -> entry of its ONNX files; the graph first, then its external data."""
    simplified: bool
    simplify_error: str | None
    timings: Mapping[str, float]
    validation: Validation

    def to_json(self) -> dict[str, Any]:
        return {"inputs": self.inputs.to_json(), "files": {rel: e.to_json() for rel, e in self.files.items()},
                "simplified": self.simplified, "simplify_error": self.simplify_error,
                "timings": dict(self.timings), "validation": self.validation.to_json()}

    @classmethod
    def from_json(cls, data: object, where: str) -> GraphRecord:
        """The record in `data` (parsed JSON); `where` (its path) starts every error."""
        r = _Object(data, where, "")
        files = r.objects("files")
        for rel in files:
            _check_path(rel, where, f"files key {rel!r}")
        return cls(GraphInputs.read(r.obj("inputs")), {rel: FileEntry.read(e) for rel, e in files.items()},
                   r.flag("simplified"), r.optional_text("simplify_error"), r.number_map("timings"),
                   Validation.read(r.obj("validation")))


# --- reading -------------------------------------------------------------------------------------------

_MISSING = object()


def _found(value: object) -> str:
    if value is _MISSING:
        return "missing"
    if isinstance(value, Mapping):
        return "an object"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}…"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_path(value: object, where: str, key: str) -> str:
    """`value` if it is a relative path that stays inside the bundle."""
    rel = PurePosixPath(value) if isinstance(value, str) else None
    if rel is None or rel.is_absolute() or ".." in rel.parts or not rel.parts or str(rel) != value:
        raise ManifestError(f"{where}: {key} is {_found(value)}, expected a path inside the bundle")
    return value


class _Object:
    """One JSON object of a manifest being read, at `key` (dotted, as errors name it; "" at the top)."""

    def __init__(self, value: object, where: str, key: str) -> None:
        if not isinstance(value, Mapping):
            raise ManifestError(f"{where}: {key} is {_found(value)}, expected an object")
        self.value: Mapping[str, Any] = value
        self.where, self.key = where, key

    def __contains__(self, name: str) -> bool:
        return name in self.value

    def _at(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def _get(self, name: str, expected: str, ok: Callable[[object], bool]) -> Any:
        value = self.value.get(name, _MISSING)
        if not ok(value):
            raise ManifestError(f"{self.where}: {self._at(name)} is {_found(value)}, expected {expected}")
        return value

    def integer(self, name: str) -> int:
        return int(self._get(name, "an integer", _is_int))

    def number(self, name: str) -> float:
        value: float = self._get(name, "a number", _is_number)
        return value  # an integer stays one, so that it is written back as it was read

    def text(self, name: str) -> str:
        return str(self._get(name, "a string", lambda v: isinstance(v, str)))

    def optional_text(self, name: str) -> str | None:
        value = self._get(name, "a string or null", lambda v: v is None or isinstance(v, str))
        return None if value is None else str(value)

    def flag(self, name: str) -> bool:
        return bool(self._get(name, "true or false", lambda v: isinstance(v, bool)))

    def path(self, name: str) -> str:
        return _check_path(self.value.get(name, _MISSING), self.where, self._at(name))

    def texts(self, name: str) -> tuple[str, ...]:
        values = self._get(name, "a list of strings",
                           lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
        return tuple(values)

    def integers(self, name: str) -> tuple[int, ...]:
        values = self._get(name, "a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v)))
        return tuple(values)

    def text_map(self, name: str) -> dict[str, str]:
        section = self.obj(name)
        return {k: section.text(k) for k in section.value}

    def number_map(self, name: str) -> dict[str, float]:
        section = self.obj(name)
        return {k: section.number(k) for k in section.value}

    def integer_lists(self, name: str) -> tuple[tuple[int, ...], ...]:
        values = self._get(name, "a list of lists of integers",
                           lambda v: isinstance(v, list) and all(isinstance(x, list) and all(map(_is_int, x))
                                                                 for x in v))
        return tuple(tuple(x) for x in values)

    def obj(self, name: str) -> _Object:
        return _Object(self.value.get(name, _MISSING), self.where, self._at(name))

    def optional_obj(self, name: str) -> _Object | None:
        """The object at `name`, or None where the manifest has null."""
        value = self.value.get(name, _MISSING)
        return None if value is None else _Object(value, self.where, self._at(name))

    def objects(self, name: str) -> dict[str, _Object]:
        """An object whose every value is an object, by key."""
        section = self.obj(name)
        return {k: section.obj(k) for k in section.value}
