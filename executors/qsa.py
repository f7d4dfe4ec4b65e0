"""QSA executor (kind "qsa"): qwen4_exp ``indexed_attention`` over a trunk and a packed proposal tree, with the
same group selection as the sequential path. Details: executors/DESIGN.md ("QSA executor").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specopd_executors.attention import masked_attention
from specopd_executors.base import Executor, GrowingCache, register_executor, resolve_kernels
from specopd_executors.options import DEFAULT_QSA_SCORE_BYTES, as_options

SCORE_BYTES = DEFAULT_QSA_SCORE_BYTES  # default options.qsa_score_bytes: score's key stage works in chunks <= this


@dataclass
class QSACache(GrowingCache):
    k: torch.Tensor  # [T, Hkv, hd] RoPE'd keys
    v: torch.Tensor  # [T, Hkv, hd]
    raw: torch.Tensor  # [T, di] raw index keys
    pooled: torch.Tensor  # [T // ratio, di] pooled group keys (k_layernorm + RoPE at the group start)

    def __len__(self) -> int:
        return int(self.k.shape[0])


@dataclass
class QSANodes:
    """What ``verify`` keeps of the M tree nodes for ``commit``: k, v [M, Hkv, hd], raw [M, di]."""

    k: torch.Tensor
    v: torch.Tensor
    raw: torch.Tensor


def _pool_new_groups(mixer, raw: torch.Tensor, t0: int, t: int) -> torch.Tensor:
    """Pooled keys [G, di] of the groups completed by tokens t0 .. t-1 (groups t0 // r .. t // r - 1);
    raw [t, di] covers the whole trunk."""
    r = mixer.ratio
    keep, g = t0 // r, t // r
    starts = torch.arange(keep, g, device=raw.device) * r
    return mixer.pool_keys(raw[keep * r: g * r].reshape(g - keep, r, raw.shape[-1]), starts)


def _record(options, mixer, sel):
    rec = as_options(options).qsa_record
    if isinstance(rec, dict):
        rec[mixer.layer_idx] = sel.detach().cpu()


def attend_selected(mixer, q, k_all, v_all, sel, pos, rows, options=None, triton=False) -> torch.Tensor:
    """Attention of queries over their own key lists: the selected groups' tokens, then the tail r*n .. pos, in
    that order, padded to S = topk * r + r - 1 keys. Queries go in chunks of <= ``options.qsa_score_bytes`` of
    key-stage tensors.

    A query's result depends only on its own row and key list, not on which other queries share the call (torch:
    one [1, S] attention per query; triton: one program per query), so prefill (low precision) and score give it
    bitwise equal outputs (its attention output feeds the next layers' QSA selections and MoE routing).

    Args:
        mixer: the ``QSAttention`` (its ratio r, topk and scaling).
        q: [Q, H, hd] queries.
        k_all, v_all: [N, Hkv, hd] the rows keys and values are gathered from.
        sel: [Q, topk] selected groups (ascending, -1 padded).
        pos: [Q] the queries' positions.
        rows: ``rows(positions [n, S], queries [n])`` maps visible-list positions to rows of k_all / v_all.
        options: ``ExecOptions`` (``qsa_score_bytes``).
        triton: use ``specopd_kernels.qsa.sparse_attention``.

    Returns:
        o [Q, H, hd].
    """
    dev, r, m = q.device, mixer.ratio, q.shape[0]
    n = (pos + 1) // r  # complete groups on each query's visible list
    s_len = sel.shape[1] * r + r - 1
    per_node = s_len * (40 + (0 if triton else 2 * k_all[0].numel() * k_all.element_size()))
    chunk = max(1, int(as_options(options).qsa_score_bytes) // per_node)
    every = torch.arange(m, device=dev)
    o = torch.empty_like(q)  # [Q, H, hd]
    for c0 in range(0, m, chunk):
        nd = every[c0: c0 + chunk]
        p_sel = (sel[nd, :, None] * r + torch.arange(r, device=dev)).flatten(1)
        ok_sel = (sel[nd] >= 0)[..., None].expand(-1, -1, r).flatten(1)
        p_tail = (r * n[nd])[:, None] + torch.arange(r - 1, device=dev)
        ok = torch.cat([ok_sel, p_tail <= pos[nd, None]], dim=1)  # [n, S]
        idx = rows(torch.where(ok, torch.cat([p_sel, p_tail], dim=1), 0), nd)
        if triton:
            from specopd_kernels.qsa.sparse_attention import pack_rows, sparse_attention  # Triton, only on this path

            o[nd] = sparse_attention(q[nd], k_all, v_all, *pack_rows(idx, ok), mixer.scaling)
        else:
            o[nd] = masked_attention(q[nd].unsqueeze(1), k_all[idx], v_all[idx], ok.unsqueeze(1),
                                     mixer.scaling)[:, 0]
    return o


def ancestor_table(tree, device) -> torch.Tensor:
    """[M, Dmax + 1] long: entry (u, j) is u's ancestor at depth j (u itself at its depth; -1 below)."""
    m = tree.num_nodes
    levels = tree.levels()
    anc = torch.full((m, len(levels)), -1, dtype=torch.long)
    for d, nodes in enumerate(levels):
        if d > 0:
            anc[nodes] = anc[tree.parent[nodes]]
        anc[nodes, d] = nodes
    return anc.to(device)


@register_executor("qsa")
class QSAExecutor(Executor):
    kind = "qsa"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        """Indexed attention over the trunk; the QSACache keeps K / V, raw index keys and the pooled keys of every
        complete group.

        Args / Returns: as ``specopd_executors.base.Executor.prefill``.
        """
        t0, t, r = (len(prev) if prev is not None else 0), x.shape[1], mixer.ratio
        if int(positions[0, 0]) != t0:
            raise ValueError(f"qsa prefill: positions start at {int(positions[0, 0])} but the cache holds {t0} tokens")
        q, k, v, gate = mixer.project(x, positions)
        qi, raw = mixer.index_project(x, positions)
        if prev is not None:
            cache = prev.grown(k=k[0], v=v[0], raw=raw[0])
            cache = cache.grown(pooled=_pool_new_groups(mixer, cache.raw, t0, t0 + t))
        else:
            cache = QSACache(k[0], v[0], raw[0], _pool_new_groups(mixer, raw[0], 0, t))
        k, v, pooled = cache.k, cache.v, cache.pooled
        chunk = max(1, int(as_options(options).qsa_prefill_chunk))  # queries per attention block
        if resolve_kernels(options, x.device) == "triton":
            from specopd_kernels.qsa.sparse_attention import qsa_prefill  # Triton, only on this path

            last = torch.arange(t0, t0 + t, device=x.device)
            o, sel = qsa_prefill(q[0], k, v, qi[0], pooled, last, mixer.topk, r, mixer.scaling, chunk=chunk)
            _record(options, mixer, sel)
            return mixer.finish(o[None], gate), cache
        sels, outs = [], []
        lowp = x.dtype != torch.float32  # bitwise the rows score gives (attend_selected); fp32: one masked block
        for s0 in range(0, t, chunk):
            last = torch.arange(t0 + s0, t0 + min(t, s0 + chunk), device=x.device)
            span = int(last[-1]) + 1  # keys visible to this block
            sel = mixer.select(mixer.index_scores(qi[0, s0: s0 + chunk], pooled.unsqueeze(0)), (last + 1) // r)
            if lowp:
                o = attend_selected(mixer, q[0, s0: s0 + chunk], k, v, sel, last, lambda p, nd: p, options)
                outs.append(o[None])
            else:
                mask = mixer.token_mask(sel, last, span)
                outs.append(masked_attention(q[:, s0: s0 + chunk], k[None, :span], v[None, :span], mask[None],
                                             mixer.scaling))
            sels.append(sel)
        _record(options, mixer, torch.cat(sels))
        return mixer.finish(torch.cat(outs, dim=1), gate), cache

    def score(self, mixer, x, tree, caches, options=None):
        """Node u as the last token of trunk[:a_u+1] + path(u): cached pooled trunk groups, the crossing and path groups
        rebuilt per node.

        Args / Returns: as ``specopd_executors.base.Executor.score``.
        """
        return self._score(mixer, x, tree, caches, options)[0]

    def verify(self, mixer, x, tree, caches, options=None):
        """``score`` that also keeps the nodes' K / V and raw index keys (``QSANodes``).

        Args / Returns: as ``specopd_executors.base.Executor.verify``.
        """
        return self._score(mixer, x, tree, caches, options)

    def commit(self, mixer, cache, nodes, path, options=None):
        """Append ``path``'s K / V and raw index keys and pool the groups its tokens complete.

        Args / Returns: as ``specopd_executors.base.Executor.commit``.
        """
        t0 = len(cache)
        cache = cache.grown(k=nodes.k[path], v=nodes.v[path], raw=nodes.raw[path])
        return cache.grown(pooled=_pool_new_groups(mixer, cache.raw, t0, len(cache)))

    def _score(self, mixer, x, tree, caches, options=None):
        dev, m, r = x.device, x.shape[1], mixer.ratio
        triton = resolve_kernels(options, dev) == "triton"
        anchor, tix = tree.anchor.to(dev), tree.trunk_index.to(dev)
        pos = tree.positions.to(dev)
        q, k, v, gate = mixer.project(x, pos.view(1, -1))
        qi, raw = mixer.index_project(x, pos.view(1, -1))
        qi = qi[0]
        lens = [len(c) for c in caches]
        offs = torch.tensor([0] + lens, dtype=torch.long, device=dev).cumsum(0)
        n_trunk = int(offs[-1])
        anc = ancestor_table(tree, dev)
        dmax = anc.shape[1] - 1

        def rows(p, nd):  # positions p [n, ...] on the visible lists of nodes nd [n] -> rows of the stacked tables
            a = anchor[nd].view(-1, *([1] * (p.dim() - 1)))
            on_trunk = p <= a
            trunk_row = offs[tix[nd]].view_as(a) + p
            depth = (p - a - 1).clamp(0, dmax)
            node_row = n_trunk + anc[nd].gather(1, depth.reshape(nd.numel(), -1)).view_as(p)
            return torch.where(on_trunk, trunk_row, node_row)

        every = torch.arange(m, device=dev)
        raw_all = torch.cat([c.raw.to(dev) for c in caches] + [raw[0]])
        n = (pos + 1) // r  # complete groups on node u's visible list
        g0 = (anchor + 1) // r  # of which wholly in the trunk
        n_own = n - g0
        j_own = torch.arange(int(n_own.max()), device=dev)
        g_own = g0[:, None] + j_own  # [M, J]
        ok_own = j_own[None, :] < n_own[:, None]
        p_own = torch.where(ok_own[..., None], g_own[..., None] * r + torch.arange(r, device=dev), 0)
        own_keys = mixer.pool_keys(raw_all[rows(p_own, every)], torch.where(ok_own, g_own * r, 0))  # [M, J, di]
        own_scores = mixer.index_scores(qi, own_keys)  # [M, J]

        gmax = int(n.max())
        scores = torch.zeros(m, gmax + 1, dtype=torch.float32, device=dev)
        for i, c in enumerate(caches):
            nodes = torch.nonzero(tix == i).flatten()
            if nodes.numel() and c.pooled.shape[0] and gmax:
                gi = min(c.pooled.shape[0], gmax)
                if triton:  # groups g < g0 only (the rest is the nodes' own)
                    from specopd_kernels.qsa.indexer import index_scores  # Triton, only on this path

                    ts = index_scores(qi[nodes], c.pooled[:gi].to(dev), g0[nodes].clamp(max=gi))
                else:
                    ts = mixer.index_scores(qi[nodes], c.pooled[:gi].to(dev).unsqueeze(0))  # [m_i, gi]
                scores[nodes, :gi] = ts
        scores.scatter_(1, torch.where(ok_own, g_own, gmax), own_scores)
        if triton:
            from specopd_kernels.qsa.indexer import topk_groups  # Triton, only on this path

            sel = topk_groups(scores[:, :gmax].contiguous(), n, mixer.topk)  # [M, topk]
        else:
            sel = mixer.select(scores[:, :gmax], n)  # [M, topk]
        _record(options, mixer, sel)

        k_all = torch.cat([c.k.to(dev) for c in caches] + [k[0]])
        v_all = torch.cat([c.v.to(dev) for c in caches] + [v[0]])
        o = attend_selected(mixer, q[0], k_all, v_all, sel, pos, rows, options, triton)
        return mixer.finish(o[None], gate), QSANodes(k[0], v[0], raw[0])
