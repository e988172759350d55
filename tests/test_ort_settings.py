"""Per-graph onnxruntime settings: the default table and a bundle's tuning file, as the runner's sessions
see them; the tuning file written by `cosyvoice-run --tune`, and refused when damaged or stale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cosyvoice_graphs import DIT, HIFT_DECODER, HIFT_F0, LLM, LLM_DECODE, OPTIONAL_SPECS, SPECS, dit_call_case
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.recipes import RECIPES
from cosyvoice_runtime import tuning
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import MODEL_DIR_ENV
from cosyvoice_runtime.cli import main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import RuntimeBundleError
from cosyvoice_runtime.process_memory import release_free_heap, rss_bytes
from cosyvoice_runtime.runners import OPTIMIZATION, OrtRunner, Runner, open_runner
from cosyvoice_runtime.runners.ort_settings import (
    ARENA_SHRINKAGE,
    FALLBACK,
    FORCE_SPINNING_STOP,
    TUNING_FILE,
    TUNING_FORMAT,
    TUNING_VERSION,
    default_settings,
    graph_files,
    keeps_spinning,
    machine,
    read_tuning,
    shrinks_arena,
)
from cosyvoice_runtime.synthesis import Synthesizer

LEVEL_NAMES = {level: name for name, level in OPTIMIZATION.items()}


@pytest.fixture
def copy(runtime_bundle: Path, tmp_path: Path) -> Path:
    """The tiny runtime bundle as links to its files, with a copied manifest, in a folder a test may write."""
    for path in runtime_bundle.rglob("*"):
        if path.is_file():
            (tmp_path / path.relative_to(runtime_bundle)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path.relative_to(runtime_bundle)).symlink_to(path)
    (tmp_path / MANIFEST).unlink()
    shutil.copy(runtime_bundle / MANIFEST, tmp_path / MANIFEST)
    return tmp_path


def session_settings(runner: Runner) -> tuple[str, int]:
    """The optimisation level and intra-op threads the runner's session was made with."""
    assert isinstance(runner, OrtRunner)
    options = runner.session.get_session_options()
    return LEVEL_NAMES[options.graph_optimization_level], options.intra_op_num_threads


def write_tuning(root: Path, graphs: dict[str, tuple[str, int]], **changes: Any) -> None:
    files = graph_files(root)
    data = {"format": TUNING_FORMAT, "version": TUNING_VERSION, "machine": machine(),
            "graphs": {g: {"optimization": level, "threads": n, "file": files[g]}
                       for g, (level, n) in graphs.items()}}
    (root / TUNING_FILE).write_text(json.dumps(data | changes))


def test_every_graph_has_a_measured_default(runtime_bundle: Path) -> None:
    bundle = RuntimeBundle.open(runtime_bundle)
    assert all(r.ort_optimization in OPTIMIZATION for r in RECIPES.values())
    assert default_settings("toy") == FALLBACK and not keeps_spinning("toy")  # a graph without a recipe
    for graph in bundle.specs:
        with open_runner(bundle, graph) as runner:
            assert session_settings(runner)[0] == default_settings(graph).optimization, graph
            # the sessions of a pipeline take turns on the cores: only the decode body, called back to back,
            # keeps its workers spinning after a call
            assert _config(runner, FORCE_SPINNING_STOP) == (None if keeps_spinning(graph) else "1"), graph
            # the graphs whose working memory follows the request's frames give it back after every call
            assert isinstance(runner, OrtRunner)
            shrink = runner.run_options.get_run_config_entry(ARENA_SHRINKAGE) if runner.run_options else None
            assert shrink == ("cpu:0" if shrinks_arena(graph) else None), graph
    assert {g for g in (*SPECS, *OPTIONAL_SPECS) if keeps_spinning(g)} == {LLM, LLM_DECODE}
    assert {g for g in (*SPECS, *OPTIONAL_SPECS) if shrinks_arena(g)} == {DIT, HIFT_F0, HIFT_DECODER}


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux)")
def test_a_long_dit_call_leaves_no_memory_resident(runtime_bundle: Path) -> None:
    """A 2,000-frame call of the tiny DiT takes ~300 MB of working memory (its attention scores alone are
    2 rows x 4 heads x 2,000^2 float32, 128 MB); the session's arena would keep all of it."""
    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc): freed heap pages stay resident anyway")
    bundle = RuntimeBundle.open(runtime_bundle)
    with open_runner(bundle, DIT) as runner:
        assert isinstance(runner, OrtRunner)
        runner.infer(runner.spec.sample_inputs(dit_call_case(50, 0, 0, 50), seed=0))
        release_free_heap()
        before = rss_bytes() or 0
        runner.infer(runner.spec.sample_inputs(dit_call_case(2000, 0, 0, 2000), seed=0))
        release_free_heap()
        assert (rss_bytes() or 0) - before < 100 * 2**20


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux)")
def test_the_flow_gives_back_what_a_dropped_calls_outputs_held(runtime_bundle: Path) -> None:
    """A call's outputs are numpy views of the arena's memory: the region they lie in stays resident while
    they are held, and still once they are dropped, until a call of the session ends; the 2,000-frame
    call's outputs keep 14 MiB so (AMD EPYC Zen 4, AVX-512), which the flow's smallest call gives back."""
    if not release_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc): freed heap pages stay resident anyway")
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as synth:
        estimator = synth.flow.estimator
        assert isinstance(estimator, OrtRunner) and estimator.shrinks_arena
        estimator.infer(estimator.spec.sample_inputs(dit_call_case(50, 0, 0, 50), seed=0))
        release_free_heap()
        before = rss_bytes() or 0
        held = estimator.infer(estimator.spec.sample_inputs(dit_call_case(2000, 0, 0, 2000), seed=0))
        del held
        release_free_heap()
        dropped = rss_bytes() or 0
        synth.flow.give_back_arena()
        release_free_heap()
        after = rss_bytes() or 0
    print(f"RSS above the 50-frame call's: outputs dropped {(dropped - before) / 2**20:.1f} MiB, "
          f"given back {(after - before) / 2**20:.1f} MiB")
    assert dropped - after > 8 * 2**20


