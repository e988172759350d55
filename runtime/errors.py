"""The runtime's typed errors; each message is one line that names what was wrong and where."""

from __future__ import annotations


class RuntimeBundleError(ValueError):
    """A runtime bundle is missing, damaged or incompatible: names the file or key, what was expected
    and what was found."""


class ProviderError(RuntimeError):
    """A requested execution provider is unavailable here, or a session silently fell back to another."""


class FeedError(ValueError):
    """Feeds that do not match a graph's spec: names the graph, the tensor, what was expected and found."""


class UserError(ValueError):
    """Bad input from the user (empty text, a missing transcript or instruction, ...)."""
