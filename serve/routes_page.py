"""`GET /`: a page to try the server in a browser (`page.html`: HTML, CSS and JS in one file, no build
step, nothing loaded from elsewhere).

The page posts a prompt recording to upstream's streaming endpoints (`/inference_zero_shot`,
`/inference_cross_lingual`, `/inference_instruct2`), or a named voice (`GET /v1/audio/voices`: the
registered speakers and the standard voice names) to `/v1/audio/speech` for the same PCM16 stream, with
the API key its user typed, if any (`X-API-Key`; the page itself is served without one), plays the PCM16
as it arrives (Web Audio) and offers the WAV afterwards. Its
Content-Security-Policy lets it run its own inline script and style only (by hash) and connect to this
server only, so a browser refuses any other origin the page might name.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()
PAGE = "page.html"


def _hashes(html: str, tag: str) -> str:
    """CSP sources allowing the inline `<tag>` elements of `html` by their sha256."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                    for b in bodies)


@functools.cache
def page() -> tuple[str, str]:
    """The page and its Content-Security-Policy."""
    html = resources.files("cosyvoice_serve").joinpath(PAGE).read_text(encoding="utf-8")
    policy = "; ".join([
        "default-src 'none'", f"script-src {_hashes(html, 'script')}", f"style-src {_hashes(html, 'style')}",
        "connect-src 'self' blob:", "media-src 'self' blob:", "img-src data:", "base-uri 'none'",
        "form-action 'none'", "frame-ancestors 'none'"])
    return html, policy


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    """The page: pick a voice or a prompt recording, type text, choose the mode, hear the stream, download
    the WAV."""
    html, policy = page()
    return HTMLResponse(html, headers={"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
                                       "Cache-Control": "no-cache"})
