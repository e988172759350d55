"""The flow decoder's estimator: upstream's `DiT` (`cosyvoice/flow/DiT/dit.py`, `modules.py`).

Module and attribute names follow upstream so that `flow.pt`'s `decoder.estimator.*` keys load
unchanged. Unlike upstream, the attention mask is an input of `DiT.forward` rather than derived
from a Python `streaming` flag, so one traced graph serves both offline and streaming synthesis;
`dit_attention_mask` builds it. `DiT.forward_cached` runs the same network over a chunk of new frames
given the caches of the frames before it (per-layer keys/values, the causal convs' left context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import DiTConfig

LN_EPS = 1e-6
TIME_SINUSOID_SCALE = 1000.0
"""Upstream's DiT multiplies the ODE time t in [0, 1] by this before the frequencies."""


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

    inv_freq: Tensor  # a buffer (registered in __init__), declared for the type checker

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, positions: Tensor) -> Tensor:
        """Angles for integer `positions` (T,), interleaved [θ0, θ0, θ1, θ1, ...]: (T, dim)."""
        pos = positions.to(self.inv_freq.dtype)
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


class _OrtRotaryEmbedding(torch.autograd.Function):
    """onnxruntime's `RotaryEmbedding` (com.microsoft), interleaved, over x (B, T, C) with the angles' cos/sin
    halves (T, R/2), R = `rotated`: its first R channels rotated, the rest passed. Eager, `_apply_rope`; in an
    ONNX export, the operator (one head of C channels, `rotary_embedding_dim` R), one node where the standard
    operators take about twenty. onnxruntime's kernel rounds its products on its own (fused multiply-adds),
    so its results differ from `_apply_rope`'s in the last bit."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, rotated: int) -> Tensor:
        return _apply_rope(x, cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1))

    @staticmethod
    def symbolic(g: Any, x: Any, cos: Any, sin: Any, rotated: int) -> Any:
        # position_ids [0]: x's frame i takes the angles' row i
        start = g.op("Constant", value_t=torch.tensor([0], dtype=torch.int64))
        out = g.op("com.microsoft::RotaryEmbedding", x, start, cos, sin, interleaved_i=1, num_heads_i=1,
                   rotary_embedding_dim_i=rotated)
        out.setType(x.type())  # a type torch cannot infer for an operator outside ONNX's domain
        return out


def _ort_rope(x: Tensor, cos: Tensor, sin: Tensor, rotated: int) -> Tensor:
    """`_apply_rope` with onnxruntime's operator (`_OrtRotaryEmbedding`); `rotated`: cos's channels, as a
    Python int (the tracer's shapes are not)."""
    return _OrtRotaryEmbedding.apply(x, cos[:, 0::2], sin[:, 0::2], rotated)


def _conv_mish(conv: nn.Sequential, x: Tensor, onnxruntime_only: bool) -> Tensor:
    """`conv` (upstream's conv, then Mish: x tanh(softplus(x))) over x. For onnxruntime alone, an ONNX export
    writes the Mish as x / (1 + 2 / n) with n = e (e + 2), e = exp(min(x, 20)), the same function
    (tanh(log(1 + e)) = n / (n + 2); past 20 the tanh is 1 in float32): onnxruntime's Softplus kernel is
    scalar, about ten times the time of these seven operators (on an AVX-512 Zen 5,
    docs/performance-log.md), and this form is nearer torch's Mish than that kernel. It stays finite and
    accurate in float16, where e and n overflow from x = 5.5 (n = inf gives x; n = 0, from e's underflow,
    gives 0; n / (n + 2) would be NaN and 1 - 2 / (n + 2) would cancel)."""
    if not (onnxruntime_only and torch.onnx.is_in_onnx_export()):
        return conv(x)
    y = conv[0](x)
    e = torch.exp(torch.clamp(y, max=20.0))
    n = e * (e + 2)
    return y / (1 + y.new_tensor(2.0) / n)  # a tensor 2: `2 / n` would trace as Reciprocal and Mul


class _SinusPositionEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: Tensor) -> Tensor:
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        emb = TIME_SINUSOID_SCALE * t[:, None] * freqs[None, :]  # (B, half)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)  # (B, dim), sin half first


