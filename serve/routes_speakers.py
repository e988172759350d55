"""Speaker registration: `GET /speakers` (names, as the bridge), `POST /speakers`, `GET`/`DELETE
/speakers/{name}`. A registered speaker's prompt features are computed once and kept on disk
(`SpeakerRegistry`); `/v1/audio/speech` uses them by name. Registering also queues the speaker's flow
prefix as a background job that yields to every session in flight (`cosyvoice_runtime.prefix_jobs`), so its
first stream starts as fast as its second; deleting or replacing it cancels that job."""

from __future__ import annotations

import errno
import logging
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, Response, UploadFile
from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.speakers import SpeakerError, check_name, shown_name

from .errors import ApiError, EmptyField, FieldError, error_responses
from .forms import FormRoute
from .responses import first_item, read_upload, require_text
from .state import State

router = APIRouter(route_class=FormRoute)
log = logging.getLogger(__name__)


def folder_error(error: OSError) -> ApiError:
    """The speakers folder refused a write (full, read-only, gone): 507 where it is out of space, else 500,
    one line for the client and one for the log; the registry is as it was."""
    log.error("the speakers folder refused a write: %s", error)
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    return ApiError(507 if full else 500, f"the server's speakers folder cannot be written: "
                                          f"{error.strerror or type(error).__name__}")


@router.get("/speakers")
async def list_speakers(state: State) -> list[str]:
    """The registered speakers' names."""
    return state.speakers.names()


@router.post("/speakers", status_code=201, responses=error_responses(400, 401, 413, 422, 500, 503, 504, 507))
async def register_speaker(request: Request, state: State,
                           name: Annotated[str, Form(description="The speaker's name: 1 to 64 printable "
                                                                 "characters, none of / \\ ? # %, no "
                                                                 "leading or trailing blank.")],
                           prompt_text: Annotated[str, Form(description="Transcript of prompt_wav.")],
                           prompt_wav: Annotated[UploadFile, File(description="The speaker's recording.")]
                           ) -> dict[str, Any]:
    """Register (or replace) a speaker: its recording's features are computed now and kept on disk, its
    flow prefix in the background."""
    if not name.strip():
        raise EmptyField("name")
    # check_name strips a name: one sent with blanks around it would register (or replace) another name
    if name != name.strip():
        raise FieldError("name", f"a speaker name has no leading or trailing blanks; got {shown_name(name)}")
    try:
        check_name(name)
    except SpeakerError as e:
        raise FieldError("name", str(e)) from None
    prompt_text = require_text(prompt_text, "prompt_text", state.settings)
    upload = await read_upload(prompt_wav, "prompt_wav")
    # a session of the queue (503 when it is full), not a synthesis: the requests' counters leave it out
    stream = state.sessions.submit(lambda _: [state.engine.extract(upload)])
    features = await first_item(state, request, stream)
    async with state.speaker_changes:
        try:
            speaker = await run_in_threadpool(state.speakers.add, name, prompt_text, features)
        except OSError as e:
            raise folder_error(e) from None
        state.engine.voice.prefix_jobs.submit(speaker.name, features)
    return speaker.describe()


@router.get("/speakers/{name}", responses=error_responses(401, 404, 422))
async def get_speaker(name: str, state: State) -> dict[str, Any]:
    """A registered speaker's transcript, size and time of registration."""
    speaker = state.speakers.get(name)
    if speaker is None:
        raise FieldError("name", f"unknown speaker {shown_name(name)}", status=404)
    return speaker.describe()


@router.delete("/speakers/{name}", status_code=204, responses=error_responses(401, 404, 422, 500, 507))
async def delete_speaker(name: str, state: State) -> Response:
    """Forget a speaker (its features file too, and its flow prefix)."""
    async with state.speaker_changes:
        try:
            removed = await run_in_threadpool(state.speakers.remove, name)
        except OSError as e:
            raise folder_error(e) from None
        if not removed:
            raise FieldError("name", f"unknown speaker {shown_name(name)}", status=404)
        state.engine.voice.prefix_jobs.cancel(name)
    return Response(status_code=204)
