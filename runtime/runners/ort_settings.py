"""onnxruntime session settings per graph: the measured defaults, and the tuning file that
`cosyvoice-run --tune` writes beside a bundle's manifest after measuring on the user's machine.

A setting comes from, first to last: what the caller passes (`OrtRunner(optimization=, threads=)`), the
bundle's tuning file, `default_settings` (the graph's recipe). The tuning file is refused, in one line, when
it is damaged or was measured for other graph files, another CPU or another onnxruntime: a stale choice would
be silently slower.
"""

from __future__ import annotations

import json
import numbers
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from cosyvoice_graphs import HIFT_DECODER, HIFT_F0
from cosyvoice_graphs.bundle_layout import GRAPHS_DIR, MANIFEST
from cosyvoice_graphs.manifest import Manifest, ManifestError
from cosyvoice_graphs.providers import CUDA
from cosyvoice_graphs.recipes import RECIPES

from ..errors import RuntimeBundleError

TUNING_FILE = "ort_tuning.json"
"""The tuning file's name, beside the bundle's manifest."""
TUNING_FORMAT = "cosyvoice3-ort-tuning"
TUNING_VERSION = 1
OPTIMIZATION = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
"""onnxruntime graph optimisation levels by name, least to most rewriting."""


@dataclass(frozen=True)
class OrtSettings:
    """How a graph's onnxruntime session is made."""

    optimization: str
    """A graph optimisation level, a key of `OPTIMIZATION`."""
    threads: int | None = None
    """Intra-op threads; None: onnxruntime's default (one per core)."""


FORCE_SPINNING_STOP = "session.force_spinning_stop"
"""onnxruntime's session option that puts the intra-op workers to sleep when a call ends."""
ARENA_SHRINKAGE = "memory.enable_memory_arena_shrinkage"
"""onnxruntime's run option naming the devices whose memory arenas give back, when the call ends, what they
grew by."""
FALLBACK = OrtSettings("all")
"""For a graph without a recipe, and for the GPU providers."""
CONV_ALGO_SEARCHES = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
"""How onnxruntime's CUDA provider picks a cuDNN convolution algorithm for a new input shape: by timing every
candidate (onnxruntime's default: the first call of each shape pays for it), by cuDNN's heuristics, or
cuDNN's default algorithm."""
CONV_ALGO_SEARCH = "HEURISTIC"
"""The CUDA sessions' choice among `CONV_ALGO_SEARCHES`, by measurement (the float32 vocoder on an H200, docs/
performance.md): a new shape's first call 0.15-0.18 s against 1.2-1.3 s searching exhaustively, and warm calls
faster too (18.7 against 31.5 ms over 500 frames)."""

SHAPE_SESSIONS = {HIFT_F0: 6, HIFT_DECODER: 6}
"""Sessions per graph on CUDA, each call on the one whose last call had its input shapes (`ShapePool`): the
vocoder's graphs, whose `Conv` nodes onnxruntime's CUDA provider builds cuDNN plans for again at every
change of shape. Six hold the lengths that streams and offline requests of one prompt come in (its first
window on upstream's schedule or on the first-chunk policy, the later hops' windows of 50 and 100 tokens,
each stream's last repeating one of them, the offline windows of 200 frames; the f0 graph's calls reach a
few frames further: six lengths, the decoder's five); with three, every round of the bench's streamed and
offline cases changed shapes 8-9 times a graph (tests/test_shape_pool.py)."""


def shape_sessions(graph: str, provider: str) -> int:
    """How many sessions `open_runner` opens for `graph` on `provider` (`SHAPE_SESSIONS` on CUDA, else 1)."""
    return SHAPE_SESSIONS.get(graph, 1) if provider == CUDA else 1


def default_settings(graph: str) -> OrtSettings:
    """What the runtime uses for `graph` on the CPU without a tuning file: its recipe's optimisation level
    (`GraphRecipe.ort_optimization`, where it says why), onnxruntime's default threads; `FALLBACK` for a
    graph without a recipe."""
    recipe = RECIPES.get(graph)
    return FALLBACK if recipe is None else OrtSettings(recipe.ort_optimization)


def keeps_spinning(graph: str) -> bool:
    """Whether `graph`'s intra-op workers keep spinning after a call (`GraphRecipe.ort_keep_spinning`, where
    it says why); every other graph's session stops them (`FORCE_SPINNING_STOP`)."""
    recipe = RECIPES.get(graph)
    return recipe is not None and recipe.ort_keep_spinning


def shrinks_arena(graph: str) -> bool:
    """Whether `graph`'s calls on the CPU shrink its session's memory arena when they end
    (`GraphRecipe.ort_arena_shrink`, where it says why)."""
    recipe = RECIPES.get(graph)
    return recipe is not None and recipe.ort_arena_shrink


