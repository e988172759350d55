"""Many decodings advanced together: continuous batching of the LLM's decode steps on `llm_decode`.

A `DecodeBatcher` owns a thread and one set of cache buffers with a row per decoding (`BatchBuffers`). A
decoding submitted to it prefills alone, exactly as it would unbatched (on the CPU on its consumer's thread
and its own buffers, then copied into a row; on a GPU by the batcher, into its row), then joins the batch;
every batch step is one `llm_decode` call over all joined rows, each at its own cache length
(`GroupQueryAttention` takes one per row), and each row's id is its own decoding's (its request's sampler and
seed, its masks and limiter), the rows' draws made together (`llm.take_rows`). A row leaves at its stop id, at
`max_len`, or when its consumer closes it (a client that went away); on the CPU the last row moves into its
place, so the rows stay packed, and on a GPU the row stays free for the next decoding (`SlotBuffers`). Rows
wait for a place (`max_batch`) in the order they joined, and every joined row advances at every step, but the
batch waits while every row holds `AHEAD_IDS` ids its consumer has not taken, and while the streams' flow and
vocoder work it yields to is running or waiting (`chunks_due`) unless a consumer that has sent no audio yet
waits for an id: then those calls, which need the cores, are not slowed by ids due later, and a first chunk's
ids are not kept waiting. The other way round, `first_audio_due` tells the streams' later chunks when the
batch works for a stream's first audio, so that on the CPU they wait between their DiT calls meanwhile
(`synthesis.chunks_yield_to`).

On onnxruntime's CPU in float32 a row's log-probs are those of the same decoding run alone, to the bit
(tests/test_decode_batch.py, both ways of keeping the rows): the batched call computes each row's matmul
outputs as the single-row call does, and attention row by row; so its ids, and the audio made from them,
are the same.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import MAX_BATCH, GraphSpec

from .decode_graphs import GraphedSteps
from .errors import SynthesisError
from .llm import FIRST_BUFFER_STEPS, Decoding, KVBuffers, SpeechTokenLM, placed, take_rows, zeroed_caches
from .runners import CPU, BufferView, to_host

AHEAD_IDS = 32
"""Ids a row may hold untaken before the batch waits (when every row does): about what a stream's first chunk
takes (a hop of 25 and the flow's look-ahead of 3), so that the ids of later chunks are decoded as they are
needed rather than while other streams' first audio is due (docs/runtime.md, "Measured defaults")."""


class BatchObserver(Protocol):
    """What a batcher reports (a server's metrics)."""

    def step(self, rows: int, seconds: float) -> None:
        """A batch step advanced `rows` decodings in `seconds`."""

    def admitted(self, waited: float) -> None:
        """A decoding got a row `waited` seconds after it was queued for one (after its prefill, where it
        prefills on its own)."""


class _Quiet:
    def step(self, rows: int, seconds: float) -> None:
        pass

    def admitted(self, waited: float) -> None:
        pass


class BatchBuffers:
    """The batch's caches: per `past_*` input of `llm_decode` one (max_batch, KV, rows, D) buffer on the
    runner's device whose row i holds the cache of the decoding in row i, its first `lengths[i]` positions. A
    call runs over the first `len(lengths)` rows (`views`). A buffer too short is replaced by one twice as
    long (up to `max_rows`, the RoPE table's), the rows in use copied (on a GPU through the host: a few times
    in a batch's life, as the buffers never shrink)."""

    def __init__(self, spec: GraphSpec, max_batch: int, rows: int, max_rows: int, device: str = CPU,
                 device_id: int = 0) -> None:
        self.spec = spec
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.device, self.device_id = device, device_id
        self.lengths: list[int] = []
        self.arrays: dict[str, np.ndarray] = {}
        """The buffers on the CPU (`values` wrap their memory); empty on a GPU."""
        self.values: dict[str, ort.OrtValue] = {}
        self._views: dict[tuple[int, int], Mapping[str, ort.OrtValue | BufferView]] = {}
        self._allocate(min(rows, max_rows))

    @property
    def rows(self) -> int:
        """Positions each row can hold."""
        return int(next(iter(self.values.values())).shape()[2])

    def fit(self, positions: int) -> None:
        """Room for `positions` in every row (the buffers double, up to `max_rows`)."""
        if positions > self.max_rows:
            raise ValueError(f"{self.spec.name}: {positions} positions, but its RoPE table ends at "
                             f"{self.max_rows}")
        if positions > self.rows:
            self._allocate(min(max(positions, 2 * self.rows), self.max_rows))

    def views(self, first: int, count: int) -> Mapping[str, ort.OrtValue | BufferView]:
        """Rows `first` to `first + count` of each buffer, as a call's `past_*` feeds and the memory its
        `present_*` outputs are written into (made once per rows and allocation)."""
        key = (first, count)
        if key not in self._views:
            self._views[key] = self._view(first, count)
        return self._views[key]

    def _view(self, first: int, count: int) -> dict[str, ort.OrtValue | BufferView]:
        return {past: BufferView(value, first, count) for past, value in self.values.items()}

    def clear(self) -> None:
        """No rows in use."""
        self.lengths.clear()

    def _allocate(self, rows: int) -> None:
        used = len(self.lengths)
        arrays = zeroed_caches(self.spec, self.max_batch, rows)  # pages of rows never used stay unmapped
        if self.values and used:
            for past, array in arrays.items():
                old = to_host(self.values[past])  # the CPU buffer itself, or a GPU buffer's copy
                array[:used, :, :old.shape[2]] = old[:used]
        self.arrays, self.values = placed(arrays, self.device, self.device_id)
        self._views = {}


class PackedBuffers(BatchBuffers):
    """The batch's caches in host memory, its rows packed: a decoding prefilled on its own buffers is copied
    into the next row, and a row that leaves is replaced by the last."""

    def _view(self, first: int, count: int) -> dict[str, ort.OrtValue | BufferView]:
        # an OrtValue of rows of an array is their memory: bound as a tensor, cheaper than by address
        return {past: ort.OrtValue.ortvalue_from_numpy(array[first:first + count])
                for past, array in self.arrays.items()}

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


class SlotBuffers(BatchBuffers):
    """The batch's caches in a GPU's memory, where onnxruntime's Python API copies no part of a buffer:
    rows never move. A decoding takes the first free row (its slot) and its prefill writes there; a call
    runs over the rows up to the last one taken, a free one among them as an idle row (cache length 0,
    its outputs dropped: one row's arithmetic, a GPU's smallest cost)."""

    def __init__(self, spec: GraphSpec, max_batch: int, rows: int, max_rows: int, device: str = CPU,
                 device_id: int = 0) -> None:
        super().__init__(spec, max_batch, rows, max_rows, device, device_id)
        self.free: set[int] = set()
        """The free rows among the first `len(lengths)`."""

    def take(self) -> int:
        """The row a new decoding writes its cache in: the first free one."""
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
            return slot
        if len(self.lengths) == self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} rows)")
        self.lengths.append(0)
        return len(self.lengths) - 1

    def clear(self) -> None:
        super().clear()
        self.free.clear()

    def release(self, slot: int) -> None:
        """Free `slot`; calls stop at the last row still taken."""
        self.lengths[slot] = 0
        self.free.add(slot)
        while self.lengths and len(self.lengths) - 1 in self.free:
            self.free.remove(len(self.lengths) - 1)
            self.lengths.pop()


