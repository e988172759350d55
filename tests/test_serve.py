"""`cosyvoice-serve` on the demo bundle: every endpoint over HTTP, exactness against `cosyvoice-run`,
speakers across a restart, the schema, the API key, the queue under load, client disconnects, a session
failing mid-stream, 16 streams at concurrency 4 with the server's memory, bad and malformed input,
metrics, settings."""

from __future__ import annotations

import asyncio
import base64
import errno
import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="httpx, the server tests' client, is not installed (the dev extra)")

import httpx
import numpy as np
import soundfile as sf
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from cosyvoice_graphs.bundle_layout import MODEL_YAML
from cosyvoice_runtime import bundle_source
from cosyvoice_runtime.bundle import ModelDims, RuntimeBundle
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV, MODEL_DIR_ENV
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.dit_graphs import GraphedDit
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.flow_prefix import prompt_key
from cosyvoice_runtime.frontend import PromptFeatures, zero_shot_prompt
from cosyvoice_runtime.sampling import Sampling
from cosyvoice_runtime.segments import Segment
from cosyvoice_runtime.speakers import LOCK, REGISTRY, SpeakerRegistry, frontend_fingerprint
from cosyvoice_runtime.synthesis import Mode
from cosyvoice_serve import Engine, ServerSettings, create_app
from cosyvoice_serve import cli as serve_cli
from cosyvoice_serve.app import ROUTERS
from cosyvoice_serve.auth import MISSING_KEY, OPEN_PATHS
from cosyvoice_serve.engine import (
    WARM_UP_CHUNKS,
    WARM_UP_ROUNDS_REPLAYED,
    BundlePrompt,
    SynthesisJob,
    decode_upload,
)
from cosyvoice_serve.http_server import HttpServer
from cosyvoice_serve.queue import ServerStopping, Session
from cosyvoice_serve.routes_bridge import MISSING_PROMPT
from cosyvoice_serve.settings import API_KEY_ENV, PORT_ENV, read_dotenv

SHORT = "Hi."
"""60 speech tokens on the demo model (2.4 s of audio, two streamed chunks): about a second of work."""
LONG = "Hello there, this is a test of the server."
"""340 speech tokens (13.6 s of audio): several seconds of work, long enough to interrupt."""
API_KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def prompt() -> tuple[bytes, str]:
    """The demo bundle's prompt recording (file bytes) and transcript."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    return default[0].read_bytes(), default[1]


def make_app(engine: Engine, folder: Path, **settings: Any) -> FastAPI:
    """An app with greedy sampling (exact comparisons) and its speakers in `folder`."""
    return create_app(engine, ServerSettings(speakers_dir=folder / "speakers", sampling="greedy", **settings))


def form(prompt: tuple[bytes, str], text: str = SHORT) -> dict[str, Any]:
    """Upstream's zero-shot form fields and upload, as its client sends them."""
    return {"data": {"tts_text": text, "prompt_text": prompt[1]},
            "files": {"prompt_wav": ("prompt_wav", prompt[0], "application/octet-stream")}}


def metric(text: str, name: str) -> float:
    """A metric's value in the Prometheus text format."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def metrics_once(client: httpx.Client, name: str, value: float) -> str:
    """The server's /metrics once `name` has reached `value` (within 10 s)."""
    deadline = time.monotonic() + 10
    while metric(text := client.get("/metrics").text, name) < value:
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return text


@contextmanager
def serving(app: FastAPI) -> Iterator[httpx.Client]:
    """`app` on uvicorn on a free loopback port (a real socket, for streaming and disconnects)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def cosyvoice_serve(folder: Path, *args: str, env: dict[str, str] | None = None
                    ) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str]]]:
    """`cosyvoice-serve ARGS` on the demo bundle (greedy, its speakers in `folder`) in a process of its own,
    and its stderr's lines (read on a thread, so that the pipe never fills up; "" at the end). Killed at the
    end if still running."""
    command = [sys.executable, "-c", "from cosyvoice_serve.cli import main; main()", "--model",
               str(DEMO_BUNDLE), "--sampling", "greedy", "--speakers", str(folder / "speakers"), *args]
    env = {**{k: v for k, v in os.environ.items() if k != MODEL_DIR_ENV}, **(env or {})}
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env) as server:
        lines: queue.Queue[str] = queue.Queue()

        def read_stderr() -> None:
            for line in server.stderr or ():
                lines.put(line)
            lines.put("")

        threading.Thread(target=read_stderr, daemon=True).start()
        try:
            yield server, lines
        finally:
            server.kill()


def wait_for_line(lines: queue.Queue[str], text: str, within: float = 60) -> list[str]:
    """The lines up to the first that holds `text` (fails if the process ends first)."""
    seen: list[str] = []
    while text not in (seen or [""])[-1]:
        seen.append(lines.get(timeout=within))
        assert seen[-1], f"cosyvoice-serve ended: {''.join(seen)}"
    return seen


def wait_for_http(client: httpx.Client, within: float = 30) -> None:
    """Return once the server answers `GET /health` (fails after `within` seconds)."""
    start = time.monotonic()
    while True:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.ConnectError:
            pass
        assert time.monotonic() - start < within, "the HTTP server did not start"
        time.sleep(0.05)


# --- upstream's endpoints ----------------------------------------------------------------------------


def cosyvoice_run(folder: Path, *args: str) -> np.ndarray:
    """`cosyvoice-run` on the demo bundle and its prompt, greedy: the samples of its WAV (int16)."""
    out = folder / "cli.wav"
    args = ("--model", str(DEMO_BUNDLE), "--sampling", "greedy", "--out", str(out), *args)
    result = CliRunner().invoke(run_main, args)
    assert result.exit_code == 0, result.output
    samples, rate = sf.read(out, dtype="int16")
    assert rate == 24000
    return samples


@pytest.fixture(scope="module")
def cli_stream(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """`cosyvoice-run --stream --text Hi.` (zero-shot, the demo prompt)."""
    return cosyvoice_run(tmp_path_factory.mktemp("cli"), "--stream", "--text", SHORT)


def test_zero_shot_stream_equals_cosyvoice_run_stream(engine: Engine, prompt: tuple[bytes, str],
                                                      cli_stream: np.ndarray, tmp_path: Path) -> None:
    with TestClient(make_app(engine, tmp_path)) as client:
        response = client.request("GET", "/inference_zero_shot", **form(prompt))  # upstream's client uses GET
    assert response.status_code == 200, response.text
    assert response.headers["x-sample-rate"] == "24000" and response.headers["x-seed"].isdigit()
    assert np.array_equal(np.frombuffer(response.content, "<i2"), cli_stream)


def test_a_flow_window_streams_as_cosyvoice_run_does(prompt: tuple[bytes, str], cli_stream: np.ndarray,
                                                      tmp_path: Path) -> None:
    """`cosyvoice-serve --flow-window all` streams what `cosyvoice-run --stream --flow-window all` does: the
    same samples, which are not upstream's (the final chunk runs against the caches)."""
    policy = ChunkPolicy(flow="window", flow_window=None)
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", chunk_policy=policy)
    try:
        with TestClient(make_app(engine, tmp_path)) as client:
            response = client.post("/inference_zero_shot", **form(prompt))
    finally:
        engine.close()
    assert response.status_code == 200, response.text
    served = np.frombuffer(response.content, "<i2")
    windowed = cosyvoice_run(tmp_path, "--stream", "--flow-window", "all", "--text", SHORT)
    assert np.array_equal(served, windowed)
    assert len(served) == len(cli_stream) and not np.array_equal(served, cli_stream)


def test_concurrent_sessions_share_one_synthesizer_exactly(engine: Engine, prompt: tuple[bytes, str],
                                                          cli_stream: np.ndarray, tmp_path: Path) -> None:
    with serving(make_app(engine, tmp_path, max_concurrency=2)) as client, ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: client.post("/inference_zero_shot", **form(prompt)), range(2)))
        text = client.get("/metrics").text
    assert [r.status_code for r in both] == [200, 200]
    assert all(np.array_equal(np.frombuffer(r.content, "<i2"), cli_stream) for r in both)
    assert metric(text, "tts_synthesis_duration_seconds_count") == 2


def test_concurrent_sessions_share_openvino_runners_exactly(prompt: tuple[bytes, str], tmp_path: Path
                                                           ) -> None:
    """`--provider openvino`: each thread has its own infer request, so two sessions at once get what
    `cosyvoice-run --provider openvino` gives."""
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    (tmp_path / "cli").mkdir()
    want = cosyvoice_run(tmp_path / "cli", "--stream", "--text", SHORT, "--provider", "openvino")
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", provider="openvino")
    try:
        with serving(make_app(engine, tmp_path, max_concurrency=2)) as client, ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: client.post("/inference_zero_shot", **form(prompt)), range(2)))
    finally:
        engine.close()
    assert [r.status_code for r in both] == [200, 200]
    assert all(np.array_equal(np.frombuffer(r.content, "<i2"), want) for r in both)


