"""The exporters' one exception type for a graph that is not what its spec says."""

from __future__ import annotations


class ExportError(RuntimeError):
    """An exported graph is not what its spec says, or failed its checks; the message is one line."""
