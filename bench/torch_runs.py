"""The torch reference's side (`--vs-torch`): `ReferencePipeline`, eager, float32, on the CPU with as
many torch threads as onnxruntime gets, timed from outside through `CallLog`.

The reference has no streaming path. Its first chunk is what upstream's stream computes before its first
yield, back to back: the LLM decodes the first hop plus look-ahead (the runtime's `ChunkPolicy`), the
block-causal flow runs over those tokens (non-final), then the non-final HiFT. Its streaming RTF is not
measured.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
import torch

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.reference.frontend import TorchPromptFeatures
from cosyvoice_export.reference.llm_decode import TorchRasSampler, generate_speech_tokens
from cosyvoice_export.reference.pipeline import LLMInputs, ReferencePipeline
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.synthesis import Mode

from .backend import FirstChunk, OfflineRun
from .cases import Case
from .measure import CallLog, llm_figures, mean, prefill_length


class TorchBackend:
    """The torch reference pipeline of a model directory (the runtime bundle's source)."""

    name = "torch"

    def __init__(self, model_dir: Path, llm_checkpoint: str, *, threads: int, prompt_text: str,
                 seed: int) -> None:
        """Load the three networks, the LLM from `llm_checkpoint` (the runtime bundle's: its manifest's
        `llm_checkpoint`); torch runs on `threads` threads until `close`."""
        start = time.perf_counter()
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.pipe = ReferencePipeline(ModelBundle.open(model_dir, llm_checkpoint))
        self.prompt_text, self.seed = prompt_text, seed
        self.policy = ChunkPolicy(lookahead=self.pipe.config.flow.pre_lookahead_len)
        self._log = CallLog()
        self.load_s = time.perf_counter() - start

    def prompt_features(self, wav: Path) -> TorchPromptFeatures:
        return self.pipe.prompt_features(wav)

    def _inputs(self, case: Case, prompt: TorchPromptFeatures) -> LLMInputs:
        """The reference's front end: tokenisation and the zero-shot prompt format (no normalisation)."""
        return self.pipe.llm_inputs(Mode.ZERO_SHOT, case.text, prompt, prompt_text=self.prompt_text)

    def _decode(self, inputs: LLMInputs, steps: int) -> list[int]:
        sampler = TorchRasSampler(self.pipe.config.llm.sampling,
                                  np.random.Generator(np.random.PCG64(self.seed)))
        return generate_speech_tokens(self.pipe.llm, inputs.text_ids, inputs.prompt_text_ids,
                                      inputs.prompt_speech_tokens, self.pipe.eop_id, sampler,
                                      max_tokens=steps, ignore_stop=True)

    def forget_prompts(self) -> None:
        """The reference pipeline keeps nothing per prompt: every stream runs the flow from frame 0."""

    @torch.no_grad()
    def first_chunk(self, case: Case, prompt: TorchPromptFeatures) -> FirstChunk:
        start = time.perf_counter()
        pipe = self.pipe
        inputs = self._inputs(case, prompt)
        needed = next(self.policy.hops(prompt.speech_tokens.shape[1])) + self.policy.lookahead
        finalize = case.tokens < needed  # the stream's only chunk is its final one: the offline path
        llm_start = time.perf_counter()
        tokens = torch.tensor([self._decode(inputs, case.tokens if finalize else needed)])  # (1, N)
        flow_start = time.perf_counter()
        mel = pipe.flow.inference(tokens, prompt.speech_tokens, prompt.mel, prompt.embedding,  # (1, 80, T)
                                  pipe.noise.flow_noise, streaming=not finalize, finalize=finalize)
        vocoder_start = time.perf_counter()
        audio = pipe.hift.inference(mel, pipe.noise.sine_waves, finalize=finalize)[0].numpy()
        end = time.perf_counter()
        return FirstChunk(end - start, len(audio) / pipe.config.sample_rate, flow_start - llm_start,
                          vocoder_start - flow_start, end - vocoder_start)

    def stream(self, case: Case, prompt: TorchPromptFeatures) -> None:
        """The reference has no streaming path."""
        return None

    def offline(self, case: Case, prompt: TorchPromptFeatures) -> OfflineRun:
        start = time.perf_counter()
        inputs = self._inputs(case, prompt)
        front_end_s = time.perf_counter() - start
        pipe, log = self.pipe, self._log
        targets = {"llm": (pipe.llm, "forward_step"), "estimator": (pipe.flow.decoder.estimator, "forward"),
                   "flow": (pipe.flow, "inference"), "hift": (pipe.hift, "inference")}
        with log.wrap(targets):
            llm_start = time.perf_counter()
            tokens = self._decode(inputs, case.tokens)
            llm_s = time.perf_counter() - llm_start
            _, audio = pipe.token2wav(tokens, prompt)
        seconds = time.perf_counter() - start
        audio_s = len(audio) / pipe.config.sample_rate
        figures = {
            "front_end_s": front_end_s,
            "llm_prefill_len": prefill_length(inputs.text_ids, inputs.prompt_text_ids,
                                              len(inputs.prompt_speech_tokens)),
            **llm_figures(llm_s, log.seconds("llm")),
            "speech_tokens": len(tokens),
            "flow_s": sum(log.seconds("flow")),
            "flow_per_step_s": mean(log.seconds("estimator")),
            "hift_s": sum(log.seconds("hift")),
            "audio_s": audio_s,
            "rtf_offline": seconds / audio_s,
        }
        return OfflineRun(figures, tokens)

    def close(self) -> None:
        del self.pipe
        gc.collect()
        torch.set_num_threads(self._threads_before)
