"""Prompt audio: read any soundfile-readable file as mono float32, check it, and resample it.

Upstream's `load_wav` decodes to floats in [-1, 1], averages the channels in float32, refuses rates
under 16 kHz and resamples with torchaudio's default `Resample` (Hann-windowed sinc, lowpass filter
width 6, rolloff 0.99). `resample` reproduces that transform exactly in numpy: the same float32 kernel,
the same output length.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf

from ..errors import FrontendError

MIN_SAMPLE_RATE = 16000
"""Upstream refuses prompt audio below 16 kHz."""

MAX_SAMPLE_RATE = 384000
"""The highest rate recorders and interfaces offer. Upstream takes any rate, but torchaudio's kernel, and
ours, grows with a rate that shares few factors with 16 and 24 kHz (about 0.6 GB of memory per MHz): a
file of a few MB at a made-up rate of MHz would take GBs and seconds of work. Refused above it."""

SPEECH_SAMPLE_RATE = 16000
"""Rate of the audio the speech tokenizer and CAM++ take."""

MAX_PROMPT_SECONDS = 30.0
"""The speech tokenizer takes at most 30 s of audio (upstream asserts it)."""

MIN_TOKENIZER_SAMPLES = 200
"""The speech tokenizer's Whisper log-mel reflect-pads n_fft / 2 = 200 samples at each end (16 kHz), which
needs more than that many: a voice conversion's source shorter than 12.5 ms has no tokens to give."""
MIN_PROMPT_SECONDS = 0.5
"""Shorter recordings hold too little speech to clone a voice from."""

SILENCE_DBFS = -60.0
"""A prompt whose RMS level is below this (dB relative to full scale) is taken as silent."""

LOWPASS_FILTER_WIDTH = 6
"""torchaudio `Resample`'s default: the sinc's half-width in zero crossings."""

ROLLOFF = 0.99
"""torchaudio `Resample`'s default: the cutoff as a fraction of the lower Nyquist frequency."""


@dataclass(frozen=True)
class PromptAudio:
    """A decoded prompt recording that passed `check_prompt_audio`."""

    samples: np.ndarray
    """float32 (N,): mono samples in [-1, 1] at `sample_rate`."""
    sample_rate: int
    source: str
    """What the audio is called in errors, e.g. "audio file prompt.wav"."""


def read_audio(path: str | Path | BinaryIO) -> tuple[np.ndarray, int]:
    """Read `path` (a file's path, or an open binary file) as mono float32 samples (N,) in [-1, 1] and
    its sample rate.

    Channels are averaged in float32, as upstream does before any resampling. Raises `FrontendError`
    (one line, naming the file) if the file cannot be read or its sample rate is below 16 kHz or above
    384 kHz.
    """
    if hasattr(path, "read"):  # soundfile's "Format not recognised" (and a cffi traceback) for these
        if getattr(path, "closed", False):
            raise FrontendError(f"audio file {_name(path)}: the file is closed")
        if isinstance(path, io.TextIOBase):
            raise FrontendError(f"audio file {_name(path)}: opened in text mode; open it in binary mode "
                                "('rb')")
    else:  # libsndfile says only "System error." for these
        if not Path(path).exists():
            raise FrontendError(f"audio file {path}: no such file")
        if Path(path).is_dir():
            raise FrontendError(f"audio file {path}: is a folder")
    try:
        source = path if hasattr(path, "read") else os.fsencode(path)  # a name's bytes, UTF-8 or not
        data, sr = sf.read(source, dtype="float32", always_2d=True)  # (frames, channels)
    except Exception as exc:  # libsndfile and OS errors come in several types; all mean "unreadable"
        # libsndfile's own words without soundfile's "Error opening <repr of the file>: " prefix
        reason = " ".join(str(getattr(exc, "error_string", None) or exc).split())
        raise FrontendError(f"cannot read audio file {_name(path)}: {reason}") from None
    check_sample_rate(sr, f"audio file {_name(path)}")
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32), int(sr)


def check_sample_rate(sample_rate: int, source: str) -> None:
    """Raise `FrontendError` (one line naming `source`, e.g. "audio file prompt.wav") for a rate below 16 kHz
    or above 384 kHz."""
    if sample_rate < MIN_SAMPLE_RATE:
        raise FrontendError(f"{source} has sample rate {sample_rate} Hz; the minimum is {MIN_SAMPLE_RATE} Hz")
    if sample_rate > MAX_SAMPLE_RATE:
        raise FrontendError(f"{source} has sample rate {sample_rate} Hz; the maximum is {MAX_SAMPLE_RATE} Hz")


def read_prompt_audio(path: str | Path | BinaryIO) -> PromptAudio:
    """Read a prompt recording (`read_audio`) and refuse it if it cannot prompt (`check_prompt_audio`)."""
    samples, sr = read_audio(path)
    prompt = PromptAudio(samples, sr, f"audio file {_name(path)}")
    check_prompt_audio(prompt)
    return prompt


def read_source_audio(path: str | Path | BinaryIO) -> PromptAudio:
    """Read a voice conversion's source recording (`read_audio`) and refuse what the speech tokenizer
    cannot take (`check_source_audio`)."""
    samples, sr = read_audio(path)
    source = PromptAudio(samples, sr, f"audio file {_name(path)}")
    check_source_audio(source)
    return source


def _name(path: str | Path | BinaryIO) -> str:
    """How errors call a file: its path, or an open file's name."""
    return str(getattr(path, "name", "(an open file)")) if hasattr(path, "read") else str(path)


