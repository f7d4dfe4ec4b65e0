"""Drafters (DFlash, DSpark as released): values against an independent reference of the released model,
the shared-context branch attention against the per-branch reference (values and gradients), sampling,
the decoding cache, default layer ids, the mask token, save/load, and that the target stays frozen."""
import json
from types import SimpleNamespace

import pytest
import torch

from specopd.drafters import (build_drafter, choose_mask, default_target_layer_ids, export_drafter, load_drafter,
                              shift_tokens)
from specopd.drafters.attention import BranchLayout, chunked_branch_attention, flex_available, flex_branch_attention
from specopd.models import load_target
from tests.dflash_reference import ReleasedReference, per_branch_attention
from tests.oracle import make_tiny_checkpoint

BS = 4  # block_size (counts the anchor)
W = BS - 1  # drafted tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("drafters"), num_hidden_layers=4,
                                vocab_size=128, hidden_size=32, intermediate_size=48)


@pytest.fixture(scope="module")
def target(ckpt):
    return load_target(ckpt)


def _feats(target, ids, layers=(1, 1)):
    return [target.hidden_states(i.view(1, -1), list(layers))[0] for i in ids]


@pytest.fixture(scope="module")
def batch(target):
    """Two trunks (7 and 5 rows); 8 branches in no particular order: anchors at 0, at T (the bonus token),
    three on one anchor, both trunks."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (7,), generator=g), torch.randint(0, 128, (5,), generator=g)]
    feats = _feats(target, ids, default_target_layer_ids(4, 2))
    anchors = torch.tensor([3, 0, 7, 5, 2, 3, 3, 0])
    tix = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1])
    atok = torch.tensor([int(ids[t][a]) if a < len(ids[t]) else 17 for a, t in zip(anchors, tix)])
    return feats, anchors, tix, atok


def _drafter(target, kind="dflash", seed=0, **kw):
    d = build_drafter(kind, target, num_layers=2, block_size=BS, seed=seed, **kw)
    with torch.no_grad():  # make the heads and norms matter (W2 starts at zero, norms at one)
        g = torch.Generator().manual_seed(seed + 7)
        for name, p in d.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        if kind == "dspark":
            d.markov_head.markov_w2.weight.normal_(0, 0.5, generator=g)
        if kind == "dflash2":  # its convolutions start at identity and its selector at zero
            for name, p in d.named_parameters():
                if "base_kernel" in name or "kernel_projection" in name or "candidate_selector" in name:
                    p.normal_(0, 0.3, generator=g)
    return d


def _prev(kind, atok, n):
    return shift_tokens(atok, (torch.arange(n * W).view(n, W) * 7) % 128) if kind in ("dspark", "dflash2") else None


# ------------------------------------------------------------------ values: the released model, independently


@pytest.mark.parametrize("kind,mask", [("dflash", 5), ("dflash", -1), ("dspark", 9), ("dspark", -1)])
def test_matches_independent_released_reference(target, batch, kind, mask, tmp_path):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind, mask_token_id=mask)
    assert d.config.learned_mask == (mask == -1) and ("mask_embedding" in d.state_dict()) == (mask == -1)
    export_drafter(d, str(tmp_path / "out"))
    ref = ReleasedReference(str(tmp_path / "out"), target.model.embed_tokens.weight, target.lm_head.weight)
    prev = _prev(kind, atok, len(anchors))
    with torch.no_grad():
        out = d(feats, anchors, tix, atok, prev)
        assert out.shape == (len(anchors), W, 128) and out.dtype == torch.float32
        for b in range(len(anchors)):
            r = ref.logits(feats[tix[b]], int(anchors[b]), int(atok[b]), None if prev is None else prev[b])
            torch.testing.assert_close(out[b], r, rtol=1e-5, atol=1e-5)
        if kind == "dspark":
            _, conf = d(feats, anchors, tix, atok, prev, return_confidence=True)
            r = torch.stack([ref.confidence(feats[tix[b]], int(anchors[b]), int(atok[b]), prev[b])
                             for b in range(len(anchors))])
            torch.testing.assert_close(conf, r, rtol=1e-5, atol=1e-5)


def test_hidden_and_head(target, batch):
    """logits = target.lm_head(hidden) (no target final norm); DSpark = [h ; W1[prev]] @ [W_lm ; W2]^T."""
    feats, anchors, tix, atok = batch
    for kind in ("dflash", "dspark"):
        d = _drafter(target, kind)
        prev = _prev(kind, atok, len(anchors))
        with torch.no_grad():
            h = d.hidden(feats, anchors, tix, atok)
            assert h.shape == (len(anchors), W, 32)
            base = h @ target.lm_head.weight.T
            torch.testing.assert_close(d.logits_from_hidden(h), base)
            assert (d.logits_from_hidden(h) - target.head(h)).abs().max() > 1e-3  # target's norm not applied
            if kind == "dflash":
                torch.testing.assert_close(d(feats, anchors, tix, atok), base)
            else:
                wcat = torch.cat([target.lm_head.weight, d.markov_head.markov_w2.weight], 1)  # [V, D + r]
                fused = torch.cat([h, d.markov_features(prev)], -1) @ wcat.T
                torch.testing.assert_close(d(feats, anchors, tix, atok, prev), fused, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ shared-context attention vs per-branch


def _layout_case(n_trunks=3, lens=(9, 0, 6), per=(5, 2, 4), seed=0, h=4, hkv=2, s=BS, dtype=torch.float64):
    """Random q/k/v for blocks over several trunks: anchors 0 and T, repeats, one trunk without context."""
    g = torch.Generator().manual_seed(seed)
    starts, anchors, off = [], [], 0
    for t in range(n_trunks):
        a = torch.randint(0, lens[t] + 1, (per[t],), generator=g).tolist() + [0, lens[t]]
        if per[t] > 2:
            a += [a[0]] * 2  # several branches on one anchor
        a = sorted(a)
        starts += [off] * len(a)
        anchors += a
        off += lens[t]
    n, c = len(anchors), off
    layout = BranchLayout(torch.tensor(starts), torch.tensor(anchors), c, s)
    r = lambda *sh: torch.randn(*sh, generator=g, dtype=dtype, requires_grad=True)  # noqa: E731
    return layout, (r(n, s, h, 8), r(n, s, hkv, 8), r(n, s, hkv, 8), r(c, hkv, 8), r(c, hkv, 8))


@pytest.mark.parametrize("h,hkv,chunk", [(4, 2, 1 << 22), (4, 2, 40), (2, 2, 1), (6, 1, 300)])
def test_chunked_attention_matches_per_branch(h, hkv, chunk):
    layout, args = _layout_case(h=h, hkv=hkv)
    scale = 8 ** -0.5
    out = chunked_branch_attention(*args, layout, scale, chunk_elems=chunk)
    ref = per_branch_attention(*args, layout, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    g1 = torch.autograd.grad(out, args, go)
    g2 = torch.autograd.grad(ref, args, go)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if chunk < 1000:
        assert len(layout.chunks(h, chunk)) > 3  # the small budgets really split the work


def test_chunked_attention_gradcheck():
    layout, args = _layout_case(lens=(4, 3), per=(2, 1), n_trunks=2, s=2, h=2, hkv=1)
    assert torch.autograd.gradcheck(lambda *a: chunked_branch_attention(*a, layout, 0.4, chunk_elems=8), args)


def test_chunked_attention_fp32_and_layout_checks():
    layout, args = _layout_case(dtype=torch.float32)
    out = chunked_branch_attention(*args, layout, 0.3)
    torch.testing.assert_close(out, per_branch_attention(*args, layout, 0.3), rtol=1e-5, atol=1e-6)
    bad = BranchLayout(layout.starts.flip(0), layout.anchors.flip(0), layout.ctx_len, layout.block)
    with pytest.raises(ValueError, match="sorted by anchor"):
        chunked_branch_attention(*args, bad, 0.3)


@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
def test_flex_mask_matches_chunked_forward():
    """The flex path's BlockMask (eager, forward only on the CPU) gives the chunked path's values."""
    import warnings

    layout, args = _layout_case(dtype=torch.float32)
    args = [a.detach() for a in args]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_branch_attention(*args, layout, 0.3)
        assert layout.ran == {"flex_eager"}  # the layout records which path computed
        torch.testing.assert_close(out, chunked_branch_attention(*args, layout, 0.3), rtol=1e-5, atol=1e-5)
    assert layout.ran == {"flex_eager", "chunked"}


@pytest.mark.slow
@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
def test_flex_compiled_mask_and_forward_on_cpu():
    """The drafter's BlockMask (create_block_mask _compile=True) and forward through torch.compile(flex_attention,
    dynamic=False) compile on the CPU and give the chunked path's values (dynamic=True fails to build C++ here)."""
    import warnings

    layout, args = _layout_case(dtype=torch.float32)
    args = [a.detach() for a in args]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_branch_attention(*args, layout, 0.3, compiled=True, dynamic=False)
    torch.testing.assert_close(out, chunked_branch_attention(*args, layout, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
def test_flex_compile_failure_on_cuda_falls_back_with_one_warning(monkeypatch):
    """On CUDA a failed flex compile warns once, returns the chunked result, and later "auto" calls pick chunked.
    Simulated on the CPU: the fallback guard is on and the compiled flex raises."""
    from specopd.drafters import attention as A

    layout, args = _layout_case(dtype=torch.float32)
    args = [a.detach() for a in args]
    monkeypatch.setattr(A, "_FLEX", {})
    monkeypatch.setattr(A, "_on_cuda", lambda q: True)
    monkeypatch.setattr(A, "_compiled_flex", lambda dynamic: (_ for _ in ()).throw(RuntimeError("inductor: boom")))
    q = args[0]
    with pytest.warns(RuntimeWarning, match="flex_attention failed to compile.*boom.*kernels.drafter_attention"):
        out = A.flex_branch_attention(q, *args[1:], layout, 0.3)
    assert layout.ran == {"chunked"}  # a caller (the GPU test) can tell the fallback ran, not flex
    torch.testing.assert_close(out, chunked_branch_attention(*args, layout, 0.3))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure stays silent
        A.flex_branch_attention(q, *args[1:], layout, 0.3)
    assert "boom" in A.flex_failed()
    assert A.resolve_backend("auto", torch.device("cuda")) == "chunked"


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_drafter_values_and_gradients_match_per_branch(ckpt, batch, kind):
    target = load_target(ckpt, dtype=torch.float64)
    feats, anchors, tix, atok = batch
    feats = [f.double() for f in feats]
    d1, d2 = _drafter(target, kind).double(), _drafter(target, kind).double()
    d2.attention_backend = per_branch_attention
    prev = _prev(kind, atok, len(anchors))
    outs = []
    for d in (d1, d2):
        q = d(feats, anchors, tix, atok, prev)
        (q.logsumexp(-1) * torch.linspace(0.5, 2, q.shape[0] * W, dtype=q.dtype).view(-1, W)).sum().backward()
        outs.append(q.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    for (name, p1), p2 in zip(d1.named_parameters(), d2.parameters()):
        if name.startswith("confidence_head"):  # not in the logits
            continue
        assert p1.grad is not None and p1.grad.abs().sum() > 0, name
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_branch_order_does_not_matter(target, batch):
    feats, anchors, tix, atok = batch
    d = _drafter(target)
    perm = torch.randperm(len(anchors), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = d(feats, anchors, tix, atok)
        b = d(feats, anchors[perm], tix[perm], atok[perm])
    torch.testing.assert_close(a[perm], b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ masking, inputs


def test_context_masking(target, batch):
    feats, anchors, tix, atok = batch
    d = _drafter(target)
    with torch.no_grad():
        base = d(feats, anchors, tix, atok)
        later = [f.clone() for f in feats]
        later[0][3:] += 5.0  # trunk-0 positions >= 3: only branches anchored after 3 (anchor 7) see them
        out = d(later, anchors, tix, atok)
        sees = (tix == 0) & (anchors > 3)
        torch.testing.assert_close(out[~sees], base[~sees], rtol=0, atol=1e-6)
        assert (out[sees] - base[sees]).abs().amax() > 1e-3
        earlier = [f.clone() for f in feats]
        earlier[0][2] += 5.0  # position 2 < 3
        out = d(earlier, anchors, tix, atok)
        sees = (tix == 0) & (anchors > 2)
        assert (out[sees] - base[sees]).abs().amax(dim=(1, 2)).min() > 1e-3
        torch.testing.assert_close(out[~sees], base[~sees], rtol=0, atol=1e-6)
        # a branch alone with its own truncated trunk == the same branch in the packed batch
        alone = d([feats[1][:2]], anchors[4:5], None, atok[4:5])
        torch.testing.assert_close(alone[0], base[4], rtol=1e-5, atol=1e-6)


def test_anchor_range_and_inputs(target, batch):
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
    with torch.no_grad():
        caches = [SimpleNamespace(features=f, feature_layers=d.feature_layers) for f in feats]
        assert torch.equal(d(caches, anchors, tix, atok), d(feats, anchors, tix, atok))
        with pytest.raises(ValueError, match="feature_layers=drafter.feature_layers"):
            d([SimpleNamespace(features=feats[0], feature_layers=(0,))], torch.tensor([2]), None, torch.tensor([1]))


def test_block_size_counts_the_anchor(target, batch):
    feats, anchors, tix, atok = batch
    d = build_drafter("dflash", target, num_layers=2, block_size=2)
    assert d.block_size == 2 and d.draft_len == 1
    assert d(feats, anchors, tix, atok).shape == (len(anchors), 1, 128)
    with pytest.raises(ValueError, match="block_size"):
        build_drafter("dflash", target, block_size=1)


# ------------------------------------------------------------------ sampling


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
        other = shift_tokens(atok, (tokens + 1) % 128)  # the Markov head reads the previous token
        assert (d(feats, anchors, tix, atok, other)[:, 1:] - f_logits[:, 1:]).abs().max() > 1e-3
        with pytest.raises(ValueError, match="prev_tokens"):
            d(feats, anchors, tix, atok)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_sampling_greedy_seeded_and_per_row_generators(target, batch, kind):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind)
    with torch.no_grad():
        t0, l0 = d.sample(feats, anchors, tix, atok, temperature=0.0)
        t1, _ = d.sample(feats, anchors, tix, atok, temperature=0.0)
        assert torch.equal(t0, t1) and torch.equal(t0, l0.argmax(-1))
        s = [d.sample(feats, anchors, tix, atok, temperature=2.0, generator=torch.Generator().manual_seed(s))[0]
             for s in (5, 5, 6)]
        assert torch.equal(s[0], s[1]) and not torch.equal(s[0], s[2])
        # rows[i] drawn with gens[i]: each group equals sampling that group alone with its generator
        rows = [torch.nonzero(tix == i).flatten() for i in range(2)]
        gen = lambda: [torch.Generator().manual_seed(10 + i) for i in range(2)]  # noqa: E731
        both, _ = d.sample(feats, anchors, tix, atok, temperature=2.0, generator=gen(), rows=rows)
        for i, r in enumerate(rows):
            alone, _ = d.sample(feats, anchors[r], tix[r], atok[r], temperature=2.0, generator=gen()[i])
            assert torch.equal(both[r], alone)


# ------------------------------------------------------------------ decoding cache


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_decoding_cache_equals_recomputation(target, kind):
    d = _drafter(target, kind)
    ids = torch.randint(0, 128, (22,), generator=torch.Generator().manual_seed(4))
    f = _feats(target, [ids], d.feature_layers)[0]
    rows = []
    d.fc.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    ctx = d.context_cache()
    caps = []
    for lo, hi in ((0, 0), (0, 2), (2, 7), (7, 7), (7, 21)):
        before = [k[:lo].clone() for k in ctx.k] if lo else None
        rows.clear()
        ctx.extend(f[lo:hi])
        assert rows == ([hi - lo] if hi > lo else [])  # only the new positions are projected
        if before:
            assert all(torch.equal(b, k[:lo]) for b, k in zip(before, ctx.k))
        caps.append(ctx.capacity)
        assert len(ctx) == hi
        for temp, seed in ((0.0, 0), (1.0, 9)):
            tok, logits = d.draft(ctx, int(ids[hi]), temperature=temp, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                rt, rl = d.sample([f[:hi]], torch.tensor([hi]), None, torch.tensor([int(ids[hi])]), temperature=temp,
                                  generator=torch.Generator().manual_seed(seed))
            assert tok.shape == (W,) and logits.shape == (W, 128)
            torch.testing.assert_close(logits, rl[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(tok, rt[0])
    assert caps == sorted(caps) and caps[-1] < 2 * 21 + 16  # amortised doubling, no per-token reallocation
    with pytest.raises(ValueError, match="another drafter"):
        _drafter(target, kind).draft(ctx, 1)


def test_cached_attention_matches_per_branch():
    """Decoding attention: each block over its own cached context (lists, never packed) = the per-branch
    reference over the same contexts packed; empty and one-row contexts, GQA, MHA, one kv head."""
    from specopd.drafters.attention import cached_branch_attention

    g = torch.Generator().manual_seed(2)
    lens = [0, 1, 9, 4, 0, 17]
    for h, hkv in ((4, 2), (3, 1), (2, 2)):
        r = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64)  # noqa: E731
        q, kb, vb = r(len(lens), BS, h, 8), r(len(lens), BS, hkv, 8), r(len(lens), BS, hkv, 8)
        kc, vc = [r(t, hkv, 8) for t in lens], [r(t, hkv, 8) for t in lens]
        out = cached_branch_attention(q, kb, vb, kc, vc, 0.3)
        n = torch.tensor(lens)
        layout = BranchLayout(torch.cumsum(n, 0) - n, n, int(n.sum()), BS)
        ref = per_branch_attention(q, kb, vb, torch.cat(kc), torch.cat(vc), layout, 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="contexts for"):
        cached_branch_attention(q, kb, vb, kc[:2], vc[:2], 0.3)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_draft_batch_equals_recomputation_over_rounds(target, kind):
    """Four sequences decoded together over many rounds (1-token prompt, commits of the bonus token alone, of a
    whole block, none): every round's tokens and q logits from the context caches equal a recomputation from
    all features (per sequence with its own generator, and batched with one generator); each round projects
    only the new rows, in one pass for all sequences."""
    d = _drafter(target, kind)
    conf = {"return_confidence": True} if kind == "dspark" else {}
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 128, (64,), generator=g) for _ in range(4)]
    feats = _feats(target, ids, d.feature_layers)  # [64, F] each
    lens = [0, 1, 6, 13]  # context rows before round 1 (0: a one-token prompt, anchored at its token)
    steps = [(1, 1, 4, 2), (0, 4, 1, 1), (4, 1, 0, 3), (2, 2, 2, 1), (1, 1, 1, 1), (3, 4, 4, 4), (1, 0, 2, 1)]
    calls = []
    d.fc.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    ctxs, have = [d.context_cache() for _ in lens], [0] * 4
    for rnd in range(len(steps) + 1):
        calls.clear()
        d.extend_contexts(ctxs, [f[h:n] for f, h, n in zip(feats, have, lens)])
        new = sum(n - h for n, h in zip(lens, have))
        assert calls == ([new] if new else []), "one projection pass over the new rows only"
        assert [len(c) for c in ctxs] == lens
        have = list(lens)
        atok = torch.stack([i[n] for i, n in zip(ids, lens)])
        for temp in (0.0, 1.5):
            gens = lambda: [torch.Generator().manual_seed(100 * rnd + b) for b in range(4)]  # noqa: E731
            out = d.draft_batch(ctxs, atok, temp, gens(), **conf)
            assert out[0].shape == (4, W) and out[1].shape == (4, W, 128)
            for b, gb in enumerate(gens()):
                ref = d.sample([feats[b][:lens[b]]], torch.tensor([lens[b]]), None, atok[b:b + 1], temperature=temp,
                               generator=gb, **conf)
                assert torch.equal(out[0][b], ref[0][0]), f"round {rnd}, sequence {b}, T={temp}: tokens differ"
                for x, y in zip(out[1:], ref[1:]):
                    torch.testing.assert_close(x[b], y[0], rtol=1e-5, atol=1e-5)
            one = d.draft_batch(ctxs, atok, temp, torch.Generator().manual_seed(rnd), **conf)
            with torch.no_grad():
                ref = d.sample([f[:n] for f, n in zip(feats, lens)], torch.tensor(lens), torch.arange(4), atok,
                               temperature=temp, generator=torch.Generator().manual_seed(rnd), **conf)
            assert torch.equal(one[0], ref[0])
            for x, y in zip(one[1:], ref[1:]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        if rnd < len(steps):
            lens = [n + k for n, k in zip(lens, steps[rnd])]
    assert all(c.capacity < 2 * len(c) + 16 for c in ctxs)
    with pytest.raises(ValueError, match="another drafter"):
        _drafter(target, kind).draft_batch(ctxs, atok)
    with pytest.raises(ValueError, match="generators for"):
        d.draft_batch(ctxs, atok, 1.0, [torch.Generator()])
    with pytest.raises(ValueError, match="anchor tokens for"):
        d.draft_batch(ctxs, atok[:2])


# ------------------------------------------------------------------ defaults: layer ids, mask token


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, as released
    assert default_target_layer_ids(36, 1) == (18,)  # one layer: L // 2
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(2, 1) == (1,)  # tiny targets
    assert default_target_layer_ids(2, 2) == (0, 1)  # the formula would leave [0, L): spread instead
    assert default_target_layer_ids(4, 2) == (1, 1)


def test_mask_token_choice(ckpt, target, tmp_path):
    tok = {"model": {"vocab": {f"t{i}": i for i in range(100)}}, "added_tokens": [{"id": 100}, {"id": 101}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert choose_mask(target, None, str(tmp_path)) == (102, False)  # first id the tokenizer leaves unused
    d = build_drafter("dflash", target, target_dir=str(tmp_path))
    assert d.mask_token_id == 102 and not d.config.learned_mask and "mask_embedding" not in d.state_dict()
    full = {"model": {"vocab": {f"t{i}": i for i in range(128)}}, "added_tokens": []}
    (tmp_path / "tokenizer.json").write_text(json.dumps(full))
    eos = json.load(open(f"{ckpt}/config.json"))["eos_token_id"]
    assert choose_mask(target, None, str(tmp_path)) == (eos, True)  # no spare id: learned vector, served as eos
    assert choose_mask(target, None, None) == (eos, True)  # no tokenizer at all (tiny targets)
    assert choose_mask(target, 7) == (7, False) and choose_mask(target, -1)[1] is True
    with pytest.raises(ValueError, match="vocab"):
        choose_mask(target, 128)


# ------------------------------------------------------------------ save / load, errors, frozen target


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_save_load_roundtrip(target, batch, kind, tmp_path):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind, seed=3)
    d.save(str(tmp_path / "d"))
    cfg = json.load(open(tmp_path / "d" / "config.json"))
    assert cfg["kind"] == kind and cfg["block_size"] == BS and cfg["feature_layers"] == list(d.feature_layers)
    assert cfg["target"] == {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4,
                             "max_position_embeddings": target.config.max_position_embeddings}
    e = load_drafter(str(tmp_path / "d"), target)
    assert type(e) is type(d)
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    prev = _prev(kind, atok, len(anchors))
    with torch.no_grad():
        assert torch.equal(d(feats, anchors, tix, atok, prev), e(feats, anchors, tix, atok, prev))


def test_load_into_mismatched_target(target, tmp_path):
    d = _drafter(target)
    d.save(str(tmp_path / "d"))
    other = load_target(make_tiny_checkpoint("llama", tmp_path, vocab_size=96, hidden_size=32,
                                             intermediate_size=48, num_hidden_layers=4))
    with pytest.raises(ValueError, match="vocab size mismatch.*vocab_size=128.*vocab_size=96"):
        load_drafter(str(tmp_path / "d"), other)


def test_folder_that_is_not_a_drafter(ckpt, target, tmp_path):
    """A config.json that is not a drafter's (the target's own folder, broken JSON, a list, an unknown kind,
    missing fields) gives NotADrafterError naming the folder and what a drafter folder holds, never a
    TypeError / KeyError / AttributeError."""
    from specopd.drafters.layout import NotADrafterError

    cases = {"not valid JSON": "{kind: dflash", "holds a list": "[1, 2]", "kind 'eagle'": json.dumps({"kind": "eagle"}),
             "lacks ['num_layers'": json.dumps({"kind": "dflash", "format": 2, "block_size": 4}),
             "lacks the field 'num_hidden_layers'": json.dumps({"architectures": ["DFlashDraftModel"],
                                                                "model_type": "qwen3"})}
    folders = {"a model's (architectures ['LlamaForCausalLM']": ckpt}
    for i, (why, text) in enumerate(cases.items()):
        (tmp_path / f"f{i}").mkdir()
        (tmp_path / f"f{i}" / "config.json").write_text(text)
        folders[why] = str(tmp_path / f"f{i}")
    for why, folder in folders.items():
        with pytest.raises(NotADrafterError) as e:
            load_drafter(folder, target)
        msg = str(e.value)
        assert f"{folder!r} is not a drafter folder" in msg and why in msg, msg
        assert '"kind": "dflash" | "dspark"' in msg and "DFlashDraftModel" in msg and "mask_embedding.pt" in msg
    assert issubclass(NotADrafterError, ValueError)  # the CLI reports ValueErrors without a traceback


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
    assert build_drafter("dflash", target, num_layers=3).feature_layers == default_target_layer_ids(4, 3)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_target_frozen_and_not_in_state(target, batch, kind):
    feats, anchors, tix, atok = batch
    d = _drafter(target, kind)
    target_ids = {id(p) for p in target.parameters()}
    assert not target_ids & {id(p) for p in d.parameters()}
    assert not any(k.startswith(("target", "model.", "lm_head", "embed")) for k in d.state_dict())
    assert sum(v.numel() for v in d.state_dict().values()) == sum(p.numel() for p in d.parameters())
    prev = shift_tokens(atok, torch.ones(len(anchors), W, dtype=torch.long))
    out = d(feats, anchors, tix, atok, prev, **({"return_confidence": True} if kind == "dspark" else {}))
    loss = out[0].logsumexp(-1).sum() + out[1].sum() if kind == "dspark" else out.logsumexp(-1).sum()
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
