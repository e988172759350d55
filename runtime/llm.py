"""Speech-token decoding over the `llm` graph, with the KV cache as explicit numpy arrays.

Upstream's HF path (`Qwen2LM.inference` / `inference_wrapper`, `cosyvoice/llm/llm.py`) plus the
silent-token limiter of `llm_job` (`cosyvoice/cli/model.py`):

- input `[E_speech[sos], E_text(prompt_text ++ text), E_speech[task_id], E_speech(prompt_speech)]`,
  prefilled in one call, then one token per call; every `present_X` output is fed back as `past_X`
  (`cosyvoice_graphs.cache_pairs`), matched by name, or, on `llm_decode`, written in place into buffers
  (`KVBuffers`);
- `min_len = int(2 * Lt)`, `max_len = int(20 * Lt)`, Lt = number of tts-text ids (prompt text excluded);
- upstream's quirk, reproduced: during the first `min_len` steps the masked id is `speech_token_size`
  (= sos), not eos, so any stop id can still end decoding early;
- any id >= speech_token_size ends decoding and is not emitted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import SEQLENS_K, GraphSpec, cache_pairs, decode_lengths, empty_caches

from .runners import CPU, BufferView, Feed, OrtRunner, Runner, to_host
from .runners.capture_gate import on_device
from .sampling import Sampler, SilentTokenLimiter, sample_rows

PREFILL_BODY_FROM = 4
"""New positions from which a call runs on the bundle's prefill body (`llm_prefill`) when it has one: where
the prefill body measured faster than the int4 `llm` (docs/runtime.md, "Measured defaults")."""
FIRST_BUFFER_STEPS = 256
"""Decode steps `KVBuffers` first make room for after the prefill; a full buffer doubles."""
MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0


@dataclass(frozen=True)
class LlmRequest:
    """What the LLM sees for one segment. The two text id lists are tokenised separately and joined."""

    text_ids: tuple[int, ...]
    """The tts text's ids; their count sets min_len and max_len."""
    prompt_text_ids: tuple[int, ...] = ()
    """Prompt transcript (zero-shot) or instruction (instruct2) ids; empty for cross-lingual."""
    prompt_speech_tokens: tuple[int, ...] = ()
    """The prompt's speech tokens (zero-shot only)."""


class KVBuffers:
    """`llm_decode`'s caches: a buffer per `past_*` input whose first `length` rows hold the cache, which
    the graph extends in place (`OrtRunner.infer_in_place`). A buffer too short for a call is replaced by
    one twice as long (at most `max_rows`, the positions of the graph's RoPE table), the cache copied.

    On the CPU the buffers are numpy arrays (`arrays`, their pages mapped as they are written) that `values`
    wrap; on a GPU (`device`) they are onnxruntime's `values` alone, in the device's memory, which only the
    graph writes (a replacement copies the cache through the host: a few times per decoding)."""

    def __init__(self, spec: GraphSpec, rows: int, max_rows: int, device: str = CPU, device_id: int = 0
                 ) -> None:
        self.spec = spec
        self.pairs = cache_pairs(spec)
        self.max_rows = max_rows
        self.device, self.device_id = device, device_id
        self.length = 0
        self.arrays: dict[str, np.ndarray] = {}
        """The buffers on the CPU, which `values` wrap without a copy; empty on a GPU."""
        self.values: dict[str, ort.OrtValue] = {}
        self._allocate(min(rows, max_rows))

    @property
    def rows(self) -> int:
        """Positions the buffers hold."""
        return int(next(iter(self.values.values())).shape()[2])

    def reserve(self, new: int) -> None:
        """Room for `new` more positions; a one-line `ValueError` past `max_rows`."""
        need = self.length + new
        if need > self.max_rows:
            raise ValueError(f"{self.spec.name}: {need} positions, but its RoPE table ends at "
                             f"{self.max_rows}")
        if need > self.rows:
            self._allocate(min(max(need, 2 * self.rows), self.max_rows))

    def fill(self, caches: Mapping[str, Feed]) -> None:
        """Take the caches of a call that grew them (`llm_prefill`: `present_*` fed back by name) as the
        cache: `length` becomes theirs. CPU buffers only (on a GPU the prefill runs on `llm_decode`)."""
        if self.device != CPU:
            raise ValueError(f"{self.spec.name}: buffers on {self.device} are written by the graph alone")
        host = {past: to_host(v) for past, v in caches.items()}
        length = next(iter(host.values())).shape[2]
        self.length = 0
        self.reserve(length)
        for past, value in host.items():
            self.arrays[past][:, :, :length] = value
        self.length = length

    def _allocate(self, rows: int) -> None:
        arrays = zeroed_caches(self.spec, 1, rows)  # one decoding: one row of the batch
        if self.length:  # the cache so far (`numpy()`: the CPU buffer itself, or a GPU buffer's copy)
            for past, array in arrays.items():
                array[:, :, :self.length] = to_host(self.values[past])[:, :, :self.length]
        self.arrays, self.values = placed(arrays, self.device, self.device_id)


