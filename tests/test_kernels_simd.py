"""kernels/simd.h: the CPU kernels of kernels/e2e_tv and kernels/sampling give the same bits built for AVX-512 and for
AVX2 + FMA (two __m256 per vector, the same operations in the same order, reductions written out).

On a CPU with AVX-512 the AVX2 build (``-DSPECOPD_SIMD_AVX2``, still ``-march=native``) runs beside the default one
on the same inputs: alpha, the row statistics, both gradients (fp32 and bf16 out, with the CE term) and the draws
must be equal bit for bit. On an AVX2-only CPU there is nothing to compare (the AVX2 build is the default there and
is checked against the float64 references by tests/test_kernels_tv_cpu.py and tests/test_kernels_sampling.py)."""
import pytest
import torch

from kernel_check import c_kernels_expected, cpu_flags
from specopd_kernels.e2e_tv import cpu as tv
from specopd_kernels.sampling import cpu as sampling

pytestmark = [
    pytest.mark.skipif(not c_kernels_expected(), reason="no C compiler or no AVX2 + FMA / AVX-512: no CPU kernels"),
    pytest.mark.skipif("avx512f" not in cpu_flags(), reason="no AVX-512 here: the AVX2 build is the only one, "
                                                            "checked against float64 by the kernels' own tests"),
]


def _avx2(module):
    lib = module.LIB.variant(("SPECOPD_SIMD_AVX2",))
    assert lib.available(), lib.reason()
    return lib


def _cases():
    """[R, V] logit pairs: V below / on / past a vector (16) and a sum block (1024), ties, huge ranges, NaN, bf16."""
    g = torch.Generator().manual_seed(0)
    out = []
    for v in (1, 7, 16, 17, 1023, 1024, 1025, 5000):
        zq, zp = torch.randn(6, v, generator=g) * 4, torch.randn(6, v, generator=g) * 4
        zp[1] = zq[1]  # a row of exact ties
        zq[2, : v // 2] = -1e4  # underflowing exponentials
        zp[3, 0] = float("nan")
        out.append((zq, zp))
    zq, zp = (torch.randn(5, 3000, generator=g) * 3).bfloat16(), (torch.randn(5, 3000, generator=g) * 3).bfloat16()
    out.append((zq, zp))
    return out


def _tv_run():
    res = []
    for t in (0.7, 1.0):
        for zq, zp in _cases():
            a, st = tv.tv_alpha_forward(zq, zp, t)
            ga = torch.linspace(-1, 1, zq.shape[0])
            g32 = tv.tv_alpha_backward(zq, zp, t, st, ga, torch.empty(zq.shape))
            g16 = tv.tv_alpha_backward(zq, zp, t, st, ga, torch.empty(zq.shape, dtype=torch.bfloat16))
            res += [a, st, g32, g16]
            if t == 1.0:
                tg = torch.arange(zq.shape[0]) % zq.shape[1]
                res.append(tv.tv_alpha_backward(zq, zp, t, st, ga, torch.empty(zq.shape), grad_nll=ga.flip(0),
                                                targets=tg))
    return res


def _draws():
    g = torch.Generator().manual_seed(1)
    res = []
    for zq, _ in _cases():
        zq = torch.nan_to_num(zq.float(), nan=0.0)
        u = torch.rand(zq.shape[0], generator=g, dtype=torch.float64)
        for t, block in ((0.5, 1024), (1.0, 16), (1.7, 100)):
            res.append(sampling.draw(zq, u, t, block))
    return res


@pytest.mark.parametrize("module,run", [(tv, _tv_run), (sampling, _draws)], ids=["e2e_tv", "sampling"])
def test_avx2_build_gives_the_avx512_bits(monkeypatch, module, run):
    want = run()
    monkeypatch.setattr(module, "LIB", _avx2(module))
    got = run()
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        same = (a.view(torch.int16) == b.view(torch.int16)) if a.dtype == torch.bfloat16 else (
            a.view(torch.int32) == b.view(torch.int32)) if a.dtype == torch.float32 else a == b
        assert bool(same.all()), (i, (~same).nonzero()[:5])