def test_instruct2_streams_pcm(engine: Engine, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    with TestClient(make_app(engine, tmp_path)) as client:
        response = client.post("/inference_instruct2", data={"tts_text": SHORT, "instruct_text": "Slowly."},
                               files={"prompt_wav": ("p.wav", prompt[0], "audio/wav")})
    assert response.status_code == 200, response.text
    pcm = np.frombuffer(response.content, "<i2")
    assert len(response.content) % 2 == 0 and pcm.size > 24000 // 2 and np.abs(pcm).max() > 0


# --- the bridge's API ---------------------------------------------------------------------------------


def test_synthesize_is_cosyvoice_run_offline_as_a_wav(engine: Engine, prompt: tuple[bytes, str],
                                                     tmp_path: Path) -> None:
    expected = cosyvoice_run(tmp_path, "--text", SHORT)
    audio = base64.b64encode(prompt[0]).decode()
    with TestClient(make_app(engine, tmp_path)) as client:
        zero_shot = {"text": SHORT, "prompt_audio": audio, "prompt_text": prompt[1]}
        normal = client.post("/synthesize", json=zero_shot)
        fast = client.post("/synthesize", json={**zero_shot, "speed": 2.0})
        instructed = client.post("/synthesize", json={"text": SHORT, "prompt_audio": f"data:;base64,{audio}"})
        # blank fields count as not given, as an empty one does: the default instruction, or the speaker
        blanks = [client.post("/synthesize", json={"text": SHORT, "prompt_audio": audio, "seed": 1, **fields})
                  for fields in ({}, {"instruct": " ", "speaker": "\t", "prompt_text": " "},
                                 {"instruct": "Speak naturally in English."},
                                 {"speaker": "Speak fast."}, {"instruct": " ", "speaker": "Speak fast."})]
        missing = client.post("/synthesize", json={"text": SHORT, "prompt_text": prompt[1]})
    assert normal.status_code == 200 and normal.headers["content-type"] == "audio/wav"
    samples, rate = sf.read(io.BytesIO(normal.content), dtype="int16")
    assert np.array_equal(samples, expected)
    assert float(normal.headers["x-audio-duration"]) == pytest.approx(len(samples) / rate, abs=1e-3)
    assert len(sf.read(io.BytesIO(fast.content))[0]) == len(samples) // 2  # the same tokens, half the mel
    assert instructed.status_code == 200, instructed.text  # instruct2, "Speak naturally in English."
    assert len(sf.read(io.BytesIO(instructed.content))[0]) > 0
    assert all(r.status_code == 200 for r in blanks), [r.text for r in blanks]
    assert blanks[0].content == blanks[1].content == blanks[2].content != blanks[3].content
    assert blanks[3].content == blanks[4].content
    assert missing.status_code == 400
    assert missing.json()["detail"] == MISSING_PROMPT == missing.json()["error"]


def readme_table_commands() -> list[str]:
    """The commands of the endpoint table of the server's page (docs/server.md), in order: each row's last
    cell, one code span (a `\\|` in it, GitHub's escape of a pipe in a table, read as `|`)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "server.md").read_text(encoding="utf-8")
    return [m.group(1).replace("\\|", "|") for m in re.finditer(r"^\|.*\| `([^`]+)` \|$", text, re.MULTILINE)]


def readme_command(marker: str) -> str:
    """The command of the README's endpoint table that holds `marker`."""
    return next(command for command in readme_table_commands() if marker in command)


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None,
                    reason="the README's command needs curl and base64")
def test_the_readmes_synthesize_command_works_with_a_long_prompt(tmp_path: Path) -> None:
    """The README's /synthesize command line, run by bash as written against the real server, with a
    prompt whose base64 is longer than one command-line argument may be (128 KiB on Linux)."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    wav = default[0]
    assert sf.info(wav).duration > 3 and len(base64.b64encode(wav.read_bytes())) > 128 * 1024
    shutil.copy(wav, tmp_path / "prompt.wav")
    command = readme_command("localhost:50000/synthesize")
    port = free_port()
    with cosyvoice_serve(tmp_path, "--port", str(port)):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            wait_for_http(client)
        done = subprocess.run(["bash", "-c", command.replace("localhost:50000", f"127.0.0.1:{port}")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    samples, rate = sf.read(tmp_path / "out.wav", dtype="int16")  # a WAV, not an error's JSON body
    assert rate == 24000 and len(samples) > 0


# --- speakers and the OpenAI-style endpoint ----------------------------------------------------------


def test_a_speakers_folder_that_refuses_a_write_is_one_line(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full: 507; read-only or gone: 500; the cause named, no traceback for the client, the registry kept."""
    def refuse(code: int) -> Callable[..., Any]:
        def write(*_: Any) -> Any:
            raise OSError(code, os.strerror(code))
        return write

    with TestClient(make_app(engine, tmp_path)) as client:
        register = {"data": {"name": "demo", "prompt_text": prompt[1]},
                    "files": {"prompt_wav": ("p.wav", prompt[0], "audio/wav")}}
        assert client.post("/speakers", **register).status_code == 201
        monkeypatch.setattr(SpeakerRegistry, "add", refuse(errno.ENOSPC))
        full = client.post("/speakers", **{**register, "data": {"name": "other", "prompt_text": prompt[1]}})
        assert full.status_code == 507
        assert full.json()["detail"] == ("the server's speakers folder cannot be written: No space left on "
                                         "device")
        monkeypatch.setattr(SpeakerRegistry, "remove", refuse(errno.EROFS))
        read_only = client.delete("/speakers/demo")
        assert read_only.status_code == 500
        assert read_only.json()["detail"] == ("the server's speakers folder cannot be written: Read-only "
                                              "file system")
        assert client.get("/speakers").json() == ["demo"]


