"""Batched decoding (`cosyvoice_runtime.decode_batch`): concurrent decodings advanced by one `llm_decode` call
per step, each row at its own cache length and with its own sampler. On onnxruntime's CPU in float32 a row
is the same decoding run alone, to the bit: its ids, and the audio made of them; the fp16 body (float16
caches, CUDA's) gives each row its ids alone there too."""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnxruntime as ort
from click.testing import CliRunner

from cosyvoice_graphs import ODE_STEPS, spec
from cosyvoice_runtime import CosyVoice3, synthesis
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.decode_batch import BatchedDecoding, DecodeBatcher
from cosyvoice_runtime.decode_graphs import GraphedSteps
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.llm import LlmRequest
from cosyvoice_runtime.runners import CPU, CUDA, OPENVINO, ort_settings
from cosyvoice_runtime.sampling import make_sampler
from cosyvoice_runtime.synthesis import AudioChunk, Mode, Synthesizer, default_chunk_slots, llm_request

T = TypeVar("T")


class Recorder:
    """A `BatchObserver` that keeps what it is told, and with `batcher` the rows each call ran over (idle
    ones included)."""

    def __init__(self, batcher: Callable[[], DecodeBatcher | None] = lambda: None) -> None:
        self.sizes: list[int] = []
        self.call_rows: list[int] = []
        self.waits: list[float] = []
        self._batcher = batcher

    def step(self, rows: int, seconds: float) -> None:
        self.sizes.append(rows)
        batcher = self._batcher()
        if batcher is not None:
            self.call_rows.append(len(batcher.buffers.lengths))

    def admitted(self, waited: float) -> None:
        self.waits.append(waited)


def _requests(bundle: RuntimeBundle, n: int) -> list[LlmRequest]:
    """`n` requests of different lengths: prompts of different lengths, and texts whose max_len differ, so
    that the rows leave the batch one after another."""
    eop = bundle.endofprompt_id
    return [LlmRequest(text_ids=(*range(5, 12 + 3 * i), eop), prompt_speech_tokens=tuple(range(9 + 7 * i)))
            for i in range(n)]


def _concurrently(calls: list[Callable[[], T]]) -> list[T]:
    """Each call on a thread of its own, all started together; their results in order (the first error
    raised in one of them is raised here)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result(timeout=120) for future in futures]


@pytest.mark.parametrize("sampling", ["ras", "greedy"])
@pytest.mark.parametrize(("body", "in_slots", "graphs"), [("fp32_decode_bundle", False, False),
                                                          ("fp32_decode_bundle", True, False),
                                                          ("fp32_decode_bundle", True, True),
                                                          ("fp16_decode_bundle", False, False)])
def test_batched_rows_are_the_decodings_alone(body: str, in_slots: bool, graphs: bool, sampling: str,
                                              request: pytest.FixtureRequest) -> None:
    """Five decodings, at most three in the batch: two wait for a row and join mid-batch as others leave at
    their own max_len; every one's ids equal its run alone. Rows packed (the CPU's way), and in slots (a
    GPU's: the batcher prefills each decoding into a free row on `llm_decode`, as a GPU's run alone does;
    here in the CPU's memory), there also through the bindings that CUDA graphs replay (`GraphedSteps`;
    on the CPU, ordinary calls)."""
    bundle = RuntimeBundle.open(request.getfixturevalue(body))
    requests = _requests(bundle, 5)
    with Synthesizer(bundle, threads=1) as alone:
        assert alone.batcher is None
        runs = [alone.decode(r, make_sampler(sampling, seed=i)) for i, r in enumerate(requests)]
        want = [list(run) for run in runs]
        steps = [run.steps for run in runs]  # a step more than ids where a stop id ended it
    assert len(set(steps)) == 5  # each leaves at its own step
    with Synthesizer(bundle, threads=1) as synth:
        observed = Recorder()
        assert synth.lm.in_place is not None
        graphed = GraphedSteps(synth.lm.in_place) if graphs else None
        batcher = DecodeBatcher(synth.lm, 3, observed, in_slots=in_slots, graphs=graphed)
        try:
            got = _concurrently([lambda r=r, i=i: list(batcher.submit(synth.lm.decode(
                r, make_sampler(sampling, seed=i)))) for i, r in enumerate(requests)])
            assert batcher.size == 0 and batcher.buffers.lengths == []
            assert graphed is None or graphed.graphs > 0
        finally:
            batcher.close()
    assert got == want
    assert graphed is None or graphed.graphs == 0  # released with the batch
    assert len(observed.waits) == 5  # every decoding joined
    assert max(observed.sizes) == 3 and min(observed.sizes) < 3  # full, and smaller as rows left
    assert sum(observed.sizes) == sum(steps) - 5  # every step after each prefill, batched


class Replay:
    """A sampler that keeps the log-probs it is shown and returns their argmax, or, given another run's ids,
    that run's in turn (teacher forcing)."""

    def __init__(self, ids: list[int] | None = None) -> None:
        self.forced = ids
        self.ids: list[int] = []
        self.seen: list[np.ndarray] = []

    def __call__(self, logp: np.ndarray, history: Sequence[int]) -> int:
        self.seen.append(logp.copy())
        token = int(np.argmax(logp)) if self.forced is None else self.forced[len(self.ids)]
        self.ids.append(token)
        return token


