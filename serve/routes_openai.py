"""`POST /v1/audio/speech` in the style of OpenAI's speech API, over registered speakers.

`input` is the text, `voice` names a registered speaker (`POST /speakers`), `response_format` is `wav`
or `pcm` (PCM16, mono, little-endian, 24 kHz), `speed` 0.5 to 2.0, `stream` streams the runtime's
chunks as they come (a `wav` stream starts with a header of unknown length). The speaker's transcript
makes it zero-shot cloning; OpenAI's `instructions`, when given, make it instruct2 instead. `model` is
accepted and ignored (there is one model). As upstream, `speed` works offline only.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from cosyvoice_runtime.synthesis import Mode

from .audio import pcm16, streaming_wav_header, wav_bytes
from .engine import SynthesisJob
from .errors import FieldError
from .responses import SYNTHESIS_TAG, Seed, offline_audio, request_sampling, require_text, stream_response
from .state import State

router = APIRouter()
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


class SpeechRequest(BaseModel):
    """OpenAI's `audio.speech.create` body, the formats and speeds this model has, plus `stream`, `seed`."""

    model: str | None = Field(None, description="Ignored: the server has one model.")
    input: str = Field(description="Text to speak.")
    voice: str = Field(description="A registered speaker's name.")
    instructions: str | None = Field(None, description="An instruction: instruct2 instead of zero-shot.")
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = Field(1.0, ge=0.5, le=2.0, description="Speaking rate (not with stream).")
    stream: bool = Field(False, description="Stream the audio as it is synthesised.")
    seed: Seed = None


@router.post("/v1/audio/speech", tags=[SYNTHESIS_TAG])
async def speech(body: SpeechRequest, request: Request, state: State) -> Response:
    """`input` spoken by the registered speaker `voice`, as a WAV file or raw PCM, whole or streamed."""
    settings = state.settings
    text = require_text(body.input, "input", settings)
    speaker = state.speakers.get(body.voice)
    if speaker is None:
        raise FieldError("voice", f"voice: unknown speaker {body.voice!r}; registered: "
                                  f"{', '.join(state.speakers.names()) or 'none'} (POST /speakers adds one)")
    if body.stream and body.speed != 1.0:
        raise FieldError("speed", "speed works only without stream (upstream ignores it when streaming)")
    sampling = request_sampling(settings, body.seed)
    if body.instructions and body.instructions.strip():
        instruct = require_text(body.instructions, "instructions", settings)
        job = SynthesisJob(Mode.INSTRUCT2, text, speaker.features, sampling, speed=body.speed,
                           instruct=instruct, text_field="input")
    else:
        job = SynthesisJob(Mode.ZERO_SHOT, text, speaker.features, sampling, speed=body.speed,
                           prompt_text=speaker.prompt_text, text_field="input")
    rate = state.engine.sample_rate
    media_type = MEDIA_TYPES[body.response_format]
    headers = {"X-Seed": str(sampling.seed), "X-Sample-Rate": str(rate)}
    wav = body.response_format == "wav"
    if body.stream:
        return await stream_response(state, request, job, media_type=media_type, headers=headers,
                                     header=streaming_wav_header(rate) if wav else b"")
    audio = await offline_audio(state, request, job)
    headers["X-Audio-Duration"] = f"{len(audio) / rate:g}"
    return Response(wav_bytes(audio, rate) if wav else pcm16(audio), media_type=media_type, headers=headers)
