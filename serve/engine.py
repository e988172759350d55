"""The model side of the server: one runtime bundle, one `Synthesizer` shared by every session, the front end.

Why one `Synthesizer` may serve concurrent sessions: every graph call goes through an `OrtRunner`,
whose `infer` checks the feeds and calls `InferenceSession.run`, which onnxruntime documents as
thread-safe, or an `OpenVinoRunner` (the `openvino` provider, and bf16 graphs), which shares its
compiled model and gives each thread an infer request of its own, as OpenVINO requires. The Python
objects around the runners keep no per-call state: `SpeechTokenLM.decode` returns a `Decoding` that
owns its KV cache and history, `Synthesizer.stream_tokens` keeps an utterance's state (its mel, flow
and vocoder streams) in a `_Stream` of its own, `Flow` and `Vocoder` only read their tables, and the
per-prompt flow prefixes (`FlowPrefixCache`, read-only arrays) and the lazily drawn sine-noise table
(`UniformNoise`) take a lock. A test runs two sessions at once and gets `cosyvoice-run`'s samples from
both. The one exception is TensorRT: a `TrtRunner` reuses one execution context and its device buffers
per call, so the server offers the onnxruntime providers and OpenVINO (`cpu`, `cuda`, `tensorrt`,
`openvino`). The text front end is used under a lock: the wetext grammars load on first use and their
thread-safety is not documented; it is cheap next to synthesis. Prompt extraction uses two onnxruntime
sessions of its own, safe the same way.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import choose_bundle
from cosyvoice_runtime.flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from cosyvoice_runtime.frontend import (
    FrontendError,
    PromptFeatures,
    TextFrontend,
    TextTokenizer,
    extract_prompt,
    open_session,
)
from cosyvoice_runtime.llm import Decoding
from cosyvoice_runtime.runners import CPU, OPENVINO, ORT_PROVIDERS
from cosyvoice_runtime.sampling import make_sampler
from cosyvoice_runtime.segments import Segment, segments
from cosyvoice_runtime.synthesis import Mode, SynthesisError, Synthesizer, llm_request

from .errors import FieldError
from .queue import Session
from .speakers import frontend_fingerprint

SERVER_PROVIDERS = (*ORT_PROVIDERS, OPENVINO)
"""Providers whose runners are safe to share between sessions (see the module docstring)."""


@dataclass(frozen=True)
class AudioUpload:
    """A prompt recording as sent: an audio file's bytes and the request field they came in."""

    data: bytes
    field: str


@dataclass(frozen=True)
class Sampling:
    """How a request's speech tokens are drawn: every segment gets a fresh sampler of this kind and seed."""

    kind: str
    """"ras" (upstream's repetition-aware sampling) or "greedy" (argmax; the seed is unused)."""
    seed: int


@dataclass(frozen=True)
class SynthesisJob:
    """One request, validated: what to say, in which mode, from which prompt."""

    mode: Mode
    text: str
    prompt: PromptFeatures | AudioUpload
    """Features of a registered speaker, or a recording to extract them from."""
    sampling: Sampling
    prompt_text: str = ""
    """The prompt's transcript (zero-shot)."""
    instruct: str = ""
    """The instruction (instruct2)."""
    speed: float = 1.0
    """Speaking rate; offline only, as upstream."""
    text_field: str = "text"
    """The request field of `text`, named in errors."""


