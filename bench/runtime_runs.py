"""The runtime's side: `CosyVoice3` run through the `Backend` interface, and concurrent sessions.

Sharing one `CosyVoice3` between threads is safe for the onnxruntime providers and OpenVINO:
onnxruntime's `InferenceSession.run` is thread-safe, an `OpenVinoRunner` gives each thread its own infer
request, and every per-request state (the `Decoding`, the stream's accumulated mel and vocoder window)
is created per call; the `Synthesizer`, `Flow`, `Vocoder` and runners only read their own attributes
while running. A `TrtRunner` keeps device buffers and an execution context per runner, so under
`--provider trt` every session gets its own `CosyVoice3`.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.call_stack import CallStack
from cosyvoice_runtime.chunk_policy import ChunkPolicy, check_policy
from cosyvoice_runtime.cosyvoice3 import SegmentSpeech
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.llm import Decoding
from cosyvoice_runtime.process_memory import release_free_heap
from cosyvoice_runtime.runners import TRT
from cosyvoice_runtime.segments import Segment
from cosyvoice_runtime.synthesis import AudioChunk, Mode, Synthesizer, batches, check_chunk_slots, llm_request

from . import graph_calls
from .backend import FirstChunk, OfflineRun, StreamRun
from .cases import Case
from .measure import CallLog, GpuSampler, batch_llm_calls, llm_figures, mean, prefill_length

STACKS: dict[str, Callable[[Synthesizer], CallStack[Any, Any, Any] | None]] = {
    "dit": lambda synth: synth.flow.stack, "vocoder": lambda synth: synth.vocoder.stack}
"""The stacks whose calls a concurrency row counts (`<name>_calls`, `<name>_streams_per_call`), where the
synthesizer has them."""

WORD_INTERVAL_S = 0.075
"""How often a word comes when the benchmark streams a text in: an LLM writing its answer (50-100 ms)."""


@dataclass(frozen=True)
class TextStreamFirstChunk:
    """The first chunk of a text streamed in: seconds from its first word, and the words sent by then."""

    seconds: float
    words: int


class RuntimeBackend:
    """The torch-free runtime on one provider: a `CosyVoice3` whose every segment decodes a fixed number
    of tokens."""

    name = "runtime"

    def __init__(self, bundle: RuntimeBundle, *, provider: str, threads: int, prompt_text: str, seed: int,
                 latency_policy: ChunkPolicy | None = None, chunk_slots: int | None = None,
                 cuda_graphs: bool = False, stack_dit: bool = False, stack_vocoder: bool = False) -> None:
        """Open every graph on `provider` with `threads` intra-op threads; `prompt_text` is the prompt
        recording's transcript (zero-shot), `seed` the RAS sampler's; `latency_policy`: the chunk policy
        `policy_first_chunk` measures beside upstream's, checked against these graphs first (a `UserError`
        before anything opens); `chunk_slots`: the batched sessions' chunks at once (None: the runtime's
        default); `cuda_graphs`: the decode steps replay from CUDA graphs, in a batch even of one
        (`Synthesizer`), so that the runs without a batch decode one stream at a time; `stack_dit`,
        `stack_vocoder`: concurrent streams' DiT and vocoder calls run stacked (`call_stack`)."""
        start = time.perf_counter()
        self.bundle, self.provider, self.threads = bundle, provider, threads
        self.prompt_text = prompt_text
        self.latency_policy = check_policy(latency_policy, bundle) if latency_policy is not None else None
        check_chunk_slots(chunk_slots)
        self.chunk_slots = chunk_slots
        self.cuda_graphs, self.stack_dit, self.stack_vocoder = cuda_graphs, stack_dit, stack_vocoder
        # unbatched (on cuda the runtime's default is a batch of 4): levels batch it (`concurrent`)
        self.voice = CosyVoice3(bundle, provider=provider, threads=threads, seed=seed, max_batch=1,
                                cuda_graphs=cuda_graphs, stack_dit=stack_dit, stack_vocoder=stack_vocoder)
        self._log = CallLog()
        self.load_s = time.perf_counter() - start

    def prompt_features(self, wav: Path) -> PromptFeatures:
        return self.voice.prompt_features(wav)

    def _segment(self, case: Case) -> Segment:
        """The front end: normalise, split and tokenise as `cosyvoice-run` does; the segments' ids are
        joined into one LLM request (the bench texts are one segment with the real tokenizer)."""
        pieces = self.voice.segments(Mode.ZERO_SHOT, case.text, prompt_text=self.prompt_text)
        return Segment(case.text, [i for p in pieces for i in p.text_ids], pieces[0].prompt_text_ids)

    @staticmethod
    def _speak(voice: CosyVoice3, piece: Segment, prompt: PromptFeatures, tokens: int, *, stream: bool,
               policy: ChunkPolicy | None = None) -> SegmentSpeech:
        """Exactly `tokens` decoding steps (the stop ids masked), streamed (on the voice's schedule, or on
        `policy`) or offline."""
        return voice.speak(piece, prompt, Mode.ZERO_SHOT, stream=stream, max_tokens=tokens, ignore_stop=True,
                           policy=policy)

    def forget_prompts(self) -> None:
        """Drop the streaming flow's per-prompt prefixes (`Flow.prefixes`)."""
        self.voice.synth.flow.prefixes.clear()

    def first_chunk(self, case: Case, prompt: PromptFeatures) -> FirstChunk:
        return self._first_chunk(case, prompt, None)

    def policy_first_chunk(self, case: Case, prompt: PromptFeatures) -> FirstChunk | None:
        """The first chunk on the latency policy; None without its first chunk's deviation."""
        if self.latency_policy is None or self.latency_policy.first_chunk_tokens is None:
            return None
        return self._first_chunk(case, prompt, self.latency_policy)

    def policy_stream(self, case: Case, prompt: PromptFeatures) -> StreamRun | None:
        """The whole stream on the latency policy's flow (`--flow-window`) and upstream's schedule, so that
        it differs from `stream` by the flow alone; None without that deviation."""
        flow = self._flow_policy()
        return self._stream(case, prompt, flow) if flow is not None else None

    def _flow_policy(self) -> ChunkPolicy | None:
        """The latency policy's flow deviation on upstream's chunk schedule; None without it."""
        if self.latency_policy is None or self.latency_policy.flow != "window":
            return None
        return replace(self.latency_policy, first_chunk_tokens=None)

    def text_stream_first_chunk(self, case: Case, prompt: PromptFeatures) -> TextStreamFirstChunk:
        """The first chunk of `case`'s text streamed in (upstream's bistream, `speak_text_stream`) a word
        every `WORD_INTERVAL_S`, as an LLM writes it, from the first word; and the words sent by then."""
        words = re.findall(r"\S+\s*", case.text)
        sent = 0

        def pieces() -> Iterator[str]:
            nonlocal sent
            for word in words:
                if sent:
                    time.sleep(WORD_INTERVAL_S)
                sent += 1
                yield word

        start = time.perf_counter()
        speech = self.voice.speak_text_stream(pieces(), prompt, Mode.ZERO_SHOT, prompt_text=self.prompt_text,
                                              max_tokens=case.tokens)
        chunks = speech.chunks
        next(chunks)
        seconds = time.perf_counter() - start
        if isinstance(chunks, Generator):  # stop decoding: the rest is not measured
            chunks.close()
        return TextStreamFirstChunk(seconds, sent)

    def _first_chunk(self, case: Case, prompt: PromptFeatures, policy: ChunkPolicy | None) -> FirstChunk:
        start = time.perf_counter()
        speech = self._speak(self.voice, self._segment(case), prompt, case.tokens, stream=True, policy=policy)
        chunk = next(iter(speech))
        return self._first(chunk, time.perf_counter() - start)

    def _first(self, chunk: AudioChunk, seconds: float) -> FirstChunk:
        t = chunk.timings
        return FirstChunk(seconds, len(chunk.samples) / self.voice.sample_rate, t.llm, t.flow, t.vocoder)

    def stream(self, case: Case, prompt: PromptFeatures) -> StreamRun:
        return self._stream(case, prompt, None)

    def _stream(self, case: Case, prompt: PromptFeatures, policy: ChunkPolicy | None) -> StreamRun:
        start = time.perf_counter()
        first: FirstChunk | None = None
        parts, arrivals = [], [start]
        speech = self._speak(self.voice, self._segment(case), prompt, case.tokens, stream=True, policy=policy)
        for chunk in speech:
            arrivals.append(time.perf_counter())
            if first is None:
                first = self._first(chunk, arrivals[-1] - start)
            parts.append(chunk.samples)
        assert first is not None  # a stream always ends with a final chunk
        audio = np.concatenate(parts)
        return StreamRun(first, arrivals[-1] - start, arrivals[-1] - arrivals[-2],
                         len(audio) / self.voice.sample_rate, audio, list(speech.speech_tokens))

    def offline(self, case: Case, prompt: PromptFeatures) -> OfflineRun:
        start = time.perf_counter()
        piece = self._segment(case)
        front_end_s = time.perf_counter() - start
        synth = self.voice.synth
        # `lm.step` is one llm graph call whichever runner method it uses (IOBinding on onnxruntime); a
        # decode batch's calls (`--cuda-graphs`) are timed by when their ids reach the decoding (`accept`,
        # after each call's draw, alone or with the batch's other rows); the offline flow fetches the DiT's
        # velocity only, through `infer_outputs`
        llm = (synth.lm, "step") if synth.batcher is None else (Decoding, "accept")
        calls = {"llm": llm, "estimator": (synth.flow.estimator, "infer_outputs")}
        with self._log.wrap(calls):
            speech = self._speak(self.voice, piece, prompt, case.tokens, stream=False)
            (chunk,) = list(speech)
        seconds = time.perf_counter() - start
        audio_s = len(chunk.samples) / self.voice.sample_rate
        llm_s = chunk.timings.llm
        llm_calls = (self._log.seconds("llm") if synth.batcher is None
                     else batch_llm_calls(llm_s, self._log.starts("llm")))
        figures = {
            "front_end_s": front_end_s,
            "llm_prefill_len": prefill_length(piece.text_ids, piece.prompt_text_ids,
                                              prompt.speech_tokens.shape[1]),
            **llm_figures(llm_s, llm_calls),
            "speech_tokens": len(speech.speech_tokens),
            "flow_s": chunk.timings.flow,
            "flow_per_step_s": mean(self._log.seconds("estimator")),
            "hift_s": chunk.timings.vocoder,
            "audio_s": audio_s,
            "rtf_offline": seconds / audio_s,
        }
        return OfflineRun(figures, list(speech.speech_tokens))

    def concurrent(self, case: Case, prompt: PromptFeatures, level: int, reference: StreamRun,
                   gpu: GpuSampler | None = None, window_reference: StreamRun | None = None
                   ) -> dict[str, Any]:
        """`level` streamed sessions of `case` started together on `level` threads, from tokenised text
        and a cached prompt (the front end stays outside: wetext's thread safety is not ours to claim), and
        `level` decodings alone (the LLM's tokens per second); then the same with their decodings in one
        batch (`Synthesizer.set_max_batch`), where this bundle batches on this provider, and with the latency
        policy's flow (`--flow-window`) those batched sessions again on it (`batched_window`, judged against
        `window_reference`, a single stream on it): the throughput of the deviation at that many streams.

        Above one session, an unmeasured round of them comes first (its figures kept as `warm_up`): the
        first time a process runs that many sessions their memory is new to it, and a first touch can cost
        a round tens of seconds of system time on a small VM (docs/performance-log.md, the AMX Xeon's flash
        attention entry), which a running server has paid long before; without it the phase measured first
        would pay it alone.

        `outputs_match` compares every session's audio with `reference` (a single stream of the same case
        and seed): sessions that share the `CosyVoice3`, or its batch, must not disturb each other.
        `outputs_max_diff` is by how much they differ where they do (another batch's float rounding), and
        `tokens_match` whether their speech ids are the reference's all the same (a sampled draw that
        rounding moved changes the rest of the audio). With `gpu`, each run's mean GPU utilisation
        (`gpu_utilization_mean_pct`): how much of the wall the device computed."""
        piece = self._segment(case)
        shared = self.provider != TRT
        voices = ([self.voice] * level if shared else
                  [CosyVoice3(self.bundle, provider=self.provider, threads=self.threads, max_batch=1,
                              seed=self.voice.sampling.seed, cuda_graphs=self.cuda_graphs,
                              stack_dit=self.stack_dit, stack_vocoder=self.stack_vocoder)
                   for _ in range(level)])
        try:
            warm_up = (self._sessions(voices, piece, prompt, case.tokens, reference, gpu) if level > 1
                       else None)
            release_free_heap()
            row = {"level": level, "length": case.name, "shared_synthesizer": shared, "warm_up": warm_up,
                   **self._sessions(voices, piece, prompt, case.tokens, reference, gpu),
                   "llm_tokens_per_s": self._decodings(voices, piece, prompt, case.tokens), "batched": None}
        finally:
            for voice in voices:
                if voice is not self.voice:
                    voice.close()
        synth = self.voice.synth
        flow = self._flow_policy()
        row["batched_window"] = None
        if level > 1 and batches(self.bundle, self.provider):
            release_free_heap()  # the sessions' threads' heaps, before as many sessions again
            synth.set_max_batch(level, chunk_slots=self.chunk_slots)
            try:
                voices = [self.voice] * level
                assert synth.turns is not None
                row["batched"] = {**self._sessions(voices, piece, prompt, case.tokens, reference, gpu),
                                  "llm_tokens_per_s": self._decodings(voices, piece, prompt, case.tokens),
                                  "chunk_slots": synth.turns.slots}
                if flow is not None and window_reference is not None:
                    release_free_heap()
                    row["batched_window"] = self._sessions(voices, piece, prompt, case.tokens,
                                                           window_reference, gpu, flow)
            finally:
                synth.set_max_batch(1)
        release_free_heap()
        return row

    def _sessions(self, voices: list[CosyVoice3], piece: Segment, prompt: PromptFeatures, tokens: int,
                  reference: StreamRun, gpu: GpuSampler | None, policy: ChunkPolicy | None = None
                  ) -> dict[str, Any]:
        """One streamed session per voice (on `policy`, else the voice's), all started together: throughput,
        session RTF, first chunks, where their wall went (`graphs`: each graph's calls in flight,
        `graph_calls.in_flight`), and with `gpu` the GPU's mean utilisation meanwhile."""
        barrier = threading.Barrier(len(voices))
        stacks = {name: list({id(s): s for v in voices if (s := stack_of(v.synth)) is not None}.values())
                  for name, stack_of in STACKS.items()}
        before = {name: [(s.calls, s.streams) for s in found] for name, found in stacks.items()}
        graphed = list({id(g): g for v in voices if (g := v.synth.dit_graphs) is not None}.values())
        graphed_before = [(g.calls, g.bound_calls) for g in graphed]

        def session(voice: CosyVoice3) -> _Session:
            barrier.wait()
            start = time.perf_counter()
            first = None
            parts = []
            speech = self._speak(voice, piece, prompt, tokens, stream=True, policy=policy)
            for chunk in speech:
                first = time.perf_counter() - start if first is None else first
                parts.append(chunk.samples)
            end = time.perf_counter()
            audio = np.concatenate(parts)
            assert first is not None
            return _Session(start, end, first, len(audio) / voice.sample_rate, audio,
                            list(speech.speech_tokens))

        with gpu.sample() if gpu is not None else nullcontext(lambda: None) as usage, \
                graph_calls.record() as calls, ThreadPoolExecutor(len(voices)) as pool:
            runs = list(pool.map(session, voices))
        figures = _sessions_figures(runs, reference)
        figures["graphs"] = graph_calls.in_flight(calls, min(r.start for r in runs), max(r.end for r in runs))
        if gpu is not None:
            used = usage()
            figures["gpu_utilization_mean_pct"] = used.utilization_mean_pct if used is not None else None
        for name, found in stacks.items():
            if found:
                calls = sum(s.calls - b[0] for s, b in zip(found, before[name], strict=True))
                streams = sum(s.streams - b[1] for s, b in zip(found, before[name], strict=True))
                figures |= {f"{name}_calls": calls,
                            f"{name}_streams_per_call": streams / calls if calls else None}
        if graphed:
            calls = sum(g.calls - b[0] for g, b in zip(graphed, graphed_before, strict=True))
            bound = sum(g.bound_calls - b[1] for g, b in zip(graphed, graphed_before, strict=True))
            figures["dit_bound_share"] = bound / calls if calls else None
        return figures

    @staticmethod
    def _decodings(voices: list[CosyVoice3], piece: Segment, prompt: PromptFeatures, tokens: int) -> float:
        """Speech tokens per second of one decoding per voice, all started together, nothing else running:
        the LLM's throughput at that many streams."""
        request = llm_request(Mode.ZERO_SHOT, piece.text_ids, prompt, piece.prompt_text_ids)
        barrier = threading.Barrier(len(voices))

        def decode(voice: CosyVoice3) -> tuple[float, float, int]:
            decoding = voice.synth.decode(request, voice.sampling.sampler(), max_tokens=tokens,
                                          ignore_stop=True)
            barrier.wait()
            start = time.perf_counter()
            count = sum(1 for _ in decoding)
            return start, time.perf_counter(), count

        with ThreadPoolExecutor(len(voices)) as pool:
            runs = list(pool.map(decode, voices))
        return sum(r[2] for r in runs) / (max(r[1] for r in runs) - min(r[0] for r in runs))

    def close(self) -> None:
        self.voice.close()


