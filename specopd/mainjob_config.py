"""The recipe's ``pipeline:`` section (``PipelineConfig``): the main job's stages (``specopd.mainjob``). A leaf beside
it (imports only ``specopd.settings`` and ``specopd.errors``), so the recipe root can import it without the job."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from specopd.errors import is_finite_number
from specopd.settings import SAME_RUN, RecipeError, check_choice, check_range, setting


@dataclass
class PipelineConfig:
    """The main job (``specopd.mainjob``). Off by default: ``specopd train`` is plain training. Each key names its
    stage: ``data_*`` the references, ``warmup_*`` the warm-up stage, ``eval_*`` the before / after table."""
    enabled: bool = setting(False, resume=SAME_RUN)
    """On: prepare the target (model.target names a `specopd prepare model` target) and chat references on
    first use (cached), warm a fresh drafter up (pipeline.warmup_method) if no warm drafter exists, train with
    trainer.method from it, then print a held-out speculative-decoding AL table (before / after) and the profile."""
    data_num: int = setting(48, resume=SAME_RUN)
    """Distinct chat prompts (first turns of chitchat-dataset train conversations) the target answers (cached,
    resumable)."""
    data_max_new_tokens: int = setting(64, resume=SAME_RUN)
    """Response tokens generated per prompt."""
    data_temperature: float = setting(1.0, resume=SAME_RUN)
    """The temperature the target answers the prompts at (0: greedy); synthetic data's is
    ``data.synthetic_temperature``."""
    data_batch_size: int = setting(64, resume=SAME_RUN)
    """Prompts answered together by the built-in engine (one packed target pass per generated token)."""
    data_engine: str = setting("auto", resume=SAME_RUN)
    """Who answers the prompts: auto (vLLM when its venv is there, `make vllm`, else builtin) | builtin | vllm."""
    data_prompts: str = setting("first_turns", resume=SAME_RUN)
    """first_turns: distinct first user turns of train conversations; all_turns: then their later user turns too
    (58k prompts: pretraining). Held-out conversations' openings are never used."""
    warmup_steps: int = setting(20, resume=SAME_RUN)
    """Steps of the warm-up stage from a fresh drafter (0: none; trainer.method starts from drafter.init_from, else
    from a random drafter). Its learning rate warms up over min(trainer.lr_warmup_steps, these) steps."""
    warmup_method: str = setting("offpolicy_ce", resume=SAME_RUN)
    """Method of the warm-up: offpolicy_ce | offpolicy_e2e_tv (on the same references)."""
    warmup_lr: float = setting(3e-3, resume=SAME_RUN)
    """Peak learning rate of the warm-up (trainer.lr is the rate of the main training stage)."""
    warmup_min_lr_ratio: float = setting(0.1, resume=SAME_RUN)
    """The warm-up's cosine schedule ends at warmup_lr * this (1.0: constant after the linear warmup)."""
    eval_temperatures: List[float] = setting(factory=lambda: [0.0, 1.0], resume=SAME_RUN)
    """Decoding temperatures of the before / after table (0: greedy, acceptance = exact match); ``specopd eval``
    decodes at ``eval.decode_temperature``."""

    def __post_init__(self):
        check_range("pipeline", "data_num", self.data_num, lo=2)
        check_range("pipeline", "data_max_new_tokens", self.data_max_new_tokens, lo=1)
        check_range("pipeline", "data_temperature", self.data_temperature, lo=0)
        check_range("pipeline", "data_batch_size", self.data_batch_size, lo=1)
        check_choice("pipeline", "data_engine", self.data_engine, ["auto", "builtin", "vllm"])
        check_choice("pipeline", "data_prompts", self.data_prompts, ["first_turns", "all_turns"])
        check_range("pipeline", "warmup_steps", self.warmup_steps, lo=0)
        check_choice("pipeline", "warmup_method", self.warmup_method, ["offpolicy_ce", "offpolicy_e2e_tv"])
        check_range("pipeline", "warmup_lr", self.warmup_lr, lo=0, lo_open=True)
        check_range("pipeline", "warmup_min_lr_ratio", self.warmup_min_lr_ratio, lo=0, hi=1)
        if not self.eval_temperatures or any(not is_finite_number(t) or t < 0 for t in self.eval_temperatures):
            raise RecipeError(f"pipeline.eval_temperatures={list(self.eval_temperatures)} must list one or more "
                              f"temperatures >= 0 (0 = greedy)")
