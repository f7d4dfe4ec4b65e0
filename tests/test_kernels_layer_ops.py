"""The bf16 CPU layer ops (kernels/layer_ops/layer_ops_cpu.c) against torch's eager forms (naive.py).

RoPE and the SiLU kernel's product are bitwise torch's; RMSNorm (another summation order) and SiLU (another exp)
may differ by one bf16 unit where the fp32 value sits at a rounding boundary: at most 1 unit, on few elements.
"""
import pytest
import torch

from specopd_kernels.paths import KernelsConfig
from specopd_kernels.layer_ops import cpu, naive

pytestmark = pytest.mark.skipif(not cpu.LIB.available(), reason=f"layer ops kernel unavailable: {cpu.LIB.error}")


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit at |x| (fp32 tensor): 2^(exponent - 7)."""
    e = torch.frexp(x.abs().clamp(min=2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(x), e - 8)


def assert_within_one_unit(got, ref, max_share=1e-3, floor=1e-30):
    g, r = got.float(), ref.float()
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    assert torch.equal(torch.isnan(g), torch.isnan(r))
    ok = ~torch.isnan(r)
    d = (g - r).abs()[ok]
    unit = _ulp(torch.maximum(g.abs(), r.abs()))[ok]
    assert bool((d <= torch.maximum(unit, torch.full_like(unit, floor))).all()), float((d / unit).max())
    assert float((d > 0).float().mean()) <= max_share


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows,d", [(1, 1), (3, 15), (5, 16), (7, 17), (33, 64), (100, 576), (4, 1025)])
def test_rms_norm_within_one_unit_of_torch(rows, d, unit_offset):
    g = torch.Generator().manual_seed(rows * 1000 + d)
    x = (3 * torch.randn(rows, d, generator=g)).bfloat16()
    w = (0.1 * torch.randn(d, generator=g) + (0 if unit_offset else 1)).bfloat16()
    ref = naive.rms_norm(x, w, 1e-5, unit_offset)
    got = cpu.rms_norm(x, w, 1e-5, unit_offset)
    assert_within_one_unit(got, ref, max_share=1e-2 if rows * d < 1000 else 1e-3)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))  # float64: both close
    exact = exact * (1 + w.double()) if unit_offset else w.double() * exact
    assert float((got.double() - exact).abs().max()) <= 2 * float((ref.double() - exact).abs().max()) + 1e-6


def test_rms_norm_strided_rows_3d_and_zero_rows():
    x = (2 * torch.randn(4, 6, 80)).bfloat16()
    w = (1 + 0.1 * torch.randn(64)).bfloat16()
    view = x[..., 8:72]  # row stride 80, not 64
    assert_within_one_unit(cpu.rms_norm(view, w, 1e-6), naive.rms_norm(view, w, 1e-6), max_share=1e-2)
    z = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu.rms_norm(z, w, 1e-6), naive.rms_norm(z, w, 1e-6))  # eps keeps it finite: zeros
    with pytest.raises(ValueError, match="weight"):
        cpu.rms_norm(x, w, 1e-6)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1536])
def test_silu_mul_within_one_unit_of_torch(n):
    g = torch.Generator().manual_seed(n)
    gate = (4 * torch.randn(64, n, generator=g)).bfloat16()
    up = torch.randn(64, n, generator=g).bfloat16()
    assert_within_one_unit(cpu.silu_mul(gate, up), naive.silu_mul(gate, up), max_share=1e-2 if n < 100 else 1e-3)


def test_silu_mul_extremes():
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 20, -20, 87, -87, 88.5, -88.5, 89, -89, 100, -100, 3e38, -3e38,
                          float("nan")]]).bfloat16()
    up = torch.ones_like(gate)
    up[0, 1] = -1
    assert_within_one_unit(cpu.silu_mul(gate, up), naive.silu_mul(gate, up), max_share=1.0)


@pytest.mark.parametrize("rd", [64, 32, 2])
def test_rope_is_bitwise_torch(rd):
    g = torch.Generator().manual_seed(rd)
    x = torch.randn(2, 37, 9, 64, generator=g).bfloat16()
    x[0, 0, 0, :] = 0.0
    x[0, 0, 1, :] = -0.0  # the sign of zero survives as in torch
    cos = torch.randn(2, 37, rd, generator=g).bfloat16()
    sin = torch.randn(2, 37, rd, generator=g).bfloat16()
    ref, got = naive.rope(x, cos, sin), cpu.rope(x, cos, sin)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    proj = torch.randn(2, 37, 9 * 64 + 3 * 64, generator=g).bfloat16()  # q and k as views of one projection
    q, k = proj[..., : 9 * 64].view(2, 37, 9, 64), proj[..., 9 * 64:].view(2, 37, 3, 64)
    for t in (q, k, x.transpose(1, 2).contiguous().transpose(1, 2)):
        assert torch.equal(cpu.rope(t, cos, sin).view(torch.int16), naive.rope(t, cos, sin).view(torch.int16))
    odd = torch.randn(2, 37, 3).bfloat16()
    with pytest.raises(ValueError, match="even rd"):
        cpu.rope(x, odd, odd)


def test_rows_do_not_depend_on_batch_mates_or_threads():
    x = (3 * torch.randn(300, 576)).bfloat16()
    w = (1 + 0.1 * torch.randn(576)).bfloat16()
    g, u = (4 * torch.randn(300, 1536)).bfloat16(), torch.randn(300, 1536).bfloat16()
    full_n, full_s = cpu.rms_norm(x, w, 1e-5), cpu.silu_mul(g, u)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.rms_norm(x, w, 1e-5), full_n) and torch.equal(cpu.silu_mul(g, u), full_s)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(cpu.rms_norm(x[7:8], w, 1e-5), full_n[7:8])
    assert torch.equal(cpu.silu_mul(g[7:9], u[7:9]), full_s[7:9])


def test_enabled_only_for_bf16_cpu_tensors_outside_autograd():
    b = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert cpu.enabled(b, b)
    assert not cpu.enabled(b, b.float())
    assert not cpu.enabled(b, b.clone().requires_grad_())
    with torch.no_grad():
        assert cpu.enabled(b, b.clone().requires_grad_())
    assert not cpu.enabled(b, b, kernel_paths=KernelsConfig(cpu_layer_ops="torch"))
    bad = KernelsConfig()
    bad.cpu_layer_ops = "fast"  # changed after the check: refused where it is read
    with pytest.raises(ValueError, match="kernels.cpu_layer_ops"):
        cpu.enabled(b, b, kernel_paths=bad)


def test_a_bf16_target_runs_the_kernels_and_its_greedy_tokens_match_torchs_ops(tmp_path, monkeypatch):
    """A tiny bf16 llama: its forward calls each kernel; with them its logits stay as close to the fp32 forward
    of the same rounded weights as torch's bf16 ops are (the noise unit of tests/test_bf16.py), with the same
    argmax at every position."""
    from specopd.models.common import hand_down
    from specopd.models.loading import load_target
    from specopd.models.tiny import build_tiny_target

    path = build_tiny_target("llama", str(tmp_path / "t"), overrides={"vocab_size": 256, "num_hidden_layers": 2})
    target = load_target(path, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    calls = {}
    for name in ("rms_norm", "silu_mul", "rope"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _r=real, _n=name: calls.__setitem__(_n, calls.get(_n, 0) + 1)
                            or _r(*a))
    with torch.no_grad():
        fast = target(ids).float()
        assert calls.keys() == {"rms_norm", "silu_mul", "rope"}
        plain = hand_down(target, KernelsConfig(cpu_layer_ops="torch"))(ids).float()
        exact = target.float()(ids)
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))
    unit = float((plain - exact).abs().max())
    assert unit > 0 and float((fast - exact).abs().max()) <= 1.5 * unit, (float((fast - exact).abs().max()), unit)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 341])
def test_bf16_mlp_runs_gate_and_up_as_one_matmul_with_the_same_bits(rows, bias):
    """MLP on bf16 CPU inputs: one [2I, D] matmul split in two gives gate(x) and up(x) bit for bit (oneDNN), and
    the fused weight follows changes of the module's weights."""
    from specopd.models.common import MLP

    torch.manual_seed(rows)
    mlp = MLP(64, 160, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 64).bfloat16()
    gu = torch.nn.functional.linear(x, *mlp._gate_up())
    assert torch.equal(gu[:, :160], mlp.gate_proj(x)) and torch.equal(gu[:, 160:], mlp.up_proj(x))
    assert torch.equal(mlp(x), mlp.down_proj(cpu.silu_mul(mlp.gate_proj(x), mlp.up_proj(x))))
    before = mlp(x)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # in place: the version counter changes
    assert torch.equal(mlp(x), mlp.down_proj(cpu.silu_mul(mlp.gate_proj(x), mlp.up_proj(x))))
    assert not torch.equal(mlp(x), before)
    assert not any(k.startswith("_gate_up") for k in mlp.state_dict())
