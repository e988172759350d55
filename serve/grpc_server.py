"""Running the gRPC service: `GrpcServer` (an asyncio gRPC server on one address) and `run_grpc` (serve
until SIGINT or SIGTERM, then stop gracefully; optionally with the HTTP server in the same event loop).

The server is grpc's asyncio one: a handler awaits its session's chunks on the event loop, and the
session queue's workers synthesise, as under uvicorn. Upstream's server bounds concurrent RPCs with
`maximum_concurrent_rpcs`; here the session queue bounds them (`--max-conc` running, `--queue` waiting,
RESOURCE_EXHAUSTED beyond), so grpc's own limit is left unset. Port reuse is off, so that a port another
server holds is an error rather than a silently shared port (grpc turns SO_REUSEPORT on by default).

HTTP beside gRPC (`cosyvoice-serve --grpc-port`): one event loop runs both servers, and the gRPC service
admits its sessions to the HTTP app's queue, so `--max-conc` and `--queue` bound both together over the
one engine. uvicorn takes SIGINT and SIGTERM with `signal.signal` while it serves and raises the signal
again once it has shut down; the loop's own handlers, installed before it, still receive both (asyncio
learns of a signal through its wakeup fd, which `signal.signal` leaves alone), so a signal stops both
servers side by side and the re-raised one is harmless.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import uvicorn

from .auth import GrpcApiKey
from .engine import Engine
from .grpc_service import CosyVoiceService
from .metrics import ServerMetrics
from .queue import SessionQueue
from .settings import ServerSettings

OPTIONS = (("grpc.so_reuseport", 0),)


def grpc_address(host: str, port: int) -> str:
    """`host:port` as grpc takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class GrpcServer:
    """A started gRPC server for one engine (`start`); `stop` ends it."""

    server: grpc.aio.Server
    service: CosyVoiceService
    address: str
    """Where it listens: `host:port`, the port the one bound."""

    @classmethod
    async def start(cls, engine: Engine, settings: ServerSettings, host: str, port: int,
                    sessions: SessionQueue | None = None, metrics: ServerMetrics | None = None) -> GrpcServer:
        """Serve `engine` on `host:port` (port 0: any free one), on the running event loop; `OSError` if the
        address cannot be bound. Sessions go to `sessions` (the HTTP app's, which stops once both servers
        have), else to a queue of the service's own; calls count in `metrics` (the HTTP app's) where given.
        With `settings.api_key`, every call must carry the key."""
        interceptors = [GrpcApiKey(settings.api_key)] if settings.api_key is not None else []
        server = grpc.aio.server(interceptors=interceptors, options=OPTIONS)
        service = CosyVoiceService(engine, settings, sessions, metrics)
        service.add_to(server)
        try:
            bound = server.add_insecure_port(grpc_address(host, port))
        except RuntimeError as e:  # grpc's "Failed to bind to address"
            raise OSError(f"cannot listen on {grpc_address(host, port)}: {e}") from None
        await server.start()
        if sessions is not None:  # the HTTP app's: it stops once both servers have
            sessions.share()
        return cls(server, service, grpc_address(host, bound))

    async def stop(self, grace: float | None) -> None:
        """Refuse new RPCs, give those in flight `grace` seconds, then cancel them; then the session queue
        stops, or, shared with HTTP, once HTTP's has stopped too."""
        await self.server.stop(grace)
        self.service.sessions.shutdown()


def run_grpc(engine: Engine, settings: ServerSettings, host: str, port: int,
             announce: Callable[[str], None] = print, *, http: uvicorn.Server | None = None,
             sessions: SessionQueue | None = None, metrics: ServerMetrics | None = None) -> None:
    """Serve `engine` over gRPC on `host:port` until SIGINT or SIGTERM; `announce` gets a line once it
    listens. With `http` (a uvicorn server, not started), serve that too, in the same event loop, until
    a signal or its end; `sessions` and `metrics` are then its app's queue and metrics, which the gRPC
    service shares."""
    # HTTP's socket is bound first, outside the loop: uvicorn reports a failed bind with one line and
    # `sys.exit`, which from inside a task would tear the loop down instead.
    sockets = [http.config.bind_socket()] if http is not None else []

    async def serve() -> None:
        server = await GrpcServer.start(engine, settings, host, port, sessions, metrics)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        beside = " beside HTTP" if http is not None else ""
        announce(f"gRPC: cosyvoice.CosyVoice on {server.address}{beside} (Ctrl+C stops)")
        stopped = asyncio.ensure_future(stop.wait())
        serving = [asyncio.ensure_future(http.serve(sockets))] if http is not None else []
        try:
            await asyncio.wait([stopped, *serving], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            server.service.sessions.stop()  # the calls still waiting are refused now, not run
            if http is not None:
                http.should_exit = True  # uvicorn's graceful shutdown, beside gRPC's
            await asyncio.gather(server.stop(settings.shutdown_grace), *serving)

    asyncio.run(serve())
