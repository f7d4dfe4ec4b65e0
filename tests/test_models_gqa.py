"""llama / qwen3 targets and the shared building blocks (specopd/models/common.py) vs transformers."""
import pytest
import torch

from oracle import hf_logits, load_hf, make_tiny_checkpoint, rel_err
from specopd.models import load_target
from specopd.models import common

T = 160


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("gqa_models")
    return {
        "llama": make_tiny_checkpoint("llama", d),
        "qwen3": make_tiny_checkpoint("qwen3", d),
        "llama-sharded": make_tiny_checkpoint("llama", d, shards=True),
        "qwen3-sharded": make_tiny_checkpoint("qwen3", d, shards=True),
    }


def _ids(b=2, t=T, seed=0, vocab=256):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-sharded", "qwen3-sharded"])
def test_logits_match_transformers(ckpts, name):
    ids = _ids()
    ref = hf_logits(ckpts[name], ids)
    model = load_target(ckpts[name])
    assert model.model_type == name.split("-")[0]
    out = model(ids)
    assert out.shape == ref.shape == (2, T, 256)
    assert rel_err(out, ref) <= 1e-4


def test_sharded_checkpoint_is_really_sharded(ckpts):
    import os

    files = os.listdir(ckpts["llama-sharded"])
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2


def test_wrong_config_is_detected(ckpts):
    """The comparison can fail: a different rope_theta changes the logits far beyond tolerance."""
    ids = _ids(1)
    ref = hf_logits(ckpts["qwen3"], ids)
    bad = load_target(ckpts["qwen3"], config_overrides={"rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 500.0}})
    assert rel_err(bad(ids), ref) > 1e-2


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=False, mlp_bias=True, attention_bias=True),
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    dict(num_key_value_heads=1, head_dim=32),
])
def test_llama_variants(tmp_path, overrides):
    path = make_tiny_checkpoint("llama", tmp_path, seed=3, **overrides)
    ids = _ids(1, 96, seed=1)
    assert rel_err(load_target(path)(ids), hf_logits(path, ids)) <= 1e-4


def test_qwen3_variants(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=4, num_attention_heads=6, num_key_value_heads=3,
                                tie_word_embeddings=True, attention_bias=True)
    ids = _ids(1, 96, seed=2)
    assert rel_err(load_target(path)(ids), hf_logits(path, ids)) <= 1e-4


