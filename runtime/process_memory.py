"""This process's resident memory, from /proc/self/status (Linux): the figures `cosyvoice-bench` reports
for a synthesis and `cosyvoice-export all --report-memory` per stage of an export; handing the C heap's
free pages back to the OS; and running on transparent huge pages."""

from __future__ import annotations

import ctypes
import os
import re
import resource
import sys
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""The kernel's transparent huge page mode: `[always]`, `[madvise]` (a region gets them where asked) or
`[never]`."""
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's tunable (2.35 and later) by which its malloc asks for transparent huge pages (1)."""


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


def huge_pages_wanted(environ: Mapping[str, str] = os.environ, thp_mode: Path = THP_MODE) -> bool:
    """Whether glibc's malloc would use transparent huge pages only if asked (`rerun_with_huge_pages`): glibc
    2.35 or later, the kernel's mode `madvise` (with `always` every region has them, with `never` none), and
    GLIBC_TUNABLES not naming `HUGE_PAGES_TUNABLE` (where it does, that is the user's choice, or the run
    again)."""
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    match = re.fullmatch(r"glibc (\d+)\.(\d+).*", version or "")
    if match is None or (int(match.group(1)), int(match.group(2))) < (2, 35):
        return False
    try:
        if "[madvise]" not in thp_mode.read_text():
            return False
    except OSError:
        return False
    return HUGE_PAGES_TUNABLE not in environ.get("GLIBC_TUNABLES", "")


def started_as(script: str, module: str) -> bool:
    """Whether this process was started to run the console script `script` or `python -m module` (not a
    program that calls their entry point itself: a test, a caller's script)."""
    args = iter(sys.orig_argv[1:])
    for arg in args:  # the interpreter's options, up to what it runs
        if arg.startswith("-m"):
            return (arg[2:] or next(args, None)) == module
        if arg.startswith("-c"):
            return False
        if arg in ("-W", "-X"):
            next(args, None)  # their value
        elif not arg.startswith("-"):
            return Path(arg).name == script
    return False


def rerun_with_huge_pages(script: str, module: str) -> None:
    """Run this process again (`exec`: the same pid, arguments and streams) with glibc's malloc on
    transparent huge pages, where it would not use them otherwise (`huge_pages_wanted`) and the process was
    started as the console script `script` or `python -m module` (`started_as`); glibc reads its tunables
    only as a process starts. For a command that allocates and frees large buffers over and over: each new
    one is memory first touched 4 KiB at a time (an export of the full-size model took 29.9 million page
    faults and 112-117 s of system time on a 2-core AMD EPYC Zen 4 VM with AVX-512, 1.3 million and 65-71 s
    on huge pages, docs/performance-log.md). Call it before anything else has run; GLIBC_TUNABLES naming the
    tunable (=0 to keep 4 KiB pages) leaves the process as it is."""
    if not (started_as(script, module) and huge_pages_wanted()):
        return
    tunables, wanted = os.environ.get("GLIBC_TUNABLES"), f"{HUGE_PAGES_TUNABLE}=1"
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{wanted}" if tunables else wanted
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
