"""`cosyvoice-serve --ray` on a local Ray cluster the tests start (2 CPUs, no dashboard): 2 replicas of the
demo bundle behind Ray Serve's proxy. Requests spread over both, with the single-process server's bytes;
a speaker registered through one replica is used through the other (the shared folder; the store actor
on its own); a replica that cannot open the bundle fails the deployment in one line; a replica killed
mid-stream cuts that stream cleanly, the other serves the next requests and Ray replaces it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (the ray extra)")
pytest.importorskip("httpx", reason="httpx, the server tests' client, is not installed (the dev extra)")

import httpx
import numpy as np
import yaml
from fastapi.testclient import TestClient
from ray import serve
from ray.serve.schema import ServeDeploySchema

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import CPU
from cosyvoice_serve import Engine, ServerSettings, create_app
from cosyvoice_serve.ray_app import (
    APP_NAME,
    DEPLOYMENT_NAME,
    SERVED_BY,
    ReplicaConfig,
    deployment,
    replica_chunk_slots,
    replica_config,
)
from cosyvoice_serve.ray_options import ScaleOptions
from cosyvoice_serve.ray_speakers import ActorSpeakers
from cosyvoice_serve.settings import API_KEY_ENV

SHORT = "Hi."
"""About a second of work on the demo model (two streamed chunks)."""
LONG = "Hello there, this is a test of the server."
"""Several seconds of work: long enough to kill its replica mid-stream."""
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def prompt() -> tuple[bytes, str]:
    """The demo bundle's prompt recording (file bytes) and transcript."""
    default = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
    assert default is not None
    return default[0].read_bytes(), default[1]


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> ServerSettings:
    """Greedy sampling (exact comparisons), speakers in a folder every replica shares."""
    return ServerSettings(speakers_dir=tmp_path_factory.mktemp("ray") / "speakers", sampling="greedy", seed=0)


def start_ray() -> None:
    """`ray.init` of a local node, tried twice: Ray gives its raylet a fixed 30 s to come up and register,
    which late in the full suite on two busy cores it sometimes misses (the GCS port file or the node's
    registration times out), while this module run alone starts."""
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:  # Ray raises a bare Exception for the node, RuntimeError for the port file
            ray.shutdown()
            if attempt == 2 or "timed out" not in str(e).lower():
                raise


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster with Serve's proxy on a free port; its address. Torn down after the module."""
    start_ray()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def replicas(cluster: str, settings: ServerSettings) -> Iterator[httpx.Client]:
    """Two replicas of the demo bundle, one CPU each; a client of the proxy."""
    scale = ScaleOptions(replicas=2, cpus=1)
    serve.run(deployment(scale, settings, CPU).bind(ReplicaConfig(settings=settings)), name=APP_NAME,
              route_prefix="/")
    with httpx.Client(base_url=cluster, timeout=120) as client:
        yield client
    serve.delete(APP_NAME)


def zero_shot(prompt: tuple[bytes, str], text: str = SHORT) -> dict[str, Any]:
    """Upstream's zero-shot form fields and upload."""
    return {"data": {"tts_text": text, "prompt_text": prompt[1]},
            "files": {"prompt_wav": ("prompt_wav", prompt[0], "application/octet-stream")}}


