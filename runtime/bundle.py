"""Open a runtime bundle (what `cosyvoice-export all` writes) and check it before anything runs.

The layout, format and version are `cosyvoice_graphs.bundle_layout`'s; the graphs' I/O is the specs'
(`cosyvoice_graphs.spec(name, dims)`, sized by the manifest's model constants). Every mismatch is a
one-line `RuntimeBundleError` naming the file or key, what was expected and what was found.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from cosyvoice_graphs import SPECS, GraphSpec, ModelDims, Precision, spec
from cosyvoice_graphs.bundle_layout import FORMAT, FORMAT_VERSION, MANIFEST, RETIRED_GRAPHS
from cosyvoice_graphs.precision import FP32

from .errors import RuntimeBundleError
from .noise import MT19937, UniformNoise

SPECIAL_IDS = ("sos", "eos", "task_id", "endofprompt_id")
"""Ids the manifest's `model` records besides the dims: LLM speech-table rows and the tokenizer's id."""
FRONTEND_MODELS = ("campplus", "speech_tokenizer")


@dataclass(frozen=True)
class TrtPlan:
    """A graph's TensorRT plan, as the manifest records it: it runs only with this TensorRT on this GPU."""

    path: Path
    tensorrt: str
    gpu: str


class RuntimeBundle:
    """A checked runtime bundle: its manifest, model dims, graph specs, and paths to its files.

    Make one with `RuntimeBundle.open`.
    """

    def __init__(self, root: Path, manifest: Mapping[str, Any], dims: ModelDims, ids: Mapping[str, int],
                 specs: Mapping[str, GraphSpec]) -> None:
        self.root = root
        self.manifest = manifest
        self.dims = dims
        """The model constants every graph's shapes follow."""
        self.specs = specs
        """Graph name -> its spec, in pipeline order."""
        self._ids = dict(ids)
        self._tables: dict[str, np.ndarray] = {}
        self._metadata: dict[str, dict[str, str]] = {}

    @classmethod
    def open(cls, root: Path | str, *, verify: bool = False) -> RuntimeBundle:
        """Read and check `root/manifest.json`: format and version, model constants, one graph per
        registered spec at our spec version (besides which an older bundle may list `RETIRED_GRAPHS`,
        never opened), and every listed file present with its recorded size.

        `verify` also re-hashes every file against the manifest's sha256 (seconds for a full model).
        """
        root = Path(root)
        manifest = _read_manifest(root / MANIFEST)
        where = f"{root / MANIFEST}"
        for key, want in (("format", FORMAT), ("format_version", FORMAT_VERSION)):
            if manifest.get(key) != want:
                raise RuntimeBundleError(f"{where}: {key} is {manifest.get(key)!r}, expected {want!r} "
                                         "(re-export the model with `cosyvoice-export all`)")
        model = _section(manifest, "model", where)
        dims = ModelDims(**{f.name: _int(model, f.name, f"{where}: model") for f in fields(ModelDims)})
        ids = {k: _int(model, k, f"{where}: model") for k in SPECIAL_IDS}
        files = _section(manifest, "files", where)
        graphs = _section(manifest, "graphs", where)
        if not set(SPECS) <= set(graphs) <= set(SPECS) | RETIRED_GRAPHS:
            raise RuntimeBundleError(f"{where}: graphs are {sorted(graphs)}, expected {sorted(SPECS)}")
        specs = {name: spec(name, dims) for name in SPECS}
        for name, s in specs.items():
            entry = _section(graphs, name, f"{where}: graphs")
            if entry.get("spec_name") != name or entry.get("spec_version") != s.version:
                raise RuntimeBundleError(
                    f"{where}: graphs.{name} is spec {entry.get('spec_name')!r} version "
                    f"{entry.get('spec_version')!r}, this runtime needs {name!r} version {s.version}")
        bundle = cls(root, manifest, dims, ids, specs)
        referenced = [bundle._rel(graphs[n], "file", f"graphs.{n}") for n in SPECS]
        referenced += [bundle._rel(_section(manifest, "tables", where), t, "tables")
                       for t in _section(manifest, "tables", where)]
        frontend = _section(manifest, "frontend", where)
        referenced += [bundle._rel(frontend, m, "frontend") for m in FRONTEND_MODELS]
        if manifest.get("prompt"):
            prompt = _section(manifest, "prompt", where)
            referenced += [bundle._rel(prompt, k, "prompt") for k in ("wav", "text")]
        for rel in referenced:
            if rel not in files:
                raise RuntimeBundleError(f"{where}: {rel} is used but not listed in files")
        for rel, entry in files.items():
            bundle._check_file(rel, entry, verify)
        return bundle

    # --- model constants ---------------------------------------------------------------------------

    @property
    def sos(self) -> int:
        """Speech-table row that starts the LLM's speech sequence."""
        return self._ids["sos"]

    @property
    def eos(self) -> int:
        """Speech id that ends generation."""
        return self._ids["eos"]

    @property
    def task_id(self) -> int:
        """Speech-table row between the text and the prompt speech tokens."""
        return self._ids["task_id"]

    @property
    def endofprompt_id(self) -> int:
        """Text token id of `<|endofprompt|>` in the bundle's tokenizer."""
        return self._ids["endofprompt_id"]

    @property
    def sample_rate(self) -> int:
        """Sample rate of the generated audio."""
        return self.dims.sample_rate

    # --- files -------------------------------------------------------------------------------------

    def graph_path(self, name: str) -> Path:
        """The ONNX file of graph `name` (its external data, if any, lies beside it)."""
        return self.root / self._rel(self._graph_entry(name), "file", f"graphs.{name}")

    def frontend_path(self, name: str) -> Path:
        """The ONNX file of a front-end model: "campplus" or "speech_tokenizer"."""
        if name not in FRONTEND_MODELS:
            raise KeyError(f"unknown front-end model {name!r}; known: {', '.join(FRONTEND_MODELS)}")
        return self.root / self._rel(self.manifest["frontend"], name, "frontend")

    @property
    def tokenizer_dir(self) -> Path:
        """The folder of the Qwen2 tokenizer files (vocab.json, merges.txt, tokenizer_config.json)."""
        tokenizer = _section(self.manifest, "tokenizer", f"{self.root / MANIFEST}")
        return self.root / self._rel(tokenizer, "dir", "tokenizer")

    def table(self, name: str) -> np.ndarray:
        """Table `name` of `cosyvoice_graphs.bundle_layout` (embeddings, flow noise), memory-mapped
        read-only and checked against the manifest's shape and dtype."""
        if name not in self._tables:
            tables = self._table_entry(name)
            if "generator" in tables[name]:
                raise KeyError(f"table {name!r} is drawn from a generator state; use uniform_noise()")
            path = self.root / self._rel(tables, name, "tables")
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise RuntimeBundleError(f"{path}: not a readable .npy file ({e})") from None
            want = (tuple(tables[name].get("shape", ())), tables[name].get("dtype"))
            if (array.shape, str(array.dtype)) != want:
                raise RuntimeBundleError(f"{path}: {array.shape} {array.dtype}, the manifest says "
                                         f"{want[0]} {want[1]}")
            self._tables[name] = array
        return self._tables[name]

    def uniform_noise(self, name: str) -> UniformNoise:
        """Table `name` (the sine noise), drawn exactly from the MT19937 state the bundle stores."""
        tables = self._table_entry(name)
        entry, path = tables[name], self.root / self._rel(tables, name, "tables")
        shape = tuple(entry.get("shape", ()))
        if entry.get("generator") != MT19937 or len(shape) != 3 or entry.get("dtype") != "float32":
            raise RuntimeBundleError(f"{self.root / MANIFEST}: tables.{name} is not an {MT19937} float32 "
                                     f"(1, samples, harmonics) table")
        try:
            return UniformNoise(np.load(path, allow_pickle=False), shape[1], shape[2])
        except (OSError, ValueError) as e:
            raise RuntimeBundleError(f"{path}: not an {MT19937} state ({e})") from None

    def default_prompt(self) -> tuple[Path, str] | None:
        """The prompt recording and transcript the bundle carries (ours do, exports of upstream's do
        not), or None."""
        prompt = self.manifest.get("prompt")
        if not prompt:
            return None
        wav, text = (self.root / self._rel(prompt, k, "prompt") for k in ("wav", "text"))
        return wav, text.read_text(encoding="utf-8").strip()

    def trt_plan(self, name: str) -> TrtPlan:
        """The TensorRT plan of graph `name`; a bundle exported without `--trt` has none."""
        entry = self._graph_entry(name).get("trt")
        if not isinstance(entry, Mapping):
            raise RuntimeBundleError(f"{self.root / MANIFEST}: graphs.{name} has no TensorRT plan "
                                     "(export with `cosyvoice-export all --trt` on the GPU that will run it)")
        where = f"graphs.{name}.trt"
        return TrtPlan(self.root / self._rel(entry, "file", where), str(entry.get("tensorrt")),
                       str(entry.get("gpu")))

    # --- provenance --------------------------------------------------------------------------------

    def graph_precision(self, name: str) -> Precision:
        """Graph `name`'s precision as the manifest records it (fp32 where it records none)."""
        try:
            return Precision.named(self._graph_entry(name).get("precision", FP32.name))
        except ValueError as e:
            raise RuntimeBundleError(f"{self.root / MANIFEST}: graphs.{name}.precision: {e}") from None

    def graph_metadata(self, name: str) -> dict[str, str]:
        """Graph `name`'s ONNX `metadata_props` (read without loading its weights), checked by
        `check_metadata`."""
        if name not in self._metadata:
            path = self.graph_path(name)
            meta = read_onnx_metadata(path)
            self.check_metadata(name, meta)
            self._metadata[name] = meta
        return dict(self._metadata[name])

    def check_metadata(self, name: str, meta: Mapping[str, str]) -> None:
        """Check a graph's metadata (from the file, or from a session that loaded it) against the
        manifest: spec name, spec version, every model constant and the graph's precision (a graph that
        records none is fp32)."""
        where = f"{self.graph_path(name)}: metadata"
        s = self.specs[name]
        want = {"spec_name": s.name, "spec_version": str(s.version), **self.dims.to_metadata(),
                "precision": self.graph_precision(name).name}
        for key, value in want.items():
            if meta.get(key, FP32.name if key == "precision" else None) != value:
                raise RuntimeBundleError(f"{where} {key} is {meta.get(key)!r}, the manifest says {value!r}")

    # --- helpers -----------------------------------------------------------------------------------

    def _table_entry(self, name: str) -> Mapping[str, Any]:
        tables = _section(self.manifest, "tables", f"{self.root / MANIFEST}")
        if name not in tables:
            raise KeyError(f"unknown table {name!r}; the bundle has {', '.join(tables)}")
        return tables

    def _graph_entry(self, name: str) -> Mapping[str, Any]:
        if name not in self.specs:
            raise KeyError(f"unknown graph {name!r}; known: {', '.join(self.specs)}")
        return self.manifest["graphs"][name]

    def _rel(self, section: Mapping[str, Any], key: str, where: str) -> str:
        """A bundle-relative path from the manifest; one that leaves the bundle is refused."""
        value = section.get(key)
        if isinstance(value, Mapping):  # tables: {"file": ..., "shape": ...}
            value = value.get("file")
        rel = PurePosixPath(value) if isinstance(value, str) else None
        if rel is None or rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise RuntimeBundleError(f"{self.root / MANIFEST}: {where}.{key} is {value!r}, "
                                     "expected a path inside the bundle")
        return str(rel)

    def _check_file(self, rel: str, entry: Any, verify: bool) -> None:
        path = self.root / self._rel({"file": rel}, "file", "files")
        if not isinstance(entry, Mapping) or not isinstance(entry.get("size"), int):
            raise RuntimeBundleError(f"{self.root / MANIFEST}: files.{rel} is {entry!r}, "
                                     "expected {size, sha256}")
        if not path.is_file():
            raise RuntimeBundleError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise RuntimeBundleError(f"{path}: {size} bytes, the manifest says {entry['size']}")
        if verify:
            with open(path, "rb") as f:
                sha = hashlib.file_digest(f, "sha256").hexdigest()
            if sha != entry.get("sha256"):
                raise RuntimeBundleError(f"{path}: sha256 {sha[:16]}…, the manifest says "
                                         f"{str(entry.get('sha256'))[:16]}…")


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuntimeBundleError(f"{path}: missing; not a runtime bundle "
                                 "(make one with `cosyvoice-export all`)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeBundleError(f"{path}: unreadable ({e})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeBundleError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
                                 ) from None
    if not isinstance(manifest, dict):
        raise RuntimeBundleError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
    return manifest


