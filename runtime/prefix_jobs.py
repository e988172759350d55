"""Speakers' flow prefixes computed in the background, at the lowest priority, so that the first stream from
a newly registered speaker starts as fast as the second.

Registering a speaker queues a job for its prompt's `FlowPrefix` (`Flow.compute_prefix`), which one daemon
thread per runtime object runs, one job at a time, into the same `FlowPrefixCache` that streams read;
so a stream finds it there as if an earlier stream had computed it, and its samples are the same.

Priority: a job runs one graph call at a time (the encoder, then one DiT call per ODE step) and, before
each, waits while any synthesis is in flight on the same graphs (`LiveWork`, which every stream and every
offline synthesis holds from its first step to its end). A live request therefore never waits for a job,
except for the one graph call that a job had started just before the request arrived.

A stream that needs the prefix while its job is queued or paused computes the prefix itself, as it would
without jobs: it never waits for a job. The job, resumed, sees the prefix kept and stops (`CACHED`); it
cannot be computing at that time, since the stream is live work. Deleting or replacing a speaker cancels
its job (a running one stops at its next graph call) and drops the prefix its job computed from the cache,
unless another speaker of this runtime has the same prompt or the cache holds it besides (a server's own
voice). A prefix the speaker found kept (the bundle's own prompt voice, an upload of the same recording)
stays: streams that are no speaker's use it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from .flow_prefix import prompt_key
from .frontend import PromptFeatures

if TYPE_CHECKING:
    from .token2wav import Flow

log = logging.getLogger(__name__)


class LiveWork:
    """The syntheses in flight on one set of graphs: background work waits until there are none.

    Its condition is also the lock of the `PrefixJobs` that wait on it, so that a stream's start, a
    cancellation and a job's wait never miss each other's notification.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._count = 0

    @property
    def count(self) -> int:
        """Syntheses in flight now."""
        return self._count

    @contextmanager
    def held(self) -> Iterator[None]:
        """Count one synthesis in flight for the duration."""
        with self.cond:
            self._count += 1
        try:
            yield
        finally:
            with self.cond:
                self._count -= 1
                self.cond.notify_all()


class JobState(StrEnum):
    """Where a prefix job is."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    """Computed by the job and kept in the cache."""
    CACHED = "cached"
    """The cache held the prefix already (a stream computed it first): nothing (more) to compute."""
    CANCELLED = "cancelled"
    """Its speaker was deleted or replaced, or the runtime closed."""
    FAILED = "failed"
    """The computation raised (logged); a stream will compute the prefix itself."""


FINISHED = frozenset({JobState.DONE, JobState.CACHED, JobState.CANCELLED, JobState.FAILED})


@dataclass
class PrefixJob:
    """One prompt's prefix to compute, shared by every speaker name with that prompt."""

    key: str
    """The prompt's `prompt_key`, which the cache keeps its prefix under."""
    prompt: PromptFeatures = field(repr=False)
    state: JobState = JobState.QUEUED
    waits: int = 0
    """Times the job found live work in flight before a graph call and waited for it."""
    graph_calls: int = 0
    """Graph calls the job has made."""


class _Stop(Exception):
    """Raised inside a job's computation to end it early, with the state it ends in."""

    def __init__(self, state: JobState) -> None:
        super().__init__(state.value)
        self.state = state