@pytest.mark.parametrize(("body", "provider", "graphs"), [("fp32_decode_bundle", CPU, False),
                                                          ("fp16_decode_bundle", CUDA, False),
                                                          ("fp16_decode_bundle", CUDA, True)])
def test_batched_rows_follow_their_runs_alone(body: str, provider: str, graphs: bool,
                                              request: pytest.FixtureRequest) -> None:
    """On a GPU a row's arithmetic may differ from its run alone in the last bits (the kernels follow the
    batch's shape). Five decodings, greedy alone, then in a batch of three (on a GPU in slots, prefilled by
    the batcher; and the steps replayed from CUDA graphs) fed the ids they took alone: the log-probs within
    the fp16 bound of theirs alone, and the same greedy id wherever alone the best two differ by more than
    twice the worst difference; on the CPU in float32, equal to the bit."""
    if provider == CUDA and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime's CUDA provider (onnxruntime-gpu and a GPU)")
    bundle = RuntimeBundle.open(request.getfixturevalue(body))
    requests = _requests(bundle, 5)
    speech = bundle.dims.speech_token_size
    alone = [Replay() for _ in requests]
    with Synthesizer(bundle, provider, threads=1, max_batch=1, cuda_graphs=False) as synth:  # as launched
        for r, sampler in zip(requests, alone, strict=True):
            synth.decode(r, sampler, max_tokens=60, ignore_stop=True).run()
    batched = [Replay(sampler.ids) for sampler in alone]
    with Synthesizer(bundle, provider, threads=1, max_batch=3, cuda_graphs=graphs) as synth:
        assert synth.batcher is not None and synth.batcher.prefills == (provider != CPU)
        assert (synth.batcher.graphs is not None) == graphs
        _concurrently([lambda r=r, s=s: list(synth.decode(r, s, max_tokens=60, ignore_stop=True))
                       for r, s in zip(requests, batched, strict=True)])
    pairs = [(a[:speech], b[:speech]) for x, y in zip(alone, batched, strict=True)
             for a, b in zip(x.seen, y.seen, strict=True)]
    assert len(pairs) == 5 * 60
    worst = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in pairs)
    if provider == CPU:
        assert worst == 0
        return
    bound = spec("llm_decode", bundle.dims).precision_tolerances["fp16"]["logp"].bound
    assert worst < bound, f"log-probs {worst:.3g} of their scale from their runs alone, bound {bound}"
    for step, (a, b) in enumerate(pairs):
        best, second = np.sort(a)[-2:][::-1]
        if best - second > 2 * worst * np.abs(a).max():
            assert np.argmax(a) == np.argmax(b), f"step {step % 60} of decoding {step // 60}: another best id"


