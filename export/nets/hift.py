"""The CosyVoice3 vocoder: `CausalHiFTGenerator` (NSF source + causal HiFi-GAN + 16-point ISTFT).

Built from `HiFTConfig`; `state_dict()` has upstream's keys, shapes and order (`tests/data/upstream_manifest/
hift.tsv`), so a released `hift.pt` loads strictly after `normalize_hift_state_dict`. Weight-normed layers use
torch's parametrized weight norm, as upstream does on any current torch.

The harmonic noise that upstream draws at construction (`SineGen2.sine_waves`) is not a buffer here: callers
pass it to `inference` (see `cosyvoice_export.noise`), so every random value the vocoder uses is an input.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_export.config import F0PredictorConfig, HiFTConfig
from cosyvoice_export.nets.causal_conv import (
    CausalConv1d,
    CausalConv1dDownSample,
    CausalConv1dUpsample,
    Snake,
)
from cosyvoice_graphs.hift_layout import HiftLayout

F0_FIRST_KERNEL = 4
"""The F0 predictor's first conv, which looks kernel - 1 = 3 frames ahead."""
F0_CAUSAL_KERNELS = (3, 3, 3, 3)
"""The F0 predictor's left-causal convs after its first."""
CONV_POST_KERNEL = 7
"""HiFT's last conv (left-causal); the architecture fixes it, the yaml does not set it."""


