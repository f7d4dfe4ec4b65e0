"""Losses against direct loops: alpha = sum min(q, p), E2E-TV with prefix masks, acceptance length,
CE, confidence BCE, gradient only through q, and denom splitting."""
import math

import pytest
import torch

from specopd.losses import acceptance_length, align_p_logits, ce_loss, confidence_loss, e2e_tv_loss, tv_alpha

N, W, V = 4, 3, 7


def _logits(seed, n=N, w=W, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, w, V, generator=g) * 2).requires_grad_(requires_grad)


def _alpha_loop(q, p, temp=1.0):
    out = torch.zeros(q.shape[:2])
    for b in range(q.shape[0]):
        for j in range(q.shape[1]):
            qs = [math.exp(x / temp) for x in q[b, j].tolist()]
            ps = [math.exp(x / temp) for x in p[b, j].tolist()]
            out[b, j] = sum(min(a / sum(qs), c / sum(ps)) for a, c in zip(qs, ps))
    return out


def _e2e_loop(alpha, mask):
    losses = []
    for b in range(alpha.shape[0]):
        prod, total, wb = 1.0, 0.0, 0
        for j in range(alpha.shape[1]):
            if not mask[b, j]:
                break  # a masked position ends the branch
            prod *= float(alpha[b, j])
            total += prod
            wb += 1
        if wb:
            losses.append(1.0 - total / wb)
    return sum(losses) / max(len(losses), 1)


def test_tv_alpha_values():
    q, p = _logits(0), _logits(1)
    torch.testing.assert_close(tv_alpha(q, p), _alpha_loop(q, p), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tv_alpha(q, p, temperature=0.5), _alpha_loop(q, p, 0.5), rtol=1e-5, atol=1e-6)
    # 1 - TV: alpha = 1 - 0.5 * sum |q - p|
    tv = 0.5 * (torch.softmax(q, -1) - torch.softmax(p, -1)).abs().sum(-1)
    torch.testing.assert_close(tv_alpha(q, p), 1 - tv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tv_alpha(q, q), torch.ones(N, W), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        tv_alpha(q, p[..., :5])


def test_tv_alpha_greedy_is_q_at_the_target_argmax():
    """temperature 0: p one-hot at argmax p, q at T = 1, so alpha = q(argmax p); its gradient goes through q."""
    q, p = _logits(4, requires_grad=True), _logits(5)
    a = tv_alpha(q, p, temperature=0.0)
    for b in range(N):
        for j in range(W):
            qs = [math.exp(x) for x in q[b, j].tolist()]
            g = max(range(V), key=lambda v: float(p[b, j, v]))
            assert abs(float(a[b, j].detach()) - qs[g] / sum(qs)) < 1e-6
    (gq,) = torch.autograd.grad(a.sum(), q)
    sq = torch.softmax(q.detach(), -1)
    onehot = torch.nn.functional.one_hot(p.argmax(-1), V).float()
    torch.testing.assert_close(gq, a.detach()[..., None] * (onehot - sq), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="temperature"):
        e2e_tv_loss(q, p, temperature=-1.0)


def test_e2e_tv_values_and_masks():
    q, p = _logits(2), _logits(3)
    alpha = _alpha_loop(q, p)
    full = torch.ones(N, W, dtype=torch.bool)
    assert abs(float(e2e_tv_loss(q, p)) - _e2e_loop(alpha, full)) < 1e-5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)  # row 3: empty branch
    assert abs(float(e2e_tv_loss(q, p, mask)) - _e2e_loop(alpha, mask)) < 1e-5
    # row 2's position 2 is after a masked position: it must not count
    assert abs(float(e2e_tv_loss(q[2:3], p[2:3], mask[2:3])) - (1 - float(alpha[2, 0]))) < 1e-5
    assert float(e2e_tv_loss(q[3:4], p[3:4], mask[3:4])) == 0.0
    # acceptance length, bonus included
    al = acceptance_length(alpha, mask)
    for b in range(N):
        prod, ref = 1.0, 1.0
        for j in range(W):
            if not mask[b, j]:
                break
            prod *= float(alpha[b, j])
            ref += prod
        assert abs(float(al[b]) - ref) < 1e-5
    assert torch.allclose(acceptance_length(torch.ones(2, W)), torch.full((2,), W + 1.0))


def test_w1_is_mean_tv():
    q, p = _logits(4, w=1), _logits(5, w=1)
    torch.testing.assert_close(e2e_tv_loss(q, p), (1 - _alpha_loop(q, p)).mean(), rtol=1e-5, atol=1e-6)