class Engine:
    """A runtime bundle opened for serving: synthesis and prompt extraction, callable from any thread."""

    def __init__(self, bundle: RuntimeBundle, origin: str, *, provider: str = CPU,
                 flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        """Open every graph of `bundle` on `provider` (one of `SERVER_PROVIDERS`); `flow_prefix_bytes`
        bounds the per-prompt flow prefixes that streams from one speaker share (`Flow.prefixes`)."""
        if provider not in SERVER_PROVIDERS:
            raise ValueError(f"the server runs on providers whose runners sessions can share "
                             f"({', '.join(SERVER_PROVIDERS)}); got {provider!r}")
        self.bundle, self.origin, self.provider = bundle, origin, provider
        self.tokenizer = TextTokenizer(bundle.tokenizer_dir)
        self.frontend = TextFrontend(self.tokenizer)
        self._text_lock = threading.Lock()
        self._campplus = open_session(bundle.frontend_path("campplus"))
        self._speech_tokenizer = open_session(bundle.frontend_path("speech_tokenizer"))
        self.synth = Synthesizer(bundle, provider, flow_prefix_bytes=flow_prefix_bytes)

    @classmethod
    def open(cls, model: Path | None, *, provider: str = CPU,
             flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> Engine:
        """The bundle `cosyvoice-run` would use for `--model model` (verified), opened for serving."""
        choice = choose_bundle(model)
        return cls(RuntimeBundle.open(choice.path, verify=True), choice.origin, provider=provider,
                   flow_prefix_bytes=flow_prefix_bytes)

    @property
    def sample_rate(self) -> int:
        """Sample rate of the audio (24 kHz)."""
        return self.synth.sample_rate

    @property
    def frontend_fingerprint(self) -> str:
        """What prompt features depend on: the front-end models' hashes and the token/mel ratio."""
        return frontend_fingerprint(self.bundle)

    def close(self) -> None:
        """Release the graphs."""
        self.synth.close()

    # --- work run on a session's worker -----------------------------------------------------------------

    def extract(self, upload: AudioUpload) -> PromptFeatures:
        """Speech tokens, prompt mel and x-vector of an uploaded recording; a `FieldError` naming the
        field if it is not usable audio (unreadable, under 16 kHz, over 30 s, too short)."""
        with tempfile.TemporaryDirectory(prefix="cosyvoice-serve-") as folder:
            path = Path(folder) / upload.field
            path.write_bytes(upload.data)
            try:
                return extract_prompt(path, self._campplus, self._speech_tokenizer,
                                      self.bundle.dims.token_mel_ratio)
            except FrontendError as e:  # its messages name the file: say "the audio file" instead
                message = str(e).replace(f"audio file {path}", "the audio file")
                raise FieldError(upload.field, message.replace(str(path), upload.field)) from None

    def stream(self, job: SynthesisJob, session: Session) -> Iterator[np.ndarray]:
        """The job's audio as the runtime streams it: each chunk's new samples, segment after segment."""
        pieces, prompt = self._prepare(job)
        for piece in pieces:
            tokens = session.watch(self._decoding(job, piece, prompt))
            try:
                for chunk in self.synth.stream_tokens(tokens, prompt):
                    yield chunk.samples
            except SynthesisError as e:
                raise FieldError(job.text_field, str(e), status=422) from None

    def synthesize(self, job: SynthesisJob, session: Session) -> Iterator[np.ndarray]:
        """The job's audio offline (upstream's non-streaming path, `speed` applied): one array."""
        pieces, prompt = self._prepare(job)
        audio = []
        for piece in pieces:
            tokens = list(session.watch(self._decoding(job, piece, prompt)))
            session.check()
            try:
                audio.append(self.synth.token2wav(tokens, prompt, speed=job.speed)[1])
            except SynthesisError as e:
                raise FieldError(job.text_field, str(e), status=422) from None
        yield np.concatenate(audio)

    def _prepare(self, job: SynthesisJob) -> tuple[list[Segment], PromptFeatures]:
        """The text's segments (upstream's normalisation, split and prompt formats) and the prompt."""
        with self._text_lock:
            try:
                pieces = segments(job.text, job.mode, self.tokenizer, self.frontend,
                                  prompt_text=job.prompt_text, instruct=job.instruct)
            except FrontendError as e:
                raise FieldError(job.text_field, str(e)) from None
        if not pieces:
            raise FieldError(job.text_field, f"{job.text_field} has nothing to speak after normalisation")
        prompt = self.extract(job.prompt) if isinstance(job.prompt, AudioUpload) else job.prompt
        return pieces, prompt

    def _decoding(self, job: SynthesisJob, piece: Segment, prompt: PromptFeatures) -> Decoding:
        """A segment's decoding, its sampler fresh from the job's seed (as `cosyvoice-run` per segment)."""
        request = llm_request(job.mode, piece.text_ids, prompt, piece.prompt_text_ids)
        return self.synth.lm.decode(request, make_sampler(job.sampling.kind, job.sampling.seed))
