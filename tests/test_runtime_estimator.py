"""One DiT in memory: `flow_estimator`'s calls run on the `flow_estimator_cached` session
(`cosyvoice_runtime.estimator.EstimatorOnCached`), bit-identical to the `flow_estimator` graph, and the
`Synthesizer` never loads the `flow_estimator` graph. On the embedded demo bundle; no torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from cosyvoice_graphs import empty_caches
from cosyvoice_runtime import runners
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import FeedError
from cosyvoice_runtime.estimator import EstimatorOnCached
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import Runner, open_runner
from cosyvoice_runtime.synthesis import ChunkPolicy, Synthesizer
from cosyvoice_runtime.token2wav import N_TIMESTEPS


@pytest.fixture(scope="module")
def bundle() -> RuntimeBundle:
    return RuntimeBundle.open(DEMO_BUNDLE)


@pytest.fixture(scope="module")
def graphs(bundle: RuntimeBundle) -> Iterator[tuple[Runner, Runner]]:
    """The `flow_estimator` graph's own runner, and the cached graph's (1 thread: the reference backend)."""
    with open_runner(bundle, "flow_estimator", threads=1) as full, \
            open_runner(bundle, "flow_estimator_cached", threads=1) as cached:
        yield full, cached


def _feeds(bundle: RuntimeBundle, frames: int, block: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mel = bundle.dims.mel_bins

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    return {"x": normal(2, mel, frames), "mask": np.ones((2, 1, frames), dtype=np.float32),
            "mu": normal(2, mel, frames), "t": np.full(2, 0.37, dtype=np.float32), "spks": normal(2, mel),
            "cond": normal(2, mel, frames), "block_frames": np.array([block], dtype=np.int64)}


@pytest.mark.parametrize("frames", [7, 50, 123, 451])
@pytest.mark.parametrize("block", [50, 100_000])
def test_the_cached_graph_without_caches_is_the_estimator_bit_for_bit(
        bundle: RuntimeBundle, graphs: tuple[Runner, Runner], frames: int, block: int) -> None:
    full, cached = graphs
    feeds = _feeds(bundle, frames, block, seed=frames)
    want = full.infer(feeds)
    got = EstimatorOnCached(cached, bundle.specs["flow_estimator"]).infer(feeds)
    assert list(got) == ["velocity"]
    assert np.array_equal(got["velocity"], want["velocity"])


def test_padding_and_unknown_outputs_are_refused(bundle: RuntimeBundle,
                                                  graphs: tuple[Runner, Runner]) -> None:
    _, cached = graphs
    view = EstimatorOnCached(cached, bundle.specs["flow_estimator"])
    feeds = _feeds(bundle, 20, 50, seed=0)
    feeds["mask"][:, :, -3:] = 0.0
    with pytest.raises(FeedError, match=r"flow_estimator\.mask: padding"):
        view.infer(feeds)
    with pytest.raises(ValueError, match="unknown output 'present_key_0'"):
        view.infer_outputs(_feeds(bundle, 20, 50, seed=0), ["present_key_0"])
    with pytest.raises(ValueError, match="runs flow_estimator on flow_estimator_cached"):
        EstimatorOnCached(cached, bundle.specs["hift_f0"])
    view.close()
    with pytest.raises(RuntimeError, match="closed"):
        view.infer(_feeds(bundle, 20, 50, seed=0))
    feeds = {k: v for k, v in _feeds(bundle, 20, 50, seed=0).items() if k != "mask"}
    feeds.update(offset=np.zeros(1, dtype=np.int64), **empty_caches(cached.spec))
    # closing the view leaves the shared runner open
    assert cached.infer_outputs(feeds, ["velocity"])["velocity"].shape[2] == 20


@pytest.fixture(scope="module")
def opened(bundle: RuntimeBundle) -> Iterator[tuple[Synthesizer, list[str]]]:
    """A Synthesizer on the demo bundle, and the files onnxruntime loaded while it opened."""
    loaded: list[str] = []
    real = runners.ort.InferenceSession

    def recording(path: str, *args: Any, **kwargs: Any) -> ort.InferenceSession:
        loaded.append(Path(path).name)
        return real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runners.ort, "InferenceSession", recording)
        synth = Synthesizer(bundle, threads=1)
    with synth:
        yield synth, loaded


def test_the_synthesizer_holds_one_dit(opened: tuple[Synthesizer, list[str]]) -> None:
    synth, loaded = opened
    assert "flow_estimator_cached.onnx" in loaded and "flow_estimator.onnx" not in loaded
    assert len(loaded) == len(synth.bundle.specs) - 1
    estimator = synth.flow.estimator
    assert isinstance(estimator, EstimatorOnCached)
    assert estimator.cached is synth.flow.cached  # one session serves the offline and the streaming flow
    assert estimator.spec is synth.bundle.specs["flow_estimator"]


def _prompt(synth: Synthesizer, tokens: int) -> PromptFeatures:
    rng = np.random.default_rng(3)
    d = synth.dims
    return PromptFeatures(rng.integers(0, d.speech_token_size, (1, tokens)).astype(np.int64),
                          rng.standard_normal((1, d.token_mel_ratio * tokens, d.mel_bins), dtype=np.float32),
                          rng.standard_normal((1, 192), dtype=np.float32))


def test_every_flow_call_runs_on_the_cached_session(opened: tuple[Synthesizer, list[str]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline and streamed, each DiT call goes to the one session: offline calls fetch the velocity
    only, and reach the cached runner through `infer_outputs`, so per-graph observers of `infer` (golden
    statistics, the benchmark's timers) still count them as `flow_estimator`'s."""
    synth, _ = opened
    cached = synth.flow.cached
    assert cached is not None
    calls: list[tuple[str, int]] = []
    infer, infer_outputs = cached.infer, cached.infer_outputs
    monkeypatch.setattr(cached, "infer", lambda feeds: calls.append(("infer", 0)) or infer(feeds))
    monkeypatch.setattr(cached, "infer_outputs", lambda feeds, names: calls.append(
        ("infer_outputs", len(names))) or infer_outputs(feeds, names))
    prompt = _prompt(synth, 20)
    tokens = list(np.random.default_rng(4).integers(0, synth.dims.speech_token_size, 90))
    synth.token2wav(tokens, prompt)
    assert calls == [("infer_outputs", 1)] * N_TIMESTEPS
    calls.clear()
    policy = ChunkPolicy(lookahead=synth.dims.pre_lookahead_len)
    chunks = list(synth.stream_tokens(tokens, prompt, policy=policy))
    assert len(chunks) > 1
    # non-final chunks: the cached graph with its caches; the final one: the estimator's full call
    assert calls.count(("infer_outputs", 1)) == N_TIMESTEPS
    assert calls.count(("infer", 0)) == N_TIMESTEPS * (len(chunks) - 1)
