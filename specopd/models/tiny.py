"""Tiny seeded random targets built on the fly (``model.target: tiny:<model_type>``): our own model class, every
parameter filled from the seed, written as a real Hugging Face folder and loaded with ``load_target``.
Seeding and the head scale: specopd/models/DESIGN.md ("Tiny targets").
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import zlib

import safetensors.torch
import torch

from specopd_executors.base import check_kernels
from specopd.settings import RecipeError
from specopd.models.loading import check_device_dtype, param_dtype, place_weights, resolve_dtype
from specopd.models.registry import MODEL_TYPES

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
             hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=10000.0,
             torch_dtype="float32")

TINY_CONFIGS = {
    "llama": lambda: {**_BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    # 4 layers: three Gated DeltaNet layers, then one gated full-attention layer (full_attention_interval 4)
    "qwen3_next": lambda: {**_BASE, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                           "num_hidden_layers": 4, "full_attention_interval": 4,
                           "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 0,
                           "partial_rotary_factor": 0.25},
    # qwen4_exp: the QSA owner's tiny test config (tests/oracle.py CONFIGS["qwen4_exp_text"]): QSA layers
    # with indexer budget 16 (sparse selection from 20 visible tokens on) + GDN, 2 hyper-connection
    # streams, MoE with a shared expert, PLE on layer 1.
    "qwen4_exp": lambda: {**{k: v for k, v in _BASE.items() if k != "intermediate_size"},
                          "model_type": "qwen4_exp", "hidden_size": 32, "head_dim": 16, "num_hidden_layers": 4,
                          "layer_types": ["linear_attention", "indexed_attention"] * 2,
                          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "hc_count": 2,
                          "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 16, "heads_per_ngram": 2,
                          "ngram_vocab_size_base": 1000, "split_ngram_parts": 2, "eos_token_id": 3, "indexer_n_heads": 8,
                          "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                          "indexer_compress_ratio": 4, "rope_theta": 10000.0,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}},
}

# the qwen3_next tiny config as a dense qwen3_5 (its own GDN projections: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
TINY_CONFIGS["qwen3_5"] = lambda: {**TINY_CONFIGS["qwen3_next"](), "model_type": "qwen3_5",
                                   "architectures": ["Qwen3_5ForCausalLM"]}

# keys of ``model.tiny`` consumed by the initializer (not written to config.json)
INIT_KEYS = {"init_head_scale": 2.0, "init_embed_std": 1.0}
# Hugging Face config keys a tiny target may set although its defaults leave them out (special token ids)
OPTIONAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id",
                 "num_nextn_predict_layers", "mtp_num_hidden_layers")  # the MTP layer count (qwen3_next, qwen3_5)
TINY_VERSION = 2  # bump when the construction changes: cached tiny targets / data are rebuilt


def tiny_config(model_type: str, overrides: dict) -> tuple:
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for model type {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    cfg = TINY_CONFIGS[model_type]()
    init = dict(INIT_KEYS)
    unknown = sorted(k for k in dict(overrides or {}) if k not in cfg and k not in init and k not in OPTIONAL_KEYS)
    if unknown:
        raise RecipeError(f"model.tiny: unknown key(s) {unknown} for tiny:{model_type}; valid keys: "
                          f"{sorted(set(cfg) | set(init) | set(OPTIONAL_KEYS))} (a typo would otherwise land in the target's config.json)")
    for k, v in dict(overrides or {}).items():
        if k in init:
            init[k] = float(v)
        else:
            cfg[k] = v
    return cfg, init


def _param_init(name: str, shape, seed: int, hidden: int, init: dict, device="cpu") -> torch.Tensor:
    """fp32 values of parameter ``name``, drawn on ``device`` from a generator of its own (the CPU's draws are the
    tiny targets' bits)."""
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=device)
    if len(shape) == 1:
        if leaf == "bias":
            return torch.zeros(shape, device=device)
        if "norm" in name:  # perturbed so norm semantics matter
            return 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
        return 0.1 * torch.randn(shape, generator=g, device=device)
    if "embed" in name:
        return init["init_embed_std"] * torch.randn(shape, generator=g, device=device)
    if "lm_head" in name:
        return (init["init_head_scale"] / math.sqrt(hidden)) * torch.randn(shape, generator=g, device=device)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=g, device=device) / math.sqrt(fan_in)


