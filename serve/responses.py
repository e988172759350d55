"""From a validated job to an HTTP response: admission, the wait for the first audio, streaming, metrics.

Every synthesis route builds a `SynthesisJob` and hands it to `stream_response` or `offline_audio`.
Both wait for the job's first audio before answering, so an error found before any audio (bad text or
prompt, a timeout in the queue) is a proper 4xx/5xx rather than a cut stream; while they wait they watch
the connection, and a client that goes away ends its text's normalisation or cancels its session, queued
or running. During a stream, Starlette cancels the response when the client disconnects; the session is
cancelled with it and its worker stops within one LLM step or one chunk's flow and vocoder call.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Annotated, Any, TypeVar

import numpy as np
from fastapi import Request, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.errors import FrontendError
from cosyvoice_runtime.frontend.tokenizer import check_unicode
from cosyvoice_runtime.sampling import MAX_SEED, Sampling
from cosyvoice_runtime.segments import Segment

from .audio import check_upload
from .engine import AudioUpload, SynthesisJob, decode_upload
from .errors import CANCELLED, OUTCOME, ApiError, EmptyField, FieldError, StreamCut
from .formats import ChunkEncoder, PcmEncoder
from .metrics import ServerMetrics
from .queue import QueueFull, Session, SessionStream
from .settings import ServerSettings
from .state import ServerState

log = logging.getLogger(__name__)

T = TypeVar("T")
SYNTHESIS_TAG = "synthesis"
"""The tag of the synthesis routes: the `tts_requests_*` counters count their requests."""
SEED_DESCRIPTION = (f"Sampler seed, 0 to {MAX_SEED}; default --seed, else random (ours: upstream and OpenAI "
                    "have none).")
Seed = Annotated[int | None, Field(ge=0, le=MAX_SEED, description=SEED_DESCRIPTION)]
"""A JSON body's `seed`, bounded as the sampler takes it (a form's is `routes_upstream.Seed`)."""


class ClientGone(ApiError):
    """The client closed the connection before any audio: nobody reads this answer."""

    def __init__(self) -> None:
        super().__init__(499, "client closed the request")


def require_text(value: str, field: str, settings: ServerSettings) -> str:
    """`value` if it is non-blank and within the length limit, else a `FieldError` naming `field`."""
    if not value.strip():
        raise EmptyField(field)
    if len(value) > settings.max_text_chars:
        raise FieldError(field, f"{field} has {len(value)} characters; the limit is "
                                f"{settings.max_text_chars}")
    try:  # a JSON body's "\ud800" escape: a 500 from the tokenizer otherwise
        check_unicode(value, field)
    except FrontendError as e:
        raise FieldError(field, str(e)) from None
    return value


def request_sampling(settings: ServerSettings, seed: int | None) -> Sampling:
    """The server's sampling with the request's seed, else the server's, else a fresh random one
    (upstream samples unseeded)."""
    if seed is None:
        seed = settings.seed if settings.seed is not None else secrets.randbelow(2**31)
    return Sampling(settings.sampling, seed)


async def read_upload(upload: UploadFile, field: str) -> AudioUpload:
    """An uploaded prompt recording, checked for size, then decoded and checked as a prompt
    (`decoded_upload`)."""
    return await decoded_upload(check_upload(await upload.read(), field), field)


async def decoded_upload(data: bytes, field: str) -> AudioUpload:
    """`decode_upload` on a worker thread (a large compressed file takes a while to decode): bad audio is a
    4xx before the request is admitted to a session."""
    return await run_in_threadpool(decode_upload, data, field)


async def submit(state: ServerState, request: Request, job: SynthesisJob,
                 work: Callable[[SynthesisJob, list[Segment], Session], Iterable[T]]) -> SessionStream[T]:
    """Admit `work` on the job's segments to the session queue (503 when full, counted), its text normalised
    first (`Engine.text_segments`): text with nothing to speak is a 400 before any wait in the queue, and a
    client that leaves meanwhile ends the normalisation and is never admitted (`ClientGone`)."""
    try:
        state.sessions.check_room()
        pieces = await _while_connected(state, request,
                                        state.engine.text_segments(job, state.settings.timeout))
        return state.sessions.submit(lambda session: work(job, pieces, session))
    except QueueFull:
        state.metrics.requests_rejected.inc()
        raise


async def first_item(state: ServerState, request: Request, stream: SessionStream[T]) -> T:
    """The session's first item, waiting for it while watching the connection (`ClientGone`)."""
    try:
        first = await _while_connected(state, request, stream.next())
    except (ClientGone, asyncio.CancelledError):
        stream.cancel()
        raise
    if first is None:
        raise ApiError(500, "synthesis ended without audio")
    return first


