"""The plain reference of ``cpu.causal_attention``: per sequence, the fp32 softmax attention of the same inputs."""
from __future__ import annotations

from typing import Sequence

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int],
                     scale: float) -> torch.Tensor:
    """Causal GQA attention of packed sequences in fp32 (any input dtype; computed from its values).

    Args:
        q: [Nq, H, D]; sequence s has rows cu_q[s] .. cu_q[s + 1] - 1.
        k, v: [Nk, Hkv, D]; sequence s has rows cu_k[s] .. cu_k[s + 1] - 1 (H % Hkv == 0).
        cu_q, cu_k: [n + 1] offsets; query i of sequence s sits at key position (Lk - Lq) + i.
        scale: softmax scale.

    Returns:
        [Nq, H, D] fp32.
    """
    out = torch.empty(q.shape, dtype=torch.float32)
    rep = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].float().transpose(0, 1)                                # [H, Lq, D]
        ks = k[cu_k[s]:cu_k[s + 1]].float().repeat_interleave(rep, 1).transpose(0, 1)      # [H, Lk, D]
        vs = v[cu_k[s]:cu_k[s + 1]].float().repeat_interleave(rep, 1).transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]          # [Lq, Lk]
        att = (qs @ ks.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_q[s]:cu_q[s + 1]] = (att @ vs).transpose(0, 1)
    return out