class _TimestepEmbedding(nn.Module):
    """Upstream's `TimestepEmbedding`: the sinusoid of t, then an MLP."""

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

    def forward(self, x: Tensor, past: tuple[Tensor, Tensor] | None = None, onnxruntime_only: bool = False
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, C) -> (B, T, C), and the last kernel - 1 input frames of each conv (B, C, kernel - 1).

        `past` holds those of the frames before x; None is the start of the sequence, whose left
        context is upstream's zero padding (so zero caches are the same thing). `onnxruntime_only`: see
        `_conv_mish`.
        """
        ctx = self.kernel_size - 1
        h = x.transpose(1, 2)  # (B, C, T)
        h1 = F.pad(h, (ctx, 0)) if past is None else torch.cat((past[0], h), dim=2)  # (B, C, ctx + T)
        h = _conv_mish(self.conv1, h1, onnxruntime_only)  # (B, C, T); left context only: causal
        h2 = F.pad(h, (ctx, 0)) if past is None else torch.cat((past[1], h), dim=2)
        h = _conv_mish(self.conv2, h2, onnxruntime_only)
        return h.transpose(1, 2), (h1[:, :, -ctx:], h2[:, :, -ctx:])


class _InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = _CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor,
                past_conv: tuple[Tensor, Tensor] | None = None, onnxruntime_only: bool = False
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """(B, T, dim), and the conv position embedding's caches (see `_CausalConvPositionEmbedding`)."""
        if torch.onnx.is_in_onnx_export():
            # the same frames without reading x's shape: an expand to T traces as index arithmetic on it,
            # which onnxruntime's CUDA provider runs on the CPU, and then no CUDA graph can replay the DiT
            spks = spks[:, None, :] + 0 * x[:, :, :1]  # (B, T, spk_dim); x is finite
        else:
            spks = spks[:, None, :].expand(-1, x.shape[1], -1)  # (B, T, spk_dim)
        x = self.proj(torch.cat((x, cond, mu, spks), dim=-1))  # (B, T, dim); upstream's column order
        pos, conv = self.conv_pos_embed(x, past_conv, onnxruntime_only)
        return pos + x, conv


def _modulated_norm(x: Tensor, dim: int, scale: Tensor, shift: Tensor, onnxruntime_only: bool) -> Tensor:
    """layer_norm(x) (1 + scale) + shift over x (B, T, dim), scale and shift pieces of `DiT.modulation_pieces`
    ((dim,) for one row, else (B, 1, dim)); `dim` a Python int (the ONNX tracer turns `x.shape[-1:]` into a
    non-constant shape). For onnxruntime alone, an ONNX export of one modulation row (the CFG rows share
    their time) passes them as LayerNormalization's own scale and bias: that kernel's products and sums, one
    pass over x where there were three."""
    if onnxruntime_only and torch.onnx.is_in_onnx_export() and scale.dim() == 1:
        return F.layer_norm(x, (dim,), 1 + scale, shift, eps=LN_EPS)
    return F.layer_norm(x, (dim,), eps=LN_EPS) * (1 + scale) + shift


