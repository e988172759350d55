"""How far HiFT's outputs reach back and ahead in its inputs: the vocoder's hyper-parameters that the
streaming runtime derives its margins from, and the derivations.

The graphs' shapes do not depend on them, so `ModelDims` does not carry them; the exporter records them
in the manifest's `model` section, read from the network it exported. Every conv is causal (left padding)
except conv_pre and the F0 predictor's first conv, which only look right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _resblock_reach(kernel: int, dilations: tuple[int, ...]) -> int:
    """Steps a causal `ResBlock` output looks back: per dilation d, conv1 (k - 1) d then conv2 (k - 1)."""
    return sum((kernel - 1) * (d + 1) for d in dilations)


@dataclass(frozen=True)
class HiftLayout:
    """The HiFT hyper-parameters that bound how far a sample depends on the vocoder's inputs."""

    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    istft_n_fft: int
    istft_hop_len: int
    conv_pre_look_right: int
    """Mel frames conv_pre looks ahead."""
    conv_post_kernel_size: int
    f0_look_right: int
    """Mel frames the F0 predictor's first conv looks ahead."""
    f0_causal_kernel_sizes: tuple[int, ...]
    """The F0 predictor's left-causal convs (after its look-right first conv), all undilated."""

    @property
    def samples_per_frame(self) -> int:
        """prod(upsample_rates) · iSTFT hop (480)."""
        return math.prod(self.upsample_rates) * self.istft_hop_len

    @property
    def final_lookahead(self) -> int:
        """Mel frames at the end of a non-final call whose samples are not final yet (8): upstream's
        `CausalHiFTGenerator.inference(finalize=False)` reads the last `f0_look_right` (3) as the F0
        predictor's look-ahead and the `conv_pre_look_right` (4) before them as conv_pre's, then drops one
        more frame of samples, whose iSTFT frames still overlap the next ones."""
        return self.f0_look_right + self.conv_pre_look_right + 1

    def f0_left_context(self) -> int:
        """Mel frames before frame t that f0[t] reads: the sum of k - 1 over the causal convs (4 · 2 = 8)."""
        return sum(k - 1 for k in self.f0_causal_kernel_sizes)

    def decoder_left_context(self) -> int:
        """Samples at the start of a `hift_decoder` call that can differ from a call over a longer prefix
        given the same mel, f0, phase and noise from the call's first frame on (13736).

        Walks the first index at which each layer's output no longer reads anything before the call
        (zero or reflect padding instead of real context), for CosyVoice3's values:
        - conv_pre only looks right: clean from mel frame 0; the NSF source is per sample: clean from 0;
        - the centred source STFT: frame f reads samples hop·f ± n_fft/2, so frames from n_fft/2/hop = 2
          on miss the reflect pad;
        - stage i upsamples (nearest by r, then a causal conv k): c -> c·r + k - 1, the last stage adds
          its one-step left reflect pad; the source branch at that rate: the strided downsample by u
          (kernel 2u, left pad u - 1) gives ceil((2 + u - 1) / u), then its ResBlock; the parallel
          ResBlocks are averaged, so the widest (k 11: 10 · (1+3+5) + 3 · 10 = 120) counts:
          rate 8:   max(0·8 + 15, 2 + 72) + 120 = 194;
          rate 40:  max(194·5 + 10, 2 + 72) + 120 = 1100;
          rate 120: max(1100·3 + 6 + 1, 2 + 120) + 120 = 3427; conv_post (k 7): 3433 STFT frames;
        - the iSTFT: sample n overlap-adds the frames f with hop·f - n_fft/2 <= n < hop·f + n_fft/2,
          all clean from n = hop·(3433 - 1) + n_fft/2 = 13736 (28.6 mel frames) on.
        """
        hop, half = self.istft_hop_len, self.istft_n_fft // 2
        stft_clean = -(-half // hop)
        rates = self.upsample_rates
        widest = max(_resblock_reach(k, d) for k, d in
                     zip(self.resblock_kernel_sizes, self.resblock_dilation_sizes, strict=True))
        stages = zip(rates, self.upsample_kernel_sizes, self.source_resblock_kernel_sizes,
                     self.source_resblock_dilation_sizes, strict=True)
        clean = 0
        for i, (rate, kernel, source_kernel, source_dilations) in enumerate(stages):
            clean = clean * rate + kernel - 1
            if i == len(rates) - 1:
                clean += 1  # the reflect pad that matches the STFT's frame count
            down = math.prod(rates[i + 1:])
            source = -(-(stft_clean + down - 1) // down) if down > 1 else stft_clean
            source += _resblock_reach(source_kernel, source_dilations)
            clean = max(clean, source) + widest
        clean += self.conv_post_kernel_size - 1
        return hop * (clean - 1) + half

    def window_margin(self) -> int:
        """Mel frames a streaming window re-runs before its first new sample: the decoder's left context
        rounded up to whole frames (29)."""
        return -(-self.decoder_left_context() // self.samples_per_frame)
