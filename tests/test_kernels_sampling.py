"""kernels/sampling: the CPU inverse-CDF kernel against its float64 reference (naive.py) on random rows with the edge
cases: V below / on / past a vector (16) and a search block (1024), temperatures, bf16 logits, -inf logits, u at 0
and just below 1, one finite logit, logits that underflow, NaN / inf rows, strided rows; rows are independent of
their batch-mates and of the thread count; the sampler's kernel path draws what its torch path draws."""
import pytest
import torch

from kernel_check import c_kernels_expected
from specopd_kernels.paths import KernelsConfig
from specopd_kernels.sampling import cpu, naive
from specopd import sampling


def test_kernel_builds_where_it_can():
    """Where a C compiler and AVX-512 or AVX2 + FMA exist the kernel must build: a silent fallback would hide a
    broken kernel."""
    if not c_kernels_expected():
        pytest.skip("neither AVX-512 nor AVX2 + FMA, or no C compiler: the sampler keeps its torch path here")
    assert cpu.available(), cpu.unavailable_reason()


needs_kernel = pytest.mark.skipif(not cpu.available(), reason=f"CPU sampling kernel unavailable: "
                                                               f"{cpu.unavailable_reason()}")


def _case(seed, r, v, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(r, v, generator=g) * scale).to(dtype), torch.rand(r, generator=g, dtype=torch.float64)


NEAR = 1e-6  # |u * total - a CDF boundary| / total below which fp32 exponentials may round a draw either way


def _agree(z, u, t, block=1024, min_checked=0.8):
    """The kernel's tokens equal the float64 rule's wherever u * total is not within ``NEAR`` of a CDF boundary
    (two correct implementations may differ there), and most rows are checked."""
    got, ref = cpu.draw(z, u, t, block), naive.draw(z.float(), u, t)
    away = naive.margin(z.float(), u, t) > NEAR
    assert away.float().mean() >= min_checked, "too few rows away from a boundary: the check would be empty"
    assert torch.equal(got[away], ref[away]), (got[away] != ref[away]).nonzero()[:5]
    return got