def random_target(config: dict, dtype="bfloat16", device="cpu", seed: int = 0, kernels: str = "auto"):
    """Our model class for ``config`` (config.json entries) with every weight drawn as a tiny target's is, directly on
    ``device`` and cast one parameter at a time: a real target's size with no checkpoint to read or write
    (benchmarks/gpu_step.py; drawing 8 B weights on the CPU would take minutes). The CPU's draws are
    ``build_tiny_target``'s bits.

    Args:
        config: the target's config.json entries (``model_type`` one of ``MODEL_TYPES``).
        dtype: parameter dtype (fp32 where the model keeps it, as ``load_target`` stores it).
        device: where the weights are drawn and stay.
        seed: fills every parameter.
        kernels: as ``load_target``'s.

    Returns:
        TargetModel in eval mode with ``requires_grad=False`` on all parameters.
    """
    dtype = resolve_dtype(dtype)
    device = check_device_dtype(device, dtype)
    check_kernels(kernels, device)
    if config.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {config.get('model_type')!r} is not one of ours: {sorted(MODEL_TYPES)}")
    with torch.device("meta"):
        model = MODEL_TYPES[config["model_type"]](dict(config))
    tied = (getattr(model, "tied_params", {}) or {}) if config.get("tie_word_embeddings") else {}
    sd = {}
    for name, p in model.named_parameters():
        if name not in tied:
            sd[name] = _param_init(name, tuple(p.shape), int(seed), int(config["hidden_size"]), INIT_KEYS,
                                   device).to(param_dtype(model, name, dtype))
    sd.update({k: sd[src] for k, src in tied.items() if src in sd})
    return place_weights(model, sd, dtype, device, kernels)


def build_tiny_target(model_type: str, out_dir: str, seed: int = 0, overrides: dict | None = None) -> str:
    """Write (or reuse) a tiny random checkpoint folder at ``out_dir``.

    Reused when ``out_dir/tiny.json`` records the same (model_type, seed, overrides); otherwise rebuilt.
    Written to ``out_dir.tmp`` and renamed, so a crash never leaves a half-written target behind.

    Args:
        model_type: a model type with a tiny config (``tiny_config``).
        out_dir: the folder.
        seed: fills every parameter.
        overrides: config entries that replace the tiny defaults.

    Returns:
        ``out_dir``.
    """
    spec = {"model_type": model_type, "seed": int(seed), "overrides": dict(overrides or {}), "version": TINY_VERSION,
            "init": tiny_config(model_type, dict(overrides or {}))[1]}
    marker = os.path.join(out_dir, "tiny.json")
    if _built(marker, spec):
        return out_dir
    cfg, init = tiny_config(model_type, spec["overrides"])
    if model_type not in MODEL_TYPES:
        raise ValueError(f"tiny:{model_type}: our {model_type} model is not available (specopd/models/"
                         f"{model_type}.py missing); known model types: {sorted(MODEL_TYPES)}")
    cls = MODEL_TYPES[model_type]
    with torch.device("meta"):
        model = cls(dict(cfg))
    tied = getattr(model, "tied_params", {}) or {}
    tied = tied if cfg.get("tie_word_embeddings") else {}
    sd = {}
    for name, p in model.named_parameters():
        if name in tied:
            continue
        t = _param_init(name, tuple(p.shape), int(seed), int(cfg["hidden_size"]), init)
        sd[name] = t.to(torch.float32).contiguous()
    n_mtp = model.mtp_num_layers() if hasattr(model, "mtp_num_layers") else None
    if n_mtp:  # the checkpoint's MTP head, under its released names (mtp.fc.weight, mtp.layers.0. ...)
        with torch.device("meta"):
            mtp = model.build_mtp(n_mtp)
        for name, p in mtp.named_parameters():
            t = _param_init("mtp." + name, tuple(p.shape), int(seed), int(cfg["hidden_size"]), init)
            sd["mtp." + name] = t.to(torch.float32).contiguous()
    tmp = out_dir.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    safetensors.torch.save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, "tiny.json"), "w") as f:
        json.dump(spec, f)
    for _ in range(8):
        try:
            os.rename(tmp, out_dir)  # atomic: readers see no folder or a whole one
            return out_dir
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _built(marker, spec):  # another process (a Ray worker of this run) finished first: use its folder
            shutil.rmtree(tmp, ignore_errors=True)
            return out_dir
        old = out_dir.rstrip("/") + f".old-{os.getpid()}"  # a stale target: moved aside, never deleted in place
        try:
            os.rename(out_dir, old)
        except FileNotFoundError:
            continue
        shutil.rmtree(old, ignore_errors=True)
    raise RuntimeError(f"{out_dir}: could not replace it with a new tiny target ({tmp}); other processes keep "
                       f"writing it; remove the folder and rerun")


def _built(marker: str, spec: dict) -> bool:
    """Whether ``marker`` (a target folder's tiny.json) records exactly ``spec``."""
    try:
        with open(marker) as f:
            return json.load(f) == json.loads(json.dumps(spec))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def resolve_target_path(model_cfg, output_dir: str) -> str:
    """The folder to ``load_target``: the HF folder itself, or a tiny target built under output_dir."""
    if model_cfg.target.startswith("tiny:"):
        mt = model_cfg.target[len("tiny:"):]
        return build_tiny_target(mt, os.path.join(output_dir, f"tiny-target-{mt}"), seed=model_cfg.tiny_seed,
                                 overrides=dict(model_cfg.tiny))
    return model_cfg.target

