"""Golden files: what `update` records and `check` reads. Torch-free; every file is written atomically.

    data/<case>.json    the case as recorded, the runtime bundle's fingerprint, the prompt, per segment
                        the speech tokens and chunks (token and sample ranges; the sha256 of the float32
                        samples, as `cosyvoice-run --chunks-out` writes it; the PCM16 sha256), the graphs'
                        output statistics, and the reference backend's audio metrics against torch
    data/<case>.npz     `audio`: the torch reference's float32 samples, and `mel`: its generated mel
                        (1, 80, frames) that the vocoder read, the segments concatenated
    data/graphs/<graph>.json, .npz
                        a graph's golden bundle: its spec version, the bundle's fingerprint, and per stored
                        validation case the spec's sample inputs and the torch wrapper's outputs

A JSON file names its npz file's sha256, so a pair that does not belong together is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_graphs.bundle_layout import TRT_DIR
from cosyvoice_runtime.atomic_files import atomic_path, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle, file_sha256

from .errors import GoldenError

FORMAT = "cosyvoice-golden"
FORMAT_VERSION = 2
GRAPHS_DIR = "graphs"
UPDATE = "cosyvoice-golden update"
"""The command that records goldens, as remedies name it (with the cases file and model of a check)."""
AUDIO = "audio"
"""The torch reference's samples in a case's npz file."""
MEL = "mel"
"""The torch reference's generated mel in a case's npz file."""
EXPECTATION_FIELDS = ("text", "prompt_text", "instruct", "mode", "stream", "chunk_policy", "sampling", "seed",
                      "speed", "max_tokens", "precision", "pieces")
"""The case fields that change what is synthesised: a golden recorded with other values is stale."""


# --- the bundle a golden belongs to -------------------------------------------------------------------------

def fingerprint(bundle: RuntimeBundle) -> dict[str, Any]:
    """What a golden records of the runtime bundle it was made with, from its manifest: the model
    constants, the source model's file hashes, the precision, and every file's hash (TensorRT plans left
    out: they belong to one GPU, not to the export)."""
    manifest = bundle.manifest
    return {
        "model": manifest.model.to_json(),
        "sources": {name: entry.sha256 for name, entry in manifest.sources.items()},
        "precision": manifest.precision,
        "files": {rel: entry.sha256 for rel, entry in manifest.files.items()
                  if not rel.startswith(f"{TRT_DIR}/")},
    }


def check_same_model(recorded: Mapping[str, Any], bundle: RuntimeBundle, where: str, update: str = UPDATE
                     ) -> None:
    """Raise `GoldenError` unless `bundle` was exported from the model the golden at `where` was recorded
    from (every model constant and source file the golden records, the same): expectations from torch
    hold for any export of it. Constants or sources a later exporter records besides do not count."""
    now = fingerprint(bundle)
    for key in ("model", "sources"):
        name = _recorded_difference(recorded.get(key, {}), now[key])
        if name is not None:
            raise GoldenError(
                f"{where} was recorded from another model than {bundle.root}: {key} {name} is "
                f"{_short(recorded.get(key, {}).get(name))} there and {_short(now[key].get(name))} here "
                f"(record goldens for this model with `{update}`)")


def check_model_files(recorded: Mapping[str, Mapping[str, Any]], model_dir: Path, update: str = UPDATE
                      ) -> None:
    """`check_same_model`'s verdict on the sources of a model bundle not yet exported (minutes): `recorded`
    maps each golden's path to what it records of its bundle, whose source files `model_dir` must hold,
    sha256 for sha256. Each file is hashed once, the smallest first, so that another model's yaml tells."""
    wanted = [(where, name, sha) for where, bundle in recorded.items()
              for name, sha in bundle.get("sources", {}).items()]
    paths = {name: model_dir / name for _, name, _ in wanted}
    sizes = {name: path.stat().st_size if path.is_file() else -1 for name, path in paths.items()}
    digests: dict[str, str | None] = {}
    for where, name, sha in sorted(wanted, key=lambda w: (sizes[w[1]], w[1])):
        if name not in digests:
            digests[name] = file_sha256(paths[name]) if sizes[name] >= 0 else None
        if digests[name] != sha:
            raise GoldenError(
                f"{where} was recorded from another model than {model_dir}: sources {name} is {_short(sha)} "
                f"there and {_short(digests[name])} here (record goldens for this model with `{update}`)")


def export_difference(recorded: Mapping[str, Any], bundle: RuntimeBundle) -> str | None:
    """Why `bundle` is not the export the golden was recorded on (None if it is): only there are the PCM16
    hashes and graph statistics expected bit for bit. Files the bundle has gained (a new graph) do not
    count: should the runtime start to use them and its output change, the hashes say so."""
    now = fingerprint(bundle)
    if recorded.get("precision") != now["precision"]:
        return f"{now['precision']} graphs, recorded on {recorded.get('precision')}"
    name = _recorded_difference(recorded.get("files", {}), now["files"])
    return None if name is None else f"{name} differs from the recorded export"


