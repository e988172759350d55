"""The hift_f0 / hift_decoder export wrappers: spec I/O, the explicit harmonic phase, the real-valued
STFT, equality with `CausalHiFTGenerator.inference`, and a legacy-exporter round trip through
onnxruntime at the specs' validation cases."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn

import cosyvoice_graphs
from cosyvoice_export.bundle.prompt_wav import synth_prompt_wav
from cosyvoice_export.config import HiFTConfig, ModelConfig, tiny
from cosyvoice_export.nets.hift import CausalHiFTGenerator, init_random_
from cosyvoice_export.noise import noise_tables
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.wrappers.hift import HiFTDecoderGraph, HiFTF0Graph, RealSTFT, sine_phase
from cosyvoice_export.reference.frontend import prompt_mel
from cosyvoice_graphs import GraphSpec

U = 480  # samples per mel frame
GRAPHS = ("hift_f0", "hift_decoder")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return tiny(832)


@pytest.fixture(scope="module")
def hift(cfg: ModelConfig) -> CausalHiFTGenerator:
    model = CausalHiFTGenerator(cfg.hift).eval().requires_grad_(False)
    init_random_(model, _gen(0))
    return model


@pytest.fixture(scope="module")
def sine_waves(cfg: ModelConfig) -> Tensor:
    """The first 3000 frames of upstream's harmonic noise table (1, 3000*U, H)."""
    return noise_tables(cfg).sine_waves[:, : 3000 * U].clone()


@pytest.fixture(scope="module")
def speech_mel(cfg: ModelConfig) -> Tensor:
    """A realistic log-mel (1, 80, 225): the front end's mel of the synthetic 4.5 s prompt."""
    wav = torch.from_numpy(synth_prompt_wav(0))[None]  # (1, N) at 24 kHz
    return prompt_mel(wav, cfg.feat).transpose(1, 2).contiguous()


@pytest.fixture(scope="module")
def wrappers(hift: CausalHiFTGenerator) -> dict[str, nn.Module]:
    return {"hift_f0": HiFTF0Graph(hift).eval(), "hift_decoder": HiFTDecoderGraph(hift).eval()}


def _spec(name: str, cfg: ModelConfig) -> GraphSpec:
    return cosyvoice_graphs.spec(name, model_dims(cfg))


def _decoder_inputs(hift: CausalHiFTGenerator, mel: Tensor, f0: Tensor, noise: Tensor) -> tuple[Tensor, ...]:
    """hift_decoder's inputs for `mel` and `f0`: the phase from `sine_phase`, the table's prefix."""
    return mel, f0, sine_phase(f0, hift.cfg), noise[:, : U * mel.shape[2]]


def _feeds(name: str, s: GraphSpec, case: cosyvoice_graphs.Case, hift: CausalHiFTGenerator, noise: Tensor
           ) -> dict[str, np.ndarray]:
    """Spec sample inputs, made realistic where a uniform draw would be meaningless: the decoder gets
    the float32 predictor's f0 for its mel, that f0's phase and the noise table."""
    feeds = s.sample_inputs(case)
    if name == "hift_decoder":
        mel = torch.from_numpy(feeds["mel"])
        with torch.no_grad():
            f0 = HiFTF0Graph(hift)(mel)
        inputs = _decoder_inputs(hift, mel, f0, noise)
        feeds = {n: t.numpy() for n, t in zip(s.input_names, inputs, strict=True)}
    return feeds


def _run(module: nn.Module, s: GraphSpec, feeds: dict[str, np.ndarray]) -> Tensor:
    with torch.no_grad():
        return module(*(torch.from_numpy(feeds[n]) for n in s.input_names))


def _dynamic_axes(s: GraphSpec) -> dict[str, dict[int, str]]:
    """`dynamic_axes` for the legacy exporter: every symbolic dim of every input and output, by name."""
    return {t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
            for t in (*s.inputs, *s.outputs) if t.symbols()}


# --- spec I/O ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GRAPHS)
def test_wrappers_follow_the_spec(
    name: str, cfg: ModelConfig, hift: CausalHiFTGenerator, sine_waves: Tensor, wrappers: dict[str, nn.Module]
) -> None:
    s = _spec(name, cfg)
    module = wrappers[name]
    assert list(inspect.signature(module.forward).parameters) == s.input_names
    for case in (s.trace, *s.validate):
        out = _run(module, s, _feeds(name, s, case, hift, sine_waves))
        (want,) = s.outputs
        assert out.dtype == torch.float32
        assert tuple(out.shape) == s.shape_of(want, case.dims)


# --- the harmonic phase -----------------------------------------------------------------------------


def _f0_track(frames: int, seed: int) -> Tensor:
    """A long voiced f0 contour (1, frames) in Hz around 180 Hz, with an unvoiced stretch."""
    t = torch.arange(frames, dtype=torch.float32)
    f0 = 180 + 60 * torch.sin(t / 40) + 5 * torch.randn(frames, generator=_gen(seed))
    f0[300:340] = 0.0
    return f0[None]


