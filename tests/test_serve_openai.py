"""The OpenAI-style endpoints through the official `openai` SDK, against `cosyvoice-serve` in a process of its
own on the demo bundle: every `response_format` decodes to the stream's samples (the lossless ones exactly;
the compressed encoders, fed chunk by chunk, keep a tone),
the body streams as it is synthesised, SSE events carry the same audio and the usage, the standard voices
work before any speaker is registered and a registered speaker of the same name comes first, the models and
voices are listed, our `stream` field and `speed` still work, errors reach the SDK, an optional field's null
is its default, the API key is the SDK's, and the server page's commands (docs/server.md) run as written."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
openai = pytest.importorskip("openai", reason="the official openai SDK is not installed (the dev extra)")
av = pytest.importorskip("av", reason="PyAV is not installed (the serve extra)")

import httpx
import numpy as np
import soundfile as sf
from test_serve import (
    API_KEY,
    LONG,
    SHORT,
    cosyvoice_serve,
    free_port,
    make_app,
    readme_command,
    serving,
    wait_for_http,
)

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_serve import Engine
from cosyvoice_serve.formats import FORMATS
from cosyvoice_serve.routes_openai import MODEL_IDS, STANDARD_VOICES

RATE = 24000
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg; codecs=opus", "aac": "audio/aac",
               "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}
PADDING = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 0}
"""Samples a compressed stream may decode to beyond the input: the encoder's delay and its last frame's
padding (MP3 and AAC in a stream carry neither length nor delay; Ogg Opus carries both)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`cosyvoice-serve` on the demo bundle (greedy, no speakers yet): its base URL."""
    folder = tmp_path_factory.mktemp("openai")
    port = free_port()
    with cosyvoice_serve(folder, "--port", str(port)):
        base_url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url) as client:
            wait_for_http(client)
        yield base_url


@pytest.fixture(scope="module")
def sdk(server: str) -> Any:
    """The official client, pointed at the server (which wants no key: any will do)."""
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pcm(sdk: Any) -> np.ndarray:
    """`Hi.` in the standard voice alloy as raw PCM16 (the reference of every other format)."""
    response = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="pcm")
    assert response.response.headers["content-type"] == "audio/pcm"
    return np.frombuffer(response.content, "<i2")


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Any of the formats decoded by FFmpeg, as mono int16 at 24 kHz (Opus decodes at 48 kHz), and the
    rate it was decoded at."""
    to_pcm16 = av.AudioResampler(format="s16", layout="mono", rate=RATE)
    with av.open(io.BytesIO(data)) as container:
        frames = [out for frame in container.decode(audio=0) for out in to_pcm16.resample(frame)]
        rate = container.streams.audio[0].rate
    frames += to_pcm16.resample(None)
    return np.concatenate([frame.to_ndarray() for frame in frames], axis=1)[0], rate


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac"])
def test_the_compressed_encoders_fed_chunk_by_chunk_keep_a_tone(response_format: str) -> None:
    phase = 2 * np.pi * np.arange(2 * RATE) / RATE
    tone = (0.3 * np.sin(220 * phase) + 0.2 * np.sin(1234 * phase)).astype(np.float32)
    reference = np.round(tone * 32767).astype(np.int16)
    encoder = FORMATS[response_format].encoder(RATE)
    data = b"".join(encoder.encode(tone[i:i + 5000]) for i in range(0, len(tone), 5000)) + encoder.finish()
    decoded, _ = decode(data)
    assert len(reference) <= len(decoded) <= len(reference) + PADDING[response_format]
    x = reference.astype(np.float64)
    lags = np.correlate(decoded[:PADDING["mp3"] + 4800].astype(np.float64), x[:4800], "valid")
    lag = int(np.argmax(lags))  # the encoder's delay
    y = decoded[lag:lag + len(x)].astype(np.float64)
    assert np.dot(x[:len(y)], y) / np.linalg.norm(x[:len(y)]) / np.linalg.norm(y) > 0.99


