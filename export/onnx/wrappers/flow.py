"""The `flow_encoder` and `flow_estimator_cached` graphs of `CausalMaskedDiffWithDiT`.

The CFM's Euler loop stays outside the graphs (the runtime runs it), so the flow is exported as the
front (tokens -> `mu`, x-vector -> `spks`) and one DiT evaluation of the CFG batch over a call's new
frames, given the caches of the earlier ones (none for a call over every frame).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_graphs import euler_steps

from ...nets.dit import DiT
from ...nets.flow import CausalMaskedDiffWithDiT


class FlowEncoderGraph(nn.Module):
    """Token embedding, pre-lookahead and mel-rate upsampling, plus the speaker projection.

    Equals the `mu`/`spks` that `CausalMaskedDiffWithDiT.inference` hands its decoder: a non-final
    call passes tokens[:-3] as `tokens` and tokens[-3:] as `lookahead_tokens`; a final call passes all
    tokens and -1 look-ahead ids, which embed to zero vectors, i.e. upstream's zero right-padding.
    """

    def __init__(self, flow: CausalMaskedDiffWithDiT) -> None:
        super().__init__()
        self.input_embedding = flow.input_embedding
        self.spk_embed_affine_layer = flow.spk_embed_affine_layer
        self.pre_lookahead_layer = flow.pre_lookahead_layer
        self.token_mel_ratio = flow.cfg.token_mel_ratio

    def forward(self, tokens: Tensor, lookahead_tokens: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
        """tokens (1, N), lookahead_tokens (1, L) int64, embedding (1, E) -> mu (1, 80, 2N), spks (1, 80)."""
        emb = self.input_embedding(tokens.clamp(min=0))  # (1, N, 80)
        ahead = self.input_embedding(lookahead_tokens.clamp(min=0))  # (1, L, 80)
        # A missing look-ahead token is a zero frame, exactly what the final call's padding feeds conv1.
        ahead = torch.where((lookahead_tokens >= 0).unsqueeze(-1), ahead, torch.zeros_like(ahead))
        h = self.pre_lookahead_layer(emb, ahead)  # (1, N, 80)
        h = h.repeat_interleave(self.token_mel_ratio, dim=1)  # (1, 2N, 80)
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # (1, 80)
        return h.transpose(1, 2), spks


class FlowEstimatorCachedGraph(nn.Module):
    """`DiT.forward_cached` for the CFG batch, its caches flattened into the spec's I/O order, the time
    modulation of every Euler step (`euler_steps`) precomputed in `modulations`.

    Inputs: x, mu (2, 80, T), ode_step (1,), spks (2, 80), cond (2, 80, T), positions (T,) (the new frames'
    places in the sequence), attention_mask (T, P + T) (`cosyvoice_graphs.dit_attention`), past_pos_conv1/2
    (2, dim, kernel - 1), then past_key_i, past_value_i (2, H, P, Dh) per block i. Outputs: velocity
    (2, 80, T), present_pos_conv1/2, then present_key_i, present_value_i (2, H, P + T, Dh). Every frame is a
    real one (the runtime never pads), so no query row is masked. `onnxruntime_only`: its export is written
    for a graph that only onnxruntime runs (`DiT.forward_cached`).
    """

    modulations: Tensor

    def __init__(self, dit: DiT, *, onnxruntime_only: bool = False) -> None:
        super().__init__()
        self.dit = dit
        self.depth = dit.cfg.depth
        self.onnxruntime_only = onnxruntime_only
        # per step over the CFG batch of 2, as upstream's solve calls it: the same matmul shapes, so the
        # same float32 rounding as `DiT.forward`
        with torch.no_grad():
            rows = [dit.modulation(torch.tensor([t, t]))[:1] for t, _ in euler_steps()]
        self.register_buffer("modulations", torch.cat(rows))  # (steps, (6 depth + 2) dim)

    def forward(self, x: Tensor, mu: Tensor, ode_step: Tensor, spks: Tensor, cond: Tensor,
                positions: Tensor, attention_mask: Tensor, past_pos_conv1: Tensor, past_pos_conv2: Tensor,
                *past_kv: Tensor) -> tuple[Tensor, ...]:
        """x, mu, ode_step, spks, cond, positions, attention_mask, past_pos_conv1, past_pos_conv2, past_key_0,
        past_value_0, past_key_1, ... -> velocity, present_pos_conv1, present_pos_conv2, present_key_0, ..."""
        if len(past_kv) != 2 * self.depth:
            raise ValueError(f"expected {2 * self.depth} past key/value tensors, got {len(past_kv)}")
        attn_mask = attention_mask[None, None]  # (1, 1, T, P + T)
        pairs = list(zip(past_kv[0::2], past_kv[1::2], strict=True))
        modulation = self.modulations.index_select(0, ode_step)  # (1, M): both CFG rows share t
        velocity, conv, kv = self.dit.forward_cached(x, mu, modulation, spks, cond, positions, attn_mask,
                                                     None, (past_pos_conv1, past_pos_conv2), pairs,
                                                     onnxruntime_only=self.onnxruntime_only)
        return (velocity, *conv, *[y for pair in kv for y in pair])  # key_0, value_0, key_1, ...
