from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from cosyvoice_export.bundle.tiny import write_bundle

if TYPE_CHECKING:
    from cosyvoice_serve import Engine


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bundle (seed 0), written once per test session; tests must not modify it."""
    return write_bundle(tmp_path_factory.mktemp("bundles") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def runtime_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime bundle exported from `tiny_bundle`, once per test session; tests must not modify it."""
    from cosyvoice_export.onnx.runtime_bundle import export_all

    report = export_all(tiny_bundle, tmp_path_factory.mktemp("runtime") / "tiny", progress=False)
    assert report.manifest is not None, report.table()
    return report.out


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The embedded demo bundle opened for serving, shared by the serve tests; tests must not close it."""
    from cosyvoice_runtime.bundle import RuntimeBundle
    from cosyvoice_runtime.demo import DEMO_BUNDLE
    from cosyvoice_serve import Engine

    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle")
    yield engine
    engine.close()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Test networks are tiny: extra OpenMP threads only add waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
