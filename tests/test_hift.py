"""CausalHiFTGenerator: checkpoint layout, causal convs, STFT/ISTFT, NSF source, streaming, weight norm."""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import scipy.signal
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_export.config import full_size, tiny
from cosyvoice_export.nets.causal_conv import (
    CausalConv1d,
    CausalConv1dDownSample,
    CausalConv1dUpsample,
    Snake,
    repeat_frames,
)
from cosyvoice_export.nets.hift import (
    CausalConvRNNF0Predictor,
    CausalHiFTGenerator,
    SourceModuleHnNSF,
    hift_layout,
    init_random_,
    normalize_hift_state_dict,
)

MANIFEST = Path(__file__).parent / "data" / "upstream_manifest" / "hift.tsv"
U = 480  # samples per mel frame


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mel(frames: int, seed: int) -> torch.Tensor:
    """Log-mel-like input: mean -5, std 2."""
    return -5 + 2 * torch.randn(1, 80, frames, generator=_gen(seed))


@pytest.fixture(scope="module")
def hift() -> CausalHiFTGenerator:
    model = CausalHiFTGenerator(tiny(64).hift).eval()
    init_random_(model, _gen(0))
    return model


@pytest.fixture(scope="module")
def sine_noise() -> torch.Tensor:
    return torch.rand(1, U * 50, 9, generator=_gen(1))


# --- checkpoint layout -------------------------------------------------------------------------------------


def test_full_size_state_dict_equals_upstream_manifest() -> None:
    with torch.device("meta"):
        model = CausalHiFTGenerator(full_size().hift)
    expected = []
    for line in MANIFEST.read_text().splitlines():
        key, shape, dtype = line.split("\t")
        expected.append((key, json.loads(shape), dtype))
    got = [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()]
    assert len(expected) == 328
    assert got == expected


# --- causal primitives -------------------------------------------------------------------------------------


def test_causal_conv_left_right_and_context() -> None:
    x = torch.randn(2, 3, 20, generator=_gen(2))
    for kernel, dilation in [(3, 1), (3, 5), (4, 1), (7, 3)]:
        pad = (kernel - 1) * dilation
        for side in ("left", "right"):
            conv = CausalConv1d(3, 5, kernel, dilation=dilation, causal_type=side)
            assert conv.causal_padding == pad
            padded = F.pad(x, (pad, 0) if side == "left" else (0, pad))
            ref = F.conv1d(padded, conv.weight, conv.bias, dilation=dilation)
            torch.testing.assert_close(conv(x), ref, rtol=0, atol=0)
        # Real context on the right gives the outputs a longer input would give at those positions.
        right = CausalConv1d(3, 5, kernel, dilation=dilation, causal_type="right")
        torch.testing.assert_close(right(x[..., :-pad], x[..., -pad:]), right(x)[..., :-pad])
        left = CausalConv1d(3, 5, kernel, dilation=dilation, causal_type="left")
        torch.testing.assert_close(left(x[..., pad:], x[..., :pad]), left(x)[..., pad:])
    with pytest.raises(ValueError):
        CausalConv1d(3, 5, 4, dilation=2)


def test_the_layout_has_the_networks_kernels() -> None:
    """The layout the exporter records (`hift_layout`) has the kernels of the network its config builds:
    the yaml's (test_runtime_vocoder_stream checks the bundle's against the configs) and those the
    architecture fixes (conv_post's, the F0 predictor's)."""
    for cfg in (full_size().hift, tiny(100).hift):
        layout, predictor = hift_layout(cfg), CausalConvRNNF0Predictor(cfg.f0)
        f0_convs = predictor.condnet[2::2]
        assert layout.f0_causal_kernel_sizes == tuple(c.kernel_size[0] for c in f0_convs)
        assert all(c.causal_type == "left" and c.dilation == (1,) for c in f0_convs)
        assert layout.f0_look_right == predictor.look_right == 3
        assert predictor.condnet[0].causal_type == "right"
    hift, layout = CausalHiFTGenerator(tiny(100).hift), hift_layout(tiny(100).hift)
    assert layout.conv_post_kernel_size == hift.conv_post.kernel_size[0]
    assert hift.conv_pre.causal_type == "right" and hift.conv_pre.causal_padding == layout.conv_pre_look_right