def test_a_last_row_leaving_takes_the_free_rows_before_it(fp32_decode_bundle: Path) -> None:
    """In slots: the middle row ends first and stays free, then the last one ends, which frees both (the
    calls stop at the first row); the first row runs on to its end, its ids its run's alone."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    requests = _requests(bundle, 3)
    steps = (40, 5, 12)  # the middle one ends first, the last one next
    with Synthesizer(bundle, threads=1) as alone:
        want = [list(alone.decode(r, make_sampler("greedy"), max_tokens=n, ignore_stop=True))
                for r, n in zip(requests, steps, strict=True)]
    with Synthesizer(bundle, threads=1) as synth:
        batcher = DecodeBatcher(synth.lm, 3, observed := Recorder(lambda: batcher), in_slots=True)
        try:
            decodings = [batcher.submit(synth.lm.decode(r, make_sampler("greedy"), max_tokens=n,
                                                        ignore_stop=True))
                         for r, n in zip(requests, steps, strict=True)]
            firsts = [next(d) for d in decodings]  # one after another: rows 0, 1 and 2
            got = _concurrently([lambda d=d, f=f: [f, *d] for d, f in zip(decodings, firsts, strict=True)])
        finally:
            batcher.close()
    assert got == want
    assert (3, 3) in zip(observed.sizes, observed.call_rows, strict=False)
    assert (2, 3) in zip(observed.sizes, observed.call_rows, strict=False)  # the middle row free, idle
    assert observed.call_rows[-1] == 1  # then the calls over the first row alone


@pytest.mark.parametrize("in_slots", [False, True])
def test_a_closed_decoding_leaves_the_batch(fp32_decode_bundle: Path, in_slots: bool) -> None:
    """A consumer that stops (a client gone) frees its row at the next step; the others run on unchanged,
    past the buffers' first size. In slots the first row stays free, an idle row of the calls, until a new
    decoding takes it."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    first, second, third = _requests(bundle, 3)
    with Synthesizer(bundle, threads=1) as alone:
        want = list(alone.decode(second, make_sampler("ras", seed=1), max_tokens=300, ignore_stop=True))
        want_third = list(alone.decode(third, make_sampler("ras", seed=2), max_tokens=40, ignore_stop=True))
    with Synthesizer(bundle, threads=1) as synth:
        batcher = DecodeBatcher(synth.lm, 2, observed := Recorder(lambda: batcher), in_slots=in_slots)
        try:
            leaving = batcher.submit(synth.lm.decode(first, make_sampler("ras", seed=0), max_tokens=300,
                                                     ignore_stop=True))
            staying = batcher.submit(synth.lm.decode(second, make_sampler("ras", seed=1), max_tokens=300,
                                                     ignore_stop=True))
            ids = [next(leaving) for _ in range(3)]
            rest: list[int] = []
            thread = threading.Thread(target=lambda: rest.extend(staying))
            thread.start()
            _until(lambda: batcher.size == 2)
            leaving.close()
            _until(lambda: batcher.size <= 1)
            assert len(leaving.tokens) < 300
            assert list(leaving) == [] and len(ids) == 3
            if in_slots:  # the second keeps its row, behind the first's, free now: calls over two rows
                _until(lambda: (1, 2) in zip(observed.sizes, observed.call_rows, strict=False))
                joining = batcher.submit(synth.lm.decode(third, make_sampler("ras", seed=2), max_tokens=40,
                                                         ignore_stop=True))
                assert list(joining) == want_third  # in the free row (of two), which held the first's cache
            thread.join(timeout=120)
        finally:
            batcher.close()
    assert rest == want
    assert max(observed.sizes) == 2


