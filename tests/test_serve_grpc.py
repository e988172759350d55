"""`cosyvoice-serve --grpc` on the demo bundle: upstream's wire format, requests built as upstream's
`runtime/python/grpc/client.py` builds them, exactness against `cosyvoice-run --stream`, the bounded queue,
cancellation, the server's timeout, bad input, and the command itself."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc", reason="the serve extra is not installed")

import grpc
import httpx
import numpy as np
import soundfile as sf
from google.protobuf import descriptor_pb2
from test_serve import (
    API_KEY,
    FAIL,
    LONG,
    SHORT,
    MidStreamFaults,
    cosyvoice_run,
    cosyvoice_serve,
    free_port,
    metric,
    wait_for_http,
    wait_for_line,
)

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.frontend import load_wav
from cosyvoice_serve import Engine, ServerSettings
from cosyvoice_serve.auth import MISSING_KEY
from cosyvoice_serve.grpc_server import GrpcServer
from cosyvoice_serve.grpc_service import CosyVoiceService
from cosyvoice_serve.proto import cosyvoice_pb2, cosyvoice_pb2_grpc
from cosyvoice_serve.queue import ServerStopping, SessionQueue
from cosyvoice_serve.settings import API_KEY_ENV

PROMPT_RATE = 16000
INSTRUCTION = "Speak slowly."


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, str, Path]:
    """The demo prompt as upstream's client sends it (`load_wav(path, 16000)`, then
    `(x * 2**15).astype(np.int16).tobytes()`), its transcript, and a WAV of those samples (cosyvoice-run)."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    pcm = (load_wav(default[0], PROMPT_RATE) * 2**15).astype(np.int16)
    path = tmp_path_factory.mktemp("prompt") / "prompt16k.wav"
    sf.write(path, pcm, PROMPT_RATE, subtype="PCM_16")
    return pcm.tobytes(), default[1], path