# --- response formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_response_format_decodes_to_the_streamed_samples(sdk: Any, pcm: np.ndarray, server: str,
                                                               response_format: str) -> None:
    assert httpx.get(f"{server}/speakers").json() == []  # a standard voice, with no speaker registered
    streamed = {"stream": True} if response_format == "flac" else None  # a FLAC is whole unless asked
    with sdk.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=SHORT,
                                                         response_format=response_format,
                                                         extra_body=streamed) as response:
        assert response.headers["content-type"] == MEDIA_TYPES[response_format]
        assert response.headers["x-sample-rate"] == str(RATE)
        data = response.read()
    if response_format == "pcm":
        assert np.array_equal(np.frombuffer(data, "<i2"), pcm)
        return
    samples, rate = decode(data)
    if response_format == "wav":  # a streamed WAV's unknown sizes: libsndfile reads to the end
        assert np.array_equal(sf.read(io.BytesIO(data), dtype="int16")[0], pcm)
    if response_format in ("wav", "flac"):  # lossless: the same samples
        assert rate == RATE and np.array_equal(samples, pcm)
        return
    assert rate == (2 * RATE if response_format == "opus" else RATE)
    assert len(pcm) <= len(samples) <= len(pcm) + PADDING[response_format]
    print(f"{response_format}: {len(data)} bytes, {len(samples)} samples for {len(pcm)}")


def test_mp3_is_openais_default_and_a_whole_file_knows_its_length(sdk: Any, server: str, pcm: np.ndarray
                                                                  ) -> None:
    streamed = sdk.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=SHORT)
    assert streamed.response.headers["content-type"] == "audio/mpeg"
    assert "x-audio-duration" not in streamed.response.headers  # unknown while it streams
    whole = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, extra_body={"stream": False})
    samples, rate = decode(whole.content)
    # Offline synthesis (upstream's non-streaming path): the LAME tag gives the exact length.
    assert rate == RATE and len(samples) == len(pcm)
    assert float(whole.response.headers["x-audio-duration"]) == pytest.approx(len(pcm) / RATE, abs=1e-3)
    wav, flac = (sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format=f,
                                         extra_body={"stream": False}).content for f in ("wav", "flac"))
    offline = sf.read(io.BytesIO(wav), dtype="int16")[0]
    assert np.array_equal(sf.read(io.BytesIO(flac), dtype="int16")[0], offline)  # its length in STREAMINFO
    flac_default = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="flac")
    assert float(flac_default.response.headers["x-audio-duration"]) == pytest.approx(len(offline) / RATE,
                                                                                      abs=1e-3)
    assert np.array_equal(sf.read(io.BytesIO(flac_default.content), dtype="int16")[0], offline)


def test_a_streamed_flac_leaves_its_length_unknown(sdk: Any, pcm: np.ndarray) -> None:
    """Why a FLAC is whole unless `stream` asks: libsndfile reads a FLAC whose STREAMINFO gives no total
    length as one of 2**63 - 1 frames, which `soundfile` cannot read."""
    streamed = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="flac",
                                       extra_body={"stream": True}).content
    assert np.array_equal(decode(streamed)[0], pcm)
    assert sf.info(io.BytesIO(streamed)).frames == 2**63 - 1


def test_the_body_is_sent_as_it_is_synthesised(sdk: Any) -> None:
    arrivals: list[tuple[float, int]] = []
    start = time.monotonic()
    with sdk.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=LONG,
                                                         response_format="opus") as response:
        for data in response.iter_bytes():
            arrivals.append((time.monotonic() - start, len(data)))
    first, last = arrivals[0][0], arrivals[-1][0]
    print(f"{len(arrivals)} pieces; the first after {first:.2f} s, the last after {last:.2f} s")
    assert len(arrivals) > 2 and first < last / 2  # 13.6 s of audio in several chunks


# --- server-sent events -------------------------------------------------------------------------------


def events(body: str) -> list[dict[str, Any]]:
    """The JSON of each `data:` line of an event stream."""
    return [json.loads(line.removeprefix("data: ")) for line in body.splitlines()
            if line.startswith("data: ")]


