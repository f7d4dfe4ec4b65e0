"""Drafters (DFlash, DSpark): shapes, context masking against a direct per-branch computation, sampling,
save/load, and that the target stays frozen and outside the drafter's state."""
import json
from types import SimpleNamespace

import pytest
import torch

from specopd.drafters import DFlashDrafter, build_drafter, load_drafter, shift_tokens
from specopd.models import load_target
from specopd.models.common import apply_rope, rope_cos_sin
from tests.oracle import make_tiny_checkpoint

W = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("drafters"), num_hidden_layers=4,
                                vocab_size=128, hidden_size=32, intermediate_size=48)


@pytest.fixture(scope="module")
def target(ckpt):
    return load_target(ckpt)


@pytest.fixture(scope="module")
def batch(target):
    """Two trunks (lengths 7 and 5) with feature rows; 5 branches, one with anchor 0 and one at T."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (7,), generator=g), torch.randint(0, 128, (5,), generator=g)]
    fl = target.default_feature_layers()
    feats = [target.hidden_states(i.view(1, -1), fl)[0] for i in ids]
    anchors = torch.tensor([3, 0, 6, 5, 2])
    tix = torch.tensor([0, 0, 0, 1, 1])
    atok = torch.tensor([int(ids[t][a]) if a < len(ids[t]) else 17 for a, t in zip(anchors, tix)])
    return feats, anchors, tix, atok


def _drafter(target, kind="dflash", seed=0, **kw):
    d = build_drafter(kind, target, num_layers=2, block_size=W, seed=seed, **kw)
    if kind == "dspark":  # W2 starts at zero; make the Markov head matter
        with torch.no_grad():
            d.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + 7))
    return d


def _direct(d, target, feat, a, atok):
    """One branch computed directly: explicit K/V lists, repeated heads, softmax over all keys."""
    c = d.config
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    ctx = d.hidden_norm(d.fc(feat[:a]))[None]  # [1, a, D]
    cc, cs = rope_cos_sin(torch.arange(a)[None], inv, torch.float32)
    h = torch.cat([target.embed(torch.tensor([atok])), d.mask_embedding[None].expand(W, -1)])[None]
    bc, bs = rope_cos_sin(a + torch.arange(W + 1)[None], inv, torch.float32)
    for layer in d.layers:
        at, x = layer.self_attn, layer.input_layernorm(h)
        q = apply_rope(at.q_norm(at.q_proj(x).view(1, W + 1, at.h, at.hd)), bc, bs)[0]
        kc = apply_rope(at.k_norm(at.k_proj(ctx).view(1, a, at.hkv, at.hd)), cc, cs)[0]
        kb = apply_rope(at.k_norm(at.k_proj(x).view(1, W + 1, at.hkv, at.hd)), bc, bs)[0]
        k = torch.cat([kc, kb]).repeat_interleave(at.h // at.hkv, dim=1)  # [a + W + 1, H, hd]
        v = torch.cat([at.v_proj(ctx).view(a, at.hkv, at.hd), at.v_proj(x)[0].view(W + 1, at.hkv, at.hd)])
        v = v.repeat_interleave(at.h // at.hkv, dim=1)
        p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * at.hd ** -0.5, -1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(1, W + 1, -1)
        h = h + at.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return target.head(d.norm(h[0, 1:]))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_shapes_and_direct_computation(target, batch, kind):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind)
    tokens, logits = d.sample(feats, anchors, tix, atok, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert tokens.shape == (5, W) and logits.shape == (5, W, 128) and logits.dtype == torch.float32
    assert d.block_size == W and d.feature_layers == target.default_feature_layers()
    with torch.no_grad():
        out = d(feats, anchors, tix, atok, shift_tokens(atok, tokens))
        for b in range(5):
            ref = _direct(d, target, feats[tix[b]], int(anchors[b]), int(atok[b]))
            if kind == "dspark":
                ref = ref + d.markov_w2(d.markov_w1(shift_tokens(atok, tokens)[b]))
            torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


def test_context_masking(target, batch):
    feats, anchors, tix, atok = batch
    d = _drafter(target)
    with torch.no_grad():
        base = d(feats, anchors, tix, atok)
        later = [f.clone() for f in feats]
        later[0][3:] += 5.0  # positions >= 3 of trunk 0: branch 0 (anchor 3) and 1 (anchor 0) must not move
        out = d(later, anchors, tix, atok)
        torch.testing.assert_close(out[[0, 1, 3, 4]], base[[0, 1, 3, 4]], rtol=0, atol=1e-6)
        assert (out[2] - base[2]).abs().max() > 1e-3  # anchor 6 sees them
        earlier = [f.clone() for f in feats]
        earlier[0][2] += 5.0  # position 2 < 3
        out = d(earlier, anchors, tix, atok)
        assert (out[0] - base[0]).abs().max() > 1e-3 and (out[2] - base[2]).abs().max() > 1e-3
        torch.testing.assert_close(out[[1, 3, 4]], base[[1, 3, 4]], rtol=0, atol=1e-6)
        # a branch alone with its own truncated trunk == the same branch in the packed batch
        alone = d([feats[1][:2]], anchors[4:], None, atok[4:])
        torch.testing.assert_close(alone[0], base[4], rtol=1e-5, atol=1e-6)


def test_anchor_range(target, batch):
    feats, anchors, tix, atok = batch
    d = _drafter(target)
    d([feats[0]], torch.tensor([7]), None, torch.tensor([1]))  # anchor == T: the bonus token, allowed
    with pytest.raises(ValueError, match="outside"):
        d([feats[0]], torch.tensor([8]), None, torch.tensor([1]))
    with pytest.raises(ValueError, match="outside"):
        d([feats[0]], torch.tensor([-1]), None, torch.tensor([1]))
    with pytest.raises(ValueError, match="feature_layers"):
        d([feats[0][:, :10]], torch.tensor([2]), None, torch.tensor([1]))
    with pytest.raises(ValueError, match="anchor_tokens"):
        d([feats[0]], torch.tensor([2]), None, torch.tensor([128]))
    # TargetCache-like inputs: .features is used, and its feature_layers must be the drafter's
    with torch.no_grad():
        caches = [SimpleNamespace(features=f, feature_layers=d.feature_layers) for f in feats]
        assert torch.equal(d(caches, anchors, tix, atok), d(feats, anchors, tix, atok))
        with pytest.raises(ValueError, match="feature_layers=drafter.feature_layers"):
            d([SimpleNamespace(features=feats[0], feature_layers=(0,))], torch.tensor([2]), None, torch.tensor([1]))


def test_dspark_sample_matches_forward(target, batch):
    feats, anchors, tix, atok = batch
    d = _drafter(target, "dspark")
    with torch.no_grad():
        for temp in (0.0, 1.0):
            tokens, logits, conf = d.sample(feats, anchors, tix, atok, temperature=temp,
                                            generator=torch.Generator().manual_seed(3), return_confidence=True)
            f_logits, f_conf = d(feats, anchors, tix, atok, shift_tokens(atok, tokens), return_confidence=True)
            torch.testing.assert_close(logits, f_logits, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(conf, f_conf, rtol=1e-6, atol=1e-6)
            if temp == 0.0:
                assert torch.equal(tokens, f_logits.argmax(-1))
        # the Markov head reads the previous token: other prev tokens give other logits
        other = shift_tokens(atok, (tokens + 1) % 128)
        assert (d(feats, anchors, tix, atok, other)[:, 1:] - f_logits[:, 1:]).abs().max() > 1e-3
        with pytest.raises(ValueError, match="prev_tokens"):
            d(feats, anchors, tix, atok)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_sampling_greedy_and_seeded(target, batch, kind):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind)
    with torch.no_grad():
        t0, l0 = d.sample(feats, anchors, tix, atok, temperature=0.0)
        t1, _ = d.sample(feats, anchors, tix, atok, temperature=0.0)
        assert torch.equal(t0, t1) and torch.equal(t0, l0.argmax(-1))
        s = [d.sample(feats, anchors, tix, atok, temperature=2.0, generator=torch.Generator().manual_seed(s))[0]
             for s in (5, 5, 6)]
        assert torch.equal(s[0], s[1]) and not torch.equal(s[0], s[2])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_save_load_roundtrip(target, batch, kind, tmp_path):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind, seed=3)
    d.save(str(tmp_path / "d"))
    cfg = json.load(open(tmp_path / "d" / "config.json"))
    assert cfg["kind"] == kind and cfg["block_size"] == W and cfg["feature_layers"] == list(d.feature_layers)
    assert cfg["target"] == {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4}
    e = load_drafter(str(tmp_path / "d"), target)
    assert type(e) is type(d) and isinstance(DFlashDrafter.load(str(tmp_path / "d"), target), type(d))
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    prev = shift_tokens(atok, torch.zeros(5, W, dtype=torch.long))
    with torch.no_grad():
        assert torch.equal(d(feats, anchors, tix, atok, prev), e(feats, anchors, tix, atok, prev))


def test_load_into_mismatched_target(target, tmp_path):
    d = _drafter(target)
    d.save(str(tmp_path / "d"))
    other = load_target(make_tiny_checkpoint("llama", tmp_path, vocab_size=96, hidden_size=32,
                                             intermediate_size=48, num_hidden_layers=4))
    with pytest.raises(ValueError, match="vocab_size=128.*vocab_size=96"):
        load_drafter(str(tmp_path / "d"), other)


def test_build_errors_and_seeded_init(target):
    with pytest.raises(ValueError, match="dflash.*dspark"):
        build_drafter("eagle", target)
    with pytest.raises(ValueError, match="unknown drafter override"):
        build_drafter("dflash", target, hidden_size=16)
    with pytest.raises(ValueError, match="feature_layers"):
        build_drafter("dflash", target, feature_layers=[4])
    a, b, c = (build_drafter("dspark", target, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    d = build_drafter("dflash", target, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=20)
    assert d.layers[0].self_attn.q_proj.weight.shape == (16, 32) and d.layers[0].mlp.up_proj.weight.shape == (20, 32)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_target_frozen_and_not_in_state(target, batch, kind):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind)
    target_ids = {id(p) for p in target.parameters()}
    assert not target_ids & {id(p) for p in d.parameters()}
    assert not any(k.startswith(("target", "model.", "lm_head")) for k in d.state_dict())
    n_target = sum(p.numel() for p in target.parameters())
    assert sum(v.numel() for v in d.state_dict().values()) == sum(p.numel() for p in d.parameters())
    out = d(feats, anchors, tix, atok, shift_tokens(atok, torch.ones(5, W, dtype=torch.long)), **(
        {"return_confidence": True} if kind == "dspark" else {}))
    loss = out[0].logsumexp(-1).sum() + out[1].sum() if kind == "dspark" else out.logsumexp(-1).sum()
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert n_target > 0
