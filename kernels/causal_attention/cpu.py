"""The bf16 causal attention kernel (``attention_cpu.c``), built on first use by ``specopd_kernels.cbuild`` and loaded with
ctypes. It needs AVX512-BF16 (``LIB.reason()`` says why it is not available elsewhere). The same library holds the
tree kernel (``specopd_kernels.tree_attention.cpu``), which ``enabled`` and ``kernels.cpu_attention`` govern alike.

The recipe key ``kernels.cpu_attention`` (``specopd_kernels.paths``) picks where ``specopd_executors.gqa`` uses it: ``auto`` (default) for bf16 on CPUs without AMX-BF16
(there torch's flash kernel runs bf16 at a sixth of the matmul rate; with AMX torch's runs on AMX tiles and was
not measured against this one), ``cpu`` on every CPU where it builds, ``torch`` nowhere.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

import torch

from specopd_kernels import paths
from specopd_kernels.cbuild import Library, bf16_cpu_inference
from specopd_kernels.cpu_features import cpu_flags

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_cpu.c")
MODES = paths.CHOICES["cpu_attention"]
MAX_HEAD_DIM = 256


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.causal_attention_bf16.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, p, p, i64, i64, i64,
                                          i64, f32, i32]
    lib.causal_attention_bf16.restype = i32
    lib.tree_attention_bf16.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64,
                                        p, i64, p, p, p, p, i64, i64, i64, i64, i64, f32, i32]
    lib.tree_attention_bf16.restype = i32


LIB = Library(SOURCE, _declare)


def enabled(q: torch.Tensor, k: torch.Tensor, kernel_paths: Optional[paths.KernelsConfig] = None) -> bool:
    """Whether ``specopd_executors.gqa`` should call the kernels for these tensors: bf16 on the CPU outside autograd, a head
    dim the kernels take, ``kernel_paths``'s ``cpu_attention`` allowing this CPU (None: "auto"), and the library built
    (``LIB.reason()``)."""
    d = q.shape[-1]
    if not bf16_cpu_inference(q, k) or d % 32 or d > MAX_HEAD_DIM:
        return False
    m = paths.mode(kernel_paths, "cpu_attention")
    if m == "torch" or (m == "auto" and "amx_bf16" in cpu_flags()):
        return False
    return LIB.available()


def check_inputs(h: int, hkv: int, d: int, **tensors: torch.Tensor) -> None:
    """What the kernels take (``causal_attention`` and ``specopd_kernels.tree_attention.cpu.tree_attention``): H a multiple
    of Hkv, D a multiple of 32 up to ``MAX_HEAD_DIM``, each tensor [rows, heads, D] bf16 on the CPU with D
    contiguous; else a ValueError naming the tensor."""
    if h % hkv or d % 32 or d > MAX_HEAD_DIM:
        raise ValueError(f"heads {h} must be a multiple of kv heads {hkv}; head dim {d} a multiple of 32 <= "
                         f"{MAX_HEAD_DIM}")
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(2) != 1:
            raise ValueError(f"{name} must be bf16 on the CPU with a contiguous last dim; got {t.dtype} on "
                             f"{t.device}, strides {t.stride()}")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int],
                     scale: float) -> torch.Tensor:
    """``naive.causal_attention`` in bf16: fp32 scores and softmax, P rounded to bf16, fp32 accumulation
    (``attention_cpu.c``'s header), all sequences and heads in one call.

    Args:
        q: [Nq, H, D] bf16; sequence s has rows cu_q[s] .. cu_q[s + 1] - 1 (D contiguous; any row / head stride).
        k, v: [Nk, Hkv, D] bf16; sequence s has rows cu_k[s] .. cu_k[s + 1] - 1; H % Hkv == 0.
        cu_q, cu_k: [n + 1] python ints; Lk >= Lq per sequence, query i at key position (Lk - Lq) + i.
        scale: softmax scale.

    Returns:
        [Nq, H, D] bf16.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [Nq, H, D], k / v [Nk, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    nq, h, d = q.shape
    hkv = k.shape[1]
    check_inputs(h, hkv, d, q=q, k=k, v=v)
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    if len(cu_q) != len(cu_k) or cu_q[0] or cu_k[0] or cu_q[-1] != nq or cu_k[-1] != k.shape[0]:
        raise ValueError(f"cu_q / cu_k must be offsets from 0 to Nq = {nq} / Nk = {k.shape[0]} with one entry per "
                         f"sequence boundary; got {cu_q} / {cu_k}")
    lens = [(cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]) for s in range(len(cu_q) - 1)]
    if any(lq < 0 or lk < lq for lq, lk in lens):
        raise ValueError(f"each sequence needs 0 <= Lq <= Lk; got (Lq, Lk) = {lens}")
    out = torch.empty(nq, h, d, dtype=torch.bfloat16)
    cq = torch.tensor(cu_q, dtype=torch.int64)
    ck = torch.tensor(cu_k, dtype=torch.int64)
    rc = LIB.get().causal_attention_bf16(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                                         k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(),
                                         out.stride(0), out.stride(1), cq.data_ptr(), ck.data_ptr(), len(lens), h,
                                         hkv, d, float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("causal_attention_bf16: out of memory for its packed K / V or scratch")
    return out
