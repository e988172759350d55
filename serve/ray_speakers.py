"""Speakers shared by replicas on machines without a shared filesystem: one named Ray actor holds them.

The actor (`SpeakerStore`) wraps a `SpeakerRegistry` over a folder on the head node's disk, so a
speaker's prompt features, computed once by the replica that registered it, are kept in one place and
survive the actor's restart (Ray restarts it there) and redeploys of the app (it is detached). Being one
actor, it runs one call at a time: writes never race. Replicas reach it through `ActorSpeakers`, the
routes' `Speakers`. Ray's object store alone would not do: an object belongs to the process that put it
and is lost with it, and it cannot be found by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.speakers import Speaker, SpeakerRegistry

NAMESPACE = "cosyvoice"
"""The Ray namespace of the store actor."""
HEAD_NODE = "node:__internal_head__"
"""A resource only the cluster's head node has (Ray's own state actors are placed by it)."""


class SpeakerStore:
    """The store actor: a speaker registry folder on its node, behind `Speakers`' four calls."""

    def __init__(self, root: str, fingerprint: str) -> None:
        self.registry = SpeakerRegistry(Path(root), fingerprint)
        self.registry.tidy()

    def names(self) -> list[str]:
        return self.registry.names()

    def get(self, name: str) -> Speaker | None:
        return self.registry.get(name)

    def add(self, name: str, prompt_text: str, features: PromptFeatures) -> Speaker:
        return self.registry.add(name, prompt_text, features)

    def remove(self, name: str) -> bool:
        return self.registry.remove(name)


class ActorSpeakers:
    """`Speakers` kept by the store actor: every call is one round trip to it (a millisecond on one
    machine; a synthesis takes seconds)."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        """The store of speakers made with front end `fingerprint`, started on the head node with its folder
        at `root` (a path on that node) by the first replica that asks."""
        # calls made while Ray restarts it are retried there, rather than failing their requests
        store = ray.remote(SpeakerStore).options(
            name=store_name(fingerprint), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            max_restarts=-1, max_task_retries=-1, num_cpus=0, resources={HEAD_NODE: 0.001})
        # Any: Ray's stubs type a handle's methods as the class's, not as remote calls
        self._store: Any = store.remote(str(root), fingerprint)

    def names(self) -> list[str]:
        names: list[str] = ray.get(self._store.names.remote())
        return names

    def get(self, name: str) -> Speaker | None:
        speaker: Speaker | None = ray.get(self._store.get.remote(name))
        return speaker

    def add(self, name: str, prompt_text: str, features: PromptFeatures) -> Speaker:
        speaker: Speaker = ray.get(self._store.add.remote(name, prompt_text, features))
        return speaker

    def remove(self, name: str) -> bool:
        removed: bool = ray.get(self._store.remove.remote(name))
        return removed


def store_name(fingerprint: str) -> str:
    """The store actor's name: one per front end, so that apps over different bundles keep apart."""
    return f"cosyvoice-speakers-{fingerprint}"
