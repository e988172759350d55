"""`/v1/audio/speech/stream` (serve/routes_stream.py): text pieces in over a WebSocket, audio out, on a real
uvicorn with the `websockets` client; the audio is the runtime's text stream of the same pieces, and every
way a session can end badly gets its close code and frees its slot."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
websockets = pytest.importorskip("websockets", reason="the serve extra is not installed")

import httpx
import numpy as np
from test_serve import API_KEY, make_app, metric, serving
from websockets.sync.client import ClientConnection, connect

from cosyvoice_runtime.audio_files import pcm16
from cosyvoice_runtime.sampling import Sampling
from cosyvoice_runtime.synthesis import Mode
from cosyvoice_serve import Engine
from cosyvoice_serve.queue import Cancelled
from cosyvoice_serve.ws_origin import origin_allowed, refusal

PIECES = ["Hello ", "there, ", "this text ", "comes in ", "while it ", "is spoken."]


@contextmanager
def socket_to(engine: Engine, folder: Path, **settings: Any
              ) -> Iterator[tuple[Callable[..., ClientConnection], httpx.Client]]:
    """A server of `engine` (greedy): a function that opens a WebSocket to its stream endpoint, and an HTTP
    client of it."""
    app = make_app(engine, folder, **settings)
    with serving(app) as client:
        url = f"ws://127.0.0.1:{client.base_url.port}/v1/audio/speech/stream"
        yield (lambda **kw: connect(url, open_timeout=30, close_timeout=5, **kw)), client


def converse(ws: ClientConnection, messages: list[dict[str, Any] | str | bytes], pause: float = 0.0
             ) -> tuple[list[dict[str, Any]], bytes, int]:
    """Send `messages` (dicts as JSON), then read to the close: the JSON events, the audio, the close code."""
    for message in messages:
        ws.send(json.dumps(message) if isinstance(message, dict) else message)
        time.sleep(pause)
    events, audio = [], b""
    try:
        while True:
            frame = ws.recv(timeout=120)
            if isinstance(frame, bytes):
                audio += frame
            else:
                events.append(json.loads(frame))
    except websockets.exceptions.ConnectionClosed as closed:
        assert closed.rcvd is not None
        return events, audio, closed.rcvd.code


def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_text_pieces_in_audio_out(engine: Engine, tmp_path: Path) -> None:
    start = {"type": "start", "voice": "alloy", "seed": 3}
    with socket_to(engine, tmp_path) as (open_socket, _), open_socket() as ws:
        events, audio, code = converse(ws, [start, *({"type": "text", "text": p} for p in PIECES),
                                            {"type": "end"}], pause=0.05)
    assert code == 1000
    started, done = events[0], events[-1]
    assert started == {"type": "started", "sample_rate": 24000, "seed": 3, "response_format": "pcm"}
    assert done["type"] == "done" and done["usage"]["output_tokens"] > 0 and done["usage"]["input_tokens"] > 0
    assert done["audio_seconds"] == pytest.approx(len(audio) / 2 / 24000)
    default = engine.default_prompt
    assert default is not None
    speech = engine.voice.speak_text_stream(iter(PIECES), engine.default_features(), Mode.ZERO_SHOT,
                                            prompt_text=default[1], sampling=Sampling("greedy", 3))
    want = np.concatenate([chunk.samples for chunk in speech])
    assert audio == pcm16(want)  # the runtime's text stream, sample for sample
    assert done["usage"]["output_tokens"] == len(speech.speech_tokens)


@pytest.mark.parametrize(("messages", "code", "message"), [
    ([{"type": "text", "text": "hi"}], 1008, 'the first message must be {"type": "start", ...}'),
    ([{"type": "start", "voice": "nobody"}], 1008, "voice: unknown speaker 'nobody'"),
    ([{"type": "start", "voice": "alloy", "response_format": "ogg"}], 1008, "start: response_format:"),
    ([{"type": "start", "voice": 5}], 1008, "start: voice: expected a speaker name (a string) or an object "
                                            "with an id (a string), got a number"),
    (["{not json"], 1008, "not valid JSON"),
    (["[" * 100000 + "]" * 100000], 1008, "not valid JSON (nested too deeply)"),  # a RecursionError: 1011
    ([{"type": "start", "voice": "alloy"}, '{"type": "text", "text": "Hi \\ud800"}'], 1008,
     "text is not valid Unicode text: character 4 is a lone surrogate (U+D800)"),
    ([{"type": "start", "voice": "alloy", "instructions": "\udc00"}], 1008,
     "instructions is not valid Unicode text: character 1 is a lone surrogate (U+DC00)"),
    ([b"\x00\x01"], 1008, "messages are JSON text frames, not binary"),
    ([{"type": "start", "voice": "alloy"}, {"type": "txt", "text": "hi"}], 1008, 'expected {"type": "text"'),
    ([{"type": "start", "voice": "alloy"}, {"type": "text", "text": "x" * 30}], 1009,
     "text has 30 characters; the limit is 20"),
])
def test_a_bad_message_closes_the_session_with_its_code(engine: Engine, tmp_path: Path,
                                                        messages: list[Any], code: int, message: str) -> None:
    with socket_to(engine, tmp_path, max_text_chars=20) as (open_socket, _):
        with open_socket() as ws:
            events, _, got = converse(ws, messages)
        assert got == code
        assert events[-1]["type"] == "error" and message in events[-1]["message"]
        with open_socket() as ws:  # the slot is free again
            events, audio, got = converse(ws, [{"type": "start", "voice": "alloy"},
                                               {"type": "text", "text": "Hello."}, {"type": "end"}])
        assert got == 1000 and audio


@pytest.mark.parametrize("texts", [[], ["", "  "]], ids=["no piece", "blank pieces"])
def test_an_end_before_any_text_is_refused_before_the_llm_runs(engine: Engine, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             texts: list[str]) -> None:
    """The worker's text never ends (it would run the LLM on nothing, and fail as a synthesis, 1011): its
    session is stopped first, and the client is told it sent no text (1008)."""
    read: list[list[str] | None] = []

    def text_only(job: Any, pieces: Iterator[str], session: Any) -> Iterator[Any]:
        try:
            read.append(list(pieces))
        except Cancelled:
            read.append(None)
            raise
        yield from ()

    monkeypatch.setattr(engine, "stream_text", text_only)
    with socket_to(engine, tmp_path) as (open_socket, _), open_socket() as ws:
        events, _, code = converse(ws, [{"type": "start", "voice": "alloy"},
                                        *({"type": "text", "text": t} for t in texts), {"type": "end"}])
    message = "text: no text was sent before end (no piece, or only empty or blank ones)"
    assert code == 1008 and events[-1] == {"type": "error", "message": message}
    assert read == [None]


def test_a_start_of_nulls_takes_the_defaults(engine: Engine, tmp_path: Path) -> None:
    start = {"type": "start", "voice": {"id": "alloy"}, "instructions": None, "response_format": None,
             "seed": None}
    with socket_to(engine, tmp_path) as (open_socket, _), open_socket() as ws:
        events, audio, code = converse(ws, [start, {"type": "text", "text": "Hello."}, {"type": "end"}])
    assert code == 1000 and audio and events[0]["response_format"] == "pcm"


def test_an_idle_client_is_closed_and_frees_its_slot(engine: Engine, tmp_path: Path) -> None:
    with socket_to(engine, tmp_path, stream_idle_timeout=0.5, queue_depth=0) as (open_socket, _):
        with open_socket() as ws:
            events, _, code = converse(ws, [{"type": "start", "voice": "alloy"},
                                            {"type": "text", "text": "Hi"}])
        assert code == 4408 and events[-1]["message"] == "no message for 0.5 s"
        with open_socket() as ws:
            assert converse(ws, [{"type": "start", "voice": "alloy"}, {"type": "text", "text": "Hello."},
                                 {"type": "end"}])[2] == 1000


def test_a_client_told_to_go_finds_its_slot_free_when_it_comes_back_at_once(
        engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes a session (idle here) only once its work has stopped and freed the slot, however
    long the work takes to stop (half a second here, as a flow call can): one slot and no queue, and the
    client that reconnects at once is served."""
    stream_text = engine.stream_text

    def slow_to_stop(*args: Any, **kwargs: Any) -> Iterator[Any]:
        try:
            yield from stream_text(*args, **kwargs)
        finally:
            time.sleep(0.5)

    monkeypatch.setattr(engine, "stream_text", slow_to_stop)
    with socket_to(engine, tmp_path, stream_idle_timeout=0.5, queue_depth=0) as (open_socket, _):
        with open_socket() as ws:
            _, _, code = converse(ws, [{"type": "start", "voice": "alloy"}, {"type": "text", "text": "Hi"}])
        assert code == 4408
        with open_socket() as ws:
            assert converse(ws, [{"type": "start", "voice": "alloy"}, {"type": "text", "text": "Hello."},
                                 {"type": "end"}])[2] == 1000


