"""Prometheus metrics in the text exposition format (version 0.0.4), written here in a few lines.

Not prometheus_client: it renames every counter to end in `_total`, and the bridge server's counters
are `tts_requests_success` and `tts_requests_error` (its Prometheus exporter keeps names as given);
dashboards built on those names must keep working. Every metric is a process-wide number without
labels, updated from any thread.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cosyvoice_runtime.call_stack import CallStack
from cosyvoice_runtime.dit_stack import DitStack
from cosyvoice_runtime.flow_prefix import FlowPrefixCache
from cosyvoice_runtime.prefix_jobs import JobState, PrefixJobs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RTF_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if value != int(value) else str(int(value))


@dataclass
class Counter:
    """A number that only goes up."""

    name: str
    help: str
    value: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter",
                f"{self.name} {_number(self.value)}"]


@dataclass
class Gauge:
    """A number read when the metrics are scraped."""

    name: str
    help: str
    read: Callable[[], float]
    kind: ClassVar[str] = "gauge"

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}",
                f"{self.name} {_number(self.read())}"]


class CountReading(Gauge):
    """A count kept elsewhere that only goes up, read when the metrics are scraped: a counter to
    Prometheus (whose `rate()` handles its restarts), a gauge's plumbing here."""

    kind: ClassVar[str] = "counter"


@dataclass
class Histogram:
    """Observations counted into cumulative buckets, with their sum and count."""

    name: str
    help: str
    buckets: Sequence[float]
    counts: list[int] = field(init=False)
    sum: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.buckets = tuple(sorted(self.buckets))
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        with self._lock:
            index = bisect.bisect_left(self.buckets, value)
            if index < len(self.counts):
                self.counts[index] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, counts, strict=True):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {count}', f"{self.name}_sum {_number(total)}",
                  f"{self.name}_count {count}"]
        return lines


BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


