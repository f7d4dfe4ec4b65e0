"""Full (GQA) attention over a trunk and a proposal tree: causal prefill, tree scoring through the block plan of
``specopd_kernels.tree_attention``, verify / commit of accepted paths. Backends: executors/DESIGN.md ("GQA executor").
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from specopd_executors.attention import masked_attention, sdpa_attention
from specopd_executors.base import Executor, GrowingCache, register_executor, resolve_kernels, tree_cached
from specopd_executors.options import as_options
from specopd_kernels.causal_attention import cpu as causal_cpu
from specopd_kernels.tree_attention import block_groups, build_tree_plan, tree_attention_blocked
from specopd_kernels.tree_attention import cpu as tree_cpu


@dataclass
class GQACache(GrowingCache):
    """One layer's trunk cache. k, v: [T, Hkv, hd] in the model dtype (after q/k norm and RoPE)."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return int(self.k.shape[0])


@dataclass
class GQANodes:
    """What ``verify`` keeps of the M tree nodes for ``commit``: k, v [M, Hkv, hd] (RoPE'd at their positions)."""

    k: torch.Tensor
    v: torch.Tensor


BACKENDS = {"dense": masked_attention, "sdpa": sdpa_attention}  # dense-mask attention (prefill; score baseline)
SCORE_BACKENDS = ("blocked", "triton", "cpu", "dense", "sdpa")
BLOCKED = dict(block_m=64, block_n=64)  # torch path: nodes x keys per block (fewer, larger blocks: fewer launches)
GROUP_KEYS = 1 << 16  # torch path in bf16 / fp16: query blocks x keys gathered per fused-attention call


def _option(options) -> str:
    backend = as_options(options).gqa_backend
    if backend != "auto" and backend not in SCORE_BACKENDS:
        raise ValueError(f"unknown gqa_backend {backend!r}; available: 'auto', {', '.join(map(repr, SCORE_BACKENDS))}")
    return backend


def _backend(q, options) -> str:
    """The dense-mask backend for prefill: "dense" (the exact HF-eager numerics) for fp32 on the CPU, "sdpa"
    on the GPU and for bf16 / fp16 on the CPU (torch's flash kernel: no [T, T] score tensor, fp32 accumulation;
    bf16 results are promised within bf16 noise only, docs/exactness.md), unless one is named."""
    backend = _option(options)
    if backend in BACKENDS:
        return backend
    return "dense" if q.device.type == "cpu" and q.dtype == torch.float32 else "sdpa"


def score_backend(device, options, q=None, k=None) -> str:
    """The score path: ``options.gqa_backend``; "auto" = "triton" where ``options.kernels`` is, else "cpu"
    (``specopd_kernels.tree_attention.cpu``) where ``causal_cpu.enabled(q, k)`` (bf16 on a CPU with AVX512-BF16 and no AMX,
    ``options.kernel_paths``' ``cpu_attention``), else "blocked".

    Args:
        device: where the pass runs.
        options: run options (``gqa_backend``, ``kernels``, ``kernel_paths``).
        q, k: [..., H, hd] / [..., Hkv, hd] the layer's queries and keys (their dtype and head dim decide "cpu");
            None: "cpu" is never picked.

    Returns:
        "blocked" | "triton" | "cpu" | "dense" | "sdpa".
    """
    backend = _option(options)
    if backend == "auto":
        if resolve_kernels(options, device) == "triton":
            return "triton"
        cpu = q is not None and causal_cpu.enabled(q, k, as_options(options).kernel_paths)
        return "cpu" if cpu else "blocked"
    if backend == "triton":
        resolve_kernels(replace(as_options(options), kernels="triton"), device)  # clear error off CUDA
    if backend == "cpu" and not (q is None or (q.device.type == "cpu" and q.dtype == torch.bfloat16
                                               and causal_cpu.LIB.available())):
        raise ValueError(f"gqa_backend='cpu' scores bf16 on a CPU with AVX512-BF16 (specopd_kernels.tree_attention.cpu); got "
                         f"{q.dtype} on {q.device}, kernel: {causal_cpu.LIB.reason() or 'available'}; use 'auto'")
    return backend


