"""The model side of the server: one `CosyVoice3` shared by every session, its errors as the API's.

Why one `CosyVoice3` (its `Synthesizer`) may serve concurrent sessions: every graph call goes through an
`OrtRunner`, whose `infer` checks the feeds and calls `InferenceSession.run`, which onnxruntime documents as
thread-safe, or an `OpenVinoRunner` (the `openvino` provider, and bf16 graphs), which shares its compiled
model and gives each thread an infer request of its own, as OpenVINO requires. The Python objects around the
runners keep no per-call state: `SpeechTokenLM.decode` returns a `Decoding` that owns its KV cache and
history, `Synthesizer.stream_tokens` keeps an utterance's state (its mel, flow and vocoder streams) in a
`_Stream` of its own, `Flow` and `Vocoder` only read their tables, and the per-prompt flow prefixes
(`FlowPrefixCache`, read-only arrays) and the lazily drawn sine-noise table (`UniformNoise`) take a lock.
With `max_batch` > 1 the sessions' decodings run in one `DecodeBatcher` (`decode_batch`): a thread of its
own that alone touches the batch's caches and takes decodings through a lock (prefilled on the CPU; on a GPU
it prefills them). The registered speakers' prefixes are computed by `CosyVoice3.prefix_jobs` on a thread of
its own, one graph call at a time, none while any session synthesises. A test runs two sessions at once and
gets `cosyvoice-run`'s samples from both. The one exception is TensorRT: a `TrtRunner` reuses one execution
context and its device buffers per call, so the server offers the onnxruntime providers and OpenVINO (`cpu`,
`cuda`, `tensorrt`, `openvino`). A request's text is normalised before it waits for a session,
`TEXT_THREADS` at once, each text's grammar in a process of its own (`GrammarProcess`, whose children hold
the wetext grammars; inflect's speller takes turns behind a lock), which a client that leaves ends
(`text_segments`). Prompt extraction uses two onnxruntime sessions of its own, safe the same way, on an
upload decoded before its request waits for a session (`decode_upload`).
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import bundle_graphs, choose_bundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cosyvoice3 import SegmentSpeech
from cosyvoice_runtime.errors import FrontendError, SynthesisError, UserError
from cosyvoice_runtime.flow_prefix import DEFAULT_PREFIX_CACHE_BYTES, prompt_key
from cosyvoice_runtime.frontend import PromptAudio, PromptFeatures, read_prompt_audio
from cosyvoice_runtime.frontend.grammar_process import INTERRUPTION, Interruption
from cosyvoice_runtime.progress import SynthesisProgress
from cosyvoice_runtime.runners import CPU
from cosyvoice_runtime.sampling import Sampling
from cosyvoice_runtime.segments import Segment
from cosyvoice_runtime.speakers import frontend_fingerprint
from cosyvoice_runtime.synthesis import (
    Mode,
    Synthesizer,
    check_options,
    check_synthesis,
    default_max_batch,
    uses_cuda_graphs,
)

from .errors import ApiError, FieldError
from .metrics import BatchMetrics
from .queue import Session
from .settings import SERVER_PROVIDERS

log = logging.getLogger(__name__)
_REQUESTS = itertools.count(1)
"""Numbers the requests' log lines."""


