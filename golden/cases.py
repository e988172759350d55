"""The golden cases: `cases.toml` read into frozen dataclasses, every field checked.

Plain data, torch-free. A case pins everything a synthesis depends on (bundle, text, prompt, mode,
offline or streaming, chunk policy, sampling, speed, provider, precision) and the audio bounds per
backend; `GoldenCase.to_json` is what a golden file records of it.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cosyvoice_graphs import PRECISION_NAMES, SPECS
from cosyvoice_graphs.precision import FP32
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.runners import PROVIDERS
from cosyvoice_runtime.sampling import MAX_SEED, SAMPLINGS
from cosyvoice_runtime.synthesis import Mode

from .errors import GoldenError

CASES_FILE = Path(__file__).with_name("cases.toml")
"""The cases shipped with the package, recorded against the demo bundle."""
DATA_DIR = "data"
"""Beside a cases file: its golden data (`<case>.json`, `<case>.npz`, `graphs/<graph>.*`)."""
FORMAT_VERSION = 1
TOP_LEVEL_KEYS = frozenset({"format_version", "reference", "tolerance", "precision_tolerance", "graphs",
                            "defaults", "case"})
"""What a cases file holds at its top level."""
DEMO = "demo"
"""`bundle = "demo"`: the runtime's embedded demo bundle (`cosyvoice_runtime.demo.DEMO_BUNDLE`)."""
FROM_BUNDLE = "bundle"
"""`prompt_wav` / `prompt_text` = "bundle": the bundle's own prompt and transcript."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A case's name, which names its golden files in the data folder."""


@dataclass(frozen=True)
class Bounds:
    """How far a run may be from the torch reference; every bound given must hold (None: not judged)."""

    max_abs: float | None = None
    """Largest |a - b| over all samples."""
    l1: float | None = None
    """Mean |a - b| over all samples."""
    snr_db: float | None = None
    """Least 10 log10(sum b^2 / sum (a - b)^2) over all samples."""
    mel_snr_db: float | None = None
    """The same SNR over the generated log-mel values that the vocoder read: the judge of a reduced
    precision, which the waveform magnifies (see cases.toml)."""


def loosest(bounds: Sequence[Bounds]) -> Bounds:
    """The bounds of a bundle mixing reduced precisions: each bound the loosest any of them gives (a bound
    one of them leaves out is not judged), since the audio's error is at most about the worst graph's."""

    def widest(values: list[float | None], pick: Callable[[Iterable[float]], float]) -> float | None:
        return None if None in values else pick(v for v in values if v is not None)

    return Bounds(max_abs=widest([b.max_abs for b in bounds], max), l1=widest([b.l1 for b in bounds], max),
                  snr_db=widest([b.snr_db for b in bounds], min),
                  mel_snr_db=widest([b.mel_snr_db for b in bounds], min))


@dataclass(frozen=True)
class Reference:
    """The backend whose output is pinned bit for bit (PCM16 hashes, graph statistics), on the export a
    golden was recorded from."""

    provider: str
    threads: int
    """onnxruntime's intra-op threads (a different count may round differently)."""


@dataclass(frozen=True)
class GoldenCase:
    """One fully pinned synthesis."""

    name: str
    bundle: str
    """`DEMO`, or a runtime bundle's folder (relative to the cases file)."""
    text: str
    prompt_wav: str
    """`FROM_BUNDLE`, or a recording's path (relative to the cases file)."""
    prompt_text: str
    """The prompt's transcript (zero-shot only), or `FROM_BUNDLE`."""
    instruct: str
    mode: Mode
    stream: bool
    chunk_policy: ChunkPolicy | None
    """Streaming cases only."""
    sampling: str
    seed: int
    speed: float
    max_tokens: int | None
    """LLM steps per segment instead of upstream's max_len (for the tiny random LLM, which rarely stops)."""
    pieces: tuple[str, ...] | None
    """The text in the pieces it is streamed in (upstream's bistream: one segment, `text` their
    concatenation), or None: `text` given whole."""
    provider: str
    precision: str
    tolerance: Mapping[str, Bounds]
    """Per provider."""

    def to_json(self) -> dict[str, Any]:
        """The case as a golden file records it (what `update` compares to see what changed)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mode"] = self.mode.value
        # an option left off (None) is not recorded, so adding one that is off by default leaves goldens valid
        out["chunk_policy"] = ({k: v for k, v in asdict(self.chunk_policy).items() if v is not None}
                               if self.chunk_policy else None)
        out["tolerance"] = {p: asdict(b) for p, b in self.tolerance.items()}
        out["pieces"] = list(self.pieces) if self.pieces is not None else None
        return out


@dataclass(frozen=True)
class Cases:
    """A cases file: its reference backend, graph selections and cases, by name in file order."""

    path: Path
    reference: Reference
    graphs: Mapping[str, tuple[int, ...]]
    """Graph name -> indices of its spec's validation cases stored as its golden bundle."""
    graph_bundle: str
    """The bundle graph goldens are recorded on and checked against: the defaults' `bundle`."""
    cases: Mapping[str, GoldenCase]
    precision_tolerance: Mapping[str, Bounds]
    """Reduced precision -> the audio bounds of a case judged on a bundle of that precision instead of
    the case's own (`check --precision`), on any backend."""

    @property
    def data_dir(self) -> Path:
        """Where the golden data of these cases lives."""
        return self.path.parent / DATA_DIR

    def select(self, names: tuple[str, ...]) -> list[GoldenCase]:
        """The named cases, each once (all of them for no names); an unknown name is a `GoldenError`."""
        for name in names:
            if name not in self.cases:
                raise GoldenError(f"unknown case {name!r}; {self.path.name} has {', '.join(self.cases)}")
        return [self.cases[n] for n in dict.fromkeys(names)] if names else list(self.cases.values())

    def select_graphs(self, names: tuple[str, ...]) -> list[str]:
        """The named graphs, each once (all of them for no names); a graph without golden cases is a
        `GoldenError`."""
        for name in names:
            if name not in self.graphs:
                raise GoldenError(f"unknown graph {name!r}; {self.path.name} has golden bundles for "
                                  f"{', '.join(self.graphs)}")
        return list(dict.fromkeys(names)) if names else list(self.graphs)

    def resolve(self, value: str) -> Path:
        """A path from the cases file, relative to its folder."""
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.path.parent / path