def attend(q, k, v, mask, scaling, options=None):
    """Masked attention, "dense" (the exact HF-eager numerics of the plain forward) or "sdpa" (torch's fused attention
    with the boolean mask), see ``_backend``.

    Args:
        q: [1, Tq, H, hd].
        k, v: [1, Tk, Hkv, hd].
        mask: [1, Tq, Tk] bool (True = may attend).
        scaling: softmax scale.
        options: run options (``gqa_backend``).

    Returns:
        [1, Tq, H, hd].
    """
    return BACKENDS[_backend(q, options)](q, k, v, mask, scaling)


def attend_causal(q, k, v, scaling, options=None):
    """Causal attention of the last Tq of Tk positions (queries at t0 .. t0 + Tq - 1, t0 = Tk - Tq). With sdpa a
    lower-right causal bias (no dense mask) lets torch pick its flash kernel.

    Args:
        q: [1, Tq, H, hd].
        k, v: [1, Tk, Hkv, hd].
        scaling: softmax scale.
        options: run options.

    Returns:
        [1, Tq, H, hd].
    """
    tq, tk = q.shape[1], k.shape[1]
    if _backend(q, options) == "sdpa" and tq > 0:
        if causal_cpu.enabled(q, k, as_options(options).kernel_paths):  # bf16, no AMX: kernels/causal_attention
            return causal_cpu.causal_attention(q[0], k[0], v[0], [0, tq], [0, tk], scaling)[None]
        if q.device.type == "cpu" and (tq == tk or tq == 1):  # no mask object: the CPU flash kernel, GQA in place
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=tq > 1, scale=scaling, enable_gqa=True)
            return o.transpose(1, 2)
        return sdpa_attention(q, k, v, None, scaling, bias=causal_lower_right(tq, tk))
    mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    return attend(q, k, v, mask[None], scaling, options)


# ---------------------------------------------------------------------------------------------- varlen
def varlen_backend(q, k, options) -> str:
    """Packed causal prefill: ``options.varlen_backend`` "auto" | "flash_attn" | "torch" | "cpu" | "loop".
    "auto" = on CUDA flash-attn's ``flash_attn_varlen_func`` when importable, else torch's ``varlen_attn`` (torch >=
    2.9, bf16 / fp16), else "loop"; on the CPU "cpu" (``specopd_kernels.causal_attention``: every trunk in one call) where
    ``causal_cpu.enabled`` (bf16, AVX512-BF16 without AMX, ``options.kernel_paths``' ``cpu_attention``), else "loop"
    (per-sequence ``attend_causal``: exact, any device)."""
    backend = as_options(options).varlen_backend
    if backend not in ("auto", "flash_attn", "torch", "cpu", "loop"):
        raise ValueError(f"unknown varlen_backend {backend!r}; use 'auto', 'flash_attn', 'torch', 'cpu' or 'loop'")
    if backend == "cpu" and not (q.device.type == "cpu" and q.dtype == torch.bfloat16 and causal_cpu.LIB.available()):
        raise ValueError(f"varlen_backend='cpu' runs bf16 on a CPU with AVX512-BF16 (specopd_kernels.causal_attention); got "
                         f"{q.dtype} on {q.device}, kernel: {causal_cpu.LIB.reason() or 'available'}; use 'auto'")
    if backend != "auto":
        return backend
    if q.device.type == "cpu":
        cpu = causal_cpu.enabled(q, k, as_options(options).kernel_paths) and _backend(q, options) == "sdpa"
        return "cpu" if cpu else "loop"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "loop"
    try:
        import flash_attn  # noqa: F401  (optional gpu extra)

        return "flash_attn"
    except ImportError:
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (newer torch only)

        return "torch"
    except ImportError:
        return "loop"