def replica_names() -> set[str]:
    """The running replicas' actor names."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    prefix = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#"
    return {a["name"] for a in actors if a["name"].startswith(prefix)}


def test_a_config_files_args_are_the_servers_settings_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, " key ")
    args = {"model": "/models/m", "max_concurrency": "2", "seed": "7", "speakers_dir": "/shared/speakers",
            "speaker_store": "actor", "cors_origins": ["https://app.example.com"]}  # serve run's strings too
    assert replica_config(args) == ReplicaConfig(
        Path("/models/m"), "cpu", DEFAULT_PREFIX_CACHE_BYTES,
        ServerSettings(max_concurrency=2, seed=7, speakers_dir=Path("/shared/speakers"), api_key="key",
                       cors_origins=("https://app.example.com",)), "actor")
    with pytest.raises(ValueError, match="unknown args num_replicas, replicas: model, provider"):
        replica_config({"replicas": 2, "num_replicas": 2})
    with pytest.raises(ValueError, match="speaker_store must be one of folder, actor, got 'disk'"):
        replica_config({"speaker_store": "disk"})
    with pytest.raises(ValueError, match="sampling must be one of"):
        replica_config({"sampling": "beam"})
    with pytest.raises(ValueError, match="provider must be one of cpu, cuda, tensorrt, openvino, got 'trt'"):
        replica_config({"provider": "trt"})
    for value in (-1, "abc", 1.5, True):
        with pytest.raises(ValueError, match=f"^flow_prefix_mib must be a whole number >= 0, got {value!r}$"):
            replica_config({"flow_prefix_mib": value})
    assert replica_config({"flow_prefix_mib": "64"}).flow_prefix_bytes == 64 << 20
    assert replica_config({"speakers_sync": "5"}).settings.speakers_sync == 5.0
    assert replica_config({"speakers_sync": None}).settings.speakers_sync is None
    # one line per wrong value, never the environment's key (pydantic's own message repeats the input)
    for args, message in (({"max_concurrency": 0}, "max_concurrency must be >= 1, got 0"),
                          ({"timeout": "x"}, "timeout: Input should be a valid number"),
                          ({"speakers_sync": "0"}, "speakers_sync must be > 0 (None: never), got 0.0")):
        with pytest.raises(ValueError) as refused:
            replica_config(args)
        assert str(refused.value).startswith(message) and "key" not in str(refused.value)


def test_a_cpu_replica_runs_one_chunk_at_a_time_unless_told() -> None:
    """A replica that reserved CPUs shares them, not the machine's cores, among its batch's chunks: one slot
    by default on a CPU; a config's `chunk_slots` is kept; on a GPU, with no CPUs reserved (the graphs take
    every core), or without a batch (a CPU's default, where slots are refused), the runtime's default."""
    cpu = replica_config({"max_batch": "2"})
    assert replica_chunk_slots(cpu, 2) == 1 and replica_chunk_slots(cpu, None) is None
    assert replica_chunk_slots(replica_config({"chunk_slots": "3", "max_batch": "4"}), 2) == 3
    assert replica_chunk_slots(replica_config({"provider": "cuda"}), 2) is None
    assert replica_chunk_slots(replica_config({}), 2) is None
    # what a default replica that reserved CPUs opens with is taken
    Engine.check(DEMO_BUNDLE, chunk_slots=replica_chunk_slots(replica_config({}), 2))


@pytest.mark.parametrize("name", ["serve-config.yaml", "rayservice.yaml"])
def test_the_deploy_files_are_serve_configs_of_this_app(name: str) -> None:
    config = next(yaml.safe_load_all((DEPLOY / name).read_text(encoding="utf-8")))
    if config.get("kind") == "RayService":
        assert config["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
        config = yaml.safe_load(config["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)  # Ray's own check of a config file
    (app,) = config["applications"]
    assert (app["name"], app["import_path"]) == (APP_NAME, "cosyvoice_serve.ray_app:build_app")
    assert [d["name"] for d in app["deployments"]] == [DEPLOYMENT_NAME]
    settings = replica_config(app["args"]).settings
    replicas = app["deployments"][0]
    assert replicas["max_ongoing_requests"] == settings.max_concurrency  # as --ray sets them
    assert replicas["max_queued_requests"] == settings.queue_depth


def test_a_replica_that_cannot_open_the_bundle_fails_the_deployment_in_one_line(cluster: str, tmp_path: Path
                                                                                ) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cosyvoice_serve", "--ray", "--ray-address",
                           ray.get_runtime_context().gcs_address, "--model", str(tmp_path),
                           "--replica-cpus", "0", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=180)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: replica SERVE_REPLICA::cosyvoice#CosyVoice#")
    assert errors[0].endswith(f"{tmp_path / 'manifest.json'}: format is None, expected "
                              "'cosyvoice3-runtime-bundle' (re-export the model with `cosyvoice-export all`)")
    assert time.monotonic() - started < 120  # Ray gave up after a few tries, not looping
    assert APP_NAME not in serve.status().applications  # and the command took its app away


def test_concurrent_requests_spread_over_both_replicas_with_the_single_process_bytes(
        replicas: httpx.Client, settings: ServerSettings, prompt: tuple[bytes, str], tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: replicas.post("/inference_zero_shot", **zero_shot(prompt)),
                                range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert len({a.headers[SERVED_BY] for a in answers}) == 2
    # onnxruntime's sums depend on its thread count in the last bits: the server's as a replica's, one
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        with TestClient(create_app(engine, replace(settings, speakers_dir=tmp_path))) as client:
            expected = client.post("/inference_zero_shot", **zero_shot(prompt))
    finally:
        engine.close()
    assert expected.status_code == 200 and len(expected.content) > 0
    assert all(a.content == expected.content for a in answers)
    health = replicas.get("/health")
    assert health.status_code == 200 and health.headers[SERVED_BY] in replica_names()


def test_a_speaker_registered_through_one_replica_is_used_through_the_other(
        replicas: httpx.Client, prompt: tuple[bytes, str]) -> None:
    added = replicas.post("/speakers", data={"name": "shared", "prompt_text": prompt[1]},
                          files={"prompt_wav": ("p.wav", prompt[0], "audio/wav")})
    assert added.status_code == 201, added.text
    speech = {"input": SHORT, "voice": "shared", "response_format": "pcm"}
    served: dict[str, httpx.Response] = {}
    for _ in range(20):  # Ray's router picks the replica; ask until the other one has answered
        answer = replicas.post("/v1/audio/speech", json=speech)
        served.setdefault(answer.headers[SERVED_BY], answer)
        if len(served) == 2:
            break
    other = served.get(next(name for name in replica_names() if name != added.headers[SERVED_BY]))
    assert other is not None and other.status_code == 200, other and other.text
    assert other.content == replicas.post("/inference_zero_shot", **zero_shot(prompt)).content
    assert all(replicas.get("/speakers").json() == ["shared"] for _ in range(4))


def test_the_store_actor_shares_speakers_and_keeps_them_across_its_restart(cluster: str, tmp_path: Path
                                                                          ) -> None:
    one, two = ActorSpeakers(tmp_path, "fp"), ActorSpeakers(tmp_path, "fp")  # two replicas' views
    features = PromptFeatures(np.arange(4)[None], np.ones((1, 8, 80), np.float32),
                              np.ones((1, 192), np.float32))
    one.add("alice", "hello", features)
    alice = two.get("alice")
    assert two.names() == ["alice"] and alice is not None and np.array_equal(alice.features.mel, features.mel)
    ray.kill(ray.get_actor("cosyvoice-speakers-fp", namespace="cosyvoice"), no_restart=False)
    assert one.names() == ["alice"]  # Ray restarts it, it reads its folder again, and the call is retried
    assert two.remove("alice") and one.names() == []
    ray.kill(ray.get_actor("cosyvoice-speakers-fp", namespace="cosyvoice"), no_restart=True)


def test_a_replica_killed_mid_stream_cuts_its_stream_and_the_other_serves_until_ray_replaces_it(
        replicas: httpx.Client, prompt: tuple[bytes, str]) -> None:
    before = replica_names()
    with replicas.stream("POST", "/inference_zero_shot", **zero_shot(prompt, LONG)) as streamed:
        assert streamed.status_code == 200
        killed = streamed.headers[SERVED_BY]
        chunks = streamed.iter_bytes()
        assert next(chunks)
        ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            for _ in chunks:
                pass
        assert time.monotonic() - started < 10  # an error at once, not a hang
    answers = [replicas.post("/inference_zero_shot", **zero_shot(prompt)) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers[SERVED_BY] for a in answers} == before - {killed}
    deadline = time.monotonic() + 90
    while len(replica_names() - before) < 1 or len(replica_names()) < 2:
        assert time.monotonic() < deadline, "Ray started no replacement"
        time.sleep(1)
    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    deadline = time.monotonic() + 90
    while status.replica_states.get("RUNNING") != 2:
        assert time.monotonic() < deadline, status
        time.sleep(1)
        status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
