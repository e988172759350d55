"""Concurrent streams' DiT calls as one: `DitStack` gathers the `flow_estimator_cached` calls that streams'
chunks make at the same ODE step over the same frames and runs their CFG pairs stacked in one call (the
graph's `batch`), each stream getting its rows back.

On a GPU a DiT call's time is mostly its kernels' launches on the host: 16 streams' pairs in one call took
6.56x less time than their 16 calls on an H200 (performance-log.md, "the DiT's calls stacked"). Rows are
independent, so stacking changes no stream's frames: on the CPU in float32 a stream's rows of a stacked call
are its call alone to the bit, on a GPU within float32's rounding (the graph's spec).

A stream's chunk joins the stack for its flow work (`DitStack.member`). A call waits while another stacked
call runs (one at a time), and when its turn comes, up to `linger_s` more for the chunk members that may
still make a call of its key (those whose next call is unknown yet or the same, and that are not held at
their chunk's pause): streams whose chunks started together then go through their ODE steps together. A
stream's caches stay where the runtime keeps them: on the host as numpy rows, on a GPU as views of the
stacked call's outputs (`BufferView`), stacked again without a copy while the same streams go on together
and by onnxruntime's Concat on the device (`RowConcat`) when they do not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import BATCH, DIT_ROWS, MAX_BATCH, ODE_STEPS, GraphSpec, cache_pairs

from .runners import BufferView, Feed, OrtRunner, Runner, feed_shape
from .runners.row_concat import RowConcat

LINGER_S = 0.005
"""How long a gathered call waits at most for the chunks expected to join it: a few launches' worth on a GPU
(a stream's DiT call took ~19 ms on an H200)."""


class Presents(StrEnum):
    """What a call gives back of its `present_*` caches."""

    HOST = "host"
    """Numpy arrays."""
    DEVICE = "device"
    """Left where the runner computed them (`Runner.infer_kept`: on a GPU, there)."""
    NONE = "none"
    """Nothing: a call whose caches no later call reads (the flow over every frame) copies none out."""


class CallKey(NamedTuple):
    """What a call's streams share: the ODE step, the new frames' position, count and attention block, the
    cached frames, and what it gives back of its caches."""

    step: int
    offset: int
    block_frames: int
    new_frames: int
    past_frames: int
    presents: Presents

    def next(self) -> CallKey | None:
        """The key of the chunk's next call (None after its last ODE step)."""
        return self._replace(step=self.step + 1) if self.step + 1 < ODE_STEPS else None


class DitCalls(Protocol):
    """How a chunk makes its DiT calls: alone (`AloneCalls`) or through a `DitStack` (`StackMember`)."""

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> tuple[np.ndarray, dict[str, Feed]]:
        """After `pause`, one ODE step's call on `feeds` (every input of the graph): the velocity (2, 80, n)
        and, as `presents` says, the caches for the next call, by input name."""
        ...


def call_alone(estimator: Runner, feeds: Mapping[str, Feed], *, presents: Presents
               ) -> tuple[np.ndarray, dict[str, Feed]]:
    """`DitCalls.velocity` of one call, without the pause."""
    pairs = cache_pairs(estimator.spec)
    if presents == Presents.DEVICE:
        out, values = estimator.infer_kept(feeds, keep=[present for _, present in pairs])
        return out["velocity"], {past: values[present] for past, present in pairs}
    if presents == Presents.NONE:
        return estimator.infer_outputs(feeds, ["velocity"])["velocity"], {}
    out = estimator.infer(feeds)
    return out["velocity"], {past: out[present] for past, present in pairs}


@dataclass(frozen=True)
class AloneCalls:
    """A chunk's DiT calls made one by one on its own thread."""

    estimator: Runner

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> tuple[np.ndarray, dict[str, Feed]]:
        pause()
        return call_alone(self.estimator, feeds, presents=presents)


def row_inputs(spec: GraphSpec) -> set[str]:
    """The inputs of `flow_estimator_cached` with a row per CFG row; the others a call's streams share."""
    return {t.name for t in spec.inputs if t.shape[0] == DIT_ROWS}


def stacked_feeds(spec: GraphSpec, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Streams' host feeds (any of the graph's inputs, the same in each) as one call's: the inputs with rows
    concatenated along them, in order, the others the first stream's."""
    rows = row_inputs(spec)
    return {name: np.concatenate([f[name] for f in feeds]) if name in rows else value
            for name, value in feeds[0].items()}


def _host(value: Feed) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


@dataclass(eq=False)
class StackMember:
    """One chunk's part in a `DitStack` (`DitStack.member`): its calls go through the stack."""

    stack: DitStack = field(repr=False)
    next_key: CallKey | None = None
    """The key of the chunk's next call, known once it has made one (None before and after its calls)."""
    started: bool = False
    """Whether it has made a call: before its first, its next call's key is unknown."""
    pausing: bool = False
    """Held at the chunk's pause (its turn's): not expected to join a call until it returns."""
    pending: bool = False
    """Its call waits to be gathered."""

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> tuple[np.ndarray, dict[str, Feed]]:
        return self.stack.call(self, feeds, presents=presents, pause=pause)


@dataclass(eq=False)
class _Call:
    member: StackMember
    key: CallKey
    feeds: Mapping[str, Feed]
    arrived: float
    done: bool = False
    velocity: np.ndarray | None = None
    caches: dict[str, Feed] | None = None
    error: BaseException | None = None


class DitStack:
    """Gathers concurrent chunks' calls of one `flow_estimator_cached` runner by `CallKey` and runs each group
    as one call of up to `max_streams` CFG pairs (see the module)."""

    def __init__(self, estimator: Runner, *, max_streams: int = MAX_BATCH, linger_s: float = LINGER_S
                 ) -> None:
        if not 1 <= max_streams <= MAX_BATCH:
            raise ValueError(f"max_streams must be 1 to {MAX_BATCH}, got {max_streams}")
        self.estimator = estimator
        self.max_streams, self.linger_s = max_streams, linger_s
        spec = estimator.spec
        self.pairs = cache_pairs(spec)
        self.rows_per_stream = spec.derived[DIT_ROWS].terms[BATCH]
        """A stream's rows in a call (its CFG pair)."""
        self.keys_input = next(t.name for t in spec.inputs if t.shape[2:3] == ("past_frames",))
        """A cache whose frames are the cached frames (a key cache)."""
        pasts = {past for past, _ in self.pairs}
        self.concat = RowConcat({t.name: (t.np_dtype, len(t.shape)) for t in spec.inputs if t.name in pasts},
                                estimator.provider, estimator.device_id) \
            if isinstance(estimator, OrtRunner) else None
        """Stacks device caches that are not one buffer's rows in order (an `OrtRunner`'s, on a GPU)."""
        self.calls = 0
        """Calls made."""
        self.streams = 0
        """Stream calls they served: `streams / calls` streams a call."""
        self.stacked = 0
        """Calls of more than one stream."""
        self.concats = 0
        """Stacked calls whose device caches were concatenated (`RowConcat`) rather than viewed as one."""
        self._cond = threading.Condition()
        self._members: set[StackMember] = set()
        self._pending: list[_Call] = []
        self._running = False

    @contextmanager
    def member(self) -> Iterator[StackMember]:
        """A chunk's place in the stack while its flow work runs: calls of its key wait for it."""
        member = StackMember(self)
        with self._cond:
            self._members.add(member)
        try:
            yield member
        finally:
            with self._cond:
                self._members.discard(member)
                self._cond.notify_all()

    def call(self, member: StackMember, feeds: Mapping[str, Feed], *, presents: Presents,
             pause: Callable[[], None]) -> tuple[np.ndarray, dict[str, Feed]]:
        """`DitCalls.velocity` of `member`'s chunk: the call runs alone or stacked with others of its key."""
        with self._cond:
            member.pausing = True
            self._cond.notify_all()  # a gathered call waiting for this chunk goes on without it
        try:
            pause()
        finally:
            with self._cond:
                member.pausing = False
        call = _Call(member, self.key(feeds, presents=presents), feeds, time.perf_counter())
        with self._cond:
            member.next_key, member.started, member.pending = call.key, True, True
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
        assert call.velocity is not None and call.caches is not None
        return call.velocity, call.caches

    def key(self, feeds: Mapping[str, Feed], *, presents: Presents) -> CallKey:
        """The key of a call on `feeds`."""
        return CallKey(step=int(_host(feeds["ode_step"])[0]), offset=int(_host(feeds["offset"])[0]),
                       block_frames=int(_host(feeds["block_frames"])[0]),
                       new_frames=feed_shape(feeds["x"])[2],
                       past_frames=feed_shape(feeds[self.keys_input])[2], presents=presents)

    def _gather(self) -> list[_Call]:
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
            c.member.pending, c.member.next_key = False, key.next()
        return group

    def _expecting(self, key: CallKey) -> bool:
        """Whether a chunk not waiting yet may make a call of `key`: one whose next call is `key` or, before
        its first, unknown, and that is not held at its pause."""
        return any(not m.pending and not m.pausing and (m.next_key == key or not m.started)
                   for m in self._members)

    def _run(self, group: list[_Call]) -> None:
        """Run `group` as one call and give each its rows (or the call's error)."""
        try:
            if len(group) == 1:
                (call,) = group
                presents = call.key.presents
                call.velocity, call.caches = call_alone(self.estimator, call.feeds, presents=presents)
            else:
                self._run_stacked(group)
            self.calls += 1
            self.streams += len(group)
            self.stacked += len(group) > 1
        except BaseException as e:  # every caller of the group raises it
            for c in group:
                c.error = e
        finally:
            for c in group:
                c.done = True

    def _run_stacked(self, group: list[_Call]) -> None:
        presents = group[0].key.presents
        if presents == Presents.DEVICE:  # rows of one buffer, in order, stack again without a copy
            group.sort(key=lambda c: _place(c.feeds[self.pairs[0][0]]))
        pasts = [past for past, _ in self.pairs]
        feeds: dict[str, Feed] = dict(stacked_feeds(self.estimator.spec, [
            {name: _host(v) for name, v in c.feeds.items() if name not in pasts} for c in group]))
        feeds.update(self._stacked_caches([c.feeds for c in group], pasts))
        velocity, caches = call_alone(self.estimator, feeds, presents=presents)
        for i, c in enumerate(group):
            rows = slice(self.rows_per_stream * i, self.rows_per_stream * (i + 1))
            c.velocity = velocity[rows]
            c.caches = {name: _rows(value, rows) for name, value in caches.items()}

    def _stacked_caches(self, parts: Sequence[Mapping[str, Feed]], names: list[str]) -> dict[str, Feed]:
        """The caches `names` of `parts` stacked: host arrays concatenated, device rows of one buffer in order
        viewed as one, anything else concatenated on the device."""
        values = {name: [p[name] for p in parts] for name in names}
        if all(isinstance(v, np.ndarray) for vs in values.values() for v in vs):
            return {name: np.concatenate([_host(v) for v in vs]) for name, vs in values.items()}
        runs = {name: _one_run(vs) for name, vs in values.items()}
        if all(run is not None for run in runs.values()):
            return {name: run for name, run in runs.items() if run is not None}
        assert self.concat is not None  # device values come from an OrtRunner
        self.concats += 1
        return dict(self.concat([{name: p[name] for name in names} for p in parts]))


def _place(value: Feed) -> tuple[int, int]:
    """Where a feed's rows are: (buffer address, first row); numpy arrays all at (0, 0)."""
    if isinstance(value, BufferView):
        return value.value.data_ptr(), value.first
    if isinstance(value, ort.OrtValue):
        return value.data_ptr(), 0
    return 0, 0


def _one_run(values: Sequence[Feed]) -> BufferView | None:
    """`values` as one view where they are consecutive rows of one device buffer, in order."""
    if not all(isinstance(v, BufferView) for v in values):
        return None
    views = [v for v in values if isinstance(v, BufferView)]
    first = views[0]
    for before, after in zip(views, views[1:], strict=False):
        if after.value.data_ptr() != first.value.data_ptr() or after.first != before.first + before.count:
            return None
    return BufferView(first.value, first.first, sum(v.count for v in views))


def _rows(value: Feed, rows: slice) -> Feed:
    """Rows `rows` of a call's output: a numpy view, or a view of the device buffer."""
    if isinstance(value, np.ndarray):
        return value[rows]
    assert isinstance(value, ort.OrtValue)
    return BufferView(value, rows.start, rows.stop - rows.start)
