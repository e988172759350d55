"""Open a runtime bundle (what `cosyvoice-export all` writes) and check it before anything runs.

The layout, format and version are `cosyvoice_graphs.bundle_layout`'s; the graphs' I/O is the specs'
(`cosyvoice_graphs.spec(name, dims)`, sized by the manifest's model constants). Every mismatch is a
one-line `RuntimeBundleError` naming the file or key, what was expected and what was found.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import textwrap
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from cosyvoice_graphs import LLM, LLM_DECODE, OPTIONAL_SPECS, SPECS, GraphSpec, ModelDims, Precision, spec
from cosyvoice_graphs.bundle_layout import FORMAT, FORMAT_VERSION, MANIFEST
from cosyvoice_graphs.manifest import (
    FRONTEND_MODELS,
    FileEntry,
    GraphEntry,
    Manifest,
    ManifestError,
    TableEntry,
)
from cosyvoice_graphs.pipeline import providers_run
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.precision_plan import PrecisionPlan, PrecisionPlanError

from .errors import RuntimeBundleError, path_problem
from .noise import MT19937, UniformNoise

__all__ = ["FRONTEND_MODELS", "BundleGraphs", "RuntimeBundle", "StreamConstants", "TrtPlan",
           "file_sha256", "read_onnx_metadata"]

VERIFY_THREADS = 4
"""Files hashed at once by `RuntimeBundle.open(verify=True)`: as fast as two on 2 cores, faster with more."""


@dataclass(frozen=True)
class TrtPlan:
    """A graph's TensorRT plan, as the manifest records it: it runs only with this TensorRT on this GPU."""

    path: Path
    tensorrt: str
    gpu: str


@dataclass(frozen=True)
class StreamConstants:
    """The model constants a chunk policy is held against (`chunk_policy.check_policy`)."""

    lookahead: int
    """Tokens after a chunk that the flow's pre-lookahead layer reads (`pre_lookahead_len`)."""
    block_frames: int
    """Mel frames per block of the DiT's block-causal mask."""
    token_mel_ratio: int
    vocoder_held: int
    """Mel frames at the end of a non-final vocoder call whose samples are not final yet
    (`HiftLayout.final_lookahead`)."""

    @classmethod
    def of(cls, manifest: Manifest) -> StreamConstants:
        dims = manifest.model.dims
        return cls(dims.pre_lookahead_len, dims.dit_block_frames, dims.token_mel_ratio,
                   manifest.model.hift.final_lookahead)


class BundleGraphs(Protocol):
    """What the checks made before any graph opens read of a bundle: its precision, each graph's, which
    graphs have TensorRT plans, and its streaming constants. A `RuntimeBundle`, or the export a model bundle
    will get (`bundle_source.PlannedExport`)."""

    @property
    def root(self) -> Path: ...

    @property
    def precision(self) -> str:
        """The bundle's precision as `--precision` named it (a precision, a profile or a list)."""
        ...

    @property
    def graph_precisions(self) -> dict[str, Precision]: ...

    @property
    def trt_planned(self) -> list[str]: ...

    @property
    def stream_constants(self) -> StreamConstants: ...


