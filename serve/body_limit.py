"""The request body limit (`--max-body-mib`): a larger body is refused with 413 before the server holds it.

A request whose `Content-Length` is over the limit is answered before the app runs, none of its body read.
A body without one (chunked) is counted as it arrives, and the read that passes the limit fails, so at
most the limit and one chunk are ever taken in. Either answer says `Connection: close`: the server then
closes the connection rather than read and discard the rest of the body to keep it open.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

CLOSE = {"Connection": "close"}


class BodyTooLarge(HTTPException):
    """A body read past the limit: raised by the app's `receive`, answered 413 by the error handlers."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"body: more than {limit} bytes; the limit is {limit} bytes", headers=CLOSE)


class LimitBody:
    """ASGI middleware: HTTP request bodies of at most `limit` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.limit:
            response = error_response(413, f"body: {int(declared)} bytes; the limit is {self.limit} bytes",
                                      headers=CLOSE, path=scope["path"])
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)