def test_a_full_queue_and_a_client_that_leaves(engine: Engine, tmp_path: Path) -> None:
    """One slot, no queue: a second session is refused (1013) while the first waits for text; the first
    client leaving cancels its session and frees the slot."""
    with socket_to(engine, tmp_path, queue_depth=0) as (open_socket, client):
        with open_socket() as first:
            first.send(json.dumps({"type": "start", "voice": "alloy"}))
            assert json.loads(first.recv(timeout=30))["type"] == "started"
            assert metric(client.get("/metrics").text, "tts_active_sessions") == 1
            with open_socket() as second:
                events, _, code = converse(second, [{"type": "start", "voice": "alloy"}])
            assert code == 1013 and "server busy" in events[-1]["message"]
        _until(lambda: metric(client.get("/metrics").text, "tts_active_sessions") == 0)
        assert metric(client.get("/metrics").text, "tts_sessions_cancelled") >= 1
        with open_socket() as again:  # the first client closed its socket: its session stopped
            assert converse(again, [{"type": "start", "voice": "alloy"}, {"type": "text", "text": "Hello."},
                                    {"type": "end"}])[2] == 1000


def test_the_api_key_guards_the_handshake(engine: Engine, tmp_path: Path) -> None:
    with socket_to(engine, tmp_path, api_key=API_KEY) as (open_socket, _):
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            open_socket()
        assert refused.value.response.status_code == 403
        with open_socket(additional_headers={"X-API-Key": API_KEY}) as ws:
            assert converse(ws, [{"type": "start", "voice": "alloy"}, {"type": "text", "text": "Hello."},
                                 {"type": "end"}])[2] == 1000


