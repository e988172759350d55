"""The README's first command and its four real-model commands, run in order as bash runs them, in a copy of
the checkout with a venv of its own: the install lines are all a newcomer types. The download goes to a local
hub serving the tiny bundle as the release (test_download's); the server is started, asked for its health
and stopped."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import httpx
from test_download import Hub, hub, release  # noqa: F401  (the local hub's fixtures)

from cosyvoice_runtime.demo import DEMO_BUNDLE

ROOT = Path(__file__).resolve().parent.parent
INSTALL = 900
"""Seconds the venv's installs may take (torch among them; pip's cache is warm where CI ran first)."""


def readme_blocks() -> tuple[str, list[str]]:
    """The README's first command (its venv and install only: the demo is the test suite's business) and
    the lines of its real-model block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = text.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()[0]
    install = first.split(" && .venv/bin/cosyvoice-export demo")[0]
    block = text.split("Real model, in four commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return install, [line for line in block.strip().splitlines() if line.strip()]


def checkout_copy(to: Path) -> Path:
    """The tracked files of this checkout, as a fresh clone has them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


def test_the_readmes_commands_run_in_order_in_a_fresh_venv(hub: Hub, tmp_path: Path) -> None:  # noqa: F811
    install, lines = readme_blocks()
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install -e ")
    work = checkout_copy(tmp_path / "checkout")
    shutil.copy(DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav", work / "voice.wav")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COSYVOICE_", "VIRTUAL_ENV"))}
    env |= {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "COSYVOICE_CACHE_DIR": str(tmp_path / "cache")}
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    install = install.replace("python3 ", f"{python} ", 1)  # the interpreter this suite runs, not a venv's
    done = subprocess.run(["bash", "-c", f"{install} --quiet --disable-pip-version-check"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=INSTALL)
    assert done.returncode == 0, done.stderr[-3000:]
    *commands, serve = lines
    for line in commands:
        quiet = " --quiet --disable-pip-version-check" if "pip install" in line else ""
        command = line.split("  #")[0] + quiet
        done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=INSTALL)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    assert (work / "hello.wav").stat().st_size > 44
    port = re.search(r"127\.0\.0\.1:(\d+)", serve)
    assert port is not None and serve.startswith(".venv/bin/cosyvoice-serve ")
    server = subprocess.Popen(["bash", "-c", f"exec {serve.split('  #')[0]}"], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port[1]}/health", timeout=2)
                break
            except httpx.TransportError:
                alive = server.poll() is None and time.monotonic() < deadline
                assert alive, server.stderr.read() if server.stderr else "the server stopped"
                time.sleep(0.5)
        assert health.status_code == 200 and health.json()["status"] == "healthy"
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
