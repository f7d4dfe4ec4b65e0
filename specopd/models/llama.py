"""Our own ``llama`` (SmolLM2 family: GQA, optionally tied embeddings) and ``qwen3`` (+ per-head q/k
RMSNorm) targets. Parameter names equal the Hugging Face ones, so ``checkpoint_key`` is the identity.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from specopd.models.base import DecoderLayer as BaseDecoderLayer
from specopd.models.base import TargetModel
from specopd.models.common import MLP, Linear, RMSNorm, Rotary, causal_mask, masked_attention
from specopd.models.registry import register_model


class Attention(nn.Module):
    """Full causal GQA self-attention (kind "gqa"). qwen3 adds RMSNorm on each q/k head before RoPE."""

    kind = "gqa"
    kernel_paths = None  # the recipe's kernels: section for RoPE (``common.hand_down``)

    def __init__(self, cfg: dict, qk_norm: bool):
        super().__init__()
        d, self.num_heads, self.num_kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or d // self.num_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, d, bias=bias)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = Rotary(cfg, self.head_dim)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, D], positions [B, T] -> q [B, T, H, hd], k, v [B, T, Hkv, hd] (RoPE applied), extra=None."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, positions, self.kernel_paths)
        return q, k, v, None

    def finish(self, o: torch.Tensor, extra=None) -> torch.Tensor:
        """o [B, T, H, hd] -> [B, T, D]."""
        return self.o_proj(o.reshape(*o.shape[:2], self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Plain causal attention (the reference): x [B, T, D] -> [B, T, D]."""
        q, k, v, extra = self.project(x, positions)
        return self.finish(masked_attention(q, k, v, causal_mask(x.shape[1], x.device), self.scaling), extra)


class DecoderLayer(BaseDecoderLayer):
    def __init__(self, cfg: dict, qk_norm: bool):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(cfg, qk_norm)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
                       bias=bool(cfg.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: dict, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, qk_norm) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))


class LlamaTarget(TargetModel):
    """llama: pre-norm decoder, GQA attention with RoPE, SwiGLU MLP."""

    model_type = "llama"
    qk_norm = False

    def __init__(self, cfg: dict):
        super().__init__()
        cfg = dict(cfg)
        cfg["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        types = cfg.get("layer_types")
        if not types:  # old configs: qwen3 makes layers >= max_window_layers sliding when use_sliding_window
            sliding = cfg.get("use_sliding_window") and cfg.get("sliding_window")
            mwl = cfg.get("max_window_layers", cfg["num_hidden_layers"])
            types = ["sliding_attention" if sliding and i >= mwl else "full_attention"
                     for i in range(cfg["num_hidden_layers"])]
        bad = sorted(set(t for t in types if t != "full_attention"))
        if bad:
            raise NotImplementedError(f"{cfg.get('model_type')}: layer types {bad} (sliding-window attention) are "
                                      f"not supported; use a checkpoint with full attention in every layer")
        self.config = SimpleNamespace(**cfg)
        self.model = _Backbone(cfg, self.qk_norm)
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.layer_kinds = ["gqa"] * cfg["num_hidden_layers"]
        tie = cfg.get("tie_word_embeddings", False)
        self.tied_params = {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}


@register_model("qwen3")
class Qwen3Target(LlamaTarget):
    """qwen3: llama + RMSNorm over each query/key head (before RoPE)."""

    model_type = "qwen3"
    qk_norm = True


register_model("llama")(LlamaTarget)
