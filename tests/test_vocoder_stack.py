"""Concurrent streams' vocoder windows gathered into one `hift_decoder` call (`Vocoder.stack_calls`): each
stream gets its f0 and phase alone to the bit, and its samples within `STACKED_WAVEFORM_MAX` of them on the
CPU provider at one thread; a call waits for the chunks whose next call has its key and for none other
(`CallStack`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from test_dit_stack import HAS_CUDA, LONG_WAIT_S, NEEDS_CUDA, _threads, _tokens

from cosyvoice_bench.vocoder_stacking import main, measure
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.call_stack import CallStack
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import CUDA
from cosyvoice_runtime.synthesis import Synthesizer
from cosyvoice_runtime.token2wav import VocoderJob, VocoderKey

STACKED_WAVEFORM_MAX = 1e-6
"""A stream's samples stacked against alone: onnxruntime's CPU `Sin` computes a tensor's elements in vector
packets and the last ones (past the last whole packet) in scalar code, which round the last bit apart; a row's
elements fall elsewhere among the packets in a stacked call (measured up to 4.0e-7 on a Zen 4 with AVX-512,
the demo bundle's waveform, frame counts 20 to 398); a row given another stream's frames would be off by
~1e-1."""


def _echo(key: str, jobs: list[int]) -> list[tuple[str, int, int]]:
    """A stacked call that tells each job its key and how many shared its call."""
    return [(key, len(jobs), job) for job in jobs]


def test_a_call_waits_for_the_chunks_announced_with_its_key_only() -> None:
    """A chunk that announced the same key joins the call however late it comes; one that announced another
    key, or that is held at its pause, is not waited for (the linger is a minute: waiting for either would
    fail the test's time)."""
    stack: CallStack[str, int, tuple[str, int, int]] = CallStack(_echo, linger_s=LONG_WAIT_S)
    released = threading.Event()
    with stack.member("a") as first, stack.member("a") as late, stack.member("b") as other, \
            stack.member("a") as held:
        start = time.perf_counter()

        def late_call() -> tuple[str, int, int]:
            time.sleep(0.2)
            return stack.call(late, "a", 2, pause=lambda: None)

        def held_call() -> tuple[str, int, int]:
            return stack.call(held, "a", 4, pause=released.wait)

        def first_call() -> tuple[str, int, int]:
            try:
                return stack.call(first, "a", 1, pause=lambda: None)
            finally:
                released.set()

        got = _threads([first_call, late_call, lambda: stack.call(other, "b", 3, pause=lambda: None),
                        held_call])
    assert time.perf_counter() - start < LONG_WAIT_S / 2
    assert got[:3] == [("a", 2, 1), ("a", 2, 2), ("b", 1, 3)] and got[3] == ("a", 1, 4)
    assert (stack.calls, stack.streams, stack.stacked) == (3, 4, 1)


def test_a_stacked_call_gives_each_stream_its_call_alone(runtime_bundle: Path) -> None:
    """Three streams' windows of one key (f0 context, a first frame past the utterance's start, phases
    carried from earlier frames) as one call against each alone: the same phase sums to the bit (f0 is a
    call per stream), the samples within `STACKED_WAVEFORM_MAX`."""
    bundle = RuntimeBundle.open(runtime_bundle)
    rng = np.random.default_rng(0)
    key = VocoderKey(frames=47, skip=5, first_frame=30)
    jobs = [VocoderJob(rng.uniform(-8, 1, (1, bundle.dims.mel_bins, key.frames)).astype(np.float32),
                       rng.uniform(0, 1e3, bundle.dims.harmonics)) for _ in range(3)]
    with Synthesizer(bundle, threads=1) as synth:
        alone = [synth.vocoder.run(key, [job])[0] for job in jobs]
        stacked = synth.vocoder.run(key, jobs)
    for a, b in zip(stacked, alone, strict=True):
        assert a.waveform.shape == ((key.frames - key.skip) * bundle.dims.samples_per_frame,)
        assert np.array_equal(a.acc, b.acc)
        assert float(np.abs(a.waveform - b.waveform).max()) <= STACKED_WAVEFORM_MAX


@pytest.mark.parametrize("vocoder", ["window", "rerun"])
def test_streams_stacked_give_their_samples_alone(runtime_bundle: Path, prompt: PromptFeatures, vocoder: str
                                                  ) -> None:
    """Three streams of as many tokens started together through a stacking synthesizer, against each
    alone: every chunk's samples within `STACKED_WAVEFORM_MAX`, and their vocoder calls stacked (the linger
    a minute: a wrongly announced key would show in the test's time)."""
    bundle = RuntimeBundle.open(runtime_bundle)
    policy = ChunkPolicy(vocoder=vocoder)  # type: ignore[arg-type]
    tokens = [_tokens(160, seed) for seed in (3, 4, 5)]
    with Synthesizer(bundle, threads=1) as alone, Synthesizer(bundle, threads=1, stack_vocoder=True) as synth:
        want = [[c.samples for c in alone.stream_tokens(t, prompt, policy=policy)] for t in tokens]
        stack = synth.vocoder.stack
        assert stack is not None
        synth.vocoder.stack = stack = CallStack(stack.run_group, linger_s=LONG_WAIT_S)
        synth.flow.prefix(prompt)
        start = time.perf_counter()
        got = _threads([lambda t=t: [c.samples for c in synth.stream_tokens(t, prompt, policy=policy)]
                        for t in tokens])
    assert time.perf_counter() - start < LONG_WAIT_S / 2
    chunks = len(want[0])
    assert chunks >= 3 and stack.streams == 3 * chunks and stack.calls < stack.streams
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for a, b in zip(g, w, strict=True):
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= STACKED_WAVEFORM_MAX


@pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_CUDA)
def test_on_cuda_stacked_windows_follow_their_calls_alone(runtime_bundle: Path) -> None:
    """On CUDA a stacked call's kernels may differ from a call alone's (another batch): each stream's phase
    sums and samples within float32's rounding of its windows alone; a row given another stream's frames
    would be off by ~1e-1."""
    bundle = RuntimeBundle.open(runtime_bundle)
    with Synthesizer(bundle, CUDA) as synth:
        result = measure(synth.vocoder, 4, 50, 100, rounds=2)
    assert result["waveform_max_abs_diff"] < 1e-3 and result["phase_sum_max_abs_diff"] < 1e-3


def test_the_benchmark_prints_and_writes_each_count_and_window(tmp_path: Path) -> None:
    out = tmp_path / "stacking.json"
    done = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE), "--streams", "1,3", "--windows",
                                     "30:0,20:40", "--rounds", "2", "--threads", "1", "--json", str(out)])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0].startswith("vocoder (hift_f0 fp32, hift_decoder fp32) on cpu, onnxruntime "
                               f"{ort.__version__}")
    assert len(lines) == 5 and "  3 streams,   20 new frames after   40 (" in lines[4]
    written = json.loads(out.read_text())
    assert written["provider"] == "cpu"
    assert [(r["new_frames"], r["frames_before"], r["streams"]) for r in written["runs"]] == [
        (30, 0, 1), (30, 0, 3), (20, 40, 1), (20, 40, 3)]
    for r in written["runs"]:
        assert r["separate_ms"] > 0 and r["stacked_ms"] > 0 and r["phase_sum_max_abs_diff"] == 0
        assert r["waveform_max_abs_diff"] <= STACKED_WAVEFORM_MAX


@pytest.mark.parametrize(("args", "message"), [
    (["--streams", "17"], "'17': comma-separated stream counts from 1 to 16"),
    (["--windows", "0:10"], "'0:10': NEW:BEFORE, new frames (at least 1)"),
    (["--windows", "50:5"], "error: --windows 50:5: the frames pushed before a window are 0 or more than the "
                            "vocoder's look-ahead (8)"),
])
def test_bad_counts_and_windows_are_refused_before_any_call(args: list[str], message: str) -> None:
    done = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE), *args])
    assert done.exit_code == 2 and message in done.output
