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
"""

from __future__ import annotations

import math

import numpy as np

from cosyvoice_graphs import ModelDims

from .frontend import PromptFeatures
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
    k = np.arange(1, harmonics + 1, dtype=np.float32)  # (H,)
    rad = np.mod(f0.astype(np.float32)[..., None] * k / np.float32(sample_rate), np.float32(1))  # (1, T, H)
    acc = np.cumsum(rad, axis=1, dtype=np.float64).astype(np.float32)
    p = acc * np.float32(2) * np.float32(np.pi) * np.float32(samples_per_frame)
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


class Vocoder:
    """`hift_f0` -> `sine_phase` -> `hift_decoder`: mel -> 24 kHz waveform."""

    def __init__(self, f0: Runner, decoder: Runner, sine_noise: np.ndarray, dims: ModelDims) -> None:
        """`sine_noise` is the bundle's table (1, max samples, harmonics), read from sample 0."""
        self.f0, self.decoder = f0, decoder
        self.sine_noise = sine_noise
        self.dims = dims

    def __call__(self, mel: np.ndarray, *, finalize: bool) -> np.ndarray:
        """mel (1, 80, T) -> float32 samples: U·T when final, else the U·(T - 8) that are final already
        (upstream's `finalize=False`, whose output is that prefix of the final one)."""
        frames, spf = mel.shape[2], self.dims.samples_per_frame
        if not finalize and frames <= HIFT_FINAL_LOOKAHEAD:
            raise ValueError(f"a non-final vocoder call needs more than {HIFT_FINAL_LOOKAHEAD} frames")
        if frames * spf > self.sine_noise.shape[1]:
            raise SynthesisError(f"{frames * spf} samples exceed the sine noise table's "
                                 f"{self.sine_noise.shape[1]}; use a shorter text")
        mel = np.ascontiguousarray(mel, dtype=np.float32)
        f0 = self.f0.infer({"mel": mel})["f0"]  # (1, T)
        phase = sine_phase(f0, self.dims.harmonics, self.dims.sample_rate, spf)  # (1, T, H)
        noise = np.array(self.sine_noise[:, : frames * spf], dtype=np.float32)  # (1, U T, H)
        wav = self.decoder.infer({"mel": mel, "f0": f0, "phase": phase, "sine_noise": noise})["waveform"][0]
        return wav if finalize else wav[: spf * (frames - HIFT_FINAL_LOOKAHEAD)]


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """Upstream's offline `speed`: the mel linearly resampled to int(T / speed) frames."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return mel if speed == 1.0 else interpolate_linear(mel, int(mel.shape[2] / speed))
