"""The flow network: upstream's `CausalMaskedDiffWithDiT` (`cosyvoice/flow/flow.py`).

Speech tokens are embedded straight into mel dimensions, sharpened by a causal pre-lookahead conv
stack, upsampled to the mel rate and decoded by the CFM sampler with a DiT estimator. The state
dict matches upstream's `flow.pt` key for key and in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import FlowConfig
from .cfm import CausalConditionalCFM


class PreLookaheadLayer(nn.Module):
    """Upstream's `PreLookaheadLayer` (`cosyvoice/transformer/upsample_encoder.py`)."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """x: (B, T, C) -> (B, T, C).

        `context` (B, <=pre_lookahead_len, C) holds the real frames after x; without it (or past its
        end) the look-ahead sees zeros. Context frames get no output of their own.
        """
        h = x.transpose(1, 2)  # (B, C, T)
        if context is not None:
            h = torch.cat((h, context.transpose(1, 2)), dim=2)
        h = F.pad(h, (0, x.shape[1] + self.pre_lookahead_len - h.shape[2]))  # (B, C, T + L)
        h = F.leaky_relu(self.conv1(h))  # (B, channels, T); default slope 0.01, as upstream
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal: left pad only
        return h.transpose(1, 2) + x


class CausalMaskedDiffWithDiT(nn.Module):
    """Token embedding, speaker projection, pre-lookahead layer and the CFM decoder (`decoder.estimator`)."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = CausalConditionalCFM(cfg.cfm, cfg.dit)

    @torch.no_grad()
    def inference(self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                  noise: Tensor, *, streaming: bool, finalize: bool) -> Tensor:
        """Mel frames for `token`, continuing the prompt, as upstream's `inference`.

        token: (1, N) and prompt_token: (1, P) speech ids; prompt_feat: (1, 2P, 80) prompt mel;
        embedding: (1, spk_embed_dim) x-vector; noise: (1, 80, >=T) with T = 2(P+N) frames, read from
        frame 0. Non-final calls (`finalize=False`) use the last `pre_lookahead_len` tokens only as
        look-ahead, so they yield 2(N-3) frames instead of 2N. `streaming` selects the block-causal
        DiT mask. Returns (1, 80, T_gen) float32, the frames after the prompt.
        """
        if token.shape[0] != 1:
            raise ValueError(f"batch must be 1, got {token.shape[0]}")
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # (1, 80)
        tokens = torch.cat((prompt_token, token), dim=1).clamp(min=0)  # (1, P+N)
        emb = self.input_embedding(tokens)  # (1, P+N, 80)
        L = self.cfg.pre_lookahead_len
        h = self.pre_lookahead_layer(emb) if finalize else self.pre_lookahead_layer(emb[:, :-L], emb[:, -L:])
        h = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1)  # (1, T, 80)
        T, T_prompt = h.shape[1], prompt_feat.shape[1]
        if noise.shape[2] < T:
            raise ValueError(f"noise has {noise.shape[2]} frames, {T} needed")
        cond = torch.cat((prompt_feat, prompt_feat.new_zeros(1, T - T_prompt, prompt_feat.shape[2])), dim=1)
        mask = h.new_ones(1, 1, T)
        feat = self.decoder(h.transpose(1, 2), mask, spks, cond.transpose(1, 2), noise[:, :, :T].to(h),
                            streaming=streaming)  # (1, 80, T)
        return feat[:, :, T_prompt:]


OUT_BIAS_RANGE = (-2.0, -8.0)
"""Per-channel `proj_out` bias for random weights: a log-mel-like tilt, loud lows to quiet highs."""


@torch.no_grad()
def init_random_(flow: CausalMaskedDiffWithDiT, generator: torch.Generator) -> None:
    """Fill `flow`'s parameters with deterministic random values (our test bundles).

    Weights are N(0, 1/fan_in), so activations keep unit scale through every layer; biases are small
    and the AdaLN gates are damped so 22 residual blocks stay bounded. `proj_out.bias` gets a
    log-mel-like tilt so sampled mels (noise + velocity) look like log-mels in magnitude. Buffers
    (`rotary_embed.inv_freq`) are left as constructed.
    """
    for name, p in flow.named_parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        if name.endswith("bias"):
            p.copy_(0.02 * noise)
        elif name == "input_embedding.weight":
            p.copy_(noise)
        else:
            p.copy_(noise / p[0].numel() ** 0.5)  # fan_in = in_channels/groups * kernel
        if name.endswith(".attn_norm.linear.weight"):  # every DiT block's AdaLN
            p.mul_(0.5)  # gates ~0.5: residual stream grows slowly with depth
    est = flow.decoder.estimator
    lo, hi = OUT_BIAS_RANGE
    n = est.proj_out.bias.numel()
    est.proj_out.bias.copy_(torch.linspace(lo, hi, n) + 0.5 * torch.randn(n, generator=generator))