def test_while_chunks_are_due_the_batch_steps_only_for_streams_without_audio(fp32_decode_bundle: Path
                                                                              ) -> None:
    """While chunks it yields to run or wait (`chunks_due`), the batch steps for a consumer that has sent no
    audio and waits for ids, and not for one that has sent audio: its ids wait until the chunks are done,
    then come as before."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    early, late = _requests(bundle, 2)
    due = threading.Event()
    due.set()
    with Synthesizer(bundle, threads=1) as synth:
        batcher = DecodeBatcher(synth.lm, 2, observed := Recorder(), chunks_due=due.is_set)
        try:
            sent = batcher.submit(synth.lm.decode(early, make_sampler("ras", seed=0), max_tokens=300,
                                                  ignore_stop=True))
            sent.sent_audio = True
            assert next(sent) is not None  # from its prefill, on this thread
            silent = batcher.submit(synth.lm.decode(late, make_sampler("ras", seed=1), max_tokens=300,
                                                    ignore_stop=True))
            assert len([next(silent) for _ in range(5)]) == 5  # no audio yet: the batch steps for it
            steps = -1
            while steps != len(observed.sizes) or not sent.ids.empty():  # until a step in flight has ended
                steps = len(observed.sizes)
                while not sent.ids.empty():
                    next(sent)
                time.sleep(0.2)
            got: list[int] = []
            thread = threading.Thread(target=lambda: got.append(next(sent)))
            thread.start()
            thread.join(0.5)
            assert thread.is_alive() and not got and len(observed.sizes) == steps  # it waits
            due.clear()
            batcher.wake()
            thread.join(30)
            assert len(got) == 1 and len(observed.sizes) > steps
        finally:
            batcher.close()


def test_a_batched_stream_tells_the_batch_once_its_first_audio_is_out(fp32_decode_bundle: Path,
                                                                       prompt_wav: Path, prompt_text: str
                                                                       ) -> None:
    """On the CPU the pipeline's batch with one chunk slot pauses for every chunk its turns hold or queue
    (`ChunkTurns.full`, woken as each turn ends), and a stream's decoding is marked as having sent audio once
    its first chunk is made."""
    with CosyVoice3(fp32_decode_bundle, threads=1, max_batch=2, chunk_slots=1) as voice:
        synth = voice.synth
        assert synth.turns is not None and synth.batcher is not None and synth.turns.slots == 1
        assert synth.turns.on_done == synth.batcher.wake and not synth.batcher.chunks_due()
        for first in (True, False):
            with synth.turns.turn(first=first):
                assert synth.batcher.chunks_due()
        assert not synth.batcher.chunks_due()
        prompt = voice.prompt_features(prompt_wav)
        piece = voice.segments(Mode.ZERO_SHOT, "A sentence long enough for two chunks of speech, at least.",
                               prompt_text=prompt_text)[0]
        decoding = synth.decode(llm_request(Mode.ZERO_SHOT, piece.text_ids, prompt, piece.prompt_text_ids),
                                make_sampler("ras", seed=0), max_tokens=120, ignore_stop=True)
        assert isinstance(decoding, BatchedDecoding)
        chunks = synth.stream_tokens(decoding, prompt)
        assert not decoding.sent_audio
        first = next(chunks)
        assert first.index == 0 and decoding.sent_audio
        assert [c.index for c in chunks][-1] > 0
        decoding.close()

        # the same where the ids are watched on their way (the server's cancellation check wraps them)
        made: list[Iterator[int]] = []

        def keep(*args: Any, **kwargs: Any) -> Iterator[int]:
            made.append(decode(*args, **kwargs))
            return made[-1]

        decode = synth.decode
        synth.decode = keep  # type: ignore[method-assign]
        speech = voice.speak(piece, prompt, Mode.ZERO_SHOT, stream=True, max_tokens=120, ignore_stop=True,
                             watch=lambda ids: (i for i in ids))
        watched = iter(speech)
        assert next(watched).index == 0
        assert isinstance(made[0], BatchedDecoding) and made[0].sent_audio
        speech.close()


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_final_chunk_holds_back_for_a_new_streams_first_audio(fp32_decode_bundle: Path, prompt_wav: Path,
                                                                 prompt_text: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With one chunk slot on the CPU, a stream's final chunk (the flow's full re-run, one DiT call per ODE
    step) makes no DiT call while a stream that started meanwhile computes its first ids (the batch works for
    its first audio) and hands the slot to its first chunk: the new stream's first audio comes out before the
    final chunk's, and each stream's audio is its audio alone."""
    with CosyVoice3(fp32_decode_bundle, threads=1, max_batch=2, chunk_slots=1) as voice:
        synth = voice.synth
        assert synth.turns is not None and synth.batcher is not None
        batcher = synth.batcher
        prompt = voice.prompt_features(prompt_wav)
        piece = voice.segments(Mode.ZERO_SHOT, "A sentence long enough for two chunks of speech, at least.",
                               prompt_text=prompt_text)[0]
        old = np.random.default_rng(3).integers(0, synth.dims.speech_token_size, 70).tolist()

        def new_stream() -> Iterator[AudioChunk]:
            return synth.stream(piece.text_ids, prompt, sampler=make_sampler("ras", seed=5),
                                prompt_text_ids=piece.prompt_text_ids, max_tokens=60, ignore_stop=True)

        alone = {"old": [c.samples for c in synth.stream_tokens(old, prompt)],
                 "new": [c.samples for c in new_stream()]}
        assert len(alone["old"]) > 1 and len(alone["new"]) > 1
        events: list[str] = []
        got: dict[str, list[np.ndarray]] = {"old": [], "new": []}

        def consume(name: str, chunks: Iterator[AudioChunk]) -> None:
            for chunk in chunks:
                got[name].append(chunk.samples)
                events.append(f"{name} {'final' if chunk.is_final else chunk.index}")

        newcomer = threading.Thread(target=lambda: consume("new", new_stream()))
        infer_outputs = synth.flow.estimator.infer_outputs

        def dit_call(feeds: Any, names: Any) -> dict[str, np.ndarray]:
            if threading.current_thread() is newcomer:
                events.append("new DiT call")
            elif list(names) == ["velocity"]:  # only a final chunk's re-run fetches the velocity alone
                events.append("old DiT call")
                if not newcomer.is_alive() and not got["new"]:  # the re-run's first call: a stream starts
                    events.append("new starts")
                    newcomer.start()
                    _until(batcher.first_audio_due)
            return infer_outputs(feeds, names)

        monkeypatch.setattr(synth.flow.estimator, "infer_outputs", dit_call)
        consume("old", synth.stream_tokens(old, prompt))
        newcomer.join(60)
    # after the new stream starts, the old one's next DiT call waits for its ids and then its first chunk
    after = events[events.index("new starts") + 1:]
    assert after[:ODE_STEPS] == ["new DiT call"] * ODE_STEPS
    assert events.index("new 0") < events.index("old final")
    for name, chunks in got.items():
        assert len(chunks) == len(alone[name])
        assert all(np.array_equal(a, b) for a, b in zip(chunks, alone[name], strict=True))


