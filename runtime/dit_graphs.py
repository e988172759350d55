"""`flow_estimator_cached`'s calls replayed from CUDA graphs (onnxruntime's CUDA provider's
`enable_cuda_graph`).

At one stream a DiT call is mostly the host's work of launching its few hundred nodes: on an H200 a first
chunk's ten calls took 0.116 s of which the kernels are a small part (docs/gpu.md). onnxruntime captures a
call's kernels into a CUDA graph and replays them with one launch, where no node of the graph runs on the CPU
(the DiT takes its positions and attention mask as inputs for that) and every input and output is bound at the
device address it had at the capture, with the same shape. A stream's caches are its own, one set per ODE
step, and grow every chunk, so `GraphedDit` keeps per shape of a call (rows, new frames, and cached frames
rounded up to `PAST_BUCKET`) a binding over device memory of its own: before a call the host inputs are
written into it and the caches copied into it on the device after as many zero frames as the rounding adds,
which the attention mask hides (`FramePad`); after it the velocity is copied to the host and the caches,
without those frames, to where the call's `Presents` wants them. The ten ODE steps of a chunk are calls of one
shape, and so are the next chunks' until their cache outgrows the bucket: onnxruntime's regular runs, then its
capture, then replays. A capture holds the GPU alone (`capture_gate`), so a shape is bound once it comes again
(`BIND_AFTER`), and a handful of bindings are kept (`MAX_GRAPHS`, `MAX_BOUND_BYTES`).

A binding serves one call at a time. A call that finds its shape's bindings busy (other streams', on other
threads) runs as an ordinary call, and once as many calls as bind a shape have found them so, the shape gets
one more binding: streams in step, as a batch's are, then replay side by side. On a runner without CUDA
graphs (the CPU's, in tests) the bindings run as ordinary calls: a call gives what `dit_stack.call_alone`
gives, to the bit where its cache fills its bucket, else within float32's rounding (the attention's sums over
more keys, the hidden ones adding zeros, group otherwise).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import (
    BATCH,
    DIT_PAST_FRAMES,
    DIT_ROWS,
    ODE_STEPS,
    TensorSpec,
    cache_pairs,
    dit_frame_caches,
)

from .decode_graphs import CAPTURE_RUNS
from .dit_stack import DitResult, Presents, call_alone
from .runners import OrtRunner, feed_shape, to_host
from .runners.base import Feed
from .runners.capture_gate import GATE, on_device
from .runners.device_copies import FramePad
from .runners.ort import GPU_GRAPH_ID

MAX_GRAPHS = 8
"""Bindings (and CUDA graphs) `GraphedDit` keeps, the least recently called shape's let go first."""
MAX_BOUND_BYTES = 4 << 30
"""Device memory `GraphedDit`'s bindings may hold together, besides what onnxruntime keeps for their graphs:
a binding holds a call's inputs and outputs, at full size ~0.36 MB of caches a frame, a cached frame's in and
out (a first chunk after a 300-frame prompt ~0.25 GB, a call over 1,000 new frames ~0.36 GB); a shape that
needs more than this alone is never bound."""
BIND_AFTER = ODE_STEPS
"""Calls of a shape launched before `GraphedDit` binds it: one chunk's. A capture holds the GPU alone and
a binding holds memory, so a shape is bound once it comes again (a voice's first chunk, the later chunks of
a schedule, in the next request or another stream), not for a length that comes once (an offline call)."""
PAST_BUCKET = 128
"""Cached frames a binding's shape rounds a call's up to (2.56 s of audio): a stream's later chunks, 50 new
frames each on upstream's schedule, share a binding for a few chunks, and prompts of nearby lengths share
their first chunk's; the hidden frames cost the attention a few more keys and the binding ~0.7 MB each at
full size (a frame's keys and values in and out)."""
SEEN_SHAPES = 64
"""Unbound shapes whose launched calls `GraphedDit` counts, the least recent forgotten first."""


class Shape(NamedTuple):
    """What a binding is made for: a call's rows (two per stream), new frames and cached frames."""

    rows: int
    new_frames: int
    past_frames: int


@dataclass
class _Graph:
    """One shape's binding, the device memory bound in it, and its calls so far."""

    id: int
    binding: ort.IOBinding
    run_options: ort.RunOptions
    nbytes: int
    """The device memory of its inputs and outputs."""
    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    runs: int = 0
    busy: threading.Lock = field(default_factory=threading.Lock)


