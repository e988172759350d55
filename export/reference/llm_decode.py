"""Torch reference for CosyVoice3's speech-token decoding (upstream's HF path, not vLLM).

Follows `Qwen2LM.inference` / `inference_wrapper` (`cosyvoice/llm/llm.py`), `ras_sampling`
(`cosyvoice/utils/common.py`) and the silent-token limiter of `llm_job` (`cosyvoice/cli/model.py`):

- input `[E_speech[sos], E_text(prompt_text ++ text), E_speech[task_id], E_speech(prompt_speech)]`,
  prefilled once, then one generated token per step through the explicit KV cache;
- `min_len = int(2 * Lt)`, `max_len = int(20 * Lt)`, Lt = number of tts-text tokens (prompt text excluded);
- any id >= speech_token_size stops decoding and is not emitted;
- sampling is repetition-aware (RAS), drawn by the runtime's numpy sampler from a caller-owned
  `numpy.random.Generator`, so the reference and the runtime draw the same ids for a seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cosyvoice_runtime.sampling import SilentTokenLimiter, ras_sample
from cosyvoice_runtime.text_stream import FILL_OFFSET, MIX_RATIO

from ..config import RASConfig
from ..nets.llm import CosyVoice3LM

MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0


class TorchSampler(Protocol):
    """The runtime's `Sampler` over torch log-probs: the next id from log-probs (V,) given the ids this
    call has emitted so far."""

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int: ...


@dataclass
class TorchRasSampler:
    """Upstream's repetition-aware sampling with the yaml's settings and an explicit generator.

    The draws are the runtime's (`cosyvoice_runtime.sampling.ras_sample`: one uniform per draw,
    inverse CDF), so a reference run and a runtime run with the same seed pick the same ids.
    """

    cfg: RASConfig
    generator: np.random.Generator

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int:
        return ras_sample(logp.detach().float().cpu().numpy(), history, self.cfg, self.generator)


@dataclass
class TorchGreedySampler:
    """Argmax (first index on ties), no RAS: deterministic decoding for exact comparisons."""

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int:
        return int(torch.argmax(logp))


def build_prompt_embeds(
    lm: CosyVoice3LM, ids: Sequence[int], prompt_speech_tokens: Sequence[int]
) -> Tensor:
    """`[E_speech[sos], E_text(ids), E_speech[task_id], E_speech(prompt_speech)]` as (1, T, C)."""
    device = lm.speech_embedding.weight.device
    cfg = lm.cfg

    def _ids(values: Sequence[int]) -> Tensor:
        return torch.tensor([list(values)], dtype=torch.long, device=device)  # (1, T)

    return torch.cat(
        (
            lm.embed_speech(_ids([cfg.sos])),
            lm.embed_text(_ids(ids)),
            lm.embed_speech(_ids([cfg.task_id])),
            lm.embed_speech(_ids(prompt_speech_tokens)),
        ),
        dim=1,
    )


@torch.no_grad()
def generate_speech_tokens(
    lm: CosyVoice3LM,
    text_ids: Sequence[int],
    prompt_text_ids: Sequence[int],
    prompt_speech_tokens: Sequence[int],
    eop_id: int,
    sampler: TorchSampler,
    *,
    max_tokens: int | None = None,
    ignore_stop: bool = False,
) -> list[int]:
    """Decode speech tokens for one utterance; returns the ids that pass the silent-token limiter.

    `text_ids` and `prompt_text_ids` are tokenised separately (as upstream's frontend does) and
    joined; together they must contain `eop_id` (`<|endofprompt|>`). `max_tokens` replaces
    `max_len` as the number of decoding steps; `ignore_stop` masks every stop id so that exactly that
    many steps run (benchmarks). Limiter-dropped ids count as steps, so the result may be shorter.

    Upstream quirk, reproduced: during the first `min_len` steps the masked index is
    `speech_token_size` (= sos), not eos, so an eos or another stop id can still end decoding early.
    """
    ids = list(prompt_text_ids) + list(text_ids)
    if eop_id not in ids:
        raise ValueError(f"<|endofprompt|> (id {eop_id}) is in neither the text nor the prompt text")
    lt = len(text_ids)
    min_len = int(lt * MIN_TOKEN_TEXT_RATIO)
    steps = int(lt * MAX_TOKEN_TEXT_RATIO) if max_tokens is None else max_tokens
    stop_from = lm.cfg.speech_token_size

    x = build_prompt_embeds(lm, ids, prompt_speech_tokens)  # (1, T, C)
    past_keys, past_values = lm.empty_cache(device=x.device, dtype=x.dtype)
    limiter = SilentTokenLimiter()
    history: list[int] = []
    out: list[int] = []
    for i in range(steps):
        logp, past_keys, past_values = lm.forward_step(x, past_keys, past_values)
        logp = logp[0].float()  # (V,)
        if i < min_len:
            logp[stop_from] = float("-inf")
        if ignore_stop:
            logp[stop_from:] = float("-inf")
        token = sampler(logp, history)
        if token >= stop_from:
            break
        history.append(token)
        if limiter.keep(token):
            out.append(token)
        x = lm.embed_speech(torch.tensor([[token]], dtype=torch.long, device=x.device))  # (1, 1, C)
    return out


@torch.no_grad()
def generate_speech_tokens_bistream(
    lm: CosyVoice3LM,
    text_ids: Iterable[int],
    prompt_text_ids: Sequence[int],
    prompt_speech_tokens: Sequence[int],
    eop_id: int,
    sampler: TorchSampler,
    *,
    max_tokens: int | None = None,
) -> list[int]:
    """Upstream's `Qwen2LM.inference_bistream` for CosyVoice3 (text ids arriving one at a time), with the
    silent-token limiter of `llm_job`; returns the kept ids. Upstream's final loop has no length bound; this
    one stops at `MAX_TOKEN_TEXT_RATIO` sampled ids per text id, or `max_tokens` (the runtime's
    `text_stream.TextStreamDecoding` has the same bound)."""
    cfg = lm.cfg
    device = lm.speech_embedding.weight.device
    texts, speech_rows = MIX_RATIO
    fill, eos, size = cfg.speech_token_size + FILL_OFFSET, cfg.eos, cfg.speech_token_size

    def text(ids: Sequence[int]) -> Tensor:
        return lm.embed_text(torch.tensor([list(ids)], dtype=torch.long, device=device))

    def speech(ids: Sequence[int]) -> Tensor:
        return lm.embed_speech(torch.tensor([list(ids)], dtype=torch.long, device=device))

    prompt_text, prompt_speech = list(prompt_text_ids), list(prompt_speech_tokens)
    eop = prompt_text.index(eop_id)
    x = torch.cat((speech([cfg.sos]), text(prompt_text[:eop + 1])), dim=1)
    queued = prompt_text[eop + 1:]
    next_fill = (len(prompt_speech) // speech_rows + 1) * speech_rows - len(prompt_speech)
    keys, values = lm.empty_cache(device=device, dtype=x.dtype)
    history: list[int] = []
    emitted: list[int] = []
    count = 0

    def step(x: Tensor) -> Tensor:
        nonlocal keys, values
        logp, keys, values = lm.forward_step(x, keys, values)
        return logp[0].float()

    for text_id in text_ids:
        count += 1
        queued.append(int(text_id))
        while prompt_speech and len(queued) >= texts:
            x = torch.cat((x, text(queued[:texts]), speech(prompt_speech[:speech_rows])), dim=1)
            queued, prompt_speech = queued[texts:], prompt_speech[speech_rows:]
        if prompt_speech:
            continue
        after_fill = bool(history) and history[-1] == fill
        if after_fill or (not history and x.shape[1] == 1):
            if len(queued) < texts:
                continue
            x = text(queued[:texts]) if after_fill else torch.cat((x, text(queued[:texts])), dim=1)
            queued = queued[texts:]
        while True:
            logp = step(x)
            if next_fill != -1 and len(history) == next_fill:
                token = fill
            else:
                logp[size] = float("-inf")
                token = sampler(logp, history)
            if token == fill:
                next_fill = len(history) + speech_rows + 1
            history.append(token)
            if token == fill:
                break
            if token >= size:
                raise ValueError(f"should not get token {token}")
            emitted.append(token)
            x = speech([token])
    x = torch.cat((x, text(queued), speech([cfg.task_id])), dim=1)
    limit = int(count * MAX_TOKEN_TEXT_RATIO) if max_tokens is None else max_tokens
    while len(history) < limit:
        token = sampler(step(x), history)
        history.append(token)
        if token == eos:
            break
        if token >= size:
            raise ValueError(f"should not get token {token}")
        emitted.append(token)
        x = speech([token])
    limiter = SilentTokenLimiter()
    return [t for t in emitted if limiter.keep(t)]
