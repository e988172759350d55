"""Speech-token sampling in numpy, with every random draw explicit.

Upstream samples with `torch.multinomial`, whose draws cannot be reproduced outside torch. Here a
sampler owns a caller-seeded `numpy.random.Generator`, and each draw is exactly one
`generator.random()` uniform mapped to an id by inverse CDF over the (unnormalised) weights
(`draw_indices`). The torch reference (`cosyvoice_export.reference.llm_decode`) calls these same
functions, so a seed gives the same ids in both.

- `ras_sample`: upstream's repetition-aware sampling (`ras_sampling`, `cosyvoice/utils/common.py`);
  `ras_sample_rows` draws a batch's rows together, each the id it draws alone (`sample_rows`).
- `greedy_sample`: argmax, for exact comparisons.
- `SilentTokenLimiter`: CosyVoice3Model's cap on runs of silent ids (`llm_job`, `cosyvoice/cli/model.py`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import UserError, require_finite

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
    """float32 softmax over the last axis of (..., V) scores; -inf scores get probability 0. A row of a
    batch gets what it gets alone, to the bit: numpy sums a contiguous last axis row by row, pairwise."""
    scores = np.asarray(scores, dtype=np.float32)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, dtype=np.float32, keepdims=True)


def nucleus_sizes(sorted_probs: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """How many of each row's descending-sorted probs (R, N) upstream's nucleus keeps, as (R,) ints.

    Ids are taken while the running total is below `top_p` and fewer than `top_k` are kept, so the id
    that crosses `top_p` is included. The total is accumulated one float32 add at a time, as upstream
    does: numpy's `cumsum` is such a sequence of adds (a pairwise sum may round differently at the
    boundary).
    """
    rows, limit = sorted_probs.shape[0], min(top_k, sorted_probs.shape[1])
    if limit == 0:
        return np.zeros(rows, dtype=np.int64)
    ended = ~(sorted_probs[:, :limit].cumsum(axis=1, dtype=np.float32) < top_p)  # a NaN total ends it too
    first = ended.argmax(axis=1)
    return np.where(ended[np.arange(rows), first], first + 1, limit)


def draw_indices(weights: np.ndarray, counts: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF per row: over row r's first `counts[r]` non-negative `weights` (R, N), the index i with
    cdf[i-1] <= u[r] * total < cdf[i], as (R,) ints.

    `u` holds one uniform draw in [0, 1) per row. The weights need not sum to 1; the cumulative sum is
    taken in float64 (a running sum, so each prefix is the row's own whatever follows it). A zero weight
    is never picked.
    """
    cdf = weights.cumsum(axis=1, dtype=np.float64)  # (R, N)
    limits = cdf[np.arange(weights.shape[0]), counts - 1] * u
    # numpy's searchsorted(side="right") on each row: no total past a row's first counts[r] is below its
    # limit unless the limit is the whole total, which the fallback below takes
    index = np.count_nonzero(cdf <= limits[:, None], axis=1)
    for row in np.flatnonzero(index >= counts):  # u * total rounded up to total: the last id with weight
        index[row] = weights[row, :counts[row]].nonzero()[0][-1]
    return index


TOP_SAMPLE_STRIDE = 8
"""`top_orders` bounds each row's k-th largest prob by the k-th largest of every this many probs."""


