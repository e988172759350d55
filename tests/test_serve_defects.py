"""`cosyvoice-serve`'s edges: offline syntheses timed in /metrics, seeds bounded, bodies bounded before they
are read, speaker names that are one URL segment, silent and short prompts refused on every route, empty
and blank fields answered alike, a stream cut logged once, upstream's spk2info endpoints answered 501,
CORS and the docs pages off by default, the bridge's prompt paths confined to --prompt-dir, and the
server page's endpoint table (docs/server.md) run as written."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

import httpx
import numpy as np
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_runtime_core import clone
from test_serve import (
    API_KEY,
    FAIL,
    HOLD,
    SHORT,
    MidStreamFaults,
    _Unclosable,
    _wav,
    cosyvoice_serve,
    form,
    free_port,
    make_app,
    metric,
    prompt,
    readme_table_commands,
    serving,
    wait_for_http,
    wait_until,
)

from cosyvoice_graphs import DIT
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import MODEL_DIR_ENV
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import SpeakerError
from cosyvoice_runtime.sampling import MAX_SEED, Sampling
from cosyvoice_runtime.speakers import SPEAKERS_DIR_ENV, check_name
from cosyvoice_serve import Engine, ServerSettings, create_app
from cosyvoice_serve import cli as serve_cli
from cosyvoice_serve.errors import UNFINISHED
from cosyvoice_serve.grpc_service import request_seed
from cosyvoice_serve.http_server import HttpServer

__all__ = ["prompt"]  # the module-scoped fixture, shared with test_serve

SILENT = _wav(np.zeros(16000, np.float32), 16000)
"""One second of digital silence at 16 kHz."""
SHORT_PROMPT = _wav((0.3 * np.sin(np.arange(3200) * 0.2)).astype(np.float32), 16000)
"""A 0.2 s tone: too short to prompt."""


def upload(data: bytes) -> dict[str, Any]:
    return {"prompt_wav": ("p.wav", data, "audio/wav")}


# --- offline syntheses are timed ---------------------------------------------------------------------------


def test_offline_syntheses_record_their_duration_and_rtf(engine: Engine, prompt: tuple[bytes, str],
                                                         tmp_path: Path) -> None:
    audio = base64.b64encode(prompt[0]).decode()
    with TestClient(make_app(engine, tmp_path)) as client:
        added = client.post("/speakers", data={"name": "demo", "prompt_text": prompt[1]},
                            files=upload(prompt[0]))
        assert added.status_code == 201, added.text
        for _ in range(2):
            bridge = client.post("/synthesize", json={"text": SHORT, "prompt_audio": audio,
                                                      "prompt_text": prompt[1]})
            assert bridge.status_code == 200, bridge.text
        speech = client.post("/v1/audio/speech", json={"input": SHORT, "voice": "demo",
                                                       "response_format": "wav", "stream": False})
        assert speech.status_code == 200, speech.text
        text = client.get("/metrics").text
    assert metric(text, "tts_synthesis_duration_seconds_count") == 3 == metric(text, "tts_rtf_count")
    assert metric(text, "tts_synthesis_duration_seconds_sum") > 0 and metric(text, "tts_rtf_sum") > 0


# --- seeds --------------------------------------------------------------------------------------------------

SEED_REQUESTS = [
    ("/synthesize", "json", {"text": SHORT, "prompt_audio": "AAAA", "prompt_text": "x"}),
    ("/v1/audio/speech", "json", {"input": SHORT, "voice": "nobody"}),
    ("/inference_zero_shot", "form", {"tts_text": SHORT, "prompt_text": "x"}),
    ("/inference_cross_lingual", "form", {"tts_text": SHORT}),
    ("/inference_instruct2", "form", {"tts_text": SHORT, "instruct_text": "x"}),
]


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1])
@pytest.mark.parametrize(("path", "kind", "fields"), SEED_REQUESTS, ids=[r[0] for r in SEED_REQUESTS])
def test_a_seed_out_of_range_is_a_422_naming_it_on_every_route(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        path: str, kind: str, fields: dict[str, Any], seed: int) -> None:
    app = create_app(engine, ServerSettings(speakers_dir=tmp_path / "speakers"))  # ras: the seed is used
    with TestClient(app) as client:
        if kind == "json":
            response = client.post(path, json={**fields, "seed": seed})
        else:
            response = client.post(path, data={**fields, "seed": str(seed)}, files=upload(prompt[0]))
    assert response.status_code == 422, response.text
    body = response.json()
    detail = body["error"]["message"] if path.startswith("/v1/") else body["detail"]
    assert detail.startswith("seed: Input should be ") and "\n" not in detail
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_seed_range_is_one_everywhere() -> None:
    assert Sampling("ras", MAX_SEED).seed == MAX_SEED == request_seed([("seed", str(MAX_SEED))])
    for bad in (-1, MAX_SEED + 1):
        with pytest.raises(ValueError, match="seed"):
            Sampling("ras", bad)
        with pytest.raises(ValueError, match="seed must be from 0"):
            ServerSettings(seed=bad)
        refused = CliRunner().invoke(serve_cli.serve, ["--seed", str(bad)])
        assert refused.exit_code == 2 and "--seed" in refused.output
    for text in ("-1", str(MAX_SEED + 1), "²", "1e3"):  # "²" is a digit to str.isdigit, not to int()
        with pytest.raises(Exception, match=f"seed metadata must be an integer from 0 to {MAX_SEED}"):
            request_seed([("seed", text)])


# --- request bodies -----------------------------------------------------------------------------------------


def test_a_body_declared_too_large_is_refused_before_any_of_it_is_sent(engine: Engine, tmp_path: Path
                                                                       ) -> None:
    declared = 200 << 20
    with serving(make_app(engine, tmp_path)) as client:
        with socket.create_connection(("127.0.0.1", client.base_url.port), timeout=10) as sock:
            sock.sendall(f"POST /synthesize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {declared}\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):  # the server answers and closes with no body byte sent
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    limit = ServerSettings().max_body_bytes
    assert limit == 44 << 20  # the largest upload (32 MiB) base64-encoded in JSON, and a MiB
    assert json.loads(body)["detail"] == f"body: {declared} bytes; the limit is {limit} bytes"


def test_a_chunked_body_is_read_no_further_than_the_limit(engine: Engine, tmp_path: Path) -> None:
    app = make_app(engine, tmp_path, max_body_bytes=2 << 20)
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:  # an upload of 64 MiB, 1 MiB at a time, no Content-Length
        nonlocal sent
        yield b'--b0\r\nContent-Disposition: form-data; name="prompt_wav"; filename="p.wav"\r\n\r\n'
        for _ in range(64):
            sent += 1
            yield b"x" * (1 << 20)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return await client.post("/inference_zero_shot", content=chunks(),
                                     headers={"content-type": "multipart/form-data; boundary=b0"})

    response = asyncio.run(post())
    assert response.status_code == 413, response.text
    assert response.json()["detail"] == f"body: more than {2 << 20} bytes; the limit is {2 << 20} bytes"
    assert response.headers["connection"] == "close"
    assert sent == 2  # the part's header and two MiB pass the limit: nothing after them was read


def raw_form(fields: dict[str, bytes], charset: str | None = None) -> dict[str, Any]:
    """A multipart body of `fields` (bytes as they are) and the demo prompt, with `charset` declared."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    parts = [f'--b0\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"
             for name, value in fields.items()]
    parts.append(b'--b0\r\nContent-Disposition: form-data; name="prompt_wav"; filename="p.wav"\r\n\r\n'
                 + default[0].read_bytes() + b"\r\n--b0--\r\n")
    content_type = "multipart/form-data; boundary=b0" + (f"; charset={charset}" if charset else "")
    return {"content": b"".join(parts), "headers": {"content-type": content_type}}