def test_downsample_and_upsample_convs() -> None:
    x = torch.randn(1, 18, 120 * 3 + 1, generator=_gen(3))
    for stride in (15, 3):
        down = CausalConv1dDownSample(18, 4, 2 * stride, stride)
        out = down(x)
        assert out.shape[-1] == 120 * 3 // stride
        ref = F.conv1d(F.pad(x, (stride - 1, 0)), down.weight, down.bias, stride=stride)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)

    y = torch.randn(1, 6, 9, generator=_gen(4))
    for stride, kernel in [(8, 16), (5, 11), (3, 7)]:
        up = CausalConv1dUpsample(6, 4, kernel, stride)
        assert up.weight.shape == (4, 6, kernel)  # a Conv1d weight, not ConvTranspose1d's (in, out, k)
        nearest = F.interpolate(y, scale_factor=stride, mode="nearest")
        ref = F.conv1d(F.pad(nearest, (kernel - 1, 0)), up.weight, up.bias)
        torch.testing.assert_close(up(y), ref, rtol=0, atol=0)
    for factor in (3, 5, 8, 480):
        nearest = F.interpolate(y, scale_factor=factor)
        torch.testing.assert_close(repeat_frames(y, factor), nearest, rtol=0, atol=0)


def test_snake_formula() -> None:
    snake = Snake(4)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.5, 1.0, 1.7, 3.0]))
    x = torch.randn(2, 4, 11, generator=_gen(5))
    a = snake.alpha.detach().numpy()[None, :, None].astype(np.float64)
    xn = x.numpy().astype(np.float64)
    ref = xn + np.sin(a * xn) ** 2 / (a + 1e-9)
    np.testing.assert_allclose(snake(x).detach().numpy(), ref, rtol=1e-6, atol=1e-6)


# --- STFT / ISTFT ------------------------------------------------------------------------------------------


def _np_window() -> np.ndarray:
    return scipy.signal.get_window("hann", 16, fftbins=True).astype(np.float32).astype(np.float64)


def _np_stft(x: np.ndarray) -> np.ndarray:
    """Centred (reflect pad 8), hop 4, periodic Hann 16, one-sided: (L,) -> (9, L/4 + 1)."""
    padded = np.pad(x, 8, mode="reflect")
    frames = np.stack([padded[i : i + 16] for i in range(0, len(padded) - 16 + 1, 4)], axis=1)  # (16, F)
    return np.fft.rfft(frames * _np_window()[:, None], axis=0)


def _np_istft(spec: np.ndarray) -> np.ndarray:
    """Weighted overlap-add with window-square normalisation, 8 samples trimmed at each end."""
    window = _np_window()
    frames = np.fft.irfft(spec, n=16, axis=0) * window[:, None]  # (16, F)
    n = 16 + 4 * (spec.shape[1] - 1)
    out, norm = np.zeros(n), np.zeros(n)
    for i in range(spec.shape[1]):
        out[4 * i : 4 * i + 16] += frames[:, i]
        norm[4 * i : 4 * i + 16] += window**2
    return out[8:-8] / norm[8:-8]


def test_stft_window_is_scipy_periodic_hann(hift: CausalHiFTGenerator) -> None:
    expected = scipy.signal.get_window("hann", 16, fftbins=True).astype(np.float32)
    np.testing.assert_array_equal(hift.stft_window.numpy(), expected)


def test_stft_and_istft_match_numpy(hift: CausalHiFTGenerator) -> None:
    x = torch.randn(1, U * 3, generator=_gen(6))
    real, imag = hift.source_stft(x)
    assert real.shape == (1, 9, U * 3 // 4 + 1)
    ref = _np_stft(x[0].double().numpy())
    np.testing.assert_allclose(real[0].numpy(), ref.real, atol=2e-5)
    np.testing.assert_allclose(imag[0].numpy(), ref.imag, atol=2e-5)

    # Magnitudes above 100 are clipped; phase is used as given.
    magnitude = 150 * torch.rand(1, 9, 40, generator=_gen(7))
    phase = 6 * torch.rand(1, 9, 40, generator=_gen(8)) - 3
    wav = hift.istft(magnitude, phase)
    assert wav.shape == (1, 4 * 39)
    mag = np.minimum(magnitude[0].double().numpy(), 100.0)
    ref_wav = _np_istft(mag * np.exp(1j * phase[0].double().numpy()))
    np.testing.assert_allclose(wav[0].numpy(), ref_wav, rtol=1e-4, atol=1e-4)

    # Round trip through magnitude/phase gives the signal back.
    back = hift.istft(torch.sqrt(real**2 + imag**2), torch.atan2(imag, real))
    torch.testing.assert_close(back, x, atol=1e-5, rtol=0)


# --- NSF source --------------------------------------------------------------------------------------------


def _sample_level_source(
    src: SourceModuleHnNSF, f0: torch.Tensor, table: torch.Tensor, rand_ini: torch.Tensor
) -> torch.Tensor:
    """Upstream's causal `SineGen2` source step by step at sample rate, with rand_ini added on sample 0."""
    f0_up = F.interpolate(f0[:, None], scale_factor=U).transpose(1, 2)  # (B, L, 1)
    fn = f0_up * torch.arange(1, 10, dtype=torch.float32)  # (B, L, 9)
    rad = (fn / 24000) % 1
    rad[:, 0, :] = rad[:, 0, :] + rand_ini
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / U, mode="linear").transpose(1, 2)  # (B, T, 9)
    phase = torch.cumsum(rad, dim=1) * 2 * math.pi
    phase = F.interpolate(phase.transpose(1, 2) * U, scale_factor=U, mode="nearest").transpose(1, 2)
    sines = torch.sin(phase) * 0.1
    uv = (f0_up > 10).float()
    noise_amp = uv * 0.003 + (1 - uv) * 0.1 / 3
    harm = sines * uv + noise_amp * table[:, : f0_up.shape[1]]
    return torch.tanh(src.l_linear(harm)).transpose(1, 2)  # (B, 1, L)


