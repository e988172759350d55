from __future__ import annotations

from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from cosyvoice_serve import Engine

# The runtime's tests run where only the base install is: the exporter, and torch with it, is an extra.
HAS_TORCH = find_spec("torch") is not None
NEEDS_TORCH = "needs torch (the export extra)"
EXPORTED = {"tiny_bundle", "runtime_bundle"}
"""The fixtures the exporter makes: a test using one needs torch, marked or not."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXPORTED.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.torch)
    if HAS_TORCH:
        return
    skip = pytest.mark.skip(reason=f"{NEEDS_TORCH}; torch is not installed")
    for item in items:
        if item.get_closest_marker("torch"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bundle (seed 0), written once per test session; tests must not modify it."""
    pytest.importorskip("torch", reason=f"{NEEDS_TORCH}: the tiny bundle is made by the exporter")
    from cosyvoice_export.bundle.tiny import write_bundle

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
    if not HAS_TORCH:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
