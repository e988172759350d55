"""Streaming with flow caches (`FlowStream` over the `flow_estimator_cached` graph) against upstream's re-run
of the flow over every frame per chunk, and the deviations of the `window` policy: the final chunk run
against the caches, and attention bounded to a window of blocks.

Why the cache is exact for a non-final chunk (argued in `FlowStream`): the frames before it are whole
50-frame blocks, which the block-causal mask never lets attend to a later frame; the rest of the DiT is
per frame or causal, the noise is position-locked and their mu/cond do not change. The tests here compare
the runtime's streams frame for frame and sample for sample; test_flow_stream_cache_vs_torch checks the
argument at the DiT (the cached DiT chained over chunks against one block-causal forward, in torch and
onnxruntime, and a chunk boundary inside a block breaking the equality).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_graphs import ODE_STEPS, dit_attention, empty_caches
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.cli_options import chunk_policy
from cosyvoice_runtime.flow_prefix import FlowPrefix, FlowPrefixCache
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import OrtRunner
from cosyvoice_runtime.synthesis import AudioChunk, Synthesizer
from cosyvoice_runtime.token2wav import FlowStream

MEL_MAX = 1e-5  # cache vs re-run, measured ~3e-6: the graphs' float rounding on other shapes
AUDIO_MEAN = 2e-3  # hift_decoder's tolerance; measured ~2e-5 (an ulp of mel can move f0: vocoder tests)
BLOCK = 50


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth(runtime_bundle: Path) -> Iterator[Synthesizer]:
    """One intra-op thread: the graphs round alike run after run."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        yield s


def _tokens(n: int, seed: int = 2) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 6561, n)]


# --- the runtime: cached stream vs the re-run -------------------------------------------------------


def _cache_bytes(synth: Synthesizer, frames: int) -> int:
    """What the caches should hold: per ODE step, two conv caches (2, dim, kernel - 1) and per block
    keys and values (2, heads, frames, head_dim), float32."""
    d = synth.dims
    conv = 2 * 2 * d.dit_dim * (d.dit_conv_kernel - 1)
    kv = d.dit_depth * 2 * 2 * d.dit_heads * frames * d.dit_head_dim
    return ODE_STEPS * 4 * (conv + kv)


def _schedule(policy: ChunkPolicy, prompt_tokens: int, n: int) -> Iterator[tuple[list[int], int, bool]]:
    """(tokens so far, the chunk's offset, final) per chunk, as `Synthesizer.stream_tokens` fires them."""
    hops, offset = policy.hops(prompt_tokens), 0
    hop = next(hops)
    while n - offset >= hop + policy.lookahead:
        yield _tokens(n)[: offset + hop + policy.lookahead], offset, False
        offset, hop = offset + hop, next(hops)
    yield _tokens(n), offset, True


@pytest.mark.parametrize("n", [20, 250, 420])
def test_flow_stream_equals_the_rerun_chunk_by_chunk(synth: Synthesizer, prompt: PromptFeatures, n: int
                                                     ) -> None:
    stream, p = synth.flow.stream(prompt), prompt.speech_tokens.shape[1]
    assert stream.cache_bytes == _cache_bytes(synth, 0) and stream.frames == stream.tokens == 0
    worst, chunks, held = 0.0, 0, 0
    for tokens, offset, final in _schedule(ChunkPolicy(), p, n):
        want = synth.flow(np.asarray(tokens), prompt, finalize=final, streaming=not final)[:, :, 2 * offset:]
        got = stream.push(tokens, finalize=final)
        assert got.shape == want.shape and got.dtype == np.float32
        worst = max(worst, float(np.abs(got - want).max()))
        chunks += 1
        if not final:  # explicit state: every frame so far cached, nothing else
            assert stream.tokens == len(tokens) - 3 and stream.frames == 2 * (p + stream.tokens)
            assert stream.frames % BLOCK == 0 and stream.cached_frames == stream.frames
            assert stream.cache_bytes == _cache_bytes(synth, stream.frames)
            held = stream.cache_bytes
    assert stream.finished and stream.tokens == n
    assert stream.cache_bytes == stream.cached_frames == 0  # the full re-run released them
    print(f"{n} tokens, {chunks} chunks: cache vs re-run mel max abs {worst:.2e}; "
          f"cache before the final push {held / 2**20:.1f} MiB")
    assert worst < MEL_MAX


