"""The model bundle's networks as `cosyvoice-export all` reads them: each loaded when first read, one
task's at a time, so that a full-size LLM and DiT are never in memory together."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from ..bundle.model_dir import ModelBundle
from ..config import ModelConfig
from ..manifest import NETWORKS
from ..memory import free_memory
from ..nets.flow import CausalMaskedDiffWithDiT
from ..nets.hift import CausalHiFTGenerator
from ..nets.llm import CosyVoice3LM

_Net = TypeVar("_Net", bound=nn.Module)


class LazyNetworks:
    """The bundle's networks (a `NetworkSource`), each loaded when first read, one task's at a time.

    A task (the tables, a graph's export and validation) reads the networks it needs; reading one that is
    not loaded first frees those the current task has not read, so that a full-size LLM and DiT are never
    in memory together, and `release` frees them all (a graph's, once it is traced). A run that reuses
    every graph loads only the LLM, for its tables.
    """

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self._loaded: dict[str, nn.Module] = {}
        self._read: set[str] = set()

    @property
    def config(self) -> ModelConfig:
        return self.bundle.config

    @property
    def llm(self) -> CosyVoice3LM:
        return self._get("llm", CosyVoice3LM)

    @property
    def flow(self) -> CausalMaskedDiffWithDiT:
        return self._get("flow", CausalMaskedDiffWithDiT)

    @property
    def hift(self) -> CausalHiFTGenerator:
        return self._get("hift", CausalHiFTGenerator)

    def next_task(self) -> None:
        """Begin a task: the networks read so far are freed when it reads one that is not loaded (and what
        the last task freed is returned to the system now)."""
        self._read.clear()
        free_memory()

    def release(self) -> None:
        """Free every loaded network (once nothing else refers to it); reading one loads it again."""
        self._loaded.clear()
        free_memory()

    def loaded(self) -> dict[str, nn.Module]:
        """The networks in memory, by name, in `NETWORKS` order."""
        return {n: self._loaded[n] for n in NETWORKS if n in self._loaded}

    def _get(self, name: str, kind: type[_Net]) -> _Net:
        self._read.add(name)
        if name not in self._loaded:
            for unread in set(self._loaded) - self._read:
                del self._loaded[unread]
            free_memory()  # the last task's modules, before the next network is read
            self._loaded[name] = self.bundle.load_network(name)
        net = self._loaded[name]
        assert isinstance(net, kind)
        return net


def checkpoints_of(wrapper: nn.Module, nets: LazyNetworks) -> list[str]:
    """The checkpoints whose tensors `wrapper` holds (all of them if it holds copies we cannot trace). It was
    built from loaded networks, and reading one loads it: the networks not loaded are not among them."""
    held = {t.data_ptr() for t in wrapper.state_dict().values() if t.numel()}
    used = [n for n, net in nets.loaded().items()
            if any(t.data_ptr() in held for t in net.state_dict().values() if t.numel())]
    return [nets.bundle.checkpoint_file(n) for n in (used or NETWORKS)]
