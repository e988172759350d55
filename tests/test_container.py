"""The container: the Dockerfile's ENTRYPOINT and HEALTHCHECK commands, read from the Dockerfile and run as
it states them (its in-image paths mapped to the files it copies, `python` to this environment's) against
a live `cosyvoice-serve` from this environment; what the Dockerfile and .dockerignore promise, read from
them; and, where a Docker daemon is at hand, the image built and run (skipped, saying why, elsewhere)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cosyvoice_runtime.demo import DEMO_BUNDLE

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
BASE_IMAGE_ENV = "COSYVOICE_DOCKER_BASE_IMAGE"
"""Builds the image test on this base instead of the Dockerfile's (`--build-arg PYTHON_IMAGE`): a mirror,
or a local stand-in where the official image cannot be pulled."""
IMAGE = "cosyvoice-onnx:test"


# --- the Dockerfile, as docker reads it --------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"the stage has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        """Its ENV variables (KEY=VALUE form), `$VAR` left as written."""
        pairs: dict[str, str] = {}
        for args in self.all("ENV"):
            for word in shlex.split(args):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=VALUE form"
                pairs[key] = value
        return pairs


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            found.append((keyword.upper(), " ".join(args.split())))
    return found


def stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the build stages."""
    args: dict[str, str] = {}
    found: list[Stage] = []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), words[0])
            found.append(Stage(base, words[2] if len(words) > 2 and words[1].upper() == "AS" else None))
        elif found:
            found[-1].instructions.append((keyword, rest))
        elif keyword == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
    return args, found


ARGS, STAGES = stages(DOCKERFILE.read_text(encoding="utf-8"))
FINAL = STAGES[-1]
IMAGE_ENV = FINAL.env()


def copied_files() -> dict[str, Path]:
    """In-image path -> the file of this repository the final stage copies there (COPY from the context)."""
    files: dict[str, Path] = {}
    for args in FINAL.all("COPY"):
        if args.startswith("--from"):
            continue
        *sources, dest = args.split()
        for source in sources:
            target = dest + Path(source).name if dest.endswith("/") else dest
            files[target] = ROOT / source
    return files


def healthcheck() -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK's options and its CMD (exec form)."""
    match = re.fullmatch(r"((?:--\S+\s+)*)CMD\s+(\[.*\])", FINAL.last("HEALTHCHECK"))
    assert match, "HEALTHCHECK: give its command in the exec form, CMD [...]"
    options = dict(option.removeprefix("--").split("=", 1) for option in match.group(1).split())
    return options, json.loads(match.group(2))


def entrypoint() -> list[str]:
    command = json.loads(FINAL.last("ENTRYPOINT"))
    assert isinstance(command, list), "ENTRYPOINT: give it in the exec form, [...]"
    return command


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[match.group(2)]


# --- what the Dockerfile promises ----------------------------------------------------------------------


def test_the_base_is_an_official_slim_python_311_pinned_to_a_patch_release() -> None:
    assert ARGS.get("PYTHON_IMAGE"), "the base image is the PYTHON_IMAGE build argument"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", ARGS["PYTHON_IMAGE"])
    assert {stage.base for stage in STAGES} == {ARGS["PYTHON_IMAGE"]}
    assert len(STAGES) == 2 and FINAL.name is None


def test_the_build_stage_installs_the_cpu_and_serve_extras_under_the_ci_constraints() -> None:
    install = " ".join(STAGES[0].all("RUN"))
    assert re.search(r"pip install -c ci/constraints\.txt '\.\[cpu,serve\]'", install)
    assert any(args.endswith(" ci/") and "ci/constraints.txt" in args for args in STAGES[0].all("COPY"))
    assert FINAL.all("COPY")[0] == "--from=build /opt/venv /opt/venv"
    assert IMAGE_ENV["PATH"].startswith("/opt/venv/bin:")


def test_the_server_runs_as_a_user_on_every_interface_on_the_default_port_with_volumes() -> None:
    settings = pytest.importorskip("cosyvoice_serve.settings", reason="the serve extra is not installed")
    port = str(settings.DEFAULT_PORT)
    assert FINAL.last("USER") not in ("root", "0")
    assert IMAGE_ENV["COSYVOICE_HOST"] == "0.0.0.0"
    assert IMAGE_ENV["COSYVOICE_PORT"] == port
    assert FINAL.last("EXPOSE") == port
    assert json.loads(FINAL.last("VOLUME")) == [IMAGE_ENV["COSYVOICE_SPEAKERS_DIR"]]
    assert "COSYVOICE_MODEL_DIR" not in IMAGE_ENV, "without a mount, the image serves the demo bundle"
    assert IMAGE_ENV["COSYVOICE_MODEL_MOUNT"].startswith("/models/")