def _digests(chunks: list[AudioChunk]) -> list[str]:
    return [hashlib.sha256(c.samples.tobytes()).hexdigest() for c in chunks]


def test_synthesizer_stream_cache_equals_rerun(synth: Synthesizer, prompt: PromptFeatures) -> None:
    tokens = _tokens(250)  # 10 s of speech
    cache = list(synth.stream_tokens(tokens, prompt))
    assert ChunkPolicy().flow == "cache"
    rerun = list(synth.stream_tokens(tokens, prompt, policy=ChunkPolicy(flow="rerun")))
    assert len(cache) == len(rerun) >= 4
    for c, r in zip(cache, rerun, strict=True):
        assert (c.index, c.is_final, c.token_range, c.sample_range) == \
            (r.index, r.is_final, r.token_range, r.sample_range)
    got, want = (np.concatenate([c.samples for c in chunks]) for chunks in (cache, rerun))
    diff = np.abs(got - want)
    flow_s = [(round(c.timings.flow, 3), round(r.timings.flow, 3)) for c, r in zip(cache, rerun, strict=True)]
    print(f"stream: cache vs re-run audio max abs {diff.max():.2e}, mean {diff.mean():.2e}; "
          f"flow s per chunk (cache, re-run): {flow_s}")
    assert diff.mean() < AUDIO_MEAN
    assert _digests(list(synth.stream_tokens(tokens, prompt))) == _digests(cache)  # repeatable, per chunk


# --- the per-prompt prefix -------------------------------------------------------------------------


def test_the_prefix_covers_the_whole_blocks_that_read_prompt_tokens_only(synth: Synthesizer) -> None:
    """Frame f's `mu` reads tokens up to f // 2 + 3: a prompt of P tokens has 2(P - 3) such frames."""
    frames = {p: synth.flow.prefix_frames(p) for p in (0, 3, 27, 28, 52, 53, 112)}
    assert frames == {0: 0, 3: 0, 27: 0, 28: 50, 52: 50, 53: 100, 112: 200}  # 112: the bench's 4.5 s prompt


def _cut(prompt: PromptFeatures, tokens: int) -> PromptFeatures:
    """The prompt's first `tokens` tokens and their frames: another prompt, for the cache's tests."""
    return PromptFeatures(prompt.speech_tokens[:, :tokens], prompt.mel[:, :2 * tokens], prompt.embedding)


def test_the_prefix_is_the_first_chunks_caches_of_its_frames(synth: Synthesizer, prompt: PromptFeatures
                                                             ) -> None:
    """The prefix's keys/values equal those of the same frames in one call over the whole first chunk."""
    p = prompt.speech_tokens.shape[1]
    prefix = synth.flow.prefix(prompt)
    print(f"prompt {p} tokens: prefix {prefix.frames} frames, {prefix.nbytes / 2**20:.2f} MiB")
    assert prefix.frames == synth.flow.prefix_frames(p) > 0
    assert prefix.nbytes == _cache_bytes(synth, prefix.frames) and len(prefix.caches) == ODE_STEPS
    assert not any(a.flags.writeable for step in prefix.caches for a in step.values())  # shared
    whole = synth.flow.stream(prompt)  # no prefix: `advance` over every frame of the first chunk
    tokens = whole.flow.tokens_with_prompt(_tokens(-p % 25 + 28), prompt, finalize=False)
    mu, spks = synth.flow.encode(tokens, 0, prompt, finalize=False)
    whole.advance(mu, spks, block_frames=BLOCK)
    worst = 0.0
    for got, want in zip(prefix.caches, whole.caches, strict=True):
        for name in whole.flow.growing:
            worst = max(worst, float(np.abs(got[name] - want[name][:, :, :prefix.frames]).max()))
    print(f"prefix vs one first-chunk call, keys/values max abs {worst:.2e}")
    assert worst < MEL_MAX


