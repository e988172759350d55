"""A deterministic synthetic prompt utterance for test bundles, and the transcript that goes with it.

The audio is a crude formant synthesiser: a harmonic glottal source with a drifting, declining pitch
contour, shaped per syllable by three vowel formant resonators, with short fricative bursts, pauses
between words and longer ones between the two phrases. It is not speech, but it has what the prompt
front end cares about: a voiced 80-250 Hz fundamental, speech-like spectral envelopes and silences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
from scipy import signal

PROMPT_TRANSCRIPT = "Hello, this is a short voice prompt. It was made for testing."
PROMPT_SAMPLE_RATE = 24000
PROMPT_SECONDS = 4.5
PROMPT_PEAK = 0.5  # about -6 dBFS, a typical normalised recording level

# (F1, F2, F3) in Hz of a few vowels for an adult male voice.
_VOWEL_FORMANTS = {
    "a": (730.0, 1090.0, 2440.0), "e": (530.0, 1840.0, 2480.0), "i": (270.0, 2290.0, 3010.0),
    "o": (570.0, 840.0, 2410.0), "u": (300.0, 870.0, 2240.0), "ae": (660.0, 1720.0, 2410.0),
}
_FORMANT_BANDWIDTHS = (90.0, 110.0, 170.0)
# Syllables per word of the transcript; a phrase break follows the word whose index is in _PHRASE_ENDS.
_WORD_SYLLABLES = (2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2)
_PHRASE_ENDS = {6}
_LEAD_SILENCE = 0.15
_TRAIL_SILENCE = 0.1
_WORD_GAP = (0.04, 0.09)
_PHRASE_GAP = 0.3


def _resonator(x: np.ndarray, freq: float, bandwidth: float, sample_rate: int) -> np.ndarray:
    """Klatt's second-order resonator with unity gain at DC."""
    r = np.exp(-np.pi * bandwidth / sample_rate)
    b1, b2 = 2.0 * r * np.cos(2.0 * np.pi * freq / sample_rate), -r * r
    return signal.lfilter([1.0 - b1 - b2], [1.0, -b1, -b2], x)


def _syllable(rng: np.random.Generator, t0: float, sample_rate: int) -> np.ndarray:
    """One voiced syllable starting `t0` seconds into the utterance."""
    dur = rng.uniform(0.13, 0.24)
    n = int(dur * sample_rate)
    t = np.arange(n) / sample_rate
    # Pitch: declination of 12 Hz/s from 150 Hz, a rise-fall accent on the syllable, slight jitter.
    base = np.maximum(150.0 - 12.0 * (t0 + t), 95.0)
    accent = rng.uniform(-10.0, 25.0) * np.sin(np.pi * t / dur)
    f0 = base + accent + rng.normal(0.0, 0.5, n)
    phase = 2.0 * np.pi * np.cumsum(f0) / sample_rate
    n_harmonics = int(0.45 * sample_rate / f0.max())
    k = np.arange(1, n_harmonics + 1)[:, None]
    source = (np.sin(k * phase[None, :]) / k**2).sum(axis=0)  # -12 dB/octave glottal tilt
    source = np.append(source[0], np.diff(source)) * 20.0  # lip radiation: +6 dB/octave
    source += rng.normal(0.0, 0.02, n)  # breathiness

    vowel = _VOWEL_FORMANTS[rng.choice(list(_VOWEL_FORMANTS))]
    tail = int(0.02 * sample_rate)  # let the resonators ring out instead of cutting them
    y = np.concatenate([source, np.zeros(tail)])
    for freq, bw in zip(vowel, _FORMANT_BANDWIDTHS, strict=True):
        y = _resonator(y, freq * rng.uniform(0.95, 1.05), bw, sample_rate)
    attack, release = int(0.025 * sample_rate), int(0.05 * sample_rate)
    envelope = np.ones(n + tail)
    envelope[:attack] = np.sin(0.5 * np.pi * np.arange(attack) / attack) ** 2
    envelope[n + tail - release:] = np.cos(0.5 * np.pi * np.arange(release) / release) ** 2
    y *= envelope * rng.uniform(0.6, 1.0)

    if rng.random() < 0.35:  # a fricative onset ("s", "sh", "f"-like band-limited noise)
        m = int(rng.uniform(0.03, 0.07) * sample_rate)
        low = rng.uniform(2500.0, 4500.0)
        sos = signal.butter(4, [low, min(low * 2.0, 0.45 * sample_rate)], "bandpass", fs=sample_rate,
                            output="sos")
        burst = signal.sosfilt(sos, rng.normal(0.0, 1.0, m)) * np.hanning(m)
        y = np.concatenate([burst * 0.3 * np.abs(y).max() / (np.abs(burst).max() + 1e-9), y])
    return y


def synth_prompt_wav(seed: int = 0, sample_rate: int = PROMPT_SAMPLE_RATE,
                     seconds: float = PROMPT_SECONDS) -> np.ndarray:
    """The prompt utterance as float32 mono samples, exactly `seconds` long, with peak `PROMPT_PEAK`.

    Raises `ValueError` if this seed's speech does not fit in `seconds` with some trailing silence.
    """
    rng = np.random.default_rng(seed)
    placed: list[tuple[int, np.ndarray]] = []
    pos = int(_LEAD_SILENCE * sample_rate)
    for word, n_syllables in enumerate(_WORD_SYLLABLES):
        for _ in range(n_syllables):
            syl = _syllable(rng, pos / sample_rate, sample_rate)
            placed.append((pos, syl))
            pos += len(syl) - int(0.02 * sample_rate)  # syllables of a word overlap by their ringing tails
        gap = _PHRASE_GAP if word in _PHRASE_ENDS else rng.uniform(*_WORD_GAP)
        pos += int(gap * sample_rate)
    speech_end = max(start + len(syl) for start, syl in placed)
    out = np.zeros(int(round(seconds * sample_rate)))
    if speech_end + int(_TRAIL_SILENCE * sample_rate) > len(out):
        raise ValueError(f"seed {seed} gives {speech_end / sample_rate:.2f} s of speech; "
                         f"{seconds} s leaves no trailing silence")
    for start, syl in placed:
        out[start:start + len(syl)] += syl
    return (out * (PROMPT_PEAK / np.abs(out).max())).astype(np.float32)


def write_prompt_wav(path: Path, seed: int = 0, sample_rate: int = PROMPT_SAMPLE_RATE) -> Path:
    """Write `synth_prompt_wav(seed, sample_rate)` as a 16-bit PCM mono WAV file."""
    path = Path(path)
    sf.write(str(path), synth_prompt_wav(seed, sample_rate), sample_rate, subtype="PCM_16")
    return path