def _recorded_difference(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """The first key of `recorded` whose value `now` does not have."""
    return next((k for k in sorted(recorded) if now.get(k) != recorded[k]), None)


def _short(value: Any) -> str:
    if value is None:
        return "missing"
    text = str(value)
    return f"{text[:12]}…" if len(text) > 16 else text


# --- case goldens -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkGolden:
    """One chunk of a segment (offline: the whole segment, as one final chunk)."""

    index: int
    is_final: bool
    token_range: tuple[int, int]
    sample_range: tuple[int, int]
    """[start, end) within the segment's samples."""
    sha256: str
    """sha256 of the runtime's float32 samples on the reference backend (`cosyvoice-run --chunks-out`)."""
    pcm16_sha256: str
    """sha256 of the same samples as the PCM16 a WAV file holds: the exact check."""
    reference_max_abs: float
    """Largest |runtime - torch| in the chunk on the reference backend when recorded: a sample further
    than this from torch is where a changed output diverged."""


@dataclass(frozen=True)
class SegmentGolden:
    """One text segment: its speech tokens (the torch reference's) and chunks."""

    text: str
    speech_tokens: tuple[int, ...]
    chunks: tuple[ChunkGolden, ...]
    mel_frames: int
    """Frames of the segment's generated mel."""

    @property
    def samples(self) -> int:
        return self.chunks[-1].sample_range[1]


@dataclass(frozen=True)
class CaseGolden:
    """The expectation of one case."""

    name: str
    case: dict[str, Any]
    """`GoldenCase.to_json()` when recorded."""
    bundle: dict[str, Any]
    """`fingerprint` of the runtime bundle it was recorded with."""
    prompt: dict[str, str]
    """`wav_sha256` and `text` (the transcript used, after resolving "bundle")."""
    reference: dict[str, Any]
    """The backend the hashes and statistics come from, and the library versions."""
    segments: tuple[SegmentGolden, ...]
    graph_stats: dict[str, Any]
    """`stats.GraphStats.to_json()` on the reference backend."""
    metrics: dict[str, float]
    """The reference backend's audio metrics against torch when recorded."""
    audio: np.ndarray = field(repr=False)
    """The torch reference's float32 samples, the segments concatenated."""
    mel: np.ndarray = field(repr=False)
    """The torch reference's generated mel (1, 80, frames), the segments concatenated."""

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.segments)

    def layout(self) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, int], tuple[int, int]]]]]:
        """Per segment: its speech tokens, and per chunk its token and sample ranges."""
        return [(s.speech_tokens, [(c.token_range, c.sample_range) for c in s.chunks]) for s in self.segments]

    def to_json(self, audio_sha256: str) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": self.name, "case": self.case,
            "bundle": self.bundle, "prompt": self.prompt, "reference": self.reference,
            "samples": self.samples,
            "segments": [{"text": s.text, "speech_tokens": list(s.speech_tokens), "mel_frames": s.mel_frames,
                          "chunks": [{**vars(c), "token_range": list(c.token_range),
                                      "sample_range": list(c.sample_range)} for c in s.chunks]}
                         for s in self.segments],
            "graph_stats": self.graph_stats, "metrics": self.metrics,
            "audio": {"file": f"{self.name}.npz", "sha256": audio_sha256},
        }


def case_paths(data_dir: Path, name: str) -> tuple[Path, Path]:
    """The JSON and npz files of case `name`."""
    return data_dir / f"{name}.json", data_dir / f"{name}.npz"


def write_case(data_dir: Path, golden: CaseGolden) -> None:
    """Write a case's golden files atomically, the npz first (the JSON names its hash)."""
    json_path, npz_path = case_paths(data_dir, golden.name)
    sha = _write_npz(npz_path, {AUDIO: golden.audio, MEL: golden.mel})
    write_json_atomic(json_path, golden.to_json(sha))


def read_case(data_dir: Path, name: str, update: str = UPDATE) -> CaseGolden:
    """Read a case's golden files; a missing, damaged or mismatched file is a `GoldenError` whose remedy
    runs `update` (the command that records them)."""
    json_path, npz_path = case_paths(data_dir, name)
    data, arrays = _read_pair(json_path, npz_path, "audio", f"{update} --case {name}", "case")
    try:
        segments = tuple(
            SegmentGolden(s["text"], tuple(s["speech_tokens"]), tuple(
                ChunkGolden(c["index"], c["is_final"], tuple(c["token_range"]), tuple(c["sample_range"]),
                            c["sha256"], c["pcm16_sha256"], c["reference_max_abs"]) for c in s["chunks"]),
                          s["mel_frames"])
            for s in data["segments"])
        golden = CaseGolden(data["name"], data["case"], data["bundle"], data["prompt"], data["reference"],
                            segments, data["graph_stats"], data["metrics"], arrays[AUDIO], arrays[MEL])
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise GoldenError(f"{json_path}: not a golden case file ({type(e).__name__}: {e})") from None
    frames = sum(s.mel_frames for s in golden.segments)
    if golden.name != name or golden.audio.shape != (golden.samples,) or golden.mel.shape[::2] != (1, frames):
        raise GoldenError(f"{json_path}: inconsistent (name {golden.name!r}, {golden.samples} samples, "
                          f"audio {golden.audio.shape}, {frames} mel frames, mel {golden.mel.shape}); record "
                          f"it again with `{update} --case {name}`")
    return golden


