"""`CosyVoice3`: upstream's `CosyVoice3` class without torch, opened on a runtime bundle.

Upstream's public methods keep their names, argument names, order and defaults; each generator yields
`{"tts_speech": float32 array (1, N)}` per text segment (offline) or per chunk (`stream=True`), numpy
where upstream yields tensors, so upstream's `example.py` runs with its import and its `torchaudio.save`
lines changed:

    from cosyvoice_runtime import AutoModel, save_wav
    cosyvoice = AutoModel(model_dir="bundles/tiny-runtime")
    for i, j in enumerate(cosyvoice.inference_zero_shot(text, prompt_text, "prompt.wav", stream=False)):
        save_wav("zero_shot_{}.wav".format(i), j["tts_speech"], cosyvoice.sample_rate)

Speakers that `add_zero_shot_spk` adds live in this object until `save_spkinfo` writes them to a
speaker registry folder (`cosyvoice_runtime.speakers`; by default the one `cosyvoice-serve` and
`cosyvoice-export speakers` use), from which a later `CosyVoice3` reads them, as upstream keeps them in
`spk2info.pt` beside the model. Adding a speaker also queues its prompt's flow prefix (what a stream's
first chunk would otherwise compute first) as a background job that yields to every synthesis in flight
(`prefix_jobs`, `cosyvoice_runtime.prefix_jobs`), so that its first stream starts as fast as its second.

The lower level, which `cosyvoice-run`, the server, the golden runner and the benchmark use: `segments`
(the text as upstream normalises, splits and formats it), `prompt_features` (a prompt recording's
tokens, mel and x-vector; its first call opens the front end's two models, which a process that speaks only
registered speakers never loads) and `speak` (one segment's audio chunks, with its speech tokens).
Ours beside upstream's: `synthesize_many`, many texts at once, their decodings batched (`max_batch`).
"""

from __future__ import annotations

import functools
import numbers
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

import numpy as np
import onnxruntime

from cosyvoice_graphs.precision import FP16, FP32
from cosyvoice_graphs.precision_plan import GPU_FP16

from .bundle import RuntimeBundle
from .bundle_source import bundle_graphs, choose_bundle
from .chunk_policy import ChunkPolicy, check_policy
from .decode_batch import BatchObserver
from .errors import UserError
from .flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from .frontend import (
    ENDOFPROMPT,
    PromptAudio,
    PromptFeatures,
    TextFrontend,
    TextTokenizer,
    check_prompt_audio,
    check_source_audio,
    extract_prompt,
    open_session,
    read_prompt_audio,
    read_source_audio,
    source_speech_tokens,
    zero_shot_prompt,
)
from .frontend.audio import check_sample_rate
from .frontend.grammar_process import GrammarProcess
from .frontend.text import checked_wetext_normalize
from .frontend.tokenizer import check_unicode
from .prefix_jobs import PrefixJobs
from .process_memory import release_free_heap
from .runners import CPU, CPU_PROVIDERS, CUDA, TENSORRT
from .runners.ort import LOAD_ERRORS, unloadable
from .sampling import Sampling
from .segments import Segment, checked_segments, prompt_ids
from .speakers import (
    Speaker,
    SpeakerRegistry,
    check_name,
    default_speakers_dir,
    frontend_fingerprint,
    shown_name,
)
from .synthesis import (
    AudioChunk,
    Mode,
    Synthesizer,
    check_options,
    check_synthesis,
    closing_after,
    llm_request,
)
from .text_stream import TextStreamDecoding

MIN_SPEED, MAX_SPEED = 0.25, 4.0
"""The speeds taken: OpenAI's speech API's range, the widest of our front doors (upstream checks none; at
1000 its flow has no frame left, at 1e-4 it would make hours of audio)."""

PromptWav = str | Path | BinaryIO | tuple[np.ndarray, int] | PromptAudio
"""A prompt recording: a file's path, an open binary file, (samples, sample rate) with samples (N,) or
(N, channels) in [-1, 1], or audio read already."""

TtsText = str | Iterable[str]
"""A text, or its pieces as they come (upstream takes a generator: its bistream)."""
TokenWatch = Callable[[Iterator[int]], Iterator[int]]
"""Wraps a segment's speech-id iterator, e.g. to stop it between LLM steps (a server's cancellation)."""