def test_speakers_serve_v1_audio_speech_and_persist_across_a_restart(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    speech = {"input": SHORT, "voice": "demo", "response_format": "pcm", "stream": True}
    with TestClient(make_app(engine, tmp_path)) as client:
        added = client.post("/speakers", data={"name": "demo", "prompt_text": prompt[1]},
                            files={"prompt_wav": ("p.wav", prompt[0], "audio/wav")})
        assert added.status_code == 201, added.text
        assert added.json()["prompt_text"] == prompt[1] and client.get("/speakers").json() == ["demo"]
        streamed = client.post("/v1/audio/speech", json=speech)
        uploaded = client.post("/inference_zero_shot", **form(prompt))
        wav = client.post("/v1/audio/speech", json={**speech, "response_format": "wav", "stream": False})
    assert streamed.status_code == 200 and streamed.headers["content-type"] == "audio/pcm"
    assert streamed.content == uploaded.content  # registered features = the upload's, same stream
    samples, rate = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert wav.headers["content-type"] == "audio/wav" and rate == 24000 and len(samples) > 0

    with TestClient(make_app(engine, tmp_path)) as client:  # a restart: a new app on the same folder
        assert client.get("/speakers").json() == ["demo"]
        assert client.get("/health").json()["speakers"] == ["demo"]
        assert client.post("/v1/audio/speech", json=speech).content == streamed.content
        assert client.delete("/speakers/demo").status_code == 204
        unknown = client.post("/v1/audio/speech", json=speech)
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"].startswith("voice: unknown speaker 'demo'")
        assert client.delete("/speakers/demo").status_code == 404
    with TestClient(make_app(engine, tmp_path)) as client:
        assert client.get("/speakers").json() == []
    assert sorted(p.name for p in (tmp_path / "speakers").iterdir()) == [REGISTRY, LOCK]  # no features left


def upstream_spk2info_entry(engine: Engine, prompt: tuple[bytes, str]) -> dict[str, Any]:
    """An entry of `spk2info.pt` as upstream's `add_zero_shot_spk(prompt_text, prompt_wav, spk_id)` keeps it
    for CosyVoice3 (prompt_text "You are a helpful assistant.<|endofprompt|>" + transcript) and `save_spkinfo`
    writes it: the keys, shapes and dtypes of `frontend_zero_shot` (the features of the demo prompt, computed
    by our front end)."""
    import torch

    features = engine.extract(decode_upload(prompt[0], "prompt_wav"))
    text = torch.tensor([engine.voice.tokenizer.encode(zero_shot_prompt(prompt[1]))], dtype=torch.int32)
    tokens = torch.from_numpy(features.speech_tokens).to(torch.int32)
    mel, embedding = torch.from_numpy(features.mel), torch.from_numpy(features.embedding)

    def length(tensor: torch.Tensor) -> torch.Tensor:
        return torch.tensor([tensor.shape[1]], dtype=torch.int32)

    entry = {"prompt_text": text, "prompt_text_len": length(text),
             "llm_prompt_speech_token": tokens, "llm_prompt_speech_token_len": length(tokens),
             "flow_prompt_speech_token": tokens, "flow_prompt_speech_token_len": length(tokens),
             "prompt_speech_feat": mel, "prompt_speech_feat_len": length(mel),
             "llm_embedding": embedding, "flow_embedding": embedding}
    assert tokens.shape == (1, tokens.shape[1]) and mel.shape == (1, 2 * tokens.shape[1], 80)
    assert embedding.shape == (1, 192) and mel.dtype == embedding.dtype == torch.float32
    return entry


def export_speakers(spk2info: Path, out: Path, model: Path = DEMO_BUNDLE) -> Any:
    """`cosyvoice-export speakers SPK2INFO --out OUT --model MODEL`, its result."""
    from cosyvoice_export.cli import main as export_main

    args = ["speakers", str(spk2info), "--out", str(out), "--model", str(model)]
    return CliRunner().invoke(export_main, args)


def refusal(result: Any) -> str:
    """The one line of a refused command, exit status 2 and nothing else on stdout or stderr."""
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.output
    return str(result.stderr.rstrip("\n"))


@pytest.mark.torch
def test_upstream_spk2info_speakers_are_converted_and_served_from_start(
        engine: Engine, prompt: tuple[bytes, str], cli_stream: np.ndarray, tmp_path: Path) -> None:
    import torch

    spk2info = tmp_path / "spk2info.pt"
    torch.save({"upstream_spk": upstream_spk2info_entry(engine, prompt)}, spk2info)
    converted = export_speakers(spk2info, tmp_path / "speakers")
    assert converted.exit_code == 0, converted.output
    assert converted.output.endswith(f"1 speakers added to {tmp_path / 'speakers'}\n")
    speech = {"input": SHORT, "voice": "upstream_spk", "response_format": "pcm", "stream": True}
    with TestClient(make_app(engine, tmp_path)) as client:  # a server started on that folder
        assert client.get("/speakers").json() == ["upstream_spk"]
        speaker = client.get("/speakers/upstream_spk").json()
        streamed = client.post("/v1/audio/speech", json=speech)
    assert speaker["prompt_text"] == zero_shot_prompt(prompt[1])  # the ids decoded, <|endofprompt|> kept
    assert streamed.status_code == 200, streamed.text
    # Upstream's stored features and prompt ids: the same stream as a zero-shot upload of the prompt.
    assert np.array_equal(np.frombuffer(streamed.content, "<i2"), cli_stream)

    sft = tmp_path / "sft.pt"  # upstream's built-in voices: an x-vector only, nothing to clone from
    torch.save({"中文女": {"embedding": torch.zeros(1, 192)}}, sft)
    refused = refusal(export_speakers(sft, tmp_path / "speakers"))
    assert refused.startswith(f"error: {sft}: speaker '中文女': lacks prompt_text, ")
    assert "(an sft speaker" in refused


def test_spk2info_is_checked_before_a_model_bundle_is_exported(tiny_bundle: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the tokenizer and model constants the export will have: a model bundle's export takes
    minutes."""
    import torch

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the bundle was exported"))
    sft = tmp_path / "sft.pt"
    torch.save({"中文女": {"embedding": torch.zeros(1, 192)}}, sft)
    assert refusal(export_speakers(sft, tmp_path / "speakers", tiny_bundle)).startswith(
        f"error: {sft}: speaker '中文女': lacks prompt_text, ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.pt"]


@pytest.mark.torch
def test_spk2info_in_other_precisions_and_torchs_legacy_format_is_converted_to_float32(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    import torch

    entry = upstream_spk2info_entry(engine, prompt)
    embedding, mel = entry["llm_embedding"].bfloat16(), entry["prompt_speech_feat"].half()
    spk2info = tmp_path / "spk2info.pt"
    torch.save({"low": {**entry, "llm_embedding": embedding, "flow_embedding": embedding,
                        "prompt_speech_feat": mel}}, spk2info)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert export_speakers(spk2info, tmp_path / "speakers").exit_code == 0
        # the legacy format, pickled with a protocol torch warns about though it reads it
        torch.save({"legacy": entry}, spk2info, _use_new_zipfile_serialization=False, pickle_protocol=3)
        caught.clear()
        converted = export_speakers(spk2info, tmp_path / "speakers")
    assert converted.exit_code == 0 and converted.stderr == "", converted.output
    assert [str(w.message) for w in caught] == []
    registry = SpeakerRegistry(tmp_path / "speakers", frontend_fingerprint(engine.voice.bundle))
    low = registry.get("low")
    assert low is not None and low.features.embedding.dtype == low.features.mel.dtype == np.float32
    assert np.array_equal(low.features.embedding, embedding.float().numpy())
    assert np.array_equal(low.features.mel, mel.float().numpy())
    assert registry.names() == ["legacy", "low"]


def poked(tensor: Any, value: float) -> Any:
    """`tensor` with its first element `value`."""
    flat = tensor.flatten().clone()  # a copy, whatever the strides
    flat[0] = value
    return flat.reshape(tensor.shape)


def entry_with(entry: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`spk2info.pt` of one speaker 's', its `entry` with `changes` (`tokens`, `embedding`: the llm_ and
    flow_ keys alike)."""
    for short, keys in (("tokens", ("llm_prompt_speech_token", "flow_prompt_speech_token")),
                        ("embedding", ("llm_embedding", "flow_embedding"))):
        if short in changes:
            changes |= dict.fromkeys(keys, changes.pop(short))
    return {"s": {**entry, **changes}}


Make = Callable[[dict[str, Any], ModelDims], object]
"""`spk2info.pt`'s contents made from a valid entry, for a bundle of those dims."""
NAN, INF = float("nan"), float("inf")
SPK2INFO_REFUSALS = [  # contents that cannot be served, and the start of the refusal after the file's name
    pytest.param(lambda e, _: entry_with(e, prompt_speech_feat=poked(e["prompt_speech_feat"], NAN)),
                 "speaker 's': prompt_speech_feat has 1 NaN or infinite values of ", id="mel NaN"),
    pytest.param(lambda e, _: entry_with(e, prompt_speech_feat=poked(e["prompt_speech_feat"].double(), 1e99)),
                 "speaker 's': prompt_speech_feat has 1 NaN or infinite ", id="mel float64 beyond float32"),
    pytest.param(lambda e, _: entry_with(e, embedding=poked(e["llm_embedding"], INF)),
                 "speaker 's': llm_embedding has 1 NaN or infinite values of 192", id="x-vector inf"),
    pytest.param(lambda e, _: entry_with(e, flow_embedding=poked(e["llm_embedding"], NAN)),
                 "speaker 's': flow_embedding differs from its llm_ counterpart", id="flow x-vector NaN"),
    pytest.param(lambda e, _: entry_with(e, tokens=e["llm_prompt_speech_token"] * 0 + 999999),
                 "speaker 's': llm_prompt_speech_token has ids from 999999 to 999999; the bundle's speech "
                 "codebook has 0 to {last_token}", id="speech tokens huge"),
    pytest.param(lambda e, _: entry_with(e, tokens=poked(e["llm_prompt_speech_token"], -5)),
                 "speaker 's': llm_prompt_speech_token has ids from -5 to ", id="a speech token negative"),
    pytest.param(lambda e, d: entry_with(e, tokens=poked(e["llm_prompt_speech_token"], d.speech_token_size)),
                 "speaker 's': llm_prompt_speech_token has ids from ", id="a speech token a stop id"),
    pytest.param(lambda e, _: entry_with(e, tokens=e["llm_prompt_speech_token"][0, 0]),
                 "speaker 's': llm_prompt_speech_token is int32 (), expected integer ",
                 id="speech tokens a scalar"),
    pytest.param(lambda e, _: entry_with(e, prompt_text=poked(e["prompt_text"], -1)),
                 "speaker 's': prompt_text has ids from -1 to ", id="a text id negative"),
    pytest.param(lambda e, _: entry_with(e, prompt_text=e["prompt_text"] * 0 + 10**9),
                 "speaker 's': prompt_text has ids from 1000000000 to 1000000000; the bundle's tokenizer has "
                 "0 to {last_text_id}", id="text ids beyond the vocabulary"),
    pytest.param(lambda e, _: entry_with(e, prompt_speech_feat=e["prompt_speech_feat"].chalf()),
                 "speaker 's': prompt_speech_feat is torch.complex32, neither an integer nor a float",
                 id="mel complex32", marks=pytest.mark.filterwarnings("ignore:ComplexHalf support")),
    pytest.param(lambda e, _: {"dave": e, " dave": e}, "speakers 'dave' and ' dave' are both named 'dave' "
                 "(names are stripped); rename one", id="names equal once stripped"),
    pytest.param(lambda e, _: {5: e}, "speaker 5: the speaker id is int, not str", id="an int id"),
    pytest.param(lambda e, _: {("a", "b"): e}, "speaker ('a', 'b'): the speaker id is tuple, not str",
                 id="a tuple id"),
]


@pytest.mark.torch
@pytest.mark.parametrize(("make", "why"), SPK2INFO_REFUSALS)
def test_spk2info_that_cannot_be_served_is_one_line_and_nothing_written(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, make: Make, why: str) -> None:
    import torch

    spk2info = tmp_path / "spk2info.pt"
    dims = engine.voice.bundle.dims
    torch.save(make(upstream_spk2info_entry(engine, prompt), dims), spk2info)
    last = {"last_token": dims.speech_token_size - 1, "last_text_id": len(engine.voice.tokenizer) - 1}
    line = refusal(export_speakers(spk2info, tmp_path / "speakers"))
    assert line.startswith(f"error: {spk2info}: {why.format(**last)}"), line
    assert list(tmp_path.iterdir()) == [spk2info]


@pytest.mark.torch
def test_a_file_that_is_not_torchs_is_named_as_such(engine: Engine, prompt: tuple[bytes, str], tmp_path: Path
                                                    ) -> None:
    import pickle

    import torch

    spk2info = tmp_path / "spk2info.pt"
    torch.save({"s": upstream_spk2info_entry(engine, prompt)}, spk2info)
    whole = spk2info.read_bytes()
    not_torch = "not a torch file (neither torch.save's zip archive nor its legacy pickle); expected "
    files: dict[bytes, str] = {
        b"": "empty file; expected upstream's spk2info.pt",
        b"hello, not a pickle\n": not_torch,
        b'{"speakers": {}}\n': not_torch,
        pickle.dumps({"s": {"prompt_text": [1, 2]}}): not_torch,  # a plain pickle: torch warns, then refuses
        whole[:len(whole) // 2]: "a torch file that cannot be read as speakers (its zip archive is cut short",
    }
    for content, why in files.items():
        spk2info.write_bytes(content)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = refusal(export_speakers(spk2info, tmp_path / "speakers"))
        assert line.startswith(f"error: {spk2info}: {why}"), (content[:20], line)
        assert [str(w.message) for w in caught] == []
    assert list(tmp_path.iterdir()) == [spk2info]


@pytest.mark.torch
def test_an_out_folder_that_cannot_be_written_is_one_line_before_the_file_is_read(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    (tmp_path / "file").write_text("")
    refusals = {tmp_path / "file" / "speakers": f"{tmp_path / 'file'} is not a folder"}
    if Path("/proc/self").is_dir():  # procfs: a folder nobody may write in, whoever runs the test
        refusals[Path("/proc/speakers")] = ""
    for out, why in refusals.items():  # neither the file nor the bundle exists: --out is judged first
        line = refusal(export_speakers(tmp_path / "no-such.pt", out, tmp_path / "no-bundle"))
        assert line.startswith(f"error: --out {out}: {why}"), line
    spk2info = tmp_path / "spk2info.pt"
    torch.save({"a": upstream_spk2info_entry(engine, prompt)}, spk2info)

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(SpeakerRegistry, "add", full)  # a folder that fills up after the check
    assert refusal(export_speakers(spk2info, tmp_path / "speakers")) == (
        f"error: {tmp_path / 'speakers'}: cannot write in the folder (No space left on device); 0 of 1 "
        "speakers added")


def test_a_crash_while_registering_leaves_the_registry_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    features = PromptFeatures(np.arange(4, dtype=np.int64)[None], np.zeros((1, 8, 80), np.float32),
                              np.ones((1, 192), np.float32))
    SpeakerRegistry(tmp_path, "fp").add("first", "one", features)
    before = (tmp_path / REGISTRY).read_text()
    real_replace = os.replace

    def crash_on_registry(src: str, dst: str) -> None:
        if Path(dst).name == REGISTRY:
            raise KeyboardInterrupt  # the process dies between the features file and the registry
        real_replace(src, dst)

    monkeypatch.setattr("os.replace", crash_on_registry)
    with pytest.raises(KeyboardInterrupt):
        SpeakerRegistry(tmp_path, "fp").add("second", "two", features)
    monkeypatch.undo()
    assert (tmp_path / REGISTRY).read_text() == before
    assert len(list(tmp_path.glob("*.npz"))) == 2  # the second speaker's features, not referenced
    registry = SpeakerRegistry(tmp_path, "fp")
    assert registry.names() == ["first"]
    assert len(list(tmp_path.glob("*.npz"))) == 2  # reading removes nothing: another may be writing
    left = [tmp_path / f".{REGISTRY}.0badc0de.tmp", tmp_path / ".0123456789abcdef-01234567.npz.c0ffee00.tmp"]
    for path in left:  # what a write that died before its rename leaves
        path.write_bytes(b"half")
    registry.tidy()
    assert len(list(tmp_path.glob("*.npz"))) == 1  # the orphan is gone, the registry's file kept
    assert not any(path.exists() for path in left)
    speaker = registry.get("first")
    assert speaker is not None and np.array_equal(speaker.features.speech_tokens, features.speech_tokens)
    assert SpeakerRegistry(tmp_path, "other front end").names() == []


# --- the app and its schema ----------------------------------------------------------------------------


def api_routes() -> list[APIRoute]:
    """Every route `create_app` serves (FastAPI's docs and schema aside)."""
    return [route for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)]


def refs(node: object) -> Iterator[str]:
    """Every `$ref` in a JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def test_the_app_builds_without_warnings_and_its_openapi_lists_every_route(engine: Engine, tmp_path: Path
                                                                            ) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = make_app(engine, tmp_path)
        with TestClient(app) as client:
            response = client.get("/openapi.json")
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.") and schema["info"]["title"] == "cosyvoice-serve"
    operations = {(method.upper(), path): operation for path, item in schema["paths"].items()
                  for method, operation in item.items()}
    routes = {(method, route.path) for route in api_routes() if route.include_in_schema
              for method in route.methods}
    assert set(operations) == routes
    assert {("GET", "/inference_zero_shot"), ("POST", "/inference_zero_shot")} <= routes  # upstream's methods
    ids = [operation["operationId"] for operation in operations.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert all(operation.get("responses") for operation in operations.values())
    components = schema["components"]["schemas"]
    assert all(ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components
               for ref in refs(schema))
    for method in ("get", "post"):  # both describe upstream's form
        body = schema["paths"]["/inference_zero_shot"][method]["requestBody"]["content"]
        [form_schema] = [components[ref.rsplit("/", 1)[1]] for ref in refs(body["multipart/form-data"])]
        assert set(form_schema["required"]) == {"tts_text", "prompt_text", "prompt_wav"}
    # the bodies the server sends: audio where it answers audio, and its own error body, not FastAPI's list
    answers = {(path, method): operation["responses"] for (method, path), operation in operations.items()}
    assert set(answers["/inference_zero_shot", "POST"]["200"]["content"]) == {"application/octet-stream"}
    assert set(answers["/synthesize", "POST"]["200"]["content"]) == {"audio/wav"}
    assert {"audio/mpeg", "audio/flac", "text/event-stream"} <= set(answers["/v1/audio/speech", "POST"]["200"]
                                                                     ["content"])
    assert "HTTPValidationError" not in components
    assert set(components["ErrorBody"]["properties"]) == {"detail", "error", "code"}
    assert list(refs(answers["/synthesize", "POST"]["422"])) == ["#/components/schemas/ErrorBody"]
    assert list(refs(answers["/v1/audio/speech", "POST"]["422"])) == ["#/components/schemas/OpenAIErrorBody"]


# --- the API key ---------------------------------------------------------------------------------------


def test_an_api_key_guards_every_endpoint_but_health_and_the_page(
        engine: Engine, prompt: tuple[bytes, str], cli_stream: np.ndarray, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(engine, tmp_path, api_key=API_KEY)
    routes = [(method, re.sub(r"{\w+}", "x", route.path)) for route in api_routes()
              for method in sorted(route.methods)]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no-such-path")]
    refused = {"detail": MISSING_KEY, "error": MISSING_KEY, "code": 401}
    refused_openai = {"error": {"message": MISSING_KEY, "type": "invalid_request_error", "param": None,
                                "code": "invalid_api_key"}}
    wrong = [{}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"},
             {"Authorization": f"Basic {API_KEY}"}, {"Authorization": API_KEY}]
    with TestClient(app) as client:
        for open_path in sorted(OPEN_PATHS):
            assert client.get(open_path).status_code == 200, open_path
        for method, path in routes:
            if path in OPEN_PATHS:
                continue
            for headers in wrong:
                response = client.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.text)
                want = refused_openai if path.startswith("/v1/") else refused
                assert response.json() == want and response.headers["www-authenticate"] == "Bearer"
        assert client.get("/speakers", headers={"Authorization": f"bearer  {API_KEY} "}).json() == []
        # the open probe tells no speakers or model path to a request without the key
        assert not {"speakers", "model"} & set(client.get("/health").json())
        assert {"speakers", "model"} <= set(client.get("/health", headers={"X-API-Key": API_KEY}).json())
        streamed = client.post("/inference_zero_shot", headers={"x-api-key": API_KEY}, **form(prompt))
        text = client.get("/metrics", headers={"X-API-Key": API_KEY}).text
    assert streamed.status_code == 200 and np.array_equal(np.frombuffer(streamed.content, "<i2"), cli_stream)
    assert metric(text, "tts_requests_total") == 1  # refused requests are not synthesis requests
    assert API_KEY not in caplog.text and API_KEY not in repr(app.state.server.settings)


def test_a_method_a_synthesis_route_lacks_is_not_counted_as_a_synthesis_request(engine: Engine,
                                                                               tmp_path: Path) -> None:
    with TestClient(make_app(engine, tmp_path)) as client:
        put = client.put("/v1/audio/speech", json={"input": "Hello.", "voice": "alloy"})
        delete = client.delete("/inference_zero_shot")
        text = client.get("/metrics").text
    assert put.status_code == 405 == delete.status_code
    assert metric(text, "tts_requests_total") == 0 == metric(text, "tts_requests_error")


def test_head_is_answered_where_get_reads_and_refused_where_it_would_synthesise(engine: Engine,
                                                                              tmp_path: Path) -> None:
    """HEAD, as uptime checks and `wget --spider` send it: the GET's status and headers, no body (uvicorn's
    part); on a synthesis route, whose GET synthesises, a 405 as before."""
    with serving(make_app(engine, tmp_path)) as client:
        for path in ("/health", "/", "/metrics", "/v1/models", "/v1/audio/voices", "/speakers",
                     "/openapi.json"):
            get, head = client.get(path), client.head(path)
            assert head.status_code == 200 == get.status_code, path
            assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
        assert client.head("/speakers/none").status_code == 404 == client.get("/speakers/none").status_code
        synthesis = client.head("/inference_zero_shot")
        assert synthesis.status_code == 405
        text = client.get("/metrics").text
    assert metric(text, "tts_requests_total") == 0


# --- behaviour under load -------------------------------------------------------------------------------


def wait_until(client: httpx.Client, running: int, waiting: int, within: float = 5.0) -> float:
    """Seconds until /health shows `running` and `waiting` sessions (fails after `within`)."""
    start = time.monotonic()
    while True:
        sessions = client.get("/health").json()["sessions"]
        if (sessions["running"], sessions["waiting"]) == (running, waiting):
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"sessions stay at {sessions}"
        time.sleep(0.02)


def test_the_queue_is_bounded_and_clients_that_leave_free_their_sessions(
        engine: Engine, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    app = make_app(MidStreamFaults(engine), tmp_path, max_concurrency=1, queue_depth=1)
    with serving(app) as client, ThreadPoolExecutor(1) as pool:
        with client.stream("POST", "/inference_zero_shot", **form(prompt, HOLD)) as running:
            assert running.status_code == 200
            chunks = running.iter_raw()
            assert next(chunks)  # the first chunk is here, the session goes on
            # text with nothing to speak is refused for what it is, before it waits for the session ahead
            start = time.monotonic()
            silent = client.post("/inference_zero_shot", **form(prompt, "😀。"), timeout=5)
            assert time.monotonic() - start < 2.0
            assert silent.status_code == 400
            assert silent.json()["detail"] == "tts_text has nothing to speak after normalisation"
            queued = pool.submit(client.post, "/inference_zero_shot", **form(prompt), timeout=1.5)
            wait_until(client, running=1, waiting=1)
            start = time.monotonic()
            busy = client.post("/inference_zero_shot", **form(prompt))
            assert time.monotonic() - start < 2.0  # at once, not after the sessions ahead (seconds)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["detail"].startswith("server busy")
            registration = client.post("/speakers", data={"name": "late", "prompt_text": prompt[1]},
                                       files={"prompt_wav": ("p.wav", prompt[0], "audio/wav")})
            assert registration.status_code == 503  # refused too, but not a synthesis request counted
            # a recording that cannot prompt is refused for what it is, before it asks for a session
            unreadable = (b"not audio", prompt[1])
            bad = client.post("/inference_zero_shot", **form(unreadable))
            assert bad.status_code == 400 and bad.json()["detail"].startswith("prompt_wav: cannot read")
            bad = client.post("/speakers", data={"name": "late", "prompt_text": prompt[1]},
                              files={"prompt_wav": ("p.wav", b"not audio", "audio/wav")})
            assert bad.status_code == 400 and bad.json()["detail"].startswith("prompt_wav: cannot read")
            with pytest.raises(httpx.ReadTimeout):
                queued.result()  # that client gives up while queued: its session never runs
            wait_until(client, running=1, waiting=0)
        wait_until(client, running=0, waiting=0)  # closed mid-utterance: the session stops
        assert client.post("/inference_zero_shot", **form(prompt)).status_code == 200
        text = client.get("/metrics").text
    assert metric(text, "tts_requests_total") == 6
    assert metric(text, "tts_requests_success") == 1
    assert metric(text, "tts_requests_error") == 3 and metric(text, "tts_requests_rejected") == 1
    assert metric(text, "tts_sessions_cancelled") == 2
    assert metric(text, "tts_synthesis_duration_seconds_count") == 1 == metric(text, "tts_rtf_count")
    assert metric(text, "tts_first_chunk_latency_seconds_count") == 2
    assert metric(text, "tts_queue_depth") == 0 == metric(text, "tts_active_sessions")
    prefixes = engine.synth.flow.prefixes  # one prompt here; the engine is shared with other tests
    assert metric(text, "tts_flow_prefix_cache_bytes") == prefixes.nbytes > 0
    assert metric(text, "tts_flow_prefix_cache_hits") == prefixes.hits >= 1
    # its prompt's prefix may have been made for a test run before this one (then no miss here)
    assert metric(text, "tts_flow_prefix_cache_misses") == prefixes.misses
    assert metric(text, "tts_flow_prefix_cache_prompts") == len(prefixes) >= 1
    assert "# TYPE tts_flow_prefix_cache_hits counter" in text
    assert "# TYPE tts_flow_prefix_cache_bytes gauge" in text
    assert "# TYPE tts_rtf histogram" in text and 'tts_rtf_bucket{le="+Inf"} 1' in text


def test_a_request_past_the_timeout_answers_504(engine: Engine, prompt: tuple[bytes, str], tmp_path: Path
                                                ) -> None:
    audio = base64.b64encode(prompt[0]).decode()
    with TestClient(make_app(engine, tmp_path, timeout=0.3)) as client:
        late = client.post("/synthesize", json={"text": LONG, "prompt_audio": audio,
                                                "prompt_text": prompt[1]})
        assert late.status_code == 504 and "timeout of 0.3 s" in late.json()["detail"]
        start = time.monotonic()
        while client.get("/health").json()["sessions"]["running"]:
            assert time.monotonic() - start < 5
            time.sleep(0.02)


# --- faults and load -----------------------------------------------------------------------------------

FAIL = "Fail here."
"""A text whose stream `MidStreamFaults` breaks after the first chunk."""
HOLD = "Hold here."
"""A text whose stream `MidStreamFaults` keeps going after the first chunk until its session stops."""


class MidStreamFaults:
    """The engine, except after the first chunk of a stream of `FAIL`, which raises (a session whose
    synthesis dies mid-utterance), or of `HOLD`, which works on, checking its session, until the session
    is cancelled (an utterance still under way whenever its client leaves, however fast the machine
    synthesises the real one). Injected where `create_app` and the gRPC service take their engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, job: SynthesisJob, pieces: list[Segment], session: Session) -> Iterator[np.ndarray]:
        chunks = self._engine.stream(job, pieces, session)
        yield next(chunks)
        if job.text == FAIL:
            raise RuntimeError("injected: synthesis failed mid-stream")
        if job.text == HOLD:
            start = time.monotonic()
            while time.monotonic() - start < 60:  # a bound, so that a broken cancel fails the test
                session.check()
                time.sleep(0.01)
        yield from chunks


def test_a_session_failing_mid_stream_cuts_only_its_own_stream_and_frees_its_slot(
        engine: Engine, prompt: tuple[bytes, str], cli_stream: np.ndarray, tmp_path: Path) -> None:
    app = make_app(MidStreamFaults(engine), tmp_path, max_concurrency=2, queue_depth=0)
    with serving(app) as client, ThreadPoolExecutor(2) as pool:
        failing = pool.submit(client.post, "/inference_zero_shot", **form(prompt, FAIL))
        healthy = pool.submit(client.post, "/inference_zero_shot", **form(prompt))
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            failing.result()  # the status was 200 already: the stream is cut, the client sees it unfinished
        assert np.array_equal(np.frombuffer(healthy.result().content, "<i2"), cli_stream)  # its neighbour
        wait_until(client, running=0, waiting=0)
        # Both slots are free again: with no queue, a slot still held would make one of these a 503.
        again = list(pool.map(lambda _: client.post("/inference_zero_shot", **form(prompt)), range(2)))
        text = client.get("/metrics").text
    assert [r.status_code for r in again] == [200, 200]
    assert all(np.array_equal(np.frombuffer(r.content, "<i2"), cli_stream) for r in again)
    assert metric(text, "tts_requests_total") == 4 and metric(text, "tts_requests_error") == 1
    assert metric(text, "tts_requests_success") == 3 and metric(text, "tts_active_sessions") == 0


def rss_mib(pid: int) -> float:
    """Resident set size of process `pid` (`VmRSS` in /proc/PID/status), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


LOAD_STREAMS, LOAD_CONCURRENCY, LOAD_QUEUE = 16, 4, 4
WARM_UP_LOADS = 2
RSS_SLACK_MIB = 32
"""How far above its post-warm-up baseline the server's RSS may stay after the load. The warm-up is the
same load twice, so the allocators (a glibc arena per worker thread, onnxruntime's arena, the buffers of
16 uploads parsed at once) have grown to what it needs and keep their freed pages; what the measured
round may add is churn, 0 to 18 MiB in 22 runs here (after one warm-up load the next one still grew by up
to 34 MiB now and then: the arenas do not always reach their size in one). A session of the demo
model holds well under 1 MiB (its upload, prompt features, KV cache and queued chunks), so this bound
catches what piles up per request at scale (sessions, threads or buffers never released, a copy of a
model graph), not a leak of a few small objects per session."""


def test_16_streams_at_concurrency_4_complete_or_get_a_prompt_503_and_memory_returns(
        prompt: tuple[bytes, str], cli_stream: np.ndarray, tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    args = ("--port", str(port), "--max-conc", str(LOAD_CONCURRENCY), "--queue", str(LOAD_QUEUE))

    def stream(start: threading.Barrier) -> tuple[int, bytes, httpx.Headers, float]:
        """One streaming request, upstream's way (form upload, read as it comes); when it ended."""
        with httpx.Client(base_url=base_url, timeout=60) as own:  # a connection of its own
            start.wait(30)
            with own.stream("POST", "/inference_zero_shot", **form(prompt)) as response:
                body = b"".join(response.iter_bytes())
            return response.status_code, body, response.headers, time.monotonic()

    def at_once(n: int) -> list[tuple[int, bytes, httpx.Headers, float]]:
        start = threading.Barrier(n)
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(stream, start) for _ in range(n)]
            return [future.result(timeout=180) for future in futures]  # none hangs

    # One malloc arena: glibc's per-thread arenas keep tens of MiB that depend on which thread ran what, up
    # and down from one load to the next, which would hide a leak or fail without one.
    with cosyvoice_serve(tmp_path, *args, env={"MALLOC_ARENA_MAX": "1"}) as (server, _), \
            httpx.Client(base_url=base_url, timeout=60) as client:
        wait_for_http(client)
        # Warm-up: the same load twice, so that the allocators have grown to what it needs.
        for _ in range(WARM_UP_LOADS):
            assert {status for status, *_ in at_once(LOAD_STREAMS)} == {200, 503}
            wait_until(client, running=0, waiting=0)
        baseline = rss_mib(server.pid)
        results = at_once(LOAD_STREAMS)
        wait_until(client, running=0, waiting=0)
        after = rss_mib(server.pid)
        text = client.get("/metrics").text
    done = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    print(f"load: {len(done)} completed, {len(busy)} refused; RSS {baseline:.0f} MiB after warm-up, "
          f"{after:.0f} MiB after the load")
    assert len(done) + len(busy) == LOAD_STREAMS and done and busy
    assert all(np.array_equal(np.frombuffer(body, "<i2"), cli_stream) for _, body, _, _ in done)
    for _, body, headers, _ in busy:
        assert json.loads(body)["detail"].startswith("server busy") and headers["retry-after"] == "1"
    # Prompt: a refusal came while the sessions it queued behind still ran, not once they had ended.
    assert max(ended for *_, ended in busy) < max(ended for *_, ended in done)
    assert metric(text, "tts_requests_total") == (WARM_UP_LOADS + 1) * LOAD_STREAMS
    assert metric(text, "tts_requests_rejected") == metric(text, "tts_requests_error") >= len(busy)
    assert after - baseline < RSS_SLACK_MIB, f"RSS {baseline:.0f} MiB -> {after:.0f} MiB"


