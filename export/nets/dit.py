"""The flow decoder's estimator: upstream's `DiT` (`cosyvoice/flow/DiT/dit.py`, `modules.py`).

Module and attribute names follow upstream so that `flow.pt`'s `decoder.estimator.*` keys load
unchanged. Unlike upstream, the attention mask is an input of `DiT.forward` rather than derived
from a Python `streaming` flag, so one traced graph serves both offline and streaming synthesis;
`dit_attention_mask` builds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import DiTConfig

LN_EPS = 1e-6
TIME_SCALE = 1000.0
"""Upstream's sinusoid multiplies t in [0, 1] by 1000 before the frequencies."""


def dit_attention_mask(pad_mask: Tensor, streaming: bool, chunk_frames: int) -> Tensor:
    """The DiT's boolean attention mask (True = may attend), as upstream's `add_optional_chunk_mask`.

    pad_mask: (B, 1, T), nonzero on valid frames. Offline: key padding only. Streaming: block-causal
    on top, query i sees key j iff ``j < (i // chunk_frames + 1) * chunk_frames``, blocks counted
    from frame 0. Rows left with no visible key are opened fully, as upstream does (such queries are
    padding and are zeroed by the estimator anyway). Returns (B, 1, T, T).
    """
    keys = pad_mask.bool()  # (B, 1, T)
    T = keys.shape[-1]
    if streaming:
        pos = torch.arange(T, device=keys.device)
        block_end = (torch.div(pos, chunk_frames, rounding_mode="floor") + 1) * chunk_frames  # (T,)
        mask = keys & (pos[None, :] < block_end[:, None])  # (B, T, T)
    else:
        mask = keys.expand(-1, T, -1)  # (B, T, T)
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask.unsqueeze(1)


class _RotaryEmbedding(nn.Module):
    """x-transformers' `RotaryEmbedding(dim_head)`: the persistent `inv_freq` buffer and its table."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, seq_len: int) -> Tensor:
        """Angles for positions 0..seq_len-1, interleaved [θ0, θ0, θ1, θ1, ...]: (T, dim)."""
        pos = torch.arange(seq_len, device=self.inv_freq.device).to(self.inv_freq.dtype)
        freqs = pos[:, None] * self.inv_freq[None, :]  # (T, dim/2)
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs (2m, 2m+1) of x's first `cos.shape[-1]` channels; the rest pass.

    Applied to the full-width q/k before the head split, so only head 0 gets positions (as upstream).
    """
    rot_dim = cos.shape[-1]
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    pairs = xr.unflatten(-1, (-1, 2))  # (B, T, rot_dim/2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (B, T, rot_dim)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


class _SinusPositionEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: Tensor) -> Tensor:
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        emb = TIME_SCALE * t[:, None] * freqs[None, :]  # (B, half)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)  # (B, dim), sin half first


class _TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.time_embed = _SinusPositionEmbedding(freq_dim)
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(self.time_embed(t).to(t.dtype))  # (B, dim)


class _CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:
        x = x.transpose(1, 2)  # (B, C, T)
        x = self.conv1(F.pad(x, (self.kernel_size - 1, 0)))  # left pad only: causal
        x = self.conv2(F.pad(x, (self.kernel_size - 1, 0)))
        return x.transpose(1, 2)  # (B, T, C)


class _InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = _CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        spks = spks[:, None, :].expand(-1, x.shape[1], -1)  # (B, T, spk_dim)
        x = self.proj(torch.cat((x, cond, mu, spks), dim=-1))  # (B, T, dim); upstream's column order
        return self.conv_pos_embed(x) + x


class _AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim  # a Python int: the ONNX tracer turns `x.shape[-1:]` into a non-constant shape
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, x: Tensor, c: Tensor) -> tuple[Tensor, ...]:
        emb = self.linear(F.silu(c))  # (B, 6 * dim)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = F.layer_norm(x, (self.dim,), eps=LN_EPS) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class _AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(c)).chunk(2, dim=1)  # scale first here, unlike the blocks
        return F.layer_norm(x, (self.dim,), eps=LN_EPS) * (1 + scale)[:, None] + shift[:, None]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor, keep: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = _apply_rope(self.to_q(x), cos, sin)  # (B, T, inner)
        k = _apply_rope(self.to_k(x), cos, sin)
        v = self.to_v(x)
        q, k, v = (y.view(B, T, self.heads, -1).transpose(1, 2) for y in (q, k, v))  # (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, Dh)
        y = self.to_out[0](y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)
        return y.masked_fill(~keep, 0.0)  # padded query rows are zeroed, as upstream


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Index 1 held upstream's dropout (inactive at inference); kept so the keys read `ff.2`.
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(dim * mult, dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class _DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int) -> None:
        super().__init__()
        self.dim = dim
        self.attn_norm = _AdaLayerNormZero(dim)
        self.attn = _Attention(dim, heads, dim_head)
        self.ff = _FeedForward(dim, ff_mult)

    def forward(self, x: Tensor, c: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor,
                keep: Tensor) -> Tensor:
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, c)
        x = x + gate_msa[:, None] * self.attn(norm, cos, sin, attn_mask, keep)
        norm = F.layer_norm(x, (self.dim,), eps=LN_EPS) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(norm)


class DiT(nn.Module):
    """Upstream's DiT estimator with the attention mask as an explicit input."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = _TimestepEmbedding(cfg.dim, cfg.time_embed_dim)
        self.input_embed = _InputEmbedding(cfg)
        self.rotary_embed = _RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(
            [_DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult) for _ in range(cfg.depth)]
        )
        self.norm_out = _AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                attn_mask: Tensor) -> Tensor:
        """Velocity estimate.

        x, mu, cond: (B, 80, T); mask: (B, 1, T), nonzero on valid frames; t: (B,); spks: (B, 80);
        attn_mask: (B, 1, T, T) bool from `dit_attention_mask`. Returns (B, 80, T).
        """
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)  # (B, T, 80)
        c = self.time_embed(t)  # (B, dim)
        h = self.input_embed(x, cond, mu, spks)  # (B, T, dim)
        freqs = self.rotary_embed(h.shape[1])  # (T, dim_head)
        cos, sin = freqs.cos(), freqs.sin()
        keep = mask.bool().transpose(1, 2)  # (B, T, 1)
        for block in self.transformer_blocks:
            h = block(h, c, cos, sin, attn_mask, keep)
        h = self.norm_out(h, c)
        return self.proj_out(h).transpose(1, 2)  # (B, 80, T)
