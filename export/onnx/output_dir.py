"""The folder `cosyvoice-export all` writes a runtime bundle into (OUT): its lock, its preparation, the
removal of retired graphs, and the writing of every file in it.

Besides the bundle's files, OUT/.export holds what only the exporter reads: the precision plan OUT was
exported with and one record per exported graph, which is what lets a later run skip it.

Every file is written to a temporary name and renamed, and an existing manifest is removed before
anything in OUT changes, so an interrupted export never leaves a manifest that claims files that are
not complete. An export holds OUT.lock, beside OUT, while it runs: two exports never write into one OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from cosyvoice_graphs.bundle_layout import GRAPHS_DIR, MANIFEST, TRT_DIR
from cosyvoice_graphs.manifest import FileEntry
from cosyvoice_graphs.precision import FP32
from cosyvoice_runtime.bundle import file_sha256

from ..bundle.errors import BundleError

STATE_DIR = ".export"
PRECISION_FILE = "precision"
"""In STATE_DIR: the precision plan OUT was exported with (`PrecisionPlan.name`); one OUT holds one."""
PARTIAL = ".partial"
"""Suffix of every temporary name the exporters write; a later export removes leftovers of a killed one."""


class OutputDirError(BundleError):
    """OUT cannot be used: a foreign non-empty directory, or not writable."""


def lock_path(out: Path) -> Path:
    """The lock file of exports into `out`: beside the folder, never in the bundle (nor its manifest);
    left in place, as a lock file may be in use when it would be deleted."""
    out = out.resolve()
    return out.with_name(f"{out.name}.lock")


@contextmanager
def locked(out: Path, wait: bool) -> Iterator[None]:
    """Hold `out`'s lock; `OutputDirError` if another export holds it (unless `wait`), or if the lock file
    cannot be made there at all (a parent that is not a folder, a read-only file system, /proc)."""
    path = lock_path(out)
    _make_lock_file(out, path)
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


def _make_lock_file(out: Path, path: Path) -> None:
    """Create `path` (or open it where it exists) so that a place no lock can be made in is one line here:
    filelock reports a file it cannot create as a lock held by someone else (a `Timeout`, which --wait
    would wait on for ever) wherever the open fails with "no such file" in an existing folder, as in
    /proc."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folder `mkdir(parents=True)` would create the rest in
    if not parent.is_dir():
        raise OutputDirError(f"{out}: cannot write there ({parent} is not a folder)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        raise OutputDirError(f"{out}: cannot write there (its lock {path}: {e.strerror or type(e).__name__})"
                             ) from None


def check_reuse_source(source: Path) -> None:
    """Refuse a `--reuse-from` folder that has no graph records to lend (a model bundle, a copied or
    committed runtime bundle without STATE_DIR): only a folder this command exported into has them."""
    if not (source / STATE_DIR).is_dir():
        what = "a runtime bundle without" if (source / MANIFEST).is_file() else "not a runtime bundle with"
        raise OutputDirError(f"--reuse-from {source}: {what} the records of `cosyvoice-export all` "
                             f"({STATE_DIR}/); name a folder that command exported into")


def recorded_precision(out: Path) -> str | None:
    """The precision plan OUT was exported with (`PrecisionPlan.name`); None where OUT holds no export."""
    marker = out / STATE_DIR / PRECISION_FILE
    if marker.is_file():
        return marker.read_text().strip()
    # bundles written before precisions were recorded are fp32
    return FP32.name if (out / MANIFEST).is_file() or (out / STATE_DIR).is_dir() else None


def check_out(out: Path, precision: str) -> None:
    """Refuse an OUT that cannot take an export of `precision` (a `PrecisionPlan.name`): the file system's
    root, a file, a foreign folder that is not empty, a bundle of another precision plan. Reads only: it
    runs before the lock is made, and again under it (`prepare_out`)."""
    if not out.resolve().name:
        raise OutputDirError(f"{out}: the file system's root; choose a folder below it")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out}: exists and is not a directory")
    found = recorded_precision(out)
    if found is None and out.is_dir() and any(out.iterdir()):
        raise OutputDirError(f"{out}: not empty and not a runtime bundle (no {MANIFEST}); "
                             "choose a new or empty directory")
    if found not in (None, precision):
        raise OutputDirError(f"{out}: holds a {found} runtime bundle; --precision {precision} needs "
                             "a new or empty --out (one precision plan per bundle)")


def prepare_out(out: Path, precision: str) -> None:
    """Refuse a foreign or unwritable OUT, or one exported with another precision plan (`precision`, a
    `PrecisionPlan.name`); mark it as ours (and its plan) and drop its manifest before changing it."""
    check_out(out, precision)
    marker = out / STATE_DIR / PRECISION_FILE
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


def graph_record_file(graph: str) -> str:
    """Where in OUT the record of `graph`'s export lies (a `GraphRecord`)."""
    return f"{STATE_DIR}/graph-{graph}.json"


def drop_graphs(out: Path, names: Iterable[str]) -> None:
    """Delete what an earlier export wrote for the graphs `names` (the graph and its external data, its
    record, its TensorRT plans): graphs this exporter no longer makes (`RETIRED_GRAPHS`) or this export
    leaves out (`--providers`), which the new manifest does not list."""
    for name in names:
        for path in (*(out / GRAPHS_DIR).glob(f"{name}.onnx*"), *(out / TRT_DIR).glob(f"{name}.*.plan"),
                     out / graph_record_file(name)):
            path.unlink(missing_ok=True)


def file_entry(path: Path) -> FileEntry:
    """`path`'s size and sha256."""
    return FileEntry(path.stat().st_size, file_sha256(path))


def install(out: Path, rel: str, write: Callable[[IO[bytes]], object]) -> FileEntry:
    """Write `out/rel` through a temporary name; returns its entry."""
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        entry = file_entry(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return entry


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link, or a copy where the file system has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def link_into(out: Path, rel: str, source: Path) -> None:
    """`out/rel` as `source`'s file (a hard link, else a copy), through a temporary name: every write into
    OUT replaces a file, so a linked file is never changed in place, here or where it came from."""
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    tmp.unlink(missing_ok=True)
    try:
        link_or_copy(source, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(out: Path, rel: str, data: Mapping[str, Any]) -> FileEntry:
    """Write `data` to `out/rel` as indented UTF-8 JSON, through `install`."""
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    return install(out, rel, lambda f: f.write(text.encode()))
