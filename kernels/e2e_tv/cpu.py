"""The CPU kernel of alpha = sum_v min(q, p) and its gradient (``tv_cpu.c``), built on first use and loaded with
ctypes.

Built by ``specopd_kernels.cbuild`` (the system C compiler, cached in ``$SPECOPD_CACHE/kernels``). ``available()`` is False
where no compiler works; the callers (``specopd.losses``) then keep the torch path, which computes the same numbers
(``naive.py``).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from specopd_kernels.cbuild import Library

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tv_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.tv_alpha_forward.argtypes = [ptr, i32, i64, ptr, i32, i64, i64, i64, f32, ptr, ptr, i32]
    lib.tv_alpha_backward.argtypes = [ptr, i32, i64, ptr, i32, i64, i64, i64, f32, ptr, ptr, ptr, ptr, ptr, i32, i64,
                                      i32]
    lib.tv_alpha_forward.restype = lib.tv_alpha_backward.restype = None


LIB = Library(SOURCE, _declare)


available = LIB.available  # True when the kernel is built (or builds now) and loads
unavailable_reason = LIB.reason  # why not, or None


def _rows(z: torch.Tensor, name: str):
    if z.dim() != 2 or z.device.type != "cpu" or z.dtype not in (torch.float32, torch.bfloat16) or z.stride(1) != 1:
        raise ValueError(f"{name} must be a CPU [R, V] fp32 / bf16 tensor with contiguous rows; got "
                         f"{tuple(z.shape)} {z.dtype} on {z.device} with strides {z.stride()}")
    return z.data_ptr(), int(z.dtype == torch.bfloat16), z.stride(0)


def _check(zq, zp, temperature):
    if zq.shape != zp.shape:
        raise ValueError(f"zq {tuple(zq.shape)} and zp {tuple(zp.shape)} must both be [R, V]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if not available():
        raise RuntimeError(f"the CPU TV kernel is not available: {LIB.error}")


def tv_alpha_forward(zq: torch.Tensor, zp: torch.Tensor, temperature: float):
    """alpha and the backward's row statistics from one read of the logits.

    Args:
        zq: [R, V] fp32 / bf16 drafter logits (rows contiguous; any row stride).
        zp: [R, V] fp32 / bf16 target logits.
        temperature: T > 0 of both softmaxes.

    Returns:
        (alpha [R] fp32 = sum_v min(softmax(zq / T), softmax(zp / T)), NaN on a row with a non-finite logit;
        stats [R, 5] fp32 for ``tv_alpha_backward``).
    """
    _check(zq, zp, temperature)
    r, v = zq.shape
    alpha = torch.empty(r, dtype=torch.float32)
    stats = torch.empty(r, 5, dtype=torch.float32)
    LIB.get().tv_alpha_forward(*_rows(zq, "zq"), *_rows(zp, "zp"), r, v, 1.0 / float(temperature),
                               alpha.data_ptr(), stats.data_ptr(), torch.get_num_threads())
    return alpha, stats


def ce_nll(zq: torch.Tensor, stats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """nll [R] = logsumexp(zq) - zq[target] from ``tv_alpha_forward``'s statistics of a T = 1 call (its max and
    1 / sum of exp); zq the same logits."""
    zt = zq.gather(1, targets.long()[:, None]).squeeze(1).float()
    return stats[:, 0] - torch.log(stats[:, 2]) - zt


def tv_alpha_backward(zq: torch.Tensor, zp: torch.Tensor, temperature: float, stats: torch.Tensor,
                      grad_alpha: torch.Tensor, out: torch.Tensor, grad_nll: Optional[torch.Tensor] = None,
                      targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dL/dzq = dL/dalpha * q (ind - <q, ind>) / T, ind = 1[q < p] + 1/2 1[q == p], written into ``out``; with
    ``grad_nll`` (T = 1 only) plus dL/dnll * (q - onehot(target)), the CE term's (``ce_nll``).

    Args:
        zq, zp: [R, V] the logits given to ``tv_alpha_forward`` (recomputed: the same values).
        temperature: its T.
        stats: [R, 5] its statistics.
        grad_alpha: [R] fp32 dL/dalpha.
        out: [R, V] fp32 / bf16 with contiguous rows (may be zq itself when both are fp32 and zq is not needed
            after: each row is read before it is written).
        grad_nll: [R] fp32 dL/dnll of the CE term, or None.
        targets: [R] int64, the CE's labels (with ``grad_nll``).

    Returns:
        ``out``.
    """
    _check(zq, zp, temperature)
    r, v = zq.shape
    if tuple(out.shape) != (r, v) or tuple(stats.shape) != (r, 5) or tuple(grad_alpha.shape) != (r,):
        raise ValueError(f"out [R, V] = {[r, v]}, stats [R, 5], grad_alpha [R]; got {tuple(out.shape)}, "
                         f"{tuple(stats.shape)}, {tuple(grad_alpha.shape)}")
    cn = tg = None
    if grad_nll is not None:
        if float(temperature) != 1.0:
            raise ValueError(f"the CE term's gradient needs the kernel's q at T = 1; got temperature {temperature}")
        if targets is None or tuple(grad_nll.shape) != (r,) or tuple(targets.shape) != (r,):
            raise ValueError(f"grad_nll and targets must both be [R] = [{r}]; got "
                             f"{tuple(grad_nll.shape)} and {None if targets is None else tuple(targets.shape)}")
        if bool(((targets < 0) | (targets >= v)).any()):
            raise ValueError(f"targets must lie in [0, V = {v})")
        cn = grad_nll.float().contiguous()
        tg = targets.to(torch.int64).contiguous()
    coef = (grad_alpha.float() / float(temperature)).contiguous()
    stats = stats.float().contiguous()
    LIB.get().tv_alpha_backward(*_rows(zq, "zq"), *_rows(zp, "zp"), r, v, 1.0 / float(temperature),
                                stats.data_ptr(), coef.data_ptr(), None if cn is None else cn.data_ptr(),
                                None if tg is None else tg.data_ptr(), *_rows(out, "out"), torch.get_num_threads())
    return out
