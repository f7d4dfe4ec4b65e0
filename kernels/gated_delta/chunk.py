"""Chunked gated delta rule forward (Triton, fla's WY form) that keeps the fp32 state entering every chunk: the
GDN executor's checkpoints. Maths: kernels/DESIGN.md ("GDN kernels"). CUDA, or the CPU under
``TRITON_INTERPRET=1`` (set before importing this module; tests only).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from specopd_kernels.dot import MIN_DOT, dot_block, dot_precision


@triton.jit
def _chunk_wy_fwd(k, v, g, beta, gc_out, w_out, u_out, T, Tp, pad,
                  H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hq = i_h // (H // HQ)
    o_r = tl.arange(0, BT)
    o_t = i_t * BT + o_r - pad  # token index of each chunk row (< 0: front padding)
    m_t = (o_t >= 0) & (o_t < T)
    tok = (i_b * T + o_t).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_gc = tl.cumsum(b_g, 0)
    row = (i_b * Tp + i_t * BT + o_r).to(tl.int64)  # padded row
    tl.store(gc_out + row * H + i_h, b_gc)
    b_k = tl.load(k + (tok * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_v = tl.load(v + (tok * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.0).to(tl.float32)
    lower = o_r[:, None] > o_r[None, :]
    b_A = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC) * b_beta[:, None]
    b_A = -tl.where(lower, b_A * tl.exp(tl.where(lower, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    # (I + A)^-1 by forward substitution: row i of the strictly lower part = a + sum_j a_j row_j (rows j < i done)
    for i in range(1, BT):
        sel = o_r == i
        a = tl.sum(tl.where(sel[:, None], b_A, 0.0), 0)
        a = a + tl.sum(a[:, None] * b_A, 0) * (o_r < i)
        b_A = tl.where(sel[:, None], a[None, :], b_A)
    b_A += (o_r[:, None] == o_r[None, :]).to(tl.float32)
    b_w = tl.dot(b_A, b_k * (b_beta * tl.exp(b_gc))[:, None], input_precision=DOT_PREC)
    b_u = tl.dot(b_A, b_v * b_beta[:, None], input_precision=DOT_PREC)
    tl.store(w_out + (row * H + i_h)[:, None] * K + o_k[None, :], b_w, mask=m_k[None, :])
    tl.store(u_out + (row * H + i_h)[:, None] * V + o_v[None, :], b_u, mask=m_v[None, :])


@triton.jit
def _chunk_h_fwd(k, w, u, gc, h0, h_out, vn_out, ht, T, Tp, pad, NT,
                 H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, DOT_PREC: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hq = i_h // (H // HQ)
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_bh.to(tl.int64) * K * V + off_h, mask=m_h, other=0.0).to(tl.float32)
    for i_t in range(0, NT):
        tl.store(h_out + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V + off_h, b_h, mask=m_h)
        row = (i_b * Tp + i_t * BT + o_r).to(tl.int64)
        o_t = i_t * BT + o_r - pad
        m_t = (o_t >= 0) & (o_t < T)
        b_w = tl.load(w + (row * H + i_h)[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_u = tl.load(u + (row * H + i_h)[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_vn = b_u - tl.dot(b_w, b_h, input_precision=DOT_PREC)
        tl.store(vn_out + (row * H + i_h)[:, None] * V + o_v[None, :], b_vn, mask=m_v[None, :])
        b_gc = tl.load(gc + row * H + i_h)
        g_last = tl.load(gc + (i_b * Tp + i_t * BT + BT - 1).to(tl.int64) * H + i_h)
        tok = (i_b * T + o_t).to(tl.int64)
        b_k = tl.load(k + (tok * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_k = b_k * tl.exp(g_last - b_gc)[:, None]
        b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_k), b_vn, input_precision=DOT_PREC)
    tl.store(ht + i_bh.to(tl.int64) * K * V + off_h, b_h, mask=m_h)


@triton.jit
def _chunk_o_fwd(q, k, gc, h, vn, o, T, Tp, pad, NT,
                 H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_v = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hq = i_h // (H // HQ)
    o_r = tl.arange(0, BT)
    o_t = i_t * BT + o_r - pad
    m_t = (o_t >= 0) & (o_t < T)
    tok = (i_b * T + o_t).to(tl.int64)
    row = (i_b * Tp + i_t * BT + o_r).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    b_q = tl.load(q + (tok * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_k = tl.load(k + (tok * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_gc = tl.load(gc + row * H + i_h)
    b_h = tl.load(h + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vn = tl.load(vn + (row * H + i_h)[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_o = tl.dot(b_q, b_h, input_precision=DOT_PREC) * tl.exp(b_gc)[:, None]
    causal = o_r[:, None] >= o_r[None, :]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    b_s = tl.where(causal, b_s * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    b_o += tl.dot(b_s, b_vn, input_precision=DOT_PREC)
    tl.store(o + (tok * H + i_h)[:, None] * V + o_v[None, :], b_o, mask=m_t[:, None] & m_v[None, :])


def chunk_size_for(checkpoint_every: Optional[int]) -> int:
    """The chunk BT (64, 32 or 16) whose chunk states include every checkpoint: the largest that divides C."""
    if checkpoint_every is None:
        return 64
    for bt in (64, 32, 16):
        if checkpoint_every % bt == 0:
            return bt
    raise ValueError(f"chunk_gated_delta_rule keeps checkpoints at chunk starts, so checkpoint_every must be a "
                     f"multiple of 16 (got {checkpoint_every}); use gdn_checkpoint_every=64 or the fused recurrent "
                     f"kernel (specopd_kernels.gated_delta.fused_recurrent)")


def kernel_config(k_dim: int, v_dim: int) -> dict:
    """Block sizes and warps per kernel (checked for spills by ``benchmarks/aot_check.py``)."""
    bk, bv_full = dot_block(k_dim), dot_block(v_dim)  # K, V and BT all reach tl.dot
    return dict(BK=bk, BV_WY=bv_full, BV_H=min(bv_full, 32), BV_O=min(bv_full, 32),
                warps_wy=8 if bk * bv_full > 64 * 64 else 4, warps_h=4, warps_o=4)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                           checkpoint_every: Optional[int] = None, start: int = 0,
                           chunk_size: Optional[int] = None):
    """The chunked Triton forward with the same contract as ``naive.recurrent_gated_delta_rule``.

    Args / Returns: as ``specopd_kernels.gated_delta.naive.recurrent_gated_delta_rule``, except:
        q, k: [B, T, HQ, K] with v's H a multiple of HQ (head h reads q/k head h // (H / HQ)).
        chunk_size: BT (default: ``chunk_size_for(C)``, the largest of 64, 32, 16 that divides C).
    """
    b, t, hq, kd = k.shape
    h, vd = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (b, t) or h % hq or g.shape != (b, t, h) or beta.shape != (b, t, h):
        raise ValueError(f"chunk_gated_delta_rule: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} do not match [B, T, HQ, K] / [B, T, H, V] / "
                         f"[B, T, H] with H a multiple of HQ")
    if initial_state is not None and initial_state.shape != (b, h, kd, vd):
        raise ValueError(f"chunk_gated_delta_rule: initial_state {tuple(initial_state.shape)} is not [B, H, K, V] = "
                         f"{(b, h, kd, vd)}")
    bt = chunk_size or chunk_size_for(checkpoint_every)
    if bt < MIN_DOT or bt & (bt - 1):
        raise ValueError(f"chunk_size must be a power of two >= {MIN_DOT} (the chunk is a tl.dot dim); got {bt}")
    if checkpoint_every is not None and checkpoint_every % bt:
        raise ValueError(f"chunk_size {bt} must divide checkpoint_every {checkpoint_every}")
    dev = v.device
    q, k, v = (x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    pad = start % bt
    nt = max(1, triton.cdiv(pad + t, bt))
    tp = nt * bt
    f32 = dict(dtype=torch.float32, device=dev)
    gc, w, u = torch.empty(b, tp, h, **f32), torch.empty(b, tp, h, kd, **f32), torch.empty(b, tp, h, vd, **f32)
    states = torch.empty(b, nt, h, kd, vd, **f32)
    vn = torch.empty(b, tp, h, vd, **f32)
    o = torch.empty(b, t, h, vd, **f32)
    ht = torch.empty(b, h, kd, vd, **f32)
    h0 = initial_state.float().contiguous() if initial_state is not None else ht  # dummy when unused
    cfg = kernel_config(kd, vd)
    common = dict(H=h, HQ=hq, K=kd, V=vd, BT=bt, BK=cfg["BK"], DOT_PREC=dot_precision(q.dtype))
    if t > 0:
        _chunk_wy_fwd[(nt, b * h)](k, v, g, beta, gc, w, u, t, tp, pad, BV=cfg["BV_WY"], **common,
                                   num_warps=cfg["warps_wy"])
    else:
        gc.zero_(), w.zero_(), u.zero_()
    _chunk_h_fwd[(triton.cdiv(vd, cfg["BV_H"]), b * h)](k, w, u, gc, h0, states, vn, ht, t, tp, pad, nt,
                                                       BV=cfg["BV_H"], USE_H0=initial_state is not None, **common,
                                                       num_warps=cfg["warps_h"])
    if t > 0:
        _chunk_o_fwd[(nt, b * h, triton.cdiv(vd, cfg["BV_O"]))](q, k, gc, states, vn, o, t, tp, pad, nt,
                                                               BV=cfg["BV_O"], **common, num_warps=cfg["warps_o"])
    return o, ht, chunk_checkpoints(states, start, t, bt, checkpoint_every)


def chunk_checkpoints(states: torch.Tensor, start: int, t: int, bt: int, every: Optional[int]):
    """Pick the checkpoints out of the chunk states of a sequence whose chunk 0 starts at ``start - start % bt``.

    Args:
        states: [B, NT, H, K, V] the state entering each chunk.
        start: the sequence's first absolute position.
        t: its length.
        bt: the chunk size.
        every: C, or None.

    Returns:
        [B, n, H, K, V] the states before the positions in [start, start + t) that are multiples of C, or None.
    """
    if every is None:
        return None
    pad = start % bt
    base = start - pad  # absolute position where chunk 0 starts
    keep = [c for c in range(states.shape[1]) if (base + c * bt) % every == 0 and (c > 0 or pad == 0)
            and base + c * bt < start + t]
    return states[:, keep] if keep else states.new_zeros(states.shape[0], 0, *states.shape[2:])
