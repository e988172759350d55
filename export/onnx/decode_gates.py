"""Sequence-level fidelity of a reduced-precision autoregressive graph: teacher-forced decoding of the
ONNX graph beside the torch float32 wrapper, judged by the spec's `DecodeGates`.

Per-output tolerances at a few random inputs say little about what decoding sees: a prompt, then one id
after another, each step's distribution conditioned on a cache the graph itself wrote. Here both run the
same sequence: a zero-shot-like prefill (sos, text embeddings, task_id, prompt speech embeddings, from the
model's own tables), then `steps` one-position calls, each fed the embedding of torch's greedy speech id,
so that every call's next-id distribution can be compared on the same history.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import nn

from cosyvoice_graphs import GraphSpec, cache_pairs, empty_caches

from .graphs import Networks
from .trace import ExportError
from .validate import Figure, cpu_graph, gate_figures, run_torch

PROMPT_TEXT_IDS = 30
"""Text positions of the prefill: a sentence's worth of ids."""
PROMPT_SPEECH_IDS = 150
"""Prompt speech positions of the prefill (6 s at 25 tokens/s): with 200 steps the cache grows from 182
to 382 positions, where decoding spends its time."""
SEED = 0


@dataclass(frozen=True)
class DecodeSequence:
    """What one teacher-forced run feeds: the prefill, and the rows fed back for a chosen id."""

    prefill: np.ndarray
    """(1, T, C) float32: the first call's input."""
    rows: np.ndarray
    """(ids, C) float32: a decode call's input is row `id` of this table, `id` torch's greedy choice."""
    choices: int
    """Greedy ids are chosen among the first `choices` rows (the speech codebook: no stop id)."""


def llm_sequence(nets: Networks) -> DecodeSequence:
    """`[E_speech[sos], E_text(30 ids), E_speech[task_id], E_speech(150 ids)]`, ids drawn with `SEED`; fed
    back: speech-table rows, greedy over the codebook."""
    lm, cfg = nets.llm, nets.llm.cfg
    rng = np.random.default_rng(SEED)
    text = lm.backbone.embed_tokens.weight.detach().numpy()
    speech = lm.speech_embedding.weight.detach().numpy()
    text_ids = rng.integers(0, text.shape[0], PROMPT_TEXT_IDS)
    speech_ids = rng.integers(0, cfg.speech_token_size, PROMPT_SPEECH_IDS)
    prefill = np.concatenate([speech[[cfg.sos]], text[text_ids], speech[[cfg.task_id]], speech[speech_ids]])
    return DecodeSequence(prefill[None].astype(np.float32), speech.astype(np.float32), cfg.speech_token_size)


SEQUENCES: dict[str, Callable[[Networks], DecodeSequence]] = {"llm": llm_sequence}
"""Graph name -> the sequence its decode gates are measured on (every spec with `decode_gates` has one)."""


def validate_decode(path: Path, wrapper: nn.Module, spec: GraphSpec, precision: str, sequence: DecodeSequence
                    ) -> tuple[Figure, ...]:
    """The figure of each of `spec.decode_gates[precision]` for the ONNX graph at `path` (run as
    `cpu_graph` runs a `precision` graph) against `wrapper` (torch float32), teacher-forced on `sequence`.
    Failures are figures, not raised."""
    gates = spec.decode_gates[precision]
    pairs = cache_pairs(spec)
    fed = [n for n in spec.input_names if n not in dict(pairs)]
    if len(fed) != 1:
        raise ExportError(f"{spec.name}: decode gates need one input besides the caches, found {fed}")
    run, _ = cpu_graph(path, spec, precision)
    caches = {"onnx": empty_caches(spec), "torch": empty_caches(spec)}
    logps: dict[str, list[np.ndarray]] = {"onnx": [], "torch": []}
    step = sequence.prefill
    for _ in range(gates.steps + 1):
        outputs = {"onnx": run({fed[0]: step, **caches["onnx"]}),
                   "torch": run_torch(wrapper, spec, {fed[0]: step, **caches["torch"]})}
        for who, out in outputs.items():
            logps[who].append(out[gates.output].reshape(-1))
            caches[who] = {past: out[present] for past, present in pairs}
        chosen = int(np.argmax(logps["torch"][-1][:sequence.choices]))
        step = sequence.rows[[chosen]][None]  # (1, 1, C)
    label = f"teacher-forced decode: {sequence.prefill.shape[1]}-position prefill + {gates.steps} steps"
    return gate_figures(label, gates, np.stack(logps["onnx"]), np.stack(logps["torch"]), "log-probs")
