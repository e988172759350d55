"""`cosyvoice-export download` end to end: the real huggingface_hub client against a local hub.

The hub is an HTTP server on 127.0.0.1 that answers the requests `snapshot_download` makes: the model
info at a revision (`GET /api/models/{repo}/revision/{rev}`, listing `siblings` and the commit `sha`) and
each file's metadata and bytes (`HEAD`/`GET /{repo}/resolve/{rev}/{file}`: `ETag`, `X-Repo-Commit`,
`Content-Length`, and `Range` requests for resumed files), with the Hub's `X-Error-Code` on a 404. The CLI
runs in a subprocess with $HF_ENDPOINT pointing at it, as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import torch
from click.testing import CliRunner

from cosyvoice_export.cli import main
from cosyvoice_export.download import REPO_ID
from cosyvoice_graphs.bundle_layout import QWEN_DIR
from cosyvoice_runtime.bundle_source import console_script

COMMIT = "5f1c0ffee5f1c0ffee5f1c0ffee5f1c0ffee5f1c"
"""The commit the local hub serves every revision it knows at."""
REVISIONS = ("main", COMMIT)
UNUSED = ("speech_tokenizer_v3.batch.onnx", "flow.decoder.estimator.fp32.onnx", "configuration.json",
          "README.md", "CosyVoice-BlankEN/model.safetensors")
"""Files of the release that the download must leave on the hub."""
INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
RANGE = re.compile(r"^bytes=(?P<start>\d+)-$")
LARGE = "asset/large.bin"
"""Larger than the client's 10 MiB read chunk, so that an interrupted download leaves bytes to resume."""
CUT = 1 << 20


@dataclass
class Hub:
    """What the local hub serves, and the requests it has answered."""

    files: dict[str, bytes]
    repo_id: str = REPO_ID
    cut_short: set[str] = field(default_factory=set)
    """Files whose next GET stops a MiB short and closes the connection, as a dropped network does."""
    stall: set[str] = field(default_factory=set)
    """Files whose GET sends a MiB and then waits, as a slow link does, until `resume` is set."""
    resume: threading.Event = field(default_factory=threading.Event)
    refuse: tuple[int, str] | None = None
    """The status and `X-Error-Code` (or "") the model info is answered with instead, where set."""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(method, path, Range header) of every request."""
    endpoint: str = ""

    def gets(self, since: int = 0) -> list[str]:
        """The files fetched (GET on `resolve`) from request `since` on, in order."""
        return [m["file"] for method, path, _ in self.requests[since:] if method == "GET"
                if (m := RESOLVE.match(path))]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass  # the test reads `hub.requests`

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if (m := INFO.match(path)) and hub.refuse is not None:
                status, code = hub.refuse
                self._send(status, b"", {"X-Error-Code": code} if code else {}, body)
            elif m := INFO.match(path):
                if self._known(m["repo"], m["rev"]):
                    siblings = [{"rfilename": name} for name in sorted(hub.files)]
                    info = {"id": hub.repo_id, "sha": COMMIT, "siblings": siblings}
                    self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            elif m := RESOLVE.match(path):
                if self._known(m["repo"], m["rev"]):
                    self._file(m["file"], body)
            else:
                self._send(404, b"", {}, body)

        def _known(self, repo: str, rev: str) -> bool:
            if repo != hub.repo_id:
                self._send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, True)
            elif rev not in REVISIONS:
                self._send(404, b"Revision not found", {"X-Error-Code": "RevisionNotFound"}, True)
            else:
                return True
            return False

        def _file(self, name: str, body: bool) -> None:
            data = hub.files.get(name)
            if data is None:
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
                self._send(404, b"Entry not found", headers, body)
                return
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                       "Accept-Ranges": "bytes"}
            status, start = 200, 0
            if body and (m := RANGE.match(self.headers.get("Range") or "")):
                status, start = 206, int(m["start"])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            part = data[start:]
            if body and name in hub.cut_short:
                hub.cut_short.discard(name)
                self._send(status, part[:-CUT], headers, body, length=len(part))
                self.close_connection = True
                return
            if body and name in hub.stall:
                self._send(status, part[:CUT], headers, body, length=len(part))
                self.wfile.flush()
                hub.resume.wait(60)
                self.close_connection = True
                return
            self._send(status, part, headers, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool,
                  length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


@pytest.fixture(scope="module")
def release(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The release's files as the hub serves them: the tiny bundle, an `llm.rl.pt` of other values, and the
    files the download must skip."""
    files = {p.relative_to(tiny_bundle).as_posix(): p.read_bytes()
             for p in sorted(tiny_bundle.rglob("*")) if p.is_file()}
    generator = torch.Generator().manual_seed(1)
    state = torch.load(tiny_bundle / "llm.pt", weights_only=True)
    rl = {k: v + 0.01 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in state.items()}
    rl_path = tmp_path_factory.mktemp("rl") / "llm.rl.pt"
    torch.save(rl, rl_path)
    files["llm.rl.pt"] = rl_path.read_bytes()
    for name in UNUSED:
        files.setdefault(name, f"{name}: not ours to fetch".encode())
    files[LARGE] = bytes(range(256)) * (12 << 12)  # 12 MiB
    return files


