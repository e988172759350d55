"""The sessions' queue (serve/queue.py) on its own: its deadline bounds the synthesis, not how fast the client
reads what the synthesis yielded."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from cosyvoice_serve.errors import ApiError
from cosyvoice_serve.queue import (
    Cancelled,
    ServerStopping,
    Session,
    SessionQueue,
    SessionStream,
    SessionTimeout,
)
from cosyvoice_serve.responses import ClientGone, first_item

TIMEOUT = 0.3


async def _read(stream: SessionStream[int], pause: float) -> list[int | None]:
    """Every item of `stream` and its end, read after `pause` seconds."""
    await asyncio.sleep(pause)
    items: list[int | None] = []
    while not items or items[-1] is not None:
        items.append(await stream.next())
    return items


def test_what_the_work_yielded_in_time_reaches_a_client_that_reads_late() -> None:
    """A client that reads past the deadline (one playing the audio as it comes) gets every item the work
    yielded before it: the work finished in time."""

    def work(session: Session) -> Iterator[int]:
        yield from session.watch([1, 2, 3])

    async def main() -> list[int | None]:
        queue = SessionQueue(1, 0, TIMEOUT)
        try:
            stream = queue.submit(work)
            return await _read(stream, 2 * TIMEOUT)
        finally:
            queue.shutdown()

    assert asyncio.run(main()) == [1, 2, 3, None]


def test_work_past_the_deadline_still_times_out() -> None:
    """The items before the deadline arrive; waiting for one the work has not yielded by then is a
    `SessionTimeout`, and the session is cancelled."""

    def work(session: Session) -> Iterator[int]:
        yield 1
        time.sleep(3 * TIMEOUT)  # a graph call that runs past the deadline
        yield 2

    async def main() -> tuple[int | None, SessionStream[int]]:
        queue = SessionQueue(1, 0, TIMEOUT)
        try:
            stream = queue.submit(work)
            first = await stream.next()
            with pytest.raises(SessionTimeout, match=f"timeout of {TIMEOUT:g} s"):
                await stream.next()
            return first, stream
        finally:
            queue.shutdown()

    first, stream = asyncio.run(main())
    assert first == 1
    with pytest.raises(Cancelled):  # the work's next check stops it
        stream.session.check()


class _FailsAfterCancel:
    """A session stream whose next item is an error that comes even once the wait for it is cancelled (as
    `asyncio.wait_for` on Python 3.11 returns an item already queued rather than raise CancelledError)."""

    async def next(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)
        raise ApiError(400, "text is empty")

    def cancel(self) -> None:
        pass


class _Gone:
    """A request whose client has gone."""

    state = SimpleNamespace()

    async def receive(self) -> dict[str, str]:
        return {"type": "http.disconnect"}


def test_a_client_gone_before_the_first_item_leaves_no_error_unread() -> None:
    """The session's error, which nobody reads any more, is read all the same: asyncio logs no 'Task exception
    was never retrieved' traceback for a client that closes just after its request."""
    unread: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unread.append(context))
        state = SimpleNamespace(metrics=SimpleNamespace(sessions_cancelled=SimpleNamespace(inc=lambda: None)))
        with pytest.raises(ClientGone):
            await first_item(state, _Gone(), _FailsAfterCancel())  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the cancelled wait ends with its error
        gc.collect()  # where asyncio reports a task's error nobody retrieved

    asyncio.run(main())
    assert unread == []


def test_a_queue_stops_once_each_of_its_servers_has_and_tells_the_waiting_sessions() -> None:
    """Shared by two servers (gRPC beside HTTP), the queue runs its waiting session on after the first stops;
    once the second has, a waiting session's client hears `ServerStopping` at once (not at its deadline), a
    new one is refused so, and the running one goes on to its end."""
    release = threading.Event()

    def held(session: Session) -> Iterator[int]:
        release.wait(10)
        yield 1

    def work(session: Session) -> Iterator[int]:
        yield 2

    async def main() -> None:
        queue = SessionQueue(1, 1, 60.0)
        running = queue.submit(held)
        waiting = queue.submit(work)
        while queue.running != 1:  # the held session on its worker: the stop leaves it be
            await asyncio.sleep(0.01)
        queue.share()
        queue.shutdown()  # one server stopped: the queue goes on
        assert waiting.session.future is not None and not waiting.session.future.cancelled()
        queue.shutdown()  # the last one
        start = time.monotonic()
        with pytest.raises(ServerStopping, match="the server is stopping"):
            await waiting.next()
        assert time.monotonic() - start < 1.0
        assert waiting.session.released.is_set() and queue.waiting == 0
        with pytest.raises(ServerStopping):
            queue.submit(work)
        release.set()
        assert [await running.next(), await running.next()] == [1, None]

    asyncio.run(main())
