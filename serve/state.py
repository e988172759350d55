"""What every route reads: the engine, settings, session queue, speakers and metrics of one app."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from fastapi import Depends, Request

from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.speakers import Speaker

from .engine import Engine
from .metrics import ServerMetrics
from .queue import SessionQueue
from .settings import ServerSettings


class Speakers(Protocol):
    """Where the routes find and keep registered speakers: a `SpeakerRegistry` folder, or a store that
    replicas on several machines share (`cosyvoice_serve.ray_speakers`)."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> Speaker | None: ...

    def add(self, name: str, prompt_text: str, features: PromptFeatures) -> Speaker: ...

    def remove(self, name: str) -> bool: ...


@dataclass(frozen=True)
class ServerState:
    """One app's parts (`create_app` makes them)."""

    engine: Engine
    settings: ServerSettings
    sessions: SessionQueue
    speakers: Speakers
    metrics: ServerMetrics
    speaker_changes: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held from a speaker's write to its prefix job's submission or cancellation, so that a deletion and a
    registration of one name that overlap leave the job of the speaker that is registered, or none."""


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    state: ServerState = request.app.state.server
    return state


State = Annotated[ServerState, Depends(server_state)]
"""A route parameter of this type receives the app's `ServerState`."""
