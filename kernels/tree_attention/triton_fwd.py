"""Triton forward of tree attention over a block plan (the target is frozen: no backward). Runs on CUDA, or on
the CPU under ``TRITON_INTERPRET=1`` (set before importing; tests only).
Tiling and numerics: kernels/DESIGN.md ("Tree-attention kernel").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specopd_kernels.dot import dot_block, dot_precision
from specopd_kernels.softmax import online_softmax_update
from specopd_kernels.tree_attention.plan import TreeAttentionPlan


@triton.jit
def _tree_attn_fwd(Q, K, V, TK, TV, Out, order, anchor, depth, bits, q_start, q_end, q_toff, t_full, t_len,
                   nb_ptr, nb_idx, M, qk_scale,
                   stride_qm, stride_qh, stride_km, stride_kh, stride_tm, stride_th, stride_om, stride_oh,
                   G: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
                   BMN: tl.constexpr, BN: tl.constexpr, CHAIN: tl.constexpr, DOT_PREC: tl.constexpr):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    s0 = tl.load(q_start + qb)
    s1 = tl.load(q_end + qb)
    toff = tl.load(q_toff + qb)
    tfull = tl.load(t_full + qb)
    tlen = tl.load(t_len + qb)
    # scalar int64 bases, int32 tile offsets (M * H * D and T * Hkv * D < 2^31: checked by the launcher)
    TKh = TK + toff.to(tl.int64) * stride_tm + kvh * stride_th
    TVh = TV + toff.to(tl.int64) * stride_tm + kvh * stride_th
    Kh = K + kvh * stride_kh
    Vh = V + kvh * stride_kh
    r = tl.arange(0, BM)
    i = r // G  # node slot of row r
    hq = kvh * G + r % G  # its query head
    s = s0 + i  # sorted position
    valid = (i < BMN) & (s < s1)
    node = tl.load(order + s, mask=valid, other=0)
    anc = tl.load(anchor + s, mask=valid, other=0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    q = tl.load(Q + node[:, None] * stride_qm + hq[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    n = tl.arange(0, BN)
    # trunk keys every row sees: no mask
    for start in range(0, (tfull // BN) * BN, BN):
        j = start + n
        kt = tl.load(TKh + j[None, :] * stride_tm + d[:, None], mask=dm[:, None], other=0.0)
        vt = tl.load(TVh + j[:, None] * stride_tm + d[None, :], mask=dm[None, :], other=0.0)
        sc = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, sc, vt, DOT_PREC)
    # trunk keys up to the block's largest anchor: row sees key j <= its anchor
    for start in range((tfull // BN) * BN, tlen, BN):
        j = start + n
        kin = j < tlen
        kt = tl.load(TKh + j[None, :] * stride_tm + d[:, None], mask=dm[:, None] & kin[None, :], other=0.0)
        vt = tl.load(TVh + j[:, None] * stride_tm + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
        sc = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        sc = tl.where(j[None, :] <= anc[:, None], sc, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, sc, vt, DOT_PREC)
    # tree keys: the node blocks holding an ancestor (or the node itself) of some row
    dep = tl.load(depth + s, mask=valid, other=0)
    e0 = tl.load(nb_ptr + qb)
    e1 = tl.load(nb_ptr + qb + 1)
    for e in range(e0, e1):
        kb = tl.load(nb_idx + e)
        kpos = kb * BN + n
        kin = kpos < M
        knode = tl.load(order + kpos, mask=kin, other=0)
        kt = tl.load(Kh + knode[None, :] * stride_km + d[:, None], mask=dm[:, None] & kin[None, :], other=0.0)
        vt = tl.load(Vh + knode[:, None] * stride_km + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)
        sc = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        if CHAIN:
            vis = (kpos[None, :] >= (s - dep)[:, None]) & (kpos[None, :] <= s[:, None])
        else:
            w = tl.load(bits + e * BMN + i, mask=valid, other=0)
            vis = ((w[:, None] >> n[None, :].to(tl.int64)) & 1) != 0
        sc = tl.where(vis & kin[None, :], sc, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, sc, vt, DOT_PREC)
    o = acc / l_i[:, None]
    tl.store(Out + node[:, None] * stride_om + hq[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
             mask=valid[:, None] & dm[None, :])


def kernel_config(head_dim: int, group: int) -> dict:
    """Block sizes for head_dim and G = H / Hkv (rows BM = nodes per block x G, a power of two).
    Checked for registers, shared memory and spills by ``benchmarks/aot_check.py`` on sm_90 / sm_100."""
    block_d = dot_block(head_dim)
    if block_d <= 128:
        bm, bn, warps = 128, 64, 8
    else:  # head_dim 256: q [64, 256] and acc stay in registers; a narrow key block avoids spills on sm_90
        bm, bn, warps = 64, 16, 8
    bm = max(bm, triton.next_power_of_2(group))  # at least one node per block
    return dict(BM=bm, BN=bn, BMN=bm // group, BLOCK_D=block_d, num_warps=warps, num_stages=2)


def plan_blocks(head_dim: int, num_heads: int, num_kv_heads: int) -> dict:
    """The (block_m nodes, block_n keys) the kernel needs its plan built with (``build_tree_plan(..., **this)``)."""
    cfg = kernel_config(head_dim, num_heads // num_kv_heads)
    return dict(block_m=cfg["BMN"], block_n=cfg["BN"])


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, trunk_k: torch.Tensor, trunk_v: torch.Tensor,
                   plan: TreeAttentionPlan, scale: float, out_dtype=None) -> torch.Tensor:
    """The Triton forward over the same plan as ``tree_attention_blocked``.

    Args:
        q: [M, H, D] node queries.
        k, v: [M, Hkv, D] node keys / values (node order).
        trunk_k, trunk_v: [sum T_i, Hkv, D] the trunks' keys packed at ``plan.trunk_offsets``.
        plan: from ``build_tree_plan(..., **plan_blocks(D, H, Hkv))``; pass ``plan.to(device)`` (kept with the tree)
            to avoid a host-to-device copy per call.
        scale: softmax scale.
        out_dtype: the output dtype (default: q's).

    Returns:
        o [M, H, D].
    """
    m, h, hd = q.shape
    hkv = k.shape[1]
    if h % hkv or k.shape != (m, hkv, hd) or v.shape != k.shape or trunk_k.shape[1:] != (hkv, hd) \
            or trunk_v.shape != trunk_k.shape:
        raise ValueError(f"tree_attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} trunk_k "
                         f"{tuple(trunk_k.shape)} trunk_v {tuple(trunk_v.shape)} do not match [M, H, D] / "
                         f"[M, Hkv, D] / [T, Hkv, D] with H a multiple of Hkv")
    cfg = kernel_config(hd, h // hkv)
    if (plan.block_m, plan.block_n) != (cfg["BMN"], cfg["BN"]) or plan.num_nodes != m:
        raise ValueError(f"tree_attention: the plan was built for block_m={plan.block_m}, block_n={plan.block_n}, "
                         f"{plan.num_nodes} nodes; this call needs {cfg['BMN']}, {cfg['BN']}, {m}: build it with "
                         f"build_tree_plan(..., **plan_blocks(head_dim, num_heads, num_kv_heads))")
    if max(m * h * hd, plan.trunk_max * hkv * hd) >= 2 ** 31:
        raise ValueError("tree_attention: a tensor is too large for the kernel's int32 offsets (M * H * D and "
                         "T_i * Hkv * D must stay below 2^31); split the tree")
    if plan.trunk_total > trunk_k.shape[0]:
        raise ValueError(f"tree_attention: the plan's trunks hold {plan.trunk_total} keys but trunk_k "
                         f"has {trunk_k.shape[0]} rows")
    q, k, v, trunk_k, trunk_v = (x.contiguous() for x in (q, k, v, trunk_k, trunk_v))
    p = plan if plan.order.device == q.device and plan.order.dtype == torch.int32 else plan.to(q.device)
    o = torch.empty(m, h, hd, dtype=out_dtype or q.dtype, device=q.device)
    bits = p.nb_bits if p.nb_bits is not None else p.order  # dummy pointer for chains
    q_toff = p.trunk_offsets[p.q_trunk.long()]
    grid = (plan.num_qblocks, hkv)
    _tree_attn_fwd[grid](q, k, v, trunk_k, trunk_v, o, p.order, p.anchor, p.depth, bits, p.q_start, p.q_end,
                         q_toff, p.t_full, p.t_len, p.nb_ptr, p.nb_idx, m, scale * 1.4426950408889634,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), trunk_k.stride(0), trunk_k.stride(1),
                         o.stride(0), o.stride(1),
                         G=h // hkv, HD=hd, BLOCK_D=cfg["BLOCK_D"], BM=cfg["BM"], BMN=cfg["BMN"], BN=cfg["BN"],
                         CHAIN=plan.chain, DOT_PREC=dot_precision(q.dtype),
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o
