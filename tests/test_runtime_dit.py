"""One DiT graph: the `Synthesizer` opens each graph of the bundle once and runs every flow call on
`flow_estimator_cached` (the offline flow and a stream's final chunk with nothing cached, fetching the
velocity only). On the embedded demo bundle; no torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from cosyvoice_graphs import ODE_STEPS, SPECS, empty_caches
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.synthesis import Synthesizer


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files onnxruntime loads while the test runs."""
    names: list[str] = []
    real = ort.InferenceSession

    def recording(path: str, *args: Any, **kwargs: Any) -> ort.InferenceSession:
        names.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    return names


@pytest.fixture(scope="module")
def synth() -> Iterator[Synthesizer]:
    with Synthesizer(RuntimeBundle.open(DEMO_BUNDLE), threads=1) as s:
        yield s


def _prompt(synth: Synthesizer, tokens: int) -> PromptFeatures:
    rng = np.random.default_rng(3)
    d = synth.dims
    return PromptFeatures(rng.integers(0, d.speech_token_size, (1, tokens)).astype(np.int64),
                          rng.standard_normal((1, d.token_mel_ratio * tokens, d.mel_bins), dtype=np.float32),
                          rng.standard_normal((1, 192), dtype=np.float32))


def _tokens(synth: Synthesizer) -> list[int]:
    return [int(t) for t in np.random.default_rng(4).integers(0, synth.dims.speech_token_size, 90)]


def test_the_synthesizer_opens_each_graph_once(loaded: list[str]) -> None:
    with Synthesizer(RuntimeBundle.open(DEMO_BUNDLE), threads=1) as synth:
        assert sorted(loaded) == sorted(f"{name}.onnx" for name in SPECS)
        assert list(synth.runners) == list(SPECS)
        assert synth.flow.estimator is synth.runners["flow_estimator_cached"]


def test_every_flow_call_runs_on_the_dit_graph(synth: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, each Euler step is one call with nothing cached that fetches the velocity only; streamed,
    the non-final chunks fetch the caches too and the final chunk is an offline call again. (`infer` goes
    through `infer_outputs`, so every call is seen here.)"""
    estimator = synth.flow.estimator
    fetched: list[int] = []
    infer_outputs = estimator.infer_outputs

    def counting(feeds: Any, names: Any) -> dict[str, np.ndarray]:
        fetched.append(len(names))
        if len(names) == 1:  # nothing cached: zero past frames, positions from 0, zero conv context
            assert int(feeds["positions"][0]) == 0
            assert all(np.array_equal(feeds[k], v) for k, v in empty_caches(estimator.spec).items())
        return infer_outputs(feeds, names)

    monkeypatch.setattr(estimator, "infer_outputs", counting)
    prompt, tokens = _prompt(synth, 20), _tokens(synth)
    synth.token2wav(tokens, prompt)
    assert fetched == [1] * ODE_STEPS
    fetched.clear()
    policy = ChunkPolicy(lookahead=synth.dims.pre_lookahead_len)
    chunks = list(synth.stream_tokens(tokens, prompt, policy=policy))
    assert len(chunks) > 1
    everything = len(estimator.spec.outputs)
    assert fetched.count(everything) == ODE_STEPS * (len(chunks) - 1)
    assert fetched.count(1) == ODE_STEPS and len(fetched) == ODE_STEPS * len(chunks)
    with pytest.raises(ValueError, match="unknown output 'present'"):
        infer_outputs({}, ["present"])


def test_the_flow_pauses_before_every_dit_call(synth: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's pause (its `ChunkTurns` turn's) comes before each of its DiT calls: offline, in a cached
    push, in a peek and in the final re-run."""
    calls: list[str] = []
    infer_outputs = synth.flow.estimator.infer_outputs
    monkeypatch.setattr(synth.flow.estimator, "infer_outputs",
                        lambda feeds, names: calls.append("dit") or infer_outputs(feeds, names))

    def pause() -> None:
        calls.append("pause")

    prompt, tokens = _prompt(synth, 20), _tokens(synth)
    synth.flow(np.asarray(tokens), prompt, finalize=True, streaming=False, pause=pause)
    assert calls == ["pause", "dit"] * ODE_STEPS
    d = synth.dims
    per_block = d.dit_block_frames // d.token_mel_ratio
    # non-final pushes end on block boundaries: prompt + pushed tokens - look-ahead a whole number of blocks
    ends = [n for n in range(len(tokens)) if (20 + n - d.pre_lookahead_len) % per_block == 0
            and n > d.pre_lookahead_len]
    stream = synth.flow.stream(prompt)
    stream.push(tokens[:ends[0]], finalize=False)  # the prompt's prefix, then the first chunk: no pause given
    calls.clear()
    stream.peek(tokens[:ends[0] + 1], pause=pause)
    stream.push(tokens[:ends[1]], finalize=False, pause=pause)
    stream.push(tokens, finalize=True, pause=pause)
    assert calls == ["pause", "dit"] * (3 * ODE_STEPS)
