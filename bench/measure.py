"""Timers and GPU sampling: timed wrappers around a pipeline's calls, the per-stage figures built from them,
and what a GPU used (peak RSS is `cosyvoice_runtime.process_memory`'s).

Stages are timed from outside: `CallLog.wrap` swaps a method of an existing object (a runner's `infer`,
a torch module's `forward`) for a timed one for the duration of a block, so neither the runtime nor the
reference carries timing code.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class CallLog:
    """When every call to the wrapped methods began and how long it took, by label, in call order
    (thread-safe)."""

    def __init__(self) -> None:
        self._calls: dict[str, list[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def wrap(self, targets: Mapping[str, tuple[object, str]]) -> Iterator[CallLog]:
        """For the block, record the seconds of each call of `obj.attr` under its label; the log is
        cleared first. The original methods are put back afterwards, also on error."""
        self._calls = {label: [] for label in targets}
        patched: list[tuple[object, str, bool, Any]] = []
        try:
            for label, (obj, attr) in targets.items():
                original = getattr(obj, attr)
                patched.append((obj, attr, attr in vars(obj), original))
                setattr(obj, attr, self._timed(label, original))
            yield self
        finally:
            for obj, attr, own, original in reversed(patched):
                if own:
                    setattr(obj, attr, original)
                else:
                    delattr(obj, attr)  # the class's method shows through again

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                with self._lock:
                    self._calls[label].append((start, seconds))
        return timed

    def seconds(self, label: str) -> list[float]:
        """Seconds of each recorded call under `label`, in call order."""
        with self._lock:
            return [seconds for _, seconds in self._calls.get(label, [])]

    def starts(self, label: str) -> list[float]:
        """When each recorded call under `label` began (`time.perf_counter`), in call order."""
        with self._lock:
            return [start for start, _ in self._calls.get(label, [])]


def llm_figures(llm_s: float, calls: Sequence[float]) -> dict[str, float | int | None]:
    """LLM figures from its total seconds and the seconds of each graph/network call (prefill first).

    Per token: (LLM time - prefill call) / (calls - 1), i.e. a decode step with its embedding lookup and
    sampling; tokens/s: decoding steps / LLM time, prefill included.
    """
    steps = len(calls)
    return {
        "llm_s": llm_s,
        "llm_steps": steps,
        "llm_prefill_s": calls[0] if calls else None,
        "llm_per_token_s": (llm_s - calls[0]) / (steps - 1) if steps > 1 else None,
        "llm_tokens_per_s": steps / llm_s if steps and llm_s > 0 else None,
    }


def timed(work: Callable[[], object]) -> float:
    """Seconds `work` took."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def batch_llm_calls(llm_s: float, accepts: Sequence[float]) -> list[float]:
    """A batched decoding's calls as `llm_figures` reads them (prefill first), from when each call's id
    reached the decoding (`accepts`: the starts of its `Decoding.accept`, one per call). A decode batch
    makes the calls on its own thread, in steps it may replay from CUDA graphs, so they are timed by their
    period: a step is the mean interval between accepts, the prefill what came before the first."""
    if len(accepts) < 2:
        return [llm_s] * len(accepts)
    span = accepts[-1] - accepts[0]
    return [llm_s - span] + [span / (len(accepts) - 1)] * (len(accepts) - 1)


def prefill_length(text_ids: Sequence[int], prompt_text_ids: Sequence[int], prompt_speech_tokens: int) -> int:
    """Positions of the LLM's prefill: sos, prompt text and text, task_id, prompt speech tokens."""
    return 1 + len(prompt_text_ids) + len(text_ids) + 1 + prompt_speech_tokens


def mean(values: Sequence[float]) -> float | None:
    """The mean, None for no values."""
    return statistics.fmean(values) if values else None


# --- GPU ---------------------------------------------------------------------------------------------

_QUERY = ["--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class GpuUsage:
    """What `GpuSampler` saw on GPU 0 while it ran."""

    memory_peak_mib: float
    """Device memory in use (every process), peak over the samples."""
    utilization_mean_pct: float
    samples: int


class GpuSampler:
    """Polls `nvidia-smi` for GPU 0's memory use and utilisation in a thread while a block runs."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.available = shutil.which("nvidia-smi") is not None
        """False: no nvidia-smi on PATH, and `sample` gives None."""

    @contextmanager
    def sample(self) -> Iterator[Callable[[], GpuUsage | None]]:
        """Sample during the block; the yielded function gives the usage once the block has ended."""
        rows: list[tuple[float, float]] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                out = subprocess.run(["nvidia-smi", "-i", "0", *_QUERY], capture_output=True, text=True)
                if out.returncode == 0 and out.stdout.strip():
                    used, util = (float(v) for v in out.stdout.strip().splitlines()[0].split(","))
                    rows.append((used, util))
                stop.wait(self.interval_s)

        thread = threading.Thread(target=poll, daemon=True) if self.available else None
        if thread is not None:
            thread.start()
        try:
            yield lambda: (GpuUsage(max(r[0] for r in rows), statistics.fmean(r[1] for r in rows), len(rows))
                           if rows else None)
        finally:
            stop.set()
            if thread is not None:
                thread.join()