def test_gradient_through_q_only():
    q, p = _logits(6, requires_grad=True), _logits(7, requires_grad=True)
    e2e_tv_loss(q, p).backward()
    assert p.grad is None or p.grad.abs().max() == 0
    assert q.grad is not None and q.grad.abs().max() > 0
    # finite-difference check of one coordinate (float64 inputs are cast to fp32 inside: loose tolerance)
    eps, idx = 1e-2, (1, 1, 2)
    qp, qm = q.detach().clone(), q.detach().clone()
    qp[idx] += eps
    qm[idx] -= eps
    fd = (float(e2e_tv_loss(qp, p)) - float(e2e_tv_loss(qm, p))) / (2 * eps)
    assert abs(fd - float(q.grad[idx])) < 2e-3 * max(1.0, abs(fd))


def test_denom_splitting():
    q, p = _logits(8, requires_grad=True), _logits(9)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    targets = torch.randint(0, V, (N, W), generator=torch.Generator().manual_seed(0))
    conf = torch.randn(N, W, generator=torch.Generator().manual_seed(1), requires_grad=True)
    alpha = tv_alpha(q, p)
    for fn, args in ((e2e_tv_loss, (q, p)), (ce_loss, (q, targets)), (confidence_loss, (conf, alpha))):
        whole = fn(*args, mask)
        gw = torch.autograd.grad(whole, args[0], retain_graph=True)[0]
        halves = [fn(*(a[s] for a in args), mask[s], denom=N) for s in (slice(0, 2), slice(2, 4))]
        torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-6, atol=1e-7)
        gh = torch.autograd.grad(halves[0] + halves[1], args[0], retain_graph=True)[0]
        torch.testing.assert_close(gh, gw, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="denom"):
        e2e_tv_loss(q, p, denom=0)


