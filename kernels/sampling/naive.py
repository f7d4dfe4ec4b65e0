"""Plain float64 reference of the CPU sampling kernel (``cpu.py``): the inverse CDF of softmax(z / T) at u."""
from __future__ import annotations

import torch


def draw(z: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u, in float64.

    Args:
        z: [R, V] logits (any float dtype; -inf allowed, at least one finite per row).
        u: [R] uniforms in [0, 1).
        temperature: T > 0.

    Returns:
        [R] int64 tokens; a token with p = 0 is never drawn.
    """
    p = torch.softmax(z.double() / temperature, -1)
    c = torch.cumsum(p, -1)
    t = (u.double() * c[:, -1]).clamp(max=torch.nextafter(c[:, -1], torch.zeros_like(c[:, -1])))
    tok = torch.searchsorted(c, t[:, None], right=True).squeeze(1)
    last = torch.where(p > 0, torch.arange(p.shape[1]), -1).amax(-1)
    return torch.minimum(tok, last)


def margin(z: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """[R] float64: how far u * total lies from the nearest CDF boundary, relative to the total (a draw within
    ~1e-6 of a boundary may go either way between two correct fp32 / fp64 implementations)."""
    p = torch.softmax(z.double() / temperature, -1)
    c = torch.cumsum(p, -1)
    t = u.double()[:, None] * c[:, -1:]
    return (c - t).abs().amin(-1) / c[:, -1]
