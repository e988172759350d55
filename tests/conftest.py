from __future__ import annotations

import subprocess
import threading
from collections.abc import Generator, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cosyvoice_graphs.bundle_layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.frontend import PromptFeatures, extract_prompt, open_session

if TYPE_CHECKING:
    from cosyvoice_serve import Engine

# The runtime's tests run where only the base install is: the exporter, and torch with it, is an extra.
HAS_TORCH = find_spec("torch") is not None
NEEDS_TORCH = "needs torch (the export extra)"
EXPORTED = "tiny_bundle"
"""The fixture only the exporter makes: a test using it needs torch, marked or not (`runtime_bundle` falls
back to the demo bundle)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXPORTED in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.torch)
    if HAS_TORCH:
        return
    skip = pytest.mark.skip(reason=f"{NEEDS_TORCH}; torch is not installed")
    for item in items:
        if item.get_closest_marker("torch"):
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--failures-at-once", action="store_true",
                     help="print a failing test's report when it fails, not in the summary: for a process "
                          "that may not reach the summary (a CUDA error ending it; ci/gpu.sh)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    report = (yield).get_result()
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    if report.failed and terminal is not None and item.config.getoption("failures_at_once"):
        terminal.write_line(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random bundle (seed 0), written once per test session; tests must not modify it."""
    pytest.importorskip("torch", reason=f"{NEEDS_TORCH}: the tiny bundle is made by the exporter")
    from cosyvoice_export.bundle.tiny import write_bundle

    return write_bundle(tmp_path_factory.mktemp("bundles") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def runtime_bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime bundle of `tiny_bundle`: exported once per test session where torch is, else the embedded
    demo bundle, which is that export committed (test_demo_bundle checks it still is); tests must not modify
    it."""
    if not HAS_TORCH:
        return DEMO_BUNDLE
    from cosyvoice_export.onnx.bundle_assembly import export_all

    tiny_bundle: Path = request.getfixturevalue("tiny_bundle")
    report = export_all(tiny_bundle, tmp_path_factory.mktemp("runtime") / "tiny", progress=False)
    assert report.manifest is not None, report.table()
    return report.out


@pytest.fixture(scope="session")
def fp16_decode_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_bundle` exported with an fp16 `llm_decode` (CUDA's decode body) beside an int8 prefill body and
    the float32 rest; tests must not modify it."""
    from cosyvoice_export.onnx.bundle_assembly import export_all

    out = tmp_path_factory.mktemp("runtime") / "tiny-decode-fp16"
    report = export_all(tiny_bundle, out, precision="decode=fp16,prefill=int8", progress=False)
    assert report.manifest is not None, report.table()
    return report.out


@pytest.fixture(scope="session")
def fp32_decode_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_bundle` exported with a float32 `llm_decode` (the CPU's exact body, which batches decodings)
    beside the float32 rest; tests must not modify it."""
    from cosyvoice_export.onnx.bundle_assembly import export_all

    out = tmp_path_factory.mktemp("runtime") / "tiny-decode-fp32"
    report = export_all(tiny_bundle, out, precision="decode=fp32", progress=False)
    assert report.manifest is not None, report.table()
    return report.out


@pytest.fixture(scope="session")
def prompt_wav() -> Path:
    """`tiny_bundle`'s prompt recording as the demo bundle carries it, byte for byte (test_export_all and
    test_demo_bundle check so); tests must not modify it."""
    return DEMO_BUNDLE / PROMPT_WAV


@pytest.fixture(scope="session")
def prompt_text() -> str:
    """The transcript of `prompt_wav`."""
    return (DEMO_BUNDLE / PROMPT_TEXT).read_text(encoding="utf-8").strip()


@pytest.fixture(scope="session")
def prompt(runtime_bundle: Path, prompt_wav: Path) -> PromptFeatures:
    """`prompt_wav` through the runtime's front end with `runtime_bundle`'s models. A module comparing the
    runtime with the torch reference may override it with the reference's features, so both start alike."""
    bundle = RuntimeBundle.open(runtime_bundle)
    campplus, tokenizer = (open_session(bundle.frontend_path(n)) for n in ("campplus", "speech_tokenizer"))
    return extract_prompt(prompt_wav, campplus, tokenizer, bundle.dims.token_mel_ratio)


@pytest.fixture(scope="session")
def standin_paths() -> tuple[Path, Path]:
    """(campplus, speech tokenizer): `tiny_bundle`'s stand-in ONNX files as the demo bundle carries them, byte
    for byte; tests must not modify them."""
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    return bundle.frontend_path("campplus"), bundle.frontend_path("speech_tokenizer")


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The embedded demo bundle opened for serving, shared by the serve tests; tests must not close it."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from cosyvoice_serve import Engine

    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle")
    yield engine
    engine.close()


@pytest.fixture
def long_text_asked(monkeypatch: pytest.MonkeyPatch) -> tuple[str, threading.Event]:
    """A 2,000-character English text with digits, whose normalisation takes seconds, and an event set once a
    grammar process (`GrammarProcess`) is asked to normalise it."""
    from cosyvoice_runtime.frontend import grammar_process

    text = ("On Jan. 5, 2024 at 3:30 pm, 12 people paid $45.50 each for 3 kg of apples. " * 30)[:1999]
    asked = threading.Event()
    ask = grammar_process._ask

    def noting_the_text(child: subprocess.Popen[bytes], asked_text: str) -> dict[str, str]:
        if asked_text == text:
            asked.set()
        return ask(child, asked_text)

    monkeypatch.setattr(grammar_process, "_ask", noting_the_text)
    return text, asked


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
