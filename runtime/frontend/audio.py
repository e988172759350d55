"""Prompt audio: read any soundfile-readable file as mono float32 and resample it.

Mirrors upstream's `load_wav` (samples as floats in [-1, 1], channels averaged in float32 before
resampling, at least 16 kHz), with the reference pipeline's resampler: soxr at VHQ, trimmed or
extended to torchaudio's output length ceil(N * target / orig) so frame and token counts match
upstream's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from .errors import FrontendError

MIN_SAMPLE_RATE = 16000
"""Upstream refuses prompt audio below 16 kHz."""

SPEECH_SAMPLE_RATE = 16000
"""Rate of the audio the speech tokenizer and CAM++ take."""

MAX_PROMPT_SECONDS = 30.0
"""The speech tokenizer takes at most 30 s of audio (upstream asserts it)."""


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read `path` as mono float32 samples (N,) in [-1, 1] and its sample rate.

    Channels are averaged in float32, as upstream does before any resampling. Raises `FrontendError`
    (one line, naming the file) if the file cannot be read or its sample rate is below 16 kHz.
    """
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)  # (frames, channels)
    except Exception as exc:  # libsndfile and OS errors come in several types; all mean "unreadable"
        reason = " ".join(str(exc).split())
        raise FrontendError(f"cannot read audio file {path}: {reason}") from None
    if sr < MIN_SAMPLE_RATE:
        raise FrontendError(f"audio file {path} has sample rate {sr} Hz; the minimum is {MIN_SAMPLE_RATE} Hz")
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32), int(sr)


def resample(x: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample mono float32 `x` from `orig_sr` to `target_sr` (soxr VHQ) -> (ceil(N * target / orig),).

    Returns `x` itself when the rates are equal.
    """
    if orig_sr == target_sr:
        return x
    g = math.gcd(orig_sr, target_sr)
    orig, new = orig_sr // g, target_sr // g
    out_len = -(-x.shape[0] * new // orig)
    # soxr rounds its output length where torchaudio takes the ceiling; trailing zeros (which soxr
    # assumes past the end anyway, so earlier samples are unchanged) give it the extra sample.
    padded = np.concatenate([x, np.zeros(orig // new + 2, dtype=np.float32)])
    y = soxr.resample(padded, orig_sr, target_sr, quality="VHQ")
    return np.ascontiguousarray(y[:out_len], dtype=np.float32)


def load_wav(path: str | Path, target_sr: int) -> np.ndarray:
    """Read `path` as mono float32 (N,) at `target_sr` (upstream's `load_wav`).

    Errors are `FrontendError`s with a one-line message naming the file.
    """
    mono, sr = read_audio(path)
    return resample(mono, sr, target_sr)


def check_tokenizer_length(wav16k: np.ndarray, source: str) -> None:
    """Raise `FrontendError` if 16 kHz audio `wav16k` is longer than the speech tokenizer takes (30 s).

    `source` names the audio in the message, e.g. "audio file prompt.wav".
    """
    seconds = wav16k.shape[0] / SPEECH_SAMPLE_RATE
    if seconds > MAX_PROMPT_SECONDS:
        raise FrontendError(f"{source} lasts {seconds:.2f} s; the speech tokenizer takes at most "
                            f"{MAX_PROMPT_SECONDS:g} s")
