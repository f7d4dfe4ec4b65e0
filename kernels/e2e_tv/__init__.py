"""alpha = sum_v min(q, p) over rows of logits and its gradient: a CPU kernel (``cpu.py``, C) and its plain
reference (``naive.py``). ``specopd.losses`` uses the kernel for the fused E2E-TV loss on the CPU."""
