"""Branch attention of the DFlash draft layers: many blocks over a shared, packed context.

N blocks (branches) of S = block_size query slots each; block b hangs off trunk t_b at anchor a_b. Its
queries see the context keys of trunk t_b at positions p < a_b, then all S keys of its own block
(non-causal). The context K/V of every trunk is computed once per layer and packed: ``k_ctx [C, Hkv, hd]``
holds trunk 0's rows, then trunk 1's, ...; block b's context is ``k_ctx[start_b : start_b + a_b]``. No
branch ever gets its own copy of the context.

Layout: branches must be grouped by trunk and sorted by anchor (``BranchLayout`` checks it; the drafter
sorts before calling), so each group of consecutive queries needs one contiguous prefix of one trunk's
context and the mask is block-sparse (a staircase over the context plus S x S blocks on the diagonal).

Backends (``branch_attention(..., backend=)``):
- ``"chunked"`` (CPU default, exact, any device): consecutive branches of one trunk are processed in
  chunks whose score tensor ``[n, H, S, a_max]`` stays under ``chunk_elems``; the backward recomputes the
  probabilities chunk by chunk from the saved log-sum-exp (flash-attention style), so nothing of size
  N x T is kept for the backward either. Memory per layer: O(C + N * S) plus one chunk.
- ``"flex"`` (CUDA): ``torch.nn.attention.flex_attention`` over one packed key sequence
  ``[context of all trunks ; all blocks]`` with a ``BlockMask`` built from the layout (forward and
  backward by flex). It runs eagerly (unfused, forward only) on the CPU, which the tests use to check the
  mask against the chunked path.
- ``"auto"``: flex on CUDA when importable, else chunked.
- a callable ``fn(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale) -> o`` (tests and benchmarks plug the
  per-branch reference in here).

Shapes: q [N, S, H, hd]; k_blk, v_blk [N, S, Hkv, hd]; k_ctx, v_ctx [C, Hkv, hd]; out [N, S, H, hd]
(query head h reads kv head h // (H / Hkv), as SDPA's ``enable_gqa``).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

CHUNK_ELEMS = 1 << 22  # score elements per chunk of the chunked path (16 MiB in fp32)


class BranchLayout:
    """Which context rows each block sees. starts [N], anchors [N] (long, on the queries' device):
    block b sees packed context rows ``starts[b] .. starts[b] + anchors[b] - 1``. ``ctx_len`` = C.

    Blocks must be grouped by trunk (non-decreasing ``starts``) and sorted by anchor within a trunk."""

    def __init__(self, starts: torch.Tensor, anchors: torch.Tensor, ctx_len: int, block: int):
        self.starts, self.anchors = starts, anchors
        self.ctx_len, self.block = int(ctx_len), int(block)
        self._host = None
        self._flex_masks: dict = {}

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.numel())

    def host(self):
        """(starts, anchors) as Python lists (one device sync per layout, shared by every layer)."""
        if self._host is None:
            s, a = self.starts.tolist(), self.anchors.tolist()
            for b in range(1, len(s)):
                if s[b] < s[b - 1] or (s[b] == s[b - 1] and a[b] < a[b - 1]):
                    raise ValueError("BranchLayout: blocks must be grouped by trunk and sorted by anchor "
                                     "(the drafter sorts them; call it through DFlashDrafter.hidden)")
            if s and (min(s) < 0 or max(x + y for x, y in zip(s, a)) > self.ctx_len):
                raise ValueError(f"BranchLayout: a block's context runs past the packed context ({self.ctx_len} rows)")
            self._host = (s, a)
        return self._host

    def chunks(self, heads: int, chunk_elems: int = CHUNK_ELEMS) -> list:
        """[(b0, b1, c0, a_max)]: consecutive blocks of one trunk whose scores [n, heads, S, a_max] fit
        ``chunk_elems``; c0 = their trunk's first context row, a_max = the largest anchor among them."""
        s, a = self.host()
        per_key = heads * self.block
        out, b0 = [], 0
        n = len(s)
        while b0 < n:
            b1 = b0 + 1
            while b1 < n and s[b1] == s[b0] and (b1 + 1 - b0) * per_key * max(a[b1], 1) <= chunk_elems:
                b1 += 1
            out.append((b0, b1, s[b0], a[b1 - 1]))
            b0 = b1
        return out


# ------------------------------------------------------------------------------------------- chunked


def _scores(q5, k_ctx, k_blk, anchors, scale):
    """q5 [n, S, Hkv, g, hd] fp32, k_ctx [a, Hkv, hd], k_blk [n, S, Hkv, hd] -> masked scores
    (ctx [n, Hkv, g, S, a] or None, blk [n, Hkv, g, S, S])."""
    s_blk = torch.einsum("nskgd,ntkd->nkgst", q5, k_blk) * scale
    if k_ctx.shape[0] == 0:
        return None, s_blk
    s_ctx = torch.einsum("nskgd,ckd->nkgsc", q5, k_ctx) * scale
    seen = torch.arange(k_ctx.shape[0], device=q5.device)[None, :] < anchors[:, None]  # [n, a]
    return s_ctx.masked_fill(~seen[:, None, None, None, :], float("-inf")), s_blk


class _ChunkedBranchAttention(torch.autograd.Function):
    """Exact attention of every block over [its context prefix ; its block], chunk by chunk (see module)."""

    @staticmethod
    def forward(ctx, q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, chunk_elems):
        n_all, s, h, hd = q.shape
        hkv = k_blk.shape[2]
        g = h // hkv
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        out = torch.empty_like(q)
        lse = q.new_empty((n_all, hkv, g, s), dtype=acc)
        chunks = layout.chunks(h, chunk_elems)
        for b0, b1, c0, amax in chunks:
            n = b1 - b0
            q5 = q[b0:b1].to(acc).view(n, s, hkv, g, hd)
            kc, vc = k_ctx[c0:c0 + amax].to(acc), v_ctx[c0:c0 + amax].to(acc)
            kb, vb = k_blk[b0:b1].to(acc), v_blk[b0:b1].to(acc)
            s_ctx, s_blk = _scores(q5, kc, kb, layout.anchors[b0:b1], scale)
            m = s_blk.amax(-1) if s_ctx is None else torch.maximum(s_blk.amax(-1), s_ctx.amax(-1))  # [n,k,g,S]
            p_blk = torch.exp(s_blk - m[..., None])
            o = torch.einsum("nkgst,ntkd->nskgd", p_blk, vb)
            z = p_blk.sum(-1)
            if s_ctx is not None:
                p_ctx = torch.exp(s_ctx - m[..., None])
                o = o + torch.einsum("nkgsc,ckd->nskgd", p_ctx, vc)
                z = z + p_ctx.sum(-1)
            o = o / z.permute(0, 3, 1, 2)[..., None]
            out[b0:b1] = o.reshape(n, s, h, hd).to(q.dtype)
            lse[b0:b1] = m + torch.log(z)
        ctx.save_for_backward(q, k_blk, v_blk, k_ctx, v_ctx, out, lse)
        ctx.layout, ctx.scale, ctx.chunks = layout, scale, chunks
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k_blk, v_blk, k_ctx, v_ctx, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        n_all, s, h, hd = q.shape
        hkv = k_blk.shape[2]
        g = h // hkv
        acc = lse.dtype
        dq, dkb, dvb = torch.empty_like(q), torch.empty_like(k_blk), torch.empty_like(v_blk)
        dkc = torch.zeros(k_ctx.shape, dtype=acc, device=k_ctx.device)
        dvc = torch.zeros(v_ctx.shape, dtype=acc, device=v_ctx.device)
        for b0, b1, c0, amax in ctx.chunks:
            n = b1 - b0
            q5 = q[b0:b1].to(acc).view(n, s, hkv, g, hd)
            do5 = d_out[b0:b1].to(acc).view(n, s, hkv, g, hd)
            o5 = out[b0:b1].to(acc).view(n, s, hkv, g, hd)
            kc, vc = k_ctx[c0:c0 + amax].to(acc), v_ctx[c0:c0 + amax].to(acc)
            kb, vb = k_blk[b0:b1].to(acc), v_blk[b0:b1].to(acc)
            s_ctx, s_blk = _scores(q5, kc, kb, layout.anchors[b0:b1], scale)
            lse_c = lse[b0:b1][..., None]  # [n, k, g, S, 1]
            delta = (do5 * o5).sum(-1).permute(0, 2, 3, 1)[..., None]  # [n, k, g, S, 1]
            p_blk = torch.exp(s_blk - lse_c)
            ds_blk = p_blk * (torch.einsum("nskgd,ntkd->nkgst", do5, vb) - delta)
            dq5 = torch.einsum("nkgst,ntkd->nskgd", ds_blk, kb)
            dkb[b0:b1] = (torch.einsum("nkgst,nskgd->ntkd", ds_blk, q5) * scale).to(dkb.dtype)
            dvb[b0:b1] = torch.einsum("nkgst,nskgd->ntkd", p_blk, do5).to(dvb.dtype)
            if s_ctx is not None:
                p_ctx = torch.exp(s_ctx - lse_c)
                ds_ctx = p_ctx * (torch.einsum("nskgd,ckd->nkgsc", do5, vc) - delta)
                dq5 = dq5 + torch.einsum("nkgsc,ckd->nskgd", ds_ctx, kc)
                dkc[c0:c0 + amax] += torch.einsum("nkgsc,nskgd->ckd", ds_ctx, q5) * scale
                dvc[c0:c0 + amax] += torch.einsum("nkgsc,nskgd->ckd", p_ctx, do5)
            dq[b0:b1] = (dq5 * scale).reshape(n, s, h, hd).to(dq.dtype)
        return dq, dkb, dvb, dkc.to(k_ctx.dtype), dvc.to(v_ctx.dtype), None, None, None


def chunked_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float,
                             chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """The exact chunked path (any device; forward and backward in fp32, outputs in q's dtype)."""
    _check(q, k_blk, v_blk, k_ctx, v_ctx, layout)
    return _ChunkedBranchAttention.apply(q, k_blk, v_blk, k_ctx, v_ctx, layout, float(scale), int(chunk_elems))


# ---------------------------------------------------------------------------------------------- flex

_FLEX = {}


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_block_mask(layout: BranchLayout, device, compile_mask: Optional[bool] = None):
    """The BlockMask of the packed problem: queries = the N * S block slots (block-major), keys =
    [C context rows ; N * S block slots]. Query slot i of block b = i // S sees context key j when
    ``starts[b] <= j < starts[b] + anchors[b]`` and block key C + i' when ``i' // S == b``."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = str(device)
    if key in layout._flex_masks:
        return layout._flex_masks[key]
    starts, anchors = layout.starts.to(device), layout.anchors.to(device)
    c, s, n = layout.ctx_len, layout.block, layout.num_blocks

    def mask_mod(b, h, q_idx, kv_idx):
        br = q_idx // s
        lo = starts[br]
        in_ctx = (kv_idx >= lo) & (kv_idx < lo + anchors[br])
        in_blk = (kv_idx >= c) & ((kv_idx - c) // s == br)
        return in_ctx | in_blk

    if compile_mask is None:
        compile_mask = torch.device(device).type == "cuda"
    bm = create_block_mask(mask_mod, None, None, n * s, c + n * s, device=device, _compile=compile_mask)
    layout._flex_masks[key] = bm
    return bm


def flex_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float) -> torch.Tensor:
    """flex_attention over one packed key sequence (compiled on CUDA; eager elsewhere, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    _check(q, k_blk, v_blk, k_ctx, v_ctx, layout)
    n, s, h, hd = q.shape
    hkv = k_blk.shape[2]
    bm = flex_block_mask(layout, q.device)
    qf = q.reshape(1, n * s, h, hd).transpose(1, 2)  # [1, H, N*S, hd]
    k = torch.cat([k_ctx.to(q.dtype), k_blk.reshape(n * s, hkv, hd)]).transpose(0, 1)[None]  # [1, Hkv, C+N*S, hd]
    v = torch.cat([v_ctx.to(q.dtype), v_blk.reshape(n * s, hkv, hd)]).transpose(0, 1)[None]
    fn = flex_attention
    if q.device.type == "cuda":
        fn = _FLEX.get("compiled")
        if fn is None:
            fn = _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    o = fn(qf, k, v, block_mask=bm, scale=float(scale), enable_gqa=h != hkv)
    return o.transpose(1, 2).reshape(n, s, h, hd)


# ---------------------------------------------------------------------------------------------- entry

Backend = Union[str, Callable]


def resolve_backend(backend: Backend, device: torch.device) -> Backend:
    if callable(backend):
        return backend
    if backend not in ("auto", "chunked", "flex"):
        raise ValueError(f"attention backend must be auto | chunked | flex (or a callable); got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "chunked"
    if backend == "flex" and not flex_available():
        raise RuntimeError("attention backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    return backend


def branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float,
                     backend: Backend = "auto") -> torch.Tensor:
    """o [N, S, H, hd]: every block over its context prefix and itself (see the module docstring)."""
    fn = resolve_backend(backend, q.device)
    if callable(fn):
        return fn(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)
    if fn == "flex":
        return flex_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)
    return chunked_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)


def _check(q, k_blk, v_blk, k_ctx, v_ctx, layout):
    n, s, h, hd = q.shape
    if k_blk.shape[:2] != (n, s) or v_blk.shape != k_blk.shape or h % k_blk.shape[2]:
        raise ValueError(f"branch attention: q {tuple(q.shape)}, k_blk {tuple(k_blk.shape)}, v_blk "
                         f"{tuple(v_blk.shape)} do not fit ([N, S, H, hd] / [N, S, Hkv, hd], H % Hkv == 0)")
    if k_ctx.shape[0] != layout.ctx_len or v_ctx.shape != k_ctx.shape or layout.num_blocks != n \
            or layout.block != s:
        raise ValueError(f"branch attention: context {tuple(k_ctx.shape)} / layout (C={layout.ctx_len}, "
                         f"N={layout.num_blocks}, S={layout.block}) do not match the queries {tuple(q.shape)}")