def test_sse_events_carry_the_streamed_audio_and_the_usage(sdk: Any, pcm: np.ndarray) -> None:
    response = sdk.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=SHORT,
                                       response_format="pcm", stream_format="sse")
    assert response.response.headers["content-type"].startswith("text/event-stream")
    received = events(response.text)
    *deltas, done = received
    assert {event["type"] for event in deltas} == {"speech.audio.delta"} and len(deltas) >= 2  # two chunks
    assert set(deltas[0]) == {"type", "audio"}
    audio = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    assert np.array_equal(np.frombuffer(audio, "<i2"), pcm)
    usage = done["usage"]
    assert done["type"] == "speech.audio.done"
    assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}
    assert usage["output_tokens"] == 60  # SHORT's speech tokens on the demo model
    assert usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    mp3 = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, stream_format="sse")
    *deltas, _ = events(mp3.text)
    samples, _ = decode(b"".join(base64.b64decode(event["audio"]) for event in deltas))
    assert len(pcm) <= len(samples) <= len(pcm) + PADDING["mp3"]


# --- voices and models ------------------------------------------------------------------------------------


def test_models_and_voices_are_listed(sdk: Any, server: str) -> None:
    models = sdk.models.list()
    assert [model.id for model in models.data] == list(MODEL_IDS)
    assert {"cosyvoice3", "tts-1", "tts-1-hd"} <= {model.id for model in models.data}
    assert sdk.models.retrieve("tts-1").owned_by == models.data[0].owned_by
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("whisper-1")
    voices = httpx.get(f"{server}/v1/audio/voices").json()["voices"]
    assert [v["id"] for v in voices] == list(STANDARD_VOICES) and not any(v["registered"] for v in voices)
    assert {"alloy", "ash", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer"} <= {
        v["id"] for v in voices}


def test_every_standard_voice_is_the_bundles_prompt_voice(sdk: Any, pcm: np.ndarray) -> None:
    nova = sdk.audio.speech.create(model="tts-1", voice="nova", input=SHORT, response_format="pcm")
    assert np.array_equal(np.frombuffer(nova.content, "<i2"), pcm)
    by_id = sdk.audio.speech.create(model="tts-1", voice={"id": "shimmer"}, input=SHORT,
                                    response_format="pcm")
    assert by_id.content == nova.content  # the SDK's custom-voice object


def test_a_registered_speaker_comes_before_the_standard_voice_of_its_name(sdk: Any, server: str,
                                                                         pcm: np.ndarray) -> None:
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    added = httpx.post(f"{server}/speakers", data={"name": "alloy", "prompt_text": "Another transcript."},
                       files={"prompt_wav": ("p.wav", default[0].read_bytes(), "audio/wav")}, timeout=60)
    assert added.status_code == 201, added.text
    try:
        voices = httpx.get(f"{server}/v1/audio/voices").json()["voices"]
        assert voices[0] == {"id": "alloy", "name": "alloy", "registered": True}
        assert [v["id"] for v in voices].count("alloy") == 1
        theirs = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="pcm")
        assert not np.array_equal(np.frombuffer(theirs.content, "<i2"), pcm)  # its own transcript
    finally:
        assert httpx.delete(f"{server}/speakers/alloy").status_code == 204
    again = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="pcm")
    assert np.array_equal(np.frombuffer(again.content, "<i2"), pcm)


# --- our own fields, errors, the key ----------------------------------------------------------------------


def test_our_stream_field_and_speed_still_work(sdk: Any, pcm: np.ndarray) -> None:
    streamed = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="pcm",
                                       extra_body={"stream": True})
    assert np.array_equal(np.frombuffer(streamed.content, "<i2"), pcm)
    fast = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="wav",
                                   speed=2.0)
    samples, rate = sf.read(io.BytesIO(fast.content), dtype="int16")
    assert rate == RATE and len(samples) == len(pcm) // 2  # offline, at twice the speed
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, speed=2.0,
                                extra_body={"stream": True})
    assert refused.value.body["message"].startswith("speed works only without stream")
    for speed, frames in ((0.25, 4 * len(pcm)), (4.0, len(pcm) // 4)):  # OpenAI's range, its ends
        audio = sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="pcm",
                                        speed=speed).content
        assert abs(len(audio) // 2 - frames) <= 480  # the mel stretched to int(frames / speed): a frame
    for speed in (0.24, 4.01):
        with pytest.raises(openai.UnprocessableEntityError):
            sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, speed=speed)


def test_errors_reach_the_sdk(sdk: Any) -> None:
    """The SDK raises its error class of the status with the server's one-line message (OpenAI's error shape:
    the exception's text, and `body` the error object with its `param`)."""
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.audio.speech.create(model="tts-1", voice="nobody", input=SHORT)
    error = unknown.value
    message = error.body["message"]
    assert message.startswith("voice: unknown speaker 'nobody'") and "alloy" in message
    assert error.message == f"Error code: 400 - {error.body['message']}"
    assert (error.type, error.param, error.code) == ("invalid_request_error", "voice", None)
    with pytest.raises(openai.UnprocessableEntityError) as bad_format:
        sdk.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="ogg")
    assert bad_format.value.body["message"].startswith("response_format: Input should be 'mp3', 'opus'")
    assert bad_format.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as empty:
        sdk.audio.speech.create(model="tts-1", voice="alloy", input=" ", stream_format="sse")
    assert empty.value.body["message"] == "input is empty" and empty.value.param == "input"
    with pytest.raises(openai.NotFoundError) as model:
        sdk.models.retrieve("whisper-1")
    assert "unknown model 'whisper-1'" in str(model.value)


