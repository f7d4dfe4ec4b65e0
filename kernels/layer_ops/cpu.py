"""bf16 RMSNorm, SiLU * up and RoPE on the CPU in one pass each (``layer_ops_cpu.c``), built on first use by
``kernels.cbuild`` and loaded with ctypes. ``enabled(*tensors)`` says whether the models should call them.

``SPECOPD_LAYER_OPS=auto`` (default) uses them for bf16 CPU tensors outside autograd where the library builds;
``torch`` keeps torch's eager ops (``naive.py``) everywhere. Exactness: ``layer_ops_cpu.c``'s header and
docs/exactness.md (RoPE and the product bitwise torch's; the norm and SiLU within one bf16 unit of it).
"""
from __future__ import annotations

import ctypes
import os
import torch

from kernels.cbuild import Library, bf16_cpu_inference, env_mode

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer_ops_cpu.c")
MODES = ("auto", "torch")


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.rms_norm_bf16.argtypes = [p, i64, p, p, i64, i64, i64, f32, i32, i32]
    lib.silu_mul_bf16.argtypes = [p, i64, p, i64, p, i64, i64, i64, i32]
    lib.rope_bf16.argtypes = [p, i64, i64, p, p, i64, p, i64, i64, i64, i64, i64, i64, i32]
    for f in (lib.rms_norm_bf16, lib.silu_mul_bf16, lib.rope_bf16):
        f.restype = None


LIB = Library(SOURCE, _declare)


def mode() -> str:
    return env_mode("SPECOPD_LAYER_OPS", MODES)


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all bf16 on the CPU, none needing a gradient, mode "auto", and
    the library available (``LIB.error`` says why not)."""
    return bf16_cpu_inference(*tensors) and mode() == "auto" and LIB.available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [R, N] with contiguous rows (a view where the layout allows, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``naive.rms_norm`` in one pass.

    Args:
        x: [..., D] bf16 (rows contiguous; any row stride).
        weight: [D] bf16.
        eps: added to the mean square.
        unit_offset: the weight is an offset from 1.

    Returns:
        [..., D] bf16.
    """
    d = x.shape[-1]
    if tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [{d}] for x {tuple(x.shape)}")
    x2, w = _rows(x), weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.bfloat16)
    LIB.get().rms_norm_bf16(x2.data_ptr(), x2.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), x2.shape[0],
                            d, float(eps), int(unit_offset), torch.get_num_threads())
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``naive.silu_mul`` in one pass. gate, up [..., N] bf16 -> [..., N] bf16."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must match")
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=torch.bfloat16)
    LIB.get().silu_mul_bf16(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), out.stride(0),
                            g.shape[0], g.shape[1], torch.get_num_threads())
    return out.view(gate.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``naive.rope`` in one pass. x [B, T, H, hd] bf16; cos / sin [B, T, rd] bf16 (rd even, <= hd) ->
    [B, T, H, hd] bf16."""
    b, t, h, hd = x.shape
    rd = cos.shape[-1]
    if cos.shape != sin.shape or tuple(cos.shape[:2]) != (b, t) or rd > hd or rd % 2:
        raise ValueError(f"rope: cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} must be [{b}, {t}, rd] with an "
                         f"even rd <= {hd}")
    xs = x.reshape(b * t, h, hd)  # a view of the projections' [B, T, H, hd] views
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    c = cos.reshape(b * t, rd).contiguous()
    s = sin.reshape(b * t, rd).contiguous()
    out = torch.empty(b * t, h, hd, dtype=torch.bfloat16)
    LIB.get().rope_bf16(xs.data_ptr(), xs.stride(0), xs.stride(1), c.data_ptr(), s.data_ptr(), c.stride(0),
                        out.data_ptr(), out.stride(0), out.stride(1), b * t, h, hd, rd, torch.get_num_threads())
    return out.view(b, t, h, hd)