class BatchedDecoding(Iterator[int]):
    """A decoding run by a `DecodeBatcher`: iterate for its kept ids. With the batch in host memory the first
    `next` runs its prefill and first step on the calling thread, then the batcher runs the rest; with the
    batch on a GPU the batcher runs them all, the prefill into the decoding's row. `close` takes it out of
    the batch."""

    def __init__(self, batcher: DecodeBatcher, decoding: Decoding) -> None:
        self.batcher = batcher
        self.decoding = decoding
        self.ids: queue.SimpleQueue[int | BaseException | None] = queue.SimpleQueue()
        """Kept ids from the batcher, then None (the end) or the error that ended it."""
        self.closed = False
        """Set by `close`: the batcher drops the row at its next step."""
        self.waiting = False
        """Whether its consumer waits for an id (`next` found none)."""
        self.sent_audio = False
        """Set by its consumer once it has sent its first audio: while chunks are due (`chunks_due`), the
        batch then does not step for this one's ids."""
        self.prefilling = False
        """Whether its prefill runs on its consumer's thread now."""
        self.in_row = False
        """Whether it holds a row of the batch (the batcher's thread sets and clears it)."""
        self.queued_at = 0.0
        """When it was queued for a row (after its prefill where it prefills on its own)."""
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
            self.prefilling = not self.batcher.prefills
            try:
                first = None if self.batcher.prefills else self.decoding.advance()  # the prefill, alone
            finally:
                self.prefilling = False
            if self.decoding.wants_step():
                self.queued_at = time.perf_counter()
                self.batcher.join(self)
            else:
                self.ids.put(None)
            if first is not None:
                return first
        if self.ids.empty():
            self.waiting = True
            self.batcher.wake()
        item = self.ids.get()
        self.waiting = False
        if self.ids.qsize() < AHEAD_IDS:  # the batch may be waiting for this consumer
            self.batcher.wake()
        if item is None or isinstance(item, BaseException):
            self._ended = True
            self.batcher.untrack(self)
            if item is None:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        """Stop decoding: no more ids come out, and the batcher frees the row (a consumer that stops early
        must call this)."""
        self.closed = self._ended = True
        self.decoding.close()
        self.batcher.untrack(self)
        self.batcher.wake()

    def mark_streamed(self) -> None:
        """Say that a stream makes audio chunks of these ids as they come, before it asks for the first:
        until it has sent audio, the batch's work for it is that stream's first audio
        (`DecodeBatcher.first_audio_due`)."""
        self.batcher.track(self)


