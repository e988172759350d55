"""`cosyvoice-serve`: an HTTP server for CosyVoice3 over the torch-free runtime (FastAPI + uvicorn), or
upstream's gRPC service (`--grpc`, grpc's asyncio server), or both in one process (`--grpc-port`).

Upstream's FastAPI endpoints, the bridge server's API, an OpenAI-style speech endpoint, speaker
registration and a web page; upstream's `cosyvoice.CosyVoice` gRPC service; a bounded session queue in
front of one shared `CosyVoice3`. Never imports torch or `cosyvoice_export`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .engine import Engine
    from .settings import ServerSettings

__all__ = ["Engine", "ServerSettings", "create_app"]
_HOMES = {"Engine": ".engine", "ServerSettings": ".settings", "create_app": ".app"}


def __getattr__(name: str) -> Any:
    # imported on first use, so that the console script's front (`__main__`) loads where the serve extra
    # is missing and can say so
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
