"""The front end's one error type."""

from __future__ import annotations


class FrontendError(ValueError):
    """Bad front-end input (unreadable or unusable audio, tokenizer files, text normaliser).

    The message is one line and names the offending file or setting, so a CLI can print it as is.
    """