class DecodeBatcher:
    """One thread that advances every joined decoding of `lm` (which must run on `llm_decode`) by one id per
    `llm_decode` call, at most `max_batch` at once.

    Where `lm` runs on the CPU its buffers are `PackedBuffers` and each decoding prefills on its consumer's
    thread (its own buffers, on the prefill body where the bundle has one) beside the batch; on a GPU
    they are `SlotBuffers` and the batcher prefills each decoding into its row (a device copy of a row is
    what onnxruntime's Python API lacks). `in_slots` chooses (None: by the device), so that the CPU's tests
    run the GPU's way too. With `graphs` (in slots only: rows that never move) the batch steps replay from
    CUDA graphs, one per number of rows and buffer length (`decode_graphs`)."""

    def __init__(self, lm: SpeechTokenLM, max_batch: int, observer: BatchObserver | None = None, *,
                 in_slots: bool | None = None, chunks_due: Callable[[], bool] = lambda: False,
                 graphs: GraphedSteps | None = None) -> None:
        if lm.in_place is None:
            raise ValueError(f"batched decoding runs on llm_decode, not {lm.spec.name}")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be from 1 to {MAX_BATCH}, got {max_batch}")
        self.lm = lm
        self.max_batch = max_batch
        self.observer: BatchObserver = observer or _Quiet()
        self.chunks_due = chunks_due
        """Whether streams' flow and vocoder work that the batch yields to is running or waiting (the
        pipeline's: `synthesis.batch_yields_to`): the batch then steps only for a consumer that has sent no
        audio and waits for an id."""
        device, device_id = lm.in_place.device_type, lm.in_place.device_id
        self.prefills = device != CPU if in_slots is None else in_slots
        """Whether the batcher runs each decoding's prefill, into its row (`SlotBuffers`)."""
        if graphs is not None and not self.prefills:
            raise ValueError("steps replayed from CUDA graphs need the batch's rows in slots")
        self.graphs = graphs
        kind = SlotBuffers if self.prefills else PackedBuffers
        self.buffers = kind(lm.spec, max_batch, FIRST_BUFFER_STEPS, lm.max_positions, device, device_id)
        self._rows: list[BatchedDecoding | None] = []
        """The decodings in the batch, row i of `buffers` the i-th's cache; None: a free row (`SlotBuffers`).
        The batcher's thread's alone."""
        self._idle_embeds = np.zeros((1, 1, lm.speech_embedding.shape[1]), dtype=np.float32)
        """What a free row among the used ones is fed (`SlotBuffers`)."""
        self._waiting: deque[BatchedDecoding] = deque()
        self._streams: set[BatchedDecoding] = set()
        """The decodings that streams make chunks of (`BatchedDecoding.mark_streamed`), until they end."""
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, decoding: Decoding) -> BatchedDecoding:
        """`decoding` (not started) as an iterator whose steps (after the prefill, where it is the
        consumer's) run in the batch."""
        if decoding.steps:
            raise ValueError("a decoding joins a batch before its first step")
        return BatchedDecoding(self, decoding)

    def join(self, item: BatchedDecoding) -> None:
        """Queue a decoding for a row (prefilled, unless the batcher `prefills`)."""
        with self._cond:
            if self._closed:
                raise SynthesisError("the model was closed")
            self._waiting.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="decode-batch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def track(self, item: BatchedDecoding) -> None:
        """Count `item` among the decodings that streams make chunks of (`first_audio_due`)."""
        with self._cond:
            self._streams.add(item)

    def untrack(self, item: BatchedDecoding) -> None:
        """Stop counting `item` (ended or closed) among them."""
        with self._cond:
            self._streams.discard(item)

    def first_audio_due(self) -> bool:
        """Whether the batch works for a stream's first audio now: a decoding that a stream makes chunks of
        and that has sent no audio prefills on its consumer's thread, or holds a row while its consumer waits
        for an id. Not one that waits for a row (the rows' streams would stall until one leaves), nor an
        offline request's (its whole decoding comes before its audio)."""
        with self._cond:
            return any(not item.sent_audio and (item.prefilling or (item.in_row and item.waiting))
                       for item in self._streams)

    def wake(self) -> None:
        """Make the thread look at its rows (one was closed)."""
        with self._cond:
            self._cond.notify()

    @property
    def size(self) -> int:
        """Decodings in the batch now."""
        return sum(item is not None for item in self._rows)

    def close(self) -> None:
        """Stop the thread; every decoding in it or waiting ends with a `SynthesisError`. The CUDA graphs of
        its steps are released with it."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():  # a finalizer's
            self._thread.join()
        if self.graphs is not None:
            self.graphs.release()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._idle():
                    self._cond.wait()
                if self._closed:
                    for item in (*self._joined(), *self._waiting):
                        item.ids.put(SynthesisError("the model was closed"))
                    self._rows, self._waiting = [], deque()
                    return
                joining = [self._waiting.popleft()
                           for _ in range(min(len(self._waiting), self.max_batch - self.size))]
            try:
                for item in joining:
                    self._admit(item)
                self._leave()
                if self._rows:
                    self._step()
            except Exception as e:  # a failed call: every joined decoding gets the error, none waits forever
                self._fail(e)

    def _joined(self) -> list[BatchedDecoding]:
        return [item for item in self._rows if item is not None]

    def _idle(self) -> bool:
        """Nothing to do now: no decoding waits for a row, every joined one (if any) is going on, and either
        chunks are due and no consumer that has sent no audio waits for an id, or every joined one has
        `AHEAD_IDS` ids its consumer has not taken."""
        rows = self._joined()
        if self._waiting or any(item.closed or item.decoding.finished for item in rows):
            return False
        if self.chunks_due():
            return not any(item.waiting and not item.sent_audio for item in rows)
        return all(item.ids.qsize() >= AHEAD_IDS for item in rows)

    def _fail(self, error: Exception) -> None:
        for item in self._joined():
            item.in_row = False
            item.ids.put(error)
        self._rows = []
        self.buffers.clear()

    def _admit(self, item: BatchedDecoding) -> None:
        """Give `item` a row: its own buffers copied in (`PackedBuffers`), or its prefill run into a free
        one (`SlotBuffers`)."""
        buffers = self.buffers
        waited = time.perf_counter() - item.queued_at
        try:  # room for its positions: a one-line error past the RoPE table
            if isinstance(buffers, SlotBuffers):
                buffers.fit(item.decoding.next_embeds.shape[1] + 1)
            else:
                cache = item.decoding.cache
                assert isinstance(cache, KVBuffers)  # `llm_decode`'s, or filled from the prefill body's
                buffers.admit(cache)
        except ValueError as e:
            item.ids.put(SynthesisError(str(e)))
            return
        self.observer.admitted(waited)
        if isinstance(buffers, SlotBuffers):
            self._prefill(item, buffers)
        else:
            item.decoding.cache = None  # its cache lives in the batch now
            self._rows.append(item)
            item.in_row = True

    def _prefill(self, item: BatchedDecoding, buffers: SlotBuffers) -> None:
        """`item`'s prefill, alone, into the first free row (which has room for it); its first id
        sampled."""
        embeds = item.decoding.next_embeds  # (1, T, C): the prompt
        slot = buffers.take()
        self._rows += [None] * (len(buffers.lengths) - len(self._rows))
        self._rows[slot] = item
        item.in_row = True
        logp = self.lm.extend_rows(embeds, np.zeros(1, dtype=np.int64), buffers.views(slot, 1))
        buffers.lengths[slot] = embeds.shape[1]
        token = item.decoding.take(logp[0])
        if token is not None:
            item.ids.put(token)

    def _leave(self) -> None:
        """Drop the rows that are done: ended, closed, or out of positions."""
        buffers = self.buffers
        for row in reversed(range(len(self._rows))):
            if row >= len(self._rows):  # a free row, dropped behind a last row that left
                continue
            item = self._rows[row]
            if item is None:
                continue
            if item.closed or not item.decoding.wants_step():
                item.ids.put(None)
            elif (need := buffers.lengths[row] + 1) > buffers.max_rows:
                item.ids.put(SynthesisError(f"{self.lm.spec.name}: {need} positions, but its RoPE table ends "
                                            f"at {buffers.max_rows}"))
            else:
                continue
            item.in_row = False
            if isinstance(buffers, SlotBuffers):
                buffers.release(row)
                self._rows[row] = None
                del self._rows[len(buffers.lengths):]
            else:
                buffers.remove(row)
                self._rows[row] = self._rows[-1]
                self._rows.pop()

    def _step(self) -> None:
        rows, buffers = self._rows, self.buffers
        buffers.fit(max(buffers.lengths) + 1)
        embeds = np.concatenate([self._idle_embeds if item is None else item.decoding.next_embeds
                                 for item in rows])
        lengths, views = np.array(buffers.lengths, dtype=np.int64), buffers.views(0, len(rows))
        start = time.perf_counter()
        logp = (self.lm.extend_rows(embeds, lengths, views) if self.graphs is None
                else self.graphs.step(embeds, lengths, views))
        self.observer.step(self.size, time.perf_counter() - start)
        joined = [(row, item) for row, item in enumerate(rows) if item is not None]
        for row, _ in joined:
            buffers.lengths[row] += 1
        tokens = take_rows([item.decoding for _, item in joined], logp[[row for row, _ in joined]])
        for (_, item), token in zip(joined, tokens, strict=True):
            if token is not None:
                item.ids.put(token)
