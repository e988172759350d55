"""Which web pages may open the server's WebSockets: the server's own, and those `--cors-origin` names.

Browsers apply no CORS to WebSockets: a page from any site may open one to the server (a local one
included) and read what it sends, audio in any registered speaker's voice. So a handshake that carries
an `Origin` (every browser's does) is accepted only when that origin's host is the one the request was
sent to (its `Host`) or is listed in `--cors-origin` (`*`: any); else it is refused before it is accepted
(HTTP 403, close code 1008).
Clients other than browsers send no `Origin` and are not affected. Behind a proxy that rewrites `Host`,
the public origin of a page must be named with `--cors-origin`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)
ANY = "*"


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """Whether a WebSocket handshake from a page of `origin`, sent to `host`, is accepted."""
    if origin is None:
        return True
    allowed = tuple(allowed)
    if ANY in allowed or origin in allowed:
        return True
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


def refusal(origin: str) -> str:
    """The close reason of a refused handshake (under the 123 bytes a close frame's reason may hold)."""
    return f"origin {origin[:32]} not allowed; name it with --cors-origin"


class SameOriginWebSockets:
    """ASGI middleware: a WebSocket handshake whose `Origin` is not allowed (`origin_allowed`) is closed
    before it is accepted; HTTP passes through (CORS answers it)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app, self.allowed = app, tuple(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            origin = headers.get("origin")
            if origin is not None and not origin_allowed(origin, headers.get("host"), self.allowed):
                log.info("%s: refused a WebSocket from origin %r", scope["path"], origin)
                await send({"type": "websocket.close", "code": 1008, "reason": refusal(origin)})
                return
        await self.app(scope, receive, send)
