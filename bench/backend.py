"""What a benchmarked pipeline offers (`Backend`) and what its runs return.

The runtime and the torch reference each implement `Backend`; the suite times both through it, case by
case, interleaved. Every run starts from text (its front end inside the timed region) and a prompt
whose features were extracted before, unless the suite times the extraction with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .cases import Case

Figures = dict[str, float | int | None]


@dataclass(frozen=True)
class FirstChunk:
    """The first streamed chunk of a run."""

    seconds: float
    """From the request (text, before its front end) to the chunk's samples."""
    audio_s: float
    """Seconds of audio the chunk holds."""
    llm_s: float
    """Of `seconds`: the LLM's prefill and decode of the hop and its look-ahead."""
    flow_s: float
    """Of `seconds`: the flow (encoder and ODE; with the runtime, its prompt's prefix where not kept)."""
    vocoder_s: float
    """Of `seconds`: the vocoder."""


@dataclass(frozen=True)
class StreamRun:
    """A whole streamed synthesis."""

    first: FirstChunk
    seconds: float
    """From the request to the final chunk."""
    final_wait_s: float
    """From the chunk before the final one to the final one (the first chunk's time where it is the only
    one): how long a listener waits for the end once the rest is out."""
    audio_s: float
    samples: np.ndarray
    """The concatenated float32 samples."""
    speech_tokens: list[int]
    """The speech ids the LLM kept."""


@dataclass(frozen=True)
class OfflineRun:
    """An offline synthesis with its per-stage figures (keys of `report.FIGURES`)."""

    figures: Figures
    speech_tokens: list[int]


class Backend(Protocol):
    """A pipeline opened once, then run on cases. `prompt` is the backend's own prompt-features type."""

    name: str
    load_s: float
    """Seconds the pipeline took to open."""

    def prompt_features(self, wav: Path) -> Any:
        """The prompt recording's speech tokens, mel and x-vector."""
        ...

    def forget_prompts(self) -> None:
        """Drop whatever the pipeline keeps per prompt, so that the next run derives it from the features."""
        ...

    def first_chunk(self, case: Case, prompt: Any) -> FirstChunk:
        """Synthesise `case` up to its first streamed chunk."""
        ...

    def stream(self, case: Case, prompt: Any) -> StreamRun | None:
        """Synthesise `case` streamed, to the end; None where the backend has no streaming path."""
        ...

    def offline(self, case: Case, prompt: Any) -> OfflineRun:
        """Synthesise `case` offline, timing each stage."""
        ...

    def close(self) -> None:
        """Release the pipeline."""
        ...
