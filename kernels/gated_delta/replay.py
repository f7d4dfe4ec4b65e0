"""Fused GDN tree replay (Triton): restore each anchor's state from the nearest fp32 checkpoint, then run the
branch nodes, in one launch. Segments and stops: kernels/DESIGN.md ("GDN kernels"). CUDA, or the CPU under
``TRITON_INTERPRET=1`` (set before importing this module; tests only).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch
import triton
import triton.language as tl

from specopd_kernels.trees import check_tree


@dataclass
class ReplayPlan:
    """Index tensors (long, CPU; ``to`` moves them as int32). Layout of ``states0``: for each trunk i in order,
    its checkpoints then its final state (``stack_states``); replay inputs are the trunk rows ``replay_rows``."""

    every: int
    seg_state: torch.Tensor  # [S] row of states0 each segment starts from
    seg_tok: torch.Tensor  # [S] first row of its replay tokens in the replay inputs
    seg_stop_ptr: torch.Tensor  # [S + 1] CSR into stops
    stop_len: torch.Tensor  # [n_stops] replay tokens consumed before the stop (non-decreasing within a segment)
    stop_node_ptr: torch.Tensor  # [n_stops + 1] CSR into the node order
    node_id: torch.Tensor  # [M] node run at each slot of the order
    node_src: torch.Tensor  # [M] where its input state comes from: -1 the previous node, -2 the anchor, >= 0 scratch
    node_save: torch.Tensor  # [M] scratch row it writes its state to, or -1
    num_scratch: int
    replay_trunk: torch.Tensor  # [R] trunk of each replay row
    replay_pos: torch.Tensor  # [R] its position in that trunk
    replay_rows: torch.Tensor  # [R] its row in the trunks packed one after another (offset of trunk + position)

    @property
    def num_segments(self) -> int:
        return int(self.seg_state.numel())

    def to(self, device, dtype=torch.int32) -> "ReplayPlan":
        out = {f.name: getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **out)


def stack_states(checkpoints: Sequence[torch.Tensor], finals: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per trunk: checkpoints [n_i, H, K, V] and final [H, K, V] -> states0 [sum (n_i + 1), H, K, V] fp32."""
    return torch.cat([torch.cat([c.float(), f.float()[None]]) for c, f in zip(checkpoints, finals)])


def _preorder(nodes: list, parent: torch.Tensor) -> list:
    """Depth-first preorder of ``nodes`` (one stop's nodes, parents before children; roots in index order)."""
    inside = set(nodes)
    kids = {u: [] for u in nodes}
    roots = []
    for u in nodes:
        p = int(parent[u])
        (kids[p] if p in inside else roots).append(u)
    out, stack = [], list(reversed(roots))
    while stack:
        u = stack.pop()
        out.append(u)
        stack.extend(reversed(kids[u]))
    return out