def _upstream_precision(fp16: bool, provider: str) -> str | None:
    """The precision upstream's `fp16=True` asks of a bundle on `provider` (None: the bundle's own): on
    cuda `GPU_FP16`, every graph with an fp16 body in fp16 and the decode steps on an fp16 `llm_decode`
    (onnxruntime's CUDA provider cannot decode on an fp16 `llm`), on tensorrt fp16. On a CPU's provider
    none, with a warning, as upstream takes fp16=True for False without a CUDA device."""
    if not fp16:
        return None
    if provider in CPU_PROVIDERS:
        warnings.warn(f"fp16=True ignored on the {provider} provider: upstream runs in float32 without a "
                      "CUDA device", stacklevel=3)
        return None
    return GPU_FP16 if provider == CUDA else FP16.name


def _upstream_provider(load_trt: bool, provider: str) -> str:
    """The provider upstream's `load_trt` asks for, where `provider` leaves the choice (the default)."""
    if not load_trt:
        return provider
    if provider not in (CPU, TENSORRT):
        raise UserError(f"load_trt=True asks for TensorRT; provider={provider!r} for something else")
    return TENSORRT


@dataclass
class SegmentSpeech:
    """One segment's audio as it is made: iterate for its chunks (offline: one final chunk with all of
    it); `speech_tokens` holds the speech ids decoded so far (all of them once the chunks are exhausted)."""

    chunks: Generator[AudioChunk, None, None]
    speech_tokens: list[int] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    """The text ids the LLM reads, its prompt text's first (text streamed in: those read so far)."""

    def __iter__(self) -> Iterator[AudioChunk]:
        return self.chunks

    def close(self) -> None:
        """Stop making audio before the end: its decoding stops (a batched one's row is freed)."""
        self.chunks.close()


