"""Gated delta rule (Gated DeltaNet): the plain recurrence and the tree-replay reference (``naive``); Triton
kernels (import explicitly): ``fused_recurrent`` (token-serial), ``chunk`` (chunked WY form, fp32 chunk states as
checkpoints), ``replay`` (fused checkpoint -> trunk -> branch replay); ``fla_chunk`` (fla on CUDA, untested)."""
from specopd_kernels.gated_delta.naive import gated_delta_step, recurrent_gated_delta_rule  # noqa: F401
