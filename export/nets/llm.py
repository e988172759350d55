"""The CosyVoice3 speech-token LM: a Qwen2 backbone plus speech embedding and decoder.

The module tree mirrors upstream's `CosyVoice3LM` (`cosyvoice/llm/llm.py`) wrapping HF's
`Qwen2ForCausalLM`, so `state_dict()` keys equal those of the released `llm.pt` and it loads with
`strict=True`. The backbone is our own (no transformers dependency) and takes its KV cache as
explicit tensors so that `forward_step` can be traced for ONNX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import LLMConfig, Qwen2Config


class Qwen2RMSNorm(nn.Module):
    """RMSNorm normalised in fp32 and cast back before the weight, as in transformers' Qwen2."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    # Half-split rotation: (x1, x2) -> (-x2, x1) over the two halves of head_dim.
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables (T, head_dim) for absolute `positions` (T,), computed in fp32 like HF."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _linears(x: Tensor, layers: Sequence[nn.Linear]) -> list[Tensor]:
    """`layer(x)` for each of `layers`, which read the same input. In an ONNX export, one matmul over their
    stacked weights and a split (`_stacked_linear`); eager torch keeps upstream's separate calls, which need
    no stacked copy."""
    if not torch.onnx.is_in_onnx_export():
        return [layer(x) for layer in layers]
    return list(_stacked_linear(x, layers).split([layer.out_features for layer in layers], dim=-1))


def _packed_linears(x: Tensor, layers: Sequence[nn.Linear]) -> Tensor:
    """The outputs of `_linears` concatenated along the last dim, without the split in an export."""
    if not torch.onnx.is_in_onnx_export():
        return torch.cat([layer(x) for layer in layers], dim=-1)
    return _stacked_linear(x, layers)


