"""`/v1/audio/speech/stream`: text that arrives while it is spoken, over a WebSocket (upstream's bistream).

The client sends JSON text frames: a `start` (the voice, as `/v1/audio/speech` takes it, `instructions`,
`response_format`, `seed`), then `text` pieces as they come (an LLM's words), then `end`. The server answers
`started` (sample rate, seed, format), the audio as binary frames as it is made (the format's bytes: PCM16
by default), then `done` with the usage, and closes (1000). The session takes a slot of the same queue as
the other routes, from the start message to its end. Anything else ends it with an `error` message and a
close code (`CLOSE`): a bad message or field, an `end` before any non-blank text, text past `--max-text` in
all, no message for `--stream-idle` seconds before `end`, a full queue, or a failed synthesis; the slot is
free by the time the close arrives. A client that closes the socket cancels its session; its slot is free
within one LLM step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.errors import FrontendError
from cosyvoice_runtime.frontend.tokenizer import check_unicode
from cosyvoice_runtime.synthesis import Mode

from .engine import SynthesisJob
from .errors import ApiError
from .formats import FORMATS, FormatName
from .queue import QueueFull, Session
from .responses import Seed, record_session, request_sampling
from .routes_openai import NullIsDefault, Voice, find_voice
from .state import ServerState

log = logging.getLogger(__name__)
router = APIRouter()
PATH = "/v1/audio/speech/stream"

RELEASE_WAIT_S = 10.0
"""How long a closing session waits for its work to stop and free its slot (one LLM step or one flow or
vocoder call) before the socket closes anyway."""
CLOSE = {"bad_message": 1008, "too_much_text": 1009, "failed": 1011, "busy": 1013, "idle": 4408}
"""Close codes: RFC 6455's policy violation, message too big, internal error and try again later, and, in
the private range, 4408 for a client idle past `--stream-idle` (HTTP's 408)."""
POLL_SECONDS = 0.1
"""How often a worker waiting for text checks whether its session was cancelled."""


class StartMessage(NullIsDefault):
    """The first message: who speaks, how the audio comes."""

    type: str
    voice: Voice
    instructions: str | None = None
    response_format: FormatName = "pcm"
    seed: Seed = None


class StreamClosed(Exception):
    """Ends a session with an error message and a close code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = CLOSE[reason], message


class TextFeed:
    """Text pieces from the event loop (`put`, `end`) to the session's worker, which iterates `pieces`."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def put(self, text: str) -> None:
        self._items.put(text)

    def end(self) -> None:
        """No more text (or the session stops: a cancelled worker stops at its next check)."""
        self._items.put(None)

    def pieces(self, session: Session) -> Iterator[str]:
        """The pieces as they come, checking the session while it waits (cancelled: `Cancelled`)."""
        while True:
            try:
                item = self._items.get(timeout=POLL_SECONDS)
            except queue.Empty:
                session.check()
                continue
            if item is None:
                session.check()  # a session stopped by the server ends its text too: it must not speak it
                return
            yield item


@router.websocket(PATH)
async def speech_stream(socket: WebSocket) -> None:
    """Text pieces in, audio out (the module's docstring has the protocol)."""
    state: ServerState = socket.app.state.server
    await socket.accept()
    state.metrics.requests_total.inc()
    try:
        await _serve(socket, state)
    except StreamClosed as e:
        state.metrics.requests_error.inc()
        log.info("%s: closed with %d: %s", PATH, e.code, e.message)
        await _close(socket, e.code, {"type": "error", "message": e.message})
    except WebSocketDisconnect:
        state.metrics.sessions_cancelled.inc()
        log.info("%s: the client left; its session stops", PATH)
    except Exception:
        state.metrics.requests_error.inc()
        log.exception("%s: session failed", PATH)
        await _close(socket, CLOSE["failed"], {"type": "error", "message": "internal error"})
    else:
        state.metrics.requests_success.inc()


async def _serve(socket: WebSocket, state: ServerState) -> None:
    settings = state.settings
    start = _start(await _receive(socket, settings.stream_idle_timeout))
    try:
        voice = start.voice if isinstance(start.voice, str) else start.voice.id
        prompt, prompt_text = find_voice(state, voice)
    except ApiError as e:
        raise StreamClosed("bad_message", e.detail) from None
    sampling = request_sampling(settings, start.seed)
    instruct = (start.instructions or "").strip()
    _check_length(len(instruct), settings.max_text_chars, "instructions")
    _check_unicode(instruct, "instructions")
    job = SynthesisJob(Mode.INSTRUCT2 if instruct else Mode.ZERO_SHOT, "", prompt, sampling,
                       prompt_text="" if instruct else prompt_text, instruct=instruct, text_field="text")
    feed = TextFeed()
    try:
        stream = state.sessions.submit(lambda session: state.engine.stream_text(job, feed.pieces(session),
                                                                                  session))
    except QueueFull as e:
        state.metrics.requests_rejected.inc()
        raise StreamClosed("busy", e.detail) from None
    rate = state.engine.sample_rate
    encoder = FORMATS[start.response_format].encoder(rate)
    reader = asyncio.ensure_future(_read_text(socket, feed, settings.max_text_chars,
                                              settings.stream_idle_timeout))
    samples = 0
    try:
        await socket.send_json({"type": "started", "sample_rate": rate, "seed": sampling.seed,
                                "response_format": start.response_format})
        while True:
            item = asyncio.ensure_future(stream.next())
            if not reader.done():
                await asyncio.wait({item, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                item.cancel()
                reader.result()  # what ended the text: a bad message, idle, a disconnect
            try:
                audio = await item
            except ApiError as e:
                raise StreamClosed("failed", e.detail) from None
            if audio is None:
                break
            if not samples:
                state.metrics.first_chunk_seconds.observe(time.monotonic() - stream.session.admitted)
            samples += len(audio)
            if data := await run_in_threadpool(encoder.encode, audio):
                await socket.send_bytes(data)
        if data := await run_in_threadpool(encoder.finish):
            await socket.send_bytes(data)
        record_session(state.metrics, stream.session, samples, rate)
        usage = {"input_tokens": job.usage.text_tokens, "output_tokens": job.usage.speech_tokens}
        await _close(socket, 1000, {"type": "done", "audio_seconds": samples / rate, "usage": usage})
    finally:
        reader.cancel()
        stream.cancel()  # before the feed ends, so that the worker stops rather than speak what it has
        feed.end()
        encoder.close()
        # a client told to go (idle, a bad message) finds the slot free when it comes back at once
        await asyncio.to_thread(stream.session.released.wait, RELEASE_WAIT_S)


async def _read_text(socket: WebSocket, feed: TextFeed, max_chars: int, idle: float) -> None:
    """Text messages into `feed` until `end`; raises what ends the session otherwise, an `end` before any
    non-blank text included (before the LLM runs on nothing)."""
    chars, spoken = 0, False
    while True:
        message = await _receive(socket, idle)
        kind = message.get("type")
        if kind == "end":
            if not spoken:
                raise StreamClosed("bad_message", "text: no text was sent before end (no piece, or only "
                                                  "empty or blank ones)")
            feed.end()
            return
        if kind != "text" or not isinstance(message.get("text"), str):
            raise StreamClosed("bad_message", f"expected {{\"type\": \"text\", \"text\": \"...\"}} or "
                                              f"{{\"type\": \"end\"}}, got {_short(message)}")
        chars += len(message["text"])
        _check_length(chars, max_chars, "text")
        _check_unicode(message["text"], "text")
        spoken = spoken or bool(message["text"].strip())
        feed.put(message["text"])


async def _receive(socket: WebSocket, idle: float) -> dict[str, Any]:
    """The next message, a JSON object; `StreamClosed` for anything else or for `idle` seconds of nothing."""
    try:
        raw = await asyncio.wait_for(socket.receive(), timeout=idle)
    except TimeoutError:
        raise StreamClosed("idle", f"no message for {idle:g} s") from None
    if raw["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(raw.get("code", 1000))
    text = raw.get("text")
    if text is None:
        raise StreamClosed("bad_message", "messages are JSON text frames, not binary")
    try:
        message = json.loads(text)
    except RecursionError:  # as HTTP's bodies (errors.py)
        raise StreamClosed("bad_message", "not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise StreamClosed("bad_message", f"not valid JSON ({e})") from None
    if not isinstance(message, dict):
        raise StreamClosed("bad_message", f"expected a JSON object, got {_short(message)}")
    return message


def _start(message: dict[str, Any]) -> StartMessage:
    if message.get("type") != "start":
        raise StreamClosed("bad_message", f"the first message must be {{\"type\": \"start\", ...}}, got "
                                          f"{_short(message)}")
    try:
        return StartMessage.model_validate(message)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise StreamClosed("bad_message", f"start: {field}: {first['msg']}") from None


def _check_length(chars: int, limit: int, what: str) -> None:
    if chars > limit:
        raise StreamClosed("too_much_text", f"{what} has {chars} characters; the limit is {limit}")


def _check_unicode(text: str, what: str) -> None:
    try:
        check_unicode(text, what)
    except FrontendError as e:
        raise StreamClosed("bad_message", str(e)) from None


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


async def _close(socket: WebSocket, code: int, message: dict[str, Any]) -> None:
    """Send `message`, then close with `code` (nothing, if the client has gone)."""
    try:
        await socket.send_json(message)
        await socket.close(code)
    except (WebSocketDisconnect, RuntimeError):
        pass