def attend_varlen(q, k, v, cu_seqlens, max_len: int, scaling, options=None):
    """Causal attention of packed sequences. UNTESTED on a GPU here: the "flash_attn" and "torch" backends run only on
    CUDA (``benchmarks/gpu_check.sh`` compares them with "loop").

    Args:
        q: [N, H, hd] all sequences' rows.
        k, v: [N, Hkv, hd].
        cu_seqlens: [n + 1] int32 on q's device; sequence i = rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1.
        max_len: the longest sequence.
        scaling: softmax scale.
        options: run options (``varlen_backend``).

    Returns:
        [N, H, hd].
    """
    backend = varlen_backend(q, k, options)
    if backend == "cpu":
        bounds = cu_seqlens.tolist()
        return causal_cpu.causal_attention(q, k, v, bounds, bounds, scaling)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func  # optional (gpu extra)

        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scaling,
                                      causal=True)
    if backend == "torch":
        from torch.nn.attention.varlen import varlen_attn  # newer torch only

        params = inspect.signature(varlen_attn).parameters
        kw = {"scale": scaling} if "scale" in params else {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0)  # causal
        else:
            kw["is_causal"] = True
        rep = q.shape[1] // k.shape[1]
        if "enable_gqa" in params:
            kw["enable_gqa"] = rep > 1
        elif rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if "scale" not in params:
            q = q * (scaling * q.shape[-1] ** 0.5)  # its default scale is hd^-0.5
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out[lo:hi] = attend_causal(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], scaling, options)[0]
    return out


