"""The one check of a proposal tree's index arrays (``specopd.tree.ProposalTree`` fields), shared by the tree and
the kernel plans built from those arrays (tree attention, GDN replay)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_tree(anchor: torch.Tensor, parent: torch.Tensor, trunk_index: torch.Tensor, trunk_lens: Sequence[int],
               tokens: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None) -> None:
    """The one check of a tree's index arrays (``ProposalTree`` fields, [M] long each), for the tree and the
    kernel plans built from them: ValueError naming the first bad node.

    Args:
        anchor: [M] trunk position each node's path forks from; must lie in [0, trunk_lens[trunk] - 1].
        parent: [M] an earlier node with the same anchor and trunk, or -1 for a child of the trunk.
        trunk_index: [M] which trunk; must be < len(trunk_lens).
        trunk_lens: tokens held by each trunk's cache.
        tokens: [M] node tokens, checked against ``vocab_size`` when both are given.
    """
    lens = torch.as_tensor(trunk_lens if isinstance(trunk_lens, torch.Tensor) else list(trunk_lens), dtype=torch.long)
    m = anchor.numel()
    if m and (bool((trunk_index < 0).any()) or int(trunk_index.max()) >= lens.numel()):
        raise ValueError(f"tree names trunk {int(trunk_index.max())} but {lens.numel()} trunk length(s) were given")
    bad = (anchor < 0) | (anchor >= lens[trunk_index])
    if bool(bad.any()):
        u = int(torch.nonzero(bad)[0])
        raise ValueError(f"node {u}: anchor {int(anchor[u])} is outside its trunk of length "
                         f"{int(lens[trunk_index[u]])} (anchors must be in [0, T-1])")
    if bool((parent >= torch.arange(m)).any()):
        raise ValueError("a node's parent is not an earlier node")
    pp = parent.clamp(min=0)
    if bool(((parent >= 0) & ((anchor[pp] != anchor) | (trunk_index[pp] != trunk_index))).any()):
        raise ValueError("a node and its parent have different anchors or trunks")
    if tokens is not None and vocab_size is not None and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        u = int(torch.nonzero((tokens < 0) | (tokens >= vocab_size))[0])
        raise ValueError(f"node {u}: token {int(tokens[u])} is outside the vocab [0, {vocab_size})")
