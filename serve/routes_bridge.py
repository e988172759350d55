"""The bridge server's API: `POST /synthesize` (JSON in, a WAV file out), `/health`, `/metrics`.

`/synthesize` takes `text`, `prompt_audio`, `prompt_text`, `instruct`/`speaker`, `speed` (and `seed`).
`prompt_audio` is the prompt recording's file, base64-encoded (a `data:` URL too). The bridge took a
path on the server's disk; reading paths a client names is not safe on a shared server, so paths are
refused unless the server names a folder for them (`--prompt-dir`): then a `prompt_audio` that holds a
`.`, which base64 never does, is the path of a file in that folder, relative to it or absolute, and a
path that leads out of it (`..`, a symlink, another absolute path) is refused without looking further.
With a non-blank `prompt_text` it is zero-shot cloning; otherwise instruct2, with the
instruction `instruct`, else `speaker` (the bridge passes its `speaker` field as the instruction),
else "Speak naturally in English." (a blank field counts as not given, as `prompt_text` does).
Synthesis is offline (upstream's non-streaming path, which honours `speed`); the answer is `audio/wav`
with the audio's length in seconds in `X-Audio-Duration`.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.audio_files import wav_bytes
from cosyvoice_runtime.synthesis import Mode

from .audio import check_upload, decode_base64_audio
from .auth import key_matches
from .engine import SynthesisJob
from .errors import FieldError, audio_response, error_responses
from .metrics import CONTENT_TYPE
from .responses import SYNTHESIS_TAG, Seed, decoded_upload, offline_audio, request_sampling, require_text
from .settings import MAX_UPLOAD_BYTES
from .state import State

router = APIRouter()
DEFAULT_INSTRUCTION = "Speak naturally in English."
MISSING_PROMPT = "prompt_audio is required for CosyVoice3 synthesis"


class SynthesizeRequest(BaseModel):
    """The bridge's `SynthesizeRequest`, plus `instruct` and `seed`."""

    text: str
    prompt_audio: str | None = Field(None, description="The prompt recording's file, base64-encoded; with "
                                                       "the server's --prompt-dir, a file's path there too.")
    prompt_text: str | None = Field(None, description="Its transcript: zero-shot cloning when given.")
    instruct: str | None = Field(None, description="Instruction when prompt_text is not given.")
    speaker: str | None = Field(None, description="The bridge's instruction field (if no instruct).")
    speed: float = Field(1.0, ge=0.5, le=2.0, allow_inf_nan=False, description="Speaking rate.")
    seed: Seed = None


@router.post("/synthesize", tags=[SYNTHESIS_TAG], response_class=Response,
             responses={**audio_response("The audio, a WAV file (PCM16, mono, 24 kHz)", "audio/wav"),
                        **error_responses(400, 401, 413, 422, 503, 504)})
async def synthesize(body: SynthesizeRequest, request: Request, state: State) -> Response:
    """Text to a WAV file, zero-shot or instructed, in the voice of `prompt_audio`."""
    settings = state.settings
    text = require_text(body.text, "text", settings)
    if body.prompt_audio is None or not body.prompt_audio.strip():
        raise FieldError("prompt_audio", MISSING_PROMPT)
    prompt = await decoded_upload(await prompt_audio(body.prompt_audio, settings.prompt_dir), "prompt_audio")
    sampling = request_sampling(settings, body.seed)
    if body.prompt_text and body.prompt_text.strip():
        job = SynthesisJob(Mode.ZERO_SHOT, text, prompt, sampling, speed=body.speed,
                           prompt_text=require_text(body.prompt_text, "prompt_text", settings))
    else:
        field, instruct = next(((field, value) for field, value in (("instruct", body.instruct),
                                                                    ("speaker", body.speaker))
                                if value and value.strip()), ("instruct", DEFAULT_INSTRUCTION))
        job = SynthesisJob(Mode.INSTRUCT2, text, prompt, sampling, speed=body.speed,
                           instruct=require_text(instruct, field, settings))
    audio = await offline_audio(state, request, job)
    rate = state.engine.sample_rate
    return Response(wav_bytes(audio, rate), media_type="audio/wav",
                    headers={"X-Audio-Duration": f"{len(audio) / rate:g}", "X-Seed": str(sampling.seed)})


async def prompt_audio(value: str, folder: Path | None) -> bytes:
    """The bytes of the prompt `value` sends: decoded from base64, or read from `folder` if it names a file
    there (`folder` None: paths are refused)."""
    text = value.strip()
    if folder is None or text.startswith("data:") or "." not in text:  # base64 never holds a "."
        paths = ("server paths are not read" if folder is None else
                 "or the name of a file in the server's prompt folder, with its extension")
        return decode_base64_audio(value, "prompt_audio", else_=paths)
    return await run_in_threadpool(read_prompt_file, text, folder)


def read_prompt_file(name: str, folder: Path) -> bytes:
    """The bytes of file `name` of `folder` (symlinks resolved), or a `FieldError` naming `name` only: the
    folder's layout and the targets of its links stay the server's."""
    root = folder.resolve()
    try:
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise FieldError("prompt_audio", f"prompt_audio: {name!r} is outside the server's prompt folder")
        if path.stat().st_size > MAX_UPLOAD_BYTES:
            raise FieldError("prompt_audio", f"prompt_audio: {name!r} is over {MAX_UPLOAD_BYTES} bytes",
                             status=413)
        data = path.read_bytes()
    except (OSError, RuntimeError, ValueError):  # missing, a folder, unreadable, a link loop, a name refused
        raise FieldError("prompt_audio", f"prompt_audio: no readable file {name!r} in the server's prompt "
                                         "folder") from None
    return check_upload(data, "prompt_audio")


@router.get("/health")
async def health(request: Request, state: State) -> dict[str, object]:
    """Liveness, the package version, the session counts, and the served speakers and the model: with an
    API key, only to a request that carries it (the probe is open, and `GET /speakers` is not)."""
    key = state.settings.api_key
    known = key is None or key_matches(key, request.headers.items())
    return {"status": "healthy", "version": importlib.metadata.version("cosyvoice-onnx"),
            **({"speakers": state.speakers.names(), "model": state.engine.origin} if known else {}),
            "sample_rate": state.engine.sample_rate, "provider": state.engine.provider,
            "sessions": {"running": state.sessions.running, "waiting": state.sessions.waiting,
                         "max_concurrency": state.sessions.concurrency, "max_waiting": state.sessions.depth}}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """Prometheus metrics (text format 0.0.4)."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
