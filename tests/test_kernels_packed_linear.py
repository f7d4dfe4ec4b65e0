"""The bf16 linear layers through a weight packed once for oneDNN (kernels/layer_ops/cpu.py ``PackedWeight`` /
``linear``) against ``F.linear`` (naive.py): bit for bit, for every row count, with and without bias, on strided
and 3-D inputs; the pack follows weight changes; copies of a model do not carry it.
"""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from specopd_kernels.paths import KernelsConfig
from specopd_kernels.layer_ops import cpu, naive

pytestmark = pytest.mark.skipif(not cpu.packing_available(), reason="torch's oneDNN has no native bf16 on this CPU")


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,n", [(64, 1), (64, 200), (576, 192), (1536, 576), (33, 4097)])
@pytest.mark.parametrize("rows", [0, 1, 5, 33, 341])
def test_packed_linear_is_f_linear_bit_for_bit(rows, k, n, bias):
    w, b = _bf16(n, k, seed=1), (_bf16(n, seed=2) if bias else None)
    packed = cpu.PackedWeight().get(w)
    x = _bf16(rows, k, seed=3)
    assert torch.equal(cpu.linear(x, packed, b), naive.linear(x, w, b))
    x3 = _bf16(2, rows, k, seed=4)
    assert torch.equal(cpu.linear(x3, packed, b), naive.linear(x3, w, b))
    xs = _bf16(rows, 2 * k, seed=5)[:, ::2]  # strided rows and columns
    assert torch.equal(cpu.linear(xs, packed, b), naive.linear(xs, w, b))


def test_flop_counter_counts_a_packed_linear_as_f_linear():
    from torch.utils.flop_counter import FlopCounterMode

    x, w = _bf16(2, 7, 64, seed=1), _bf16(40, 64, seed=2)
    packed = cpu.PackedWeight().get(w)
    counts = []
    for f in (lambda: naive.linear(x, w), lambda: cpu.linear(x, packed)):
        with FlopCounterMode(display=False, custom_mapping=cpu.FLOP_FORMULAS) as fc:
            f()
        counts.append(fc.get_total_flops())
    assert counts == [2 * 14 * 64 * 40] * 2


def test_rows_do_not_depend_on_batch_mates_or_threads():
    """A row alone, in a batch, and at 1 thread gives F.linear's bits there. Where F.linear's rows do not depend
    on their batch mates (AVX512-BF16 without AMX), the packed rows do not either; on AMX oneDNN picks another
    kernel for one row than for 64, in F.linear as in the packed call, and the promise is F.linear's bits."""
    w = _bf16(640, 576, seed=1)
    packed = cpu.PackedWeight().get(w)
    x = _bf16(64, 576, seed=2)
    full = cpu.linear(x, packed)
    rows = torch.cat([cpu.linear(x[i:i + 1], packed) for i in range(64)])
    assert torch.equal(full, F.linear(x, w))
    assert torch.equal(rows, torch.cat([F.linear(x[i:i + 1], w) for i in range(64)]))
    if torch.equal(torch.cat([F.linear(x[i:i + 1], w) for i in range(64)]), F.linear(x, w)):
        assert torch.equal(rows, full)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.linear(x, packed)
        assert torch.equal(one, F.linear(x, w))
        if torch.equal(F.linear(x, w), full):  # F.linear's bits do not depend on the thread count here
            assert torch.equal(one, full)
    finally:
        torch.set_num_threads(old)


def test_stacked_weights_pack_as_their_concatenation():
    g, u = _bf16(96, 64, seed=1), _bf16(96, 64, seed=2)
    x = _bf16(7, 64, seed=3)
    assert torch.equal(cpu.linear(x, cpu.PackedWeight().get(g, u)), naive.linear(x, torch.cat((g, u))))


def test_the_pack_follows_in_place_changes_and_loads():
    from specopd.models.common import Linear

    lin = Linear(64, 32, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = _bf16(5, 64, seed=1)
    before = lin(x)
    assert torch.equal(before, naive.linear(x, lin.weight, lin.bias))
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the version counter changes
    assert torch.equal(lin(x), naive.linear(x, lin.weight, lin.bias)) and not torch.equal(lin(x), before)
    sd = {k: v * 3 for k, v in lin.state_dict().items()}
    assert set(sd) == {"weight", "bias"}  # the pack is not state
    lin.load_state_dict(sd)
    assert torch.equal(lin(x), naive.linear(x, sd["weight"], sd["bias"]))
    lin.weight = torch.nn.Parameter(_bf16(32, 64, seed=9), requires_grad=False)  # a new tensor
    assert torch.equal(lin(x), naive.linear(x, lin.weight, lin.bias))


def test_copies_and_pickles_start_without_a_pack():
    from specopd.models.common import MLP

    mlp = MLP(64, 160).to(torch.bfloat16).requires_grad_(False)
    x = _bf16(3, 64, seed=1)
    with torch.no_grad():
        y = mlp(x)  # packs every weight (opaque oneDNN tensors: no storage to copy)
        for other in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp))):
            assert torch.equal(other(x), y)


