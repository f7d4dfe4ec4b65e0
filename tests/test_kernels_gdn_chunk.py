"""Chunked gated delta rule prefill (Triton, WY form) against the plain recurrence: outputs, final state and the
fp32 checkpoints (fp32; on the CPU under TRITON_INTERPRET=1). The fla path is CUDA-only and checked on a GPU."""
import warnings

import pytest
import torch

import kernel_check
from specopd_kernels.gated_delta.naive import prepare_qk, recurrent_gated_delta_rule

FILE = __file__


def inputs(b, t, hq, h, kd, vd, seed=0, device="cpu", dtype=torch.float32):
    g_ = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(b, t, hq, kd, generator=g_), torch.randn(b, t, hq, kd, generator=g_))
    v = torch.randn(b, t, h, vd, generator=g_)
    g = -torch.rand(b, t, h, generator=g_) * 1.5  # log decay <= 0
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, kd, vd, generator=g_) * 0.3
    return [x.to(device=device, dtype=dtype if i < 3 else torch.float32) for i, x in enumerate((q, k, v, g, beta, s0))]


def reference(q, k, v, g, beta, init, every, start):
    r = v.shape[2] // q.shape[2]
    return recurrent_gated_delta_rule(q.float().repeat_interleave(r, 2), k.float().repeat_interleave(r, 2), v.float(),
                                      g=g, beta=beta, initial_state=init, checkpoint_every=every, start=start)


CASES = {
    # name: (B, T, HQ, H, K, V, start, checkpoint_every, initial state)
    "t150_c64_h0": (2, 150, 2, 2, 16, 24, 0, 64, True),  # T not a multiple of 64, 3 chunks
    "t37_no_h0": (1, 37, 1, 2, 16, 16, 0, 64, False),  # T < 64, q/k heads shared by 2 value heads
    "t1": (2, 1, 2, 2, 16, 16, 0, 64, True),  # one token
    "t1_no_h0_nockpt": (1, 1, 1, 1, 16, 16, 0, None, False),
    "extend_start70_c16": (1, 45, 1, 3, 16, 16, 70, 16, True),  # extension: chunks aligned to absolute positions
    "extend_start64": (1, 64, 2, 2, 32, 16, 64, 64, True),  # starts exactly on a checkpoint
    "c128_k128": (1, 200, 1, 1, 128, 128, 30, 128, True),  # K = V = 128 (the recipes), chunk 64 < C
    # K = V = 8 (tiny:qwen4_exp, q / k expanded to the 4 value heads): padded to tl.dot's 16; fresh and extension
    "tiny_k8": (2, 37, 4, 4, 8, 8, 0, 16, True),
    "tiny_k8_extend": (1, 21, 2, 4, 8, 8, 11, 16, False),
}


def check_chunk(name: str) -> None:
    from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule

    b, t, hq, h, kd, vd, start, every, h0 = CASES[name]
    q, k, v, g, beta, s0 = inputs(b, t, hq, h, kd, vd, device=kernel_check.device())
    init = s0 if h0 else None
    ref = reference(q, k, v, g, beta, init, every, start)
    got = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=init, checkpoint_every=every, start=start)
    assert kernel_check.rel(got[0], ref[0]) <= 1e-5, (name, "o", kernel_check.rel(got[0], ref[0]))
    assert kernel_check.rel(got[1], ref[1]) <= 1e-5, (name, "final", kernel_check.rel(got[1], ref[1]))
    if every is None:
        assert got[2] is None
    else:
        assert got[2].shape == ref[2].shape and got[2].dtype == torch.float32
        assert kernel_check.rel(got[2], ref[2]) <= 1e-5, (name, "checkpoints", kernel_check.rel(got[2], ref[2]))
    assert all(x.dtype == torch.float32 for x in got[:2])


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_recurrence(name):
    pytest.importorskip("triton")
    kernel_check.run(FILE, "chunk", name)


def check_errors() -> None:
    from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule

    q, k, v, g, beta, s0 = inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_gated_delta_rule(q, k, v, g=g, beta=beta, checkpoint_every=8)
    with pytest.raises(ValueError, match="multiple of HQ"):
        chunk_gated_delta_rule(q, k, v[:, :, :0], g=g, beta=beta)
    with pytest.raises(ValueError, match="power of two >= 16"):
        chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=8)


def test_chunk_errors_name_the_fix():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "errors")


