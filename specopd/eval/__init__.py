"""Evaluation: speculative decoding with a drafter (``SpeculativeDecoder``) and AL measurement."""
from specopd.eval.decoder import GenerationResult, SpeculativeDecoder, autoregressive  # noqa: F401
