"""The flow-matching sampler: upstream's `CausalConditionalCFM` (`cosyvoice/flow/flow_matching.py`).

It has no weights of its own; the DiT lives under `estimator` so its keys read `decoder.estimator.*`.
The initial noise is an input: upstream slices a fixed seed-0 table position-locked, and the caller
does the same slicing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import CFMConfig, DiTConfig
from .dit import DiT, dit_attention_mask


def time_grid(n_timesteps: int, scheduler: str = "cosine", dtype: torch.dtype = torch.float32) -> Tensor:
    """The n_timesteps+1 ODE times from 0 to 1; `cosine` warps them as ``1 - cos(t * pi / 2)``."""
    t = torch.linspace(0, 1, n_timesteps + 1, dtype=dtype)
    if scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


class CausalConditionalCFM(nn.Module):
    """Euler sampler with classifier-free guidance around a `DiT` estimator."""

    def __init__(self, cfm: CFMConfig, dit: DiTConfig) -> None:
        super().__init__()
        self.cfm = cfm
        self.chunk_frames = dit.static_chunk_size
        self.estimator = DiT(dit)

    def forward(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, noise: Tensor, *,
                streaming: bool, n_timesteps: int | None = None) -> Tensor:
        """Integrate from `noise` at t=0 to a mel at t=1.

        mu, cond, noise: (B, 80, T); mask: (B, 1, T); spks: (B, 80). `streaming` selects the
        block-causal attention mask; `n_timesteps` defaults to the config's. Returns (B, 80, T) float32.
        """
        n = self.cfm.n_timesteps if n_timesteps is None else n_timesteps
        t_span = time_grid(n, self.cfm.t_scheduler, mu.dtype).to(mu.device)
        attn_mask = dit_attention_mask(mask, streaming, self.chunk_frames)  # (B, 1, T, T)
        return self.solve_euler(noise, t_span, mu, mask, spks, cond, attn_mask)

    def solve_euler(self, x: Tensor, t_span: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor,
                    attn_mask: Tensor) -> Tensor:
        """Fixed-step Euler over `t_span`; each step evaluates the conditional and unconditional rows.

        The CFG batch is [conditional rows; unconditional rows] with mu, spks and cond zeroed in the
        latter (x, mask and t shared). t is accumulated and dt recomputed from it, as upstream does,
        so the float rounding of the steps matches.
        """
        B = x.shape[0]
        rate = self.cfm.inference_cfg_rate
        mask_in = torch.cat((mask, mask))  # (2B, 1, T)
        mu_in = torch.cat((mu, torch.zeros_like(mu)))  # (2B, 80, T)
        spks_in = torch.cat((spks, torch.zeros_like(spks)))  # (2B, 80)
        cond_in = torch.cat((cond, torch.zeros_like(cond)))  # (2B, 80, T)
        attn_in = torch.cat((attn_mask, attn_mask))  # (2B, 1, T, T)
        t, dt = t_span[:1], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v = self.estimator(torch.cat((x, x)), mask_in, mu_in, t.expand(2 * B), spks_in, cond_in, attn_in)
            v_cond, v_uncond = v.split([B, B])
            x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()
