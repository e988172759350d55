"""The golden tool's one error type."""

from __future__ import annotations


class GoldenError(ValueError):
    """Bad input to `cosyvoice-golden` (unknown case, missing or damaged golden file, a golden recorded
    from another model): one line naming the file or case, what was expected and what was found."""
