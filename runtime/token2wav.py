"""Speech tokens -> mel -> waveform: the flow (encoder + Euler ODE over the DiT estimator) and HiFT.

Upstream's `CosyVoice3Model.token2wav` with `CausalMaskedDiffWithDiT.inference`,
`CausalConditionalCFM` and `CausalHiFTGenerator.inference`, over the bundle's graphs:

- `flow_encoder`: prompt + generated tokens -> `mu` (1, 80, T) and `spks`; a non-final call holds the
  last 3 tokens back as look-ahead, a final one passes -1s (zero right padding);
- 10 Euler steps on the cosine-warped grid, dt recomputed from the accumulated t, classifier-free
  guidance as one batch of 2 (row 1: mu, spks and cond zeroed), v = 1.7 v_cond - 0.7 v_uncond, from
  the position-locked noise table `flow_noise[:, :, :T]`; `block_frames` 50 is the streaming
  block-causal mask, T full attention;
- `hift_f0` -> the harmonic phase (`sine_phase`, numpy) -> `hift_decoder` with the `sine_noise`
  table; a non-final call keeps the samples that no longer depend on future frames.

`VocoderStream` streams the vocoder at a bounded cost per chunk: every HiFT layer is causal with a
finite reach (`HiftLayout`), so it re-runs the two graphs only over the new frames plus a fixed left
margin, and feeds what is absolute in time (the phase, from a running float64 sum, and the noise
table's slice) explicitly; its samples are those of `Vocoder` over the whole accumulated mel (to
~1e-6 when both see the same f0: the float32 phase formula turns an ulp of f0 into ~1e-3 of waveform,
and onnxruntime's f0 rounding can depend on the input's length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cosyvoice_graphs import ModelDims

from .frontend import PromptFeatures
from .noise import UniformNoise
from .runners import Runner

N_TIMESTEPS = 10
"""Euler steps per flow call (upstream hard-codes 10 in `flow.inference`)."""
CFG_RATE = 0.7
"""`inference_cfg_rate`: v = (1 + rate) v_cond - rate v_uncond."""
HIFT_FINAL_LOOKAHEAD = 8
"""Mel frames at the end of a non-final HiFT call whose samples are not final yet (facts §2.5.5)."""


class SynthesisError(ValueError):
    """A request the bundle cannot synthesise (no speech tokens, longer than the noise tables); one line."""


def time_grid(n_timesteps: int = N_TIMESTEPS) -> np.ndarray:
    """The n+1 ODE times (float32): linspace(0, 1) warped by 1 - cos(t π/2), as upstream's float32 ops.

    The cosine is evaluated in float64 and rounded, i.e. correctly rounded, which is what torch's
    float32 cos gives on this grid.
    """
    t = np.linspace(0, 1, n_timesteps + 1, dtype=np.float32)
    angle = t * np.float32(0.5) * np.float32(math.pi)
    return np.float32(1) - np.cos(angle.astype(np.float64)).astype(np.float32)


def sine_phase(f0: np.ndarray, harmonics: int, sample_rate: int, samples_per_frame: int) -> np.ndarray:
    """f0 (1, T) in Hz -> `hift_decoder`'s `phase` (1, T, harmonics) in [0, 2π), float32.

    Upstream's staircase phase bit for bit (the spec's formula): per-frame steps in float32, their
    running sum in float64 rounded per frame, upstream's float32 products in its order, then the
    reduction mod 2π in float64.
    """
    acc = accumulate_phase(np.zeros(harmonics), phase_steps(f0, harmonics, sample_rate))
    return wrap_phase(acc, samples_per_frame)


def phase_steps(f0: np.ndarray, harmonics: int, sample_rate: int) -> np.ndarray:
    """f0 (1, T) in Hz -> the per-frame phase steps in cycles (1, T, harmonics), float32:
    fl32(fl32(f0 k) / sample_rate) mod 1."""
    k = np.arange(1, harmonics + 1, dtype=np.float32)  # (H,)
    return np.mod(f0.astype(np.float32)[..., None] * k / np.float32(sample_rate), np.float32(1))


def accumulate_phase(start: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The float64 running sums (1, T, H) of `steps` (1, T, H), continued from `start` (H,): the sum of
    every earlier step.

    np.cumsum adds strictly in order, so continuing from a carried `start` gives the same float64 values
    as one sum over the whole history (from 0.0, whose first addition is exact).
    """
    seeded = np.concatenate([start.astype(np.float64)[None, None], steps.astype(np.float64)], axis=1)
    return np.cumsum(seeded, axis=1)[:, 1:]


