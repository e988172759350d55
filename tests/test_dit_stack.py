"""Concurrent streams' DiT calls gathered into one call (`DitStack`): each stream gets what its calls alone
give, to the bit on the CPU in float32, on the host and with the caches kept as device values (CPU
`OrtValue`s here, as on a GPU); calls of different keys and chunks held at their pause are not waited for; an
error reaches every stream of the call."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from test_runtime_core import clone

from cosyvoice_graphs import DIT, cache_pairs, dit_call_case, dit_frame_caches
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cosyvoice3 import CosyVoice3
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.dit_stack import DitStack, Presents, call_alone
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import CUDA, BufferView, Feed, open_runner
from cosyvoice_runtime.runners.device_copies import FramePad, RowConcat
from cosyvoice_runtime.synthesis import Synthesizer

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
NEEDS_CUDA = "needs onnxruntime's CUDA provider (onnxruntime-gpu and an NVIDIA GPU)"
CUDA_MEL_MAX = 1e-3
"""A stream's mel stacked against alone on CUDA: rows of a call differ by float32 rounding there (5.5e-6
measured on an H200 per call); a row given another stream's frames would be off by ~1."""
NEEDS_ONNX = "needs the onnx package (in the gpu and export extras), which builds RowConcat's graph"
LONG_WAIT_S = 60.0
"""A linger no test should reach: a call that waited for it would show in the test's time."""


