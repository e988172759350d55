"""Speakers' flow prefixes computed in the background (`cosyvoice_runtime.prefix_jobs`) on the demo bundle:
the prefix appears without a stream and gives the lazily computed one's samples, the first stream then skips
the prefix's frames, deletion and replacement cancel, live streams go first, a stream needing a paused
job's prefix computes it itself, and the server's routes queue and cancel the jobs."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.flow_prefix import prompt_key
from cosyvoice_runtime.prefix_jobs import JobState, PrefixJob, PrefixJobs
from cosyvoice_runtime.runners import Runner

PROMPT_WAV = DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = (DEMO_BUNDLE / "asset" / "zero_shot_prompt.txt").read_text(encoding="utf-8").strip()
TEXT = "Hello there. How are you?"
WAIT = 120.0
"""Seconds a test waits for a background job before failing (never a measure of order)."""
JOBS_THREAD = "flow-prefix-jobs"


@pytest.fixture
def voice(tmp_path: Path) -> Iterator[CosyVoice3]:
    """A fresh runtime object per test (its own cache, jobs and thread), one intra-op thread."""
    with CosyVoice3(DEMO_BUNDLE, threads=1, sampling="greedy", speakers_dir=tmp_path / "speakers") as v:
        yield v


def _shorter_prompt() -> tuple[np.ndarray, int]:
    """Another prompt: the demo prompt's first 80 %, a different `prompt_key` with a prefix of its own."""
    samples, rate = sf.read(PROMPT_WAV, dtype="float32")
    return samples[: len(samples) * 4 // 5], int(rate)


def _record(runner: Runner, name: str, events: list[tuple[str, str, int]], monkeypatch: pytest.MonkeyPatch
            ) -> None:
    """Append (thread, graph, offset) to `events` at every call of `runner` (offset: the first new frame)."""
    run = runner.infer_outputs

    def infer_outputs(feeds: Mapping[str, Any], names: Sequence[str]) -> dict[str, np.ndarray]:
        offset = int(np.asarray(feeds["positions"])[0]) if "positions" in feeds else 0
        events.append((threading.current_thread().name, name, offset))
        return run(feeds, names)

    monkeypatch.setattr(runner, "infer_outputs", infer_outputs)


def _graph_events(voice: CosyVoice3, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    events: list[tuple[str, str, int]] = []
    _record(voice.synth.flow.encoder, "flow_encoder", events, monkeypatch)
    _record(voice.synth.flow.estimator, "flow_estimator_cached", events, monkeypatch)
    return events


def _stream(voice: CosyVoice3, speaker: str) -> list[np.ndarray]:
    return [o["tts_speech"][0] for o in voice.inference_zero_shot(TEXT, "", None, zero_shot_spk_id=speaker,
                                                                  stream=True)]


def _until(jobs: PrefixJobs, check: Any) -> None:
    """Wait (on the jobs' condition, notified at every change) until `check()`."""
    with jobs.live.cond:
        assert jobs.live.cond.wait_for(check, WAIT), "the background job did not get there"


def _job(jobs: PrefixJobs, name: str) -> PrefixJob:
    """The queued or running job of speaker `name` (submitting what is queued returns that job)."""
    key = jobs._names[name]
    with jobs.live.cond:
        job = jobs._queue.get(key) or jobs._running
    assert job is not None and job.key == key
    return job


def test_a_registered_speakers_prefix_is_computed_without_a_stream(voice: CosyVoice3,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache, jobs = voice.synth.flow.prefixes, voice.prefix_jobs
    assert voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "alice") is True
    assert voice.wait_prefixes(WAIT)
    features = voice._added["alice"].features
    key = prompt_key(features)
    assert key in cache and (cache.hits, cache.misses) == (0, 0)
    assert jobs.counts[JobState.QUEUED] == jobs.counts[JobState.DONE] == 1 and jobs.pending == 0
    prefix = cache.get(features, lambda: pytest.fail("computed again"))
    assert prefix.frames == voice.synth.flow.prefix_frames(features.speech_tokens.shape[1]) > 0
    assert prefix.nbytes == voice.synth.flow.prefix_nbytes(features.speech_tokens.shape[1])
    assert voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "alice") is True  # the same again: kept
    assert voice.wait_prefixes(WAIT) and jobs.counts[JobState.QUEUED] == 1 and key in cache

    # the first stream starts after the prefix: no graph call runs over its frames
    events = _graph_events(voice, monkeypatch)
    precomputed = _stream(voice, "alice")
    assert (cache.hits, cache.misses) == (2, 0)
    first_cached = [offset for _, graph, offset in events if graph == "flow_estimator_cached"][0]
    assert first_cached == prefix.frames

    # the same samples as a stream that computes the prefix itself
    again = voice.synth.flow.compute_prefix(features)
    for got, want in zip(prefix.caches, again.caches, strict=True):
        assert all(np.array_equal(got[name], want[name]) for name in want)
    cache.clear()
    lazy = _stream(voice, "alice")
    assert cache.misses == 1
    assert len(lazy) == len(precomputed) > 1
    assert all(np.array_equal(a, b) for a, b in zip(lazy, precomputed, strict=True))


def test_deleting_or_replacing_a_speaker_cancels_its_job(voice: CosyVoice3) -> None:
    cache, jobs, live = voice.synth.flow.prefixes, voice.prefix_jobs, voice.synth.live
    with live.held():  # a synthesis in flight: the jobs wait before their first graph call
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "bob")
        job = _job(jobs, "bob")
        _until(jobs, lambda: job.waits >= 1)
        assert (job.state, job.graph_calls) == (JobState.RUNNING, 0)
        assert jobs.cancel("bob") and job.state is JobState.CANCELLED
        assert not jobs.cancel("bob")  # cancelled already

        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "carol")
        first = _job(jobs, "carol")
        voice.add_zero_shot_spk(TRANSCRIPT, _shorter_prompt(), "carol")  # replaced before it ran
        second = _job(jobs, "carol")
        assert first.key != second.key
        assert first.state is JobState.CANCELLED and second.state in (JobState.QUEUED, JobState.RUNNING)
    assert voice.wait_prefixes(WAIT)
    assert second.state is JobState.DONE
    assert job.key not in cache and first.key not in cache and second.key in cache
    assert job.graph_calls == first.graph_calls == 0
    assert jobs.counts[JobState.CANCELLED] == 2 and jobs.counts[JobState.DONE] == 1

    jobs.cancel("carol")  # deleted after its job finished: its prefix goes too
    assert second.key not in cache and len(cache) == 0


