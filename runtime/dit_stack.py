"""Concurrent streams' DiT calls as one: `DitStack` gathers the `flow_estimator_cached` calls that streams'
chunks make at the same ODE step over the same frames and runs their CFG pairs stacked in one call (the
graph's `batch`), each stream getting its rows back.

On a GPU a DiT call's time is mostly its kernels' launches on the host: 16 streams' pairs in one call took
6.56x less time than their 16 calls on an H200 (performance-log.md, "the DiT's calls stacked"). Rows are
independent, so stacking changes no stream's frames: on the CPU in float32 a stream's rows of a stacked call
are its call alone to the bit, on a GPU within float32's rounding (the graph's spec).

A stream's chunk joins the stack for its flow work (`DitStack.chunk_calls`), and its calls gather as
`call_stack` says: streams whose chunks started together go through their ODE steps together. A stream's
caches stay where the runtime keeps them: on the host as numpy rows, on a GPU as views of the
stacked call's outputs (`BufferView`), stacked again without a copy while the same streams go on together
and by onnxruntime's Concat on the device (`RowConcat`) when they do not.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import (
    BATCH,
    DIT_ROWS,
    MAX_BATCH,
    ODE_STEPS,
    GraphSpec,
    cache_pairs,
    dit_frame_caches,
)

from .call_stack import LINGER_S, CallStack, StackMember
from .runners import BufferView, Feed, OrtRunner, Runner, feed_shape, to_host
from .runners.device_copies import RowConcat


class Presents(StrEnum):
    """What a call gives back of its `present_*` caches."""

    HOST = "host"
    """Numpy arrays."""
    DEVICE = "device"
    """Left where the runner computed them (`Runner.infer_kept`: on a GPU, there)."""
    NONE = "none"
    """Nothing: a call whose caches no later call reads (the flow over every frame) copies none out."""


class CallKey(NamedTuple):
    """What a call's streams share: the ODE step, the new frames' positions and attention mask, their count,
    the cached frames, and what it gives back of its caches."""

    step: int
    attention: bytes
    """A digest of the call's `positions` and `attention_mask`."""
    new_frames: int
    past_frames: int
    presents: Presents

    def next(self) -> CallKey | None:
        """The key of the chunk's next call (None after its last ODE step)."""
        return self._replace(step=self.step + 1) if self.step + 1 < ODE_STEPS else None


DitResult = tuple[np.ndarray, dict[str, Feed]]
"""A stream's part of a call: its velocity and, as the call's `Presents` says, its caches."""


class DitCall(Protocol):
    """How one call runs (`call_alone` on a runner, or `dit_graphs.GraphedDit`)."""

    def __call__(self, feeds: Mapping[str, Feed], *, presents: Presents) -> DitResult:
        """The velocity (2 per stream, 80, n) of a call on `feeds` (every input of the graph) and, as
        `presents` says, the caches for the next call, by input name."""
        ...


class DitCalls(Protocol):
    """How a chunk makes its DiT calls: alone (`AloneCalls`) or through a `DitStack` (`StackedCalls`)."""

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> DitResult:
        """After `pause`, one ODE step's call on `feeds` (every input of the graph): the velocity (2, 80, n)
        and, as `presents` says, the caches for the next call, by input name."""
        ...


def call_alone(estimator: Runner, feeds: Mapping[str, Feed], *, presents: Presents
               ) -> DitResult:
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
    """A chunk's DiT calls made one by one on its own thread, each through `call`."""

    call: DitCall

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> DitResult:
        pause()
        return self.call(feeds, presents=presents)


def row_inputs(spec: GraphSpec) -> set[str]:
    """The inputs of `flow_estimator_cached` with a row per CFG row; the others a call's streams share."""
    return {t.name for t in spec.inputs if t.shape[0] == DIT_ROWS}


def stacked_feeds(spec: GraphSpec, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Streams' host feeds (any of the graph's inputs, the same in each) as one call's: the inputs with rows
    concatenated along them, in order, the others the first stream's."""
    rows = row_inputs(spec)
    return {name: np.concatenate([f[name] for f in feeds]) if name in rows else value
            for name, value in feeds[0].items()}


