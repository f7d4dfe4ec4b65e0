"""Bitwise reproducibility: torch's deterministic algorithms (``trainer.deterministic``) and a gradient sum that
does not depend on how the global batch is split across workers (``trainer.batch_invariant``). The tree sum:
specopd/train/DESIGN.md ("Batch invariance").
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch


def padded(n: int) -> int:
    """N: the smallest power of two >= n."""
    return 1 << max(0, (int(n) - 1).bit_length())


def blocks(lo: int, hi: int, n: int) -> list:
    """[(start, size)]: the maximal aligned blocks of the tree over [0, padded(n)) that tile the shard
    [lo, hi) (hi == n extends the shard to padded(n): the padding leaves belong to the last shard)."""
    end = padded(n) if hi >= n else hi
    out, s = [], lo
    while s < end:
        k = 1
        while s % (2 * k) == 0 and s + 2 * k <= end:
            k *= 2
        out.append((s, k))
        s += k
    return out


def all_blocks(bounds: list, n: int) -> list:
    """The blocks of every worker's shard, in worker order (each worker computes the same list)."""
    return [b for lo, hi in bounds for b in blocks(lo, hi, n)]


def block_sum(start: int, size: int, leaf: Callable[[int], torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """S(start, size) of the fixed summation tree, calling ``leaf(i)`` for each i in the block in increasing order.

    Args:
        start: the block's first sample.
        size: the block's size (an aligned block of ``blocks``).
        leaf: ``leaf(i)`` -> [P] the gradient of sample i.
        n: the global batch size (leaves from n on are padding).

    Returns:
        [P], or None for a block of padding leaves only.
    """
    if start >= n:
        return None
    if size == 1:
        return leaf(start)
    left = block_sum(start, size // 2, leaf, n)
    right = block_sum(start + size // 2, size // 2, leaf, n)
    if right is None:
        return left
    left.add_(right)
    return left


def combine(values: dict, n: int) -> torch.Tensor:
    """The root S(0, padded(n)) from blocks {(start, size): [P]} that tile [0, padded(n))."""
    def rec(s: int, k: int):
        if (s, k) in values:
            return values[(s, k)]
        if s >= n:
            return None
        if k == 1:
            raise KeyError(f"sample {s} of the global batch is in no block: the shards do not tile [0, {n})")
        left, right = rec(s, k // 2), rec(s + k // 2, k // 2)
        return left if right is None else left + right

    return rec(0, padded(n))


def apply_deterministic(enabled: bool) -> None:
    """``trainer.deterministic``: torch's deterministic algorithms (an error instead of a non-deterministic
    kernel), cuDNN without autotuning, and the cuBLAS workspace setting deterministic GEMMs need (it must
    be set before the first cuBLAS call: this runs before any model is built). Same recipe, same worker
    count -> bitwise the same run on CUDA too (on the CPU our ops are deterministic already)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