def test_the_batch_says_when_it_works_for_a_streams_first_audio(fp32_decode_bundle: Path) -> None:
    """`first_audio_due`: while a decoding that a stream makes chunks of and that has sent no audio waits for
    its ids in a row; not for a decoding no stream marked (an offline request's), nor once the stream has
    sent audio, nor after it ends."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    offline_request, streamed_request = _requests(bundle, 2)
    with Synthesizer(bundle, threads=1) as synth:
        batcher = DecodeBatcher(synth.lm, 2)
        try:
            def seen_while(decoding: BatchedDecoding, ids: int) -> set[bool]:
                """`first_audio_due` sampled while a thread takes `ids` ids of `decoding`."""
                thread = threading.Thread(target=lambda: [next(decoding) for _ in range(ids)])
                seen: set[bool] = set()
                thread.start()
                while thread.is_alive():
                    seen.add(batcher.first_audio_due())
                thread.join()
                return seen

            offline = batcher.submit(synth.lm.decode(offline_request, make_sampler("ras", seed=0),
                                                     max_tokens=300, ignore_stop=True))
            assert seen_while(offline, 150) == {False}
            streamed = batcher.submit(synth.lm.decode(streamed_request, make_sampler("ras", seed=1),
                                                      max_tokens=300, ignore_stop=True))
            streamed.mark_streamed()
            assert True in seen_while(streamed, 150)
            streamed.sent_audio = True
            assert seen_while(streamed, 100) == {False}
            streamed.sent_audio = False
            assert list(streamed)[-1] is not None  # to its end: no longer counted
            assert not batcher.first_audio_due()
            offline.close()
        finally:
            batcher.close()


def test_many_texts_in_a_batch_are_each_text_alone(fp32_decode_bundle: Path, prompt_wav: Path,
                                                    prompt_text: str) -> None:
    """`synthesize_many` (three texts, their decodings batched) and streams on threads of their own: the audio
    of each text is its audio alone, to the bit."""
    texts = ["Hello there, this is one.", "A second sentence, longer than the first one is.", "Third."]
    with CosyVoice3(fp32_decode_bundle, threads=1, seed=7) as voice:
        want = [np.concatenate([c["tts_speech"][0] for c in voice.inference_zero_shot(t, prompt_text,
                                                                                       prompt_wav)])
                for t in texts]
        want_streamed = [[c["tts_speech"][0] for c in voice.inference_zero_shot(t, prompt_text, prompt_wav,
                                                                                 stream=True)] for t in texts]
    observed = Recorder()
    with CosyVoice3(fp32_decode_bundle, threads=1, seed=7, max_batch=3, batch_observer=observed) as voice:
        got = voice.synthesize_many(texts, prompt_wav, prompt_text=prompt_text)
        assert max(observed.sizes) > 1
        streamed = _concurrently([lambda t=t: [c["tts_speech"][0] for c in voice.inference_zero_shot(
            t, prompt_text, prompt_wav, stream=True)] for t in texts])
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    for chunks, wanted in zip(streamed, want_streamed, strict=True):
        assert len(chunks) == len(wanted) > 1
        assert all(np.array_equal(a, b) for a, b in zip(chunks, wanted, strict=True))


def test_a_batch_left_open_stops_once_its_object_is_collected(fp32_decode_bundle: Path, prompt_wav: Path,
                                                              prompt_text: str) -> None:
    """The batch's thread holds the graphs: an object dropped unclosed lets them go once collected. A stream
    still iterated keeps its object, and the batch with it."""
    voice = CosyVoice3(fp32_decode_bundle, threads=1, max_batch=2)
    outputs = voice.inference_zero_shot("Hi.", prompt_text, prompt_wav, stream=True)
    batcher = voice.synth.batcher
    assert batcher is not None
    del voice
    gc.collect()
    assert next(outputs)["tts_speech"].size > 0  # its object is alive while it is iterated
    thread = batcher._thread
    assert thread is not None and thread.is_alive()
    del outputs
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_batching_needs_llm_decode(runtime_bundle: Path) -> None:
    with pytest.raises(UserError, match="max_batch 2: batched decoding runs on llm_decode, on the cpu "):
        CosyVoice3(runtime_bundle, threads=1, max_batch=2)
    with pytest.raises(UserError, match="max_batch is 17; expected 1 to 16"):
        CosyVoice3(runtime_bundle, threads=1, max_batch=17)
    with pytest.raises(UserError, match="chunk_slots is 0; expected 1 to 16"):
        CosyVoice3(runtime_bundle, threads=1, chunk_slots=0)
    with pytest.raises(UserError, match=r"chunk_slots 2: the slots are a decode batch's, and max_batch is 1"):
        CosyVoice3(runtime_bundle, threads=1, chunk_slots=2)  # not silently unused


def test_the_chunks_slots_follow_the_cores_on_a_cpu_and_the_batch_on_a_gpu(
        fp32_decode_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a batch's chunks run as many at once as the usable CPUs hold at the graphs' threads (one
    where the threads are onnxruntime's default, every core), and every stream's on a GPU; a caller's count
    is kept, and a bad one refused before the batch changes."""
    monkeypatch.setattr(synthesis, "usable_cpus", lambda: 16)
    monkeypatch.setattr(ort_settings, "usable_cpus", lambda: 16)  # what --threads may take
    assert [default_chunk_slots(CPU, 8, threads) for threads in (None, 1, 2, 3, 16, 32)] == [1, 8, 8, 5, 1, 1]
    assert default_chunk_slots(OPENVINO, 4, 2) == 4 and default_chunk_slots(CUDA, 4, None) == 4
    with CosyVoice3(fp32_decode_bundle, threads=4, max_batch=3) as voice:
        synth = voice.synth
        assert synth.turns is not None and synth.turns.slots == 3  # 16 cores hold 4 chunks; the batch has 3
        synth.set_max_batch(3, chunk_slots=2)
        assert synth.turns is not None and synth.turns.slots == 2
        batcher = synth.batcher
        with pytest.raises(UserError, match="chunk_slots is 17; expected 1 to 16"):
            synth.set_max_batch(3, chunk_slots=17)
        assert synth.batcher is batcher and synth.turns.slots == 2
        with pytest.raises(UserError, match="chunk_slots 2: the slots are a decode batch's"):
            synth.set_max_batch(1, chunk_slots=2)
        synth.set_max_batch(1)
        assert synth.turns is None


