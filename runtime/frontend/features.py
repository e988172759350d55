"""Prompt features in numpy: Whisper log-mel, Kaldi fbank and the Matcha prompt mel.

- `whisper_log_mel`: input of the speech tokenizer (openai-whisper's `log_mel_spectrogram`).
- `kaldi_fbank`: input of CAM++ (torchaudio's `compliance.kaldi.fbank` as upstream calls it), computed
  with kaldi-native-fbank and mean-normalised over time.
- `prompt_mel`: the flow's prompt mel (Matcha-TTS `mel_spectrogram` with `PromptMelConfig`).

Spectra are computed in float64 and returned as float32; the reference computes in float32, so the two
agree to float32 rounding (see the tests for the measured figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import kaldi_native_fbank as knf
import numpy as np

from ..errors import FrontendError
from .audio import SPEECH_SAMPLE_RATE

_WHISPER_N_FFT = 400
_WHISPER_HOP = 160

FBANK_BINS = 80


@dataclass(frozen=True)
class PromptMelConfig:
    """Settings of the prompt-mel extractor (upstream yaml `feat_extractor`, Matcha's `mel_spectrogram`)."""

    n_fft: int = 1920
    """FFT size (80 ms at 24 kHz)."""
    num_mels: int = 80
    """Mel bands."""
    sampling_rate: int = 24000
    """Sample rate the prompt is resampled to."""
    hop_size: int = 480
    """Frame shift: 50 frames a second, two per speech token."""
    win_size: int = 1920
    """Hann window length (centred in the FFT frame when shorter than `n_fft`)."""
    fmin: float = 0.0
    """Lowest mel edge in Hz."""
    fmax: float | None = None
    """Highest mel edge in Hz; None means Nyquist."""
    center: bool = False
    """Whether the STFT pads again by n_fft // 2 (Matcha pads (n_fft - hop) / 2 itself in any case)."""


def slaney_mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """Slaney-style mel filterbank (n_mels, n_fft // 2 + 1) float32, as `librosa.filters.mel` builds it.

    Triangles on the Slaney mel scale (linear below 1 kHz, logarithmic above), each scaled to unit
    area ("slaney" norm). The float64 -> float32 rounding happens where librosa's does, so the result
    equals librosa's bit for bit.
    """
    fmax = sr / 2.0 if fmax is None else fmax
    fft_freqs = np.arange(0, n_fft // 2 + 1) * (1.0 / (n_fft * (1.0 / sr)))
    mel_edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(mel_edges)
    ramps = np.subtract.outer(mel_edges, fft_freqs)
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        rising = -ramps[i] / widths[i]
        falling = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0, np.minimum(rising, falling))
    weights *= (2.0 / (mel_edges[2:] - mel_edges[:-2]))[:, None]  # unit area per triangle
    return weights


_MEL_F_SP = 200.0 / 3  # Hz per mel below 1 kHz
_MEL_MIN_LOG_HZ = 1000.0
_MEL_MIN_LOG_MEL = _MEL_MIN_LOG_HZ / _MEL_F_SP
_MEL_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    if hz >= _MEL_MIN_LOG_HZ:
        return float(_MEL_MIN_LOG_MEL + np.log(hz / _MEL_MIN_LOG_HZ) / _MEL_LOGSTEP)
    return hz / _MEL_F_SP


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = _MEL_F_SP * mels
    log_part = mels >= _MEL_MIN_LOG_MEL
    hz[log_part] = _MEL_MIN_LOG_HZ * np.exp(_MEL_LOGSTEP * (mels[log_part] - _MEL_MIN_LOG_MEL))
    return hz


def _periodic_hann(n: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def _stft(x: np.ndarray, n_fft: int, hop: int, window: np.ndarray) -> np.ndarray:
    """One-sided STFT of an already padded float64 signal, no further padding -> (n_fft // 2 + 1, T)."""
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]  # (T, n_fft)
    return np.fft.rfft(frames * window, axis=1).T


def _reflect_pad(x: np.ndarray, pad: int, what: str) -> np.ndarray:
    # torch's reflect pad needs pad < len(x); numpy would silently reflect repeatedly instead.
    if x.shape[0] <= pad:
        raise FrontendError(f"{what}: {x.shape[0]} samples are too few (more than {pad} are needed)")
    return np.pad(x, pad, mode="reflect")


def whisper_log_mel(wav16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """Whisper's log-mel of 16 kHz mono audio (N,) -> float32 (1, n_mels, N // 160).

    Periodic hann(400), hop 160, centred reflect-padded STFT with the last frame dropped, power
    spectrum, Slaney mel filters, log10 floored at 1e-10, then floored at (utterance max - 8) and
    scaled by (x + 4) / 4. The max is over the whole input, so extracting in pieces differs.
    """
    x = _reflect_pad(np.asarray(wav16k, dtype=np.float64), _WHISPER_N_FFT // 2, "whisper log-mel")
    spec = _stft(x, _WHISPER_N_FFT, _WHISPER_HOP, _periodic_hann(_WHISPER_N_FFT))[:, :-1]
    power = spec.real ** 2 + spec.imag ** 2
    filters = slaney_mel_filterbank(SPEECH_SAMPLE_RATE, _WHISPER_N_FFT, n_mels).astype(np.float64)
    log_spec = np.log10(np.maximum(filters @ power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)[None]


def _fbank_options() -> knf.FbankOptions:
    """torchaudio `kaldi.fbank(num_mel_bins=80, dither=0, sample_frequency=16000)` in knf's terms."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SPEECH_SAMPLE_RATE
    opts.frame_opts.frame_shift_ms = 10.0
    opts.frame_opts.frame_length_ms = 25.0
    opts.frame_opts.dither = 0.0  # knf's default is not 0
    opts.frame_opts.preemph_coeff = 0.97
    opts.frame_opts.remove_dc_offset = True
    opts.frame_opts.window_type = "povey"
    opts.frame_opts.round_to_power_of_two = True
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FBANK_BINS
    opts.mel_opts.low_freq = 20.0
    opts.mel_opts.high_freq = 0.0  # Nyquist
    opts.mel_opts.is_librosa = False
    opts.mel_opts.htk_mode = False
    opts.use_energy = False
    opts.energy_floor = 0.0
    opts.raw_energy = True
    opts.use_power = True
    opts.use_log_fbank = True
    return opts


def kaldi_fbank(wav16k: np.ndarray) -> np.ndarray:
    """80-band Kaldi log fbank of 16 kHz mono audio (N,), minus its mean over time -> float32 (T, 80).

    25 ms / 10 ms frames with snip_edges (T = 1 + (N - 400) // 160), DC removal, pre-emphasis 0.97,
    povey window, 512-point power spectrum, mel banks from 20 Hz to Nyquist, natural log floored at
    float32 eps. The waveform stays in [-1, 1]: upstream does not scale it to the int16 range.
    """
    feat = fbank_frames(wav16k)  # (T, 80)
    if feat.shape[0] == 0:
        raise FrontendError(f"kaldi fbank: {wav16k.shape[0]} samples are shorter than one 25 ms frame")
    return (feat - feat.mean(axis=0, dtype=np.float64, keepdims=True)).astype(np.float32)


def fbank_frames(wav16k: np.ndarray) -> np.ndarray:
    """`kaldi_fbank` before the mean is taken away -> float32 (T, 80), no frames under 25 ms of audio.

    The torch reference normalises these frames itself, in torch's float32 arithmetic.
    """
    samples = np.ascontiguousarray(wav16k, dtype=np.float32)
    fbank = knf.OnlineFbank(_fbank_options())
    fbank.accept_waveform(SPEECH_SAMPLE_RATE, samples)
    fbank.input_finished()
    frames = [np.asarray(fbank.get_frame(i), dtype=np.float32) for i in range(fbank.num_frames_ready)]
    return np.stack(frames) if frames else np.zeros((0, FBANK_BINS), dtype=np.float32)


def prompt_mel(wav: np.ndarray, cfg: PromptMelConfig | None = None) -> np.ndarray:
    """Matcha-TTS `mel_spectrogram` of mono audio (N,) at `cfg.sampling_rate` -> float32 (1, T, num_mels).

    `cfg` defaults to CosyVoice3's settings. Reflect-pad (n_fft - hop) / 2 each side, STFT with a
    periodic hann(win_size) (T = N // hop), magnitude sqrt(re² + im² + 1e-9), Slaney mel basis,
    natural log floored at 1e-5. The basis is built from `cfg` on every call (upstream's cache keyed
    by fmax alone can return a wrong basis for a second configuration).
    """
    cfg = cfg or PromptMelConfig()
    x = _reflect_pad(np.asarray(wav, dtype=np.float64), (cfg.n_fft - cfg.hop_size) // 2, "prompt mel")
    if cfg.center:
        x = _reflect_pad(x, cfg.n_fft // 2, "prompt mel")
    left = (cfg.n_fft - cfg.win_size) // 2  # torch.stft centres a shorter window in the frame
    window = np.zeros(cfg.n_fft)
    window[left:left + cfg.win_size] = _periodic_hann(cfg.win_size)
    spec = _stft(x, cfg.n_fft, cfg.hop_size, window)
    magnitude = np.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    basis = slaney_mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax)
    mel = np.log(np.maximum(basis.astype(np.float64) @ magnitude, 1e-5))  # (num_mels, T)
    return mel.T.astype(np.float32)[None]
