"""Replay golden cases on the torch-free runtime, through `CosyVoice3` as `cosyvoice-run` uses it.

The text is split and formatted by `CosyVoice3.segments`, each segment is spoken by `CosyVoice3.speak`
with a fresh sampler from the case's seed, and streaming cases run the LLM interleaved with the chunks.
One `CosyVoice3` per bundle and provider, and the prompts' features, are made once per `Runtime` and
shared by the cases that use them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
import soundfile as sf

from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle, file_sha256
from cosyvoice_runtime.bundle_source import choose_bundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.sampling import Sampling
from cosyvoice_runtime.segments import Segment, prompt_ids
from cosyvoice_runtime.synthesis import AudioChunk, Mode

from .cases import CASES_FILE, DEMO, FROM_BUNDLE, Cases, GoldenCase
from .errors import GoldenError
from .stats import GraphRecorder
from .store import UPDATE

ISA_FLAGS = frozenset({
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
    "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2",
})
"""CPU features onnxruntime's CPU kernels choose their code paths by (x86-64 and arm64 names)."""


def cpu_signature() -> str:
    """The machine and its kernel-relevant CPU features: two CPUs with the same signature run the same
    onnxruntime CPU kernels, so only they can be expected to give the same bits."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
            flags = set(line.partition(":")[2].split())
    except OSError:  # no /proc (macOS): the machine alone
        pass
    return " ".join([platform.machine(), *sorted(flags & ISA_FLAGS)])


def pcm16_sha256(samples: np.ndarray, sample_rate: int) -> str:
    """sha256 of `samples` as the 16-bit PCM that `cosyvoice-run` writes to its WAV (same conversion)."""
    buffer = io.BytesIO()
    sf.write(buffer, samples, sample_rate, subtype="PCM_16", format="RAW")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def chunk_record(segment: int, chunk: AudioChunk) -> dict[str, Any]:
    """`cosyvoice-run --chunks-out`'s record of a chunk without its timings, plus its PCM16 sha256."""
    record = chunk.record(segment)
    del record["timings"]
    return {**record, "pcm16_sha256": pcm16_sha256(chunk.samples, chunk.sample_rate)}


@dataclass(frozen=True)
class SegmentRun:
    """One segment as the runtime synthesised it."""

    speech_tokens: list[int]
    chunks: list[AudioChunk]
    """Offline: one final chunk with the whole segment."""

    @property
    def mel(self) -> np.ndarray:
        """The segment's generated mel (1, 80, frames), its chunks' concatenated."""
        return np.concatenate([c.mel for c in self.chunks], axis=2)


@dataclass(frozen=True)
class CaseRun:
    """One case as the runtime synthesised it."""

    segments: list[SegmentRun]
    graph_stats: dict[str, Any]
    seconds: float

    @property
    def audio(self) -> np.ndarray:
        """Every segment's samples, concatenated."""
        return np.concatenate([c.samples for s in self.segments for c in s.chunks])

    @property
    def mel(self) -> np.ndarray:
        """Every segment's generated mel (1, 80, frames), concatenated."""
        return np.concatenate([s.mel for s in self.segments], axis=2)


@dataclass(frozen=True)
class Prompt:
    """A case's prompt recording, resolved."""

    wav: Path
    text: str
    """The transcript (zero-shot), or ""."""
    features: PromptFeatures

    @property
    def wav_sha256(self) -> str:
        """The recording's sha256: a golden is stale once its prompt changed."""
        return file_sha256(self.wav)