@pytest.fixture(scope="module")
def expected(prompt: tuple[bytes, str, Path], tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """`cosyvoice-run --stream` on the 16 kHz prompt, zero-shot, greedy: the samples a client must get."""
    return cosyvoice_run(tmp_path_factory.mktemp("cli"), "--stream", "--text", SHORT,
                         "--prompt-wav", str(prompt[2]), "--prompt-text", prompt[1])


def upstream_request(mode: str, tts_text: str, prompt_audio: bytes = b"", prompt_text: str = "",
                     instruct_text: str = "", spk_id: str = "") -> cosyvoice_pb2.Request:
    """A request built as upstream's client.py builds it (and instruct2, ours, the same way)."""
    request = cosyvoice_pb2.Request()
    if mode == "sft":
        sft_request = cosyvoice_pb2.sftRequest()
        sft_request.spk_id = spk_id
        sft_request.tts_text = tts_text
        request.sft_request.CopyFrom(sft_request)
    elif mode == "zero_shot":
        zero_shot_request = cosyvoice_pb2.zeroshotRequest()
        zero_shot_request.tts_text = tts_text
        zero_shot_request.prompt_text = prompt_text
        zero_shot_request.prompt_audio = prompt_audio
        request.zero_shot_request.CopyFrom(zero_shot_request)
    elif mode == "cross_lingual":
        cross_lingual_request = cosyvoice_pb2.crosslingualRequest()
        cross_lingual_request.tts_text = tts_text
        cross_lingual_request.prompt_audio = prompt_audio
        request.cross_lingual_request.CopyFrom(cross_lingual_request)
    elif mode == "instruct":
        instruct_request = cosyvoice_pb2.instructRequest()
        instruct_request.tts_text = tts_text
        instruct_request.spk_id = spk_id
        instruct_request.instruct_text = instruct_text
        request.instruct_request.CopyFrom(instruct_request)
    elif mode == "instruct2":
        instruct2_request = cosyvoice_pb2.instruct2Request()
        instruct2_request.tts_text = tts_text
        instruct2_request.instruct_text = instruct_text
        instruct2_request.prompt_audio = prompt_audio
        request.instruct2_request.CopyFrom(instruct2_request)
    return request


def pcm(responses: Iterator[cosyvoice_pb2.Response]) -> np.ndarray:
    """The samples of a response stream, as upstream's client joins them."""
    return np.frombuffer(b"".join(r.tts_audio for r in responses), "<i2")


@contextmanager
def grpc_server(engine: Engine, sessions: SessionQueue | None = None, **settings: Any
                ) -> Iterator[GrpcServer]:
    """The gRPC server (greedy sampling) on a free loopback port, its event loop on a thread; its sessions
    in `sessions` (as HTTP's app shares its queue) where given."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = GrpcServer.start(engine, ServerSettings(sampling="greedy", **settings), "127.0.0.1", 0, sessions)
    server = asyncio.run_coroutine_threadsafe(start, loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@contextmanager
def grpc_serving(engine: Engine, **settings: Any) -> Iterator[tuple[cosyvoice_pb2_grpc.CosyVoiceStub,
                                                                    CosyVoiceService]]:
    """`grpc_server`'s stub and service."""
    with grpc_server(engine, **settings) as server, grpc.insecure_channel(server.address) as channel:
        yield cosyvoice_pb2_grpc.CosyVoiceStub(channel), server.service


def wait_for_sessions(service: CosyVoiceService, running: int, waiting: int, within: float = 5.0) -> None:
    start = time.monotonic()
    while (service.sessions.running, service.sessions.waiting) != (running, waiting):
        assert time.monotonic() - start < within, (service.sessions.running, service.sessions.waiting)
        time.sleep(0.02)


# --- the wire format ------------------------------------------------------------------------------------

STRING, BYTES, MESSAGE = (descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                          descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                          descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE)
UPSTREAM = {  # upstream's runtime/python/grpc/cosyvoice.proto: message -> (field, number, type)
    "Request": [("sft_request", 1, ".cosyvoice.sftRequest"),
                ("zero_shot_request", 2, ".cosyvoice.zeroshotRequest"),
                ("cross_lingual_request", 3, ".cosyvoice.crosslingualRequest"),
                ("instruct_request", 4, ".cosyvoice.instructRequest")],
    "sftRequest": [("spk_id", 1, STRING), ("tts_text", 2, STRING)],
    "zeroshotRequest": [("tts_text", 1, STRING), ("prompt_text", 2, STRING), ("prompt_audio", 3, BYTES)],
    "crosslingualRequest": [("tts_text", 1, STRING), ("prompt_audio", 2, BYTES)],
    "instructRequest": [("tts_text", 1, STRING), ("spk_id", 2, STRING), ("instruct_text", 3, STRING)],
    "Response": [("tts_audio", 1, BYTES)],
}


def test_the_proto_is_upstreams_wire_format_plus_instruct2(tmp_path: Path) -> None:
    proto = descriptor_pb2.FileDescriptorProto.FromString(cosyvoice_pb2.DESCRIPTOR.serialized_pb)
    assert proto.package == "cosyvoice" and proto.syntax == "proto3"
    [service] = proto.service
    [method] = service.method
    assert (service.name, method.name, method.input_type, method.output_type) == (
        "CosyVoice", "Inference", ".cosyvoice.Request", ".cosyvoice.Response")
    assert method.server_streaming and not method.client_streaming
    messages = {m.name: m for m in proto.message_type}
    for name, fields in UPSTREAM.items():
        have = {f.name: (f.number, f.type_name or f.type) for f in messages[name].field}
        assert {f: have[f] for f, _, _ in fields} == {f: (n, t) for f, n, t in fields}, name
    request = messages["Request"]
    assert [o.name for o in request.oneof_decl] == ["RequestPayload"]
    assert all(f.HasField("oneof_index") for f in request.field)
    assert {f.name: f.number for f in request.field} == {
        **{f: n for f, n, _ in UPSTREAM["Request"]}, "instruct2_request": 5}  # the only addition
    assert set(messages) == {*UPSTREAM, "instruct2Request"}
    assert [(f.name, f.number, f.type) for f in messages["instruct2Request"].field] == [
        ("tts_text", 1, STRING), ("instruct_text", 2, STRING), ("prompt_audio", 3, BYTES)]

    generate = pytest.importorskip("cosyvoice_serve.proto.generate", reason="needs grpcio-tools (dev extra)")
    generate.generate(tmp_path, descriptor_set=tmp_path / "set.pb")  # the committed modules are the .proto's
    [regenerated] = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file
    for message in regenerated.message_type:
        for field in message.field:
            field.ClearField("json_name")  # protoc fills it in descriptor sets, not in generated code
    assert regenerated == proto


# --- synthesis ------------------------------------------------------------------------------------------


def test_an_upstream_client_streams_the_samples_of_cosyvoice_run(
        engine: Engine, prompt: tuple[bytes, str, Path], expected: np.ndarray) -> None:
    with grpc_serving(engine) as (stub, _):
        call = stub.Inference(upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1]))
        responses = list(call)
        metadata = dict(call.initial_metadata())
        instructed = pcm(stub.Inference(upstream_request("instruct2", SHORT, prompt[0],
                                                         instruct_text=INSTRUCTION)))
    assert len(responses) >= 2  # chunk by chunk, as the runtime streams
    assert np.array_equal(pcm(iter(responses)), expected)
    assert metadata["x-sample-rate"] == "24000" and metadata["x-seed"].isdigit()
    assert instructed.size > 24000 // 2 and np.abs(instructed).max() > 0


