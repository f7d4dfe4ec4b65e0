"""What every Triton kernel's ``tl.dot`` needs from its launcher: block dims of at least ``MIN_DOT`` and IEEE
fp32 dots for fp32 inputs. Why: kernels/DESIGN.md ("tl.dot: block dims and precision")."""
from __future__ import annotations

import torch

MIN_DOT = 16  # every dim of a tl.dot tile (M, N and K) on NVIDIA GPUs: smaller blocks are padded to it


def dot_block(n: int) -> int:
    """The block size of a dim that reaches ``tl.dot``: the next power of two of ``n``, at least ``MIN_DOT`` (the
    kernels mask the padding on every load and store, so a small head dim computes the same values)."""
    return max(MIN_DOT, 1 << max(int(n) - 1, 0).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` of a kernel's dots for inputs of ``dtype``: "ieee" for fp32 (triton's default fp32 dot
    is TF32 on sm_80+, ~1e-3 relative, which the fp32 exactness contract does not allow), else "tf32" (16-bit
    operands ignore it; fp32 tiles cast from them round to their own noise)."""
    return "ieee" if dtype == torch.float32 else "tf32"
