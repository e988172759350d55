"""Outputs written so that a reader never sees a partial file: a temporary name, then a rename; and the
check that an output path can be written, made before the work that fills it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from .errors import UNREACHABLE, UserError


def new_sibling(path: Path, suffix: str, *, directory: bool = False) -> Path:
    """A new empty file (or folder) beside `path`, named `.NAME.<random>SUFFIX`, with the mode any new file
    (folder) gets: 0o666 (0o777) less the umask, which the kernel applies as it creates it. tempfile's
    `mkstemp`/`mkdtemp` make theirs private (0o600, 0o700), and the rename would keep that."""
    while True:
        candidate = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        try:
            if directory:
                os.mkdir(candidate, 0o777)
            else:
                os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return candidate


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
    tmp = new_sibling(path, ".tmp")
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
        new_sibling(folder / "probe" if directory else target, ".tmp").unlink()
    except OSError as e:
        raise UserError(f"{option} {path}: cannot be written there ({e.strerror or e})") from None
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):  # another process put something there meanwhile
                d.rmdir()


@dataclass(frozen=True)
class AudioFormat:
    """A file format an audio output is written in: soundfile's (libsndfile's) format and subtype."""

    container: str
    subtype: str


WAV = AudioFormat("WAV", "PCM_16")
AUDIO_FORMATS: Mapping[str, AudioFormat] = {
    ".wav": WAV, ".flac": AudioFormat("FLAC", "PCM_16"), ".mp3": AudioFormat("MP3", "MPEG_LAYER_III"),
    ".ogg": AudioFormat("OGG", "VORBIS"), ".opus": AudioFormat("OGG", "OPUS")}
"""An audio output's format by its name's suffix, in any case: WAV and FLAC hold the 16-bit samples
exactly; MP3, Ogg Vorbis and Ogg Opus are libsndfile's lossy encoders at their default quality."""
AUDIO_OUT_HELP = ("Output audio, written atomically: 24 kHz mono, in the format its suffix names: .wav "
                  "(PCM16; a name without a suffix too), .flac (the same samples, lossless), .mp3, .ogg "
                  "(Vorbis) or .opus.")


def audio_format(path: Path, option: str) -> AudioFormat:
    """The format `path`'s suffix names (`AUDIO_FORMATS`; none: WAV); any other suffix is refused, so that
    a file is never named for one format and written in another."""
    suffix = path.suffix.lower()
    if not suffix:
        return WAV
    if suffix not in AUDIO_FORMATS:
        *others, last = AUDIO_FORMATS
        raise UserError(f"{option} {path}: {path.suffix} is not an audio format written here; expected a "
                        f"name ending {', '.join(others)} or {last}")
    audio = AUDIO_FORMATS[suffix]
    if audio.subtype not in sf.available_subtypes(audio.container):  # a libsndfile built without the codec
        raise UserError(f"{option} {path}: this libsndfile ({sf.__libsndfile_version__}) cannot write "
                        f"{audio.container} {audio.subtype}; name a .wav or .flac file")
    return audio


def audio_bytes(samples: np.ndarray, sample_rate: int, audio: AudioFormat) -> bytes:
    """A complete file of `samples` ((frames,) or (frames, channels)) in `audio`'s format. Made in memory:
    libsndfile calls a failed write (a full disk, a file-size limit) "System error", where Python's write
    names it; and it takes no file name that is not UTF-8."""
    if audio.subtype == "PCM_16":  # every PCM16 file holds the samples of the WAV
        samples = _wav_pcm16(samples)
    buffer = io.BytesIO()
    sf.write(buffer, samples, sample_rate, format=audio.container, subtype=audio.subtype)
    return buffer.getvalue()


def _wav_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples as libsndfile's WAV writer makes them 16-bit integers (rounding down; its FLAC writer
    rounds to the nearest, one step apart on half the samples)."""
    buffer = io.BytesIO()
    sf.write(buffer, samples, 1, format="RAW", subtype="PCM_16", endian="LITTLE")
    return np.frombuffer(buffer.getvalue(), "<i2").reshape(np.shape(samples))


def wav_bytes(samples: np.ndarray, sample_rate: int, subtype: str = "PCM_16") -> bytes:
    """A complete WAV file of `samples` in `subtype`."""
    return audio_bytes(samples, sample_rate, AudioFormat("WAV", subtype))


def write_json(path: Path, data: Any) -> None:
    """Write `data` as indented JSON to `path`."""
    path.write_text(json.dumps(data, indent=1))


def write_audio_atomic(path: Path, samples: np.ndarray, sample_rate: int, audio: AudioFormat) -> None:
    """`audio_bytes` written to `path` through a temporary file, so no partial file is left."""
    data = audio_bytes(samples, sample_rate, audio)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: Path, data: Any) -> None:
    """`write_json` through a temporary file."""
    with atomic_path(path) as tmp:
        write_json(tmp, data)


def save_wav(path: str | Path, tts_speech: np.ndarray, sample_rate: int) -> None:
    """Write `tts_speech` as `torchaudio.save(path, tts_speech, sample_rate)` writes upstream's output,
    for users without torchaudio: (channels, frames) float samples (a (1, N) `tts_speech`, or (N,)) as a
    32-bit float WAV, through a temporary file."""
    samples = np.asarray(tts_speech, dtype=np.float32)
    if samples.ndim not in (1, 2):
        raise ValueError(f"tts_speech has shape {samples.shape}; expected (channels, frames) or (frames,)")
    frames = samples if samples.ndim == 1 else samples.T  # soundfile takes (frames, channels)
    data = wav_bytes(frames, sample_rate, subtype="FLOAT")
    with atomic_path(Path(path)) as tmp:
        tmp.write_bytes(data)


@contextmanager
def atomic_paths(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """`atomic_path` for several outputs at once: a temporary path beside each, all renamed onto theirs once
    the block has written every one, none if it fails, so that outputs that belong together are written
    together or not at all."""
    with ExitStack() as stack:
        yield [stack.enter_context(atomic_path(path)) for path in paths]