@pytest.fixture
def hub(release: dict[str, bytes]) -> Iterator[Hub]:
    served = Hub(dict(release))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    server.daemon_threads = True
    served.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served
    served.resume.set()
    server.shutdown()
    server.server_close()
    thread.join()


def download(endpoint: str, tmp_path: Path, *args: str, offline: bool = False
             ) -> subprocess.CompletedProcess[str]:
    """Run `cosyvoice-export download ARGS` against `endpoint`, with a Hugging Face home of its own."""
    command = console_script("cosyvoice-export")
    assert command is not None, "cosyvoice-export is not installed (pip install -e .)"
    env = download_env(endpoint, tmp_path)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([command, "download", *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def download_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """The environment `download` runs the command in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"),
                  "HF_HUB_DISABLE_TELEMETRY": "1"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetched(model_dir: Path) -> set[str]:
    """The files the download left in `model_dir`, the hub client's own bookkeeping aside."""
    return {p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(model_dir).parts}


def test_download_fetches_what_we_use_and_checks_it(hub: Hub, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    run = download(hub.endpoint, tmp_path, str(model_dir))
    assert run.returncode == 0, run.stderr
    want = {name for name in hub.files if name not in UNUSED and name != "llm.rl.pt"}
    assert fetched(model_dir) == want
    for name in want:
        assert (model_dir / name).read_bytes() == hub.files[name], name
    assert "ok  llm.pt:" in run.stdout and "ok  hift.pt:" in run.stdout  # the check-bundle step
    assert run.stdout.rstrip().endswith(f"{model_dir}: bundle ok")

    # a second run skips every file it has (no file is requested again) and checks them again
    before = len(hub.requests)
    again = download(hub.endpoint, tmp_path, str(model_dir))
    assert again.returncode == 0, again.stderr
    assert not [path for _, path, _ in hub.requests[before:] if RESOLVE.match(path)]
    assert again.stdout.rstrip().endswith("bundle ok")

    # a file gone is fetched again, and only it
    (model_dir / "flow.pt").unlink()
    before = len(hub.requests)
    assert download(hub.endpoint, tmp_path, str(model_dir)).returncode == 0
    assert hub.gets(since=before) == ["flow.pt"]
    assert (model_dir / "flow.pt").read_bytes() == hub.files["flow.pt"]

    # offline, the files already there are checked
    offline = download(hub.endpoint, tmp_path, str(model_dir), offline=True)
    assert offline.returncode == 0, offline.stderr
    assert "warning: offline mode is on (HF_HUB_OFFLINE); checking the files already in" in offline.stderr
    assert offline.stdout.rstrip().endswith("bundle ok")


@pytest.mark.parametrize(("llm", "checkpoints"), [("rl", {"llm.rl.pt"}), ("both", {"llm.pt", "llm.rl.pt"})])
def test_llm_choice_fetches_and_checks_its_checkpoints(hub: Hub, tmp_path: Path, llm: str,
                                                       checkpoints: set[str]) -> None:
    model_dir = tmp_path / "model"
    run = download(hub.endpoint, tmp_path, str(model_dir), "--llm", llm)
    assert run.returncode == 0, run.stderr
    assert {name for name in fetched(model_dir) if name.startswith("llm.")} == checkpoints
    assert {name for name in hub.gets() if name.startswith("llm.")} == checkpoints
    for name in checkpoints:
        assert (model_dir / name).read_bytes() == hub.files[name]
        assert f"ok  {name}:" in run.stdout


def test_interrupted_download_fails_then_resumes(hub: Hub, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    hub.cut_short.add(LARGE)
    cut = download(hub.endpoint, tmp_path, str(model_dir))
    assert cut.returncode == 2
    assert cut.stderr.splitlines()[-1].startswith("error: the download from ")
    assert "Retrying" not in cut.stderr and "thrown while requesting" not in cut.stderr  # the client's logs
    assert "run the same command again to resume" in cut.stderr
    assert not (model_dir / LARGE).exists()  # a partial file is never left under the real name
    assert "bundle ok" not in cut.stdout

    before = len(hub.requests)
    resumed = download(hub.endpoint, tmp_path, str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    ranges = [rng for method, path, rng in hub.requests[before:] if method == "GET" and path.endswith(LARGE)]
    assert len(ranges) == 1 and (m := RANGE.match(ranges[0] or "")), ranges  # it resumed
    assert 0 < int(m["start"]) <= len(hub.files[LARGE]) - CUT
    assert (model_dir / LARGE).read_bytes() == hub.files[LARGE]


def test_a_bad_file_fails_the_check(hub: Hub, tmp_path: Path) -> None:
    hub.files["hift.pt"] = b"not a checkpoint"
    run = download(hub.endpoint, tmp_path, str(tmp_path / "model"))
    assert run.returncode == 2
    line = run.stderr.splitlines()[-1]
    assert line.startswith(f"error: {tmp_path / 'model' / 'hift.pt'}: ")
    assert line.endswith("; if the download left the file damaged, delete it and run this command again to "
                         "fetch it anew")
    assert "bundle ok" not in run.stdout


def test_ctrl_c_stops_at_once_and_the_next_run_resumes(hub: Hub, tmp_path: Path) -> None:
    """The hub client's pool would finish every file in flight before the interrupt reached the command."""
    model_dir = tmp_path / "model"
    hub.stall.add(LARGE)
    command = console_script("cosyvoice-export")
    assert command is not None
    # a process started from a background shell (CI) inherits SIGINT ignored: Python installs its handler
    # only where it is not
    with subprocess.Popen([command, "download", str(model_dir)], env=download_env(hub.endpoint, tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as child:
        try:
            deadline = time.monotonic() + 120
            while LARGE not in hub.gets() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert LARGE in hub.gets()
            time.sleep(0.5)
            child.send_signal(signal.SIGINT)
            start = time.monotonic()
            _, err = child.communicate(timeout=30)
            waited = time.monotonic() - start
        finally:
            child.kill()  # never left running past a failed step, nor waited for
    assert child.returncode == 130 and waited < 10, (child.returncode, waited, err)  # the stall is 60 s
    assert err.splitlines()[-1] == "interrupted: run the same command again to resume the download"
    hub.stall.clear()
    hub.resume.set()
    resumed = download(hub.endpoint, tmp_path, str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert (model_dir / LARGE).read_bytes() == hub.files[LARGE]


def test_a_target_that_is_a_file_is_refused_before_the_hub(hub: Hub, tmp_path: Path) -> None:
    (tmp_path / "model").write_text("")
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "model")))
    assert line == f"error: MODEL_DIR {tmp_path / 'model'}: is a file, not a folder"
    assert hub.requests == []


@pytest.mark.parametrize(("status", "code", "says"), [
    (403, "GatedRepo", f"{REPO_ID} is gated at {{endpoint}}: accept its terms at {{endpoint}}/{REPO_ID}, "
                       "then set HF_TOKEN to a token that can read it, or run `huggingface-cli login`"),
    (401, "RepoNotFound", f"{REPO_ID}: no such repository at {{endpoint}} (or none that this token, or no "
                          "token, may read: set HF_TOKEN"),
    (401, "", "(set HF_TOKEN to a token that can read it, or run `huggingface-cli login`), and "),
])
def test_a_hub_that_wants_a_token_says_how_to_give_one(hub: Hub, tmp_path: Path, status: int, code: str,
                                                       says: str) -> None:
    hub.refuse = (status, code)
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "model")))
    assert says.format(endpoint=hub.endpoint) in line, line


def one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def test_unreachable_hub_is_one_line_with_the_files_to_place(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    line = one_error_line(download(f"http://127.0.0.1:{closed_port()}", tmp_path, str(model_dir)))
    assert line.startswith("error: cannot reach http://127.0.0.1:")
    assert f"into {model_dir}" in line and "llm.pt, flow.pt, hift.pt" in line
    assert f"cosyvoice-export check-bundle {model_dir}" in line
    assert not model_dir.exists()


def test_offline_without_files_is_one_line(tmp_path: Path) -> None:
    line = one_error_line(download(f"http://127.0.0.1:{closed_port()}", tmp_path, str(tmp_path / "model"),
                                   "--llm", "rl", offline=True))
    assert "offline mode is on (HF_HUB_OFFLINE)" in line
    assert "llm.rl.pt" in line and "check-bundle" in line and "--llm rl" in line


def test_a_release_in_the_hugging_face_cache_is_placed_from_there(hub: Hub, tmp_path: Path) -> None:
    """A release an earlier download left in the Hugging Face cache (`hf download`, upstream's
    `snapshot_download` without a folder) is placed in the model directory instead of fetched again: with
    the hub asked for its commit only, or without the hub where it cannot be reached (offline, or the hub
    down); its files are checked as a download's are."""
    cache_it = ("from huggingface_hub import snapshot_download; "
                f"snapshot_download({REPO_ID!r}, ignore_patterns=['llm.rl.pt'])")
    env = download_env(hub.endpoint, tmp_path)
    run = subprocess.run([sys.executable, "-c", cache_it], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    want = {name for name in hub.files if name not in UNUSED and name != "llm.rl.pt"}
    for model_dir, endpoint, offline in ((tmp_path / "online", hub.endpoint, False),
                                         (tmp_path / "offline", hub.endpoint, True),
                                         (tmp_path / "down", f"http://127.0.0.1:{closed_port()}", False)):
        before = len(hub.requests)
        placed = download(endpoint, tmp_path, str(model_dir), offline=offline)
        assert placed.returncode == 0, placed.stderr
        assert "placing the release's files from the Hugging Face cache" in placed.stderr
        assert placed.stdout.rstrip().endswith(f"{model_dir}: bundle ok")
        asked = [path for _, path, _ in hub.requests[before:]]
        assert asked == ([f"/api/models/{REPO_ID}/revision/main"] if model_dir.name == "online" else [])
        assert fetched(model_dir) == want
        assert all((model_dir / name).read_bytes() == hub.files[name] for name in want)
        assert not any(path.is_symlink() for path in model_dir.rglob("*"))  # files of its own, not links

    # a cache without the chosen checkpoint (that download left `llm.rl.pt` out) does not hold the release:
    # fetched from the hub where it answers
    before = len(hub.requests)
    assert download(hub.endpoint, tmp_path, str(tmp_path / "rl"), "--llm", "rl").returncode == 0
    assert "llm.rl.pt" in hub.gets(since=before)
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "rl-offline"), "--llm", "rl",
                                   offline=True))
    assert "does not hold the release yet (nor does the Hugging Face cache)" in line


def test_the_copies_of_a_placement_killed_outright_are_removed(hub: Hub, tmp_path: Path) -> None:
    """A placement from the Hugging Face cache copies where it cannot link (the cache on another
    filesystem): one killed outright (kill -9, the out-of-memory killer) leaves its temporary copy, GBs
    hidden by a leading dot, which the next placement removes, whether its file was placed or not."""
    cache_it = ("from huggingface_hub import snapshot_download; "
                f"snapshot_download({REPO_ID!r}, ignore_patterns=['llm.rl.pt'])")
    run = subprocess.run([sys.executable, "-c", cache_it], env=download_env(hub.endpoint, tmp_path),
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    model_dir = tmp_path / "model"
    (model_dir / QWEN_DIR).mkdir(parents=True)
    (model_dir / "flow.pt").write_bytes(hub.files["flow.pt"])  # placed before the kill
    left = [model_dir / ".llm.pt.0123abcd.tmp", model_dir / ".flow.pt.89abcdef.tmp",
            model_dir / QWEN_DIR / ".vocab.json.00ff00ff.tmp"]
    for path in left:
        path.write_bytes(b"part of a copy")
    kept = model_dir / ".llm.pt.notours.tmp"
    kept.write_bytes(b"")
    placed = download(hub.endpoint, tmp_path, str(model_dir), offline=True)
    assert placed.returncode == 0, placed.stderr
    assert not any(path.exists() for path in left) and kept.exists()
    kept.unlink()
    assert fetched(model_dir) == {name for name in hub.files if name not in UNUSED and name != "llm.rl.pt"}


def test_missing_repository_and_revision_are_one_line(hub: Hub, tmp_path: Path) -> None:
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "model"), "--revision", "v9"))
    assert line == f"error: {REPO_ID}: no revision 'v9' at {hub.endpoint}"
    hub.repo_id = "FunAudioLLM/another-model"
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "model")))
    assert line.startswith(f"error: {REPO_ID}: no such repository at {hub.endpoint} (or none that this")
    assert "; to place the files by hand" in line
    assert not (tmp_path / "model").exists()


