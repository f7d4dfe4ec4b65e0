"""QSA attention over each query's own key list (``sparse_attention``, Triton), and the blockwise prefill that
drives the indexer (``qsa_prefill``: no [T, T] tensor). Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``
(set before importing this module; tests only). Design: kernels/DESIGN.md ("QSA kernels").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specopd_kernels.dot import dot_block, dot_precision
from specopd_kernels.qsa.indexer import index_scores, topk_groups
from specopd_kernels.softmax import online_softmax_update


@triton.jit
def _sparse_attn_fwd(q, k, v, idx, n_keys, o, qk_scale, stride_qq, stride_qh, stride_kn, stride_kh, stride_iq,
                     stride_oq, stride_oh, G: tl.constexpr, BH: tl.constexpr, HD: tl.constexpr,
                     BLOCK_D: tl.constexpr, BN: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    hr = tl.arange(0, BH)
    mh = hr < G
    hq = kvh * G + hr
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    qt = tl.load(q + pid * stride_qq + hq[:, None] * stride_qh + d[None, :], mask=mh[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BLOCK_D], tl.float32)
    nk = tl.load(n_keys + pid)
    on = tl.arange(0, BN)
    for s0 in range(0, nk, BN):
        ms = s0 + on < nk
        rows = tl.load(idx + pid * stride_iq + s0 + on, mask=ms, other=0).to(tl.int64)
        kt = tl.load(k + rows[None, :] * stride_kn + kvh * stride_kh + d[:, None], mask=dm[:, None] & ms[None, :],
                     other=0.0)
        vt = tl.load(v + rows[:, None] * stride_kn + kvh * stride_kh + d[None, :], mask=ms[:, None] & dm[None, :],
                     other=0.0)
        sc = tl.dot(qt, kt, input_precision=DOT_PREC) * qk_scale
        sc = tl.where(ms[None, :], sc, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, sc, vt, DOT_PREC)
    out = acc / l_i[:, None]
    tl.store(o + pid * stride_oq + hq[:, None] * stride_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=mh[:, None] & dm[None, :])


def kernel_config(head_dim: int, group: int) -> dict:
    block_d = dot_block(head_dim)
    return dict(BH=dot_block(group), BLOCK_D=block_d, BN=64 if block_d <= 128 else 32,
                num_warps=4)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, n_keys: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale * q . k[idx]) . v[idx] per query and head (Triton).

    Args:
        q: [Q, H, D].
        k, v: [N, Hkv, D].
        idx: [Q, S] rows of k / v; the first n_keys[q] are used.
        n_keys: [Q] (>= 1).
        scale: softmax scale.

    Returns:
        o [Q, H, D] in q's dtype.
    """
    nq, h, hd = q.shape
    hkv = k.shape[1]
    if h % hkv or k.shape[2] != hd or v.shape != k.shape or idx.shape[0] != nq or n_keys.shape != (nq,):
        raise ValueError(f"sparse_attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} idx "
                         f"{tuple(idx.shape)} n_keys {tuple(n_keys.shape)} do not match [Q, H, D], [N, Hkv, D], "
                         f"[Q, S], [Q] with H a multiple of Hkv")
    o = torch.empty_like(q)
    if nq == 0:
        return o
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    idx = idx.to(torch.int32).contiguous()
    cfg = kernel_config(hd, h // hkv)
    _sparse_attn_fwd[(nq, hkv)](q, k, v, idx, n_keys.to(torch.int32).contiguous(), o, scale * 1.4426950408889634,
                                q.stride(0), q.stride(1), k.stride(0), k.stride(1), idx.stride(0), o.stride(0),
                                o.stride(1), G=h // hkv, BH=cfg["BH"], HD=hd, BLOCK_D=cfg["BLOCK_D"], BN=cfg["BN"],
                                DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"])
    return o


def group_rows(sel: torch.Tensor, last: torch.Tensor, ratio: int):
    """Selected groups sel [Q, k] (ascending, -1 padded) of queries whose visible list is positions 0..last[q]
    -> (idx [Q, k * ratio + ratio - 1] positions, n_keys [Q]): the selected groups' tokens, then the tail
    ratio * n_complete .. last, packed at the front of each row."""
    q, kk = sel.shape
    dev = sel.device
    n = (last + 1) // ratio
    n_sel = (sel >= 0).sum(1)
    tail = last + 1 - ratio * n
    j = torch.arange(kk * ratio + ratio - 1, device=dev)
    in_sel = j[None, :] < (n_sel * ratio)[:, None]
    grp = sel.gather(1, (j // ratio).clamp(max=max(kk - 1, 0))[None, :].expand(q, -1)) if kk else \
        torch.zeros(q, j.numel(), dtype=torch.long, device=dev)
    from_sel = grp * ratio + (j % ratio)[None, :]
    from_tail = (ratio * n)[:, None] + j[None, :] - (n_sel * ratio)[:, None]
    idx = torch.where(in_sel, from_sel, from_tail)
    n_keys = n_sel * ratio + tail
    idx = torch.where(j[None, :] < n_keys[:, None], idx, torch.zeros_like(idx))
    return idx, n_keys


def pack_rows(rows: torch.Tensor, ok: torch.Tensor):
    """Key rows [Q, S] with a validity mask ok [Q, S] (e.g. the tree path's selected groups then tail, -1 gaps)
    -> (idx [Q, S] with each row's valid entries first, in their order, n_keys [Q]) for ``sparse_attention``."""
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices
    return torch.where(ok, rows, torch.zeros_like(rows)).gather(1, order), ok.sum(1)


def qsa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, pooled: torch.Tensor,
                last: torch.Tensor, topk: int, ratio: int, scale: float, chunk: int = 1024):
    """Causal QSA in query chunks: indexer scores -> exact top-k -> sparse attention, no [T, T] tensor.

    Args:
        q: [Tq, H, D] queries.
        k, v: [N, Hkv, D] keys 0..N-1.
        q_idx: [Tq, Hi, di] index queries.
        pooled: [G, di] pooled keys of the complete groups (G >= the most complete groups a query sees).
        last: [Tq] each query's position (it sees 0..last).
        topk: groups selected per query.
        ratio: tokens per group.
        scale: softmax scale.
        chunk: queries per chunk.

    Returns:
        (o [Tq, H, D], sel [Tq, topk] selected groups, as ``select_groups``).
    """
    tq = q.shape[0]
    o = torch.empty_like(q)
    sels = torch.empty(tq, topk, dtype=torch.long, device=q.device)
    n_all = (last + 1) // ratio
    if tq and int(n_all.max()) > pooled.shape[0]:
        raise ValueError(f"qsa_prefill: queries see {int(n_all.max())} complete groups but {pooled.shape[0]} pooled "
                         f"keys were given")
    for s0 in range(0, tq, chunk):
        sl = slice(s0, min(tq, s0 + chunk))
        n = n_all[sl]
        g_hi = int(n.max()) if n.numel() else 0
        scores = index_scores(q_idx[sl], pooled[:g_hi], n)  # [c, g_hi] fp32
        sel = topk_groups(scores, n, topk)
        idx, n_keys = group_rows(sel, last[sl], ratio)
        o[sl] = sparse_attention(q[sl], k, v, idx, n_keys, scale)
        sels[sl] = sel
    return o, sels
