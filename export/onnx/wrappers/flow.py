"""The `flow_encoder` and `flow_estimator` graphs of `CausalMaskedDiffWithDiT`.

The CFM's Euler loop stays outside the graphs (the runtime runs it), so the flow is exported as the
front (tokens -> `mu`, x-vector -> `spks`) and one DiT evaluation of the CFG batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def block_attention_mask(mask: Tensor, block_frames: Tensor) -> Tensor:
    """`dit_attention_mask` with the block size as a tensor: (B, 1, T) pad mask, (1,) int64 -> (B, 1, T, T).

    Query i sees key j iff ``j < (i // b + 1) * b`` and j is not padding; a row left with no visible
    key opens fully, as in `dit_attention_mask`. b >= T gives its offline (key padding only) mask.
    """
    keys = mask.bool()  # (B, 1, T)
    pos = torch.arange(mask.shape[-1], device=mask.device)  # (T,)
    block_end = (torch.div(pos, block_frames, rounding_mode="floor") + 1) * block_frames  # (T,)
    visible = keys & (pos[None, :] < block_end[:, None])  # (B, T, T)
    visible = visible | ~visible.any(dim=-1, keepdim=True)
    return visible.unsqueeze(1)


class FlowEstimatorGraph(nn.Module):
    """One DiT evaluation with its attention mask built in-graph from `block_frames` and `mask`."""

    def __init__(self, dit: DiT) -> None:
        super().__init__()
        self.dit = dit

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                block_frames: Tensor) -> Tensor:
        """x, mu, cond (2, 80, T); mask (2, 1, T); t (2,); spks (2, 80); block_frames (1,) -> (2, 80, T)."""
        return self.dit(x, mask, mu, t, spks, cond, block_attention_mask(mask, block_frames))
