"""A CUDA graph's capture kept apart from every other use of the GPU in the process.

onnxruntime (1.31) captures a CUDA graph in CUDA's global capture mode (`cudaStreamCaptureModeGlobal`):
while one thread captures, a call of any other thread that may synchronise with the device (an allocation, a
copy between host and device, a session's run) is refused by CUDA and invalidates the capture; on an H200 a
session's run on another thread crashed the process (docs/gpu.md). So the runtime's
uses of a GPU (its sessions' calls, copies and buffers) go through `GATE.use()`, which any number of threads
hold at once, and a call that may capture through `GATE.capture()`, which waits for the uses in flight,
holds new ones off until it ends, and lets its own thread use the GPU meanwhile. Captures are rare (a batch
step's first calls at each shape); uses are every call, a lock's acquire and release each.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from cosyvoice_graphs.providers import CPU


class CaptureGate:
    """Shared uses of the GPU against exclusive captures; a waiting capture goes before new uses, so that
    streams calling the GPU back to back cannot keep it waiting."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._users = 0
        self._capturing: int | None = None
        """The thread that holds the capture."""
        self._waiting = 0
        """Captures waiting for the uses in flight to end."""
        self._depth = threading.local()
        """This thread's uses held, nested: an inner one never waits (a waiting capture would wait for the
        outer one, which would wait for the inner one)."""

    @contextmanager
    def use(self) -> Iterator[None]:
        """Use the GPU beside other threads' uses, not during another thread's capture."""
        depth = getattr(self._depth, "held", 0)
        if not depth and self._capturing != threading.get_ident():
            with self._changed:
                while self._capturing is not None or self._waiting:
                    self._changed.wait()
                self._users += 1
            counted = True
        else:
            counted = False
        self._depth.held = depth + 1
        try:
            yield
        finally:
            self._depth.held = depth
            if counted:
                with self._changed:
                    self._users -= 1
                    if not self._users:
                        self._changed.notify_all()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Hold the GPU alone: after every other thread's use in flight, before any new one."""
        if getattr(self._depth, "held", 0):
            raise RuntimeError("a capture inside a use of the GPU would wait for that use to end")
        with self._changed:
            self._waiting += 1
            try:
                while self._capturing is not None or self._users:
                    self._changed.wait()
            finally:
                self._waiting -= 1
                self._changed.notify_all()  # uses held off for this capture may go on if it gave up
            self._capturing = threading.get_ident()
        try:
            yield
        finally:
            with self._changed:
                self._capturing = None
                self._changed.notify_all()


GATE = CaptureGate()
"""The process's gate: CUDA's global capture mode reaches every thread of the process."""


def on_device(device: str) -> AbstractContextManager[None]:
    """A use of `device` (onnxruntime's name: "cpu", "cuda") through `GATE`; nothing to hold on the CPU."""
    return nullcontext() if device == CPU else GATE.use()