class BatchMetrics:
    """What the engine's decode batch reports (a `cosyvoice_runtime.decode_batch.BatchObserver`)."""

    def __init__(self) -> None:
        self.batch_size = Histogram("tts_decode_batch_size", "Sessions one LLM decode step advanced.",
                                    BATCH_BUCKETS)
        self.step_seconds = Histogram("tts_decode_step_seconds", "Seconds of one batched LLM decode step.",
                                      (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        self.wait_seconds = Histogram("tts_decode_batch_wait_seconds", "Seconds a session's decoding waited "
                                      "for a place in the batch after its prefill.", SECONDS_BUCKETS)

    def step(self, rows: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.step_seconds.observe(seconds)

    def admitted(self, waited: float) -> None:
        self.wait_seconds.observe(waited)

    @property
    def histograms(self) -> list[Histogram]:
        return [self.batch_size, self.step_seconds, self.wait_seconds]


class ServerMetrics:
    """The server's metrics: the bridge's five, first-chunk latency, the queue and session outcomes, the
    flow prefixes and the decode batch."""

    def __init__(self, running: Callable[[], float], waiting: Callable[[], float], prefixes: FlowPrefixCache,
                 prefix_jobs: PrefixJobs, batch: BatchMetrics | None = None,
                 dit_stack: DitStack | None = None, vocoder_stack: CallStack[Any, Any, Any] | None = None
                 ) -> None:
        """`running` and `waiting` read the session queue's current counts; `prefixes` is the engine's
        per-prompt flow cache and `prefix_jobs` the background jobs that fill it for speakers; `batch` what
        its decode batch reports (none: it has no batch); `dit_stack` and `vocoder_stack` where its DiT and
        vocoder calls stack (none: they do not)."""
        self.requests_total = Counter("tts_requests_total", "Synthesis requests received.")
        self.requests_success = Counter("tts_requests_success", "Synthesis requests answered with audio.")
        self.requests_error = Counter("tts_requests_error", "Synthesis requests answered with an error "
                                                            "(rejections and timeouts included).")
        self.requests_rejected = Counter("tts_requests_rejected", "Synthesis requests refused with 503 "
                                                                  "because the queue was full.")
        self.sessions_cancelled = Counter("tts_sessions_cancelled", "Sessions stopped because their client "
                                                                    "went away.")
        self.synthesis_seconds = Histogram("tts_synthesis_duration_seconds", "Seconds a session spent "
                                           "synthesising (queue wait excluded).", SECONDS_BUCKETS)
        self.rtf = Histogram("tts_rtf", "Real-time factor: synthesis seconds per second of audio.",
                             RTF_BUCKETS)
        self.first_chunk_seconds = Histogram("tts_first_chunk_latency_seconds", "Seconds from a request's "
                                             "admission to its first audio (its text's normalisation and its "
                                             "wait in the queue included).", SECONDS_BUCKETS)
        self.queue_depth = Gauge("tts_queue_depth", "Sessions admitted and waiting for a worker.", waiting)
        self.active_sessions = Gauge("tts_active_sessions", "Sessions synthesising now.", running)
        self.prefix_cache = [
            Gauge("tts_flow_prefix_cache_bytes", "Memory held by the streaming flow's per-prompt prefixes.",
                  lambda: prefixes.nbytes),
            Gauge("tts_flow_prefix_cache_prompts", "Prompts whose flow prefix is kept.",
                  lambda: len(prefixes)),
            CountReading("tts_flow_prefix_cache_hits", "Streams that started from a kept flow prefix.",
                         lambda: prefixes.hits),
            CountReading("tts_flow_prefix_cache_misses", "Streams that computed their prompt's flow prefix.",
                         lambda: prefixes.misses),
            Gauge("tts_flow_prefix_jobs_pending", "Speakers' flow prefixes queued or being computed in the "
                  "background.", lambda: prefix_jobs.pending),
            *(_job_count(prefix_jobs, state, help) for state, help in (
                (JobState.QUEUED, "Speakers' flow prefixes queued for the background."),
                (JobState.DONE, "Background flow prefixes computed and kept."),
                (JobState.CACHED, "Background flow prefixes that a stream computed first."),
                (JobState.CANCELLED, "Background flow prefixes cancelled (speaker deleted or replaced)."),
                (JobState.FAILED, "Background flow prefixes that failed or did not fit the cache.")))]
        self.stacks = [] if dit_stack is None else [
            *_stack_counts(dit_stack, "dit", "DiT"),
            CountReading("tts_dit_device_concats", "Stacked DiT calls whose caches were concatenated on the "
                         "device.", lambda: dit_stack.concats)]
        if vocoder_stack is not None:
            self.stacks += _stack_counts(vocoder_stack, "vocoder", "vocoder")
        self._all: list[Counter | Gauge | Histogram] = [
            self.requests_total, self.requests_success, self.requests_error, self.requests_rejected,
            self.sessions_cancelled, self.synthesis_seconds, self.rtf, self.first_chunk_seconds,
            self.queue_depth, self.active_sessions, *self.prefix_cache, *(batch.histograms if batch else ()),
            *self.stacks]

    def render(self) -> str:
        """Every metric in the text exposition format."""
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"


def _stack_counts(stack: CallStack[Any, Any, Any], name: str, what: str) -> list[CountReading]:
    """The calls made through `stack` and the streams' calls they served."""
    return [CountReading(f"tts_{name}_calls", f"{what[0].upper()}{what[1:]} calls made through the stack "
                         "(stacked or alone).", lambda: stack.calls),
            CountReading(f"tts_{name}_stream_calls", f"Streams' {what} calls those calls served.",
                         lambda: stack.streams)]


def _job_count(jobs: PrefixJobs, state: JobState, help: str) -> CountReading:
    """The count of prefix jobs submitted (`QUEUED`) or finished in `state`."""
    return CountReading(f"tts_flow_prefix_jobs_{state.value}", help, lambda: jobs.counts[state])
