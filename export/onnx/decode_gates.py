"""Sequence-level fidelity of a reduced-precision autoregressive graph: teacher-forced decoding of the
ONNX graph beside the torch float32 wrapper, judged by the spec's `DecodeGates`.

Per-output tolerances at a few random inputs say little about what decoding sees: a prompt, then one id
after another, each step's distribution conditioned on a cache the graph itself wrote. Here both run the
same sequence (the graph's `ExportRecipe.sequence`: `graphs.llm_sequence`): a zero-shot-like prefill (sos,
text embeddings, task_id, prompt speech embeddings, from the model's own tables), then `steps` one-position
calls, each fed the embedding of torch's greedy speech id, so that every call's next-id distribution can be
compared on the same history.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import nn

from cosyvoice_graphs import (
    SEQLENS_K,
    TOTAL_SEQUENCE_LENGTH,
    GraphSpec,
    cache_pairs,
    decode_lengths,
    empty_caches,
)

from .errors import ExportError
from .graphs import DecodeSequence
from .validate import Figure, cpu_graph, gate_figures, run_torch


@dataclass(frozen=True)
class DecodeReference:
    """The torch float32 half of a teacher-forced run: what `decode_figures` compares a graph with. It needs
    no graph, so that the wrapper's network can be freed before the graph is made."""

    sequence: DecodeSequence
    logps: np.ndarray
    """(calls, ids) float32: torch's output `gates.output` of each call."""
    chosen: tuple[int, ...]
    """Torch's greedy id after each call but the last: the row the next call is fed."""


def _fed_input(spec: GraphSpec) -> str:
    pairs = dict(cache_pairs(spec))
    fed = [n for n in spec.input_names if n not in pairs and n not in (SEQLENS_K, TOTAL_SEQUENCE_LENGTH)]
    if len(fed) != 1:
        raise ExportError(f"{spec.name}: decode gates need one input besides the caches, found {fed}")
    return fed[0]


def _feeds(spec: GraphSpec, fed: str, step: np.ndarray, caches: dict[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    """One call's inputs: `step`, the caches, and where the graph takes them (`llm_decode`), its lengths:
    every row of the caches holds the cache, as they grow here."""
    feeds = {fed: step, **caches}
    if SEQLENS_K in spec.input_names:  # one row
        feeds.update(decode_lengths([next(iter(caches.values())).shape[2]], step.shape[1]))
    return feeds


def _steps(sequence: DecodeSequence, chosen: tuple[int, ...]) -> Iterator[np.ndarray]:
    """What each call of a teacher-forced run is fed: the prefill, then the rows of the chosen ids."""
    yield sequence.prefill
    for i in chosen:
        yield sequence.rows[[i]][None]  # (1, 1, C)


def decode_reference(wrapper: nn.Module, spec: GraphSpec, precision: str, sequence: DecodeSequence
                     ) -> DecodeReference:
    """`wrapper` (torch float32) teacher-forced on `sequence` for `spec.decode_gates[precision]`: its
    output at each call, and its greedy ids."""
    gates = spec.decode_gates[precision]
    fed, pairs = _fed_input(spec), cache_pairs(spec)
    caches = empty_caches(spec)
    logps: list[np.ndarray] = []
    chosen: list[int] = []
    step = sequence.prefill
    for _ in range(gates.steps + 1):
        out = run_torch(wrapper, spec, _feeds(spec, fed, step, caches))
        logps.append(out[gates.output].reshape(-1))
        caches = {past: out[present] for past, present in pairs}
        chosen.append(int(np.argmax(logps[-1][:sequence.choices])))
        step = sequence.rows[[chosen[-1]]][None]  # (1, 1, C)
    return DecodeReference(sequence, np.stack(logps), tuple(chosen[:-1]))


def decode_figures(path: Path, spec: GraphSpec, precision: str, reference: DecodeReference
                   ) -> tuple[Figure, ...]:
    """The figure of each of `spec.decode_gates[precision]` for the ONNX graph at `path` (run as `cpu_graph`
    runs a `precision` graph), fed what `reference` was fed, against `reference`. Failures are figures, not
    raised."""
    gates = spec.decode_gates[precision]
    fed, pairs = _fed_input(spec), cache_pairs(spec)
    run, _ = cpu_graph(path, spec, precision)
    caches = empty_caches(spec)
    logps: list[np.ndarray] = []
    for step in _steps(reference.sequence, reference.chosen):
        out = run(_feeds(spec, fed, step, caches))
        logps.append(out[gates.output].reshape(-1))
        caches = {past: out[present] for past, present in pairs}
    prefill = reference.sequence.prefill.shape[1]
    label = f"teacher-forced decode: {prefill}-position prefill + {gates.steps} steps"
    return gate_figures(label, gates, np.stack(logps), reference.logps, "log-probs")


def validate_decode(path: Path, wrapper: nn.Module, spec: GraphSpec, precision: str, sequence: DecodeSequence
                    ) -> tuple[Figure, ...]:
    """The figure of each of `spec.decode_gates[precision]` for the ONNX graph at `path` (run as
    `cpu_graph` runs a `precision` graph) against `wrapper` (torch float32), teacher-forced on `sequence`
    (`decode_reference`, then `decode_figures`). Failures are figures, not raised."""
    return decode_figures(path, spec, precision, decode_reference(wrapper, spec, precision, sequence))
