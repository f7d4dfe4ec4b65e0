"""Inverse-CDF token draws from rows of logits: a CPU kernel (``cpu.py``, C) and its plain reference
(``naive.py``). ``specopd.sampling`` uses the kernel for the drafter's branch sampling on the CPU."""
