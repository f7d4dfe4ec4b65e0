"""The plain forms of a decoder layer's elementwise ops and its linear layers: torch's eager code, exactly as the models run it in fp32
and on every device (``specopd.models.common``). ``layer_ops_cpu.c`` and the packed
linear (``cpu.linear``) are tested against these in bf16."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in fp32: ``w * normed(x).to(x.dtype)`` (llama / qwen3), or
    ``(normed(x) * (1 + w.float())).to(x.dtype)`` (``unit_offset``: qwen3_next / qwen4_exp).

    Args:
        x: [..., D].
        weight: [D].
        eps: added to the mean square.
        unit_offset: the weight is an offset from 1.

    Returns:
        [..., D] in x's dtype (w's for ``unit_offset=False``, by type promotion).
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]: torch's ``F.linear``, as ``nn.Linear`` runs it."""
    return F.linear(x, weight, bias)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part: silu(gate) * up. [..., N] -> [..., N]."""
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]; cos / sin [B, T, rd] (rd <= hd: the rest passes through unrotated) -> [B, T, H, hd]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rd], x[..., rd:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)
