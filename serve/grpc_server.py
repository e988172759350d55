"""Running the gRPC service: `GrpcServer` (an asyncio gRPC server on one address) and `run_grpc` (serve
until SIGINT or SIGTERM, then stop gracefully).

The server is grpc's asyncio one: a handler awaits its session's chunks on the event loop, and the
session queue's workers synthesise, as under uvicorn. Upstream's server bounds concurrent RPCs with
`maximum_concurrent_rpcs`; here the session queue bounds them (`--max-conc` running, `--queue` waiting,
RESOURCE_EXHAUSTED beyond), so grpc's own limit is left unset. Port reuse is off, so that a port another
server holds is an error rather than a silently shared port (grpc turns SO_REUSEPORT on by default).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .auth import GrpcApiKey
from .engine import Engine
from .grpc_service import CosyVoiceService
from .proto import cosyvoice_pb2_grpc
from .settings import ServerSettings

GRACE_SECONDS = 5.0
"""On stop, streams in flight get this long to finish; then they are cancelled (and their sessions)."""
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
    async def start(cls, engine: Engine, settings: ServerSettings, host: str, port: int) -> GrpcServer:
        """Serve `engine` on `host:port` (port 0: any free one), on the running event loop; `OSError` if the
        address cannot be bound. With `settings.api_key`, every call must carry the key as metadata."""
        interceptors = [GrpcApiKey(settings.api_key)] if settings.api_key is not None else []
        server = grpc.aio.server(interceptors=interceptors, options=OPTIONS)
        service = CosyVoiceService(engine, settings)
        cosyvoice_pb2_grpc.add_CosyVoiceServicer_to_server(service, server)
        try:
            bound = server.add_insecure_port(grpc_address(host, port))
        except RuntimeError as e:  # grpc's "Failed to bind to address"
            raise OSError(f"cannot listen on {grpc_address(host, port)}: {e}") from None
        await server.start()
        return cls(server, service, grpc_address(host, bound))

    async def stop(self, grace: float | None = GRACE_SECONDS) -> None:
        """Refuse new RPCs, give those in flight `grace` seconds, then cancel them; drop queued sessions."""
        await self.server.stop(grace)
        self.service.sessions.shutdown()


def run_grpc(engine: Engine, settings: ServerSettings, host: str, port: int,
             announce: Callable[[str], None] = print) -> None:
    """Serve `engine` over gRPC on `host:port` until SIGINT or SIGTERM; `announce` gets a line once it
    listens."""

    async def serve() -> None:
        server = await GrpcServer.start(engine, settings, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        announce(f"gRPC: cosyvoice.CosyVoice on {server.address} (Ctrl+C stops)")
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(serve())
