"""The DiT's calls through bindings of their own per shape (`GraphedDit`), which onnxruntime's CUDA provider
captures into CUDA graphs and replays: on the CPU the same bindings run as ordinary calls and must give what a
call alone gives, to the bit where no bucket pads the cache (`past_bucket=1`), whatever shapes and streams
come and go, and within float32's rounding in a bucket; on CUDA the replays against launched calls. Which
bundles replay their DiT (`dit_replays`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from test_dit_stack import _chunks, _feeds
from test_runtime_core import clone

from cosyvoice_export.cli import main as export_main
from cosyvoice_graphs import DIT, cache_pairs
from cosyvoice_runtime import synthesis
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.dit_graphs import BIND_AFTER, PAST_BUCKET, GraphedDit, Shape
from cosyvoice_runtime.dit_stack import Presents, call_alone
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import CUDA, Feed, OrtRunner, open_runner, to_host
from cosyvoice_runtime.synthesis import Synthesizer, dit_replays

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
NEEDS_CUDA = "needs onnxruntime's CUDA provider (onnxruntime-gpu and an NVIDIA GPU)"
NEEDS_ONNX = "needs the onnx package (in the gpu and export extras), which builds the device copies' graph"


@pytest.fixture(scope="module")
def estimator(runtime_bundle: Path) -> Iterator[Any]:
    with open_runner(RuntimeBundle.open(runtime_bundle), DIT, threads=1) as runner:
        yield runner


@pytest.fixture(scope="module")
def block(runtime_bundle: Path) -> int:
    return RuntimeBundle.open(runtime_bundle).dims.dit_block_frames


def _host(result: tuple[np.ndarray, dict[str, Feed]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return result[0], {name: to_host(value) for name, value in result[1].items()}


def _equal(a: tuple[np.ndarray, dict[str, Feed]], b: tuple[np.ndarray, dict[str, Feed]]) -> bool:
    (va, ca), (vb, cb) = _host(a), _host(b)
    return np.array_equal(va, vb) and ca.keys() == cb.keys() and all(np.array_equal(ca[k], cb[k]) for k in ca)


@pytest.mark.parametrize("presents", list(Presents))
def test_calls_of_several_shapes_give_what_calls_alone_give(estimator: OrtRunner, block: int,
                                                            presents: Presents) -> None:
    """Calls of three shapes, each shape twice with other inputs (a binding's memory written anew, nothing of
    the call before left in it), a stream's two rows and two streams' four: every call's velocity and caches
    are its call alone's to the bit, the caches as `presents` asks (host arrays, device values, none)."""
    if presents == Presents.DEVICE:
        pytest.importorskip("onnx", reason=NEEDS_ONNX)
    graphed = GraphedDit(estimator, bind_after=0, past_bucket=1)
    seeds = iter(range(100))
    for new, past, streams in [(30, 0, 1), (12, 50, 1), (30, 0, 1), (12, 50, 2), (12, 50, 1), (7, 50, 1)]:
        feeds = _feeds(estimator, new, past, next(seeds), block)
        if streams == 2:
            rows = {"x", "mu", "spks", "cond", *(past for past, _ in cache_pairs(estimator.spec))}
            feeds = {k: np.concatenate([v, v[::-1]]) if k in rows else v for k, v in feeds.items()}
        got = graphed(feeds, presents=presents)
        assert _equal(got, call_alone(estimator, feeds, presents=presents)), (new, past, streams)
        if presents == Presents.DEVICE:
            assert all(isinstance(v, ort.OrtValue) for v in got[1].values())
    assert graphed.graphs == 4


def test_device_caches_are_copied_in_and_out(estimator: OrtRunner, block: int) -> None:
    """A call's caches given as device values (the previous call's, kept) are copied into the binding, and the
    caches it gives back are tensors of their own, not the binding's memory, which the next call of that
    shape overwrites: a chain of calls keeps every step's caches intact."""
    pytest.importorskip("onnx", reason=NEEDS_ONNX)
    graphed = GraphedDit(estimator, bind_after=0, past_bucket=1)
    first = _feeds(estimator, 10, 40, 1, block)
    kept = graphed(first, presents=Presents.DEVICE)[1]
    before = {k: to_host(v).copy() for k, v in kept.items()}
    graphed(_feeds(estimator, 10, 40, 2, block), presents=Presents.DEVICE)  # the same shape, other inputs
    assert all(np.array_equal(to_host(kept[k]), before[k]) for k in kept)
    second = {**_feeds(estimator, 10, 50, 3, block), **kept}
    want = call_alone(estimator, second, presents=Presents.HOST)
    assert _equal(graphed(second, presents=Presents.HOST), want)


