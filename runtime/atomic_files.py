"""Outputs written so that a reader never sees a partial file: a temporary name, then a rename."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`, renamed onto it if the block succeeds and removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_wav_atomic(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """Write mono 16-bit PCM WAV to `path` through a temporary file, so no partial file is left."""
    with atomic_path(path) as tmp:
        sf.write(tmp, audio, sample_rate, subtype="PCM_16", format="WAV")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as indented JSON to `path` through a temporary file."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))
