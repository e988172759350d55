"""wetext's grammars in a process of their own: `GrammarProcess`, and that process (`python -m
cosyvoice_runtime.frontend.grammar_process`).

kaldifst's normaliser holds the GIL through a whole text: 3-4 s for 2,000 English characters with a digit
(AMD EPYC, avx2), in which every other thread of the process stands still, a server's event loop and its
other streams' chunks among them (docs/server.md). In a child process the grammar runs beside them; the
calling thread waits on a pipe, without the GIL.

A command of its own, not a `multiprocessing` worker: a spawned worker imports the parent's main script
again (a script without a `__main__` guard, or read from stdin, cannot start one), and a forked one copies a
process whose other threads may hold locks. The pipe speaks JSON lines: a text in, {"text": ...} or
{"error": ...} out. The child ends when its stdin closes, so a parent killed outright leaves none behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import IO

from ..errors import FrontendError
from .text import checked_wetext_normalize, load_grammars, needs_grammar


class GrammarProcess:
    """`checked_wetext_normalize` run in a child process, started at once and loading both grammars (0.5 s
    and 107 MB on an AMD EPYC; kaldifst's lattices for a 2,000-character English text take it to 529 MB at
    their peak, memory the calling process would have taken otherwise), so that the first text with a digit
    does not wait for it. Texts that come together take their turns; one without a digit, which no grammar
    reads, does not go there. A child that died (killed for memory) is started again for the next text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)

    def __call__(self, text: str) -> str:
        """What `checked_wetext_normalize(text)` returns, or raises."""
        if not needs_grammar(text):
            return text
        with self._lock:
            try:
                reply = self._ask(text)
            except (BrokenPipeError, EOFError):
                self._child.wait()
                self._child = self._start()
                try:
                    reply = self._ask(text)
                except (BrokenPipeError, EOFError):
                    raise FrontendError(f"the text normaliser's process ended on this text (exit status "
                                        f"{self._child.wait()}); shorten or rephrase it") from None
        if "error" in reply:
            raise FrontendError(reply["error"])
        return str(reply["text"])

    def _ask(self, text: str) -> dict[str, str]:
        stdin, stdout = self._child.stdin, self._child.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(text).encode() + b"\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise EOFError
        return dict(json.loads(line))

    def close(self) -> None:
        """End the child once the text it works on, if any, is done."""
        with self._lock:
            if self._child.stdin is not None:
                self._child.stdin.close()
            self._child.wait()


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