def _threads(work: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each of `work` on a thread of its own, started together; their results, or the first error."""
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []
    together = threading.Barrier(len(work))

    def run(i: int) -> None:
        try:
            together.wait()
            results[i] = work[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def estimator(runtime_bundle: Path) -> Iterator[Any]:
    bundle = RuntimeBundle.open(runtime_bundle)
    with open_runner(bundle, DIT, threads=1) as runner:
        yield runner


@pytest.fixture(scope="module")
def block(runtime_bundle: Path) -> int:
    """The DiT's attention block."""
    return RuntimeBundle.open(runtime_bundle).dims.dit_block_frames


def _feeds(estimator: Any, new: int, past: int, seed: int, block: int) -> dict[str, np.ndarray]:
    return estimator.spec.sample_inputs(dit_call_case(new, past, past, block), seed=seed)


def _same(a: tuple[np.ndarray, dict[str, Feed]], b: tuple[np.ndarray, dict[str, Feed]]) -> bool:
    host = {k: v if isinstance(v, np.ndarray) else v.numpy() for k, v in a[1].items()}
    return np.array_equal(a[0], b[0]) and all(np.array_equal(host[k], b[1][k]) for k in b[1])


def test_calls_of_one_key_run_as_one_call_and_give_each_stream_its_rows(estimator: Any, block: int) -> None:
    stack = DitStack(estimator, linger_s=LONG_WAIT_S)
    feeds = [_feeds(estimator, 12, 30, seed, block) for seed in range(3)]
    for f in feeds[1:]:  # what a call's streams share
        for name in ("ode_step", "positions", "attention_mask"):
            f[name] = feeds[0][name]
    alone = [call_alone(estimator, f, presents=Presents.HOST) for f in feeds]
    with stack.chunk_calls() as a, stack.chunk_calls() as b, stack.chunk_calls() as c:
        start = time.perf_counter()
        got = _threads([lambda m=m, f=f: m.velocity(f, presents=Presents.HOST, pause=lambda: None)
                        for m, f in zip((a, b, c), feeds, strict=True)])
    assert time.perf_counter() - start < LONG_WAIT_S / 2
    assert (stack.calls, stack.streams) == (1, 3)
    for g, want in zip(got, alone, strict=True):
        assert g[0].shape[::2] == (2, 12)
        assert _same(g, want)


def test_calls_of_other_keys_and_held_chunks_are_not_waited_for(estimator: Any, block: int) -> None:
    """A chunk whose call has another key, or that is held at its pause, lets the waiting call go at once
    (the linger is a minute: waiting for it would fail the test's time)."""
    stack = DitStack(estimator, linger_s=LONG_WAIT_S)
    short, long_ = _feeds(estimator, 8, 20, 0, block), _feeds(estimator, 8, 40, 1, block)
    released = threading.Event()
    with stack.chunk_calls() as a, stack.chunk_calls() as b, stack.chunk_calls() as held:
        start = time.perf_counter()

        def held_call() -> tuple[np.ndarray, dict[str, Feed]]:
            return held.velocity(short, presents=Presents.HOST, pause=released.wait)

        def first() -> tuple[np.ndarray, dict[str, Feed]]:
            try:
                return a.velocity(short, presents=Presents.HOST, pause=lambda: None)
            finally:
                released.set()

        got = _threads([first, lambda: b.velocity(long_, presents=Presents.HOST, pause=lambda: None),
                        held_call])
    assert time.perf_counter() - start < LONG_WAIT_S / 2
    assert stack.streams == 3 and stack.calls in (2, 3)
    assert _same(got[0], call_alone(estimator, short, presents=Presents.HOST))
    assert _same(got[1], call_alone(estimator, long_, presents=Presents.HOST))
    assert _same(got[2], got[0])


def test_an_error_in_a_stacked_call_reaches_every_stream(runtime_bundle: Path, block: int) -> None:
    runner = open_runner(RuntimeBundle.open(runtime_bundle), DIT, threads=1)
    stack = DitStack(runner, linger_s=LONG_WAIT_S)
    runner.close()
    errors: list[BaseException] = []

    def call(m: Any) -> None:
        try:
            m.velocity(_feeds(runner, 6, 10, 0, block), presents=Presents.HOST, pause=lambda: None)
        except RuntimeError as e:
            errors.append(e)

    with stack.chunk_calls() as a, stack.chunk_calls() as b:
        _threads([lambda: call(a), lambda: call(b)])
    assert len(errors) == 2 and all("runner is closed" in str(e) for e in errors)


def test_row_concat_stacks_device_values_and_their_rows(estimator: Any) -> None:
    """On the CPU provider `RowConcat` takes `OrtValue`s and `BufferView`s as a GPU's caches are kept."""
    pytest.importorskip("onnx", reason=NEEDS_ONNX)
    pasts = [past for past, _ in cache_pairs(estimator.spec)][:3]
    specs = {t.name: t for t in estimator.spec.inputs}
    concat = RowConcat({name: (specs[name].np_dtype, len(specs[name].shape)) for name in pasts})
    rng = np.random.default_rng(0)
    arrays = [{name: rng.standard_normal((4 if i == 1 else 2, *(5,) * (len(specs[name].shape) - 1)))
               .astype(np.float32) for name in pasts} for i in range(3)]
    parts: list[dict[str, Feed]] = [{k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in a.items()}
                                    for a in arrays]
    parts[1] = {k: BufferView(v, 1, 2) for k, v in parts[1].items()}  # rows 1-2 of a 4-row buffer
    got = concat(parts)
    for name in pasts:
        want = np.concatenate([arrays[0][name], arrays[1][name][1:3], arrays[2][name]])
        assert np.array_equal(got[name].numpy(), want)
    assert np.array_equal(concat(parts[:1])[pasts[0]].numpy(), arrays[0][pasts[0]])


def test_frame_pad_drops_a_run_of_frames_where_the_tensors_are(estimator: Any) -> None:
    """On the CPU provider `FramePad.drop` takes `OrtValue`s and `BufferView`s as a GPU's caches are kept,
    and gives each tensor without the run of entries along its axis, as numpy's `delete`."""
    pytest.importorskip("onnx", reason=NEEDS_ONNX)
    specs = {t.name: t for t in estimator.spec.inputs}
    caches, axis = dit_frame_caches(estimator.spec)
    keys = [t.name for t in caches][:2]
    frames = FramePad({name: (specs[name].np_dtype, len(specs[name].shape)) for name in keys}, axis=axis)
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal((4, 3, 9, 5)).astype(np.float32) for name in keys}
    feeds: dict[str, Feed] = {keys[0]: ort.OrtValue.ortvalue_from_numpy(arrays[keys[0]]),
                              keys[1]: BufferView(ort.OrtValue.ortvalue_from_numpy(arrays[keys[1]]), 1, 2)}
    wants = {keys[0]: arrays[keys[0]], keys[1]: arrays[keys[1]][1:3]}
    for first, count in ((3, 4), (0, 2), (7, 2), (4, 0)):
        got = frames.drop(feeds, first, count)
        for name in keys:
            want = np.delete(wants[name], np.s_[first:first + count], axis=axis)
            assert np.array_equal(got[name].numpy(), want)
    with pytest.raises(ValueError, match="cannot drop"):
        frames.drop(feeds, 2, -1)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 6561, n)]


