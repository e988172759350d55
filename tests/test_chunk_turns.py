"""`ChunkTurns`: batched sessions' flow and vocoder work one chunk at a time, first chunks first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from cosyvoice_runtime.chunk_turns import HOLD_POLL_S, ChunkTurns
from cosyvoice_runtime.runners import CPU, CUDA
from cosyvoice_runtime.synthesis import batch_yields_to, chunks_yield_to


def test_a_first_chunk_goes_before_later_ones_that_asked_earlier() -> None:
    turns = ChunkTurns(slots=1)
    order: list[str] = []
    holding = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with turns.turn(first=False):
            holding.set()
            release.wait(10)

    def chunk(name: str, first: bool) -> None:
        with turns.turn(first=first):
            order.append(name)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(10)
    for name, first in (("later-1", False), ("later-2", False), ("first-1", True), ("first-2", True)):
        thread = threading.Thread(target=chunk, args=(name, first))
        thread.start()
        threads.append(thread)
        time.sleep(0.05)  # each asks after the one before
    assert order == []  # one slot, held
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["first-1", "first-2", "later-1", "later-2"]


def test_a_later_chunk_lets_waiting_first_chunks_pass_between_its_calls() -> None:
    """A later chunk's pause hands its slot to the first chunks that wait and takes it back before the later
    chunks that asked after it; with no first chunk waiting, and in a first chunk, the pause returns at
    once."""
    turns = ChunkTurns(slots=1)
    order: list[str] = []
    holding, paused = threading.Event(), threading.Event()

    def holder() -> None:
        with turns.turn(first=False) as pause:
            pause()  # nothing waits
            holding.set()
            paused.wait(10)
            order.append("later-1 before its pause")
            pause()
            order.append("later-1 after its pause")

    def chunk(name: str, first: bool) -> None:
        with turns.turn(first=first) as pause:
            pause()
            order.append(name)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(10)
    for name, first in (("later-2", False), ("first-1", True), ("first-2", True)):
        thread = threading.Thread(target=chunk, args=(name, first))
        thread.start()
        threads.append(thread)
        time.sleep(0.05)  # each asks after the one before
    assert order == [] and turns.full and turns.first_due
    paused.set()
    for thread in threads:
        thread.join(10)
    assert order == ["later-1 before its pause", "first-1", "first-2", "later-1 after its pause", "later-2"]
    assert not turns.full and not turns.first_due


def test_a_later_chunk_waits_at_its_pause_while_later_chunks_are_held() -> None:
    """While `hold_later` says so a later chunk's pause waits (a first chunk's does not), looks once more
    after it stops, and still lets a first chunk that waits for its slot pass; with nothing held it returns
    without waiting."""
    turns = ChunkTurns(slots=1)
    held = threading.Event()
    turns.hold_later = held.is_set
    with turns.turn(first=False) as pause:
        start = time.perf_counter()
        pause()
        assert time.perf_counter() - start < HOLD_POLL_S  # nothing held: no wait
    held.set()
    with turns.turn(first=True) as pause:
        pause()  # a first chunk is not held
    order: list[str] = []

    def later() -> None:
        with turns.turn(first=False) as pause:
            order.append("later asks to go on")
            pause()
            order.append("later goes on")

    def first() -> None:
        with turns.turn(first=True):
            order.append("first")

    thread = threading.Thread(target=later)
    thread.start()
    _until(lambda: order == ["later asks to go on"])
    newcomer = threading.Thread(target=first)
    newcomer.start()
    newcomer.join(10)  # it took the held chunk's slot
    time.sleep(5 * HOLD_POLL_S)
    assert order == ["later asks to go on", "first"]  # still held
    held.clear()
    thread.join(10)
    assert order == ["later asks to go on", "first", "later goes on"]


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_slots_run_at_once_and_a_failure_frees_its_turn() -> None:
    turns = ChunkTurns(slots=2)
    inside = threading.Barrier(2, timeout=10)

    def chunk() -> None:
        with turns.turn(first=True):
            inside.wait()  # both hold a turn at the same time, or this times out

    threads = [threading.Thread(target=chunk) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    with pytest.raises(RuntimeError), turns.turn(first=False):
        raise RuntimeError("the chunk failed")
    with turns.turn(first=False):  # its turn was given back
        pass
    with pytest.raises(ValueError, match="slots must be >= 1"):
        ChunkTurns(slots=0)


def test_chunks_due_are_known_and_each_end_is_told() -> None:
    """With one slot, `full` while any chunk holds a turn or waits for one, `first_due` while a first chunk
    does, and `on_done` after every turn."""
    turns = ChunkTurns(slots=1)
    done: list[tuple[bool, bool]] = []
    turns.on_done = lambda: done.append((turns.full, turns.first_due))
    assert not turns.full and not turns.first_due
    holding, release = threading.Event(), threading.Event()

    def later() -> None:
        with turns.turn(first=False):
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=later)
    holder.start()
    assert holding.wait(10) and turns.full and not turns.first_due  # a later chunk alone
    first = threading.Thread(target=lambda: _hold_first(turns))
    first.start()
    deadline = time.monotonic() + 10
    while not turns.first_due:  # waiting for the held turn
        assert time.monotonic() < deadline
        time.sleep(0.001)
    release.set()
    for thread in (holder, first):
        thread.join(10)
    assert done == [(True, True), (False, False)]  # the later chunk's end (the first waits), then the first's
    assert not turns.full and not turns.first_due


def test_the_slots_are_full_when_each_holds_a_chunk_or_a_chunk_waits() -> None:
    turns = ChunkTurns(slots=2)
    with turns.turn(first=False):
        assert not turns.full  # a slot is free
        with turns.turn(first=False):
            assert turns.full
            waiter = threading.Thread(target=lambda: _hold_first(turns))
            waiter.start()
            deadline = time.monotonic() + 10
            while not turns.first_due:  # waits for a slot
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert turns.full
        waiter.join(10)
        assert not turns.full


def test_the_batch_yields_to_every_chunk_on_the_cpu_and_to_first_chunks_on_a_gpu() -> None:
    """On the CPU the decode batch waits while the chunks' slots are taken (they share the cores); on a GPU
    while a first chunk holds a turn or waits for one."""
    turns = ChunkTurns(slots=1)
    on_cpu, on_gpu = batch_yields_to(turns, CPU), batch_yields_to(turns, CUDA)
    assert not on_cpu() and not on_gpu()
    with turns.turn(first=False):
        assert on_cpu() and not on_gpu()
    with turns.turn(first=True):
        assert on_cpu() and on_gpu()
    assert not on_cpu() and not on_gpu()


def _hold_first(turns: ChunkTurns) -> None:
    with turns.turn(first=True):
        assert turns.first_due


def test_later_chunks_wait_for_a_streams_first_ids_on_the_cpu_only() -> None:
    """On the CPU a batch's later chunks are held while it works for a stream's first audio (the two share
    the cores); on a GPU never."""

    class Batch:
        def first_audio_due(self) -> bool:
            return True

    assert chunks_yield_to(Batch(), CPU)()  # type: ignore[arg-type]
    assert not chunks_yield_to(Batch(), CUDA)()  # type: ignore[arg-type]
