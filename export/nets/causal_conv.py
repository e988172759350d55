"""Causal 1-D convolutions and the Snake activation of the CosyVoice3 vocoder.

Counterparts of upstream's `cosyvoice/transformer/convolution.py` (CausalConv1d, CausalConv1dDownSample,
CausalConv1dUpsample) and `cosyvoice/transformer/activation.py` (Snake). The convolutions subclass
`nn.Conv1d` and keep its `weight`/`bias` parameters, so weight-norm and checkpoint keys match upstream's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def repeat_frames(x: Tensor, factor: int) -> Tensor:
    """Nearest-neighbour upsampling of the last axis by an integer factor: (..., T) -> (..., T * factor).

    Gives the same values as `F.interpolate(mode="nearest")` by an integer factor, written as
    expand + reshape so a traced graph needs no Resize.
    """
    return x.unsqueeze(-1).expand([-1] * x.dim() + [factor]).flatten(-2)


def _extend(x: Tensor, context: Tensor | None, steps: int, left: bool = True) -> Tensor:
    """Put `steps` time steps before (left) or after x (B, C, T): zeros, or `context` (B, C, steps)."""
    if context is None:
        return F.pad(x, (steps, 0) if left else (0, steps))
    if context.shape[-1] != steps:
        raise ValueError(f"context has {context.shape[-1]} steps, expected {steps}")
    return torch.cat([context, x] if left else [x, context], dim=-1)


class CausalConv1d(nn.Conv1d):
    """Stride-1 Conv1d padded on one side only, so the output keeps the input's length.

    `causal_type="left"` puts `causal_padding = (k-1)*d` steps before the input: zeros, or `context` holding
    the real previous steps. `"right"` puts them after it: zeros, or `context` holding the real next steps
    (the look-ahead that a non-final streaming call has).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        dilation: int = 1,
        causal_type: Literal["left", "right"] = "left",
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=dilation)
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', got {causal_type!r}")
        # Upstream's pad formula equals (k-1)*d only for odd kernels or dilation 1; it rejects the rest.
        if kernel_size % 2 == 0 and dilation != 1:
            raise ValueError("an even kernel needs dilation 1")
        self.causal_type = causal_type
        self.causal_padding = (kernel_size - 1) * dilation

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """(B, C_in, T) [+ context (B, C_in, causal_padding)] -> (B, C_out, T)."""
        return super().forward(_extend(x, context, self.causal_padding, left=self.causal_type == "left"))


class CausalConv1dDownSample(nn.Conv1d):
    """Strided Conv1d (kernel a multiple of the stride) with `stride - 1` steps of left padding.

    With HiFT's kernel of 2 * stride, n input steps give floor((n - 1) / stride) outputs.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        if stride == 1 or kernel_size % stride != 0:
            raise ValueError("stride must be > 1 and divide kernel_size")
        self.causal_padding = stride - 1

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """(B, C_in, T) [+ context (B, C_in, stride-1)] -> (B, C_out, T_down)."""
        return super().forward(_extend(x, context, self.causal_padding))


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest upsampling by `stride`, then a left-padded stride-1 Conv1d (not a ConvTranspose1d)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0)
        self.upsample_factor = stride
        self.causal_padding = kernel_size - 1

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """(B, C_in, T) [+ context (B, C_in, k-1) of upsampled steps] -> (B, C_out, T * stride)."""
        x = repeat_frames(x, self.upsample_factor)  # (B, C_in, T * stride)
        return super().forward(_extend(x, context, self.causal_padding))


class Snake(nn.Module):
    """Snake activation y = x + sin^2(alpha x) / (alpha + 1e-9), one linear-scale alpha per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, T) -> (B, C, T)."""
        alpha = self.alpha[None, :, None]  # (1, C, 1)
        # Reciprocal-then-multiply, in upstream's order, to round the same way.
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)