@dataclass(frozen=True)
class StackedCalls:
    """A chunk's DiT calls through a `DitStack`, as its `member` (`DitStack.chunk_calls`)."""

    stack: DitStack
    member: StackMember[CallKey]

    def velocity(self, feeds: Mapping[str, Feed], *, presents: Presents, pause: Callable[[], None]
                 ) -> DitResult:
        return self.stack.call(self.member, self.stack.key(feeds, presents=presents), feeds, pause=pause)


class DitStack(CallStack[CallKey, Mapping[str, Feed], DitResult]):
    """Gathers concurrent chunks' calls of one `flow_estimator_cached` runner by `CallKey` and runs each group
    as one call of up to `max_streams` CFG pairs (see the module)."""

    def __init__(self, estimator: Runner, *, call: DitCall | None = None, max_streams: int = MAX_BATCH,
                 linger_s: float = LINGER_S) -> None:
        """`call` runs each stacked call (None: `call_alone` on `estimator`)."""
        super().__init__(self._run_group, after=CallKey.next, max_streams=max_streams, linger_s=linger_s)
        self.estimator = estimator
        self.dit_call: DitCall = functools.partial(call_alone, estimator) if call is None else call
        spec = estimator.spec
        self.pairs = cache_pairs(spec)
        self.rows_per_stream = spec.derived[DIT_ROWS].terms[BATCH]
        """A stream's rows in a call (its CFG pair)."""
        self.keys_input = dit_frame_caches(spec)[0][0].name
        """A cache whose frames are the cached frames (a key cache)."""
        pasts = {past for past, _ in self.pairs}
        self.concat = RowConcat({t.name: (t.np_dtype, len(t.shape)) for t in spec.inputs if t.name in pasts},
                                estimator.provider, estimator.device_id) \
            if isinstance(estimator, OrtRunner) else None
        """Stacks device caches that are not one buffer's rows in order (an `OrtRunner`'s, on a GPU)."""
        self.concats = 0
        """Stacked calls whose device caches were concatenated (`RowConcat`) rather than viewed as one."""

    @contextmanager
    def chunk_calls(self) -> Iterator[StackedCalls]:
        """A chunk's DiT calls while its flow work runs, as a member of the stack: calls of its key wait for
        it."""
        with self.member() as member:
            yield StackedCalls(self, member)

    def key(self, feeds: Mapping[str, Feed], *, presents: Presents) -> CallKey:
        """The key of a call on `feeds`."""
        attention = hashlib.blake2b(digest_size=16)
        for name in ("positions", "attention_mask"):
            attention.update(to_host(feeds[name]).tobytes())
        return CallKey(step=int(to_host(feeds["ode_step"])[0]), attention=attention.digest(),
                       new_frames=feed_shape(feeds["x"])[2],
                       past_frames=feed_shape(feeds[self.keys_input])[2], presents=presents)

    def _run_group(self, key: CallKey, group: list[Mapping[str, Feed]]) -> list[DitResult]:
        """One call of `group`'s CFG pairs; each stream's rows of its outputs."""
        if len(group) == 1:
            return [self.dit_call(group[0], presents=key.presents)]
        order = list(range(len(group)))
        if key.presents == Presents.DEVICE:  # rows of one buffer, in order, stack again without a copy
            order.sort(key=lambda i: _place(group[i][self.pairs[0][0]]))
        parts = [group[i] for i in order]
        pasts = [past for past, _ in self.pairs]
        feeds: dict[str, Feed] = dict(stacked_feeds(self.estimator.spec, [
            {name: to_host(v) for name, v in p.items() if name not in pasts} for p in parts]))
        feeds.update(self._stacked_caches(parts, pasts))
        velocity, caches = self.dit_call(feeds, presents=key.presents)
        results: dict[int, DitResult] = {}
        for place, i in enumerate(order):
            rows = slice(self.rows_per_stream * place, self.rows_per_stream * (place + 1))
            results[i] = (velocity[rows], {name: _rows(value, rows) for name, value in caches.items()})
        return [results[i] for i in range(len(group))]

    def _stacked_caches(self, parts: Sequence[Mapping[str, Feed]], names: list[str]) -> dict[str, Feed]:
        """The caches `names` of `parts` stacked: host arrays concatenated, device rows of one buffer in order
        viewed as one, anything else concatenated on the device."""
        values = {name: [p[name] for p in parts] for name in names}
        if all(isinstance(v, np.ndarray) for vs in values.values() for v in vs):
            return {name: np.concatenate([to_host(v) for v in vs]) for name, vs in values.items()}
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