_CASE_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "bundle": str, "text": str, "prompt_wav": str, "prompt_text": str, "instruct": str,
    "mode": str, "stream": bool, "chunk_policy": dict, "sampling": str, "seed": int,
    "speed": (int, float), "max_tokens": int, "provider": str, "precision": str, "tolerance": dict,
    "pieces": list,
}
_OPTIONAL = {"max_tokens", "pieces"}


def load_cases(path: Path = CASES_FILE) -> Cases:
    """Read and check a cases file; any problem is a one-line `GoldenError` naming the case and field."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoldenError(f"{path}: no such cases file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise GoldenError(f"{path}: unreadable ({e})") from None
    where = str(path)
    unknown = sorted(set(data) - TOP_LEVEL_KEYS)
    if unknown:
        raise GoldenError(f"{where}: unknown key {unknown[0]!r}; a cases file holds "
                          f"{', '.join(sorted(TOP_LEVEL_KEYS))}")
    if data.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{where}: format_version is {data.get('format_version')!r}, expected "
                          f"{FORMAT_VERSION}")
    ref = _table(data, "reference", where)
    reference = Reference(_get(ref, "provider", str, f"{where}: reference"),
                          _get(ref, "threads", int, f"{where}: reference"))
    if reference.threads < 1:
        raise GoldenError(f"{where}: reference.threads is {reference.threads}, expected at least 1")
    _choice(reference.provider, PROVIDERS, f"{where}: reference.provider")
    default_bounds = {p: _bounds(b, f"{where}: tolerance.{p}")
                      for p, b in _table(data, "tolerance", where).items()}
    for provider in default_bounds:
        _choice(provider, PROVIDERS, f"{where}: tolerance")
    precision_bounds = {p: _bounds(b, f"{where}: precision_tolerance.{p}")
                        for p, b in _table(data, "precision_tolerance", where).items()}
    not_fp32 = tuple(n for n in PRECISION_NAMES if n != FP32.name)
    for precision in precision_bounds:
        _choice(precision, not_fp32, f"{where}: precision_tolerance")
    graphs = {}
    for graph, indices in _table(data, "graphs", where).items():
        _choice(graph, tuple(SPECS), f"{where}: graphs")
        if not isinstance(indices, list) or not indices or not all(isinstance(i, int) for i in indices):
            raise GoldenError(f"{where}: graphs.{graph} is {indices!r}, expected a list of case indices")
        graphs[graph] = tuple(indices)
    defaults = _table(data, "defaults", where)
    cases: dict[str, GoldenCase] = {}
    for i, raw in enumerate(data.get("case", [])):
        case = _case({**defaults, **raw}, default_bounds, f"{where}: case {i + 1}")
        if case.name in cases:
            raise GoldenError(f"{where}: case {case.name!r} is defined twice")
        cases[case.name] = case
    if not cases:
        raise GoldenError(f"{where}: no [[case]]")
    return Cases(path, reference, graphs, _get(defaults, "bundle", str, f"{where}: defaults"), cases,
                 precision_bounds)


def _case(raw: dict[str, Any], default_bounds: Mapping[str, Bounds], where: str) -> GoldenCase:
    unknown = sorted(set(raw) - set(_CASE_TYPES))
    if unknown:
        raise GoldenError(f"{where}: unknown field {unknown[0]!r}; fields are {', '.join(_CASE_TYPES)}")
    where = f"{where} ({raw['name']!r})" if isinstance(raw.get("name"), str) else where
    pieces = _pieces(raw, where)
    if pieces is not None:
        raw = {**raw, "text": raw.get("text", "".join(pieces))}
        if raw["text"] != "".join(pieces):
            raise GoldenError(f"{where}: text must be its pieces joined (or left out)")
    v = {k: _get(raw, k, t, where) for k, t in _CASE_TYPES.items() if k not in _OPTIONAL or k in raw}
    _choice(v["mode"], tuple(m.value for m in Mode), f"{where}: mode")
    _choice(v["sampling"], SAMPLINGS, f"{where}: sampling")
    _choice(v["provider"], PROVIDERS, f"{where}: provider")
    _choice(v["precision"], PRECISION_NAMES, f"{where}: precision")
    if not NAME.fullmatch(v["name"]):
        raise GoldenError(f"{where}: name {v['name']!r} must be letters, digits, '.', '_' and '-', starting "
                          "with a letter or digit (it names the golden's files)")
    if not v["text"].strip():
        raise GoldenError(f"{where}: text must not be empty")
    if not (math.isfinite(v["speed"]) and v["speed"] > 0):  # as the runtime's methods take it
        raise GoldenError(f"{where}: speed is {v['speed']!r}, expected a finite number above 0")
    if not 0 <= v["seed"] <= MAX_SEED:
        raise GoldenError(f"{where}: seed is {v['seed']!r}, expected 0 to {MAX_SEED}")
    if v.get("max_tokens", 1) < 1:
        raise GoldenError(f"{where}: max_tokens is {v['max_tokens']!r}, expected at least 1")
    if v["stream"] and v["speed"] != 1.0:
        raise GoldenError(f"{where}: speed works offline only (upstream ignores it when streaming)")
    if pieces is not None and v["mode"] == Mode.CROSS_LINGUAL.value:
        raise GoldenError(f"{where}: pieces stream text after a prompt text, which cross-lingual has none of")
    if not v["stream"] and v["chunk_policy"]:
        raise GoldenError(f"{where}: chunk_policy is for streaming cases")
    policy = None
    if v["stream"]:
        try:
            policy = ChunkPolicy(**v["chunk_policy"])
        except (TypeError, ValueError) as e:
            raise GoldenError(f"{where}: chunk_policy {v['chunk_policy']!r}: {e}") from None
    tolerance = dict(default_bounds)
    for provider, override in v["tolerance"].items():
        _choice(provider, PROVIDERS, f"{where}: tolerance")
        base = asdict(tolerance[provider]) if provider in tolerance else {}
        if not isinstance(override, dict):
            raise GoldenError(f"{where}: tolerance.{provider} is {override!r}, expected a table of bounds")
        merged = {k: value for k, value in {**base, **override}.items() if value is not None}  # the unset
        tolerance[provider] = _bounds(merged, f"{where}: tolerance.{provider}")
    return GoldenCase(
        name=v["name"], bundle=v["bundle"], text=v["text"], prompt_wav=v["prompt_wav"],
        prompt_text=v["prompt_text"], instruct=v["instruct"], mode=Mode(v["mode"]), stream=v["stream"],
        chunk_policy=policy, sampling=v["sampling"], seed=v["seed"], speed=float(v["speed"]),
        max_tokens=v.get("max_tokens"), pieces=pieces, provider=v["provider"], precision=v["precision"],
        tolerance=tolerance)


def _pieces(raw: Mapping[str, Any], where: str) -> tuple[str, ...] | None:
    value = raw.get("pieces")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
        raise GoldenError(f"{where}: pieces is {value!r}, expected a list of strings")
    return tuple(value)


def _bounds(raw: Any, where: str) -> Bounds:
    names = [f.name for f in fields(Bounds)]
    if not isinstance(raw, dict) or not raw or not set(raw) <= set(names):
        raise GoldenError(f"{where} is {raw!r}, expected some of {{{', '.join(names)}}}")
    bounds = {k: float(_get(raw, k, (int, float), where)) for k in raw}
    for name, value in bounds.items():  # errors are at least 0; an SNR may be any finite figure
        if not math.isfinite(value) or (name in ("max_abs", "l1") and value <= 0):
            raise GoldenError(f"{where}: {name} is {value!r}, expected a finite number"
                              f"{' above 0' if name in ('max_abs', 'l1') else ''}")
    return Bounds(**bounds)


def _table(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise GoldenError(f"{where}: [{key}] is missing or not a table")
    return value


def _get(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in raw:
        raise GoldenError(f"{where}: {key} is missing")
    value = raw[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise GoldenError(f"{where}: {key} is {value!r}, of the wrong type")
    return value


def _choice(value: str, known: tuple[str, ...], where: str) -> None:
    if value not in known:
        raise GoldenError(f"{where}: {value!r} is not one of {', '.join(known)}")