@pytest.mark.parametrize("rows", [1, 5, 341])
def test_fp32_packing_is_opt_in_and_within_fp32_rounding(rows, monkeypatch):
    """``kernels.cpu_linear=all``: fp32 through oneDNN's kernel, within fp32 rounding of the float64 product (as
    ``F.linear`` is), not necessarily its bits; by default fp32 keeps ``F.linear``."""
    x, w, b = torch.randn(rows, 576), torch.randn(300, 576), torch.randn(300)
    assert not cpu.linear_enabled(x, w, b)
    every = KernelsConfig(cpu_linear="all")
    assert cpu.linear_enabled(x, w, b, kernel_paths=every)
    assert cpu.linear_enabled(x.bfloat16(), w.bfloat16(), kernel_paths=every)
    assert not cpu.linear_enabled(x, w.bfloat16(), kernel_paths=every)
    assert not cpu.linear_enabled(x, w.requires_grad_(), kernel_paths=every)
    w.requires_grad_(False)
    exact = naive.linear(x.double(), w.double(), b.double())
    bound = 576 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + b.double().abs())  # K * eps * sum |terms|
    for got in (cpu.linear(x, cpu.PackedWeight().get(w), b), naive.linear(x, w, b)):
        assert bool(((got.double() - exact).abs() <= bound).all())
    from specopd.models.common import Linear, hand_down

    lin = hand_down(Linear(576, 300).requires_grad_(False), every)
    calls = []
    real = cpu.linear
    monkeypatch.setattr(cpu, "linear", lambda *a: calls.append(1) or real(*a))
    lin(x)
    assert calls == [1]


def test_enabled_only_for_bf16_cpu_tensors_outside_autograd():
    x, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)
    assert cpu.linear_enabled(x, w) and cpu.linear_enabled(x, w, None)
    assert not cpu.linear_enabled(x[0], w)  # 1-D input: F.linear
    assert not cpu.linear_enabled(x, w.float())
    assert not cpu.linear_enabled(x, w, torch.zeros(3))
    assert not cpu.linear_enabled(x, w.clone().requires_grad_())
    with torch.no_grad():
        assert cpu.linear_enabled(x, w.clone().requires_grad_())
    torch_linear = KernelsConfig(cpu_linear="torch")
    assert not cpu.linear_enabled(x, w, kernel_paths=torch_linear)
    assert cpu.enabled(x, w, kernel_paths=torch_linear)  # the C layer ops stay on
    assert not cpu.linear_enabled(x, w, kernel_paths=KernelsConfig(cpu_layer_ops="torch"))
    with pytest.raises(ValueError, match="kernels.cpu_linear"):
        KernelsConfig(cpu_linear="packed")
    bad = KernelsConfig()
    bad.cpu_linear = "packed"  # changed after the check: refused where it is read
    with pytest.raises(ValueError, match="kernels.cpu_linear"):
        cpu.linear_enabled(x, w, kernel_paths=bad)


def test_a_bf16_target_runs_every_linear_through_the_pack_with_the_same_logits(tmp_path, monkeypatch):
    """A tiny bf16 llama: every projection, the fused gate + up, down and lm_head run packed (6 calls a layer + 1),
    and the logits equal those of the same forward with ``F.linear`` bit for bit."""
    from specopd.models.common import hand_down
    from specopd.models.loading import load_target
    from specopd.models.tiny import build_tiny_target

    path = build_tiny_target("llama", str(tmp_path / "t"), overrides={"vocab_size": 256, "num_hidden_layers": 2})
    target = load_target(path, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    calls = []
    real = cpu.linear
    monkeypatch.setattr(cpu, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fast = target(ids)
        assert len(calls) == 2 * 6 + 1
        plain = hand_down(target, KernelsConfig(cpu_linear="torch"))(ids)
    assert len(calls) == 2 * 6 + 1
    assert torch.equal(fast, plain)
