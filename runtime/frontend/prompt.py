"""Prompt recording -> speech tokens, prompt mel and x-vector (upstream `frontend_zero_shot`'s audio half).

The two third-party ONNX models are called the way upstream calls them, by input/output position
rather than by name (their names are not part of any contract we control):

- `speech_tokenizer_v3.onnx`: input 0 = Whisper log-mel (1, 128, T) float32, input 1 = [T] int32;
  output 0, whatever its rank and integer type, flattened to the token sequence.
- `campplus.onnx`: input 0 = mean-normalised Kaldi fbank (1, T, 80) float32; output 0 flattened to
  the x-vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self, TypeVar

import numpy as np
import onnxruntime

from ..errors import FrontendError
from .audio import SPEECH_SAMPLE_RATE, PromptAudio, check_tokenizer_length, read_prompt_audio, resample
from .features import PromptMelConfig, kaldi_fbank, prompt_mel, whisper_log_mel


def open_session(path: str | Path) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session with upstream's options (ORT_ENABLE_ALL, one intra-op thread)."""
    opts = onnxruntime.SessionOptions()
    opts.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def speech_tokens(session: onnxruntime.InferenceSession, wav16k: np.ndarray) -> np.ndarray:
    """Speech tokens of 16 kHz mono audio (N,) -> int64 (1, n_tokens).

    Audio over 30 s is refused with a `FrontendError`, as upstream asserts.
    """
    check_tokenizer_length(wav16k.shape[0] / SPEECH_SAMPLE_RATE, "prompt audio")
    feat = whisper_log_mel(wav16k, n_mels=128)  # (1, 128, T)
    inputs = session.get_inputs()
    length = np.array([feat.shape[2]], dtype=np.int32)
    out = session.run(None, {inputs[0].name: feat, inputs[1].name: length})[0]
    return np.asarray(out).reshape(1, -1).astype(np.int64)


def source_speech_tokens(source: PromptAudio, session: onnxruntime.InferenceSession) -> np.ndarray:
    """A voice conversion's source recording -> its speech tokens int64 (1, n) (upstream's `frontend_vc`)."""
    tokens = speech_tokens(session, resample(source.samples, source.sample_rate, SPEECH_SAMPLE_RATE))
    if tokens.shape[1] == 0:
        raise FrontendError(f"{source.source} gives no speech tokens")
    return tokens


def speaker_embedding(session: onnxruntime.InferenceSession, wav16k: np.ndarray) -> np.ndarray:
    """CAM++ x-vector of 16 kHz mono audio (N,) -> float32 (1, D), D = 192 for `campplus.onnx`."""
    feat = kaldi_fbank(wav16k)[None]  # (1, T, 80)
    out = session.run(None, {session.get_inputs()[0].name: feat})[0]
    return np.asarray(out, dtype=np.float32).reshape(1, -1)


class _Sliceable(Protocol):
    """An array that numpy and torch slice alike (the torch reference cuts its tensors here too)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: tuple[slice, slice], /) -> Self: ...


_Mel = TypeVar("_Mel", bound=_Sliceable)
_Tokens = TypeVar("_Tokens", bound=_Sliceable)


def align_prompt(mel: _Mel, tokens: _Tokens, token_mel_ratio: int) -> tuple[_Mel, _Tokens]:
    """Cut prompt mel (1, T, C) and tokens (1, N) to n = min(T // ratio, N) tokens and ratio * n frames.

    Both are cut at the tail; the cut tokens serve the LLM prompt and the flow prompt alike.
    """
    n = min(mel.shape[1] // token_mel_ratio, tokens.shape[1])
    return mel[:, : token_mel_ratio * n], tokens[:, :n]


@dataclass(frozen=True)
class PromptFeatures:
    """Everything the networks take from a prompt recording."""

    speech_tokens: np.ndarray
    """int64 (1, n): speech tokens, cut to the mel alignment (a voice conversion's prompt: as extracted)."""
    mel: np.ndarray
    """float32 (1, token_mel_ratio * n, 80): prompt mel at 50 Hz (a voice conversion's prompt: as extracted,
    at most `token_mel_ratio * n` frames)."""
    embedding: np.ndarray
    """float32 (1, 192): CAM++ x-vector (the flow's speaker embedding)."""


def extract_prompt(
    prompt: str | Path | PromptAudio,
    campplus_session: onnxruntime.InferenceSession,
    tokenizer_session: onnxruntime.InferenceSession,
    token_mel_ratio: int = 2,
    mel_config: PromptMelConfig | None = None,
    *,
    aligned: bool = True,
) -> PromptFeatures:
    """Compute a prompt recording's aligned speech tokens, prompt mel and x-vector (`aligned=False`: as
    upstream's `frontend_vc`, the mel and tokens as extracted, neither cut).

    `prompt` is a file to read (`read_prompt_audio`) or audio read already. It is resampled to 16 kHz
    (tokens, x-vector) and to `mel_config.sampling_rate` (mel; `mel_config` defaults to CosyVoice3's
    settings). Raises `FrontendError` (one line, naming the file) for an unreadable file, a sample rate
    under 16 kHz, under 0.5 s or over 30 s of audio, silence, or audio that gives no speech tokens.
    """
    mel_config = mel_config or PromptMelConfig()
    audio = prompt if isinstance(prompt, PromptAudio) else read_prompt_audio(prompt)
    wav16k = resample(audio.samples, audio.sample_rate, SPEECH_SAMPLE_RATE)
    wav_mel = resample(audio.samples, audio.sample_rate, mel_config.sampling_rate)
    tokens = speech_tokens(tokenizer_session, wav16k)
    mel = prompt_mel(wav_mel, mel_config)
    if aligned:
        mel, tokens = align_prompt(mel, tokens, token_mel_ratio)
    if tokens.shape[1] == 0:
        raise FrontendError(f"{audio.source} gives no speech tokens")
    embedding = speaker_embedding(campplus_session, wav16k)
    return PromptFeatures(speech_tokens=tokens, mel=mel, embedding=embedding)
