"""`cosyvoice-run --tune`: measure onnxruntime's optimisation levels and intra-op threads per graph on this
machine and write the fastest into the bundle's tuning file, which `OrtRunner` then uses (see
`runners.ort_settings`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_graphs import BATCH, PAST_LEN, SEQLENS_K, Case, GraphSpec, decode_step_case

from .atomic_files import write_json_atomic
from .bundle import RuntimeBundle
from .runners import CPU, OPTIMIZATION, OrtRunner, graphs_run, on_openvino
from .runners.ort_settings import (
    TUNING_FILE,
    TUNING_FORMAT,
    TUNING_VERSION,
    OrtSettings,
    default_settings,
    graph_files,
    machine,
    usable_cpus,
)

MARGIN = 0.03
"""How much faster than the default setting (its level on every usable CPU) a setting must be to be chosen
instead: less is within the noise of a few calls, and the default is the one the goldens are made with."""


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
    the TensorRT profiles tune for too; `llm_decode`'s there is a decode step whose buffers hold nothing but
    the cache."""
    dims = {name: r.opt for name, r in spec.dims.items()}
    if SEQLENS_K in spec.input_names:
        return decode_step_case(spec, dims[PAST_LEN], batch=dims[BATCH])
    return Case(dims)


def tune(bundle: RuntimeBundle, *, repeats: int = 5, threads: Sequence[int] | None = None,
         on_result: Callable[[str, OrtSettings, float, float], None] = lambda *_: None) -> Path:
    """Time every graph the CPU pipeline runs on onnxruntime (`graphs_run`) at each optimisation level and
    thread count (`thread_counts(usable_cpus())` unless given), at its spec's optimisation point, against
    its default setting, and write per graph the setting with the smallest ratio to the default (the default
    unless `MARGIN` faster) to the bundle's tuning file; returns its path.

    Each candidate runs beside a session of the default, their calls interleaved (`repeats` pairs after a
    warm-up, the order alternating), and its figure is the median of the pairs' time ratios: both sides of
    a pair share whatever else the machine is doing, so a load that drifts during the tuning favours no
    candidate, and only two sessions of a graph are open at once. `on_result` gets every candidate's median
    seconds and ratio."""
    counts = tuple(threads) if threads is not None else thread_counts(usable_cpus())
    files = graph_files(bundle.root)
    graphs: dict[str, Any] = {}
    for graph in graphs_run(bundle, CPU):
        spec = bundle.specs[graph]
        if on_openvino(bundle, graph, CPU):
            continue
        feeds = spec.sample_inputs(opt_case(spec))
        default = OrtSettings(default_settings(graph).optimization, max(counts))
        ratios = {default: 1.0}
        with _runner(bundle, graph, default) as base:
            base.infer(feeds)
            for setting in (OrtSettings(level, n) for level in OPTIMIZATION for n in counts):
                if setting == default:
                    continue
                with _runner(bundle, graph, setting) as runner:
                    runner.infer(feeds)
                    pairs = [_timed_pair(base, runner, feeds, flip=k % 2 == 1) for k in range(repeats)]
                ratios[setting] = statistics.median(t / b for b, t in pairs)
                on_result(graph, setting, statistics.median(t for _, t in pairs), ratios[setting])
        best = min(ratios, key=ratios.__getitem__)
        if ratios[best] > 1 - MARGIN:
            best = default
        figures = {f"{s.optimization}/{s.threads}": round(r, 4) for s, r in ratios.items()}
        graphs[graph] = {**asdict(best), "file": files[graph], "point": dict(opt_case(spec).dims),
                         "default": asdict(default), "ratio_to_default": figures}
    path = bundle.root / TUNING_FILE
    write_json_atomic(path, {"format": TUNING_FORMAT, "version": TUNING_VERSION, "machine": machine(),
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "graphs": graphs})
    return path


def _runner(bundle: RuntimeBundle, graph: str, setting: OrtSettings) -> OrtRunner:
    return OrtRunner(bundle.graph_path(graph), bundle.specs[graph], CPU, threads=setting.threads,
                     optimization=setting.optimization)


def _timed_pair(base: OrtRunner, other: OrtRunner, feeds: Mapping[str, np.ndarray], *, flip: bool
                ) -> tuple[float, float]:
    """Seconds of one call of `base` and one of `other`, back to back (`other` first when `flip`)."""
    times = {}
    for runner in (other, base) if flip else (base, other):
        start = time.perf_counter()
        runner.infer(feeds)
        times[id(runner)] = time.perf_counter() - start
    return times[id(base)], times[id(other)]