def test_hidden_states_match_transformers(ckpts):
    ids = _ids(1, 64)
    hf = load_hf(ckpts["llama"])
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    model = load_target(ckpts["llama"])
    feats = model.hidden_states(ids, [0])
    assert feats.shape == (1, 64, 64)
    assert rel_err(feats, hs[1]) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_loads_and_runs(ckpts, name):
    ids = _ids(1, 64)
    m16 = load_target(ckpts[name], dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16
    out = m16(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    ref = load_target(ckpts[name])(ids)
    assert rel_err(out, ref) < 0.1
    # transformers' own bf16 forward agrees within bf16 noise too
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(ckpts[name], dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        ref16 = hf16(input_ids=ids, use_cache=False).logits
    assert rel_err(out, ref16) < 0.05


def test_tied_embeddings_share_values(ckpts):
    model = load_target(ckpts["llama"])
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.tied_params == {"lm_head.weight": "model.embed_tokens.weight"}


# ------------------------------------------------------------------------------------ common blocks

def test_rmsnorm_both_semantics():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g)
    w = torch.randn(16, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = common.RMSNorm(16, 1e-5), LlamaRMSNorm(16, 1e-5)
        ours.weight.data.copy_(w), ref.weight.data.copy_(w)
        ours.to(dtype), ref.to(dtype)
        assert torch.equal(ours(x.to(dtype)), ref(x.to(dtype)))
        ours, ref = common.RMSNorm(16, 1e-5, unit_offset=True), Qwen3NextRMSNorm(16, 1e-5)
        ours.weight.data.copy_(w), ref.weight.data.copy_(w)
        ours.to(dtype), ref.to(dtype)
        assert torch.equal(ours(x.to(dtype)), ref(x.to(dtype)))


def test_partial_rotary_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    cfg = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    rot = common.Rotary(cfg, head_dim=32)
    assert rot.inv_freq.shape == (4,)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 7, 4, 32, generator=g), torch.randn(2, 7, 2, 32, generator=g)
    pos = torch.randint(0, 500, (2, 7), generator=g)
    qo, ko = rot(q, k, pos)
    cos, sin = common.rope_cos_sin(pos, rot.inv_freq, torch.float32)
    qr, kr = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(qo, qr.transpose(1, 2)) and torch.equal(ko, kr.transpose(1, 2))
    assert torch.equal(qo[..., 8:], q[..., 8:])  # the unrotated part passes through


def test_rope_parameters_forms():
    legacy = common.rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy["rope_type"] == "linear" and legacy["rope_theta"] == 5e5
    nested = common.rope_parameters({"rope_parameters": {"full_attention": {"rope_theta": 7.0},
                                                         "sliding_attention": {"rope_theta": 3.0}}},
                                    layer_type="sliding_attention")
    assert nested["rope_theta"] == 3.0 and nested["rope_type"] == "default"
    with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
        common.rope_inv_freq({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, 16)


@pytest.mark.parametrize("shared,norm", [(0, True), (24, False)])
def test_moe_matches_transformers(shared, norm):
    from types import SimpleNamespace

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = SimpleNamespace(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                          norm_topk_prob=norm, shared_expert_intermediate_size=shared, hidden_act="silu",
                          intermediate_size=48, _experts_implementation="eager")
    ref = (Qwen3NextSparseMoeBlock if shared else Qwen3MoeSparseMoeBlock)(cfg)
    torch.manual_seed(0)
    for p in ref.parameters():
        p.data.normal_(0, 0.3)
    ours = common.MoE.from_config(vars(cfg))
    ours.load_state_dict(ref.state_dict(), strict=True)  # same names and layout as HF 5.x in memory
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert rel_err(ours(x), ref(x)) <= 1e-6


def test_masked_attention_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, 6, 8, generator=g), torch.randn(2, 11, 2, 8, generator=g),
               torch.randn(2, 11, 2, 8, generator=g))
    out = common.masked_attention(q, k, v, common.causal_mask(11), 8 ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(3, 2).transpose(1, 2), v.repeat_interleave(3, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_meta_construction_has_no_buffers(model_type):
    from specopd.models import MODEL_TYPES

    cfg = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        m = MODEL_TYPES[model_type](cfg)
    assert list(m.buffers()) == []
    assert all(p.is_meta for p in m.parameters())
    names = {n for n, _ in m.named_parameters()}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (model_type == "qwen3")
    assert m.layer_kinds == ["gqa", "gqa"] and m.model.layers[0].self_attn.kind == "gqa"


@pytest.mark.slow
def test_smollm2_real_checkpoint():
    """The real CPU demo target (SmolLM2-135M, llama, 9 heads / 3 KV heads, tied): logits equal transformers',
    packed scores equal from-scratch runs."""
    try:
        from specopd.data.smollm2 import find_gguf, prepare_smollm2

        find_gguf()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    from specopd.tree import ProposalTree

    path = prepare_smollm2(verbose=False)
    m = load_target(path)
    ids = torch.randint(0, m.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    logits = m(ids)
    assert rel_err(logits, hf_logits(path, ids)) <= 1e-4
    anchors, toks = torch.tensor([0, 30, 30, 63]), torch.randint(0, m.vocab_size, (4, 3))
    p = m.score(ProposalTree.from_branches(anchors, toks), m.prefill(ids[0]))
    for b, a in enumerate(anchors.tolist()):
        ref = m(torch.cat([ids[0, :a + 1], toks[b]]).view(1, -1))[0, -3:]
        assert rel_err(p[b], ref) <= 1e-5
