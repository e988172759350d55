"""OpenAI's speech API: `POST /v1/audio/speech`, `GET /v1/audio/voices`, `GET /v1/audio/models`, `GET
/v1/models`, as the official SDKs and OpenAI-compatible TTS clients call them; errors in OpenAI's shape
(`errors.error_response`).

`input` is the text; `voice` a registered speaker (`POST /speakers`) or one of OpenAI's standard voice
names, which all speak in the bundle's own prompt voice (a registered speaker of the same name comes
first); `response_format` one of OpenAI's six (`formats.py`), mp3 by default as OpenAI's; `speed` 0.25
to 4.0, OpenAI's range; `instructions`, when given, make it instruct2 instead of zero-shot with the
voice's transcript. `stream_format` "sse" sends OpenAI's speech events instead of the bare file. `model`
may be any id: the server has one model, listed under the names clients send (`GET /v1/models`). An
optional field sent as null takes its default, as OpenAI's API reads it.

The body leaves chunk by chunk as the runtime synthesises it, as OpenAI's does, but for FLAC: its header
holds the total length, which a stream cannot go back to fill in, and readers such as libsndfile refuse
a FLAC without it, so a FLAC is a complete file unless `stream` asks for a stream. As upstream, `speed`
works offline only: with a speed other than 1.0 the audio is synthesised whole on upstream's offline path
and then sent. Our own field `stream` chooses explicitly: true streams (speed 1.0 only), false synthesises
offline and answers a complete file (`X-Audio-Duration`; an MP3 with its LAME tag, a WAV with its sizes).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_runtime.cosyvoice3 import MAX_SPEED, MIN_SPEED
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.speakers import shown_name
from cosyvoice_runtime.synthesis import Mode

from .engine import BundlePrompt, SynthesisJob
from .errors import FieldError, audio_response, error_responses
from .formats import FORMATS, SSE_MEDIA_TYPE, FormatName, SseEncoder
from .responses import SYNTHESIS_TAG, Seed, offline_audio, request_sampling, require_text, stream_response
from .state import ServerState, State

router = APIRouter()
STANDARD_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                   "sage", "shimmer", "verse")
"""OpenAI's built-in voice names (the `voice` literal of the official SDK)."""
MODEL_IDS = ("cosyvoice3", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
"""Names the one model answers to: ours, then OpenAI's speech models, which clients send by default."""
OWNER = "cosyvoice-serve"


class VoiceId(BaseModel):
    """OpenAI's custom-voice reference: here, a voice by name."""

    id: str


def _voice_shape(value: object) -> object:
    """`value` if it is a voice's shape (a name, or an object with a string `id`); else one error that says
    so, rather than pydantic's error per member of the union (`voice.str`, `voice.VoiceId`)."""
    if isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("id"), str)):
        return value
    got = {bool: "a boolean", int: "a number", float: "a number", list: "an array",
           dict: "an object without a string id", type(None): "null"}.get(type(value), type(value).__name__)
    raise PydanticCustomError("voice", "expected a speaker name (a string) or an object with an id (a "
                                       "string), got {got}", {"got": got})


Voice = Annotated[str | VoiceId, BeforeValidator(_voice_shape)]
"""A request's `voice`: a speaker's name, or OpenAI's `{"id": name}`."""


class NullIsDefault(BaseModel):
    """A body whose optional fields take null for their default, as OpenAI's API reads them (its SDKs send
    null for a field left unset); a required field's null stays an error."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class SpeechRequest(NullIsDefault):
    """OpenAI's `audio.speech.create` body, with the speeds this model has, plus our `stream` and `seed`."""

    model: str | None = Field(None, description="Any id: the server has one model (GET /v1/models).")
    input: str = Field(description="Text to speak.")
    voice: Voice = Field(description="A registered speaker, or a standard voice name (alloy, ash, ...): the "
                                     "model's own prompt voice (GET /v1/audio/voices).")
    instructions: str | None = Field(None, description="An instruction: instruct2 instead of zero-shot.")
    response_format: FormatName = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False,
                         description="Speaking rate; other than 1.0, the audio is synthesised whole before "
                                     "it is sent.")
    stream_format: Literal["audio", "sse"] = Field(
        "audio", description="audio: the file's bytes; sse: speech.audio.delta events, speech.audio.done.")
    stream: bool | None = Field(
        None, description="true: stream the runtime's chunks (speed 1.0 only); false: synthesise offline, "
                          "answer a complete file; default: stream unless speed is not 1.0 or the "
                          "format is flac.")
    seed: Seed = None


