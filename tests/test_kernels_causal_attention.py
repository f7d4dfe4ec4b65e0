"""The bf16 causal attention kernel (kernels/causal_attention/attention_cpu.c) against the fp32 reference (naive.py)
and torch's bf16 flash kernel; its rows' independence; the GQA executor's use of it.

The bound is the kernel's own rounding: P rounded to bf16 (relative 2^-8 each, so at most 2^-8 * sum_j p_j |v_j|),
the output rounded to bf16 (half a unit), fp32 sums (1e-4 * sum_j p_j |v_j| covers 1,000+ terms). Torch's flash
kernel makes the same roundings, so the kernel's mean error must also be torch's, within 10%.
"""
import pytest
import torch
import torch.nn.functional as F

from specopd_kernels.paths import KernelsConfig
from specopd_kernels.causal_attention import cpu, naive

pytestmark = pytest.mark.skipif(not cpu.LIB.available(), reason=f"attention kernel unavailable: {cpu.LIB.reason()}")


def _inputs(lens_q, lens_k, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(sum(lens_q), h, d, generator=g)).bfloat16()
    k = (2 * torch.randn(sum(lens_k), hkv, d, generator=g)).bfloat16()
    v = torch.randn(sum(lens_k), hkv, d, generator=g).bfloat16()
    cu_q, cu_k = [0], [0]
    for a, b in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    return q, k, v, cu_q, cu_k


