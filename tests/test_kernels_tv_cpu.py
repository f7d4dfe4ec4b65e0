"""kernels/e2e_tv: the CPU kernel of alpha = sum min(q, p) and its gradient against its plain reference (naive.py)
in float64, on random rows with the edge cases: one row, V below / on / past a vector (16) and a sum block (1024),
temperatures, exact ties (whole rows and single entries), bf16 logits, underflowing logits, NaN rows; rows are
independent of their batch-mates and of the thread count (bitwise); the fused E2E-TV agrees with its torch path."""
import pytest
import torch

from kernel_check import c_kernels_expected
from specopd_kernels.paths import KernelsConfig
from specopd_kernels.e2e_tv import cpu, naive
from specopd import losses


def test_kernel_builds_where_it_can():
    """Where a C compiler and AVX-512 or AVX2 + FMA exist the kernel must build: a silent fallback would hide a
    broken kernel."""
    if not c_kernels_expected():
        pytest.skip("neither AVX-512 nor AVX2 + FMA, or no C compiler: the fused loss keeps its torch path here")
    assert cpu.available(), cpu.unavailable_reason()


needs_kernel = pytest.mark.skipif(not cpu.available(), reason=f"CPU TV kernel unavailable: {cpu.unavailable_reason()}")


def _rows(seed, r, v, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(r, v, generator=g) * scale).to(dtype), (torch.randn(r, v, generator=g) * scale).to(dtype))


def _ref(zq, zp, t, ga):
    a = naive.tv_alpha_forward(zq.double(), zp.double(), t)
    return a, naive.tv_alpha_backward(zq.double(), zp.double(), t, ga.double())


CASES = [  # rows, V, temperature, logit scale
    (1, 1, 1.0, 3.0), (3, 15, 1.0, 3.0), (4, 16, 0.6, 3.0), (5, 17, 1.7, 3.0), (2, 1023, 1.0, 3.0),
    (3, 1024, 1.0, 3.0), (3, 1025, 0.8, 3.0), (2, 49152, 1.0, 3.0), (4, 300, 1.0, 60.0),  # 60: most entries underflow
]


@needs_kernel
@pytest.mark.parametrize("r,v,t,scale", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_equal_reference(r, v, t, scale, dtype):
    zq, zp = _rows(r * 1000 + v, r, v, scale, dtype)
    ga = torch.randn(r, generator=torch.Generator().manual_seed(v))
    alpha, stats = cpu.tv_alpha_forward(zq, zp, t)
    out = cpu.tv_alpha_backward(zq, zp, t, stats, ga, torch.empty(r, v))
    a_ref, g_ref = _ref(zq, zp, t, ga)
    torch.testing.assert_close(alpha.double(), a_ref, rtol=1e-5, atol=1e-7)
    scale_g = float(g_ref.abs().max()) + 1e-30
    assert float((out.double() - g_ref).abs().max()) <= 1e-5 * scale_g
    # bf16 output: fp32 gradient rounded to nearest even (torch's .to)
    ob = cpu.tv_alpha_backward(zq, zp, t, stats, ga, torch.empty(r, v, dtype=torch.bfloat16))
    assert torch.equal(ob, out.to(torch.bfloat16))


@needs_kernel
def test_ties_take_half_the_gradient():
    """q == p exactly (zq == zp on a whole row; single entries with the rest differing) follows torch.minimum's
    rule ind = 1/2. Row 1's logits are 0 or -200, so both paths compute q, p in {1/3, ~0} exactly: true ties."""
    zq, zp = _rows(7, 3, 40)
    zp[0] = zq[0]  # whole row: alpha = 1
    zq[1], zp[1] = torch.full((40,), -200.0), torch.full((40,), -200.0)
    zq[1, [0, 1, 2]] = 0.0
    zp[1, [0, 1, 3]] = 0.0  # q == p = 1/3 on entries 0, 1; q > p on 2; q < p on 3
    ga = torch.tensor([1.0, -2.0, 0.5])
    alpha, stats = cpu.tv_alpha_forward(zq, zp, 1.0)
    out = cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(3, 40))
    a_ref, g_ref = _ref(zq, zp, 1.0, ga)
    assert abs(float(alpha[0]) - 1.0) < 1e-6 and abs(float(alpha[1]) - 2 / 3) < 1e-6
    torch.testing.assert_close(alpha.double(), a_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.double(), g_ref, rtol=1e-5, atol=1e-6 * float(g_ref.abs().max()))
    # the rule matters: counting ties as q < p gives another gradient on row 1
    q, p = torch.softmax(zq[1].double(), -1), torch.softmax(zp[1].double(), -1)
    ind = (q <= p).double()
    alt = q * (ind - (q * ind).sum()) * ga[1]
    assert float((alt - out[1]).abs().max()) > 1e-2