class Runtime:
    """The runtime side of golden cases: which bundle each case uses, on which backend, opened once."""

    def __init__(self, cases: Cases, *, model: Path | None, provider: str | None, threads: int) -> None:
        """`model` replaces every case's bundle (see `open_bundle`); `provider` every case's provider;
        `threads` is onnxruntime's intra-op thread count."""
        self.cases = cases
        self.model, self.provider, self.threads = model, provider, threads
        self._bundles: dict[Path, RuntimeBundle] = {}
        self._voices: dict[tuple[Path, str], tuple[CosyVoice3, GraphRecorder]] = {}
        self._prompts: dict[tuple[Path, Path], PromptFeatures] = {}

    def update_command(self, *selection: str) -> str:
        """`cosyvoice-golden update` with this check's cases file and model, then `selection`: what a
        remedy tells to run, which must record the goldens this check reads."""
        words = [UPDATE]
        if self.cases.path.resolve() != CASES_FILE.resolve():
            words.append(f"--cases {self.cases.path}")
        if self.model is not None:
            words.append(f"--model {self.model}")
        return " ".join([*words, *selection])

    def provider_of(self, case: GoldenCase) -> str:
        """The backend `case` runs on: `provider`, else the case's own."""
        return self.provider or case.provider

    def bundle(self, case: GoldenCase) -> RuntimeBundle:
        """The runtime bundle `case` runs on."""
        return self.open_bundle(case.bundle)

    def open_bundle(self, value: str) -> RuntimeBundle:
        """The runtime bundle a cases file names (`DEMO` or a folder), unless `model` replaces it (a
        runtime bundle, or a model bundle exported on first use as `cosyvoice-run --model` does)."""
        if self.model is not None:
            root = self._model_root
        elif value == DEMO:
            root = DEMO_BUNDLE
        else:
            root = self.cases.resolve(value)
        root = root.resolve()
        if root not in self._bundles:
            # every file against its sha256: a damaged graph is one line, not a misleading token mismatch
            self._bundles[root] = RuntimeBundle.open(root, verify=True)
        return self._bundles[root]

    @functools.cached_property
    def _model_root(self) -> Path:
        assert self.model is not None
        return choose_bundle(self.model).path

    def voice(self, case: GoldenCase) -> tuple[CosyVoice3, GraphRecorder]:
        """The case's bundle opened on its provider, with a recorder of its graphs' outputs."""
        bundle, provider = self.bundle(case), self.provider_of(case)
        key = (bundle.root, provider)
        if key not in self._voices:
            voice = CosyVoice3(bundle, provider=provider, threads=self.threads)
            self._voices[key] = voice, GraphRecorder(voice.synth)
        return self._voices[key]

    def prompt(self, case: GoldenCase) -> Prompt:
        """The case's prompt recording, transcript and features."""
        bundle = self.bundle(case)
        default = bundle.default_prompt()
        if FROM_BUNDLE in (case.prompt_wav, case.prompt_text) and default is None:
            raise GoldenError(f"case {case.name}: {bundle.root} carries no prompt of its own; give the "
                              "case a prompt_wav and prompt_text")
        own = default is not None and case.prompt_wav == FROM_BUNDLE
        wav = default[0] if own and default else self.cases.resolve(case.prompt_wav)
        text = ""
        if case.mode is Mode.ZERO_SHOT:
            text = default[1] if default and case.prompt_text == FROM_BUNDLE else case.prompt_text
        key = (bundle.root, wav.resolve())
        if key not in self._prompts:
            self._prompts[key] = self.voice(case)[0].prompt_features(wav)
        return Prompt(wav, text, self._prompts[key])

    def segments(self, case: GoldenCase) -> list[Segment]:
        """The case's text, split and formatted for its mode as `cosyvoice-run` does; text in pieces: one
        segment, each piece tokenised on its own (as `speak_text_stream` reads them)."""
        voice = self.voice(case)[0]
        try:
            if case.pieces is not None:
                prompt = prompt_ids(case.mode, voice.tokenizer, prompt_text=self.prompt(case).text,
                                    instruct=case.instruct)
                ids = [i for p in case.pieces for i in voice.tokenizer.encode(p)]
                return [Segment(case.text, ids, prompt)]
            return voice.segments(case.mode, case.text, prompt_text=self.prompt(case).text,
                                  instruct=case.instruct)
        except UserError as e:
            raise GoldenError(f"case {case.name}: {e}") from None

    def run(self, case: GoldenCase) -> CaseRun:
        """Synthesise `case`: every segment with a fresh sampler, offline or streamed."""
        voice, recorder = self.voice(case)
        prompt, pieces = self.prompt(case), self.segments(case)
        sampling = Sampling(case.sampling, case.seed)
        start = time.perf_counter()
        done = []
        with recorder.record() as stats:
            for piece in pieces:
                if case.pieces is not None:
                    speech = voice.speak_text_stream(iter(case.pieces), prompt.features, case.mode,
                                                     prompt_text=prompt.text, instruct=case.instruct,
                                                     stream=case.stream, speed=case.speed, sampling=sampling,
                                                     policy=case.chunk_policy, max_tokens=case.max_tokens)
                else:
                    speech = voice.speak(piece, prompt.features, case.mode, stream=case.stream,
                                         speed=case.speed, sampling=sampling, policy=case.chunk_policy,
                                         max_tokens=case.max_tokens)
                chunks = list(speech)
                done.append(SegmentRun(list(speech.speech_tokens), chunks))
        return CaseRun(done, stats.to_json(), time.perf_counter() - start)

    def close(self) -> None:
        """Release every bundle's graphs."""
        for voice, _ in self._voices.values():
            voice.close()
        self._voices.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
