"""Prompt front end of the torch reference pipeline (upstream `cosyvoice/cli/frontend.py`).

Turns a prompt recording into the three things the networks condition on:

- speech tokens: 16 kHz audio -> Whisper-style 128-band log-mel -> `speech_tokenizer_v3.onnx`;
- x-vector: 16 kHz audio -> Kaldi fbank (mean-normalised over time) -> `campplus.onnx`;
- prompt mel: 24 kHz audio -> Matcha-TTS `mel_spectrogram` (80 bands, 50 Hz),

then cuts tokens and mel to the 1:token_mel_ratio alignment the flow needs. It also holds the
CosyVoice3 text prompt formats (`<|endofprompt|>` conventions) used by the three inference modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import librosa
import numpy as np
import onnxruntime
import soundfile as sf
import torch

from cosyvoice_export.bundle.errors import BundleError
from cosyvoice_export.config import MelConfig
from cosyvoice_runtime.frontend.audio import resample
from cosyvoice_runtime.frontend.features import fbank_frames
from cosyvoice_runtime.frontend.prompt import align_prompt

MIN_SAMPLE_RATE = 16000
"""Upstream `load_wav` refuses to upsample from below 16 kHz."""

MAX_TOKENIZER_SECONDS = 30.0
"""Upstream asserts at most 30 s of audio before running the speech tokenizer."""

# --- audio I/O --------------------------------------------------------------------------------------


def load_wav(path: str | Path, target_sr: int) -> torch.Tensor:
    """Read an audio file as a mono float32 tensor (1, N) at `target_sr`.

    Mirrors upstream `load_wav`: any format libsndfile reads, samples as floats in [-1, 1] (no int16
    scaling), channels averaged in float32 *before* resampling, torchaudio's default `Resample` (the
    runtime's `resample` reproduces it, and torchaudio cannot be installed beside this project's torch).

    Raises `BundleError` (one line, naming the file) if the file cannot be read or its sample rate
    is below 16 kHz.
    """
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile/OS errors come in several types; all mean "unreadable"
        reason = " ".join(str(exc).split())
        raise BundleError(f"cannot read audio file {path}: {reason}") from None
    if sr < MIN_SAMPLE_RATE:
        raise BundleError(f"audio file {path} has sample rate {sr} Hz; the minimum is {MIN_SAMPLE_RATE} Hz")
    # (frames, channels) -> (channels, frames); the mean is taken in float32 as torch does upstream.
    wav = torch.from_numpy(np.ascontiguousarray(data.T)).mean(dim=0, keepdim=True)
    if sr == target_sr:
        return wav
    return torch.from_numpy(resample(wav[0].numpy(), sr, target_sr)).unsqueeze(0)


# --- features ---------------------------------------------------------------------------------------

_WHISPER_SR = 16000
_WHISPER_N_FFT = 400
_WHISPER_HOP = 160


def whisper_log_mel(wav16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper's `log_mel_spectrogram` of a 16 kHz waveform (1, N) -> (1, n_mels, N // 160).

    Periodic hann(400), hop 160, centred reflect-padded STFT with the last frame dropped, power
    spectrum, Slaney mel filters from librosa (Whisper ships the same filters precomputed), log10 with
    a 1e-10 floor, then a floor at (utterance max - 8) and the (x + 4) / 4 scaling. The max is over the
    whole input, so extracting in pieces is not equivalent.
    """
    window = torch.hann_window(_WHISPER_N_FFT)
    spec = torch.stft(wav16k, _WHISPER_N_FFT, _WHISPER_HOP, window=window, return_complex=True)
    power = spec[..., :-1].abs() ** 2
    filters = torch.from_numpy(librosa.filters.mel(sr=_WHISPER_SR, n_fft=_WHISPER_N_FFT, n_mels=n_mels))
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16k: torch.Tensor) -> torch.Tensor:
    """80-band Kaldi log fbank of a 16 kHz waveform (1, N), minus its mean over time -> (T, 80).

    The settings are those of torchaudio's `compliance.kaldi.fbank(num_mel_bins=80, dither=0,
    sample_frequency=16000)` as upstream calls it: 25 ms / 10 ms frames with snip_edges
    (T = 1 + (N - 400) // 160), per-frame DC removal, pre-emphasis 0.97, povey window, 512-point FFT,
    power spectrum, Kaldi mel banks from 20 Hz to Nyquist, natural log floored at float32 eps. The
    waveform stays in [-1, 1] (upstream does not scale it to the int16 range).
    """
    samples = wav16k.reshape(-1).to(torch.float32).numpy()
    feat = torch.from_numpy(fbank_frames(samples))  # (T, 80)
    if feat.shape[0] == 0:
        raise BundleError(f"prompt audio of {samples.shape[0]} samples is shorter than one 25 ms frame")
    return feat - feat.mean(dim=0, keepdim=True)