def wrap_phase(acc: np.ndarray, samples_per_frame: int) -> np.ndarray:
    """Running sums (1, T, H) float64 -> the phase in [0, 2π), float32: rounded to float32 per frame,
    upstream's float32 products in its order, fmod in float64."""
    p = acc.astype(np.float32) * np.float32(2) * np.float32(np.pi) * np.float32(samples_per_frame)
    return np.fmod(p.astype(np.float64), 2 * np.pi).astype(np.float32)


def interpolate_linear(mel: np.ndarray, size: int) -> np.ndarray:
    """mel (1, C, T) resampled to (1, C, size) along time: torch's `F.interpolate(mode="linear")`
    with align_corners=False, in float32.

    torch's CPU kernel evaluates the source index and the blend with fused multiply-adds (one
    rounding each); the float64 products below, rounded once, give the same float32 values.
    """
    t_in = mel.shape[2]
    scale = np.float64(np.float32(t_in) / np.float32(size))
    dst = np.arange(size, dtype=np.float32) + np.float32(0.5)  # (size,)
    src = np.maximum((scale * dst - 0.5).astype(np.float32), np.float32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), t_in - 1)
    i1 = np.minimum(i0 + 1, t_in - 1)
    w1 = np.clip(src - i0.astype(np.float32), np.float32(0), np.float32(1))
    w0 = np.float32(1) - w1
    x0, x1 = mel[:, :, i0], mel[:, :, i1]  # (1, C, size)
    return (x0.astype(np.float64) * w0 + (x1 * w1)).astype(np.float32)


class Flow:
    """`flow_encoder` + the Euler/CFG loop over `flow_estimator`: tokens -> mel frames after the prompt."""

    def __init__(self, encoder: Runner, estimator: Runner, noise: np.ndarray, dims: ModelDims) -> None:
        """`noise` is the bundle's `flow_noise` table (1, mel_bins, max frames), read from frame 0."""
        self.encoder, self.estimator = encoder, estimator
        self.noise = noise
        self.dims = dims
        self.t_span = time_grid()

    def __call__(self, tokens: np.ndarray, prompt: PromptFeatures, *, finalize: bool, streaming: bool
                 ) -> np.ndarray:
        """Mel (1, 80, frames) for `tokens` (N,) after the prompt's frames.

        `finalize=False` uses the last `pre_lookahead_len` tokens as look-ahead only, giving
        2(N - 3) frames instead of 2N; `streaming` selects the 50-frame block-causal DiT mask.
        """
        lookahead = self.dims.pre_lookahead_len
        all_tokens = np.concatenate([prompt.speech_tokens[0], np.asarray(tokens, dtype=np.int64)])
        if finalize:
            body, ahead = all_tokens, np.full(lookahead, -1, dtype=np.int64)
        else:
            if len(tokens) <= lookahead:
                raise ValueError(f"a non-final flow call needs more than {lookahead} tokens, "
                                 f"got {len(tokens)}")
            body, ahead = all_tokens[:-lookahead], all_tokens[-lookahead:]
        enc = self.encoder.infer({"tokens": body[None], "lookahead_tokens": ahead[None],
                                  "embedding": prompt.embedding.astype(np.float32)})
        mu, spks = enc["mu"], enc["spks"]  # (1, 80, T), (1, 80)
        frames, prompt_frames = mu.shape[2], prompt.mel.shape[1]
        if frames > self.noise.shape[2]:
            raise SynthesisError(f"{frames} mel frames (prompt included) exceed the flow noise table's "
                                 f"{self.noise.shape[2]}; use a shorter text or prompt")
        cond = np.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt.mel.transpose(0, 2, 1)
        block = self.dims.dit_block_frames if streaming else frames
        x = np.array(self.noise[:, :, :frames], dtype=np.float32)  # (1, 80, T), position-locked
        mel = self._solve(x, mu, spks, cond, block)
        return mel[:, :, prompt_frames:]

    def _solve(self, x: np.ndarray, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, block: int
               ) -> np.ndarray:
        """Euler over `t_span` with the CFG batch [conditional; unconditional]; x (1, 80, T)."""
        frames = x.shape[2]
        feeds = {
            "mask": np.ones((2, 1, frames), dtype=np.float32),
            "mu": np.concatenate([mu, np.zeros_like(mu)]),  # (2, 80, T)
            "spks": np.concatenate([spks, np.zeros_like(spks)]),  # (2, 80)
            "cond": np.concatenate([cond, np.zeros_like(cond)]),  # (2, 80, T)
            "block_frames": np.array([block], dtype=np.int64),
        }
        t_span = self.t_span
        guided, unguided = np.float32(1.0 + CFG_RATE), np.float32(CFG_RATE)
        # t accumulates and dt is re-read from the grid against it, as upstream's solve_euler does.
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v = self.estimator.infer({"x": np.concatenate([x, x]), "t": np.full(2, t, dtype=np.float32),
                                      **feeds})["velocity"]  # (2, 80, T)
            x = x + dt * (guided * v[:1] - unguided * v[1:])
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x