def test_a_page_of_another_origin_is_refused_at_the_handshake(engine: Engine, tmp_path: Path) -> None:
    listed = "https://app.example"
    with socket_to(engine, tmp_path, cors_origins=(listed,)) as (open_socket, client):
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            open_socket(origin="https://elsewhere.example")
        assert refused.value.response.status_code == 403
        for origin in (f"http://127.0.0.1:{client.base_url.port}", listed, None):  # its own page, a listed
            with open_socket(origin=origin) as ws:                                 # one, no browser
                ws.send(json.dumps({"type": "start", "voice": "alloy"}))
                assert json.loads(ws.recv(timeout=60))["type"] == "started", origin


def test_which_origins_may_open_a_websocket() -> None:
    assert origin_allowed(None, "127.0.0.1:50000", ())
    assert origin_allowed("http://127.0.0.1:50000", "127.0.0.1:50000", ())
    assert origin_allowed("https://TTS.example", "tts.example", ())  # behind a proxy ending TLS
    assert not origin_allowed("http://127.0.0.1:8080", "127.0.0.1:50000", ())
    assert not origin_allowed("null", "127.0.0.1:50000", ())  # a sandboxed frame or a local file
    assert not origin_allowed("https://app.example", None, ())
    assert origin_allowed("https://app.example", "127.0.0.1:50000", ("https://app.example",))
    assert origin_allowed("https://anywhere.example", "127.0.0.1:50000", ("*",))
    assert len(refusal("https://" + "é" * 200).encode()) <= 123  # a close frame's reason
