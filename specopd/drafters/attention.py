"""Branch attention of the DFlash draft layers: many blocks over one shared, packed context per trunk.
q [N, S, H, hd]; k_blk, v_blk [N, S, Hkv, hd]; k_ctx, v_ctx [C, Hkv, hd] -> [N, S, H, hd]. Layout and backends:
specopd/drafters/DESIGN.md ("Branch attention").
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Union

import torch

from specopd_kernels import paths

CHUNK_ELEMS = 1 << 22  # score elements per chunk of the chunked path (16 MiB in fp32)


class BranchLayout:
    """Which context rows each block sees. starts [N], anchors [N] (long, on the queries' device):
    block b sees packed context rows ``starts[b] .. starts[b] + anchors[b] - 1``. ``ctx_len`` = C.

    Blocks must be grouped by trunk (non-decreasing ``starts``) and sorted by anchor within a trunk.
    ``ran``: the paths that computed attention over this layout ("flex", "flex_eager", "chunked", or a callable
    backend's name), so a caller or a test knows which one ran (flex falls back to chunked on a compile error)."""

    def __init__(self, starts: torch.Tensor, anchors: torch.Tensor, ctx_len: int, block: int):
        self.starts, self.anchors = starts, anchors
        self.ctx_len, self.block = int(ctx_len), int(block)
        self.ran: set = set()
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


def _heads_major(x: torch.Tensor, hkv: int, acc) -> torch.Tensor:
    """[n, S, H, hd] -> [Hkv, n, g * S, hd] (rows of one kv head: branch, then query head, then slot)."""
    n, s, h, hd = x.shape
    return x.to(acc).view(n, s, hkv, h // hkv, hd).permute(2, 0, 3, 1, 4).reshape(hkv, n, h // hkv * s, hd)


def _scores(qh, kc, kb, anchors, scale):
    """qh [Hkv, n, gS, hd], kc [Hkv, a, hd] (one trunk's context prefix), kb [Hkv, n, S, hd] -> masked scores
    (ctx [Hkv, n, gS, a] or None, blk [Hkv, n, gS, S]). The context part is one matmul per kv head with all
    branches of the chunk folded into its rows (no per-branch copy of the context)."""
    hkv, n, r, hd = qh.shape
    s_blk = torch.matmul(qh, kb.transpose(-1, -2)).mul_(scale)
    a = kc.shape[1]
    if a == 0:
        return None, s_blk
    s_ctx = torch.bmm(qh.reshape(hkv, n * r, hd), kc.transpose(1, 2)).mul_(scale).view(hkv, n, r, a)
    hidden = torch.arange(a, device=qh.device)[None, :] >= anchors[:, None]  # [n, a]: keys p >= a_b
    return s_ctx.masked_fill_(hidden[None, :, None, :], float("-inf")), s_blk


class _ChunkedBranchAttention(torch.autograd.Function):
    """Exact attention of every block over [its context prefix ; its block], chunk by chunk (see module).
    Saves q, k, v, out and the log-sum-exp; the backward recomputes the probabilities per chunk."""

    @staticmethod
    def forward(ctx, q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, chunk_elems):
        n_all, s, h, hd = q.shape
        hkv = k_blk.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        out = torch.empty_like(q)
        lse = q.new_empty((hkv, n_all, h // hkv * s), dtype=acc)
        chunks = layout.chunks(h, chunk_elems)
        for b0, b1, c0, amax in chunks:
            qh = _heads_major(q[b0:b1], hkv, acc)  # [Hkv, n, gS, hd]
            kc = k_ctx[c0:c0 + amax].to(acc).transpose(0, 1)  # [Hkv, a, hd]
            vc = v_ctx[c0:c0 + amax].to(acc).transpose(0, 1)
            kb = k_blk[b0:b1].to(acc).permute(2, 0, 1, 3)  # [Hkv, n, S, hd]
            vb = v_blk[b0:b1].to(acc).permute(2, 0, 1, 3)
            s_ctx, s_blk = _scores(qh, kc, kb, layout.anchors[b0:b1], scale)
            m = s_blk.amax(-1) if s_ctx is None else torch.maximum(s_blk.amax(-1), s_ctx.amax(-1))  # [Hkv, n, gS]
            p_blk = s_blk.sub_(m[..., None]).exp_()
            z = p_blk.sum(-1)
            o = torch.matmul(p_blk, vb)  # [Hkv, n, gS, hd]
            if s_ctx is not None:
                p_ctx = s_ctx.sub_(m[..., None]).exp_()
                z += p_ctx.sum(-1)
                o += torch.bmm(p_ctx.flatten(1, 2), vc).view_as(o)
            o /= z[..., None]
            n = b1 - b0
            out[b0:b1] = o.view(hkv, n, h // hkv, s, hd).permute(1, 3, 0, 2, 4).reshape(n, s, h, hd).to(q.dtype)
            lse[:, b0:b1] = m + torch.log(z)
        ctx.save_for_backward(q, k_blk, v_blk, k_ctx, v_ctx, out, lse)
        ctx.layout, ctx.scale, ctx.chunks = layout, scale, chunks
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k_blk, v_blk, k_ctx, v_ctx, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        _, s, h, hd = q.shape
        hkv = k_blk.shape[2]
        acc = lse.dtype
        dq, dkb, dvb = torch.empty_like(q), torch.empty_like(k_blk), torch.empty_like(v_blk)
        dkc = torch.zeros((hkv, k_ctx.shape[0], hd), dtype=acc, device=k_ctx.device)
        dvc = torch.zeros((hkv, v_ctx.shape[0], hd), dtype=acc, device=v_ctx.device)
        for b0, b1, c0, amax in ctx.chunks:
            n = b1 - b0
            qh, doh = _heads_major(q[b0:b1], hkv, acc), _heads_major(d_out[b0:b1], hkv, acc)  # [Hkv, n, gS, hd]
            oh = _heads_major(out[b0:b1], hkv, acc)
            kc = k_ctx[c0:c0 + amax].to(acc).transpose(0, 1)
            vc = v_ctx[c0:c0 + amax].to(acc).transpose(0, 1)
            kb = k_blk[b0:b1].to(acc).permute(2, 0, 1, 3)
            vb = v_blk[b0:b1].to(acc).permute(2, 0, 1, 3)
            s_ctx, s_blk = _scores(qh, kc, kb, layout.anchors[b0:b1], scale)
            lse_c = lse[:, b0:b1, :, None]  # [Hkv, n, gS, 1]
            delta = (doh * oh).sum(-1, keepdim=True)  # [Hkv, n, gS, 1]
            p_blk = s_blk.sub_(lse_c).exp_()
            ds_blk = torch.matmul(doh, vb.transpose(-1, -2)).sub_(delta).mul_(p_blk)  # [Hkv, n, gS, S]
            dqh = torch.matmul(ds_blk, kb)
            dkb[b0:b1] = (torch.matmul(ds_blk.transpose(-1, -2), qh) * scale).permute(1, 2, 0, 3).to(dkb.dtype)
            dvb[b0:b1] = torch.matmul(p_blk.transpose(-1, -2), doh).permute(1, 2, 0, 3).to(dvb.dtype)
            if s_ctx is not None:
                p_ctx = s_ctx.sub_(lse_c).exp_().flatten(1, 2)  # [Hkv, n * gS, a]
                dof, qf = doh.flatten(1, 2), qh.flatten(1, 2)  # [Hkv, n * gS, hd]
                ds_ctx = torch.bmm(dof, vc.transpose(1, 2)).sub_(delta.flatten(1, 2)).mul_(p_ctx)
                dqh += torch.bmm(ds_ctx, kc).view_as(dqh)
                dkc[:, c0:c0 + amax] += torch.bmm(ds_ctx.transpose(1, 2), qf).mul_(scale)  # summed over branches
                dvc[:, c0:c0 + amax] += torch.bmm(p_ctx.transpose(1, 2), dof)
            dq[b0:b1] = (dqh * scale).view(hkv, n, h // hkv, s, hd).permute(1, 3, 0, 2, 4).reshape(
                n, s, h, hd).to(dq.dtype)
        return (dq, dkb, dvb, dkc.transpose(0, 1).to(k_ctx.dtype), dvc.transpose(0, 1).to(v_ctx.dtype),
                None, None, None)


def chunked_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float,
                             chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """The exact chunked path (any device): forward and backward in fp32, probabilities recomputed chunk by chunk.

    Args / Returns: as ``specopd.drafters.attention.branch_attention`` (o in q's dtype); ``chunk_elems``: bound on
    one chunk's score tensor [n, H, S, a_max].
    """
    _check(q, k_blk, v_blk, k_ctx, v_ctx, layout)
    layout.ran.add("chunked")
    return _ChunkedBranchAttention.apply(q, k_blk, v_blk, k_ctx, v_ctx, layout, float(scale), int(chunk_elems))


# ---------------------------------------------------------------------------------------------- cached


def cached_branch_attention(q, k_blk, v_blk, k_ctx: list, v_ctx: list, scale: float) -> torch.Tensor:
    """Decoding: block b attends to its own sequence's cached context (all of it: the anchor is the position after it)
    and to its own block. The contexts stay where the decoding caches keep them (no packing, no copy): the block
    part is one batched matmul, each context is merged into it with its own log-sum-exp (flash style). fp32 maths;
    memory O(A * S + max_b T_b) per layer besides the caches.

    Args:
        q: [A, S, H, hd] block queries.
        k_blk, v_blk: [A, S, Hkv, hd].
        k_ctx, v_ctx: lists of A cached contexts [T_b, Hkv, hd].
        scale: softmax scale.

    Returns:
        o [A, S, H, hd].
    """
    a, s, h, hd = q.shape
    hkv = k_blk.shape[2]
    if len(k_ctx) != a or len(v_ctx) != a:
        raise ValueError(f"cached branch attention: {len(k_ctx)} contexts for {a} blocks")
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = _heads_major(q, hkv, acc)  # [Hkv, A, gS, hd]
    kb = k_blk.to(acc).permute(2, 0, 1, 3)  # [Hkv, A, S, hd]
    vb = v_blk.to(acc).permute(2, 0, 1, 3)
    sc = torch.matmul(qh, kb.transpose(-1, -2)).mul_(scale)  # [Hkv, A, gS, S]
    m = sc.amax(-1)  # [Hkv, A, gS]
    p = sc.sub_(m[..., None]).exp_()
    z = p.sum(-1)
    o = torch.matmul(p, vb)  # [Hkv, A, gS, hd] (unnormalised)
    for b, (kc, vc) in enumerate(zip(k_ctx, v_ctx)):
        if kc.shape[0] == 0:
            continue
        kc, vc = kc.to(acc).transpose(0, 1), vc.to(acc).transpose(0, 1)  # [Hkv, T_b, hd]
        sb = torch.bmm(qh[:, b], kc.transpose(1, 2)).mul_(scale)  # [Hkv, gS, T_b]
        mb = torch.maximum(m[:, b], sb.amax(-1))  # [Hkv, gS]
        old = torch.exp(m[:, b] - mb)
        pb = sb.sub_(mb[..., None]).exp_()
        z[:, b] = z[:, b] * old + pb.sum(-1)
        o[:, b] = o[:, b] * old[..., None] + torch.bmm(pb, vc)
        m[:, b] = mb
    o /= z[..., None]
    return o.view(hkv, a, h // hkv, s, hd).permute(1, 3, 0, 2, 4).reshape(a, s, h, hd).to(q.dtype)


# ---------------------------------------------------------------------------------------------- flex

_FLEX = {}


def flex_available() -> bool:
    try:
        # pulls in torch's compiler, only when asked
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_block_mask(layout: BranchLayout, device, compile_mask: Optional[bool] = None):
    """The BlockMask of the packed problem: queries = the N * S block slots (block-major), keys =
    [C context rows ; N * S block slots]. Query slot i of block b = i // S sees context key j when
    ``starts[b] <= j < starts[b] + anchors[b]`` and block key C + i' when ``i' // S == b``."""
    from torch.nn.attention.flex_attention import create_block_mask  # pulls in torch's compiler, only when used

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


def _compiled_flex(dynamic: bool):
    from torch.nn.attention.flex_attention import flex_attention  # pulls in torch's compiler, only when used

    key = ("compiled", bool(dynamic))
    if key not in _FLEX:
        _FLEX[key] = torch.compile(flex_attention, dynamic=bool(dynamic))
    return _FLEX[key]


def flex_failed() -> Optional[str]:
    """Why flex_attention failed to compile in this process (then "auto" resolves to "chunked"), else None."""
    return _FLEX.get("failed")


def flex_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float,
                          compiled: Optional[bool] = None, dynamic: bool = True) -> torch.Tensor:
    """flex_attention over one packed key sequence [context of all trunks ; all blocks] with a BlockMask from
    ``layout``.
    On CUDA a failed compile warns once (naming ``kernels.drafter_attention=chunked``), falls back to the exact
    chunked path for this call and, through ``resolve_backend``, for every later "auto" call of the process;
    ``layout.ran`` then says "chunked" where a run of the compiled flex says "flex" ("flex_eager" uncompiled).

    Args / Returns: as ``specopd.drafters.attention.branch_attention``, and:
        compiled: compile the BlockMask and the forward with ``torch.compile`` (default: on CUDA); else eager
            (unfused, forward only).
        dynamic: ``torch.compile(dynamic=)``.
    """
    _check(q, k_blk, v_blk, k_ctx, v_ctx, layout)
    if compiled is None:
        compiled = _on_cuda(q)
    if not compiled:
        out = _flex_forward(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, None, False)
        layout.ran.add("flex_eager")
        return out
    if not _on_cuda(q):  # CPU (tests): errors propagate
        out = _flex_forward(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, _compiled_flex(dynamic), True)
        layout.ran.add("flex")
        return out
    try:
        _probe(q, k_blk, dynamic)
        out = _flex_forward(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, _compiled_flex(dynamic), True)
        layout.ran.add("flex")
        return out
    except Exception as e:  # noqa: BLE001 - inductor / triton compile errors of any type
        if "failed" not in _FLEX:
            _FLEX["failed"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            warnings.warn(f"flex_attention failed to compile on {q.device} ({_FLEX['failed']}); the drafter's "
                          f"branch attention falls back to the chunked path (exact, slower) for the rest of this "
                          f"process. Set kernels.drafter_attention=chunked to skip the attempt.", RuntimeWarning,
                          stacklevel=2)
        return chunked_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)


def _on_cuda(q) -> bool:
    """On CUDA flex compiles by default, and a failed compile falls back to the chunked path (with one warning);
    elsewhere it runs eagerly unless asked, and compile errors raise."""
    return q.device.type == "cuda"


def _probe(q, k_blk, dynamic: bool) -> None:
    """Once per (device, dtype, heads, head dim): the compiled forward and backward of a tiny problem, so a compile
    error of the backward (compiled at the first backward, outside any try of the caller) shows up here."""
    key = ("probed", str(q.device), q.dtype, q.shape[2], k_blk.shape[2], q.shape[3], bool(dynamic))
    if _FLEX.get(key):
        return
    s, h, hkv, hd = q.shape[1], q.shape[2], k_blk.shape[2], q.shape[3]
    layout = BranchLayout(torch.tensor([0, 0], device=q.device), torch.tensor([0, 3], device=q.device), 3, s)
    with torch.enable_grad():
        args = [torch.randn(*sh, device=q.device, dtype=q.dtype, requires_grad=True)
                for sh in ((2, s, h, hd), (2, s, hkv, hd), (2, s, hkv, hd), (3, hkv, hd), (3, hkv, hd))]
        o = _flex_forward(*args, layout, hd ** -0.5, _compiled_flex(dynamic), True)
        o.float().sum().backward()
    _FLEX[key] = True


def _flex_forward(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale, fn, compile_mask):
    from torch.nn.attention.flex_attention import flex_attention  # pulls in torch's compiler, only when used

    n, s, h, hd = q.shape
    hkv = k_blk.shape[2]
    bm = flex_block_mask(layout, q.device, compile_mask=compile_mask)
    dev = q.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype  # one dtype for q, k, v
    qf = q.to(dt).reshape(1, n * s, h, hd).transpose(1, 2)  # [1, H, N*S, hd]
    k = torch.cat([k_ctx.to(dt), k_blk.to(dt).reshape(n * s, hkv, hd)]).transpose(0, 1)[None]  # [1, Hkv, C+N*S, hd]
    v = torch.cat([v_ctx.to(dt), v_blk.to(dt).reshape(n * s, hkv, hd)]).transpose(0, 1)[None]
    o = (fn or flex_attention)(qf, k, v, block_mask=bm, scale=float(scale), enable_gqa=h != hkv)
    return o.transpose(1, 2).reshape(n, s, h, hd).to(q.dtype)


# ---------------------------------------------------------------------------------------------- entry

Backend = Union[str, Callable]


def resolve_backend(backend: Backend, device: torch.device, kernel_paths=None) -> Backend:
    """"auto" -> ``kernel_paths``' ``drafter_attention`` (the recipe's kernels: section; None: "auto") when it names
    chunked or flex (e.g. to fall back to the chunked path on a GPU), else flex on CUDA (when importable) and chunked
    elsewhere."""
    if callable(backend):
        return backend
    if backend == "auto":
        backend = paths.mode(kernel_paths, "drafter_attention")
    if backend not in ("auto", "chunked", "flex"):
        raise ValueError(f"attention backend must be auto | chunked | flex (or a callable); got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available() and not flex_failed() else "chunked"
    if backend == "flex" and not flex_available():
        raise RuntimeError("attention backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    return backend


def branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout: BranchLayout, scale: float,
                     backend: Backend = "auto", kernel_paths=None) -> torch.Tensor:
    """Every block over its context prefix and itself (non-causal inside the block).

    Args:
        q: [N, S, H, hd] block queries (S = block_size).
        k_blk, v_blk: [N, S, Hkv, hd] the blocks' own keys / values.
        k_ctx, v_ctx: [C, Hkv, hd] the packed context of every trunk (trunk 0's rows, then trunk 1's, ...).
        layout: BranchLayout (branches grouped by trunk, sorted by anchor; block b sees its trunk's rows < a_b).
        scale: softmax scale.
        backend: "auto" (flex on CUDA when importable, else chunked; ``kernel_paths``' ``drafter_attention``
            overrides) | "chunked" | "flex" | a callable ``fn(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale) -> o``.
        kernel_paths: the recipe's ``kernels:`` section (the drafter's); None: all "auto".

    Returns:
        o [N, S, H, hd].
    """
    fn = resolve_backend(backend, q.device, kernel_paths)
    if callable(fn):
        layout.ran.add(getattr(fn, "__name__", type(fn).__name__))
        return fn(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)
    if fn == "flex":
        return flex_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)
    return chunked_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale)


def _check(q, k_blk, v_blk, k_ctx, v_ctx, layout):
    n, s, h, _ = q.shape
    if k_blk.shape[:2] != (n, s) or v_blk.shape != k_blk.shape or h % k_blk.shape[2]:
        raise ValueError(f"branch attention: q {tuple(q.shape)}, k_blk {tuple(k_blk.shape)}, v_blk "
                         f"{tuple(v_blk.shape)} do not fit ([N, S, H, hd] / [N, S, Hkv, hd], H % Hkv == 0)")
    if k_ctx.shape[0] != layout.ctx_len or v_ctx.shape != k_ctx.shape or layout.num_blocks != n \
            or layout.block != s:
        raise ValueError(f"branch attention: context {tuple(k_ctx.shape)} / layout (C={layout.ctx_len}, "
                         f"N={layout.num_blocks}, S={layout.block}) do not match the queries {tuple(q.shape)}")
