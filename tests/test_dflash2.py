"""DFlash V2 (vLLM 0.32 DFlash2DraftModel): our drafter against an independent transcription of vLLM's forward and
drafting walk (tests/dflash2_reference.py) on random tiny targets, in fp32 to 1e-5: block logits, top-K candidates,
selector scores [N, W, K, K], the walk at T = 0 and with given Gumbel noise, the realized draft logits; the
convolution's edge cases (block row 0, rows < taps, taps > block); top_k 1 and top_k = vocab; the released layout
(vLLM's weight names, config keys) and bit-exact export / load / save round trips; gradients; speculative decoding
with a V2 drafter lossless at T = 0 (the greedy target output) and T = 1 (the first two tokens' distribution)."""
import dataclasses
import json

import pytest
import torch

from specopd.drafters import build_drafter, export_drafter, load_drafter, shift_tokens
from specopd.drafters.dflash2 import V2_KEYS, GroupedConv, top_candidates
from specopd.eval import SpeculativeDecoder, autoregressive
from specopd.models import load_target
from tests.dflash2_reference import DFlash2Reference, grouped_conv
from tests.oracle import make_tiny_checkpoint
from tests.test_eval import PROMPT, chi2, chi2_threshold, empirical_two_tokens, exact_two_tokens

BS = 4
W = BS - 1
V = 128


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("dflash2"), num_hidden_layers=4,
                                            vocab_size=V, hidden_size=32, intermediate_size=48))


@pytest.fixture(scope="module")
def batch(target):
    """Two trunks (7 and 5 rows); 6 branches: anchors at 0, at T (the bonus token), repeated, both trunks."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, V, (7,), generator=g), torch.randint(0, V, (5,), generator=g)]
    layers = [1, 2]
    feats = [target.hidden_states(i.view(1, -1), layers)[0] for i in ids]
    anchors = torch.tensor([3, 0, 7, 5, 2, 3])
    tix = torch.tensor([0, 0, 0, 1, 1, 0])
    atok = torch.tensor([int(ids[t][a]) if a < len(ids[t]) else 17 for a, t in zip(anchors, tix)])
    return feats, anchors, tix, atok, layers


def _v2(target, seed=0, block_size=BS, layers=(1, 2), **kw):
    """A V2 drafter whose every part matters: norms, convolutions (base taps and kernel_projection) and the
    selector's successor codebook made non-trivial (they start at identity / zero)."""
    d = build_drafter("dflash2", target, num_layers=2, block_size=block_size, seed=seed, feature_layers=list(layers),
                      **kw)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif "base_kernel" in name or "kernel_projection" in name:
                p.normal_(0, 0.3, generator=g)
            elif "candidate_selector" in name:
                p.normal_(0, 0.3, generator=g)
    return d


def _gumbel(n, w, k, seed):
    u = torch.rand(n, w, k, generator=torch.Generator().manual_seed(seed)).clamp_min(1e-12)
    return -torch.log(-torch.log(u))


CASES = {
    "default": {},
    "taps>block": dict(conv_kernel_size=6),  # every row has fewer than taps rows above it
    "one_tap": dict(conv_kernel_size=1),
    "group1": dict(conv_group_size=1),
    "one_group": dict(conv_group_size=32),
    "top1": dict(selector_top_k=1),
    "top_vocab": dict(selector_top_k=V),
    "scaled_capped": dict(input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=1.5),
    "learned_mask": dict(mask_token_id=-1, selector_rank=5),
}