def check_prompt_audio(prompt: PromptAudio) -> None:
    """Raise `FrontendError` (one line naming the audio and the measured value) for a prompt that is
    shorter than 0.5 s, longer than the speech tokenizer's 30 s, holding a NaN or an infinity, or silent
    (RMS under -60 dBFS)."""
    seconds = prompt.samples.shape[0] / prompt.sample_rate
    if seconds < MIN_PROMPT_SECONDS:
        raise FrontendError(f"{prompt.source} is too short ({seconds:.3f} s); a prompt needs at least "
                            f"{MIN_PROMPT_SECONDS:g} s")
    check_source_audio(prompt)
    rms = math.sqrt(float(np.mean(np.square(prompt.samples, dtype=np.float64))))
    level = 20 * math.log10(rms) if rms > 0 else -math.inf
    if level < SILENCE_DBFS:
        raise FrontendError(f"{prompt.source} is silent or nearly so (RMS level {level:.1f} dBFS); a prompt "
                            f"needs speech above {SILENCE_DBFS:g} dBFS")


def check_source_audio(audio: PromptAudio) -> None:
    """Raise `FrontendError` (one line naming the audio) for audio the speech tokenizer cannot take: over
    30 s (upstream asserts it), or holding a NaN or an infinity. A voice conversion's source may be short
    or silent, as upstream's."""
    check_tokenizer_length(audio.samples.shape[0] / audio.sample_rate, audio.source)
    bad = int(np.count_nonzero(~np.isfinite(audio.samples)))
    if bad:
        raise FrontendError(f"{audio.source} holds {bad} sample(s) that are NaN or infinite; expected "
                            "finite samples")


def resample(x: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample mono float32 `x` (N,) from `orig_sr` to `target_sr` as torchaudio's default `Resample` does.

    Returns `x` itself when the rates are equal (torchaudio returns its input unchanged). Otherwise the
    output has torchaudio's length, ceil of (new * N / orig) rounded to float32 (g = gcd of the rates,
    new and orig the rates over g), which for long inputs can be one sample under the exact ceiling.
    Each output phase runs only over its kernel's non-zero taps, in float64.
    """
    if orig_sr == target_sr:
        return x
    g = math.gcd(orig_sr, target_sr)
    orig, new = orig_sr // g, target_sr // g
    taps, starts, width = _sinc_kernel(orig, new)
    n = x.shape[0]
    out_len = math.ceil(np.float32(new * n / orig))
    frames = n // orig + 1  # conv1d positions over the input padded by width, width + orig
    band = taps.shape[1]
    padded = np.zeros(width + frames * orig + band, dtype=np.float64)
    padded[width:width + n] = x
    windows = np.lib.stride_tricks.sliding_window_view(padded, band)  # (len - band + 1, band), no copy
    out = np.empty((new, frames), dtype=np.float64)
    for phase in range(new):
        np.matmul(windows[starts[phase]::orig][:frames], taps[phase], out=out[phase])
    return out.T.reshape(-1)[:out_len].astype(np.float32)  # frame-major, as conv1d's channels interleave


def _sinc_kernel(orig: int, new: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torchaudio's `sinc_interp_hann` kernel for `orig` -> `new` (rates over their gcd), cut to its band.

    torchaudio's kernel is (new, 2 * width + orig): phase j's taps over input offsets -width .. width +
    orig - 1. It is computed in float64 except the phase offsets -j / new, which torchaudio divides in
    float32, and stored as float32. Phase j is non-zero only on taps floor(j * orig / new) + [0, 2 * width
    + 1], so this returns those taps, float32 values held as float64 (new, 2 * width + 2), the first
    tap's index per phase (new,), and width.
    """
    cutoff = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / cutoff)
    n_taps = 2 * width + orig
    starts = np.arange(new, dtype=np.int64) * orig // new  # (new,)
    tap = starts[:, None] + np.arange(2 * width + 2)[None, :]  # (new, band): index into the full kernel
    phase_offset = (-np.arange(new, dtype=np.float32) / np.float32(new)).astype(np.float64)
    t = (phase_offset[:, None] + (np.minimum(tap, n_taps - 1) - width) / orig) * cutoff
    t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t *= math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    taps = sinc * (window * (cutoff / orig))
    taps[tap >= n_taps] = 0.0  # past the end of torchaudio's kernel
    return taps.astype(np.float32).astype(np.float64), starts, width


def load_wav(path: str | Path, target_sr: int) -> np.ndarray:
    """Read `path` as mono float32 (N,) at `target_sr` (upstream's `load_wav`).

    Errors are `FrontendError`s with a one-line message naming the file.
    """
    mono, sr = read_audio(path)
    return resample(mono, sr, target_sr)


def check_tokenizer_length(seconds: float, source: str) -> None:
    """Raise `FrontendError` if `seconds` of audio are more than the speech tokenizer takes (30 s), or too
    few for it (`MIN_TOKENIZER_SAMPLES`).

    `source` names the audio in the message, e.g. "audio file prompt.wav".
    """
    if seconds * SPEECH_SAMPLE_RATE <= MIN_TOKENIZER_SAMPLES:
        raise FrontendError(f"{source} lasts {seconds * 1000:.2f} ms; the speech tokenizer needs more than "
                            f"{MIN_TOKENIZER_SAMPLES * 1000 / SPEECH_SAMPLE_RATE:g} ms")
    if seconds > MAX_PROMPT_SECONDS:
        limit = f"{MAX_PROMPT_SECONDS:g} s"
        shown = f"{seconds:.2f} s" if round(seconds, 2) > MAX_PROMPT_SECONDS else f"over {limit}"
        raise FrontendError(f"{source} lasts {shown}; the speech tokenizer takes at most {limit}")
