"""What this CPU can do, read from /proc/cpuinfo (standard library only: the recipe module reads it too, to resolve
``model.dtype: auto``)."""
from __future__ import annotations


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return set()


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Without either (or off Linux: float32
    under auto), torch's bf16 matmuls are emulated, far slower than fp32
    (benchmarks/results/2026-12-02-smollm2-135m-no-native-bf16-avx2-epyc.md)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
