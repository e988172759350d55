"""The runtime's typed errors; each message is one line that names what was wrong and where."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np


class RuntimeBundleError(ValueError):
    """A runtime bundle is missing, damaged or incompatible: names the file or key, what was expected
    and what was found."""


class ProviderError(RuntimeError):
    """A requested execution provider is unavailable here, or a session silently fell back to another."""


class FeedError(ValueError):
    """Feeds that do not match a graph's spec: names the graph, the tensor, what was expected and found."""


class UserError(ValueError):
    """Bad input from the user (empty text, a missing transcript or instruction, ...)."""


class FrontendError(ValueError):
    """Bad front-end input (unreadable or unusable audio, tokenizer files, text normaliser); names the
    offending file or setting."""


class SynthesisError(ValueError):
    """A request the bundle cannot synthesise (no speech tokens, longer than the noise tables)."""


class SpeakerError(ValueError):
    """A speaker registry that cannot be read, or a speaker name that cannot be used."""


def require_finite(values: np.ndarray, what: str) -> None:
    """Raise `RuntimeBundleError` where `values` (a graph's output, or what the runtime made of one) hold a
    NaN or an infinity: the bundle's doing, never the request's."""
    if not np.isfinite(values).all():
        raise RuntimeBundleError(f"{what} holds NaN or infinity: a graph or table of the bundle is damaged "
                                 "(checking its sha256s finds which) or its precision overflowed")


UNREACHABLE = "cannot be reached (permission denied on a folder on its way)"
"""What a path inside a folder this user cannot enter (another user's home, mode 700) is called."""


def home_folder(needed_for: str, instead: str) -> Path:
    """This user's home folder (`$HOME`, else the passwd database's); a `UserError` naming `needed_for` and
    `instead` (what sets another place) where there is none: a container run as a user id of no passwd
    entry, without `$HOME`."""
    try:
        return Path.home()
    except RuntimeError:  # Python's "Could not determine home directory."
        raise UserError(f"{needed_for}: no home folder (HOME is unset, and user {os.getuid()} has no entry "
                        f"in the passwd database); {instead}") from None


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be looked at: `UNREACHABLE`, a loop of symbolic links, a name too long; None
    where it can, or where it is simply not there (`Path.exists` says False to all of these alike)."""
    try:
        os.stat(path)
    except PermissionError:
        return UNREACHABLE
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a loop of symbolic links"
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            return e.strerror or str(e)
    return None

USER_ERRORS = (UserError, RuntimeBundleError, ProviderError, FrontendError, SynthesisError, SpeakerError)
"""Errors caused by the input or the environment: a command prints the message as one line and exits
with status 2, a server answers 4xx."""