def test_the_server_batches_its_sessions_and_reports_the_batch(fp32_decode_bundle: Path, prompt_wav: Path,
                                                                prompt_text: str, tmp_path: Path) -> None:
    """`--max-batch 3`: three concurrent upstream requests run at once, their decodings in one batch, each
    answered with the audio it gets alone; /metrics shows the batch sizes."""
    pytest.importorskip("fastapi", reason="needs the serve extra")
    from fastapi.testclient import TestClient

    from cosyvoice_serve.app import create_app
    from cosyvoice_serve.engine import Engine
    from cosyvoice_serve.settings import ServerSettings

    texts = ["Hello there, this is one.", "A second sentence, longer than the first one is.", "Third."]
    upload = {"prompt_wav": ("prompt.wav", prompt_wav.read_bytes(), "audio/wav")}

    def answers(max_batch: int) -> tuple[list[bytes], str]:
        engine = Engine(RuntimeBundle.open(fp32_decode_bundle), "the tiny bundle", threads=1,
                        max_batch=max_batch)
        settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", max_batch=max_batch)
        try:
            with TestClient(create_app(engine, settings)) as client:
                responses = _concurrently([lambda t=t: client.post(
                    "/inference_zero_shot", data={"tts_text": t, "prompt_text": prompt_text}, files=upload)
                    for t in texts])
                assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
                return [r.content for r in responses], client.get("/metrics").text
        finally:
            engine.close()

    alone, unbatched_metrics = answers(1)
    batched, metrics = answers(3)
    assert batched == alone
    assert "tts_decode_batch_size" not in unbatched_metrics
    single_rows = _metric(metrics, 'tts_decode_batch_size_bucket{le="1"}')
    assert _metric(metrics, "tts_decode_batch_size_count") > single_rows  # some steps advanced several
    assert _metric(metrics, "tts_decode_batch_wait_seconds_count") == 3  # every session joined the batch


