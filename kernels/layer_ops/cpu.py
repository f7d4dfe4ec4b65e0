"""bf16 RMSNorm, SiLU * up and RoPE on the CPU in one pass each (``layer_ops_cpu.c``), built on first use by
``specopd_kernels.cbuild`` and loaded with ctypes. ``enabled(*tensors)`` says whether the models should call them.

The bf16 linear layers run through oneDNN with their weight reordered once (``PackedWeight`` / ``linear``) instead
of per call as ``F.linear`` does: the same bits (tested), faster (measured: benchmarks/results/).
``linear_enabled(x, weight)`` says whether to use it (no C library needed: torch's own oneDNN ops); the recipe key
``kernels.cpu_linear=torch`` keeps ``F.linear`` (so does ``kernels.cpu_layer_ops=torch``). ``kernels.cpu_linear=all``
packs fp32 weights too: oneDNN's fp32 kernel instead of MKL's (faster on some CPUs), within fp32 rounding of
``F.linear`` but not its bits, so fp32 no longer matches transformers bit for bit; off by default.

``kernels.cpu_layer_ops=auto`` (default) uses them for bf16 CPU tensors outside autograd where the library builds;
``torch`` keeps torch's eager ops (``naive.py``) everywhere. Exactness: ``layer_ops_cpu.c``'s header and
docs/exactness.md (RoPE and the product bitwise torch's; the norm and SiLU within one bf16 unit of it).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from specopd_kernels import paths
from specopd_kernels.cbuild import Library, bf16_cpu_inference, cpu_inference

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer_ops_cpu.c")
MODES = paths.CHOICES["cpu_layer_ops"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.rms_norm_bf16.argtypes = [p, i64, p, p, i64, i64, i64, f32, i32, i32]
    lib.silu_mul_bf16.argtypes = [p, i64, p, i64, p, i64, i64, i64, i32]
    lib.rope_bf16.argtypes = [p, i64, i64, p, p, i64, p, i64, i64, i64, i64, i64, i64, i32]
    for f in (lib.rms_norm_bf16, lib.silu_mul_bf16, lib.rope_bf16):
        f.restype = None


LIB = Library(SOURCE, _declare)


def enabled(*tensors: torch.Tensor, kernel_paths: Optional[paths.KernelsConfig] = None) -> bool:
    """Whether the kernels take these tensors: all bf16 on the CPU, none needing a gradient, ``kernel_paths``'s
    ``cpu_layer_ops`` "auto" (None: "auto"), and the library available (``LIB.error`` says why not)."""
    return (bf16_cpu_inference(*tensors) and paths.mode(kernel_paths, "cpu_layer_ops") == "auto"
            and LIB.available())


@functools.lru_cache(maxsize=None)
def packing_available() -> bool:
    """torch has oneDNN with native bf16 matmuls on this CPU (AVX512-BF16 or AMX), so packed weights pay, and a
    probe gives ``F.linear``'s bits through them (checked once per process: the promise holds on every CPU)."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((5, 96), (80, 96), (80,)))
        return torch.equal(linear(x, PackedWeight().get(w), b), torch.nn.functional.linear(x, w, b))
    except (AttributeError, RuntimeError):  # a torch build without these ops
        return False


LINEAR_MODES = paths.CHOICES["cpu_linear"]


def linear_enabled(x: torch.Tensor, *weights: torch.Tensor | None,
                   kernel_paths: Optional[paths.KernelsConfig] = None) -> bool:
    """Whether ``linear`` takes x [..., K] and these weights / biases (None ones skipped): all bf16 (with
    ``kernel_paths``'s ``cpu_linear=all`` also all fp32) on the CPU outside autograd, x at least 2-D, ``cpu_layer_ops``
    "auto", ``cpu_linear`` not "torch" (None: both "auto"), and oneDNN bf16 here."""
    ws = [w for w in weights if w is not None]
    if x.dim() < 2 or paths.mode(kernel_paths, "cpu_layer_ops") != "auto":
        return False
    which = paths.mode(kernel_paths, "cpu_linear")
    if which == "torch" or not packing_available():
        return False
    return bf16_cpu_inference(x, *ws) or (which == "all" and cpu_inference(torch.float32, x, *ws))


class PackedWeight:
    """A linear weight [N, K] bf16 (or several [N_i, K] stacked along N) reordered once into oneDNN's blocked
    layout. ``get(*weights)`` repacks when a source changes (its storage or version counter), so in-place loads
    and updates are followed. The pack is a cache: copies and pickles of its owner start without one (oneDNN's
    opaque tensors cannot be copied). Memory: one more copy of the weights it packs."""

    def __init__(self):
        self._stamp: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, *weights: torch.Tensor) -> torch.Tensor:
        stamp = tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)
        if self._stamp != stamp:
            w = weights[0] if len(weights) == 1 else torch.cat(weights)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._stamp = stamp
        return self._packed

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = PackedWeight().get(weight)``, bit for bit (oneDNN runs the
    same blocked kernel either way; ``F.linear`` reorders the weight on every call).

    Args:
        x: [..., K] bf16 (any strides).
        packed: the packed weight [N, K].
        bias: [N] bf16 or None.

    Returns:
        [..., N] bf16.
    """
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``linear`` call: 2 * rows * K * N (what ``FlopCounterMode`` counts for ``F.linear``)."""
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return 2 * rows * int(w_shape[1]) * int(w_shape[0])


# FlopCounterMode(custom_mapping=FLOP_FORMULAS) counts packed linears as it counts F.linear's matmuls
FLOP_FORMULAS = {torch.ops.mkldnn._linear_pointwise: linear_flops}  # keyed by the op packet, as the counter looks up


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
