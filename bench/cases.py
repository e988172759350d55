"""What is synthesised: the text lengths, the pinned LLM step count of each, and the option lists.

Every case decodes a pinned number of LLM steps with the stop ids masked (`SpeechTokenLM.decode`'s
`max_tokens` / `ignore_stop`), so the runtime and the torch reference do the same work on random
weights. The long case's count defaults to 10 s of audio at the bundle's token rate; the shorter cases
take a share of it that matches their text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cosyvoice_graphs import ModelDims

from .errors import BenchError

LONG_SECONDS = 10.0
"""Audio the long case stands for; its pinned step count is this many seconds of speech tokens."""
QUICK_LONG_TOKENS = 50
"""The long case's pinned step count under `--quick` (smoke runs on the tiny bundle)."""


@dataclass(frozen=True)
class Length:
    """A text length: a sentence about that long when spoken, and its share of the long case's tokens."""

    name: str
    text: str
    share: float


LENGTHS: dict[str, Length] = {length.name: length for length in (
    Length("short", "Good morning, how are you today?", 0.2),
    Length("medium", "The library opens at nine in the morning and closes late in the evening on weekdays.",
           0.5),
    Length("long", "When the storm finally passed, the villagers walked down to the harbour to count the "
                   "boats, and found that every one of them had survived the long night without a scratch.",
           1.0),
)}


@dataclass(frozen=True)
class Case:
    """One length with its pinned LLM step count."""

    length: Length
    tokens: int
    """LLM decoding steps, stop ids masked (the silent-token limiter may keep fewer ids)."""

    @property
    def name(self) -> str:
        return self.length.name

    @property
    def text(self) -> str:
        return self.length.text


def tokens_per_second(dims: ModelDims) -> float:
    """Speech tokens per second of audio: sample_rate / (samples_per_frame · token_mel_ratio), 25 here."""
    return dims.sample_rate / (dims.samples_per_frame * dims.token_mel_ratio)


def default_long_tokens(dims: ModelDims, *, quick: bool) -> int:
    """The long case's pinned steps: `LONG_SECONDS` of audio (250), or `QUICK_LONG_TOKENS` for `--quick`."""
    return QUICK_LONG_TOKENS if quick else round(LONG_SECONDS * tokens_per_second(dims))


def make_cases(names: Sequence[str], long_tokens: int) -> list[Case]:
    """The cases for `names` (keys of `LENGTHS`), each pinned to its share of `long_tokens` (at least 1)."""
    if long_tokens < 1:
        raise BenchError(f"--tokens must be at least 1, got {long_tokens}")
    return [Case(LENGTHS[n], max(1, round(LENGTHS[n].share * long_tokens))) for n in names]


def parse_lengths(text: str) -> list[str]:
    """'short,long' -> ['short', 'long']: known names, no repeats, in the order given."""
    names = _items(text, "--lengths")
    unknown = [n for n in names if n not in LENGTHS]
    if unknown:
        raise BenchError(f"--lengths: unknown length {unknown[0]!r}; known: {', '.join(LENGTHS)}")
    return names


def parse_levels(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: positive integers, no repeats."""
    items = _items(text, "--concurrency")
    bad = [i for i in items if not i.isdigit() or int(i) < 1]
    if bad:
        raise BenchError(f"--concurrency: {bad[0]!r} is not a positive integer")
    return [int(i) for i in items]


def _items(text: str, option: str) -> list[str]:
    items = [i.strip() for i in text.split(",")]
    if not all(items):
        raise BenchError(f"{option}: expected a comma-separated list without empty items, got {text!r}")
    if len(set(items)) != len(items):
        raise BenchError(f"{option}: {text!r} repeats an item")
    return items
