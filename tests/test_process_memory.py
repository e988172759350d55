"""`cosyvoice_runtime.process_memory`: the C heap's free pages go back to the OS when asked."""

from __future__ import annotations

import pytest

from cosyvoice_runtime.process_memory import release_free_heap, rss_bytes

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