def test_ce_and_confidence_values():
    q = _logits(10)
    targets = torch.randint(0, V, (N, W), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    ref, nb = 0.0, 0
    for b in range(N):
        terms = [-float(torch.log_softmax(q[b, j], -1)[targets[b, j]]) for j in range(W) if mask[b, j]]
        if terms:
            ref, nb = ref + sum(terms) / len(terms), nb + 1
    assert abs(float(ce_loss(q, targets, mask)) - ref / nb) < 1e-5
    conf = torch.randn(N, W, generator=torch.Generator().manual_seed(3), requires_grad=True)
    alpha = torch.rand(N, W, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    ref, nb = 0.0, 0
    for b in range(N):
        terms = []
        for j in range(W):
            if mask[b, j]:
                s, y = 1 / (1 + math.exp(-float(conf[b, j].detach()))), float(alpha[b, j].detach())
                terms.append(-(y * math.log(s) + (1 - y) * math.log(1 - s)))
        if terms:
            ref, nb = ref + sum(terms) / len(terms), nb + 1
    loss = confidence_loss(conf, alpha, mask)
    assert abs(float(loss.detach()) - ref / nb) < 1e-5
    loss.backward()
    assert alpha.grad is None and conf.grad.abs().max() > 0


def test_align_p_logits():
    a, sc = torch.randn(2, V), torch.randn(2, W, V)
    p = align_p_logits(a, sc)
    assert torch.equal(p[:, 0], a) and torch.equal(p[:, 1:], sc[:, :-1])


# ------------------------------------------------------------------------------ fused, chunked (hidden states)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from specopd.losses import (auto_chunk_rows, check_chunk_rows, e2e_tv_from_alpha, fused_ce,  # noqa: E402
                            fused_e2e_tv, logits_at, position_weights, target_argmax)
from specopd.sampling import sample_from_hidden  # noqa: E402


def _hidden(seed, n, w, d=8, v=13, r=0, ties=()):
    """hq (grad), lm_head weight, hp (detached), optional markov (e, w2) with grad; rows in ``ties`` get hp == hq."""
    g = torch.Generator().manual_seed(seed)
    hq = torch.randn(n, w, d, generator=g)
    hp = torch.randn(n, w, d, generator=g)
    for b in ties:
        hp[b] = hq[b]
    weight = torch.randn(v, d, generator=g)
    markov = None
    if r:
        markov = (torch.randn(n, w, r, generator=g).requires_grad_(True),
                  (torch.randn(v, r, generator=g) * 0.5).requires_grad_(True))
    return hq.requires_grad_(True), weight, hp, markov


def _ref_logits(hq, weight, hp, markov):
    q = (hq @ weight.t()).float()
    if markov is not None:
        q = q + (markov[0] @ markov[1].t()).float()
    return q, (hp @ weight.t()).float()


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _close(a, b, rtol=1e-5):
    scale = max(float(b.abs().max()), 1e-6)
    assert float((a - b).abs().max()) <= rtol * scale, (float((a - b).abs().max()), scale)


CASES = [  # n, w, temperature, chunk, markov rank, mask kind, denom, ties
    (5, 4, 1.0, 3, 0, None, None, ()),
    (5, 4, 0.6, 7, 3, "holes", 9, ()),
    (7, 1, 1.3, 2, 0, "holes", None, ()),  # a single drafted token
    (4, 3, 1.0, 5, 0, "empty", 6, (0, 2)),  # ties q == p on whole rows, an empty branch
    (6, 5, 0.9, 1, 0, "holes", 11, (3,)),
    (3, 4, 1.0, 1000, 4, None, 3, ()),  # one chunk holds everything
    (5, 4, 0.0, 3, 0, None, None, ()),  # greedy: alpha = q(argmax p)
    (7, 1, 0.0, 2, 3, "holes", None, ()),  # greedy, one drafted token, DSpark's Markov term
    (4, 3, 0.0, 5, 0, "empty", 6, (0, 2)),  # greedy, q == p rows, an empty branch
]


def _case_mask(kind, n, w, seed):
    if kind is None:
        return None
    m = torch.rand(n, w, generator=torch.Generator().manual_seed(seed)) > 0.25
    if kind == "empty":
        m[1] = False
    return m


@pytest.mark.parametrize("n,w,temp,chunk,rank,mask_kind,denom,ties", CASES)
def test_fused_e2e_tv_equals_full_logits(n, w, temp, chunk, rank, mask_kind, denom, ties):
    hq, weight, hp, markov = _hidden(n * 10 + w, n, w, r=rank, ties=ties)
    mask = _case_mask(mask_kind, n, w, n + w)
    inputs = [hq] + (list(markov) if markov else [])
    out = fused_e2e_tv(hq, weight, hp, markov=markov, mask=mask, denom=denom, temperature=temp, chunk_rows=chunk)
    g = _grads(out.loss, inputs)
    ql, pl = _ref_logits(hq, weight, hp, markov)
    ref = e2e_tv_loss(ql, pl, mask, denom=denom, temperature=temp)
    gr = _grads(ref, inputs)
    assert abs(float(out.loss.detach()) - float(ref.detach())) <= 1e-5 * max(1.0, abs(float(ref.detach())))
    for a, b in zip(g, gr):
        _close(a, b)
    # alpha (the metrics) from the same pass, on the valid prefix; 0 past it
    valid = torch.cumprod(_mask_or_ones(mask, n, w).long(), 1).bool()
    alpha_ref = tv_alpha(ql.detach(), pl, temp)
    _close(out.alpha[valid], alpha_ref[valid])
    assert bool((out.alpha[~valid] == 0).all()) and not out.alpha.requires_grad
    for b in ties:
        if temp == 0:  # greedy: alpha = q(argmax q) = max q, not 1
            top = torch.softmax(ql.detach()[b], -1).amax(-1)
            torch.testing.assert_close(out.alpha[b][valid[b]], top[valid[b]], rtol=1e-5, atol=1e-6)
        else:
            assert torch.allclose(out.alpha[b][valid[b]], torch.ones(int(valid[b].sum())), atol=1e-5)


def _mask_or_ones(mask, n, w):
    return torch.ones(n, w, dtype=torch.bool) if mask is None else mask


def test_fused_e2e_tv_ties_use_half_gradient():
    """Partial ties: q_v == p_v exactly on some v, q != p elsewhere. torch.minimum's gradient is 1/2 on a tie;
    the fused backward must follow it (checked to matter: the rule 1[q <= p] gives another gradient)."""
    weight = torch.eye(4)  # logits == hidden states, exactly
    hq = torch.tensor([[[0.0, 0.0, -1.0, -2.0], [1.0, 1.0, 0.5, -0.25]]], requires_grad=True)
    hp = torch.tensor([[[0.0, 0.0, -2.0, -1.0], [1.0, 1.0, -0.25, 0.5]]])  # entries 2, 3 swapped
    q, p = torch.softmax(hq.detach(), -1), torch.softmax(hp, -1)
    assert torch.equal(q[..., :2], p[..., :2]) and not torch.equal(q, p)  # the ties this test is about
    out = fused_e2e_tv(hq, weight, hp, chunk_rows=1)
    ref = e2e_tv_loss(hq @ weight.t(), hp @ weight.t())
    g, gr = _grads(out.loss, [hq])[0], _grads(ref, [hq])[0]
    torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-8)
    # the gradient with ties counted as q < p (ind = 1[q <= p]) differs: the test can tell the rules apart
    ind = (q <= p).float()
    alt = q * (ind - (q * ind).sum(-1, keepdim=True)) * _dl_dalpha(tv_alpha(hq.detach(), hp))[..., None]
    assert float((alt - gr).abs().max()) > 1e-3


