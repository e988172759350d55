"""Outputs written so that a reader never sees a partial file: a temporary name, then a rename; and the
check that an output path can be written, made before the work that fills it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from .errors import UNREACHABLE, UserError

TMP = ".tmp"
"""The suffix of `atomic_path`'s temporary files."""
_TAG_BYTES = 4
"""Random bytes in a `new_sibling` name, in hex."""


def new_sibling(path: Path, suffix: str, *, directory: bool = False) -> Path:
    """A new empty file (or folder) beside `path`, named `.NAME.<random>SUFFIX`, with the mode any new file
    (folder) gets: 0o666 (0o777) less the umask, which the kernel applies as it creates it. tempfile's
    `mkstemp`/`mkdtemp` make theirs private (0o600, 0o700), and the rename would keep that."""
    while True:
        candidate = path.with_name(f".{path.name}.{secrets.token_hex(_TAG_BYTES)}{suffix}")
        try:
            if directory:
                os.mkdir(candidate, 0o777)
            else:
                os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return candidate


def siblings_made(path: Path, suffix: str) -> list[Path]:
    """What `new_sibling(path, suffix)` made beside `path` and is still there (a process killed outright
    leaves its own), sorted by name."""
    name = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{2 * _TAG_BYTES}}}{re.escape(suffix)}")
    return sorted(p for p in path.parent.iterdir() if name.fullmatch(p.name)) if path.parent.is_dir() else []


SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
"""The kinds of file an output path may not name: the rename that writes an output would replace such a
file with a regular one, not write into it."""


def refuse_special_file(path: Path, name: str) -> None:
    """A `UserError` naming `name` (an option and the path, or the path) where `path` (a link followed) is
    one of `SPECIAL_FILES`."""
    try:
        mode = path.stat().st_mode
    except OSError:  # not there, or a dangling link: the rename makes a new file
        return
    kind = next((kind for is_kind, kind in SPECIAL_FILES if is_kind(mode)), None)
    if kind is not None:
        raise UserError(f"{name}: is {kind}, not a regular file (writing the output would replace it)")


def link_target(path: Path) -> Path:
    """Where an output `path` is written: the file it links to where it is a symbolic link (followed to
    the end, as a shell's `>` follows it), which the link stays pointing at; else `path`."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (beside its target where it is a symbolic link), renamed onto that if
    the block succeeds and removed otherwise; a `UserError` where `path` is a device, FIFO or socket, which
    the rename would replace."""
    refuse_special_file(path, str(path))
    path = link_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_sibling(path, TMP)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_writable(path: Path, option: str, *, directory: bool = False) -> None:
    """Refuse, in one line naming `option`, an output path that could not be written: a folder where a file
    is wanted (a file where a folder is), or a parent that is not a folder, or that neither exists nor can
    be created, or that cannot be written, or a device, FIFO or socket where a file is wanted. Proven by
    writing: the folders missing on the way are created, an empty file is made where the write will make its
    own temporary file, and all of them are removed again, so that a file system that refuses (read-only,
    /proc, full) is found before the work."""
    try:
        _check_writable(path, option, directory)
    except PermissionError:  # a folder on the way it cannot enter (another user's home, mode 700)
        raise UserError(f"{option} {path}: {UNREACHABLE}") from None
    except OSError as e:  # a name too long, a symlink loop: Python 3.11's `Path.exists` raises on them
        raise UserError(f"{option} {path}: {e.strerror or e}") from None


def resolved(path: Path, option: str) -> Path:
    """`path` with its symlinks followed, made absolute; a loop of them refused in one line naming
    `option`."""
    try:
        return path.resolve()
    except RuntimeError:  # Python 3.11's word for a loop
        raise UserError(f"{option} {path}: a loop of symbolic links") from None
    except OSError as e:
        raise UserError(f"{option} {path}: {e.strerror or e}") from None


def refuse_overwriting_inputs(path: Path, option: str, inputs: Mapping[str, Path | None]) -> None:
    """Refuse an output that is one of the run's `inputs` (option: file or folder) or a file inside one of
    its folders: written, it would destroy what the run, or a later one, reads (a prompt, a bundle's
    manifest). A new file beside a bundle's is no harm."""
    target = resolved(path, option)
    for name, source in inputs.items():
        if source is None:
            continue
        where = resolved(source, name)
        if target == where:
            raise UserError(f"{option} {path}: would overwrite {name} ({source}); write it elsewhere")
        if target.is_relative_to(where) and where.is_dir() and target.exists():
            raise UserError(f"{option} {path}: would overwrite a file of {name} ({source}); write it "
                            "elsewhere")


def _check_writable(path: Path, option: str, directory: bool) -> None:
    if directory and path.exists() and not path.is_dir():
        raise UserError(f"{option} {path}: is a file, not a folder")
    if not directory and path.is_dir():
        raise UserError(f"{option} {path}: is a folder")
    if not directory:
        refuse_special_file(path, f"{option} {path}")
    target = path.absolute() if directory else link_target(path).absolute()
    # the nearest folder that exists: `path` itself where it is a folder that exists, else the one that
    # `mkdir(parents=True)` would create the rest in
    parent = target if directory else target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{option} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: {parent} is not writable")
    folder = target if directory else target.parent
    missing = [d for d in (folder, *folder.parents) if not d.exists()]
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        # for a file, the name its write will use: a name within the limit may not be with the temporary
        # file's additions
        new_sibling(folder / "probe" if directory else target, TMP).unlink()
    except OSError as e:
        raise UserError(f"{option} {path}: cannot be written there ({e.strerror or e})") from None
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):  # another process put something there meanwhile
                d.rmdir()


def write_json(path: Path, data: Any) -> None:
    """Write `data` as indented JSON to `path`."""
    path.write_text(json.dumps(data, indent=1))


def write_json_atomic(path: Path, data: Any) -> None:
    """`write_json` through a temporary file."""
    with atomic_path(path) as tmp:
        write_json(tmp, data)


@contextmanager
def atomic_paths(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """`atomic_path` for several outputs at once: a temporary path beside each, all renamed onto theirs once
    the block has written every one, none if it fails, so that outputs that belong together are written
    together or not at all."""
    with ExitStack() as stack:
        yield [stack.enter_context(atomic_path(path)) for path in paths]
