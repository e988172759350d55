"""Registered speakers: a prompt recording's features computed once, kept on disk, used by name.

`CosyVoice3.save_spkinfo` writes the speakers `add_zero_shot_spk` added to a folder of this kind, and
`cosyvoice-serve` registers speakers over HTTP into one; by default both use the same folder
(`default_speakers_dir`). The folder holds `registry.json` (name -> transcript, feature file, front-end
fingerprint, time) and one `.npz` per speaker (speech tokens, prompt mel, x-vector). Every file is
written to a temporary file, flushed to disk and renamed over its target, and a speaker's features are
written before the registry names them; so a crash leaves either the old registry or the new one, never
a half-written one, and at worst an unreferenced `.npz` or a temporary file (`tidy` removes those; the
server does at start). Features depend on the bundle's front-end models: speakers registered with other
ones are kept on disk but not used. Several processes may share a folder (server replicas on one machine,
or on a shared filesystem whose `flock` works across machines, as NFS's does): writers take turns on
`registry.lock` and merge into the registry as it is on disk, and every reader reads the registry again
when its file has been replaced.

Upstream's `spk2info.pt` (the speakers its `add_zero_shot_spk` keeps) is a torch pickle, which the runtime
cannot read without torch; `cosyvoice-export speakers` converts it into this registry once
(`cosyvoice_export.speakers`), and the runtime and the server read those speakers like any other.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .atomic_files import atomic_path
from .bundle import FRONTEND_MODELS, RuntimeBundle
from .errors import SpeakerError, home_folder
from .frontend import PromptFeatures, PromptMelConfig

log = logging.getLogger(__name__)

SPEAKERS_DIR_ENV = "COSYVOICE_SPEAKERS_DIR"

REGISTRY = "registry.json"
LOCK = "registry.lock"
"""The file whose `flock` a writer holds while it changes the folder."""
FORMAT = "cosyvoice-serve-speakers"
VERSION = 1
MAX_NAME_CHARS = 64


def default_speakers_dir() -> Path:
    """`$COSYVOICE_SPEAKERS_DIR`, else `$XDG_DATA_HOME/cosyvoice/speakers`, default
    `~/.local/share/cosyvoice/speakers`."""
    env = os.environ.get(SPEAKERS_DIR_ENV, "").strip()
    if env:  # a leading ~ expanded, as a shell would have (a .env file's value is not)
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME", "").strip()
    data = Path(xdg).expanduser() if xdg else home_folder(
        "the speakers folder", f"give one with --speakers or ${SPEAKERS_DIR_ENV}") / ".local" / "share"
    return data / "cosyvoice" / "speakers"


@dataclass(frozen=True)
class Speaker:
    """A registered voice: the features of its recording and the recording's transcript."""

    name: str
    prompt_text: str
    features: PromptFeatures
    created: str
    """UTC time of registration, ISO 8601."""

    def describe(self) -> dict[str, Any]:
        """What the API shows of a speaker."""
        mel = PromptMelConfig()
        return {"name": self.name, "prompt_text": self.prompt_text, "created": self.created,
                "speech_tokens": int(self.features.speech_tokens.shape[1]),
                "seconds": round(self.features.mel.shape[1] * mel.hop_size / mel.sampling_rate, 3)}


