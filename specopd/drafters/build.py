"""``build_drafter``: a fresh DFlash / DSpark / DFlash V2 drafter for a target (``DRAFTERS``: kind -> class), and
``shift_tokens`` (DSpark's teacher-forced previous tokens). Re-exported by ``specopd.drafters``."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specopd.drafters.dflash import (DFlashDrafter, choose_mask, default_target_layer_ids,
                                     target_config, target_identity, target_rope_theta)
from specopd.drafters.dflash2 import V2_KEYS, DFlash2Drafter
from specopd.drafters.dspark import DSparkDrafter
from specopd.drafters.eagle3 import EAGLE3_KEYS, Eagle3Drafter, eagle3_default_layers
from specopd.drafters.mtp import build_mtp, mtp_skeleton
from specopd.models.common import hand_down

DRAFTERS = {"dflash": DFlashDrafter, "dspark": DSparkDrafter, "dflash2": DFlash2Drafter, "eagle3": Eagle3Drafter}
Drafter = DFlashDrafter  # the base class of the block drafters (EAGLE-3: ``AutoregressiveDrafter``)

_OVERRIDES = {"num_heads": "num_heads", "num_attention_heads": "num_heads", "num_kv_heads": "num_kv_heads",
              "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
              "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "hidden_act": "hidden_act",
              "markov_rank": "markov_rank", "confidence_head": "confidence_head",
              "confidence_with_markov": "confidence_with_markov", **{k: k for k in V2_KEYS},
              **{k: k for k in EAGLE3_KEYS}}


def build_drafter(kind: str, target, num_layers: int = 1, block_size: int = 16, seed: int = 0,
                  feature_layers: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None,
                  target_dir: Optional[str] = None, **overrides):
    """A freshly initialised drafter for ``target`` (weights deterministic in ``seed``).

    Args:
        kind: "dflash" | "dspark" | "dflash2" (DFlash V2) | "mtp" (the target's own MTP head, from ``target_dir``;
            the other arguments but block_size do not apply).
        target: the TargetModel it drafts for (its embedding and lm_head are shared, frozen).
        num_layers: draft layers.
        block_size: counts the anchor (released: 16 drafts 15 tokens; DSpark's release uses 7).
        seed: weight init seed.
        feature_layers: target layer ids read as features; None: the released default (``default_target_layer_ids``).
        mask_token_id: None = automatic (``choose_mask``: the first id the tokenizer in ``target_dir`` leaves unused,
            as Qwen3's 151669, else a learned vector); an id = that token's frozen embedding; -1 = a learned vector.
        target_dir: the target's folder (its tokenizer, for the automatic mask).
        **overrides: num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta, hidden_act,
            markov_rank (DSpark's r, default 256), confidence_head, confidence_with_markov (default: the target's);
            DFlash V2: conv_kernel_size, conv_group_size (default: 16, or the largest divisor of hidden_size below
            it), selector_rank, selector_top_k (default 8, at most vocab_size), input_embedding_scale,
            output_multiplier, final_logit_softcapping (``DFlash2Config``); EAGLE-3: draft_vocab (the head's target
            ids, sorted; default: the whole vocabulary), norm_before_fc, norm_before_residual, own_embedding,
            attention_bias (``Eagle3Config``).

    Returns:
        DFlashDrafter, DSparkDrafter, DFlash2Drafter, Eagle3Drafter or MTPDrafter, running the target's
        ``kernel_paths``.
    """
    if kind == "mtp":  # the target's own head, loaded from its folder (architecture and weights are the folder's)
        if target_dir is None and torch.empty(0).device.type == "meta":  # a shape-only build (the memory plan)
            return mtp_skeleton(target, block_size)
        if target_dir is None:
            raise ValueError("an mtp drafter is the target's own MTP head: give target_dir (the target's folder)")
        return build_mtp(target, target_dir, block_size)
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {sorted(DRAFTERS) + ['mtp']}")
    allowed = sorted(k for k in _OVERRIDES if (kind == "dflash2" or k not in V2_KEYS)
                     and (kind == "eagle3" or k not in EAGLE3_KEYS))
    bad = sorted(set(overrides) - set(allowed))
    if bad:
        raise ValueError(f"unknown drafter override(s) {bad} for a {kind} drafter; allowed: {allowed} "
                         f"(hidden_size always equals the target's; {', '.join(V2_KEYS)}: DFlash V2 only; "
                         f"{', '.join(EAGLE3_KEYS)}: EAGLE-3 only)")
    d = int(target.hidden_size)
    heads = int(target_config(target, "num_attention_heads", max(1, d // 64)))
    sizes = dict(num_heads=heads, num_kv_heads=int(target_config(target, "num_key_value_heads", heads)),
                 head_dim=int(target_config(target, "head_dim", d // heads)),
                 intermediate_size=int(target_config(target, "intermediate_size", 4 * d)),
                 rms_norm_eps=float(target_config(target, "rms_norm_eps", 1e-6)), rope_theta=target_rope_theta(target))
    for k, v in overrides.items():
        sizes[_OVERRIDES[k]] = v
    if kind == "eagle3":
        drafter = build_eagle3(target, num_layers, block_size, seed, feature_layers, sizes)
        return hand_down(drafter, getattr(target, "kernel_paths", None))  # the target's kernels: section
    if feature_layers is None:
        feature_layers = default_target_layer_ids(target.num_layers, num_layers)
    if kind == "dflash2":
        sizes.setdefault("conv_group_size", max(g for g in range(1, 17) if d % g == 0))
        sizes.setdefault("selector_top_k", min(8, int(target.vocab_size)))
    mask_id, learned = choose_mask(target, mask_token_id, target_dir)
    cfg = DRAFTERS[kind].config_class(kind=kind, num_layers=int(num_layers), block_size=int(block_size),
                        feature_layers=tuple(int(i) for i in feature_layers), hidden_size=d,
                        mask_token_id=mask_id, learned_mask=learned, target=target_identity(target), **sizes)
    drafter = DRAFTERS[kind](target, cfg, seed=seed)
    return hand_down(drafter, getattr(target, "kernel_paths", None))  # the target's kernels: section


def build_eagle3(target, num_layers: int, block_size: int, seed: int, feature_layers, sizes: dict):
    """``build_drafter("eagle3", ...)``.

    Args:
        target, num_layers, block_size, seed: as ``build_drafter``.
        feature_layers: None: vLLM's aux layers (``eagle3_default_layers``).
        sizes: the architecture (``Eagle3Config`` fields); ``draft_vocab`` (target ids) sets the draft vocabulary.

    Returns:
        Eagle3Drafter.
    """
    vocab = sizes.pop("draft_vocab", None)
    if feature_layers is None:
        feature_layers = eagle3_default_layers(target.num_layers)
    if vocab is not None:
        vocab = torch.as_tensor(vocab, dtype=torch.long, device="cpu").reshape(-1).unique()  # cpu: also in a meta build
        sizes["draft_vocab_size"] = 0 if vocab.numel() == int(target.vocab_size) else int(vocab.numel())
    cfg = Eagle3Drafter.config_class(kind="eagle3", num_layers=int(num_layers), block_size=int(block_size),
                                     feature_layers=tuple(int(i) for i in feature_layers),
                                     hidden_size=int(target.hidden_size), target=target_identity(target), **sizes)
    d = Eagle3Drafter(target, cfg, seed=seed)
    if vocab is not None and cfg.draft_vocab_size and not d.lm_head.weight.is_meta:  # meta: the memory plan's shapes
        d.set_draft_vocab(vocab)
    return d


def shift_tokens(anchor_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """prev_tokens [N, W] for teacher forcing: ``cat([anchor_tokens[:, None], tokens[:, :-1]], 1)``."""
    return torch.cat([anchor_tokens.reshape(-1, 1).to(tokens), tokens[:, :-1]], 1)
