"""Peak resident memory per stage of an export: what `cosyvoice-export all --report-memory` prints.

The export names its stages as it enters them (`stage("llm: trace")`); each runs until the next one
begins. While a `MemoryMonitor` records, every stage boundary reads the kernel's peak-RSS mark
(`VmHWM`) and restarts it, so a stage's peak is exact however briefly it was reached, with no sampling.
Without a monitor, `stage` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from cosyvoice_runtime.process_memory import peak_rss_bytes, reset_peak_rss, rss_bytes

GB = 1e9


@dataclass(frozen=True)
class StageMemory:
    """One stage of a monitored run."""

    name: str
    seconds: float
    peak_bytes: int
    """The highest RSS while the stage ran."""
    end_bytes: int
    """RSS when it ended: what it left resident for the stages after it."""


class MemoryMonitor:
    """The stages of one run, with their peak RSS; `monitor_memory` makes one and records into it."""

    def __init__(self) -> None:
        self.stages: list[StageMemory] = []
        self.exact = reset_peak_rss()
        """False where the peak mark cannot be restarted: each stage's peak is then the process's peak
        up to that stage's end."""
        self.start_bytes = rss_bytes() or 0
        """RSS when recording began (the interpreter and the imported libraries)."""
        self._started = time.perf_counter()
        self._current: tuple[str, float] | None = None

    @property
    def peak_bytes(self) -> int:
        """The highest RSS of the run so far (the stages' peaks cover it)."""
        return max((s.peak_bytes for s in self.stages), default=self.start_bytes)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._started

    def begin(self, name: str) -> None:
        """End the current stage, if any, and begin `name`."""
        self.end()
        self._current = (name, time.perf_counter())

    def end(self) -> None:
        """End the current stage, if any."""
        if self._current is not None:
            name, started = self._current
            self.stages.append(StageMemory(name, time.perf_counter() - started, peak_rss_bytes(),
                                           rss_bytes() or 0))
            self._current = None
        if self.exact:
            reset_peak_rss()

    def table(self) -> str:
        """One row per stage (time, peak RSS, RSS at its end), then the run's peak and the stage that
        reached it."""
        rows = [("stage", "time", "peak RSS", "RSS after")]
        rows += [(s.name, f"{s.seconds:.1f} s", f"{s.peak_bytes / GB:.2f} GB", f"{s.end_bytes / GB:.2f} GB")
                 for s in self.stages]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [_row(r, widths) for r in rows]
        top = max(self.stages, key=lambda s: s.peak_bytes, default=None)
        where = f" in {top.name}" if top else ""
        lines.append(f"peak RSS {self.peak_bytes / GB:.2f} GB{where}; {self.start_bytes / GB:.2f} GB at the "
                     f"start; {self.seconds:.1f} s")
        if not self.exact:
            lines.append("(this system cannot restart the peak-RSS mark: each stage's peak is the process's "
                         "peak up to its end)")
        return "\n".join(lines)


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    """The stage's name to the left, its figures to the right."""
    name, *figures = cells
    return "  ".join([name.ljust(widths[0]), *(c.rjust(w) for c, w in zip(figures, widths[1:], strict=True))])


_MONITOR: ContextVar[MemoryMonitor | None] = ContextVar("cosyvoice_export_memory_monitor", default=None)


@contextmanager
def monitor_memory() -> Iterator[MemoryMonitor]:
    """Record the stages begun inside the block (in this context) into a new `MemoryMonitor`."""
    monitor = MemoryMonitor()
    token = _MONITOR.set(monitor)
    try:
        yield monitor
    finally:
        monitor.end()
        _MONITOR.reset(token)


def stage(name: str) -> None:
    """Begin stage `name` of the run, ending the one before; recorded only inside `monitor_memory`."""
    monitor = _MONITOR.get()
    if monitor is not None:
        monitor.begin(name)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, None on other C libraries."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_TRIM = _malloc_trim()


def free_memory() -> None:
    """Collect unreachable objects, then hand the C heap's free pages back to the system (glibc's
    `malloc_trim`): protobuf, onnxruntime and torch free a graph's weights in many blocks, which glibc
    would otherwise keep for the process, resident, after the stage that used them."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