# ------------------------------------------------------------------ against vLLM's forward and walk


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_vllm_transcription(target, batch, case, tmp_path):
    feats, anchors, tix, atok, layers = batch
    d = _v2(target, **CASES[case])
    export_drafter(d, str(tmp_path / "out"))
    ref = DFlash2Reference(str(tmp_path / "out"), target.model.embed_tokens.weight, target.lm_head.weight)
    n, k = len(anchors), d.top_k
    tol = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        h = d.hidden(feats, anchors, tix, atok)
        rh = ref.hidden([feats[int(t)] for t in tix], anchors, atok)
        torch.testing.assert_close(h, rh, **tol)
        # block logits: the candidate logits over the vocabulary
        out = d(feats, anchors, tix, atok)
        assert out.shape == (n, W, V) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref.block_logits(rh), **tol)
        # top-K candidates and the selector's scores
        cands = d.candidates(h, chunk_rows=5)
        rids, runary = ref.candidates(rh)
        assert torch.equal(cands.ids, rids)
        torch.testing.assert_close(cands.unary, runary, **tol)
        scores = d.selector_scores(cands, atok)
        rscores = ref.scores(rh, rids, runary, atok)
        assert scores.shape == (n, W, k, k)
        torch.testing.assert_close(scores, rscores, **tol)
        # the walk: argmax at T = 0, Gumbel-max with the same noise at T > 0
        for temp, seed in ((0.0, 0), (1.0, 1), (0.6, 2)):
            noise = _gumbel(n, W, k, seed)
            draw = None if temp == 0 else (lambda slot, z, t=temp, g=noise: (z / t + g[:, slot]).argmax(-1))
            toks, idx, real = d.walk(cands, atok, temp, draw=draw)
            rt, rreal, rlogits = ref.walk(rscores, rids, temp, noise)
            assert torch.equal(toks, rt), (case, temp)
            assert torch.equal(cands.ids.gather(-1, idx[..., None])[..., 0], toks)
            torch.testing.assert_close(real, rreal, **tol)
            # teacher forcing the walk's own tokens gives its realized draft logits (-inf off the candidates)
            q = d(feats, anchors, tix, atok, shift_tokens(atok, toks))
            assert torch.equal(torch.isfinite(q), torch.isfinite(rlogits))
            torch.testing.assert_close(q[torch.isfinite(q)], rlogits[torch.isfinite(rlogits)], **tol)
            assert (torch.isfinite(q).sum(-1) == k).all()
        # the greedy draft through the drafter's own sampler
        t0, l0 = d.sample(feats, anchors, tix, atok, temperature=0.0)
        assert torch.equal(t0, ref.walk(rscores, rids, 0.0)[0]) and torch.equal(t0, l0.argmax(-1))


def test_selector_reads_the_previous_token(target, batch):
    feats, anchors, tix, atok, _ = batch
    d = _v2(target)
    with torch.no_grad():
        toks, _ = d.sample(feats, anchors, tix, atok, temperature=1.0, generator=torch.Generator().manual_seed(3))
        a = d(feats, anchors, tix, atok, shift_tokens(atok, toks))
        b = d(feats, anchors, tix, atok, shift_tokens(atok, (toks + 1) % V))
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b))  # the candidates do not depend on the previous token
        assert (a[:, 1:][fin[:, 1:]] - b[:, 1:][fin[:, 1:]]).abs().max() > 1e-3  # their scores do
        assert torch.equal(a[:, 0], b[:, 0])  # slot 0 follows the anchor token in both
    with pytest.raises(ValueError, match="prev_tokens"):
        d(feats, anchors, tix, atok, shift_tokens(atok + 1, toks))