def test_a_signal_refuses_the_waiting_sessions_and_gives_the_running_one_the_grace(
        prompt: tuple[bytes, str], tmp_path: Path) -> None:
    """`docker stop`: SIGTERM, then SIGKILL 10 s later. The sessions queued behind a stream are answered
    503 at once instead of running first, and the stream gets --shutdown-grace, then is cut."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    args = ("--port", str(port), "--max-conc", "1", "--queue", "2", "--shutdown-grace", "1", "--no-warm-up")

    def stream(start: threading.Event | None = None) -> tuple[int, bytes]:
        with httpx.Client(base_url=base_url, timeout=60) as own, \
                own.stream("POST", "/inference_zero_shot", **form(prompt, " ".join([LONG] * 8))) as response:
            body = b""
            try:
                for chunk in response.iter_bytes():
                    body += chunk
                    if start is not None:
                        start.set()
            except httpx.RemoteProtocolError:  # cut: the chunked body never ended
                return response.status_code, b"cut"
            return response.status_code, body

    with cosyvoice_serve(tmp_path, *args) as (server, lines), \
            httpx.Client(base_url=base_url, timeout=60) as client, ThreadPoolExecutor(3) as pool:
        wait_for_http(client)
        streaming = threading.Event()
        running = pool.submit(stream, streaming)
        assert streaming.wait(30)
        waiting = [pool.submit(stream) for _ in range(2)]
        wait_until(client, running=1, waiting=2)
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = [future.result(timeout=10) for future in waiting]
        assert time.monotonic() - signalled < 1
        server.wait(10)
        stopped = time.monotonic() - signalled
        log = "".join(iter(lines.get, ""))
    assert [(status, json.loads(body)["detail"]) for status, body in refused] == [
        (503, ServerStopping().detail)] * 2
    assert running.result(timeout=1) == (200, b"cut") and stopped < 4, (stopped, log)
    assert "Traceback" not in log


# --- bad input -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(make_app(engine, tmp_path_factory.mktemp("serve"), max_text_chars=100)) as client:
        yield client


def _upload(data: bytes) -> dict[str, Any]:
    return {"prompt_wav": ("p.wav", data, "audio/wav")}


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


_TONE = (0.3 * np.sin(np.arange(16000) * 0.2)).astype(np.float32)  # 1 s at 16 kHz
_AT_900 = np.arange(16000) == 900


JSON = {"content-type": "application/json"}


def multipart(body: bytes, boundary: str | None = "b0") -> dict[str, Any]:
    """A request whose body is `body` as is, sent as multipart/form-data (with `boundary`, if any)."""
    content_type = "multipart/form-data" + (f"; boundary={boundary}" if boundary else "")
    return {"content": body, "headers": {"content-type": content_type}}


BAD_REQUESTS = [
    ("empty text", "/inference_zero_shot",
     {"data": {"tts_text": "  ", "prompt_text": "x"}, "files": "prompt"}, 400, "tts_text is empty"),
    ("missing field", "/inference_zero_shot", {"data": {"tts_text": "Hi."}, "files": "prompt"},
     422, "prompt_text: Field required"),
    ("not audio", "/inference_cross_lingual", {"data": {"tts_text": "Hi."}, "files": _upload(b"not a wav")},
     400, "prompt_wav: cannot read the audio file"),
    ("silent prompt", "/inference_cross_lingual",
     {"data": {"tts_text": "Hi."}, "files": _upload(_wav(np.zeros(16000, np.float32), 16000))},
     400, "prompt_wav: the audio file is silent or nearly so (RMS level -inf dBFS)"),
    ("infinite sample", "/inference_cross_lingual",
     {"data": {"tts_text": "Hi."}, "files": _upload(_wav(np.where(_AT_900, np.inf, _TONE), 16000))},
     400, "prompt_wav: the audio file holds 1 sample(s) that are NaN or infinite; expected finite samples"),
    ("NaN sample", "/speakers", {"data": {"name": "nan", "prompt_text": "x"},
                                 "files": _upload(_wav(np.where(_AT_900, np.nan, _TONE), 16000))},
     400, "prompt_wav: the audio file holds 1 sample(s) that are NaN or infinite"),
    ("short prompt", "/inference_cross_lingual",
     {"data": {"tts_text": "Hi."}, "files": _upload(_wav(_TONE[:4000], 16000))},
     400, "prompt_wav: the audio file is too short (0.250 s); a prompt needs at least 0.5 s"),
    ("8 kHz prompt", "/inference_zero_shot",
     {"data": {"tts_text": "Hi.", "prompt_text": "x"}, "files": _upload(_wav(_TONE, 8000))},
     400, "prompt_wav: the audio file has sample rate 8000 Hz; the minimum is 16000 Hz"),
    ("31 s prompt", "/inference_instruct2", {"data": {"tts_text": "Hi.", "instruct_text": "x"},
                                              "files": _upload(_wav(np.tile(_TONE, 31), 16000))},
     400, "prompt_wav: the audio file lasts 31.00 s; the speech tokenizer takes at most 30 s"),
    ("silent speaker", "/speakers", {"data": {"name": "quiet", "prompt_text": "x"},
                                     "files": _upload(_wav(np.full(16000, 1e-4, np.float32), 16000))},
     400, "prompt_wav: the audio file is silent or nearly so (RMS level -80.0 dBFS)"),
    ("empty upload", "/inference_instruct2", {"data": {"tts_text": "Hi.", "instruct_text": "x"},
                                              "files": _upload(b"")}, 400, "prompt_wav is empty"),
    ("too long", "/inference_cross_lingual", {"data": {"tts_text": "a" * 101}, "files": "prompt"},
     400, "tts_text has 101 characters; the limit is 100"),
    ("bad base64", "/synthesize", {"json": {"text": "Hi.", "prompt_audio": "/srv/prompt.wav!"}},
     400, "prompt_audio is not base64"),
    ("not json", "/synthesize", {"content": b"text=Hi.", "headers": {"content-type": "text/plain"}},
     415, "body: expected Content-Type application/json, got text/plain"),
    ("json not UTF-8", "/synthesize", {"content": b'{"text": "\xff\xfe"}', "headers": JSON},
     422, "body: not valid JSON (not UTF-8: byte 0xff at offset 10: invalid start byte)"),
    ("json not UTF-8, OpenAI's", "/v1/audio/speech",
     {"content": b'{"input": "\xff\xfe", "voice": "alloy"}', "headers": JSON},
     422, "body: not valid JSON (not UTF-8: byte 0xff at offset 11: invalid start byte)"),
    ("json nested too deeply", "/synthesize", {"content": b"[" * 100_000 + b"]" * 100_000, "headers": JSON},
     422, "body: not valid JSON (nested too deeply)"),
    ("form field not UTF-8", "/inference_zero_shot",
     multipart(b'--b0\r\nContent-Disposition: form-data; name="tts_text"\r\n\r\n\xff\xfe\r\n--b0--\r\n'),
     400, "tts_text: not UTF-8 text (byte 0xff at offset 0: invalid start byte)"),
    ("unknown voice", "/v1/audio/speech", {"json": {"input": "Hi.", "voice": "nobody"}},
     400, "voice: unknown speaker 'nobody'"),
    ("voice not a name", "/v1/audio/speech", {"json": {"input": "Hi.", "voice": 5}}, 422,
     "voice: expected a speaker name (a string) or an object with an id (a string), got a number"),
    ("format", "/v1/audio/speech", {"json": {"input": "Hi.", "voice": "x", "response_format": "ogg"}},
     422, "response_format: Input should be 'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm'"),
    ("speed", "/synthesize", {"json": {"text": "Hi.", "speed": 9}}, 422, "speed: Input should be less than"),
    ("blank speaker name", "/speakers", {"data": {"name": " ", "prompt_text": "x"}, "files": "prompt"},
     400, "name is empty"),
    ("speaker name with blanks", "/speakers",
     {"data": {"name": " pad ", "prompt_text": "x"}, "files": "prompt"},
     400, "name: a speaker name has no leading or trailing blanks; got ' pad '"),
    ("speaker name", "/speakers", {"data": {"name": "a/b", "prompt_text": "x"}, "files": "prompt"},
     400, "name: a speaker name is 1 to 64 printable characters, none of / \\ ? # %"),
    ("multipart without boundary", "/inference_zero_shot", multipart(b"--x\r\n", boundary=None),
     400, "body: malformed multipart/form-data (Missing boundary in multipart)"),
    ("multipart garbage", "/inference_cross_lingual", multipart(b"not a multipart body"),
     400, "body: malformed multipart/form-data (Invalid multipart data)"),
    ("multipart part without name", "/inference_zero_shot",
     multipart(b"--b0\r\nContent-Disposition: form-data\r\n\r\nHi.\r\n--b0--\r\n"), 400,
     'body: malformed multipart/form-data (The Content-Disposition header field "name" must be provided)'),
    ("multipart cut short", "/inference_instruct2",
     multipart(b'--b0\r\nContent-Disposition: form-data; name="tts_text"\r\n\r\nHi.'),
     422, "tts_text: Field required; instruct_text: Field required; prompt_wav: Field required"),
    # a JSON escape that parses to no Unicode text, on which the tokenizer raises a TypeError
    ("lone surrogate", "/v1/audio/speech",
     {"content": b'{"model": "tts-1", "voice": "alloy", "input": "Hi \\ud800."}',
      "headers": {"content-type": "application/json"}},
     400, "input is not valid Unicode text: character 4 is a lone surrogate (U+D800)"),
    ("lone surrogate in the bridge", "/synthesize",
     {"content": b'{"text": "\\udfff"}', "headers": {"content-type": "application/json"}},
     400, "text is not valid Unicode text: character 1 is a lone surrogate (U+DFFF)"),
    ("integer past Python's digits", "/synthesize",
     {"content": b'{"text": "Hi.", "seed": ' + b"9" * 5000 + b"}",
      "headers": {"content-type": "application/json"}},
     422, "body: not valid JSON (a number of 5000 digits; at most 4300 are read)"),
    ("speed not a number", "/v1/audio/speech",
     {"content": b'{"input": "Hi.", "voice": "alloy", "speed": NaN}', "headers": JSON},
     422, "speed: Input should be a finite number"),
    ("prompt as a text field", "/inference_zero_shot",
     {"data": {"tts_text": "Hi.", "prompt_text": "x", "prompt_wav": "prompt.wav"}},
     422, "prompt_wav: expected an uploaded file, got a text field"),
    ("json cut short", "/synthesize",
     {"content": b'{"text": "Hi.", ', "headers": {"content-type": "application/json"}}, 422,
     "body: not valid JSON (Expecting property name enclosed in double quotes at character 16)"),
]


@pytest.mark.parametrize(("path", "request_args", "status", "detail"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_a_4xx_naming_the_field(client: TestClient, prompt: tuple[bytes, str], path: str,
                                            request_args: dict[str, Any], status: int, detail: str) -> None:
    if request_args.get("files") == "prompt":
        request_args = {**request_args, "files": _upload(prompt[0])}
    response = client.post(path, **request_args)
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith("/v1/"):  # OpenAI's error shape
        body = {"detail": body["error"]["message"], "code": status if body["error"]["type"] else None}
    assert detail in body["detail"] and "\n" not in body["detail"] and body["code"] == status
    assert client.get("/health").json()["status"] == "healthy"


def test_metrics_count_bad_requests_as_errors(client: TestClient) -> None:
    before = client.get("/metrics").text
    assert client.post("/v1/audio/speech", json={"input": "", "voice": "x"}).status_code == 400
    assert client.get("/speakers/nobody").status_code == 404  # not a synthesis request: not counted
    after = client.get("/metrics").text
    assert metric(after, "tts_requests_total") == metric(before, "tts_requests_total") + 1
    assert metric(after, "tts_requests_error") == metric(before, "tts_requests_error") + 1
    assert after.startswith("# HELP tts_requests_total")


def test_a_model_bundle_is_held_against_the_engines_options_before_its_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cosyvoice-serve --model` on upstream's model directory exports it in fp32 (minutes), which decodes
    on `llm`: a decode batch is refused before that export, as is a first chunk shorter than the vocoder's
    look-ahead."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DEMO_BUNDLE / MODEL_YAML, model / MODEL_YAML)  # all a model bundle's planned export reads
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the bundle was exported"))
    line = re.escape("max_batch 2: batched decoding runs on llm_decode, on the cpu provider or in fp16 on "
                     f"cuda; {model} (fp32) on 'cpu' decodes on llm")
    short = re.escape("first_chunk_tokens must be >= 5 (the vocoder holds back 8 mel frames), got 4")
    for call in (Engine.check, Engine.open):
        with pytest.raises(UserError, match=line):
            call(model, max_batch=2)
        with pytest.raises(UserError, match=short):
            call(model, chunk_policy=ChunkPolicy(first_chunk_tokens=4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# --- torch-free ----------------------------------------------------------------------------------------


def test_the_server_runs_without_torch() -> None:
    script = textwrap.dedent("""
        import base64, sys, tempfile
        from importlib.abc import MetaPathFinder
        from pathlib import Path

        class Refuse(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "cosyvoice_export"):
                    raise ImportError(f"{name} is off limits for the server", name=name)
                return None

        sys.meta_path.insert(0, Refuse())
        from fastapi.testclient import TestClient
        from cosyvoice_runtime.bundle import RuntimeBundle
        from cosyvoice_runtime.demo import DEMO_BUNDLE
        from cosyvoice_serve import Engine, ServerSettings, create_app

        wav, text = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
        engine = Engine.open(None)
        settings = ServerSettings(speakers_dir=Path(tempfile.mkdtemp()) / "speakers")
        with TestClient(create_app(engine, settings)) as client:
            audio = base64.b64encode(wav.read_bytes()).decode()
            body = {"text": "Hi.", "prompt_text": text, "prompt_audio": audio}
            response = client.post("/synthesize", json=body)
        leaked = [m for m in sys.modules if m.split(".")[0] in ("torch", "cosyvoice_export")]
        assert not leaked, leaked
        print(response.status_code, response.headers["x-audio-duration"])
    """)
    env = {k: v for k, v in os.environ.items() if k != MODEL_DIR_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("200 ")


# --- settings ------------------------------------------------------------------------------------------


class _Unclosable:
    """The module's engine, lent to the CLI, which closes what it opened."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("environment", "flags", "port"), [
    ({}, [], 50001), ({PORT_ENV: "50002"}, [], 50002), ({PORT_ENV: "50002"}, ["--port", "50003"], 50003)])
