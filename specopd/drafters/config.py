"""The recipe's ``drafter:`` section (``DrafterRecipeConfig``): which drafter trains and how it starts. The
drafter's architecture itself is ``specopd.drafters.DrafterConfig``. A leaf beside the drafters (imports only
``specopd.settings``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from specopd.settings import FROM_HERE, REFUSE, SAME_RUN, RecipeError, check_choice, check_range, setting


class MissingInitFrom(RecipeError):
    """drafter.init_from names no folder; ``path`` is that name (``specopd train --dry-run`` still plans the
    recipe's drafter shape: a shipped drafter's folder may not be made yet)."""

    def __init__(self, msg: str, path: str):
        super().__init__(msg)
        self.path = path


@dataclass
class DrafterRecipeConfig:
    """The recipe's drafter: section (the drafter's architecture itself is ``specopd.drafters.DrafterConfig``)."""
    kind: str = setting("dflash", resume=REFUSE)
    """dflash (parallel block drafter) | dspark (DFlash + Markov head + confidence head) | dflash2 (DFlash V2 as vLLM
    serves it: convolutions along the block, a top-K candidate selector drafted slot by slot) | eagle3 (EAGLE-3 as
    vLLM / SpecForge: one token per step on its own hidden state; block_size - 1 steps) | mtp (the target's own MTP
    head, qwen3_next / qwen3_5: loaded from the target folder, or from drafter.init_from; block_size - 1 steps)."""
    num_layers: int = setting(1, resume=REFUSE)
    """Number of drafter decoder layers."""
    block_size: int = setting(5, resume=REFUSE)
    """Block length counting the anchor, as released ("b16" = 16): each branch drafts W = block_size - 1
    tokens (drafter.draft_len). >= 2."""
    ttt_steps: Optional[int] = setting(None, resume=REFUSE)
    """Autoregressive drafters (eagle3, mtp): the steps a training branch is unrolled (SpecForge's ttt_length, 7 in its
    recipes), apart from block_size - 1, the steps drafted when served; null: block_size - 1. Draft-OPD drafts as
    served, so it takes no other value."""
    draft_vocab_size: Optional[int] = setting(None, resume=REFUSE)
    """EAGLE-3, a fresh drafter: its head covers the draft_vocab_size target ids most frequent in the training data's
    responses (SpecForge's draft_vocab_size, 32000 in its Llama-3 / Qwen3 releases; d2t / t2d as released, recorded
    in the checkpoint); null: the whole vocabulary (or architecture.draft_vocab's ids)."""
    feature_layers: Optional[List[int]] = setting(None, resume=REFUSE)
    """Target layer ids whose hidden states the drafter reads (released dflash_config.target_layer_ids);
    null -> the released default for num_layers: round(1 + i * (L - 4) / (n - 1)), one layer: [L // 2]."""
    mask_token_id: Optional[int] = setting(None, resume=FROM_HERE)
    """The MASK token whose frozen target embedding fills the drafted slots. null: the first id the target's
    tokenizer leaves unused (Qwen3: 151669, as released), else (no spare id) a learned mask vector; -1: always
    a learned vector (exported as mask_embedding.pt)."""
    init_from: Optional[str] = setting(None, resume=SAME_RUN)
    """A drafter folder to start from: ours (a checkpoint step folder) or a released DFlash / DSpark / DFlash V2 folder
    (config.json with dflash_config + safetensors, e.g. z-lab/Qwen3-8B-DFlash-b16); for drafter.kind mtp also a
    qwen3_next / qwen3_5 target folder (its mtp.* head) or an MTP export."""
    confidence_weight: float = setting(0.1, resume=FROM_HERE)
    """DSpark: weight of the confidence-head loss (ignored for dflash)."""
    architecture: Dict[str, Any] = setting(factory=dict, resume=REFUSE)
    """More architecture settings of a fresh drafter, as ``build_drafter`` takes them (ignored with init_from, whose
    folder has its own): DSpark's markov_rank, confidence_head, confidence_with_markov; DFlash V2's conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k, input_embedding_scale, output_multiplier,
    final_logit_softcapping (e.g. drafter.architecture.selector_top_k=32); also num_heads, num_kv_heads, head_dim,
    intermediate_size (default: the target's). An unknown key is an error naming the allowed ones."""

    def __post_init__(self):
        check_choice("drafter", "kind", self.kind, ["dflash", "dspark", "dflash2", "eagle3", "mtp"])
        check_range("drafter", "num_layers", self.num_layers, lo=1)
        if self.block_size < 2:
            raise RecipeError(f"drafter.block_size={self.block_size!r} is out of range: it counts the anchor, as "
                              f"released (16 drafts 15 tokens), so it must be >= 2")
        if self.ttt_steps is not None:
            check_range("drafter", "ttt_steps", self.ttt_steps, lo=1)
        if self.draft_vocab_size is not None:
            check_range("drafter", "draft_vocab_size", self.draft_vocab_size, lo=1)
            if self.kind != "eagle3" or "draft_vocab" in self.architecture:
                raise RecipeError(f"drafter.draft_vocab_size={self.draft_vocab_size} chooses an EAGLE-3 head's "
                                  f"vocabulary from the data: set drafter.kind=eagle3 and leave out "
                                  f"drafter.architecture.draft_vocab (or remove drafter.draft_vocab_size)")
        if self.mask_token_id is not None and self.mask_token_id < -1:
            raise RecipeError(f"drafter.mask_token_id={self.mask_token_id}: give a token id, -1 (learned vector) "
                              f"or null (automatic)")
        check_range("drafter", "confidence_weight", self.confidence_weight, lo=0)
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise MissingInitFrom(f"drafter.init_from={self.init_from!r}: no such folder (give a drafter folder "
                                  f"with config.json + safetensors: <output_dir>/checkpoints/step-N, or a released "
                                  f"DFlash / DSpark / EAGLE-3 folder; a shipped drafter not made yet is made by "
                                  f"`specopd export <its pretraining run>/checkpoints/step-N {self.init_from}`, "
                                  f"as the recipe's comments say)", self.init_from)

    def train_steps(self, drafter, method: str) -> int:
        """W of a training branch for ``drafter`` (built from this section) under ``trainer.method``: ``ttt_steps``
        when set (an autoregressive drafter only), else ``drafter.draft_len``."""
        w = int(drafter.draft_len)
        if self.ttt_steps is None:
            return w
        if not getattr(drafter, "autoregressive", False):
            raise RecipeError(f"drafter.ttt_steps={self.ttt_steps}: a {drafter.kind} drafter drafts its whole block in "
                              f"one pass, so it trains on block_size - 1 = {w} tokens; remove drafter.ttt_steps")
        if method == "draft_opd" and self.ttt_steps != w:
            raise RecipeError(f"drafter.ttt_steps={self.ttt_steps}: Draft-OPD trains on the drafts as served "
                              f"(block_size - 1 = {w} steps); remove drafter.ttt_steps or set it to {w}")
        return int(self.ttt_steps)