@needs_kernel
def test_rows_independent_of_batch_and_threads():
    zq, zp = _rows(3, 9, 2000)
    ga = torch.randn(9, generator=torch.Generator().manual_seed(1))
    alpha, stats = cpu.tv_alpha_forward(zq, zp, 0.9)
    out = cpu.tv_alpha_backward(zq, zp, 0.9, stats, ga, torch.empty(9, 2000))
    for i in (0, 4, 8):
        a1, s1 = cpu.tv_alpha_forward(zq[i: i + 1], zp[i: i + 1], 0.9)
        assert torch.equal(a1, alpha[i: i + 1]) and torch.equal(s1, stats[i: i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a2, s2 = cpu.tv_alpha_forward(zq, zp, 0.9)
        o2 = cpu.tv_alpha_backward(zq, zp, 0.9, s2, ga, torch.empty(9, 2000))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a2, alpha) and torch.equal(o2, out)


@needs_kernel
def test_strided_rows_in_place_output_and_nan():
    big_q, big_p = _rows(5, 4, 64)
    zq, zp = big_q[:, :50], big_p[:, 3:53]  # row strides 64, rows contiguous
    ga = torch.ones(4)
    alpha, stats = cpu.tv_alpha_forward(zq, zp, 1.0)
    a_ref, g_ref = _ref(zq, zp, 1.0, ga)
    torch.testing.assert_close(alpha.double(), a_ref, rtol=1e-5, atol=1e-7)
    buf = zq.contiguous()
    cpu.tv_alpha_backward(buf, zp, 1.0, stats, ga, buf)  # the gradient over the logits it reads
    torch.testing.assert_close(buf.double(), g_ref, rtol=1e-5, atol=1e-6 * float(g_ref.abs().max()))
    bad = zq.contiguous()
    bad[2, 7] = float("nan")
    bad[3, 0] = float("inf")
    a_bad, _ = cpu.tv_alpha_forward(bad, zp, 1.0)
    assert torch.isnan(a_bad[2:]).all() and torch.isfinite(a_bad[:2]).all()
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu.tv_alpha_forward(zq.t(), zp.t(), 1.0)
    with pytest.raises(ValueError, match="temperature"):
        cpu.tv_alpha_forward(zq, zp, 0.0)


@needs_kernel
@pytest.mark.parametrize("wdtype,rank,ce", [(torch.float32, 0, 0.0), (torch.bfloat16, 0, 0.0), (torch.float32, 3, 0.0),
                                            (torch.bfloat16, 2, 0.0), (torch.float32, 0, 0.3), (torch.bfloat16, 0, 0.3),
                                            (torch.bfloat16, 2, 0.3)])
def test_fused_e2e_tv_kernel_equals_torch_path(wdtype, rank, ce):
    """The fused loss through the kernel against its torch path: loss, alpha and every gradient (one term and
    DSpark's Markov term; fp32 and bf16 lm_head), chunked; ce > 0: trainer.ce_weight's CE term (T = 1) and its nll."""
    g = torch.Generator().manual_seed(rank + 11 + int(ce * 10))
    n, w, d, v = 6, 4, 8, 333
    hq = torch.randn(n, w, d, generator=g, requires_grad=True)
    hp = torch.randn(n, w, d, generator=g)
    weight = torch.randn(v, d, generator=g).to(wdtype)
    markov = None
    if rank:
        markov = (torch.randn(n, w, rank, generator=g).requires_grad_(True),
                  (torch.randn(v, rank, generator=g) * 0.5).requires_grad_(True))
    mask = torch.rand(n, w, generator=g) > 0.2
    targets = torch.randint(0, v, (n, w), generator=g) if ce else None
    inputs = [hq] + (list(markov) if markov else [])
    res = {}
    for kind in ("torch", "cpu"):
        out = losses.fused_e2e_tv(hq, weight, hp, markov=markov, mask=mask, denom=7, temperature=1.0 if ce else 0.8,
                                  chunk_rows=5, ce_targets=targets, ce_weight=ce,
                                  kernel_paths=KernelsConfig(cpu_tv_loss=kind))
        res[kind] = (out.loss.detach(), out.alpha, out.nll, torch.autograd.grad(out.loss, inputs))
    (l0, a0, n0, g0), (l1, a1, n1, g1) = res["torch"], res["cpu"]
    assert abs(float(l1) - float(l0)) <= 1e-5 * max(1.0, abs(float(l0)))
    torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-6)
    assert (n0 is None) == (n1 is None) == (not ce)
    if ce:
        torch.testing.assert_close(n1, n0, rtol=1e-5, atol=1e-5)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * float(y.abs().max()))