def test_port_model_and_api_key_from_flags_then_environment_then_dotenv(
        engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        environment: dict[str, str], flags: list[str], port: int) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(f"# the server's settings\nCOSYVOICE_PORT=50001\n"
                                   f"export {MODEL_DIR_ENV}='{DEMO_BUNDLE}'\n\n{API_KEY_ENV}={API_KEY}\n")
    assert read_dotenv(tmp_path / ".env") == {PORT_ENV: "50001", MODEL_DIR_ENV: str(DEMO_BUNDLE),
                                              API_KEY_ENV: API_KEY}
    for key in (PORT_ENV, MODEL_DIR_ENV, API_KEY_ENV):  # recorded, so that the variables .env sets go again
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    opened: list[tuple[Path | None, str | None]] = []

    def open_engine(model: Path | None, provider: str, flow_prefix_bytes: int, threads: int | None,
                    max_batch: int | None, chunk_slots: int | None, chunk_policy: ChunkPolicy | None,
                    cuda_graphs: bool | None, stack_dit: bool, stack_vocoder: bool) -> _Unclosable:
        # --flow-prefix-cache's default, 2048 MiB; the batch and CUDA graphs by bundle and provider (the
        # engine's defaults); upstream's chunk schedule
        assert flow_prefix_bytes == 2 << 30 and threads is None and max_batch is None and chunk_policy is None
        assert cuda_graphs is None and not stack_dit and not stack_vocoder
        assert chunk_slots is None  # the runtime's default
        opened.append((model, os.environ.get(MODEL_DIR_ENV)))
        return _Unclosable(engine)

    served: list[tuple[str, int, str | None]] = []

    def run(server: HttpServer, sockets: object = None) -> None:
        config = server.config
        served.append((config.host, config.port, config.app.state.server.settings.api_key))
        server.started = True

    monkeypatch.setattr(Engine, "open", open_engine)
    monkeypatch.setattr(HttpServer, "run", run)
    monkeypatch.setattr(sys, "argv", ["cosyvoice-serve", "--speakers", str(tmp_path / "speakers"), *flags])
    with pytest.raises(SystemExit) as exit_:
        serve_cli.main()
    assert exit_.value.code == 0
    assert served == [("127.0.0.1", port, API_KEY)]
    err = capsys.readouterr().err
    assert "API key: required" in err and API_KEY not in err
    assert "sessions at once: 1, their speech tokens decoded each on its own\n" in err  # the demo bundle's
    assert "streams: upstream's chunk schedule and flow\n" in err
    assert opened == [(None, str(DEMO_BUNDLE))]  # choose_bundle reads $COSYVOICE_MODEL_DIR, set by .env


