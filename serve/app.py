"""The FastAPI app: upstream's, the bridge's and OpenAI-style routes and the web page over one `Engine`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_runtime.speakers import SpeakerRegistry

from . import routes_bridge, routes_openai, routes_page, routes_speakers, routes_stream, routes_upstream
from .auth import RequireApiKey
from .body_limit import LimitBody
from .engine import Engine
from .errors import CANCELLED, OUTCOME, AnswerUnexpected, install_error_handlers
from .metrics import ServerMetrics
from .queue import SessionQueue
from .responses import SYNTHESIS_TAG
from .settings import ServerSettings
from .speaker_sync import keep_following
from .state import ServerState, Speakers
from .ws_origin import SameOriginWebSockets

ROUTERS = tuple(module.router for module in (routes_upstream, routes_bridge, routes_openai, routes_stream,
                                             routes_speakers, routes_page))
"""Every route of the app (FastAPI's docs and schema aside)."""
CORS_HEADERS = ("Authorization", "X-API-Key", "Content-Type")
"""Request headers a cross-origin page may send: the API key's two and the body's type."""
CORS_EXPOSED = ("X-Seed", "X-Sample-Rate", "X-Audio-Duration")
"""Response headers a cross-origin page may read."""


def create_app(engine: Engine, settings: ServerSettings | None = None, speakers: Speakers | None = None
               ) -> FastAPI:
    """An app serving `engine` (which the caller opens and closes; several apps may share one, and then
    share its speakers' prefix jobs: give them one speakers store).

    Speakers are `speakers`, else those of `settings.speakers_dir`; their flow prefixes are queued as
    background jobs (`cosyvoice_runtime.prefix_jobs`) in name order while they fit the prefix cache's
    budget, and follow the store's changes while the app runs (`speaker_sync`). The session workers stop
    with the app. With `settings.api_key`, every request but `/health`
    and the page must carry the key (`serve/auth.py`).
    Bodies are bounded by `settings.max_body_bytes`; `settings.cors_origins` lets those origins' pages call
    the API and open its WebSocket (`serve/ws_origin.py`); `settings.docs` serves FastAPI's /docs and /redoc.
    """
    settings = settings or ServerSettings()
    sessions = SessionQueue(settings.sessions_at_once(engine.max_batch), settings.queue_depth,
                            settings.timeout)
    metrics = ServerMetrics(running=lambda: sessions.running, waiting=lambda: sessions.waiting,
                            prefixes=engine.synth.flow.prefixes, prefix_jobs=engine.voice.prefix_jobs,
                            batch=engine.batch_metrics, dit_stack=engine.synth.flow.stack,
                            vocoder_stack=engine.synth.vocoder.stack)
    if speakers is None:
        registry = SpeakerRegistry(settings.speakers_dir, engine.frontend_fingerprint)
        registry.tidy()  # the server writes the folder
        speakers = registry
    # so that the first stream of each registered speaker is fast too; in the background, yielding to
    # sessions, and only as many as the prefix cache keeps (the rest compute theirs on first use)
    names = speakers.names()
    engine.voice.prefix_jobs.submit_within_budget(
        (name, speaker.features) for name in names if (speaker := speakers.get(name)) is not None)
    state = ServerState(engine, settings, sessions, speakers, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sync = (None if settings.speakers_sync is None
                else asyncio.create_task(keep_following(state, settings.speakers_sync, set(names)),
                                         name="speakers-sync"))
        yield
        if sync is not None:
            sync.cancel()
            with suppress(asyncio.CancelledError):
                await sync
        sessions.shutdown()

    docs = settings.docs  # off by default: their pages load Swagger UI and ReDoc from a CDN
    app = FastAPI(title="cosyvoice-serve", summary="CosyVoice3 text-to-speech over the torch-free runtime",
                  lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    app.state.server = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    routes = [route for route in (*app.routes, *(route for router in ROUTERS for route in router.routes))
              if isinstance(route, Route)]  # FastAPI's own (/openapi.json) and ours
    synthesis = [route for route in routes if isinstance(route, APIRoute) and SYNTHESIS_TAG in route.tags]
    calls = frozenset((method, route.path) for route in synthesis for method in route.methods or ())
    readable = tuple(route for route in routes if "GET" in (route.methods or ()) and route not in synthesis)
    # Each middleware added wraps those before it: the last one sees a request first.
    app.add_middleware(AnswerHead, routes=readable)
    app.add_middleware(LimitBody, limit=settings.max_body_bytes)
    app.add_middleware(CountSynthesisRequests, metrics=metrics, calls=calls)
    app.add_middleware(AnswerUnexpected)  # outside the counter, which must see a failure to count it
    if settings.api_key is not None:  # outside the counter: a refused request is not counted
        app.add_middleware(RequireApiKey, key=settings.api_key)
    app.add_middleware(SameOriginWebSockets, allowed=settings.cors_origins)
    if settings.cors_origins:  # outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=list(CORS_HEADERS),
                           expose_headers=list(CORS_EXPOSED))
    return app


class AnswerHead:
    """HEAD on `routes` (those that answer GET without synthesising: health probes, metrics, lists) is
    answered as their GET is; uvicorn sends no body for a HEAD request. Elsewhere it stays a 405."""

    def __init__(self, app: ASGIApp, routes: tuple[Route, ...]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            as_get = {**scope, "method": "GET"}
            if any(route.matches(as_get)[0] is Match.FULL for route in self.routes):
                scope = as_get
        await self.app(scope, receive, send)


class CountSynthesisRequests:
    """Counts every request to a synthesis route (its method and path: `calls`) once it is answered: success
    (2xx, the whole stream sent), error (an error status, or a stream cut by an error), or neither when the
    client left."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, calls: frozenset[tuple[str, str]]) -> None:
        self.app, self.metrics, self.calls = app, metrics, calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) not in self.calls:
            await self.app(scope, receive, send)
            return
        self.metrics.requests_total.inc()
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException:
            self.metrics.requests_error.inc()
            raise
        if scope.get("state", {}).get(OUTCOME) == CANCELLED:
            return
        (self.metrics.requests_error if status >= 400 else self.metrics.requests_success).inc()