def _close(a: tuple[np.ndarray, dict[str, Feed]], b: tuple[np.ndarray, dict[str, Feed]]) -> bool:
    """The same velocity and caches, shapes and values within float32's rounding (2e-6 of each's scale)."""
    (va, ca), (vb, cb) = _host(a), _host(b)
    pairs = [(va, vb), *((ca[k], cb[k]) for k in cb)]
    return ca.keys() == cb.keys() and all(
        x.shape == y.shape and float(np.abs(x - y).max()) <= 2e-6 * max(1.0, float(np.abs(y).max()))
        for x, y in pairs)


@pytest.mark.parametrize("presents", [Presents.HOST, Presents.DEVICE])
def test_calls_over_caches_of_one_bucket_share_its_binding(estimator: OrtRunner, block: int,
                                                           presents: Presents) -> None:
    """Calls whose cached frames round up to one bucket run in one binding, their caches after zero frames its
    attention mask hides: each gives its call alone's velocity and caches (of its own frames) within float32's
    rounding, to the bit where the cache fills the bucket; a chain whose caches stay on the device too."""
    if presents == Presents.DEVICE:
        pytest.importorskip("onnx", reason=NEEDS_ONNX)
    graphed = GraphedDit(estimator, bind_after=0, past_bucket=64)
    kept: dict[str, Feed] = {}
    for seed, past in enumerate((40, 52, 64, 50)):
        feeds: dict[str, Feed] = {**_feeds(estimator, 12, past, seed, block), **(kept if past == 52 else {})}
        want = call_alone(estimator, {k: to_host(v) for k, v in feeds.items()}, presents=Presents.HOST)
        got = graphed(feeds, presents=presents)
        assert (_equal if past == 64 else _close)(got, want), past
        if past == 40:  # the next call's caches: these 52 frames, where `presents` keeps them
            kept = got[1]
    assert set(graphed._graphs) == {Shape(2, 12, 64)}
    assert (graphed.bucket(0), graphed.bucket(1), graphed.bucket(64), graphed.bucket(65)) == (0, 64, 64, 128)
    top = estimator.spec.dims["past_frames"].max
    assert graphed.bucket(top - 1) == top and graphed.bucket(top + 1) == top + 1  # within the spec's range


def test_the_least_recent_shapes_are_let_go(estimator: OrtRunner, block: int) -> None:
    """At most `max_graphs` bindings are kept, the least recently called shape's let go first."""
    graphed = GraphedDit(estimator, max_graphs=2, bind_after=0)
    for new in (5, 6, 5, 7):
        graphed(_feeds(estimator, new, 0, new, block), presents=Presents.NONE)
    assert set(graphed._graphs) == {Shape(2, 5, 0), Shape(2, 7, 0)} and graphed.graphs == 2
    graphed.release()
    assert graphed.graphs == 0


def test_a_busy_shape_gets_another_binding_once_its_calls_have_waited(estimator: OrtRunner, block: int
                                                                      ) -> None:
    """A call whose shape's bindings are all busy (held by other streams' calls, on other threads) runs as an
    ordinary call, with the same result; once `bind_after` calls have found them so, the shape gets one more
    binding, and past `max_graphs` its calls run alone."""
    graphed = GraphedDit(estimator, max_graphs=2, bind_after=2)
    feeds = _feeds(estimator, 5, 0, 9, block)
    want = call_alone(estimator, feeds, presents=Presents.HOST)
    for _ in range(3):  # two launched, then bound
        assert _equal(graphed(feeds, presents=Presents.HOST), want)
    [first] = graphed._graphs[Shape(2, 5, 0)]
    with first.busy:  # held as a call on another thread holds it
        for _ in range(2):
            assert _equal(graphed(feeds, presents=Presents.HOST), want)
        assert graphed.graphs == 1 and first.runs == 1  # launched
        assert _equal(graphed(feeds, presents=Presents.HOST), want)
        [_, second] = graphed._graphs[Shape(2, 5, 0)]
        assert second.runs == 1
        with second.busy:
            for _ in range(3):
                assert _equal(graphed(feeds, presents=Presents.HOST), want)
            assert graphed.graphs == 2 and (first.runs, second.runs) == (1, 1)  # no room: launched
    assert _equal(graphed(feeds, presents=Presents.HOST), want)
    assert first.runs == 2  # the first free binding