def _half_unit(x: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit at |x| (fp32)."""
    e = torch.frexp(x.abs().clamp(min=2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(x), e - 9)


def _torch_flash(q, k, v, cu_q, cu_k, scale):
    out = torch.empty_like(q)
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]],
                                                        v[cu_k[s]:cu_k[s + 1]]))
        lq, lk = qs.shape[2], ks.shape[2]
        mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=None if lq == lk else mask, is_causal=lq == lk,
                                           scale=scale, enable_gqa=True)
        out[cu_q[s]:cu_q[s + 1]] = o[0].transpose(0, 1)
    return out


CASES = [  # (lens_q, lens_k, H, Hkv, D): key counts on the 16-key blocks' and 256-key chunks' edges, odd counts
    ([1], [1], 1, 1, 32),                       # one token
    ([2, 15, 16, 17], [2, 15, 16, 17], 9, 3, 64),
    ([31, 32, 33], [31, 32, 33], 4, 2, 64),
    ([255, 256, 257], [255, 256, 257], 9, 3, 64),
    ([513], [513], 8, 1, 128),                  # three chunks, 8 query heads per kv head
    ([1, 1, 1], [1, 300, 700], 9, 3, 64),       # one decoding step each
    ([5, 7], [5, 263], 4, 4, 96),               # a verify block after a cache, no GQA, D = 96
    ([3], [40], 2, 1, 256),
    ([70], [70], 16, 2, 64),                    # more query positions than one work item
]


@pytest.mark.parametrize("lens_q,lens_k,h,hkv,d", CASES)
def test_within_its_rounding_of_fp32_and_as_close_as_torch(lens_q, lens_k, h, hkv, d):
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, h, hkv, d, seed=sum(lens_k) * 7 + d)
    scale = d ** -0.5
    ref = naive.causal_attention(q, k, v, cu_q, cu_k, scale)
    weight = naive.causal_attention(q, k, v.abs(), cu_q, cu_k, scale)  # sum_j p_j |v_j|
    got = cpu.causal_attention(q, k, v, cu_q, cu_k, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err = (got.float() - ref).abs()
    bound = _half_unit(torch.maximum(got.float().abs(), ref.abs())) + (2.0 ** -8 + 1e-4) * weight
    assert bool((err <= bound).all()), float((err / bound).max())
    flash = _torch_flash(q, k, v, cu_q, cu_k, scale)
    assert float(err.mean()) <= 1.1 * float((flash.float() - ref).abs().mean()) + 1e-7


def test_a_rows_result_depends_only_on_its_query_and_its_keys():
    """Bitwise: a sequence alone == packed with others; 1 thread == 2; a decoding step's row == that position's
    row in the prefill (and a 9-token block after a cache == its rows in the prefill)."""
    q, k, v, cu, _ = _inputs([300, 17, 1, 64], [300, 17, 1, 64], 9, 3, 64, seed=3)
    scale = 0.125
    packed = cpu.causal_attention(q, k, v, cu, cu, scale)
    for s in range(4):
        a, b = cu[s], cu[s + 1]
        alone = cpu.causal_attention(q[a:b], k[a:b], v[a:b], [0, b - a], [0, b - a], scale)
        assert torch.equal(alone, packed[a:b])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.causal_attention(q, k, v, cu, cu, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, packed)
    for t in (0, 15, 16, 255, 256, 299):  # chunk and block edges
        step = cpu.causal_attention(q[t:t + 1], k[:t + 1], v[:t + 1], [0, 1], [0, t + 1], scale)
        assert torch.equal(step[0], packed[t])
    block = cpu.causal_attention(q[250:259], k[:259], v[:259], [0, 9], [0, 259], scale)
    assert torch.equal(block, packed[250:259])


def test_strided_inputs_and_bad_arguments():
    q, k, v, cu, _ = _inputs([20], [20], 4, 2, 64, seed=5)
    qkv = torch.cat([q, k, v], 1)  # [T, 8, D]: q / k / v as views with a row stride of 8 heads
    got = cpu.causal_attention(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], cu, cu, 0.125)
    assert torch.equal(got, cpu.causal_attention(q, k, v, cu, cu, 0.125))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cpu.causal_attention(q[:, :3], k, v, cu, cu, 0.125)
    with pytest.raises(ValueError, match="Lq <= Lk"):
        cpu.causal_attention(q, k[:10], v[:10], [0, 20], [0, 10], 0.125)
    with pytest.raises(ValueError, match="bf16"):
        cpu.causal_attention(q.float(), k.float(), v.float(), cu, cu, 0.125)


def test_the_executor_uses_it_for_bf16_packed_and_one_by_one_prefill_alike():
    """specopd_executors.gqa: varlen "auto" takes the kernel where ``enabled`` (and "loop" then runs it per trunk, the same
    bits); kernels.cpu_attention=torch keeps torch's flash kernel; "cpu" on fp32 is a clear error."""
    from specopd_executors.gqa import attend_varlen, varlen_backend
    from specopd_executors.options import ExecOptions

    q, k, v, cu, _ = _inputs([40, 7, 90], [40, 7, 90], 9, 3, 64, seed=9)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    ours = KernelsConfig(cpu_attention="cpu")
    assert varlen_backend(q, k, ExecOptions(kernel_paths=ours)) == "cpu"
    packed = attend_varlen(q, k, v, cu_t, 90, 0.125, ExecOptions(kernel_paths=ours))
    loop = attend_varlen(q, k, v, cu_t, 90, 0.125, ExecOptions(varlen_backend="loop", kernel_paths=ours))
    assert torch.equal(packed, loop)
    assert torch.equal(packed, cpu.causal_attention(q, k, v, cu, cu, 0.125))
    theirs = ExecOptions(kernel_paths=KernelsConfig(cpu_attention="torch"))
    assert varlen_backend(q, k, theirs) == "loop"
    assert torch.equal(attend_varlen(q, k, v, cu_t, 90, 0.125, theirs), _torch_flash(q, k, v, cu, cu, 0.125))
    with pytest.raises(ValueError, match="varlen_backend='cpu' runs bf16"):
        attend_varlen(q.float(), k.float(), v.float(), cu_t, 90, 0.125, ExecOptions(varlen_backend="cpu"))
    bad = KernelsConfig()
    bad.cpu_attention = "bogus"  # changed after the check: refused where it is read
    with pytest.raises(ValueError, match="kernels.cpu_attention"):
        cpu.enabled(q, k, bad)
