"""qwen3_next / qwen3_5 (Gated DeltaNet hybrids): our logits vs transformers' on tiny random checkpoints.

T >= 150 so that transformers' chunked GDN (64-token chunks) spans several chunks, while ours runs the
plain recurrence: agreement checks both the layer maths and the chunk boundaries.
"""
import json
import os

import pytest
import torch

from oracle import _MOE, _no_fla, hf_logits, make_tiny_checkpoint, qwen3_5_composite, rel_err
from specopd.models import MODEL_TYPES, load_target

T = 160
TOL = 1e-4


def _ids(vocab, t=T, seed=0):
    return torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_next", {}),
    ("qwen3_next", {**_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),  # MoE on layer 1 only
    ("qwen3_next", {**_MOE}),
    ("qwen3_5_text", {}),
    ("qwen3_5_moe_text", {}),
], ids=["next-dense", "next-moe-sparse-step", "next-moe", "qwen3_5", "qwen3_5_moe"])
def test_logits_match_transformers(tmp_path, model_type, overrides):
    path = make_tiny_checkpoint(model_type, tmp_path, **overrides)
    ids = _ids(256)
    ref = hf_logits(path, ids)
    ours = load_target(path)
    assert ours.layer_kinds == ["gdn", "gdn", "gdn", "gqa"]
    got = ours(ids)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_sharded_moe_checkpoint(tmp_path):
    """Per-expert tensors spread over several safetensors shards are stacked after loading the index."""
    path = make_tiny_checkpoint("qwen3_next", tmp_path, shards=True, **_MOE)
    ids = _ids(256, t=40)
    assert rel_err(load_target(path)(ids), hf_logits(path, ids)) <= TOL


def test_moe_layers_follow_config(tmp_path):
    from specopd.models.common import MoE

    path = make_tiny_checkpoint("qwen3_next", tmp_path, **_MOE, decoder_sparse_step=2, mlp_only_layers=[3])
    m = load_target(path)
    assert [isinstance(l.mlp, MoE) for l in m.model.layers] == [False, True, False, False]


def test_composite_qwen3_5_with_text_config(tmp_path):
    """A vision-language qwen3_5 checkpoint: text weights under model.language_model.*, a vision tower we ignore."""
    _no_fla()
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(**qwen3_5_composite(layer_types=["linear_attention", "full_attention"] * 2,
                                            tie_word_embeddings=True),
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = os.path.join(tmp_path, "qwen3_5-vl")
    hf.save_pretrained(path)
    assert "text_config" in json.load(open(os.path.join(path, "config.json")))
    ids = _ids(256)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits.float()
    ours = load_target(path)
    assert ours.layer_kinds == ["gdn", "gqa", "gdn", "gqa"]
    assert rel_err(ours(ids), ref) <= TOL


def test_gdn_mixer_matches_transformers_layer():
    """The mixer alone, both layouts, with GQA-style value heads (H = 2 * HK), fp32, T spanning 3 chunks."""
    _no_fla()
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from specopd.models.qwen3_next import GatedDeltaNet

    kw = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_hidden_layers=1, layer_types=["linear_attention"])
    for cfg_cls, hf_cls, fused in [(Qwen3NextConfig, Qwen3NextGatedDeltaNet, True),
                                   (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, False)]:
        torch.manual_seed(0)
        hf = hf_cls(cfg_cls(**kw), 0)
        with torch.no_grad():
            hf.norm.weight.add_(0.3 * torch.randn_like(hf.norm.weight))
            hf.dt_bias.add_(torch.randn_like(hf.dt_bias))
        ours = GatedDeltaNet(kw, 0, fused_qkvz=fused)
        ours.load_state_dict(hf.state_dict())
        x = torch.randn(2, 150, 32)
        with torch.no_grad():
            assert rel_err(ours(x), hf(x)) <= 1e-5


def test_checkpoint_key_and_registration():
    from specopd.models.qwen3_next import Qwen3NextTarget

    for mt in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        assert MODEL_TYPES[mt] is Qwen3NextTarget
    key = Qwen3NextTarget.checkpoint_key
    assert key("model.language_model.layers.0.linear_attn.A_log") == "model.layers.0.linear_attn.A_log"
    assert key("model.visual.blocks.0.attn.qkv.weight") is None
    assert key("mtp.layers.0.mlp.gate.weight") is None
    assert key("lm_head.weight") == "lm_head.weight"


def test_full_attention_interval_and_a_log_fp32(tmp_path):
    """layer_types derived from full_attention_interval; A_log stays fp32 when loading in bf16."""
    from specopd.models.qwen3_next import layer_types_of

    assert layer_types_of({"num_hidden_layers": 6, "full_attention_interval": 3}) == \
        ["linear_attention", "linear_attention", "full_attention"] * 2
    path = make_tiny_checkpoint("qwen3_5_text", tmp_path)
    m = load_target(path, dtype=torch.bfloat16)
    assert m.model.layers[0].linear_attn.A_log.dtype == torch.float32
    assert m.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    out = m(_ids(256, t=20))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
