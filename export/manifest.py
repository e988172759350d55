"""The state-dict layout our networks expect, in upstream's manifest TSV format.

One line per `state_dict()` entry, in order: ``key<TAB>shape as a JSON list<TAB>dtype``. The networks
are built on the meta device, so even the full-size table costs no weight memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

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


def build_network(cfg: ModelConfig, name: str) -> nn.Module:
    """Construct one network (`llm`, `flow` or `hift`) on the current default device."""
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


def parse_manifest_tsv(text: str) -> list[Entry]:
    """Read a manifest TSV (ours or upstream's) back into entries."""
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"line {lineno}: expected 3 tab-separated fields, found {len(parts)}")
        entries.append(Entry(parts[0], tuple(json.loads(parts[1])), parts[2]))
    return entries
