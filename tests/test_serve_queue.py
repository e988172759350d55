"""The sessions' queue (serve/queue.py) on its own: its deadline bounds the synthesis, not how fast the client
reads what the synthesis yielded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from cosyvoice_serve.queue import Cancelled, Session, SessionQueue, SessionStream, SessionTimeout

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
