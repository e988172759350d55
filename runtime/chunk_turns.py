"""Turns at the flow and the vocoder for streams that share the machine: first chunks first.

Concurrent streams each run their chunks' flow and vocoder calls on threads of their own; on a CPU those
calls share the cores, so four streams' first chunks all finish late together. `ChunkTurns` lets at most
`slots` chunks run at once and, among the waiting, gives the next turn to a first chunk (a listener
waiting for any audio) before a later one, otherwise in the order they asked. A later chunk also hands its
slot to a waiting first chunk between its DiT calls (the pause its turn gives) and takes it back before the
later chunks that asked after it: a stream's final chunk, whose full re-run of the flow takes seconds on a
CPU, does not hold a new stream's first audio back for all of it. It also waits there while `hold_later`
says so (on the CPU while the decode batch computes a stream's first ids, which then have the cores to
themselves). It orders work, never changes it: every chunk's samples are what they would be without it.
While the slots are taken (`full`; on a GPU while a first chunk holds or waits for a turn, `first_due`) the
decode batch decodes only the ids of first chunks (`synthesis.batch_yields_to`), and `on_done` tells it
when a turn ends.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HOLD_POLL_S = 0.01
"""How often a later chunk held at its pause (`ChunkTurns.hold_later`) looks again."""


class ChunkTurns:
    """At most `slots` chunks at once; first chunks before later ones, each kind in arrival order."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.on_done: Callable[[], None] = lambda: None
        """Called after each turn ends (the decode batch's `wake`)."""
        self.hold_later: Callable[[], bool] = lambda: False
        """Whether later chunks wait at their pauses besides while first chunks wait for a slot (on the CPU
        while the decode batch works for a stream's first audio: `synthesis.chunks_yield_to`)."""
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int]] = []
        """(0 for a first chunk else 1, arrival number) of each chunk waiting, a heap."""
        self._arrivals = itertools.count()
        self._running = 0
        self._firsts = 0
        """First chunks waiting for a turn or holding one."""

    @property
    def first_due(self) -> bool:
        """Whether a stream's first chunk holds a turn or waits for one."""
        return self._firsts > 0

    @property
    def full(self) -> bool:
        """Whether every slot holds a chunk or a chunk waits for one: the share of the machine the chunks
        were given is in use."""
        return self._running >= self.slots or bool(self._waiting)

    @contextmanager
    def turn(self, first: bool) -> Iterator[Callable[[], None]]:
        """Wait for this chunk's turn (`first`: the stream's first chunk), hold it while the block runs. The
        block calls the pause it is given before each of its DiT calls and before its vocoder: a later chunk
        waits there while waiting first chunks run and while `hold_later` says so; a first chunk's returns
        at once."""
        ticket = (0 if first else 1, next(self._arrivals))
        with self._cond:
            self._firsts += first
            self._take_slot(ticket)
        try:
            yield no_pause if first else lambda: self._pause_later(ticket)
        finally:
            with self._cond:
                self._running -= 1
                self._firsts -= first
                self._cond.notify_all()
            self.on_done()

    def _take_slot(self, ticket: tuple[int, int]) -> None:
        """Queue `ticket` and wait until it is the first in line and a slot is free; holds `_cond`."""
        heapq.heappush(self._waiting, ticket)
        while self._running >= self.slots or self._waiting[0] != ticket:
            self._cond.wait()
        heapq.heappop(self._waiting)
        self._running += 1

    def _pause_later(self, ticket: tuple[int, int]) -> None:
        """A later chunk's pause: while a first chunk waits for a slot (none free), give this one up and queue
        again under the chunk's own ticket (after every first chunk, before the later chunks that asked after
        it); while `hold_later`, wait, and look once more after it stops (a stream's consumer stops waiting
        for ids for a moment between two of them)."""
        with self._cond:
            held = confirming = False
            while True:
                if self._waiting and self._waiting[0][0] == 0 and self._running >= self.slots:
                    self._running -= 1
                    self._cond.notify_all()
                    self._take_slot(ticket)
                elif self.hold_later():
                    held, confirming = True, False
                    self._cond.wait(HOLD_POLL_S)
                elif held and not confirming:
                    confirming = True
                    self._cond.wait(HOLD_POLL_S)
                else:
                    return


def no_pause() -> None:
    """The pause of a chunk that lets nothing pass (a first chunk's, or one without turns)."""
