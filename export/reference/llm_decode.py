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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cosyvoice_runtime.sampling import SilentTokenLimiter, ras_sample

from ..config import RASConfig
from ..nets.llm import CosyVoice3LM

MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0

class Sampler(Protocol):
    """Picks the next id from log-probs (V,) given the ids this call has emitted so far."""

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int: ...


@dataclass
class RasSampler:
    """Upstream's repetition-aware sampling with the yaml's settings and an explicit generator.

    The draws are the runtime's (`cosyvoice_runtime.sampling.ras_sample`: one uniform per draw,
    inverse CDF), so a reference run and a runtime run with the same seed pick the same ids.
    """

    cfg: RASConfig
    generator: np.random.Generator

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int:
        return ras_sample(logp.detach().float().cpu().numpy(), history, self.cfg, self.generator)


@dataclass
class GreedySampler:
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
    sampler: Sampler,
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
