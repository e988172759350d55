"""wetext's grammars in processes of their own: `GrammarProcess`, and such a process (`python -m
cosyvoice_runtime.frontend.grammar_process`).

kaldifst's normaliser holds the GIL through a whole text: 3-4 s for 2,000 English characters with a digit
(AMD EPYC, avx2), in which every other thread of the process stands still, a server's event loop and its
other streams' chunks among them (docs/server.md). In a child process the grammar runs beside them; the
calling thread waits on a pipe, without the GIL.

A command of its own, not a `multiprocessing` worker: a spawned worker imports the parent's main script
again (a script without a `__main__` guard, or read from stdin, cannot start one), and a forked one copies a
process whose other threads may hold locks. The pipe speaks JSON lines: a text in, {"text": ...} or
{"error": ...} out. The child ends when its stdin closes, so a parent killed outright leaves none behind.

A text's grammar can take seconds (a long run of digits: tens of seconds), so a caller whose client has left
ends it: an `Interruption` set in `INTERRUPTION` for the call kills the child working on its text (another is
started in its place) and the call raises `TextInterrupted`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import suppress
from contextvars import ContextVar
from typing import IO

from ..errors import FrontendError
from .text import checked_wetext_normalize, load_grammars, needs_grammar


class TextInterrupted(Exception):
    """A text's normalisation ended by its `Interruption`."""


class Interruption:
    """Ends, from another thread, the normalisation of the call in whose context it is set
    (`INTERRUPTION`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self.interrupted = False

    def interrupt(self) -> None:
        """Kill the child working on the call's text, if any; the call raises `TextInterrupted`, now or
        when it reaches a grammar."""
        with self._lock:
            self.interrupted = True
            if self._child is not None:
                self._child.kill()

    def _attach(self, child: subprocess.Popen[bytes] | None) -> None:
        """`child` works on the call's text from now (None: none does); `TextInterrupted` if interrupted."""
        with self._lock:
            if self.interrupted:
                raise TextInterrupted
            self._child = child

    def _detach(self) -> None:
        with self._lock:
            self._child = None


INTERRUPTION: ContextVar[Interruption | None] = ContextVar("INTERRUPTION", default=None)
"""The running call's `Interruption`, where its caller gave one (`contextvars.Context.run`)."""


class GrammarProcess:
    """`checked_wetext_normalize` run in child processes: up to `most` texts at once, one per child, so that a
    short text need not wait behind a long one (seconds). The first child starts at once and loads both
    grammars (0.5 s and 107 MB on an AMD EPYC; kaldifst's lattices for a 2,000-character English text take it
    to 529 MB at their peak, memory the calling process would have taken otherwise), so that the first text
    with a digit does not wait for it; another starts when a text finds every child busy, and stays. A text
    without a digit, which no grammar reads, goes to none. A child that died (killed for memory, or by an
    `Interruption`) is started again."""

    def __init__(self, most: int = 1) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self._most = most
        self._changed = threading.Condition()
        self._idle = [self._start()]
        self._started = 1
        self._closed = False

    @staticmethod
    def _start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)

    def __call__(self, text: str) -> str:
        """What `checked_wetext_normalize(text)` returns, or raises."""
        if not needs_grammar(text):
            return text
        interruption = INTERRUPTION.get() or Interruption()
        child = self._take()
        try:
            interruption._attach(child)
            try:
                reply = _ask(child, text)
            except (BrokenPipeError, EOFError):
                child.wait()
                interruption._attach(None)  # killed by it: `TextInterrupted`, not a retry
                child = self._start()
                interruption._attach(child)
                try:
                    reply = _ask(child, text)
                except (BrokenPipeError, EOFError):
                    interruption._attach(None)
                    raise FrontendError(f"the text normaliser's process ended on this text (exit status "
                                        f"{child.wait()}); shorten or rephrase it") from None
        finally:
            interruption._detach()
            self._give_back(child)
        if "error" in reply:
            raise FrontendError(reply["error"])
        return str(reply["text"])

    def _take(self) -> subprocess.Popen[bytes]:
        """An idle child; a new one where every child is busy and fewer than `most` run; else the first to be
        given back."""
        with self._changed:
            while True:
                if self._closed:
                    raise FrontendError("the text normaliser is closed")
                if self._idle:
                    return self._idle.pop()
                if self._started < self._most:
                    child = self._start()
                    self._started += 1
                    return child
                self._changed.wait()

    def _give_back(self, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is not None:  # another in its place, loading its grammars before the next text
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    with suppress(OSError):
                        pipe.close()
            child = self._start()
        with self._changed:
            self._idle.append(child)
            self._changed.notify_all()

    def close(self) -> None:
        """End the children once the texts they work on, if any, are done."""
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: len(self._idle) == self._started)
            for child in self._idle:
                if child.stdin is not None:
                    child.stdin.close()
                child.wait()


def _ask(child: subprocess.Popen[bytes], text: str) -> dict[str, str]:
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None
    stdin.write(json.dumps(text).encode() + b"\n")
    stdin.flush()
    line = stdout.readline()
    if not line:
        raise EOFError
    return dict(json.loads(line))


def serve(texts: IO[bytes], replies: IO[str]) -> None:
    """The child: each line of `texts` normalised, one line on `replies` each, until `texts` ends."""
    load_grammars()
    for line in texts:
        try:
            reply = {"text": checked_wetext_normalize(json.loads(line))}
        except FrontendError as e:
            reply = {"error": str(e)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    # the replies keep the pipe; whatever else would be printed goes to stderr
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, replies)
