"""This process's resident memory, from /proc/self/status (Linux): the figures `cosyvoice-bench` reports
for a synthesis and `cosyvoice-export all --report-memory` per stage of an export; and handing the C
heap's free pages back to the OS."""

from __future__ import annotations

import ctypes
import re
import resource
from collections.abc import Callable
from functools import cache
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int | None:
    """The process's resident set size now (Linux), None elsewhere."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def reset_peak_rss() -> bool:
    """Restart the peak-RSS mark at the current RSS (Linux >= 4.0); False where that is not possible,
    and `peak_rss_bytes` then gives the process's lifetime peak."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The peak resident set size since the last `reset_peak_rss` (or the process start)."""
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: ru_maxrss, kilobytes on Linux/BSD
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim`); False where the C library has
    none. Memory a library allocates and frees again in bulk, as onnxruntime does while it makes a session,
    otherwise stays resident, in the heap of whichever thread freed it."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return None
