"""Sessions of one graph, each call on the session whose last call had its input shapes.

onnxruntime's CUDA `Conv` (cuDNN 9's frontend) builds its execution plans again whenever a node's input
shapes differ from its previous call's, keeping none of the plans it built before (`Conv::UpdateState`,
onnxruntime 1.31): the vocoder's decoder paid 0.12 to 0.19 s for it at each new frame count on an H200,
against 5.5 to 19 ms a call after (docs/gpu.md). A stream's vocoder windows come in a few lengths (a first
chunk's, a later chunk's, the last one's), and streams interleave their calls, so on one session nearly
every call would pay it; with a session per length, only a length new to every session does.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Self

import numpy as np

from cosyvoice_graphs import GraphSpec

from .base import Feed, Runner, feed_shape

Shapes = tuple[tuple[str, tuple[int, ...] | None], ...]
"""A call's feeds by name, with their shapes (None for what is not a feed: the runner's check names it)."""


def _shapes(feeds: Mapping[str, Feed]) -> Shapes:
    def shape(value: Feed) -> tuple[int, ...] | None:
        try:
            return feed_shape(value)
        except TypeError:
            return None

    return tuple(sorted((name, shape(value)) for name, value in feeds.items()))


class ShapePool:
    """A `Runner` over several runners of one graph: a call runs on the runner whose last call had the same
    input shapes, else on the one least recently used among those running no call, which keeps the new
    shapes from then on. `reshaped` counts the calls that came to a runner with other shapes than its
    last call's (where a CUDA `Conv` builds its plans again)."""

    def __init__(self, runners: Sequence[Runner]) -> None:
        if not runners:
            raise ValueError("a shape pool needs at least one runner")
        names = {r.spec.name for r in runners}
        if len(names) != 1:
            raise ValueError(f"a shape pool runs one graph, not {', '.join(sorted(names))}")
        self._runners = list(runners)
        self._shapes: list[Shapes | None] = [None] * len(runners)
        self._running = [0] * len(runners)
        self._last_used = [0] * len(runners)
        self._calls = 0
        self._lock = threading.Lock()
        self.reshaped = 0

    @property
    def spec(self) -> GraphSpec:
        return self._runners[0].spec

    @property
    def size(self) -> int:
        """How many runners the pool holds."""
        return len(self._runners)

    @contextmanager
    def _runner(self, feeds: Mapping[str, Feed]) -> Iterator[Runner]:
        shapes = _shapes(feeds)
        with self._lock:
            i = self._choose(shapes)
            if self._shapes[i] != shapes:
                self.reshaped += self._shapes[i] is not None
                self._shapes[i] = shapes
            self._calls += 1
            self._running[i] += 1
            self._last_used[i] = self._calls
        try:
            yield self._runners[i]
        finally:
            with self._lock:
                self._running[i] -= 1

    def _choose(self, shapes: Shapes) -> int:
        """The runner for a call of `shapes` (under the lock)."""
        for i, held in enumerate(self._shapes):
            if held == shapes:
                return i
        idle = [i for i, running in enumerate(self._running) if not running] or range(len(self._runners))
        return min(idle, key=lambda i: self._last_used[i])

    def infer(self, feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
        return self.infer_outputs(feeds, self.spec.output_names)

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        with self._runner(feeds) as runner:
            return runner.infer_outputs(feeds, names)

    def infer_kept(self, feeds: Mapping[str, Feed], keep: Collection[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Feed]]:
        with self._runner(feeds) as runner:
            return runner.infer_kept(feeds, keep)

    def close(self) -> None:
        for runner in self._runners:
            runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
