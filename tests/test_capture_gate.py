"""The GPU's uses against a CUDA graph's capture (`cosyvoice_runtime.runners.capture_gate`): uses of several
threads run together; a capture waits for the uses in flight, holds new ones off until it ends and goes
before uses that come after it; a thread's own uses run inside its capture and nested uses never wait."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from cosyvoice_runtime.runners.capture_gate import GATE, CaptureGate, on_device

WAIT_S = 5.0


def _started(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _blocked(thread: threading.Thread) -> bool:
    """Whether `thread` is still waiting a while later."""
    thread.join(0.2)
    return thread.is_alive()


def test_uses_of_several_threads_run_together() -> None:
    gate = CaptureGate()
    inside = threading.Barrier(3, timeout=WAIT_S)

    def use() -> None:
        with gate.use():
            inside.wait()  # all three inside at once, or BrokenBarrierError

    threads = [_started(use) for _ in range(2)]
    use()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_capture_waits_for_the_uses_in_flight_and_holds_later_ones_off() -> None:
    gate = CaptureGate()
    order: list[str] = []
    holding, release, captured, end_capture = (threading.Event() for _ in range(4))

    def user() -> None:
        with gate.use():
            holding.set()
            release.wait(WAIT_S)
            order.append("first use ends")

    def capturer() -> None:
        with gate.capture():
            order.append("capture")
            captured.set()
            end_capture.wait(WAIT_S)
            order.append("capture ends")

    def later_user() -> None:
        with gate.use():
            order.append("later use")

    first = _started(user)
    assert holding.wait(WAIT_S)
    capture = _started(capturer)
    assert _blocked(capture) and order == []  # the use in flight holds the capture off
    later = _started(later_user)
    assert _blocked(later) and order == []  # a use after a waiting capture waits behind it
    release.set()
    assert captured.wait(WAIT_S)
    assert _blocked(later)  # the capture holds the GPU alone
    end_capture.set()
    for thread in (first, capture, later):
        thread.join(WAIT_S)
    assert order == ["first use ends", "capture", "capture ends", "later use"]


def test_the_capturing_thread_uses_the_gpu_and_nested_uses_never_wait() -> None:
    gate = CaptureGate()
    with gate.capture(), gate.use(), gate.use():  # the capture's own calls (a run, a copy)
        pass
    inner, capture_waiting, done = threading.Event(), threading.Event(), threading.Event()

    def capturer() -> None:
        capture_waiting.set()
        with gate.capture():
            done.set()

    with gate.use():
        waiting = _started(capturer)
        assert capture_waiting.wait(WAIT_S) and _blocked(waiting)
        with gate.use():  # a runner's call inside a pool's: would wait for the capture, which waits for it
            inner.set()
    assert inner.is_set()
    waiting.join(WAIT_S)
    assert done.is_set()


def test_a_capture_inside_a_use_is_refused() -> None:
    gate = CaptureGate()
    with gate.use(), pytest.raises(RuntimeError, match="would wait for that use to end"):
        with gate.capture():
            pass
    with gate.capture():  # the gate is free again
        pass


def test_during_a_capture_the_cpu_goes_on_and_the_gpu_waits() -> None:
    def call(device: str) -> Callable[[], None]:
        def run() -> None:
            with on_device(device):
                pass
        return run

    with GATE.capture():
        cpu, gpu = _started(call("cpu")), _started(call("cuda"))
        cpu.join(WAIT_S)
        assert not cpu.is_alive() and _blocked(gpu)
    gpu.join(WAIT_S)
    assert not gpu.is_alive()