def test_streams_share_a_prompts_prefix_through_the_bounded_cache(runtime_bundle: Path, prompt: PromptFeatures
                                                                   ) -> None:
    tokens = _tokens(120)
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        cache = s.flow.prefixes
        first = _digests(list(s.stream_tokens(tokens, prompt)))
        assert (cache.misses, cache.hits, len(cache)) == (1, 0, 1)
        assert _digests(list(s.stream_tokens(tokens, prompt))) == first  # the same split, cached or not
        assert (cache.misses, cache.hits) == (1, 1)
        held = cache.nbytes
        assert held == s.flow.prefix(prompt).nbytes > 0

        other = _cut(prompt, prompt.speech_tokens.shape[1] - 1)  # another prompt: another entry
        s.flow.prefix(other)
        assert (cache.misses, len(cache)) == (2, 2)
        cache.max_bytes = held  # room for one: a new prompt evicts the least recently used
        s.flow.prefix(_cut(prompt, prompt.speech_tokens.shape[1] - 2))
        assert len(cache) == 1 and cache.nbytes <= held
        cache.clear()
        assert len(cache) == cache.nbytes == 0
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1, flow_prefix_bytes=0) as s:
        assert _digests(list(s.stream_tokens(tokens, prompt))) == first  # nothing kept, the same samples
        assert (s.flow.prefixes.misses, len(s.flow.prefixes)) == (1, 0)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        FlowPrefixCache(-1)


class _Stopped(Exception):
    """What stops a stream's ids in the test below (a server's cancellation, between two LLM steps)."""


def _stopping(ids: list[int], after: int) -> Iterator[int]:
    yield from ids[:after]
    raise _Stopped


@pytest.mark.parametrize("ends", ["closed", "closed beside another", "stopped", "closed, the call failing",
                                  "exhausted"])
def test_a_stream_ended_early_drops_its_caches_and_gives_their_memory_back(
        synth: Synthesizer, prompt: PromptFeatures, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, ends: str) -> None:
    """A stream's caches are outputs of the DiT's calls, held in its arena's regions, which onnxruntime gives
    back only as a call ends: a stream that ends before its final chunk, closed by its consumer or stopped by
    an error, drops them and, unless another synthesis is in flight (whose next DiT call does it), makes the
    DiT's smallest call; where that call fails, the stream ends as it would have."""
    streams: list[FlowStream] = []
    gave_back: list[int] = []
    flow_stream, give_back = synth.flow.stream, synth.flow.give_back_arena

    def stream(*args: Any, **kwargs: Any) -> FlowStream:
        streams.append(flow_stream(*args, **kwargs))
        return streams[-1]

    def give_back_arena() -> None:
        gave_back.append(streams[0].cache_bytes)
        if ends == "closed, the call failing":
            raise ort.capi.onnxruntime_pybind11_state.RuntimeException("out of memory")
        give_back()

    monkeypatch.setattr(synth.flow, "stream", stream)
    monkeypatch.setattr(synth.flow, "give_back_arena", give_back_arena)
    chunks = synth.stream_tokens(_stopping(_tokens(120), 60) if ends == "stopped" else _tokens(120), prompt)
    first = next(chunks)
    assert not first.is_final and streams[0].cached_frames > 0
    if ends == "exhausted":
        assert list(chunks)[-1].is_final
    elif ends == "stopped":
        with pytest.raises(_Stopped):
            list(chunks)
    elif ends == "closed beside another":
        with synth.live.held():
            chunks.close()
    else:
        chunks.close()
    assert streams[0].caches == []
    assert gave_back == ([] if ends in ("exhausted", "closed beside another") else [0])
    assert ("arena was not shrunk" in caplog.text) == (ends == "closed, the call failing")


