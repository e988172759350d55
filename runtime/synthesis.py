"""Offline and streaming synthesis over a runtime bundle: LLM -> flow -> vocoder.

`Synthesizer` opens the graphs once. `synthesize` is upstream's
non-streaming path: all tokens, one full-attention flow call, one final vocoder call. `stream` is
upstream's CosyVoice3 streaming (`CosyVoice2Model.tts` + `CosyVoice3Model.token2wav`): chunks on the
schedule of a `ChunkPolicy`, each non-final chunk running the block-causal flow, the last one a
full-attention, finalizing call over all tokens; each chunk carries only the samples that are new.
Upstream re-runs the flow over the whole token prefix per chunk (`"rerun"`); by default only the new
frames run, against per-step key/value caches of the earlier ones (`"cache"`, `token2wav.FlowStream`),
which gives the same frames; `"window"` bounds the cost per chunk by attending to the prompt and the
last few blocks only. The vocoder either re-runs over the whole accumulated mel as upstream does
(`"rerun"`), or over the new frames and a fixed left margin (`"window"`, `token2wav.VocoderStream`),
which gives the same samples at a bounded cost per chunk. The LLM runs interleaved with the chunks, and
a chunk fires as soon as its tokens exist, so the boundaries depend on the token sequence only.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType, TracebackType
from typing import Any, Self

import numpy as np

from cosyvoice_graphs import DIT, FLOW_ENCODER, HIFT_DECODER, HIFT_F0, LLM_DECODE, MAX_BATCH
from cosyvoice_graphs.bundle_layout import FLOW_NOISE, SINE_NOISE, SPEECH_EMBEDDING, TEXT_EMBEDDING
from cosyvoice_graphs.precision import FP16, TF32
from cosyvoice_graphs.recipes import RECIPES

from .bundle import BundleGraphs, RuntimeBundle
from .chunk_policy import ChunkPolicy, check_policy
from .chunk_turns import ChunkTurns, no_pause
from .decode_batch import BatchedDecoding, BatchObserver, DecodeBatcher
from .decode_graphs import GraphedSteps
from .dit_graphs import GraphedDit
from .dit_stack import DitStack
from .errors import SynthesisError, UserError
from .flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from .frontend import PromptFeatures
from .llm import Decoding, LlmRequest, SpeechTokenLM
from .prefix_jobs import LiveWork
from .process_memory import release_free_heap
from .runners import (
    CPU,
    CPU_PROVIDERS,
    CUDA,
    OrtRunner,
    Runner,
    ShapePool,
    check_opens,
    check_runs,
    decode_body,
    open_runner,
    prefill_body,
)
from .runners.ort_settings import threads_problem, usable_cpus
from .sampling import Sampler
from .token2wav import Flow, FlowStream, Vocoder, VocoderCalls, VocoderStream, change_speed

log = logging.getLogger(__name__)
GRAPH_CAPTURE_REFUSED = "cannot use the graph capture feature"
"""What onnxruntime says where it refuses a session CUDA graphs (a node placed off the GPU)."""

__all__ = ["AudioChunk", "ChunkTimings", "Mode", "Synthesis", "SynthesisError", "Synthesizer",
           "llm_request"]


class Mode(StrEnum):
    """Upstream's CosyVoice3 inference entry points; they differ in what the LLM is given."""

    ZERO_SHOT = "zero-shot"
    """Prompt transcript + prompt speech tokens continue into the text."""
    CROSS_LINGUAL = "cross-lingual"
    """No prompt text or speech in the LLM (the text carries `<|endofprompt|>` itself)."""
    INSTRUCT2 = "instruct2"
    """The instruction as prompt text, no prompt speech in the LLM."""


def llm_request(mode: Mode, text_ids: Sequence[int], prompt: PromptFeatures,
                prompt_text_ids: Sequence[int] = ()) -> LlmRequest:
    """What the LLM sees in `mode` (upstream's `frontend_zero_shot` / `_cross_lingual` / `_instruct2`).

    `prompt_text_ids` are the formatted prompt transcript (zero-shot) or instruction (instruct2); the
    flow always gets the prompt's tokens, mel and x-vector.
    """
    text = tuple(int(i) for i in text_ids)
    prompt_text = tuple(int(i) for i in prompt_text_ids)
    if mode is Mode.ZERO_SHOT:
        return LlmRequest(text, prompt_text, tuple(int(t) for t in prompt.speech_tokens[0]))
    if mode is Mode.CROSS_LINGUAL:
        if prompt_text:
            raise ValueError("cross-lingual takes no prompt text")
        return LlmRequest(text)
    return LlmRequest(text, prompt_text)


@dataclass(frozen=True)
class ChunkTimings:
    """Seconds spent on one chunk, and since the stream started."""

    llm: float
    """Decoding the tokens this chunk waited for."""
    flow: float
    vocoder: float
    elapsed: float
    """From the start of the stream to this chunk being ready (first chunk: its latency)."""


