"""Tests of the reference prompt front end against independent numpy formulas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime
import soundfile as sf
import torch
from onnx import TensorProto, helper

from cosyvoice_export.bundle.errors import BundleError
from cosyvoice_export.config import MelConfig
from cosyvoice_export.reference import frontend as fe
from cosyvoice_runtime.frontend import align_prompt, open_session

# --- independent numpy references -------------------------------------------------------------------


def _slaney_mel(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Slaney-style mel filterbank (Auditory Toolbox scale, area-normalised), written from its definition."""
    fmax = sr / 2 if fmax is None else fmax
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-12) / min_log_hz) / logstep,
                        f / f_sp)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)

    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    lower = (freqs[None, :] - edges[:-2, None]) / (edges[1:-1] - edges[:-2])[:, None]
    upper = (edges[2:, None] - freqs[None, :]) / (edges[2:] - edges[1:-1])[:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def _periodic_hann(n: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    count = 1 + (len(x) - size) // hop
    return np.stack([x[i * hop: i * hop + size] for i in range(count)])


def _np_whisper(x: np.ndarray) -> np.ndarray:
    padded = np.pad(x.astype(np.float64), 200, mode="reflect")
    spec = np.fft.rfft(_frames(padded, 400, 160) * _periodic_hann(400), axis=1)
    power = (np.abs(spec) ** 2)[:-1].T
    log_spec = np.log10(np.maximum(_slaney_mel(16000, 400, 128) @ power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _np_prompt_mel(x: np.ndarray) -> np.ndarray:
    padded = np.pad(x.astype(np.float64), 720, mode="reflect")
    spec = np.fft.rfft(_frames(padded, 1920, 480) * _periodic_hann(1920), axis=1)
    mag = np.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    return np.log(np.maximum(mag @ _slaney_mel(24000, 1920, 80).T, 1e-5))


def _np_kaldi_fbank(x: np.ndarray) -> np.ndarray:
    """Kaldi fbank (povey window, power spectrum, 80 bins 20 Hz..Nyquist), no mean subtraction."""
    frames = _frames(x.astype(np.float64), 400, 160)
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - 0.97 * previous
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    power = np.abs(np.fft.rfft(frames * povey, n=512, axis=1)) ** 2

    def mel(f: np.ndarray | float) -> np.ndarray:
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    lo, hi = mel(20.0), mel(8000.0)
    delta = (hi - lo) / 81
    fft_mel = mel(np.arange(256) * 16000 / 512)
    banks = np.zeros((80, 257))
    for b in range(80):
        left, center, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        inside = (fft_mel > left) & (fft_mel < right)
        rising = (fft_mel - left) / (center - left)
        falling = (right - fft_mel) / (right - center)
        banks[b, :256] = np.where(inside, np.where(fft_mel <= center, rising, falling), 0.0)
    return np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))


def _test_signal(n: int, sr: int, seed: int = 0) -> np.ndarray:
    """Two tones, a chirp and a little noise, peak well under 1."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1870 * t + 0.3)
         + 0.1 * np.sin(2 * np.pi * (200 + 1500 * t) * t) + 0.01 * rng.standard_normal(n))
    return x.astype(np.float32)


# --- features ---------------------------------------------------------------------------------------


def test_whisper_log_mel_matches_numpy() -> None:
    x = _test_signal(16000 + 123, 16000)
    got = fe.whisper_log_mel(torch.from_numpy(x)[None])
    assert got.shape == (1, 128, len(x) // 160)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got[0].numpy(), _np_whisper(x), atol=2e-4, rtol=0)


def test_whisper_log_mel_floor_is_max_minus_8() -> None:
    x = _test_signal(8000, 16000)
    x[4000:] = 0.0  # silence falls far below the utterance max and must be floored
    got = fe.whisper_log_mel(torch.from_numpy(x)[None])[0].numpy()
    top = got.max()
    assert got.min() == pytest.approx(top - 2.0, abs=1e-6)  # floor (max - 8) after the /4 scaling
    assert (got[:, -10:] == got.min()).all()


def test_prompt_mel_matches_numpy() -> None:
    x = _test_signal(24000 + 311, 24000)
    got = fe.prompt_mel(torch.from_numpy(x)[None], MelConfig())
    assert got.shape == (1, len(x) // 480, 80)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got[0].numpy(), _np_prompt_mel(x), atol=1e-4, rtol=0)


def test_prompt_mel_basis_follows_config_not_a_cache() -> None:
    x = torch.from_numpy(_test_signal(9600, 24000))[None]
    full = fe.prompt_mel(x, MelConfig())
    narrow = fe.prompt_mel(x, MelConfig(num_mels=40))  # same fmax (None): upstream's cache would collide
    assert full.shape == (1, 20, 80)
    assert narrow.shape == (1, 20, 40)
    low = fe.prompt_mel(x, MelConfig(fmax=4000.0))
    assert not torch.allclose(low, full)


def test_kaldi_fbank_frames_mean_and_values() -> None:
    x = _test_signal(16000 + 77, 16000, seed=1)
    got = fe.kaldi_fbank(torch.from_numpy(x)[None])
    assert got.shape == (1 + (len(x) - 400) // 160, 80)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.mean(dim=0).numpy(), 0.0, atol=1e-5)
    raw = _np_kaldi_fbank(x)
    ref = raw - raw.mean(axis=0, keepdims=True)
    np.testing.assert_allclose(got[37].numpy(), ref[37], atol=1e-3, rtol=0)
    # float32 FFT noise dominates bands whose energy is ~1e-6 of the frame's; elsewhere agreement is tight
    np.testing.assert_allclose(got.numpy(), ref, atol=2e-3, rtol=0)
    strong = raw > -10.0
    assert strong.mean() > 0.9
    np.testing.assert_allclose(got.numpy()[strong], ref[strong], atol=3e-4, rtol=0)


def test_kaldi_fbank_is_not_int16_scaled() -> None:
    """A near-silent stretch hits the float32-eps log floor only when the waveform stays in [-1, 1]; with
    int16 scaling it would not, and the mean-normalised features would differ there."""
    x = _test_signal(8000, 16000, seed=2)
    x[4000:] = 1e-6 * np.random.default_rng(4).standard_normal(4000).astype(np.float32)
    got = fe.kaldi_fbank(torch.from_numpy(x)[None]).numpy()
    raw = _np_kaldi_fbank(x)
    assert np.allclose(raw[-5:], math.log(float(np.finfo(np.float32).eps)))  # -15.942
    np.testing.assert_allclose(got, raw - raw.mean(axis=0), atol=2e-3, rtol=0)
    scaled = _np_kaldi_fbank(x * 32768.0)
    assert np.abs(got - (scaled - scaled.mean(axis=0))).max() > 1.0


# --- audio I/O --------------------------------------------------------------------------------------


def _peak_hz(x: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * sr / len(x))


@pytest.mark.parametrize(("orig_sr", "target_sr"),
                         [(44100, 16000), (48000, 24000), (16000, 24000), (22050, 16000)])
def test_load_wav_resamples_length_and_frequency(tmp_path: Path, orig_sr: int, target_sr: int) -> None:
    n = orig_sr + 17
    x = (0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(n) / orig_sr)).astype(np.float32)
    path = tmp_path / "tone.wav"
    sf.write(path, x, orig_sr, subtype="FLOAT")
    y = fe.load_wav(path, target_sr)
    assert y.shape == (1, math.ceil(n * target_sr / orig_sr))
    assert y.dtype == torch.float32
    assert _peak_hz(y[0].numpy(), target_sr) == pytest.approx(1000.0, abs=1.5)
    mid = y[0, target_sr // 4: 3 * target_sr // 4].numpy()
    assert np.abs(mid).max() == pytest.approx(0.5, abs=5e-3)


def test_load_wav_same_rate_is_untouched(tmp_path: Path) -> None:
    pcm = (np.arange(-500, 500) * 37).astype(np.int16)
    path = tmp_path / "pcm.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    y = fe.load_wav(path, 16000)
    np.testing.assert_array_equal(y[0].numpy(), pcm.astype(np.float32) / 32768.0)


def test_load_wav_averages_channels_before_resampling(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    stereo = (0.4 * rng.standard_normal((4800, 2))).astype(np.float32)
    sf.write(tmp_path / "st16.wav", stereo, 16000, subtype="FLOAT")
    got = fe.load_wav(tmp_path / "st16.wav", 16000)
    np.testing.assert_array_equal(got[0].numpy(), (stereo[:, 0] + stereo[:, 1]) / np.float32(2))

    mono = (stereo[:, 0] + stereo[:, 1]) / np.float32(2)
    sf.write(tmp_path / "st48.wav", stereo, 48000, subtype="FLOAT")
    sf.write(tmp_path / "mo48.wav", mono, 48000, subtype="FLOAT")
    np.testing.assert_array_equal(fe.load_wav(tmp_path / "st48.wav", 24000).numpy(),
                                  fe.load_wav(tmp_path / "mo48.wav", 24000).numpy())


def test_load_wav_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.wav"
    path.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(BundleError) as info:
        fe.load_wav(path, 16000)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="missing.wav"):
        fe.load_wav(tmp_path / "missing.wav", 16000)


def test_load_wav_refuses_8khz(tmp_path: Path) -> None:
    path = tmp_path / "narrow.wav"
    sf.write(path, np.zeros(8000, dtype=np.float32), 8000)
    with pytest.raises(BundleError) as info:
        fe.load_wav(path, 24000)
    message = str(info.value)
    assert str(path) in message and "8000" in message and "\n" not in message


# --- prompt alignment (the runtime's helper, on the reference's tensors) -----------------------------


def test_align_prompt_cuts_tails() -> None:
    mel = torch.arange(11 * 80, dtype=torch.float32).reshape(1, 11, 80)
    tokens = torch.arange(7).reshape(1, 7)
    m, t = align_prompt(mel, tokens, 2)  # mel-limited: n = min(5, 7)
    assert m.shape == (1, 10, 80) and t.shape == (1, 5)
    assert torch.equal(m, mel[:, :10]) and torch.equal(t, tokens[:, :5])

    m, t = align_prompt(mel, tokens[:, :3], 2)  # token-limited: n = min(5, 3)
    assert m.shape == (1, 6, 80) and torch.equal(t, tokens[:, :3])

    m, t = align_prompt(mel, tokens, 3)  # the ratio is honoured: n = min(3, 7)
    assert m.shape == (1, 9, 80) and t.shape == (1, 3)


# --- ONNX calling convention ------------------------------------------------------------------------


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    # IR 8 keeps the file loadable by older onnxruntime builds than the onnx package writes for
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _tokenizer_model(path: Path) -> None:
    """Input 0 'zz_feats' (1,128,T) float, input 1 'aa_len' [1] int32 (names sort opposite to position);
    output 0 (1,1,T) int64, every entry = the length input; a second output that must be ignored."""
    feats = helper.make_tensor_value_info("zz_feats", TensorProto.FLOAT, [1, 128, "T"])
    length = helper.make_tensor_value_info("aa_len", TensorProto.INT32, [1])
    out = helper.make_tensor_value_info("codes", TensorProto.INT64, [1, 1, "T"])
    other = helper.make_tensor_value_info("aux", TensorProto.FLOAT, [1, 128, "T"])
    nodes = [
        helper.make_node("ReduceMax", ["zz_feats", "axes"], ["mx"], keepdims=1),
        helper.make_node("Mul", ["mx", "zero"], ["zeros"]),
        helper.make_node("Cast", ["aa_len"], ["len_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["zeros", "len_f"], ["filled"]),
        helper.make_node("Cast", ["filled"], ["codes"], to=TensorProto.INT64),
        helper.make_node("Identity", ["zz_feats"], ["aux"]),
    ]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]
    graph = helper.make_graph(nodes, "tok", [feats, length], [out, other], initializer=inits)
    onnx.save(_model(graph), path)


def _campplus_model(path: Path) -> None:
    """Input 0 'x_in' (1,T,80) float; output 0 (1,1,80) = max over time."""
    x = helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1, "T", 80])
    out = helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 1, 80])
    node = helper.make_node("ReduceMax", ["x_in", "axes"], ["emb"], keepdims=1)
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [1])]
    graph = helper.make_graph([node], "spk", [x], [out], initializer=inits)
    onnx.save(_model(graph), path)


@pytest.fixture()
def sessions(tmp_path: Path) -> tuple[onnxruntime.InferenceSession, onnxruntime.InferenceSession]:
    _tokenizer_model(tmp_path / "tok.onnx")
    _campplus_model(tmp_path / "spk.onnx")
    return open_session(tmp_path / "tok.onnx"), open_session(tmp_path / "spk.onnx")


def test_speech_tokens_feed_by_position(sessions: tuple[onnxruntime.InferenceSession, ...]) -> None:
    tok, _ = sessions
    wav = torch.from_numpy(_test_signal(16000 + 500, 16000))[None]
    got = fe.speech_tokens(tok, wav)
    frames = wav.shape[1] // 160
    assert got.shape == (1, frames)
    assert got.dtype == torch.int64
    assert (got == frames).all()


def test_speech_tokens_refuses_over_30s(sessions: tuple[onnxruntime.InferenceSession, ...]) -> None:
    tok, _ = sessions
    with pytest.raises(BundleError, match="30"):
        fe.speech_tokens(tok, torch.zeros(1, 30 * 16000 + 1))


def test_speaker_embedding_feed_by_position(sessions: tuple[onnxruntime.InferenceSession, ...]) -> None:
    _, spk = sessions
    wav = torch.from_numpy(_test_signal(8000, 16000))[None]
    got = fe.speaker_embedding(spk, wav)
    assert got.shape == (1, 80)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], fe.kaldi_fbank(wav).max(dim=0).values)


def test_extract_prompt(tmp_path: Path, sessions: tuple[onnxruntime.InferenceSession, ...]) -> None:
    tok, spk = sessions
    x = _test_signal(44100, 44100)
    path = tmp_path / "prompt.wav"
    sf.write(path, np.stack([x, 0.5 * x], axis=1), 44100, subtype="FLOAT")
    feats = fe.extract_prompt(path, spk, tok, MelConfig(), token_mel_ratio=2)
    # 1 s: 100 whisper frames -> 100 tokens from the fake tokenizer; 50 mel frames -> n = 25
    assert feats.speech_tokens.shape == (1, 25) and (feats.speech_tokens == 100).all()
    assert feats.mel.shape == (1, 50, 80)
    wav24 = fe.load_wav(path, 24000)
    assert torch.equal(feats.mel, fe.prompt_mel(wav24, MelConfig()))
    assert torch.equal(feats.embedding, fe.speaker_embedding(spk, fe.load_wav(path, 16000)))


# --- text formats -----------------------------------------------------------------------------------