@register_executor("gqa")
class GQAExecutor(Executor):
    kind = "gqa"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        """Causal attention over the trunk, extending ``prev``; the cache keeps K / V [T, Hkv, hd] after q/k norm and
        RoPE.

        Args / Returns: as ``specopd_executors.base.Executor.prefill``.
        """
        if x.shape[0] != 1:
            raise ValueError(f"gqa prefill runs one trunk at a time (x [1, T, D]); got batch {x.shape[0]}")
        q, k, v, extra = mixer.project(x, positions)
        cache = prev.grown(k=k[0], v=v[0]) if prev is not None else GQACache(k[0], v[0])
        o = attend_causal(q, cache.k[None], cache.v[None], mixer.scaling, options)
        return mixer.finish(o, extra), cache

    def prefill_packed(self, mixer, x, positions, cu_seqlens, options=None):
        """Fresh trunks packed along the token dim in one varlen causal pass.

        Args:
            mixer: the layer's gqa-kind mixer.
            x: [1, N, D] all trunks' tokens.
            positions: [1, N], each trunk from 0.
            cu_seqlens: [n + 1] python ints; trunk i = tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1.
            options: run options.

        Returns:
            (out [1, N, D], list of one GQACache per trunk).
        """
        q, k, v, extra = mixer.project(x, positions)
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=x.device)
        max_len = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        o = attend_varlen(q[0], k[0], v[0], cu, max_len, mixer.scaling, options)
        caches = [GQACache(k[0, a:b], v[0, a:b]) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        return mixer.finish(o[None], extra), caches

    def score(self, mixer, x, tree, caches, options=None):
        """Tree attention through the block plan (``options.gqa_backend``); caches: one GQACache per trunk.

        Args / Returns: as ``specopd_executors.base.Executor.score``.
        """
        return self._score(mixer, x, tree, caches, options)[0]

    def verify(self, mixer, x, tree, caches, options=None):
        """``score`` that also keeps the nodes' K / V (``GQANodes``).

        Args / Returns: as ``specopd_executors.base.Executor.verify``.
        """
        return self._score(mixer, x, tree, caches, options)

    def commit(self, mixer, cache, nodes, path, options=None):
        """Append the K / V of ``path`` to ``cache`` -> GQACache of T + L.

        Args / Returns: as ``specopd_executors.base.Executor.commit``.
        """
        return cache.grown(k=nodes.k[path], v=nodes.v[path])

    def _score(self, mixer, x, tree, caches, options=None):
        dev = x.device
        lens = tuple(len(c) for c in caches)
        tree_cached(tree, ("valid", lens), lambda: tree.validate(lens))  # once per tree, not per layer
        pos = tree_cached(tree, ("positions", str(dev)), lambda: tree.positions.to(dev).view(1, -1))
        q, k, v, extra = mixer.project(x, pos)  # one positions tensor per tree: RoPE tables once per pass
        backend = score_backend(dev, options, q, k)
        if backend in BACKENDS:
            o = self._score_dense(mixer, q, k, v, tree, caches, options)
        else:
            trunk_k = caches[0].k if len(caches) == 1 else torch.cat([c.k for c in caches])  # [sum T_i, Hkv, hd]
            trunk_v = caches[0].v if len(caches) == 1 else torch.cat([c.v for c in caches])
            if backend == "triton":
                from specopd_kernels.tree_attention.triton_fwd import plan_blocks, tree_attention  # Triton, only on this path

                blocks = plan_blocks(q.shape[-1], q.shape[2], k.shape[2])
                plan = _tree_plan(tree, lens, blocks, dev)
                o = tree_attention(q[0], k[0], v[0], trunk_k, trunk_v, plan, mixer.scaling)[None]
            elif backend == "cpu":  # bf16, AVX512-BF16: every trunk, node and head in one call
                layout = tree_cached(tree, ("tree_cpu", lens),
                                     lambda: tree_cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens))
                o = tree_cpu.tree_attention(q[0], k[0], v[0], trunk_k, trunk_v, layout, mixer.scaling)[None]
            else:
                plan = _tree_plan(tree, lens, BLOCKED, None)
                groups = None
                if q.dtype != torch.float32 and dev.type == "cpu":  # half precision: batched blocks, once per tree
                    groups = tree_cached(tree, ("tree_groups", lens, *BLOCKED.values(), GROUP_KEYS),
                                         lambda: block_groups(plan, GROUP_KEYS))
                o = tree_attention_blocked(q[0], k[0], v[0], trunk_k, trunk_v, plan, mixer.scaling, groups)
                o = o.to(q.dtype)[None]
        return mixer.finish(o, extra), GQANodes(k[0], v[0])

    def _score_dense(self, mixer, q, k, v, tree, caches, options):
        """The dense baseline: per trunk i, [M_i, t_cut + M_i] boolean tree mask (t_cut = last anchor + 1)."""
        o = torch.empty_like(q)
        dev = q.device
        for i in range(tree.num_trunks):
            nodes = torch.nonzero(tree.trunk_index == i).flatten()
            if nodes.numel() == 0:
                continue
            a = tree.anchor[nodes]
            t_cut = int(a.max()) + 1
            trunk_vis = torch.arange(t_cut)[None, :] <= a[:, None]  # [Mi, t_cut]
            mask = torch.cat([trunk_vis, tree.ancestor_mask(nodes)], dim=1)[None].to(dev)
            nodes = nodes.to(dev)
            keys = torch.cat([caches[i].k[:t_cut], k[0, nodes]])[None]  # [1, t_cut + Mi, Hkv, hd]
            vals = torch.cat([caches[i].v[:t_cut], v[0, nodes]])[None]
            o[0, nodes] = attend(q[:, nodes], keys, vals, mask, mixer.scaling, options)[0]
        return o


def _tree_plan(tree, lens: tuple, blocks: dict, device):
    """The tree-attention block plan (built once per tree, trunk lengths and block size; the same for every
    layer), moved to ``device`` as int32 for the kernel when one is given."""
    plan = tree_cached(tree, ("tree_plan", lens, blocks["block_m"], blocks["block_n"]),
                       lambda: build_tree_plan(tree.anchor, tree.parent, tree.trunk_index, lens, **blocks))
    if device is None:
        return plan
    return tree_cached(tree, ("tree_plan", lens, blocks["block_m"], blocks["block_n"], str(device)),
                       lambda: plan.to(device))
