"""Triton fused recurrent gated delta rule (forward) with state checkpoints, same contract as
``specopd_kernels.gated_delta.naive.recurrent_gated_delta_rule``. Runs on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (set before importing this module; tests only). Design: kernels/DESIGN.md
("GDN kernels: fused recurrent").
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(q, k, v, g, beta, o, h0, ht, ck, T, start, every, first_ck, n_ck,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, SAVE_CK: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_bh * K * V + off_h, mask=m_h, other=0.0).to(tl.float32)
    for t in range(0, T):
        if SAVE_CK:
            if (start + t) % every == 0:
                j = (start + t) // every - first_ck
                tl.store(ck + ((i_b * n_ck + j) * H + i_h) * K * V + off_h, b_h, mask=m_h)
        row = (i_b * T + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + row).to(tl.float32)
        b_beta = tl.load(beta + row).to(tl.float32)
        b_h = b_h * tl.exp(b_g)
        kv = tl.sum(b_h * b_k[:, None], axis=0)
        b_d = (b_v - kv) * b_beta
        b_h = b_h + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + row * V + o_v, b_o, mask=m_v)
    tl.store(ht + i_bh * K * V + off_h, b_h, mask=m_h)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                                     checkpoint_every: Optional[int] = None, start: int = 0, block_v: int = 32):
    """The recurrence token by token in one Triton launch, exactly as ``naive.recurrent_gated_delta_rule``.

    Args / Returns: as ``specopd_kernels.gated_delta.naive.recurrent_gated_delta_rule``; ``block_v``: value columns per
    program.
    """
    b, t, h, kd = k.shape
    vd = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    dev = v.device
    o = torch.empty(b, t, h, vd, dtype=torch.float32, device=dev)
    ht = torch.empty(b, h, kd, vd, dtype=torch.float32, device=dev)
    h0 = initial_state.float().contiguous() if initial_state is not None else ht  # dummy when unused
    every = int(checkpoint_every or 1)
    first = -(-start // every)
    n_ck = max(0, -(-(start + t) // every) - first) if checkpoint_every else 0
    ck = torch.empty(b, n_ck, h, kd, vd, dtype=torch.float32, device=dev) if checkpoint_every else ht
    bk = triton.next_power_of_2(kd)
    bv = min(triton.next_power_of_2(vd), block_v)
    grid = (triton.cdiv(vd, bv), b * h)
    _fwd_kernel[grid](q, k, v, g, beta, o, h0, ht, ck, t, start, every, first, max(n_ck, 1),
                      H=h, K=kd, V=vd, BK=bk, BV=bv, USE_H0=initial_state is not None,
                      SAVE_CK=bool(checkpoint_every) and n_ck > 0)
    return o, ht, (ck if checkpoint_every else None)
