"""Trunk prefill through flash-linear-attention's chunked gated delta rule (CUDA), keeping its per-chunk states
in fp32 as the GDN checkpoints (a hook on fla-core 0.6.0's ``chunk_gated_delta_rule_fwd_h``).
The hook and its tests: kernels/DESIGN.md ("GDN kernels: fla chunk").
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Optional

import torch

from specopd_kernels.gated_delta.chunk import chunk_checkpoints
from specopd_kernels.gated_delta.naive import prepare_qk

CHUNK = 64
_lock = threading.Lock()


def fla_available() -> bool:
    """True when fla's chunked gated delta rule imports (fla-core installed, CUDA build of triton)."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's TileLang backend would bypass the fp32-state hook
    try:
        import fla.ops.gated_delta_rule.chunk  # noqa: F401  (optional gpu extra)
    except Exception:  # ImportError, or fla failing to initialise without a GPU
        return False
    return True


def fla_fp32_exact(device) -> bool:
    """Whether fla's dots on fp32 operands are IEEE on ``device``: on the CPU (the interpreter computes fp32 exactly),
    before Ampere (fla itself sets ``TRITON_F32_DEFAULT=ieee`` there) or in a process started with
    ``TRITON_F32_DEFAULT=ieee``; otherwise triton's default, TF32 (~1e-3 relative), which the fp32 exactness contract
    does not allow. Read at compile time: a kernel fla compiled before the variable was set keeps TF32."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_F32_DEFAULT") == "ieee":
        return True
    return torch.cuda.get_device_capability(device)[0] < 8


_VERIFIED: dict = {}


def fla_verified(device) -> bool:
    """fla imports and, on a small random problem on ``device`` (CUDA), gives our chunk kernel's outputs, final
    state and fp32 checkpoints (bf16 inputs, rel <= 2e-2): checked once per process and device. The GDN
    executor's "auto" prefill uses fla only when this holds, so a broken or changed fla install falls back to
    ``specopd_kernels.gated_delta.chunk`` (with a warning) instead of failing or returning wrong states."""
    key = str(device)
    if key not in _VERIFIED:
        ok, why = False, "fla-core does not import"
        if torch.device(device).type == "cuda" and fla_available():
            try:
                from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule  # Triton, only on this path

                g_ = torch.Generator().manual_seed(0)
                q, k = prepare_qk(torch.randn(1, 200, 2, 64, generator=g_), torch.randn(1, 200, 2, 64, generator=g_))
                v = torch.randn(1, 200, 4, 64, generator=g_)
                gg, beta = -torch.rand(1, 200, 4, generator=g_) * 0.1, torch.rand(1, 200, 4, generator=g_)
                args = [x.to(device, torch.bfloat16) for x in (q, k, v)]
                kw = dict(g=gg.to(device), beta=beta.to(device), checkpoint_every=CHUNK, start=0)
                ref = chunk_gated_delta_rule(*args, **kw)
                got = fla_chunk_gated_delta_rule(*[a.repeat_interleave(2, dim=2) if i < 2 else a
                                                   for i, a in enumerate(args)], **kw)
                errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, ref)]
                ok = max(errs) <= 2e-2 and got[2].dtype == torch.float32
                why = f"fla differs from the chunk kernel (rel errors {errs})"
            except Exception as e:  # noqa: BLE001 - any failure means: do not use fla
                why = f"fla failed: {type(e).__name__}: {e}"
        if not ok and torch.device(device).type == "cuda" and fla_available():
            warnings.warn(f"GDN prefill falls back from fla to specopd_kernels.gated_delta.chunk: {why}")
        _VERIFIED[key] = ok
    return _VERIFIED[key]


def fla_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                               checkpoint_every: Optional[int] = None, start: int = 0, cu_seqlens=None):
    """The contract of ``specopd_kernels.gated_delta.chunk.chunk_gated_delta_rule``, computed by fla on CUDA.

    Args / Returns: as ``specopd_kernels.gated_delta.chunk.chunk_gated_delta_rule``, except:
        q, k, v: fp32 only where ``fla_fp32_exact`` holds (else a ValueError: TF32 is not fp32).
        checkpoint_every: C must be a multiple of 64 (fla's chunk).
        cu_seqlens: [n + 1] long on the device: B = 1 holds n fresh sequences packed one after another (fla's varlen
            mode; ``start`` must be 0). Then it returns (o [1, N, H, V], final [n, H, K, V], a list of n checkpoint
            tensors [n_i, H, K, V] or None): fla's chunks restart at every sequence.
    """
    fla_available()
    try:
        import fla.ops.gated_delta_rule.chunk as fla_chunk  # optional (gpu extra)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError("gdn prefill through fla needs fla-core (pip install flash-linear-attention) on a CUDA "
                           "machine; use the Triton chunk kernel (specopd_kernels.gated_delta.chunk) instead") from e
    if checkpoint_every is not None and checkpoint_every % CHUNK:
        raise ValueError(f"fla keeps states every {CHUNK} tokens: checkpoint_every must be a multiple of {CHUNK} "
                         f"(got {checkpoint_every})")
    if q.dtype == torch.float32 and not fla_fp32_exact(q.device):
        raise ValueError(f"fla on fp32 inputs runs its dots in TF32 on {q.device} (sm_80+), not the IEEE fp32 the "
                         f"exactness contract needs: use our chunk kernel (gdn_prefill='chunk', or 'auto', which sends "
                         f"fp32 there), bf16 / fp16 inputs, or start the process with TRITON_F32_DEFAULT=ieee")
    b, t = k.shape[:2]
    if cu_seqlens is not None and (start or b != 1 or initial_state is not None):
        raise ValueError("fla varlen prefill packs fresh sequences: B = 1, start = 0, no initial_state")
    pad = start % CHUNK
    if pad:  # align chunks to absolute multiples of 64 with no-op tokens (g = beta = 0, q = k = v = 0)
        def front(x):
            return torch.cat([x.new_zeros(b, pad, *x.shape[2:]), x], dim=1)
        q, k, v, g, beta = (front(x) for x in (q, k, v, g, beta))
    captured = {}
    orig = fla_chunk.chunk_gated_delta_rule_fwd_h

    def fwd_h_fp32(*args, **kwargs):
        if args or "k" not in kwargs:
            raise RuntimeError("fla's chunk_gated_delta_rule_fwd now takes positional arguments; update "
                               "kernels/gated_delta/fla_chunk.py")
        dtype = kwargs["k"].dtype
        for name in ("k", "w", "u"):  # one dtype per kernel: the state recurrence runs on fp32 operands
            kwargs[name] = kwargs[name].float()
        h, v_new, final = orig(*args, **kwargs)
        captured["h"] = h
        # chunk_fwd_o multiplies q by h and the intra-chunk attention by v_new: hand it both in q / k's dtype
        # (what fla itself stores for bf16 inputs), keeping the fp32 h as the checkpoints
        return h.to(dtype), None if v_new is None else v_new.to(dtype), final

    with _lock, torch.no_grad():
        fla_chunk.chunk_gated_delta_rule_fwd_h = fwd_h_fp32
        try:
            o, final = fla_chunk.chunk_gated_delta_rule(
                q, k, v, g=g.float(), beta=beta.float(), scale=1.0,
                initial_state=None if initial_state is None else initial_state.float(),
                output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
        finally:
            fla_chunk.chunk_gated_delta_rule_fwd_h = orig
    h = captured.get("h")
    if h is None or h.dtype != torch.float32 or h.dim() != 5:
        raise RuntimeError("fla did not produce fp32 chunk states [B, NT, H, K, V]; update "
                           "kernels/gated_delta/fla_chunk.py")
    if cu_seqlens is not None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + -(-n // CHUNK))
        if h.shape[1] != offs[-1]:
            raise RuntimeError(f"fla returned {h.shape[1]} chunk states for sequences of lengths {lens} (expected "
                               f"{offs[-1]}); update kernels/gated_delta/fla_chunk.py")
        cks = None if checkpoint_every is None else \
            [chunk_checkpoints(h[:, a:b], 0, n, CHUNK, checkpoint_every)[0] for a, b, n in zip(offs, offs[1:], lens)]
        return o.float(), final.float(), cks
    return o[:, pad:].float(), final.float(), chunk_checkpoints(h, start, t, CHUNK, checkpoint_every)


def prefill_backend(name: str):
    """The sequence recurrence for ``name``: "chunk" (our Triton chunk kernel), "fla" (fla on CUDA; interpreted on the CPU in tests) or
    "recurrent" (the fused recurrent Triton kernel). All share ``naive.recurrent_gated_delta_rule``'s contract."""
    if name == "chunk":
        from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule  # Triton, only on this path

        return chunk_gated_delta_rule
    if name == "fla":
        return fla_chunk_gated_delta_rule
    if name == "recurrent":
        from specopd_kernels.gated_delta.fused_recurrent import fused_recurrent_gated_delta_rule  # Triton, only on this path

        return fused_recurrent_gated_delta_rule
    raise ValueError(f"unknown gdn prefill backend {name!r}; use 'chunk', 'fla' or 'recurrent'")
