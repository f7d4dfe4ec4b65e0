"""Build a CPU kernel's C source on first use and load it with ctypes (the one owner of that for ``kernels/``).

The system C compiler (``$CC``, else ``cc`` / ``gcc``) with ``-O3 -march=native -fopenmp`` (``FLAGS``; no
fast-math) into ``$SPECOPD_CACHE/kernels`` (default ``~/.cache/specopd/kernels``): one file per source, flags and
CPU, written atomically (parallel workers may build at once). OpenMP threads come from the runtime torch has
already loaded. Also what the kernels' switches share: ``bf16_cpu_inference`` / ``cpu_inference`` (the tensors a CPU kernel takes).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Callable, Optional

import torch

from specopd_kernels.cpu_features import cpu_flags

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simd.h")  # shared helpers, in every key
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def _cpu_key() -> str:
    return " ".join(sorted(cpu_flags())) + platform.machine()


def build_dir() -> str:
    root = os.environ.get("SPECOPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specopd")
    return os.path.join(root, "kernels")


def build(source: str, defines: tuple = ()) -> ctypes.CDLL:
    """Compile ``source`` (a .c path) with ``-D`` ``defines`` unless a build for these flags and this CPU exists;
    load it.

    Raises:
        RuntimeError: no compiler, or it failed (its stderr in the message).
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc / $CC) on PATH")
    src = open(source, "rb").read() + open(HEADER, "rb").read()
    flags = FLAGS + [f"-D{d}" for d in defines]
    key = hashlib.sha256(src + " ".join([cc] + flags).encode() + _cpu_key().encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(build_dir(), f"{name}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(build_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir())
        os.close(fd)
        try:
            cmd = [cc, *flags, "-I", os.path.dirname(HEADER), source, "-o", tmp, "-lm"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{cc} failed to build {source}:\n{out.stderr[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return ctypes.CDLL(path)


def cpu_inference(dtype: torch.dtype, *tensors) -> bool:
    """All ``tensors`` of ``dtype`` on the CPU and none needing a gradient."""
    if not all(t.dtype == dtype and t.device.type == "cpu" for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def bf16_cpu_inference(*tensors) -> bool:
    """All ``tensors`` bf16 on the CPU and none needing a gradient: what the CPU kernels take."""
    return cpu_inference(torch.bfloat16, *tensors)


class Library:
    """A kernel library built and loaded once per process on first ``get()``; ``declare(lib)`` sets argtypes."""

    def __init__(self, source: str, declare: Callable[[ctypes.CDLL], None], defines: tuple = ()):
        self.source, self._declare, self.defines = source, declare, tuple(defines)
        self._lock = threading.Lock()
        self._lib: Optional[ctypes.CDLL] = None
        self.error: Optional[str] = None

    def available(self) -> bool:
        """True when the library is built (or builds now) and loads; else ``error`` says why."""
        if self._lib is not None:  # the common case, asked per layer: no lock
            return True
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    lib = build(self.source, self.defines)
                    self._declare(lib)
                    self._lib = lib
                except (OSError, RuntimeError) as e:
                    self.error = str(e)
            return self._lib is not None

    def variant(self, defines: tuple) -> "Library":
        """The same source and declarations built with other ``-D`` defines (e.g. ``SPECOPD_SIMD_AVX2``: the
        AVX2 form of kernels/simd.h on an AVX-512 CPU, for tests/test_kernels_simd.py)."""
        return Library(self.source, self._declare, defines)

    def reason(self) -> Optional[str]:
        """Why the library is not available (it tries to build first), or None when it is."""
        self.available()
        return self.error

    def get(self) -> ctypes.CDLL:
        if not self.available():
            raise RuntimeError(f"the CPU kernel {os.path.basename(self.source)} is not available: {self.error}")
        return self._lib
