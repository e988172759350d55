"""Speech ids while the text still comes in: upstream's `inference_bistream` (`Qwen2LM`,
`cosyvoice/llm/llm.py`, CosyVoice3's token layout) over the `llm` graph.

The text arrives as ids, one at a time (upstream tokenises each piece of its generator and hands the ids on
one by one); the LLM's input interleaves them with speech:

- first `E_speech[sos]` and the prompt text up to and including `<|endofprompt|>`; the prompt text after
  it (zero-shot: the transcript) is the start of the text queue;
- while prompt speech tokens are left, every `MIX_RATIO` = (5 text, 15 speech) queued text ids append 5
  text and 15 prompt speech embeddings;
- then speech is decoded, the stop id `sos` masked (upstream's `ignore_eos`, which masks index
  `speech_token_size`), until a fill id: one is forced when prompt and generated ids (fills counted) reach
  a multiple of 15 after the prompt (`15 - Ls mod 15` generated ids for Ls prompt speech tokens), then
  every 16 ids; a sampled fill is taken as one and restarts that count. A fill is not fed back: decoding
  waits for 5 more queued text ids and feeds them alone. Any other stop id is an error, as upstream raises;
- when the text ends: the queued text and `E_speech[task_id]` are appended to the last input (after a fill,
  upstream's last input is the speech id the cache already holds, so it is fed twice: reproduced; prompt
  speech ids still unfed when a short text ends are never fed, as upstream), then speech is decoded with
  nothing masked until eos.

The RAS history is every sampled id, fills included; the silent-token limiter applies to the ids emitted,
as on the whole-text path. Upstream's final loop has no length bound; here it ends at `MAX_TOKEN_TEXT_RATIO`
(20) ids per text id, the bound upstream's whole-text path has (a trained model emits eos long before).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence

import numpy as np

from .errors import SynthesisError
from .llm import MAX_TOKEN_TEXT_RATIO, Cache, SpeechTokenLM
from .sampling import Sampler, SilentTokenLimiter

MIX_RATIO = (5, 15)
"""Text ids, then speech ids, per group of the interleaved input (upstream's `mix_ratio`, the yaml's)."""
FILL_OFFSET = 3
"""The fill id is `speech_token_size + 3` (`CosyVoice3LM.fill_token`; sos, eos and task_id are + 0, 1, 2)."""


class TextStreamDecoding(Iterator[int]):
    """One bistream decoding in progress: iterate for the kept speech ids; the text ids are read from
    `text_ids` as decoding needs them (so a generator that waits for an LLM's next words makes it wait).

    `tokens` are the kept ids so far, `history` every sampled id (fills included), `steps` the graph calls,
    `stop_id` the id that ended decoding (eos), None if the length bound did."""

    def __init__(self, lm: SpeechTokenLM, text_ids: Iterable[int], prompt_text_ids: Sequence[int],
                 prompt_speech_tokens: Sequence[int], sampler: Sampler, *, max_tokens: int | None = None,
                 max_ids: int | None = None) -> None:
        """`prompt_text_ids` must hold `<|endofprompt|>` (upstream asserts it: cross-lingual, which has no
        prompt text, cannot stream its text); `max_tokens` bounds the ids sampled (fills included) instead
        of `MAX_TOKEN_TEXT_RATIO` per text id (benchmarks). With `max_ids` (`Flow.max_tokens`), decoding
        ends once it has kept one id more: the synthesis fails at the flow then, as upstream's does with
        them all."""
        if lm.endofprompt_id not in prompt_text_ids:
            raise ValueError(f"<|endofprompt|> (id {lm.endofprompt_id}) is not in the prompt text: text "
                             "streaming (upstream's bistream) needs it there")
        self.lm, self.sampler, self.max_tokens, self.max_ids = lm, sampler, max_tokens, max_ids
        self.fill = lm.speech_token_size + FILL_OFFSET
        self.eos = lm.speech_token_size + 1
        self.history: list[int] = []
        self.tokens: list[int] = []
        self.steps = 0
        self.stop_id: int | None = None
        self.text_count = 0
        """Text ids read so far."""
        self._limiter = SilentTokenLimiter()
        self._ids = self._decode(iter(text_ids), list(prompt_text_ids), list(prompt_speech_tokens))

    def __next__(self) -> int:
        if self.max_ids is not None and len(self.tokens) > self.max_ids:
            self._ids.close()
            raise StopIteration
        for token in self._ids:
            if self._limiter.keep(token):
                self.tokens.append(token)
                return token
        raise StopIteration

    def close(self) -> None:
        """Stop decoding (the text source is not read further)."""
        self._ids.close()

    def run(self) -> list[int]:
        """Decode to the end; the kept ids."""
        for _ in self:
            pass
        return list(self.tokens)

    def _decode(self, text_ids: Iterator[int], prompt_text: list[int], prompt_speech: list[int]
                ) -> Generator[int, None, None]:
        """Every speech id sampled, fills left out, in upstream's order of calls."""
        lm = self.lm
        texts, speech_rows = MIX_RATIO
        eop = prompt_text.index(lm.endofprompt_id)
        start = [lm.speech_embedding[[lm.sos]], lm.text_embedding[prompt_text[:eop + 1]]]
        inputs: np.ndarray = np.concatenate(start)  # (T, C): the next call's embeddings
        queued = prompt_text[eop + 1:]
        """Text ids read and not yet fed."""
        next_fill = (len(prompt_speech) // speech_rows + 1) * speech_rows - len(prompt_speech)
        cache = lm.empty_cache(len(inputs))
        for text_id in text_ids:
            self.text_count += 1
            queued.append(int(text_id))
            while prompt_speech and len(queued) >= texts:
                inputs = np.concatenate([inputs, lm.text_embedding[queued[:texts]],
                                         lm.speech_embedding[prompt_speech[:speech_rows]]])
                queued, prompt_speech = queued[texts:], prompt_speech[speech_rows:]
            if prompt_speech:
                continue
            after_fill = bool(self.history) and self.history[-1] == self.fill
            if after_fill or (not self.history and len(inputs) == 1):
                if len(queued) < texts:
                    continue
                group = lm.text_embedding[queued[:texts]]
                inputs = group if after_fill else np.concatenate([inputs, group])
                queued = queued[texts:]
            while True:
                logp, cache = self._call(inputs, cache)
                if next_fill != -1 and len(self.history) == next_fill:
                    token = self.fill
                else:
                    logp = logp.copy()
                    logp[lm.speech_token_size] = -np.inf  # upstream's ignore_eos masks this index (sos)
                    token = self.sampler(logp, self.history)
                if token == self.fill:
                    next_fill = len(self.history) + speech_rows + 1
                self.history.append(token)
                if token == self.fill:
                    break
                self._check(token, "while the text streams in")
                yield token
                inputs = lm.speech_embedding[[token]]
        inputs = np.concatenate([inputs, lm.text_embedding[queued], lm.speech_embedding[[lm.task_id]]])
        limit = int(self.text_count * MAX_TOKEN_TEXT_RATIO) if self.max_tokens is None else self.max_tokens
        while len(self.history) < limit:
            logp, cache = self._call(inputs, cache)
            token = self.sampler(logp, self.history)
            self.history.append(token)
            if token == self.eos:
                self.stop_id = token
                return
            self._check(token, "after the text")
            yield token
            inputs = lm.speech_embedding[[token]]

    def _call(self, inputs: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        self.steps += 1
        return self.lm.step(inputs[None].astype(np.float32, copy=False), cache)

    def _check(self, token: int, when: str) -> None:
        """Upstream raises on a stop id it does not expect (`should not get token`)."""
        if token >= self.lm.speech_token_size:
            self.stop_id = token
            raise SynthesisError(f"the LLM sampled stop id {token} {when}, which upstream's bistream refuses")