class CosyVoice3:
    """A runtime bundle's graphs, front end and speakers, opened once (the runtime's front door); the
    prompt front end's models open on the first prompt."""

    def __init__(self, model_dir: str | Path | RuntimeBundle, load_trt: bool = False,
                 load_vllm: bool = False, fp16: bool = False, trt_concurrent: int = 1, *, provider: str = CPU,
                 threads: int | None = None, sampling: str = "ras", seed: int = 0, verify: bool = True,
                 speakers_dir: str | Path | None = None, flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 max_batch: int | None = None, batch_observer: BatchObserver | None = None,
                 chunk_policy: ChunkPolicy | None = None, chunk_slots: int | None = None,
                 cuda_graphs: bool | None = None, stack_dit: bool = False, stack_vocoder: bool = False,
                 normalizer_processes: int = 0) -> None:
        """Open `model_dir`: a runtime bundle, a model bundle exported on first use as `cosyvoice-run
        --model` does, or a bundle opened already. `provider` and `threads` place the graphs
        (`cosyvoice_runtime.runners.PROVIDERS`); `sampling` is upstream's repetition-aware sampling
        ("ras", seeded by `seed`, each segment from a fresh sampler) or "greedy"; `verify` checks every
        bundle file's sha256 against the manifest here (the prompt front end's models too, which open on
        first use); `speakers_dir` is the speaker registry folder (default: `default_speakers_dir()`);
        `flow_prefix_bytes` bounds the per-prompt flow prefixes that streams of one speaker share
        (`Flow.prefixes`); `max_batch` > 1 decodes the speech ids of concurrent calls (threads, the server's
        sessions, `synthesize_many`) together, up to that many per `llm_decode` call (`decode_batch`,
        reporting to `batch_observer`; the bundle needs `llm_decode`: `--precision cpu-fast` or
        `decode=fp32` on the CPU, `decode=fp16` on cuda; None: `synthesis.default_max_batch`, 4 on cuda where
        the bundle batches there, else 1), and `chunk_slots` of those calls' chunks run their flow and vocoder
        at once (None: one on a CPU whose cores a session's graphs take, `synthesis.default_chunk_slots`);
        `chunk_policy` is when every stream emits its chunks (None: upstream's schedule;
        `ChunkPolicy.first_chunk_tokens` a deviation from it for latency), checked against the graphs here;
        `cuda_graphs` replays the decode steps from CUDA graphs (on cuda, with `llm_decode`: `decode_graphs`;
        None: wherever they can), in the decode batch even of one, and the DiT's calls where its graph allows
        (`synthesis.dit_replays`, `dit_graphs`); `stack_dit` runs concurrent streams' DiT calls at the same
        ODE step and frames as one call (`dit_stack`), `stack_vocoder` their vocoder calls over the same
        frames (`Vocoder.stack_calls`); `normalizer_processes` > 0 runs the text normaliser's grammars in up
        to that many child processes, a text in each (`GrammarProcess`), where a text with a digit does not
        stop the other threads (a server's streams) for its normalisation (seconds for a long English text),
        and as many threads normalise at once.

        Upstream's own keywords are taken for what they mean here: `load_trt` runs the graphs on
        onnxruntime's TensorRT provider (upstream's DiT runs as a TensorRT plan it builds on first use);
        `fp16` asks a GPU's provider for a float16 bundle (a model bundle is exported in it, a runtime
        bundle must be one: `_upstream_precision`) and is ignored on a CPU's, with a warning, as upstream
        ignores it without CUDA; `load_vllm` and `trt_concurrent` have nothing to choose here and are
        ignored, with a warning."""
        provider = _upstream_provider(load_trt, provider)
        for name, value, default, why in (
                ("load_vllm", load_vllm, False, "the LLM runs on onnxruntime"),
                ("trt_concurrent", trt_concurrent, 1, "onnxruntime's sessions serve concurrent calls")):
            if value != default:
                warnings.warn(f"{name}={value!r} ignored: {why}", stacklevel=2)
        self.sampling = Sampling(sampling, seed)
        if not isinstance(model_dir, str | Path | RuntimeBundle):
            raise UserError(f"model_dir is {type(model_dir).__name__}; expected a bundle's path")
        if normalizer_processes < 0:  # before the bundle opens
            raise UserError(f"normalizer_processes is {normalizer_processes}; expected 0 (in this process) "
                            f"or more")
        asked = _upstream_precision(fp16, provider)
        if isinstance(model_dir, RuntimeBundle):
            bundle = model_dir
        else:  # a model bundle's options are held against its export before it is made (minutes)
            precision = asked or FP32.name
            planned = bundle_graphs(Path(model_dir), "model_dir", precision)
            check_options(planned, provider, max_batch=max_batch, chunk_slots=chunk_slots,
                          chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                          threads=threads)
            chosen = choose_bundle(Path(model_dir), precision=precision, name="model_dir", provider=provider)
            bundle = RuntimeBundle.open(chosen.path)
        if asked is not None and bundle.precision != asked:
            raise UserError(f"fp16=True: {bundle.root} is exported in {bundle.precision}; on {provider!r} "
                            f"give its model directory (exported in {asked} on first use), an export with "
                            f"cosyvoice-export all --precision {asked}, or fp16=False to run it as it is")
        check_synthesis(bundle, provider, max_batch=max_batch, chunk_slots=chunk_slots,
                        chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                        threads=threads)
        if verify and bundle is not model_dir:  # hashed once it is known to be the bundle asked for
            bundle = RuntimeBundle.open(bundle.root, verify=True)
        self.bundle = bundle
        self.tokenizer = TextTokenizer(self.bundle.tokenizer_dir)
        self._grammar_process = GrammarProcess(normalizer_processes) if normalizer_processes else None
        self.frontend = TextFrontend(self.tokenizer,
                                     grammar=self._grammar_process or checked_wetext_normalize)
        self._prompt_lock = threading.Lock()
        self._prompt_sessions: tuple[onnxruntime.InferenceSession, onnxruntime.InferenceSession] | None = None
        """CAM++ and the speech tokenizer once a prompt needed them (`_prompt_models`)."""
        self.synth = Synthesizer(self.bundle, provider, threads=threads, flow_prefix_bytes=flow_prefix_bytes,
                                 max_batch=max_batch, batch_observer=batch_observer,
                                 chunk_policy=chunk_policy, chunk_slots=chunk_slots, cuda_graphs=cuda_graphs,
                                 stack_dit=stack_dit, stack_vocoder=stack_vocoder)
        self.prefix_jobs = PrefixJobs(self.synth.flow, self.synth.live)
        """Speakers' flow prefixes computed in the background (a thread started by the first job)."""
        # an object never closed stops the jobs' thread once it is collected or at exit: a thread left
        # inside an onnxruntime call as the interpreter ends aborts the process
        self._stop_prefix_jobs = weakref.finalize(self, self.prefix_jobs.close)
        self._closed = False
        self._speakers_dir = speakers_dir
        self._added: dict[str, Speaker] = {}
        """Speakers `add_zero_shot_spk` added and `save_spkinfo` has not written yet."""
        self._added_lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self.synth.sample_rate

    # --- upstream's methods -------------------------------------------------------------------------

    def inference_zero_shot(self, tts_text: TtsText, prompt_text: str, prompt_wav: PromptWav | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Speak `tts_text` in the voice of `prompt_wav`, whose transcript is `prompt_text` (a bare
        transcript, or upstream's "You are a helpful assistant.<|endofprompt|>" + transcript), or of the
        speaker `zero_shot_spk_id` (`add_zero_shot_spk`; then `prompt_text` and `prompt_wav` are unused).
        `tts_text` may be pieces still to come, as upstream's generator (`speak_text_stream`). A stream's
        chunks follow this object's `chunk_policy`."""
        speaker = self._speaker(zero_shot_spk_id)
        if speaker is None:
            _check_str(prompt_text, "prompt_text")
        elif not speaker.prompt_text.strip():
            raise UserError(f"zero_shot_spk_id {zero_shot_spk_id!r} was added without a transcript, which "
                            "zero-shot needs; speak it with inference_cross_lingual or inference_instruct2, "
                            "or add it again with its prompt_text")
        return self._inference(Mode.ZERO_SHOT, tts_text, speaker or prompt_wav, stream, speed, text_frontend,
                               prompt_text=speaker.prompt_text if speaker else prompt_text)

    def inference_cross_lingual(self, tts_text: TtsText, prompt_wav: PromptWav | None,
                                zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                                text_frontend: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Speak `tts_text` (any language, fine-grained tags allowed) in the voice of `prompt_wav` or of
        the speaker `zero_shot_spk_id`, without the prompt's transcript; not text in pieces (upstream's
        CosyVoice3 cannot either: a `UserError`)."""
        speaker = self._speaker(zero_shot_spk_id)
        return self._inference(Mode.CROSS_LINGUAL, tts_text, speaker or prompt_wav, stream, speed,
                               text_frontend)

    def inference_instruct2(self, tts_text: TtsText, instruct_text: str, prompt_wav: PromptWav | None,
                            zero_shot_spk_id: str = "", stream: bool = False, speed: float = 1.0,
                            text_frontend: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Speak `tts_text` as `instruct_text` asks (e.g. "请用广东话表达。"), in the voice of `prompt_wav`;
        `tts_text` as `inference_zero_shot`'s. With the speaker `zero_shot_spk_id`, as upstream: its front
        end takes the stored speaker's inputs whole, so the LLM reads the speaker's transcript where the
        instruction would stand, and `instruct_text` goes unused (a warning says so; `segments` and
        `speak` with the speaker's features apply an instruction in a stored voice)."""
        speaker = self._speaker(zero_shot_spk_id)
        if speaker is not None:
            warnings.warn("instruct_text unused: with zero_shot_spk_id upstream's instruct2 reads the "
                          "speaker's transcript in its place", stacklevel=2)
            transcript = speaker.prompt_text
            instruct_text = transcript if ENDOFPROMPT in transcript else zero_shot_prompt(transcript)
        _check_str(instruct_text, "instruct_text")
        return self._inference(Mode.INSTRUCT2, tts_text, speaker or prompt_wav, stream, speed, text_frontend,
                               instruct=instruct_text)

    def inference_vc(self, source_wav: PromptWav, prompt_wav: PromptWav, stream: bool = False,
                     speed: float = 1.0) -> Iterator[dict[str, np.ndarray]]:
        """Voice conversion: `source_wav`'s speech in the voice of `prompt_wav`, as upstream's: the source's
        speech tokens (at most 30 s, as upstream asserts) go to the flow with no LLM, after the prompt's
        tokens and mel as extracted (upstream's `frontend_vc` leaves them uncut, unlike the other modes'
        front end). Offline one output; streaming one per chunk, on this object's `chunk_policy`."""
        self._check_open()
        speed = _upstream_speed(stream, speed, stacklevel=3)
        source = _audio(source_wav, "source_wav", read_source_audio, check_source_audio)
        prompt = _audio(prompt_wav, "prompt_wav", read_prompt_audio, check_prompt_audio)
        campplus, speech_tokenizer = self._prompt_models()
        features = extract_prompt(prompt, campplus, speech_tokenizer, self.bundle.dims.token_mel_ratio,
                                  aligned=False)
        tokens = [int(t) for t in source_speech_tokens(source, speech_tokenizer)[0]]
        chunks = (self.synth.stream_tokens(tokens, features) if stream
                  else self._offline(iter(tokens), features, speed))
        return self._outputs(chunks)

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav: PromptWav, zero_shot_spk_id: str, *,
                          precompute: bool = True) -> bool:
        """Keep `prompt_wav`'s features and transcript as speaker `zero_shot_spk_id` (in this object until
        `save_spkinfo`) for the `zero_shot_spk_id` argument of the inference methods, replacing one of
        that name. `precompute` (ours): queue the speaker's flow prefix as a background job
        (`prefix_jobs`; `wait_prefixes` waits for it), which never delays a synthesis in flight; without
        it the speaker's first stream computes the prefix. Either way the prefix is held as a speaker's,
        ahead of uploaded prompts'. Returns True, as upstream does."""
        self._check_open()
        _check_str(zero_shot_spk_id, "zero_shot_spk_id")
        if not zero_shot_spk_id:
            raise UserError("zero_shot_spk_id is empty")
        name = check_name(zero_shot_spk_id)
        if name != zero_shot_spk_id:  # stored stripped, it would be unknown under the name given
            raise UserError(f"zero_shot_spk_id: a speaker name has no leading or trailing blanks; got "
                            f"{zero_shot_spk_id!r}")
        _check_str(prompt_text, "prompt_text")
        features = self.prompt_features(prompt_wav)
        with self._added_lock:  # two threads adding one name leave the job of the speaker kept
            self.prefix_jobs.submit(name, features, compute=precompute)
            self._added[name] = Speaker(name, prompt_text, features, created="")
        return True

    def wait_prefixes(self, timeout: float | None = None) -> bool:
        """Block until no speaker's flow prefix is queued or being computed (`prefix_jobs`); False if
        `timeout` seconds passed first. Syntheses in flight delay the jobs."""
        return self.prefix_jobs.wait(timeout)

    def save_spkinfo(self) -> None:
        """Write the speakers added since the last save to the speaker registry folder, where a later
        `CosyVoice3` (and `cosyvoice-serve`) finds them."""
        with self._added_lock:  # a speaker added meanwhile waits, then stays for the next save
            for speaker in self._added.values():
                self.speakers.add(speaker.name, speaker.prompt_text, speaker.features)
            self._added.clear()

    def list_available_spks(self) -> list[str]:
        """The speakers of the registry folder (those made with this bundle's front end) and those added
        since, in that order."""
        saved = self.speakers.names()
        with self._added_lock:
            return saved + [name for name in self._added if name not in saved]

    @functools.cached_property
    def speakers(self) -> SpeakerRegistry:
        """The speaker registry folder, read when first needed."""
        folder = Path(self._speakers_dir) if self._speakers_dir else default_speakers_dir()
        return SpeakerRegistry(folder, frontend_fingerprint(self.bundle))

    # --- the lower level ------------------------------------------------------------------------------

    def segments(self, mode: Mode, tts_text: str, *, prompt_text: str = "", instruct: str = "",
                 text_frontend: bool = True, text_name: str = "tts_text") -> list[Segment]:
        """`tts_text` normalised and split as upstream does (`text_frontend=False`: one segment, as
        given), each piece formatted for `mode` and tokenised; a `UserError` (naming the text
        `text_name`) if nothing is left."""
        return checked_segments(tts_text, mode, self.tokenizer, self.frontend if text_frontend else None,
                                prompt_text=prompt_text, instruct=instruct, text_name=text_name)

    def prompt_features(self, prompt_wav: PromptWav) -> PromptFeatures:
        """The prompt recording's speech tokens, prompt mel and x-vector (upstream's front end); the first
        call opens its models."""
        self._check_open()
        # a bad recording is refused before any model opens
        audio = _audio(prompt_wav, "prompt_wav", read_prompt_audio, check_prompt_audio)
        campplus, speech_tokenizer = self._prompt_models()
        return extract_prompt(audio, campplus, speech_tokenizer, self.bundle.dims.token_mel_ratio)

    def speak(self, piece: Segment, prompt: PromptFeatures, mode: Mode, *, stream: bool = False,
              speed: float = 1.0, sampling: Sampling | None = None, policy: ChunkPolicy | None = None,
              max_tokens: int | None = None, ignore_stop: bool = False, watch: TokenWatch | None = None
              ) -> SegmentSpeech:
        """One segment's audio: upstream's offline path (one final chunk, `speed` applied) or its chunk
        schedule (`stream`: `Synthesizer.stream_tokens`; `policy` replaces this object's, a `UserError` if
        these graphs cannot take it), decoded with a fresh sampler of `sampling` (default: this object's).
        `max_tokens` and `ignore_stop` are for benchmarks (`SpeechTokenLM.decode`); `watch` wraps the
        speech-id iterator."""
        self._check_open()
        _check_speed(stream, speed)
        if stream and policy is not None:  # checked before the LLM runs
            policy = check_policy(policy, self.bundle)
        request = llm_request(mode, piece.text_ids, prompt, piece.prompt_text_ids)
        decoding = self.synth.decode(request, (sampling or self.sampling).sampler(), max_tokens=max_tokens,
                                     ignore_stop=ignore_stop, prompt=prompt)
        tokens = watch(decoding) if watch is not None else decoding
        chunks = (self.synth.stream_tokens(tokens, prompt, policy=policy, decoding=decoding) if stream
                  else self._offline(tokens, prompt, speed))
        return SegmentSpeech(closing_after(chunks, decoding.close), decoding.tokens,
                             [*piece.prompt_text_ids, *piece.text_ids])

    def synthesize_many(self, texts: Sequence[str], prompt_wav: PromptWav | None = None, *,
                        mode: Mode | str = Mode.ZERO_SHOT, prompt_text: str = "", instruct_text: str = "",
                        zero_shot_spk_id: str = "", speed: float = 1.0, text_frontend: bool = True
                        ) -> list[np.ndarray]:
        """Many texts in one voice (`prompt_wav`, or the speaker `zero_shot_spk_id`), offline: each text's
        audio, its segments joined, in the order given. The texts run at once, each on a thread of its own
        (`max_batch` of them), so that their speech ids decode in one batch while their flow and vocoder
        calls share the cores; each text's audio is what `inference_*` makes of it alone (each segment from
        a fresh sampler of this object's sampling). Every text is checked before any runs."""
        self._check_open()
        if isinstance(texts, str | bytes) or not isinstance(texts, Sequence):
            raise UserError(f"texts is {type(texts).__name__}; expected a list of str")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise UserError(f"texts[{i}] is {type(text).__name__}; expected a str")
        mode = Mode(mode)
        speaker = self._speaker(zero_shot_spk_id)
        prompt = speaker or prompt_wav
        if prompt is None:
            raise UserError("prompt_wav is needed unless zero_shot_spk_id names an added speaker")
        _check_speed(False, speed)
        prompt_text = speaker.prompt_text if speaker and mode is Mode.ZERO_SHOT else prompt_text
        pieces = [self.segments(mode, text, prompt_text=prompt_text, instruct=instruct_text,
                                text_frontend=text_frontend, text_name=f"texts[{i}]")
                  for i, text in enumerate(texts)]
        features = prompt.features if isinstance(prompt, Speaker) else self.prompt_features(prompt)

        def one(segments: list[Segment]) -> np.ndarray:
            return np.concatenate([chunk.samples for piece in segments
                                   for chunk in self.speak(piece, features, mode, speed=speed)])

        workers = self.synth.batcher.max_batch if self.synth.batcher is not None else 1
        with ThreadPoolExecutor(workers, thread_name_prefix="synthesize-many") as pool:
            return list(pool.map(one, pieces))

    def speak_text_stream(self, pieces: Iterable[str], prompt: PromptFeatures, mode: Mode, *,
                          prompt_text: str = "", instruct: str = "", stream: bool = True, speed: float = 1.0,
                          sampling: Sampling | None = None, policy: ChunkPolicy | None = None,
                          max_tokens: int | None = None, watch: TokenWatch | None = None) -> SegmentSpeech:
        """Audio for text that arrives in pieces while it is spoken (upstream's bistream,
        `cosyvoice_runtime.text_stream`): each piece tokenised as it is read, neither normalised nor split
        (as upstream does with a generator), the LLM fed text and speech interleaved; chunks on the
        policy's schedule (`stream`) or, offline, one final chunk. Zero-shot and instruct2 only: upstream's
        CosyVoice3 needs `<|endofprompt|>` in the prompt text, which cross-lingual has none of (a
        `UserError` here). `max_tokens` bounds the ids sampled (benchmarks); the rest as `speak`."""
        self._check_open()
        _check_text_stream(mode)
        _check_speed(stream, speed)
        if stream and policy is not None:
            policy = check_policy(policy, self.bundle)
        ids = prompt_ids(mode, self.tokenizer, prompt_text=prompt_text, instruct=instruct)
        speech = [int(t) for t in prompt.speech_tokens[0]] if mode is Mode.ZERO_SHOT else []
        read = list(ids)
        decoding = TextStreamDecoding(self.synth.lm, self._text_ids(pieces, read), ids, speech,
                                      (sampling or self.sampling).sampler(), max_tokens=max_tokens,
                                      max_ids=self.synth.flow.max_tokens(prompt))
        tokens = watch(decoding) if watch is not None else decoding
        chunks = (self.synth.stream_tokens(tokens, prompt, policy=policy) if stream
                  else self._offline(tokens, prompt, speed))
        return SegmentSpeech(closing_after(chunks, decoding.close), decoding.tokens, read)

    def _text_ids(self, pieces: Iterable[str], read: list[int]) -> Iterator[int]:
        """The ids of each piece of text, tokenised as it comes, each also appended to `read`; a `UserError`
        where the pieces end without one."""
        before = len(read)
        for piece in pieces:
            if not isinstance(piece, str):
                raise UserError(f"tts_text: a piece of streamed text is {type(piece).__name__}, not str")
            check_unicode(piece, "tts_text: a piece of streamed text")
            for i in self.tokenizer.encode(piece):
                read.append(i)
                yield i
        if len(read) == before:
            raise UserError("tts_text: the streamed pieces held no text (none, or only empty ones)")

    @property
    def chunk_policy(self) -> ChunkPolicy:
        """When every stream emits its chunks unless `speak` is given a policy (checked already)."""
        return self.synth.chunk_policy

    def close(self) -> None:
        """Cancel the prefix jobs and release the graphs and the front end's models; a synthesis asked for
        afterwards is a `UserError`."""
        self._closed = True
        self._stop_prefix_jobs()
        self.synth.close()
        if self._grammar_process is not None:
            self._grammar_process.close()
        with self._prompt_lock:
            self._prompt_sessions = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UserError("this CosyVoice3 is closed: open the bundle again")

    def _outputs(self, chunks: Iterable[AudioChunk]) -> Iterator[dict[str, np.ndarray]]:
        """Upstream's outputs of `chunks`; a method's generator, so that it keeps this object (and its
        background threads) alive while it is iterated."""
        for chunk in chunks:
            yield {"tts_speech": chunk.samples[None]}

    def _speaker(self, spk_id: str) -> Speaker | None:
        if not spk_id:
            return None
        speaker = self._added.get(spk_id) or self.speakers.get(spk_id)
        if speaker is None:
            known = ", ".join(self.list_available_spks()) or "none"
            raise UserError(f"zero_shot_spk_id: unknown speaker {shown_name(spk_id)} (available: {known})")
        return speaker

    def _prompt_models(self) -> tuple[onnxruntime.InferenceSession, onnxruntime.InferenceSession]:
        """CAM++ and the speech tokenizer, opened on first use and kept: the released speech tokenizer alone
        is ~1 GB, which a server that speaks only registered speakers would hold for nothing."""
        with self._prompt_lock:  # concurrent first prompts open them once
            if self._prompt_sessions is None:
                self._prompt_sessions = (_frontend_session(self.bundle, "campplus"),
                                         _frontend_session(self.bundle, "speech_tokenizer"))
                # parsing the models left load-time garbage resident in the C heap, as `OrtRunner`'s do
                release_free_heap()
            return self._prompt_sessions

    def _inference(self, mode: Mode, tts_text: TtsText, prompt: Speaker | PromptWav | None,
                   stream: bool,
                   speed: float, text_frontend: bool, *, prompt_text: str = "", instruct: str = ""
                   ) -> Iterator[dict[str, np.ndarray]]:
        self._check_open()
        if prompt is None:
            raise UserError("prompt_wav is needed unless zero_shot_spk_id names an added speaker")
        speed = _upstream_speed(stream, speed)
        if tts_text is None or isinstance(tts_text, bytes) or not isinstance(tts_text, Iterable):
            raise UserError(f"tts_text is {type(tts_text).__name__}; expected a str, or an iterable of str "
                            "pieces")
        if not isinstance(tts_text, str):  # pieces of text still to come: upstream's bistream
            _check_text_stream(mode)
            prompt_ids(mode, self.tokenizer, prompt_text=prompt_text, instruct=instruct)  # checked first
            features = prompt.features if isinstance(prompt, Speaker) else self.prompt_features(prompt)
            speech = self.speak_text_stream(tts_text, features, mode, prompt_text=prompt_text,
                                            instruct=instruct, stream=stream, speed=speed)
            return self._outputs(speech)
        # everything is checked before the first segment runs
        pieces = self.segments(mode, tts_text, prompt_text=prompt_text, instruct=instruct,
                               text_frontend=text_frontend)
        features = prompt.features if isinstance(prompt, Speaker) else self.prompt_features(prompt)
        return self._yield(pieces, features, mode, stream, speed)

    def _yield(self, pieces: list[Segment], features: PromptFeatures, mode: Mode, stream: bool, speed: float
               ) -> Iterator[dict[str, np.ndarray]]:
        for piece in pieces:
            for chunk in self.speak(piece, features, mode, stream=stream, speed=speed):
                yield {"tts_speech": chunk.samples[None]}

    def _offline(self, tokens: Iterator[int], prompt: PromptFeatures, speed: float) -> Iterator[AudioChunk]:
        """The segment as one final chunk, made when first asked for."""
        yield self.synth.synthesize_tokens(tokens, prompt, speed=speed).as_chunk()


def _frontend_session(bundle: RuntimeBundle, name: str) -> onnxruntime.InferenceSession:
    """The bundle's front-end model `name` opened (`open_session`); a damaged file is one line."""
    path = bundle.frontend_path(name)
    try:
        return open_session(path)
    except LOAD_ERRORS as e:
        raise unloadable(path, e) from None


def _check_text_stream(mode: Mode) -> None:
    if mode is Mode.CROSS_LINGUAL:
        raise UserError("cross-lingual cannot take its text in pieces: upstream's CosyVoice3 streams text "
                        "after a prompt text holding <|endofprompt|>, which cross-lingual has none of (use "
                        "zero-shot or instruct2)")


def _upstream_speed(stream: bool, speed: float, stacklevel: int = 4) -> float:
    """The speed that upstream's methods apply: none when streaming (a warning, at the caller of the
    method `stacklevel` - 1 frames up, says so); checked."""
    if stream and speed != 1.0:
        warnings.warn(f"speed={speed!r} ignored: upstream applies speed offline only", stacklevel=stacklevel)
        speed = 1.0
    _check_speed(stream, speed)
    return speed


def _check_speed(stream: bool, speed: float) -> None:
    if not (isinstance(speed, numbers.Real) and MIN_SPEED <= speed <= MAX_SPEED):  # nan compares false
        raise UserError(f"speed is {speed!r}; expected a number from {MIN_SPEED:g} to {MAX_SPEED:g}")
    if stream and speed != 1.0:
        raise UserError("speed works offline only (upstream ignores it when streaming)")


def _check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise UserError(f"{name} is {type(value).__name__}; expected a str")


def _audio(wav: PromptWav, name: str, read: Callable[[str | Path | BinaryIO], PromptAudio],
           check: Callable[[PromptAudio], None]) -> PromptAudio:
    """`wav`, the argument `name`, read (`read`: a path or an open file) and checked (`check`)."""
    if isinstance(wav, PromptAudio):
        return wav
    if isinstance(wav, str | Path) and not str(wav):
        hint = ", or zero_shot_spk_id naming an added speaker" if name == "prompt_wav" else ""
        raise UserError(f"{name} is empty; expected a recording's path{hint}")
    if not isinstance(wav, tuple | str | Path) and not hasattr(wav, "read"):
        raise UserError(f"{name} is {type(wav).__name__}; expected a path, an open binary file, "
                        "(samples, sample rate) or audio read already")
    if not isinstance(wav, tuple):
        return read(wav)
    if len(wav) != 2:
        raise UserError(f"{name} is a tuple of {len(wav)}; expected (samples, sample rate)")
    samples, sample_rate = wav
    if not np.issubdtype(np.asarray(samples).dtype, np.floating):  # scipy's wavfile reads int16 so
        raise UserError(f"{name} holds {np.asarray(samples).dtype} samples; expected floats in [-1, 1] "
                        "(int16 samples over 32768)")
    data = np.asarray(samples, dtype=np.float32)
    # more channels than samples: a (channels, N) array, which would read as a few samples of many channels
    if data.ndim not in (1, 2) or data.ndim == 2 and data.shape[1] > data.shape[0] \
            or not isinstance(sample_rate, int | np.integer):
        raise UserError(f"{name} is ({data.shape} array, {sample_rate!r}); expected (samples (N,) or "
                        "(N, channels), sample rate in Hz)")
    check_sample_rate(int(sample_rate), name)
    mono = data if data.ndim == 1 else data.mean(axis=1, dtype=np.float32)  # float32 mean, as upstream
    audio = PromptAudio(np.ascontiguousarray(mono), int(sample_rate), name)
    check(audio)
    return audio