def _config(runner: Runner, key: str) -> str | None:
    """A session config entry of `runner`'s session; None where it is not set."""
    assert isinstance(runner, OrtRunner)
    try:
        return str(runner.session.get_session_options().get_session_config_entry(key))
    except RuntimeError:
        return None


def test_tuning_file_is_applied_and_explicit_arguments_win(copy: Path) -> None:
    write_tuning(copy, {"hift_f0": ("basic", 1), "flow_encoder": ("disable", 2)})
    bundle = RuntimeBundle.open(copy)
    with open_runner(bundle, "hift_f0") as f0, open_runner(bundle, "flow_encoder") as encoder:
        assert session_settings(f0) == ("basic", 1)
        assert session_settings(encoder) == ("disable", 2)
    with open_runner(bundle, "hift_decoder") as decoder:  # not in the file: the table's
        assert session_settings(decoder)[0] == default_settings(HIFT_DECODER).optimization
    spec = bundle.specs["hift_f0"]
    with OrtRunner(bundle.graph_path("hift_f0"), spec, threads=2, optimization="extended") as given:
        assert session_settings(given) == ("extended", 2)


@pytest.mark.parametrize(("change", "match"), [
    ("damaged", "not a valid tuning file"),
    ("level", "not a valid tuning file .*'fastest'"),
    ("threads", r"not a valid tuning file \(hift_f0: threads 1000000 is more than the \d+ CPUs"),
    ("threads-bool", r"not a valid tuning file \(hift_f0: threads True is not a count of threads"),
    ("cpu", "measured on another machine .*cpu 'Other CPU'"),
    ("graph", r"measured on other graph files than the manifest's \(hift_f0\)"),
])
def test_bad_or_stale_tuning_file_is_refused_in_one_line(copy: Path, change: str, match: str) -> None:
    write_tuning(copy, {"hift_f0": ("basic", 1)})
    path = copy / TUNING_FILE
    data = json.loads(path.read_text())
    if change == "damaged":
        path.write_text(path.read_text()[:-5])
    elif change == "level":
        data["graphs"]["hift_f0"]["optimization"] = "fastest"
        path.write_text(json.dumps(data))
    elif change.startswith("threads"):  # a million threads would hang the run; --threads refuses both
        data["graphs"]["hift_f0"]["threads"] = True if change == "threads-bool" else 10**6
        path.write_text(json.dumps(data))
    elif change == "cpu":
        data["machine"]["cpu"] = "Other CPU"
        path.write_text(json.dumps(data))
    else:  # the graph re-exported since the tuning
        data["graphs"]["hift_f0"]["file"]["sha256"] = "0" * 64
        path.write_text(json.dumps(data))
    bundle = RuntimeBundle.open(copy)
    with pytest.raises(RuntimeBundleError, match=match) as info:
        open_runner(bundle, "hift_f0")
    assert "\n" not in str(info.value) and "--tune again, or delete it" in str(info.value)


def test_cli_tune_writes_a_file_the_runner_uses(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "usable_cpus", lambda: 1)  # one thread count: a shorter test
    result = CliRunner().invoke(main, ["--model", str(copy), "--tune", "--no-verify"])
    assert result.exit_code == 0, result.output
    tuned = read_tuning(copy)
    bundle = RuntimeBundle.open(copy)
    assert set(tuned) == set(bundle.specs)
    data = json.loads((copy / TUNING_FILE).read_text())
    for graph, setting in tuned.items():
        assert setting.threads == 1 and setting.optimization in OPTIMIZATION
        assert set(data["graphs"][graph]["ratio_to_default"]) == {f"{level}/1" for level in OPTIMIZATION}
        assert data["graphs"][graph]["ratio_to_default"][f"{default_settings(graph).optimization}/1"] == 1.0
        assert f"{graph}: {setting.optimization}, 1 thread(s)" in result.stdout
        with open_runner(bundle, graph) as runner:
            assert session_settings(runner) == (setting.optimization, 1)


def test_thread_counts() -> None:
    assert tuning.thread_counts(1) == (1,)
    assert tuning.thread_counts(2) == (1, 2)
    assert tuning.thread_counts(12) == (1, 2, 4, 8, 12)



def test_cli_tune_refuses_the_embedded_demo_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    result = CliRunner().invoke(main, ["--tune"])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: --tune needs --model or ${MODEL_DIR_ENV}; the embedded demo "
                                     "bundle is not tuned")
    assert not (DEMO_BUNDLE / TUNING_FILE).exists()
