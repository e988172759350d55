"""Speech tokens -> mel -> waveform: the flow (encoder + Euler ODE over the DiT) and HiFT.

Upstream's `CosyVoice3Model.token2wav` with `CausalMaskedDiffWithDiT.inference`,
`CausalConditionalCFM` and `CausalHiFTGenerator.inference`, over the bundle's graphs:

- `flow_encoder`: prompt + generated tokens -> `mu` (1, 80, T) and `spks`; a non-final call holds the
  last 3 tokens back as look-ahead, a final one passes -1s (zero right padding);
- 10 Euler steps on the cosine-warped grid, dt recomputed from the accumulated t, classifier-free
  guidance as one batch of 2 (row 1: mu, spks and cond zeroed), v = 1.7 v_cond - 0.7 v_uncond, from
  the position-locked noise table `flow_noise[:, :, :T]`; each step is one `flow_estimator_cached`
  call over all T frames with nothing cached, `block_frames` 50 the streaming block-causal mask, T full
  attention, `ode_step` the step (the graph holds each step's time modulation);
- `hift_f0` -> the harmonic phase (`phase_steps`, `accumulate_phase`, `wrap_phase`: numpy, the spec's
  formula bit for bit) -> `hift_decoder` with the `sine_noise` table; a non-final call keeps the samples
  that no longer depend on future frames.

`FlowStream` streams the flow: a non-final chunk runs the same graph over its new frames only, fed per
ODE step with the keys/values and conv context of the earlier frames, and gives the frames of
`Flow` over the whole prefix (the earlier frames are whole blocks that the block-causal mask never lets
attend forward); with its final chunk run against the caches and a `window` it bounds the cost per chunk,
at a deviation from upstream. The first chunk starts after the prompt's `FlowPrefix` (`flow_prefix`),
computed once per prompt.

`VocoderStream` streams the vocoder at a bounded cost per chunk: every HiFT layer is causal with a
finite reach (`HiftLayout`), so it re-runs the two graphs only over the new frames plus a fixed left
margin, and feeds what is absolute in time (the phase, from a running float64 sum, and the noise
table's slice) explicitly; its samples are those of `Vocoder` over the whole accumulated mel (to
~1e-6 when both see the same f0: the float32 phase formula turns an ulp of f0 into ~1e-3 of waveform,
and onnxruntime's f0 rounding can depend on the input's length). Where every new input length costs
(`Vocoder.repeat_shapes`, on CUDA), a stream's final window takes its previous window's length, and a final
call over many frames runs as such a stream, so that the calls' lengths repeat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cosyvoice_graphs import (
    BATCH,
    MAX_BATCH,
    ModelDims,
    cache_pairs,
    dit_attention,
    dit_call_case,
    dit_frame_caches,
    empty_caches,
    euler_steps,
)
from cosyvoice_graphs.hift_layout import HiftLayout

from .call_stack import CallStack, StackMember
from .chunk_turns import no_pause
from .dit_stack import AloneCalls, DitCall, DitCalls, DitStack, Presents, call_alone
from .errors import SynthesisError, require_finite
from .flow_prefix import DEFAULT_PREFIX_CACHE_BYTES, FlowPrefix, FlowPrefixCache
from .frontend import PromptFeatures
from .noise import UniformNoise
from .runners import CPU, Feed, OrtRunner, Runner, feed_nbytes, feed_shape
from .runners.device_copies import FramePad

CFG_RATE = 0.7
"""`inference_cfg_rate`: v = (1 + rate) v_cond - rate v_uncond."""


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


ENCODER_LEFT_CONTEXT = 2
"""Tokens before a token that its `mu` reads: the pre-lookahead layer's second conv is causal with
kernel 3 (upstream's `PreLookaheadLayer`, not a yaml value); its first conv reads only the token and
the look-ahead after it."""

Velocity = Callable[[int, np.ndarray], np.ndarray]
"""The estimator inside the Euler loop: (step index, x (2, 80, T)) -> velocity (2, 80, T)."""


def _cfg_rows(mu: np.ndarray, spks: np.ndarray, cond: np.ndarray) -> dict[str, np.ndarray]:
    """The estimator's conditioning for the CFG batch [conditional; unconditional]: row 1 zeros."""
    return {"mu": np.concatenate([mu, np.zeros_like(mu)]),  # (2, 80, T)
            "spks": np.concatenate([spks, np.zeros_like(spks)]),  # (2, 80)
            "cond": np.concatenate([cond, np.zeros_like(cond)])}  # (2, 80, T)


class Flow:
    """`flow_encoder` + the Euler/CFG loop over `flow_estimator_cached`: tokens -> mel frames after the
    prompt.

    A call runs the DiT over all frames with nothing cached; `stream` starts a `FlowStream`, which feeds
    it the caches of earlier chunks, beginning with the prompt's `prefix`, kept in `prefixes`.
    """

    def __init__(self, encoder: Runner, estimator: Runner, noise: np.ndarray, dims: ModelDims, *,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, call: DitCall | None = None) -> None:
        """`estimator` is the `flow_estimator_cached` graph; `noise` is the bundle's `flow_noise` table
        (1, mel_bins, max frames), read from frame 0; `prefix_cache_bytes` bounds `prefixes` (0: none
        kept, every stream computes its prompt's prefix); `call` runs each DiT call (None: `call_alone` on
        `estimator`; `dit_graphs.GraphedDit` replays them from CUDA graphs)."""
        self.encoder, self.estimator = encoder, estimator
        self.call: DitCall = functools.partial(call_alone, estimator) if call is None else call
        self.keep_on_device = isinstance(estimator, OrtRunner) and estimator.device_type != CPU
        """Whether a stream's DiT caches stay on the GPU that computed them between calls, instead of
        crossing to the host and back at every ODE step (at full size ~0.35 MB per cached frame each way)."""
        keys, self.frame_axis = dit_frame_caches(estimator.spec)
        self.growing = [t.name for t in keys]
        """The caches that grow with the frames (the keys and values; the conv caches' frames are fixed)."""
        self.frame_copies = (FramePad({t.name: (t.np_dtype, len(t.shape)) for t in keys},
                                      axis=self.frame_axis, provider=estimator.provider,
                                      device_id=estimator.device_id)
                             if isinstance(estimator, OrtRunner) else None)
        """Where a windowed stream's caches kept on the device drop frames, there (its sessions made when
        first needed)."""
        self.noise = noise
        self.dims = dims
        self.steps = euler_steps()
        self.prefixes = FlowPrefixCache(prefix_cache_bytes)
        self.stack: DitStack | None = None
        """Where concurrent DiT calls gather into stacked calls (`dit_stack`); None: each runs alone."""

    def __call__(self, tokens: np.ndarray, prompt: PromptFeatures, *, finalize: bool, streaming: bool,
                 pause: Callable[[], None] = no_pause) -> np.ndarray:
        """Mel (1, 80, frames) for `tokens` (N,) after the prompt's frames.

        `finalize=False` uses the last `pre_lookahead_len` tokens as look-ahead only, giving
        2(N - 3) frames instead of 2N; `streaming` selects the 50-frame block-causal DiT mask. `pause` is
        called before every DiT call (a chunk's `ChunkTurns` pause).
        """
        all_tokens = self.tokens_with_prompt(tokens, prompt, finalize=finalize)
        with self.dit_calls() as calls:
            mu, spks = self.encode(all_tokens, 0, prompt, finalize=finalize)  # (1, 80, T), (1, 80)
            frames = mu.shape[2]
            block = self.dims.dit_block_frames if streaming else frames
            feeds = {**dit_attention(0, frames, 0, block), **empty_caches(self.estimator.spec),
                     **_cfg_rows(mu, spks, self.cond(prompt, 0, frames))}

            def velocity(step: int, x: np.ndarray) -> np.ndarray:
                # the velocity only: nothing reads this call's present_* caches, so they are not copied out
                inputs = {"x": x, "ode_step": _ode_step(step), **feeds}
                return calls.velocity(inputs, presents=Presents.NONE, pause=pause)[0]

            return self.solve(self.initial_x(0, frames), velocity)[:, :, prompt.mel.shape[1]:]

    def dit_calls(self) -> AbstractContextManager[DitCalls]:
        """How a call's or a chunk's DiT calls run: through `stack` as a member for its flow work (joined
        before its encoder call, so that streams whose chunks start together go through the ODE together),
        or alone."""
        return nullcontext(AloneCalls(self.call)) if self.stack is None else self.stack.chunk_calls()

    def stream(self, prompt: PromptFeatures, *, final_cached: bool = False, window: int | None = None
               ) -> FlowStream:
        """A new utterance's `FlowStream`: upstream's computation (the defaults), or its final chunk run
        against the caches (`final_cached`), attention bounded to the prompt's blocks and the last `window`
        blocks, or both (see `FlowStream`)."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 block, got {window}")
        return FlowStream(self, prompt, final_cached, window,
                          [empty_caches(self.estimator.spec) for _ in self.steps])

    def give_back_arena(self) -> None:
        """Where the DiT's calls shrink its session's arena (`OrtRunner.shrinks_arena`), make its smallest
        call (one frame, nothing cached) so that the regions held by outputs of earlier calls, which a stream
        kept as its caches and has dropped, go back to the OS now: onnxruntime shrinks an arena only as one of
        its session's calls ends, and a stream closed early leaves 1.6 GB so at full size (cpu-fast, AMD EPYC
        Zen 4) until the next one. The call takes ~20 ms there. A closed runner, or one closed during the
        call, has no arena left."""
        estimator = self.estimator
        if isinstance(estimator, OrtRunner) and estimator.shrinks_arena and not estimator.closed:
            try:
                estimator.infer_outputs(estimator.spec.sample_inputs(dit_call_case(1, 0, 0, 1)), ["velocity"])
            except Exception:
                if not estimator.closed:
                    raise

    def max_tokens(self, prompt: PromptFeatures) -> int:
        """Generated tokens the noise table holds frames for after `prompt`'s tokens (more fail in
        `initial_x`)."""
        return self.noise.shape[2] // self.dims.token_mel_ratio - prompt.speech_tokens.shape[1]

    def prompt_lag(self, prompt: PromptFeatures) -> int:
        """Frames the prompt's mel is short of its tokens' (0 for an aligned prompt; a voice conversion's,
        as upstream's `frontend_vc` leaves it uncut, usually 0 to 2): the generated frames start that many
        frames before the tokens' own, and upstream's every chunk after the first starts again that many
        frames before the last one ended."""
        return self.dims.token_mel_ratio * prompt.speech_tokens.shape[1] - prompt.mel.shape[1]

    def prefix_frames(self, prompt_tokens: int) -> int:
        """Frames of a prompt of `prompt_tokens` tokens that `prefix` covers: the whole blocks among the
        frames of its tokens that have their look-ahead tokens in the prompt too."""
        block = self.dims.dit_block_frames
        readable = self.dims.token_mel_ratio * (prompt_tokens - self.dims.pre_lookahead_len)
        return max(0, readable // block * block)

    def prefix_nbytes(self, prompt_tokens: int) -> int:
        """Memory the `prefix` of a prompt of `prompt_tokens` tokens holds (`FlowPrefix.nbytes`), known
        before computing it: every cache input's shape for one stream with `prefix_frames` cached."""
        spec = self.estimator.spec
        frames = self.prefix_frames(prompt_tokens)
        dims = {name: 1 if name == BATCH else frames for name in spec.dims}
        pasts = {past for past, _ in cache_pairs(spec)}
        step = sum(spec.nbytes_of(t, dims) for t in spec.inputs if t.name in pasts)
        return step * len(self.steps)

    def prefix(self, prompt: PromptFeatures) -> FlowPrefix:
        """The caches after `prompt`'s `prefix_frames`, from `prefixes` or computed (and kept there)."""
        return self.prefixes.get(prompt, lambda: self.compute_prefix(prompt))

    def compute_prefix(self, prompt: PromptFeatures, *, pause: Callable[[], None] = no_pause) -> FlowPrefix:
        """The caches after `prompt`'s `prefix_frames`, computed (not looked up nor kept). `pause` is
        called before every graph call: a background job waits there, or raises to stop."""
        stream = self.stream(prompt)
        frames = self.prefix_frames(prompt.speech_tokens.shape[1])
        if frames:
            pause()
            mu, spks = self.encode(prompt.speech_tokens[0], 0, prompt, finalize=False)  # (1, 80, >= frames)
            stream.advance(mu[:, :, :frames], spks, block_frames=self.dims.dit_block_frames, pause=pause)
        return FlowPrefix(frames, tuple(stream.caches))

    def tokens_with_prompt(self, tokens: Sequence[int] | np.ndarray, prompt: PromptFeatures, *,
                           finalize: bool) -> np.ndarray:
        """The prompt's tokens then `tokens`, (P + N,) int64; a non-final call needs look-ahead tokens."""
        lookahead = self.dims.pre_lookahead_len
        if not finalize and len(tokens) <= lookahead:
            raise ValueError(f"a non-final flow call needs more than {lookahead} tokens, got {len(tokens)}")
        return np.concatenate([prompt.speech_tokens[0], np.asarray(tokens, dtype=np.int64)])

    def encode(self, all_tokens: np.ndarray, start: int, prompt: PromptFeatures, *, finalize: bool
               ) -> tuple[np.ndarray, np.ndarray]:
        """`mu` (1, 80, ratio·(end - start)) of tokens [start, end) of `all_tokens` and `spks` (1, 80).

        end is the last token, or the last before the look-ahead when not finalizing. The encoder runs
        from `ENCODER_LEFT_CONTEXT` tokens before `start`, which is all that those frames read.
        """
        lookahead = self.dims.pre_lookahead_len
        first = max(0, start - ENCODER_LEFT_CONTEXT)
        if finalize:
            body, ahead = all_tokens[first:], np.full(lookahead, -1, dtype=np.int64)
        else:
            body, ahead = all_tokens[first:-lookahead], all_tokens[-lookahead:]
        enc = self.encoder.infer({"tokens": body[None], "lookahead_tokens": ahead[None],
                                  "embedding": prompt.embedding.astype(np.float32)})
        skip = self.dims.token_mel_ratio * (start - first)
        return enc["mu"][:, :, skip:], enc["spks"]

    def cond(self, prompt: PromptFeatures, start: int, end: int) -> np.ndarray:
        """`cond` (1, 80, end - start) of frames [start, end): the prompt's mel on its frames, else 0."""
        cond = np.zeros((1, self.dims.mel_bins, end - start), dtype=np.float32)
        prompt_part = prompt.mel[0, start:end].T  # (80, frames of the prompt in range)
        cond[0, :, :prompt_part.shape[1]] = prompt_part
        return cond

    def initial_x(self, start: int, end: int) -> np.ndarray:
        """The initial x (1, 80, end - start) of frames [start, end): the position-locked noise table."""
        if end > self.noise.shape[2]:
            raise SynthesisError(f"{end} mel frames (prompt included) exceed the flow noise table's "
                                 f"{self.noise.shape[2]}; use a shorter text or prompt")
        return np.array(self.noise[:, :, start:end], dtype=np.float32)

    def solve(self, x: np.ndarray, velocity: Velocity) -> np.ndarray:
        """Euler over `euler_steps` from x (1, 80, T), CFG-guided: v = 1.7 v_cond - 0.7 v_uncond.
        `velocity` is called with the step's index and both CFG rows' x."""
        guided, unguided = np.float32(1.0 + CFG_RATE), np.float32(CFG_RATE)
        for step, (_, dt) in enumerate(self.steps):
            v = velocity(step, np.concatenate([x, x]))  # (2, 80, T)
            x = x + dt * (guided * v[:1] - unguided * v[1:])
        return x


def _ode_step(step: int) -> np.ndarray:
    """`flow_estimator_cached`'s `ode_step` input."""
    return np.array([step], dtype=np.int64)


@dataclass
class FlowStream:
    """One streamed utterance's flow state, all of it in these fields (make one with `Flow.stream`).

    A `push` runs `flow_encoder` over the new tokens (plus its left context) and, at every ODE step,
    `flow_estimator_cached` over the new frames only, with that step's caches: per DiT block the keys
    and values of the frames before, and the conv position embedding's left context. The outputs
    become the next push's caches. Why this equals upstream's re-run of every frame for a non-final
    chunk: the frames before it are whole 50-frame blocks (the first hop's pad and every hop are
    multiples of a block; `push` checks), so under the block-causal mask none of them attends to a
    later frame; every other part of the DiT is per frame (AdaLN from t, LayerNorm over channels, the
    FF) or causal (the conv position embedding); their noise is position-locked and their `mu` and
    `cond` do not change (their look-ahead tokens existed already). So at every step, in both CFG rows,
    their keys, values and velocities are the ones the re-run computes again. The first non-final push
    starts from the prompt's `FlowPrefix` (`Flow.prefix`), the caches of its leading whole blocks
    (the same argument: their frames read prompt tokens only), so it runs the frames after them.

    By default (exact) the final push re-runs the full-attention flow over every token, as upstream does
    (its full attention changes every frame, so nothing cached applies). With `final_cached` it runs over
    its new frames against the caches like the others, with full attention among them: no re-run. With a
    `window` the caches keep the prompt's blocks and the last `window` blocks (older keys/values are
    dropped after each step): the cost of every push is bounded. Both deviate from upstream, as
    docs/runtime.md states and measures.
    """

    flow: Flow = field(repr=False)
    prompt: PromptFeatures = field(repr=False)
    final_cached: bool
    """Whether the final push runs against the caches (else upstream's re-run over every frame)."""
    window: int | None
    """Blocks of generated frames whose keys/values attention keeps besides the prompt's blocks;
    None keeps every frame."""
    caches: list[dict[str, Feed]] = field(repr=False)
    """Per ODE step, the `past_*` inputs of `flow_estimator_cached` for the next push (numpy arrays, or values
    on the GPU with `Flow.keep_on_device`: `OrtValue`s, or `BufferView`s of a stacked call's); empty once the
    final push has begun (a full re-run reads none of them) or run (nothing reads them again)."""
    frames: int = 0
    """Frames (prompt included) run so far: the position of the next new frame."""
    tokens: int = 0
    """Generated tokens whose mel frames `push` has returned."""
    finished: bool = False
    tail: np.ndarray | None = field(default=None, repr=False)
    """The last push's last `Flow.prompt_lag` frames, where a prompt's mel is short of its tokens': the next
    chunk starts with them again, as upstream's does."""

    @property
    def cached_frames(self) -> int:
        """Frames whose keys/values the caches hold: `frames`, or fewer if the window dropped some."""
        flow = self.flow
        return feed_shape(self.caches[0][flow.growing[0]])[flow.frame_axis] if self.caches else 0

    @property
    def cache_bytes(self) -> int:
        """Memory held by the caches (every ODE step, both CFG rows)."""
        return sum(feed_nbytes(a) for step in self.caches for a in step.values())

    def push(self, tokens: Sequence[int], *, finalize: bool, pause: Callable[[], None] = no_pause
             ) -> np.ndarray:
        """Every generated token so far (N,) -> the mel (1, 80, n) of those after the first `self.tokens`:
        up to N - 3 (the rest are look-ahead) or, when finalizing, N. Exact mode: the frames that
        `Flow` over all tokens gives there (to the graphs' float rounding on other shapes, ~1e-6). `pause`
        is called before every DiT call."""
        if self.finished:
            raise ValueError("this flow stream is finalized already")
        flow, d = self.flow, self.flow.dims
        ratio, block = d.token_mel_ratio, d.dit_block_frames
        covered = len(tokens) - (0 if finalize else d.pre_lookahead_len)  # tokens with frames after this push
        if covered <= self.tokens:
            raise ValueError(f"no new tokens: {self.tokens} have their frames already, {len(tokens)} given")
        if finalize and not self.final_cached:
            self.caches = []  # released before the re-run allocates its own activations: a lower peak
            mel = flow(np.asarray(tokens, dtype=np.int64), self.prompt, finalize=True, streaming=False,
                       pause=pause)
            emitted, self.tokens, self.finished = ratio * self.tokens, covered, True
            self.frames = self.prompt.mel.shape[1] + mel.shape[2]
            return mel[:, :, emitted:]
        all_tokens = flow.tokens_with_prompt(tokens, self.prompt, finalize=finalize)
        if not finalize:
            self._start()
        with flow.dit_calls() as calls:
            mu, spks = flow.encode(all_tokens, self.frames // ratio, self.prompt, finalize=finalize)
            first, end = self.frames, self.frames + mu.shape[2]  # mu: (1, 80, n)
            if not finalize and end % block:
                raise ValueError(f"a non-final chunk ends at frame {end}, not on a {block}-frame block "
                                 "boundary: its frames would see later ones, so caching them would change "
                                 "the result")
            x = self.advance(mu, spks, block_frames=end if finalize else block, pause=pause, calls=calls,
                             keep=not finalize)
        if finalize:
            self.caches, self.frames = [], end  # nothing reads the caches again
        mel = self._from_emitted(x, first)
        self._keep_tail(x)
        self.tokens, self.finished = covered, finalize
        return mel

    def peek(self, tokens: Sequence[int], *, pause: Callable[[], None] = no_pause) -> np.ndarray:
        """The mel (1, 80, n) of a non-final chunk that ends inside a DiT block (a first chunk of
        `ChunkPolicy.first_chunk_tokens`): the frames after the first `self.tokens` tokens, up to N - 3,
        solved against the caches (the prompt's prefix on) and not kept, since the cut block's frames
        change once the block is whole. The stream stays where it was: its next `push` runs that block
        again. The frames equal the block-causal re-run over every frame (the same argument as `push`).
        `pause` is called before every DiT call."""
        if self.finished:
            raise ValueError("this flow stream is finalized already")
        flow, ratio = self.flow, self.flow.dims.token_mel_ratio
        self._start()
        first = self.frames
        with flow.dit_calls() as calls:
            all_tokens = flow.tokens_with_prompt(tokens, self.prompt, finalize=False)
            mu, spks = flow.encode(all_tokens, first // ratio, self.prompt, finalize=False)
            x = self.advance(mu, spks, block_frames=flow.dims.dit_block_frames, pause=pause, calls=calls,
                             keep=False)
        return self._from_emitted(x, first)

    def _from_emitted(self, x: np.ndarray, first: int) -> np.ndarray:
        """The frames of `x` (1, 80, n), which starts at frame `first`, from the first that the generated
        tokens after the first `self.tokens` give (the prompt's mel frames on): where that lies before
        `first` (a prompt whose mel is short of its tokens'), the last push's tail first."""
        emitted = self.prompt.mel.shape[1] + self.flow.dims.token_mel_ratio * self.tokens
        if emitted >= first:
            return x[:, :, emitted - first:]
        assert self.tail is not None and self.tail.shape[2] >= first - emitted
        return np.concatenate([self.tail[:, :, emitted - first:], x], axis=2)

    def _keep_tail(self, x: np.ndarray) -> None:
        lag = self.flow.prompt_lag(self.prompt)
        self.tail = x[:, :, x.shape[2] - lag:] if lag > 0 else None

    def _start(self) -> None:
        """Before the first chunk: start after the prompt's prefix (`Flow.prefix`)."""
        if not self.frames:
            prefix = self.flow.prefix(self.prompt)
            self.frames, self.caches = prefix.frames, [dict(step) for step in prefix.caches]

    def advance(self, mu: np.ndarray, spks: np.ndarray, *, block_frames: int,
                pause: Callable[[], None] = no_pause, calls: DitCalls | None = None, keep: bool = True
                ) -> np.ndarray:
        """Solve the ODE over the next frames (their `mu` (1, 80, n), `spks` (1, 80)) against the caches,
        which then cover them too (`keep`; else the calls give back no caches and the stream stays where it
        was: a final push, a peek): x (1, 80, n). `block_frames` is the mask's block (counted from frame 0);
        `pause` is called before every graph call (`Flow.compute_prefix`); the DiT calls go through `calls`
        (None: alone, as a prompt's prefix computes, whose caches a `FlowPrefixCache` keeps: rows of a stacked
        call's outputs would hold the whole call's memory there)."""
        flow, first = self.flow, self.frames
        dit = calls if calls is not None else AloneCalls(flow.call)
        end = first + mu.shape[2]
        feeds = {**dit_attention(first, mu.shape[2], self.cached_frames, block_frames),
                 **_cfg_rows(mu, spks, flow.cond(self.prompt, first, end))}
        presents = (Presents.NONE if not keep else Presents.DEVICE if flow.keep_on_device else Presents.HOST)

        def velocity(step: int, x: np.ndarray) -> np.ndarray:
            inputs = {"x": x, "ode_step": _ode_step(step), **feeds, **self.caches[step]}
            v, caches = dit.velocity(inputs, presents=presents, pause=pause)
            if keep:
                self.caches[step] = self._windowed(caches)
            return v

        x = flow.solve(flow.initial_x(first, end), velocity)
        if keep:
            self.frames = end
        return x

    def _windowed(self, caches: Mapping[str, Feed]) -> dict[str, Feed]:
        """`caches` with the keys/values of frames outside the window dropped (all kept without one), where
        they are (on the host, or on the GPU by `Flow.frame_copies`)."""
        out: dict[str, Feed] = dict(caches)
        if self.window is None:
            return out
        flow = self.flow
        block, axis = flow.dims.dit_block_frames, flow.frame_axis
        head = -(-self.prompt.mel.shape[1] // block) * block  # the prompt's blocks
        dropped = feed_shape(caches[flow.growing[0]])[axis] - head - self.window * block
        if dropped <= 0:
            return out
        if not isinstance(caches[flow.growing[0]], np.ndarray):  # kept on the device
            assert flow.frame_copies is not None
            out.update(flow.frame_copies.drop({name: caches[name] for name in flow.growing}, head, dropped))
            return out
        for name in flow.growing:
            a = caches[name]
            assert isinstance(a, np.ndarray)
            out[name] = np.delete(a, np.s_[head:head + dropped], axis=axis)
        return out


class VocoderKey(NamedTuple):
    """What a vocoder call's streams share: `hift_f0`'s frames, the first of them that only it reads, and the
    utterance frame that `hift_decoder`'s first frame is (where the noise table is read from)."""

    frames: int
    skip: int
    first_frame: int


@dataclass(frozen=True)
class VocoderJob:
    """A stream's part of a vocoder call."""

    mel: np.ndarray
    """(1, 80, frames) float32: the frames `hift_f0` reads; `hift_decoder` reads those after the key's
    `skip`."""
    acc: np.ndarray
    """float64 (H,): the running sum of the phase steps of every frame before the key's `first_frame`."""


class VocoderOut(NamedTuple):
    """What a stream gets back of a vocoder call."""

    waveform: np.ndarray
    """float32 (U n,): the samples of the `n` frames `hift_decoder` ran over."""
    acc: np.ndarray
    """float64 (1, n, H): the phase steps' running sums through each of those frames."""


OFFLINE_WINDOW_FRAMES = 200
"""`Vocoder.repeat_shapes`: the `hift_decoder` length of a final call's windows over more frames than this
(4 s of audio). On the H200 a window call was ~11-14 ms at 86 frames (its launches) and a warm 500-frame call
19 ms, where a call of a new length took ~120 ms more (performance-log.md, twelfth session): 10 s in three
windows of this length."""


class Vocoder:
    """`hift_f0` -> the harmonic phase -> `hift_decoder`: mel -> 24 kHz waveform."""

    def __init__(self, f0: Runner, decoder: Runner, sine_noise: UniformNoise, dims: ModelDims,
                 layout: HiftLayout, *, repeat_shapes: bool = False) -> None:
        """`sine_noise` is the bundle's table (1, max samples, harmonics), read from sample 0; `layout` is
        the bundle's (its `model.hift`). `repeat_shapes`: calls keep to lengths they have had, where a new
        one costs (onnxruntime's CUDA convolutions build their cuDNN plans again for every new input length,
        and `runners.ShapePool` keeps a session per length): a stream's final window takes its previous
        window's length, and a final call over more than `OFFLINE_WINDOW_FRAMES` frames runs as a stream of
        windows of that length (`VocoderStream`: its samples to ~1e-6)."""
        if layout.samples_per_frame != dims.samples_per_frame:
            raise ValueError(f"the HiFT layout gives {layout.samples_per_frame} samples per frame, "
                             f"the bundle {dims.samples_per_frame}")
        self.f0, self.decoder = f0, decoder
        self.sine_noise = sine_noise
        self.dims = dims
        self.layout = layout
        self.repeat_shapes = repeat_shapes
        self.stack: CallStack[VocoderKey, VocoderJob, VocoderOut] | None = None
        """Where concurrent vocoder calls gather into stacked calls (`stack_calls`); None: each runs alone."""

    def stack_calls(self, *, max_streams: int = MAX_BATCH) -> None:
        """Run concurrent streams' windows of one `VocoderKey` as one `hift_decoder` call (`call_stack`; f0
        stays a call per stream: `run`). Rows are independent, so each stream gets its window alone: its f0
        and phase to the bit, its samples to the decoder's rounding in another batch (on the CPU: its
        convolutions split among threads otherwise, and onnxruntime's `Sin`, which computes the elements past
        a tensor's last vector packet in scalar code; up to 3e-6 measured on a Zen 4 with AVX-512,
        performance-log.md, "the streams' vocoder calls stacked")."""
        self.stack = CallStack(self.run, max_streams=max_streams)

    def calls(self, key: VocoderKey | None = None) -> AbstractContextManager[VocoderCalls]:
        """How a chunk's vocoder call runs: alone, or through `stack` as a member from now until its call,
        expected by calls of `key` (where known)."""
        if self.stack is None:
            return nullcontext(VocoderCalls(self))
        return _stack_member(self, self.stack, key)

    def __call__(self, mel: np.ndarray, *, finalize: bool, calls: VocoderCalls | None = None,
                 pause: Callable[[], None] = no_pause) -> np.ndarray:
        """mel (1, 80, T) -> float32 samples: U·T when final, else the U·(T - 8) that are final already
        (`HiftLayout.final_lookahead`; upstream's `finalize=False`, whose output is that prefix of the final
        one). The call runs through `calls` (None: its own `calls()`) after `pause`; with `repeat_shapes`, a
        final call of its own over more than `OFFLINE_WINDOW_FRAMES` frames runs in windows (`windowed`)."""
        frames, spf = mel.shape[2], self.dims.samples_per_frame
        self.check_frames(frames, finalize=finalize)
        if finalize and calls is None and self.repeat_shapes and frames > OFFLINE_WINDOW_FRAMES:
            return self.windowed(mel, pause=pause)
        key = self.key(frames)
        job = VocoderJob(mel, np.zeros(self.dims.harmonics))
        if calls is None:
            with self.calls(key) as own:
                wav = own.run(key, job, pause=pause).waveform
        else:
            wav = calls.run(key, job, pause=pause).waveform
        return wav if finalize else wav[: spf * (frames - self.layout.final_lookahead)]

    def windowed(self, mel: np.ndarray, *, pause: Callable[[], None] = no_pause) -> np.ndarray:
        """The final samples of mel (1, 80, T) through a `VocoderStream` whose every `hift_decoder` call is
        `OFFLINE_WINDOW_FRAMES` long (T at least that): a first push of that many frames, then pushes that
        add what a window holds besides its margin and look-ahead, the final one shortened to the others'
        length. Each call alone, after `pause`."""
        frames, window = mel.shape[2], OFFLINE_WINDOW_FRAMES
        if frames < window:
            raise ValueError(f"windows of {window} frames need at least that many, got {frames}")
        hop = window - self.layout.window_margin() - self.layout.final_lookahead
        ends = [*range(window, frames, hop), frames]
        stream, pieces, start = self.stream(), [], 0
        for end in ends:
            pieces.append(stream.push(mel[:, :, start:end], finalize=end == frames, pause=pause))
            start = end
        return np.concatenate(pieces)

    @staticmethod
    def key(frames: int) -> VocoderKey:
        """The key of a call over an utterance's first `frames` frames."""
        return VocoderKey(frames, 0, 0)

    def check_frames(self, frames: int, *, finalize: bool) -> None:
        """Raise unless `frames` mel frames of an utterance can be vocoded (`SynthesisError`: too long)."""
        lookahead = self.layout.final_lookahead
        if not finalize and frames <= lookahead:
            raise ValueError(f"a non-final vocoder call needs more than {lookahead} frames")
        samples = frames * self.dims.samples_per_frame
        if samples > self.sine_noise.shape[1]:
            raise SynthesisError(f"{samples} samples exceed the sine noise table's "
                                 f"{self.sine_noise.shape[1]}; use a shorter text")

    def run(self, key: VocoderKey, jobs: list[VocoderJob]) -> list[VocoderOut]:
        """The jobs' windows: `hift_f0` over each job's mel, the phase continued from its `acc` (upstream's
        staircase phase bit for bit, the spec's formula), then one `hift_decoder` call over every job's
        frames after `key.skip`, the noise table read from `key.first_frame`'s first sample.

        f0 runs a call per stream: the phase integrates it, so the last bit of f0 that another batch or
        another split of a row's convolutions among threads moves becomes ~1e-3 of waveform (up to 2e-2
        measured, stacked at 2 threads on a Zen 4 with AVX-512); the decoder's rows move by its own rounding
        only (3e-6 there)."""
        d, spf = self.dims, self.dims.samples_per_frame
        for job in jobs:  # a NaN would reach the waveform as a constant, or as silence where it is clipped
            require_finite(job.mel, "the flow's mel")
        f0 = np.concatenate([self.f0.infer({"mel": np.ascontiguousarray(job.mel, dtype=np.float32)})["f0"]
                             for job in jobs])[:, key.skip:]  # (S, n)
        accs = [accumulate_phase(job.acc, phase_steps(f0[i:i + 1], d.harmonics, d.sample_rate))
                for i, job in enumerate(jobs)]
        n = f0.shape[1]
        noise = self.sine_noise.window(key.first_frame * spf, (key.first_frame + n) * spf)  # (1, U n, H)
        mel = np.concatenate([job.mel[:, :, key.skip:] for job in jobs])  # (S, 80, n)
        feeds = {"mel": np.ascontiguousarray(mel, dtype=np.float32), "f0": f0,
                 "phase": np.concatenate([wrap_phase(acc, spf) for acc in accs]), "sine_noise": noise}
        wav = self.decoder.infer(feeds)["waveform"]  # (S, U n)
        require_finite(wav, "the vocoder's waveform")
        return [VocoderOut(wav[i], acc) for i, acc in enumerate(accs)]

    def stream(self, margin: int | None = None) -> VocoderStream:
        """A new utterance's `VocoderStream`; `margin` (mel frames) defaults to the layout's
        `window_margin()`, and exists to show that a smaller one changes the samples."""
        margin = self.layout.window_margin() if margin is None else margin
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        return VocoderStream(self, margin, self.layout.f0_left_context(), acc=np.zeros(self.dims.harmonics),
                             mel=np.zeros((1, self.dims.mel_bins, 0), dtype=np.float32))


@dataclass(frozen=True)
class VocoderCalls:
    """How a chunk makes its vocoder call: alone, or through the vocoder's stack as `member`."""

    vocoder: Vocoder
    member: StackMember[VocoderKey] | None = None

    def pausing(self, pause: Callable[[], None]) -> Callable[[], None]:
        """`pause`, during which a stacked call does not wait for this chunk."""
        stack = self.vocoder.stack
        return pause if self.member is None or stack is None else stack.pausing(self.member, pause)

    def run(self, key: VocoderKey, job: VocoderJob, *, pause: Callable[[], None]) -> VocoderOut:
        """After `pause`, the call of `key` on `job` (`Vocoder.run`), alone or stacked."""
        stack = self.vocoder.stack
        if self.member is None or stack is None:
            pause()
            return self.vocoder.run(key, [job])[0]
        return stack.call(self.member, key, job, pause=pause)


@contextmanager
def _stack_member(vocoder: Vocoder, stack: CallStack[VocoderKey, VocoderJob, VocoderOut],
                  key: VocoderKey | None) -> Iterator[VocoderCalls]:
    with stack.member(key) as member:
        yield VocoderCalls(vocoder, member)


class LastWindow(NamedTuple):
    """A `VocoderStream`'s previous call, kept where its vocoder repeats shapes: a final window may start
    anywhere in it."""

    first_frame: int
    frames: int
    """`hift_decoder`'s frames in it."""
    acc_before: np.ndarray
    """float64 (H,): the phase steps' running sum of the frames before `first_frame`."""
    acc: np.ndarray
    """float64 (1, frames, H): the running sums through each of its frames."""


@dataclass
class VocoderStream:
    """One streamed utterance's vocoder state, all of it in these fields (make one with `Vocoder.stream`).

    Each `push` runs `hift_f0` over [start - f0_context, frames) and `hift_decoder` over [start, frames)
    (mel frames, absolute), with the phase continued from `acc` and the noise table from frame `start`,
    and keeps the samples from `samples` on: the first `margin` frames' samples only absorb the
    window's left edge. The cost per push is bounded by the new frames plus margin + f0_context + the
    layout's final look-ahead. Where the vocoder repeats shapes (`Vocoder.repeat_shapes`), a final push
    shorter than the previous window starts earlier, inside it (`last`), so that its window has that length:
    more margin, the same samples.
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
    last: LastWindow | None = field(default=None, repr=False)
    """The previous call, with `Vocoder.repeat_shapes` (`mel` then starts at its first frame's f0 context)."""

    @property
    def mel_start(self) -> int:
        """The utterance frame that `mel` starts at."""
        return self.frames - self.mel.shape[2]

    def key(self, new_frames: int, *, finalize: bool = False) -> VocoderKey:
        """The key of the call that a push of `new_frames` frames makes."""
        frames = self.frames + new_frames
        first = self._first_frame(frames, finalize=finalize)
        f0_first = max(0, first - self.f0_context)
        return VocoderKey(frames - f0_first, first - f0_first, first)

    def _first_frame(self, frames: int, *, finalize: bool) -> int:
        """The first frame of the window of a push up to `frames`: `start`, or for a final push whose window
        would be shorter than the previous one, the frame that gives it the previous one's length."""
        last = self.last
        if not finalize or last is None:
            return self.start
        return max(last.first_frame, min(self.start, frames - last.frames))

    def _acc_at(self, frame: int) -> np.ndarray:
        """The phase steps' running sum of the frames before `frame` (`start`, or one in `last`)."""
        if frame == self.start:
            return self.acc
        assert self.last is not None and frame >= self.last.first_frame
        if frame == self.last.first_frame:
            return self.last.acc_before
        return self.last.acc[0, frame - self.last.first_frame - 1]

    def push(self, mel: np.ndarray, *, finalize: bool, calls: VocoderCalls | None = None,
             pause: Callable[[], None] = no_pause) -> np.ndarray:
        """Append mel frames (1, 80, n); returns the float32 samples that became final: what `Vocoder`
        over every frame pushed so far gives after its first `samples` (up to the graphs' rounding on
        other lengths, ~1e-6). The call runs through `calls` (None: alone) after `pause`."""
        if self.finished:
            raise ValueError("this vocoder stream is finalized already")
        voc, spf = self.vocoder, self.vocoder.dims.samples_per_frame
        frames = self.frames + mel.shape[2]
        voc.check_frames(frames, finalize=finalize)
        key = self.key(mel.shape[2], finalize=finalize)
        first = key.first_frame
        tail = np.concatenate([self.mel, mel.astype(np.float32)], axis=2)  # frames [mel_start, frames)
        job = VocoderJob(tail[:, :, first - key.skip - self.mel_start:], self._acc_at(first))
        wav, acc = (calls or VocoderCalls(voc)).run(key, job, pause=pause)
        end = frames if finalize else frames - voc.layout.final_lookahead
        new = wav[self.samples - first * spf:(end - first) * spf]

        # The next window starts `margin` frames before the next new sample. The frames it skips lie
        # >= margin + final_lookahead frames before `frames`, past f0's look-ahead: their phase steps are
        # final.
        start = max(0, end - self.margin)
        self.acc = acc[0, start - first - 1] if start > first else job.acc
        kept_from = start
        if voc.repeat_shapes:
            self.last = LastWindow(first, frames - first, job.acc, acc)
            kept_from = first
        self.mel = tail[:, :, max(0, kept_from - self.f0_context) - self.mel_start:]
        self.frames, self.samples, self.start, self.finished = frames, end * spf, start, finalize
        return new


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """Upstream's offline `speed`: the mel linearly resampled to int(T / speed) frames."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return mel if speed == 1.0 else interpolate_linear(mel, int(mel.shape[2] / speed))