def test_a_full_queue_answers_resource_exhausted_at_once_and_cancelled_calls_free_their_slots(
        engine: Engine, prompt: tuple[bytes, str, Path]) -> None:
    with grpc_serving(engine, max_concurrency=1, queue_depth=1) as (stub, service):
        # cross-lingual "Hi." carries the system prompt: 400 tokens, many seconds of work
        running = stub.Inference(upstream_request("cross_lingual", SHORT, prompt[0]))
        assert next(running).tts_audio  # the first chunk is here; the session goes on
        queued = stub.Inference(upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1]))
        wait_for_sessions(service, running=1, waiting=1)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as busy:
            list(stub.Inference(upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1])))
        assert time.monotonic() - start < 2.0  # at once, not after the sessions ahead (seconds)
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert busy.value.details().startswith("server busy")
        with pytest.raises(grpc.RpcError) as silent:  # a prompt that cannot prompt is refused as such
            list(stub.Inference(upstream_request("zero_shot", SHORT, bytes(32000), prompt_text=prompt[1])))
        assert silent.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is silent" in silent.value.details()
        queued.cancel()  # while queued: its session never runs
        wait_for_sessions(service, running=1, waiting=0)
        running.cancel()  # mid-utterance: its session stops
        wait_for_sessions(service, running=0, waiting=0)
        with pytest.raises(grpc.RpcError) as cancelled:
            list(running)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        again = upstream_request("instruct2", SHORT, prompt[0], instruct_text=INSTRUCTION)
        assert pcm(stub.Inference(again)).size > 0  # the freed slot serves the next request


def test_a_queue_shared_with_http_runs_grpcs_waiting_calls_until_grpc_stops_too(
        engine: Engine, prompt: tuple[bytes, str, Path], expected: np.ndarray) -> None:
    """HTTP's app stops first (its lifespan ends when its last request has): the gRPC call waiting behind a
    running one is still served within gRPC's grace; once gRPC has stopped, the queue takes no more."""
    sessions = SessionQueue(1, 1, 60.0)
    with grpc_server(engine, sessions) as server, grpc.insecure_channel(server.address) as channel:
        stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
        running = stub.Inference(upstream_request("cross_lingual", SHORT, prompt[0]))
        assert next(running).tts_audio
        queued = stub.Inference(upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1]))
        wait_for_sessions(server.service, running=1, waiting=1)
        sessions.shutdown()  # as HTTP's lifespan does
        assert pcm(running).size > 0
        assert np.array_equal(pcm(queued), expected)

    async def submit() -> None:
        sessions.submit(lambda session: iter(()))

    with pytest.raises(ServerStopping):
        asyncio.run(submit())