def test_the_health_check_answers_within_dockers_timeout() -> None:
    options, command = healthcheck()
    assert command[0] == "python"
    script = copied_files()[command[1]]
    namespace: dict[str, object] = {}
    exec(compile(script.read_text(encoding="utf-8"), str(script), "exec"), namespace)
    assert float(namespace["TIMEOUT"]) < seconds(options["timeout"])  # type: ignore[arg-type]


def dockerignore_excludes(path: str) -> bool:
    """Whether docker leaves `path` out of the build context: the last pattern that matches it or one of
    its folders decides (`!` keeps), `*` within a name, `**` across folders."""
    excluded = False
    for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not keep
    return excluded


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_private() -> None:
    for stage in STAGES:
        for args in stage.all("COPY"):
            if args.startswith("--from"):
                continue
            for source in args.split()[:-1]:
                files = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*.py")
                for file in files:
                    relative = file.relative_to(ROOT).as_posix()
                    if "__pycache__" not in relative:
                        assert not dockerignore_excludes(relative), relative
    for private in (".venv/bin/python", ".venv-base/pyvenv.cfg", "bundles/fp32/manifest.json",
                    "pretrained_models/Fun-CosyVoice3-0.5B/llm.pt", ".git/HEAD", ".env", "out/a.wav",
                    "serve/__pycache__/cli.cpython-311.pyc", ".pytest_cache/README.md",
                    "tests/test_serve.py"):
        assert dockerignore_excludes(private), private