def test_a_release_without_the_chosen_checkpoint_is_one_line(hub: Hub, tmp_path: Path) -> None:
    del hub.files["llm.rl.pt"]
    line = one_error_line(download(hub.endpoint, tmp_path, str(tmp_path / "model"), "--llm", "both"))
    assert line == f"error: {REPO_ID}@main: the repository has no llm.rl.pt"


@pytest.mark.skipif(find_spec("modelscope") is not None, reason="modelscope is installed here")
def test_modelscope_without_its_package_says_how_to_install_it(tmp_path: Path) -> None:
    line = one_error_line(download("http://127.0.0.1:9", tmp_path, str(tmp_path / "model"),
                                   "--source", "modelscope"))
    assert line == "error: --source modelscope needs the modelscope package: pip install modelscope"


def test_bundle_check_accepts_the_rl_checkpoint_in_place_of_llm_pt(release: dict[str, bytes],
                                                                   tmp_path: Path) -> None:
    rl_only = tmp_path / "rl-only"
    for name, data in release.items():
        if name != "llm.pt":
            (rl_only / name).parent.mkdir(parents=True, exist_ok=True)
            (rl_only / name).write_bytes(data)
    check = CliRunner().invoke(main, ["check-bundle", str(rl_only), "--llm", "rl"])
    assert check.exit_code == 0, check.stderr
    assert "ok  llm.rl.pt:" in check.stdout
    base = CliRunner().invoke(main, ["check-bundle", str(rl_only)])
    assert base.exit_code == 2
    assert base.stderr == f"error: {rl_only / 'llm.pt'}: file not found\n"
