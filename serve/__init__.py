"""`cosyvoice-serve`: an HTTP server for CosyVoice3 over the torch-free runtime (FastAPI + uvicorn), or
upstream's gRPC service (`--grpc`, grpc's asyncio server).

Upstream's FastAPI endpoints, the bridge server's API, an OpenAI-style speech endpoint, speaker
registration and a web page; or upstream's `cosyvoice.CosyVoice` gRPC service; either with a bounded
session queue in front of one shared `Synthesizer`. Never imports torch or `cosyvoice_export`.
"""

from __future__ import annotations

from .app import create_app
from .engine import Engine
from .settings import ServerSettings

__all__ = ["Engine", "ServerSettings", "create_app"]