class CausalConvRNNF0Predictor(nn.Module):
    """Mel -> f0 in Hz: five weight-normed causal convs with ELU, a linear classifier, then abs.

    The first conv looks 3 frames ahead (right padding); the other four are left-causal.
    """

    def __init__(self, cfg: F0PredictorConfig) -> None:
        super().__init__()
        first = CausalConv1d(cfg.in_channels, cfg.cond_channels, F0_FIRST_KERNEL, causal_type="right")
        self.look_right = first.causal_padding
        """Mel frames of look-ahead of the first conv (3)."""
        layers: list[nn.Module] = [
            weight_norm(first),
            nn.ELU(),
        ]
        for kernel in F0_CAUSAL_KERNELS:
            layers += [weight_norm(CausalConv1d(cfg.cond_channels, cfg.cond_channels, kernel)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cfg.cond_channels, cfg.num_class)

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """mel (B, C, T) -> f0 (B, T), or (B, T - look_right) with the last frames as real look-ahead."""
        first = self.condnet[0]
        if finalize:
            x = first(mel)  # (B, cond, T)
        else:
            x = first(mel[:, :, : -self.look_right], mel[:, :, -self.look_right :])  # (B, cond, T - 3)
        x = self.condnet[1:](x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()  # (B, T')


class ResBlock(nn.Module):
    """Causal HiFi-GAN residual block: per dilation d, x += conv2(snake2(conv1_d(snake1(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(CausalConv1d(channels, channels, kernel_size)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, T) -> (B, C, T)."""
        layers = zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True)
        for conv1, conv2, act1, act2 in layers:
            x = x + conv2(act2(conv1(act1(x))))
        return x


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise excitation from frame-level f0 (upstream's SourceModuleHnNSF + causal SineGen2).

    Upstream works per sample, but with f0 held for `upsample_scale` samples every step up to the phase is
    constant within a frame, so this computes per frame and expands: the same values, a 480th of the work.
    """

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.harmonics = cfg.nb_harmonics + 1
        self.sampling_rate = cfg.sampling_rate
        self.upsample_scale = cfg.upsample_scale
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        # The per-frame phase step below relies on the 1/U linear downsampling reading two samples inside
        # each frame and off sample 0; that holds for U > 2.
        if self.upsample_scale <= 2:
            raise ValueError("upsample_scale must be > 2")
        self.l_linear = nn.Linear(self.harmonics, 1)

    def forward(self, f0: Tensor, sine_noise: Tensor) -> Tensor:
        """f0 (B, T) in Hz, sine_noise (1, >= T*U, H) uniform [0, 1) -> source (B, 1, T*U).

        The noise table is read from sample 0 on (position-locked), as upstream's `sine_waves[:, :L]`.
        """
        U, H = self.upsample_scale, self.harmonics
        if sine_noise.shape[1] < f0.shape[1] * U:
            raise ValueError(f"sine_noise has {sine_noise.shape[1]} samples, {f0.shape[1] * U} needed")
        harmonic = torch.arange(1, H + 1, dtype=f0.dtype, device=f0.device)  # (H,)
        fn = f0.unsqueeze(-1) * harmonic  # (B, T, H)
        # Phase step in cycles per sample. Upstream downsamples the per-sample steps linearly by 1/U, which
        # averages samples U*t + U/2 - 1 and U*t + U/2 of frame t: both equal this frame value. Its random
        # initial phase (`rand_ini`) is added to sample 0 only, which that average never reads, so it has
        # no effect and is left out.
        rad = (fn / self.sampling_rate) % 1  # (B, T, H)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi  # (B, T, H)
        # Upstream upsamples phase * U with nearest: a staircase, constant within each frame.
        sines = torch.sin(phase * U) * self.sine_amp  # (B, T, H)
        uv = (f0 > self.voiced_threshold).to(f0.dtype).unsqueeze(-1)  # (B, T, 1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3  # (B, T, 1)
        # Upstream's per-sample tensors are (B, L, H) views of channel-major (B, H, L) memory, and the matmul
        # in l_linear rounds differently for that layout than for a contiguous one: build it the same way.
        table = sine_noise[:, : f0.shape[1] * U].unflatten(1, (-1, U)).permute(0, 3, 1, 2)  # (1, H, T, U)
        # (B, H, T, 1), (B, 1, T, 1), (B, 1, T, 1)
        sines_c, uv_c, amp_c = (t.transpose(1, 2).unsqueeze(-1) for t in (sines, uv, noise_amp))
        harm = sines_c * uv_c + amp_c * table  # (B, H, T, U)
        harm = harm.contiguous().flatten(2).transpose(1, 2)  # (B, T*U, H), channel-major memory
        source = torch.tanh(self.l_linear(harm))  # (B, T*U, 1)
        return source.transpose(1, 2)  # (B, 1, T*U)


class CausalHiFTGenerator(nn.Module):
    """CosyVoice3's causal HiFT vocoder: mel (B, 80, T) + harmonic noise table -> 24 kHz waveform."""

    stft_window: Tensor  # a buffer (registered in __init__), declared for the type checker

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        base, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.m_source = SourceModuleHnNSF(cfg)
        self.conv_pre = weight_norm(
            CausalConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1, causal_type="right")
        )
        self.ups = nn.ModuleList(
            weight_norm(CausalConv1dUpsample(base // 2**i, base // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )
        # Stage i fuses the source STFT downsampled to its rate: cumulative products of the later upsample
        # rates, e.g. (15, 3, 1) for rates (8, 5, 3).
        down_rates = [1]
        for r in reversed(cfg.upsample_rates[1:]):
            down_rates.append(down_rates[-1] * r)
        down_rates.reverse()
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        source_blocks = zip(
            down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True
        )
        for i, (u, k, d) in enumerate(source_blocks):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(
                CausalConv1d(n_fft + 2, ch, 1) if u == 1 else CausalConv1dDownSample(n_fft + 2, ch, 2 * u, u)
            )
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(
            CausalConv1d(base // 2 ** len(cfg.upsample_rates), n_fft + 2, CONV_POST_KERNEL))
        # Registered last, like upstream (it is assigned at the end of upstream's __init__).
        self.f0_predictor = CausalConvRNNF0Predictor(cfg.f0)
        # Periodic Hann in float64, rounded to float32: upstream's scipy get_window('hann', n, fftbins=True).
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).to(torch.float32)
        self.register_buffer("stft_window", window, persistent=False)

    @property
    def frames_per_mel(self) -> int:
        """STFT frames per mel frame (product of the upsample rates)."""
        return self.cfg.upsample_scale // self.cfg.istft_hop_len

    def predict_f0(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """f0 in Hz, (B, T) or (B, T - 3), computed in float64 and returned in mel's dtype.

        Upstream casts the predictor and its input to float64 on every call (its fix for chunk-to-chunk
        consistency). This casts copies of the parameters instead, so the module stays float32; the
        weight norm is then evaluated in float64 from the float32 g and v, as upstream's is.
        """
        params = {name: p.to(torch.float64) for name, p in self.f0_predictor.named_parameters()}
        f0 = functional_call(self.f0_predictor, params, (mel.to(torch.float64),), {"finalize": finalize})
        return f0.to(mel.dtype)

    def source_stft(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """source (B, L) -> real, imag (B, n_fft/2+1, L/hop + 1): centred, reflect-padded, periodic Hann."""
        n_fft = self.cfg.istft_n_fft
        spec = torch.stft(
            source, n_fft, self.cfg.istft_hop_len, n_fft, window=self.stft_window,
            center=True, pad_mode="reflect", return_complex=True,
        )
        return spec.real, spec.imag

    def istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        """magnitude, phase (B, n_fft/2+1, F) -> waveform (B, hop*(F-1)); magnitude is clipped at 100."""
        n_fft = self.cfg.istft_n_fft
        magnitude = magnitude.clamp(max=1e2)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, self.cfg.istft_hop_len, n_fft, window=self.stft_window, center=True)

    def decode(self, mel: Tensor, source: Tensor, finalize: bool = True) -> Tensor:
        """mel (B, C, T), source (B, 1, U*T) -> waveform (B, U*T), or (B, U*(T - 5)) if not final.

        Not final: the last `conv_pre_look_right` mel frames are only look-ahead for conv_pre, the source
        STFT is cut to match, and the last U output samples (still waiting on future frames) are dropped.
        """
        real, imag = self.source_stft(source.squeeze(1))  # (B, n_fft/2+1, F)
        look_right = self.cfg.conv_pre_look_right
        if finalize:
            x = self.conv_pre(mel)  # (B, base, T)
        else:
            x = self.conv_pre(mel[:, :, :-look_right], mel[:, :, -look_right:])  # (B, base, T - 4)
            cut = self.frames_per_mel * look_right
            real, imag = real[:, :, :-cut], imag[:, :, :-cut]
        s_stft = torch.cat([real, imag], dim=1)  # (B, n_fft + 2, F)

        num_kernels = len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = F.leaky_relu(x, self.cfg.lrelu_slope)
            x = up(x)
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # (B, C, 120T + 1): the source STFT's frame count
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * num_kernels](x)
            for j in range(1, num_kernels):
                xs = xs + self.resblocks[i * num_kernels + j](x)
            x = xs / num_kernels

        x = F.leaky_relu(x)  # torch's default slope 0.01 here, not lrelu_slope (as upstream)
        x = self.conv_post(x)  # (B, n_fft + 2, F)
        half = self.cfg.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half])
        phase = torch.sin(x[:, half:])  # upstream takes sin of the raw output, then cos/sin of that
        wav = self.istft(magnitude, phase)  # (B, hop * (F - 1))
        if not finalize:
            wav = wav[:, : -self.cfg.upsample_scale]
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    def forward(self, mel: Tensor, sine_noise: Tensor, finalize: bool = True) -> Tensor:
        """mel (B, 80, T), sine_noise (1, >= U*T, H) -> waveform (B, U*T) final, (B, U*(T-8)) otherwise.

        Not final: the last 3 mel frames are only look-ahead for the f0 predictor, the 4 before them only
        look-ahead for conv_pre, and one more frame's samples are dropped; what remains equals the prefix
        of the final output for the same mel.
        """
        f0 = self.predict_f0(mel, finalize)  # (B, T')
        source = self.m_source(f0, sine_noise)  # (B, 1, U*T')
        if not finalize:
            mel = mel[:, :, : -self.f0_predictor.look_right]
        return self.decode(mel, source, finalize)

    @torch.no_grad()
    def inference(self, mel: Tensor, sine_noise: Tensor, *, finalize: bool) -> Tensor:
        """Upstream's `CausalHiFTGenerator.inference` (waveform only, no gradients); see `forward`."""
        return self(mel, sine_noise, finalize)


def hift_layout(cfg: HiFTConfig) -> HiftLayout:
    """How far `CausalHiFTGenerator(cfg)`'s outputs reach in its inputs, for the runtime's streaming margins:
    the yaml's rates and kernels and the kernels the architecture fixes."""
    return HiftLayout(
        upsample_rates=cfg.upsample_rates, upsample_kernel_sizes=cfg.upsample_kernel_sizes,
        resblock_kernel_sizes=cfg.resblock_kernel_sizes, resblock_dilation_sizes=cfg.resblock_dilation_sizes,
        source_resblock_kernel_sizes=cfg.source_resblock_kernel_sizes,
        source_resblock_dilation_sizes=cfg.source_resblock_dilation_sizes,
        istft_n_fft=cfg.istft_n_fft, istft_hop_len=cfg.istft_hop_len,
        conv_pre_look_right=cfg.conv_pre_look_right, conv_post_kernel_size=CONV_POST_KERNEL,
        f0_look_right=F0_FIRST_KERNEL - 1, f0_causal_kernel_sizes=F0_CAUSAL_KERNELS)


def normalize_hift_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map a `hift.pt` state dict onto `CausalHiFTGenerator`'s keys.

    Deletes every `generator.` substring (upstream does this so files saved from the HiFiGan training
    wrapper load) and renames legacy weight norm `X.weight_g` / `X.weight_v` to
    `X.parametrizations.weight.original0` / `original1`. Order and tensors are kept.
    """
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


def _fill_weight_norm_(conv: nn.Module, gain: float, gen: torch.Generator) -> None:
    """Random direction v, per-channel norm g ~ gain * (1 +- 10%), small bias."""
    v = conv.get_parameter("parametrizations.weight.original1")  # (out, in, k)
    g = conv.get_parameter("parametrizations.weight.original0")  # (out, 1, 1)
    bias = conv.get_parameter("bias")
    v.copy_(torch.randn(v.shape, generator=gen))
    g.copy_(gain * (1 + 0.1 * torch.randn(g.shape, generator=gen)))
    bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))


def init_random_(hift: CausalHiFTGenerator, generator: torch.Generator) -> None:
    """Fill `hift` with deterministic random weights for test bundles.

    Scaled so that, for mel inputs of unit-ish scale (log-mels included), the f0 predictor gives voiced f0
    (around 180 Hz, varying by 10-20 Hz; far above `nsf_voiced_threshold`) and the waveform is clearly
    non-zero (std ~0.05) without reaching the clamp. Draws come from `generator` in a fixed module order.
    """
    gen = generator
    with torch.no_grad():
        f0 = hift.f0_predictor
        for layer in list(f0.condnet)[::2]:  # the convs, not the ELUs between them
            _fill_weight_norm_(layer, 1.0, gen)
        cond = f0.classifier.in_features
        weight = torch.randn(f0.classifier.weight.shape, generator=gen)
        f0.classifier.weight.copy_(weight * 25 / math.sqrt(cond))
        f0.classifier.bias.fill_(180.0)

        lin = hift.m_source.l_linear  # harmonics of amplitude 0.1 -> excitation of ~0.3, tanh near-linear
        lin.weight.copy_(3 * torch.randn(lin.weight.shape, generator=gen) / math.sqrt(lin.in_features))
        lin.bias.copy_(0.01 * torch.randn(lin.bias.shape, generator=gen))

        _fill_weight_norm_(hift.conv_pre, 0.5, gen)
        for up in hift.ups:
            _fill_weight_norm_(up, 1.0, gen)
        for down in hift.source_downs:
            weight, bias = down.get_parameter("weight"), down.get_parameter("bias")
            fan_in = weight[0].numel()
            weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(fan_in))
            bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))
        # a ModuleList's items are typed nn.Module
        for block in cast(list[ResBlock], [*hift.source_resblocks, *hift.resblocks]):
            for conv in [*block.convs1, *block.convs2]:
                _fill_weight_norm_(conv, 0.3, gen)
            for act in [*block.activations1, *block.activations2]:
                alpha = act.get_parameter("alpha")
                alpha.copy_(0.5 + torch.rand(alpha.shape, generator=gen))

        # Log-magnitudes of about N(0, 0.6^2): a waveform of std ~0.07, well inside the +-0.99 clamp.
        _fill_weight_norm_(hift.conv_post, 0.6, gen)