def zeroed_caches(spec: GraphSpec, batch: int, rows: int) -> dict[str, np.ndarray]:
    """Per `past_*` input of `llm_decode`'s `spec` a zeroed (batch, KV, rows, D) buffer: `rows` positions
    for each of `batch` decodings (pages mapped as they are written)."""
    tensors = {t.name: t for t in spec.inputs}
    return {past: np.zeros((batch, tensors[past].shape[1], rows, tensors[past].shape[3]),
                           dtype=tensors[past].np_dtype)
            for past, _ in cache_pairs(spec)}


def placed(arrays: dict[str, np.ndarray], device: str, device_id: int
           ) -> tuple[dict[str, np.ndarray], dict[str, ort.OrtValue]]:
    """Buffers on `device`: on the CPU the arrays themselves and `OrtValue`s over their memory; on a GPU
    no arrays and `OrtValue`s holding a copy in the device's memory."""
    with on_device(device):
        values = {past: ort.OrtValue.ortvalue_from_numpy(a, device, device_id) for past, a in arrays.items()}
    return (arrays if device == CPU else {}), values


Cache: TypeAlias = dict[str, Feed] | KVBuffers
"""A decoding's caches: `past_*` values fed back by name (`llm`), or buffers written in place
(`llm_decode`)."""


