"""Speech-token sampling in numpy, with every random draw explicit.

Upstream samples with `torch.multinomial`, whose draws cannot be reproduced outside torch. Here a
sampler owns a caller-seeded `numpy.random.Generator`, and each draw is exactly one
`generator.random()` uniform mapped to an id by inverse CDF over the (unnormalised) weights
(`draw_index`). The torch reference (`cosyvoice_export.reference.llm_decode`) calls these same
functions, so a seed gives the same ids in both.

- `ras_sample`: upstream's repetition-aware sampling (`ras_sampling`, `cosyvoice/utils/common.py`).
- `greedy_sample`: argmax, for exact comparisons.
- `SilentTokenLimiter`: CosyVoice3Model's cap on runs of silent ids (`llm_job`, `cosyvoice/cli/model.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import UserError

SILENT_TOKENS: frozenset[int] = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
"""FSQ silence/breath ids that `CosyVoice3Model` rate-limits (`model.py`, `silent_tokens`)."""

MAX_SILENT_RUN = 5
"""Ids kept at the start of every run of consecutive silent ids."""

MAX_SEED = 2**63 - 1
"""Largest seed accepted (seeds run from 0): a signed 64-bit integer, which every client language and
protobuf's int64 can hold. PCG64 takes any non-negative integer and refuses a negative one."""


class Sampler(Protocol):
    """Picks the next id from log-probs (V,) given the ids this utterance has emitted so far."""

    def __call__(self, logp: np.ndarray, history: Sequence[int]) -> int: ...


@dataclass(frozen=True)
class RasConfig:
    """Repetition-aware sampling settings (the yaml's `ras_sampling` partial)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    """How many of the most recent emitted ids the repetition check looks at."""
    tau_r: float = 0.1
    """A drawn id seen at least `win_size * tau_r` times in the window is redrawn."""


def softmax(scores: np.ndarray) -> np.ndarray:
    """float32 softmax of (V,) scores; -inf scores get probability 0."""
    scores = np.asarray(scores, dtype=np.float32)
    e = np.exp(scores - scores.max())  # (V,)
    return e / e.sum(dtype=np.float32)


def nucleus_size(sorted_probs: np.ndarray, top_p: float, top_k: int) -> int:
    """How many of the descending-sorted probs (V,) upstream's nucleus keeps.

    Ids are taken while the running total is below `top_p` and fewer than `top_k` are kept, so the id
    that crosses `top_p` is included. The total is accumulated one float32 add at a time, as upstream
    does: numpy's `cumsum` is such a sequence of adds (a pairwise sum may round differently at the
    boundary).
    """
    limit = min(top_k, sorted_probs.shape[0])
    if limit == 0:
        return 0
    ended = ~(sorted_probs[:limit].cumsum(dtype=np.float32) < top_p)  # (limit,); a NaN total ends it too
    first = int(ended.argmax())
    return first + 1 if ended[first] else limit


def draw_index(weights: np.ndarray, u: float) -> int:
    """Inverse CDF: the index i with cdf[i-1] <= u * total < cdf[i] over non-negative `weights` (N,).

    `u` is one uniform draw in [0, 1). The weights need not sum to 1; the cumulative sum is taken in
    float64. A zero weight is never picked.
    """
    cdf = weights.cumsum(dtype=np.float64)  # (N,)
    index = int(cdf.searchsorted(u * cdf[-1], side="right"))
    if index >= cdf.shape[0]:  # u * total rounded up to total: take the last id that has weight
        index = int(weights.nonzero()[0][-1])
    return index


TOP_SAMPLE_STRIDE = 8
"""`top_order` bounds the k-th largest prob by the k-th largest of every this many probs."""


def top_order(probs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the `k` largest of `probs` (V,), descending, ties in id order: the first `k` of torch's
    stable descending sort, without sorting all V (a decode step's hot path, hence array methods rather
    than numpy's slower function wrappers).

    The k-th largest of a strided sample is at most the k-th largest of all (the sample's k largest are
    among all), so the probs at least that large hold the answer and every tie of its last value, and their
    own stable descending sort begins with it: some 200 of the 6761 speech ids sorted instead of all."""
    vocab = probs.shape[0]
    if k >= vocab:
        return np.argsort(-probs, kind="stable")
    pool = None
    sample = probs[::TOP_SAMPLE_STRIDE].copy()
    if sample.shape[0] > k:
        sample.partition(sample.shape[0] - k)
        found = (probs >= sample[sample.shape[0] - k]).nonzero()[0]  # ascending ids
        if found.shape[0] >= k:  # fewer only where a NaN made the bound
            pool = found
    if pool is None:
        kth = np.partition(probs, vocab - k)[vocab - k]  # the k-th largest value
        pool = (probs >= kth).nonzero()[0]
    return pool[(-probs[pool]).argsort(kind="stable")[:k]]


