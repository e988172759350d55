"""Sessions of one graph by input shape (`cosyvoice_runtime.runners.ShapePool`): which session a call runs
on, that a session running a call keeps its shapes, that the outputs are a single session's to the bit,
and that `open_runner` pools the vocoder's graphs on CUDA only."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort
import pytest

import cosyvoice_runtime.runners as runners
from cosyvoice_graphs import HIFT_DECODER, HIFT_F0, LLM, GraphSpec, vocoder_case
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import CPU, CUDA, Feed, OrtRunner, ShapePool, feed_shape, open_runner
from cosyvoice_runtime.runners.ort_settings import SHAPE_SESSIONS, shape_sessions
from cosyvoice_runtime.synthesis import Synthesizer


@pytest.fixture(scope="module")
def bundle() -> RuntimeBundle:
    return RuntimeBundle.open(DEMO_BUNDLE)


class Recording:
    """A runner of `spec` that records the frame counts it ran and may hold a call until released."""

    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self.frames: list[int] = []
        self.hold: threading.Event | None = None
        self.started = threading.Event()

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        self.frames.append(feed_shape(feeds["mel"])[2])
        self.started.set()
        if self.hold is not None:
            self.hold.wait(timeout=10)
        return {name: np.zeros(1, dtype=np.float32) for name in names}

    def close(self) -> None:
        pass


def feeds_of(spec: GraphSpec, frames: int) -> dict[str, np.ndarray]:
    return spec.sample_inputs(vocoder_case(frames))


def test_a_call_runs_where_its_shapes_ran_last_else_on_the_least_recently_used(bundle: RuntimeBundle
                                                                               ) -> None:
    spec = bundle.specs[HIFT_DECODER]
    runners = [Recording(spec) for _ in range(3)]
    pool = ShapePool(runners)
    for frames in (30, 40, 40, 50, 30, 40):  # a first chunk's, two later ones', the last's; then again
        pool.infer(feeds_of(spec, frames))
    assert [r.frames for r in runners] == [[30, 30], [40, 40, 40], [50]]
    assert pool.reshaped == 0  # each length kept its session
    pool.infer(feeds_of(spec, 60))  # a new length: on the session used longest ago, the last one's
    assert runners[2].frames == [50, 60] and pool.reshaped == 1


def test_a_session_running_a_call_keeps_its_shapes(bundle: RuntimeBundle) -> None:
    spec = bundle.specs[HIFT_DECODER]
    runners = [Recording(spec) for _ in range(3)]
    pool = ShapePool(runners)
    runners[0].hold = threading.Event()
    held = threading.Thread(target=pool.infer, args=(feeds_of(spec, 30),))
    held.start()
    try:
        assert runners[0].started.wait(timeout=10)
        pool.infer(feeds_of(spec, 40))
        pool.infer(feeds_of(spec, 50))
        pool.infer(feeds_of(spec, 60))  # the first session is the least recently used, but running
        assert [r.frames for r in runners] == [[30], [40, 60], [50]]
    finally:
        runners[0].hold.set()
        held.join()


def test_pooled_sessions_give_a_single_sessions_outputs(bundle: RuntimeBundle) -> None:
    spec = bundle.specs[HIFT_DECODER]
    path = bundle.graph_path(HIFT_DECODER)
    with OrtRunner(path, spec, CPU, threads=1) as alone, \
            ShapePool([OrtRunner(path, spec, CPU, threads=1) for _ in range(2)]) as pool:
        for frames in (20, 33, 20, 33):
            feeds = feeds_of(spec, frames)
            want = alone.infer(feeds)["waveform"]
            assert np.array_equal(pool.infer(feeds)["waveform"], want)
            kept, outputs = pool.infer_kept(feeds, ["waveform"])
            assert not kept and np.array_equal(np.asarray(outputs["waveform"]), want)
        assert pool.reshaped == 0 and pool.size == 2


def test_only_the_vocoders_graphs_get_a_pool_and_only_on_cuda(bundle: RuntimeBundle) -> None:
    assert shape_sessions(HIFT_DECODER, CUDA) == shape_sessions(HIFT_F0, CUDA) == 6
    assert shape_sessions(LLM, CUDA) == 1 and shape_sessions(HIFT_DECODER, CPU) == 1
    with open_runner(bundle, HIFT_DECODER, CPU, threads=1) as runner:
        assert isinstance(runner, OrtRunner)
    with pytest.raises(ValueError, match="^a shape pool runs one graph, not hift_decoder, hift_f0$"):
        ShapePool([Recording(bundle.specs[HIFT_DECODER]), Recording(bundle.specs[HIFT_F0])])


def test_the_pools_hold_the_lengths_of_streamed_and_offline_requests(
        bundle: RuntimeBundle, prompt: PromptFeatures, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream on upstream's schedule, one on the first-chunk policy and an offline request (250 tokens:
    the later hops' longest windows, the offline vocoder's 200-frame windows), twice: the second time every
    vocoder call finds a session that ran its length. The pools CUDA gets, opened on the CPU."""
    monkeypatch.setattr(runners, "shape_sessions", lambda graph, provider: SHAPE_SESSIONS.get(graph, 1))
    tokens = [(7 * i) % 300 + 1 for i in range(250)]
    with Synthesizer(bundle, CPU, threads=1) as synth:
        pools = [synth.vocoder.f0, synth.vocoder.decoder]
        assert all(isinstance(p, ShapePool) for p in pools) and synth.vocoder.repeat_shapes
        reshaped = []
        for _ in range(2):
            list(synth.stream_tokens(tokens, prompt))
            list(synth.stream_tokens(tokens, prompt, policy=ChunkPolicy(first_chunk_tokens=10)))
            synth.token2wav(tokens, prompt)
            reshaped.append([p.reshaped for p in pools if isinstance(p, ShapePool)])
    assert reshaped[1] == reshaped[0]


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime's CUDA provider (onnxruntime-gpu and a GPU)")
def test_on_cuda_the_vocoders_windows_keep_a_session_per_length(bundle: RuntimeBundle) -> None:
    spec = bundle.specs[HIFT_DECODER]
    with open_runner(bundle, HIFT_DECODER, CUDA) as pool, \
            OrtRunner(bundle.graph_path(HIFT_DECODER), spec, CPU, threads=1) as cpu:
        assert isinstance(pool, ShapePool) and pool.size == 6
        for frames in (20, 33, 47, 20, 33, 47):
            feeds = feeds_of(spec, frames)
            got, want = pool.infer(feeds)["waveform"], cpu.infer(feeds)["waveform"]
            assert np.abs(got - want).max() < 1e-4, frames  # float32 on CUDA, TF32 off
        assert pool.reshaped == 0
    with Synthesizer(bundle, CUDA) as synth:  # whose vocoder then keeps to lengths it has had
        assert synth.vocoder.repeat_shapes
    with Synthesizer(bundle, CPU, threads=1) as synth:
        assert not synth.vocoder.repeat_shapes