def test_the_bindings_keep_within_their_memory(estimator: OrtRunner, block: int) -> None:
    """The bindings' memory stays within `max_bytes`: a shape that needs more alone is launched, never bound;
    one that does not fit beside the others lets the least recent go."""
    small, large = _feeds(estimator, 5, 0, 1, block), _feeds(estimator, 40, 0, 2, block)
    graphed = GraphedDit(estimator, bind_after=0, max_bytes=1)
    want = call_alone(estimator, small, presents=Presents.NONE)
    assert _equal(graphed(small, presents=Presents.NONE), want)
    assert graphed.graphs == 0 and graphed.bound_bytes == 0
    graphed = GraphedDit(estimator, bind_after=0)
    graphed(small, presents=Presents.NONE)
    one = graphed.bound_bytes
    graphed(large, presents=Presents.NONE)
    both = graphed.bound_bytes
    assert 0 < one < both - one
    graphed = GraphedDit(estimator, bind_after=0, max_bytes=both - 1)  # room for the large one alone
    graphed(small, presents=Presents.NONE)
    graphed(large, presents=Presents.NONE)
    assert set(graphed._graphs) == {Shape(2, 40, 0)} and graphed.bound_bytes == both - one


def test_a_shape_is_bound_once_it_comes_again(estimator: OrtRunner, block: int) -> None:
    """A chunk's worth of calls of a shape (`BIND_AFTER`, its ten ODE steps) run launched; the shape's next
    call binds it: a length that comes once holds no memory and costs no capture."""
    graphed = GraphedDit(estimator)
    feeds = _feeds(estimator, 9, 0, 1, block)
    want = call_alone(estimator, feeds, presents=Presents.HOST)
    for _ in range(BIND_AFTER):
        assert _equal(graphed(feeds, presents=Presents.HOST), want)
    assert graphed.graphs == 0
    assert _equal(graphed(feeds, presents=Presents.HOST), want)
    assert graphed.graphs == 1 and graphed._graphs[Shape(2, 9, 0)][0].runs == 1


@pytest.mark.parametrize(("kept", "bucket"), [(False, 1), (True, 1), (True, PAST_BUCKET)],
                         ids=["host", "device", "device-bucketed"])
def test_a_stream_through_the_bindings_gives_its_mel_alone(runtime_bundle: Path, prompt: PromptFeatures,
                                                           kept: bool, bucket: int) -> None:
    """Streams of upstream's schedule, two of them at once on two threads, their flow's DiT calls through
    one `GraphedDit` (the prompt's prefix, the chunks, the final re-run), against the same streams through
    plain calls: the same mel, chunk by chunk, to the bit, with the caches kept as device values (forced on
    the CPU provider) and on the host; within float32's rounding where buckets pad the caches."""
    if kept:
        pytest.importorskip("onnx", reason=NEEDS_ONNX)
    bundle = RuntimeBundle.open(runtime_bundle)
    chunks = [_chunks(prompt, 200, seed) for seed in (1, 2)]
    with Synthesizer(bundle, threads=1) as plain, Synthesizer(bundle, threads=1) as graphed:
        assert graphed.dit_graphs is None  # the CPU replays nothing
        plain.flow.keep_on_device = graphed.flow.keep_on_device = kept
        graphed.flow.call = calls = GraphedDit(graphed.flow.estimator, past_bucket=bucket)
        want = [[s.push(t, finalize=f) for t, f in c] for s, c in zip(
            [plain.flow.stream(prompt) for _ in chunks], chunks, strict=True)]
        got: list[list[np.ndarray]] = [[], []]

        def run(i: int) -> None:
            stream = graphed.flow.stream(prompt)
            got[i] = [stream.push(t, finalize=f) for t, f in chunks[i]]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert calls.graphs >= 2  # the chunks' shapes, which both streams make (the prefix's computes once)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and all(a.shape == b.shape for a, b in zip(g, w, strict=True))
        worst = max(float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max()))
                    for a, b in zip(g, w, strict=True))
        assert worst == 0 if bucket == 1 else worst <= 1e-5, worst