def _numpy_phase(f0: np.ndarray, cfg: HiFTConfig) -> np.ndarray:
    """The runtime's numpy mirror of `sine_phase` (its docstring's formula)."""
    k = np.arange(1, cfg.nb_harmonics + 2, dtype=np.float32)
    rad = np.mod(f0[..., None] * k / np.float32(cfg.sampling_rate), np.float32(1))
    acc = np.cumsum(rad, axis=1, dtype=np.float64).astype(np.float32)
    p = acc * np.float32(2) * np.float32(np.pi) * np.float32(cfg.upsample_scale)
    return np.fmod(p.astype(np.float64), 2 * np.pi).astype(np.float32)


def _upstream_sine(f0: Tensor, cfg: HiFTConfig) -> Tensor:
    """sin of SineGen2's per-frame float32 phase, op for op as upstream (and `SourceModuleHnNSF`)."""
    fn = f0.unsqueeze(-1) * torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32)  # (1, T, H)
    rad = (fn / cfg.sampling_rate) % 1
    phase = torch.cumsum(rad, dim=1) * 2 * np.pi
    return torch.sin(phase * cfg.upsample_scale)  # (1, T, H)


def test_sine_phase_formula(cfg: ModelConfig) -> None:
    f0 = _f0_track(1500, 1)
    phase = sine_phase(f0, cfg.hift)
    assert phase.shape == (1, 1500, 9) and phase.dtype == torch.float32
    assert phase.min() >= 0 and phase.max() <= np.float32(2 * np.pi)
    # The numpy mirror gives the same bits.
    np.testing.assert_array_equal(phase.numpy(), _numpy_phase(f0.numpy(), cfg.hift))

    # Independent float64 math: 2π·U·cumsum((f0·k/sr) mod 1). It differs from the float32 products
    # that `sine_phase` reproduces by their rounding only: a few float32 ulps of the unreduced phase.
    f64 = f0[0].double().numpy()[:, None] * np.arange(1, 10)  # (T, H)
    exact = 2 * np.pi * U * np.cumsum(np.mod(f64 / 24000, 1), axis=0)
    diff = np.angle(np.exp(1j * (phase[0].double().numpy() - exact)))
    assert np.all(np.abs(diff) <= exact * 2.0**-21 + 1e-6)
    assert np.abs(diff).max() > 1e-3  # the rounding is real: exact math is not upstream's phase


def test_sine_phase_keeps_upstream_sine_on_long_tracks(cfg: ModelConfig) -> None:
    f0 = _f0_track(1500, 2)
    upstream = _upstream_sine(f0, cfg.hift).numpy()
    ours = torch.sin(sine_phase(f0, cfg.hift)).numpy()
    np.testing.assert_allclose(ours, upstream, rtol=0, atol=1e-6)

    # What a float32 graph would compute: a float32 running sum drifts from upstream's (float64)
    # one, visibly within seconds and by ~0.2 in sin() after 30 s.
    k = np.arange(1, 10, dtype=np.float32)
    rad = np.mod(f0.numpy()[..., None] * k / np.float32(24000), np.float32(1))  # (1, T, H)
    drifting = np.sin(np.cumsum(rad, axis=1) * np.float32(2) * np.float32(np.pi) * np.float32(U))
    error = np.abs(drifting - upstream)[0].max(axis=1)  # (T,)
    assert error[:100].max() < 0.02
    assert error.max() > 0.1
    # And so would exact math: upstream's phase is the float32 products' value, not 2π·U·sum.
    exact = np.sin(2 * np.pi * U * np.cumsum(rad.astype(np.float64), axis=1))
    assert np.abs(exact - upstream).max() > 0.01


# --- the real-valued STFT ---------------------------------------------------------------------------