def test_the_servers_timeout_is_deadline_exceeded(engine: Engine, prompt: tuple[bytes, str, Path]) -> None:
    with grpc_serving(engine, timeout=0.3) as (stub, service):
        with pytest.raises(grpc.RpcError) as late:
            list(stub.Inference(upstream_request("zero_shot", LONG, prompt[0], prompt_text=prompt[1])))
        wait_for_sessions(service, running=0, waiting=0)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timeout of 0.3 s" in late.value.details()


def test_a_session_failing_mid_stream_ends_its_call_internal_and_frees_its_slot(
        engine: Engine, prompt: tuple[bytes, str, Path], expected: np.ndarray) -> None:
    with grpc_serving(MidStreamFaults(engine), max_concurrency=1, queue_depth=0) as (stub, service):
        call = stub.Inference(upstream_request("zero_shot", FAIL, prompt[0], prompt_text=prompt[1]))
        assert next(call).tts_audio  # the first chunk came...
        with pytest.raises(grpc.RpcError) as failed:
            list(call)  # ...then the status, after the audio
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert failed.value.details() == "internal error (RuntimeError); the server keeps serving"
        wait_for_sessions(service, running=0, waiting=0)
        request = upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1])
        assert np.array_equal(pcm(stub.Inference(request)), expected)  # the one slot serves the next call


# --- bad input --------------------------------------------------------------------------------------------