def build_replay_plan(anchor: torch.Tensor, parent: torch.Tensor, trunk_index: torch.Tensor,
                      trunk_lens: Sequence[int], every: int, share_replay: bool = True) -> ReplayPlan:
    """The segments and stops of the fused replay (plain torch, built once per tree).

    Args:
        anchor, parent, trunk_index: [M] ``ProposalTree`` fields (parents precede children); checked by
            ``specopd_kernels.trees.check_tree``.
        trunk_lens: tokens in each trunk's cache.
        every: C, the checkpoint interval of the caches.
        share_replay: one segment per (trunk, checkpoint) (anchors in one interval share a replay); False: one per
            (trunk, anchor).

    Returns:
        ReplayPlan.
    """
    anchor, parent, trunk_index = (torch.as_tensor(x, dtype=torch.long).cpu().reshape(-1)
                                   for x in (anchor, parent, trunk_index))
    m = anchor.numel()
    lens = torch.as_tensor(list(trunk_lens), dtype=torch.long)
    if m == 0:
        raise ValueError("build_replay_plan: empty tree")
    if every < 1:
        raise ValueError(f"build_replay_plan: checkpoint interval must be >= 1; got {every}")
    check_tree(anchor, parent, trunk_index, lens)
    has_p = parent >= 0
    n_ck = (lens + every - 1) // every  # checkpoints per trunk
    row0 = torch.cat([torch.zeros(1, dtype=torch.long), (n_ck + 1).cumsum(0)])[:-1]  # states0 row of checkpoint 0
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    n = anchor + 1  # trunk tokens before the branch
    at_end = n == lens[trunk_index]
    ck = torch.where(at_end, n_ck[trunk_index], n // every)  # index n_ck = the final state
    r = torch.where(at_end, torch.zeros_like(n), n - ck * every)  # replay length < C
    state_row = row0[trunk_index] + ck
    seg_key = state_row * (int(anchor.max()) + 1) + anchor if not share_replay else state_row
    # stops: distinct (trunk, anchor), ordered by segment then anchor
    stop_key = state_row * (int(anchor.max()) + 1) + anchor
    stops, node_stop = torch.unique(stop_key, return_inverse=True)  # ascending: segment-major, anchor-minor
    first = torch.full((stops.numel(),), m, dtype=torch.long).scatter_reduce(0, node_stop, torch.arange(m), "amin")
    stop_seg_key = seg_key[first]
    segs, stop_seg = torch.unique_consecutive(stop_seg_key, return_inverse=True)
    n_seg = segs.numel()
    seg_first = torch.full((n_seg,), stops.numel(), dtype=torch.long).scatter_reduce(
        0, stop_seg, torch.arange(stops.numel()), "amin")
    seg_stop_ptr = torch.cat([seg_first, torch.tensor([stops.numel()])])
    stop_len = r[first]
    seg_state = state_row[first[seg_first]]
    # replay rows: once per distinct starting state, as long as its longest replay
    rows_len = torch.zeros(int(row0[-1] + n_ck[-1] + 1), dtype=torch.long).scatter_reduce(0, state_row, r, "amax")
    used = torch.nonzero(rows_len > 0).flatten()
    tok0 = torch.zeros_like(rows_len)
    tok0[used] = torch.cat([torch.zeros(1, dtype=torch.long), rows_len[used].cumsum(0)[:-1]])
    seg_tok = tok0[seg_state]
    trunk_of_row = torch.repeat_interleave(torch.arange(lens.numel()), n_ck + 1)
    rt = torch.repeat_interleave(trunk_of_row[used], rows_len[used])
    start = (used - row0[trunk_of_row[used]]) * every
    step = torch.arange(int(rows_len.sum())) - torch.repeat_interleave(tok0[used], rows_len[used])
    rp = torch.repeat_interleave(start, rows_len[used]) + step
    # node order: per stop, depth-first preorder (chains: index order)
    chain = bool(((parent == torch.arange(m) - 1) | ~has_p).all())
    by_stop = torch.sort(node_stop, stable=True).indices
    counts = torch.bincount(node_stop, minlength=stops.numel())
    if chain:
        order = by_stop
    else:
        order, lo = [], 0
        for c in counts.tolist():
            order.extend(_preorder(by_stop[lo: lo + c].tolist(), parent))
            lo += c
        order = torch.tensor(order, dtype=torch.long)
    stop_node_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    prev = torch.cat([torch.full((1,), -1, dtype=torch.long), order[:-1]])
    par = parent[order]
    first_in_stop = torch.zeros(m, dtype=torch.bool)
    first_in_stop[stop_node_ptr[:-1]] = True
    follows = (par == prev) & ~first_in_stop
    needs = has_p[order] & ~follows  # reload the parent's state from scratch
    savers = torch.unique(par[needs])
    slot = torch.full((m,), -1, dtype=torch.long)
    slot[savers] = torch.arange(savers.numel())
    node_src = torch.where(~has_p[order], torch.full_like(par, -2), torch.where(follows, torch.full_like(par, -1),
                                                                                 slot[par.clamp(min=0)]))
    node_save = slot[order]
    return ReplayPlan(every=every, seg_state=seg_state, seg_tok=seg_tok, seg_stop_ptr=seg_stop_ptr, stop_len=stop_len,
                      stop_node_ptr=stop_node_ptr, node_id=order, node_src=node_src, node_save=node_save,
                      num_scratch=int(savers.numel()), replay_trunk=rt, replay_pos=rp, replay_rows=offs[rt] + rp)


@triton.jit
def _replay_fwd(states0, scratch, states_out, o, rk, rv, rg, rbeta, nq, nk, nv, ng, nbeta,
                seg_state, seg_tok, seg_stop_ptr, stop_len, stop_node_ptr, node_id, node_src, node_save,
                H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, STORE_STATES: tl.constexpr):
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hq = i_h // (H // HQ)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]
    zero = tl.zeros([BK, BV], dtype=tl.int32)  # broadcasts a per-node scalar test to the tile (mask operand)
    row = tl.load(seg_state + i_s).to(tl.int64)
    b_h = tl.load(states0 + (row * H + i_h) * K * V + off_h, mask=m_h, other=0.0)
    tok0 = tl.load(seg_tok + i_s).to(tl.int64)
    done = 0
    for e in range(tl.load(seg_stop_ptr + i_s), tl.load(seg_stop_ptr + i_s + 1)):
        n_rep = tl.load(stop_len + e)
        for j in range(done, n_rep):  # trunk tokens between the previous stop and this anchor
            t = tok0 + j
            b_k = tl.load(rk + (t * HQ + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(rv + (t * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(rg + t * H + i_h).to(tl.float32)
            b_beta = tl.load(rbeta + t * H + i_h).to(tl.float32)
            b_h = b_h * tl.exp(b_g)  # one gated delta step, naive.gated_delta_step's order (written out twice:
            b_d = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta  # nested jit calls are slow to interpret)
            b_h = b_h + b_k[:, None] * b_d[None, :]
        done = n_rep
        b_a = b_h  # the anchor state
        for u in range(tl.load(stop_node_ptr + e), tl.load(stop_node_ptr + e + 1)):
            nid = tl.load(node_id + u).to(tl.int64)
            src = tl.load(node_src + u)
            b_h = tl.where(src == -2, b_a, b_h)
            b_l = tl.load(scratch + (tl.maximum(src, 0).to(tl.int64) * H + i_h) * K * V + off_h,
                          mask=m_h & ((zero + src) >= 0), other=0.0)
            b_h = tl.where(src >= 0, b_l, b_h)
            b_q = tl.load(nq + (nid * HQ + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(nk + (nid * HQ + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(nv + (nid * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(ng + nid * H + i_h).to(tl.float32)
            b_beta = tl.load(nbeta + nid * H + i_h).to(tl.float32)
            b_h = b_h * tl.exp(b_g)
            b_d = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta
            b_h = b_h + b_k[:, None] * b_d[None, :]
            b_o = tl.sum(b_h * b_q[:, None], axis=0)
            tl.store(o + (nid * H + i_h) * V + o_v, b_o, mask=m_v)
            sv = tl.load(node_save + u)
            tl.store(scratch + (tl.maximum(sv, 0).to(tl.int64) * H + i_h) * K * V + off_h, b_h,
                     mask=m_h & ((zero + sv) >= 0))
            if STORE_STATES:
                tl.store(states_out + (nid * H + i_h) * K * V + off_h, b_h, mask=m_h)
        b_h = b_a  # later anchors of this segment continue the replay from here


def kernel_config(k_dim: int, v_dim: int) -> dict:
    """Block sizes (checked for spills by ``benchmarks/aot_check.py``): the [K, BV] fp32 state slice and the
    anchor copy stay in registers."""
    bk = triton.next_power_of_2(k_dim)
    return dict(BK=bk, BV=min(triton.next_power_of_2(v_dim), max(16, 8192 // bk)), num_warps=8)


def gdn_tree_replay(states0: torch.Tensor, replay_k: torch.Tensor, replay_v: torch.Tensor, replay_g: torch.Tensor,
                    replay_beta: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, plan: ReplayPlan, store_states: bool = False):
    """Score tree nodes through GDN from the trunks' checkpoints in one Triton launch.

    Args:
        states0: [S0, H, K, V] fp32, ``stack_states`` of every trunk's checkpoints + final state.
        replay_k: [R, HQ, K] the trunk rows ``plan.replay_rows`` (prepared as in the prefill).
        replay_v: [R, H, V].
        replay_g, replay_beta: [R, H].
        q, k: [M, HQ, K] node inputs (prepared).
        v: [M, H, V].
        g, beta: [M, H].
        plan: ``build_replay_plan``'s; pass ``plan.to(device)`` once per tree to avoid a copy per layer.
        store_states: also write every node's state (decoding's commit needs it).

    Returns:
        (o [M, H, V] fp32, states [M, H, K, V] fp32 or None).
    """
    m, hq, kd = k.shape
    h, vd = v.shape[1], v.shape[2]
    r = int(plan.replay_rows.numel())
    if q.shape != k.shape or v.shape[0] != m or h % hq or g.shape != (m, h) or beta.shape != (m, h) \
            or states0.shape[1:] != (h, kd, vd) or replay_k.shape != (r, hq, kd) or replay_v.shape != (r, h, vd) \
            or replay_g.shape != (r, h) or replay_beta.shape != (r, h):
        raise ValueError(f"gdn_tree_replay: shapes states0 {tuple(states0.shape)} replay_k {tuple(replay_k.shape)} "
                         f"replay_v {tuple(replay_v.shape)} replay_g {tuple(replay_g.shape)} q {tuple(q.shape)} "
                         f"k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)} do not "
                         f"match [S0, H, K, V], [R={r}, HQ, K], [R, H, V], [R, H], [M, HQ, K], [M, H, V], [M, H]")
    if int(plan.node_id.numel()) != m:
        raise ValueError(f"gdn_tree_replay: the plan covers {int(plan.node_id.numel())} nodes but {m} were given")
    dev = v.device
    p = plan if plan.node_id.device == dev and plan.node_id.dtype == torch.int32 else plan.to(dev)
    f32 = dict(dtype=torch.float32, device=dev)
    o = torch.empty(m, h, vd, **f32)
    states = torch.empty(m, h, kd, vd, **f32) if store_states else o
    scratch = torch.empty(max(plan.num_scratch, 1), h, kd, vd, **f32)
    cfg = kernel_config(kd, vd)
    args = [x.contiguous() for x in (replay_k, replay_v, replay_g, replay_beta, q, k, v, g, beta)]
    grid = (plan.num_segments, h, triton.cdiv(vd, cfg["BV"]))
    _replay_fwd[grid](states0.float().contiguous(), scratch, states, o, *args, p.seg_state, p.seg_tok,
                      p.seg_stop_ptr, p.stop_len, p.stop_node_ptr, p.node_id, p.node_src, p.node_save,
                      H=h, HQ=hq, K=kd, V=vd, BK=cfg["BK"], BV=cfg["BV"], STORE_STATES=store_states,
                      num_warps=cfg["num_warps"])
    return o, (states if store_states else None)