class _LogLines(io.TextIOBase):
    """A text stream whose lines go to the log at INFO, each after `prefix` (what `SynthesisProgress`
    writes, in the server's log)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                log.info("%s%s", self.prefix, line)
        return len(text)


@dataclass(frozen=True)
class AudioUpload:
    """A prompt recording as sent, decoded and checked as a prompt (`decode_upload`), and the request field
    it came in."""

    audio: PromptAudio
    field: str


def decode_upload(data: bytes, field: str) -> AudioUpload:
    """An uploaded audio file's bytes read as a prompt recording: a `FieldError` naming `field` if it is not
    usable audio (unreadable, under 16 kHz, over 30 s, too short, silent). Cheap next to a prompt's
    features, so a request is refused before it waits for a session."""
    audio = io.BytesIO(data)
    audio.name = field  # what the front end's errors call the file
    try:
        return AudioUpload(read_prompt_audio(audio), field)
    except FrontendError as e:
        raise FieldError(field, str(e).replace(f"audio file {field}", "the audio file")) from None


TEXT_THREADS = 4
"""Requests' texts normalised and split at once (`Engine.text_segments`), each text's grammar in a process of
its own (`GrammarProcess`): a short text does not wait behind a long one."""
WARM_UP_CHUNKS = 2
"""Chunks `Engine.warm_up` streams: a first chunk's shapes and a later chunk's."""
WARM_UP_ROUNDS_REPLAYED = 2
"""Times `Engine.warm_up` streams them where the DiT's calls replay from CUDA graphs: a shape is bound once it
comes again (`dit_graphs.BIND_AFTER`), so the second round's calls bind, capture and replay, and the first
request in the bundle's voice (or in one whose prompt's cache rounds alike) replays its first chunk."""


class BundlePrompt(Enum):
    """The prompt recording the bundle carries (`RuntimeBundle.default_prompt`)."""

    DEFAULT = "default"


@dataclass
class TokenUsage:
    """What a job's synthesis read and made, counted by its worker (read once its stream has ended)."""

    text_tokens: int = 0
    """Text tokens the LLM read: each segment's prompt text (transcript or instruction) and text."""
    speech_tokens: int = 0
    """Speech tokens the LLM generated."""


@dataclass(frozen=True)
class SynthesisJob:
    """One request, validated: what to say, in which mode, from which prompt."""

    mode: Mode
    text: str
    prompt: PromptFeatures | AudioUpload | BundlePrompt
    """Features of a registered speaker, a recording to extract them from, or the bundle's own prompt."""
    sampling: Sampling
    """Every segment gets a fresh sampler of this kind and seed."""
    prompt_text: str = ""
    """The prompt's transcript (zero-shot)."""
    instruct: str = ""
    """The instruction (instruct2)."""
    speed: float = 1.0
    """Speaking rate; offline only, as upstream."""
    text_field: str = "text"
    """The request field of `text`, named in errors."""
    usage: TokenUsage = field(default_factory=TokenUsage)