def prompt_mel(wav24k: torch.Tensor, cfg: MelConfig) -> torch.Tensor:
    """Matcha-TTS `mel_spectrogram` of a waveform (1, N) at `cfg.sampling_rate`, as (1, T, num_mels).

    Reflect-pad (n_fft - hop) / 2 on each side, STFT with a periodic hann(win_size) and
    `center=cfg.center` (False for CosyVoice3, giving T = N // hop), magnitude sqrt(re² + im² + 1e-9),
    librosa Slaney mel basis (fmax None = Nyquist), natural log floored at 1e-5.

    The mel basis is built on every call from `cfg`; upstream caches it keyed only by fmax, which
    silently reuses a wrong basis for a second configuration with the same fmax.
    """
    pad = int((cfg.n_fft - cfg.hop_size) / 2)
    y = torch.nn.functional.pad(wav24k.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(
        y,
        cfg.n_fft,
        hop_length=cfg.hop_size,
        win_length=cfg.win_size,
        window=torch.hann_window(cfg.win_size),
        center=cfg.center,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    basis = librosa.filters.mel(sr=cfg.sampling_rate, n_fft=cfg.n_fft, n_mels=cfg.num_mels,
                                fmin=cfg.fmin, fmax=cfg.fmax)
    mel = torch.matmul(torch.from_numpy(basis).float(), mag)
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


# --- ONNX feature models (sessions from the runtime's `open_session`) ---------------------------------


def speech_tokens(session: onnxruntime.InferenceSession, wav16k: torch.Tensor) -> torch.Tensor:
    """Speech tokens of a 16 kHz waveform (1, N) from `speech_tokenizer_v3.onnx` -> int64 (1, n_tokens).

    Like upstream, tensors are addressed by position, not name: input 0 gets the Whisper log-mel
    (1, 128, T) float32, input 1 a one-element int32 array holding T; output 0 is flattened whatever
    its rank. Audio longer than 30 s is refused, as upstream asserts. Upstream holds the tokens as int32;
    the values are the same.
    """
    seconds = wav16k.shape[-1] / _WHISPER_SR
    if seconds > MAX_TOKENIZER_SECONDS:
        raise BundleError(f"prompt audio is {seconds:.2f} s; the speech tokenizer takes at most "
                          f"{MAX_TOKENIZER_SECONDS:g} s")
    feat = whisper_log_mel(wav16k, n_mels=128).numpy().astype(np.float32, copy=False)
    inputs = session.get_inputs()
    out = session.run(None, {inputs[0].name: feat,
                             inputs[1].name: np.array([feat.shape[2]], dtype=np.int32)})[0]
    return torch.from_numpy(np.asarray(out).reshape(-1).astype(np.int64)).unsqueeze(0)


def speaker_embedding(session: onnxruntime.InferenceSession, wav16k: torch.Tensor) -> torch.Tensor:
    """CAM++ x-vector of a 16 kHz waveform (1, N) -> float32 (1, D), D = 192 for `campplus.onnx`.

    Input 0 (by position) gets the mean-normalised fbank as (1, T, 80) float32; output 0 is flattened.
    """
    feat = kaldi_fbank(wav16k).unsqueeze(0).numpy()
    out = session.run(None, {session.get_inputs()[0].name: feat})[0]
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(-1).copy()).unsqueeze(0)


# --- prompt assembly --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchPromptFeatures:
    """The runtime's `PromptFeatures` (same fields, shapes and dtypes) as the tensors the networks take."""

    speech_tokens: torch.Tensor
    mel: torch.Tensor
    embedding: torch.Tensor


def extract_prompt(
    wav_path: str | Path,
    campplus_session: onnxruntime.InferenceSession,
    tokenizer_session: onnxruntime.InferenceSession,
    mel_cfg: MelConfig,
    token_mel_ratio: int,
) -> TorchPromptFeatures:
    """Load a prompt recording and compute its aligned tokens, mel and x-vector (upstream
    `frontend_zero_shot`'s audio half; sessions come from the runtime's `open_session`)."""
    wav16k = load_wav(wav_path, 16000)
    wav_mel = load_wav(wav_path, mel_cfg.sampling_rate)
    tokens = speech_tokens(tokenizer_session, wav16k)
    mel, tokens = align_prompt(prompt_mel(wav_mel, mel_cfg), tokens, token_mel_ratio)
    embedding = speaker_embedding(campplus_session, wav16k)
    return TorchPromptFeatures(speech_tokens=tokens, mel=mel, embedding=embedding)