INVALID, UNIMPLEMENTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED
BAD_REQUESTS = [
    ("empty text", ("zero_shot", "  "), {"prompt_text": "x"}, INVALID, "zero_shot_request.tts_text is empty"),
    ("no transcript", ("zero_shot", "Hi."), {}, INVALID, "zero_shot_request.prompt_text is empty"),
    ("no instruction", ("instruct2", "Hi."), {}, INVALID, "instruct2_request.instruct_text is empty"),
    ("too long", ("cross_lingual", "a" * 101), {}, INVALID,
     "cross_lingual_request.tts_text has 101 characters; the limit is 100"),
    ("no prompt", ("cross_lingual", "Hi."), {"prompt_audio": b""}, INVALID,
     "cross_lingual_request.prompt_audio is empty"),
    ("odd bytes", ("cross_lingual", "Hi."), {"prompt_audio": b"\0\0\0"}, INVALID,
     "cross_lingual_request.prompt_audio has 3 bytes, not a whole number of 16-bit samples"),
    ("short prompt", ("instruct2", "Hi."), {"prompt_audio": bytes(200), "instruct_text": "x"}, INVALID,
     "instruct2_request.prompt_audio: the recording is too short"),
    *[(f"{name} file prompt", ("cross_lingual", "Hi."), {"prompt_audio": magic + bytes(1000)}, INVALID,
       f"cross_lingual_request.prompt_audio holds {name} file; send the recording's samples")
      for magic, name in ((b"RIFF", "a WAV"), (b"fLaC", "a FLAC"), (b"OggS", "an Ogg"), (b"ID3", "an MP3"))],
    ("30 s and a sample", ("cross_lingual", "Hi."), {"prompt_audio": bytes(2 * (30 * PROMPT_RATE + 1))},
     INVALID, "cross_lingual_request.prompt_audio: the recording lasts over 30 s; the speech tokenizer "
              "takes at most 30 s"),
    *[(f"{quality} prompt, {kind}", (kind, "Hi."), {"prompt_audio": audio, **fields}, INVALID,
       f"{kind}_request.prompt_audio: the recording is {problem}")
      for kind, fields in (("zero_shot", {"prompt_text": "x"}), ("cross_lingual", {}),
                           ("instruct2", {"instruct_text": "x"}))
      for quality, audio, problem in (
          ("silent", bytes(2 * PROMPT_RATE), "silent or nearly so (RMS level -inf dBFS)"),
          ("0.2 s", (0.3 * 2**15 * np.sin(np.arange(PROMPT_RATE // 5) * 0.2)).astype("<i2").tobytes(),
           "too short (0.200 s)"))],
    ("nothing to speak", ("cross_lingual", "😀。"), {}, INVALID,
     "cross_lingual_request.tts_text has nothing to speak after normalisation"),
    ("no kind", ("none", "Hi."), {}, INVALID, "RequestPayload is empty"),
    ("sft", ("sft", "Hi."), {"spk_id": "中文女"}, UNIMPLEMENTED, "sft_request needs a built-in speaker"),
    ("instruct", ("instruct", "Hi."), {"spk_id": "中文女", "instruct_text": "x"}, UNIMPLEMENTED,
     "instruct_request (CosyVoice-300M's instruct) needs a built-in speaker"),
]


@pytest.fixture(scope="module")
def stub(engine: Engine) -> Iterator[cosyvoice_pb2_grpc.CosyVoiceStub]:
    with grpc_serving(engine, max_text_chars=100) as (stub, _):
        yield stub


@pytest.mark.parametrize(("request_args", "fields", "code", "detail"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_one_line_naming_the_field(
        stub: cosyvoice_pb2_grpc.CosyVoiceStub, prompt: tuple[bytes, str, Path],
        request_args: tuple[str, str], fields: dict[str, Any], code: grpc.StatusCode, detail: str) -> None:
    request = upstream_request(*request_args, **{"prompt_audio": prompt[0], **fields})
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Inference(request))
    assert error.value.code() == code
    assert error.value.details().startswith(detail) and "\n" not in error.value.details()


def test_a_bad_seed_is_invalid_argument(stub: cosyvoice_pb2_grpc.CosyVoiceStub,
                                        prompt: tuple[bytes, str, Path]) -> None:
    request = upstream_request("instruct2", SHORT, prompt[0], instruct_text=INSTRUCTION)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Inference(request, metadata=(("seed", "-1"),)))
    assert error.value.code() == INVALID
    assert error.value.details() == f"seed metadata must be an integer from 0 to {2**63 - 1}, got '-1'"


def test_bytes_that_are_no_request_are_invalid_argument_and_log_no_traceback(
        engine: Engine, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """A call whose bytes protobuf cannot parse (garbage, a string field that is not UTF-8) is refused in one
    line, not grpc's UNKNOWN with the parser's traceback logged; without the key, UNAUTHENTICATED."""
    text = b"\x0a\x02\xff\xfe"  # cross_lingual_request.tts_text, two bytes that are no UTF-8
    bodies = {"garbage": b"\xff\xff\xff", "not UTF-8": b"\x1a" + bytes([len(text)]) + text}
    reasons = {"garbage": "Error parsing message with type 'cosyvoice.Request'",  # protobuf's own words
               "not UTF-8": "cross_lingual_request.tts_text: not UTF-8 text (byte 0xff at offset 0: invalid "
                            "start byte)"}  # the field named as the .proto names it
    for settings, code in (({}, INVALID), ({"api_key": API_KEY}, grpc.StatusCode.UNAUTHENTICATED)):
        with grpc_server(engine, **settings) as server, grpc.insecure_channel(server.address) as channel:
            call = channel.unary_stream("/cosyvoice.CosyVoice/Inference")  # the bytes as they are
            for name, body in bodies.items():
                with pytest.raises(grpc.RpcError) as refused:
                    list(call(body, timeout=10))
                assert refused.value.code() == code, name
                if code == INVALID:
                    assert refused.value.details().startswith("the call's bytes are not a cosyvoice.Request: "
                                                              + reasons[name])
    assert "Traceback" not in caplog.text + capfd.readouterr().err


def test_an_api_key_is_required_as_metadata(engine: Engine, prompt: tuple[bytes, str, Path]) -> None:
    request = upstream_request("zero_shot", "  ", prompt[0], prompt_text="x")  # bad input: no synthesis
    with grpc_serving(engine, api_key=API_KEY) as (stub, _):
        for metadata in [(), (("x-api-key", "wrong"),), (("authorization", "Bearer wrong"),),
                         (("authorization", API_KEY),)]:
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Inference(request, metadata=metadata))
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAUTHENTICATED,
                                                                       MISSING_KEY)
        for metadata in [(("x-api-key", API_KEY),), (("authorization", f"Bearer {API_KEY}"),)]:
            with pytest.raises(grpc.RpcError) as passed:  # past the key, the service answers
                list(stub.Inference(request, metadata=metadata))
            assert passed.value.code() == INVALID, metadata


# --- the command ------------------------------------------------------------------------------------------


def test_cosyvoice_serve_grpc_serves_until_interrupted(engine: Engine, prompt: tuple[bytes, str, Path],
                                                       expected: np.ndarray, tmp_path: Path) -> None:
    port = free_port()
    with cosyvoice_serve(tmp_path, "--grpc", "--port", str(port), "--max-conc", "2") as (server, lines):
        seen = wait_for_line(lines, "cosyvoice.CosyVoice on")
        assert f"gRPC: cosyvoice.CosyVoice on 127.0.0.1:{port}" in seen[-1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):  # the port is taken
            asyncio.run(GrpcServer.start(engine, ServerSettings(), "127.0.0.1", port))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
            request = upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1])
            assert np.array_equal(pcm(stub.Inference(request)), expected)
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0


