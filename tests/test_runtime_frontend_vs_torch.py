"""The runtime's torch-free front end (audio, features, prompt extraction) against the torch reference
front end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import librosa
import numpy as np
import soundfile as sf
import torch
from test_runtime_frontend import speechlike_signal, tone_signal

from cosyvoice_export.config import MelConfig
from cosyvoice_export.reference import frontend as ref
from cosyvoice_runtime import frontend as rt


def _max_abs(a: np.ndarray, b: np.ndarray | torch.Tensor) -> float:
    b_np = b.numpy() if isinstance(b, torch.Tensor) else b
    assert a.shape == b_np.shape
    return float(np.abs(a.astype(np.float64) - b_np.astype(np.float64)).max())


# --- audio ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("orig_sr", "target_sr", "channels"),
                         [(44100, 16000, 2), (48000, 24000, 1), (16000, 24000, 2), (22050, 16000, 1),
                          (24000, 24000, 3)])
def test_load_wav_equals_reference(tmp_path: Path, orig_sr: int, target_sr: int, channels: int) -> None:
    n = orig_sr + 17
    data = np.stack([tone_signal(n, orig_sr, seed=c) * (0.5 + 0.2 * c) for c in range(channels)], axis=1)
    path = tmp_path / "in.wav"
    sf.write(path, data, orig_sr, subtype="FLOAT")
    got = rt.load_wav(path, target_sr)
    assert got.dtype == np.float32 and got.shape == (-(-n * target_sr // orig_sr),)
    np.testing.assert_array_equal(got, ref.load_wav(path, target_sr)[0].numpy())


# --- features ---------------------------------------------------------------------------------------


def _torch64_whisper(x: np.ndarray) -> np.ndarray:
    """The reference's Whisper log-mel with every op in float64."""
    wav = torch.from_numpy(x.astype(np.float64))[None]
    spec = torch.stft(wav, 400, 160, window=torch.hann_window(400, dtype=torch.float64), return_complex=True)
    filters = torch.from_numpy(librosa.filters.mel(sr=16000, n_fft=400, n_mels=128).astype(np.float64))
    log_spec = torch.clamp(filters @ spec[..., :-1].abs() ** 2, min=1e-10).log10()
    return ((torch.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0).numpy()


@pytest.mark.parametrize("signal", [tone_signal, speechlike_signal])
def test_whisper_log_mel_matches_reference(signal: Callable[..., np.ndarray]) -> None:
    x = signal(3 * 16000 + 123, 16000)
    got = rt.whisper_log_mel(x)
    assert got.shape == (1, 128, len(x) // 160) and got.dtype == np.float32
    # What is left is the reference's float32 STFT rounding: float64 torch agrees with us to 1e-6.
    assert _max_abs(got, ref.whisper_log_mel(torch.from_numpy(x)[None])) < 5e-5
    assert _max_abs(got, _torch64_whisper(x)) < 1e-6


@pytest.mark.parametrize("signal", [tone_signal, speechlike_signal])
def test_kaldi_fbank_matches_reference(signal: Callable[..., np.ndarray]) -> None:
    x = signal(2 * 16000 + 77, 16000)
    got = rt.kaldi_fbank(x)
    assert got.shape == (1 + (len(x) - 400) // 160, 80) and got.dtype == np.float32
    assert _max_abs(got, ref.kaldi_fbank(torch.from_numpy(x)[None])) < 1e-5
    np.testing.assert_allclose(got.mean(axis=0), 0.0, atol=1e-5)


def _assert_prompt_mel_close(got: np.ndarray, expected: torch.Tensor) -> None:
    """The reference's float32 STFT rounding grows in bins far below the frame's energy: near the 1e-5
    clamp (ln = -11.5) the two differ by up to ~2e-3, above ln = -8 by a few 1e-5 (up to 6.1e-5
    with the float32 kernels of a Xeon with AMX): the float64 comparison beside it is the exact one."""
    assert _max_abs(got, expected) < 3e-3
    loud = expected.numpy() > -8.0
    assert _max_abs(got[loud], expected.numpy()[loud]) < 1e-4


def _torch64_prompt_mel(x: np.ndarray) -> np.ndarray:
    """The reference's prompt mel with every op in float64."""
    wav = torch.from_numpy(x.astype(np.float64))[None, None]
    wav = torch.nn.functional.pad(wav, (720, 720), mode="reflect")[0]
    window = torch.hann_window(1920, dtype=torch.float64)
    spec = torch.stft(wav, 1920, 480, 1920, window=window, center=False, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    basis = torch.from_numpy(librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80).astype(np.float64))
    return torch.log(torch.clamp(basis @ magnitude, min=1e-5)).transpose(1, 2).numpy()


@pytest.mark.parametrize("signal", [tone_signal, speechlike_signal])
def test_prompt_mel_matches_reference(signal: Callable[..., np.ndarray]) -> None:
    x = signal(3 * 24000 + 311, 24000)
    got = rt.prompt_mel(x)
    assert got.shape == (1, len(x) // 480, 80) and got.dtype == np.float32
    _assert_prompt_mel_close(got, ref.prompt_mel(torch.from_numpy(x)[None], MelConfig()))
    assert _max_abs(got, _torch64_prompt_mel(x)) < 1e-6


@pytest.mark.parametrize("changes", [{"num_mels": 40}, {"fmax": 4000.0, "fmin": 50.0}, {"center": True},
                                     {"win_size": 1600}, {"n_fft": 1024, "win_size": 1024, "hop_size": 256}])
def test_prompt_mel_follows_its_config(changes: dict[str, object]) -> None:
    x = tone_signal(24000, 24000)
    got = rt.prompt_mel(x, rt.PromptMelConfig(**changes))  # type: ignore[arg-type]
    expected = ref.prompt_mel(torch.from_numpy(x)[None], MelConfig(**changes))  # type: ignore[arg-type]
    assert _max_abs(got, expected) < 2e-5


# --- prompt extraction ------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "sr", "signal"), [(1.0, 44100, tone_signal),
                                                       (3.7, 16000, speechlike_signal),
                                                       (2.3, 48000, speechlike_signal)])
def test_extract_prompt_matches_reference(tmp_path: Path, standin_paths: tuple[Path, Path], seconds: float,
                                          sr: int, signal: Callable[..., np.ndarray]) -> None:
    n = int(seconds * sr)
    path = tmp_path / "prompt.wav"
    sf.write(path, np.stack([signal(n, sr), 0.5 * signal(n, sr, seed=1)], axis=1), sr, subtype="FLOAT")
    campplus, tokenizer = (rt.open_session(p) for p in standin_paths)
    got = rt.extract_prompt(path, campplus, tokenizer, token_mel_ratio=2)
    expected = ref.extract_prompt(path, campplus, tokenizer, MelConfig(), token_mel_ratio=2)

    n_tokens = expected.speech_tokens.shape[1]
    assert got.speech_tokens.dtype == np.int64 and got.speech_tokens.shape == (1, n_tokens)
    np.testing.assert_array_equal(got.speech_tokens, expected.speech_tokens.numpy())
    assert got.mel.dtype == np.float32 and got.mel.shape == (1, 2 * n_tokens, 80)
    _assert_prompt_mel_close(got.mel, expected.mel)
    assert got.embedding.dtype == np.float32 and got.embedding.shape == (1, 192)
    assert _max_abs(got.embedding, expected.embedding) < 1e-5

