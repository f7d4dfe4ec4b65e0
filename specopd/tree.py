"""Proposal trees: drafted tokens hanging off positions of a reference sequence ("trunk"), scored by the target as
if each node's path had run from scratch; chains (``from_branches``), general trees (``from_parents``), packing
(``pack``). Nodes, anchors and positions: specopd/DESIGN.md ("Proposal trees").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specopd_kernels.trees import check_tree


@dataclass
class ProposalTree:
    tokens: torch.Tensor  # [M] long, the node tokens
    parent: torch.Tensor  # [M] long, parent node index, or -1 when the parent is the anchor (trunk)
    anchor: torch.Tensor  # [M] long, trunk position the node's path forks from
    trunk_index: torch.Tensor  # [M] long, which trunk (0 unless packed)
    shape: Optional[tuple] = None  # (N, W) for chain branches: node b*W + j is branch b, depth j
    num_trunks: int = 1
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_branches(cls, anchors, tokens) -> "ProposalTree":
        """Chain branches. anchors: [N] trunk positions; tokens: [N, W] (W >= 1)."""
        anchors = torch.as_tensor(anchors, dtype=torch.long)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() != 2 or anchors.dim() != 1 or anchors.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"from_branches needs anchors [N] and tokens [N, W]; got {tuple(anchors.shape)} and {tuple(tokens.shape)}"
            )
        n, w = tokens.shape
        if w == 0:
            raise ValueError("from_branches: W = 0 (branches without tokens); draft at least one token per branch")
        idx = torch.arange(n * w).view(n, w)
        parent = torch.where(torch.arange(w) == 0, torch.full((n, w), -1), idx - 1)
        return cls(
            tokens=tokens.reshape(-1).clone(),
            parent=parent.reshape(-1).clone(),
            anchor=anchors.repeat_interleave(w),
            trunk_index=torch.zeros(n * w, dtype=torch.long),
            shape=(n, w),
        )

    @classmethod
    def from_parents(cls, tokens, parents) -> "ProposalTree":
        """General tree. tokens: [M]; parents: [M] with ``parents[u] >= 0`` an earlier node index and
        ``parents[u] < 0`` meaning trunk position ``-parents[u] - 1`` (so -1 is trunk position 0)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError("from_parents: empty tree")
        if parents.shape != tokens.shape:
            raise ValueError(f"from_parents: tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ")
        m = tokens.numel()
        anchor = torch.empty(m, dtype=torch.long)
        parent = torch.empty(m, dtype=torch.long)
        for u in range(m):
            p = int(parents[u])
            if p >= 0:
                if p >= u:
                    raise ValueError(f"node {u}: parent {p} is not an earlier node (parents must come first)")
                parent[u] = p
                anchor[u] = anchor[p]
            else:
                parent[u] = -1
                anchor[u] = -p - 1
        return cls(tokens=tokens.clone(), parent=parent, anchor=anchor, trunk_index=torch.zeros(m, dtype=torch.long))

    @staticmethod
    def pack(trees: Sequence["ProposalTree"]) -> "ProposalTree":
        """Pack the trees of several trunks (tree i belongs to trunk i) into one scoring batch.
        Chain trees with one W keep their shape (N = sum of N_i)."""
        if len(trees) == 0:
            raise ValueError("pack: no trees")
        toks, par, anc, tix = [], [], [], []
        off = 0
        for i, t in enumerate(trees):
            if t.num_trunks != 1:
                raise ValueError("pack: trees must each belong to one trunk")
            toks.append(t.tokens)
            par.append(torch.where(t.parent >= 0, t.parent + off, t.parent))
            anc.append(t.anchor)
            tix.append(torch.full_like(t.tokens, i))
            off += t.num_nodes
        shape = None
        if all(t.shape is not None for t in trees) and len({t.shape[1] for t in trees}) == 1:
            shape = (sum(t.shape[0] for t in trees), trees[0].shape[1])
        return ProposalTree(
            tokens=torch.cat(toks), parent=torch.cat(par), anchor=torch.cat(anc), trunk_index=torch.cat(tix),
            shape=shape, num_trunks=len(trees),
        )

    def split(self, node_values: torch.Tensor) -> list:
        """Undo ``pack`` on per-node values [M, ...] -> list (one per trunk) of [M_i, ...]."""
        return [node_values[self.trunk_index == i] for i in range(self.num_trunks)]

    # ------------------------------------------------------------------ derived structure
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def depth(self) -> torch.Tensor:
        """[M] depth below the anchor (0 for a node whose parent is the trunk)."""
        if "depth" not in self._cache:  # pointer jumping: max-depth vector steps, no loop over nodes
            d = torch.zeros(self.num_nodes, dtype=torch.long)
            p = self.parent.clone()
            while bool((p >= 0).any()):
                up = p >= 0
                d += up.long()
                p = torch.where(up, self.parent[p.clamp(min=0)], p)
            self._cache["depth"] = d
        return self._cache["depth"]

    @property
    def positions(self) -> torch.Tensor:
        """[M] semantic positions: anchor + 1 + depth (RoPE and everything positional use these)."""
        return self.anchor + 1 + self.depth

    def levels(self) -> list:
        """Node indices grouped by depth, shallowest first: each node's parent is in an earlier level."""
        if "levels" not in self._cache:
            d = self.depth
            self._cache["levels"] = [torch.nonzero(d == k).flatten() for k in range(int(d.max()) + 1)]
        return self._cache["levels"]

    def ancestor_mask(self, nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[M', M'] bool over ``nodes`` (default: all M): ``mask[u, v]`` is True when v is u itself or an
        ancestor of u. ``nodes`` must hold every ancestor of its members (e.g. one trunk's nodes), so a
        packed batch never needs the full [M, M] matrix (nodes of different trunks are never related)."""
        if nodes is None:
            nodes = torch.arange(self.num_nodes)
        m = int(nodes.numel())
        local = torch.full((self.num_nodes,), -1, dtype=torch.long)
        local[nodes] = torch.arange(m)
        par = self.parent[nodes]
        par_local = torch.where(par >= 0, local[par.clamp(min=0)], par)
        if bool(((par >= 0) & (par_local < 0)).any()):
            raise ValueError("ancestor_mask: `nodes` must contain every ancestor of its nodes")
        depth = self.depth[nodes]
        anc = torch.eye(m, dtype=torch.bool)
        for d in range(1, int(depth.max()) + 1 if m else 1):
            lvl = torch.nonzero(depth == d).flatten()
            anc[lvl] |= anc[par_local[lvl]]
        return anc

    def path_refs(self, k: int) -> tuple:
        """Where the 1..k steps before each node along its path lie (structure only, cached per k).

        Returns (node_ref [M, k], trunk_pos [M, k]): at step s (0-based, s+1 back) either ``node_ref >= 0``
        (an ancestor node) or ``trunk_pos >= 0`` (a position of the node's trunk); both -1 before the start.
        """
        key = ("path_refs", k)
        if key not in self._cache:
            m = self.num_nodes
            node_ref = torch.full((m, k), -1, dtype=torch.long)
            trunk_pos = torch.full((m, k), -1, dtype=torch.long)
            cur_node = self.parent.clone()  # -1 -> on the trunk
            cur_pos = torch.where(self.parent < 0, self.anchor, torch.full_like(self.anchor, -1))
            for s in range(k):
                on_node = cur_node >= 0
                node_ref[:, s] = torch.where(on_node, cur_node, torch.full_like(cur_node, -1))
                trunk_pos[:, s] = torch.where(on_node, torch.full_like(cur_pos, -1), cur_pos)
                safe = cur_node.clamp(min=0)
                nxt_node = torch.where(on_node, self.parent[safe], torch.full_like(cur_node, -1))
                nxt_pos = torch.where(
                    on_node,
                    torch.where(self.parent[safe] < 0, self.anchor, torch.full_like(cur_pos, -1)),
                    torch.where(cur_pos >= 0, cur_pos - 1, cur_pos),
                )
                cur_node, cur_pos = nxt_node, nxt_pos
            self._cache[key] = (node_ref, trunk_pos)
        return self._cache[key]

    def path_back(self, k: int, trunk_ids: Sequence[torch.Tensor]) -> tuple:
        """``path_refs(k)`` plus the tokens there: (node_ref [M, k], trunk_pos [M, k], token [M, k]),
        token -1 before the start of the sequence. trunk_ids: one [T_i] id tensor per trunk."""
        node_ref, trunk_pos = self.path_refs(k)
        token = torch.where(node_ref >= 0, self.tokens[node_ref.clamp(min=0)], torch.full_like(node_ref, -1))
        for i, ids in enumerate(trunk_ids):
            sel = (trunk_pos >= 0) & (self.trunk_index == i)[:, None]
            if sel.any():
                token[sel] = ids.to(torch.long).cpu()[trunk_pos[sel]]
        return node_ref, trunk_pos, token

    def validate(self, trunk_lens: Sequence[int], vocab_size: Optional[int] = None) -> None:
        """Clear errors for an anchor outside its trunk, a token outside the vocab, a bad parent."""
        if len(trunk_lens) != self.num_trunks:
            raise ValueError(f"tree spans {self.num_trunks} trunk(s) but {len(trunk_lens)} cache(s) were given")
        check_tree(self.anchor, self.parent, self.trunk_index, trunk_lens, self.tokens, vocab_size)

    def cached(self, key, build):
        """``build()`` once per tree and ``key`` (structure derived from the tree, e.g. an executor's plan)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def reshape_nodes(self, values: torch.Tensor) -> torch.Tensor:
        """[M, ...] -> [N, W, ...] for chain branches, unchanged otherwise."""
        if self.shape is None:
            return values
        return values.reshape(self.shape[0], self.shape[1], *values.shape[1:])

    def to(self, device) -> "ProposalTree":
        """Trees live on the CPU (they are small); executors move the index tensors they need."""
        return self