def top_orders(probs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the `k` largest of each row of finite `probs` (R, V), descending, ties in id order, as
    (R, k): the first `k` of torch's stable descending sort, without sorting all V (a decode step's hot
    path).

    The k-th largest of a strided sample is at most the k-th largest of all (the sample's k largest are
    among all), so the probs at least that large hold the answer and every tie of its last value, and their
    own stable descending sort begins with it: some 200 of the 6761 speech ids sorted instead of all."""
    rows, vocab = probs.shape
    if k >= vocab:
        return np.argsort(-probs, axis=1, kind="stable")
    sample = probs[:, ::TOP_SAMPLE_STRIDE]
    if sample.shape[1] > k:
        bounds = np.partition(sample, sample.shape[1] - k, axis=1)[:, sample.shape[1] - k]
    else:  # too few to sample: each row's k-th largest itself
        bounds = np.partition(probs, vocab - k, axis=1)[:, vocab - k]
    flat = (probs >= bounds[:, None]).ravel().nonzero()[0]  # row by row, each row's ids ascending
    ends = np.searchsorted(flat, np.arange(1, rows + 1) * vocab).tolist()
    values = probs.ravel()[flat]
    order = np.empty((rows, k), dtype=np.int64)
    start = 0
    for row, end in enumerate(ends):
        order[row] = flat[start:end][(-values[start:end]).argsort(kind="stable")[:k]] - row * vocab
        start = end
    return order


def ras_sample_rows(logp: np.ndarray, histories: Sequence[Sequence[int]], cfg: RasConfig,
                    generators: Sequence[np.random.Generator]) -> list[int]:
    """Repetition-aware sampling (VALL-E 2) as upstream's `ras_sampling`, with explicit uniforms, for
    each row of `logp` (R, V) with its own history and generator: each row's id is the one it draws alone.

    One uniform picks an id from the top-p/top-k nucleus of `softmax(logp)` (stable descending sort,
    unnormalised kept probs). If that id occurs at least `win_size * tau_r` times in the last
    `win_size` history ids, its score is set to -inf and a second uniform picks an id from the full
    softmax of the rest. The redrawn id is not re-checked and may be a stop id.
    """
    if len({id(g) for g in generators}) < len(generators):  # a shared generator: its draws in row order
        return [ras_sample_rows(logp[row:row + 1], histories[row:row + 1], cfg, generators[row:row + 1])[0]
                for row in range(len(generators))]
    scores = np.asarray(logp, dtype=np.float32)  # (R, V)
    probs = softmax(scores)
    require_finite(probs[:, 0], "the LLM's log-probs")  # a NaN or +inf score makes its row's every prob NaN
    order = top_orders(probs, cfg.top_k)
    sorted_probs = probs[np.arange(order.shape[0])[:, None], order]  # (R, k)
    n = nucleus_sizes(sorted_probs, cfg.top_p, cfg.top_k)
    u = np.array([g.random() for g in generators])
    tokens = order[np.arange(order.shape[0]), draw_indices(sorted_probs, n, u)].tolist()
    for row, (token, history) in enumerate(zip(tokens, histories, strict=True)):
        window = list(history[-cfg.win_size:]) if cfg.win_size > 0 else []
        if window.count(token) >= cfg.win_size * cfg.tau_r:
            redraw = scores[row:row + 1].copy()
            redraw[0, token] = -np.inf
            tokens[row] = int(draw_indices(softmax(redraw), np.array([redraw.shape[1]]),
                                           np.array([generators[row].random()]))[0])
    return tokens


def ras_sample(logp: np.ndarray, history: Sequence[int], cfg: RasConfig, generator: np.random.Generator
               ) -> int:
    """`ras_sample_rows` for one decoding's log-probs (V,)."""
    return ras_sample_rows(np.asarray(logp)[None], [history], cfg, [generator])[0]


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


def sample_rows(samplers: Sequence[Sampler], logp: np.ndarray, histories: Sequence[Sequence[int]]
                ) -> list[int]:
    """Row r's id of `logp` (R, V) from `samplers[r]` given `histories[r]`, each the id that sampler draws
    alone: the `RasSampler`s of one config draw together (`ras_sample_rows`), any other sampler row by row."""
    tokens = [0] * len(samplers)
    together: dict[RasConfig, list[tuple[int, np.random.Generator]]] = {}
    for row, sampler in enumerate(samplers):
        if isinstance(sampler, RasSampler):
            together.setdefault(sampler.cfg, []).append((row, sampler.generator))
        else:
            tokens[row] = sampler(logp[row], histories[row])
    for cfg, members in together.items():
        rows = [row for row, _ in members]
        drawn = ras_sample_rows(logp[rows], [histories[r] for r in rows], cfg, [g for _, g in members])
        for row, token in zip(rows, drawn, strict=True):
            tokens[row] = token
    return tokens


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
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                or not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"seed is {self.seed!r}; expected an integer from 0 to {MAX_SEED}")

    def sampler(self) -> Sampler:
        """A fresh sampler."""
        return make_sampler(self.kind, self.seed)