def test_http_and_grpc_in_one_process_share_the_engine_and_the_queue(
        prompt: tuple[bytes, str, Path], expected: np.ndarray, tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    key = (("x-api-key", API_KEY),)
    args = ("--port", str(http_port), "--grpc-port", str(grpc_port), "--max-conc", "1", "--queue", "0")
    with cosyvoice_serve(tmp_path, *args, env={API_KEY_ENV: API_KEY}) as (server, lines), \
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", headers={"X-API-Key": API_KEY},
                         timeout=60) as client, grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        seen = wait_for_line(lines, "cosyvoice.CosyVoice on")
        assert f"gRPC: cosyvoice.CosyVoice on 127.0.0.1:{grpc_port} beside HTTP" in seen[-1]
        wait_for_http(client)
        stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
        request = upstream_request("zero_shot", SHORT, prompt[0], prompt_text=prompt[1])
        # cross-lingual "Hi." carries the system prompt: 400 tokens, many seconds of work
        with client.stream("POST", "/inference_cross_lingual", data={"tts_text": SHORT},
                           files={"prompt_wav": ("p.wav", prompt[2].read_bytes(), "audio/wav")}) as running:
            chunks = running.iter_raw()  # (kept: dropping the iterator would close the stream)
            assert running.status_code == 200 and next(chunks)  # HTTP holds the one slot...
            with pytest.raises(grpc.RpcError) as busy:
                list(stub.Inference(request, metadata=key))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # ...which gRPC shares
        start = time.monotonic()  # closed mid-utterance: the session stops and frees the slot
        while (sessions := client.get("/health").json()["sessions"])["running"]:
            assert time.monotonic() - start < 10, sessions
            time.sleep(0.02)
        assert np.array_equal(pcm(stub.Inference(request, metadata=key)), expected)
        with pytest.raises(grpc.RpcError) as refused:  # the key from the environment guards gRPC too
            list(stub.Inference(request))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # HTTP's metrics count the gRPC calls too: the busy one (rejected, an error), the one that
        # streamed (a success); the unauthenticated one never reached the service; HTTP's stream closed
        # mid-utterance is a cancelled session, neither success nor error
        text = client.get("/metrics").text
        counts = {name: metric(text, f"tts_{name}") for name in
                  ("requests_total", "requests_success", "requests_error", "requests_rejected",
                   "sessions_cancelled")}
        assert counts == {"requests_total": 3, "requests_success": 1, "requests_error": 1,
                          "requests_rejected": 1, "sessions_cancelled": 1}
        assert metric(text, "tts_first_chunk_latency_seconds_count") == 2  # HTTP's stream and gRPC's
        assert metric(text, "tts_rtf_count") == 1
        server.send_signal(signal.SIGINT)  # stops both
        assert server.wait(30) == 0
        output = "".join(seen) + "".join(iter(lines.get, ""))
    assert "Traceback" not in output and API_KEY not in output
