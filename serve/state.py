"""What every route reads: the engine, settings, session queue, speakers and metrics of one app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from cosyvoice_runtime.speakers import SpeakerRegistry

from .engine import Engine
from .metrics import ServerMetrics
from .queue import SessionQueue
from .settings import ServerSettings


@dataclass(frozen=True)
class ServerState:
    """One app's parts (`create_app` makes them)."""

    engine: Engine
    settings: ServerSettings
    sessions: SessionQueue
    speakers: SpeakerRegistry
    metrics: ServerMetrics


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    state: ServerState = request.app.state.server
    return state


State = Annotated[ServerState, Depends(server_state)]
"""A route parameter of this type receives the app's `ServerState`."""