def test_deleting_a_speaker_keeps_a_prefix_it_found_kept(voice: CosyVoice3) -> None:
    """A stream that is no speaker's (an upload, the bundle's own voice) computed the prefix; a speaker of
    the same recording finds it kept, and deleting the speaker leaves it for those streams."""
    cache, jobs = voice.synth.flow.prefixes, voice.prefix_jobs
    uploaded = [o["tts_speech"][0] for o in voice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV),
                                                                      stream=True)]
    assert len(cache) == 1 and (cache.hits, cache.misses) == (0, 1) and len(uploaded) > 1
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "dave")
    assert voice.wait_prefixes(WAIT) and jobs.counts[JobState.DONE] == 0  # found kept: nothing computed
    assert jobs.cancel("dave") and len(cache) == 1
    list(voice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV), stream=True))
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_speaker_added_without_a_job_has_its_prefix_held_all_the_same(voice: CosyVoice3) -> None:
    """`precompute=False` queues nothing, but the prefix the speaker's first stream computes is held as a
    speaker's (ahead of uploads'), and let go when the speaker is replaced."""
    cache, jobs = voice.synth.flow.prefixes, voice.prefix_jobs
    voice.add_zero_shot_spk(TRANSCRIPT, _shorter_prompt(), "frank", precompute=False)
    key = jobs.speakers()["frank"]
    assert jobs.counts[JobState.QUEUED] == 0 and jobs.pending == 0 and key not in cache and key in cache._held
    assert len(_stream(voice, "frank")) > 1 and key in cache and cache.misses == 1
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "frank", precompute=False)
    assert key not in cache._held and jobs.speakers()["frank"] in cache._held
    assert key in cache  # computed by a stream, not by a job: it stays for uploads of that recording
    assert jobs.counts[JobState.QUEUED] == 0