async def _while_connected(state: ServerState, request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or `ClientGone` (counted) where the client disconnects first: `work` is cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # it may end with an error all the same: nobody reads it now
    if task not in done:
        _mark_cancelled(state, request)
        raise ClientGone
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Reads a task's outcome, so that asyncio does not log an error nobody was to read."""
    if not task.cancelled():
        task.exception()


async def offline_audio(state: ServerState, request: Request, job: SynthesisJob) -> np.ndarray:
    """The job synthesised offline (`Engine.synthesize`): all of its samples."""
    stream = await submit(state, request, job, state.engine.synthesize)
    audio = await first_item(state, request, stream)
    await stream.next()  # the end: it comes once the worker has marked the session finished, for its timing
    record_session(state.metrics, stream.session, len(audio), state.engine.sample_rate)
    return audio


async def stream_response(state: ServerState, request: Request, job: SynthesisJob, *, media_type: str,
                          encoder: ChunkEncoder | None = None, offline: bool = False,
                          headers: dict[str, str] | None = None) -> StreamingResponse:
    """A response streaming the job's audio through `encoder` (default: raw PCM16) as the runtime yields
    chunks; `offline` synthesises on upstream's offline path instead (one chunk, `speed` applied)."""
    encode = encoder or PcmEncoder()
    work = state.engine.synthesize if offline else state.engine.stream
    start = time.monotonic()
    stream = await submit(state, request, job, work)
    first = await first_item(state, request, stream)
    state.metrics.first_chunk_seconds.observe(time.monotonic() - start)

    async def body() -> AsyncIterator[bytes]:
        samples = len(first)
        try:
            # on a worker thread: compressed formats take a few milliseconds per second of audio
            if data := await run_in_threadpool(encode.encode, first):
                yield data
            while (chunk := await stream.next()) is not None:
                samples += len(chunk)
                if data := await run_in_threadpool(encode.encode, chunk):
                    yield data
            if data := await run_in_threadpool(encode.finish):
                yield data
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: nothing went wrong here
            _mark_cancelled(state, request)
            log.info("%s: the client left after %d samples; its session stops", request.url.path, samples)
            raise
        # After the status line all that is left is to cut the stream: one line says why (`StreamCut`).
        except ApiError as e:
            log.warning("%s: stream cut after %d samples: %s", request.url.path, samples, e.detail)
            raise StreamCut from None
        except Exception:
            log.exception("%s: stream cut after %d samples", request.url.path, samples)
            raise StreamCut from None
        finally:
            stream.cancel()
            encode.close()
        record_session(state.metrics, stream.session, samples, state.engine.sample_rate)

    return StreamingResponse(body(), media_type=media_type, headers=headers)


def record_session(metrics: ServerMetrics, session: Session, samples: int, sample_rate: int) -> None:
    """Duration and RTF of a session that finished with `samples` samples."""
    if session.started is None or session.finished is None:
        return
    seconds = session.finished - session.started
    metrics.synthesis_seconds.observe(seconds)
    if samples:
        metrics.rtf.observe(seconds / (samples / sample_rate))


def _mark_cancelled(state: ServerState, request: Request) -> None:
    setattr(request.state, OUTCOME, CANCELLED)
    state.metrics.sessions_cancelled.inc()


async def _disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
