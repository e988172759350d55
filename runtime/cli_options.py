"""Options that several console scripts share, defined once."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from .chunk_policy import ChunkPolicy
from .errors import USER_ERRORS, path_problem
from .runners.ort_settings import threads_problem

EVERY_BLOCK = "all"
"""`--flow-window`'s value for a window of every block (only the final chunk deviates)."""


@contextmanager
def one_line_errors(*errors: type[Exception]) -> Iterator[None]:
    """Bad input or environment, `errors` (default: the runtime's `USER_ERRORS`), as one line on stderr
    ("error: ...") and exit status 2."""
    caught = errors or USER_ERRORS
    try:
        yield
    except caught as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


class NonEmptyPath(click.Path):
    """`click.Path` that refuses an empty value, which it would take as the working folder (`Path("")` is
    `Path(".")`): an empty value is an unset variable in a script, not a path; where it takes files only, a
    name ending in a slash; and, where the path must exist, says why one it cannot look at is refused
    (click calls every such path missing)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str | bytes) and not value:
            self.fail("an empty path; expected the name of a file or folder", param, ctx)
        # a folder's name (pathlib would drop the slash and take it as the file's)
        if not self.dir_okay and isinstance(value, str) and value.endswith(os.sep):
            self.fail(f"{value!r} ends with {os.sep!r}, as a folder's name does; expected a file's", param,
                      ctx)
        problem = path_problem(value) if self.exists and isinstance(value, str) else None
        if problem is not None:
            self.fail(f"{value!r}: {problem}", param, ctx)
        return super().convert(value, param, ctx)


class FlowWindow(click.ParamType):
    """`--flow-window`: `EVERY_BLOCK` or a number of blocks >= 1, as given (the string or the count)."""

    name = "all|N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str | int:
        text = str(value).strip().lower()
        if text == EVERY_BLOCK:
            return EVERY_BLOCK
        if text.isdigit() and int(text) >= 1:
            return int(text)
        self.fail(f"expected {EVERY_BLOCK!r} or a number of 1-s blocks >= 1, got {value!r}", param, ctx)


class Threads(click.ParamType):
    """`--threads`: a count of threads from 1 to the CPUs this process may use (`threads_problem`, read when
    the option is given)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        count = click.INT.convert(value, param, ctx)
        problem = threads_problem(count)
        if problem is not None:
            self.fail(problem, param, ctx)
        return count


THREADS = Threads()
"""The type of every command's `--threads`."""


class FiniteFloatRange(click.FloatRange):
    """`click.FloatRange` that also refuses nan (which compares false with both bounds, so passes them) and
    infinities."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def chunk_policy(first_chunk_tokens: int | None, flow_window: str | int | None) -> ChunkPolicy | None:
    """The `ChunkPolicy` of `--first-chunk-tokens` and `--flow-window` (None where not given), or None where
    neither is given: upstream's schedule and flow."""
    if first_chunk_tokens is None and flow_window is None:
        return None
    if flow_window is None:
        return ChunkPolicy(first_chunk_tokens=first_chunk_tokens)
    window = None if flow_window == EVERY_BLOCK else int(flow_window)
    return ChunkPolicy(first_chunk_tokens=first_chunk_tokens, flow="window", flow_window=window)


FLOW_WINDOW_HELP = ("deviate from upstream for streams that cost less: the final chunk runs over its own "
                    "frames against the earlier chunks' caches, not upstream's re-run over every frame, and "
                    "attention keeps the prompt and the last N 1-s blocks ('all': every block, so only the "
                    "final chunk's frames change) [default: off, upstream's flow; docs/runtime.md measures "
                    "it].")
"""`--flow-window`'s help, the same wherever it streams."""


def chunk_policy_options(first_chunk_help: str, flow_window_help: str = FLOW_WINDOW_HELP
                         ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--first-chunk-tokens N` and `--flow-window all|N`, given to the command as one `chunk_policy`: a
    `ChunkPolicy`, or None (upstream's schedule and flow). The graphs check it (`check_policy`)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def with_policy(*args: Any, first_chunk_tokens: int | None, flow_window: str | int | None,
                        **kwargs: Any) -> Any:
            return command(*args, chunk_policy=chunk_policy(first_chunk_tokens, flow_window), **kwargs)

        with_window = click.option("--flow-window", type=FlowWindow(), default=None, metavar="all|N",
                                   help=flow_window_help)(with_policy)
        return click.option("--first-chunk-tokens", type=int, default=None, metavar="N",
                            help=first_chunk_help)(with_window)

    return decorate