def ras_sample(logp: np.ndarray, history: Sequence[int], cfg: RasConfig, generator: np.random.Generator
               ) -> int:
    """Repetition-aware sampling (VALL-E 2) as upstream's `ras_sampling`, with explicit uniforms.

    One uniform picks an id from the top-p/top-k nucleus of `softmax(logp)` (stable descending sort,
    unnormalised kept probs). If that id occurs at least `win_size * tau_r` times in the last
    `win_size` history ids, its score is set to -inf and a second uniform picks an id from the full
    softmax of the rest. The redrawn id is not re-checked and may be a stop id.
    """
    scores = np.asarray(logp, dtype=np.float32)  # (V,)
    probs = softmax(scores)
    order = top_order(probs, cfg.top_k)
    sorted_probs = probs[order]
    n = nucleus_size(sorted_probs, cfg.top_p, cfg.top_k)
    token = int(order[draw_index(sorted_probs[:n], generator.random())])
    window = list(history[-cfg.win_size:]) if cfg.win_size > 0 else []
    if window.count(token) >= cfg.win_size * cfg.tau_r:
        scores = scores.copy()
        scores[token] = -np.inf
        token = draw_index(softmax(scores), generator.random())
    return token


def greedy_sample(logp: np.ndarray) -> int:
    """Argmax of (V,) log-probs, the first index on ties."""
    return int(np.argmax(logp))


@dataclass
class RasSampler:
    """`ras_sample` with fixed settings and a caller-owned generator (seed it for reproducible ids)."""

    generator: np.random.Generator
    cfg: RasConfig = field(default_factory=RasConfig)

    @classmethod
    def seeded(cls, seed: int, cfg: RasConfig | None = None) -> RasSampler:
        """A sampler drawing from `numpy.random.Generator(PCG64(seed))`."""
        return cls(np.random.Generator(np.random.PCG64(seed)), cfg or RasConfig())

    def __call__(self, logp: np.ndarray, history: Sequence[int]) -> int:
        return ras_sample(logp, history, self.cfg, self.generator)


@dataclass
class GreedySampler:
    """Argmax decoding (first index on ties), no RAS: deterministic ids for exact comparisons."""

    def __call__(self, logp: np.ndarray, history: Sequence[int]) -> int:
        return greedy_sample(logp)


@dataclass
class SilentTokenLimiter:
    """Keeps the first `max_run` ids of every run of consecutive silent ids and drops the rest.

    Only a non-silent id ends a run. Dropped ids are still fed back to the LM and stay in the RAS
    history; they are only left out of what reaches the flow.
    """

    silent_ids: frozenset[int] = SILENT_TOKENS
    max_run: int = MAX_SILENT_RUN
    _run: int = field(default=0, init=False)

    def keep(self, token: int) -> bool:
        """Whether `token` goes to the output; updates the run counter."""
        if token not in self.silent_ids:
            self._run = 0
            return True
        self._run += 1
        return self._run <= self.max_run


SAMPLINGS = ("ras", "greedy")


def make_sampler(kind: str, seed: int = 0, cfg: RasConfig | None = None) -> Sampler:
    """A fresh sampler: "ras" (seeded PCG64) or "greedy" (the seed is unused)."""
    if kind == "ras":
        return RasSampler.seeded(seed, cfg)
    if kind == "greedy":
        return GreedySampler()
    raise ValueError(f"unknown sampling {kind!r}; known: {', '.join(SAMPLINGS)}")


@dataclass(frozen=True)
class Sampling:
    """How speech ids are drawn: each segment gets a fresh sampler of this kind and seed, as each of
    upstream's requests does."""

    kind: str = "ras"
    """"ras" (upstream's repetition-aware sampling) or "greedy" (argmax; the seed is unused)."""
    seed: int = 0
    """0 to `MAX_SEED`."""

    def __post_init__(self) -> None:
        if self.kind not in SAMPLINGS:
            raise UserError(f"sampling is {self.kind!r}; expected one of {', '.join(SAMPLINGS)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"seed is {self.seed}; expected an integer from 0 to {MAX_SEED}")

    def sampler(self) -> Sampler:
        """A fresh sampler."""
        return make_sampler(self.kind, self.seed)