def _section(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if not isinstance(value, Mapping):
        found = "missing" if value is None else f"a {type(value).__name__}"
        raise RuntimeBundleError(f"{where}: {key} is {found}, expected an object")
    return value


def _int(section: Mapping[str, Any], key: str, where: str) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RuntimeBundleError(f"{where}.{key} is {value!r}, expected an integer")
    return value


# --- ONNX metadata without onnx ------------------------------------------------------------------------
# The runtime does not depend on the `onnx` package; ModelProto's metadata_props (field 14, repeated
# {key: 1, value: 2}) is read from the protobuf wire format, skipping the graph and its weights unread.

_METADATA_PROPS = 14


def read_onnx_metadata(path: Path) -> dict[str, str]:
    """The `metadata_props` of the ONNX model at `path`."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta = {}
            for field, start, end in _fields(buf, 0, len(buf)):
                if field == _METADATA_PROPS:
                    entry = {k: bytes(buf[s:e]).decode() for k, s, e in _fields(buf, start, end)}
                    meta[entry.get(1, "")] = entry.get(2, "")
            return meta
    except (OSError, ValueError, IndexError) as e:  # mmap of an empty file, truncated or bad protobuf
        raise RuntimeBundleError(f"{path}: not a readable ONNX model ({e or type(e).__name__})") from None


def _fields(buf: mmap.mmap, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field in buf[pos:end]; others are skipped."""
    while pos < end:
        tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            yield tag >> 3, pos, pos + size
            pos += size
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {pos}")
    if pos != end:
        raise ValueError("truncated protobuf")


def _varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError(f"bad protobuf varint before byte {pos}")
