"""ExecOptions: how the executors run the layers of one target call.

A TargetCache keeps the options it was prefilled with (``cache.options``; an extension keeps them); every
target call hands ``target.run_options(cache.options)`` (the target's ``kernels`` and ``kernel_paths`` filled in)
to each layer's executor. Each field is read by one executor; the values are checked where they are read (an
unknown name is a ValueError naming the choices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specopd_kernels.paths import KernelsConfig

DEFAULT_CHECKPOINT_EVERY = 64  # GDN: tokens between two fp32 state checkpoints of a trunk
DEFAULT_QSA_SCORE_BYTES = 1 << 28  # QSA score: the key stage works in node chunks of <= this many bytes


@dataclass
class ExecOptions:
    kernels: Optional[str] = None  # "auto" | "torch" | "triton"; None: the target's (load_target(kernels=))
    kernel_paths: Optional[KernelsConfig] = None  # the recipe's kernels: section; None: the target's, else all "auto"
    gdn_checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY  # GDN prefill: an fp32 state checkpoint every C tokens
    gdn_keep_checkpoints: bool = True  # GDN prefill: False (decoding) keeps only the final state
    gdn_prefill: str = "auto"  # GDN Triton prefill: "auto" | "chunk" | "fla" | "recurrent"
    gqa_backend: str = "auto"  # GQA attention: "auto" | "blocked" | "triton" | "cpu" | "dense" | "sdpa"
    varlen_backend: str = "auto"  # GQA packed causal prefill: "auto" | "flash_attn" | "torch" | "cpu" | "loop"
    qsa_prefill_chunk: int = 1024  # QSA prefill: queries per attention block
    qsa_score_bytes: int = DEFAULT_QSA_SCORE_BYTES  # QSA score: bytes per node chunk of the key stage
    qsa_record: Optional[dict] = None  # QSA (tests): receives {layer_idx: selected groups [Q, topk]} when a dict


def as_options(options: Optional[ExecOptions]) -> ExecOptions:
    """``options``, or the defaults for None (an executor called directly)."""
    return options if options is not None else ExecOptions()