class SpeechTokenLM:
    """The `llm` graph with the embedding tables around it: request -> speech tokens."""

    def __init__(self, runner: Runner, text_embedding: np.ndarray,
                 speech_embedding: np.ndarray, *, sos: int, task_id: int, endofprompt_id: int,
                 speech_token_size: int, prefill: Runner | None = None) -> None:
        """`runner` is the bundle's `llm`, or its `llm_decode` (`runners.decode_body`), whose caches then
        live in `KVBuffers` on its device. `text_embedding` (text vocab, C) and `speech_embedding` (speech
        vocab, C) are the bundle's tables; sos and task_id are rows of the latter. `prefill` (the bundle's
        `llm_prefill`, where it has one: `runners.prefill_body`) runs the calls over `PREFILL_BODY_FROM` new
        positions or more, `runner` the rest."""
        self.runner = runner
        self.prefill = prefill
        self.spec = runner.spec
        self.text_embedding = text_embedding
        self.speech_embedding = speech_embedding
        self.sos, self.task_id, self.endofprompt_id = sos, task_id, endofprompt_id
        self.speech_token_size = speech_token_size
        self.pairs = cache_pairs(self.spec)
        self._written_into = {present: past for past, present in self.pairs}
        self.in_place: OrtRunner | None = None
        """`runner` when it writes the caches in place (`llm_decode`)."""
        self.max_positions = 0
        """`llm_decode`'s RoPE table rows (its metadata `max_positions`), where it is the runner."""
        if SEQLENS_K in self.spec.input_names:
            if not isinstance(runner, OrtRunner):
                raise TypeError(f"{self.spec.name} runs on onnxruntime, not on {type(runner).__name__}")
            if runner.device_type != CPU and prefill is not None:
                raise ValueError(f"{self.spec.name} on {runner.device_type} prefills itself, into its "
                                 "buffers there; no prefill body")
            self.in_place = runner
            self.max_positions = int(runner.metadata["max_positions"])

    def empty_cache(self, positions: int = 0) -> Cache:
        """The caches before the first call: zero-length `past_*` inputs, (1, kv_heads, 0, head_dim) each,
        or, for `llm_decode`, empty `KVBuffers` with room for `positions` + `FIRST_BUFFER_STEPS`."""
        if self.in_place is not None:
            return KVBuffers(self.spec, positions + FIRST_BUFFER_STEPS, self.max_positions,
                             self.in_place.device_type, self.in_place.device_id)
        return empty_caches(self.spec)

    def prompt_embeds(self, request: LlmRequest) -> np.ndarray:
        """`[E_speech[sos], E_text(prompt_text ++ text), E_speech[task_id], E_speech(prompt_speech)]`
        as (1, T, C) float32."""
        ids = np.asarray(request.prompt_text_ids + request.text_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.text_embedding.shape[0]):
            raise ValueError(f"text ids must be in [0, {self.text_embedding.shape[0]}), got "
                             f"[{ids.min()}, {ids.max()}]")
        speech = np.asarray(request.prompt_speech_tokens, dtype=np.int64)
        if speech.size and (speech.min() < 0 or speech.max() >= self.speech_token_size):
            raise ValueError(f"prompt speech tokens must be in [0, {self.speech_token_size})")
        rows = [self.speech_embedding[[self.sos]], self.text_embedding[ids],
                self.speech_embedding[[self.task_id]], self.speech_embedding[speech]]
        return np.concatenate(rows, axis=0)[None].astype(np.float32, copy=False)  # (1, T, C)

    def step(self, embeds: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        """One graph call: embeds (1, T, C) + the caches -> logp (V,) at the last position, the next caches.

        The cache stays where the runner keeps it (`Runner.infer_kept`: on onnxruntime, where the
        session computed it, so on a GPU it never crosses to the host; `KVBuffers`: written in place). A
        call over many positions runs on the prefill body where there is one: same I/O as `llm`, so its
        caches feed the next step as they are, or fill the buffers."""
        many = embeds.shape[1] >= PREFILL_BODY_FROM
        if isinstance(cache, KVBuffers):
            if self.prefill is not None and many:
                # in the prefill body's dtype (float32; an fp16 body's buffers are float16)
                dtypes = {t.name: t.np_dtype for t in self.prefill.spec.inputs}
                past = {p: a[:, :, :cache.length].astype(dtypes[p], copy=False)
                        for p, a in cache.arrays.items()}
                logp, grown = self._grow(self.prefill, embeds, past)
                cache.fill(grown)
                return logp, cache
            return self._extend(embeds, cache), cache
        runner = self.prefill if self.prefill is not None and many else self.runner
        return self._grow(runner, embeds, cache)

    def _grow(self, runner: Runner, embeds: np.ndarray, cache: Mapping[str, Feed]
              ) -> tuple[np.ndarray, dict[str, Feed]]:
        """A call on a body that takes the caches as `past_*` and returns them grown as `present_*`."""
        out, kept = runner.infer_kept({"inputs_embeds": embeds, **cache},
                                      keep=[present for _, present in self.pairs])
        return out["logp"][0], {past: kept[present] for past, present in self.pairs}

    def _extend(self, embeds: np.ndarray, cache: KVBuffers) -> np.ndarray:
        """A call on `llm_decode`, which writes the new positions into `cache`'s buffers."""
        cache.reserve(embeds.shape[1])
        logp = self.extend_rows(embeds, np.array([cache.length], dtype=np.int64), cache.values)
        cache.length += embeds.shape[1]
        return logp[0]

    def extend_rows(self, embeds: np.ndarray, lengths: np.ndarray,
                    buffers: Mapping[str, ort.OrtValue | BufferView]) -> np.ndarray:
        """One `llm_decode` call over a batch: embeds (B, T, C), row b's cache the first `lengths[b]`
        positions of row b of `buffers` (`past_*` -> a (B, KV, rows, D) buffer, or rows of one, on the
        runner's device), which must have room for T more; writes the new positions there and returns
        logp (B, V)."""
        assert self.in_place is not None
        feeds = {"inputs_embeds": embeds, **decode_lengths(lengths, embeds.shape[1]), **buffers}
        return self.in_place.infer_in_place(feeds, self._written_into, ["logp"])["logp"]

    def decode(self, request: LlmRequest, sampler: Sampler, *, max_tokens: int | None = None,
               ignore_stop: bool = False, max_ids: int | None = None) -> Decoding:
        """Start decoding `request`; iterate the result for the ids that pass the silent-token limiter.

        Together the text id lists must contain `<|endofprompt|>`. `max_tokens` replaces `max_len` as
        the number of decoding steps; `ignore_stop` masks every stop id so that exactly that many steps
        run (benchmarks). Limiter-dropped ids count as steps, so fewer ids may come out. `max_ids`: the
        decoding ends once it has kept one id more (what the flow holds, `Flow.max_tokens`: more fail there,
        as upstream's do, so the rest are not decoded first).
        """
        if self.endofprompt_id not in request.prompt_text_ids + request.text_ids:
            raise ValueError(f"<|endofprompt|> (id {self.endofprompt_id}) is in neither the text nor the "
                             "prompt text")
        lt = len(request.text_ids)
        steps = int(lt * MAX_TOKEN_TEXT_RATIO) if max_tokens is None else max_tokens
        return Decoding(self, request, sampler, min_len=int(lt * MIN_TOKEN_TEXT_RATIO), max_len=steps,
                        ignore_stop=ignore_stop, max_ids=max_ids)


class Decoding(Iterator[int]):
    """One segment's decoding in progress: an iterator of kept speech ids with its state in the open.

    `cache` holds the `past_*` values for the next call (`OrtValue`s left where onnxruntime computed
    them, or numpy arrays from other runners) or the `KVBuffers` `llm_decode` writes (made by the first
    call: a decoding prefilled in a batch's row has none), `history` every sampled id (limiter-dropped
    ones included: upstream's RAS history), `tokens` the kept ids so far, `steps` the graph calls made
    after the prefill, and `stop_id` the id that ended decoding (None if `max_len` did).
    """

    def __init__(self, lm: SpeechTokenLM, request: LlmRequest, sampler: Sampler, *, min_len: int,
                 max_len: int, ignore_stop: bool, max_ids: int | None = None) -> None:
        self.lm = lm
        self.sampler = sampler
        self.min_len, self.max_len, self.ignore_stop = min_len, max_len, ignore_stop
        self.max_ids = max_ids
        """Kept ids past which decoding ends, once it has one more (None: no bound but `max_len`)."""
        self._next_embeds: np.ndarray = lm.prompt_embeds(request)  # (1, T, C)
        self.cache: Cache | None = None
        self.history: list[int] = []
        self.tokens: list[int] = []
        self.steps = 0
        self.stop_id: int | None = None
        self.finished = False
        self._limiter = SilentTokenLimiter()

    def __next__(self) -> int:
        while not self.finished:
            token = self.advance()
            if token is not None:
                return token
        raise StopIteration

    @property
    def next_embeds(self) -> np.ndarray:
        """What the next call is fed: the request's prompt (1, T, C) before the prefill, then the last
        sampled id's row (1, 1, C)."""
        return self._next_embeds

    def close(self) -> None:
        """Stop decoding: no more steps run (the ids kept so far stay)."""
        self.finished = True

    def wants_step(self) -> bool:
        """Whether another step runs (False once a stop id, `max_len` or `close` ended decoding)."""
        if self.steps >= self.max_len:
            self.finished = True
        return not self.finished

    def advance(self) -> int | None:
        """One decoding step on this decoding's own cache; returns the kept id, or None if it was dropped or
        decoding ended."""
        if not self.wants_step():
            return None
        if self.cache is None:
            self.cache = self.lm.empty_cache(self._next_embeds.shape[1])
        logp, self.cache = self.lm.step(self._next_embeds, self.cache)
        return self.take(logp)

    def take(self, logp: np.ndarray) -> int | None:
        """The step after a call: sample from its log-probs (V,) at the last position (masked as upstream
        does), end at a stop id, feed the id back, apply the silent-token limiter; returns the kept id, or
        None. A batch (`decode_batch.DecodeBatcher`) makes the call for many decodings and takes their rows
        together (`take_rows`)."""
        if self.steps < self.min_len or self.ignore_stop:
            logp = logp.copy()
            self.mask(logp)
        return self.accept(self.sampler(logp, self.history))

    def mask(self, logp: np.ndarray) -> None:
        """Upstream's masks on this step's log-probs (V,), in place."""
        stop_from = self.lm.speech_token_size
        if self.steps < self.min_len:
            logp[stop_from] = -np.inf  # upstream masks sos here, not eos
        if self.ignore_stop:
            logp[stop_from:] = -np.inf

    def accept(self, token: int) -> int | None:
        """`take` after its draw: end at a stop id, feed the id back, apply the silent-token limiter."""
        stop_from = self.lm.speech_token_size
        self.steps += 1
        if token >= stop_from:
            self.stop_id, self.finished = token, True
            return None
        self.history.append(token)
        self._next_embeds = self.lm.speech_embedding[[token]][None]  # (1, 1, C)
        if not self._limiter.keep(token):
            return None
        self.tokens.append(token)
        if self.max_ids is not None and len(self.tokens) > self.max_ids:
            self.finished = True
        return token

    def run(self) -> list[int]:
        """Decode to the end; the kept ids."""
        for _ in self:
            pass
        return list(self.tokens)


def take_rows(decodings: Sequence[Decoding], logp: np.ndarray) -> list[int | None]:
    """`Decoding.take` for many decodings at once, row r of `logp` (R, V) being decodings[r]'s: each
    masked as it would be alone, in place (the caller's copy of the step's rows), and their ids drawn
    together (`sample_rows`), each the id it draws alone."""
    for decoding, row in zip(decodings, logp, strict=True):
        decoding.mask(row)
    tokens = sample_rows([d.sampler for d in decodings], logp, [d.history for d in decodings])
    return [d.accept(token) for d, token in zip(decodings, tokens, strict=True)]