def cuda_options(device_id: int, *, tf32: bool, conv_algo_search: str = CONV_ALGO_SEARCH,
                 cuda_graph: bool = False) -> dict[str, str]:
    """onnxruntime's CUDA provider options for a graph on CUDA device `device_id`. `tf32`: float32 matmuls
    and convolutions in TF32 (a tf32 graph's precision asks for it); otherwise they are float32, which the
    provider's default (TF32 on) is not. `cuda_graph`: the session captures its kernels into a CUDA graph
    and replays it, which needs every input and output bound at the same device address at every call."""
    if conv_algo_search not in CONV_ALGO_SEARCHES:
        raise ValueError(f"unknown cuDNN algorithm search {conv_algo_search!r}; known: "
                         f"{', '.join(CONV_ALGO_SEARCHES)}")
    options = {"device_id": str(device_id), "use_tf32": "1" if tf32 else "0",
               "cudnn_conv_algo_search": conv_algo_search}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return options


def machine() -> dict[str, Any]:
    """What a tuning is valid for: the CPU model, the CPUs this process may use and onnxruntime's version."""
    return {"cpu": _cpu_model(), "usable_cpus": usable_cpus(), "onnxruntime": ort.__version__}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_problem(threads: object) -> str | None:
    """Why `threads` is not a count of threads from 1 to the CPUs this process may use (`usable_cpus`), or
    None: more threads than CPUs only slow every call, onnxruntime's threads spinning for cores they share."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or int(threads) < 1:
        return f"{threads!r} is not a count of threads; expected 1 or more"
    cpus = usable_cpus()
    if int(threads) > cpus:
        return f"{threads} is more than the {cpus} CPUs this process may use"
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def settings_for(graph_path: Path, graph: str) -> OrtSettings:
    """The settings of `graph`, whose file is `graph_path`: its bundle's tuning file's when there is one
    (`graph_path` in the bundle's graphs folder), else `default_settings`'."""
    graph_path = Path(graph_path)
    if graph_path.parent.name == GRAPHS_DIR:
        tuned = read_tuning(graph_path.parent.parent).get(graph)
        if tuned is not None:
            return tuned
    return default_settings(graph)


def graph_files(root: Path) -> dict[str, dict[str, Any]]:
    """Graph name -> its manifest file entry ({"size", "sha256"}), read from `root`'s manifest: what a
    tuning was measured on."""
    path = root / MANIFEST
    try:
        manifest = Manifest.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
    except ManifestError as e:
        raise RuntimeBundleError(str(e)) from None
    return {name: manifest.files[g.file].to_json() for name, g in manifest.graphs.items()}


def read_tuning(root: Path) -> dict[str, OrtSettings]:
    """Graph -> tuned settings from `root/ort_tuning.json` ({} without one). Raises `RuntimeBundleError`
    (one line) for a damaged file, or one measured for other graph files, another CPU or onnxruntime."""
    path = root / TUNING_FILE
    if not path.is_file():
        return {}
    retune = f"run cosyvoice-run --model {root} --tune again, or delete it"
    try:
        data = json.loads(path.read_text())
        if data.get("format") != TUNING_FORMAT or data.get("version") != TUNING_VERSION:
            raise ValueError(f"format {data.get('format')!r} v{data.get('version')}, expected "
                             f"{TUNING_FORMAT!r} v{TUNING_VERSION}")
        tuned = {name: OrtSettings(g["optimization"], g["threads"]) for name, g in data["graphs"].items()}
        for name, s in tuned.items():
            if s.optimization not in OPTIMIZATION:
                raise ValueError(f"{name}: optimization {s.optimization!r}")
            # as --threads: more than the CPUs this process may use only slows (a million would hang the run)
            problem = None if s.threads is None else threads_problem(s.threads)
            if problem is not None:
                raise ValueError(f"{name}: threads {problem}")
        recorded = {name: g["file"] for name, g in data["graphs"].items()}
        here, there = machine(), dict(data["machine"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise RuntimeBundleError(f"{path}: not a valid tuning file ({e}); {retune}") from None
    if there != here:
        changed = ", ".join(f"{k} {there.get(k)!r} -> {v!r}" for k, v in here.items() if there.get(k) != v)
        raise RuntimeBundleError(f"{path}: measured on another machine ({changed}); {retune}")
    files = graph_files(root)
    stale = [name for name, entry in recorded.items() if files.get(name) != entry]
    if stale:
        raise RuntimeBundleError(f"{path}: measured on other graph files than the manifest's "
                                 f"({', '.join(stale)}); {retune}")
    return tuned
