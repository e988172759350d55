"""`cosyvoice-run --tune`: measure onnxruntime's optimisation levels and intra-op threads per graph on this
machine and write the fastest into the bundle's tuning file, which `OrtRunner` then uses (see
`runners.ort_settings`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cosyvoice_graphs import Case, GraphSpec

from .atomic_files import write_json_atomic
from .bundle import RuntimeBundle
from .runners import CPU, OPTIMIZATION, OrtRunner, on_openvino
from .runners.ort_settings import (
    DEFAULT_SETTINGS,
    FALLBACK,
    TUNING_FILE,
    TUNING_FORMAT,
    TUNING_VERSION,
    OrtSettings,
    graph_files,
    machine,
    usable_cpus,
)

MARGIN = 0.03
"""How much faster than the default level on every usable CPU a setting must be to be chosen instead:
less is within the noise of a few calls, and the default is the one the goldens are made with."""


def thread_counts(cpus: int) -> tuple[int, ...]:
    """The intra-op thread counts tried: powers of two below `cpus`, and `cpus`."""
    counts = {cpus}
    n = 1
    while n < cpus:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


def opt_case(spec: GraphSpec) -> Case:
    """The spec's optimisation point (its `opt` sizes): the call shape a graph spends most time at, which
    the TensorRT profiles tune for too."""
    return Case({name: r.opt for name, r in spec.dims.items()})


def tune(bundle: RuntimeBundle, *, repeats: int = 3, threads: Sequence[int] | None = None,
         on_result: Callable[[str, OrtSettings, float], None] = lambda *_: None) -> Path:
    """Time every graph that runs on onnxruntime's CPU provider at each optimisation level and thread count
    (`thread_counts(usable_cpus())` unless given), at its spec's optimisation point, and write the fastest
    setting per graph (the default one unless `MARGIN` faster) to the bundle's tuning file; returns its
    path. A setting's figure is the median of `repeats` calls after a warm-up; the candidates are taken in
    turn and then in reverse order and the better pass kept, so that a load that drifts during the tuning
    favours none. `on_result` gets every figure."""
    counts = tuple(threads) if threads is not None else thread_counts(usable_cpus())
    candidates = [OrtSettings(level, n) for level in OPTIMIZATION for n in counts]
    files = graph_files(bundle.root)
    graphs: dict[str, Any] = {}
    for graph, spec in bundle.specs.items():
        if on_openvino(bundle, graph, CPU):
            continue
        feeds = spec.sample_inputs(opt_case(spec))
        seconds: dict[OrtSettings, float] = {}
        for order in (candidates, candidates[::-1]):
            for setting in order:
                with OrtRunner(bundle.graph_path(graph), spec, CPU, threads=setting.threads,
                               optimization=setting.optimization) as runner:
                    runner.infer(feeds)
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        runner.infer(feeds)
                        times.append(time.perf_counter() - start)
                figure = statistics.median(times)
                seconds[setting] = min(seconds.get(setting, figure), figure)
                on_result(graph, setting, figure)
        best = min(seconds, key=seconds.__getitem__)
        default = OrtSettings(DEFAULT_SETTINGS.get(graph, FALLBACK).optimization, max(counts))
        if default in seconds and seconds[best] > seconds[default] * (1 - MARGIN):
            best = default
        figures = {f"{s.optimization}/{s.threads}": round(t, 6) for s, t in seconds.items()}
        graphs[graph] = {**asdict(best), "file": files[graph], "point": dict(opt_case(spec).dims),
                         "seconds": figures}
    path = bundle.root / TUNING_FILE
    write_json_atomic(path, {"format": TUNING_FORMAT, "version": TUNING_VERSION, "machine": machine(),
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "graphs": graphs})
    return path
