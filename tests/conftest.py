from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_export.bundle.tiny import write_bundle


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bundle (seed 0), written once per test session; tests must not modify it."""
    return write_bundle(tmp_path_factory.mktemp("bundles") / "tiny", size="tiny", seed=0)
