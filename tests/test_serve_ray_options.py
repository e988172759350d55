"""`cosyvoice-serve --ray`'s options: what they ask of Ray Serve, the combinations refused before anything
starts, what a local instance's replicas would refuse refused before Ray starts, the one line where the
ray extra is missing; and (the one test here that starts Ray) a local instance ended in seconds by a
signal to its process group."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnxruntime
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from click.testing import CliRunner

from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.runners import CUDA, ORT_PROVIDERS
from cosyvoice_runtime.speakers import REGISTRY
from cosyvoice_runtime.synthesis import GPU_MAX_BATCH
from cosyvoice_serve import cli as serve_cli
from cosyvoice_serve.ray_options import ScaleOptions
from cosyvoice_serve.settings import ServerSettings


def test_the_scale_options_are_ray_serves_deployment_options() -> None:
    settings = ServerSettings(max_concurrency=2, queue_depth=6)
    assert ScaleOptions(replicas=3, cpus=2, gpus=0.5).deployment_options(settings, "cpu") == {
        "num_replicas": 3, "max_ongoing_requests": 2, "max_queued_requests": 6,
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}}
    autoscaling = ScaleOptions(replicas=2, max_replicas=4, min_replicas=0, max_ongoing=3)
    assert autoscaling.deployment_options(settings, "cpu") == {
        "max_ongoing_requests": 3, "max_queued_requests": 6,
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0},
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 2,
                               "target_ongoing_requests": 2}}
    targeted = ScaleOptions(max_replicas=2, target_ongoing=1.5).deployment_options(settings, "cpu")
    assert targeted["autoscaling_config"]["target_ongoing_requests"] == 1.5
    no_queue = ScaleOptions().deployment_options(ServerSettings(queue_depth=0), "cpu")
    assert no_queue["max_queued_requests"] == 1  # Ray's least


def test_ray_sends_a_replica_as_many_requests_as_it_runs_at_once() -> None:
    """A replica runs `--max-conc` sessions at once, or its decode batch where larger: `--max-batch`, else
    the engine's default on the provider (the most it gives there: 4 on cuda, 1 elsewhere), which the
    driver, without the bundle, cannot narrow."""
    def ongoing(settings: ServerSettings, provider: str) -> tuple[int, int]:
        options = ScaleOptions(max_replicas=2).deployment_options(settings, provider)
        return options["max_ongoing_requests"], options["autoscaling_config"]["target_ongoing_requests"]

    assert ongoing(ServerSettings(), "cpu") == (1, 1)
    assert ongoing(ServerSettings(), "cuda") == (GPU_MAX_BATCH, GPU_MAX_BATCH) == (4, 4)
    assert ongoing(ServerSettings(max_batch=1), "cuda") == (1, 1)
    assert ongoing(ServerSettings(max_batch=3, max_concurrency=2), "cpu") == (3, 3)
    assert ongoing(ServerSettings(max_batch=2, max_concurrency=5), "cuda") == (5, 5)


@pytest.mark.parametrize(("args", "message"), [
    (["--ray", "--min-replicas", "2"], "--min-replicas bounds autoscaling, which --max-replicas turns on"),
    (["--ray", "--replicas", "5", "--max-replicas", "3"],
     "replicas (5) must be from min_replicas (1) to max_replicas (3)"),
    (["--ray", "--replicas", "0"], "replicas must be at least 1 without autoscaling"),
    (["--ray-address", "auto", "--grpc"], "--ray serves HTTP only"),
    (["--replicas", "2"], "--speaker-store need --ray"),
    (["--speaker-store", "actor"], "--speaker-store need --ray"),
])
def test_refused_combinations_say_why_before_anything_starts(args: list[str], message: str) -> None:
    done = CliRunner().invoke(serve_cli.serve, args)
    assert done.exit_code == 2 and message in done.output, done.output


def test_without_the_ray_extra_ray_is_one_line_naming_it() -> None:
    code = ("import sys; sys.argv[0] = 'cosyvoice-serve'; sys.modules['ray'] = None; "
            "from cosyvoice_serve.__main__ import main; main()")
    done = subprocess.run([sys.executable, "-c", code, "--ray"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["error: cosyvoice-serve needs the ray extra (ray is not installed): "
                                        "pip install 'cosyvoice-onnx[ray]'"]


@pytest.mark.parametrize("case", ["manifest", "max-batch", "provider", "speakers", "speakers-folder", "port"])
def test_on_a_local_instance_what_a_replica_would_refuse_is_refused_before_ray_starts(
        case: str, tmp_path: Path) -> None:
    """The replicas of a local Ray instance open this machine's bundle and speakers: the driver holds them to
    the replica's checks first, one line and exit status 2 in a second, not after Ray started."""
    ray = pytest.importorskip("ray", reason="Ray Serve is not installed (the ray extra)")
    speakers = tmp_path / "speakers"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = str(free.getsockname()[1])
    free.close()
    args, message = {
        "manifest": (["--model", str(tmp_path)], f"{tmp_path / 'manifest.json'}: format is None, expected "
                                                 "'cosyvoice3-runtime-bundle'"),
        "max-batch": (["--max-batch", "4"], f"max_batch 4: batched decoding runs on llm_decode, on the cpu "
                                            f"provider or in fp16 on cuda; {DEMO_BUNDLE} (fp32) on 'cpu' "
                                            "decodes on llm"),
        "provider": (["--provider", CUDA], "provider 'cuda' needs onnxruntime's CUDAExecutionProvider"),
        "speakers": ([], f"{speakers / REGISTRY}: not a readable speaker registry"),
        # after Ray had started, in a replica's traceback
        "speakers-folder": (["--speakers", "/proc/none"], "--speakers /proc/none: cannot create the folder"),
        "port": (["--port", str(taken.getsockname()[1])], "cannot listen on '127.0.0.1' port "),
    }[case]
    if case == "provider" and ORT_PROVIDERS[CUDA] in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider, whose absence the case refuses")
    (tmp_path / "manifest.json").write_text("{}")
    speakers.mkdir()
    (speakers / REGISTRY).write_text("not a registry")
    started = time.monotonic()
    with taken:
        done = CliRunner().invoke(serve_cli.serve, ["--ray", "--port", port, "--speakers", str(speakers),
                                                    "--model", str(DEMO_BUNDLE), *args])
    assert done.exit_code == 2, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.output
    assert not ray.is_initialized() and time.monotonic() - started < 10


