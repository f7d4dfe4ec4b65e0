"""The block plan of tree attention (plain torch): which key blocks each query block can see; it drives both the
Triton kernel and the blocked torch path. Design: kernels/DESIGN.md ("Tree-attention block plan").
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from specopd_kernels.tree_attention.naive import attend
from specopd_kernels.trees import check_tree


@dataclass
class TreeAttentionPlan:
    """All tensors long on the CPU (``to`` moves them as int32 for a kernel). S = sorted node position."""

    block_m: int  # nodes per query block
    block_n: int  # keys per key block
    chain: bool  # every node's ancestors are the depth nodes just before it (sorted order)
    order: torch.Tensor  # [M] node id at sorted position s
    anchor: torch.Tensor  # [M] anchor of the node at s
    depth: torch.Tensor  # [M] depth of the node at s (0 for a child of the trunk)
    trunk_offsets: torch.Tensor  # [n + 1] row of trunk i's first key in the packed trunk K/V
    q_start: torch.Tensor  # [NQB] first sorted position of each query block
    q_end: torch.Tensor  # [NQB] one past its last
    q_trunk: torch.Tensor  # [NQB] its trunk
    t_full: torch.Tensor  # [NQB] trunk keys [0, t_full) are visible to every row
    t_len: torch.Tensor  # [NQB] trunk keys [0, t_len) are scanned (largest anchor + 1)
    nb_ptr: torch.Tensor  # [NQB + 1] CSR into nb_idx
    nb_idx: torch.Tensor  # [E] node key blocks to visit (sorted node space)
    nb_bits: Optional[torch.Tensor]  # [E, block_m] int64 visibility bits (general trees), None for chains
    trunk_total: int = 0  # keys of all trunks together (rows of the packed trunk K/V)
    trunk_max: int = 0  # keys of the longest trunk

    @property
    def num_nodes(self) -> int:
        return int(self.order.numel())

    @property
    def num_qblocks(self) -> int:
        return int(self.q_start.numel())

    def to(self, device, dtype=torch.int32) -> "TreeAttentionPlan":
        """Index tensors as ``dtype`` on ``device`` (bits stay int64)."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                out[f.name] = t.to(device=device, dtype=torch.int64 if f.name == "nb_bits" else dtype)
        return replace(self, **out)

    def stats(self) -> dict:
        """Blocks visited against the dense grid (query blocks x key blocks over [t_cut + M_i] per trunk, what
        a dense masked kernel computes), and the share of visited score entries that are visible."""
        bn = self.block_n
        trunk_blocks = (self.t_len + bn - 1) // bn
        node_blocks = self.nb_ptr[1:] - self.nb_ptr[:-1]
        visited = int((trunk_blocks + node_blocks).sum())
        dense = 0
        for i in range(self.trunk_offsets.numel() - 1):
            sel = self.q_trunk == i
            if not bool(sel.any()):
                continue
            m_i = int((self.q_end[sel] - self.q_start[sel]).sum())
            t_cut = int(self.t_len[sel].max())
            dense += int(sel.sum()) * -(-(t_cut + m_i) // bn)
        visible = int((self.anchor + 1 + self.depth + 1).sum())  # trunk keys 0..a plus the path incl. itself
        return {"visited_blocks": visited, "dense_blocks": dense, "fraction": visited / max(dense, 1),
                "visible_entries": visible, "visited_entries": visited * self.block_m * bn,
                "density": visible / max(1, visited * self.block_m * bn)}


def _depth(parent: torch.Tensor) -> torch.Tensor:
    """Depth below the anchor by pointer jumping (parents are earlier nodes)."""
    d = torch.zeros_like(parent)
    p = parent.clone()
    while bool((p >= 0).any()):
        up = p >= 0
        d += up.long()
        p = torch.where(up, parent[p.clamp(min=0)], p)
    return d


def node_order(anchor: torch.Tensor, trunk_index: torch.Tensor) -> torch.Tensor:
    """[M] node ids sorted by (trunk, anchor); stable, so parents stay before their children (same key, earlier
    index). The block plan's and the CPU kernel's (``specopd_kernels.tree_attention.cpu``) query order."""
    key = trunk_index * (int(anchor.max()) + 2) + anchor
    return torch.sort(key, stable=True).indices


def build_tree_plan(anchor: torch.Tensor, parent: torch.Tensor, trunk_index: torch.Tensor,
                    trunk_lens: Sequence[int], block_m: int, block_n: int) -> TreeAttentionPlan:
    """The block plan of one tree (built once per tree and block size; the same for every layer).

    Args:
        anchor, parent, trunk_index: [M] ``ProposalTree`` fields (parent -1 for a child of the trunk; parents
            precede children); checked by ``specopd_kernels.trees.check_tree``.
        trunk_lens: keys held by each trunk's cache.
        block_m: nodes per query block.
        block_n: keys per key block (<= 64: int64 bitmasks).

    Returns:
        TreeAttentionPlan.
    """
    anchor, parent, trunk_index = (torch.as_tensor(x, dtype=torch.long).cpu().reshape(-1)
                                   for x in (anchor, parent, trunk_index))
    m = anchor.numel()
    lens = torch.as_tensor(list(trunk_lens), dtype=torch.long)
    if m == 0:
        raise ValueError("build_tree_plan: empty tree")
    if block_n > 64 or block_m < 1:
        raise ValueError(f"build_tree_plan: block_n must be <= 64 (int64 bitmasks), block_m >= 1; got {block_n}, "
                         f"{block_m}")
    check_tree(anchor, parent, trunk_index, lens)
    has_p = parent >= 0
    pp = parent.clamp(min=0)
    order = node_order(anchor, trunk_index)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(m)
    par_s = torch.where(has_p[order], rank[pp[order]], torch.full_like(order, -1))  # parent in sorted space
    depth = _depth(par_s)
    s_idx = torch.arange(m)
    chain = bool(((par_s == s_idx - 1) | (par_s < 0)).all())
    anc_s, tix_s = anchor[order], trunk_index[order]
    # query blocks: per trunk, runs of block_m sorted nodes
    counts = torch.bincount(tix_s, minlength=lens.numel())
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    q_start, q_end, q_trunk = [], [], []
    for i in range(lens.numel()):
        lo, hi = int(starts[i]), int(starts[i + 1])
        b = torch.arange(lo, hi, block_m)
        q_start.append(b)
        q_end.append((b + block_m).clamp(max=hi))
        q_trunk.append(torch.full_like(b, i))
    q_start, q_end, q_trunk = torch.cat(q_start), torch.cat(q_end), torch.cat(q_trunk)
    t_full = anc_s[q_start] + 1  # sorted by anchor within a trunk: first row has the smallest anchor
    t_len = anc_s[q_end - 1] + 1
    nqb = q_start.numel()
    qb_of = torch.repeat_interleave(torch.arange(nqb), q_end - q_start)  # [M] query block of sorted node s
    if chain:
        first = (s_idx - depth) // block_n  # block of the root of each row's branch
        lo = torch.full((nqb,), m, dtype=torch.long).scatter_reduce(0, qb_of, first, "amin")
        hi = (q_end - 1) // block_n
        cnt = hi - lo + 1
        nb_ptr = torch.cat([torch.zeros(1, dtype=torch.long), cnt.cumsum(0)])
        nb_idx = torch.repeat_interleave(lo, cnt) + (torch.arange(int(cnt.sum())) -
                                                     torch.repeat_interleave(nb_ptr[:-1], cnt))
        bits = None
    else:
        # ancestor table in sorted space: anc[s, j] = ancestor of s at depth j (s itself at its depth)
        dmax = int(depth.max())
        anc = torch.full((m, dmax + 1), -1, dtype=torch.long)
        for d in range(dmax + 1):
            lvl = torch.nonzero(depth == d).flatten()
            if d > 0:
                anc[lvl] = anc[par_s[lvl]]
            anc[lvl, d] = lvl
        ptr, idx, bit_rows = [0], [], []
        for b in range(nqb):
            s0, s1 = int(q_start[b]), int(q_end[b])
            a = anc[s0:s1]  # [rows, dmax + 1]
            ok = a >= 0
            blocks = torch.unique(a[ok] // block_n)  # ascending
            row_bits = torch.zeros(blocks.numel(), block_m, dtype=torch.long)
            r, _ = torch.nonzero(ok, as_tuple=True)
            kb = torch.searchsorted(blocks, a[ok] // block_n)
            vals = torch.ones_like(kb) << (a[ok] % block_n)  # bit 63 wraps to the sign bit: fine for int64
            row_bits.index_put_((kb, r), vals, accumulate=True)  # distinct ancestors: sums never carry
            idx.append(blocks)
            bit_rows.append(row_bits)
            ptr.append(ptr[-1] + blocks.numel())
        nb_ptr = torch.tensor(ptr, dtype=torch.long)
        nb_idx = torch.cat(idx)
        bits = torch.cat(bit_rows)
    trunk_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return TreeAttentionPlan(block_m=block_m, block_n=block_n, chain=chain, order=order, anchor=anc_s, depth=depth,
                             trunk_offsets=trunk_offsets, q_start=q_start, q_end=q_end, q_trunk=q_trunk,
                             t_full=t_full, t_len=t_len, nb_ptr=nb_ptr, nb_idx=nb_idx, nb_bits=bits,
                             trunk_total=int(lens.sum()), trunk_max=int(lens.max()))


def block_visibility(plan: TreeAttentionPlan, b: int, e: int) -> torch.Tensor:
    """[rows of query block b, block_n] bool: which keys of the e-th node block listed for b each row sees."""
    s = torch.arange(int(plan.q_start[b]), int(plan.q_end[b]))
    kp = int(plan.nb_idx[e]) * plan.block_n + torch.arange(plan.block_n)
    if plan.chain:
        return (kp[None, :] >= (s - plan.depth[s])[:, None]) & (kp[None, :] <= s[:, None])
    w = plan.nb_bits[e, : s.numel()]
    return ((w[:, None] >> torch.arange(plan.block_n)[None, :]) & 1) != 0


@dataclass
class BlockGroup:
    """Query blocks of a plan gathered for one batched attention call (G blocks, padded to the longest)."""

    rows: torch.Tensor  # [G, R] node id of each query row, R <= block_m (a padding row repeats its block's first)
    real: torch.Tensor  # [G, R] bool, False on padding rows
    keys: torch.Tensor  # [G, S] row of each key in cat([trunk keys, node keys]) (padding: row 0, masked)
    mask: torch.Tensor  # [G, R, S] bool visibility


def _block_keys(plan: TreeAttentionPlan, b: int, lo_t: torch.Tensor, hi_t: torch.Tensor):
    """Query block b's keys as rows of cat([trunk keys, node keys]) and its [rows, keys] visibility."""
    s0, s1 = int(plan.q_start[b]), int(plan.q_end[b])
    tr = int(plan.q_trunk[b])
    off, t_len = int(plan.trunk_offsets[tr]), int(plan.t_len[b])
    keys = [torch.arange(off, off + t_len)]
    masks = [torch.arange(t_len)[None, :] <= plan.anchor[s0:s1, None]]
    for e in range(int(plan.nb_ptr[b]), int(plan.nb_ptr[b + 1])):
        kb = int(plan.nb_idx[e])
        k0, k1 = max(kb * plan.block_n, int(lo_t[tr])), min((kb + 1) * plan.block_n, int(hi_t[tr]))
        keys.append(plan.trunk_total + plan.order[k0:k1])
        masks.append(block_visibility(plan, b, e)[:, k0 - kb * plan.block_n: k1 - kb * plan.block_n])
    return torch.cat(keys), torch.cat(masks, dim=1)


def _trunk_node_ranges(plan: TreeAttentionPlan):
    """Sorted node range [lo_t, hi_t) of each trunk: node key blocks are clipped to it (the rest is never
    visible)."""
    n_tr = plan.trunk_offsets.numel() - 1
    lo_t = torch.full((n_tr,), plan.num_nodes, dtype=torch.long).scatter_reduce(0, plan.q_trunk, plan.q_start, "amin")
    hi_t = torch.zeros(n_tr, dtype=torch.long).scatter_reduce(0, plan.q_trunk, plan.q_end, "amax")
    return lo_t, hi_t


def block_groups(plan: TreeAttentionPlan, max_keys: int = 1 << 16) -> list:
    """The plan's query blocks as ``BlockGroup`` s for ``tree_attention_blocked`` on half-precision CPU inputs:
    built once per plan (the same for every layer), blocks sorted by key count and grouped while
    G x S <= ``max_keys``, so the gathered K / V stay bounded (G x S x Hkv x D, not blocks x trunk length) and
    padding stays small.

    Returns:
        list of BlockGroup.
    """
    lo_t, hi_t = _trunk_node_ranges(plan)
    blocks = [_block_keys(plan, b, lo_t, hi_t) for b in range(plan.num_qblocks)]
    order = sorted(range(len(blocks)), key=lambda b: blocks[b][0].numel())
    groups, cur = [], []
    for b in order + [None]:
        if b is not None and (not cur or (len(cur) + 1) * blocks[b][0].numel() <= max_keys):
            cur.append(b)
            continue
        s = max(blocks[c][0].numel() for c in cur)
        r = max(int(plan.q_end[c] - plan.q_start[c]) for c in cur)
        g = len(cur)
        rows = torch.empty(g, r, dtype=torch.long)
        real = torch.zeros(g, r, dtype=torch.bool)
        keys = torch.zeros(g, s, dtype=torch.long)
        mask = torch.zeros(g, r, s, dtype=torch.bool)
        for i, c in enumerate(cur):
            s0, s1 = int(plan.q_start[c]), int(plan.q_end[c])
            kc, mc = blocks[c]
            n = s1 - s0
            rows[i, :n], rows[i, n:] = plan.order[s0:s1], plan.order[s0]
            real[i, :n] = True
            keys[i, : kc.numel()] = kc
            mask[i, :n, : kc.numel()] = mc
            mask[i, n:, : kc.numel()] = mc[0]
        groups.append(BlockGroup(rows=rows, real=real, keys=keys, mask=mask))
        cur = [b] if b is not None else []
    return groups


def tree_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, trunk_k: torch.Tensor,
                           trunk_v: torch.Tensor, plan: TreeAttentionPlan, scale: float,
                           groups: Optional[list] = None) -> torch.Tensor:
    """Tree attention in torch over the plan's blocks only (the CPU path; exact in fp32): per query block its trunk
    prefix [0, t_len) and its listed node blocks. fp32: one exact ``attend`` per query block. bf16 / fp16 on the
    CPU: torch's fused attention, one call per ``BlockGroup`` (``groups``: ``block_groups(plan)``, built here when
    not given; pass it to reuse it across layers).

    Args:
        q: [M, H, D] node queries.
        k, v: [M, Hkv, D] node keys / values (node order).
        trunk_k, trunk_v: [sum T_i, Hkv, D] the trunks' keys packed at ``plan.trunk_offsets``.
        plan: ``build_tree_plan``'s.
        scale: softmax scale.
        groups: ``block_groups(plan)`` (half-precision CPU inputs only).

    Returns:
        o [M, H, D] fp32 (bf16 / fp16 inputs on the CPU: the fused kernel's output in fp32 storage).
    """
    o = torch.empty(plan.num_nodes, q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    keys, vals = torch.cat([trunk_k, k]), torch.cat([trunk_v, v])  # [sum T_i + M, Hkv, D]
    if q.dtype != torch.float32 and q.device.type == "cpu":
        return _attend_groups(o, q, keys, vals, groups or block_groups(plan), scale)
    order = plan.order.to(q.device)
    lo_t, hi_t = _trunk_node_ranges(plan)
    for b in range(plan.num_qblocks):
        rows = order[int(plan.q_start[b]): int(plan.q_end[b])]
        kb, mask = _block_keys(plan, b, lo_t, hi_t)
        kb = kb.to(q.device)
        o[rows] = attend(q[rows], keys[kb], vals[kb], mask.to(q.device), scale)
    return o


def _attend_groups(o, q, keys, vals, groups: list, scale: float) -> torch.Tensor:
    """Half precision on the CPU: one fused attention call per group of query blocks (fp32 accumulation inside;
    within bf16 noise of the reference, docs/exactness.md). keys / vals [sum T_i + M, Hkv, D]. Fills and returns
    o [M, H, D]."""
    for g in groups:
        qg = q[g.rows].transpose(1, 2)  # [G, H, R, D]
        kg, vg = keys[g.keys].transpose(1, 2), vals[g.keys].transpose(1, 2)  # [G, Hkv, S, D]
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask[:, None], scale=scale, enable_gqa=True)
        o[g.rows[g.real]] = og.transpose(1, 2)[g.real].float()
    return o