def _dl_dalpha(alpha):
    a = alpha.clone().requires_grad_(True)
    return torch.autograd.grad(e2e_tv_from_alpha(a), a)[0]


def test_fused_lm_head_gradient_when_trainable():
    hq, weight, hp, _ = _hidden(5, 3, 4)
    weight.requires_grad_(True)
    out = fused_e2e_tv(hq, weight, hp, temperature=0.8, chunk_rows=5)
    # the target side is a constant: p from a detached copy of the weight
    ref = e2e_tv_loss(hq @ weight.t(), hp @ weight.detach().t(), temperature=0.8)
    for a, b in zip(_grads(out.loss, [hq, weight]), _grads(ref, [hq, weight])):
        _close(a, b)


def test_fused_all_masked_and_denom_split():
    hq, weight, hp, markov = _hidden(6, 4, 3, r=2)
    none = torch.zeros(4, 3, dtype=torch.bool)
    out = fused_e2e_tv(hq, weight, hp, markov=markov, mask=none, chunk_rows=2)
    assert float(out.loss.detach()) == 0.0
    whole = fused_e2e_tv(hq, weight, hp, markov=markov, chunk_rows=4).loss
    halves = [fused_e2e_tv(hq[s], weight, hp[s], markov=(markov[0][s], markov[1]), denom=4, chunk_rows=4).loss
              for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,w,temp,chunk,rank,mask_kind,denom,ties", CASES)
def test_fused_e2e_tv_with_ce_term_equals_full_logits(n, w, temp, chunk, rank, mask_kind, denom, ties):
    """trainer.ce_weight: E2E-TV + ce_weight x CE on the reference tokens, one pass: loss and every gradient equal
    the plain ``e2e_tv_loss + ce_weight * ce_loss`` on full logits (the CE on the valid prefix, q at T = 1)."""
    hq, weight, hp, markov = _hidden(n * 10 + w + 1, n, w, r=rank, ties=ties)
    mask = _case_mask(mask_kind, n, w, n + w)
    targets = torch.randint(0, 13, (n, w), generator=torch.Generator().manual_seed(n + 2 * w))
    inputs = [hq] + (list(markov) if markov else [])
    lam = 0.3
    out = fused_e2e_tv(hq, weight, hp, markov=markov, mask=mask, denom=denom, temperature=temp, chunk_rows=chunk,
                       ce_targets=targets, ce_weight=lam)
    ql, pl = _ref_logits(hq, weight, hp, markov)
    valid = torch.cumprod(_mask_or_ones(mask, n, w).long(), 1).bool()
    ref = e2e_tv_loss(ql, pl, mask, denom=denom, temperature=temp) + lam * ce_loss(ql, targets, valid, denom=denom)
    assert abs(float(out.loss.detach()) - float(ref.detach())) <= 1e-5 * max(1.0, abs(float(ref.detach())))
    g = _grads(out.loss, inputs)
    for a, b in zip(g, _grads(ref, inputs)):
        _close(a, b)
    _close(out.alpha[valid], tv_alpha(ql.detach(), pl, temp)[valid])
    nll_ref = -torch.log_softmax(ql.detach(), -1).gather(-1, targets[..., None]).squeeze(-1)
    _close(out.nll[valid], nll_ref[valid])
    # the CE term is what moves the gradient: without it the result is E2E-TV's
    alone = fused_e2e_tv(hq, weight, hp, markov=markov, mask=mask, denom=denom, temperature=temp, chunk_rows=chunk)
    assert out.nll is not None and alone.nll is None
    if bool(valid.any()):
        assert float((g[0] - _grads(alone.loss, [hq])[0]).abs().max()) > 1e-4


@pytest.mark.parametrize("n,w,chunk", [(1, 1, "auto"), (3, 4, 1), (5, 3, 4), (4, 5, 7), (2, 6, "auto")])
def test_target_argmax_equals_full_logits(n, w, chunk):
    """trainer.ce_labels=target: the target's argmax at every scored position, chunk by chunk (one row, chunks that
    cut rows unevenly, one chunk), equals argmax of the full [N, W, V] logits; on a tie the first index wins (a
    duplicated lm_head row; a hidden state of zeros ties every token and gives 0), as torch.argmax."""
    _, weight, hp, _ = _hidden(7 * n + w, n, w, v=13)
    weight[9] = weight[4]  # tokens 4 and 9 tie wherever one of them is the maximum
    hp[0, 0] = weight[4] * 4  # ... which it is here: the label is 4, not 9
    if w > 1:
        hp[-1, -1] = 0.0  # every logit 0: the label is 0
    got = target_argmax(hp, weight, chunk_rows=chunk)
    full = (hp @ weight.t()).argmax(-1)
    assert got.dtype == torch.long and tuple(got.shape) == (n, w)
    assert torch.equal(got, full)
    assert int(got[0, 0]) == 4 and (w == 1 or int(got[-1, -1]) == 0)


def test_fused_e2e_tv_ce_term_needs_its_labels():
    hq, weight, hp, _ = _hidden(3, 2, 3)
    with pytest.raises(ValueError, match="ce_targets"):
        fused_e2e_tv(hq, weight, hp, ce_weight=0.5)
    with pytest.raises(ValueError, match="ce_targets"):
        fused_e2e_tv(hq, weight, hp, ce_weight=0.5, ce_targets=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ce_weight"):
        fused_e2e_tv(hq, weight, hp, ce_weight=-1.0, ce_targets=torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("weights", [None, "dflash", [0.5, 1.0, 0.0, 2.0]])
def test_fused_ce_equals_full_logits(weights):
    n, w = 6, 4
    hq, weight, hp, markov = _hidden(11, n, w, r=3)
    targets = torch.randint(0, 13, (n, w), generator=torch.Generator().manual_seed(3))
    mask = _case_mask("empty", n, w, 5)
    out = fused_ce(hq, weight, targets, markov=markov, mask=mask, denom=8, weights=weights, hp=hp,
                   temperature=0.7, chunk_rows=5)
    ql, pl = _ref_logits(hq, weight, hp, markov)
    ref = ce_loss(ql, targets, mask, denom=8, weights=weights)
    assert abs(float(out.loss.detach()) - float(ref.detach())) <= 1e-5 * max(1.0, abs(float(ref.detach())))
    inputs = [hq, *markov]
    for a, b in zip(_grads(out.loss, inputs), _grads(ref, inputs)):
        _close(a, b)
    # alpha for the metrics comes from the same pass (at the sampling temperature), on valid positions
    _close(out.alpha[mask], tv_alpha(ql.detach(), pl, 0.7)[mask])
    no_alpha = fused_ce(hq, weight, targets, chunk_rows=3)
    assert no_alpha.alpha is None
    # greedy alpha beside the CE in one pass: the same loss and gradient, alpha = q(argmax p)
    greedy = fused_ce(hq, weight, targets, markov=markov, mask=mask, denom=8, weights=weights, hp=hp,
                      temperature=0.0, chunk_rows=4)
    ref = ce_loss(*_ref_logits(hq, weight, hp, markov)[:1], targets, mask, denom=8, weights=weights)
    for a, b in zip(_grads(greedy.loss, inputs), _grads(ref, inputs)):
        _close(a, b)
    _close(greedy.alpha[mask], tv_alpha(ql.detach(), pl, 0.0)[mask])


def test_position_weights_dflash():
    w = position_weights("dflash", 4)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7), math.exp(-3 / 7)]))
    with pytest.raises(ValueError, match="position_weights"):
        position_weights("linear", 4)
    with pytest.raises(ValueError, match="position_weights"):
        position_weights([1.0, 2.0], 4)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "big", None])
