"""The torch side of each registered graph (`ExportRecipe`): the wrapper that exports it and, for a graph
with decode gates, the sequence they are measured on. Its plain-data facts are `cosyvoice_graphs.recipes`.

A wrapper is an `nn.Module` whose `forward` takes exactly its spec's inputs, in order, and returns
exactly its spec's outputs, in order; it is also the torch reference the exported graph is
validated against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch import nn

from cosyvoice_graphs import DIT, FLOW_ENCODER, HIFT_DECODER, HIFT_F0, LLM, LLM_DECODE, LLM_PREFILL

from ..config import ModelConfig
from ..nets.flow import CausalMaskedDiffWithDiT
from ..nets.hift import CausalHiFTGenerator
from ..nets.llm import CosyVoice3LM
from .wrappers.flow import FlowEncoderGraph, FlowEstimatorCachedGraph
from .wrappers.hift import HiFTDecoderGraph, HiFTF0Graph
from .wrappers.llm import LLMDecodeGraph, LLMGraph


class NetworkSource(Protocol):
    """A bundle's config and its three networks, by attribute: `Networks`, or the exporter's, which loads a
    network when it is first read."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def llm(self) -> CosyVoice3LM: ...
    @property
    def flow(self) -> CausalMaskedDiffWithDiT: ...
    @property
    def hift(self) -> CausalHiFTGenerator: ...


@dataclass(frozen=True)
class Networks:
    """The three loaded networks of one bundle (eval mode, float32)."""

    config: ModelConfig
    llm: CosyVoice3LM
    flow: CausalMaskedDiffWithDiT
    hift: CausalHiFTGenerator


PROMPT_TEXT_IDS = 30
"""Text positions of the decode gates' prefill: a sentence's worth of ids."""
PROMPT_SPEECH_IDS = 150
"""Prompt speech positions of the decode gates' prefill (6 s at 25 tokens/s): with 200 steps the cache grows
from 182 to 382 positions, where decoding spends its time."""
SEED = 0


@dataclass(frozen=True)
class DecodeSequence:
    """What one teacher-forced run of decode gates (`decode_gates`) feeds: the prefill, and the rows fed back
    for a chosen id."""

    prefill: np.ndarray
    """(1, T, C) float32: the first call's input."""
    rows: np.ndarray
    """(ids, C) float32: a decode call's input is row `id` of this table, `id` torch's greedy choice."""
    choices: int
    """Greedy ids are chosen among the first `choices` rows (the speech codebook: no stop id)."""


def llm_sequence(nets: NetworkSource) -> DecodeSequence:
    """`[E_speech[sos], E_text(30 ids), E_speech[task_id], E_speech(150 ids)]`, ids drawn with `SEED`; fed
    back: speech-table rows, greedy over the codebook."""
    lm, cfg = nets.llm, nets.llm.cfg
    rng = np.random.default_rng(SEED)
    text = lm.backbone.embed_tokens.weight.detach().numpy()
    speech = lm.speech_embedding.weight.detach().numpy()
    text_ids = rng.integers(0, text.shape[0], PROMPT_TEXT_IDS)
    speech_ids = rng.integers(0, cfg.speech_token_size, PROMPT_SPEECH_IDS)
    prefill = np.concatenate([speech[[cfg.sos]], text[text_ids], speech[[cfg.task_id]], speech[speech_ids]])
    return DecodeSequence(prefill[None].astype(np.float32), speech.astype(np.float32), cfg.speech_token_size)


class WrapperFactory(Protocol):
    """Builds a graph's wrapper from a bundle's networks. `onnxruntime_only`: its export may be written for
    onnxruntime alone (`Precision.onnxruntime_only`); the wrapper's eager torch computes the same either
    way."""

    def __call__(self, nets: NetworkSource, *, onnxruntime_only: bool = False) -> nn.Module: ...


def _dit(nets: NetworkSource, *, onnxruntime_only: bool = False) -> nn.Module:
    return FlowEstimatorCachedGraph(nets.flow.decoder.estimator, onnxruntime_only=onnxruntime_only)


def _llm(nets: NetworkSource, *, onnxruntime_only: bool = False) -> nn.Module:
    return LLMGraph(nets.llm, onnxruntime_only=onnxruntime_only)


def _plain(build: Callable[[NetworkSource], nn.Module]) -> WrapperFactory:
    """A wrapper whose export is the same for every precision."""
    def factory(nets: NetworkSource, *, onnxruntime_only: bool = False) -> nn.Module:
        return build(nets)
    return factory


@dataclass(frozen=True)
class ExportRecipe:
    """The torch side of one graph."""

    wrapper: WrapperFactory
    """Builds the graph's wrapper from a bundle's networks."""
    sequence: Callable[[NetworkSource], DecodeSequence] | None = None
    """Builds the sequence its decode gates are measured on (every spec with `decode_gates` has one)."""


EXPORT_RECIPES: dict[str, ExportRecipe] = {
    LLM: ExportRecipe(_llm, llm_sequence),
    FLOW_ENCODER: ExportRecipe(_plain(lambda n: FlowEncoderGraph(n.flow))),
    DIT: ExportRecipe(_dit),
    HIFT_F0: ExportRecipe(_plain(lambda n: HiFTF0Graph(n.hift))),
    HIFT_DECODER: ExportRecipe(_plain(lambda n: HiFTDecoderGraph(n.hift))),
    LLM_PREFILL: ExportRecipe(_llm, llm_sequence),
    LLM_DECODE: ExportRecipe(_plain(lambda n: LLMDecodeGraph(n.llm)), llm_sequence),
}
"""Graph name (as in `cosyvoice_graphs.SPECS` and `OPTIONAL_SPECS`) -> its torch side."""
