"""`cosyvoice-serve`: an HTTP server for CosyVoice3 over the torch-free runtime (FastAPI + uvicorn), or
upstream's gRPC service (`--grpc`, grpc's asyncio server), or both in one process (`--grpc-port`).

Upstream's FastAPI endpoints, the bridge server's API, an OpenAI-style speech endpoint, speaker
registration and a web page; upstream's `cosyvoice.CosyVoice` gRPC service; a bounded session queue in
front of one shared `Synthesizer`. Never imports torch or `cosyvoice_export`.

The names below are imported on first use, so that `cosyvoice_serve.speakers` (whose registry the
exporter's `speakers` command writes) can be imported without the server's FastAPI and grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .engine import Engine
    from .settings import ServerSettings

__all__ = ["Engine", "ServerSettings", "create_app"]
_MODULES = {"Engine": ".engine", "ServerSettings": ".settings", "create_app": ".app"}


def __getattr__(name: str) -> Any:
    """`Engine`, `ServerSettings` and `create_app`, from their modules on first use."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name], __name__), name)