class GraphedDit:
    """`flow_estimator_cached` calls of `runner`, each shape replayed from its CUDA graph where the runner
    captures them (`OrtRunner(cuda_graph=True)`); a `dit_stack.DitCall` (see the module)."""

    def __init__(self, runner: OrtRunner, *, max_graphs: int = MAX_GRAPHS, max_bytes: int = MAX_BOUND_BYTES,
                 bind_after: int = BIND_AFTER, past_bucket: int = PAST_BUCKET) -> None:
        if max_graphs < 1 or max_bytes < 0 or bind_after < 0 or past_bucket < 1:
            raise ValueError(f"max_graphs and past_bucket must be >= 1, max_bytes and bind_after >= 0, got "
                             f"{max_graphs}, {past_bucket}, {max_bytes}, {bind_after}")
        self.runner = runner
        self.max_graphs, self.max_bytes, self.bind_after = max_graphs, max_bytes, bind_after
        self.past_bucket = past_bucket
        spec = runner.spec
        self._pairs = cache_pairs(spec)
        pasts = {past for past, _ in self._pairs}
        keys, self._axis = dit_frame_caches(spec)
        self._framed = {t.name for t in keys}
        """The caches of keys and values, whose frames a bucket pads (the conv caches' frames are fixed);
        `_axis` their frames' axis, which the conv caches' frames share."""
        self._frames = FramePad({t.name: (t.np_dtype, len(t.shape)) for t in spec.inputs if t.name in pasts},
                                axis=self._axis, provider=runner.provider, device_id=runner.device_id)
        """Copies caches on the device: into a binding's inputs after the bucket's hidden frames, out of its
        outputs without them."""
        self._max_past = spec.dims[DIT_PAST_FRAMES].max
        self._dtypes = {t.name: t.np_dtype for t in spec.inputs}
        self._rows_per_stream = spec.derived[DIT_ROWS].terms[BATCH]
        self._graphs: OrderedDict[Shape, list[_Graph]] = OrderedDict()
        """Bound shapes -> their bindings, the least recently called shape first."""
        self._seen: OrderedDict[Shape, int] = OrderedDict()
        """Shapes -> their calls launched since the shape's last binding (none free, or none bound)."""
        self.calls = 0
        """Calls so far."""
        self.bound_calls = 0
        """Calls so far that ran in a binding (on CUDA a replay, but for each binding's first
        `CAPTURE_RUNS`), the others launched node by node."""
        self._lock = threading.Lock()
        """Guards `_graphs`, `_seen`, `_next_id` and the counts of calls."""
        self._next_id = 1  # onnxruntime keeps 0, its default, to itself (and -1 runs outside the graphs)

    @property
    def graphs(self) -> int:
        """Bindings now (each a CUDA graph once captured)."""
        return sum(len(pool) for pool in self._graphs.values())

    @property
    def bound_bytes(self) -> int:
        """Device memory the bindings hold now."""
        return sum(graph.nbytes for pool in self._graphs.values() for graph in pool)

    def __call__(self, feeds: Mapping[str, Feed], *, presents: Presents) -> DitResult:
        """One call on `feeds` (every input of the graph): the velocity and, as `presents` says, the caches
        for the next call (on the device: tensors of their own), as `call_alone` gives them."""
        rows, _, new_frames = feed_shape(feeds["x"])
        past = feed_shape(feeds[next(iter(self._framed))])[self._axis]
        bucket = self.bucket(past)
        graph = self._claim(Shape(rows, new_frames, bucket))
        if graph is None:
            return call_alone(self.runner, feeds, presents=presents)
        try:
            return self._run(graph, feeds, presents, hidden=bucket - past)
        finally:
            graph.busy.release()

    def bucket(self, past: int) -> int:
        """The cached frames of the binding a call over `past` cached frames runs in: `past` rounded up to
        `past_bucket`, within the spec's range (`past` itself where it lies beyond)."""
        rounded = -(-past // self.past_bucket) * self.past_bucket
        return rounded if rounded <= self._max_past else max(past, self._max_past)

    def release(self) -> None:
        """Let every shape's binding and graph go; later calls bind and capture anew, under new graph ids."""
        with self._lock:
            while self._graphs:
                _, pool = self._graphs.popitem(last=False)
                for graph in pool:
                    with graph.busy:
                        self._let_go(graph)

    def _claim(self, shape: Shape) -> _Graph | None:
        """A free binding of `shape`, bound now if none is and the shape has earned one, held for this
        call; None where the call is launched: fewer than `bind_after` calls of the shape found none free
        since its last binding, or the bounds leave no room (the other bindings busy, or more than
        `max_bytes` alone)."""
        with self._lock:
            self.calls += 1
            pool = self._graphs.get(shape, [])
            if pool:
                self._graphs.move_to_end(shape)
            for graph in pool:
                if graph.busy.acquire(blocking=False):
                    self.bound_calls += 1
                    return graph
            seen = self._seen.pop(shape, 0)
            self._seen[shape] = seen + 1
            while len(self._seen) > SEEN_SHAPES:
                self._seen.popitem(last=False)
            dims = self._dims(shape)
            need = self._nbytes(dims)
            if seen < self.bind_after or need > self.max_bytes:
                return None

            def full() -> bool:
                return self.graphs >= self.max_graphs or self.bound_bytes + need > self.max_bytes

            for old in [other for other in self._graphs if other != shape]:  # least recent first, idle ones
                for graph in list(self._graphs[old]):
                    if not full():
                        break
                    if graph.busy.acquire(blocking=False):
                        self._graphs[old].remove(graph)
                        self._let_go(graph)
                if not self._graphs[old]:
                    del self._graphs[old]
            if full():
                return None
            del self._seen[shape]
            with on_device(self.runner.device_type):  # device memory of its own
                graph = self._bind(shape, dims, need)
            graph.busy.acquire()
            self._graphs[shape] = [*pool, graph]
            self._graphs.move_to_end(shape)
            self.bound_calls += 1
            return graph

    def _run(self, graph: _Graph, feeds: Mapping[str, Feed], presents: Presents, *, hidden: int
             ) -> DitResult:
        """`feeds`' call in `graph`, whose cached frames are `hidden` more than theirs: zeros in front of
        their caches, which its attention mask does not see."""
        runner = self.runner
        graph.runs += 1
        held = GATE.capture() if runner.cuda_graph and graph.runs <= CAPTURE_RUNS else \
            on_device(runner.device_type)
        pasts = [past for past, _ in self._pairs]
        frames = {past: hidden if past in self._framed else 0 for past in pasts}
        on_host = all(isinstance(feeds[past], np.ndarray) for past in pasts)  # else copied on the device
        with held:
            for name, value in graph.inputs.items():
                if on_host or name not in pasts:
                    host = to_host(feeds[name])
                    if hidden and name == "attention_mask":
                        host = np.concatenate([np.zeros((host.shape[0], hidden), dtype=bool), host], axis=1)
                    elif hidden and name in self._framed:  # else written as it is, copied once
                        host = np.pad(host, [(hidden, 0) if axis == self._axis else (0, 0)
                                             for axis in range(host.ndim)])
                    value.update_inplace(np.ascontiguousarray(host, dtype=self._dtypes[name]))
            if not on_host:
                self._frames.pad({past: feeds[past] for past in pasts}, frames, into=graph.inputs)
            runner.session.run_with_iobinding(graph.binding, graph.run_options)
            velocity = np.array(graph.outputs["velocity"].numpy())
            out = {past: graph.outputs[present] for past, present in self._pairs}
            if presents == Presents.DEVICE:
                return velocity, self._frames.cut(out, frames)
            if presents == Presents.HOST:
                return velocity, {past: np.array(value.numpy()[(slice(None),) * self._axis
                                                               + (slice(frames[past], None),)])
                                  for past, value in out.items()}
            return velocity, {}

    def _dims(self, shape: Shape) -> dict[str, int]:
        """The spec's free dims for `shape`."""
        return {BATCH: shape.rows // self._rows_per_stream, "new_frames": shape.new_frames,
                DIT_PAST_FRAMES: shape.past_frames}

    def _nbytes(self, dims: Mapping[str, int]) -> int:
        """The device memory of a binding's inputs and outputs at `dims`."""
        spec = self.runner.spec
        return sum(spec.nbytes_of(t, dims) for t in (*spec.inputs, *spec.outputs))

    def _bind(self, shape: Shape, dims: Mapping[str, int], nbytes: int) -> _Graph:
        runner, spec = self.runner, self.runner.spec

        def value(tensor: TensorSpec) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_shape_and_type(list(spec.shape_of(tensor, dims)),
                                                             tensor.np_dtype, runner.device_type,
                                                             runner.device_id)

        graph = _Graph(id=self._next_id, binding=runner.session.io_binding(), run_options=ort.RunOptions(),
                       nbytes=nbytes, inputs={t.name: value(t) for t in spec.inputs},
                       outputs={t.name: value(t) for t in spec.outputs})
        self._next_id += 1
        graph.run_options.add_run_config_entry(GPU_GRAPH_ID, str(graph.id))
        for name, bound in graph.inputs.items():
            graph.binding.bind_ortvalue_input(name, bound)
        for name, bound in graph.outputs.items():
            graph.binding.bind_ortvalue_output(name, bound)
        return graph

    def _let_go(self, graph: _Graph) -> None:
        """Release `graph`'s CUDA graph (its binding's memory goes with the object)."""
        if self.runner.cuda_graph:
            with on_device(self.runner.device_type):
                self.runner.session.release_captured_graph(graph.id)
