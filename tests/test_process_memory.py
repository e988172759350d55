"""`cosyvoice_runtime.process_memory`: the C heap's free pages go back to the OS when asked, and a process
runs again on transparent huge pages where glibc would not use them unasked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_runtime.process_memory import (
    HUGE_PAGES_TUNABLE,
    THP_MODE,
    huge_pages_wanted,
    release_free_heap,
    rss_bytes,
    started_as,
)

MIB = 2**20


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux)")
def test_release_free_heap_returns_freed_memory_to_the_os() -> None:
    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    # 64 KiB blocks sit in the heap (below malloc's mmap threshold); every 50th kept alive holds the freed
    # ones between them in place, where free() alone returns nothing
    blocks = [bytearray(64 * 1024) for _ in range(4096)]
    kept = blocks[::50]
    del blocks
    held = rss_bytes() or 0
    assert release_free_heap()
    assert (rss_bytes() or 0) < held - 200 * MIB
    assert len(kept) == 82


GLIBC = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None


@pytest.mark.parametrize(("mode", "tunables", "wanted"), [
    ("always [madvise] never", None, True),
    ("always [madvise] never", "glibc.malloc.arena_max=2", True),
    ("always [madvise] never", "glibc.malloc.hugetlb=0", False),  # the user's choice
    ("always [madvise] never", "glibc.malloc.hugetlb=1", False),  # the run again
    ("[always] madvise never", None, False),  # malloc has them unasked
    ("always madvise [never]", None, False),
    (None, None, False),  # no such file: no transparent huge pages
])
def test_huge_pages_are_asked_for_only_where_malloc_would_not_use_them(
        tmp_path: Path, mode: str | None, tunables: str | None, wanted: bool) -> None:
    if GLIBC is None or tuple(int(n) for n in GLIBC.split()[1].split(".")[:2]) < (2, 35):
        pytest.skip(f"needs glibc 2.35 or later (its {HUGE_PAGES_TUNABLE} tunable); this is {GLIBC}")
    thp = tmp_path / "enabled"
    if mode is not None:
        thp.write_text(mode + "\n")
    environ = {} if tunables is None else {"GLIBC_TUNABLES": tunables}
    assert huge_pages_wanted(environ, thp) is wanted


@pytest.mark.parametrize(("argv", "started"), [
    (["py", "/v/bin/cosyvoice-export", "all", "-m", "x"], True),
    (["py", "-u", "/v/bin/cosyvoice-export"], True),
    (["py", "-m", "cosyvoice_export", "all"], True),
    (["py", "-X", "dev", "-W", "error", "-m", "cosyvoice_export"], True),
    (["py", "-mcosyvoice_export"], True),
    (["py", "/v/bin/pytest", "tests"], False),  # a test runner calling the entry point
    (["py", "-m", "pytest", "-m", "not torch"], False),
    (["py", "-c", "code", "cosyvoice-export"], False),
    (["py"], False),
])
def test_started_as_reads_the_interpreters_own_arguments(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                         started: bool) -> None:
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert started_as("cosyvoice-export", "cosyvoice_export") is started


PROBE = """import os, sys
from cosyvoice_runtime.process_memory import rerun_with_huge_pages
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
rerun_with_huge_pages("probe", "probe")
print("ran", os.getpid(), flush=True)
"""
"""A program that reports its pid and tunables, asks to run again on huge pages, and reports again."""


def _probe_lines(command: list[str], given: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if given is not None:
        env["GLIBC_TUNABLES"] = given
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.splitlines()


@pytest.mark.parametrize(("given", "after"), [
    (None, "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=4", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", None),  # left as it is
])
def test_the_process_runs_again_on_huge_pages(tmp_path: Path, given: str | None, after: str | None) -> None:
    """A process started as the script runs again, the same process (pid), with the tunable added to the
    ones given, where this machine's malloc would not use huge pages unasked; left to run on where the
    tunable is named."""
    if not huge_pages_wanted({}):
        pytest.skip(f"glibc would not run on huge pages only when asked here ({GLIBC}, {THP_MODE} "
                    f"{THP_MODE.read_text().strip() if THP_MODE.exists() else 'absent'})")
    script = tmp_path / "probe"
    script.write_text(PROBE)
    lines = _probe_lines([sys.executable, str(script)], given)
    pid = lines[0].split()[0]
    runs = [f"{pid} {given}"] + ([f"{pid} {after}"] if after is not None else [])
    assert lines == [*runs, f"ran {pid}"]


def test_a_program_calling_the_entry_point_itself_runs_on() -> None:
    """Only a process started as the script (or its module) runs again: a program that calls its entry point
    (a test runner, a caller's own script) would run itself again from its start."""
    lines = _probe_lines([sys.executable, "-c", PROBE], None)
    pid = lines[0].split()[0]
    assert lines == [f"{pid} None", f"ran {pid}"]
