"""Where concurrent sessions' wall went: every graph call made during a block, by graph, from every thread.

`record()` swaps, for the block, the methods through which every graph runs: onnxruntime's
`InferenceSession.run` and `run_with_iobinding` (the runners' calls, bound calls, and the steps and DiT
calls replayed from CUDA graphs), OpenVINO's and TensorRT's runners' `_run`. A call is labelled by its
graph: the `spec_name` a bundle's graph carries in its metadata (every session of one graph, as the
vocoder's per-length pool makes, shares it), `DEVICE_COPIES` for the graphs the runtime builds in memory
to copy device buffers (`runners.device_copies`), which carry none.

`in_flight` turns the calls into figures over a window (the sessions' wall): per graph its calls, their
mean duration, and the share of the wall during which at least one of its calls ran (a share near 1: that
graph was never idle; calls of several sessions at once count once); `any`: some graph ran. What no graph
covered is the host's own work and waits (sampling, queues, turns).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import onnxruntime as ort

from cosyvoice_runtime.runners.openvino import OpenVinoRunner
from cosyvoice_runtime.runners.trt import TrtRunner

DEVICE_COPIES = "device copies"
"""The label of onnxruntime sessions of graphs without a `spec_name`: the runtime's copy graphs."""
ANY = "any"
"""The key of `in_flight`'s union over every graph."""

Call = tuple[float, float]
"""When a call began and ended (`time.perf_counter`)."""


_SESSION_GRAPHS: weakref.WeakKeyDictionary[ort.InferenceSession, str] = weakref.WeakKeyDictionary()
"""Each session's graph, read once (reading a session's metadata copies all of it)."""


def _session_graph(session: ort.InferenceSession) -> str:
    graph = _SESSION_GRAPHS.get(session)
    if graph is None:
        meta = session.get_modelmeta().custom_metadata_map  # `cosyvoice_graphs.metadata`'s
        graph = _SESSION_GRAPHS[session] = meta.get("spec_name", DEVICE_COPIES)
    return graph


def _runner_graph(runner: OpenVinoRunner | TrtRunner) -> str:
    return runner.spec.name


_TARGETS: tuple[tuple[type, str, Callable[[Any], str]], ...] = (
    (ort.InferenceSession, "run", _session_graph),
    (ort.InferenceSession, "run_with_iobinding", _session_graph),
    (OpenVinoRunner, "_run", _runner_graph),
    (TrtRunner, "_run", _runner_graph),
)
"""The class, the method every graph call of that kind passes through, and how a call's graph is named."""

_ACTIVE = threading.Lock()
"""Held while a block records: the swaps are process-wide, so blocks cannot nest or overlap."""


@contextmanager
def record() -> Iterator[dict[str, list[Call]]]:
    """Record every graph call made in the block, on any thread, into the yielded dict (graph -> its
    calls, in the order they ended); the original methods are put back afterwards, also on error."""
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError("graph calls are already being recorded")
    calls: dict[str, list[Call]] = {}
    lock = threading.Lock()

    def timed(method: Callable[..., Any], graph_of: Callable[[Any], str]) -> Callable[..., Any]:
        def call(owner: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(owner, *args, **kwargs)
            finally:
                end = time.perf_counter()
                with lock:  # also guards `_SESSION_GRAPHS`
                    calls.setdefault(graph_of(owner), []).append((start, end))
        return call

    swapped: list[tuple[type, str, Any]] = []
    try:
        for cls, name, graph_of in _TARGETS:
            swapped.append((cls, name, vars(cls).get(name)))
            setattr(cls, name, timed(getattr(cls, name), graph_of))
        yield calls
    finally:
        for cls, name, own in reversed(swapped):
            if own is None:
                delattr(cls, name)  # the base class's method shows through again
            else:
                setattr(cls, name, own)
        _ACTIVE.release()


def covered(calls: Sequence[Call], start: float, end: float) -> float:
    """Seconds of [start, end] during which at least one of `calls` ran."""
    total, reach = 0.0, start
    for begin, finish in sorted(calls):
        begin, finish = max(begin, reach), min(finish, end)
        if finish > begin:
            total += finish - begin
            reach = finish
    return total


def in_flight(calls: Mapping[str, Sequence[Call]], start: float, end: float) -> dict[str, dict[str, Any]]:
    """Per graph (by name), over [start, end]: `calls`, `call_ms_mean` and `share`, the part of the window
    during which at least one of its calls ran; `ANY` the same over every graph's calls together."""
    wall = end - start
    if wall <= 0:
        raise ValueError(f"an empty window: {start} to {end}")

    def figures(made: Sequence[Call]) -> dict[str, Any]:
        return {"calls": len(made),
                "call_ms_mean": 1e3 * sum(e - s for s, e in made) / len(made) if made else None,
                "share": covered(made, start, end) / wall}

    return {**{graph: figures(made) for graph, made in sorted(calls.items())},
            ANY: figures([c for made in calls.values() for c in made])}
