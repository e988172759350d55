"""ODE-level fidelity of a reduced-precision DiT graph: the torch reference flow solved twice on the same
tokens, prompt and noise, once with its float32 DiT and once with the ONNX `flow_estimator_cached` graph
(nothing cached) in the DiT's place, judged by the spec's `SolveGates`.

Per-output tolerances at random inputs say little about the mel: the Euler loop feeds every step's
velocity into the next step's state, and classifier-free guidance scales the conditional row's error by
1.7. Here both solves run upstream's loop (`CausalConditionalCFM.solve_euler`, offline full attention)
on the model's own encoder output, and the gate compares the mels they end at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from cosyvoice_graphs import GraphSpec, dit_attention, empty_caches, euler_steps

from ..nets.flow import CausalMaskedDiffWithDiT
from .errors import ExportError
from .graphs import NetworkSource
from .validate import Figure, GraphCall, cpu_graph, gate_figures

SEED = 0
PROMPT_SHARE = 4
"""A quarter of the solved frames are the prompt's (cond holds its mel there), as in zero-shot use."""


@dataclass(frozen=True)
class SolveInputs:
    """What one solve is fed: `CausalMaskedDiffWithDiT.inference`'s arguments."""

    token: Tensor
    """(1, N) speech ids after the prompt."""
    prompt_token: Tensor
    """(1, P) prompt speech ids."""
    prompt_feat: Tensor
    """(1, P * token_mel_ratio, 80) prompt mel."""
    embedding: Tensor
    """(1, spk_embed_dim) x-vector."""
    noise: Tensor
    """(1, 80, frames) initial ODE state."""


def solve_inputs(flow: CausalMaskedDiffWithDiT, frames: int, mel_range: tuple[float, float]) -> SolveInputs:
    """Random ids, prompt mel (uniform in `mel_range`), x-vector and noise for a `frames`-frame solve,
    drawn with `SEED`."""
    cfg = flow.cfg
    tokens = frames // cfg.token_mel_ratio
    prompt = tokens // PROMPT_SHARE
    if prompt < 1 or tokens - prompt < 1:
        raise ExportError(f"a solve of {frames} frames is too short to hold a prompt and generated tokens")
    rng = np.random.default_rng(SEED)
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (1, tokens)))
    low, high = mel_range
    mel = rng.uniform(low, high, (1, prompt * cfg.token_mel_ratio, cfg.output_size))
    embedding = rng.standard_normal((1, cfg.spk_embed_dim))
    noise = rng.standard_normal((1, cfg.output_size, tokens * cfg.token_mel_ratio))
    return SolveInputs(ids[:, prompt:], ids[:, :prompt], torch.from_numpy(mel).float(),
                       torch.from_numpy(embedding).float(), torch.from_numpy(noise).float())


class OnnxEstimator(nn.Module):
    """The exported `flow_estimator_cached` graph with the torch DiT's call signature, for offline solves
    (full attention, no padding): every frame new, nothing cached, as the runtime's offline flow calls it."""

    def __init__(self, run: GraphCall, spec: GraphSpec) -> None:
        super().__init__()
        self.run, self.spec = run, spec
        self.steps = {float(t): step for step, (t, _) in enumerate(euler_steps())}

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                attn_mask: Tensor) -> Tensor:
        if not (bool(attn_mask.all()) and bool(mask.all())):
            raise ExportError(f"{self.spec.name}: solve gates run offline solves (full attention, no "
                              "padding) only")
        given = {"x": x, "mu": mu, "spks": spks, "cond": cond}
        feeds = {n: v.numpy() for n, v in given.items()} | empty_caches(self.spec)
        step = self.steps.get(float(t[0]))
        if step is None or not bool((t == t[0]).all()):
            raise ExportError(f"{self.spec.name}: the graph holds the time modulation of its Euler steps' "
                              f"times only, not of t = {t.tolist()}")
        feeds["ode_step"] = np.array([step], dtype=np.int64)
        feeds |= dit_attention(0, x.shape[2], 0, x.shape[2])  # full attention
        unknown = set(self.spec.input_names) - set(feeds)
        if unknown:
            raise ExportError(f"{self.spec.name}: solve gates cannot feed inputs {sorted(unknown)}")
        return torch.from_numpy(self.run(feeds)["velocity"])


@contextmanager
def estimator_replaced(flow: CausalMaskedDiffWithDiT, estimator: nn.Module) -> Iterator[None]:
    """`flow` solving with `estimator` in its DiT's place, inside the block only."""
    original = flow.decoder.estimator
    flow.decoder.estimator = estimator  # type: ignore[assignment]  # any module with the DiT's call
    try:
        yield
    finally:
        flow.decoder.estimator = original


def solve(flow: CausalMaskedDiffWithDiT, inputs: SolveInputs) -> np.ndarray:
    """The mel (1, 80, generated frames) of an offline, final solve of `inputs`."""
    with torch.no_grad():
        mel = flow.inference(inputs.token, inputs.prompt_token, inputs.prompt_feat, inputs.embedding,
                             inputs.noise, streaming=False, finalize=True)
    return mel.numpy()


def validate_solve(path: Path, nets: NetworkSource, spec: GraphSpec, precision: str) -> tuple[Figure, ...]:
    """The figure of each of `spec.solve_gates[precision]` for the ONNX graph at `path` (run as `cpu_graph`
    runs a `precision` graph) in the flow's solve against the torch float32 DiT. Failures are figures, not
    raised."""
    gates = spec.solve_gates[precision]
    cond = next(t for t in spec.inputs if t.name == "cond")  # the prompt mel's levels
    inputs = solve_inputs(nets.flow, gates.frames, (cond.low, cond.high))
    want = solve(nets.flow, inputs)
    with estimator_replaced(nets.flow, OnnxEstimator(cpu_graph(path, spec, precision)[0], spec)):
        got = solve(nets.flow, inputs)
    label = f"flow solve: {gates.frames} frames, {nets.flow.decoder.cfm.n_timesteps} Euler steps"
    return gate_figures(label, gates, got, want, "mel values")
