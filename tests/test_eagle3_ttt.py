"""EAGLE-3's off-policy training-time test made cheaper without changing what it computes: ``fused_ttt``'s gradient
made in its forward pass equals the one recomputed in the backward bit for bit and the plain ``ttt_loss`` (fp32),
the target's logits are made once per chunk, and a backward the forward did not foresee still gets the right
gradient."""
import pytest
import torch

from specopd import losses
from specopd.losses import fused_ttt, ttt_loss, tv_alpha

V, D = 96, 16
SUB = torch.arange(0, V, 3)  # a draft vocabulary


def _problem(vocab: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, w = 7, 4
    vq = SUB.numel() if vocab else V
    wq = torch.randn(vq, D, generator=g).requires_grad_()
    wp = torch.randn(V, D, generator=g)
    hq = torch.randn(n, w, D, generator=g).requires_grad_()
    hp = torch.randn(n, w, D, generator=g) * 2
    if vocab:  # some rows' target argmax inside the draft vocabulary, some outside
        hp[:3] = wp[SUB[:3]][:, None, :] * 3
    mask = torch.rand(n, w, generator=g) > 0.2
    return hq, wq, hp, wp, (SUB if vocab else None), mask


def _run(hq, wq, hp, wp, ids, mask, early, temperature=1.0, scale=1.0, chunk_rows=5):
    hq.grad = wq.grad = None
    out = fused_ttt(hq, wq, hp, p_weight=wp, q_ids=ids, mask=mask, denom=9.0, chunk_rows=chunk_rows,
                    temperature=temperature, early_grad=early)
    (out.loss * scale if scale != 1.0 else out.loss).backward()
    return out, hq.grad.clone(), wq.grad.clone()


@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.7])
def test_fused_ttt_early_gradient_equals_the_recomputed_one_and_the_plain_loss(vocab, temperature):
    """The forward-pass gradient (the default) is the recomputed backward's bit for bit, loss, alpha and per-position
    CE too; both equal the plain ``ttt_loss`` on full logits (loss and gradients, fp32 1e-5) and alpha tv_alpha."""
    hq, wq, hp, wp, ids, mask = _problem(vocab)
    early, dh_e, dw_e = _run(hq, wq, hp, wp, ids, mask, True, temperature)
    late, dh_l, dw_l = _run(hq, wq, hp, wp, ids, mask, False, temperature)
    assert torch.equal(early.loss, late.loss) and torch.equal(early.alpha, late.alpha)
    assert torch.equal(early.nll, late.nll)
    assert torch.equal(dh_e, dh_l) and torch.equal(dw_e, dw_l)
    hq.grad = wq.grad = None
    zq, zp = hq @ wq.T, hp @ wp.T
    plain = ttt_loss(zq, zp, ids, mask, 9.0)
    plain.backward()
    assert torch.allclose(early.loss, plain.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(dh_e, hq.grad, rtol=1e-5, atol=1e-6) and torch.allclose(dw_e, wq.grad, rtol=1e-5, atol=1e-6)
    assert float(dh_e.abs().max()) > 0 and float(dw_e.abs().max()) > 0
    full = torch.full((*zq.shape[:2], V), float("-inf"))
    full[..., SUB if vocab else torch.arange(V)] = zq.detach()
    assert torch.allclose(early.alpha[mask], tv_alpha(full, zp, temperature)[mask], atol=1e-6)


@pytest.mark.parametrize("vocab", [False, True])
def test_fused_ttt_unforeseen_backward_is_recomputed(vocab):
    """A backward from something else than the loss as returned (here 3 x loss) is not the gradient the forward
    made: it is recomputed, and equals 3 x the plain gradient."""
    hq, wq, hp, wp, ids, mask = _problem(vocab, seed=1)
    _, dh, dw = _run(hq, wq, hp, wp, ids, mask, True)
    _, dh3, dw3 = _run(hq, wq, hp, wp, ids, mask, True, scale=3.0)
    assert torch.allclose(dh3, 3 * dh, rtol=1e-5, atol=1e-6) and torch.allclose(dw3, 3 * dw, rtol=1e-5, atol=1e-6)
    assert not torch.equal(dh3, dh)


def test_fused_ttt_makes_each_chunks_logits_once(monkeypatch):
    """With the gradient made in the forward, each chunk's q and p logits are made once in all (the recomputing
    backward makes both again: 2 more per chunk); at T = 1 alpha reuses the target's softmax."""
    calls = []
    real = losses.chunk_logits

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(losses, "chunk_logits", counting)
    hq, wq, hp, wp, ids, mask = _problem(False)
    chunks = -(-int(mask.sum()) // 5)
    _run(hq, wq, hp, wp, ids, mask, True, chunk_rows=5)
    assert len(calls) == 2 * chunks
    calls.clear()
    _run(hq, wq, hp, wp, ids, mask, False, chunk_rows=5)
    assert len(calls) == 4 * chunks


def test_fused_ttt_under_no_grad_makes_no_gradient():
    """Evaluation (no grad): no gradient buffers are made, the loss and alpha are the same."""
    hq, wq, hp, wp, ids, mask = _problem(False)
    out, _, _ = _run(hq, wq, hp, wp, ids, mask, True)
    with torch.no_grad():
        ev = fused_ttt(hq, wq, hp, p_weight=wp, mask=mask, denom=9.0, chunk_rows=5)
    assert torch.equal(ev.loss, out.loss.detach()) and torch.equal(ev.alpha, out.alpha)
    assert not ev.loss.requires_grad


@pytest.mark.parametrize("vocab", [False, True])
def test_fused_ttt_onednn_head_products_on_request(monkeypatch, vocab):
    """``kernels.cpu_linear=all``: q's three fp32 head products go through oneDNN (within fp32 rounding of the plain
    loss's gradients; the forward-pass gradient still the recomputed one bit for bit); the default keeps torch.mm."""
    from specopd_kernels.layer_ops import cpu as layer_ops
    from specopd_kernels.paths import KernelsConfig

    if not layer_ops.packing_available():
        pytest.skip("oneDNN with native bf16 (what cpu_linear packs for) is not on this CPU")
    calls = []
    real = layer_ops.linear
    monkeypatch.setattr(layer_ops, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    hq, wq, hp, wp, ids, mask = _problem(vocab, seed=2)
    kp = KernelsConfig(cpu_linear="all")
    got = {}
    for early in (True, False):
        hq.grad = wq.grad = None
        out = fused_ttt(hq, wq, hp, p_weight=wp, q_ids=ids, mask=mask, denom=9.0, chunk_rows=5, early_grad=early,
                        kernel_paths=kp)
        out.loss.backward()
        got[early] = (out.loss.detach(), hq.grad.clone(), wq.grad.clone())
    chunks = -(-int(mask.sum()) // 5)
    assert len(calls) == 3 * chunks + 4 * chunks  # early: z, dx, dw per chunk; recomputed: z twice, dx, dw
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
    hq.grad = wq.grad = None
    plain = ttt_loss(hq @ wq.T, hp @ wp.T, ids, mask, 9.0)
    plain.backward()
    assert torch.allclose(got[True][0], plain.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[True][1], hq.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[True][2], wq.grad, rtol=1e-5, atol=1e-6)
    calls.clear()
    _run(hq, wq, hp, wp, ids, mask, True)  # no kernels section: torch.mm
    assert not calls


@pytest.mark.parametrize("layers", [1, 2])
def test_rows_out_makes_the_last_layer_at_the_wanted_rows_only(tmp_path, layers):
    """The trunk context (``rows(..., out=)``): the last layer's query and everything after it run at the wanted rows
    only (a branch's first step, row a - 1), the K/V of every row still made; the outputs equal the full pass's
    rows (fp32: the same formula on fewer rows, 1e-6)."""
    from specopd.drafters import build_drafter
    from specopd.drafters.autoregressive import causal_attention
    from specopd.models import load_target
    from tests.oracle import make_tiny_checkpoint

    target = load_target(make_tiny_checkpoint("llama", tmp_path, num_hidden_layers=4, vocab_size=V, hidden_size=32,
                                              intermediate_size=48))
    d = build_drafter("eagle3", target, num_layers=layers, block_size=4, seed=3)
    g = torch.Generator().manual_seed(4)
    m = 9
    toks = torch.randint(0, V, (m,), generator=g)
    hidden = d.context_hidden(target.hidden_states(torch.randint(0, V, (1, m), generator=g),
                                                   list(d.feature_layers))[0])
    pos = torch.arange(m)
    out = torch.tensor([0, 4, 8])
    queries = []

    def full(i, q, k, v):
        return causal_attention(q, k, v)

    def part(i, q, k, v):
        queries.append((i, q.shape[0], k.shape[0]))
        return causal_attention(q, k, v, at=out) if i == layers - 1 else causal_attention(q, k, v)

    n_full, h_full = d.rows(toks, hidden, pos, full)
    n_part, h_part = d.rows(toks, hidden, pos, part, out=out)
    assert queries[-1] == (layers - 1, out.numel(), m) and all(x == (i, m, m) for i, x in enumerate(queries[:-1]))
    assert n_part.shape == (out.numel(), n_full.shape[1])
    assert torch.allclose(n_part, n_full[out], rtol=1e-6, atol=1e-6)
    assert torch.allclose(h_part, h_full[out], rtol=1e-6, atol=1e-6)