def test_an_optional_field_sent_as_null_takes_its_default(server: str) -> None:
    """As in OpenAI's API (its SDKs may send null for a field left unset); a required field's null is an
    error naming it, the voice's as any value that is no voice."""
    fields = {"input": SHORT, "voice": "alloy"}
    nulls = dict.fromkeys(("model", "instructions", "response_format", "speed", "stream_format", "stream",
                           "seed"))
    default = httpx.post(f"{server}/v1/audio/speech", json=fields, timeout=60)
    null = httpx.post(f"{server}/v1/audio/speech", json={**fields, **nulls}, timeout=60)
    assert null.status_code == default.status_code == 200, null.text
    assert null.headers["content-type"] == "audio/mpeg" and null.content == default.content
    expected = "voice: expected a speaker name (a string) or an object with an id (a string), got "
    for voice, got in ((None, "null"), (5, "a number"), ([], "an array"), ({"id": 5}, "an object without "
                                                                                       "a string id")):
        refused = httpx.post(f"{server}/v1/audio/speech", json={**fields, "voice": voice}).json()["error"]
        assert (refused["message"], refused["param"]) == (expected + got, "voice")
    refused = httpx.post(f"{server}/v1/audio/speech", json={**fields, "input": None}).json()["error"]
    assert (refused["message"], refused["param"]) == ("input: Input should be a valid string", "input")


def test_only_the_openai_routes_answer_in_openais_shape(server: str) -> None:
    """Open WebUI lists the speech models at /v1/audio/models; every other route keeps our error body."""
    assert httpx.get(f"{server}/v1/audio/models").json() == {
        "models": [{"id": name, "name": name} for name in MODEL_IDS]}
    ours = httpx.post(f"{server}/inference_zero_shot", data={"tts_text": "Hi."}).json()
    assert set(ours) == {"detail", "error", "code"}
    theirs = httpx.post(f"{server}/v1/audio/speech", json={"voice": "alloy"}).json()
    assert theirs == {"error": {"message": "input: Field required", "type": "invalid_request_error",
                                "param": "input", "code": None}}


def test_the_sdks_api_key_is_the_servers(engine: Engine, tmp_path: Path) -> None:
    with serving(make_app(engine, tmp_path, api_key=API_KEY)) as client:
        base_url = f"{str(client.base_url).rstrip('/')}/v1"
        keyed = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
        assert [model.id for model in keyed.models.list().data] == list(MODEL_IDS)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()


# --- the server page ----------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="the server page's commands need curl")
def test_the_server_pages_openai_commands_work(server: str, tmp_path: Path) -> None:
    host = server.removeprefix("http://")
    for marker in ('"voice": "alloy"}', '"stream_format": "sse"', "localhost:50000/v1/models"):
        command = readme_command(marker).replace("localhost:50000", host)
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (command, done.stderr)
        if marker.startswith('"stream_format"'):
            assert events(done.stdout)[-1]["type"] == "speech.audio.done"
        elif "models" in marker:
            assert json.loads(done.stdout)["object"] == "list"
    samples, rate = decode((tmp_path / "out.mp3").read_bytes())
    assert rate == RATE and len(samples) > 0
