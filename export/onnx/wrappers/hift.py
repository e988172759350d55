"""The vocoder's graphs: `hift_f0` (mel -> f0) and `hift_decoder` (mel, f0, phase, noise -> waveform).

Both wrap a `CausalHiFTGenerator` without copying or changing it (the legacy exporter folds the
weight-norm parametrizations into constants by itself). Their semantics are upstream's
`inference(mel, finalize=True)`; a non-final caller keeps a prefix (see `cosyvoice_graphs.registry`).

Three things differ from the torch network so that the graphs are exportable and the runtime can
reproduce upstream, and one so that they run faster:

- the F0 predictor runs in float32 (onnxruntime's CPU EP has no float64 Conv: a session fails to
  load with NOT_IMPLEMENTED);
- the harmonic phase is an input, computed by `sine_phase` (float64 running sum, reduced mod 2π),
  because a float32 phase of a long utterance loses the precision that upstream's sine relies on;
- the complex `torch.stft` / `torch.istft` are replaced by `RealSTFT`'s real-valued convolutions;
- each upsampling layer (nearest repeat, then a conv at the high rate) is `PolyphaseUpsample`: one conv
  at the low rate computing every output phase, 2.3-5.3x fewer multiply-adds for the same sums of the
  same products (they differ from torch's by float32 rounding only).
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import HiFTConfig
from ...nets.causal_conv import CausalConv1dUpsample
from ...nets.hift import CausalHiFTGenerator, SourceModuleHnNSF


def sine_phase(f0: Tensor, cfg: HiFTConfig) -> Tensor:
    """f0 (B, T) in Hz -> the harmonics' phase (B, T, H) in [0, 2π], float32: `hift_decoder`'s `phase`.

    Upstream's causal SineGen2 holds the phase constant within each frame (a staircase). Per frame t
    and harmonic k = 1..H, with `fl32` rounding to float32, U = samples per frame and sr the rate:

        rad[t, k]   = fl32(fl32(f0[t] * k) / sr) mod 1          per-sample step in cycles (float32)
        acc[t, k]   = fl32(sum_{s <= t} rad[s, k])              summed in float64, rounded per frame
        P[t, k]     = fl32(fl32(fl32(2 * acc) * fl32(π)) * U)    upstream's float32 products, in its order
        phase[t, k] = fl32(fmod(P[t, k], 2π))                   reduced in float64

    `acc` is what torch's CPU cumsum of float32 gives (it accumulates in float64), and P is, bit for
    bit, the float32 phase upstream feeds to sin(). That value reaches 3e5 rad within a minute, where
    float32 steps 0.03 rad apart; a graph could neither recompute it (a float32 running sum drifts
    further) nor take sin() of it in a reduced precision. Reduced here, its sine equals upstream's to
    float32 precision. In numpy (the runtime's mirror), with float32 arrays `f0` and `k`:

        rad = np.mod(f0[..., None] * k / np.float32(sr), np.float32(1))
        acc = np.cumsum(rad, axis=1, dtype=np.float64).astype(np.float32)
        p = acc * np.float32(2) * np.float32(np.pi) * np.float32(U)
        phase = np.fmod(p.astype(np.float64), 2 * np.pi).astype(np.float32)
    """
    harmonic = torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32)  # (H,)
    rad = (f0.to(torch.float32).unsqueeze(-1) * harmonic / cfg.sampling_rate) % 1  # (B, T, H)
    acc = torch.cumsum(rad.to(torch.float64), dim=1).to(torch.float32)  # (B, T, H)
    upstream = acc * 2 * math.pi * cfg.upsample_scale  # (B, T, H), float32 ops in SineGen2's order
    # All terms are >= 0, so fmod is the exact reduction (and numpy's np.fmod is the same function).
    return torch.fmod(upstream.to(torch.float64), 2 * math.pi).to(torch.float32)


class RealSTFT(nn.Module):
    """The vocoder's centred, reflect-padded, onesided STFT and its inverse as real convolutions.

    Stand-ins for `CausalHiFTGenerator.source_stft` / `istft` (`torch.stft` / `torch.istft` with
    window = win_length = n_fft), whose complex tensors the opset-17 exporter cannot write. Bin k of
    frame f is sum_n x[hop*f + n - n_fft/2] * w[n] * exp(-2πi kn / n_fft) (a Conv1d with a fixed
    window * DFT basis); the inverse is the onesided inverse DFT times the window, overlap-added (a
    ConvTranspose1d), divided by the overlap-added squared window and trimmed by n_fft/2 at both ends.
    """

    analysis: Tensor
    """(2*bins, 1, n_fft): window * cos, then window * -sin, per bin."""
    synthesis: Tensor
    """(2*bins, 1, n_fft): onesided inverse DFT rows for the real, then the imaginary parts, * window."""
    window_sq: Tensor
    """(1, 1, n_fft): the squared window, whose overlap-add normalises the inverse."""

    def __init__(self, window: Tensor, hop: int) -> None:
        super().__init__()
        n_fft = window.numel()
        if n_fft % 2:
            raise ValueError("n_fft must be even")
        self.n_fft, self.hop = n_fft, hop
        bins = n_fft // 2 + 1
        # Angles from the exact integer k*n mod n_fft; cos/sin that are 0 in exact arithmetic are set
        # to 0 so the DC and Nyquist bins have no imaginary part (as an FFT gives).
        angle = 2 * np.pi * (np.outer(np.arange(bins), np.arange(n_fft)) % n_fft) / n_fft  # (bins, n_fft)
        cos, sin = (np.where(np.abs(b) < 1e-9, 0.0, b) for b in (np.cos(angle), np.sin(angle)))
        w = window.detach().cpu().to(torch.float64).numpy()  # (n_fft,)
        # Onesided inverse: bins 1..n_fft/2-1 stand for themselves and their conjugates.
        weight = np.full((bins, 1), 2.0 / n_fft)
        weight[[0, -1]] = 1.0 / n_fft
        bases = {
            "analysis": np.concatenate([cos * w, -sin * w])[:, None, :],
            "synthesis": np.concatenate([weight * cos * w, -weight * sin * w])[:, None, :],
            "window_sq": w[None, None] ** 2,
        }
        for name, array in bases.items():
            self.register_buffer(name, torch.from_numpy(array).to(torch.float32), persistent=False)

    def stft(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, L) -> real, imag (B, n_fft/2+1, L/hop + 1), as `torch.stft(center=True, reflect)`."""
        half = self.n_fft // 2
        padded = F.pad(x.unsqueeze(1), (half, half), mode="reflect")  # (B, 1, L + n_fft)
        spec = F.conv1d(padded, self.analysis, stride=self.hop)  # (B, 2*bins, F)
        real, imag = spec.chunk(2, dim=1)  # (B, bins, F) each
        return real, imag

    def istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        """magnitude, phase (B, n_fft/2+1, F) -> (B, hop*(F-1)), as `CausalHiFTGenerator.istft`."""
        magnitude = magnitude.clamp(max=1e2)
        real, imag = magnitude * torch.cos(phase), magnitude * torch.sin(phase)  # (B, bins, F)
        spec = torch.cat([real, imag], dim=1)  # (B, 2*bins, F)
        frames = F.conv_transpose1d(spec, self.synthesis, stride=self.hop)  # (B, 1, hop*(F-1) + n_fft)
        # The envelope depends on F only; built from F ones so that it stays dynamic in the graph.
        envelope = F.conv_transpose1d(torch.ones_like(spec[:, :1]), self.window_sq, stride=self.hop)
        half = self.n_fft // 2
        return (frames / envelope)[:, 0, half:-half]  # (B, hop*(F-1))


class PolyphaseUpsample(nn.Module):
    """`CausalConv1dUpsample` (repeat each step r times, left-pad k-1, conv of kernel k) as one conv at the
    input's rate, for a call without streaming context.

    Output step n = r*t + p sums w[k-1-i] * x[floor((n-i)/r)] over i < k: for phase p, input step t - q
    with q = ceil((i-p)/r) in 0..Q, Q = ceil((k-1)/r). So phase p is a left-causal conv over x with
    kernel Q+1 whose taps are sums of the original taps; the r phases are one conv of r*C_out channels,
    interleaved in time afterwards. The layer's weight is read at every call (its weight norm included),
    and the tap sums fold into constants in the exported graph.
    """

    selection: Tensor
    """(r, Q+1, k) 0/1: which original tap (by i = k-1-j) adds to phase p's tap Q-q."""

    def __init__(self, layer: CausalConv1dUpsample) -> None:
        super().__init__()
        self.layer = layer
        r, k = layer.upsample_factor, layer.kernel_size[0]
        self.taps = -(-(k - 1) // r) + 1  # Q + 1
        selection = torch.zeros(r, self.taps, k)
        for p in range(r):
            for i in range(k):
                selection[p, self.taps - 1 + (p - i) // r, k - 1 - i] = 1.0  # (p-i)//r = -q
        self.register_buffer("selection", selection, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C_in, T) -> (B, C_out, T * r), as `layer(x)`."""
        weight, bias = self.layer.weight, self.layer.bias  # (C_out, C_in, k), (C_out,)
        assert bias is not None  # HiFT's upsampling convs have one
        r = self.layer.upsample_factor
        c_out = weight.shape[0]
        phases = torch.einsum("pjk,oik->poij", self.selection, weight)  # (r, C_out, C_in, Q+1)
        y = F.conv1d(F.pad(x, (self.taps - 1, 0)), phases.flatten(0, 1), bias.repeat(r))  # (B, r*C_out, T)
        y = y.unflatten(1, (r, c_out)).permute(0, 2, 3, 1)  # (B, C_out, T, r)
        return y.flatten(2)  # (B, C_out, T*r)


class _RealSTFTView:
    """`hift` with `RealSTFT` as its source_stft / istft and `PolyphaseUpsample` layers as its ups, for
    calling `CausalHiFTGenerator.decode`.

    `decode` reaches the transforms only through `self.source_stft` and `self.istft`, and the upsampling
    layers through `self.ups`; running it on this view keeps one copy of the decoder's code and leaves
    the caller's module untouched.
    """

    def __init__(self, hift: CausalHiFTGenerator, transform: RealSTFT, ups: nn.ModuleList) -> None:
        self._hift = hift
        self.source_stft = transform.stft
        self.istft = transform.istft
        self.ups = ups

    def __getattr__(self, name: str) -> object:
        return getattr(self._hift, name)


def nsf_source(m_source: SourceModuleHnNSF, f0: Tensor, phase: Tensor, sine_noise: Tensor) -> Tensor:
    """f0 (B, T), phase (B, T, H), sine_noise (1, T*U, H) -> excitation (B, 1, T*U).

    `SourceModuleHnNSF.forward` with the phase given (see `sine_phase`): harmonics of amplitude
    alpha, voiced where f0 > threshold, plus the scaled noise table, mixed by l_linear and tanh.
    """
    U, H = m_source.upsample_scale, m_source.harmonics
    sines = torch.sin(phase) * m_source.sine_amp  # (B, T, H)
    uv = (f0 > m_source.voiced_threshold).to(f0.dtype).unsqueeze(-1)  # (B, T, 1)
    noise_amp = uv * m_source.noise_std + (1 - uv) * m_source.sine_amp / 3  # (B, T, 1)
    table = sine_noise.reshape(1, -1, U, H)  # (1, T, U, H)
    # The sine is a staircase: one value per frame, broadcast over the frame's U samples.
    harm = (sines * uv).unsqueeze(2) + noise_amp.unsqueeze(2) * table  # (B, T, U, H)
    source = torch.tanh(m_source.l_linear(harm.flatten(1, 2)))  # (B, T*U, 1)
    return source.transpose(1, 2)  # (B, 1, T*U)


class HiFTF0Graph(nn.Module):
    """`hift_f0`: mel (1, 80, T) -> f0 (1, T) in Hz, zero right padding (upstream's final call).

    The predictor runs in float32 here, upstream's in float64: on random-weight vocoders the graph's
    f0 is within 3e-4 Hz of `CausalHiFTGenerator.predict_f0` (tests/test_export_wrappers_hift.py).
    """

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        super().__init__()
        self.f0_predictor = hift.f0_predictor

    def forward(self, mel: Tensor) -> Tensor:
        """mel (1, 80, T) -> f0 (1, T)."""
        return self.f0_predictor(mel, finalize=True)


class HiFTDecoderGraph(nn.Module):
    """`hift_decoder`: mel (1, 80, T), f0 (1, T), phase (1, T, H), sine_noise (1, T*U, H) -> (1, T*U).

    `CausalHiFTGenerator.inference(mel, sine_noise, finalize=True)` with f0 and the harmonic phase
    given, the STFT/iSTFT as real convolutions (`RealSTFT`) and the upsampling layers polyphase
    (`PolyphaseUpsample`).
    """

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        super().__init__()
        self.hift = hift
        self.transform = RealSTFT(hift.get_buffer("stft_window"), hift.cfg.istft_hop_len)
        self.ups = nn.ModuleList(PolyphaseUpsample(up) for up in cast(list[CausalConv1dUpsample], hift.ups))

    def forward(self, mel: Tensor, f0: Tensor, phase: Tensor, sine_noise: Tensor) -> Tensor:
        """See the class docstring; the waveform is clamped to +-audio_limit."""
        source = nsf_source(self.hift.m_source, f0, phase, sine_noise)  # (1, 1, T*U)
        view = _RealSTFTView(self.hift, self.transform, self.ups)
        return CausalHiFTGenerator.decode(view, mel, source, finalize=True)  # type: ignore[arg-type]
