"""Gated delta rule (Gated DeltaNet): the plain recurrence (``naive``) and, on CUDA, a Triton kernel."""
from kernels.gated_delta.naive import gated_delta_step, recurrent_gated_delta_rule  # noqa: F401