class RuntimeBundle:
    """A checked runtime bundle: its manifest, model dims, graph specs, and paths to its files.

    Make one with `RuntimeBundle.open`.
    """

    def __init__(self, root: Path, manifest: Manifest, specs: Mapping[str, GraphSpec]) -> None:
        self.root = root
        self.manifest = manifest
        self.dims: ModelDims = manifest.model.dims
        """The model constants every graph's shapes follow."""
        self.specs = specs
        """Graph name -> its spec, in pipeline order, with the I/O of its precision's body
        (`GraphSpec.io_at`)."""
        self._tables: dict[str, np.ndarray] = {}
        self._metadata: dict[str, dict[str, str]] = {}

    @classmethod
    def open(cls, root: Path | str, *, verify: bool = False) -> RuntimeBundle:
        """Read and check `root/manifest.json`: its format, version and shape (`Manifest.from_json`), one
        graph per registered spec (`llm` only where `llm_decode` is there: an export for the providers that
        decode on it alone may leave `llm` out) and optional ones (`OPTIONAL_SPECS`), at our spec version, and
        every listed file present with its recorded size.

        `verify` also re-hashes every file against the manifest's sha256 (`VERIFY_THREADS` files at a time:
        0.75 s for the full-size cpu-fast bundle's 1.8 GB on a 2-core AVX2 EPYC, 1.36 s one at a time).
        """
        root = Path(root)
        where = f"{root / MANIFEST}"
        problem = path_problem(root)
        if problem is not None:
            raise RuntimeBundleError(f"{root}: {problem}")
        try:
            str(root).encode("utf-8")
        except UnicodeEncodeError:
            raise RuntimeBundleError(f"{root}: its name holds bytes that are not UTF-8, and onnxruntime and "
                                     "the tokenizer open files by UTF-8 names only; rename it, or give a "
                                     "link to it with a UTF-8 name") from None
        if not root.exists():  # else its manifest is named missing, as if the folder were there
            raise RuntimeBundleError(f"{root}: does not exist; a runtime bundle is a folder (make one with "
                                     "`cosyvoice-export all`)")
        try:
            manifest = Manifest.from_json(_read_manifest(root / MANIFEST), where)
        except ManifestError as e:
            raise RuntimeBundleError(str(e)) from None
        graphs = manifest.graphs
        # a bundle exported for the providers that decode on llm_decode alone may lack llm (--providers)
        required = set(SPECS) - {LLM} if LLM_DECODE in graphs else set(SPECS)
        if not required <= set(graphs) <= set(SPECS) | set(OPTIONAL_SPECS):
            raise RuntimeBundleError(f"{where}: graphs are {sorted(graphs)}, expected {sorted(SPECS)} (llm "
                                     f"only beside llm_decode) and optionally {sorted(OPTIONAL_SPECS)}")
        specs = {name: spec(name, manifest.model.dims) for name in (*SPECS, *OPTIONAL_SPECS)
                 if name in graphs}
        for name, s in specs.items():
            entry = graphs[name]
            if entry.spec_name != name or entry.spec_version != s.version:
                raise RuntimeBundleError(
                    f"{where}: graphs.{name} is spec {entry.spec_name!r} version {entry.spec_version!r}, "
                    f"this runtime needs {name!r} version {s.version}")
        try:  # what judges the bundle (`cosyvoice-golden`) and what `--info` shows
            PrecisionPlan.parse(manifest.precision)
        except PrecisionPlanError:
            raise RuntimeBundleError(f"{where}: precision is {manifest.precision!r}, no precision, profile "
                                     "or graph=precision list the exporter writes") from None
        bundle = cls(root, manifest, specs)
        # a body's I/O may differ from the spec's in its precision (`GraphSpec.io_at`)
        bundle.specs = {name: s.io_at(bundle.graph_precision(name).name) for name, s in specs.items()}
        for rel, file in manifest.files.items():
            bundle._check_file(rel, file)
        if verify:
            bundle._check_hashes()
        return bundle

    # --- model constants ---------------------------------------------------------------------------

    @property
    def sos(self) -> int:
        """Speech-table row that starts the LLM's speech sequence."""
        return self.manifest.model.sos

    @property
    def eos(self) -> int:
        """Speech id that ends generation."""
        return self.manifest.model.eos

    @property
    def task_id(self) -> int:
        """Speech-table row between the text and the prompt speech tokens."""
        return self.manifest.model.task_id

    @property
    def endofprompt_id(self) -> int:
        """Text token id of `<|endofprompt|>` in the bundle's tokenizer."""
        return self.manifest.model.endofprompt_id

    @property
    def sample_rate(self) -> int:
        """Sample rate of the generated audio."""
        return self.dims.sample_rate

    # --- files -------------------------------------------------------------------------------------

    def graph_path(self, name: str) -> Path:
        """The ONNX file of graph `name` (its external data, if any, lies beside it)."""
        return self.root / self._graph_entry(name).file

    def frontend_path(self, name: str) -> Path:
        """The ONNX file of a front-end model: "campplus" or "speech_tokenizer"."""
        paths = self.manifest.frontend.paths()
        if name not in paths:
            raise KeyError(f"unknown front-end model {name!r}; known: {', '.join(FRONTEND_MODELS)}")
        return self.root / paths[name]

    @property
    def tokenizer_dir(self) -> Path:
        """The folder of the Qwen2 tokenizer files (vocab.json, merges.txt, tokenizer_config.json)."""
        return self.root / self.manifest.tokenizer.dir

    def table(self, name: str) -> np.ndarray:
        """Table `name` of `cosyvoice_graphs.bundle_layout` (embeddings, flow noise), memory-mapped
        read-only and checked against the manifest's shape and dtype."""
        if name not in self._tables:
            entry = self._table_entry(name)
            if entry.generator is not None:
                raise KeyError(f"table {name!r} is drawn from a generator state; use uniform_noise()")
            path = self.root / entry.file
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise RuntimeBundleError(f"{path}: not a readable .npy file ({e})") from None
            if (array.shape, str(array.dtype)) != (entry.shape, entry.dtype):
                raise RuntimeBundleError(f"{path}: {array.shape} {array.dtype}, the manifest says "
                                         f"{entry.shape} {entry.dtype}")
            # a plain array over the same mapped pages: each lookup in a `np.memmap` builds a memmap of its
            # result, a cost a decode step's embedding lookup would pay per id
            self._tables[name] = array.view(np.ndarray)
        return self._tables[name]

    def uniform_noise(self, name: str) -> UniformNoise:
        """Table `name` (the sine noise), drawn exactly from the MT19937 state the bundle stores."""
        entry = self._table_entry(name)
        path, shape = self.root / entry.file, entry.shape
        if entry.generator != MT19937 or len(shape) != 3 or entry.dtype != "float32":
            raise RuntimeBundleError(f"{self.root / MANIFEST}: tables.{name} is not an {MT19937} float32 "
                                     f"(1, samples, harmonics) table")
        try:
            return UniformNoise(np.load(path, allow_pickle=False), shape[1], shape[2])
        except (OSError, ValueError) as e:
            raise RuntimeBundleError(f"{path}: not an {MT19937} state ({e})") from None

    def default_prompt(self) -> tuple[Path, str] | None:
        """The prompt recording and transcript the bundle carries (ours do, exports of upstream's do
        not), or None."""
        prompt = self.manifest.prompt
        if prompt is None:
            return None
        return self.root / prompt.wav, (self.root / prompt.text).read_text(encoding="utf-8").strip()

    def trt_plan(self, name: str) -> TrtPlan:
        """The TensorRT plan of graph `name`; a bundle exported without `--trt` has none."""
        entry = self._graph_entry(name).trt
        if entry is None:
            raise RuntimeBundleError(f"{self.root / MANIFEST}: graphs.{name} has no TensorRT plan "
                                     "(export with `cosyvoice-export all --trt` on the GPU that will run it)")
        return TrtPlan(self.root / entry.file, entry.tensorrt, entry.gpu)

    def has_trt_plan(self, name: str) -> bool:
        """Whether graph `name` was exported with `--trt` (its plan built; an fp16 body then keeps the
        standard operators TensorRT parses, not onnxruntime's own)."""
        return self._graph_entry(name).trt is not None

    # --- provenance --------------------------------------------------------------------------------

    def graph_precision(self, name: str) -> Precision:
        """Graph `name`'s precision as the manifest records it."""
        try:
            return Precision.named(self._graph_entry(name).precision)
        except ValueError as e:
            raise RuntimeBundleError(f"{self.root / MANIFEST}: graphs.{name}.precision: {e}") from None

    @property
    def precision(self) -> str:
        """The precision the bundle was exported in, as the manifest records it."""
        return self.manifest.precision

    @property
    def graph_precisions(self) -> dict[str, Precision]:
        """Graph -> its precision (`graph_precision`), in pipeline order."""
        return {name: self.graph_precision(name) for name in self.specs}

    @property
    def trt_planned(self) -> list[str]:
        """The graphs with TensorRT plans (`has_trt_plan`)."""
        return [name for name in self.specs if self.has_trt_plan(name)]

    @property
    def stream_constants(self) -> StreamConstants:
        return StreamConstants.of(self.manifest)

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

    def summary(self) -> list[str]:
        """The bundle in a few lines (`cosyvoice-run --info`): where it is, its format and provenance, the
        LLM checkpoint, the model constants, each graph's precision and TensorRT plan, and the providers that
        run it (`cosyvoice_graphs.pipeline.providers_run`)."""
        m = self.manifest
        dims = ", ".join(f"{name}={value}" for name, value in asdict(self.dims).items())
        lines = [f"bundle: {self.root}", f"format: {FORMAT} version {FORMAT_VERSION}",
                 f"exported: {m.created} by {m.exporter_version}", f"precision: {m.precision}",
                 f"llm checkpoint: {m.llm_checkpoint} (sha256 {m.llm_source.sha256})",
                 f"sample rate: {self.sample_rate} Hz",
                 *textwrap.wrap(dims, 110, initial_indent="model dims: ", subsequent_indent="  "), "graphs:"]
        for name in self.specs:
            entry = m.graphs[name]
            plan = "a TensorRT plan" if entry.trt is not None else "no TensorRT plan"
            lines.append(f"  {name}: {entry.precision}, spec version {entry.spec_version}, {entry.file}, "
                         f"{plan}")
        plans = [e.trt for e in m.graphs.values() if e.trt is not None]
        if plans:
            lines.append(f"TensorRT plans: {len(plans)} of {len(m.graphs)} graphs, for {plans[0].gpu} with "
                         f"TensorRT {plans[0].tensorrt}")
        else:
            lines.append("TensorRT plans: none (`cosyvoice-export all --trt` builds them)")
        lines.append(f"providers: {', '.join(providers_run(self.graph_precisions, self.trt_planned))}")
        return lines

    # --- helpers -----------------------------------------------------------------------------------

    def _table_entry(self, name: str) -> TableEntry:
        tables = self.manifest.tables
        if name not in tables:
            raise KeyError(f"unknown table {name!r}; the bundle has {', '.join(tables)}")
        return tables[name]

    def _graph_entry(self, name: str) -> GraphEntry:
        if name not in self.specs:
            raise KeyError(f"unknown graph {name!r}; known: {', '.join(self.specs)}")
        return self.manifest.graphs[name]

    def _check_file(self, rel: str, entry: FileEntry) -> None:
        path = self.root / rel
        unreadable = RuntimeBundleError(f"{path}: cannot be read (permission denied)")
        try:
            if not path.is_file():
                raise RuntimeBundleError(f"{path}: missing (listed in {MANIFEST})")
            size = path.stat().st_size
        except PermissionError:  # its folder cannot be entered (exported under umask 077, shared later)
            raise unreadable from None
        if size != entry.size:
            raise RuntimeBundleError(f"{path}: {size} bytes, the manifest says {entry.size}")
        if not os.access(path, os.R_OK):
            raise unreadable

    def _check_hashes(self) -> None:
        """Every listed file against its sha256, hashed `VERIFY_THREADS` at a time, largest first (hashlib
        lets go of the GIL); a mismatch is named in the manifest's order, whichever was hashed first."""
        files = self.manifest.files
        largest_first = sorted(files, key=lambda rel: -files[rel].size)
        with ThreadPoolExecutor(VERIFY_THREADS) as pool:
            hashing = {rel: pool.submit(file_sha256, self.root / rel) for rel in largest_first}
        for rel, entry in files.items():
            sha = hashing[rel].result()
            if sha != entry.sha256:
                raise RuntimeBundleError(f"{self.root / rel}: sha256 {sha[:16]}…, the manifest says "
                                         f"{entry.sha256[:16]}…")


def file_sha256(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """sha256 (hex) of a file, read in 1 MiB chunks; `progress` gets each chunk's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def _read_manifest(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuntimeBundleError(f"{path}: missing; not a runtime bundle "
                                 "(make one with `cosyvoice-export all`)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeBundleError(f"{path}: unreadable ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeBundleError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
                                 ) from None


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
