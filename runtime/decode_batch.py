"""Many decodings advanced together: continuous batching of the LLM's decode steps on `llm_decode`.

A `DecodeBatcher` owns a thread and one set of cache buffers with a row per decoding (`BatchBuffers`). A
decoding submitted to it prefills on its consumer's thread, alone and exactly as it would unbatched, then
joins the batch; every batch step is one `llm_decode` call over all joined rows, each at its own cache
length (`GroupQueryAttention` takes one per row), and each row's id is drawn by its own decoding (its
request's sampler and seed, its masks and limiter). A row leaves at its stop id, at `max_len`, or when its
consumer closes it (a client that went away); the last row moves into its place, so the rows stay packed.
Rows wait for a place (`max_batch`) in the order they joined, and every joined row advances at every step,
but the batch waits while every row holds `AHEAD_IDS` ids its consumer has not taken: then the streams'
flow and vocoder calls, which need the cores for the audio due first, are not slowed by ids due later.

On onnxruntime's CPU in float32 a row's log-probs are those of the same decoding run alone, to the bit
(tests/test_decode_batch.py): the batched call computes each row's matmul outputs as the single-row call
does, and attention row by row; so its ids, and the audio made from them, are the same.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import MAX_BATCH, GraphSpec, cache_pairs

from .errors import SynthesisError
from .llm import FIRST_BUFFER_STEPS, Decoding, KVBuffers, SpeechTokenLM

AHEAD_IDS = 32
"""Ids a row may hold untaken before the batch waits (when every row does): about what a stream's first chunk
takes (a hop of 25 and the flow's look-ahead of 3), so that the ids of later chunks are decoded as they are
needed rather than while other streams' first audio is due (docs/runtime.md, "Measured defaults")."""


class BatchObserver(Protocol):
    """What a batcher reports (a server's metrics)."""

    def step(self, rows: int, seconds: float) -> None:
        """A batch step advanced `rows` decodings in `seconds`."""

    def admitted(self, waited: float) -> None:
        """A decoding joined the batch `waited` seconds after its prefill ended."""


class _Quiet:
    def step(self, rows: int, seconds: float) -> None:
        pass

    def admitted(self, waited: float) -> None:
        pass


class BatchBuffers:
    """The batch's caches: per `past_*` input of `llm_decode` one (max_batch, KV, rows, D) buffer whose row i
    holds the i-th decoding's cache, its first `lengths[i]` positions. Pages of rows never used are never
    touched, so a large `max_batch` costs address space only."""

    def __init__(self, spec: GraphSpec, max_batch: int, rows: int, max_rows: int) -> None:
        self.spec = spec
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.lengths: list[int] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._values: dict[int, dict[str, ort.OrtValue]] = {}
        """Batch size -> `OrtValue`s over the first rows of `arrays` (made once per size and allocation)."""
        self._allocate(min(rows, max_rows))

    @property
    def rows(self) -> int:
        """Positions each row can hold."""
        return next(iter(self.arrays.values())).shape[2]

    def admit(self, cache: KVBuffers) -> None:
        """Append a row holding `cache`'s positions (a decoding's own buffers after its prefill)."""
        if len(self.lengths) == self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} rows)")
        self.fit(cache.length + 1)
        row = len(self.lengths)
        for past, array in self.arrays.items():
            array[row, :, :cache.length] = cache.arrays[past][0, :, :cache.length]
        self.lengths.append(cache.length)

    def remove(self, row: int) -> None:
        """Drop `row`; the last row moves into its place."""
        last = len(self.lengths) - 1
        if row != last:
            length = self.lengths[last]
            for array in self.arrays.values():
                array[row, :, :length] = array[last, :, :length]
            self.lengths[row] = length
        self.lengths.pop()

    def fit(self, positions: int) -> None:
        """Room for `positions` in every row (the buffers double, up to `max_rows`)."""
        if positions > self.max_rows:
            raise ValueError(f"{self.spec.name}: {positions} positions, but its RoPE table ends at "
                             f"{self.max_rows}")
        if positions > self.rows:
            self._allocate(min(max(positions, 2 * self.rows), self.max_rows))

    def values(self) -> dict[str, ort.OrtValue]:
        """The buffers of the rows in use, as the call's `past_*` feeds (no copy: the first rows of each
        buffer are contiguous)."""
        n = len(self.lengths)
        if n not in self._values:
            self._values[n] = {past: ort.OrtValue.ortvalue_from_numpy(array[:n])
                               for past, array in self.arrays.items()}
        return self._values[n]

    def _allocate(self, rows: int) -> None:
        tensors = {t.name: t for t in self.spec.inputs}
        used = len(self.lengths)
        arrays = {}
        for past, _ in cache_pairs(self.spec):
            kv_heads, head_dim = tensors[past].shape[1], tensors[past].shape[3]
            arrays[past] = np.zeros((self.max_batch, kv_heads, rows, head_dim), dtype=tensors[past].np_dtype)
            if self.arrays:
                old = self.arrays[past]
                arrays[past][:used, :, :old.shape[2]] = old[:used]
        self.arrays = arrays
        self._values = {}


