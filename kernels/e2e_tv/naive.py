"""Plain torch references of the CPU TV kernel (``cpu.py``): the formulas of ``specopd.losses``' torch path."""
from __future__ import annotations

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32, or fp64 when given fp64 (the tests' exact-enough reference)."""
    return x if x.dtype == torch.float64 else x.float()


def tv_alpha_forward(zq: torch.Tensor, zp: torch.Tensor, temperature: float) -> torch.Tensor:
    """alpha [R] = sum_v min(softmax(zq / T), softmax(zp / T)) for zq, zp [R, V] (in fp32, or fp64 for fp64)."""
    q = torch.softmax(_wide(zq) / temperature, -1)
    p = torch.softmax(_wide(zp) / temperature, -1)
    return torch.minimum(q, p).sum(-1)


def tv_alpha_backward(zq: torch.Tensor, zp: torch.Tensor, temperature: float,
                      grad_alpha: torch.Tensor) -> torch.Tensor:
    """dL/dzq = grad_alpha q (ind - <q, ind>) / T, ind = 1[q < p] + 1/2 1[q == p] (torch.minimum's gradient rule).

    Args:
        zq, zp: [R, V] logits of q and p.
        temperature: T > 0.
        grad_alpha: [R] dL/dalpha.

    Returns:
        [R, V] fp32 (fp64 for fp64 inputs).
    """
    q = torch.softmax(_wide(zq) / temperature, -1)
    p = torch.softmax(_wide(zp) / temperature, -1)
    ind = (q < p).to(q.dtype) + 0.5 * (q == p).to(q.dtype)
    return q * (ind - (q * ind).sum(-1, keepdim=True)) * (_wide(grad_alpha)[:, None] / temperature)


def ce_nll(zq: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """nll [R] = -log softmax(zq)[target] (q at T = 1)."""
    return -torch.log_softmax(_wide(zq), -1).gather(-1, targets.long()[:, None]).squeeze(-1)


def ce_backward(zq: torch.Tensor, targets: torch.Tensor, grad_nll: torch.Tensor) -> torch.Tensor:
    """dL/dzq of the CE term = grad_nll (softmax(zq) - onehot(target)), [R, V] fp32 (fp64 for fp64 inputs)."""
    q = torch.softmax(_wide(zq), -1)
    q[torch.arange(q.shape[0]), targets.long()] -= 1.0
    return q * _wide(grad_nll)[:, None]
