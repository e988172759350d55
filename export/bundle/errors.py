"""The one exception type for problems with a model bundle the user handed us."""

from __future__ import annotations


class BundleError(ValueError):
    """A bundle file is missing, unreadable or says something we cannot use.

    The message is one line and names the file and, where there is one, the key inside it, so that a
    CLI can print it as is.
    """
