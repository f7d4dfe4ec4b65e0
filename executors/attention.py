"""Dense attention with GQA head groups: the plain attention of the models' causal forwards and of the
executors' torch paths (one implementation, below the models: ``specopd.models.common`` re-exports it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, max_scores: int = 1 << 26) -> torch.Tensor:
    """Dense attention with GQA head groups, HF eager numerics (scores * scaling, softmax in fp32, probabilities cast
    back to q.dtype). Query rows are processed in chunks of at most ``max_scores`` score entries (rows are
    independent: chunking does not change the result).

    Args:
        q: [B, Tq, H, hd]; H a multiple of Hkv (query head h reads kv head h // (H / Hkv)).
        k, v: [B, Tk, Hkv, hd].
        mask: [B or 1, Tq, Tk] bool (True = may attend), or None.
        scaling: softmax scale.
        max_scores: bound on one chunk's score tensor.

    Returns:
        [B, Tq, H, hd].
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    g = h // hkv
    kh = k.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Tk, d]
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)
    if tq == 0:
        return q.new_zeros(b, 0, h, v.shape[-1])
    rows = max(1, max_scores // max(1, b * h * k.shape[1]))
    outs = []
    for s in range(0, tq, rows):
        qc = q[:, s:s + rows]
        tc = qc.shape[1]
        qh = qc.reshape(b, tc, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, tc, d]
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scaling  # [B, Hkv, G, tc, Tk]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, s:s + rows], float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(torch.matmul(probs, vh).permute(0, 3, 1, 2, 4).reshape(b, tc, h, v.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float, bias=None) -> torch.Tensor:
    """Same contract as ``masked_attention`` through ``F.scaled_dot_product_attention`` (fused kernels on the GPU; K/V
    heads repeated to H so that every backend accepts it).

    Args:
        q, k, v, mask, scaling: as ``masked_attention``.
        bias: an attention bias (e.g. torch's ``causal_lower_right``) replacing ``mask`` when given.

    Returns:
        [B, Tq, H, hd].
    """
    g = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(g, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(g, dim=2).transpose(1, 2)
    m = bias if bias is not None else (None if mask is None else mask[:, None])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=m, scale=scaling)
    return out.transpose(1, 2)
