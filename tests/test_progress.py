"""`cosyvoice-run`'s progress: speech tokens against the LLM's cap, then the flow and vocoder, per segment;
a line every few seconds where stderr is no terminal, a bar where it is one."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from cosyvoice_runtime.cli import main
from cosyvoice_runtime.progress import SynthesisProgress, token_cap
from cosyvoice_runtime.segments import Segment

SEGMENTS = [Segment("Hello there.", list(range(4)), []), Segment("How are you?", list(range(10)), [])]


class Clock:
    """A clock that a fake synthesis moves on: one second per speech token."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _slow_tokens(clock: Clock, n: int) -> Iterator[int]:
    for i in range(n):
        clock.now += 1.0
        yield i


def test_a_long_synthesis_prints_its_tokens_every_few_seconds_off_a_terminal() -> None:
    out, clock = io.StringIO(), Clock()
    assert [token_cap(s) for s in SEGMENTS] == [80, 200]
    with SynthesisProgress(SEGMENTS, out=out, interval_s=5.0, clock=clock) as progress:
        for i, n in enumerate((12, 7)):
            assert list(progress.watch(i)(_slow_tokens(clock, n))) == list(range(n))
    lines = out.getvalue().splitlines()
    assert lines == [
        "synthesising: segment 1/2, speech tokens; 0 speech tokens of at most 280; 0 s",
        "synthesising: segment 1/2, speech tokens; 5 speech tokens of at most 280; 5 s",
        "synthesising: segment 1/2, speech tokens; 10 speech tokens of at most 280; 10 s",
        "synthesising: segment 1/2, flow and vocoder; 12 speech tokens of at most 280; 12 s",
        "synthesising: segment 2/2, speech tokens; 12 speech tokens of at most 280; 12 s",
        "synthesising: segment 2/2, speech tokens; 17 speech tokens of at most 280; 17 s",
        "synthesising: segment 2/2, flow and vocoder; 19 speech tokens of at most 280; 19 s",
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_counts_the_tokens() -> None:
    out = Terminal()
    with SynthesisProgress(SEGMENTS, out=out) as progress:
        list(progress.watch(0)(iter(range(30))))
        assert progress._bar is not None and progress._bar.n == 30 and progress._bar.total == 280
    text = out.getvalue()
    assert "speech tokens" in text and "segment 1/2: flow and vocoder" in text


def test_cosyvoice_run_shows_its_progress(tmp_path: Path) -> None:
    done = CliRunner().invoke(main, ["--text", "Hello there.", "--out", str(tmp_path / "a.wav")])
    assert done.exit_code == 0, done.output
    stderr = done.stderr
    assert "synthesising: segment 1/1, speech tokens; 0 speech tokens of at most " in stderr
    assert "synthesising: segment 1/1, flow and vocoder; " in stderr


def test_cosyvoice_run_takes_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads reaches the runtime, as cosyvoice-bench's, cosyvoice-golden's and cosyvoice-serve's do."""
    import cosyvoice_runtime.cli as run_cli

    opened: list[int | None] = []
    real = run_cli.CosyVoice3

    def recording(*args: object, threads: int | None = None, **kwargs: object) -> object:
        opened.append(threads)
        return real(*args, threads=threads, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(run_cli, "CosyVoice3", recording)
    done = CliRunner().invoke(main, ["--text", "Hi.", "--threads", "1", "--out", str(tmp_path / "a.wav")])
    assert done.exit_code == 0, done.output
    assert opened == [1]