def test_chunk_rows_below_one_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="chunk_rows"):
        check_chunk_rows(bad)
    hq, weight, hp, _ = _hidden(1, 2, 2)
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_e2e_tv(hq, weight, hp, chunk_rows=bad)


def test_auto_chunk_rows_fits_budget():
    v = 151_936
    rows = auto_chunk_rows(v, "cpu", budget_bytes=1 << 30)
    assert rows * 4 * v * 4 <= 1 << 30 < (rows + 1) * 4 * v * 4
    assert auto_chunk_rows(v, "cpu", budget_bytes=10) == 1
    assert auto_chunk_rows(v, "cpu") >= 1


def test_even_chunk_cuts_rows_into_near_equal_chunks():
    """No small last chunk: ceil(n / chunk) chunks of near-equal size, never above ``chunk``."""
    from specopd.losses import even_chunk

    assert even_chunk(512, 341) == 256 and even_chunk(512, 682) == 512 and even_chunk(1024, 682) == 512
    assert even_chunk(0, 5) == 5 and even_chunk(1, 5) == 1 and even_chunk(7, 1) == 1
    for n in range(1, 60):
        for c in range(1, 20):
            e = even_chunk(n, c)
            sizes = [min(e, n - s) for s in range(0, n, e)]
            assert e <= c and len(sizes) == -(-n // c) and max(sizes) - min(sizes) <= len(sizes), (n, c, sizes)


def test_pooled_chunk_buffers_are_kept_between_calls_on_the_cpu():
    """``ChunkBuffers.pooled``: the same storage call after call (no fresh pages), grown when more rows are asked,
    fresh while in use (a nested call cannot overwrite its caller's chunk), freed by ``release_pool``; the fused
    loss's outputs are not views of it (a second call leaves the first call's alpha as it was)."""
    from specopd.losses import ChunkBuffers

    ChunkBuffers.release_pool()
    with ChunkBuffers.pooled(8, 300, "cpu") as a:
        pa = a.fp32(0, 8).data_ptr()
        with ChunkBuffers.pooled(8, 300, "cpu") as nested:
            assert nested is not a and nested.fp32(0, 8).data_ptr() != pa
    with ChunkBuffers.pooled(4, 300, "cpu") as b:
        assert b is a and b.fp32(0, 4).data_ptr() == pa
    with ChunkBuffers.pooled(16, 300, "cpu") as c:
        assert c is not a and c.rows == 16
    ChunkBuffers.release_pool()
    with ChunkBuffers.pooled(4, 300, "cpu") as d:
        assert d is not c
    hq, weight, hp, _ = _hidden(6, 4, 3)
    first = fused_e2e_tv(hq, weight, hp, chunk_rows=5)
    kept = first.alpha.clone()
    fused_e2e_tv(hq * 2, weight, hp, chunk_rows=5)
    assert torch.equal(first.alpha, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ce", [0.0, 0.5])
def test_backward_reads_the_forwards_single_chunk_back_bit_for_bit(monkeypatch, dtype, ce):
    """With all rows in one pooled chunk, the kernel's backward reads the forward's logits back instead of
    recomputing them: the same gradient to the bit as a backward that recomputes (forced by a call that uses the
    pool in between), and the read-back path is the one taken."""
    from specopd_kernels.e2e_tv import cpu as tv_cpu
    from specopd import losses

    if not tv_cpu.available():
        pytest.skip(f"the CPU TV kernel does not build: {tv_cpu.unavailable_reason()}")
    reads = []
    raw = losses.raw_logits
    monkeypatch.setattr(losses, "raw_logits", lambda *a, **k: reads.append(k.get("compute", True)) or raw(*a, **k))
    g = torch.Generator().manual_seed(3)
    n, w, d, v = 5, 4, 16, 300
    hp = torch.randn(n, w, d, generator=g)
    weight = torch.randn(v, d, generator=g).to(dtype)
    targets = torch.randint(0, v, (n, w), generator=g)
    grads = []
    for between in (False, True):
        hq = torch.randn(n, w, d, generator=torch.Generator().manual_seed(4)).requires_grad_()
        kw = dict(ce_targets=targets, ce_weight=ce) if ce else {}
        out = fused_e2e_tv(hq, weight, hp.to(dtype).float(), chunk_rows=64, temperature=1.0 if ce else 0.9, **kw)  # CE: kernel at T = 1
        if between:
            with losses.ChunkBuffers.pooled(4, v, "cpu"):
                pass
        reads.clear()
        out.loss.backward()
        assert reads == ([True, True] if between else [False, False])
        grads.append(hq.grad)
    assert torch.equal(grads[0], grads[1])


def test_bf16_backward_in_row_blocks_puts_every_row_back(monkeypatch):
    """A bf16 chunk's dx = G @ w runs in blocks of ``DX_ROWS_CPU_BF16`` rows on the CPU: the gradient of every row
    equals the one-block product up to one bf16 rounding of the same fp32 sums (rows land where they belong)."""
    from specopd import losses

    g = torch.Generator().manual_seed(7)
    n, w, d, v = 100, 7, 16, 50  # 700 rows in one chunk: blocks of 234 at 341
    hp = torch.randn(n, w, d, generator=g)
    weight = torch.randn(v, d, generator=g).bfloat16()
    grads = []
    for rows in (losses.DX_ROWS_CPU_BF16, 1 << 30):
        monkeypatch.setattr(losses, "DX_ROWS_CPU_BF16", rows)
        hq = torch.randn(n, w, d, generator=torch.Generator().manual_seed(8)).requires_grad_()
        fused_e2e_tv(hq, weight, hp, chunk_rows=1000).loss.backward()
        grads.append(hq.grad)
    blocked, whole = grads
    assert torch.allclose(blocked, whole, rtol=2 ** -7, atol=1e-6 * float(whole.abs().max()))
    assert float((blocked - whole).abs().max()) < 0.05 * float(whole.abs().max())


def test_bad_shapes_are_clear_errors():
    hq, weight, hp, _ = _hidden(2, 3, 2)
    with pytest.raises(ValueError, match="lm_head weight"):
        fused_e2e_tv(hq, weight[:, :4], hp)
    with pytest.raises(ValueError, match="hp must be"):
        fused_e2e_tv(hq, weight, hp[:2])
    with pytest.raises(ValueError, match="markov"):
        fused_e2e_tv(hq, weight, hp, markov=(torch.zeros(3, 2, 2), torch.zeros(5, 2)))
    with pytest.raises(ValueError, match="temperature"):
        fused_e2e_tv(hq, weight, hp, temperature=-0.5)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_fused_never_materialises_all_rows_of_logits():
    n, w, v, chunk = 12, 5, 97, 7
    hq, weight, hp, markov = _hidden(9, n, w, v=v, r=3)
    targets = torch.randint(0, v, (n, w))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with _MaxNumel() as rec:
        out = fused_e2e_tv(hq, weight, hp, markov=markov, chunk_rows=chunk, temperature=0.9)
        out.loss.backward()
        fused_ce(hq, weight, targets, markov=markov, hp=hp, chunk_rows=chunk).loss.backward()
        sample_from_hidden(hq.detach(), weight, 1.0, [torch.arange(6), torch.arange(6, 12)], gens,
                           markov=(markov[0].detach(), markov[1].detach()), chunk_rows=chunk)
    # the largest tensors are one chunk's logits and the frozen / low-rank weights' gradients, never [N, W, V]
    assert rec.max_numel <= max(chunk * v, v * 8), rec.max_numel
    assert rec.max_numel < n * w * v // 4


# ------------------------------------------------------------------------------ chunked sampling
def test_sample_greedy_is_argmax():
    hq, weight, _, markov = _hidden(4, 6, 3, r=2)
    h, m = hq.detach(), (markov[0].detach(), markov[1].detach())
    toks = sample_from_hidden(h, weight, 0.0, [torch.arange(6)], [None], markov=m, chunk_rows=4)
    torch.testing.assert_close(toks, (h @ weight.t() + m[0] @ m[1].t()).argmax(-1))


def test_sample_independent_of_chunks_and_other_samples():
    hq, weight, _, _ = _hidden(8, 9, 4)
    h = hq.detach()
    rows = [torch.arange(0, 4), torch.arange(4, 9)]

    def draw(chunk, seeds=(1, 2), which=(0, 1)):
        gens = [torch.Generator().manual_seed(seeds[i]) for i in which]
        return sample_from_hidden(h, weight, 0.8, [rows[i] for i in which], gens, chunk_rows=chunk)

    ref = draw(1000)
    for chunk in (1, 3, 5, 36):
        assert torch.equal(draw(chunk), ref)
    # sample 0's tokens depend only on its own generator, not on sample 1's seed or presence
    assert torch.equal(draw(4, seeds=(1, 99))[:4], ref[:4])
    assert torch.equal(draw(4, which=(0,))[:4], ref[:4])
    assert bool((draw(4, which=(0,))[4:] == -1).all())  # rows of no sample are not drawn


def test_sample_distribution_and_zero_probability():
    """Empirical frequencies match softmax(logits / T); tokens with p == 0 in fp32 are never drawn."""
    v, d, n = 6, 4, 4000
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, d, generator=g)
    weight[2] = -1e4 * torch.ones(d)  # logit -4e4: p underflows to 0
    h = torch.ones(n, d)
    toks = sample_from_hidden(h, weight, 1.5, [torch.arange(n)], [torch.Generator().manual_seed(5)], chunk_rows=333)
    p = torch.softmax((h[0] @ weight.t()) / 1.5, -1)
    freq = torch.bincount(toks, minlength=v).float() / n
    assert int((toks == 2).sum()) == 0 and float(p[2]) == 0.0
    # 4000 draws: each frequency within 5 standard errors of its probability
    se = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-6).all()), (freq, p)


