"""The gated delta rule as a plain recurrence in fp32 (the reference every faster form is tested against), with
fla's shapes: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], state S [B, H, K, V].
The recurrence: kernels/DESIGN.md ("GDN kernels: reference recurrence").
"""
from __future__ import annotations

from typing import Optional

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (fla / HF numerics)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor):
    """fp32 l2-normed q, k, with q scaled by K^-0.5. q, k [..., K]."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q / (q.shape[-1] ** 0.5), k


def gated_delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor):
    """One token of the gated delta rule for a batch of independent states (S is not modified in place).

    Args:
        S: [N, H, K, V] fp32 states.
        q, k: [N, H, K] prepared.
        v: [N, H, V].
        g: [N, H] log decay.
        beta: [N, H] write strength.

    Returns:
        (new S [N, H, K, V], o [N, H, V]).
    """
    S = S * g.exp()[..., None, None]
    kv_mem = (S * k.unsqueeze(-1)).sum(dim=-2)  # [N, H, V]
    d = (v - kv_mem) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * d.unsqueeze(-2)
    o = (S * q.unsqueeze(-1)).sum(dim=-2)
    return S, o


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                               checkpoint_every: Optional[int] = None, start: int = 0):
    """Run the recurrence over T tokens in fp32 (the reference of every GDN kernel).

    Args:
        q, k: [B, T, H, K] prepared (l2-normed, q scaled: ``naive.prepare_qk``).
        v: [B, T, H, V].
        g: [B, T, H] log decay.
        beta: [B, T, H] write strength.
        initial_state: [B, H, K, V] or None (zeros).
        checkpoint_every: C; keep the states before every token whose absolute position ``start + t`` is a multiple
            of C.
        start: the absolute position of token 0 (an extension of a trunk).

    Returns:
        (o [B, T, H, V] fp32, final_state [B, H, K, V] fp32, checkpoints [B, n, H, K, V] fp32 or None without C).
        Checkpoint j is the state after the first j * C tokens of the sequence.
    """
    b, t, h, kd = k.shape
    vd = v.shape[-1]
    if q.shape != k.shape or v.shape[:3] != (b, t, h) or g.shape != (b, t, h) or beta.shape != (b, t, h):
        raise ValueError(f"recurrent_gated_delta_rule: shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)} do not match "
                         f"[B, T, H, K] / [B, T, H, V] / [B, T, H]")
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = torch.zeros(b, h, kd, vd, dtype=torch.float32, device=v.device) if initial_state is None \
        else initial_state.float()
    o = torch.empty(b, t, h, vd, dtype=torch.float32, device=v.device)
    ckpts = []
    for i in range(t):
        if checkpoint_every is not None and (start + i) % checkpoint_every == 0:
            ckpts.append(S)
        S, o[:, i] = gated_delta_step(S, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
    if checkpoint_every is None:
        return o, S, None
    ck = torch.stack(ckpts, 1) if ckpts else S.new_zeros(b, 0, h, kd, vd)
    return o, S, ck


def tree_replay_reference(checkpoints, finals, every: int, trunk_k, trunk_v, trunk_g, trunk_beta, q, k, v, g, beta,
                          anchor, parent, trunk_index):
    """Tree nodes through the recurrence from the trunks' checkpoints, one node at a time (what the GDN executor's
    torch path and the fused replay kernel compute). A root with anchor a starts from the state after trunk tokens
    0..a: checkpoint (a+1)//every plus < every replayed tokens, or the final state when a is the last token.

    Args:
        checkpoints: per trunk [n_i, H, K, V] (the state after the first j * every tokens).
        finals: per trunk [H, K, V].
        every: the checkpoint interval.
        trunk_k, trunk_v: per trunk [T_i, H, K] / [T_i, H, V] (prepared).
        trunk_g, trunk_beta: per trunk [T_i, H].
        q, k: [M, H, K] node inputs (prepared).
        v: [M, H, V].
        g, beta: [M, H].
        anchor, parent, trunk_index: [M] tree structure (parents precede children).

    Returns:
        (o [M, H, V], states [M, H, K, V]).
    """
    m = anchor.numel()
    o = torch.empty(m, *v.shape[1:], dtype=torch.float32, device=v.device)
    states = torch.empty(m, *checkpoints[0].shape[1:], dtype=torch.float32, device=v.device)
    for u in range(m):
        p = int(parent[u])
        if p >= 0:
            S = states[p][None]
        else:
            i, n = int(trunk_index[u]), int(anchor[u]) + 1
            if n == trunk_k[i].shape[0]:
                S = finals[i].float()[None]
            else:
                c = n // every
                S = checkpoints[i][c].float()[None]
                lo = c * every
                if n > lo:
                    sl = slice(lo, n)
                    tk = trunk_k[i][None, sl]  # q is not needed: only the state is kept
                    _, S, _ = recurrent_gated_delta_rule(tk, tk, trunk_v[i][None, sl], g=trunk_g[i][None, sl],
                                                         beta=trunk_beta[i][None, sl], initial_state=S)
        S, o_u = gated_delta_step(S, q[u][None], k[u][None], v[u][None], g[u][None], beta[u][None])
        states[u], o[u] = S[0], o_u[0]
    return o, states
