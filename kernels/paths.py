"""Which compute path an op runs where there is a choice: the CPU (C) kernels and the drafter's attention.

The recipe's ``kernels:`` section (``KernelsConfig``, defined here) is the one description of the choice. It is
handed down, never kept in a process-wide table: ``load_target(..., kernel_paths=)`` gives it to the target's layers
and executors (``ExecOptions.kernel_paths``), a drafter takes its target's, and the fused losses and the sampler take
it as an argument; each op reads its value with ``mode(choice, name)``. None (outside a recipe: a script, a test)
is "auto" everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

CHOICES = {  # name -> its values, "auto" (the default) first
    "cpu_attention": ("auto", "cpu", "torch"),  # bf16 causal and tree attention in C (kernels/causal_attention)
    "cpu_layer_ops": ("auto", "torch"),  # bf16 RMSNorm, SiLU * up, RoPE in C and packed linear layers (layer_ops)
    "cpu_linear": ("auto", "torch", "all"),  # linear layers with weights packed once for oneDNN (layer_ops)
    "cpu_tv_loss": ("auto", "cpu", "torch"),  # the fused E2E-TV's alpha and gradient in C (kernels/e2e_tv)
    "cpu_sampling": ("auto", "cpu", "torch"),  # draws at T > 0 in C (kernels/sampling)
    "drafter_attention": ("auto", "chunked", "flex"),  # the drafter's branch attention (specopd/drafters)
}

# every path may change on a resume and takes effect from the resumed step on: the recipe's resume policy
# "from_here" (specopd.settings.FROM_HERE; kernels/ imports nothing from specopd)
_FROM_HERE = {"resume": "from_here"}


class PathChoiceError(ValueError):
    """A ``kernels:`` value outside its ``CHOICES`` (the recipe loader reports it as a recipe error)."""


@dataclass
class KernelsConfig:
    """The recipe's ``kernels:`` section: one field per ``CHOICES`` name, each "auto" by default (the fastest path
    that is exact to its promise on this machine)."""
    cpu_attention: str = field(default="auto", metadata=_FROM_HERE)
    """bf16 causal and tree attention in C (kernels/causal_attention): auto (on CPUs with AVX512-BF16 and no AMX) |
    cpu (wherever it builds; an error where it does not) | torch (torch's attention everywhere)."""
    cpu_layer_ops: str = field(default="auto", metadata=_FROM_HERE)
    """bf16 RMSNorm, SiLU * up and RoPE in C, and packed linear layers (kernels/layer_ops): auto | torch."""
    cpu_linear: str = field(default="auto", metadata=_FROM_HERE)
    """Linear layers with the weight packed once for oneDNN: auto (bf16; F.linear's bits) | torch (F.linear) | all
    (fp32 too: oneDNN's fp32 kernel, not F.linear's bits)."""
    cpu_tv_loss: str = field(default="auto", metadata=_FROM_HERE)
    """The fused E2E-TV's alpha and gradient in C (kernels/e2e_tv): auto | cpu (an error if it does not build) |
    torch."""
    cpu_sampling: str = field(default="auto", metadata=_FROM_HERE)
    """Draws at T > 0 in C (kernels/sampling): auto | cpu (an error if it does not build) | torch."""
    drafter_attention: str = field(default="auto", metadata=_FROM_HERE)
    """The drafter's branch attention: auto (flex_attention on CUDA when it compiles, else chunked) | chunked |
    flex."""

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise PathChoiceError(f"kernels.{name}={value!r} is not valid; choose one of {list(choices)}")


def mode(choice: Optional[KernelsConfig], name: str) -> str:
    """``choice``'s value for ``name`` (one of ``CHOICES``); None (no recipe) is "auto". A value outside
    ``CHOICES[name]`` (a field changed after the check) is a ValueError naming the recipe key."""
    if name not in CHOICES:
        raise ValueError(f"kernels.{name}: no such compute path; the paths are {sorted(CHOICES)}")
    value = "auto" if choice is None else getattr(choice, name)
    if value not in CHOICES[name]:
        raise ValueError(f"kernels.{name}={value!r}: use one of {CHOICES[name]}")
    return value