def test_a_form_field_is_text_in_the_bodys_charset_or_refused_naming_it(engine: Engine, tmp_path: Path
                                                                        ) -> None:
    """Starlette would read bytes that are not UTF-8 as Latin-1, and the server speak or register the
    result; a charset the body declares is the one it is read in."""
    with TestClient(make_app(engine, tmp_path)) as client:
        transcript = client.post("/inference_zero_shot",
                                 **raw_form({"tts_text": SHORT.encode(), "prompt_text": b"ok\xc3"}))
        name = client.post("/speakers", **raw_form({"name": "café".encode("latin-1"), "prompt_text": b"x"}))
        assert client.get("/speakers").json() == []
        latin = client.post("/speakers", **raw_form({"name": "café".encode("latin-1"), "prompt_text": b"x"},
                                                    charset="latin-1"))
        assert latin.status_code == 201 and latin.json()["name"] == "café"
    assert [(r.status_code, r.json()["detail"]) for r in (transcript, name)] == [
        (400, "prompt_text: not UTF-8 text (byte 0xc3 at offset 2: unexpected end of data)"),
        (400, "name: not UTF-8 text (byte 0xe9 at offset 3: unexpected end of data)")]


def test_a_body_of_another_content_type_than_the_route_reads_is_a_415(client: TestClient) -> None:
    """curl's `-d` sends application/x-www-form-urlencoded: a JSON route answered that the body should be a
    dictionary, a form route that fields it was sent were missing."""
    speech = b'{"input": "Hello.", "voice": "alloy"}'
    answers = [client.post("/v1/audio/speech", content=speech,
                           headers={"content-type": "application/x-www-form-urlencoded"}),
               client.post("/synthesize", content=b'{"text": "Hi."}', headers={"content-type": "text/plain"}),
               client.post("/inference_zero_shot", json={"tts_text": "Hello.", "prompt_text": "Hi."}),
               client.post("/speakers", json={"name": "alice"})]
    form = "multipart/form-data or application/x-www-form-urlencoded"
    assert [(r.status_code, r.json()) for r in answers] == [
        (415, {"error": {"message": "body: expected Content-Type application/json, got "
                                    "application/x-www-form-urlencoded", "type": "invalid_request_error",
                         "param": None, "code": None}}),
        *((415, {"detail": line, "error": line, "code": 415}) for line in (
            "body: expected Content-Type application/json, got text/plain",
            f"body: expected Content-Type {form}, got application/json",
            f"body: expected Content-Type {form}, got application/json"))]
    missing = client.post("/inference_zero_shot", data={"tts_text": "Hello.", "prompt_text": "Hi."})
    assert (missing.status_code, missing.json()["detail"]) == (422, "prompt_wav: Field required")


