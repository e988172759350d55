"""Concurrent streams' calls of one graph gathered into stacked calls: `CallStack` groups the calls that
streams' chunks make with equal keys (what their rows must share to be one call) and runs each group as one
call, each stream getting its part back.

A chunk joins the stack as a member for the work that makes its calls (`CallStack.member`). A call waits while
another of the stack's calls runs (one at a time), and when its turn comes, up to `linger_s` more for the
members that may still make a call of its key: those whose next call is that key or not known yet, that are
not waiting already and not held at their chunk's pause. Streams whose chunks started together then go
through their calls together. `dit_stack` and the vocoder stack the streams' DiT and HiFT calls this way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from cosyvoice_graphs import MAX_BATCH

LINGER_S = 0.005
"""How long a gathered call waits at most for the chunks expected to join it: a few launches' worth on a GPU
(a stream's DiT call took ~19 ms on an H200)."""

K = TypeVar("K", bound=Hashable)
"""A call's key: calls of equal keys can run as one."""
J = TypeVar("J")
"""What a stream brings to a call."""
R = TypeVar("R")
"""What a stream gets back."""


@dataclass(eq=False)
class StackMember(Generic[K]):
    """One chunk's part in a `CallStack` (`CallStack.member`): its calls go through the stack."""

    next_key: K | None = None
    """The key of the chunk's next call where known (None before its first, unless given, and after its
    last)."""
    started: bool = False
    """Whether its next call's key is known: before, it is expected for any key."""
    pausing: bool = False
    """Held at the chunk's pause (its turn's): not expected to join a call until it returns."""
    pending: bool = False
    """Its call waits to be gathered."""


@dataclass(eq=False)
class _Call(Generic[K, J, R]):
    member: StackMember[K]
    key: K
    job: J
    arrived: float
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class CallStack(Generic[K, J, R]):
    """Gathers concurrent chunks' calls by key and runs each group of up to `max_streams` as one call of
    `run_group` (see the module)."""

    def __init__(self, run_group: Callable[[K, list[J]], list[R]], *,
                 after: Callable[[K], K | None] = lambda key: None, max_streams: int = MAX_BATCH,
                 linger_s: float = LINGER_S) -> None:
        """`run_group(key, jobs)` runs one call of the streams' `jobs` (one or more, of `key`) and gives each
        its part, in order; `after(key)` is the key of a chunk's next call after one of `key` (None: no
        more)."""
        if not 1 <= max_streams <= MAX_BATCH:
            raise ValueError(f"max_streams must be 1 to {MAX_BATCH}, got {max_streams}")
        self.run_group, self.after = run_group, after
        self.max_streams, self.linger_s = max_streams, linger_s
        self.calls = 0
        """Calls made."""
        self.streams = 0
        """Stream calls they served: `streams / calls` streams a call."""
        self.stacked = 0
        """Calls of more than one stream."""
        self._cond = threading.Condition()
        self._members: set[StackMember[K]] = set()
        self._pending: list[_Call[K, J, R]] = []
        self._running = False

    @contextmanager
    def member(self, next_key: K | None = None) -> Iterator[StackMember[K]]:
        """A chunk's place in the stack while its work runs: calls of its key (`next_key` where known
        already, else any) wait for it."""
        member: StackMember[K] = StackMember(next_key, started=next_key is not None)
        with self._cond:
            self._members.add(member)
        try:
            yield member
        finally:
            with self._cond:
                self._members.discard(member)
                self._cond.notify_all()

    def pausing(self, member: StackMember[K], pause: Callable[[], None]) -> Callable[[], None]:
        """`pause`, with `member` not expected by waiting calls while it runs."""
        def paused() -> None:
            with self._cond:
                member.pausing = True
                self._cond.notify_all()  # a gathered call waiting for this chunk goes on without it
            try:
                pause()
            finally:
                with self._cond:
                    member.pausing = False
        return paused

    def call(self, member: StackMember[K], key: K, job: J, *, pause: Callable[[], None]) -> R:
        """After `pause`, `member`'s call of `key` on `job`: alone or stacked with others of its key."""
        self.pausing(member, pause)()
        call: _Call[K, J, R] = _Call(member, key, job, time.perf_counter())
        with self._cond:
            member.next_key, member.started, member.pending = key, True, True
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                if self._running or not self._pending:
                    self._cond.wait()
                    continue
                group = self._gather()
                self._cond.release()
                try:
                    self._run(group)
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _gather(self) -> list[_Call[K, J, R]]:
        """The next group: the oldest pending call and those of its key, after waiting up to `linger_s` from
        its arrival while a chunk may still join. Holds `_cond`; marks the stack running."""
        self._running = True
        key = self._pending[0].key
        deadline = self._pending[0].arrived + self.linger_s
        while True:
            group = [c for c in self._pending if c.key == key][:self.max_streams]
            left = deadline - time.perf_counter()
            if len(group) == self.max_streams or left <= 0 or not self._expecting(key):
                break
            self._cond.wait(left)
        for c in group:
            self._pending.remove(c)
            c.member.pending, c.member.next_key = False, self.after(key)
        return group

    def _expecting(self, key: K) -> bool:
        """Whether a chunk not waiting yet may make a call of `key`: one whose next call is `key` or, before
        its first, unknown, and that is not held at its pause."""
        return any(not m.pending and not m.pausing and (m.next_key == key or not m.started)
                   for m in self._members)

    def _run(self, group: list[_Call[K, J, R]]) -> None:
        """Run `group` as one call and give each its part (or the call's error)."""
        try:
            results = self.run_group(group[0].key, [c.job for c in group])
            for c, result in zip(group, results, strict=True):
                c.result = result
            self.calls += 1
            self.streams += len(group)
            self.stacked += len(group) > 1
        except BaseException as e:  # every caller of the group raises it
            for c in group:
                c.error = e
        finally:
            for c in group:
                c.done = True