def test_source_matches_sample_level_formula_and_rand_ini_has_no_effect(hift: CausalHiFTGenerator) -> None:
    src = hift.m_source
    for batch, frames in [(1, 5), (1, 37), (2, 9)]:
        f0 = 80 + 220 * torch.rand(batch, frames, generator=_gen(frames))
        f0[:, ::4] = 0.0  # some unvoiced frames
        table = torch.rand(1, U * frames + 100, 9, generator=_gen(10 + frames))
        out = src(f0, table)
        assert out.shape == (batch, 1, U * frames)
        for seed in (0, 1):
            rand_ini = torch.rand(1, 9, generator=_gen(seed))
            rand_ini[:, 0] = 0
            # Bit-exact: same ops, and the same memory layout going into l_linear as upstream's.
            assert torch.equal(out, _sample_level_source(src, f0, table, rand_ini))


def test_sine_is_a_staircase(hift: CausalHiFTGenerator) -> None:
    """With the noise table zeroed, the excitation is constant within every 480-sample frame."""
    frames = 12
    f0 = 90 + 200 * torch.rand(1, frames, generator=_gen(11))
    out = hift.m_source(f0, torch.zeros(1, U * frames, 9))[0, 0].view(frames, U)
    assert torch.equal(out, out[:, :1].expand(frames, U))
    assert out[:, 0].std() > 1e-3  # but it does change from frame to frame


def test_noise_table_is_position_locked(hift: CausalHiFTGenerator, sine_noise: torch.Tensor) -> None:
    frames = 14
    mel = _mel(frames, 12)
    ref = hift.inference(mel, sine_noise, finalize=True)
    tail_changed = sine_noise.clone()
    tail_changed[:, U * frames :] = 0.5
    assert torch.equal(hift.inference(mel, tail_changed, finalize=True), ref)
    head_changed = sine_noise.clone()
    head_changed[:, 5] += 0.5
    assert not torch.equal(hift.inference(mel, head_changed, finalize=True), ref)


# --- decode ------------------------------------------------------------------------------------------------


