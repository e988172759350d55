"""Ray Serve replicas against one server process: throughput, first-chunk latency and memory of
`cosyvoice-serve --ray --replicas N` at several concurrencies, measured from an HTTP client.

`python -m cosyvoice_bench.serve_replicas --model DIR` starts each server as its own process (its Ray
instance local, the replicas sharing this machine's CPUs equally: `--replica-cpus` is usable CPUs / N, so
each replica's graphs run on that many threads), warms every replica, then runs each concurrency level as
that many clients each streaming `--requests` syntheses one after the other through
`/v1/audio/speech` (the bundle's own voice, PCM, greedy, seed 0). The single-process server
(`cosyvoice-serve`, graphs on every CPU) is the baseline. Replicas' memory is each replica process's RSS
(Linux: /proc) after the load. A client only: it imports neither the server nor Ray.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from cosyvoice_runtime.atomic_files import check_writable, write_json_atomic
from cosyvoice_runtime.cli_options import NonEmptyPath

from .cases import parse_levels
from .errors import BenchError, user_errors
from .machine import describe, usable_cpus

SAMPLE_RATE = 24000
REPLICA_TITLE = "ray::ServeReplica:cosyvoice:CosyVoice"
"""The process title Ray gives a replica of `cosyvoice-serve --ray`'s deployment."""
DEFAULT_TEXT = "Hello there, this is a test of the server."


@dataclass(frozen=True)
class Request:
    """One streamed synthesis as the client saw it."""

    first_chunk_s: float
    """From sending the request to the first audio bytes."""
    total_s: float
    audio_s: float
    served_by: str


@dataclass(frozen=True)
class Level:
    """One concurrency level on one server."""

    concurrency: int
    requests: int
    wall_s: float
    audio_s: float
    audio_per_s: float
    """Seconds of audio made per second of wall time, all clients together."""
    requests_per_min: float
    first_chunk_median_s: float
    first_chunk_max_s: float
    replicas_used: int
    load_1min: float
    """The machine's load average when the level started: other work shares the CPUs too."""


