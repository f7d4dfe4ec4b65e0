"""Tree attention, dense and masked (the reference the block plan and the Triton kernel are tested against).

Queries are the M nodes of a proposal tree packed over several trunks. Node u (trunk i, anchor a) attends to
trunk i's keys at positions 0..a plus its own ancestors and itself; keys are trunk first, then tree nodes.
Everything is computed in fp32 (scores * scale, softmax, weighted sum), one trunk at a time.
"""
from __future__ import annotations

from typing import Sequence

import torch


def ancestor_or_self(parent: torch.Tensor) -> torch.Tensor:
    """parent [M] (-1 for a root; parents precede children) -> [M, M] bool, ``mask[u, v]``: v is u or an
    ancestor of u. Dense: for references and tests only."""
    m = parent.numel()
    anc = torch.eye(m, dtype=torch.bool)
    for u in range(m):
        p = int(parent[u])
        if p >= 0:
            if p >= u:
                raise ValueError(f"node {u}: parent {p} is not an earlier node")
            anc[u] |= anc[p]
    return anc


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked attention in fp32 with GQA head groups (no repeated K/V in memory beyond a view).

    Args:
        q: [Q, H, D].
        k, v: [S, Hkv, D].
        mask: [Q, S] bool (every row needs one True).
        scale: softmax scale.

    Returns:
        [Q, H, D] fp32.
    """
    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv
    qf = q.float().view(q.shape[0], hkv, g, q.shape[-1])  # [Q, Hkv, G, D]
    s = torch.einsum("qhgd,shd->hgqs", qf, k.float()) * scale  # [Hkv, G, Q, S]
    s = torch.where(mask, s, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("hgqs,shd->qhgd", p, v.float())
    return o.reshape(q.shape[0], h, v.shape[-1])


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, trunk_k: Sequence[torch.Tensor],
                             trunk_v: Sequence[torch.Tensor], anchor: torch.Tensor, parent: torch.Tensor,
                             trunk_index: torch.Tensor, scale: float) -> torch.Tensor:
    """Node u attends to its trunk's keys 0..anchor_u, its ancestors and itself (dense, one node at a time).

    Args:
        q: [M, H, D] node queries.
        k, v: [M, Hkv, D] node keys / values.
        trunk_k, trunk_v: one [T_i, Hkv, D] per trunk.
        anchor, parent, trunk_index: [M] tree structure (parents precede children).
        scale: softmax scale.

    Returns:
        o [M, H, D] fp32.
    """
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    anc_all = ancestor_or_self(parent.cpu())
    for i in range(len(trunk_k)):
        nodes = torch.nonzero(trunk_index.cpu() == i).flatten()
        if nodes.numel() == 0:
            continue
        a = anchor.cpu()[nodes]
        t_cut = int(a.max()) + 1
        trunk_vis = torch.arange(t_cut)[None, :] <= a[:, None]
        mask = torch.cat([trunk_vis, anc_all[nodes][:, nodes]], dim=1).to(q.device)
        nd = nodes.to(q.device)
        keys = torch.cat([trunk_k[i][:t_cut], k[nd]])
        vals = torch.cat([trunk_v[i][:t_cut], v[nd]])
        o[nd] = attend(q[nd], keys, vals, mask, scale)
    return o
