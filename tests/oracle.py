"""Test oracle: tiny random transformers checkpoints and transformers' own logits.

    path = make_tiny_checkpoint("llama", tmp_path, shards=False, seed=0, num_hidden_layers=3)
    ref = hf_logits(path, ids)          # ids [T] or [B, T] -> fp32 logits [B, T, V] (eager attention)

Other owners add model types by adding a config builder to ``CONFIGS`` (a function of ``**overrides``
returning the config kwargs for ``transformers.AutoConfig.for_model``) and, if transformers would take a
non-torch kernel path, a fix-up to ``FORCE_TORCH_PATH``.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Callable

import torch

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _base() -> dict:
    """A fresh copy: transformers' configs edit nested dicts (rope_parameters) in place."""
    return copy.deepcopy(_BASE)


def _llama(**o):
    return {**_base(), "tie_word_embeddings": True, **o}


def _qwen3(**o):
    return {**_base(), "head_dim": 16, **o}


_GDN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=4)  # layers 0-2 GDN, 3 full
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _qwen3_next(**o):  # dense unless num_experts > 0 (pass **_MOE for the MoE variant)
    return {**_base(), **_GDN, "num_experts": 0, **o}


def _qwen3_5_text(**o):
    return {**_base(), **_GDN, **o}


def _qwen3_5_moe_text(**o):
    return {**{k: v for k, v in _base().items() if k != "intermediate_size"}, **_GDN, **_MOE, **o}


def qwen3_5_composite(**o):
    """Config kwargs of a composite (vision-language) qwen3_5 (text model in text_config); AutoModelForCausalLM
    would build a text-only model from it, so build it with Qwen3_5ForConditionalGeneration."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=_BASE["hidden_size"])
    return {"text_config": _qwen3_5_text(**o), "vision_config": vision}


# model_type -> builder(**overrides) -> config kwargs
CONFIGS: dict[str, Callable[..., dict]] = {"llama": _llama, "qwen3": _qwen3, "qwen3_next": _qwen3_next,
                                           "qwen3_5_text": _qwen3_5_text, "qwen3_5_moe_text": _qwen3_5_moe_text}

# model_type -> fn(hf_model) run after loading, to make transformers take its pure-torch path
FORCE_TORCH_PATH: dict[str, Callable] = {}


@contextlib.contextmanager
def _no_fla():
    """While transformers imports its modeling modules, make ``import fla`` fail so that it picks its
    pure-torch path (fla's Triton kernels do not run on the CPU). Restores sys.modules afterwards, so
    our own code can still use fla. Also quiets progress bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    saved = sys.modules.get("fla", _MISSING)
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is _MISSING:
            sys.modules.pop("fla", None)
        else:
            sys.modules["fla"] = saved


_MISSING = object()


def make_tiny_checkpoint(model_type: str, tmp_path, shards: bool = False, seed: int = 0, **overrides) -> str:
    """Build a tiny random transformers model of ``model_type`` and ``save_pretrained`` it (fp32).

    Norm weights are perturbed (1-D params named *norm*) so that norm semantics are tested too.
    shards=True writes several safetensors shards plus model.safetensors.index.json.
    Returns the folder path (``<tmp_path>/<model_type>-<seed>[-sharded]``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r} in tests/oracle.py CONFIGS (have {sorted(CONFIGS)})")
    # deep copy: transformers may edit nested dicts (rope_parameters) in place, which would leak between tests
    cfg = AutoConfig.for_model(model_type, **copy.deepcopy(CONFIGS[model_type](**overrides)))
    torch.manual_seed(seed)
    with _no_fla():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    path = os.path.join(str(tmp_path), f"{model_type}-{seed}" + ("-sharded" if shards else ""))
    model.save_pretrained(path, max_shard_size="20KB" if shards else "10GB")
    return path


def load_hf(path: str):
    """transformers' own model for ``path``, fp32, eager attention, eval mode, torch kernel path."""
    from transformers import AutoModelForCausalLM

    with _no_fla():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    fix = FORCE_TORCH_PATH.get(model.config.model_type)
    if fix is not None:
        fix(model)
    return model


@torch.no_grad()
def hf_logits(path_or_model, ids) -> torch.Tensor:
    """ids [T] or [B, T] -> transformers' fp32 logits [B, T, V]."""
    model = load_hf(path_or_model) if isinstance(path_or_model, str) else path_or_model
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.view(1, -1)
    return model(input_ids=ids, use_cache=False).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (fp32)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------- qwen4_exp (qsa owner)
def _qwen4_exp_text(**o):
    """qwen4_exp text model: QSA (budget 16: selection is sparse from 20 visible tokens on) + GDN, 2
    hyper-connection streams, MoE with a shared expert, PLE on layer 1 (1-indexed; ``ple_layer_ids=[]``
    turns it off). 8 indexer heads make exact score ties (every head's ReLU = 0) rare, so transformers'
    torch.topk tie order does not matter. Note: PLE's conv starts at zero in transformers (see
    tests/test_models_qsa.py ``perturb_ple_conv``)."""
    c = {k: v for k, v in _base().items() if k != "intermediate_size"}
    c.update(hidden_size=32, head_dim=16, num_hidden_layers=4,
             layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
             linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
             hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, heads_per_ngram=2,
             ngram_vocab_size_base=1000, split_ngram_parts=2, eos_token_id=3,
             indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    return {**c, **o}


CONFIGS["qwen4_exp_text"] = _qwen4_exp_text