def _chunks(prompt: PromptFeatures, n: int, seed: int) -> list[tuple[list[int], bool]]:
    """(tokens so far, final) per chunk of upstream's schedule."""
    policy, tokens = ChunkPolicy(), _tokens(n, seed)
    hops, offset, out = policy.hops(prompt.speech_tokens.shape[1]), 0, []
    hop = next(hops)
    while n - offset >= hop + policy.lookahead:
        out.append((tokens[: offset + hop + policy.lookahead], False))
        offset, hop = offset + hop, next(hops)
    return [*out, (tokens, True)]


def _chunk_by_chunk(alone: Synthesizer, stacked: Synthesizer, prompt: PromptFeatures
                    ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], DitStack]:
    """Three streams' chunks pushed together through `stacked`'s stack (its linger a minute: every chunk
    expected joins), streams 0 and 2 without 1 for the second chunk, and each stream alone on `alone`:
    (the stacked streams' mels, the lone ones', the stack)."""
    seeds = (3, 4, 5)
    stack = stacked.flow.stack
    assert stack is not None and stack.linger_s < 1
    stacked.flow.stack = stack = DitStack(stacked.flow.estimator, linger_s=LONG_WAIT_S)
    chunks = [_chunks(prompt, 250, seed) for seed in seeds]
    assert len({len(c) for c in chunks}) == 1 and len(chunks[0]) >= 4
    lone = [alone.flow.stream(prompt) for _ in seeds]
    want = [[lone[i].push(t, finalize=f) for t, f in chunks[i]] for i in range(3)]
    streams = [stacked.flow.stream(prompt) for _ in seeds]
    stacked.flow.prefix(prompt)
    got: list[list[np.ndarray]] = [[], [], []]

    def push(i: int, c: int) -> Callable[[], None]:
        return lambda: got[i].append(streams[i].push(chunks[i][c][0], finalize=chunks[i][c][1]))

    _threads([push(i, 0) for i in range(3)])
    _threads([push(0, 1), push(2, 1)])
    push(1, 1)()
    for c in range(2, len(chunks[0])):
        _threads([push(i, c) for i in range(3)])
    assert [len(g) for g in got] == [len(w) for w in want]
    return got, want, stack


@pytest.mark.parametrize("kept", [False, True], ids=["host", "device"])
def test_streams_stacked_chunk_by_chunk_give_their_mel_alone(runtime_bundle: Path, prompt: PromptFeatures,
                                                            kept: bool) -> None:
    """Three streams' chunks pushed together through the stack against each stream alone: the same mel to
    the bit. With the caches kept as device values (forced on the CPU provider) the first chunks stack the
    prompt's prefix by Concat, the next ones the stacked call's rows as they are, and streams 0 and 2
    without 1 by Concat of rows again."""
    if kept:
        pytest.importorskip("onnx", reason=NEEDS_ONNX)
    bundle = RuntimeBundle.open(runtime_bundle)
    with Synthesizer(bundle, threads=1) as alone, Synthesizer(bundle, threads=1, stack_dit=True) as stacked:
        alone.flow.keep_on_device = stacked.flow.keep_on_device = kept
        got, want, stack = _chunk_by_chunk(alone, stacked, prompt)
    assert 0 < stack.stacked < stack.calls
    if kept:  # the prefix and streams 0 and 2 concatenated; the other stacked calls' caches were one run
        assert 2 <= stack.concats < stack.stacked
    else:
        assert stack.concats == 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_CUDA)
def test_on_cuda_stacked_streams_keep_their_caches_there(runtime_bundle: Path, prompt: PromptFeatures
                                                         ) -> None:
    """The same on CUDA, where the caches stay on the GPU by default: the stacked call's rows as views of its
    outputs there, the prompt's prefix and regrouped streams concatenated by `RowConcat` on the device; each
    stream's mel within float32's rounding of its stream alone (another batch, other kernels)."""
    pytest.importorskip("onnx", reason=NEEDS_ONNX)
    bundle = RuntimeBundle.open(runtime_bundle)
    with Synthesizer(bundle, CUDA) as alone, Synthesizer(bundle, CUDA, stack_dit=True) as stacked:
        assert stacked.flow.keep_on_device
        got, want, stack = _chunk_by_chunk(alone, stacked, prompt)
    assert 0 < stack.stacked < stack.calls and 2 <= stack.concats < stack.stacked
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.shape == b.shape and float(np.abs(a - b).max()) < CUDA_MEL_MAX


