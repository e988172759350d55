"""The state-dict layout our networks expect, in upstream's manifest TSV format.

One line per `state_dict()` entry, in order: ``key<TAB>shape as a JSON list<TAB>dtype``. The networks
are built on the meta device, so even the full-size table costs no weight memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .config import ModelConfig
from .nets.flow import CausalMaskedDiffWithDiT
from .nets.hift import CausalHiFTGenerator
from .nets.llm import CosyVoice3LM

NETWORKS = ("llm", "flow", "hift")
"""Checkpoint files of a bundle, by stem (`llm.pt`, ...)."""


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: str

    def tsv(self) -> str:
        return f"{self.key}\t{json.dumps(list(self.shape))}\t{self.dtype}"


_RANDOM_INITS = frozenset({
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
    nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.orthogonal_,
    torch.Tensor.uniform_, torch.Tensor.normal_})
"""The draws of the modules' initial weights (`reset_parameters`)."""


class _NoRandomInit(TorchFunctionMode):
    """Modules built in it keep their weights' memory as allocated: for weights a checkpoint then loads."""

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_network(cfg: ModelConfig, name: str, *, random_init: bool = True) -> nn.Module:
    """Construct one network (`llm`, `flow` or `hift`) on the current default device. Without
    `random_init` its weights are left as allocated (not drawn: 3 s of the full-size LLM's construction on
    a 2-core AMD EPYC Zen 4 with AVX-512), for a strict load of every one of them
    (`ModelBundle.load_network`)."""
    if not random_init:
        with _NoRandomInit():
            return build_network(cfg, name)
    if name == "llm":
        return CosyVoice3LM(cfg.llm)
    if name == "flow":
        return CausalMaskedDiffWithDiT(cfg.flow)
    if name == "hift":
        return CausalHiFTGenerator(cfg.hift)
    raise ValueError(f"unknown network {name!r}; expected one of {', '.join(NETWORKS)}")


def expected_entries(cfg: ModelConfig, name: str) -> list[Entry]:
    """The state-dict entries of network `name`, built without allocating weights."""
    with torch.device("meta"):
        net = build_network(cfg, name)
    return [
        Entry(key, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for key, t in net.state_dict(keep_vars=True).items()
    ]


def manifest_tsv(cfg: ModelConfig, name: str) -> str:
    """The manifest of network `name` as TSV text (trailing newline included)."""
    return "".join(e.tsv() + "\n" for e in expected_entries(cfg, name))