def test_the_server_batches_by_default_where_a_gpu_decodes(fp16_decode_bundle: Path, fp32_decode_bundle: Path
                                                           ) -> None:
    """`--max-batch` not given: `GPU_MAX_BATCH` sessions on cuda where the decode steps batch there (an fp16
    `llm_decode`), else one, on the CPU too (a batch there is asked for); the engine resolves it, with CUDA
    graphs wherever the runtime replays them."""
    pytest.importorskip("fastapi", reason="needs the serve extra")
    from cosyvoice_runtime.synthesis import GPU_MAX_BATCH, default_max_batch
    from cosyvoice_serve.engine import Engine
    from cosyvoice_serve.settings import ServerSettings

    fp16, fp32 = RuntimeBundle.open(fp16_decode_bundle), RuntimeBundle.open(fp32_decode_bundle)
    assert default_max_batch(fp16, CUDA) == GPU_MAX_BATCH == 4
    assert default_max_batch(fp16, CPU) == default_max_batch(fp32, CPU) == default_max_batch(fp32, CUDA) == 1
    assert default_max_batch(RuntimeBundle.open(DEMO_BUNDLE), CUDA) == 1  # decodes on llm
    engine = Engine(fp32, "the tiny bundle", threads=1)
    try:
        assert (engine.max_batch, engine.cuda_graphs, engine.batch_metrics) == (1, False, None)
        assert engine.synth.batcher is None
    finally:
        engine.close()
    asked = Engine(fp32, "the tiny bundle", threads=1, max_batch=3)
    try:
        assert asked.max_batch == 3 and asked.synth.batcher is not None and asked.synth.batcher.max_batch == 3
        assert ServerSettings().sessions_at_once(asked.max_batch) == 3
        assert ServerSettings(max_concurrency=5).sessions_at_once(asked.max_batch) == 5
    finally:
        asked.close()


