"""A synthesis's progress on stderr, for `cosyvoice-run`: speech tokens against the LLM's length cap, then
the flow and the vocoder, segment by segment. On a terminal a tqdm bar; otherwise (a log, a pipe) one line
every `interval_s` seconds and one when a stage starts, so that a long synthesis shows where it is.

The LLM's cap is upstream's `max_len` (20 speech tokens per text token): a real model stops well before it,
random weights run to it, so the bar says "at most".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Self, TextIO

from tqdm import tqdm

from .llm import MAX_TOKEN_TEXT_RATIO
from .segments import Segment

LINE_INTERVAL_S = 5.0
"""Seconds between two progress lines where stderr is not a terminal."""


def token_cap(segment: Segment) -> int:
    """The LLM's length cap for `segment` (`SpeechTokenLM.decode`'s max_len)."""
    return int(MAX_TOKEN_TEXT_RATIO * len(segment.text_ids))


class SynthesisProgress:
    """Progress over `segments`: `watch(i)` wraps segment i's speech-id iterator (`CosyVoice3.speak`'s
    `watch`); use as a context manager."""

    def __init__(self, segments: Sequence[Segment], *, out: TextIO | None = None,
                 interval_s: float = LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out if out is not None else sys.stderr
        self.caps = [token_cap(s) for s in segments]
        self.interval_s, self.clock = interval_s, clock
        self.tokens = 0
        """Speech tokens decoded so far, every segment."""
        self._start = self._last = clock()
        self._bar = (tqdm(total=sum(self.caps), unit="token", desc="speech tokens", file=self.out,
                          leave=False, dynamic_ncols=True) if self.out.isatty() else None)

    def watch(self, index: int) -> Callable[[Iterator[int]], Iterator[int]]:
        """The wrapper of segment `index`'s speech ids: counts each, then marks the flow and vocoder."""
        def watched(ids: Iterator[int]) -> Iterator[int]:
            self._stage(index, "speech tokens")
            for token in ids:
                self._advance(index)
                yield token
            self._stage(index, "flow and vocoder")
        return watched

    def _where(self, index: int) -> str:
        return f"segment {index + 1}/{len(self.caps)}"

    def _stage(self, index: int, stage: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._where(index)}: {stage}")
        else:
            self._line(index, stage)

    def _advance(self, index: int) -> None:
        self.tokens += 1
        if self._bar is not None:
            self._bar.update()
        elif self.clock() - self._last >= self.interval_s:
            self._line(index, "speech tokens")

    def _line(self, index: int, stage: str) -> None:
        now = self.clock()
        self._last = now
        print(f"synthesising: {self._where(index)}, {stage}; {self.tokens} speech tokens of at most "
              f"{sum(self.caps)}; {now - self._start:.0f} s", file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
