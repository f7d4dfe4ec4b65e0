"""QSA indexer (Triton): group scores (``index_scores``) and the per-query top-k of groups (``topk_groups``, ties
to the lowest group index, no sort). Tiling and the top-k search: kernels/DESIGN.md ("QSA kernels").
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specopd_kernels.dot import dot_block, dot_precision


@triton.jit
def _index_scores_fwd(q, keys, n_complete, scores, Q, G, inv_div, stride_qq, stride_qh, stride_kg, stride_sq,
                      HI: tl.constexpr, DI: tl.constexpr, BLOCK_D: tl.constexpr, BQ: tl.constexpr,
                      BG: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_g = tl.program_id(1)
    oq = pid_q * BQ + tl.arange(0, BQ)
    mq = oq < Q
    n = tl.load(n_complete + oq, mask=mq, other=0)
    g0 = pid_g * BG
    if g0 < tl.max(n, 0):  # else no query of this block sees these groups
        og = g0 + tl.arange(0, BG)
        d = tl.arange(0, BLOCK_D)
        dm = d < DI
        kt = tl.load(keys + og[None, :] * stride_kg + d[:, None], mask=dm[:, None] & (og < G)[None, :], other=0.0)
        s = tl.zeros([BQ, BG], tl.float32)
        qb = q + (pid_q * BQ).to(tl.int64) * stride_qq  # int64 base, int32 tile offsets
        for h in range(HI):  # not unrolled: one head's q tile live at a time
            qh = tl.load(qb + (oq - pid_q * BQ)[:, None] * stride_qq + h * stride_qh + d[None, :],
                         mask=mq[:, None] & dm[None, :], other=0.0)
            s += tl.maximum(tl.dot(qh, kt, input_precision=DOT_PREC), 0.0)
        s = s / inv_div
        sb = scores + (pid_q * BQ).to(tl.int64) * stride_sq
        tl.store(sb + (oq - pid_q * BQ)[:, None] * stride_sq + og[None, :], s,
                 mask=mq[:, None] & (og[None, :] < n[:, None]) & (og < G)[None, :])


@triton.jit
def _topk_groups_fwd(scores, n_complete, out, stride_sq, K_SEL: tl.constexpr, BG: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(n_complete + pid)
    row = scores + pid.to(tl.int64) * stride_sq
    dst = out + pid.to(tl.int64) * K_SEL
    og = tl.arange(0, BG)
    if n <= K_SEL:  # every complete group is kept
        for j0 in range(0, K_SEL, BG):
            oj = j0 + og
            tl.store(dst + oj, tl.where(oj < n, oj, -1), mask=oj < K_SEL)
    else:
        # largest threshold t (fp32 bits) with count(bits >= t) >= K_SEL: the K_SEL-th largest score
        lo = tl.zeros([], tl.int32)
        hi = tl.full([], 0x7F800001, tl.int32)
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            cnt = tl.zeros([], tl.int32)
            for g0 in range(0, n, BG):
                g = g0 + og
                x = tl.load(row + g, mask=g < n, other=0.0)
                bits = tl.where(g < n, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
                cnt += tl.sum((bits >= mid).to(tl.int32), 0)
            ok = cnt >= K_SEL
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        gt_total = tl.zeros([], tl.int32)
        for g0 in range(0, n, BG):
            g = g0 + og
            x = tl.load(row + g, mask=g < n, other=0.0)
            bits = tl.where(g < n, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
            gt_total += tl.sum((bits > lo).to(tl.int32), 0)
        need = K_SEL - gt_total  # ties at the threshold to keep, lowest group index first
        seen_eq = tl.zeros([], tl.int32)
        written = tl.zeros([], tl.int32)
        for g0 in range(0, n, BG):
            g = g0 + og
            x = tl.load(row + g, mask=g < n, other=0.0)
            bits = tl.where(g < n, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
            eq = (bits == lo).to(tl.int32)
            keep = ((bits > lo) | ((eq != 0) & ((tl.cumsum(eq, 0) - eq + seen_eq) < need))).to(tl.int32)
            pos = tl.cumsum(keep, 0) - keep + written
            tl.store(dst + pos, g, mask=keep != 0)
            seen_eq += tl.sum(eq, 0)
            written += tl.sum(keep, 0)


def scores_config(head_dim: int, fp32: bool = True) -> dict:
    """Tiles of ``_index_scores_fwd``. fp32 operands (the indexer's, ``QSAttention.index_project``) take half the
    group tile of 16-bit ones: a [BLOCK_D, 128] fp32 key tile next to the fp32 q tile spilled 288 B under triton
    3.6 (the H200 machine's) at di = 128 (``benchmarks/aot_check.py``)."""
    block_d = dot_block(head_dim)
    bg = 128 if block_d <= 128 else 64
    return dict(BQ=32 if fp32 else 64, BG=bg // 2 if fp32 else bg, BLOCK_D=block_d, num_warps=8)


def index_scores(q: torch.Tensor, keys: torch.Tensor, n_complete: torch.Tensor) -> torch.Tensor:
    """q [Q, Hi, di] index queries; keys [G, di] pooled group keys; n_complete [Q] -> scores [Q, G] fp32 (entries
    at g >= n_complete[q] are left unset: ``topk_groups`` never reads them)."""
    nq, hi, di = q.shape
    g = keys.shape[0]
    if keys.shape[1] != di or n_complete.shape != (nq,):
        raise ValueError(f"index_scores: q {tuple(q.shape)}, keys {tuple(keys.shape)}, n_complete "
                         f"{tuple(n_complete.shape)} do not match [Q, Hi, di], [G, di], [Q]")
    q, keys = q.contiguous(), keys.contiguous()
    out = torch.empty(nq, max(g, 1), dtype=torch.float32, device=q.device)
    if nq == 0 or g == 0:
        return out[:, :g]
    cfg = scores_config(di, q.dtype == torch.float32)
    grid = (triton.cdiv(nq, cfg["BQ"]), triton.cdiv(g, cfg["BG"]))
    _index_scores_fwd[grid](q, keys, n_complete.to(torch.int32).contiguous(), out, nq, g, math.sqrt(di),
                            q.stride(0), q.stride(1), keys.stride(0), out.stride(0), HI=hi, DI=di,
                            BLOCK_D=cfg["BLOCK_D"], BQ=cfg["BQ"], BG=cfg["BG"],
                            DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"])
    return out


def topk_config(topk: int) -> dict:
    """One 1024-score tile per counting step (G <= 1024 is a single pass; longer rows loop over tiles)."""
    return dict(BG=1024, num_warps=4)


def topk_groups(scores: torch.Tensor, n_complete: torch.Tensor, k: int) -> torch.Tensor:
    """scores [Q, G] fp32 (>= 0, as the indexer's are; only g < n_complete[q] read); n_complete [Q]; k -> [Q, k]
    long: selected group indices ascending, -1 padded; identical to ``select_groups`` (ties: lowest index)."""
    nq = scores.shape[0]
    out = torch.empty(nq, max(k, 1), dtype=torch.int32, device=scores.device)
    if n_complete.shape != (nq,):
        raise ValueError(f"topk_groups: n_complete {tuple(n_complete.shape)} is not [Q] = [{nq}]")
    if nq == 0 or k == 0:
        return out[:, :k].long()
    if bool((n_complete > scores.shape[1]).any()):
        raise ValueError(f"topk_groups: n_complete exceeds the {scores.shape[1]} score columns")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    cfg = topk_config(k)
    _topk_groups_fwd[(nq,)](scores, n_complete.to(torch.int32).contiguous(), out, scores.stride(0), K_SEL=k,
                            BG=cfg["BG"], num_warps=cfg["num_warps"])
    return out.long()
