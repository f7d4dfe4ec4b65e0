"""Causal GQA attention over packed sequences: a bf16 CPU kernel (``cpu.py``, C with AVX512-BF16) and its plain
fp32 reference (``naive.py``). ``specopd_executors.gqa`` uses the kernel for bf16 prefill on CPUs without AMX."""
