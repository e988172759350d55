"""Per-graph output statistics of a synthesis: how often each graph ran and what its outputs held.

On the reference backend they are pinned bit for bit next to the PCM16 hashes; elsewhere they show which
graph drifted first when the audio is off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosyvoice_graphs import cache_pairs
from cosyvoice_runtime.runners import Feed, OrtRunner
from cosyvoice_runtime.synthesis import Synthesizer

InferOutputs = Callable[[Mapping[str, Feed], Sequence[str]], dict[str, np.ndarray]]
"""`Runner.infer_outputs`'s signature."""
KeptInfer = Callable[[Mapping[str, Feed], Collection[str]], tuple[dict[str, np.ndarray], dict[str, Feed]]]
"""`Runner.infer_kept`'s signature."""

InPlaceInfer = Callable[[Mapping[str, Feed], Mapping[str, str], Sequence[str]], dict[str, np.ndarray]]
"""`OrtRunner.infer_in_place`'s signature."""

STAT_NAMES = ("mean", "rms", "min", "max")


@dataclass
class _Accumulator:
    """Float64 running sums over every value one output took in every call."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: np.ndarray) -> None:
        v = np.asarray(value, dtype=np.float64)
        if v.size:
            self.count += v.size
            self.total += float(v.sum())
            self.squares += float(np.square(v).sum())
            self.low = min(self.low, float(v.min()))
            self.high = max(self.high, float(v.max()))

    def to_json(self) -> dict[str, float | int]:
        n = max(self.count, 1)
        return {"values": self.count, "mean": self.total / n, "rms": math.sqrt(self.squares / n),
                "min": self.low if self.count else 0.0, "max": self.high if self.count else 0.0}


@dataclass
class GraphStats:
    """Calls and output statistics per graph, in call order of first use."""

    calls: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, dict[str, _Accumulator]] = field(default_factory=dict)

    def add(self, graph: str, outputs: Mapping[str, np.ndarray]) -> None:
        """One call of `graph` and the outputs it returned."""
        self.calls[graph] = self.calls.get(graph, 0) + 1
        per_output = self.outputs.setdefault(graph, {})
        for name, value in outputs.items():
            per_output.setdefault(name, _Accumulator()).add(value)

    def to_json(self) -> dict[str, Any]:
        """{graph: {"calls": n, "outputs": {output: {"values", "mean", "rms", "min", "max"}}}}."""
        return {g: {"calls": self.calls[g], "outputs": {o: a.to_json() for o, a in self.outputs[g].items()}}
                for g in self.calls}


def stats_difference(got: Mapping[str, Any], want: Mapping[str, Any]) -> str | None:
    """The first difference between two `GraphStats.to_json()`, in words (None if equal)."""
    for graph in sorted(set(got) | set(want)):
        if graph not in got or graph not in want:
            return f"graph {graph} ran {got.get(graph, {}).get('calls', 0)} times, golden " \
                   f"{want.get(graph, {}).get('calls', 0)}"
        g, w = got[graph], want[graph]
        if g["calls"] != w["calls"]:
            return f"graph {graph} ran {g['calls']} times, golden {w['calls']}"
        for output, ws in w["outputs"].items():
            gs = g["outputs"].get(output, {})
            for stat in ("values", *STAT_NAMES):
                if gs.get(stat) != ws[stat]:
                    return f"{graph}.{output} {stat} {gs.get(stat)!r}, golden {ws[stat]!r}"
    return None


def largest_drift(got: Mapping[str, Any], want: Mapping[str, Any]) -> tuple[str, float] | None:
    """The output statistic furthest from the golden's, relative to the output's golden rms:
    ("graph.output stat", drift), or None when no graph ran in both."""
    worst: tuple[str, float] | None = None
    for graph in set(got) & set(want):
        for output, ws in want[graph]["outputs"].items():
            gs = got[graph]["outputs"].get(output)
            if gs is None:
                continue
            scale = max(abs(ws["rms"]), float(np.finfo(np.float32).tiny))
            for stat in STAT_NAMES:
                drift = abs(gs[stat] - ws[stat]) / scale
                if worst is None or drift > worst[1]:
                    worst = (f"{graph}.{output} {stat}", drift)
    return worst


class GraphRecorder:
    """Feeds every graph call of a `Synthesizer` into the current `GraphStats`.

    The synthesizer's runners are wrapped in place (their `infer_outputs`, which `infer` calls,
    `infer_kept` and onnxruntime's `infer_in_place`, shadowed on the instance; a call goes through exactly
    one of them), so every object
    holding a runner (the LM, the flow, the vocoder and its streams) is observed, whichever outputs a call
    fetches. Cache outputs
    (`present_*`) are left out: they grow with every step (quadratic cost) and feed the outputs that are
    kept.
    """

    def __init__(self, synth: Synthesizer) -> None:
        self._stats: GraphStats | None = None
        for name, runner in synth.runners.items():
            caches = {present for _, present in cache_pairs(runner.spec)}
            runner.infer_outputs = self._observer(  # type: ignore[method-assign]
                name, runner.infer_outputs, caches)
            runner.infer_kept = self._kept_observer(  # type: ignore[method-assign]
                name, runner.infer_kept, caches)
            if isinstance(runner, OrtRunner):
                runner.infer_in_place = self._in_place_observer(  # type: ignore[method-assign]
                    name, runner.infer_in_place)

    def _observer(self, graph: str, infer_outputs: InferOutputs, caches: set[str]) -> InferOutputs:
        def observed(feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
            outputs = infer_outputs(feeds, names)
            if self._stats is not None:
                self._stats.add(graph, {k: v for k, v in outputs.items() if k not in caches})
            return outputs

        return observed

    def _kept_observer(self, graph: str, infer_kept: KeptInfer, caches: set[str]) -> KeptInfer:
        def observed(feeds: Mapping[str, Feed], keep: Collection[str]
                     ) -> tuple[dict[str, np.ndarray], dict[str, Feed]]:
            host, kept = infer_kept(feeds, keep)
            if self._stats is not None:
                self._stats.add(graph, {k: v for k, v in host.items() if k not in caches})
            return host, kept

        return observed

    def _in_place_observer(self, graph: str, infer_in_place: InPlaceInfer) -> InPlaceInfer:
        def observed(feeds: Mapping[str, Feed], in_place: Mapping[str, str], names: Sequence[str]
                     ) -> dict[str, np.ndarray]:
            outputs = infer_in_place(feeds, in_place, names)
            if self._stats is not None:
                self._stats.add(graph, outputs)  # the outputs written in place are caches, not returned
            return outputs

        return observed

    @contextmanager
    def record(self) -> Iterator[GraphStats]:
        """Statistics of the graph calls made inside the block."""
        self._stats = stats = GraphStats()
        try:
            yield stats
        finally:
            self._stats = None
