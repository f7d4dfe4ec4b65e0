"""Executor for depthwise (dilated) causal convolutions along a token path (kind "conv").

Used by qwen4_exp's PLE short conv (``specopd.models.qwen4_exp.DilatedConv``): out[t] = sum_j w[:, j] *
x[t - back_j] with ``mixer.taps() = [(back_j, j)]``, zeros before the sequence start. The trunk cache keeps
every trunk input (anchors can be anywhere); a tree node reads its inputs ``back`` steps up its own path
(ancestor nodes, then trunk positions <= its anchor). verify keeps the nodes' inputs (``ConvNodes``); commit
appends a path's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specopd_executors.base import Executor, GrowingCache, register_executor


@dataclass
class ConvCache(GrowingCache):
    x: torch.Tensor  # [T, C] conv inputs of every trunk token

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass
class ConvNodes:
    """What ``verify`` keeps of the M tree nodes for ``commit``: their conv inputs x [M, C]."""

    x: torch.Tensor


@register_executor("conv")
class ConvExecutor(Executor):
    kind = "conv"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        """The depthwise causal conv over the trunk; the ConvCache keeps the trunk's inputs [T, C].

        Args / Returns: as ``specopd_executors.base.Executor.prefill`` (D = C for the conv).
        """
        cache = prev.grown(x=x[0]) if prev is not None else ConvCache(x[0])
        full = cache.x
        span = max(b for b, _ in mixer.taps())
        t = x.shape[1]
        window = full[max(0, full.shape[0] - t - span):]
        out = mixer(window.unsqueeze(0).to(x.dtype))[:, -t:]
        return out, cache

    def score(self, mixer, x, tree, caches, options=None):
        """Each node convolves its own path (ancestors, then trunk tokens above the fork).

        Args / Returns: as ``specopd_executors.base.Executor.score`` (D = C for the conv).
        """
        return self._score(mixer, x, tree, caches, options)[0]

    def verify(self, mixer, x, tree, caches, options=None):
        """``score`` that also keeps the nodes' inputs (``ConvNodes``).

        Args / Returns: as ``specopd_executors.base.Executor.verify`` (D = C for the conv).
        """
        return self._score(mixer, x, tree, caches, options)

    def commit(self, mixer, cache, nodes, path, options=None):
        """Append the inputs of ``path`` -> ConvCache of T + L.

        Args / Returns: as ``specopd_executors.base.Executor.commit`` (D = C for the conv).
        """
        return cache.grown(x=nodes.x[path])

    def _score(self, mixer, x, tree, caches, options=None):
        dev, c = x.device, x.shape[-1]
        taps = mixer.taps()
        span = max(b for b, _ in taps)
        lens = [len(cc) for cc in caches]
        node_ref, trunk_pos = tree.path_refs(span)
        offs = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
        n_trunk = int(offs[-1])
        table = torch.cat([cc.x.to(device=dev, dtype=x.dtype) for cc in caches] + [x[0], x.new_zeros(1, c)], dim=0)
        zero_row = table.shape[0] - 1
        tix = tree.trunk_index
        cols = []
        for back, j in sorted(taps, key=lambda bj: bj[1]):
            if back == 0:
                cols.append(x[0])
            else:
                nr, tp = node_ref[:, back - 1], trunk_pos[:, back - 1]
                rows = torch.where(nr >= 0, n_trunk + nr, torch.where(tp >= 0, offs[tix] + tp, zero_row))
                cols.append(table[rows.to(dev)])
        return mixer.tap_sum(cols, x.dtype).unsqueeze(0), ConvNodes(x[0])