def test_backend_selection_and_fla_guard(monkeypatch):
    """"chunk" / "recurrent" / "fla" are selectable; without fla-core (simulated: ``import fla`` fails, whether or
    not it is installed) the fla path says what to install."""
    import sys

    from specopd_kernels.gated_delta.fla_chunk import fla_available, fla_chunk_gated_delta_rule, prefill_backend

    assert prefill_backend("fla") is fla_chunk_gated_delta_rule
    with pytest.raises(ValueError, match="'chunk', 'fla' or 'recurrent'"):
        prefill_backend("nope")
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")] + ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert not fla_available()
    q, k, v, g, beta, _ = inputs(1, 4, 1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="fla-core"):
        fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, checkpoint_every=64)


def test_fp32_never_goes_to_fla(monkeypatch):
    """GDN "auto" sends an fp32 model to our IEEE chunk kernel even where fla would pass (CUDA, verified, C % 64 ==
    0): fla's fp32 dots run in TF32 on sm_80+. fla called on fp32 there refuses with the fix, unless the process set
    TRITON_F32_DEFAULT=ieee (simulated on the CPU: an sm_90 device capability)."""
    import specopd_kernels.gated_delta.fla_chunk as fc
    from specopd_executors.gdn import auto_prefill

    monkeypatch.setattr(fc, "fla_verified", lambda device: True)
    cuda = torch.device("cuda")
    assert [auto_prefill(cuda, 64, dt) for dt in (torch.bfloat16, torch.float16, torch.float32)] == \
        ["fla", "fla", "chunk"]
    assert auto_prefill(cuda, 16, torch.float32) == "chunk" and auto_prefill(cuda, 8, torch.float32) == "recurrent"
    assert auto_prefill("cpu", 64, torch.bfloat16) == "chunk"
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fc.fla_fp32_exact("cpu") and not fc.fla_fp32_exact(cuda)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert fc.fla_fp32_exact(cuda)
    monkeypatch.setattr(fc, "fla_fp32_exact", lambda device: False)
    with warnings.catch_warnings():  # importing fla on a CPU: "Triton is not supported", torch.jit deprecations
        warnings.simplefilter("ignore")
        have_fla = fc.fla_available()
    if have_fla:
        q, k, v, g, beta, _ = inputs(1, 4, 1, 1, 16, 16)
        with pytest.raises(ValueError, match="TF32.*gdn_prefill='chunk'.*TRITON_F32_DEFAULT=ieee"):
            fc.fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, checkpoint_every=64)


def check_gpu() -> None:
    """bf16 q/k/v on CUDA within bf16 noise of the fp32 recurrence; fla (when installed) against the same."""
    from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule
    from specopd_kernels.gated_delta.fla_chunk import fla_available, fla_chunk_gated_delta_rule

    q, k, v, g, beta, s0 = inputs(2, 1000, 4, 12, 128, 128, device="cuda")
    ref = reference(q, k, v, g, beta, s0, 64, 0)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    fns = [chunk_gated_delta_rule] + ([fla_chunk_gated_delta_rule] if fla_available() else [])
    for fn in fns:
        got = fn(qb, kb, vb, g=g, beta=beta, initial_state=s0, checkpoint_every=64, start=0)
        for a, r in zip(got, ref):
            assert kernel_check.rel(a, r) <= 3e-2, (fn.__name__, kernel_check.rel(a, r))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunk_bf16_and_fla_on_cuda():
    check_gpu()


def check_fp16() -> None:
    """fp16 q / k / v (bf16's stand-in under the interpreter), extension with an initial state and checkpoints:
    o, final state and fp32 checkpoints within 2.5x the recurrence's own input rounding noise."""
    from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule

    q, k, v, g, beta, s0 = inputs(1, 150, 2, 4, 32, 32, seed=7, device=kernel_check.device())
    exact = reference(q, k, v, g, beta, s0, 64, 30)
    half = [x.half() for x in (q, k, v)]
    rounded = reference(*half, g, beta, s0, 64, 30)
    got = chunk_gated_delta_rule(*half, g=g, beta=beta, initial_state=s0, checkpoint_every=64, start=30)
    assert got[2].dtype == torch.float32
    for what, a, e, r in zip(("o", "final", "checkpoints"), got, exact, rounded):
        kernel_check.lowp_check(a, e, r, what=f"gdn chunk fp16 {what}")


def test_chunk_fp16_within_noise():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "fp16")


CHECKS = {"chunk": check_chunk, "errors": check_errors, "gpu": check_gpu, "fp16": check_fp16}

if __name__ == "__main__":
    kernel_check.main(CHECKS)
