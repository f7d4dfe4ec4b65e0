"""Drafter losses and acceptance metrics. N branches, W positions, V vocab.

Probabilities are ``softmax(logits / temperature)`` computed in fp32 (pass logits already scaled, or
``temperature``). The target side ``p`` is always detached: gradients reach the drafter logits only.

Masks are bool [N, W], True = the position exists (e.g. False past the end of the reference sequence).
- ``e2e_tv_loss`` / ``acceptance_length``: a False position *ends the branch*: only the valid prefix
  (positions before the first False) counts, W_b = its length. Branch loss
  ``L_b = 1 - (1/W_b) sum_{j<W_b} prod_{i<=j} alpha_{b,i}``.
- ``ce_loss`` / ``confidence_loss``: False positions are skipped; branch loss = mean over its valid positions.
Normalisation: the sum of branch losses divided by ``denom`` when given (the global number of branches,
so losses of batch halves add up to the loss of the whole batch), else by the number of branches with at
least one valid position. Branches without valid positions add 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for probabilities (T = 0 acceptance is exact match); "
                         f"got {temperature}")
    return torch.softmax(logits.float() / float(temperature), dim=-1)


def _mask(mask: Optional[torch.Tensor], shape, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    mask = torch.as_tensor(mask, device=device)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must be [N, W] = {list(shape)}; got {list(mask.shape)}")
    return mask.bool()


def _reduce(per_branch: torch.Tensor, has_any: torch.Tensor, denom) -> torch.Tensor:
    """per_branch [N] (0 where a branch has no valid position) -> scalar."""
    if denom is None:
        denom = has_any.sum().clamp(min=1)
    elif float(denom) <= 0:
        raise ValueError(f"denom must be > 0 (the global number of branches); got {denom}")
    return per_branch.sum() / denom


def tv_alpha(q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """alpha [N, W] = sum_v min(q, p) = 1 - TV(p, q) (rejection-sampling acceptance); grad through q only."""
    if q_logits.shape != p_logits.shape:
        raise ValueError(f"q_logits {tuple(q_logits.shape)} and p_logits {tuple(p_logits.shape)} must have one "
                         f"shape [N, W, V] (same vocabulary)")
    return torch.minimum(_probs(q_logits, temperature), _probs(p_logits.detach(), temperature)).sum(-1)


def align_p_logits(anchor_logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Target logits aligned with drafter slots: slot j predicts the token after ``trunk[:a+1] + y[:j]``,
    so p[:, 0] = the trunk logits at the anchor (``cache.logits[a]``, [N, V]) and p[:, j] = scored[:, j-1]
    (``target.score`` output [N, W, V]; its last row is the bonus position and is not used here)."""
    if anchor_logits.dim() != 2 or scored.dim() != 3 or anchor_logits.shape[0] != scored.shape[0]:
        raise ValueError(f"need anchor_logits [N, V] and scored [N, W, V]; got {tuple(anchor_logits.shape)} and "
                         f"{tuple(scored.shape)}")
    return torch.cat([anchor_logits[:, None].to(scored.dtype), scored[:, :-1]], 1)


def prefix_survival(alpha: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, W]: prod_{i<=j} alpha_i on the valid prefix, 0 from the first masked position on."""
    valid = torch.cumprod(_mask(mask, alpha.shape, alpha.device).long(), dim=1).bool()
    return torch.cumprod(torch.where(valid, alpha, torch.zeros_like(alpha)), dim=1)


def acceptance_length(alpha: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expected tokens per verification round, bonus included: [N] = 1 + sum_j prod_{i<=j} alpha_i."""
    return 1.0 + prefix_survival(alpha, mask).sum(1)


expected_acceptance_length = acceptance_length


def e2e_tv_loss(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: Optional[torch.Tensor] = None,
                denom=None, temperature: float = 1.0) -> torch.Tensor:
    """Bebop E2E-TV: mean over branches of ``1 - (1/W_b) sum_j prod_{i<=j} alpha_i`` (see module doc)."""
    alpha = tv_alpha(q_logits, p_logits, temperature)
    valid = torch.cumprod(_mask(mask, alpha.shape, alpha.device).long(), dim=1)
    wb = valid.sum(1)
    surv = prefix_survival(alpha, valid.bool()).sum(1)
    per_branch = torch.where(wb > 0, 1.0 - surv / wb.clamp(min=1), torch.zeros_like(surv))
    return _reduce(per_branch, wb > 0, denom)


def _masked_branch_mean(values: torch.Tensor, mask, denom) -> torch.Tensor:
    m = _mask(mask, values.shape, values.device)
    cnt = m.sum(1)
    per_branch = torch.where(m, values, torch.zeros_like(values)).sum(1) / cnt.clamp(min=1)
    return _reduce(per_branch, cnt > 0, denom)


def ce_loss(q_logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None,
            denom=None) -> torch.Tensor:
    """Cross-entropy of the drafter on reference tokens targets [N, W]: per-branch mean of -log q(target)."""
    if tuple(targets.shape) != tuple(q_logits.shape[:2]):
        raise ValueError(f"targets must be [N, W] = {list(q_logits.shape[:2])}; got {list(targets.shape)}")
    nll = -torch.log_softmax(q_logits.float(), -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return _masked_branch_mean(nll, mask, denom)


def confidence_loss(conf_logits: torch.Tensor, alpha: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    denom=None) -> torch.Tensor:
    """DSpark: BCE(sigmoid(conf_logits), alpha.detach()) [N, W], per-branch mean over valid positions."""
    if conf_logits.shape != alpha.shape:
        raise ValueError(f"conf_logits {tuple(conf_logits.shape)} and alpha {tuple(alpha.shape)} must both be [N, W]")
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), alpha.detach().float(), reduction="none")
    return _masked_branch_mean(bce, mask, denom)
