"""Helpers for the Triton kernel tests (tests/test_kernels_*.py).

On CUDA a check runs in-process on the device. On the CPU it runs in a fresh interpreter with
TRITON_INTERPRET=1: triton decides between compiling and interpreting when a kernel is decorated, i.e. when its
module is first imported, so the flag cannot be switched on inside a pytest process that may already have
imported a kernel module.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from specopd_kernels.cpu_features import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The interpreter runs tl.dot as numpy's matmul (OpenBLAS). OpenBLAS's Haswell / Zen sgemm kernels give an element
# bits that depend on its row's and column's place in the tile (measured on an AVX2 AMD EPYC, 2026-12-02: a block's
# node keys moved from columns 0..7 to 12..19 change their scores' last bits), unlike a GPU's dot, where every
# element is the same FMA chain. Packed scoring then differs from one-by-one in the last bit under the interpreter
# only. The Sandybridge kernel (AVX, on every x86-64 machine these tests run on) has no such dependence.
BLAS_CORE = "Sandybridge"


def interpreter_env() -> dict:
    """The environment of a process that runs Triton kernels interpreted on the CPU: TRITON_INTERPRET=1, one
    thread, tests/ importable, and on x86-64 a position-independent OpenBLAS kernel for numpy's matmul
    (``BLAS_CORE``, also over an OPENBLAS_CORETYPE the machine sets: another kernel, e.g. Haswell, makes packed
    and one-by-one scoring differ in the last bit under the interpreter, and the tests compare them bitwise)."""
    import platform

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    if platform.machine() in ("x86_64", "AMD64"):
        env["OPENBLAS_CORETYPE"] = BLAS_CORE
    return env


def c_kernels_expected() -> bool:
    """AVX-512 F, or AVX2 + FMA, and a C compiler: the CPU C kernels of kernels/e2e_tv and kernels/sampling must
    build here (kernels/simd.h); a silent fallback to torch would hide a broken kernel. (kernels/layer_ops, bf16
    only, needs AVX-512 F / BW / VL, which every CPU with native bf16 has.)"""
    flags = cpu_flags()
    simd = "avx512f" in flags or {"avx2", "fma"} <= flags
    return simd and bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for two empty or all-zero tensors that agree)."""
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if b.numel() == 0:
        return 0.0
    den = float(b.abs().max())
    num = float((a - b).abs().max())
    return num / den if den > 0 else num


def lowp_check(got: torch.Tensor, exact: torch.Tensor, rounded: torch.Tensor, factor: float = 2.5,
               what: str = "") -> float:
    """A low-precision kernel result against measured noise: ``exact`` = the fp32 reference on the fp32 inputs,
    ``rounded`` = the same reference on the inputs rounded to the kernel's dtype. Noise = rel(rounded, exact);
    asserts rel(got, exact) <= factor * noise (the kernel may round its intermediates and output too, each about
    as much as its inputs). Returns the error."""
    noise, err = rel(rounded, exact), rel(got, exact)
    print(f"{what}: error {err:.2e}, input rounding noise {noise:.2e} (bound {factor:g}x)")
    assert 0 < noise and err <= factor * noise, (what, err, noise)
    return err


def run(test_file: str, check: str, *args: str, timeout: int = 300) -> None:
    """Run ``check`` (a name that ``test_file``'s ``__main__`` dispatches) in-process on CUDA, else interpreted."""
    if torch.cuda.is_available():
        import importlib.util

        spec = importlib.util.spec_from_file_location("_kernel_test_mod", test_file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.CHECKS[check](*args)
        return
    r = subprocess.run([sys.executable, test_file, check, *args], env=interpreter_env(), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0 and f"{check} ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def strict_interpreted_dots() -> None:
    """Make the Triton interpreter (this process runs under TRITON_INTERPRET=1) refuse a ``tl.dot`` whose block dims
    (M, N, K) are not all >= ``specopd_kernels.dot.MIN_DOT``, as the AOT compile does (``tests/aot_kernels.strict_dot_rule``):
    the interpreter checks none, so an interpreted test would pass a launch that a GPU refuses. Our kernels' tests and
    the interpreted executor tests run under it; fla's (``tests/test_fla.py``) do not: fla follows triton's rule."""
    from triton.runtime import interpreter

    from specopd_kernels.dot import MIN_DOT

    fns = interpreter.interpreter_builder.codegen_fns  # the interpreter's one builder; raises if that changes
    if "min_dot_size" not in fns:
        raise RuntimeError("the Triton interpreter has no min_dot_size hook any more: update kernel_check.py")
    fns["min_dot_size"] = lambda lhs, rhs: (MIN_DOT, MIN_DOT, MIN_DOT)


def main(checks: dict, strict_dots: bool = True) -> None:
    """``python test_file.py CHECK [ARGS...]``: run one check (under TRITON_INTERPRET=1 when on the CPU, with
    ``strict_interpreted_dots`` unless ``strict_dots`` is False)."""
    torch.set_num_threads(1)
    if strict_dots and os.environ.get("TRITON_INTERPRET") == "1":
        strict_interpreted_dots()
    name, args = sys.argv[1], sys.argv[2:]
    checks[name](*args)
    print(f"{name} ok")


def kernel_modes() -> list:
    """pytest params of the executor tests' ``kernels`` fixture: "torch", and "triton" where the Triton kernels
    can run on the CPU targets these tests build, i.e. in a process started with TRITON_INTERPRET=1
    (``tests/test_executor_kernels.py`` reruns the executor test files so, with ``-k triton``)."""
    import pytest

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return ["torch", pytest.param("triton", marks=pytest.mark.skipif(
        not interpreted, reason="Triton kernels on the CPU run only under TRITON_INTERPRET=1: "
                                "tests/test_executor_kernels.py runs these so"))]

