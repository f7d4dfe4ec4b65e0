"""Tree attention in bf16 on the CPU: ``tree_attention_bf16`` of ``kernels/causal_attention/attention_cpu.c`` (the
causal kernel's trunk chunks with a per-node key limit, then one online-softmax step over the node's ancestors).

``specopd_executors.gqa`` uses it to score and verify trees where ``specopd_kernels.causal_attention.cpu.enabled`` holds (bf16, an
AVX512-BF16 CPU without AMX, ``kernels.cpu_attention``): torch's fused attention with a mask runs bf16 at a fraction of
the matmul rate there (benchmarks/results/, the tree-attention-in-C report). Reference: ``naive.tree_attention_reference``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from specopd_kernels.causal_attention.cpu import LIB, check_inputs
from specopd_kernels.tree_attention.plan import node_order
from specopd_kernels.trees import check_tree


@dataclass(frozen=True)
class TreeLayout:
    """What the kernel needs of a tree besides its tensors; built once per tree (``tree_layout``)."""

    order: torch.Tensor  # [M] int64, nodes sorted by (trunk, anchor): a work item's consecutive nodes
    anchor: torch.Tensor  # [M] int64, each node's anchor
    trunk_index: torch.Tensor  # [M] int64, each node's trunk
    ancestors: torch.Tensor  # [M, A] int64, ancestors-or-self root first, -1 after the last (A = deepest path)
    cu_k: torch.Tensor  # [n + 1] int64, trunk i's keys are rows cu_k[i] .. cu_k[i + 1] - 1 of the packed trunk K / V


def tree_layout(anchor: torch.Tensor, parent: torch.Tensor, trunk_index: torch.Tensor,
                trunk_lens: Sequence[int]) -> TreeLayout:
    """Check a tree (``specopd_kernels.trees.check_tree``) and lay it out for ``tree_attention``.

    Args:
        anchor, parent, trunk_index: [M] ``ProposalTree`` fields (parent -1 for a child of the trunk; parents
            precede children).
        trunk_lens: keys held by each trunk's cache.

    Returns:
        TreeLayout.
    """
    anchor, parent, trunk_index = (torch.as_tensor(x, dtype=torch.long).cpu().reshape(-1).contiguous()
                                   for x in (anchor, parent, trunk_index))
    lens = [int(x) for x in trunk_lens]
    check_tree(anchor, parent, trunk_index, lens)
    m = anchor.numel()
    order = node_order(anchor, trunk_index)
    cols = [torch.arange(m)]  # self, parent, grandparent, ... (pointer chasing; paths are short)
    while bool((cols[-1] >= 0).any()):
        cur = cols[-1]
        cols.append(torch.where(cur >= 0, parent[cur.clamp(min=0)], cur))
    up = torch.stack(cols[:-1], 1)  # [M, A] self first, -1 past the root
    depth = (up >= 0).sum(1, keepdim=True)  # path length incl. self
    j = torch.arange(up.shape[1])[None]
    ancestors = torch.where(j < depth, up.gather(1, (depth - 1 - j).clamp(min=0)), torch.full_like(up, -1))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long)
    return TreeLayout(order.contiguous(), anchor, trunk_index, ancestors.contiguous(), cu)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, trunk_k: torch.Tensor, trunk_v: torch.Tensor,
                   layout: TreeLayout, scale: float) -> torch.Tensor:
    """``naive.tree_attention_reference`` in bf16: fp32 scores and softmax, P rounded to bf16, fp32 accumulation
    (``attention_cpu.c``), every trunk, node and head in one call.

    Args:
        q: [M, H, D] bf16 node queries (D contiguous; any row / head stride).
        k, v: [M, Hkv, D] bf16 node keys / values.
        trunk_k, trunk_v: [sum T_i, Hkv, D] bf16, the trunks' caches packed (``layout.cu_k``).
        layout: ``tree_layout`` of the tree and these trunk lengths.
        scale: softmax scale.

    Returns:
        [M, H, D] bf16.
    """
    m, h, d = q.shape if q.dim() == 3 else (-1, -1, -1)
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or k.shape[0] != m or trunk_k.shape != trunk_v.shape \
            or trunk_k.dim() != 3 or tuple(trunk_k.shape[1:]) != tuple(k.shape[1:]) or k.shape[2] != d:
        raise ValueError(f"q [M, H, D], k / v [M, Hkv, D], trunk_k / trunk_v [T, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(trunk_k.shape)}, {tuple(trunk_v.shape)}")
    hkv = k.shape[1]
    if layout.order.numel() != m or int(layout.cu_k[-1]) != trunk_k.shape[0]:
        raise ValueError(f"layout is for {layout.order.numel()} nodes and {int(layout.cu_k[-1])} trunk keys; got "
                         f"{m} and {trunk_k.shape[0]}: build it with tree_layout for this tree and these caches")
    check_inputs(h, hkv, d, q=q, k=k, v=v, trunk_k=trunk_k, trunk_v=trunk_v)
    out = torch.empty(m, h, d, dtype=torch.bfloat16)
    lay = layout
    rc = LIB.get().tree_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), trunk_k.data_ptr(), trunk_k.stride(0), trunk_k.stride(1), trunk_v.data_ptr(), trunk_v.stride(0),
        trunk_v.stride(1), out.data_ptr(), out.stride(0), out.stride(1), lay.cu_k.data_ptr(), lay.cu_k.numel() - 1,
        lay.order.data_ptr(), lay.anchor.data_ptr(), lay.trunk_index.data_ptr(), lay.ancestors.data_ptr(),
        lay.ancestors.shape[1], m, h, hkv, d, float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("tree_attention_bf16: out of memory for its packed K / V or scratch")
    return out