# --- speaker names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a/b", "a\\b", "what?", "a#b", "100%", ".", ".."])
def test_a_speaker_name_that_is_not_one_url_segment_is_refused(name: str) -> None:
    with pytest.raises(SpeakerError, match=r"^a speaker name is 1 to 64 printable characters, none of "
                                           r"/ \\ \? # %, and not \. or \.\.; got "):
        check_name(name)


def test_a_long_name_is_not_echoed_whole(engine: Engine, tmp_path: Path) -> None:
    name = "x" * 3000
    cut = f"{'x' * 64!r}... (3000 characters)"
    with pytest.raises(SpeakerError, match=re.escape(f"got {cut}")):
        check_name(name)
    with TestClient(make_app(engine, tmp_path)) as client:
        answers = [client.get(f"/speakers/{name}"), client.delete(f"/speakers/{name}"),
                   client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": name})]
    assert [r.status_code for r in answers] == [404, 404, 400]
    for answer in answers:
        message = answer.json()["detail"] if "detail" in answer.json() else answer.json()["error"]["message"]
        assert f"unknown speaker {cut}" in message and len(message) < 400


def test_any_other_printable_name_registers_and_is_fetched_and_deleted_by_its_url(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    name = "中文 女:1"
    with TestClient(make_app(engine, tmp_path)) as client:
        slash = client.post("/speakers", data={"name": "team/alice", "prompt_text": prompt[1]},
                            files=upload(prompt[0]))
        assert slash.status_code == 400 and slash.json()["detail"].startswith("name: a speaker name is 1 to")
        assert client.post("/speakers", data={"name": name, "prompt_text": prompt[1]},
                           files=upload(prompt[0])).status_code == 201
        assert client.get("/speakers").json() == [name]
        assert client.get(f"/speakers/{name}").json()["name"] == name  # the client percent-encodes it
        assert client.delete(f"/speakers/{name}").status_code == 204
        assert client.get("/speakers").json() == []


# --- silent and short prompts -------------------------------------------------------------------------------

PROMPT_ROUTES = [
    ("/inference_zero_shot", {"tts_text": SHORT, "prompt_text": "x"}),
    ("/inference_cross_lingual", {"tts_text": SHORT}),
    ("/inference_instruct2", {"tts_text": SHORT, "instruct_text": "x"}),
    ("/speakers", {"name": "quiet", "prompt_text": "x"}),
    ("/synthesize", {"text": SHORT, "prompt_text": "x"}),
]
BAD_PROMPTS = [(SILENT, "prompt_{}: the audio file is silent or nearly so (RMS level -inf dBFS)"),
               (SHORT_PROMPT, "prompt_{}: the audio file is too short (0.200 s); a prompt needs at least "
                              "0.5 s")]


@pytest.mark.parametrize(("data", "detail"), BAD_PROMPTS, ids=["silent", "0.2 s"])
@pytest.mark.parametrize(("path", "fields"), PROMPT_ROUTES, ids=[r[0] for r in PROMPT_ROUTES])
def test_silent_and_short_prompts_are_refused_on_every_route(
        engine: Engine, tmp_path: Path, path: str, fields: dict[str, Any], data: bytes, detail: str) -> None:
    with TestClient(make_app(engine, tmp_path)) as client:
        if path == "/synthesize":
            response = client.post(path, json={**fields, "prompt_audio": base64.b64encode(data).decode()})
        else:
            response = client.post(path, data=fields, files=upload(data))
        assert client.get("/speakers").json() == []
    field = "audio" if path == "/synthesize" else "wav"
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(detail.format(field))


# --- empty and blank fields ---------------------------------------------------------------------------------

FORM_FIELDS = [
    ("/inference_zero_shot", {"tts_text": SHORT, "prompt_text": "x"}, "tts_text"),
    ("/inference_zero_shot", {"tts_text": SHORT, "prompt_text": "x"}, "prompt_text"),
    ("/inference_cross_lingual", {"tts_text": SHORT}, "tts_text"),
    ("/inference_instruct2", {"tts_text": SHORT, "instruct_text": "x"}, "tts_text"),
    ("/inference_instruct2", {"tts_text": SHORT, "instruct_text": "x"}, "instruct_text"),
    ("/speakers", {"name": "x", "prompt_text": "x"}, "name"),
    ("/speakers", {"name": "x", "prompt_text": "x"}, "prompt_text"),
]


@pytest.mark.parametrize(("path", "fields", "field"), FORM_FIELDS,
                         ids=[f"{p}:{f}" for p, _, f in FORM_FIELDS])
def test_an_empty_form_field_is_answered_as_a_blank_one(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, path: str, fields: dict[str, str],
        field: str) -> None:
    with TestClient(make_app(engine, tmp_path)) as client:
        answers = [client.post(path, data={**fields, field: value}, files=upload(prompt[0]))
                   for value in ("", "  ")]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json() == answers[1].json() == {"detail": f"{field} is empty",
                                                       "error": f"{field} is empty", "code": 400}


# --- streams cut and unexpected errors ----------------------------------------------------------------------


def serve_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The server's records but each request's stage lines (`Engine`'s log, test_serve checks them)."""
    return [r for r in caplog.records if r.name.startswith("cosyvoice_serve")
            and r.name != "cosyvoice_serve.engine"]


def test_a_client_leaving_mid_stream_is_one_info_line(engine: Engine, prompt: tuple[bytes, str],
                                                     tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="cosyvoice_serve")
    with serving(make_app(MidStreamFaults(engine), tmp_path)) as client:
        with client.stream("POST", "/inference_zero_shot", **form(prompt, HOLD)) as response:
            assert response.status_code == 200 and next(response.iter_raw())
        wait_until(client, running=0, waiting=0)
    [record] = serve_records(caplog)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert re.fullmatch(r"/inference_zero_shot: the client left after \d+ samples; its session stops",
                        record.getMessage())
    assert "Traceback" not in capfd.readouterr().err


def test_a_stream_failing_mid_way_is_logged_once(engine: Engine, prompt: tuple[bytes, str], tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    with serving(make_app(MidStreamFaults(engine), tmp_path)) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            client.post("/inference_zero_shot", **form(prompt, FAIL))
        wait_until(client, running=0, waiting=0)
        text = client.get("/metrics").text
    [record] = serve_records(caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None  # the one traceback
    assert record.getMessage().startswith("/inference_zero_shot: stream cut after ")
    err = capfd.readouterr().err
    assert "Traceback" not in err and UNFINISHED not in err  # nothing from the server besides it
    assert metric(text, "tts_requests_error") == 1 and metric(text, "tts_requests_success") == 0


def test_a_stream_cut_by_the_timeout_is_one_warning_line_and_ends_unfinished(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    """The client sees the stream end without its last chunk (the signal of a cut); the log has the
    server's line only, not uvicorn's own about the unfinished response too."""
    with serving(make_app(MidStreamFaults(engine), tmp_path, timeout=3)) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            client.post("/inference_zero_shot", **form(prompt, HOLD))
        wait_until(client, running=0, waiting=0)
    [record] = serve_records(caplog)
    assert record.levelno == logging.WARNING and re.fullmatch(
        r"/inference_zero_shot: stream cut after \d+ samples: synthesis took longer than the server's "
        r"timeout of 3 s", record.getMessage())
    err = capfd.readouterr().err
    assert "Traceback" not in err and UNFINISHED not in err


class FailsBeforeAudio(MidStreamFaults):
    """The engine, except that synthesis fails at once (a bug, not bad input)."""

    def stream(self, job: Any, pieces: Any, session: Any) -> Any:
        raise RuntimeError("injected: synthesis failed")


def test_an_unexpected_error_is_a_500_logged_once(engine: Engine, prompt: tuple[bytes, str], tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    with serving(make_app(FailsBeforeAudio(engine), tmp_path)) as client:
        response = client.post("/inference_zero_shot", **form(prompt))
    assert response.status_code == 500
    assert response.json()["detail"] == "internal error (RuntimeError); the server keeps serving"
    [record] = serve_records(caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "Traceback" not in capfd.readouterr().err


# --- upstream's spk2info endpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize(("path", "fields", "instead"), [
    ("/inference_sft", {"tts_text": SHORT, "spk_id": "中文女"}, "/inference_zero_shot"),
    ("/inference_instruct", {"tts_text": SHORT, "spk_id": "中文女", "instruct_text": "x"},
     "/inference_instruct2"),
])
def test_upstreams_spk2info_endpoints_answer_501_with_what_to_call(
        client: TestClient, method: str, path: str, fields: dict[str, str], instead: str) -> None:
    response = client.request(method, path, data=fields)  # as upstream's client sends them
    assert response.status_code == 501
    body = response.json()
    assert body["code"] == 501 and body["detail"] == body["error"] and "\n" not in body["detail"]
    assert body["detail"].startswith(f"{path} ") and "spk2info.pt" in body["detail"]
    assert f"for CosyVoice3 call {instead} " in body["detail"]


@pytest.fixture(scope="module")
def client(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with TestClient(make_app(engine, tmp_path_factory.mktemp("serve"))) as client:
        yield client


# --- CORS and the docs pages --------------------------------------------------------------------------------

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "x-api-key, content-type"}


def test_cors_is_off_by_default(client: TestClient) -> None:
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": ORIGIN}).headers
    preflight = client.options("/synthesize", headers=PREFLIGHT)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_cors_origins_may_call_the_api_from_a_browser(engine: Engine, tmp_path: Path) -> None:
    app = make_app(engine, tmp_path, cors_origins=(ORIGIN, "http://localhost:8080"), api_key=API_KEY)
    with TestClient(app) as client:
        preflight = client.options("/synthesize", headers=PREFLIGHT)  # a browser's, without the key
        refused = client.post("/synthesize", headers={"Origin": ORIGIN}, json={})
        allowed = client.get("/speakers", headers={"Origin": ORIGIN, "X-API-Key": API_KEY})
        other = client.get("/health", headers={"Origin": "https://elsewhere.example"})
        other_preflight = client.options("/synthesize", headers={**PREFLIGHT, "Origin": "https://elsewhere.example"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert {"x-api-key", "content-type"} <= set(preflight.headers["access-control-allow-headers"].lower()
                                                .replace(" ", "").split(","))
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "x-seed" in allowed.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-origin" not in other.headers and other_preflight.status_code == 400


def test_the_docs_pages_are_off_unless_asked_for_and_then_load_from_a_cdn(client: TestClient, engine: Engine,
                                                                        tmp_path: Path) -> None:
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200
    with TestClient(make_app(engine, tmp_path, docs=True)) as docs:
        page = docs.get("/docs")
        assert docs.get("/redoc").status_code == 200
    assert page.status_code == 200 and "https://cdn.jsdelivr.net/" in page.text  # as --help says


# --- the bridge's prompt paths ------------------------------------------------------------------------------


def test_prompt_paths_are_read_inside_prompt_dir_only(engine: Engine, prompt: tuple[bytes, str],
                                                      tmp_path: Path) -> None:
    folder, outside = tmp_path / "prompts", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "prompt.wav").write_bytes(prompt[0])
    (folder / "quiet.wav").write_bytes(SILENT)
    (outside / "secret.wav").write_bytes(prompt[0])
    (folder / "link.wav").symlink_to(outside / "secret.wav")
    (folder / "dir.wav").mkdir()

    def body(audio: str) -> dict[str, str]:
        return {"text": SHORT, "prompt_text": prompt[1], "prompt_audio": audio}

    with TestClient(make_app(engine, tmp_path)) as client:  # no --prompt-dir: base64 only, as before
        refused = client.post("/synthesize", json=body(str(folder / "prompt.wav"))).json()["detail"]
        assert refused.startswith("prompt_audio is not base64: send the audio file's bytes base64-encoded "
                                  "(server paths are not read)")
        by_value = client.post("/synthesize", json=body(base64.b64encode(prompt[0]).decode()))
    with TestClient(make_app(engine, tmp_path, prompt_dir=folder)) as client:
        by_name = client.post("/synthesize", json=body("prompt.wav"))
        answers = {name: client.post("/synthesize", json=body(name)).json()["detail"] for name in [
            str(folder / "quiet.wav"), "dir.wav/../quiet.wav", "../outside/secret.wav",
            str(outside / "secret.wav"),
            "link.wav", "missing.wav", "dir.wav", "/etc/ssl/openssl.cnf", "a\0b.wav", "voice"]}
    assert by_name.status_code == 200 and by_name.content == by_value.content  # the same prompt, read there
    quiet = "prompt_audio: the audio file is silent"
    assert answers[str(folder / "quiet.wav")].startswith(quiet)
    assert answers["dir.wav/../quiet.wav"].startswith(quiet)
    for name in ("../outside/secret.wav", str(outside / "secret.wav"), "link.wav", "/etc/ssl/openssl.cnf"):
        # the name as given, nothing of the folder or of where a link leads
        assert answers[name] == f"prompt_audio: {name!r} is outside the server's prompt folder", name
    for name in ("missing.wav", "dir.wav", "a\0b.wav"):
        assert answers[name] == f"prompt_audio: no readable file {name!r} in the server's prompt folder", name
    # no extension: read as base64, and the answer says what a path needs
    assert answers["voice"] == ("prompt_audio is not base64: send the audio file's bytes base64-encoded (or "
                                "the name of a file in the server's prompt folder, with its extension)")


# --- the options --------------------------------------------------------------------------------------------


def test_cuda_graphs_on_the_cpu_are_one_line_before_the_graphs_open(tmp_path: Path) -> None:
    result = CliRunner().invoke(serve_cli.serve, ["--speakers", str(tmp_path / "speakers"), "--model",
                                                  str(DEMO_BUNDLE), "--cuda-graphs"])
    assert result.exit_code == 2
    assert result.stderr == "error: cuda graphs are the cuda provider's, not 'cpu''s\n"


def test_stack_dit_on_an_int8_dit_is_one_line_before_the_graphs_open(tmp_path: Path) -> None:
    root = clone(DEMO_BUNDLE, tmp_path / "int8", lambda m: m["graphs"][DIT].__setitem__("precision", "int8"))
    result = CliRunner().invoke(serve_cli.serve, ["--speakers", str(tmp_path / "speakers"), "--model",
                                                  str(root), "--stack-dit"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: stack_dit: {root}'s {DIT} is int8, its activations quantized ")


def test_a_speakers_folder_the_server_cannot_use_is_one_line_before_the_bundle_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Any] = []
    monkeypatch.setattr(Engine, "open", lambda *args, **_: opened.append(args))
    (tmp_path / "file").write_text("")
    refusals = {tmp_path / "file" / "speakers": "cannot create the folder (Not a directory)"}
    if Path("/proc/self").is_dir():  # procfs: a folder nobody may write in, whoever runs the test
        refusals[Path("/proc")] = "cannot write in the folder ("
    for folder, why in refusals.items():
        result = CliRunner().invoke(serve_cli.serve, ["--speakers", str(folder), "--no-warm-up"])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"error: --speakers {folder}: {why}")
        assert result.stderr.count("\n") == 1
    # not given: named by what chose it, not as an option the user did not give
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    monkeypatch.delenv(SPEAKERS_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    default = tmp_path / "file" / ".local" / "share" / "cosyvoice" / "speakers"
    result = CliRunner().invoke(serve_cli.serve, ["--no-warm-up"])
    assert result.exit_code == 2 and result.stderr.startswith(
        f"error: the speakers folder {default} (the default; --speakers sets another): cannot create")
    monkeypatch.setenv(SPEAKERS_DIR_ENV, str(tmp_path / "file"))
    result = CliRunner().invoke(serve_cli.serve, ["--no-warm-up"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: ${SPEAKERS_DIR_ENV} {tmp_path / 'file'}: cannot create")
    assert opened == []


SERVE_PROBE = ("import atexit, sys\n"
               "atexit.register(lambda: print('fastapi loaded:', 'fastapi' in sys.modules))\n"
               "sys.argv[0] = 'cosyvoice-serve'\n"
               "from cosyvoice_serve.cli import main\n"
               "main()\n")
"""`cosyvoice-serve ARGS`, then whether it imported FastAPI, on stdout."""


def test_a_wrong_model_folder_is_one_line_before_fastapi_loads_and_the_speakers_folder_is_made(
        tmp_path: Path) -> None:
    none, empty, speakers = tmp_path / "none", tmp_path / "empty", tmp_path / "speakers"
    empty.mkdir()
    cases = [(["--model", str(none)], {}, f"{none} (--model): does not exist"),
             (["--model", str(empty)], {}, f"{empty} (--model): neither a runtime bundle (no manifest.json) "
              "nor a model bundle (no cosyvoice3.yaml)"),
             ([], {MODEL_DIR_ENV: str(none)}, f"{none} (${MODEL_DIR_ENV}): does not exist")]
    for args, env, says in cases:
        done = subprocess.run([sys.executable, "-c", SERVE_PROBE, *args, "--speakers", str(speakers)],
                              capture_output=True, text=True, timeout=60, check=False, env=os.environ | env)
        assert (done.returncode, done.stderr) == (2, f"error: {says}\n")
        assert done.stdout == "fastapi loaded: False\n"
    assert not speakers.exists()


def test_the_options_reach_the_settings(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    served: list[FastAPI] = []
    opened: list[dict[str, Any]] = []

    def open_engine(*_: Any, **options: Any) -> _Unclosable:
        opened.append(options)
        return _Unclosable(engine)

    def run(server: HttpServer, sockets: object = None) -> None:
        served.append(server.config.app)
        server.started = True

    monkeypatch.setattr(Engine, "open", open_engine)
    monkeypatch.setattr(HttpServer, "run", run)
    args = ["--speakers", str(tmp_path / "speakers"), "--max-body-mib", "3", "--cors-origin", ORIGIN,
            "--cors-origin", "http://localhost:8080", "--docs", "--prompt-dir", str(tmp_path),
            "--threads", "2", "--chunk-slots", "2", "--cuda-graphs", "--stack-dit", "--stack-vocoder"]
    result = CliRunner().invoke(serve_cli.serve, args)
    assert result.exit_code == 0, result.output
    assert opened[0]["threads"] == 2 and opened[0]["chunk_slots"] == 2 and opened[0]["cuda_graphs"]
    assert opened[0]["stack_dit"] and opened[0]["stack_vocoder"]
    settings = served[0].state.server.settings
    assert settings.chunk_slots == 2 and settings.cuda_graphs
    assert settings.stack_dit and settings.stack_vocoder
    assert settings.max_body_bytes == 3 << 20 and settings.docs and settings.prompt_dir == tmp_path
    assert settings.cors_origins == (ORIGIN, "http://localhost:8080")
    default = CliRunner().invoke(serve_cli.serve, ["--speakers", str(tmp_path / "speakers")])
    assert default.exit_code == 0 and served[1].state.server.settings == ServerSettings(
        speakers_dir=tmp_path / "speakers")
    refused = CliRunner().invoke(serve_cli.serve, ["--chunk-slots", "17"])
    assert refused.exit_code == 2 and "--chunk-slots" in refused.output and not opened[2:]
    with pytest.raises(ValueError, match="chunk_slots must be from 1 to 16, got 0"):
        ServerSettings(chunk_slots=0)
    help_text = " ".join(CliRunner().invoke(serve_cli.serve, ["--help"]).output.split())
    assert "upstream's server allows every origin" in help_text and "from a CDN" in help_text


# --- the server page's endpoint table (docs/server.md) ------------------------------------------------------

EXPECTED_STATUS = {"/inference_sft": 501, "/inference_instruct": 501}
"""Endpoints whose docs/server.md line shows the refusal; every other answers 2xx."""


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None,
                    reason="the server page's commands need curl and base64")
def test_every_command_of_the_server_pages_endpoint_table_works_as_written(tmp_path: Path) -> None:
    """Each endpoint row's curl line, run by bash against the real server from a folder holding the demo
    prompt as prompt.wav: speakers registered first and deleted last, as a reader would."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    shutil.copy(default[0], tmp_path / "prompt.wav")
    commands = readme_table_commands()
    assert len(commands) >= 10
    first = [c for c in commands if "localhost:50000/speakers -F " in c]
    last = [c for c in commands if "-X DELETE" in c]
    assert first and last
    ordered = first + [c for c in commands if c not in first and c not in last] + last
    port = free_port()
    with cosyvoice_serve(tmp_path, "--port", str(port)):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            wait_for_http(client)
        for command in ordered:
            line = command.replace("localhost:50000", f"127.0.0.1:{port}")
            line = line.replace("curl ", "curl -sS -w '\\n%{http_code}' ", 1)  # the status, last
            start = time.monotonic()
            done = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, (command, done.stderr)
            status = int(done.stdout.rsplit("\n", 1)[-1])
            path = re.search(r"localhost:50000(/[^\s?'\"]*)", command)
            assert path, command
            want = EXPECTED_STATUS.get(path.group(1))
            assert (status == want) if want else (200 <= status < 300), (command, status, done.stdout[-300:])
            print(f"{time.monotonic() - start:5.1f} s  {status}  {command[:90]}", file=sys.stderr)