def test_two_level_inverse_cdf_equals_flat_cdf():
    """``draw_`` (block sums, then one block's cumulative sum) picks the token of the flat fp64 inverse CDF, for V
    below, at and above the block size, with zero-probability tokens at block edges never drawn."""
    from specopd.sampling import CDF_BLOCK, draw_

    g = torch.Generator().manual_seed(3)
    for v in (7, CDF_BLOCK, 2 * CDF_BLOCK + 5, 3 * CDF_BLOCK):
        z = torch.randn(400, v, generator=g) * 3
        dead = [0, v - 1] + [k * CDF_BLOCK + d for k in range(1, v // CDF_BLOCK + 1) for d in (-1, 0)
                             if 0 <= k * CDF_BLOCK + d < v]
        z[:, dead] = -1e4  # p underflows to 0 at the edges of every block
        u = torch.rand(400, generator=g, dtype=torch.float64)
        u[:3] = torch.tensor([0.0, 1 - 2**-53, 0.5], dtype=torch.float64)
        p = torch.softmax(z / 0.7, -1)
        cdf = torch.cumsum(p.double(), -1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=v - 1)
        got = draw_(z.clone(), u, 0.7)
        assert float(p[torch.arange(400), got].min()) > 0
        assert int((got != ref).sum()) <= 1, v  # fp32 block sums: a u on a token boundary may round across it


def test_logits_at_rows():
    h, weight = torch.randn(7, 5), torch.randn(11, 5)
    torch.testing.assert_close(logits_at(h, weight, torch.tensor([6, 0, 3]), temperature=0.5),
                               (h[[6, 0, 3]] @ weight.t()) / 0.5)


def test_fused_bf16_close_to_fp32():
    """bf16 inputs: the chunk's logits are cast to fp32 before the softmax (fp32 accumulation per chunk)."""
    hq, weight, hp, _ = _hidden(12, 6, 4, d=32, v=50)
    out = fused_e2e_tv(hq.detach().bfloat16().requires_grad_(True), weight.bfloat16(), hp.bfloat16(), chunk_rows=5)
    ref = e2e_tv_loss(hq @ weight.t(), hp @ weight.t())
    assert abs(float(out.loss.detach()) - float(ref.detach())) < 2e-2
    assert out.alpha.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cuda_bf16_paper_scale_memory_and_value():
    """V = 151,936, 4,096 branch rows, bf16 on CUDA: the loss + backward stays within inputs + one chunk, and
    equals the fp32 full-logit reference to bf16 accuracy."""
    n, w, d, v, chunk = 256, 16, 1024, 151_936, 256
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(v, d, generator=g) / d ** 0.5).cuda()
    hq32 = (torch.randn(n, w, d, generator=g) * 3).cuda()
    hp32 = (torch.randn(n, w, d, generator=g) * 3).cuda()
    hq = hq32.bfloat16().requires_grad_(True)
    wb, hp = weight.bfloat16(), hp32.bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fused_e2e_tv(hq, wb, hp, temperature=0.8, chunk_rows=chunk)
    out.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # one chunk's fp32 working set (CHUNK_WORKSET_FACTOR x [chunk, V]) + hq's gradient + index / alpha vectors
    from specopd.losses import CHUNK_WORKSET_FACTOR

    budget = CHUNK_WORKSET_FACTOR * chunk * v * 4 + 2 * n * w * d * 2 + (64 << 20)
    assert peak <= budget, (peak / 2**20, budget / 2**20)
    assert peak < n * w * v * 4  # less than a single [N, W, V] fp32 tensor
    ref_q = (hq32.bfloat16().float() @ wb.float().t()).requires_grad_(True)
    ref = e2e_tv_loss(ref_q, hp.float() @ wb.float().t(), temperature=0.8)
    assert abs(float(out.loss.detach()) - float(ref.detach())) < 5e-3
    (gq,) = torch.autograd.grad(ref, ref_q)
    g_ref = (gq @ wb.float()).flatten()
    cos = torch.nn.functional.cosine_similarity(hq.grad.float().flatten(), g_ref, dim=0)
    assert float(cos) > 0.99