def test_the_python_object_takes_the_runtimes_default_batch(fp32_decode_bundle: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`CosyVoice3` without `max_batch` decodes in the batch `synthesis.default_max_batch` gives (the server's
    default: 4 on cuda where the bundle batches there)."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    with CosyVoice3(bundle, threads=1, verify=False) as voice:
        assert voice.synth.batcher is None  # 1 on the CPU
    monkeypatch.setattr(synthesis, "default_max_batch", lambda b, provider: 3)
    with CosyVoice3(bundle, threads=1, verify=False) as voice:
        assert voice.synth.batcher is not None and voice.synth.batcher.max_batch == 3


def _metric(text: str, name: str) -> float:
    """A metric's value in the Prometheus text format."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_benchmark_has_a_batched_column(fp32_decode_bundle: Path, tmp_path: Path) -> None:
    """`cosyvoice-bench` on a bundle that batches: each concurrency level also runs its sessions with their
    decodings in one batch, whose audio is the single stream's, and the table shows the ratio."""
    from cosyvoice_bench.cli import main as bench

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, ["--model", str(fp32_decode_bundle), "--quick", "--threads", "1",
                                        "--json", str(out), "--no-progress", "--lengths", "short",
                                        "--concurrency", "1,3", "--chunk-slots", "2"])
    assert result.exit_code == 0, result.output
    assert all(column in result.output for column in ("batched audio s/s", "ratio", "chunk slots"))
    document = json.loads(out.read_text())
    assert document["settings"]["chunk_slots"] == 2
    one, three = document["concurrency"]
    assert (one["level"], three["level"]) == (1, 3) and one["batched"] is None  # a batch of one is no batch
    batched = three["batched"]
    assert batched["chunk_slots"] == 2  # two of the three sessions' chunks at once
    assert three["outputs_match"] is True and batched["outputs_match"] is True
    assert batched["audio_s_per_s"] > 0 and batched["llm_tokens_per_s"] > 0
    assert batched["first_chunk_mean_s"] <= batched["first_chunk_p95_s"] <= batched["first_chunk_max_s"]
    assert three["batched_window"] is None  # no --flow-window


def test_the_benchmark_streams_the_batch_on_the_flow_window(fp32_decode_bundle: Path, tmp_path: Path) -> None:
    """With `--flow-window`, each level's batched sessions run again on it: every session's audio is a
    single stream's on that window, which is not upstream's flow's (the long case ends in a final chunk
    after earlier ones, so a window of one block changes it)."""
    from cosyvoice_bench.cli import main as bench

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, ["--model", str(fp32_decode_bundle), "--quick", "--threads", "1",
                                        "--json", str(out), "--no-progress", "--lengths", "long",
                                        "--concurrency", "1,2", "--flow-window", "1"])
    assert result.exit_code == 0, result.output
    assert all(column in result.output for column in ("window audio s/s", "window/batched"))
    document = json.loads(out.read_text())
    one, two = document["concurrency"]
    assert one["batched_window"] is None  # a batch of one is no batch
    window, batched = two["batched_window"], two["batched"]
    assert window["outputs_match"] is True and window["tokens_match"] is True
    assert batched["outputs_match"] is True
    assert window["audio_s"] == batched["audio_s"] and window["audio_s_per_s"] > 0
    assert window["first_chunk_mean_s"] <= window["first_chunk_p95_s"] <= window["first_chunk_max_s"]
    assert "batched_window" in document["notes"]["stream_policy"]
