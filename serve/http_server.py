"""The HTTP server of `cosyvoice-serve`: uvicorn's, stopping as a deployment's signal needs it to.

On SIGINT or SIGTERM uvicorn stops taking connections and waits for the responses in flight. Sessions
still waiting for a slot would run to their end first (a queue of 8 behind a 300 s timeout: minutes,
past `docker stop`'s 10 s and its SIGKILL); here they are refused at once (503, "the server is
stopping"), and the running ones get `ServerSettings.shutdown_grace` seconds, after which uvicorn cancels
them (their streams end unfinished, as a client that left would end them).
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from .queue import SessionQueue
from .settings import ServerSettings

UVICORN: dict[str, Any] = {"log_level": "info", "http": "h11"}
"""uvicorn's settings. h11: it holds at most 16 KiB of a request's head that has not finished arriving (a
400 past it), where httptools, uvicorn's choice where installed, reads a head whole (a header of 256 MiB:
300 MB of the server's memory, kept)."""


class HttpServer(uvicorn.Server):
    """uvicorn's server whose shutdown first refuses the sessions still waiting (`SessionQueue.stop`)."""

    def __init__(self, config: uvicorn.Config, sessions: SessionQueue) -> None:
        super().__init__(config)
        self.sessions = sessions

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.sessions.stop()
        await super().shutdown(sockets)


def http_server(app: FastAPI, settings: ServerSettings, host: str, port: int) -> HttpServer:
    """The server of `app` (`create_app`'s, whose session queue it stops) on `host:port`."""
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=settings.shutdown_grace,
                            **UVICORN)
    return HttpServer(config, app.state.server.sessions)