def test_replicas_the_clusters_nodes_cannot_hold_are_named() -> None:
    """Each replica on one node, as many as `--replicas` starts with (`ray.nodes()`'s total resources)."""
    pytest.importorskip("ray", reason="Ray Serve is not installed (the ray extra)")
    from cosyvoice_serve.ray_app import placement_problem

    def node(cpus: float, gpus: float = 0.0, alive: bool = True) -> dict[str, object]:
        resources = {"CPU": cpus, "memory": 1e10} | ({"GPU": gpus} if gpus else {})
        return {"Alive": alive, "Resources": resources}

    two_cpus = [node(2.0), node(8.0, 1.0, alive=False)]
    assert placement_problem(ScaleOptions(replicas=2), two_cpus) is None
    assert placement_problem(ScaleOptions(replicas=4, cpus=0.5), two_cpus) is None
    assert placement_problem(ScaleOptions(cpus=0), []) is None  # nothing reserved: anywhere
    assert placement_problem(ScaleOptions(gpus=1), two_cpus) == (
        "each replica reserves 1 CPU and 1 GPU, which no node of the cluster has")
    assert placement_problem(ScaleOptions(replicas=3), two_cpus) == (
        "3 replicas reserving 1 CPU each: the cluster's nodes hold 2")
    assert placement_problem(ScaleOptions(replicas=2, cpus=1, gpus=1), [node(2, 1), node(1, 1)]) is None


def _serve_on_a_local_instance(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """`cosyvoice-serve --ray` on the demo bundle in a process group of its own, stderr piped; its port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "cosyvoice_serve", "--ray", "--port", str(port),
                               "--model", str(DEMO_BUNDLE), "--speakers", str(tmp_path / "speakers")],
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    return server, port


def test_sigterm_while_the_app_deploys_unwinds_as_ctrl_c_does(tmp_path: Path) -> None:
    """Ray's handler of SIGTERM ends the process with SIGABRT and a stack dump; before the app serves, the
    command unwinds instead: the app deleted, the local instance stopped, exit status 130."""
    pytest.importorskip("ray", reason="Ray Serve is not installed (the ray extra)")
    server, port = _serve_on_a_local_instance(tmp_path)
    log: list[str] = []
    try:
        for line in server.stderr or ():  # Serve starts, then the app deploys (seconds: the replica opens)
            log.append(line)
            if "Started Serve" in line:
                server.send_signal(signal.SIGTERM)
                break
        log.extend(server.stderr or ())
        status = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert status == 130 and not any("SIGTERM received" in line for line in log), "".join(log)
    assert not any("serving http://" in line for line in log), "".join(log)
    deadline = time.monotonic() + 15
    while _group_alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(server.pid), "the local instance's processes outlived the command"


def test_a_signal_to_its_process_group_ends_a_local_instance_in_seconds(tmp_path: Path) -> None:
    """systemd stopping the unit, `timeout` and `kill -TERM -PGID` stop the local instance's GCS beside the
    command, which then neither waits Ray's 60 s for it nor is ended by Ray, nor crashes in Ray's shutdown
    beside the delete it gave up: status 0 in seconds, and none of the instance's processes left."""
    pytest.importorskip("ray", reason="Ray Serve is not installed (the ray extra)")
    from cosyvoice_serve.ray_app import DELETE_WAIT_S

    server, port = _serve_on_a_local_instance(tmp_path)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in server.stderr or ():
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        log: list[str] = []
        while not any("serving http://" in line for line in log):
            log.append(lines.get(timeout=max(deadline - time.monotonic(), 0)))
        assert f"; API key: none; serving http://127.0.0.1:{port}\n" in log[-1]  # as the server's own line
        os.killpg(server.pid, signal.SIGTERM)
        stopped = time.monotonic()
        status = server.wait(timeout=55)
        waited = time.monotonic() - stopped
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    reader.join(10)  # the rest of stderr, to its end
    log.extend(lines.queue)
    assert status == 0 and waited < DELETE_WAIT_S + 15, (status, waited, "".join(log))
    # Ray's end of a process that lost its GCS for 60 s (its other GCS lines at shutdown are routine)
    assert not any("The program will terminate" in line for line in log), "".join(log)
    deadline = time.monotonic() + 15
    while _group_alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _group_alive(server.pid):
        left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(server.pid)], capture_output=True,
                              text=True).stdout
        os.killpg(server.pid, signal.SIGKILL)
        raise AssertionError(f"the local instance's processes outlived the command:\n{left}")


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
