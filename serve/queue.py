"""Admission and execution of synthesis sessions: a bounded queue in front of a fixed set of workers.

`SessionQueue.submit` admits a session if fewer than `concurrency + depth` are in flight and refuses
it with `QueueFull` (503) at once otherwise. Admitted sessions run on `concurrency` worker threads, in
order; the others wait. A session's work is a generator run on its worker; what it yields reaches the
event loop through a `SessionStream`. Every session has a deadline (admission + timeout) and a cancel
flag; the work checks both between LLM steps (`Session.watch`), so a cancelled or late session stops
within one decoding step or one flow/vocoder call, and its worker is free for the next one. A session
cancelled while it still waits never runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from .errors import ApiError

T = TypeVar("T")


class QueueFull(ApiError):
    """Every worker is busy and the queue is full: 503, try again later."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(503, f"server busy: {in_flight} sessions in flight (running and queued); "
                              "try again later", headers={"Retry-After": "1"})


class ServerStopping(ApiError):
    """The server is stopping: a session that came after, or waited and was dropped: 503."""

    def __init__(self) -> None:
        super().__init__(503, "the server is stopping; try again once it is back, or on another",
                         headers={"Retry-After": "1"})


class SessionTimeout(ApiError):
    """The session ran past its deadline: 504."""

    def __init__(self, timeout: float) -> None:
        super().__init__(504, f"synthesis took longer than the server's timeout of {timeout:g} s")


class Cancelled(Exception):
    """The session was cancelled (its client went away); raised inside its work to stop it."""


class Session:
    """One admitted request's cancel flag, deadline and timing, shared by its worker and the event loop."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.admitted = time.monotonic()
        self.deadline = self.admitted + timeout
        self.started: float | None = None
        """When a worker took it (None while it waits)."""
        self.finished: float | None = None
        """When its work ended without error."""
        self._cancel = threading.Event()
        self.future: Future[None] | None = None
        self.released = threading.Event()
        """Set once its slot is free: its work has ended, or it was dropped before it ran."""

    def cancel(self) -> None:
        """Stop the session: drop it if it still waits, else make its next `check` raise `Cancelled`."""
        self._cancel.set()
        if self.future is not None:
            self.future.cancel()

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` was called."""
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise `Cancelled` or `SessionTimeout` if the session must stop."""
        if self._cancel.is_set():
            raise Cancelled
        if time.monotonic() > self.deadline:
            raise SessionTimeout(self.timeout)

    def watch(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, checking the session before each one and after the last (wrap the LLM's token
        iterator in it)."""
        for item in items:
            self.check()
            yield item
        self.check()


_END = object()


class SessionStream(Generic[T]):
    """The event loop's end of a session: `await next()` for each item its work yields, None at the end.

    Errors raised by the work are raised by `next()`; a deadline that passes while waiting cancels the
    session and raises `SessionTimeout`. What the work has yielded is delivered however late the client
    reads it: the deadline bounds the synthesis, not the client.
    """

    def __init__(self, session: Session, loop: asyncio.AbstractEventLoop) -> None:
        self.session = session
        self._loop = loop
        self._items: asyncio.Queue[object] = asyncio.Queue()

    def put(self, item: object) -> None:
        """Hand `item` (an item, an exception or the end) to the event loop; from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self.session.cancel()

    async def next(self) -> T | None:
        """The next item, or None when the work has finished."""
        try:  # an item already here is taken at once (`wait_for` with no time left would not)
            item = self._items.get_nowait()
        except asyncio.QueueEmpty:
            remaining = self.session.deadline - time.monotonic()
            try:
                item = await asyncio.wait_for(self._items.get(), timeout=max(remaining, 0.0))
            except TimeoutError:
                self.session.cancel()
                raise SessionTimeout(self.session.timeout) from None
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]  # the work's items are T

    def cancel(self) -> None:
        """Stop the session (a no-op once it has finished)."""
        self.session.cancel()


class SessionQueue:
    """At most `concurrency` sessions running and `depth` waiting; the rest refused at once.

    It stops when each of its servers has called `shutdown` (one, and one more per `share`)."""

    def __init__(self, concurrency: int, depth: int, timeout: float) -> None:
        self.concurrency, self.depth, self.timeout = concurrency, depth, timeout
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="cosyvoice-session")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._running = 0
        self._servers = 1

    @property
    def running(self) -> int:
        """Sessions on a worker now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Sessions admitted and waiting for a worker (the queue depth)."""
        with self._lock:
            return self._in_flight - self._running

    def check_room(self) -> None:
        """`ServerStopping` or `QueueFull` where `submit` would refuse a session now: for the work a request
        does before it is admitted (its text normalised) to be refused first, not done for nothing."""
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:
        if not self._servers:
            raise ServerStopping
        if self._in_flight >= self.concurrency + self.depth:
            raise QueueFull(self._in_flight)

    def submit(self, work: Callable[[Session], Iterable[T]]) -> SessionStream[T]:
        """Admit a session that runs `work(session)` on a worker, or raise `QueueFull`.

        Must be called from the event loop's thread: the stream delivers to that loop. `ServerStopping`
        once the queue has stopped.
        """
        with self._lock:
            self._check_room()
            self._in_flight += 1
        session = Session(self.timeout)
        stream: SessionStream[T] = SessionStream(session, asyncio.get_running_loop())
        try:
            session.future = self._executor.submit(self._run, work, session, stream)
        except BaseException as e:
            with self._lock:
                self._in_flight -= 1
            if isinstance(e, RuntimeError):  # the executor's refusal: the queue stopped since the check
                raise ServerStopping from None
            raise
        session.future.add_done_callback(lambda future: self._release(future, session, stream))
        return stream

    def _run(self, work: Callable[[Session], Iterable[T]], session: Session, stream: SessionStream[T]
             ) -> None:
        with self._lock:
            self._running += 1
        session.started = time.monotonic()
        last: object = _END
        try:
            session.check()
            for item in work(session):
                stream.put(item)
            session.finished = time.monotonic()
        except BaseException as e:  # the event loop raises it where the client is answered
            last = e
        finally:
            # Free the slot before the client can see the end, so that its next request finds it free.
            with self._lock:
                self._running -= 1
                self._in_flight -= 1
            session.released.set()
        stream.put(last)

    def _release(self, future: Future[None], session: Session, stream: SessionStream[T]) -> None:
        """Free the slot of a session that never ran (the others free theirs in `_run`); one the queue
        dropped as it stopped, not its client, tells its client so."""
        if future.cancelled():
            with self._lock:
                self._in_flight -= 1
            session.released.set()
            if not session.cancelled:
                stream.put(ServerStopping())

    def share(self) -> None:
        """One more server submits to this queue: it stops once that one has called `shutdown` too."""
        with self._lock:
            self._servers += 1

    def shutdown(self) -> None:
        """A server is done with the queue; once every one is, `stop`."""
        with self._lock:
            self._servers = max(self._servers - 1, 0)
            if self._servers:
                return
        self.stop()

    def stop(self) -> None:
        """Take no new sessions and drop the waiting ones (their clients get `ServerStopping`), whichever
        servers share the queue (the process is stopping); the running ones go on to their end."""
        with self._lock:
            self._servers = 0
        self._executor.shutdown(wait=False, cancel_futures=True)
