"""Upstream's FastAPI endpoints (`runtime/python/fastapi/server.py`): same paths, GET and POST, same form
fields, the response a stream of raw PCM16 (mono, little-endian, 24 kHz) without a header.

As upstream's CosyVoice3 servers do, a transcript or instruction without `<|endofprompt|>` gets the
system prompt (`You are a helpful assistant.<|endofprompt|>`) put in front, and cross-lingual text gets
it too (`cosyvoice_runtime.segments.segments`). The audio is the runtime's stream, chunk by chunk. Upstream
samples every request from an unseeded generator; here the optional form field `seed` (else
`--seed`, else a random one, sent back in `X-Seed`) seeds it, and `--sampling greedy` makes it exact.

Upstream's `/inference_sft` and `/inference_instruct` speak as a built-in speaker of `spk2info.pt`, which
CosyVoice3 runtime bundles do not have; they answer 501 with the endpoint to call instead, as the gRPC
service answers their requests UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, File, Form, Request, Response, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse

from cosyvoice_runtime.sampling import MAX_SEED
from cosyvoice_runtime.synthesis import Mode

from .engine import SynthesisJob
from .errors import ApiError, audio_response, error_responses
from .forms import FormRoute
from .responses import (
    SEED_DESCRIPTION,
    SYNTHESIS_TAG,
    read_upload,
    request_sampling,
    require_text,
    stream_response,
)
from .state import ServerState, State

router = APIRouter(tags=[SYNTHESIS_TAG], route_class=FormRoute)
PCM_MEDIA_TYPE = "application/octet-stream"
METHODS = ("GET", "POST")
"""Upstream serves each endpoint to both; its own client uses GET (with a form body)."""
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
NEEDS_SPK2INFO = {
    "/inference_sft": "/inference_sft speaks as a built-in speaker of upstream's spk2info.pt, which "
                      "CosyVoice3 runtime bundles do not have; for CosyVoice3 call /inference_zero_shot "
                      "(tts_text, prompt_text, prompt_wav), or /v1/audio/speech with a speaker registered "
                      "at /speakers",
    "/inference_instruct": "/inference_instruct is CosyVoice-300M's instruct, with a built-in speaker of "
                           "spk2info.pt; for CosyVoice3 call /inference_instruct2 (tts_text, instruct_text, "
                           "prompt_wav)",
}


def get_and_post(path: str, **route: Any) -> Callable[[Endpoint], Endpoint]:
    """Register an endpoint for GET and for POST as two routes, each with its own OpenAPI operation id
    (`<name>_get`, `<name>_post`): one route for both methods would give both operations one id. `route`
    goes to `add_api_route`."""

    def register(endpoint: Endpoint) -> Endpoint:
        for method in METHODS:
            router.add_api_route(path, endpoint, methods=[method],
                                 operation_id=f"{endpoint.__name__}_{method.lower()}", **route)
        return endpoint

    return register


def _needs_spk2info(path: str) -> dict[str, Any]:
    """The route options of an upstream endpoint CosyVoice3 cannot serve: its 501 in the schema."""
    return {"response_class": JSONResponse, "status_code": 501,
            "responses": {**error_responses(401, 501), 501: {**error_responses(501)[501],
                                                            "description": NEEDS_SPK2INFO[path]}}}


PCM_STREAM = {"response_class": Response,
              "responses": {**audio_response("The audio as it is synthesised: PCM16, mono, 24 kHz "
                                             "(X-Sample-Rate), little-endian", PCM_MEDIA_TYPE),
                            **error_responses(400, 401, 413, 422, 503, 504)}}
"""The route options of an upstream endpoint that streams audio."""

TtsText = Annotated[str, Form(description="Text to speak.")]
PromptWav = Annotated[UploadFile, File(description="Prompt recording (audio file, >= 16 kHz, <= 30 s).")]
Seed = Annotated[int | None, Form(ge=0, le=MAX_SEED, description=SEED_DESCRIPTION)]


async def _pcm_stream(state: ServerState, request: Request, job: SynthesisJob) -> StreamingResponse:
    headers = {"X-Sample-Rate": str(state.engine.sample_rate), "X-Seed": str(job.sampling.seed)}
    return await stream_response(state, request, job, media_type=PCM_MEDIA_TYPE, headers=headers)


@get_and_post("/inference_zero_shot", **PCM_STREAM)
async def inference_zero_shot(request: Request, state: State, tts_text: TtsText,
                              prompt_text: Annotated[str, Form(description="Transcript of prompt_wav.")],
                              prompt_wav: PromptWav, seed: Seed = None) -> StreamingResponse:
    """Zero-shot voice cloning: `tts_text` in the voice of `prompt_wav`, whose words are `prompt_text`."""
    job = SynthesisJob(Mode.ZERO_SHOT, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       prompt_text=require_text(prompt_text, "prompt_text", state.settings),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)


@get_and_post("/inference_cross_lingual", **PCM_STREAM)
async def inference_cross_lingual(request: Request, state: State, tts_text: TtsText, prompt_wav: PromptWav,
                                  seed: Seed = None) -> StreamingResponse:
    """Cross-lingual cloning: `tts_text` (any language) in the voice of `prompt_wav`, no transcript."""
    job = SynthesisJob(Mode.CROSS_LINGUAL, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)


@get_and_post("/inference_instruct2", **PCM_STREAM)
async def inference_instruct2(request: Request, state: State, tts_text: TtsText,
                              instruct_text: Annotated[str, Form(description="e.g. 'Speak slowly.'")],
                              prompt_wav: PromptWav, seed: Seed = None) -> StreamingResponse:
    """Instructed synthesis: `tts_text` in the voice of `prompt_wav`, spoken as `instruct_text` asks."""
    job = SynthesisJob(Mode.INSTRUCT2, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       instruct=require_text(instruct_text, "instruct_text", state.settings),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)


@get_and_post("/inference_sft", **_needs_spk2info("/inference_sft"))
async def inference_sft() -> JSONResponse:
    """Upstream's built-in speakers (spk2info.pt): not in CosyVoice3 runtime bundles, so always 501."""
    raise ApiError(501, NEEDS_SPK2INFO["/inference_sft"])


@get_and_post("/inference_instruct", **_needs_spk2info("/inference_instruct"))
async def inference_instruct() -> JSONResponse:
    """CosyVoice-300M's instruct with a built-in speaker: not CosyVoice3's, so always 501."""
    raise ApiError(501, NEEDS_SPK2INFO["/inference_instruct"])