@pytest.mark.parametrize(("environment", "flags"), [({API_KEY_ENV: ""}, []), ({API_KEY_ENV: "  "}, []),
                                                    ({}, ["--api-key", " "])])
def test_a_blank_api_key_is_refused_before_the_bundle_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        environment: dict[str, str], flags: list[str]) -> None:
    """`COSYVOICE_API_KEY=$KEY` with `KEY` unset opens no server: click takes an empty variable for unset."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(Engine, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    monkeypatch.setattr(sys, "argv", ["cosyvoice-serve", "--speakers", str(tmp_path / "speakers"), *flags])
    with pytest.raises(SystemExit) as exit_:
        serve_cli.main()
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Invalid value for '--api-key': " in line and "the API key is blank" in line


@pytest.mark.parametrize("where", ["taken", "unresolved", "grpc-taken"])
def test_an_address_the_server_cannot_listen_on_is_refused_before_the_bundle_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A port taken or a host that does not resolve: before the bundle's load and warm-up, not in uvicorn."""
    monkeypatch.setattr(Engine, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, free = taken.getsockname()[1], free_port()
        args = {"taken": ["--port", str(busy)], "unresolved": ["--host", "no-such-host.invalid"],
                "grpc-taken": ["--port", str(free), "--grpc-port", str(busy)]}[where]
        monkeypatch.setattr(sys, "argv", ["cosyvoice-serve", "--speakers", str(tmp_path / "speakers"), *args])
        with pytest.raises(SystemExit) as exit_:
            serve_cli.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen on "), lines
    option = "--grpc-port" if where == "grpc-taken" else "--port"
    assert f"(--host or $COSYVOICE_HOST, {option}): " in lines[0]


def test_a_request_head_past_16_kib_is_refused_and_not_kept(tmp_path: Path) -> None:
    """httptools, uvicorn's choice where installed, reads a head whole: 256 MiB of header costs 300 MB."""
    port = free_port()
    with cosyvoice_serve(tmp_path, "--port", str(port), "--no-warm-up"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        wait_for_http(client)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            try:  # a head that arrives in pieces: what h11 holds of it unfinished is bounded
                raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
                answer = raw.recv(200)
            except (BrokenPipeError, ConnectionResetError):  # closed while the rest was still on its way
                answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.1 400 "), answer
        assert client.get("/health").status_code == 200


def test_a_client_that_leaves_mid_upload_is_counted_as_gone_not_as_an_error(tmp_path: Path) -> None:
    """FastAPI answers the body's ClientDisconnect with a 400: the client's leaving, not a request error."""
    port = free_port()
    with cosyvoice_serve(tmp_path, "--port", str(port), "--no-warm-up"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        wait_for_http(client)
        for path, kind in (("/inference_cross_lingual", "multipart/form-data; boundary=b0"),
                           ("/synthesize", "application/json")):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\n"
                            f"Content-Length: {1 << 20}\r\n\r\n".encode() + b"--b0\r\n" + b"x" * 4096)
                time.sleep(0.3)  # the server is reading the body when the client goes
        text = metrics_once(client, "tts_requests_total", 2)
    assert metric(text, "tts_requests_total") == 2
    assert metric(text, "tts_requests_error") == 0 == metric(text, "tts_requests_success")


def test_texts_are_normalised_at_once_not_in_turns(engine: Engine,
                                                   long_text_asked: tuple[str, threading.Event]) -> None:
    """A request's text is normalised and split on one of the engine's `TEXT_THREADS` before it waits for a
    session, a text with a digit in a grammar process of its own: short texts sent while a long English
    text with digits is normalised (seconds) are ready before it, with a digit or without."""
    long_text, asked = long_text_asked

    async def in_turn_of_readiness() -> list[str]:
        ready: list[str] = []

        async def segments(name: str, text: str) -> None:
            await engine.text_segments(SynthesisJob(Mode.ZERO_SHOT, text, BundlePrompt.DEFAULT, Sampling(),
                                                    prompt_text=SHORT), timeout=60)
            ready.append(name)

        long = asyncio.create_task(segments("long", long_text))
        assert await asyncio.to_thread(asked.wait, 30)
        await segments("digit", "Room 12.")
        await segments("plain", LONG)
        await long
        return ready

    assert asyncio.run(in_turn_of_readiness()) == ["digit", "plain", "long"]


def test_a_client_that_leaves_while_its_text_is_normalised_ends_it_and_is_never_admitted(
        engine: Engine, tmp_path: Path, long_text_asked: tuple[str, threading.Event],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The grammar process working on a long text (seconds) is ended when its client leaves, and the request
    never takes a session: it would otherwise work on, then synthesise for nobody."""
    long_text, asked = long_text_asked
    working = children_asked(long_text, monkeypatch)
    body = json.dumps({"input": long_text, "voice": "alloy", "response_format": "pcm"}).encode()
    with serving(make_app(engine, tmp_path)) as client, caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", client.base_url.port), timeout=30) as raw:
            raw.sendall(f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert asked.wait(30)
        [child] = working
        assert child.wait(timeout=30) == -signal.SIGKILL
        text = metrics_once(client, "tts_sessions_cancelled", 1)
    assert metric(text, "tts_requests_total") == 1
    assert metric(text, "tts_requests_error") == 0 == metric(text, "tts_requests_success")
    engine_lines = [r.getMessage() for r in caplog.records if r.name == "cosyvoice_serve.engine"]
    assert not [line for line in engine_lines if "in the queue" in line]  # no session began


def test_a_text_whose_normalisation_outlasts_the_timeout_is_a_504_and_its_process_ends(
        engine: Engine, tmp_path: Path, long_text_asked: tuple[str, threading.Event],
        monkeypatch: pytest.MonkeyPatch) -> None:
    long_text, _ = long_text_asked
    working = children_asked(long_text, monkeypatch)
    with TestClient(make_app(engine, tmp_path, timeout=0.5)) as client:
        answer = client.post("/v1/audio/speech", json={"input": long_text, "voice": "alloy"})
        text = client.get("/metrics").text
    line = "normalising input took longer than the server's timeout of 0.5 s"
    assert answer.status_code == 504 and answer.json()["error"]["message"] == line
    [child] = working
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert metric(text, "tts_requests_error") == 1


def children_asked(text: str, monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """The grammar processes asked to normalise `text`, as they are asked."""
    from cosyvoice_runtime.frontend import grammar_process

    asked: list[subprocess.Popen[bytes]] = []
    ask = grammar_process._ask

    def noting_the_child(child: subprocess.Popen[bytes], asked_text: str) -> dict[str, str]:
        if asked_text == text:
            asked.append(child)
        return ask(child, asked_text)

    monkeypatch.setattr(grammar_process, "_ask", noting_the_child)
    return asked


def test_the_warm_up_leaves_the_bundle_voice_ready(caplog: pytest.LogCaptureFixture) -> None:
    """`Engine.warm_up` streams a few chunks in the bundle's own voice and stops: a request in that voice then
    finds its flow prefix made (a hit, not a second miss); a bundle without a prompt of its own skips it."""
    warm = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle")
    try:
        prefixes = warm.synth.flow.prefixes
        with caplog.at_level(logging.INFO, logger="cosyvoice_serve.engine"):
            seconds = warm.warm_up()
        assert seconds is not None and seconds > 0
        assert (prefixes.misses, prefixes.hits) == (1, 0)
        messages = [r.getMessage() for r in caplog.records]
        assert f"warm-up: {WARM_UP_CHUNKS} chunks in the bundle's own voice in {seconds:.2f} s" in messages
        assert warm.default_prompt is not None
        job = SynthesisJob(Mode.ZERO_SHOT, SHORT, BundlePrompt.DEFAULT, Sampling(),
                           prompt_text=warm.default_prompt[1])
        chunks = warm.stream(job, warm.segments(job), Session(60))
        assert len(next(chunks)) > 0
        chunks.close()
        assert (prefixes.misses, prefixes.hits) == (1, 1)

        # the voice of every request without a prompt: held, as a registered speaker's, ahead of uploads
        samples, rate = sf.read(warm.default_prompt[0], dtype="float32")
        upload = warm.voice.prompt_features((samples[: len(samples) * 4 // 5], int(rate)))
        prefixes.max_bytes = prefixes.nbytes * 3 // 2  # room for one prefix
        warm.synth.flow.prefix(upload)
        assert prompt_key(upload) not in prefixes and prompt_key(warm.default_features()) in prefixes
        warm.default_prompt = None
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cosyvoice_serve.engine"):
            assert warm.warm_up() is None
        skipped = "warm-up: skipped, the bundle carries no prompt of its own"
        assert [r.getMessage() for r in caplog.records] == [skipped]
    finally:
        warm.close()


def test_where_the_dit_replays_the_warm_up_binds_its_shapes(caplog: pytest.LogCaptureFixture) -> None:
    """Where the DiT's calls go through `dit_graphs` (on a GPU, CUDA graphs; here its bindings run as plain
    calls) the warm-up streams its chunks twice, so that the second time binds the shapes the first made
    (a shape is bound once it comes again) and the next stream in that voice runs its first chunk there."""
    warm = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle")
    try:
        synth = warm.synth
        synth.dit_graphs = synth.flow.call = graphed = GraphedDit(synth.flow.estimator)
        with caplog.at_level(logging.INFO, logger="cosyvoice_serve.engine"):
            seconds = warm.warm_up()
        said = (f"warm-up: {WARM_UP_CHUNKS} chunks in the bundle's own voice, {WARM_UP_ROUNDS_REPLAYED} "
                f"times (the DiT's graphs) in {seconds:.2f} s")
        assert said in [r.getMessage() for r in caplog.records]
        assert graphed.graphs >= 1 and graphed.bound_calls > 0
        assert warm.default_prompt is not None
        bound = graphed.bound_calls
        job = SynthesisJob(Mode.ZERO_SHOT, SHORT, BundlePrompt.DEFAULT, Sampling(),
                           prompt_text=warm.default_prompt[1])
        chunks = warm.stream(job, warm.segments(job), Session(60))
        assert len(next(chunks)) > 0
        chunks.close()
        assert graphed.bound_calls > bound  # the first chunk in a binding
    finally:
        warm.close()


@pytest.mark.parametrize(("flags", "warmed"), [([], 1), (["--no-warm-up"], 0)])
def test_the_server_warms_up_before_serving_unless_told_not_to(engine: Engine, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               flags: list[str], warmed: int) -> None:
    calls: list[str] = []
    monkeypatch.setattr(Engine, "open", lambda *_, **__: _Unclosable(engine))
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append("warm-up"))

    def serve(server: HttpServer, sockets: object = None) -> None:
        calls.append("serve")
        server.started = True

    monkeypatch.setattr(HttpServer, "run", serve)
    result = CliRunner().invoke(serve_cli.serve, ["--speakers", str(tmp_path / "speakers"), *flags])
    assert result.exit_code == 0, result.output
    assert calls == ["warm-up"] * warmed + ["serve"]


def test_a_request_logs_its_stages(client: TestClient, prompt: tuple[bytes, str],
                                   caplog: pytest.LogCaptureFixture) -> None:
    """What the request is, its speech tokens as they come (SynthesisProgress's lines), its first audio
    and its end, each line naming the request: a long synthesis shows where it is in the server's log."""
    with caplog.at_level(logging.INFO, logger="cosyvoice_serve.engine"):
        assert client.post("/inference_zero_shot", **form(prompt)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "cosyvoice_serve.engine"]
    number = re.match(r"request (\d+): ", lines[0])
    assert number is not None and all(line.startswith(number[0]) for line in lines), lines
    stages = [line.removeprefix(number[0]) for line in lines]
    assert stages[0].startswith("zero-shot, streamed, 1 segment(s), ") and " s in the queue" in stages[0]
    assert stages[1].startswith("synthesising: segment 1/1, speech tokens; 0 speech tokens of at most ")
    assert any(s.startswith("first audio after ") for s in stages)
    assert any(s.startswith("synthesising: segment 1/1, flow and vocoder; ") for s in stages)
    assert re.fullmatch(r"done, [\d.]+ s of audio \(\d+ speech tokens\) in [\d.]+ s", stages[-1])