@pytest.mark.parametrize("taps,rows", [(4, 4), (6, 4), (1, 3), (3, 1), (2, 5)])
def test_grouped_conv_rows(taps, rows):
    """Our convolution = vLLM's CPU ``_grouped_conv`` on flattened blocks; row r reads rows r - t of its own block
    only (t < taps, t <= r): block row 0 is a pointwise product, rows < taps see only the rows above them."""
    g = torch.Generator().manual_seed(taps * 10 + rows)
    d, gs, n = 12, 4, 3
    conv = GroupedConv(d, taps, gs)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(generator=g)
    x = torch.randn(n, rows, d, generator=g)
    c = conv.coefficients(x)
    for side in (0, 1):
        out = conv.convolve(x, c[:, :, side], side)
        ref = grouped_conv(x.reshape(-1, d), c[:, :, side].reshape(n * rows, taps, d // gs), conv.base_kernel[side],
                           rows, d // gs, gs, taps)
        torch.testing.assert_close(out.reshape(-1, d), ref, rtol=1e-6, atol=1e-6)
        # row r depends on rows <= r of its block only
        for r in range(rows):
            y = x.clone()
            y[:, r + 1:] += 5.0
            y[0] += 3.0  # another block
            out2 = conv.convolve(y, c[:, :, side], side)
            assert torch.equal(out2[1:, r], out[1:, r])
        x0 = x.clone()
        x0[:, 1:] = 0
        torch.testing.assert_close(conv.convolve(x0, c[:, :, side], side)[:, 0],
                                   (conv.base_kernel[side, 0] + c[:, 0, side, 0].repeat_interleave(gs, -1)) * x[:, 0])


# ------------------------------------------------------------------ layout, round trips


def test_released_layout_names_and_config(target, tmp_path):
    d = _v2(target, selector_rank=6, conv_kernel_size=3, output_multiplier=0.5, final_logit_softcapping=20.0)
    export_drafter(d, str(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3" and "auto_map" not in cfg
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in V2_KEYS} == dict(conv_kernel_size=3, conv_group_size=16, selector_rank=6,
                                               selector_top_k=8, input_embedding_scale=1.0, output_multiplier=0.5,
                                               final_logit_softcapping=20.0)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    # the names vLLM's DFlash2Qwen3ForCausalLM.load_weights maps to model.<name>
    v2 = {f"layers.{i}.{c}.{p}" for i in range(2) for c in ("attention_conv", "mlp_conv")
          for p in ("base_kernel", "kernel_projection.weight")}
    v2 |= {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
           "candidate_selector.hidden_projection.weight"}
    assert v2 <= names and not any(n.startswith(("model.", "lm_head", "embed")) for n in names)
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sd["layers.0.attention_conv.base_kernel"].shape == (2, 3, 32)
    assert sd["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * 2, 32)
    assert sd["candidate_selector.successor_codebook"].shape == (V, 6)
    assert sd["candidate_selector.hidden_projection.weight"].shape == (6, 32)
    # vLLM reads the first four keys without defaults: a V2 folder without them is refused, naming them
    del dc["selector_top_k"]
    json.dump(cfg, open(tmp_path / "out" / "config.json", "w"))
    with pytest.raises(ValueError, match="selector_top_k"):
        load_drafter(str(tmp_path / "out"), target)


def _v2_config(d) -> dict:
    """The drafter's config without the DSpark-only fields (markov_rank, confidence_*), which V2 does not use."""
    return {k: v for k, v in dataclasses.asdict(d.config).items() if not k.startswith(("markov", "confidence"))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_load_save_roundtrips_are_bit_exact(target, batch, tmp_path, dtype):
    feats, anchors, tix, atok, _ = batch
    d = _v2(target, seed=3, output_multiplier=1.3, final_logit_softcapping=7.0, input_embedding_scale=0.9)
    export_drafter(d, str(tmp_path / "a"), dtype=dtype)
    e = load_drafter(str(tmp_path / "a"), target)
    assert type(e) is type(d) and _v2_config(e) == _v2_config(d)
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k].to(dtype).float(), se[k]) for k in sd)
    export_drafter(e, str(tmp_path / "b"), dtype=dtype)  # load -> export gives the same files
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    e.save(str(tmp_path / "ours"))  # our checkpoint layout
    cfg = json.load(open(tmp_path / "ours" / "config.json"))
    assert cfg["kind"] == "dflash2" and all(cfg[k] == getattr(d.config, k) for k in V2_KEYS)
    f = load_drafter(str(tmp_path / "ours"), target)
    assert _v2_config(f) == _v2_config(e) and all(torch.equal(se[k], v) for k, v in f.state_dict().items())
    with torch.no_grad():
        assert torch.equal(e(feats, anchors, tix, atok), f(feats, anchors, tix, atok))


def test_build_checks(target):
    with pytest.raises(ValueError, match="conv_group_size=5"):
        build_drafter("dflash2", target, conv_group_size=5)
    with pytest.raises(ValueError, match="selector_top_k=129"):
        build_drafter("dflash2", target, selector_top_k=V + 1)
    with pytest.raises(ValueError, match="output_multiplier"):
        build_drafter("dflash2", target, output_multiplier=-1.0)
    with pytest.raises(ValueError, match="unknown drafter override"):
        build_drafter("dflash", target, selector_top_k=4)
    d = build_drafter("dflash2", target)
    assert d.top_k == 8 and d.config.conv_group_size == 16
    # a fresh V2 drafter starts as DFlash restricted to its top K: identity convolutions, no selector term
    f = build_drafter("dflash", target, seed=0)
    assert all(float(layer.attention_conv.kernel_projection.weight.detach().abs().sum()) == 0 for layer in d.layers)
    assert float(d.candidate_selector.successor_codebook.detach().abs().sum()) == 0 and f.kind == "dflash"


# ------------------------------------------------------------------ gradients


def test_gradients_reach_every_part(target, batch):
    feats, anchors, tix, atok, _ = batch
    d = _v2(target)
    toks, _ = d.sample(feats, anchors, tix, atok, temperature=1.0, generator=torch.Generator().manual_seed(0))
    h = d.hidden(feats, anchors, tix, atok)
    r = d.realized(h, shift_tokens(atok, toks.detach()), extra=toks.detach(), chunk_rows=4)
    loss = torch.log_softmax(r.scores, -1).mean() + r.extra.mean()
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_top_candidates_backward_equals_full_logits():
    """The chunked top-K's gradient (dh = g @ W[ids], row chunks) = autograd through the full logits' gather."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g)
    extra = torch.randint(0, 40, (2, 5), generator=g)
    c = torch.randn(2, 5, 7, generator=g)
    raw, ids = top_candidates(h, w, 6, extra, chunk_rows=3)
    full = h @ w.T
    v, i = torch.topk(full, 6, -1)
    assert torch.equal(ids[..., :6], i) and torch.equal(ids[..., 6], extra)
    torch.testing.assert_close(raw, full.gather(-1, ids), rtol=1e-6, atol=1e-6)
    (gh,) = torch.autograd.grad((raw * c).sum(), h)
    (rh,) = torch.autograd.grad((full.gather(-1, ids) * c).sum(), h)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ speculative decoding


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """1-layer llama, vocab 8 (as tests/test_eval.py's)."""
    return load_target(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("eval2"), vocab_size=8,
                                            num_hidden_layers=1, initializer_range=0.5))


def _small_v2(small, seed=3, top_k=3):
    d = build_drafter("dflash2", small, num_layers=1, block_size=3, seed=seed, selector_top_k=top_k,
                      feature_layers=[0])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        d.candidate_selector.successor_codebook.normal_(0, 1.0, generator=g)
        d.candidate_selector.predecessor_codebook.normal_(0, 1.0, generator=g)
        d.candidate_selector.hidden_projection.weight.normal_(0, 1.0, generator=g)
        for layer in d.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0, 0.3, generator=g)
    return d


@pytest.mark.parametrize("top_k", [1, 3])
def test_greedy_decoding_is_the_targets_greedy_output(small, top_k):
    n = 24
    ar = autoregressive(small, PROMPT, n, temperature=0.0)
    res = SpeculativeDecoder(small, _small_v2(small, top_k=top_k), temperature=0.0).generate(PROMPT, n)
    assert res.tokens[:n].tolist() == ar.tokens.tolist()
    assert sum(res.accept_lengths) == res.tokens.numel()


def test_lossless_at_t1_with_a_v2_drafter(small):
    """q is supported on 3 of 8 tokens and depends on the previous draft: the committed tokens are still the
    target's (chi-square and TV of the first two tokens' joint distribution, as DFlash's test)."""
    dec = SpeculativeDecoder(small, _small_v2(small), temperature=1.0)
    exact = exact_two_tokens(small, PROMPT, 1.0).flatten()
    counts = empirical_two_tokens(dec, PROMPT, 800)
    stat, df = chi2(counts, exact)
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} (df {df})"
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    bound = 0.5 * float((exact * (1 - exact) / counts.sum()).sqrt().sum())
    assert tv < 1.5 * bound, f"TV {tv:.4f} vs expected-TV bound {bound:.4f}"