def test_a_stream_stopped_before_its_first_chunk_makes_no_call(synth: Synthesizer, prompt: PromptFeatures,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its first chunk a stream's caches hold nothing of a DiT call's: nothing to give back."""
    calls: list[str] = []
    monkeypatch.setattr(synth.flow, "give_back_arena", lambda: calls.append("give back"))
    with pytest.raises(_Stopped):
        list(synth.stream_tokens(_stopping(_tokens(120), 5), prompt))
    assert calls == []


def test_a_runtime_closed_during_the_give_back_call_has_nothing_to_give_back(
        runtime_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime closed between the call's check and its run (a stream ended while the server shuts down):
    its arena is gone, so the failed call is no failure; one failing on an open runner is."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        estimator = s.flow.estimator
        assert isinstance(estimator, OrtRunner) and estimator.shrinks_arena

        def failing(feeds: Any, names: Any) -> dict[str, np.ndarray]:
            raise RuntimeError("the session went")

        monkeypatch.setattr(estimator, "infer_outputs", failing)
        with pytest.raises(RuntimeError, match="session went"):
            s.flow.give_back_arena()

        def closing(feeds: Any, names: Any) -> dict[str, np.ndarray]:
            estimator.close()
            raise RuntimeError("the session went")

        monkeypatch.setattr(estimator, "infer_outputs", closing)
        s.flow.give_back_arena()
        assert estimator.closed


def test_a_stream_closed_after_its_runtime_makes_no_call(runtime_bundle: Path, prompt: PromptFeatures,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A stream left open until after its graphs closed (collected at exit) has no arena to shrink."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        chunks = s.stream_tokens(_tokens(120), prompt)
        next(chunks)
    chunks.close()
    assert "arena" not in caplog.text


def test_held_prefixes_are_dropped_after_every_other() -> None:
    """Past the budget the least recently used prefix not held goes first; a held one only where every
    prefix kept is held, and a prefix not held is not kept where it would drop a held one."""
    def prefix(kib: int = 1) -> FlowPrefix:
        return FlowPrefix(50, ({"past": np.zeros(256 * kib, np.float32)},))

    cache = FlowPrefixCache(3 << 10)
    cache.hold("a")
    assert cache.put("a", prefix(2)) and cache.put("b", prefix())
    assert not cache.put("c", prefix(2)) and "b" in cache  # it would not fit beside "a": it drops nothing
    cache.clear()
    assert all(cache.put(key, prefix()) for key in "abc")
    assert cache.put("d", prefix()) and [k for k in "abcd" if k in cache] == ["a", "c", "d"]  # not a
    cache.hold("c")
    cache.hold("d")
    assert not cache.put("e", prefix()) and "e" not in cache  # it would drop a held one
    cache.let_go("a")
    assert cache.put("e", prefix()) and [k for k in "acde" if k in cache] == ["c", "d", "e"]
    cache.hold("e")
    cache.hold("f")
    assert cache.put("f", prefix()) and [k for k in "cdef" if k in cache] == ["d", "e", "f"]  # all held

    cache.clear()
    cache.hold("g")  # held twice (a speaker's recording and a server's own voice): let go once, still held
    cache.hold("g")
    cache.let_go("g")
    assert cache.put("g", prefix(2)) and not cache.put("h", prefix(2)) and "g" in cache


def test_streams_check_their_inputs(synth: Synthesizer, prompt: PromptFeatures) -> None:
    stream = synth.flow.stream(prompt)
    pad = -prompt.speech_tokens.shape[1] % 25
    with pytest.raises(ValueError, match="block boundary"):
        stream.push(_tokens(pad + 10 + 3), finalize=False)  # ends 10 tokens into a block
    first = _tokens(pad + 25 + 3)
    stream.push(first, finalize=False)
    with pytest.raises(ValueError, match="no new tokens"):
        stream.push(first, finalize=False)
    stream.push(_tokens(60), finalize=True)
    with pytest.raises(ValueError, match="finalized"):
        stream.push(_tokens(60), finalize=True)
    with pytest.raises(ValueError, match="window"):
        synth.flow.stream(prompt, window=0)
    with pytest.raises(ValueError, match="whole 50-frame DiT blocks"):
        synth.stream_tokens(_tokens(100), prompt, policy=ChunkPolicy(token_hop=20))
    synth.stream_tokens(_tokens(100), prompt, policy=ChunkPolicy(token_hop=20, flow="rerun"))  # fine re-run
    with pytest.raises(ValueError, match="flow must be"):
        ChunkPolicy(flow="cached")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flow_window"):
        ChunkPolicy(flow_window=0)


# --- the bounded window -----------------------------------------------------------------------------

LONG = 500  # 20 s of speech: 7 chunks, the window drops blocks from the third on


def _snr_db(got: np.ndarray, want: np.ndarray) -> float:
    noise = float(np.sum((got.astype(np.float64) - want) ** 2))
    return 10 * np.log10(float(np.sum(want.astype(np.float64) ** 2)) / max(noise, 1e-30))


def _vocode(synth: Synthesizer, mels: list[np.ndarray]) -> np.ndarray:
    """The streamed audio of mel chunks (the last one final), as `Synthesizer.stream_tokens` vocodes it."""
    vocoder = synth.vocoder.stream()
    return np.concatenate([vocoder.push(m, finalize=i == len(mels) - 1) for i, m in enumerate(mels)])


Rerun = tuple[list[np.ndarray], np.ndarray]


@pytest.fixture(scope="module")
def long_rerun(synth: Synthesizer, prompt: PromptFeatures) -> Rerun:
    """Upstream's stream of `LONG` tokens: the mel of each chunk and the audio."""
    mels = [synth.flow(np.asarray(tokens), prompt, finalize=final, streaming=not final)[:, :, 2 * offset:]
            for tokens, offset, final in _schedule(ChunkPolicy(), prompt.speech_tokens.shape[1], LONG)]
    return mels, _vocode(synth, mels)


@pytest.mark.parametrize("window", [2, 8])
def test_window_bounds_the_cache_and_its_deviation_is_measured(synth: Synthesizer, prompt: PromptFeatures,
                                                                long_rerun: Rerun, window: int) -> None:
    """The caches never hold more than the prompt's blocks and `window` blocks, so every chunk costs the
    same; mel and audio deviate from upstream's re-run (figures printed; docs/runtime.md has them)."""
    p = prompt.speech_tokens.shape[1]
    head = -(-2 * p // BLOCK) * BLOCK
    stream = synth.flow.stream(prompt, final_cached=True, window=window)
    mels, held = [], 0
    for tokens, _, final in _schedule(ChunkPolicy(), p, LONG):
        mels.append(stream.push(tokens, finalize=final))
        assert stream.cached_frames <= head + window * BLOCK
        held = max(held, stream.cache_bytes)
    assert stream.frames == 2 * (p + LONG)
    want_mels, want_audio = long_rerun
    assert [m.shape for m in mels] == [m.shape for m in want_mels]
    mel_diff = np.abs(np.concatenate(mels, axis=2) - np.concatenate(want_mels, axis=2))
    audio = _vocode(synth, mels)
    print(f"window {window}: {len(mels)} chunks, mel vs re-run max abs {mel_diff.max():.3g}, mean "
          f"{mel_diff.mean():.3g}; audio SNR {_snr_db(audio, want_audio):.1f} dB; cache "
          f"{held / 2**20:.1f} MiB at most")
    assert np.isfinite(audio).all() and audio.shape == want_audio.shape
    assert 0 < mel_diff.mean() < 0.1  # an approximation, not a failure: random weights attend everywhere


def test_window_policy_streams_through_the_synthesizer(synth: Synthesizer, prompt: PromptFeatures) -> None:
    """`flow="window"` in `Synthesizer.stream_tokens` is `FlowStream` with its final chunk cached and the
    policy's window (None: every block), vocoded."""
    for policy in (ChunkPolicy(flow="window"), ChunkPolicy(flow="window", flow_window=None)):
        stream = synth.flow.stream(prompt, final_cached=True, window=policy.flow_window)
        mels = [stream.push(tokens, finalize=final)
                for tokens, _, final in _schedule(policy, prompt.speech_tokens.shape[1], LONG)]
        chunks = list(synth.stream_tokens(_tokens(LONG), prompt, policy=policy))
        assert len(chunks) == len(mels) and chunks[-1].is_final
        assert np.array_equal(np.concatenate([c.samples for c in chunks]), _vocode(synth, mels))


def _final_seeing_everything(synth: Synthesizer, prompt: PromptFeatures, tokens: list[int], first: int
                             ) -> np.ndarray:
    """The mel from frame `first` on of one flow call over every frame without caches, under the block-causal
    mask except that the frames from `first` on see every frame: what a stream whose final push runs from
    `first` on computes against its caches (`final_cached`)."""
    flow = synth.flow
    mu, spks = flow.encode(flow.tokens_with_prompt(tokens, prompt, finalize=True), 0, prompt, finalize=True)
    frames = mu.shape[2]
    attention = dit_attention(0, frames, 0, BLOCK)
    attention["attention_mask"][first:] = True
    cond = flow.cond(prompt, 0, frames)
    feeds = {**attention, **empty_caches(flow.estimator.spec),
             "mu": np.concatenate([mu, np.zeros_like(mu)]),
             "spks": np.concatenate([spks, np.zeros_like(spks)]),
             "cond": np.concatenate([cond, np.zeros_like(cond)])}

    def velocity(step: int, x: np.ndarray) -> np.ndarray:
        ode_step = np.array([step], dtype=np.int64)
        return flow.estimator.infer({"x": x, "ode_step": ode_step, **feeds})["velocity"]

    return flow.solve(flow.initial_x(0, frames), velocity)[:, :, first:]


@pytest.mark.parametrize("n", [20, 250])
def test_a_cached_final_chunk_sees_every_frame_and_only_it_deviates(synth: Synthesizer,
                                                                     prompt: PromptFeatures, n: int) -> None:
    """`final_cached` without a window: every chunk before the final is the exact stream's to the bit; the
    final one is the flow over every frame with the block-causal mask, its own frames seeing all (to float
    rounding), not upstream's re-run under full attention, from which it deviates (printed); nothing held
    after it. 20 tokens: a final chunk alone, which is upstream's call."""
    p = prompt.speech_tokens.shape[1]
    exact, cached = synth.flow.stream(prompt), synth.flow.stream(prompt, final_cached=True)
    for tokens, offset, final in _schedule(ChunkPolicy(), p, n):
        start = cached.frames  # where the push's calls begin: after its caches (none before a first chunk)
        want, got = exact.push(tokens, finalize=final), cached.push(tokens, finalize=final)
        if not final:
            assert np.array_equal(got, want)
            continue
        emitted = prompt.mel.shape[1] + 2 * offset
        reference = _final_seeing_everything(synth, prompt, tokens, start)[:, :, emitted - start:]
        worst = float(np.abs(got - reference).max())
        deviation = np.abs(got - want)
        print(f"{n} tokens: final chunk of {got.shape[2]} frames against the one-call reference max abs "
              f"{worst:.2e}; against upstream's re-run max {deviation.max():.3g}, "
              f"mean {deviation.mean():.3g}")
        assert got.shape == want.shape and worst < MEL_MAX
        if offset == 0:
            assert deviation.max() < MEL_MAX  # no chunk before: every frame sees every frame, as upstream's
        else:
            assert 0 < deviation.mean() < 0.1
    assert cached.finished and cached.caches == [] and cached.cache_bytes == 0


def test_cosyvoice_run_takes_a_flow_window_and_refuses_a_bad_one(tmp_path: Path) -> None:
    """`--flow-window all|N` (with `--first-chunk-tokens` or not) is `ChunkPolicy(flow="window")`; a value
    that is not a count of blocks, or no `--stream`, is one line and exit status 2."""
    assert chunk_policy(None, None) is None
    assert chunk_policy(10, None) == ChunkPolicy(first_chunk_tokens=10)
    assert chunk_policy(None, "all") == ChunkPolicy(flow="window", flow_window=None)
    assert chunk_policy(10, 3) == ChunkPolicy(first_chunk_tokens=10, flow="window", flow_window=3)
    assert ChunkPolicy(flow="window", flow_window=None, first_chunk_tokens=10).summary() == (
        "the first chunk after 10 speech tokens; the final chunk run against the caches, attention kept to "
        "the prompt and every block (deviations from upstream)")
    out = tmp_path / "out.wav"
    base = ["--text", "Hi.", "--sampling", "greedy", "--out", str(out)]
    audio = {}
    for flags in ([], ["--flow-window", "all"], ["--flow-window", "2"]):
        result = CliRunner().invoke(run_main, [*base, "--stream", *flags])
        assert result.exit_code == 0, result.output
        audio[tuple(flags)] = sf.read(out, dtype="int16")[0]
    upstream, every, two = audio.values()
    assert len(every) == len(upstream) and not np.array_equal(every, upstream)  # its final chunk differs
    assert np.array_equal(two, every)  # 2.4 s of speech: a window of two blocks drops nothing
    for bad in ("0", "-1", "x", "1.5"):
        result = CliRunner().invoke(run_main, [*base, "--stream", "--flow-window", bad])
        assert result.exit_code == 2 and "Invalid value for '--flow-window': expected 'all' or a number of " \
            "1-s blocks >= 1" in result.stderr
    result = CliRunner().invoke(run_main, [*base, "--flow-window", "all"])
    assert result.exit_code == 2 and result.stderr == "error: --flow-window needs --stream\n"


# --- the caches left where the estimator computed them --------------------------------------------------


def test_caches_kept_on_the_device_give_the_same_stream(runtime_bundle: Path, prompt: PromptFeatures) -> None:
    """On a GPU an exact stream's DiT caches stay there between calls (`Flow.keep_on_device`, through
    `Runner.infer_kept`). Forced on the CPU provider, where the kept values are CPU `OrtValue`s: the same
    mel bit for bit, chunk by chunk, the caches (and the prompt's prefix) held as `OrtValue`s of the same
    size."""
    n = 250
    mels: dict[bool, list[np.ndarray]] = {}
    for keep in (False, True):
        with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
            assert not s.flow.keep_on_device  # the CPU provider keeps them on the host
            s.flow.keep_on_device = keep
            stream, mels[keep] = s.flow.stream(prompt), []
            for tokens, _, final in _schedule(ChunkPolicy(), prompt.speech_tokens.shape[1], n):
                mels[keep].append(stream.push(tokens, finalize=final))
                if not final:
                    held = [v for step in stream.caches for v in step.values()]
                    assert all(isinstance(v, ort.OrtValue) == keep for v in held)
                    assert stream.cache_bytes == _cache_bytes(s, stream.frames)
            prefix = s.flow.prefix(prompt)
            assert all(isinstance(v, ort.OrtValue) == keep for step in prefix.caches for v in step.values())
    assert len(mels[False]) == len(mels[True]) > 2
    for a, b in zip(mels[False], mels[True], strict=True):
        assert np.array_equal(a, b)


def test_a_window_drops_frames_where_the_caches_are(runtime_bundle: Path, prompt: PromptFeatures) -> None:
    """Kept on the device, a windowed stream's caches drop the frames outside the window there
    (`Flow.frame_copies`, onnxruntime's `Slice` and `Concat`), never crossing to the host. Forced on the CPU
    provider: the host's stream's mel bit for bit, chunk by chunk, the caches `OrtValue`s bounded to the
    window."""
    pytest.importorskip("onnx", reason="needs the onnx package (in the gpu and export extras), which builds "
                                       "the graph that drops the frames")
    p = prompt.speech_tokens.shape[1]
    head = -(-2 * p // BLOCK) * BLOCK
    mels: dict[bool, list[np.ndarray]] = {}
    for keep in (False, True):
        with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
            s.flow.keep_on_device = keep
            stream, mels[keep] = s.flow.stream(prompt, final_cached=True, window=2), []
            for tokens, _, final in _schedule(ChunkPolicy(), p, LONG):
                mels[keep].append(stream.push(tokens, finalize=final))
                if not final:
                    held = [v for step in stream.caches for v in step.values()]
                    assert all(isinstance(v, ort.OrtValue) == keep for v in held)
                    assert stream.cached_frames == min(stream.frames, head + 2 * BLOCK)
    assert stream.frames - head > 2 * BLOCK  # the window dropped frames
    assert len(mels[False]) == len(mels[True]) > 2
    for a, b in zip(mels[False], mels[True], strict=True):
        assert np.array_equal(a, b)
