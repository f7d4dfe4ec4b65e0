"""Full (GQA) attention over a trunk and a proposal tree.

prefill: causal attention over the trunk (extending ``prev``); the cache keeps the trunk's K and V
         ([T, Hkv, hd] each, after q/k norm and RoPE at the trunk positions; growable, see executors.base).
score:   tree node u (anchor a, trunk i) attends to trunk i's keys at positions <= a, plus its own
         ancestors and itself (``tree.ancestor_mask()``); its q/k use RoPE at its semantic position
         a + 1 + depth. Keys are ordered trunk first, then tree nodes in node order (parents precede
         children), i.e. the same order as the sequential reference ``trunk[:a+1] + path(u)``.
verify:  score, also keeping the nodes' K/V (``GQANodes``); commit appends a path's K/V to the trunk cache.

Only ``mixer.project``, ``mixer.finish`` and ``mixer.scaling`` are used (see docs/interfaces.md).
The attention itself goes through ``attend``: dense masked attention with fp32 softmax (exact on the
CPU) or torch SDPA (GPU default), chosen by ``options["gqa_backend"]``; a flex_attention / Triton
backend slots into ``BACKENDS``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executors.base import Executor, GrowingCache, register_executor
from specopd.models.common import masked_attention, sdpa_attention


@dataclass
class GQACache(GrowingCache):
    """One layer's trunk cache. k, v: [T, Hkv, hd] in the model dtype (after q/k norm and RoPE)."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return int(self.k.shape[0])


@dataclass
class GQANodes:
    """What ``verify`` keeps of the M tree nodes for ``commit``: k, v [M, Hkv, hd] (RoPE'd at their positions)."""

    k: torch.Tensor
    v: torch.Tensor


BACKENDS = {"dense": masked_attention, "sdpa": sdpa_attention}


def _backend(q, options) -> str:
    backend = (options or {}).get("gqa_backend", "auto")
    if backend == "auto":
        backend = "dense" if q.device.type == "cpu" else "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"unknown gqa_backend {backend!r}; available: 'auto', {', '.join(map(repr, BACKENDS))}")
    return backend


def attend(q, k, v, mask, scaling, options=None):
    """q [1, Tq, H, hd], k/v [1, Tk, Hkv, hd], mask [1, Tq, Tk] bool -> [1, Tq, H, hd].

    ``options["gqa_backend"]``: "auto" (default: dense on the CPU, sdpa on the GPU), "dense" (the exact
    HF-eager numerics of the plain forward), "sdpa" (torch's fused attention with the boolean mask).
    """
    return BACKENDS[_backend(q, options)](q, k, v, mask, scaling)


def attend_causal(q, k, v, scaling, options=None):
    """Causal attention of the last Tq of Tk positions (queries at t0..t0+Tq-1 with t0 = Tk - Tq):
    q [1, Tq, H, hd], k/v [1, Tk, Hkv, hd] -> [1, Tq, H, hd]. With sdpa, a lower-right causal bias
    (no dense mask) lets torch pick its flash kernel."""
    tq, tk = q.shape[1], k.shape[1]
    if _backend(q, options) == "sdpa" and tq > 0:
        from torch.nn.attention.bias import causal_lower_right

        return sdpa_attention(q, k, v, None, scaling, bias=causal_lower_right(tq, tk))
    mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    return attend(q, k, v, mask[None], scaling, options)


@register_executor("gqa")
class GQAExecutor(Executor):
    kind = "gqa"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        """x [1, T, D], positions [1, T] (= t0 .. t0+T-1) -> (out [1, T, D], GQACache of t0 + T tokens)."""
        if x.shape[0] != 1:
            raise ValueError(f"gqa prefill runs one trunk at a time (x [1, T, D]); got batch {x.shape[0]}")
        q, k, v, extra = mixer.project(x, positions)
        cache = prev.grown(k=k[0], v=v[0]) if prev is not None else GQACache(k[0], v[0])
        o = attend_causal(q, cache.k[None], cache.v[None], mixer.scaling, options)
        return mixer.finish(o, extra), cache

    def score(self, mixer, x, tree, caches, options=None):
        """x [1, M, D] inputs of the M tree nodes; caches: one GQACache per trunk -> out [1, M, D]."""
        return self._score(mixer, x, tree, caches, options)[0]

    def verify(self, mixer, x, tree, caches, options=None):
        """``score`` -> (out [1, M, D], GQANodes of the M nodes)."""
        return self._score(mixer, x, tree, caches, options)

    def commit(self, mixer, cache, nodes, path, options=None):
        """Append the K/V of ``path`` ([L] node indices, root first) to ``cache`` -> GQACache of T + L."""
        return cache.grown(k=nodes.k[path], v=nodes.v[path])

    def _score(self, mixer, x, tree, caches, options=None):
        if len(caches) != tree.num_trunks:
            raise ValueError(f"tree spans {tree.num_trunks} trunk(s) but {len(caches)} cache(s) were given")
        dev = x.device
        q, k, v, extra = mixer.project(x, tree.positions.to(dev).view(1, -1))
        o = torch.empty_like(q)
        for i, nodes, t_cut, mask in _plan(tree, dev):
            if t_cut > len(caches[i]):
                raise ValueError(f"anchor {t_cut - 1} is outside trunk {i} of length {len(caches[i])}")
            keys = torch.cat([caches[i].k[:t_cut], k[0, nodes]])[None]  # [1, t_cut + Mi, Hkv, hd]
            vals = torch.cat([caches[i].v[:t_cut], v[0, nodes]])[None]
            o[0, nodes] = attend(q[:, nodes], keys, vals, mask, mixer.scaling, options)[0]
        return mixer.finish(o, extra), GQANodes(k[0], v[0])


def _plan(tree, device):
    """Per trunk i with nodes: (i, nodes [Mi], t_cut, mask [1, Mi, t_cut + Mi]) where t_cut = last anchor + 1
    (later trunk keys are never visible) and mask = [trunk positions <= anchor | ancestor-or-self].
    Built once per tree and device (the same for every layer), kept in the tree's cache."""
    key = ("gqa_plan", str(device))
    if key not in tree._cache:
        plan = []
        for i in range(tree.num_trunks):
            nodes = torch.nonzero(tree.trunk_index == i).flatten()
            if nodes.numel() == 0:
                continue
            a = tree.anchor[nodes]
            t_cut = int(a.max()) + 1
            trunk_vis = torch.arange(t_cut)[None, :] <= a[:, None]  # [Mi, t_cut]
            mask = torch.cat([trunk_vis, tree.ancestor_mask(nodes)], dim=1)[None]  # one trunk's block only
            plan.append((i, nodes.to(device), t_cut, mask.to(device)))
        tree._cache[key] = plan
    return tree._cache[key]
