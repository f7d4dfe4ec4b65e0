"""Per-query sequential QSA reference: transformers' ``Qwen4ExpTextQSAIndexer`` loop, written out literally.

For each query i (visible tokens 0..i): pool the complete groups of ``ratio`` raw index keys (mean in fp32,
``k_layernorm``, RoPE at the group's first position), score ``sum_h relu(q_h . k_g) / sqrt(d)``, keep the
top ``topk`` groups (ties: lowest group index -- transformers uses ``torch.topk``, whose tie order is
unspecified), add the tail tokens after the last complete group, and attend over exactly those tokens.
Slow (a Python loop over queries); the vectorised plain forward and the executor are tested against it.
"""
from __future__ import annotations

import torch


def sequential_selection(mixer, x: torch.Tensor, positions: torch.Tensor) -> list:
    """x [1, T, D], positions [1, T] -> per query i a (groups [<= topk] ascending, tokens [k_i]) pair."""
    q_idx, raw = mixer.index_project(x, positions)
    r, out = mixer.ratio, []
    for i in range(x.shape[1]):
        n = (i + 1) // r
        if n:
            blocks = torch.arange(n * r).view(n, r)
            keys = mixer.pool_keys(raw[0, blocks.flatten()].view(n, r, -1), positions[0, blocks[:, 0]])
            s = mixer.index_scores(q_idx[0, i], keys)  # [n]
            order = sorted(range(n), key=lambda g: (-float(s[g]), g))  # descending, lowest index on ties
            groups = sorted(order[: min(mixer.topk, n)])
            tokens = blocks[groups].flatten()
        else:
            groups, tokens = [], torch.zeros(0, dtype=torch.long)
        tokens = torch.cat([tokens, torch.arange(n * r, i + 1)])
        out.append((torch.tensor(groups, dtype=torch.long), tokens))
    return out


def sequential_attention(mixer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [1, T, D] -> [1, T, D]: each query's softmax attention over its own selected tokens only."""
    q, k, v, gate = mixer.project(x, positions)
    rep = mixer.num_heads // mixer.num_kv_heads
    outs = []
    for i, (_, tok) in enumerate(sequential_selection(mixer, x, positions)):
        kk = k[0, tok].repeat_interleave(rep, dim=1)  # [S, H, hd]
        vv = v[0, tok].repeat_interleave(rep, dim=1)
        w = torch.einsum("hd,shd->hs", q[0, i], kk) * mixer.scaling
        p = torch.softmax(w.float(), dim=-1).to(q.dtype)
        outs.append(torch.einsum("hs,shd->hd", p, vv))
    return mixer.finish(torch.stack(outs).unsqueeze(0), gate)


def group_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [Q, Hi, di], keys [G, di] -> [Q, G] fp32: sum_h relu(q_h . k_g) / sqrt(di) (``QSAttention.index_scores``),
    the reference of ``specopd_kernels.qsa.indexer.index_scores``."""
    s = torch.matmul(q.float(), keys.float().t())  # [Q, Hi, G]
    return torch.relu(s).sum(dim=-2) / (q.shape[-1] ** 0.5)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, n_keys: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Each query attends to its own gathered key rows (softmax in fp32): the reference of ``sparse_attention``.

    Args:
        q: [Q, H, D].
        k, v: [N, Hkv, D].
        idx: [Q, S] rows of k / v.
        n_keys: [Q] how many of idx[q] are used.
        scale: softmax scale.

    Returns:
        [Q, H, D] fp32.
    """
    nq, h, _ = q.shape
    rep = h // k.shape[1]
    ok = torch.arange(idx.shape[1], device=idx.device)[None, :] < n_keys[:, None]  # [Q, S]
    kk = k[idx].float().repeat_interleave(rep, dim=2)  # [Q, S, H, D]
    vv = v[idx].float().repeat_interleave(rep, dim=2)
    w = torch.einsum("qhd,qshd->qhs", q.float(), kk) * scale
    w = w.masked_fill(~ok[:, None, :], float("-inf"))
    return torch.einsum("qhs,qshd->qhd", torch.softmax(w, dim=-1), vv)