@dataclass(frozen=True)
class AudioChunk:
    """One piece of a streamed utterance: new samples only, in order, without overlap."""

    index: int
    samples: np.ndarray
    """float32 (n,) in [-audio_limit, audio_limit]."""
    sample_rate: int
    is_final: bool
    token_range: tuple[int, int]
    """[start, end) of the generated tokens whose mel this chunk added to the accumulated mel."""
    sample_range: tuple[int, int]
    """[start, end) of `samples` in the utterance's waveform."""
    timings: ChunkTimings
    mel: np.ndarray
    """float32 (1, 80, frames): the mel frames this chunk added to the utterance's, which the vocoder
    turned into `samples` and the chunks before."""

    def record(self, segment: int) -> dict[str, Any]:
        """A JSON-able summary (for `--chunks-out`, goldens): ranges, the samples' sha256, timings."""
        return {"segment": segment, "index": self.index, "is_final": self.is_final,
                "token_range": list(self.token_range), "sample_range": list(self.sample_range),
                "sha256": hashlib.sha256(self.samples.tobytes()).hexdigest(),
                "timings": {k: round(v, 6) for k, v in vars(self.timings).items()}}


@dataclass(frozen=True)
class Synthesis:
    """One offline synthesised segment."""

    speech_tokens: list[int]
    mel: np.ndarray
    """(1, 80, T) float32 generated mel frames (after `speed`)."""
    audio: np.ndarray
    """float32 samples at `sample_rate`."""
    sample_rate: int
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per stage: llm, flow, vocoder."""

    def as_chunk(self) -> AudioChunk:
        """The segment as a stream's one final chunk (what offline callers iterate like a stream)."""
        t = self.timings
        timings = ChunkTimings(t["llm"], t["flow"], t["vocoder"], sum(t.values()))
        return AudioChunk(0, self.audio, self.sample_rate, True, (0, len(self.speech_tokens)),
                          (0, len(self.audio)), timings, self.mel)


