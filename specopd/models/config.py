"""The recipe's ``model:`` section: the frozen target (``ModelConfig``). A leaf beside the models (imports only
``specopd.settings``); ``model.dtype: auto`` is resolved by the recipe root (``specopd.config.auto_dtype``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from specopd.settings import FROM_HERE, REFUSE, SAME_RUN, check_choice, check_range, setting

TINY_PREFIX = "tiny:"
TINY_MODEL_TYPES = ("llama", "qwen3_next", "qwen4_exp")


@dataclass
class ModelConfig:
    target: str = setting("tiny:llama", resume=REFUSE)
    """The target model: a Hugging Face folder (config.json + safetensors), or ``tiny:<model_type>``
    (llama | qwen3_next | qwen4_exp) for a tiny random target built deterministically from ``tiny_seed``
    and written as a real safetensors folder under ``<output_dir>/tiny-target``."""
    dtype: str = setting("float32", resume=FROM_HERE)
    """Target dtype: float32 | bfloat16 | float16 | auto (``auto_dtype``: bfloat16 on CUDA and on CPUs with native
    bf16 matmuls, AMX-BF16 or AVX512-BF16, else float32; resolved when the recipe is read). The drafter keeps
    fp32 master weights."""
    device: str = setting("cpu", resume=SAME_RUN)
    """cpu | cuda | auto (cuda when available)."""
    tiny_seed: int = setting(0, resume=REFUSE)
    """Seed of the tiny random target's weights (only for ``tiny:`` targets)."""
    tiny: Dict[str, Any] = setting(factory=dict, resume=REFUSE)
    """Overrides of the tiny target's config.json entries (e.g. ``{hidden_size: 64}``)."""
    gdn_checkpoint_every: int = setting(64, resume=SAME_RUN)
    """GDN layers: keep a recurrent-state checkpoint every C trunk tokens (branches replay < C steps)."""
    kernels: str = setting("auto", resume=FROM_HERE)
    """How the target's executors run prefill / score / verify / commit (``load_target(..., kernels=)``):
    auto (Triton kernels and fla on CUDA, torch on the CPU) | torch (plain torch, any device) | triton (the
    Triton kernels: CUDA; on the CPU only interpreted, with TRITON_INTERPRET=1)."""
    shape: Dict[str, Any] = setting(factory=dict, resume=FROM_HERE)
    """config.json entries of the target (model_type, hidden_size, vocab_size, ...) for the memory plan of
    ``specopd train --dry-run`` when the target folder is not on this machine; its config.json wins when it is."""
    gpu_memory_gb: Optional[float] = setting(None, resume=SAME_RUN)
    """The GPU the memory plan checks against, in GB (10^9 bytes), when no CUDA device is visible (the plan of a
    recipe for another machine); null: 80. A visible GPU's own memory wins."""

    def __post_init__(self):
        if self.gpu_memory_gb is not None:
            check_range("model", "gpu_memory_gb", self.gpu_memory_gb, lo=1)
        if self.target.startswith(TINY_PREFIX):
            check_choice("model", "target", self.target, [TINY_PREFIX + t for t in TINY_MODEL_TYPES] + ["<HF folder>"])
        check_choice("model", "dtype", self.dtype, ["float32", "bfloat16", "float16", "auto"])
        check_choice("model", "device", self.device, ["cpu", "cuda", "auto"])
        check_range("model", "gdn_checkpoint_every", self.gdn_checkpoint_every, lo=1)
        check_choice("model", "kernels", self.kernels, ["auto", "torch", "triton"])

    @property
    def is_tiny(self) -> bool:
        return self.target.startswith(TINY_PREFIX)
