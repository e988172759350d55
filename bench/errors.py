"""The benchmark's one exception type for bad input."""

from __future__ import annotations


class BenchError(ValueError):
    """Bad benchmark input (an unknown length, an empty list, a missing option); one line, exit status 2."""
