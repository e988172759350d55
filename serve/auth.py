"""The optional API key (`--api-key`, `$COSYVOICE_API_KEY`): one check, applied to HTTP and to gRPC.

A client sends the key as `Authorization: Bearer <key>` or as `X-API-Key: <key>` (HTTP headers, or gRPC
metadata of the same names in lower case). Keys are compared with `hmac.compare_digest`, so the time a
comparison takes does not reveal how much of a guess was right. HTTP answers a missing or wrong key with
401 and the server's JSON error body; gRPC with UNAUTHENTICATED. `GET /health` stays open (load
balancers probe it) and so does the web page at `/`, which holds no data and sends the key its user
types with every API call. The key is never logged: nothing here formats it, and `ServerSettings` leaves
it out of its repr.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

AUTHORIZATION = "authorization"
API_KEY_HEADER = "x-api-key"
BEARER = "bearer"
OPEN_PATHS = frozenset({"/health", "/"})
"""HTTP paths served without the key: the health probe and the web page (static, no data)."""
MISSING_KEY = ("missing or wrong API key: send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")


def presented_keys(headers: Iterable[tuple[str, str]]) -> list[str]:
    """The keys a request carries: the `Authorization: Bearer` credential and `X-API-Key` values."""
    keys = []
    for name, value in headers:
        name = name.lower()
        if name == API_KEY_HEADER:
            keys.append(value.strip())
        elif name == AUTHORIZATION:
            scheme, _, credential = value.strip().partition(" ")
            if scheme.lower() == BEARER:
                keys.append(credential.strip())
    return keys


def key_matches(expected: str, headers: Iterable[tuple[str, str]]) -> bool:
    """Whether any key the request carries is `expected` (each compared in constant time)."""
    wanted = expected.encode()
    # Every presented key is compared, so the answer's timing does not tell which header was tried.
    matches = [hmac.compare_digest(key.encode(), wanted) for key in presented_keys(headers)]
    return any(matches)


class RequireApiKey:
    """ASGI middleware: every HTTP request but those to `OPEN_PATHS` must carry `key`, else 401, and every
    WebSocket handshake, else it is refused (closed before it is accepted: HTTP 403, close code 1008).

    It answers before the app reads the body, so an unauthenticated upload is never parsed.
    """

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        if key_matches(self.key, headers):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": MISSING_KEY[:120]})
            return
        response = error_response(401, MISSING_KEY, headers={"WWW-Authenticate": "Bearer"},
                                  path=scope["path"])
        await response(scope, receive, send)


class GrpcApiKey(grpc.aio.ServerInterceptor):
    """gRPC server interceptor: a call whose metadata lacks the key is answered UNAUTHENTICATED."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        metadata = [(key, value.decode("latin-1") if isinstance(value, bytes) else value)
                    for key, value in handler_call_details.invocation_metadata or ()]
        handler = await continuation(handler_call_details)
        if handler is None or key_matches(self.key, metadata):
            return handler
        return _refusal(handler)


async def _unauthenticated(_: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (unary or streaming, each way) that refuses the call."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(_unauthenticated, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