@dataclass(frozen=True)
class ServerRun:
    """One server: its replicas (0: the single-process server) and what it did."""

    replicas: int
    cpus_per_replica: float
    start_s: float
    """From launching the command to its first answer."""
    rss_mib: list[float]
    """Each replica process's (the server process's) resident memory after the load."""
    levels: list[Level]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def speak(port: int, text: str) -> Request:
    """Stream one synthesis, timing the first audio bytes and the whole."""
    body = json.dumps({"input": text, "voice": "alloy", "response_format": "pcm", "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    started = time.monotonic()
    connection.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = response.read1(65536)
    first_chunk = time.monotonic() - started
    size = len(first) + len(response.read())
    total = time.monotonic() - started
    connection.close()
    return Request(first_chunk, total, size / 2 / SAMPLE_RATE, response.getheader("X-Served-By") or "")


def run_level(port: int, text: str, concurrency: int, per_client: int) -> Level:
    """`concurrency` clients, each streaming `per_client` syntheses back to back."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        done = [r for client in pool.map(lambda _: [speak(port, text) for _ in range(per_client)],
                                         range(concurrency)) for r in client]
    wall = time.monotonic() - started
    audio = sum(r.audio_s for r in done)
    firsts = [r.first_chunk_s for r in done]
    return Level(concurrency, len(done), round(wall, 2), round(audio, 2), round(audio / wall, 3),
                 round(60 * len(done) / wall, 2), round(statistics.median(firsts), 3), round(max(firsts), 3),
                 len({r.served_by for r in done}), round(load, 2))


def replica_rss_mib(server_pid: int, replicas: int) -> list[float]:
    """Each replica process's RSS, or the server process's when it has no replicas."""
    if replicas == 0:
        pids = [server_pid]
    else:
        pids = [int(p) for p in os.listdir("/proc")
                if p.isdigit() and _cmdline(int(p)).startswith(REPLICA_TITLE)]
    return sorted(round(_rss_kib(pid) / 1024, 1) for pid in pids)


def bench_server(model: Path | None, replicas: int, text: str, levels: list[int], per_client: int
                 ) -> ServerRun:
    """Start the server (`replicas` 0: the single-process one), warm every replica, run each level."""
    port, cpus = free_port(), usable_cpus() / max(replicas, 1)
    with tempfile.TemporaryDirectory() as speakers:
        command = [sys.executable, "-m", "cosyvoice_serve", "--port", str(port), "--sampling", "greedy",
                   "--seed", "0", "--speakers", speakers, "--max-conc", "1", "--queue", str(2 * max(levels))]
        if model is not None:
            command += ["--model", str(model)]
        if replicas:
            command += ["--ray", "--replicas", str(replicas), "--replica-cpus", f"{cpus:g}"]
        started = time.monotonic()
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        errors: list[str] = []
        threading.Thread(target=lambda: errors.extend(server.stderr or ()), daemon=True).start()
        try:
            _wait_for_health(port, server, errors)
            start_s = time.monotonic() - started
            seen: set[str] = set()
            warm = 2 * max(replicas, 1)
            while len(seen) < max(replicas, 1):  # every replica pays its first request before the figures
                with ThreadPoolExecutor(warm) as pool:
                    seen |= {r.served_by for r in pool.map(lambda _: speak(port, text), range(warm))}
            results = [run_level(port, text, level, per_client) for level in levels]
            rss = replica_rss_mib(server.pid, replicas)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
    return ServerRun(replicas, cpus, round(start_s, 1), rss, results)


def render(runs: list[ServerRun], machine: dict[str, Any], text: str) -> str:
    """The figures as a table."""
    lines = [f"CPU: {machine['cpu']} ({', '.join(machine['cpu_flags'])}), {machine['usable_cpus']} usable "
             f"CPUs, {machine['memory_gib']} GiB; text: {text!r}",
             "server              CPUs/replica  clients  requests  wall s  audio s/s  req/min  first chunk "
             "median s  max s  replicas used  load  RSS per replica MiB"]
    for run in runs:
        name = "single process" if run.replicas == 0 else f"ray, {run.replicas} replica(s)"
        for level in run.levels:
            lines.append(f"{name:<18}  {run.cpus_per_replica:>12g}  {level.concurrency:>7}  "
                         f"{level.requests:>8}  "
                         f"{level.wall_s:>6.1f}  {level.audio_per_s:>9.3f}  {level.requests_per_min:>7.2f}  "
                         f"{level.first_chunk_median_s:>20.2f}  {level.first_chunk_max_s:>5.2f}  "
                         f"{level.replicas_used:>13}  {level.load_1min:>4.1f}  "
                         f"{', '.join(f'{m:.0f}' for m in run.rss_mib)}")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Runtime bundle [default: the servers' default, the demo bundle]")
@click.option("--replicas", default="0,1,2", show_default=True,
              help="Servers to measure, comma-separated: 0 is the single-process server, N Ray replicas.")
@click.option("--concurrency", default="1,2,4", show_default=True, help="Clients at once, comma-separated.")
@click.option("--requests", "per_client", type=click.IntRange(min=1), default=2, show_default=True,
              help="Syntheses each client streams, one after the other.")
@click.option("--text", default=DEFAULT_TEXT, show_default=True)
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write the results as JSON (atomically).")
def main(model: Path | None, replicas: str, concurrency: str, per_client: int, text: str,
         json_out: Path | None) -> None:
    """Throughput, first-chunk latency and memory of `cosyvoice-serve --ray` replicas against the
    single-process server, from an HTTP client on this machine."""
    with user_errors():
        counts = parse_replicas(replicas, usable_cpus())
        levels = parse_levels(concurrency)
        if not text.strip():
            raise BenchError("--text: nothing to speak")
        if model is not None and not model.is_dir():
            raise BenchError(f"--model {model}: not a folder")
        if json_out is not None:
            check_writable(json_out, "--json")
    machine = describe(usable_cpus(), None)
    runs = [bench_server(model, n, text, levels, per_client) for n in counts]
    click.echo(render(runs, machine, text))
    if json_out is not None:
        write_json_atomic(json_out, {"machine": machine, "text": text, "model": str(model) if model else None,
                                     "runs": [asdict(r) for r in runs]})


def parse_replicas(text: str, cpus: int) -> list[int]:
    """'0,1,2' -> [0, 1, 2]: 0 (the single-process server) or a count of Ray replicas, each with a share of
    the `cpus` usable CPUs (at most one replica a CPU)."""
    items = [item.strip() for item in text.split(",")]
    bad = [item for item in items if not item.isdigit() or int(item) > cpus]
    if not items or bad or len(set(items)) != len(items):
        raise BenchError(f"--replicas: {text!r}; expected distinct counts from 0 (the single-process server) "
                         f"to {cpus} (a replica per usable CPU at most), comma-separated")
    return [int(item) for item in items]


def _wait_for_health(port: int, server: subprocess.Popen[str], errors: list[str]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise click.ClickException(f"the server stopped: {''.join(errors[-5:])}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise click.ClickException("the server did not answer /health within 10 minutes")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    main()