# --- graph goldens ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphCaseGolden:
    """One stored validation case of a graph: its inputs and the torch wrapper's outputs."""

    index: int
    """Index of the case in the spec's `validate`."""
    label: str
    inputs: dict[str, np.ndarray] = field(repr=False)
    outputs: dict[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class GraphGolden:
    """A graph's golden bundle."""

    graph: str
    spec_version: int
    bundle: dict[str, Any]
    cases: tuple[GraphCaseGolden, ...]

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"{i}/{kind}/{name}": value for i, c in enumerate(self.cases)
                for kind, tensors in (("inputs", c.inputs), ("outputs", c.outputs))
                for name, value in tensors.items()}


def graph_paths(data_dir: Path, graph: str) -> tuple[Path, Path]:
    """The JSON and npz files of graph `graph`'s golden bundle."""
    return data_dir / GRAPHS_DIR / f"{graph}.json", data_dir / GRAPHS_DIR / f"{graph}.npz"


def write_graph(data_dir: Path, golden: GraphGolden) -> None:
    """Write a graph's golden bundle atomically, the npz first."""
    json_path, npz_path = graph_paths(data_dir, golden.graph)
    sha = _write_npz(npz_path, golden.arrays())
    write_json_atomic(json_path, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "graph": golden.graph,
        "spec_version": golden.spec_version, "bundle": golden.bundle,
        "cases": [{"index": c.index, "label": c.label, "inputs": list(c.inputs), "outputs": list(c.outputs)}
                  for c in golden.cases],
        "arrays": {"file": npz_path.name, "sha256": sha},
    })


def read_graph(data_dir: Path, graph: str, update: str = UPDATE) -> GraphGolden:
    """Read a graph's golden bundle; a missing, damaged or mismatched file is a `GoldenError` whose remedy
    runs `update`."""
    json_path, npz_path = graph_paths(data_dir, graph)
    data, arrays = _read_pair(json_path, npz_path, "arrays", f"{update} --graph {graph}", "graph")
    try:
        cases = tuple(GraphCaseGolden(c["index"], c["label"],
                                      {n: arrays[f"{i}/inputs/{n}"] for n in c["inputs"]},
                                      {n: arrays[f"{i}/outputs/{n}"] for n in c["outputs"]})
                      for i, c in enumerate(data["cases"]))
        golden = GraphGolden(data["graph"], data["spec_version"], data["bundle"], cases)
    except (KeyError, TypeError, ValueError) as e:
        raise GoldenError(f"{json_path}: not a golden graph file ({type(e).__name__}: {e})") from None
    if golden.graph != graph:
        raise GoldenError(f"{json_path}: holds graph {golden.graph!r}, expected {graph!r}")
    return golden


# --- files --------------------------------------------------------------------------------------------------

def _write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> str:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, allow_pickle=False, **arrays)
    data = buffer.getvalue()
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _read_json(path: Path, remedy: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoldenError(f"{path}: missing; record it with `{remedy}`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GoldenError(f"{path}: not a {FORMAT} file")
    if data.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{path}: format_version {data.get('format_version')!r}, this tool reads "
                          f"{FORMAT_VERSION}; record it again with `{remedy}`")
    return data


def _read_pair(json_path: Path, npz_path: Path, table: str, remedy: str, kind: str
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A golden's JSON and its arrays, which the JSON's `table` names by hash; each a `GoldenError` where
    missing or damaged, whose remedy runs `remedy`."""
    data = _read_json(json_path, remedy)
    try:
        sha256 = data[table]["sha256"]
    except (KeyError, TypeError) as e:
        raise GoldenError(f"{json_path}: not a golden {kind} file ({type(e).__name__}: {e})") from None
    return data, _read_npz(npz_path, sha256, json_path, remedy)


def _read_npz(path: Path, sha256: str, json_path: Path, update: str) -> dict[str, np.ndarray]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GoldenError(f"{path}: missing (named by {json_path.name}); record both again with "
                          f"`{update}`") from None
    except OSError as e:
        raise GoldenError(f"{path}: unreadable ({e})") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise GoldenError(f"{path}: sha256 is not the one {json_path.name} records; the pair is damaged or "
                          f"mixed (record it again with `{update}`)")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}