def test_which_bundles_replay_their_dit(runtime_bundle: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    """The DiT written for onnxruntime in floating point (tf32's; fp16's without TensorRT plans) replays;
    fp32's standard operators and int8's quantization read shapes and do not."""
    assert not dit_replays(RuntimeBundle.open(runtime_bundle))
    out = tmp_path / "tf32"
    result = CliRunner().invoke(export_main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                              "--precision", "dit=tf32"])
    assert result.exit_code == 0, result.output
    assert dit_replays(RuntimeBundle.open(out))
    int8 = clone(out, tmp_path / "int8", lambda m: m["graphs"][DIT].__setitem__("precision", "int8"))
    assert not dit_replays(RuntimeBundle.open(int8))


def test_a_dit_refused_cuda_graphs_opens_without_them_and_says_why(
        runtime_bundle: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """onnxruntime refuses a session CUDA graphs where it places a node off the GPU: the DiT then opens
    without them (its calls launched) and the log says why; any other error of the session stays an error."""
    bundle = RuntimeBundle.open(runtime_bundle)
    refusal = ("[ONNXRuntimeError] : 1 : FAIL : This session cannot use the graph capture feature as "
               "requested by the user as all compute graph nodes have not been partitioned to the "
               "CUDAExecutionProvider")

    def opening(error: str) -> Any:
        def open_(bundle: RuntimeBundle, graph: str, provider: str = "cpu", *, threads: int | None = None,
                  cuda_graph: bool = False) -> Any:
            if cuda_graph:
                raise RuntimeError(error)
            return open_runner(bundle, graph, provider, threads=threads)
        return open_

    monkeypatch.setattr(synthesis, "open_runner", opening(refusal))
    with caplog.at_level("WARNING"), synthesis.open_replayed_dit(bundle, "cpu", 1) as runner:
        assert isinstance(runner, OrtRunner) and not runner.cuda_graph
    assert "the DiT's calls launch node by node: onnxruntime refused its CUDA graphs" in caplog.text
    assert "cannot use the graph capture feature" in caplog.text
    monkeypatch.setattr(synthesis, "open_runner", opening("out of memory"))
    with pytest.raises(RuntimeError, match="^out of memory$"):
        synthesis.open_replayed_dit(bundle, "cpu", 1)


@pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_CUDA)
def test_on_cuda_replayed_calls_equal_launched_ones(tiny_bundle: Path, tmp_path: Path) -> None:
    """On CUDA, a tf32 bundle's DiT calls captured and replayed (a session with CUDA graphs) against the same
    calls launched node by node: the ten calls of a shape with nothing cached (two regular runs, the capture,
    seven replays), then ten of a later chunk whose caches are the first calls' kept on the device (copied
    in there), each within float32's rounding of its launched call, its caches given back on the device."""
    pytest.importorskip("onnx", reason=NEEDS_ONNX)
    out = tmp_path / "tf32"
    result = CliRunner().invoke(export_main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                              "--precision", "dit=tf32"])
    assert result.exit_code == 0, result.output
    bundle = RuntimeBundle.open(out)
    block = bundle.dims.dit_block_frames
    with open_runner(bundle, DIT, CUDA, cuda_graph=True) as captured, open_runner(bundle, DIT, CUDA) as plain:
        assert isinstance(captured, OrtRunner) and captured.cuda_graph
        graphed = GraphedDit(captured, bind_after=0)
        pairs = cache_pairs(plain.spec)
        kept: dict[str, Feed] = {}
        for step in range(20):
            new, past = (50, 0) if step < 10 else (12, 50)
            feeds: dict[str, Feed] = {**_feeds(plain, new, past, step, block), **(kept if past else {})}
            result = graphed(feeds, presents=Presents.DEVICE)
            assert all(isinstance(v, ort.OrtValue) for v in result[1].values())
            got = _host(result)
            want = _host(call_alone(plain, {k: to_host(v) for k, v in feeds.items()}, presents=Presents.HOST))
            for a, b in [(got[0], want[0]), *((got[1][p], want[1][p]) for p, _ in pairs)]:
                assert float(np.abs(a - b).max()) <= 1e-4 * max(1.0, float(np.abs(b).max())), step
            if step == 0:
                kept = result[1]  # caches of 50 frames, on the GPU
        assert graphed.graphs == 2
        graphed.release()