def _stacked_linear(x: Tensor, layers: Sequence[nn.Linear]) -> Tensor:
    """One matmul over the stacked weights of `layers` (the stacking is constant-folded in an export): one
    kernel call instead of several in the graph, where a decode step is hundreds of small ones, and the
    same dot products per output."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return F.linear(x, weight, bias)


def _grouped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, b: int, t: int,
                       sizes: tuple[int, int, int]) -> Tensor:
    """Causal-masked softmax attention of q (B, H, T, D) over k, v (B, KV, S, D) -> (B, T, H*D).

    GQA by broadcasting: query head h = kv * G + g reads KV head kv (HF's repeat_kv order). Unlike expand
    + reshape of the cache, this exports with a static T and a dynamic past length. `b` and `t` are the
    batch and new length as read from the caller's input (traced sizes in an export), `sizes` (H, KV, D)."""
    heads, kv_heads, head_dim = sizes
    qg = q.view(b, kv_heads, heads // kv_heads, t, head_dim)  # (B, KV, G, T, D)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # (B, KV, G, T, S)
    scores = scores * (head_dim**-0.5)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # (B, KV, G, T, D)
    out = out.reshape(b, heads, t, head_dim)  # (B, H, T, D)
    return out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)


class CausalPositions(NamedTuple):
    """Where a block of new positions attends from when it follows a cache of P positions: the RoPE cos/sin
    at its positions (T, D) and which of the S = P + T keys each may see (T, S) bool."""

    cos: Tensor
    sin: Tensor
    allowed: Tensor


class BufferedPositions(NamedTuple):
    """Where a block of new positions attends from when each row's cache sits in a buffer
    (`GroupQueryAttention`): the RoPE cos/sin tables (positions, D/2), indexed at each row's own positions,
    and its (seqlens_k (B,), total_len ()) int32."""

    rope: tuple[Tensor, Tensor]
    lengths: tuple[Tensor, Tensor]


Positions: TypeAlias = CausalPositions | BufferedPositions
"""What a layer's attention needs besides its input and caches; its type picks the attention."""


class GroupQueryAttention(torch.autograd.Function):
    """onnxruntime's `GroupQueryAttention` (com.microsoft) over packed q/k/v, with RoPE from tables and
    the caches in buffers: eager, the attention it computes (upstream's, as `Qwen2Attention.forward`
    does it); in an ONNX export, the operator.

    qkv (B, T, (H + 2 KV) D) before RoPE; past buffers (B, KV, P, D) whose first `seqlens_k[b] + 1 - T` rows
    of row b hold its cache; `seqlens_k` (B,) int32, each row's total length - 1, and `total_len` () int32,
    the longest; cos/sin tables (positions, D/2). Returns the attention output (B, T, H D) and the present
    buffers (B, KV, max(P, total_len), D): each row's cache, then its new keys (after RoPE) and values, then
    zeros here (onnxruntime leaves those rows unspecified). onnxruntime writes the present rows into the
    past buffers when they are bound to the same memory."""

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, past_k: Tensor, past_v: Tensor, seqlens_k: Tensor, total_len: Tensor,
                cos_table: Tensor, sin_table: Tensor, heads: int, kv_heads: int
                ) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = qkv.shape
        head_dim = past_k.shape[3]
        rows = max(past_k.shape[2], int(total_len))
        present_k = past_k.new_zeros(b, kv_heads, rows, head_dim)
        present_v = past_v.new_zeros(b, kv_heads, rows, head_dim)
        outs = []
        for row in range(b):  # each row has its own cache length
            total = int(seqlens_k[row]) + 1
            past = total - t
            q, k, v = qkv[row:row + 1].view(1, t, heads + 2 * kv_heads, head_dim).transpose(1, 2).split(
                [heads, kv_heads, kv_heads], dim=1)
            positions = torch.arange(past, total)
            cos = torch.cat((cos_table[positions], cos_table[positions]), dim=-1)  # (T, D)
            sin = torch.cat((sin_table[positions], sin_table[positions]), dim=-1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys = torch.cat((past_k[row:row + 1, :, :past], k), dim=2)  # (1, KV, S, D)
            values = torch.cat((past_v[row:row + 1, :, :past], v), dim=2)
            allowed = torch.arange(total)[None, :] <= positions[:, None]  # (T, S)
            outs.append(_grouped_attention(q, keys, values, allowed, 1, t, (heads, kv_heads, head_dim)))
            present_k[row, :, :total] = keys[0]
            present_v[row, :, :total] = values[0]
        return torch.cat(outs), present_k, present_v

    @staticmethod
    def symbolic(g: Any, qkv: Any, past_k: Any, past_v: Any, seqlens_k: Any, total_len: Any, cos_table: Any,
                 sin_table: Any, heads: int, kv_heads: int) -> Any:
        absent = g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())  # packed: no key, value
        out, present_k, present_v = g.op(
            "com.microsoft::GroupQueryAttention", qkv, absent, absent, past_k, past_v, seqlens_k, total_len,
            cos_table, sin_table, num_heads_i=heads, kv_num_heads_i=kv_heads, do_rotary_i=1, outputs=3)
        # the types torch cannot infer for an operator outside ONNX's domain
        sizes = qkv.type().varyingSizes()
        out.setType(qkv.type().with_sizes([*sizes[:-1], heads * past_k.type().varyingSizes()[3]]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


class Qwen2Attention(nn.Module):
    """Grouped-query self-attention with RoPE and an explicit (past, present) KV cache."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Positions, past_k: Tensor, past_v: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C); past (B, KV, P, D) -> out, present k, v: after the cache (`CausalPositions`), or
        written into buffers (`BufferedPositions`)."""
        if isinstance(positions, BufferedPositions):
            return self._buffered(x, positions, past_k, past_v)
        cos, sin, allowed = positions
        b, t, _ = x.shape
        q, k, v = _linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Keys are cached after RoPE, so a step never re-rotates the past.
        k = torch.cat((past_k, k), dim=2)  # (B, KV, S, D), S = P + T
        v = torch.cat((past_v, v), dim=2)
        sizes = (self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(_grouped_attention(q, k, v, allowed, b, t, sizes)), k, v

    def _buffered(self, x: Tensor, positions: BufferedPositions, past_k: Tensor, past_v: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """`forward` with the caches in buffers (`GroupQueryAttention`)."""
        qkv = _packed_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        out, k, v = GroupQueryAttention.apply(qkv, past_k, past_v, *positions.lengths, *positions.rope,
                                              self.num_heads, self.num_kv_heads)
        return self.o_proj(out), k, v


class Qwen2MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = _linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm transformer block (attribute order = HF's, which fixes the state_dict order)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, positions: Positions, past_k: Tensor, past_v: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        attn, k, v = self.self_attn(self.input_layernorm(x), positions, past_k, past_v)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class Qwen2Model(nn.Module):
    """Qwen2 decoder stack over input embeddings; returns the final-RMSNorm hidden states."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs_embeds: Tensor, past_keys: list[Tensor], past_values: list[Tensor],
                lengths: tuple[Tensor, Tensor] | None = None, *, onnxruntime_only: bool = False
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Embeddings (B, T, C) + pasts (B, KV, P, D) -> final-norm hidden (B, T, C), presents.

        Without `lengths`, presents are (B, KV, P+T, D) per layer; positions continue from the past
        length, and the new block is causal and sees the whole past. With them, the caches are in buffers:
        `lengths` are `GroupQueryAttention`'s seqlens_k (B,) and total_sequence_length () int32, row b's
        cache the first `seqlens_k[b] + 1 - T` rows of row b of each past, and presents are the buffers
        with each row's new positions written after its cache.
        `onnxruntime_only` (without `lengths`): an ONNX export for a graph only onnxruntime runs writes
        each layer's RoPE and attention as `GroupQueryAttention` too, the pasts taken as buffers their caches
        fill (presents (B, KV, P+T, D) as well), where the standard export writes about forty operators a
        layer (RoPE's halves, the caches' growth, the scores, the causal mask, the softmax).
        """
        if lengths is None and onnxruntime_only and torch.onnx.is_in_onnx_export():
            # every row's cache fills its past: P rows, then the T new ones
            total = (torch.zeros(inputs_embeds.shape[0], dtype=torch.int64) + past_keys[0].shape[2]
                     + inputs_embeds.shape[1]).to(torch.int32)
            lengths = (total - 1, total.max().reshape(()))
        positions = (self._causal(inputs_embeds, past_keys[0]) if lengths is None
                     else self._buffered(inputs_embeds, lengths))
        x = inputs_embeds
        present_keys: list[Tensor] = []
        present_values: list[Tensor] = []
        for layer, past_k, past_v in zip(self.layers, past_keys, past_values, strict=True):
            x, k, v = layer(x, positions, past_k, past_v)
            present_keys.append(k)
            present_values.append(v)
        return self.norm(x), present_keys, present_values

    def _causal(self, inputs_embeds: Tensor, past: Tensor) -> CausalPositions:
        t = inputs_embeds.shape[1]
        past_len = past.shape[2]
        device = inputs_embeds.device
        q_pos = torch.arange(t, device=device) + past_len  # (T,)
        k_pos = torch.arange(past_len + t, device=device)  # (S,)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (T, S)
        cos, sin = _rope_cos_sin(q_pos, self.cfg.head_dim, self.cfg.rope_theta, inputs_embeds.dtype)
        return CausalPositions(cos, sin, allowed)

    def _buffered(self, inputs_embeds: Tensor, lengths: tuple[Tensor, Tensor]) -> BufferedPositions:
        positions = torch.arange(self.cfg.max_position_embeddings, device=inputs_embeds.device)
        cos, sin = _rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, inputs_embeds.dtype)
        half = self.cfg.head_dim // 2  # the tables hold each frequency once
        return BufferedPositions((cos[:, :half], sin[:, :half]), lengths)


class Qwen2CausalLM(nn.Module):
    """Stands in for HF `Qwen2ForCausalLM` so the keys read `model.*` and `lm_head.weight`.

    `lm_head` only exists for the checkpoint: upstream computes its logits and discards them.
    """

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Encoder(nn.Module):
    """Stands in for upstream's `Qwen2Encoder`, which holds the HF model as `.model`."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2CausalLM(cfg)


class CosyVoice3LM(nn.Module):
    """`CosyVoice3LM`: Qwen2 over [sos, text, task_id, speech] embeddings -> speech-token log-probs."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        if cfg.llm_input_size != cfg.qwen.hidden_size or cfg.llm_output_size != cfg.qwen.hidden_size:
            raise ValueError("llm_input_size and llm_output_size must equal the Qwen2 hidden size")
        self.cfg = cfg
        self.llm = Qwen2Encoder(cfg.qwen)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_vocab, bias=False)
        self.speech_embedding = nn.Embedding(cfg.speech_vocab, cfg.llm_input_size)

    @property
    def backbone(self) -> Qwen2Model:
        """The Qwen2 decoder stack (`llm.model.model`)."""
        return self.llm.model.model

    def embed_text(self, ids: Tensor) -> Tensor:
        """Text token ids (B, T) -> Qwen input embeddings (B, T, C)."""
        return self.backbone.embed_tokens(ids)

    def embed_speech(self, ids: Tensor) -> Tensor:
        """Speech ids (B, T), incl. sos/task_id rows -> embeddings (B, T, C)."""
        return self.speech_embedding(ids)

    def empty_cache(
        self, batch: int = 1, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Zero-length past keys and values, one (B, KV, 0, D) tensor per layer each."""
        q = self.cfg.qwen
        ref = self.llm_decoder.weight
        shape = (batch, q.num_key_value_heads, 0, q.head_dim)
        keys = [ref.new_zeros(shape, device=device, dtype=dtype) for _ in range(q.num_hidden_layers)]
        values = [ref.new_zeros(shape, device=device, dtype=dtype) for _ in range(q.num_hidden_layers)]
        return keys, values

    def forward_step(
        self, inputs_embeds: Tensor, past_keys: list[Tensor], past_values: list[Tensor], *,
        onnxruntime_only: bool = False
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One decoding call: embeddings (B, T, C) + pasts -> (logp (B, V) of the last position, presents).

        `logp` is `log_softmax(llm_decoder(h))` of the final-norm hidden state, V = speech_vocab.
        Caches are (B, num_kv_heads, T_total, head_dim), keys after RoPE. `onnxruntime_only`: see
        `Qwen2Model.forward`.
        """
        hidden, present_keys, present_values = self.backbone(inputs_embeds, past_keys, past_values,
                                                             onnxruntime_only=onnxruntime_only)
        return self._logp(hidden), present_keys, present_values

    def forward_step_buffered(
        self, inputs_embeds: Tensor, seqlens_k: Tensor, total_sequence_length: Tensor,
        past_keys: list[Tensor], past_values: list[Tensor]
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """`forward_step` with the caches in buffers, their lengths given as `GroupQueryAttention` takes them
        (`Qwen2Model.forward`)."""
        hidden, present_keys, present_values = self.backbone(inputs_embeds, past_keys, past_values,
                                                             (seqlens_k, total_sequence_length))
        return self._logp(hidden), present_keys, present_values

    def _logp(self, hidden: Tensor) -> Tensor:
        """Speech-token log-probs (B, V) at the last position of the final-norm hidden states."""
        return self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1)

    def forward(
        self, inputs_embeds: Tensor, past_keys: list[Tensor], past_values: list[Tensor]
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Alias of `forward_step`, so the module itself can be traced."""
        return self.forward_step(inputs_embeds, past_keys, past_values)


_LOGIT_STD = 4.0
_STOP_ROW_SCALE = 0.8


@torch.no_grad()
def init_random_(lm: CosyVoice3LM, generator: torch.Generator) -> None:
    """Fill `lm` with deterministic random weights for test bundles (drawn on CPU from `generator`).

    Linear weights are N(0, 1/fan_in) so the residual stream keeps its scale, embeddings N(0, 1),
    biases N(0, 0.02^2), RMSNorm weights 1 + N(0, 0.1^2). `llm_decoder` rows get std
    `_LOGIT_STD / sqrt(C)`: on the tiny config the top id then has probability ~0.2-0.8 and the RAS
    nucleus holds ~18 ids on average (about half the steps below the top-k cap). The stop rows
    (ids >= speech_token_size) are scaled by `_STOP_ROW_SCALE`, which makes a stop rare, so random
    text usually decodes to `max_len` tokens instead of ending after a few.
    """
    hidden = lm.cfg.qwen.hidden_size
    # named_parameters() yields a tied lm_head/embed_tokens weight once, so it is drawn once.
    for name, p in lm.named_parameters():
        if name == "llm_decoder.weight":
            w = torch.randn(p.shape, generator=generator) * (_LOGIT_STD / math.sqrt(hidden))
            w[lm.cfg.speech_token_size:] *= _STOP_ROW_SCALE
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
        elif name.endswith(".bias"):
            w = 0.02 * torch.randn(p.shape, generator=generator)
        elif p.ndim == 2 and "embed" in name:
            w = torch.randn(p.shape, generator=generator)
        else:
            w = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1])
        p.copy_(w)
