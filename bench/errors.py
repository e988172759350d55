"""The benchmark's exception type for bad input, and the one-line handling its commands share."""

from __future__ import annotations

from contextlib import AbstractContextManager

from cosyvoice_export.bundle.errors import BundleError
from cosyvoice_runtime.cli_options import one_line_errors
from cosyvoice_runtime.errors import USER_ERRORS


class BenchError(ValueError):
    """Bad benchmark input (an unknown length, an empty list, a missing option); one line, exit status 2."""


BENCH_USER_ERRORS = (BenchError, BundleError, *USER_ERRORS)
"""Bad input or environment: the runtime's user errors, a model directory's (yaml, `--model-dir`), ours."""


def user_errors() -> AbstractContextManager[None]:
    """Bad input: one line on stderr and exit status 2."""
    return one_line_errors(*BENCH_USER_ERRORS)