CE_CASES = [(1, 1, 3.0), (3, 15, 3.0), (4, 16, 3.0), (5, 17, 3.0), (3, 1025, 3.0), (2, 49152, 3.0), (4, 300, 60.0)]


@needs_kernel
@pytest.mark.parametrize("r,v,scale", CE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_term_equals_reference(r, v, scale, dtype):
    """trainer.ce_weight through the kernel (T = 1): nll from the forward's statistics, and the gradient
    dL/dalpha q (ind - <q, ind>) + dL/dnll (q - onehot) in one pass, against naive.py in float64; targets on the
    first and last entries; bf16 output rounded once (the onehot subtracted before rounding)."""
    zq, zp = _rows(r * 7 + v, r, v, scale, dtype)
    g = torch.Generator().manual_seed(r + v)
    ga, gn = torch.randn(r, generator=g), torch.randn(r, generator=g)
    targets = torch.randint(0, v, (r,), generator=g)
    targets[0] = 0
    targets[-1] = v - 1
    alpha, stats = cpu.tv_alpha_forward(zq, zp, 1.0)
    nll = cpu.ce_nll(zq, stats, targets)
    ref_nll = naive.ce_nll(zq.double(), targets)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-5, atol=1e-5)
    out = cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(r, v), grad_nll=gn, targets=targets)
    ref = _ref(zq, zp, 1.0, ga)[1] + naive.ce_backward(zq.double(), targets, gn.double())
    assert float((out.double() - ref).abs().max()) <= 1e-5 * (float(ref.abs().max()) + 1e-30)
    ob = cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(r, v, dtype=torch.bfloat16), grad_nll=gn,
                               targets=targets)
    assert torch.equal(ob, out.to(torch.bfloat16))
    if dtype == torch.float32:  # in place over the logits it reads
        buf = zq.clone()
        cpu.tv_alpha_backward(buf, zp, 1.0, stats, ga, buf, grad_nll=gn, targets=targets)
        assert torch.equal(buf, out)
    # a zero CE coefficient (with targets) gives the gradient of no CE term, bit for bit
    alone = cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(r, v))
    zero = cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(r, v), grad_nll=torch.zeros(r), targets=targets)
    assert torch.equal(zero, alone)


@needs_kernel
def test_ce_term_errors_name_what_is_wrong():
    zq, zp = _rows(1, 3, 20)
    _, stats = cpu.tv_alpha_forward(zq, zp, 0.7)
    ga = torch.ones(3)
    with pytest.raises(ValueError, match="T = 1"):
        cpu.tv_alpha_backward(zq, zp, 0.7, stats, ga, torch.empty(3, 20), grad_nll=ga, targets=torch.zeros(3).long())
    _, stats = cpu.tv_alpha_forward(zq, zp, 1.0)
    with pytest.raises(ValueError, match="targets"):
        cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(3, 20), grad_nll=ga, targets=None)
    with pytest.raises(ValueError, match=r"\[0, V = 20\)"):
        cpu.tv_alpha_backward(zq, zp, 1.0, stats, ga, torch.empty(3, 20), grad_nll=ga,
                              targets=torch.tensor([0, 20, 1]))


def test_kernel_choice_errors_name_the_fix():
    bad = KernelsConfig()
    bad.cpu_tv_loss = "fast"  # changed after the check: refused where it is read
    with pytest.raises(ValueError, match="kernels.cpu_tv_loss"):
        losses.use_tv_kernel("cpu", bad)
    assert losses.use_tv_kernel("cpu") == cpu.available()
    assert not losses.use_tv_kernel("meta")