def test_a_live_stream_goes_first(voice: CosyVoice3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job queued while a stream is in flight makes no graph call until the stream has ended."""
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "dave", precompute=False)
    events = _graph_events(voice, monkeypatch)
    chunks = voice.inference_zero_shot(TEXT, "", None, zero_shot_spk_id="dave", stream=True)
    next(chunks)  # the stream is in flight
    voice.add_zero_shot_spk(TRANSCRIPT, _shorter_prompt(), "erin")
    job = _job(voice.prefix_jobs, "erin")
    _until(voice.prefix_jobs, lambda: job.waits >= 1)
    stream_calls = len(events)
    list(chunks)  # the rest of the stream
    assert len(events) > stream_calls  # the stream kept calling graphs while the job waited
    assert voice.wait_prefixes(WAIT) and job.state is JobState.DONE and job.graph_calls > 0
    threads = [thread for thread, _, _ in events]
    assert JOBS_THREAD in threads and threads.index(JOBS_THREAD) == len(threads) - job.graph_calls
    assert set(threads[threads.index(JOBS_THREAD):]) == {JOBS_THREAD}  # after every call of the stream


def test_a_stream_needing_a_paused_jobs_prefix_computes_it_and_the_job_stops(voice: CosyVoice3) -> None:
    cache, jobs, live = voice.synth.flow.prefixes, voice.prefix_jobs, voice.synth.live
    with live.held():
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "frank")
        job = _job(jobs, "frank")
        _until(jobs, lambda: job.waits >= 1)
        _stream(voice, "frank")  # does not wait for the job, which waits for it
        assert cache.misses == 1 and job.key in cache and job.state is JobState.RUNNING
    assert voice.wait_prefixes(WAIT)
    assert (job.state, job.graph_calls) == (JobState.CACHED, 0)
    assert jobs.counts[JobState.CACHED] == 1


def test_a_registered_speakers_prefix_outlasts_uploaded_prompts(voice: CosyVoice3) -> None:
    """With room for one prefix, an uploaded prompt's stream leaves the speaker's kept and keeps none of its
    own (it would have dropped the speaker's); once the speaker is deleted, uploads are kept again."""
    cache = voice.synth.flow.prefixes
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "ivan")
    assert voice.wait_prefixes(WAIT)
    speaker = prompt_key(voice._added["ivan"].features)
    cache.max_bytes = cache.nbytes * 3 // 2
    upload = _shorter_prompt()
    uploaded = prompt_key(voice.prompt_features(upload))
    for _ in range(2):
        list(voice.inference_zero_shot(TEXT, TRANSCRIPT, upload, stream=True))
        assert speaker in cache and uploaded not in cache
    assert (cache.hits, cache.misses) == (0, 2)
    _stream(voice, "ivan")
    assert cache.hits == 1

    voice.prefix_jobs.cancel("ivan")
    list(voice.inference_zero_shot(TEXT, TRANSCRIPT, upload, stream=True))
    assert speaker not in cache and uploaded in cache


def test_a_prompt_is_held_while_any_speaker_of_it_is(voice: CosyVoice3) -> None:
    """Speakers of one recording hold it once, whatever they are submitted again; the last one deleted
    lets it go, and a hold of its own (a server's voice) outlasts them all."""
    cache, jobs = voice.synth.flow.prefixes, voice.prefix_jobs
    for name in ("jack", "jack", "kate"):
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), name)
    key = jobs._names["jack"]
    assert cache._held[key] == 1
    jobs.cancel("jack")
    assert cache._held[key] == 1
    cache.hold(key)
    jobs.cancel("kate")
    assert cache._held[key] == 1
    cache.let_go(key)
    assert key not in cache._held


@pytest.mark.parametrize("held_besides", [True, False])
def test_a_deleted_speakers_prefix_stays_where_the_cache_holds_it_besides(voice: CosyVoice3,
                                                                          held_besides: bool) -> None:
    """A server holds its own voice's prompt: a speaker of that recording, deleted, takes the prefix its job
    computed with it only where no such hold is left."""
    cache, jobs = voice.synth.flow.prefixes, voice.prefix_jobs
    key = prompt_key(voice.prompt_features(str(PROMPT_WAV)))
    if held_besides:
        cache.hold(key)
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "lena")
    assert voice.wait_prefixes(WAIT) and jobs.counts[JobState.DONE] == 1 and key in cache
    jobs.cancel("lena")
    assert (key in cache) is held_besides
    assert (key in cache._held) is held_besides