def test_offline_flows_of_equal_length_stack_and_give_their_mel_alone(runtime_bundle: Path,
                                                                       prompt: PromptFeatures) -> None:
    """The flow over every frame (offline, and an exact stream's final re-run) copies no caches out: three
    of equal length at once stack, each giving its mel alone to the bit; one of another length runs apart."""
    bundle = RuntimeBundle.open(runtime_bundle)
    lengths = (40, 40, 40, 31)
    tokens = [np.array(_tokens(n, seed), dtype=np.int64) for seed, n in enumerate(lengths)]
    with Synthesizer(bundle, threads=1) as alone, Synthesizer(bundle, threads=1, stack_dit=True) as stacked:
        stacked.flow.stack = stack = DitStack(stacked.flow.estimator, linger_s=LONG_WAIT_S)
        want = [alone.flow(t, prompt, finalize=True, streaming=False) for t in tokens]
        got = _threads([lambda t=t: stacked.flow(t, prompt, finalize=True, streaming=False) for t in tokens])
    assert stack.streams == 4 * 10 and stack.stacked > 0 and stack.concats == 0
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)


def test_a_dit_quantized_per_tensor_is_refused_before_anything_opens(runtime_bundle: Path, tmp_path: Path
                                                                      ) -> None:
    """The int8 DiT's activations share one scale over a call's rows: stacked, a stream's frames would depend
    on the others'. Refused in one line by the `Synthesizer` and `CosyVoice3` alike."""
    root = clone(runtime_bundle, tmp_path / "int8",
                 lambda m: m["graphs"][DIT].__setitem__("precision", "int8"))
    message = (rf"^stack_dit: {tmp_path / 'int8'}'s {DIT} is int8, its activations quantized with one scale "
               r"over every row of a call, .* \(export --precision fp32, fp16, bf16 or gpu-fp16\)$")
    with pytest.raises(UserError, match=message):
        Synthesizer(RuntimeBundle.open(root), stack_dit=True)
    with pytest.raises(UserError, match=message):
        CosyVoice3(root, verify=False, stack_dit=True)


@pytest.mark.parametrize("graphs", ["dit", "vocoder"])
def test_the_server_stacks_its_sessions_calls_and_reports_them(prompt_wav: Path, prompt_text: str,
                                                               tmp_path: Path, graphs: str) -> None:
    """`cosyvoice-serve --stack-dit` (or `--stack-vocoder`) `--max-conc 3`: three concurrent upstream
    requests, each answered with the audio it gets without stacking (the vocoder's: to its samples' last
    bits, PCM16 within one step); /metrics counts the stack's calls and the streams' calls they served."""
    pytest.importorskip("fastapi", reason="needs the serve extra")
    from fastapi.testclient import TestClient

    from cosyvoice_serve.app import create_app
    from cosyvoice_serve.engine import Engine
    from cosyvoice_serve.settings import ServerSettings

    text = "A sentence long enough that its stream sends a chunk before its final one, and then some more."
    upload = {"prompt_wav": ("prompt.wav", prompt_wav.read_bytes(), "audio/wav")}

    def answers(stack: bool) -> tuple[list[bytes], str]:
        flags = {f"stack_{graphs}": stack}
        engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1, **flags)
        settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", max_concurrency=3,
                                  **flags)
        try:
            with TestClient(create_app(engine, settings)) as client:
                responses = _threads([lambda: client.post("/inference_zero_shot", files=upload,
                                                          data={"tts_text": text, "prompt_text": prompt_text})
                                      for _ in range(3)])
                assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
                return [r.content for r in responses], client.get("/metrics").text
        finally:
            engine.close()

    alone, plain_metrics = answers(False)
    stacked, metrics = answers(True)
    assert len(set(alone)) == 1
    if graphs == "dit":
        assert stacked == alone
    for got in stacked:  # upstream's interface streams raw PCM16
        pcm, want = np.frombuffer(got, np.int16), np.frombuffer(alone[0], np.int16)
        assert pcm.shape == want.shape and int(np.abs(pcm.astype(np.int32) - want).max()) <= 1
    assert f"tts_{graphs}_calls" not in plain_metrics
    calls, streams = (float(re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)[1])  # type: ignore[index]
                      for name in (f"tts_{graphs}_calls", f"tts_{graphs}_stream_calls"))
    assert 0 < calls <= streams
