"""Which torch wrapper exports which registered graph.

A wrapper is an `nn.Module` whose `forward` takes exactly its spec's inputs, in order, and returns
exactly its spec's outputs, in order; it is also the torch reference the exported graph is
validated against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

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


WRAPPERS: dict[str, Callable[[NetworkSource], nn.Module]] = {
    "llm": lambda n: LLMGraph(n.llm),
    "llm_prefill": lambda n: LLMGraph(n.llm),
    "llm_decode": lambda n: LLMDecodeGraph(n.llm),
    "flow_encoder": lambda n: FlowEncoderGraph(n.flow),
    "flow_estimator_cached": lambda n: FlowEstimatorCachedGraph(n.flow.decoder.estimator),
    "hift_f0": lambda n: HiFTF0Graph(n.hift),
    "hift_decoder": lambda n: HiFTDecoderGraph(n.hift),
}
"""Graph name (as in `cosyvoice_graphs.SPECS`) -> wrapper builder."""
