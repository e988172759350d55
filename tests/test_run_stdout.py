"""`cosyvoice-run --out -`: WAV on standard output, for a player. Offline, the file `--out` would write;
streamed, a header of unknown length and each chunk as it is made; refused on a terminal; a reader that
leaves stops the run."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_runtime.audio_files import streaming_wav_header
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE

TEXT = "Hello there, this is a test."
LONG = " ".join(f"This is sentence number {i} of a long text." for i in range(10))
"""Minutes of the demo's audio: seconds of work after its first chunk."""


def run(*args: str) -> tuple[bytes, str]:
    result = CliRunner().invoke(run_main, ["--model", str(DEMO_BUNDLE), "--sampling", "greedy", "--text",
                                           TEXT, *args])
    assert result.exit_code == 0, result.output
    return result.stdout_bytes, result.stderr


def run_process(*args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cosyvoice_runtime", "--model", str(DEMO_BUNDLE), *args],
                            stderr=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]


def test_offline_it_is_the_wav_file(tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    run("--out", str(out))
    data, said = run("--out", "-")
    assert data == out.read_bytes()
    assert said.splitlines()[-1].startswith("wrote standard output: ")


def test_streamed_it_is_a_header_then_the_streamed_files_samples(tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    run("--stream", "--out", str(out))
    data, _ = run("--stream", "--out", "-")
    header = streaming_wav_header(24000)
    assert data[:len(header)] == header
    np.testing.assert_array_equal(np.frombuffer(data[len(header):], "<i2"), sf.read(out, dtype="int16")[0])


def test_a_streamed_chunk_leaves_while_the_rest_is_made() -> None:
    process = run_process("--stream", "--text", LONG, "--out", "-", stdout=subprocess.PIPE)
    assert process.stdout is not None
    first = process.stdout.read(len(streaming_wav_header(24000)) + 2 * 24000 // 2)  # the header and 0.5 s
    still_running = process.poll() is None
    rest = process.stdout.read()
    assert process.wait(timeout=300) == 0
    assert still_running, "the first half second came only once the run had ended"
    assert len(first) + len(rest) > 2 * 24000 * 60  # over a minute of audio in all


def test_a_terminal_is_refused_before_the_work() -> None:
    terminal, other = pty.openpty()
    try:
        process = run_process("--text", TEXT, "--out", "-", stdout=other)
        _, said = process.communicate(timeout=120)
    finally:
        os.close(terminal)
        os.close(other)
    assert process.returncode == 2
    assert said.decode().splitlines() == ["error: --out -: standard output is a terminal; pipe it into a "
                                          "player (`| aplay`) or give a file name"]


def test_a_reader_that_leaves_stops_the_run_in_one_line() -> None:
    process = run_process("--stream", "--text", LONG, "--out", "-", stdout=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.read(100)
    process.stdout.close()  # a player that quit
    _, said = process.communicate(timeout=300)
    assert process.returncode == 1
    lines = said.decode().splitlines()
    assert lines[-1] == "error: --out -: its reader closed standard output before the audio's end", lines
    assert not any(line.startswith("wrote ") for line in lines)