def test_a_prefix_beyond_the_cache_budget_is_not_queued(tmp_path: Path) -> None:
    with CosyVoice3(DEMO_BUNDLE, threads=1, speakers_dir=tmp_path, flow_prefix_bytes=0) as voice:
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "gina")
        assert voice.prefix_jobs.counts[JobState.QUEUED] == 0 and voice.wait_prefixes(0)


def test_close_cancels_a_waiting_job(tmp_path: Path) -> None:
    voice = CosyVoice3(RuntimeBundle.open(DEMO_BUNDLE), threads=1, speakers_dir=tmp_path)
    with voice.synth.live.held():
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "hana")
        job = _job(voice.prefix_jobs, "hana")
        voice.close()  # returns although live work never ended: the job stops at its wait
    assert job.state is JobState.CANCELLED and job.graph_calls == 0


# --- the server --------------------------------------------------------------------------------------


def _metric(client: Any, name: str) -> float:
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_the_server_queues_a_registered_speakers_prefix_and_cancels_it_on_delete(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    pytest.importorskip("httpx", reason="httpx, the test client's transport, is not installed")
    from fastapi.testclient import TestClient

    from cosyvoice_serve import Engine, ServerSettings, create_app

    wav, shorter = PROMPT_WAV.read_bytes(), io.BytesIO()
    sf.write(shorter, *_shorter_prompt(), format="WAV")
    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy")

    def register(client: TestClient, name: str, audio: bytes) -> None:
        added = client.post("/speakers", data={"name": name, "prompt_text": TRANSCRIPT},
                            files={"prompt_wav": ("prompt.wav", audio, "audio/wav")})
        assert added.status_code == 201, added.text

    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        cache, jobs = engine.synth.flow.prefixes, engine.voice.prefix_jobs
        with TestClient(create_app(engine, settings)) as client:
            register(client, "alice", wav)
            assert engine.voice.wait_prefixes(WAIT) and len(cache) == 1 and cache.misses == 0
            assert _metric(client, "tts_flow_prefix_jobs_done") == 1
            with engine.synth.live.held():  # a session in flight: the job waits
                register(client, "bob", shorter.getvalue())
                bob = _job(jobs, "bob")
                _until(jobs, lambda: bob.waits >= 1)
                assert client.delete("/speakers/bob").status_code == 204
                assert bob.state is JobState.CANCELLED
            assert engine.voice.wait_prefixes(WAIT) and bob.key not in cache and bob.graph_calls == 0
            assert _metric(client, "tts_flow_prefix_jobs_cancelled") == 1
            assert _metric(client, "tts_flow_prefix_jobs_pending") == 0
            streamed = client.post("/inference_zero_shot",
                                   data={"tts_text": "Hi.", "prompt_text": TRANSCRIPT},
                                   files={"prompt_wav": ("prompt.wav", wav, "audio/wav")})
            assert streamed.status_code == 200 and (cache.hits, cache.misses) == (1, 0)  # alice's prompt
    finally:
        engine.close()
    restarted = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        with TestClient(create_app(restarted, settings)):  # alice's prefix is queued at start
            assert restarted.voice.wait_prefixes(WAIT)
            assert restarted.voice.prefix_jobs.counts[JobState.DONE] == 1
            assert len(restarted.synth.flow.prefixes) == 1
    finally:
        restarted.close()


def test_a_speaker_deleted_while_it_registers_leaves_no_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A DELETE that arrives while its speaker's registration writes waits for the registration's job to be
    queued, then cancels it: neither job nor hold outlives the speaker."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    pytest.importorskip("httpx", reason="httpx, the test client's transport, is not installed")
    from fastapi.testclient import TestClient

    from cosyvoice_serve import Engine, ServerSettings, create_app

    audio = io.BytesIO()
    sf.write(audio, *_shorter_prompt(), format="WAV")
    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy")
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        jobs, app = engine.voice.prefix_jobs, create_app(engine, settings)
        with TestClient(app) as client:
            speakers = app.state.server.speakers
            writing, cancelled = threading.Event(), threading.Event()
            add, cancel = speakers.add, jobs.cancel

            def slow_add(*args: Any) -> Any:
                """Written, then slow to return: until the DELETE's cancellation (or for 2 s, where it waits
                for this registration to end)."""
                speaker = add(*args)
                writing.set()
                cancelled.wait(2.0)
                return speaker

            def cancelling(name: str) -> bool:
                cancelled.set()
                return cancel(name)

            monkeypatch.setattr(speakers, "add", slow_add)
            monkeypatch.setattr(jobs, "cancel", cancelling)
            statuses: list[int] = []
            post = threading.Thread(target=lambda: statuses.append(client.post(
                "/speakers", data={"name": "carol", "prompt_text": TRANSCRIPT},
                files={"prompt_wav": ("prompt.wav", audio.getvalue(), "audio/wav")}).status_code))
            post.start()
            assert writing.wait(WAIT)
            assert client.delete("/speakers/carol").status_code == 204
            post.join()
            assert statuses == [201] and speakers.get("carol") is None
            assert "carol" not in jobs._names
            key = prompt_key(engine.voice.prompt_features(_shorter_prompt()))
            assert key not in engine.synth.flow.prefixes._held
    finally:
        engine.close()


def test_a_server_follows_speakers_added_deleted_or_replaced_through_another(tmp_path: Path) -> None:
    """Two servers over one speakers folder (replicas): a speaker replaced through one is computed again
    with its new prompt by the other, one deleted through one is let go by the other, its hold and job
    with it, and one registered through one is computed and held by the other, within the period of
    `ServerSettings.speakers_sync`."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    pytest.importorskip("httpx", reason="httpx, the test client's transport, is not installed")
    from fastapi.testclient import TestClient

    from cosyvoice_runtime.speakers import SpeakerRegistry
    from cosyvoice_serve import Engine, ServerSettings, create_app

    samples, rate = sf.read(PROMPT_WAV, dtype="float32")
    first, second = samples[: len(samples) * 4 // 5], samples[: len(samples) * 3 // 5]
    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", speakers_sync=0.05)
    here, there = (Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1) for _ in range(2))
    try:
        registry = SpeakerRegistry(settings.speakers_dir, here.frontend_fingerprint)
        registry.add("carol", TRANSCRIPT, here.voice.prompt_features((first, rate)))
        keys = [prompt_key(here.voice.prompt_features((prompt, rate))) for prompt in (first, second)]
        jobs, held = here.voice.prefix_jobs, here.synth.flow.prefixes._held
        with TestClient(create_app(here, settings)), TestClient(create_app(there, settings)) as client:
            assert jobs.speakers() == {"carol": keys[0]} and keys[0] in held  # queued at the start

            def until(check: Any) -> None:
                deadline = time.monotonic() + WAIT
                while not check():
                    assert time.monotonic() < deadline, "the server did not follow the other's change"
                    time.sleep(0.02)

            audio = io.BytesIO()
            sf.write(audio, second, rate, format="WAV")
            assert client.post("/speakers", data={"name": "carol", "prompt_text": TRANSCRIPT},
                               files={"prompt_wav": ("prompt.wav", audio.getvalue(), "audio/wav")}
                               ).status_code == 201
            until(lambda: jobs.speakers() == {"carol": keys[1]})
            assert keys[1] in held and keys[0] not in held
            assert client.delete("/speakers/carol").status_code == 204
            until(lambda: not jobs.speakers())
            assert keys[1] not in held
            assert jobs.wait(WAIT) and keys[1] not in here.synth.flow.prefixes  # computed by its job, dropped
            sf.write(audio := io.BytesIO(), first, rate, format="WAV")
            assert client.post("/speakers", data={"name": "dave", "prompt_text": TRANSCRIPT},
                               files={"prompt_wav": ("prompt.wav", audio.getvalue(), "audio/wav")}
                               ).status_code == 201
            until(lambda: jobs.speakers() == {"dave": keys[0]})
            assert keys[0] in held and jobs.wait(WAIT) and keys[0] in here.synth.flow.prefixes
    finally:
        here.close()
        there.close()


def test_a_speaker_left_out_for_the_budget_at_the_start_is_not_new_to_the_sync(tmp_path: Path) -> None:
    """The speakers a server left out at its start, their prefixes beyond the cache's budget, stay out when
    it follows the store (their first streams compute them); only a name the store did not have at the last
    comparison is submitted as registered elsewhere."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    import asyncio

    from cosyvoice_runtime.speakers import SpeakerRegistry
    from cosyvoice_serve import Engine, ServerSettings, create_app
    from cosyvoice_serve.speaker_sync import follow_store

    samples, rate = sf.read(PROMPT_WAV, dtype="float32")
    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", speakers_sync=None)
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        registry = SpeakerRegistry(settings.speakers_dir, engine.frontend_fingerprint)
        prompts = {name: engine.voice.prompt_features((samples[: len(samples) * n // 5], rate))
                   for name, n in (("amy", 4), ("bob", 3))}
        for name, features in prompts.items():
            registry.add(name, TRANSCRIPT, features)
        flow = engine.synth.flow
        flow.prefixes.max_bytes = flow.prefix_nbytes(prompts["amy"].speech_tokens.shape[1])  # amy's alone
        jobs = engine.voice.prefix_jobs
        state = create_app(engine, settings).state.server
        assert list(jobs.speakers()) == ["amy"]
        assert asyncio.run(follow_store(state, {"amy", "bob"})) == {"amy", "bob"}
        assert list(jobs.speakers()) == ["amy"]
        asyncio.run(follow_store(state, {"amy"}))  # bob new since the last comparison
        assert jobs.speakers() == {name: prompt_key(features) for name, features in prompts.items()}
    finally:
        engine.close()


def test_a_store_that_cannot_be_read_for_a_while_is_followed_again_after(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture
                                                                        ) -> None:
    """A speakers store that fails (its folder's disk, the store actor restarting) is logged as a warning, and
    followed again once it answers: a speaker removed from the folder meanwhile is let go."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    pytest.importorskip("httpx", reason="httpx, the test client's transport, is not installed")
    from fastapi.testclient import TestClient

    from cosyvoice_runtime.speakers import Speaker, SpeakerRegistry
    from cosyvoice_serve import Engine, ServerSettings, create_app

    class Failing:
        """The folder's registry, whose reads fail with `OSError` while `failing` is set."""

        def __init__(self, registry: SpeakerRegistry) -> None:
            self.registry, self.failing, self.failures = registry, threading.Event(), 0

        def names(self) -> list[str]:
            return self.registry.names()

        def get(self, name: str) -> Speaker | None:
            if self.failing.is_set():
                self.failures += 1
                raise OSError(5, "Input/output error")
            return self.registry.get(name)

        def add(self, name: str, prompt_text: str, features: Any) -> Speaker:
            return self.registry.add(name, prompt_text, features)

        def remove(self, name: str) -> bool:
            return self.registry.remove(name)

    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", speakers_sync=0.05)
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", threads=1)
    try:
        registry = SpeakerRegistry(settings.speakers_dir, engine.frontend_fingerprint)
        registry.add("carol", TRANSCRIPT, engine.voice.prompt_features(_shorter_prompt()))
        store = Failing(registry)
        jobs = engine.voice.prefix_jobs
        with TestClient(create_app(engine, settings, store)):
            assert list(jobs.speakers()) == ["carol"]
            store.failing.set()
            deadline = time.monotonic() + WAIT
            while store.failures < 2:  # the loop went on after the first
                assert time.monotonic() < deadline, "the store was not read again"
                time.sleep(0.02)
            SpeakerRegistry(settings.speakers_dir, engine.frontend_fingerprint).remove("carol")  # elsewhere
            store.failing.clear()
            while jobs.speakers():
                assert time.monotonic() < deadline, "the server did not let the speaker go"
                time.sleep(0.02)
        assert "the speakers store could not be read to follow its changes: OSError: [Errno 5] " \
               "Input/output error" in caplog.text
    finally:
        engine.close()