def frontend_fingerprint(bundle: RuntimeBundle) -> str:
    """What a speaker's features depend on: the bundle's front-end models (their hashes) and its token/mel
    ratio. A registry serves the speakers registered with the fingerprint it is opened with."""
    files, paths = bundle.manifest.files, bundle.manifest.frontend.paths()
    parts = [files[paths[m]].sha256 for m in FRONTEND_MODELS] + [str(bundle.dims.token_mel_ratio)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


NAME_RESERVED = "/\\?#%"
"""Characters a speaker name may not hold: a name is one segment of a URL path (`/speakers/{name}`), so a
separator, a query or fragment mark or a percent escape would make it a different path or none."""
NAME_DOT_SEGMENTS = (".", "..")
"""Names that clients and proxies fold away as path segments (`/speakers/..` is `/`)."""


def shown_name(name: str) -> str:
    """`name` quoted for a message; one longer than any speaker name can be is cut there and its length said,
    so a client's long string is not echoed whole."""
    if len(name) <= MAX_NAME_CHARS:
        return repr(name)
    return f"{name[:MAX_NAME_CHARS]!r}... ({len(name)} characters)"


def check_name(name: str) -> str:
    """`name` stripped, if it is a usable speaker name: 1 to 64 printable characters (any script), none of
    `NAME_RESERVED`, and not `.` or `..`."""
    given, name = name, name.strip()
    if (not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or name in NAME_DOT_SEGMENTS
            or any(c in NAME_RESERVED for c in name)):
        raise SpeakerError(f"a speaker name is 1 to {MAX_NAME_CHARS} printable characters, none of "
                           f"{' '.join(NAME_RESERVED)}, and not . or ..; got {shown_name(given)}")
    return name


class SpeakerRegistry:
    """The speakers of one folder, for one front end (`fingerprint`); safe to use from any thread, and from
    several processes sharing the folder, each of which sees the others' changes."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        """Read `root` (a missing folder holds no speakers and is created by the first `add`);
        `SpeakerError` if its registry is not ours or not readable."""
        self.root, self.fingerprint = root, fingerprint
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        """Every entry of the registry file, those of other front ends included."""
        self._speakers: dict[str, Speaker] = {}
        self._seen: tuple[int, int, int] | None = None
        """The registry file's (inode, size, mtime) when it was read; None: there was none."""
        self._refresh(strict=True)

    def names(self) -> list[str]:
        """The usable speakers' names, sorted."""
        with self._lock:
            self._refresh()
            return sorted(self._speakers)

    def get(self, name: str) -> Speaker | None:
        """Speaker `name`, or None."""
        with self._lock:
            self._refresh()
            return self._speakers.get(name)

    def add(self, name: str, prompt_text: str, features: PromptFeatures) -> Speaker:
        """Register (or replace) speaker `name`: its features file first, then the registry."""
        name = check_name(name)
        file = f"{hashlib.sha256(name.encode()).hexdigest()[:16]}-{secrets.token_hex(4)}.npz"
        speaker = Speaker(name, prompt_text, features, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with self._writing():
            # under the lock, so that another process's `tidy` cannot take the file for a crash's leftover
            with atomic_path(self.root / file) as tmp, tmp.open("wb") as out:
                np.savez(out, speech_tokens=features.speech_tokens, mel=features.mel,
                         embedding=features.embedding)
                _flush_to_disk(out)
            old = self._entries.get(name)
            self._write_registry({**self._entries, name: {"file": file, "prompt_text": prompt_text,
                                                          "created": speaker.created,
                                                          "frontend": self.fingerprint}})
            self._speakers[name] = speaker
        if old is not None:
            (self.root / str(old.get("file"))).unlink(missing_ok=True)
        return speaker

    def remove(self, name: str) -> bool:
        """Forget speaker `name` (registry first, then its file); False if there is none."""
        with self._writing():
            if name not in self._speakers:
                return False
            old = self._entries[name]
            self._write_registry({k: v for k, v in self._entries.items() if k != name})
            del self._speakers[name]
        (self.root / str(old.get("file"))).unlink(missing_ok=True)
        return True

    def tidy(self) -> None:
        """Remove the feature files no entry names, left by a crash between writing one and the registry,
        and the temporary files of writes a crash cut short (every write holds the lock `tidy` holds)."""
        with self._writing():
            named = {str(e.get("file")) for e in self._entries.values()}
            for path in [*self.root.glob("*.npz"), *self.root.glob(".*.tmp")]:
                if path.name not in named:
                    path.unlink(missing_ok=True)

    # --- files ------------------------------------------------------------------------------------------

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """The folder's write lock (writers in other processes wait for it) and this object's, with the
        registry as it is on disk, so that a change merges into the others'."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / LOCK).open("a") as lock:  # closing the file releases the lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            with self._lock:
                self._refresh(strict=True)
                yield

    def _refresh(self, *, strict: bool = False) -> None:
        """Read the registry again if its file is not the one read last (another process replaced it),
        loading the features of new or changed entries only. An unreadable registry raises `SpeakerError`
        when `strict`, else leaves the speakers read before (logged)."""
        try:
            read = self._read_registry()
        except SpeakerError as e:
            if strict:
                raise
            log.warning("%s; keeping the speakers read before", e)
            return
        if read is None:
            return
        seen, entries = read
        speakers = {}
        for name, entry in entries.items():
            known = self._entries.get(name) == entry
            if known and name in self._speakers:
                speakers[name] = self._speakers[name]
            elif entry.get("frontend") != self.fingerprint:
                if not known:
                    log.warning("speaker %r was registered with other front-end models; not used", name)
            else:
                try:
                    speakers[name] = Speaker(name, str(entry["prompt_text"]), self._read_features(entry),
                                             str(entry.get("created", "")))
                except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
                    if not known:
                        log.warning("speaker %r: %s is unreadable (%s); not used", name, entry.get("file"), e)
        self._entries, self._speakers, self._seen = entries, speakers, seen

    def _read_registry(self) -> tuple[tuple[int, int, int] | None, dict[str, dict[str, Any]]] | None:
        """The registry file's signature and entries (a missing file: None and none), or None if it is
        the file read last; `SpeakerError` if it is not ours or not readable."""
        path = self.root / REGISTRY
        try:
            # the signature and the text of one open file: a replacement after the read shows next time
            with path.open("rb") as registry:
                stat = os.fstat(registry.fileno())
                seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if seen == self._seen:
                    return None
                data = json.loads(registry.read().decode("utf-8"))
        except FileNotFoundError:
            return (None, {}) if self._seen is not None or self._entries else None
        except (OSError, ValueError) as e:
            raise SpeakerError(f"{path}: not a readable speaker registry ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise SpeakerError(f"{path}: not a {FORMAT} registry version {VERSION}")
        speakers = data.get("speakers")
        if not isinstance(speakers, dict) or not all(isinstance(v, dict) for v in speakers.values()):
            raise SpeakerError(f"{path}: 'speakers' is not a mapping of names to entries")
        return seen, speakers

    def _write_registry(self, entries: dict[str, dict[str, Any]]) -> None:
        """Replace the registry file (under `_writing`) and take `entries` as read."""
        text = json.dumps({"format": FORMAT, "version": VERSION, "speakers": entries}, indent=1,
                          ensure_ascii=False)
        path = self.root / REGISTRY
        with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as out:
            out.write(text)
            _flush_to_disk(out)
        stat = path.stat()
        self._entries, self._seen = entries, (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def _read_features(self, entry: dict[str, Any]) -> PromptFeatures:
        with np.load(self.root / str(entry["file"]), allow_pickle=False) as data:
            return PromptFeatures(speech_tokens=data["speech_tokens"], mel=data["mel"],
                                  embedding=data["embedding"])


def _flush_to_disk(out: IO[Any]) -> None:
    """Flush a file to disk before it is renamed into place, so that a power cut cannot leave it empty."""
    out.flush()
    os.fsync(out.fileno())