def _reference_decode(h: CausalHiFTGenerator, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Upstream's `CausalHiFTGenerator.decode` (finalize=True) with functional ops and explicit pads, for the
    example yaml's layout."""

    def conv(m: nn.Conv1d, x: torch.Tensor, left: int = 0, right: int = 0) -> torch.Tensor:
        return F.conv1d(F.pad(x, (left, right)), m.weight, m.bias, stride=m.stride, dilation=m.dilation)

    def snake(act: Snake, x: torch.Tensor) -> torch.Tensor:
        alpha = act.alpha[None, :, None]
        return x + torch.sin(alpha * x) ** 2 / (alpha + 1e-9)

    def resblock(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        layers = zip(block.convs1, block.convs2, block.activations1, block.activations2, strict=True)
        for c1, c2, a1, a2 in layers:
            k = c1.kernel_size[0]
            y = conv(c1, snake(a1, x), left=(k - 1) * c1.dilation[0])
            x = x + conv(c2, snake(a2, y), left=k - 1)
        return x

    window = torch.from_numpy(scipy.signal.get_window("hann", 16, fftbins=True).astype(np.float32))
    spec = torch.stft(source[:, 0], 16, 4, 16, window=window, return_complex=True)
    s = torch.cat([spec.real, spec.imag], dim=1)  # (B, 18, 120T + 1)
    x = conv(h.conv_pre, mel, right=4)
    for i, rate in enumerate((8, 5, 3)):
        up = h.ups[i]
        x = F.leaky_relu(x, 0.1)
        x = conv(up, F.interpolate(x, scale_factor=rate, mode="nearest"), left=up.kernel_size[0] - 1)
        if i == 2:
            x = nn.ReflectionPad1d((1, 0))(x)
        down = h.source_downs[i]
        x = x + resblock(h.source_resblocks[i], conv(down, s, left=down.stride[0] - 1))
        x = (resblock(h.resblocks[3 * i], x) + resblock(h.resblocks[3 * i + 1], x)
             + resblock(h.resblocks[3 * i + 2], x)) / 3
    x = conv(h.conv_post, F.leaky_relu(x, 0.01), left=6)
    magnitude = torch.exp(x[:, :9]).clamp(max=100)
    phase = torch.sin(x[:, 9:])
    wav = torch.istft(torch.polar(magnitude, phase), 16, 4, 16, window=window)
    return wav.clamp(-0.99, 0.99)


def test_decode_matches_reference(hift: CausalHiFTGenerator, sine_noise: torch.Tensor) -> None:
    mel = _mel(18, 20)
    with torch.no_grad():
        source = hift.m_source(hift.predict_f0(mel), sine_noise)
        wav = hift.decode(mel, source)
        ref = _reference_decode(hift, mel, source)
    assert wav.shape == (1, U * 18)
    torch.testing.assert_close(wav, ref, rtol=0, atol=1e-5)
    assert ref.std() > 0.01


# --- streaming ---------------------------------------------------------------------------------------------


def test_full_size_non_final_prefix_is_bit_identical(sine_noise: torch.Tensor) -> None:
    """At full size `inference(finalize=False)` gives the final output's prefix bit for bit."""
    model = CausalHiFTGenerator(full_size().hift).eval()
    init_random_(model, _gen(0))
    mel = _mel(35, 21)
    final = model.inference(mel, sine_noise, finalize=True)
    for frames, samples in [(20, 5760), (35, 12960)]:
        chunk = model.inference(mel[:, :, :frames], sine_noise, finalize=False)
        assert chunk.shape == (1, samples)
        assert torch.equal(chunk, final[:, :samples])


def test_lengths_and_non_final_prefix(hift: CausalHiFTGenerator, sine_noise: torch.Tensor) -> None:
    mel = _mel(40, 13)
    full = hift.inference(mel, sine_noise, finalize=True)
    assert full.shape == (1, U * 40)
    for frames in (12, 21, 33):
        part = mel[:, :, :frames]
        final = hift.inference(part, sine_noise, finalize=True)
        chunk = hift.inference(part, sine_noise, finalize=False)
        assert final.shape == (1, U * frames)
        assert chunk.shape == (1, U * (frames - 8))
        n = chunk.shape[1]
        assert (chunk - final[:, :n]).abs().max() <= 1e-6
        assert (chunk - full[:, :n]).abs().max() <= 1e-6
        # The samples a non-final call withholds do change once real future frames arrive.
        assert (final[:, n:] - full[:, n : U * frames]).abs().max() > 1e-4


# --- weight norm -------------------------------------------------------------------------------------------


def _legacy_layout(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in sd.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        out[prefix + key] = value
    return out


def test_both_weight_norm_layouts_load_strictly(hift: CausalHiFTGenerator, sine_noise: torch.Tensor) -> None:
    mel = _mel(16, 14)
    ref = hift.inference(mel, sine_noise, finalize=True)
    sd = hift.state_dict()
    assert sum(k.endswith("original0") for k in sd) == 82
    layouts = {
        "parametrized": {k: v.clone() for k, v in sd.items()},
        "parametrized+generator": {"generator." + k: v.clone() for k, v in sd.items()},
        "legacy": _legacy_layout(sd, ""),
        "legacy+generator": _legacy_layout(sd, "generator."),
    }
    for name, layout in layouts.items():
        model = CausalHiFTGenerator(hift.cfg).eval()
        normalized = normalize_hift_state_dict(layout)
        assert list(normalized) == list(sd), name
        model.load_state_dict(normalized, strict=True)
        assert torch.equal(model.inference(mel, sine_noise, finalize=True), ref), name


def test_normalize_removes_every_generator_substring() -> None:
    g, v = torch.zeros(1), torch.ones(2)
    sd = {"generator.generator.conv_pre.weight_g": g, "a.generator.ups.0.weight_v": v}
    out = normalize_hift_state_dict(sd)
    g_key, v_key = "conv_pre.parametrizations.weight.original0", "a.ups.0.parametrizations.weight.original1"
    assert list(out) == [g_key, v_key]
    assert out[g_key] is g and out[v_key] is v


def test_torch_legacy_weight_norm_keys_load_after_normalize() -> None:
    """Keys written by torch's legacy `nn.utils.weight_norm` map onto the parametrized layer."""
    legacy = nn.Conv1d(6, 5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        legacy = nn.utils.weight_norm(legacy)
    with torch.no_grad():
        legacy.weight_g.uniform_(0.5, 2.0, generator=_gen(15))
    sd = {"generator.conv." + k: v for k, v in legacy.state_dict().items()}
    assert set(sd) == {"generator.conv.bias", "generator.conv.weight_g", "generator.conv.weight_v"}
    target = nn.Module()
    target.conv = weight_norm(nn.Conv1d(6, 5, 3))
    target.load_state_dict(normalize_hift_state_dict(sd), strict=True)
    legacy_weight = legacy.weight_g * legacy.weight_v / legacy.weight_v.norm(dim=(1, 2), keepdim=True)
    torch.testing.assert_close(target.conv.weight, legacy_weight)


def test_effective_weight_is_g_v_over_norm(hift: CausalHiFTGenerator) -> None:
    for name in ("conv_pre", "ups.0", "resblocks.4.convs1.2", "conv_post", "f0_predictor.condnet.0"):
        conv = hift.get_submodule(name)
        g = conv.parametrizations.weight.original0.detach().double().numpy()  # (out, 1, 1)
        v = conv.parametrizations.weight.original1.detach().double().numpy()  # (out, in, k)
        norm = np.sqrt((v**2).sum(axis=(1, 2), keepdims=True))
        np.testing.assert_allclose(conv.weight.detach().numpy(), g * v / norm, rtol=1e-5, atol=1e-7)


# --- F0 predictor and random init --------------------------------------------------------------------------


def test_f0_predictor_runs_in_float64(hift: CausalHiFTGenerator, sine_noise: torch.Tensor) -> None:
    dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def record(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        dtypes.append((args[0].dtype, output.dtype))

    layers = [hift.f0_predictor.condnet[0], hift.f0_predictor.condnet[8], hift.f0_predictor.classifier]
    handles = [layer.register_forward_hook(record) for layer in layers]
    try:
        mel = _mel(15, 16)
        hift.inference(mel, sine_noise, finalize=False)
        f0 = hift.predict_f0(mel)
    finally:
        for handle in handles:
            handle.remove()
    assert dtypes == [(torch.float64, torch.float64)] * 6
    assert f0.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in hift.parameters())  # the module itself is not converted
    double = copy.deepcopy(hift.f0_predictor).double()
    assert torch.equal(f0, double(mel.double()).float())


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_init_random_gives_voiced_f0(size: str) -> None:
    cfg = tiny(64).hift if size == "tiny" else full_size().hift
    model = CausalHiFTGenerator(cfg).eval()
    init_random_(model, _gen(0))
    for mel in (_mel(30, 17), torch.randn(1, 80, 30, generator=_gen(18))):
        f0 = model.predict_f0(mel)
        assert f0.min() > 80 and f0.max() < 300, (f0.min(), f0.max())
        assert f0.std() > 5


def test_init_random_waveform_is_nontrivial_and_deterministic(
    hift: CausalHiFTGenerator, sine_noise: torch.Tensor
) -> None:
    mel = _mel(30, 19)
    wav = hift.inference(mel, sine_noise, finalize=True)
    assert wav.std() > 0.01
    assert (wav.abs() >= hift.cfg.audio_limit).float().mean() < 1e-3
    # The voiced sine branch reaches the waveform: an all-unvoiced source changes it.
    with torch.no_grad():
        voiced = hift.m_source(hift.predict_f0(mel), sine_noise)
        unvoiced = hift.m_source(torch.zeros(1, 30), sine_noise)
        assert (voiced - unvoiced).abs().max() > 0.05
        assert (hift.decode(mel, voiced) - hift.decode(mel, unvoiced)).abs().max() > 1e-3

    again = CausalHiFTGenerator(hift.cfg)
    init_random_(again, _gen(0))
    pairs = zip(again.state_dict().values(), hift.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    other = CausalHiFTGenerator(hift.cfg)
    init_random_(other, _gen(1))
    assert not torch.equal(other.conv_pre.bias, again.conv_pre.bias)
