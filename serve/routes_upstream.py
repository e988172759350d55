"""Upstream's FastAPI endpoints (`runtime/python/fastapi/server.py`): same paths, GET and POST, same form
fields, the response a stream of raw PCM16 (mono, little-endian, 24 kHz) without a header.

As upstream's CosyVoice3 servers do, a transcript or instruction without `<|endofprompt|>` gets the
system prompt (`You are a helpful assistant.<|endofprompt|>`) put in front, and cross-lingual text gets
it too (`cosyvoice_runtime.segments.segments`). The audio is the runtime's stream, chunk by chunk. Upstream
samples every request from an unseeded generator; here the optional form field `seed` (else
`--seed`, else a random one, sent back in `X-Seed`) seeds it, and `--sampling greedy` makes it exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from cosyvoice_runtime.synthesis import Mode

from .engine import SynthesisJob
from .responses import SYNTHESIS_TAG, read_upload, request_sampling, require_text, stream_response
from .state import ServerState, State

router = APIRouter(tags=[SYNTHESIS_TAG])
PCM_MEDIA_TYPE = "application/octet-stream"
METHODS = ("GET", "POST")
"""Upstream serves each endpoint to both; its own client uses GET (with a form body)."""
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def get_and_post(path: str) -> Callable[[Endpoint], Endpoint]:
    """Register an endpoint for GET and for POST as two routes, each with its own OpenAPI operation id
    (`<name>_get`, `<name>_post`): one route for both methods would give both operations one id."""

    def register(endpoint: Endpoint) -> Endpoint:
        for method in METHODS:
            router.add_api_route(path, endpoint, methods=[method],
                                 operation_id=f"{endpoint.__name__}_{method.lower()}")
        return endpoint

    return register

TtsText = Annotated[str, Form(description="Text to speak.")]
PromptWav = Annotated[UploadFile, File(description="Prompt recording (audio file, >= 16 kHz, <= 30 s).")]
Seed = Annotated[int | None, Form(description="Sampler seed (not upstream's; default: --seed, else random).")]


async def _pcm_stream(state: ServerState, request: Request, job: SynthesisJob) -> StreamingResponse:
    headers = {"X-Sample-Rate": str(state.engine.sample_rate), "X-Seed": str(job.sampling.seed)}
    return await stream_response(state, request, job, media_type=PCM_MEDIA_TYPE, headers=headers)


@get_and_post("/inference_zero_shot")
async def inference_zero_shot(request: Request, state: State, tts_text: TtsText,
                              prompt_text: Annotated[str, Form(description="Transcript of prompt_wav.")],
                              prompt_wav: PromptWav, seed: Seed = None) -> StreamingResponse:
    """Zero-shot voice cloning: `tts_text` in the voice of `prompt_wav`, whose words are `prompt_text`."""
    job = SynthesisJob(Mode.ZERO_SHOT, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       prompt_text=require_text(prompt_text, "prompt_text", state.settings),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)


@get_and_post("/inference_cross_lingual")
async def inference_cross_lingual(request: Request, state: State, tts_text: TtsText, prompt_wav: PromptWav,
                                  seed: Seed = None) -> StreamingResponse:
    """Cross-lingual cloning: `tts_text` (any language) in the voice of `prompt_wav`, no transcript."""
    job = SynthesisJob(Mode.CROSS_LINGUAL, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)


@get_and_post("/inference_instruct2")
async def inference_instruct2(request: Request, state: State, tts_text: TtsText,
                              instruct_text: Annotated[str, Form(description="e.g. 'Speak slowly.'")],
                              prompt_wav: PromptWav, seed: Seed = None) -> StreamingResponse:
    """Instructed synthesis: `tts_text` in the voice of `prompt_wav`, spoken as `instruct_text` asks."""
    job = SynthesisJob(Mode.INSTRUCT2, require_text(tts_text, "tts_text", state.settings),
                       await read_upload(prompt_wav, "prompt_wav"), request_sampling(state.settings, seed),
                       instruct=require_text(instruct_text, "instruct_text", state.settings),
                       text_field="tts_text")
    return await _pcm_stream(state, request, job)