def test_the_image_builds_the_package_with_its_license_text() -> None:
    copied = {source for stage in STAGES for args in stage.all("COPY") if not args.startswith("--from")
              for source in args.split()[:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert set(project["license-files"]) <= copied


# --- the entrypoint and the health check, run against a live server ----------------------------------


BIN = Path(sys.executable).parent


def needs_the_server() -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    if shutil.which("cosyvoice-serve", path=str(BIN)) is None:
        pytest.skip(f"cosyvoice-serve is not installed beside {sys.executable}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def as_run_here(command: list[str]) -> list[str]:
    """The Dockerfile's command with the files it copies at their place in this repository and the image's
    python as this environment's."""
    files = copied_files()
    return [sys.executable if word == "python" else str(files.get(word, word)) for word in command]


def image_environment(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    """The image's environment, its paths moved under `tmp_path`, bound to loopback (the image's 0.0.0.0
    is checked above), with this environment's scripts first on PATH."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("COSYVOICE_")}
    env.update(IMAGE_ENV)
    env.update(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", COSYVOICE_HOST="127.0.0.1",
               COSYVOICE_PORT=str(port), COSYVOICE_SPEAKERS_DIR=str(tmp_path / "speakers"),
               COSYVOICE_MODEL_MOUNT=str(tmp_path / "models" / "bundle"))
    env.update(extra)
    return env


def run_healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(as_run_here(healthcheck()[1]), env=env, capture_output=True, text=True, timeout=30)


def get_health(port: int, key: str | None = None) -> dict[str, object]:
    """The server's `/health`, asked with the API key `key` where given."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/health",
                                     headers={"X-API-Key": key} if key is not None else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return dict(json.load(response))


@contextmanager
def entrypoint_server(tmp_path: Path, *args: str, **extra_env: str
                      ) -> Iterator[tuple[subprocess.Popen[str], dict[str, str], list[str]]]:
    """The Dockerfile's ENTRYPOINT with `args`, in `tmp_path` (no .env there), once its /health answers; its
    environment and output lines."""
    port = free_port()
    env = image_environment(tmp_path, port, **extra_env)
    with subprocess.Popen([*as_run_here(entrypoint()), *args], env=env, cwd=tmp_path, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as server:
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(server.stdout or ()), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, f"the server ended: {''.join(output)}"
                assert time.monotonic() < deadline, f"the server did not start: {''.join(output)}"
                try:
                    get_health(port)
                    break
                except OSError:
                    time.sleep(0.1)
            yield server, env, output
        finally:
            if server.poll() is None:
                server.kill()
            reader.join(5)


def test_the_health_check_passes_on_a_live_server_and_the_demo_bundle_is_served_without_a_mount(
        tmp_path: Path) -> None:
    needs_the_server()
    # an API key guards every endpoint but /health: the check needs none
    with entrypoint_server(tmp_path, COSYVOICE_API_KEY="container-test-key") as (server, env, output):
        assert "model" not in get_health(int(env["COSYVOICE_PORT"]))  # told only with the key
        assert "demo bundle" in str(get_health(int(env["COSYVOICE_PORT"]), "container-test-key")["model"])
        done = run_healthcheck(env)
        assert (done.returncode, done.stdout) == (0, f"healthy: GET http://127.0.0.1:{env['COSYVOICE_PORT']}"
                                                     "/health\n"), done.stderr
        # exec: the entrypoint's process is the server itself, so SIGTERM (docker stop) reaches it
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"cosyvoice-serve") for part in cmdline), cmdline
        assert not any(part.endswith(b"entrypoint.sh") for part in cmdline), cmdline
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then raises the signal again: the status of a death by SIGTERM here, 0 as a
        # container's PID 1 (which a signal without a handler does not kill)
        assert server.wait(10) == -signal.SIGTERM
        assert time.monotonic() - start < 5
    assert "Application shutdown complete." in "".join(output)  # all read, the server's pipe closed
    done = run_healthcheck(env)  # the same port, closed now
    assert done.returncode == 1, done.stdout
    assert done.stdout.startswith(f"unhealthy: GET http://127.0.0.1:{env['COSYVOICE_PORT']}/health: ")
    assert "refused" in done.stdout


def test_a_mounted_bundle_is_served_and_arguments_reach_the_server(tmp_path: Path) -> None:
    needs_the_server()
    mount = tmp_path / "models" / "bundle"
    mount.parent.mkdir()
    mount.symlink_to(DEMO_BUNDLE, target_is_directory=True)
    with entrypoint_server(tmp_path, "--max-conc", "2", "--queue", "3") as (_, env, _):
        health = get_health(int(env["COSYVOICE_PORT"]))
        assert health["model"] == f"$COSYVOICE_MODEL_DIR ({mount})"
        assert health["sessions"] == {"running": 0, "waiting": 0, "max_concurrency": 2, "max_waiting": 3}
        assert run_healthcheck(env).returncode == 0


def test_the_entrypoint_runs_another_command_in_place_with_the_same_model(tmp_path: Path) -> None:
    def model_dir(env: dict[str, str]) -> str:
        command = [*as_run_here(entrypoint()), "sh", "-c", 'printf %s "$COSYVOICE_MODEL_DIR"']
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
        return done.stdout

    env = image_environment(tmp_path, free_port())
    assert model_dir(env) == ""  # no mount: the demo bundle
    (tmp_path / "models" / "bundle").mkdir(parents=True)
    assert model_dir(env) == env["COSYVOICE_MODEL_MOUNT"]
    assert model_dir({**env, "COSYVOICE_MODEL_DIR": "/elsewhere"}) == "/elsewhere"


class _Answer(BaseHTTPRequestHandler):
    status = 200
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize(("status", "body", "says"), [
    (503, b'{"detail": "overloaded"}', "HTTP Error 503"),
    (200, b'{"status": "starting"}', "status 'starting'"),
    (200, b"<html>another server</html>", "Expecting value"),
])
def test_the_health_check_fails_on_an_answer_that_is_not_healthy(tmp_path: Path, status: int, body: bytes,
                                                                 says: str) -> None:
    handler = type("Answer", (_Answer,), {"status": status, "body": body})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as stub:
        threading.Thread(target=stub.serve_forever, daemon=True).start()
        try:
            done = run_healthcheck(image_environment(tmp_path, stub.server_address[1]))
        finally:
            stub.shutdown()
    assert done.returncode == 1
    assert done.stdout.startswith("unhealthy: ") and says in done.stdout, done.stdout


def test_the_health_check_gives_up_on_a_server_that_never_answers(tmp_path: Path) -> None:
    with socket.socket() as listening:  # accepts connections (the backlog), never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        start = time.monotonic()
        done = run_healthcheck(image_environment(tmp_path, listening.getsockname()[1]))
        took = time.monotonic() - start
    options, _ = healthcheck()
    assert done.returncode == 1 and "timed out" in done.stdout, done.stdout
    assert took < seconds(options["timeout"])


# --- the image, where a Docker daemon is at hand -------------------------------------------------------


def docker(*args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check,
                          env=env)


@pytest.fixture(scope="module")
def image() -> str:
    """The image built from this repository on the Dockerfile's base, or on $BASE_IMAGE_ENV's."""
    if shutil.which("docker") is None:
        pytest.skip("no docker command")
    info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    if info.returncode != 0:
        pytest.skip(f"no Docker daemon: {(info.stderr.strip().splitlines() or ['docker info failed'])[-1]}")
    base = os.environ.get(BASE_IMAGE_ENV) or ARGS["PYTHON_IMAGE"]
    if docker("image", "inspect", base, check=False).returncode != 0:
        pulled = docker("pull", base, check=False, timeout=600)
        if pulled.returncode != 0:
            pytest.skip(f"the base image {base} is not here and cannot be pulled "
                        f"({pulled.stderr.strip()}); ${BASE_IMAGE_ENV} names another")
    env = dict(os.environ)
    if docker("buildx", "version", check=False).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # the classic builder, where the buildx plugin is missing
    # the host's network: pip reaches the package index however the daemon's bridge is set up
    docker("build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={base}", "-t", IMAGE, str(ROOT),
           timeout=1800, env=env)
    return IMAGE


@contextmanager
def container(image: str, *options: str, args: tuple[str, ...] = ()) -> Iterator[str]:
    """A container of `image` given `docker run` options and the image's arguments (no network: the checks
    run inside it), removed at the end."""
    name = f"cosyvoice-test-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "--network", "none", "--health-interval=1s", *options, image, *args,
           timeout=300)
    try:
        yield name
    finally:
        docker("rm", "-f", "-v", name, check=False)  # -v: its anonymous speakers volume too


def wait_healthy(name: str, within: float = 120) -> None:
    """Until docker runs the image's HEALTHCHECK with success."""
    deadline = time.monotonic() + within
    while (status := docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()) != "healthy":
        assert status in ("starting", "unhealthy") and time.monotonic() < deadline, (
            f"{name}: {status}\n{docker('logs', name, check=False).stderr}")
        time.sleep(0.5)


HEALTH = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:50000/health').read().decode())"
REGISTER_ALICE = textwrap.dedent("""\
    import urllib.request
    wav = open("/models/bundle/asset/zero_shot_prompt.wav", "rb").read()
    text = open("/models/bundle/asset/zero_shot_prompt.txt").read().strip()
    def part(name, value, filename=""):
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        return f"--b0b0\\r\\nContent-Disposition: {disposition}\\r\\n\\r\\n".encode() + value + b"\\r\\n"
    body = part("name", b"alice") + part("prompt_text", text.encode()) + part("prompt_wav", wav, "p.wav")
    request = urllib.request.Request("http://127.0.0.1:50000/speakers", data=body + b"--b0b0--\\r\\n",
                                     headers={"Content-Type": "multipart/form-data; boundary=b0b0"})
    print(urllib.request.urlopen(request).status)
    """)
"""`POST /speakers` of the mounted bundle's prompt as "alice", from inside the container (no network)."""


def health_inside(name: str) -> dict[str, object]:
    return dict(json.loads(docker("exec", name, "python", "-c", HEALTH).stdout))


def test_the_image_serves_the_demo_bundle_as_a_user_and_stops_on_sigterm(image: str) -> None:
    with container(image) as name:
        wait_healthy(name)
        assert "demo bundle" in str(health_inside(name)["model"])
        assert docker("exec", name, "id", "-u").stdout.strip() == "10001"
        assert "cosyvoice-serve" in docker("exec", name, "cat", "/proc/1/cmdline").stdout
        start = time.monotonic()
        docker("stop", "--time", "20", name)
        assert time.monotonic() - start < 10, "SIGTERM did not stop the server: docker killed it"
        assert docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() == "0"


def test_the_image_serves_a_mounted_bundle_and_keeps_speakers_in_a_volume(image: str, tmp_path: Path) -> None:
    # the image's own demo bundle, mounted read-only, in the format its runtime reads
    copy = f"cosyvoice-test-{uuid.uuid4().hex[:8]}"
    docker("create", "--name", copy, image)
    try:
        docker("cp", f"{copy}:/opt/venv/lib/python3.11/site-packages/cosyvoice_runtime/demo_bundle",
               str(tmp_path / "bundle"))
    finally:
        docker("rm", "-v", copy)
    volume = f"cosyvoice-test-{uuid.uuid4().hex[:8]}"
    mounts = ["-v", f"{tmp_path / 'bundle'}:/models/bundle:ro", "-v", f"{volume}:/data/speakers"]
    try:
        with container(image, *mounts, args=("--max-conc", "2")) as name:
            wait_healthy(name)
            health = health_inside(name)
            assert health["model"] == "$COSYVOICE_MODEL_DIR (/models/bundle)"
            assert dict(health["sessions"])["max_concurrency"] == 2  # type: ignore[call-overload]
            assert docker("exec", name, "python", "-c", REGISTER_ALICE).stdout.strip() == "201"
        with container(image, *mounts) as name:  # a new container, the same volume
            wait_healthy(name)
            assert health_inside(name)["speakers"] == ["alice"]
    finally:
        docker("volume", "rm", "-f", volume, check=False)