class Engine:
    """A runtime bundle opened for serving: synthesis and prompt extraction, callable from any thread."""

    def __init__(self, bundle: RuntimeBundle, origin: str, *, provider: str = CPU,
                 flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, threads: int | None = None,
                 max_batch: int | None = None, chunk_slots: int | None = None,
                 chunk_policy: ChunkPolicy | None = None, cuda_graphs: bool | None = None,
                 stack_dit: bool = False, stack_vocoder: bool = False) -> None:
        """Open every graph of `bundle` on `provider` (one of `SERVER_PROVIDERS`) with `threads` intra-op
        threads (None: the provider's default, every core); `flow_prefix_bytes` bounds the per-prompt flow
        prefixes that streams from one speaker share (`Flow.prefixes`); `max_batch` > 1 decodes the speech
        ids of that many sessions in one LLM call (`decode_batch`: a `UserError` where the bundle has no
        `llm_decode` on `provider`; None: `default_max_batch`), `chunk_slots` of their chunks at once
        (`Synthesizer.set_max_batch`); `chunk_policy` is every stream's schedule (None: upstream's; a
        `UserError` where these graphs cannot stream on it); `cuda_graphs` replays the decode steps from CUDA
        graphs (None: wherever they can, `uses_cuda_graphs`), `stack_dit` and `stack_vocoder` stack
        concurrent sessions' DiT and vocoder calls (all `CosyVoice3`)."""
        _check_provider(provider)
        self.bundle, self.origin, self.provider = bundle, origin, provider
        self.max_batch = default_max_batch(bundle, provider) if max_batch is None else max_batch
        """Sessions whose speech ids one LLM call decodes (1: each on its own)."""
        self.cuda_graphs = uses_cuda_graphs(cuda_graphs, bundle, provider)
        """Whether the decode steps (and the DiT's calls, where its graph allows) replay from CUDA graphs."""
        max_batch, cuda_graphs = self.max_batch, self.cuda_graphs
        self.batch_metrics = BatchMetrics() if max_batch > 1 or cuda_graphs else None
        """What the decode batch reports, where there is one."""
        self.voice = CosyVoice3(bundle, provider=provider, threads=threads,
                                flow_prefix_bytes=flow_prefix_bytes, max_batch=max_batch,
                                batch_observer=self.batch_metrics, chunk_policy=chunk_policy,
                                chunk_slots=chunk_slots, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                                stack_vocoder=stack_vocoder, normalizer_processes=TEXT_THREADS)
        self.default_prompt = bundle.default_prompt()
        """The bundle's own prompt recording and its transcript, or None (exports of upstream's)."""
        self._text_threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="cosyvoice-text")
        self._default_lock = threading.Lock()
        self._default_features: PromptFeatures | None = None

    @classmethod
    def open(cls, model: Path | None, *, provider: str = CPU,
             flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, threads: int | None = None,
             max_batch: int | None = None, chunk_slots: int | None = None,
             chunk_policy: ChunkPolicy | None = None, cuda_graphs: bool | None = None,
             stack_dit: bool = False, stack_vocoder: bool = False) -> Engine:
        """The bundle `cosyvoice-run` would use for `--model model` (verified), opened for serving; a model
        bundle's export refused before it is made where it could not take these options."""
        _check_provider(provider)
        check_options(bundle_graphs(model), provider, max_batch=max_batch, chunk_slots=chunk_slots,
                      chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                      threads=threads)
        choice = choose_bundle(model, provider=provider)
        return cls(RuntimeBundle.open(choice.path, verify=True), choice.origin, provider=provider,
                   flow_prefix_bytes=flow_prefix_bytes, threads=threads, max_batch=max_batch,
                   chunk_slots=chunk_slots, chunk_policy=chunk_policy, cuda_graphs=cuda_graphs,
                   stack_dit=stack_dit, stack_vocoder=stack_vocoder)

    @staticmethod
    def check(model: Path | None, *, provider: str = CPU, max_batch: int | None = None,
              chunk_slots: int | None = None, chunk_policy: ChunkPolicy | None = None,
              cuda_graphs: bool | None = None, stack_dit: bool = False) -> RuntimeBundle:
        """The bundle `open` would serve for `model` (a model bundle exported first; no file hashed), held
        against the options as `open` holds it before any graph opens (`check_synthesis`): one of
        `USER_ERRORS` where `open` would refuse them (a model bundle's options before its export)."""
        _check_provider(provider)
        check_options(bundle_graphs(model), provider, max_batch=max_batch, chunk_slots=chunk_slots,
                      chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit)
        bundle = RuntimeBundle.open(choose_bundle(model, provider=provider).path)
        check_synthesis(bundle, provider, max_batch=max_batch, chunk_slots=chunk_slots,
                        chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit)
        return bundle

    @property
    def synth(self) -> Synthesizer:
        """The graphs every session shares."""
        return self.voice.synth

    @property
    def sample_rate(self) -> int:
        """Sample rate of the audio (24 kHz)."""
        return self.voice.sample_rate

    @property
    def frontend_fingerprint(self) -> str:
        """What prompt features depend on: the front-end models' hashes and the token/mel ratio."""
        return frontend_fingerprint(self.bundle)

    def close(self) -> None:
        """Release the graphs."""
        self._text_threads.shutdown(wait=False, cancel_futures=True)
        self.voice.close()

    def segments(self, job: SynthesisJob) -> list[Segment]:
        """The job's text's segments (upstream's normalisation, split and prompt formats); a `FieldError`
        naming its field where there is nothing to speak."""
        try:
            return self.voice.segments(job.mode, job.text, prompt_text=job.prompt_text, instruct=job.instruct,
                                       text_name=job.text_field)
        except (FrontendError, UserError) as e:
            raise FieldError(job.text_field, str(e)) from None

    async def text_segments(self, job: SynthesisJob, timeout: float) -> list[Segment]:
        """`segments` for the event loop, before the job waits for a session: text with nothing to speak is
        a 4xx at once, not after the queue's wait. On the engine's own `TEXT_THREADS`, not the event loop's
        worker threads (which encode the streams). Cancelled (its client left) or past `timeout` seconds
        (a 504), it ends the grammar's process working on the text (`Interruption`), which would work on
        for seconds otherwise (a long run of digits: tens of seconds)."""
        interruption = Interruption()
        context = contextvars.copy_context()
        context.run(INTERRUPTION.set, interruption)
        work = asyncio.get_running_loop().run_in_executor(self._text_threads, context.run, self.segments, job)
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            interruption.interrupt()
            raise ApiError(504, f"normalising {job.text_field} took longer than the server's timeout of "
                                f"{timeout:g} s") from None
        except asyncio.CancelledError:
            interruption.interrupt()
            raise

    # --- work run on a session's worker -----------------------------------------------------------------

    def extract(self, upload: AudioUpload) -> PromptFeatures:
        """Speech tokens, prompt mel and x-vector of an uploaded recording."""
        return self.voice.prompt_features(upload.audio)

    def default_features(self) -> PromptFeatures:
        """The features of the bundle's own prompt, extracted on first use and kept (a server that never
        uses them never pays for them); the voice of every request without a prompt of its own, so its flow
        prefix is held in the cache as a registered speaker's is."""
        if self.default_prompt is None:
            raise ValueError(f"{self.bundle.root} carries no prompt of its own")
        with self._default_lock:
            if self._default_features is None:
                self._default_features = self.voice.prompt_features(self.default_prompt[0])
                self.synth.flow.prefixes.hold(prompt_key(self._default_features))
            return self._default_features

    def warm_up(self) -> float | None:
        """Stream the bundle's own prompt's transcript in its own voice for `WARM_UP_CHUNKS` chunks, then
        stop, so that the first request does not pay what only a first synthesis pays: the text normaliser's
        grammars, the bundle prompt's features and flow prefix, onnxruntime's first calls of every graph at
        a stream's first shapes (on a GPU, cuDNN's algorithm search for them; where the DiT replays, its
        graphs of them: `WARM_UP_ROUNDS_REPLAYED`). Returns the seconds it took, or None for a bundle
        without a prompt of its own (nothing to warm up with)."""
        if self.default_prompt is None:
            log.info("warm-up: skipped, the bundle carries no prompt of its own")
            return None
        start = time.monotonic()
        text = self.default_prompt[1]
        prompt = self.default_features()
        pieces = self.voice.segments(Mode.ZERO_SHOT, text, prompt_text=text)
        rounds = WARM_UP_ROUNDS_REPLAYED if self.synth.dit_graphs is not None else 1
        for _ in range(rounds):
            speech = self.voice.speak(pieces[0], prompt, Mode.ZERO_SHOT, stream=True)
            try:
                for _ in itertools.islice(speech, WARM_UP_CHUNKS):
                    pass
            finally:
                speech.close()
        seconds = time.monotonic() - start
        log.info("warm-up: %d chunks in the bundle's own voice%s in %.2f s", WARM_UP_CHUNKS,
                 f", {rounds} times (the DiT's graphs)" if rounds > 1 else "", seconds)
        return seconds

    def stream(self, job: SynthesisJob, pieces: list[Segment], session: Session) -> Iterator[np.ndarray]:
        """The job's audio as the runtime streams it: each chunk's new samples, segment after segment
        (`pieces`: its `segments`)."""
        yield from self._speak(job, pieces, session, stream=True)

    def synthesize(self, job: SynthesisJob, pieces: list[Segment], session: Session) -> Iterator[np.ndarray]:
        """The job's audio offline (upstream's non-streaming path, `speed` applied): one array."""
        yield np.concatenate(list(self._speak(job, pieces, session, stream=False)))

    def stream_text(self, job: SynthesisJob, pieces: Iterable[str], session: Session) -> Iterator[np.ndarray]:
        """The job's audio while its text comes in `pieces` (upstream's bistream, `speak_text_stream`;
        `job.text` is unused): each chunk's new samples. Zero-shot or instruct2."""
        request, start = next(_REQUESTS), time.monotonic()
        prompt = self._prompt(job)
        log.info("request %d: %s, text streamed in; %.2f s in the queue", request, job.mode,
                 start - session.admitted)
        speech = self.voice.speak_text_stream(pieces, prompt, job.mode,
                                              prompt_text=job.prompt_text, instruct=job.instruct,
                                              sampling=job.sampling, watch=session.watch)
        samples = 0
        for audio in self._samples(request, start, speech, job, first=True):
            samples += len(audio)
            yield audio
        self._log_done(request, start, samples, job)

    def _speak(self, job: SynthesisJob, pieces: list[Segment], session: Session, *, stream: bool
               ) -> Iterator[np.ndarray]:
        """The job's chunks; its stages go to the log: what it is, the speech tokens every few seconds
        (`SynthesisProgress`), its first audio and its end."""
        request, start = next(_REQUESTS), time.monotonic()
        prompt = self._prompt(job)
        log.info("request %d: %s, %s, %d segment(s), %d characters; %.2f s in the queue", request, job.mode,
                 "streamed" if stream else "offline", len(pieces), len(job.text), start - session.admitted)
        samples = 0
        with SynthesisProgress(pieces, out=_LogLines(f"request {request}: ")) as progress:
            for i, piece in enumerate(pieces):
                def watch(ids: Iterator[int], i: int = i) -> Iterator[int]:
                    return progress.watch(i)(session.watch(ids))

                speech = self.voice.speak(piece, prompt, job.mode, stream=stream, speed=job.speed,
                                          sampling=job.sampling, watch=watch)
                for audio in self._samples(request, start, speech, job, first=samples == 0):
                    samples += len(audio)
                    yield audio
        self._log_done(request, start, samples, job)

    def _samples(self, request: int, start: float, speech: SegmentSpeech, job: SynthesisJob, *, first: bool
                 ) -> Iterator[np.ndarray]:
        """`speech`'s chunks' samples (the request's first audio logged where `first`), then its text and
        speech tokens counted in `job.usage`; a failed synthesis as a 422 naming the text field."""
        try:
            for chunk in speech:
                if first:
                    log.info("request %d: first audio after %.2f s", request, time.monotonic() - start)
                    first = False
                yield chunk.samples
        except SynthesisError as e:
            raise FieldError(job.text_field, str(e), status=422) from None
        job.usage.text_tokens += len(speech.text_ids)
        job.usage.speech_tokens += len(speech.speech_tokens)

    def _log_done(self, request: int, start: float, samples: int, job: SynthesisJob) -> None:
        log.info("request %d: done, %.2f s of audio (%d speech tokens) in %.2f s", request,
                 samples / self.sample_rate, job.usage.speech_tokens, time.monotonic() - start)

    def _prompt(self, job: SynthesisJob) -> PromptFeatures:
        """The job's prompt features: a speaker's, an upload's (extracted now) or the bundle's own."""
        if isinstance(job.prompt, AudioUpload):
            return self.extract(job.prompt)
        if isinstance(job.prompt, BundlePrompt):
            return self.default_features()
        return job.prompt


def _check_provider(provider: str) -> None:
    if provider not in SERVER_PROVIDERS:
        raise ValueError(f"the server runs on providers whose runners sessions can share "
                         f"({', '.join(SERVER_PROVIDERS)}); got {provider!r}")