class Synthesizer:
    """The bundle's graphs, opened once on one provider, and the tables they read."""

    def __init__(self, bundle: RuntimeBundle, provider: str = CPU, *, threads: int | None = None,
                 flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, max_batch: int | None = None,
                 batch_observer: BatchObserver | None = None, chunk_policy: ChunkPolicy | None = None,
                 chunk_slots: int | None = None, cuda_graphs: bool | None = None, stack_dit: bool = False,
                 stack_vocoder: bool = False) -> None:
        """Open every graph of `bundle` on `provider` (see `cosyvoice_runtime.runners.PROVIDERS`);
        `flow_prefix_bytes` bounds the streaming flow's per-prompt cache (`Flow.prefixes`). `max_batch` > 1
        decodes concurrent requests' speech ids together (`decode_batch`, reporting to `batch_observer`),
        which needs the bundle's `llm_decode` on the decode steps (`batches`); 1 decodes each on its own;
        None: `default_max_batch`.
        `chunk_slots` is how many of the batch's streams run their chunks' flow and vocoder calls at once
        (`set_max_batch`). `cuda_graphs`: the decode steps replay from CUDA graphs (`decode_graphs`; on
        cuda, where `llm_decode` takes them), in a batch even of one (None: wherever they can,
        `uses_cuda_graphs`), and so do the DiT's calls where its graph allows (`dit_replays`,
        `dit_graphs`). `stack_dit`: concurrent DiT calls at the
        same ODE step over the same frames run as one call (`dit_stack`; the calls of chunks that run at once:
        every stream's without a batch, a batch's `chunk_slots`). `stack_vocoder`: concurrent vocoder calls
        over the same frames run as one `hift_decoder` call (`Vocoder.stack_calls`). `chunk_policy` is the
        streams' schedule (None: upstream's); it, `max_batch`, `chunk_slots`, `cuda_graphs` and `stack_dit`
        are checked before any graph opens (`check_synthesis`)."""
        graphs = check_synthesis(bundle, provider, max_batch=max_batch, chunk_slots=chunk_slots,
                                 chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                                 threads=threads)
        max_batch = default_max_batch(bundle, provider) if max_batch is None else max_batch
        cuda_graphs = uses_cuda_graphs(cuda_graphs, bundle, provider)
        self.chunk_policy = check_policy(chunk_policy, bundle)
        """The streams' chunk schedule unless a call gives its own."""
        self.bundle, self.provider, self.threads = bundle, provider, threads
        self.dims = bundle.dims
        self._runners: dict[str, Runner] = {}
        try:
            for name in graphs:
                if name == DIT and cuda_graphs and dit_replays(bundle):
                    self._runners[name] = open_replayed_dit(bundle, provider, threads)
                else:
                    self._runners[name] = open_runner(bundle, name, provider, threads=threads,
                                                      cuda_graph=cuda_graphs and name == LLM_DECODE)
        except BaseException:
            self.close()
            raise
        r = self._runners
        prefill = prefill_body(bundle, provider)
        self.lm = SpeechTokenLM(r[decode_body(bundle, provider)], bundle.table(TEXT_EMBEDDING),
                                bundle.table(SPEECH_EMBEDDING),
                                sos=bundle.sos, task_id=bundle.task_id, endofprompt_id=bundle.endofprompt_id,
                                speech_token_size=self.dims.speech_token_size,
                                prefill=None if prefill is None else r[prefill])
        estimator = r[DIT]
        self.dit_graphs = GraphedDit(estimator) if isinstance(estimator, OrtRunner) and estimator.cuda_graph \
            else None
        """Where the DiT's calls replay from CUDA graphs (`cuda_graphs`, `dit_replays`)."""
        self.flow = Flow(r[FLOW_ENCODER], estimator, bundle.table(FLOW_NOISE), self.dims,
                         prefix_cache_bytes=flow_prefix_bytes, call=self.dit_graphs)
        if stack_dit:
            self.flow.stack = DitStack(estimator, call=self.flow.call)
        # where a vocoder graph has a session per shape, its calls keep to shapes they have had
        pooled = isinstance(r[HIFT_DECODER], ShapePool)
        self.vocoder = Vocoder(r[HIFT_F0], r[HIFT_DECODER], bundle.uniform_noise(SINE_NOISE), self.dims,
                               bundle.manifest.model.hift, repeat_shapes=pooled)
        if stack_vocoder:
            self.vocoder.stack_calls()
        self.live = LiveWork()
        """Streams and offline syntheses in flight, held from their first step to their end: background work
        (`PrefixJobs`) waits while there are any."""
        self.graphs: GraphedSteps | None = None
        """Where the batch's decode steps replay from CUDA graphs (`cuda_graphs`)."""
        if cuda_graphs:
            assert self.lm.in_place is not None  # llm_decode: check_cuda_graphs
            self.graphs = GraphedSteps(self.lm.in_place)
        self.batcher: DecodeBatcher | None = None
        """Where decodings run when `max_batch` > 1 or with `cuda_graphs`."""
        self._stop_batch: Callable[[], object] = lambda: None
        """Closes `batcher`, once."""
        self.turns: ChunkTurns | None = None
        """The order of the batch's sessions' flow and vocoder work (`chunk_turn`)."""
        self.set_max_batch(max_batch, batch_observer, chunk_slots=chunk_slots)

    def set_max_batch(self, max_batch: int, observer: BatchObserver | None = None, *,
                      chunk_slots: int | None = None) -> None:
        """Decode the requests started from now on in a batch of up to `max_batch` (`decode_batch`, reporting
        to `observer`), or each on its own (1, unless the steps replay from CUDA graphs: a batch of one then);
        the batch before is closed, so call it between requests.
        With a batch, `chunk_slots` of its streams' chunks run their flow and vocoder calls at once, first
        chunks first (`ChunkTurns`; None: `default_chunk_slots`). A `UserError` (one line) where these
        graphs cannot batch (`check_max_batch`), or `chunk_slots` is out of range or given without a batch."""
        check_max_batch(max_batch, self.bundle, self.provider)
        check_chunk_slots(chunk_slots, max_batch > 1 or self.graphs is not None)
        self._stop_batch()
        if max_batch > 1 or self.graphs is not None:
            slots = default_chunk_slots(self.provider, max_batch, self.threads) if chunk_slots is None \
                else chunk_slots
            turns = ChunkTurns(slots)
            batcher = DecodeBatcher(self.lm, max_batch, observer, graphs=self.graphs,
                                    chunks_due=batch_yields_to(turns, self.provider))
            turns.on_done = batcher.wake
            turns.hold_later = chunks_yield_to(batcher, self.provider)
            self.batcher, self.turns = batcher, turns
            # the batch's thread keeps its batcher, and the graphs with it, alive: it stops once this
            # object is collected unclosed, or at exit, where a thread inside onnxruntime aborts the process
            self._stop_batch = weakref.finalize(self, batcher.close)
        else:
            self.batcher, self.turns = None, None

    def chunk_turn(self, *, first: bool) -> AbstractContextManager[Callable[[], None]]:
        """The turn a chunk's flow and vocoder work waits for: with a decode batch, whose sessions share the
        machine, one of its `ChunkTurns` slots, first chunks first; else none. It gives the pause the chunk
        calls before each of its DiT calls and before its vocoder (`ChunkTurns.turn`)."""
        return self.turns.turn(first) if self.turns is not None else nullcontext(no_pause)

    @property
    def runners(self) -> Mapping[str, Runner]:
        """Graph name -> its runner (read-only), for observers such as golden's graph statistics."""
        return MappingProxyType(self._runners)

    @property
    def sample_rate(self) -> int:
        """Sample rate of the audio (24 kHz)."""
        return self.dims.sample_rate

    def close(self) -> None:
        """Stop the batch and release every runner."""
        stop_batch: Callable[[], object] | None = getattr(self, "_stop_batch", None)  # not while runners open
        if stop_batch is not None:
            stop_batch()
        dit_graphs: GraphedDit | None = getattr(self, "dit_graphs", None)
        if dit_graphs is not None:
            dit_graphs.release()
        for runner in self._runners.values():
            runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def decode(self, request: LlmRequest, sampler: Sampler, *, max_tokens: int | None = None,
               ignore_stop: bool = False, prompt: PromptFeatures | None = None) -> Decoding | BatchedDecoding:
        """`SpeechTokenLM.decode`, its steps after the prefill run in the batch where there is one. With the
        flow's `prompt`, the decoding ends once it has one id more than the flow holds after it
        (`Flow.max_tokens`): the synthesis fails at the flow then, as upstream's does with them all."""
        max_ids = None if prompt is None else self.flow.max_tokens(prompt)
        decoding = self.lm.decode(request, sampler, max_tokens=max_tokens, ignore_stop=ignore_stop,
                                  max_ids=max_ids)
        return decoding if self.batcher is None else self.batcher.submit(decoding)

    # --- offline ---------------------------------------------------------------------------------------

    def token2wav(self, tokens: Sequence[int], prompt: PromptFeatures, *, speed: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """Offline token2wav: full-attention flow, `speed` by linear mel resampling, final vocoder.

        Returns the mel (1, 80, T), the samples and the seconds per stage (flow, vocoder).
        """
        if not tokens:
            raise SynthesisError("the LLM produced no speech tokens; nothing to vocode")
        start = time.perf_counter()
        mel = change_speed(self.flow(np.asarray(tokens, dtype=np.int64), prompt, finalize=True,
                                     streaming=False), speed)
        mid = time.perf_counter()
        audio = self.vocoder(mel, finalize=True)
        return mel, audio, {"flow": mid - start, "vocoder": time.perf_counter() - mid}

    def synthesize(self, text_ids: Sequence[int], prompt: PromptFeatures, *, sampler: Sampler,
                   mode: Mode = Mode.ZERO_SHOT, prompt_text_ids: Sequence[int] = (), speed: float = 1.0,
                   max_tokens: int | None = None, ignore_stop: bool = False) -> Synthesis:
        """One text segment (already formatted and tokenised) to speech, upstream's offline path.

        `sampler` owns the randomness (`sampling.make_sampler`); `max_tokens` / `ignore_stop` are
        for benchmarks (see `SpeechTokenLM.decode`).
        """
        request = llm_request(mode, text_ids, prompt, prompt_text_ids)
        decoding = self.decode(request, sampler, max_tokens=max_tokens, ignore_stop=ignore_stop,
                               prompt=prompt)
        try:
            return self.synthesize_tokens(decoding, prompt, speed=speed)
        finally:
            decoding.close()

    def synthesize_tokens(self, tokens: Iterable[int], prompt: PromptFeatures, *, speed: float = 1.0
                          ) -> Synthesis:
        """Offline synthesis of the speech ids from `tokens` (a decoding in progress, drained first and
        timed as the LLM's, or a fixed list)."""
        with self.live.held():
            start = time.perf_counter()
            ids = [int(t) for t in tokens]
            llm_s = time.perf_counter() - start
            with self.chunk_turn(first=True):  # all of its audio at once
                mel, audio, timings = self.token2wav(ids, prompt, speed=speed)
        return Synthesis(ids, mel, audio, self.sample_rate, {"llm": llm_s, **timings})

    # --- streaming -------------------------------------------------------------------------------------

    def stream(self, text_ids: Sequence[int], prompt: PromptFeatures, *, sampler: Sampler,
               mode: Mode = Mode.ZERO_SHOT, prompt_text_ids: Sequence[int] = (),
               policy: ChunkPolicy | None = None, max_tokens: int | None = None,
               ignore_stop: bool = False) -> Iterator[AudioChunk]:
        """One text segment as a stream of audio chunks, the LLM decoding interleaved with them.

        Upstream ignores `speed` when streaming, so there is none here.
        """
        request = llm_request(mode, text_ids, prompt, prompt_text_ids)
        decoding = self.decode(request, sampler, max_tokens=max_tokens, ignore_stop=ignore_stop,
                               prompt=prompt)
        return closing_after(self.stream_tokens(decoding, prompt, policy=policy), decoding.close)

    def stream_tokens(self, tokens: Iterable[int], prompt: PromptFeatures, *,
                      policy: ChunkPolicy | None = None, decoding: Iterator[int] | None = None
                      ) -> Iterator[AudioChunk]:
        """Stream audio for speech ids from `tokens` (a decoding in progress, or a fixed list; `decoding`:
        the decoding that `tokens` wraps, e.g. in a server's cancellation check, which the stream tells
        about its first audio where it is a batch's, as it tells `tokens` itself).

        A non-final chunk fires when the hop's tokens and their look-ahead exist: block-causal flow
        over tokens[:offset + hop + lookahead] keeping the frames after 2·offset (re-run or cached:
        `policy.flow`), then the non-finalizing vocoder over the accumulated mel (all of it, or a
        window: `policy.vocoder`). When `tokens` ends, the final chunk runs the full-attention flow
        over all tokens (`"window"`: over the new ones) and the finalizing vocoder. `policy` replaces
        `self.chunk_policy` for this stream (checked here: a `UserError`).
        """
        policy = self.chunk_policy if policy is None else check_policy(policy, self.bundle)
        log.info("streaming with %s", policy)
        return _Stream(self, prompt, policy).run(iter(tokens), tokens if decoding is None else decoding)


def batch_yields_to(turns: ChunkTurns, provider: str) -> Callable[[], bool]:
    """When a decode batch on `provider` waits for the chunks of `turns` (`DecodeBatcher.chunks_due`): on the
    CPU while the chunks' slots are all taken or a chunk waits for one (`ChunkTurns.full`: with one slot,
    while any chunk holds or waits for its turn), since the batch and the chunks' graph calls then share the
    cores, and the two at once do a quarter less work than each alone (performance-log.md, "the batch yields
    to every chunk"); on a GPU while a first chunk holds or waits for a turn (what the two cost each other
    there is not measured)."""
    return (lambda: turns.full) if provider in CPU_PROVIDERS else (lambda: turns.first_due)


def chunks_yield_to(batcher: DecodeBatcher, provider: str) -> Callable[[], bool]:
    """When the later chunks of a decode batch's streams on `provider` wait at their pauses
    (`ChunkTurns.hold_later`): on the CPU while the batch works for a stream's first audio
    (`DecodeBatcher.first_audio_due`), whose ids then take the cores alone rather than beside a DiT call
    (performance-log.md, "a later chunk lets first chunks pass"); on a GPU never (not measured there)."""
    return batcher.first_audio_due if provider in CPU_PROVIDERS else (lambda: False)


def default_chunk_slots(provider: str, max_batch: int, threads: int | None) -> int:
    """Chunks of a batch's streams that run their flow and vocoder calls at once, unless the caller says:
    on the CPU as many as the usable CPUs (the affinity mask's) hold at `threads` each (one where a session's
    graphs take every core: `threads` None), since the chunks' calls share the cores; on a GPU, where a call's
    time is mostly its kernels' launches on the host, every stream's (`max_batch`), as without a batch.
    Measured on a CPU of 2 cores only (performance-log.md, "the chunks' slots follow the cores")."""
    if provider not in CPU_PROVIDERS:
        return max_batch
    return max(1, min(max_batch, usable_cpus() // threads)) if threads else 1


def check_synthesis(bundle: RuntimeBundle, provider: str, *, max_batch: int | None = None,
                    chunk_slots: int | None = None, chunk_policy: ChunkPolicy | None = None,
                    cuda_graphs: bool | None = None, stack_dit: bool = False, threads: int | None = None
                    ) -> list[str]:
    """The graphs a `Synthesizer` of `bundle` on `provider` with these options opens, after every check it
    makes before one opens: those of `check_options`, then a `ProviderError` where this machine lacks what
    runs a graph on `provider` (`check_opens`); one line each."""
    check_options(bundle, provider, max_batch=max_batch, chunk_slots=chunk_slots, chunk_policy=chunk_policy,
                  cuda_graphs=cuda_graphs, stack_dit=stack_dit, threads=threads)
    return check_opens(bundle, provider)


def check_options(graphs: BundleGraphs, provider: str, *, max_batch: int | None = None,
                  chunk_slots: int | None = None, chunk_policy: ChunkPolicy | None = None,
                  cuda_graphs: bool | None = None, stack_dit: bool = False, threads: int | None = None
                  ) -> None:
    """The checks of `check_synthesis` that read no more than the graphs' precisions and streaming constants,
    so that a model bundle's options are held against its export before it is made
    (`bundle_source.bundle_graphs`): a `ProviderError` where `provider` does not run the pipeline
    (`check_runs`), a `UserError` for an option the graphs or this machine's CPUs cannot take, or a chunk
    policy they cannot stream on (`check_policy`); one line each."""
    check_threads(threads)
    check_runs(graphs, provider)
    batch = default_max_batch(graphs, provider) if max_batch is None else max_batch
    check_max_batch(batch, graphs, provider)
    check_chunk_slots(chunk_slots, batch > 1 or uses_cuda_graphs(cuda_graphs, graphs, provider))
    if stack_dit:
        check_stack_dit(graphs)
    check_policy(chunk_policy, graphs)


def check_threads(threads: int | None) -> None:
    """A `UserError` (one line) unless `threads` is None (onnxruntime's default) or a count of threads from
    1 to the CPUs this process may use (`threads_problem`)."""
    problem = None if threads is None else threads_problem(threads)
    if problem is not None:
        raise UserError(f"threads: {problem}")


def check_chunk_slots(chunk_slots: int | None, batched: bool = True) -> None:
    """A `UserError` (one line) unless `chunk_slots` is None (the default), or 1 to `MAX_BATCH` where the
    requests decode in a batch (`batched`): the slots are its streams'."""
    if chunk_slots is None:
        return
    if not 1 <= chunk_slots <= MAX_BATCH:
        raise UserError(f"chunk_slots is {chunk_slots}; expected 1 to {MAX_BATCH}")
    if not batched:
        raise UserError(f"chunk_slots {chunk_slots}: the slots are a decode batch's, and max_batch is 1 "
                        "(give max_batch 2 or more)")


def batches(bundle: BundleGraphs, provider: str) -> bool:
    """Whether `bundle` on `provider` decodes requests in a batch (`max_batch` > 1): where its decode steps
    run on `llm_decode` (`decode_body`: on onnxruntime's CPU, and on CUDA in fp16)."""
    return decode_body(bundle, provider) == LLM_DECODE


GPU_MAX_BATCH = 4
"""`default_max_batch` on cuda. On an H200 (docs/performance-log.md, "fourteenth session") 4 sessions in the
decode batch made 17.3 s of audio per s against 8.15 for one alone (`decode=fp16,dit=tf32`), each stream 4x
faster than real time; 16 made 14.1 s (`decode=fp16`), each stream slower than real time."""


def default_max_batch(bundle: BundleGraphs, provider: str) -> int:
    """The decode batch where none is given (`Synthesizer`, `CosyVoice3`, the server's `--max-batch`):
    `GPU_MAX_BATCH` on cuda where `bundle` batches (`batches`: an fp16 `llm_decode`), else 1. On cuda a lone
    request decodes in a batch either way where its steps replay from CUDA graphs (the default:
    `uses_cuda_graphs`), and in a batch of one concurrent requests would decode one after another. A CPU
    batches only when asked: there 4 sessions batched on two cores made 1.20-1.25x the audio of sessions one
    by one (docs/performance.md), each stream 4x slower, while every session holds its flow's caches (~2.6 GB
    for 10 s of audio at full size)."""
    return GPU_MAX_BATCH if provider == CUDA and batches(bundle, provider) else 1


def check_max_batch(max_batch: int, bundle: BundleGraphs, provider: str) -> None:
    """A `UserError` (one line) unless `bundle` on `provider` decodes in batches of `max_batch`: 1 always,
    up to `MAX_BATCH` where it `batches`."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise UserError(f"max_batch is {max_batch}; expected 1 to {MAX_BATCH}")
    if max_batch > 1 and not batches(bundle, provider):
        body = decode_body(bundle, provider)
        raise UserError(f"max_batch {max_batch}: batched decoding runs on llm_decode, on the cpu provider or "
                        f"in fp16 on cuda; {bundle.root} ({bundle.precision}) on {provider!r} "
                        f"decodes on {body} (export --precision cpu-fast, or decode=fp32 for float32, for "
                        "the cpu; decode=fp16 for cuda)")


def uses_cuda_graphs(asked: bool | None, bundle: BundleGraphs, provider: str) -> bool:
    """Whether `bundle`'s decode steps replay from CUDA graphs on `provider`: as `asked` (True checked by
    `check_cuda_graphs`), or where None wherever they can, on cuda with the decode steps on `llm_decode`: a
    step took 1.50 ms replayed against 5.09 ms launched node by node on an H200 (docs/gpu.md). Without a
    batch of more than one they decode concurrent requests one after another."""
    if asked is None:
        return provider == CUDA and decode_body(bundle, provider) == LLM_DECODE
    if asked:
        check_cuda_graphs(bundle, provider)
    return asked


def dit_replays(bundle: RuntimeBundle) -> bool:
    """Whether `bundle`'s DiT calls can replay from CUDA graphs: where its graph is the floating-point form
    written for onnxruntime (`Precision.onnxruntime_only`: tf32's, fp16's without TensorRT plans), which reads
    no shape and computes nothing on the CPU (its positions and mask are inputs); fp32's standard operators
    reshape by the shapes they read, and the int8 form's quantization does."""
    precision = bundle.graph_precision(DIT)
    return precision.name in (TF32.name, FP16.name) and precision.onnxruntime_only(
        trt_plans=bundle.has_trt_plan(DIT), float32_cuda_form=RECIPES[DIT].float32_cuda_form)


def open_replayed_dit(bundle: RuntimeBundle, provider: str, threads: int | None) -> Runner:
    """`bundle`'s DiT opened to replay its calls from CUDA graphs (`dit_replays`). onnxruntime refuses a
    session with CUDA graphs where it places a node off the GPU; then the DiT opens without them, its calls
    launched node by node, and the log says why."""
    try:
        return open_runner(bundle, DIT, provider, threads=threads, cuda_graph=True)
    except Exception as e:  # onnxruntime's own exception types, not part of its public API
        if GRAPH_CAPTURE_REFUSED not in str(e):
            raise
        reason = str(e).strip().splitlines()[-1]
        log.warning("%s: the DiT's calls launch node by node: onnxruntime refused its CUDA graphs (%s)",
                    bundle.root, reason)
    return open_runner(bundle, DIT, provider, threads=threads)


def check_cuda_graphs(bundle: BundleGraphs, provider: str) -> None:
    """A `UserError` (one line) unless `bundle`'s decode steps can replay from CUDA graphs on `provider`:
    on cuda, where they run on `llm_decode`."""
    if provider != CUDA:
        raise UserError(f"cuda graphs are the cuda provider's, not {provider!r}'s")
    body = decode_body(bundle, provider)
    if body != LLM_DECODE:
        raise UserError(f"cuda graphs: the decode steps replay from CUDA graphs on llm_decode; {bundle.root} "
                        f"({bundle.precision}) decodes on {body} on cuda (export --precision "
                        "decode=fp16 or gpu-fp16)")


def check_stack_dit(bundle: BundleGraphs) -> None:
    """A `UserError` (one line) unless `bundle`'s DiT gives each stream of a stacked call what its call alone
    gives: not where its activations are quantized per tensor, one scale over every stream's rows (the int8
    DiT's: a stream's velocity 9e-2 from its call alone at full size, performance-log.md, "streams' DiT
    calls stacked in the runtime")."""
    precision = bundle.graph_precisions[DIT]
    scheme = RECIPES[DIT].quantization.get(precision.name)
    if scheme is not None and scheme.rows_share_scales:
        raise UserError(f"stack_dit: {bundle.root}'s {DIT} is {precision.name}, its activations quantized "
                        "with one scale over every row of a call, so a stream's frames would depend on the "
                        "streams stacked with it; stacking takes a float DiT (export --precision fp32, fp16, "
                        "bf16 or gpu-fp16)")


def closing_after(chunks: Iterator[AudioChunk], close: Callable[[], None]
                  ) -> Generator[AudioChunk, None, None]:
    """`chunks`, then `close` (a decoding's), however the stream ends (exhausted, failed, or dropped by its
    consumer): a batched decoding's row is freed then, a text stream's source no longer read. Then the C
    heap's free pages go back to the OS: the segment's caches (hundreds of MB at full size) would otherwise
    stay resident in it after every request, 0.8 GB and more (docs/performance.md, "Memory across
    requests")."""
    try:
        yield from chunks
    finally:
        close()
        release_free_heap()


class _Stream:
    """The state of one streamed utterance (upstream's per-request dicts, without threads)."""

    def __init__(self, synth: Synthesizer, prompt: PromptFeatures, policy: ChunkPolicy) -> None:
        self.synth, self.prompt, self.policy = synth, prompt, policy
        self.ratio = synth.dims.token_mel_ratio
        self.tokens: list[int] = []
        self.mel = np.zeros((1, synth.dims.mel_bins, 0), dtype=np.float32)
        """The accumulated mel (1, 80, M) that `"rerun"` re-vocodes; `"window"` keeps only
        `vocoder_stream`'s tail."""
        self.vocoder_stream: VocoderStream | None = (synth.vocoder.stream() if policy.vocoder == "window"
                                                     else None)
        self.flow_stream: FlowStream | None = (
            None if policy.flow == "rerun"
            else synth.flow.stream(prompt, final_cached=policy.flow == "window",
                                   window=policy.flow_window if policy.flow == "window" else None))
        self.offset = 0
        """Tokens whose mel frames have gone to the vocoder."""
        self.samples_out = 0
        self.index = 0
        self.start = time.perf_counter()

    def run(self, source: Iterator[int], decoding: Iterable[int]) -> Iterator[AudioChunk]:
        """The chunks of the ids from `source`; `decoding` is the decoding they come from (`source` itself,
        or what it wraps): a batch's is told when this stream's first audio is due and when it is out."""
        batched = decoding if isinstance(decoding, BatchedDecoding) else None
        try:
            with self.synth.live.held():  # from the first step to the end, however the stream ends
                if batched is not None:
                    batched.mark_streamed()
                hops = self.policy.hops(self.prompt.speech_tokens.shape[1])
                hop = next(hops)
                llm_s = 0.0
                while True:
                    before = time.perf_counter()
                    token = next(source, None)
                    llm_s += time.perf_counter() - before
                    if token is None:
                        break
                    self.tokens.append(token)
                    if len(self.tokens) - self.offset >= hop + self.policy.lookahead:
                        chunk = self._chunk(self.tokens[: self.offset + hop + self.policy.lookahead], hop,
                                            llm_s, final=False)
                        if batched is not None:  # its later ids wait for others' first audio
                            batched.sent_audio = True
                        yield chunk
                        hop, llm_s = next(hops), 0.0
                if not self.tokens:
                    raise SynthesisError("the LLM produced no speech tokens; nothing to vocode")
                yield self._chunk(self.tokens, len(self.tokens) - self.offset, llm_s, final=True)
        except BaseException:  # closed by its consumer or stopped by an error (a server's cancellation)
            self._drop_caches()
            raise

    def _drop_caches(self) -> None:
        """Drop the flow stream's DiT caches, where it ended before its final chunk, and, where no other
        synthesis is in flight (whose DiT calls would), have the DiT's arena give back the memory they held
        (`Flow.give_back_arena`)."""
        stream = self.flow_stream
        if stream is None or stream.cached_frames == 0:  # before its first chunk, or its final one begun
            return
        stream.caches = []
        if self.synth.live.count == 0:
            try:
                self.synth.flow.give_back_arena()
            except Exception:  # what ended the stream is what its consumer sees; the DiT's next call shrinks
                log.warning("the DiT's arena was not shrunk after a stream ended early", exc_info=True)

    def _mid_block(self, end: int) -> bool:
        """Whether a non-final chunk ending after `end` generated tokens cuts a DiT block (only a first
        chunk of `first_chunk_tokens` can)."""
        frames = self.ratio * (self.prompt.speech_tokens.shape[1] + end)
        return frames % self.synth.dims.dit_block_frames != 0

    def _chunk(self, tokens: list[int], hop: int, llm_s: float, *, final: bool) -> AudioChunk:
        # the chunk adds ratio * hop mel frames (its look-ahead tokens' frames come with the next one), and
        # again the last chunk's last frames where the prompt's mel is short of its tokens' (`prompt_lag`)
        frames = self.ratio * hop + self.synth.flow.prompt_lag(self.prompt)
        key = (Vocoder.key(self.mel.shape[2] + frames) if self.vocoder_stream is None
               else self.vocoder_stream.key(frames, finalize=final))
        with self.synth.chunk_turn(first=self.index == 0) as pause, self.synth.vocoder.calls(key) as calls:
            return self._run_chunk(tokens, hop, llm_s, final=final, pause=calls.pausing(pause), calls=calls)

    def _run_chunk(self, tokens: list[int], hop: int, llm_s: float, *, final: bool,
                   pause: Callable[[], None], calls: VocoderCalls) -> AudioChunk:
        synth = self.synth
        start = time.perf_counter()
        if self.flow_stream is None:
            mel = synth.flow(np.asarray(tokens, dtype=np.int64), self.prompt, finalize=final,
                             streaming=not final, pause=pause)  # (1, 80, ratio * (offset + hop)): all, re-run
            added = mel[:, :, self.ratio * self.offset:]
        else:
            # after a first chunk cut inside a block (peeked, not kept), the stream runs that block again
            # and its frames before `offset` have been sent already
            sent = self.ratio * (self.offset - self.flow_stream.tokens)
            stream = self.flow_stream
            mid_block = not final and self._mid_block(self.offset + hop)
            mel = stream.peek(tokens, pause=pause) if mid_block else stream.push(tokens, finalize=final,
                                                                                 pause=pause)
            added = mel[:, :, sent:]  # (1, 80, ratio * hop)
        pause()
        mid = time.perf_counter()
        if self.vocoder_stream is None:
            self.mel = np.concatenate([self.mel, added], axis=2)
            # all of it, re-run
            audio = synth.vocoder(self.mel, finalize=final, calls=calls)[self.samples_out:]
        else:
            audio = self.vocoder_stream.push(added, finalize=final, calls=calls)
        new = np.ascontiguousarray(audio)
        done = time.perf_counter()
        chunk = AudioChunk(
            index=self.index, samples=new, sample_rate=synth.sample_rate, is_final=final,
            token_range=(self.offset, self.offset + hop),
            sample_range=(self.samples_out, self.samples_out + len(new)),
            timings=ChunkTimings(llm=llm_s, flow=mid - start, vocoder=done - mid, elapsed=done - self.start),
            mel=added,
        )
        self.offset += hop
        self.samples_out += len(new)
        self.index += 1
        return chunk