# ------------------------------------------------------------------ training


def _full_logit_reference(w, prop, denom):
    """The step on full logits: a second drafter forward, q [N, W, V] = the realized draft logits (-inf off the
    candidates) teacher-forced on the branch's tokens, p [N, W, V] from plain target forwards, ``e2e_tv_loss`` /
    the CE over the candidates joined by the reference token (built here from the full candidate logits)."""
    from specopd.losses import e2e_tv_loss, tv_alpha

    t, d = w.cfg.trainer, w.drafter
    prev = shift_tokens(prop.anchor_tokens, prop.tokens)
    h = d.hidden(prop.features, prop.anchors, prop.trunk_index, prop.anchor_tokens)
    q = d.logits_from_hidden(h, prev)
    with torch.no_grad():
        p = []
        for b in range(q.shape[0]):
            trunk = w.sample(prop.sample_ids[int(prop.trunk_index[b])])["input_ids"]
            a = int(prop.anchors[b])
            seq = torch.cat([trunk[: a + 1], prop.tokens[b, : w.W - 1]]) if not prop.reference else trunk
            p.append(w.target(seq[None])[0, a: a + w.W])
        p = torch.stack(p)

    def nll(targets):
        sel = d.candidate_selector
        zt = d.logits_from_hidden(h).gather(-1, targets[..., None])[..., 0] + (
            sel.predecessor_codebook[prev] * sel.hidden_projection(h) * sel.successor_codebook[targets]).sum(-1)
        qt = q.gather(-1, targets[..., None])[..., 0]
        inside = torch.isfinite(qt)
        joined = torch.cat([q, torch.where(inside, float("-inf"), zt)[..., None]], -1)
        return torch.logsumexp(joined, -1) - torch.where(inside, qt, zt)

    ref = torch.stack([w.sample(prop.sample_ids[int(prop.trunk_index[b])])["input_ids"][
        int(prop.anchors[b]) + 1: int(prop.anchors[b]) + 1 + w.W] for b in range(q.shape[0])])
    if t.method == "offpolicy_ce":
        loss = nll(prop.tokens).mean(1).sum() / denom
        if t.vocab_ce_weight > 0:  # DFlash's CE on the raw lm_head logits, over the whole vocabulary
            raw = (h @ w.target.lm_head.weight.T).float()
            full = torch.logsumexp(raw, -1) - raw.gather(-1, prop.tokens[..., None])[..., 0]
            loss = loss + t.vocab_ce_weight * full.mean(1).sum() / denom
    else:
        loss = e2e_tv_loss(q, p, denom=denom, temperature=t.acceptance_temperature)
    if t.ce_weight > 0 and t.method != "offpolicy_ce":  # trainer.ce_labels=target: the plain forwards' argmax
        loss = loss + t.ce_weight * nll(p.argmax(-1) if t.ce_labels == "target" else ref).mean(1).sum() / denom
    return loss, tv_alpha(q.detach(), p, temperature=t.acceptance_temperature)