def _resblock_reach(kernel: int, dilations: tuple[int, ...]) -> int:
    """Steps a causal `ResBlock` output looks back: per dilation d, conv1 (k - 1) d then conv2 (k - 1)."""
    return sum((kernel - 1) * (d + 1) for d in dilations)


@dataclass(frozen=True)
class HiftLayout:
    """The HiFT hyper-parameters that bound how far back a sample depends on the vocoder's inputs.

    The graphs' shapes do not depend on them, so the bundle's `ModelDims` does not carry them: these are
    CosyVoice3's `hift` yaml values, shared by the released and the tiny model (the tests check them
    against the exporter's configs and probe the graphs). Every conv is causal (left padding) except
    conv_pre and the F0 predictor's first conv, which only look right.
    """

    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    conv_post_kernel_size: int = 7
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    f0_causal_kernel_sizes: tuple[int, ...] = (3, 3, 3, 3)
    """The F0 predictor's left-causal convs (after its look-right first conv)."""

    @property
    def samples_per_frame(self) -> int:
        """prod(upsample_rates) · iSTFT hop (480)."""
        return math.prod(self.upsample_rates) * self.istft_hop_len

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


HIFT_LAYOUT = HiftLayout()
"""CosyVoice3's vocoder (Fun-CosyVoice3-0.5B and the tiny test model)."""


class Vocoder:
    """`hift_f0` -> `sine_phase` -> `hift_decoder`: mel -> 24 kHz waveform."""

    def __init__(self, f0: Runner, decoder: Runner, sine_noise: UniformNoise, dims: ModelDims,
                 layout: HiftLayout = HIFT_LAYOUT) -> None:
        """`sine_noise` is the bundle's table (1, max samples, harmonics), read from sample 0."""
        if layout.samples_per_frame != dims.samples_per_frame:
            raise ValueError(f"the HiFT layout gives {layout.samples_per_frame} samples per frame, "
                             f"the bundle {dims.samples_per_frame}")
        self.f0, self.decoder = f0, decoder
        self.sine_noise = sine_noise
        self.dims = dims
        self.layout = layout

    def __call__(self, mel: np.ndarray, *, finalize: bool) -> np.ndarray:
        """mel (1, 80, T) -> float32 samples: U·T when final, else the U·(T - 8) that are final already
        (upstream's `finalize=False`, whose output is that prefix of the final one)."""
        frames, spf = mel.shape[2], self.dims.samples_per_frame
        self.check_frames(frames, finalize=finalize)
        mel = np.ascontiguousarray(mel, dtype=np.float32)
        f0 = self.f0.infer({"mel": mel})["f0"]  # (1, T)
        phase = sine_phase(f0, self.dims.harmonics, self.dims.sample_rate, spf)  # (1, T, H)
        wav = self.decode(mel, f0, phase)
        return wav if finalize else wav[: spf * (frames - HIFT_FINAL_LOOKAHEAD)]

    def check_frames(self, frames: int, *, finalize: bool) -> None:
        """Raise unless `frames` mel frames of an utterance can be vocoded (`SynthesisError`: too long)."""
        if not finalize and frames <= HIFT_FINAL_LOOKAHEAD:
            raise ValueError(f"a non-final vocoder call needs more than {HIFT_FINAL_LOOKAHEAD} frames")
        samples = frames * self.dims.samples_per_frame
        if samples > self.sine_noise.shape[1]:
            raise SynthesisError(f"{samples} samples exceed the sine noise table's "
                                 f"{self.sine_noise.shape[1]}; use a shorter text")

    def decode(self, mel: np.ndarray, f0: np.ndarray, phase: np.ndarray, first_frame: int = 0) -> np.ndarray:
        """`hift_decoder` over mel (1, 80, n) that starts at the utterance's frame `first_frame`, with its
        f0 (1, n) and phase (1, n, H): U·n samples, the noise table read from that frame's first sample."""
        spf = self.dims.samples_per_frame
        noise = self.sine_noise.window(first_frame * spf, (first_frame + mel.shape[2]) * spf)  # (1, U n, H)
        feeds = {"mel": np.ascontiguousarray(mel, dtype=np.float32), "f0": f0, "phase": phase,
                 "sine_noise": noise}
        return self.decoder.infer(feeds)["waveform"][0]

    def stream(self, margin: int | None = None) -> VocoderStream:
        """A new utterance's `VocoderStream`; `margin` (mel frames) defaults to the layout's
        `window_margin()`, and exists to show that a smaller one changes the samples."""
        margin = self.layout.window_margin() if margin is None else margin
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        return VocoderStream(self, margin, self.layout.f0_left_context(), acc=np.zeros(self.dims.harmonics),
                             mel=np.zeros((1, self.dims.mel_bins, 0), dtype=np.float32))