class BatchedDecoding(Iterator[int]):
    """A decoding run by a `DecodeBatcher`: iterate for its kept ids. The first `next` runs its prefill and
    first step on the calling thread, then the batcher runs the rest; `close` takes it out of the batch."""

    def __init__(self, batcher: DecodeBatcher, decoding: Decoding) -> None:
        self.batcher = batcher
        self.decoding = decoding
        self.ids: queue.SimpleQueue[int | BaseException | None] = queue.SimpleQueue()
        """Kept ids from the batcher, then None (the end) or the error that ended it."""
        self.closed = False
        """Set by `close`: the batcher drops the row at its next step."""
        self.prefilled_at = 0.0
        self._started = False
        self._ended = False

    @property
    def tokens(self) -> list[int]:
        """The kept ids so far (`Decoding.tokens`)."""
        return self.decoding.tokens

    def __next__(self) -> int:
        if self._ended:
            raise StopIteration
        if not self._started:
            self._started = True
            first = self.decoding.advance()  # the prefill, alone
            if self.decoding.wants_step():
                self.prefilled_at = time.perf_counter()
                self.batcher.join(self)
            else:
                self.ids.put(None)
            if first is not None:
                return first
        item = self.ids.get()
        if self.ids.qsize() < AHEAD_IDS:  # the batch may be waiting for this consumer
            self.batcher.wake()
        if item is None or isinstance(item, BaseException):
            self._ended = True
            if item is None:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        """Stop decoding: no more ids come out, and the batcher frees the row (a consumer that stops early
        must call this)."""
        self.closed = self._ended = True
        self.decoding.close()
        self.batcher.wake()


class DecodeBatcher:
    """One thread that advances every joined decoding of `lm` (which must run on `llm_decode`) by one id per
    `llm_decode` call, at most `max_batch` at once."""

    def __init__(self, lm: SpeechTokenLM, max_batch: int, observer: BatchObserver | None = None) -> None:
        if lm.in_place is None:
            raise ValueError(f"batched decoding runs on llm_decode (onnxruntime's CPU), not {lm.spec.name}")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be from 1 to {MAX_BATCH}, got {max_batch}")
        self.lm = lm
        self.max_batch = max_batch
        self.observer: BatchObserver = observer or _Quiet()
        self.buffers = BatchBuffers(lm.spec, max_batch, FIRST_BUFFER_STEPS, lm.max_positions)
        self._rows: list[BatchedDecoding] = []
        """The joined decodings, row i of `buffers` the i-th's cache (the batcher's thread's alone)."""
        self._waiting: deque[BatchedDecoding] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, decoding: Decoding) -> BatchedDecoding:
        """`decoding` (not started) as an iterator whose steps after the prefill run in the batch."""
        if decoding.steps:
            raise ValueError("a decoding joins a batch before its first step")
        return BatchedDecoding(self, decoding)

    def join(self, item: BatchedDecoding) -> None:
        """Queue a prefilled decoding for a row."""
        with self._cond:
            if self._closed:
                raise SynthesisError("the model was closed")
            self._waiting.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="decode-batch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def wake(self) -> None:
        """Make the thread look at its rows (one was closed)."""
        with self._cond:
            self._cond.notify()

    @property
    def size(self) -> int:
        """Decodings in the batch now."""
        return len(self._rows)

    def close(self) -> None:
        """Stop the thread; every decoding in it or waiting ends with a `SynthesisError`."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._idle():
                    self._cond.wait()
                if self._closed:
                    for item in (*self._rows, *self._waiting):
                        item.ids.put(SynthesisError("the model was closed"))
                    self._rows, self._waiting = [], deque()
                    return
                joining = [self._waiting.popleft()
                           for _ in range(min(len(self._waiting), self.max_batch - len(self._rows)))]
            try:
                for item in joining:
                    self._admit(item)
                self._leave()
                if self._rows:
                    self._step()
            except Exception as e:  # a failed call: every joined decoding gets the error, none waits forever
                self._fail(e)

    def _idle(self) -> bool:
        """Nothing to do now: no decoding waits for a row, and every joined one (if any) is going on and has
        `AHEAD_IDS` ids its consumer has not taken."""
        return not self._waiting and all(
            not item.closed and not item.decoding.finished and item.ids.qsize() >= AHEAD_IDS
            for item in self._rows)

    def _fail(self, error: Exception) -> None:
        for item in self._rows:
            item.ids.put(error)
        self._rows = []
        self.buffers.lengths.clear()

    def _admit(self, item: BatchedDecoding) -> None:
        cache = item.decoding.cache
        assert isinstance(cache, KVBuffers)  # `llm_decode`'s, or filled from the prefill body's
        try:
            self.buffers.admit(cache)
        except ValueError as e:
            item.ids.put(SynthesisError(str(e)))
            return
        item.decoding.cache = {}  # its cache lives in the batch now
        self._rows.append(item)
        self.observer.admitted(time.perf_counter() - item.prefilled_at)

    def _leave(self) -> None:
        """Drop the rows that are done: ended, closed, or out of positions."""
        for row in reversed(range(len(self._rows))):
            item = self._rows[row]
            if item.closed or not item.decoding.wants_step():
                item.ids.put(None)
            elif (need := self.buffers.lengths[row] + 1) > self.buffers.max_rows:
                item.ids.put(SynthesisError(f"{self.lm.spec.name}: {need} positions, but its RoPE table ends "
                                            f"at {self.buffers.max_rows}"))
            else:
                continue
            self.buffers.remove(row)
            self._rows[row] = self._rows[-1]
            self._rows.pop()

    def _step(self) -> None:
        rows, buffers = self._rows, self.buffers
        buffers.fit(max(buffers.lengths) + 1)
        embeds = np.concatenate([item.decoding.next_embeds for item in rows])  # (B, 1, C)
        start = time.perf_counter()
        logp = self.lm.extend_rows(embeds, np.array(buffers.lengths, dtype=np.int64), buffers.values())
        self.observer.step(len(rows), time.perf_counter() - start)
        for row, item in enumerate(rows):
            buffers.lengths[row] += 1
            token = item.decoding.take(logp[row])
            if token is not None:
                item.ids.put(token)