@dataclass(frozen=True)
class _Session:
    """One concurrent session: when it started and ended, its first chunk's and its audio's seconds, its
    samples and speech ids."""

    start: float
    end: float
    first_s: float
    audio_s: float
    samples: np.ndarray
    speech_tokens: list[int]


def _sessions_figures(runs: Sequence[_Session], reference: StreamRun) -> dict[str, Any]:
    """Concurrent sessions' figures, their outputs against `reference`'s."""
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    audio = sum(r.audio_s for r in runs)
    firsts = sorted(r.first_s for r in runs)
    return {
        "wall_s": wall,
        "audio_s": audio,
        "audio_s_per_s": audio / wall,
        "session_rtf_mean": mean([(r.end - r.start) / r.audio_s for r in runs]),
        "first_chunk_mean_s": mean(firsts),
        "first_chunk_p95_s": firsts[math.ceil(0.95 * len(firsts)) - 1],
        "first_chunk_max_s": firsts[-1],
        "outputs_match": all(np.array_equal(r.samples, reference.samples) for r in runs),
        "outputs_max_diff": _max_diff([r.samples for r in runs], reference.samples),
        "tokens_match": all(r.speech_tokens == reference.speech_tokens for r in runs),
    }


def _max_diff(outputs: Sequence[np.ndarray], reference: np.ndarray) -> float | None:
    """The largest |sample - reference's| over `outputs`; None where one's length differs."""
    if any(o.shape != reference.shape for o in outputs):
        return None
    return max((float(np.abs(o - reference).max(initial=0.0)) for o in outputs), default=0.0)