@pytest.mark.parametrize("method,temp", [("specopd", 0.8), ("specopd", 0.0), ("offpolicy_e2e_tv", 0.8),
                                         ("offpolicy_ce", 0.8), ("offpolicy_ce+vce", 0.8), ("specopd+ce", 0.8),
                                         ("offpolicy_e2e_tv+ce", 0.0), ("specopd+tce", 0.8)])
def test_one_forward_step_equals_full_logit_reference(tmp_path, method, temp):
    """The step's one drafter forward (branches walked from its detached hidden state; the loss on candidates,
    chunked, never [N, W, V]) gives the loss, alpha and gradients of the full-logit step; top K = 6 of vocab 256,
    so references miss the candidates often (the CE's joined token); "+vce": trainer.vocab_ce_weight, the
    full-vocabulary CE on the raw logits beside it; "+tce": the CE on the target's argmax (trainer.ce_labels=target);
    off-policy CE and T = 0: K = 64, so that the
    references (the target's argmax) are candidates in some slots and not in others (where the argmax is in none,
    greedy alpha and its gradient are 0)."""
    from specopd.train import phases
    from tiny_runs import tiny_recipe
    from specopd.train.worker import Worker

    method, extra = method.split("+")[0], method.split("+")[1:]
    ce, vce = 0.4 if extra in (["ce"], ["tce"]) else 0.0, 0.5 if extra == ["vce"] else 0.0
    labels = ["trainer.ce_labels=target"] if extra == ["tce"] else []
    cfg = tiny_recipe(str(tmp_path), ["drafter.kind=dflash2", f"trainer.method={method}", "trainer.loss_chunk_rows=5",
                                      f"trainer.acceptance_temperature={temp}", "drafter.block_size=5",
                                      f"trainer.ce_weight={ce}", f"trainer.vocab_ce_weight={vce}"] + labels)
    w = Worker(cfg)
    with torch.no_grad():  # a drafter whose convolutions and selector matter, with a top K of 6
        w.drafter.config.selector_top_k = 64 if temp == 0 or method == "offpolicy_ce" else 6
        g = torch.Generator().manual_seed(1)
        for name, p in w.drafter.named_parameters():
            if "base_kernel" in name or "kernel_projection" in name or "candidate_selector" in name:
                p.normal_(0, 0.3, generator=g)
    ids = w.train_ids[:2]
    caches = phases.prefill(w, ids)
    prop = phases.propose(w, caches, ids, step=1, reference=method.startswith("offpolicy"))
    assert prop.hidden.requires_grad
    if method == "specopd":  # the branches are the walk the decoding-style sampler draws from the same forward
        rows = [torch.nonzero(prop.trunk_index == i).flatten() for i in range(len(ids))]
        gens = [w.generator("branch", 1, int(s)) for s in ids]
        with torch.no_grad():
            toks, _ = w.drafter.sample(prop.features, prop.anchors, prop.trunk_index, prop.anchor_tokens,
                                       temp, gens, rows=rows)
        assert torch.equal(toks, prop.tokens)
    hp = phases.score(w, prop, caches)
    denom = 3 * prop.tokens.shape[0]
    ref_loss, ref_alpha = _full_logit_reference(w, prop, denom)
    assert torch.isfinite(ref_loss)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in w.params]
    w.optimizer.zero_grad(set_to_none=True)
    m = phases.loss_backward(w, prop, hp, denom)
    assert prop.hidden is None
    assert m["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(torch.tensor(m["alpha_sum"]), ref_alpha.sum(0), rtol=1e-5, atol=1e-6)
    for (name, p), g in zip(w.drafter.named_parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6 * float(g.abs().max()) + 1e-9, msg=name)
        assert float(g.abs().sum()) > 0 or name == "mask_embedding", name  # through unary, convs and selector
    assert 0 < sum(m["alpha_sum"])
    if method == "offpolicy_ce":  # some references are outside their slot's top K, some inside
        r = w.drafter.realized(w.drafter.hidden(prop.features, prop.anchors, prop.trunk_index, prop.anchor_tokens),
                               shift_tokens(prop.anchor_tokens, prop.tokens))
        inside = (r.ids == prop.tokens[..., None]).any(-1)
        assert inside.any() and not inside.all()


@pytest.mark.parametrize("method", ["specopd", "offpolicy_ce", "offpolicy_e2e_tv", "draft_opd"])
def test_cli_trains_resumes_exports_and_inits_from(tmp_path, method, capsys):
    """``specopd train recipes/tiny.yaml drafter.kind=dflash2`` with each method: 3 steps; a run resumed from its
    step-2 checkpoint ends bit for bit where the straight run does; ``specopd export`` writes the V2 layout, and
    ``drafter.init_from`` that export starts a worker from exactly its weights."""
    import os
    import shutil

    from safetensors.torch import load_file

    from specopd.cli import main
    from tiny_runs import tiny_recipe
    from specopd.train.worker import Worker

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny.yaml")
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["train", recipe, "drafter.kind=dflash2", f"trainer.method={method}", "trainer.max_steps=3",
            "trainer.save_every=1", "trainer.keep_last=3", "trainer.eval_heldout=false", "data.num_samples=24",
            "trainer.anchors_per_seq=4"]
    assert main(args + [f"trainer.output_dir={a}"]) == 0
    lines = [json.loads(x) for x in open(a / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2, 3] and all(torch.isfinite(torch.tensor(m["loss"])) for m in lines)
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-3")
    shutil.rmtree(b / "checkpoints" / "step-1")
    assert main(args + [f"trainer.output_dir={b}"]) == 0  # trainer.resume=auto: from step-2
    assert not (b / "checkpoints" / "step-1").exists()  # it resumed (a fresh run would write step-1 again)
    wa, wb = (load_file(str(r / "checkpoints" / "step-3" / "model.safetensors")) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["candidate_selector.successor_codebook"],
                           load_file(str(a / "checkpoints" / "step-1" / "model.safetensors"))[
                               "candidate_selector.successor_codebook"])  # the selector trains
    capsys.readouterr()
    assert main(["export", str(a), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "GPU model runner" in out and "num_speculative_tokens 4" in out
    assert json.load(open(tmp_path / "out" / "config.json"))["architectures"] == ["DFlash2DraftModel"]
    w = Worker(tiny_recipe(str(tmp_path / "c"), [f"drafter.init_from={tmp_path / 'out'}", "drafter.kind=dflash2",
                                                 "drafter.block_size=5", "trainer.eval_heldout=false"]))
    assert w.drafter.kind == "dflash2"
    assert all(torch.equal(v, wa[k]) for k, v in w.drafter.state_dict().items())


@pytest.mark.parametrize("temp", [1.0, 0.7, 0.0])
def test_candidate_losses_equal_the_full_logit_forms(temp):
    """candidate_e2e_tv / candidate_ce on [N, W, K] = e2e_tv_loss / ce_loss on the [N, W, V] logits that are -inf off
    the candidates (values and gradients; a mask ending branches early); the CE stays finite where the target is
    not a candidate."""
    from specopd.losses import candidate_ce, candidate_e2e_tv, ce_loss, e2e_tv_loss, tv_alpha

    g = torch.Generator().manual_seed(int(temp * 10))
    n, w, k, v, d = 5, 4, 6, 40, 8
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n * w)]).view(n, w, k)
    scores = torch.randn(n, w, k, generator=g, requires_grad=True)
    hp, wp = torch.randn(n, w, d, generator=g), torch.randn(v, d, generator=g)
    if temp == 0:  # make the target's argmax a candidate in some slots
        wp[ids[:2, :, 0].reshape(-1)] += 3 * hp[:2].reshape(-1, d)
    mask = torch.ones(n, w, dtype=torch.bool)
    mask[1, 2:] = False
    full = torch.full((n, w, v), float("-inf")).scatter(-1, ids, scores)
    out = candidate_e2e_tv(ids, scores, hp, p_weight=wp, mask=mask, denom=7, temperature=temp, chunk_rows=3)
    ref = e2e_tv_loss(full, hp @ wp.T, mask=mask, denom=7, temperature=temp)
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-7)
    valid = torch.cumprod(mask.long(), 1).bool()
    torch.testing.assert_close(out.alpha, torch.where(valid, tv_alpha(full.detach(), hp @ wp.T, temp), 0.0))
    (ga,) = torch.autograd.grad(out.loss, scores)
    (gr,) = torch.autograd.grad(ref, scores)
    torch.testing.assert_close(ga, gr, rtol=1e-5, atol=1e-7)
    targets = torch.where(torch.rand(n, w, generator=g) < 0.5, ids[..., 1], (ids[..., 0] + 1) % v)
    inside = (ids == targets[..., None]).any(-1)
    assert inside.any() and not inside.all()
    tscores = torch.randn(n, w, generator=g, requires_grad=True)
    ce = candidate_ce(ids, scores, targets, tscores, denom=3)
    assert torch.isfinite(ce.loss)
    # where the target is a candidate, exactly -log q(target); elsewhere -log over the candidates and the target
    exact = -torch.log_softmax(full, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(ce.nll[inside], exact[inside])
    joined = torch.cat([scores, tscores[..., None]], -1)
    torch.testing.assert_close(ce.nll[~inside], (torch.logsumexp(joined, -1) - tscores)[~inside])
    with torch.no_grad():
        inf_ce = ce_loss(full, targets, denom=3)
    assert not torch.isfinite(inf_ce)  # why the CE joins the target


def test_memory_plan_counts_the_selector(tmp_path, capsys):
    """``--dry-run`` plans V2's candidate selector (by hand here) next to the loss chunk; the 8-GPU Qwen3-8B recipe
    with drafter.kind=dflash2 still fits 80 GB and names the term."""
    import os

    from specopd.cli import main
    from specopd.config import load_recipe
    from specopd.memory import memory_plan

    cfg = load_recipe(None, ["model.target=tiny:llama", f"trainer.output_dir={tmp_path}", "drafter.kind=dflash2",
                             "data.batch_size=6", "trainer.anchors_per_seq=5", "drafter.block_size=4",
                             "trainer.loss_chunk_rows=7"])
    p = memory_plan(cfg, device_bytes=10**9)
    N, W, K, R, D, act = 30, 3, 8, 64, 64, 4  # tiny llama: D = 64, V = 256; the CPU's fp32 activations
    want = N * W * (K * (8 + 20 + R * act) + 3 * R * act) + 7 * K * D * 4
    term = next(t for t in p.terms if t.name == "candidate selector (dflash2)")
    assert term.bytes == want and p.sizes["selector_top_k"] == K and p.sizes["selector_rank"] == R
    assert "candidate selector" not in [t.name for t in memory_plan(load_recipe(None, [
        "model.target=tiny:llama", f"trainer.output_dir={tmp_path}"]), device_bytes=10**9).terms]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rc = main(["train", os.path.join(root, "recipes", "qwen3-8b-dflash-8gpu.yaml"), "--dry-run",
               "drafter.kind=dflash2"])
    out = capsys.readouterr().out
    assert rc == 0 and "candidate selector (dflash2)" in out and "DOES NOT FIT" not in out


# ------------------------------------------------------------------ vLLM's own code (its venv, when there is one)

_VLLM_PARTS = r"""
import json, sys, tempfile, torch
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models import qwen3_dflash2 as m
folder, inp, outp = sys.argv[1:4]
cfg = json.load(open(folder + "/config.json")); dc = cfg["dflash_config"]
w, data, out, used = load_file(folder + "/model.safetensors"), torch.load(inp, weights_only=True), {}, set()
def ready(module):  # what vLLM's loader runs after loading (the CPU linears' packed weights)
    for mod in module.modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(mod)
def load(module, prefix):
    for n, p in module.named_parameters():  # a KeyError here: a name vLLM's loader would not find
        p.data.copy_(w[prefix + "." + n]); used.add(prefix + "." + n)
    ready(module)
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp())
    initialize_model_parallel(1, 1)
    for i in range(cfg["num_hidden_layers"]):
        for name in ("attention_conv", "mlp_conv"):
            prefix = f"layers.{i}.{name}"
            conv = m.DFlashGroupedConv(hidden_size=cfg["hidden_size"], taps=dc["conv_kernel_size"],
                                       group_size=dc["conv_group_size"], block_size=cfg["block_size"],
                                       params_dtype=torch.float32, prefix=prefix)
            load(conv, prefix)
            x, y = data[prefix]
            a, coef = conv.prepare(x)
            out[prefix] = (a, conv.finish(y, coef))
    sel = m.CandidateSelector(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], rank=dc["selector_rank"],
                              top_k=dc["selector_top_k"], params_dtype=torch.float32, prefix="candidate_selector")
    load(sel, "candidate_selector")
    head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], prefix="lm_head")
    head.weight.data.copy_(data["lm_head"])
    ready(head)
    cap = float(dc.get("final_logit_softcapping") or 0.0)
    lp = LogitsProcessor(cfg["vocab_size"], scale=float(dc.get("output_multiplier", 1.0)),
                         soft_cap=cap if cap > 0 else None)
    h = data["h"]
    n, s, d = h.shape
    ids, unary = lp.get_top_k_tokens(head, h.reshape(-1, d), dc["selector_top_k"])
    ids, unary = ids.view(n, s, -1), unary.view(n, s, -1)
    hidden = sel.hidden_projection(h.reshape(-1, d)).view(n, s, -1)
    out["candidates"] = (ids, unary)
    out["scores"] = m._score_edges(sel.predecessor_codebook, sel.successor_codebook, ids, unary, hidden,
                                   data["atok"], dc["selector_top_k"])
out["unused"] = sorted(k for k in w if ("_conv." in k or k.startswith("candidate_selector.")) and k not in used)
torch.save(out, outp)
print("ok")
"""


def test_against_vllms_own_modules(target, batch, tmp_path):
    """vLLM's own DFlashGroupedConv (prepare / finish: the CPU branch of _grouped_conv), CandidateSelector with
    _score_edges and LogitsProcessor.get_top_k_tokens, run in vLLM's venv on our export's weights (loaded by the
    names vLLM's modules have): the same convolutions, candidates and [N, W, K, K] scores as ours to 1e-5."""
    import subprocess

    from specopd.engines import vllm_env, vllm_missing_reason, vllm_python

    why = vllm_missing_reason()
    if why:
        pytest.skip(f"no vLLM: {why}")
    feats, anchors, tix, atok, _ = batch
    d = _v2(target, output_multiplier=0.7, final_logit_softcapping=2.0, conv_kernel_size=3)
    export_drafter(d, str(tmp_path / "out"))
    g = torch.Generator().manual_seed(5)
    data, ours = {}, {}
    with torch.no_grad():
        for i, layer in enumerate(d.layers):
            for name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, name)
                x, y = torch.randn(2, 5, BS, 32, generator=g)
                c = conv.coefficients(x)
                data[f"layers.{i}.{name}"] = (x.reshape(-1, 32), y.reshape(-1, 32))
                ours[f"layers.{i}.{name}"] = (conv.convolve(x, c[:, :, 0], 0).reshape(-1, 32),
                                              conv.convolve(y, c[:, :, 1], 1).reshape(-1, 32))
        h = d.hidden(feats, anchors, tix, atok)
        cands = d.candidates(h)
        scores = d.selector_scores(cands, atok)
    data.update(h=h, atok=atok, lm_head=target.lm_head.weight.detach())
    torch.save(data, tmp_path / "in.pt")
    p = subprocess.run([vllm_python(), "-c", _VLLM_PARTS, str(tmp_path / "out"), str(tmp_path / "in.pt"),
                        str(tmp_path / "res.pt")], capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = torch.load(tmp_path / "res.pt", weights_only=True)
    assert res["unused"] == []  # every V2 tensor of the export is one of vLLM's parameters
    for k, (a, b) in ours.items():
        torch.testing.assert_close(res[k][0], a, rtol=1e-5, atol=1e-5, msg=k)
        torch.testing.assert_close(res[k][1], b, rtol=1e-5, atol=1e-5, msg=k)
    assert torch.equal(res["candidates"][0], cands.ids)
    torch.testing.assert_close(res["candidates"][1], cands.unary, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["scores"], scores, rtol=1e-5, atol=1e-5)


def test_recipe_architecture_settings(tmp_path):
    """drafter.architecture passes V2's settings to a fresh drafter (and to the memory plan); an unknown or
    another kind's key is an error naming the allowed ones."""
    from specopd.memory import memory_plan
    from tiny_runs import tiny_recipe
    from specopd.train.worker import Worker

    over = ["drafter.kind=dflash2", "drafter.architecture.selector_top_k=32", "drafter.architecture.selector_rank=4",
            "drafter.architecture.final_logit_softcapping=30.0", "trainer.eval_heldout=false"]
    w = Worker(tiny_recipe(str(tmp_path / "a"), over))
    c = w.drafter.config
    assert (c.selector_top_k, c.selector_rank, c.final_logit_softcapping) == (32, 4, 30.0)
    assert w.drafter.candidate_selector.successor_codebook.shape == (256, 4)
    p = memory_plan(tiny_recipe(str(tmp_path / "a"), over), device_bytes=10**9)
    assert (p.sizes["selector_top_k"], p.sizes["selector_rank"]) == (32, 4)
    with pytest.raises(ValueError, match="unknown drafter override"):
        Worker(tiny_recipe(str(tmp_path / "b"), ["drafter.architecture.selector_top_k=4"]))  # a dflash drafter
    with pytest.raises(ValueError, match="unknown drafter override"):
        Worker(tiny_recipe(str(tmp_path / "c"), ["drafter.kind=dflash2", "drafter.architecture.top_k=4"]))
