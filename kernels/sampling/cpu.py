"""The CPU sampling kernel (``sample_cpu.c``): inverse-CDF draws from softmax(z / T) in one pass per row, built on
first use and loaded with ctypes.

Built by ``specopd_kernels.cbuild`` (the system C compiler, cached in ``$SPECOPD_CACHE/kernels``). ``available()`` is False
where no compiler works; ``specopd.sampling`` then keeps its torch path (``draw_``), which applies the same rule.
"""
from __future__ import annotations

import ctypes
import os

import torch

from specopd_kernels.cbuild import Library

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.sample_rows.argtypes = [ptr, i32, i64, i64, i64, i64, f32, ptr, ptr, i32]
    lib.sample_rows.restype = None


LIB = Library(SOURCE, _declare)


available = LIB.available  # True when the kernel is built (or builds now) and loads
unavailable_reason = LIB.reason  # why not, or None


def draw(z: torch.Tensor, u: torch.Tensor, temperature: float, block: int = 1024) -> torch.Tensor:
    """Tokens drawn by the inverse CDF of softmax(z / T) at u: the first token whose cumulative sum of
    exp((z - max) / T) exceeds u * total, located by block sums of ``block`` entries, then inside the block (fp64).

    Args:
        z: [R, V] fp32 / bf16 logits on the CPU (rows contiguous; any row stride).
        u: [R] uniforms in [0, 1) (fp64).
        temperature: T > 0.
        block: entries per block of the two-level search (``specopd.sampling.CDF_BLOCK``).

    Returns:
        [R] int64 tokens, each with p > 0.
    """
    if z.dim() != 2 or z.device.type != "cpu" or z.dtype not in (torch.float32, torch.bfloat16) or z.stride(1) != 1:
        raise ValueError(f"z must be a CPU [R, V] fp32 / bf16 tensor with contiguous rows; got {tuple(z.shape)} "
                         f"{z.dtype} on {z.device} with strides {z.stride()}")
    r, v = z.shape
    if tuple(u.shape) != (r,):
        raise ValueError(f"u must be [R] = [{r}]; got {tuple(u.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (T = 0 is an argmax); got {temperature}")
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    u = u.to(torch.float64).contiguous()
    out = torch.empty(r, dtype=torch.int64)
    LIB.get().sample_rows(z.data_ptr(), int(z.dtype == torch.bfloat16), z.stride(0), r, v, int(block),
                          1.0 / float(temperature), u.data_ptr(), out.data_ptr(), torch.get_num_threads())
    bad = (out < 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"rows {bad[:8].tolist()} of the logits have a NaN or +inf, or no finite value: nothing to "
                         f"sample (check the drafter's hidden states)")
    return out
