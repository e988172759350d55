"""Several streams' CFG pairs in one `flow_estimator_cached` call (its `batch`), and `python -m
cosyvoice_bench.dit_stacking`, which times that against the streams' calls one after another. On the CPU in
float32 at 2 threads each stream's rows of a stacked call are its call alone to the bit; on CUDA (where
present) within float32's rounding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from cosyvoice_bench.dit_stacking import main, measure, stream_feeds
from cosyvoice_graphs import DIT, cache_pairs
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.dit_stack import stacked_feeds
from cosyvoice_runtime.runners import open_runner

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_stacked_feeds_put_each_streams_pair_in_its_two_rows() -> None:
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    spec = bundle.specs[DIT]
    feeds = stream_feeds(spec, 9, 14, bundle.dims.dit_block_frames, 3)
    together = stacked_feeds(spec, feeds)
    assert together["x"].shape == (6, bundle.dims.mel_bins, 9)
    past_key = cache_pairs(spec)[-1][0]
    assert together[past_key].shape[0] == 6 and together[past_key].shape[2] == 14
    for s in range(3):
        np.testing.assert_array_equal(together["cond"][2 * s:2 * s + 2], feeds[s]["cond"])
        np.testing.assert_array_equal(together[past_key][2 * s:2 * s + 2], feeds[s][past_key])
    assert not np.array_equal(feeds[0]["x"], feeds[1]["x"])  # a draw per stream
    for name in ("ode_step", "positions", "attention_mask"):
        assert all(np.array_equal(f[name], feeds[0][name]) for f in feeds)
        np.testing.assert_array_equal(together[name], feeds[0][name])


@pytest.mark.parametrize("provider", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs onnxruntime's CUDA provider (onnxruntime-gpu and an NVIDIA GPU)"))])
@pytest.mark.parametrize(("new", "past"), [(30, 0), (17, 45)])
def test_a_streams_rows_of_a_stacked_call_are_its_call_alone(provider: str, new: int, past: int) -> None:
    """Every output (velocity, keys, values, conv caches) of each stream's rows against its own call: the
    same float32 to the bit on the CPU at 2 threads, within float32 rounding on CUDA (another batch, other
    kernels). 16 threads of the H200 machine's CPU gave 4.8e-7: onnxruntime splits a matmul's work by its
    rows."""
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    runner = open_runner(bundle, DIT, provider, threads=2 if provider == "cpu" else None)
    try:
        result = measure(runner, bundle.dims.dit_block_frames, 4, new, past, rounds=2)
    finally:
        runner.close()
    assert (result["streams"], result["new_frames"], result["past_frames"]) == (4, new, past)
    assert result["separate_ms"] > 0 and result["stacked_ms"] > 0
    assert result["speedup"] == pytest.approx(result["separate_ms"] / result["stacked_ms"])
    if provider == "cpu":
        assert result["max_abs_diff"] == 0
    else:
        assert result["max_abs_diff"] < 1e-4


def test_the_command_prints_and_writes_each_count_and_shape(tmp_path: Path) -> None:
    out = tmp_path / "stacking.json"
    done = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE), "--streams", "1,3", "--shapes", "12:0,8:20",
                                     "--rounds", "2", "--threads", "2", "--json", str(out)])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0].startswith(f"{DIT} (fp32) on cpu, onnxruntime {ort.__version__}")
    assert len(lines) == 5 and "  3 streams,    8 new frames after   20:" in lines[4]
    written = json.loads(out.read_text())
    assert written["precision"] == "fp32" and written["provider"] == "cpu"
    assert [(r["new_frames"], r["past_frames"], r["streams"]) for r in written["runs"]] == [
        (12, 0, 1), (12, 0, 3), (8, 20, 1), (8, 20, 3)]
    assert all(r["max_abs_diff"] == 0 for r in written["runs"])


@pytest.mark.parametrize(("args", "message"), [
    (["--streams", "0"], "'0': comma-separated stream counts from 1 to 16"),
    (["--streams", "2,x"], "'2,x': comma-separated stream counts"),
    (["--shapes", "0:10"], "'0:10': NEW:PAST, new frames (at least 1)"),
    (["--shapes", "12"], "'12': NEW:PAST"),
])
def test_bad_counts_and_shapes_are_refused_before_any_session(args: list[str], message: str) -> None:
    done = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE), *args])
    assert done.exit_code == 2 and f"Invalid value for {args[0]}: {message}" in done.output


def test_a_directory_that_is_no_bundle_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = CliRunner().invoke(main, ["--model", str(tmp_path)])
    assert done.exit_code == 2
    assert done.output.startswith("error: ") and str(tmp_path) in done.output
    assert len(done.output.strip().splitlines()) == 1