class _AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 6 * dim)

    def modulation(self, c: Tensor) -> Tensor:
        return self.linear(F.silu(c))  # (B, 6 * dim)

    def forward(self, x: Tensor, emb: Sequence[Tensor], onnxruntime_only: bool = False) -> tuple[Tensor, ...]:
        """x (B, T, dim), emb this norm's six pieces of `DiT.modulation_pieces`; `onnxruntime_only`: see
        `_modulated_norm`."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb
        norm = _modulated_norm(x, self.dim, scale_msa, shift_msa, onnxruntime_only)
        return norm, gate_msa, shift_mlp, scale_mlp, gate_mlp


class _AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)

    def modulation(self, c: Tensor) -> Tensor:
        return self.linear(F.silu(c))  # (B, 2 * dim)

    def forward(self, x: Tensor, emb: Sequence[Tensor], onnxruntime_only: bool = False) -> Tensor:
        """x (B, T, dim), emb this norm's two pieces of `DiT.modulation_pieces`; `onnxruntime_only`: see
        `_modulated_norm`."""
        scale, shift = emb  # scale first here, unlike the blocks
        return _modulated_norm(x, self.dim, scale, shift, onnxruntime_only)


def _attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Softmax attention of q (B, H, T, Dh) over k, v (B, H, S, Dh) with the additive `bias` at `scale`
    (Dh ** -0.5): upstream's `scaled_dot_product_attention` in eager torch. Its ONNX export scales q and
    every key by the scale's root, a pass over all S keys per call whose Mul also sits between the keys'
    Transpose and the MatMul, where onnxruntime would fuse the two; an export scales the T queries alone,
    the same product (exactly for a power-of-two scale, as 64 dims' 1/8)."""
    if not torch.onnx.is_in_onnx_export():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    scores = torch.matmul(q * scale, k.transpose(-1, -2)) + bias  # (B, H, T, S)
    return torch.matmul(scores.softmax(dim=-1), v)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, past: tuple[Tensor, Tensor] | None, heads: int,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Multi-head attention of new q, k, v (B, T, H Dh) (after RoPE) over the cached keys/values `past`
    (B, H, P, Dh; None for none) then their own: the output (B, T, H Dh) and the keys/values attended to
    (B, H, P + T, Dh)."""
    B, T, _ = q.shape
    q, k, v = (y.view(B, T, heads, -1).transpose(1, 2) for y in (q, k, v))  # (B, H, T, Dh)
    if past is not None:
        k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)  # (B, H, P + T, Dh)
    y = _attention(q, k, v, bias, scale)  # (B, H, T, Dh)
    return y.transpose(1, 2).reshape(B, T, -1), k, v


class _MultiHeadAttention(torch.autograd.Function):
    """onnxruntime's `MultiHeadAttention` (com.microsoft) over a chunk's new q/k/v (B, T, H Dh) (after RoPE)
    and the cached keys/values (B, H, P, Dh): eager, the attention of `_Attention`; in an ONNX export, the
    operator, one node for the caches' growth, the scores and their mask, the softmax and the values' sum.
    Returns the output (B, T, H Dh) and the keys/values (B, H, P + T, Dh), the caches then the new frames'.
    Its scale is the operator's default, Dh ** -0.5."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, past_k: Tensor, past_v: Tensor,
                heads: int) -> tuple[Tensor, Tensor, Tensor]:
        return _attend(q, k, v, bias, (past_k, past_v), heads, (q.shape[-1] // heads) ** -0.5)

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, bias: Any, past_k: Any, past_v: Any, heads: int) -> Any:
        absent = g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())  # no q/k/v bias, key mask
        y, present_k, present_v = g.op("com.microsoft::MultiHeadAttention", q, k, v, absent, absent, bias,
                                       past_k, past_v, num_heads_i=heads, outputs=3)
        # the types torch cannot infer for an operator outside ONNX's domain
        y.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return y, present_k, present_v


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.scale = dim_head**-0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_bias: Tensor, keep: Tensor | None,
                past: tuple[Tensor, Tensor] | None = None, onnxruntime_only: bool = False
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> (B, T, dim), and the keys (after RoPE) and values (B, H, S, Dh) attended to.

        `past` holds the keys and values (B, H, P, Dh) of earlier frames, which come first: S = P + T
        and `attn_bias` (B, 1, T, S) is added to the scores (0 where visible, -inf where not). cos/sin
        (T, dim_head) are the angles of x's positions. `onnxruntime_only`: with `past`, an ONNX export writes
        RoPE and the attention as onnxruntime's `RotaryEmbedding` and `MultiHeadAttention`.
        """
        if onnxruntime_only and past is not None and torch.onnx.is_in_onnx_export():
            # (B, T, inner) each
            q, k = (_ort_rope(y, cos, sin, self.dim_head) for y in (self.to_q(x), self.to_k(x)))
            y, k, v = _MultiHeadAttention.apply(q, k, self.to_v(x), attn_bias, past[0], past[1], self.heads)
        else:
            q, k = _apply_rope(self.to_q(x), cos, sin), _apply_rope(self.to_k(x), cos, sin)
            y, k, v = _attend(q, k, self.to_v(x), attn_bias, past, self.heads, self.scale)
        y = self.to_out[0](y)  # (B, T, dim)
        if keep is not None:
            y = y.masked_fill(~keep, 0.0)  # padded query rows are zeroed, as upstream
        return y, k, v


class _TanhGelu(nn.Module):
    """Upstream's `nn.GELU(approximate="tanh")` in eager torch. Its ONNX export is eight elementwise passes
    in an order onnxruntime's FastGelu fusion does not match; an export writes the same formula in the order
    it does, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with x^3 a Pow, which onnxruntime then runs as
    one node (on the CPU and CUDA)."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.onnx.is_in_onnx_export():
            return F.gelu(x, approximate="tanh")
        inner = (x + 0.044715 * x.pow(3)) * math.sqrt(2 / math.pi)
        return (0.5 * x) * (1 + torch.tanh(inner))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Index 1 held upstream's dropout (inactive at inference); kept so the keys read `ff.2`.
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, dim * mult), _TanhGelu()),
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

    def forward(self, x: Tensor, emb: Sequence[Tensor], cos: Tensor, sin: Tensor, attn_bias: Tensor,
                keep: Tensor | None, past: tuple[Tensor, Tensor] | None = None, onnxruntime_only: bool = False
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> (B, T, dim), and the attention's keys and values (see `_Attention`, and
        `_modulated_norm` for `onnxruntime_only`); `emb` is `attn_norm`'s six modulation pieces."""
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, emb, onnxruntime_only)
        attn, k, v = self.attn(norm, cos, sin, attn_bias, keep, past, onnxruntime_only)
        x = x + gate_msa * attn
        norm = _modulated_norm(x, self.dim, scale_mlp, shift_mlp, onnxruntime_only)
        return x + gate_mlp * self.ff(norm), k, v


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
        positions = torch.arange(x.shape[2], device=x.device)  # (T,)
        keep = mask.bool().transpose(1, 2)  # (B, T, 1)
        return self.forward_cached(x, mu, self.modulation(t), spks, cond, positions, attn_mask, keep, None,
                                   None)[0]

    def modulation(self, t: Tensor) -> Tensor:
        """ODE times t (B,) -> every AdaLN's shifts, scales and gates (B, (6 depth + 2) dim), the blocks'
        then the final norm's: all that t enters the network through. A function of t alone, so a graph
        whose calls share a few times can hold it precomputed (`FlowEstimatorCachedGraph`)."""
        c = self.time_embed(t)  # (B, dim)
        parts = [cast(_DiTBlock, block).attn_norm.modulation(c) for block in self.transformer_blocks]
        return torch.cat([*parts, self.norm_out.modulation(c)], dim=1)

    def modulation_pieces(self, modulation: Tensor) -> tuple[Tensor, ...]:
        """`modulation` (B or 1, (6 depth + 2) dim) as its 6 depth + 2 shifts, scales and gates, each
        broadcasting over (B, T, dim): (dim,) for one row, else (B, 1, dim). One Split node in an ONNX
        export, where slicing each norm's row would take a Slice, an Unsqueeze and their index arithmetic per
        piece: a kernel launch each per call on a GPU."""
        rows = modulation[0] if modulation.shape[0] == 1 else modulation[:, None, :]
        return rows.split(self.cfg.dim, dim=-1)

    def forward_cached(self, x: Tensor, mu: Tensor, modulation: Tensor, spks: Tensor, cond: Tensor,
                       positions: Tensor, attn_mask: Tensor, keep: Tensor | None,
                       past_conv: tuple[Tensor, Tensor] | None,
                       past_kv: Sequence[tuple[Tensor, Tensor]] | None, *, onnxruntime_only: bool = False
                       ) -> tuple[Tensor, tuple[Tensor, Tensor], list[tuple[Tensor, Tensor]]]:
        """Velocity of T new frames that continue earlier ones, given the earlier frames' caches.

        x, mu, cond: (B, 80, T); modulation: (B or 1, (6 depth + 2) dim), the ODE time's `modulation`;
        spks: (B, 80); positions: (T,) int, the new frames' indices
        in the sequence (RoPE); attn_mask: (B or 1, 1, T, P + T) bool over [cached | new] keys;
        keep: (B, T, 1) bool, False on padded query rows (None: none padded). `past_conv`: the last
        kernel - 1 input frames of the conv position embedding's two convs (B, dim, kernel - 1), None at
        the sequence start;
        `past_kv`: per block, keys (after RoPE) and values (B, H, P, Dh), None for P = 0. Returns the velocity
        (B, 80, T), the conv caches after the new frames and each block's keys/values (B, H, P + T, Dh):
        fed back, they make a sequence of chunks equal one forward over all frames whenever no earlier
        frame may attend to a later one (the block-causal mask on block boundaries). `onnxruntime_only`: an
        ONNX export for a graph that only onnxruntime runs writes each block's RoPE and attention over
        `past_kv` as onnxruntime's own operators (`_Attention`), the modulated norms as LayerNormalization's
        scale and bias (`_modulated_norm`) and Mish in operators its CPU kernels run vectorized
        (`_conv_mish`); eager torch computes the same either way.
        """
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)  # (B, T, 80)
        mods = self.modulation_pieces(modulation)
        h, conv = self.input_embed(x, cond, mu, spks, past_conv, onnxruntime_only)  # (B, T, dim)
        freqs = self.rotary_embed(positions)  # (T, dim_head)
        cos, sin = freqs.cos(), freqs.sin()
        # The additive form of the mask, built once for every block (scaled_dot_product_attention turns a
        # boolean one into it per block, and its export then guards every block's softmax against
        # all-masked rows: IsNaN + Where over (B, H, T, S), docs/performance-log.md); no row is all-masked
        # here (the masks open any row that would be). A Where of two scalars: no node reads the mask's shape.
        bias = torch.where(attn_mask, 0.0, float("-inf")).to(h.dtype)
        kv = []
        for i, block in enumerate(self.transformer_blocks):
            h, k, v = block(h, mods[6 * i:6 * i + 6], cos, sin, bias, keep,
                            None if past_kv is None else past_kv[i], onnxruntime_only)
            kv.append((k, v))
        h = self.norm_out(h, mods[-2:], onnxruntime_only)
        return self.proj_out(h).transpose(1, 2), conv, kv  # (B, 80, T)