@dataclass
class VocoderStream:
    """One streamed utterance's vocoder state, all of it in these fields (make one with `Vocoder.stream`).

    Each `push` runs `hift_f0` over [start - f0_context, frames) and `hift_decoder` over [start, frames)
    (mel frames, absolute), with the phase continued from `acc` and the noise table from frame `start`,
    and keeps the samples from `samples` on: the first `margin` frames' samples only absorb the
    window's left edge. The cost per push is bounded by the new frames plus margin + f0_context + 8.
    """

    vocoder: Vocoder = field(repr=False)
    margin: int
    """Mel frames re-run before the first new sample (`HiftLayout.window_margin`)."""
    f0_context: int
    """Mel frames before `start` that `hift_f0` reads (`HiftLayout.f0_left_context`)."""
    acc: np.ndarray
    """float64 (H,): the running sum of the per-frame phase steps of frames [0, start), per harmonic."""
    mel: np.ndarray = field(repr=False)
    """(1, 80, frames - mel_start) float32: the frames the next window reads."""
    frames: int = 0
    """Mel frames pushed so far."""
    samples: int = 0
    """Samples returned so far (a whole number of frames)."""
    start: int = 0
    """The next window's first mel frame: max(0, samples / U - margin)."""
    finished: bool = False

    @property
    def mel_start(self) -> int:
        """The utterance frame that `mel` starts at."""
        return self.frames - self.mel.shape[2]

    def push(self, mel: np.ndarray, *, finalize: bool) -> np.ndarray:
        """Append mel frames (1, 80, n); returns the float32 samples that became final: what `Vocoder`
        over every frame pushed so far gives after its first `samples` (up to the graphs' rounding on
        other lengths, ~1e-6)."""
        if self.finished:
            raise ValueError("this vocoder stream is finalized already")
        voc, spf = self.vocoder, self.vocoder.dims.samples_per_frame
        frames = self.frames + mel.shape[2]
        voc.check_frames(frames, finalize=finalize)
        tail = np.concatenate([self.mel, mel.astype(np.float32)], axis=2)  # frames [mel_start, frames)
        skip = self.start - self.mel_start  # f0 context: read by hift_f0 only
        f0 = voc.f0.infer({"mel": tail})["f0"][:, skip:]  # (1, frames - start)
        acc = accumulate_phase(self.acc, phase_steps(f0, voc.dims.harmonics, voc.dims.sample_rate))
        wav = voc.decode(tail[:, :, skip:], f0, wrap_phase(acc, spf), self.start)
        end = frames if finalize else frames - HIFT_FINAL_LOOKAHEAD
        new = wav[self.samples - self.start * spf:(end - self.start) * spf]

        # The next window starts `margin` frames before the next new sample. The frames it skips lie
        # >= margin + 8 frames before `frames`, past f0's 3-frame look-ahead: their phase steps are final.
        start = max(0, end - self.margin)
        if start > self.start:
            self.acc = acc[0, start - self.start - 1]
        self.mel = tail[:, :, max(0, start - self.f0_context) - self.mel_start:]
        self.frames, self.samples, self.start, self.finished = frames, end * spf, start, finalize
        return new


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """Upstream's offline `speed`: the mel linearly resampled to int(T / speed) frames."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return mel if speed == 1.0 else interpolate_linear(mel, int(mel.shape[2] / speed))
