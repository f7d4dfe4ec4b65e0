"""Random-weight targets of each attention kind (no checkpoint), at sizes a caller picks: shared by the executor
tests and ``benchmarks/bench_executors.py``. ``args`` carries hidden, layers, vocab, device and dtype."""
from __future__ import annotations

import torch


def random_target(model_type: str, cfg: dict, device, dtype, seed: int = 0):
    """Our ``model_type`` implementation with random weights (no checkpoint): linear weights ~ N(0, 0.05),
    norms ~ 1 + N(0, 0.1) (unit-offset norms ~ N(0, 0.1))."""
    from specopd.models import MODEL_TYPES

    torch.manual_seed(seed)
    model = MODEL_TYPES[model_type]({"model_type": model_type, **cfg})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:  # keep the init (1, or 0 for unit-offset norms), add noise
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def gqa_target(args):
    cfg = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
               rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})
    return random_target("llama", cfg, args.device, args.dtype)


def gdn_config(args, every_layer_gdn=False):
    h = args.hidden
    n = args.layers
    types = ["linear_attention"] * n if every_layer_gdn else \
        ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 3, num_hidden_layers=n,
                num_attention_heads=8, num_key_value_heads=2, head_dim=h // 8, linear_num_key_heads=4,
                linear_num_value_heads=8, linear_key_head_dim=h // 4, linear_value_head_dim=h // 4,
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=types,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def gdn_target(args):
    """qwen3_5 hybrid: 3 Gated DeltaNet layers per gated-attention layer."""
    return random_target("qwen3_5_text", gdn_config(args), args.device, args.dtype)


def qsa_config(args):
    """qwen4_exp: GDN and QSA layers alternating, 2 hyper-connection streams, MoE, PLE on layer 1;
    indexer budget 64 (sparse once more than 67 tokens are visible)."""
    h, n = args.hidden, args.layers
    return dict(vocab_size=args.vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=8,
                num_key_value_heads=2, head_dim=h // 8, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=h // 4, linear_value_head_dim=h // 4, linear_conv_kernel_dim=4,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=h, shared_expert_intermediate_size=h,
                hc_count=2, hc_lowrank=32, ple_layer_ids=[1], ple_embed_dim=h // 2, heads_per_ngram=4,
                ngram_vocab_size_base=4096, eos_token_id=1, indexer_n_heads=8, indexer_kv_heads=1,
                indexer_head_dim=h // 4, indexer_budget=64, indexer_compress_ratio=4, rms_norm_eps=1e-6,
                layer_types=["linear_attention" if i % 2 == 0 else "indexed_attention" for i in range(n)],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def qsa_target(args):
    """qwen4_exp hybrid (QSA + GDN + PLE + hyper-connections)."""
    return random_target("qwen4_exp_text", qsa_config(args), args.device, args.dtype)