def test_real_stft_matches_torch_stft(hift: CausalHiFTGenerator) -> None:
    transform = RealSTFT(hift.stft_window, hift.cfg.istft_hop_len)
    x = torch.randn(2, U * 7, generator=_gen(3))
    real, imag = transform.stft(x)
    want_real, want_imag = hift.source_stft(x)
    assert real.shape == want_real.shape == (2, 9, U * 7 // 4 + 1)
    torch.testing.assert_close(real, want_real, rtol=0, atol=1e-5)
    torch.testing.assert_close(imag, want_imag, rtol=0, atol=1e-5)
    assert torch.equal(imag[:, [0, 8]], torch.zeros_like(imag[:, [0, 8]]))  # DC and Nyquist are real

    # Typical decoder magnitudes, then magnitudes clipped at 100 (waveform values up to ~50).
    phase = 6 * torch.rand(2, 9, 60, generator=_gen(4)) - 3
    for magnitude in (torch.exp(0.6 * torch.randn(2, 9, 60, generator=_gen(5))),
                      150 * torch.rand(2, 9, 60, generator=_gen(6))):
        want = hift.istft(magnitude, phase)
        got = transform.istft(magnitude, phase)
        assert got.shape == want.shape == (2, 4 * 59)
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


# --- equality with the torch vocoder ----------------------------------------------------------------


def test_f0_graph_drift_from_float64_predictor(hift: CausalHiFTGenerator, speech_mel: Tensor) -> None:
    f0_graph = HiFTF0Graph(hift)
    for mel in (speech_mel, -5 + 2 * torch.randn(1, 80, 300, generator=_gen(7))):
        frames = mel.shape[2]
        want = hift.predict_f0(mel)
        got = f0_graph(mel)
        assert got.shape == (1, frames)
        assert want.min() > 80  # voiced: the drift is measured where it matters
        # float32 vs float64: measured up to ~1.2e-4 Hz here and ~2.8e-4 Hz at full size.
        assert (got - want).abs().max() < 2e-3
        # Non-final: the first frames - 3 saw real look-ahead only.
        non_final = hift.predict_f0(mel, finalize=False)
        assert torch.equal(want[:, : frames - 3], non_final)
        assert (got[:, : frames - 3] - non_final).abs().max() < 2e-3


def test_chain_equals_inference(
    hift: CausalHiFTGenerator, speech_mel: Tensor, sine_waves: Tensor, wrappers: dict[str, nn.Module]
) -> None:
    decoder, f0_graph = wrappers["hift_decoder"], wrappers["hift_f0"]
    mel = speech_mel[:, :, 20:160]  # (1, 80, 140)
    want = hift.inference(mel, sine_waves, finalize=True)
    assert want.std() > 0.01
    with torch.no_grad():
        exact_f0 = decoder(*_decoder_inputs(hift, mel, hift.predict_f0(mel), sine_waves))
        graph_f0 = decoder(*_decoder_inputs(hift, mel, f0_graph(mel), sine_waves))
    assert exact_f0.shape == want.shape == (1, U * 140)
    # With upstream's f0, only the reduced phase and the real STFT round differently.
    torch.testing.assert_close(exact_f0, want, rtol=0, atol=1e-5)
    # The float32 f0 moves the float32 phase by a few of its ulps (upstream's own sensitivity):
    # measured L1 5e-6, max 2e-4 on 140 frames; 30 s at full size give L1 2.5e-4, max 7e-3.
    error = (graph_f0 - want).abs()
    assert error.mean() < 1e-4 and error.max() < 5e-3


@pytest.mark.parametrize("frames", [12, 37, 90])
def test_non_final_call_is_a_prefix(
    frames: int, hift: CausalHiFTGenerator, speech_mel: Tensor, sine_waves: Tensor,
    wrappers: dict[str, nn.Module],
) -> None:
    mel = speech_mel[:, :, 30 : 30 + frames]
    want = hift.inference(mel, sine_waves, finalize=False)
    assert want.shape == (1, U * (frames - 8))
    with torch.no_grad():
        f0 = wrappers["hift_f0"](mel)
        got = wrappers["hift_decoder"](*_decoder_inputs(hift, mel, f0, sine_waves))
        exact = wrappers["hift_decoder"](*_decoder_inputs(hift, mel, hift.predict_f0(mel), sine_waves))
    torch.testing.assert_close(exact[:, : want.shape[1]], want, rtol=0, atol=1e-5)
    assert (got[:, : want.shape[1]] - want).abs().max() < 5e-3


# --- ONNX export ------------------------------------------------------------------------------------


def _export(module: nn.Module, s: GraphSpec, feeds: dict[str, np.ndarray], path: Path) -> None:
    args = tuple(torch.from_numpy(feeds[n]) for n in s.input_names)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and constant-folding notes
        torch.onnx.export(
            module, args, str(path), dynamo=False, opset_version=s.opset, input_names=s.input_names,
            output_names=s.output_names, dynamic_axes=_dynamic_axes(s),
        )


@pytest.mark.parametrize("name", GRAPHS)
def test_onnxruntime_matches_torch(
    name: str, cfg: ModelConfig, hift: CausalHiFTGenerator, sine_waves: Tensor,
    wrappers: dict[str, nn.Module], tmp_path: Path,
) -> None:
    s = _spec(name, cfg)
    module = wrappers[name]
    path = tmp_path / f"{name}.onnx"
    _export(module, s, _feeds(name, s, s.trace, hift, sine_waves), path)

    model = onnx.load(str(path))
    assert model.ir_version <= 10  # onnxruntime 1.31 loads IR <= 10
    assert [i.name for i in model.graph.input] == s.input_names
    assert [o.name for o in model.graph.output] == s.output_names
    # Exporting neither folded the caller's weight norm nor left the real STFT on its vocoder.
    assert hasattr(hift.conv_pre, "parametrizations")
    assert "istft" not in vars(hift) and "source_stft" not in vars(hift)

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for case in s.validate:
        feeds = _feeds(name, s, case, hift, sine_waves)
        (got,) = session.run(None, feeds)
        want = _run(module, s, feeds).numpy()
        assert got.shape == want.shape
        for out in s.output_names:
            tol = s.tolerances[out]
            error = tol.measure(got, want)
            assert error <= tol.bound, f"{name}.{out} at {dict(case.dims)}: {tol.metric} {error:.3g}"
            assert np.abs(got - want).max() < 1e-3  # far inside: measured ~1e-6 (waveform), ~1e-4 Hz (f0)
