"""Drafters: ``build_drafter(kind, target, ...)`` and ``load_drafter(dir, target)``.

kinds: "dflash" (parallel block drafter, specopd/drafters/dflash.py) and "dspark" (DFlash + Markov head
+ confidence head, dspark.py). Common API (N branches, W = block_size, V = vocab):
``drafter(features, anchors, trunk_index, anchor_tokens, prev_tokens) -> logits [N, W, V]``,
``drafter.sample(features, anchors, trunk_index, anchor_tokens, temperature, generator) -> (tokens, logits)``,
``drafter.save(dir)``, ``load_drafter(dir, target)`` (== ``DFlashDrafter.load(dir, target)``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specopd.drafters.dflash import DFlashDrafter, DrafterConfig, _tcfg, target_identity, target_rope_theta
from specopd.drafters.dspark import DSparkDrafter
from specopd.speculative import pick_tokens  # re-export: it lives with the speculative round

DRAFTERS = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}
Drafter = DFlashDrafter  # the base class: ``Drafter.load(dir, target)`` loads any kind

_OVERRIDES = {"num_heads": "num_heads", "num_attention_heads": "num_heads", "num_kv_heads": "num_kv_heads",
              "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
              "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "qk_norm": "qk_norm",
              "hidden_act": "hidden_act", "markov_rank": "markov_rank"}


def build_drafter(kind: str, target, num_layers: int = 1, block_size: int = 16, seed: int = 0,
                  feature_layers: Optional[Sequence[int]] = None, **overrides):
    """A freshly initialised drafter for ``target`` (weights deterministic in ``seed``).

    Sizes default to the target's (hidden, heads, kv heads, head_dim, intermediate, rms eps, rope theta);
    ``overrides`` may set num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta,
    qk_norm, hidden_act, markov_rank (DSpark's r, default 256). feature_layers None ->
    ``target.default_feature_layers()``.
    """
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {sorted(DRAFTERS)}")
    bad = sorted(set(overrides) - set(_OVERRIDES))
    if bad:
        raise ValueError(f"unknown drafter override(s) {bad}; allowed: {sorted(_OVERRIDES)} "
                         f"(hidden_size always equals the target's)")
    d = int(target.hidden_size)
    heads = int(_tcfg(target, "num_attention_heads", max(1, d // 64)))
    sizes = dict(num_heads=heads, num_kv_heads=int(_tcfg(target, "num_key_value_heads", heads)),
                 head_dim=int(_tcfg(target, "head_dim", d // heads)),
                 intermediate_size=int(_tcfg(target, "intermediate_size", 4 * d)),
                 rms_norm_eps=float(_tcfg(target, "rms_norm_eps", 1e-6)), rope_theta=target_rope_theta(target))
    for k, v in overrides.items():
        sizes[_OVERRIDES[k]] = v
    if feature_layers is None:
        feature_layers = target.default_feature_layers()
    cfg = DrafterConfig(kind=kind, num_layers=int(num_layers), block_size=int(block_size),
                        feature_layers=tuple(int(i) for i in feature_layers), hidden_size=d,
                        target=target_identity(target), **sizes)
    return DRAFTERS[kind](target, cfg, seed=seed)


def load_drafter(path: str, target):
    """Load a drafter saved with ``drafter.save(path)`` for ``target`` (kind read from config.json)."""
    return DFlashDrafter.load(path, target)


def shift_tokens(anchor_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """prev_tokens [N, W] for teacher forcing: ``cat([anchor_tokens[:, None], tokens[:, :-1]], 1)``."""
    return torch.cat([anchor_tokens.reshape(-1, 1).to(tokens), tokens[:, :-1]], 1)


__all__ = ["Drafter", "build_drafter", "load_drafter", "shift_tokens", "pick_tokens", "DFlashDrafter", "DSparkDrafter",
           "DrafterConfig", "DRAFTERS"]
