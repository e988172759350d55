"""Audio as files and bytes: the formats an audio output is written in (by its name's suffix), and the
16-bit PCM every one of them holds, the same samples in a WAV file, a FLAC file and a stream.

Float samples become 16-bit integers by libsndfile's conversion for WAV (rounding down), so a server's
stream holds the samples of `cosyvoice-run`'s WAV for the same request. (Upstream's server truncates
`x * 2**15` instead; the two differ by at most one step.)
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from .atomic_files import atomic_path
from .errors import UserError

PCM16_BYTES = 2


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
    a file is never named for one format and written in another, and so is `-` (`cosyvoice-run` alone
    writes to standard output, and takes `-` before asking)."""
    if str(path) == "-":
        raise UserError(f"{option} -: this command writes a file, not standard output; give a file name")
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


def write_audio_atomic(path: Path, samples: np.ndarray, sample_rate: int, audio: AudioFormat) -> None:
    """`audio_bytes` written to `path` through a temporary file, so no partial file is left."""
    data = audio_bytes(samples, sample_rate, audio)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


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


def pcm16(samples: np.ndarray) -> bytes:
    """Mono float32 samples in [-1, 1] as raw little-endian PCM16."""
    return _wav_pcm16(samples).tobytes()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A mono PCM16 WAV header for a stream of unknown length: RIFF and data sizes 0xFFFFFFFF, as
    streaming TTS services send (decoders read to the end of the stream)."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * PCM16_BYTES,
                                    PCM16_BYTES, 8 * PCM16_BYTES)
            + b"data" + struct.pack("<I", unknown))