def test_fused_mixed_dtypes_and_autocast():
    """fp32 hidden states with a bf16 lm_head (the worker's fp32 drafter + bf16 target) and an ambient autocast:
    the weight's dtype sets the matmul precision, gradients come back in the input's dtype."""
    hq, weight, hp, _ = _hidden(13, 4, 3, d=16, v=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_e2e_tv(hq, weight.bfloat16(), hp, chunk_rows=5)
        out.loss.backward()
    assert hq.grad.dtype == torch.float32
    ref = fused_e2e_tv(hq.detach().bfloat16().float().requires_grad_(True), weight.bfloat16().float(),
                       hp.bfloat16().float(), chunk_rows=5)
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) < 1e-2


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_chunk_logits_into_reused_buffers_is_bitwise_the_same(dtypes):
    """``ChunkBuffers`` only changes where the logits live: every chunk's values have the same bits as fresh
    tensors, for one term and for two (DSpark's low-rank term), in fp32 and bf16, over chunks of several sizes."""
    from specopd.losses import ChunkBuffers, chunk_logits

    g = torch.Generator().manual_seed(0)
    v, rows = 300, torch.randperm(23, generator=g)
    xs = [torch.randn(23, k, generator=g).to(dt) for k, dt in zip((16, 5), dtypes)]
    ws = [torch.randn(v, k, generator=g).to(dt) for k, dt in zip((16, 5), dtypes)]
    bufs = ChunkBuffers(8, v, "cpu")
    for s in range(0, 23, 8):
        r = rows[s: s + 8]
        got = chunk_logits(xs, ws, r, bufs)
        other = chunk_logits(xs[:1], ws[:1], r, bufs, slot=1)  # another slot: got is not overwritten
        assert got.dtype == torch.float32 and got.shape == (r.numel(), v)
        assert torch.equal(got, chunk_logits(xs, ws, r)) and torch.equal(other, chunk_logits(xs[:1], ws[:1], r))
        assert got.data_ptr() != other.data_ptr()