class PrefixJobs:
    """The background prefix jobs of one runtime object (`CosyVoice3.prefix_jobs`): a queue keyed by
    prompt, first in first out, and the daemon thread that runs it, started by the first `submit`."""

    def __init__(self, flow: Flow, live: LiveWork) -> None:
        self.flow, self.live = flow, live
        self._cond = live.cond
        self._queue: OrderedDict[str, PrefixJob] = OrderedDict()
        self._running: PrefixJob | None = None
        self._names: dict[str, str] = {}
        """Speaker name -> the `prompt_key` of its prompt, for every speaker submitted and not cancelled."""
        self._computed: set[str] = set()
        """The keys of the prefixes jobs here computed (which a speaker's cancellation drops)."""
        self._thread: threading.Thread | None = None
        self._closed = False
        self.counts = dict.fromkeys(JobState, 0)
        """Jobs submitted (`QUEUED`) and jobs finished, by how they ended."""

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def speakers(self) -> dict[str, str]:
        """Each speaker submitted and not cancelled, with its prompt's `prompt_key`."""
        with self._cond:
            return dict(self._names)

    def submit(self, name: str, prompt: PromptFeatures, *, compute: bool = True) -> PrefixJob | None:
        """Queue the prefix of speaker `name`'s prompt (replacing a speaker of that name: its job is
        cancelled and its prefix dropped). The job of the same prompt if one is queued or running; a
        `CACHED` job if the prefix is kept already; None if the prefix would not fit the cache's budget
        (it would be computed for nothing). Without `compute`, the prefix is held as a speaker's but
        left to its first stream to compute: no job, None."""
        key = prompt_key(prompt)
        if self.flow.prefix_nbytes(prompt.speech_tokens.shape[1]) > self.flow.prefixes.max_bytes:
            self.cancel(name)
            return None
        with self._cond:
            if self._closed:
                raise RuntimeError("the prefix jobs are closed")
            if self._names.get(name) != key:
                self._cancel(name)
                if key not in self._names.values():  # one hold per prompt, let go with its last speaker
                    self.flow.prefixes.hold(key)
                self._names[name] = key
            if not compute:
                return None
            job = self._queue.get(key) or (self._running if self._running and self._running.key == key
                                            else None)
            if job is not None:
                return job
            if key in self.flow.prefixes:
                return PrefixJob(key, prompt, JobState.CACHED)
            job = PrefixJob(key, prompt)
            self._queue[key] = job
            self.counts[JobState.QUEUED] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flow-prefix-jobs", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return job

    def submit_within_budget(self, speakers: Iterable[tuple[str, PromptFeatures]]) -> list[PrefixJob]:
        """`submit` each speaker, in order, while the prefixes queued here fit the cache's budget together;
        a speaker whose prefix would not fit is skipped (its first stream computes it). What a server
        does at start-up for its registered speakers."""
        room, jobs = self.flow.prefixes.max_bytes, []
        for name, prompt in speakers:
            size = self.flow.prefix_nbytes(prompt.speech_tokens.shape[1])
            if size <= room and (job := self.submit(name, prompt)) is not None:
                room -= size
                jobs.append(job)
        return jobs

    def cancel(self, name: str) -> bool:
        """Speaker `name` was deleted: cancel its prompt's job and drop the prefix a job computed for it,
        unless another speaker has the same prompt or the cache holds it besides. False if `name` was never
        submitted (or is cancelled already)."""
        with self._cond:
            return self._cancel(name)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running (live work delays that); False on `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._running is None, timeout)

    def close(self) -> None:
        """Cancel every job and wait for the thread to leave the graph call it is in (before the graphs
        close)."""
        with self._cond:
            self._closed = True
            for job in self._queue.values():
                self._finish(job, JobState.CANCELLED)
            self._queue.clear()
            if self._running is not None and self._running.state is JobState.RUNNING:
                self._finish(self._running, JobState.CANCELLED)
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():  # a finalizer's
            self._thread.join()

    # --- internals (under `_cond` where noted) ---------------------------------------------------------

    def _cancel(self, name: str) -> bool:
        """`cancel`, under `_cond`."""
        key = self._names.pop(name, None)
        if key is None:
            return False
        if key in self._names.values():  # another speaker's prompt too
            return True
        job = self._queue.pop(key, None)
        if job is None and self._running is not None and self._running.key == key:
            job = self._running  # the thread stops at its next graph call, seeing the state
        if job is not None and job.state not in FINISHED:
            self._finish(job, JobState.CANCELLED)
        # what a job computed goes with the speaker, unless the prompt is held besides (a server's own voice)
        self.flow.prefixes.let_go(key, discard=key in self._computed)
        self._computed.discard(key)
        self._cond.notify_all()
        return True

    def _finish(self, job: PrefixJob, state: JobState) -> None:
        """Under `_cond`."""
        job.state = state
        self.counts[state] += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                _, job = self._queue.popitem(last=False)
                job.state, self._running = JobState.RUNNING, job
            try:
                self._compute(job)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _compute(self, job: PrefixJob) -> None:
        """Run `job` (on the thread) to one of its finished states."""
        try:
            prefix = self.flow.compute_prefix(job.prompt, pause=lambda: self._pause(job))
            with self._cond:  # a cancellation after the last graph call must not find it kept
                if job.state is JobState.RUNNING:
                    kept = self.flow.prefixes.put(job.key, prefix)
                    if kept:
                        self._computed.add(job.key)
                    self._finish(job, JobState.DONE if kept else JobState.FAILED)
        except _Stop as stop:
            with self._cond:
                if job.state is JobState.RUNNING:
                    self._finish(job, stop.state)
        except Exception:
            log.exception("computing a speaker's flow prefix in the background failed; its first stream "
                          "computes it")
            with self._cond:
                if job.state is JobState.RUNNING:
                    self._finish(job, JobState.FAILED)

    def _pause(self, job: PrefixJob) -> None:
        """Before a job's graph call: wait while live work is in flight; stop if the job was cancelled or a
        stream has kept the prefix meanwhile."""
        with self._cond:
            if self.live.count and job.state is JobState.RUNNING:
                job.waits += 1
                self._cond.notify_all()  # for observers of `waits`
            self._cond.wait_for(lambda: job.state is not JobState.RUNNING or not self.live.count)
            if job.state is not JobState.RUNNING:
                raise _Stop(job.state)
            if job.key in self.flow.prefixes:
                raise _Stop(JobState.CACHED)
            job.graph_calls += 1