@needs_kernel
@pytest.mark.parametrize("v", [1, 5, 16, 17, 1023, 1024, 1025, 3000, 49152])
@pytest.mark.parametrize("t", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_draws_the_float64_inverse_cdf(v, t, dtype):
    z, u = _case(v, 64, v, dtype=dtype)
    got = _agree(z, u, t, min_checked=0.8 if v > 1 else 1.0)
    assert ((got >= 0) & (got < v)).all()


@needs_kernel
@pytest.mark.parametrize("block", [1, 16, 100, 1024])
def test_block_sizes_and_u_on_block_edges(block):
    """Uniform logits put the CDF's boundaries at k / V: u at and around block edges land in the right token."""
    v = 400
    z = torch.zeros(9, v)
    u = torch.tensor([0.0, 0.25 + 1e-9, 0.5 - 1e-9, 0.5 + 1e-9, 0.75 + 1e-9, 100.5 / v, 1 - 1e-12, 0.123456, 0.9912],
                     dtype=torch.float64)
    assert torch.equal(cpu.draw(z, u, 1.0, block), naive.draw(z, u, 1.0))


@needs_kernel
def test_minus_inf_and_underflowing_tokens_are_never_drawn():
    """-inf logits (masked tokens) and logits whose probability is below fp32's normal range are never drawn, even
    at u = 0 and u just below 1; one finite logit is always drawn."""
    g = torch.Generator().manual_seed(1)
    v = 2500
    z = torch.randn(6, v, generator=g)
    z[:, ::3] = float("-inf")
    z[:, 0] = float("-inf")
    z[:, -1] = float("-inf")
    z[1, 7] = -500.0  # p ~ e^-500: underflows in fp32
    z[2] = float("-inf")
    z[2, 1234] = 0.0  # one finite logit
    u = torch.tensor([0.0, 1 - 1e-15, 0.5, 0.0, 1 - 1e-15, 0.3], dtype=torch.float64)
    tok = cpu.draw(z, u, 1.0)
    assert torch.isfinite(z.gather(1, tok[:, None])).all()
    assert tok[2] == 1234 and tok[1] != 7
    first = (torch.isfinite(z[0])).nonzero()[0, 0]
    last = (torch.isfinite(z[1])).nonzero()[-1, 0]
    assert tok[0] == first and tok[3] == (torch.isfinite(z[3])).nonzero()[0, 0] and tok[1] == last
    zs = torch.full((2, 50), -1e4)
    zs[:, 10] = 0.0
    assert cpu.draw(zs, torch.tensor([0.0, 0.999], dtype=torch.float64), 1.0).tolist() == [10, 10]


@needs_kernel
def test_non_finite_rows_are_a_clear_error():
    z, u = _case(2, 4, 100)
    z[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        cpu.draw(z, u, 1.0)
    z[1, 3] = float("inf")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        cpu.draw(z, u, 1.0)
    z[1] = float("-inf")
    with pytest.raises(ValueError, match="no finite value"):
        cpu.draw(z, u, 1.0)


@needs_kernel
def test_bad_arguments_are_clear_errors():
    z, u = _case(3, 4, 10)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        cpu.draw(z[None], u, 1.0)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        cpu.draw(z.double(), u, 1.0)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        cpu.draw(z.t(), u, 1.0)
    with pytest.raises(ValueError, match="u must be"):
        cpu.draw(z, u[:3], 1.0)
    with pytest.raises(ValueError, match="temperature"):
        cpu.draw(z, u, 0.0)
    with pytest.raises(ValueError, match="block"):
        cpu.draw(z, u, 1.0, 0)


@needs_kernel
def test_rows_are_independent_of_batch_mates_threads_and_strides():
    z, u = _case(4, 37, 5000, dtype=torch.bfloat16)
    whole = cpu.draw(z, u, 0.8)
    assert torch.equal(torch.cat([cpu.draw(z[s: s + 5], u[s: s + 5], 0.8) for s in range(0, 37, 5)]), whole)
    wide = torch.zeros(37, 5100, dtype=torch.bfloat16)
    wide[:, 50:5050] = z
    assert torch.equal(cpu.draw(wide[:, 50:5050], u, 0.8), whole)  # row stride 5100
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.draw(z, u, 0.8)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, whole)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [0.7, 1.0])
def test_sampler_kernel_path_draws_what_its_torch_path_draws(dtype, t):
    """``sample_from_hidden`` and ``pick_tokens`` through the kernel against their torch path (``draw_``), with
    per-group generators and chunks: equal tokens wherever the float64 rule is not within ``NEAR`` of a boundary."""
    g = torch.Generator().manual_seed(5)
    n, w, d, v = 12, 3, 32, 3001
    h = torch.randn(n, w, d, generator=g)
    weight = (torch.randn(v, d, generator=g) * 0.5).to(dtype)
    rows = [torch.arange(0, 6), torch.arange(6, 12)]
    out = {}
    for path in ("torch", "cpu"):
        choice = KernelsConfig(cpu_sampling=path)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        a = sampling.sample_from_hidden(h, weight, t, rows=rows, generators=gens, chunk_rows=7, kernel_paths=choice)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        logits = (h.to(dtype) @ weight.t()).to(dtype)
        b = sampling.pick_tokens(logits, t, gens, rows=rows, chunk_rows=5, kernel_paths=choice)
        out[path] = (a, b, logits)
    u = torch.cat([torch.rand(6 * w, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                   for i in range(2)])
    away = naive.margin(out["cpu"][2].reshape(-1, v).float(), u, t) > NEAR
    assert away.float().mean() > 0.8
    for k in (0, 1):
        assert torch.equal(out["cpu"][k].reshape(-1)[away], out["torch"][k].reshape(-1)[away])
    assert torch.equal(out["cpu"][1].reshape(-1)[away], naive.draw(out["cpu"][2].reshape(-1, v).float(), u, t)[away])


def test_sample_kernel_setting_is_checked():
    bad = KernelsConfig()
    bad.cpu_sampling = "fast"  # changed after the check: refused where it is read
    with pytest.raises(ValueError, match="kernels.cpu_sampling"):
        sampling.use_sample_kernel("cpu", 1.0, bad)
    assert not sampling.use_sample_kernel("cpu", 0.0)  # T = 0 is an argmax
