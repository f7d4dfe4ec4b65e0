"""The recipe's ``eval:`` section (``EvalConfig``): ``specopd eval`` and the main job's before / after table. A leaf
beside the evaluation code (imports only ``specopd.settings``)."""
from __future__ import annotations

from dataclasses import dataclass

from specopd.settings import SAME_RUN, check_choice, check_range, setting


@dataclass
class EvalConfig:
    prompts: int = setting(8, resume=SAME_RUN)
    """Number of held-out prompts decoded by ``specopd eval`` (with ``--prompts FILE``: its first N, the only lines
    read)."""
    max_new_tokens: int = setting(32, resume=SAME_RUN)
    """Tokens generated per prompt."""
    decode_temperature: float = setting(0.0, resume=SAME_RUN)
    """``specopd eval``'s decoding temperature when ``--temperatures`` is not given (0 = greedy, acceptance = exact
    match with the target's argmax). The main job's table decodes at ``pipeline.eval_temperatures``; training
    samples at ``trainer.acceptance_temperature``."""
    checkpoint: str = setting("latest", resume=SAME_RUN)
    """Drafter to evaluate: latest (newest checkpoint of trainer.output_dir) | none (untrained) | a folder."""
    seed: int = setting(0, resume=SAME_RUN)
    """Seed of the decoding generator."""
    dtype: str = setting("auto", resume=SAME_RUN)
    """The target's dtype when decoding and judging: auto (= model.dtype) | float32 | bfloat16 | float16. float32
    keeps the judge's exact checks (T = 0 token equality with vLLM) for a drafter trained on a bf16 target."""
    bench: str = setting("chat", resume=SAME_RUN)
    """The main job's before / after prompts: chat (held-out chitchat first turns, eval.prompts of them) | mt-bench
    (MT-Bench's 80 first turns in vLLM; ours on eval.prompts of them, the same number from each category)."""

    def __post_init__(self):
        check_choice("eval", "dtype", self.dtype, ["auto", "float32", "bfloat16", "float16"])
        check_choice("eval", "bench", self.bench, ["chat", "mt-bench"])
        check_range("eval", "prompts", self.prompts, lo=1)
        check_range("eval", "max_new_tokens", self.max_new_tokens, lo=1)
        check_range("eval", "decode_temperature", self.decode_temperature, lo=0)

    def target_dtype(self, model_dtype: str) -> str:
        """The target dtype of decoding and judging: ``eval.dtype``, or ``model_dtype`` (the recipe's
        ``model.dtype``) when it is auto."""
        return model_dtype if self.dtype == "auto" else self.dtype
