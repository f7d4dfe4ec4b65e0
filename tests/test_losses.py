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
