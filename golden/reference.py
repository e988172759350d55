"""The torch side of `cosyvoice-golden update`: expectations from the torch reference pipeline.

Offline segments are `ReferencePipeline`'s synthesis; streaming ones are upstream's CosyVoice3 streaming
over the torch networks (block-causal flow over each token prefix, HiFT re-run over the accumulated mel,
a full-attention finalizing last chunk) on the chunk schedule of the case's `ChunkPolicy`. Graph goldens
hold each spec's sample inputs and its torch wrapper's outputs. This module imports torch and
`cosyvoice_export`; `check` never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cosyvoice_export.bundle.errors import BundleError
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.bundle.tiny import write_bundle
from cosyvoice_export.onnx.graphs import EXPORT_RECIPES, Networks
from cosyvoice_export.onnx.validate import case_label, run_torch
from cosyvoice_export.reference.frontend import TorchPromptFeatures
from cosyvoice_export.reference.llm_decode import (
    TorchGreedySampler,
    TorchRasSampler,
    TorchSampler,
    generate_speech_tokens,
    generate_speech_tokens_bistream,
)
from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.demo import DEMO_SEED
from cosyvoice_runtime.segments import Segment

from .cases import GoldenCase
from .errors import GoldenError
from .store import GraphCaseGolden, GraphGolden, fingerprint


def demo_model(folder: Path) -> Path:
    """The model bundle the demo runtime bundle is exported from (`cosyvoice-export tiny-bundle`, seed
    `DEMO_SEED`), written into `folder`."""
    return write_bundle(folder / "model", size="tiny", seed=DEMO_SEED, progress=False)


def open_pipeline(model_dir: Path, bundle: RuntimeBundle) -> ReferencePipeline:
    """The torch reference over `model_dir`, which must be the model `bundle` was exported from (every
    source file the bundle's manifest names, with its sha256), its LLM read from the bundle's checkpoint.

    torch runs on one thread from here on: its float rounding depends on the thread count, and a golden
    recorded again must come out the same.
    """
    torch.set_num_threads(1)
    try:
        return ReferencePipeline(ModelBundle.open_exported_from(model_dir, bundle))
    except BundleError as e:
        raise GoldenError(str(e)) from None


@dataclass(frozen=True)
class ReferenceSegment:
    """One segment as the torch reference synthesises it."""

    speech_tokens: list[int]
    chunks: list[tuple[tuple[int, int], np.ndarray]]
    """(token range, float32 samples) per chunk; offline: one chunk."""
    mel: np.ndarray
    """float32 (1, 80, frames): the generated mel the vocoder read (a stream's chunks' accumulated)."""


def _sampler(pipe: ReferencePipeline, case: GoldenCase) -> TorchSampler:
    if case.sampling == "greedy":
        return TorchGreedySampler()
    return TorchRasSampler(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(case.seed)))


def reference_segments(pipe: ReferencePipeline, case: GoldenCase, pieces: list[Segment], prompt_wav: Path,
                       prompt_text: str) -> list[ReferenceSegment]:
    """Synthesise `case`'s segments (as `cosyvoice-run` splits them) with the torch reference: each with a
    fresh sampler, offline or streamed."""
    prompt = pipe.prompt_features(prompt_wav)
    out = []
    for piece in pieces:
        inputs = pipe.llm_inputs(case.mode, "" if case.pieces else piece.text, prompt,
                                 prompt_text=prompt_text, instruct_text=case.instruct)
        text_ids = ([i for p in case.pieces for i in pipe.tokenizer.encode(p)] if case.pieces
                    else inputs.text_ids)  # pieces: each tokenised on its own, as upstream's bistream
        if (text_ids, inputs.prompt_text_ids) != (piece.text_ids, piece.prompt_text_ids):
            raise GoldenError(f"case {case.name}: the runtime's and the reference's tokenizers disagree on "
                              f"{piece.text!r}")
        if case.pieces:
            tokens = generate_speech_tokens_bistream(pipe.llm, text_ids, inputs.prompt_text_ids,
                                                     inputs.prompt_speech_tokens, pipe.eop_id,
                                                     _sampler(pipe, case), max_tokens=case.max_tokens)
        else:
            tokens = generate_speech_tokens(pipe.llm, text_ids, inputs.prompt_text_ids,
                                            inputs.prompt_speech_tokens, pipe.eop_id, _sampler(pipe, case),
                                            max_tokens=case.max_tokens)
        if case.chunk_policy is None:
            mel, audio = pipe.token2wav(tokens, prompt, speed=case.speed)
            out.append(ReferenceSegment(tokens, [((0, len(tokens)), audio)], mel.numpy()))
        else:
            out.append(ReferenceSegment(tokens, *stream(pipe, tokens, prompt, case.chunk_policy)))
    return out


def stream(pipe: ReferencePipeline, tokens: list[int], prompt: TorchPromptFeatures, policy: ChunkPolicy
           ) -> tuple[list[tuple[tuple[int, int], np.ndarray]], np.ndarray]:
    """Upstream's CosyVoice3 streaming token2wav over the torch networks for a finished token list, on
    the runtime's schedule: chunk k covers hop_k tokens and fires once hop_k + lookahead tokens follow
    the previous chunk (all tokens are known here); the remaining tokens form the final chunk. Returns the
    chunks and the accumulated mel."""
    hops = policy.hops(prompt.speech_tokens.shape[1])
    plan: list[int] = []
    offset, hop = 0, next(hops)
    while len(tokens) - offset >= hop + policy.lookahead:
        plan.append(hop)
        offset, hop = offset + hop, next(hops)
    return pipe.token2wav_stream(tokens, prompt, plan, policy.lookahead)


def graph_golden(pipe: ReferencePipeline, bundle: RuntimeBundle, graph: str, indices: tuple[int, ...]
                 ) -> GraphGolden:
    """Graph `graph`'s golden bundle: its spec's validation cases `indices`, their sample inputs (seed 0,
    as the exporter validates) and the torch wrapper's outputs."""
    spec = bundle.specs[graph]
    bad = [i for i in indices if not 0 <= i < len(spec.validate)]
    if bad:
        raise GoldenError(f"graph {graph}: its spec has validation cases 0..{len(spec.validate) - 1}, "
                          f"not {bad[0]}")
    wrapper = EXPORT_RECIPES[graph].wrapper(Networks(pipe.config, pipe.llm, pipe.flow, pipe.hift))
    cases = []
    for i in indices:
        case = spec.validate[i]
        feeds = spec.sample_inputs(case)
        cases.append(GraphCaseGolden(i, case_label(case), feeds, run_torch(wrapper, spec, feeds)))
    return GraphGolden(graph, spec.version, fingerprint(bundle), tuple(cases))