@router.post("/v1/audio/speech", tags=[SYNTHESIS_TAG], response_class=Response,
             responses={**audio_response("The audio in `response_format`, or OpenAI's speech events "
                                         "(`stream_format: sse`)", *(f.media_type for f in FORMATS.values()),
                                         SSE_MEDIA_TYPE),
                        **error_responses(400, 401, 413, 422, 503, 504, openai=True)})
async def speech(body: SpeechRequest, request: Request, state: State) -> Response:
    """`input` spoken by `voice` in `response_format`, streamed as it is synthesised, or as events."""
    settings = state.settings
    text = require_text(body.input, "input", settings)
    prompt, prompt_text = find_voice(state, body.voice if isinstance(body.voice, str) else body.voice.id)
    streamed = body.speed == 1.0 and body.response_format != "flac" if body.stream is None else body.stream
    if streamed and body.speed != 1.0:
        raise FieldError("speed", "speed works only without stream (upstream ignores it when streaming)")
    sampling = request_sampling(settings, body.seed)
    if body.instructions and body.instructions.strip():
        instruct = require_text(body.instructions, "instructions", settings)
        job = SynthesisJob(Mode.INSTRUCT2, text, prompt, sampling, speed=body.speed, instruct=instruct,
                           text_field="input")
    else:
        job = SynthesisJob(Mode.ZERO_SHOT, text, prompt, sampling, speed=body.speed, prompt_text=prompt_text,
                           text_field="input")
    rate = state.engine.sample_rate
    audio_format = FORMATS[body.response_format]
    headers = {"X-Seed": str(sampling.seed), "X-Sample-Rate": str(rate)}
    if body.stream_format == "sse":
        return await stream_response(state, request, job, media_type=SSE_MEDIA_TYPE, offline=not streamed,
                                     encoder=SseEncoder(audio_format.encoder(rate), job.usage),
                                     headers={**headers, "Cache-Control": "no-cache"})
    if streamed:
        return await stream_response(state, request, job, media_type=audio_format.media_type,
                                     encoder=audio_format.encoder(rate), headers=headers)
    audio = await offline_audio(state, request, job)
    headers["X-Audio-Duration"] = f"{len(audio) / rate:g}"
    data = await run_in_threadpool(audio_format.encode_whole, audio, rate)
    return Response(data, media_type=audio_format.media_type, headers=headers)


def find_voice(state: ServerState, name: str) -> tuple[PromptFeatures | BundlePrompt, str]:
    """The prompt and transcript of voice `name`: a registered speaker, else a standard voice name (the
    bundle's prompt); a `FieldError` naming what there is otherwise."""
    speaker = state.speakers.get(name)
    if speaker is not None:
        return speaker.features, speaker.prompt_text
    default = state.engine.default_prompt
    if name in STANDARD_VOICES and default is not None:
        return BundlePrompt.DEFAULT, default[1]
    standard = (f"; or a standard voice ({', '.join(STANDARD_VOICES)})" if default is not None else
                "; this model carries no prompt voice of its own for the standard voice names")
    raise FieldError("voice", f"voice: unknown speaker {shown_name(name)}; registered: "
                              f"{', '.join(state.speakers.names()) or 'none'} (POST /speakers adds one)"
                              f"{standard}")


@router.get("/v1/audio/voices")
async def list_voices(state: State) -> dict[str, list[dict[str, Any]]]:
    """The voices `voice` takes: the registered speakers, then the standard voice names they leave (the
    model's own prompt voice, if it carries one)."""
    registered = state.speakers.names()
    standard = ([name for name in STANDARD_VOICES if name not in registered]
                if state.engine.default_prompt is not None else [])
    return {"voices": [{"id": name, "name": name, "registered": True} for name in registered]
            + [{"id": name, "name": name, "registered": False} for name in standard]}


def _model(state: ServerState, model_id: str) -> dict[str, Any]:
    """OpenAI's model object; `created` is when the bundle's manifest was written (its export)."""
    created = int((state.engine.bundle.root / MANIFEST).stat().st_mtime)
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNER}


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    """The model, under each name it answers to, in OpenAI's list shape."""
    return {"object": "list", "data": [_model(state, model_id) for model_id in MODEL_IDS]}


@router.get("/v1/audio/models")
async def list_speech_models() -> dict[str, list[dict[str, str]]]:
    """The speech models, as OpenAI-compatible TTS clients (Open WebUI) list them: the one model under each
    name it answers to."""
    return {"models": [{"id": model_id, "name": model_id} for model_id in MODEL_IDS]}


@router.get("/v1/models/{model_id}", responses=error_responses(401, 404, 422, openai=True))
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    """One of `GET /v1/models`' entries."""
    if model_id not in MODEL_IDS:
        raise FieldError("model", f"unknown model {model_id!r}; this server has {', '.join(MODEL_IDS)}",
                         status=404)
    return _model(state, model_id)
