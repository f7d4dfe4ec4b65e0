"""Gated delta rule kernels: the naive recurrence vs transformers' torch reference, and the Triton fused
recurrent kernel vs the naive recurrence (fp32; on the CPU through TRITON_INTERPRET=1)."""
import os

import pytest
import torch

from specopd_kernels.gated_delta.naive import gated_delta_step, prepare_qk, recurrent_gated_delta_rule


def _inputs(b=2, t=37, h=3, kd=12, vd=20, seed=0, device="cpu"):
    g_ = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(b, t, h, kd, generator=g_), torch.randn(b, t, h, kd, generator=g_))
    v = torch.randn(b, t, h, vd, generator=g_)
    g = -torch.rand(b, t, h, generator=g_) * 2  # log decay <= 0
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, kd, vd, generator=g_) * 0.3
    return [x.to(device) for x in (q, k, v, g, beta, s0)]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_naive_matches_transformers_references():
    """HF's recurrent and chunked (64-token chunks, T = 150) torch references, with an initial state."""
    from oracle import _no_fla

    with _no_fla():  # transformers would import fla, whose Triton needs a GPU driver (fails alone on the CPU)
        from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                        torch_recurrent_gated_delta_rule)

    g_ = torch.Generator().manual_seed(1)
    b, t, h, kd, vd = 1, 150, 2, 16, 8
    qr, kr = torch.randn(b, t, h, kd, generator=g_), torch.randn(b, t, h, kd, generator=g_)
    v = torch.randn(b, t, h, vd, generator=g_)
    g = -torch.rand(b, t, h, generator=g_)
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, kd, vd, generator=g_) * 0.3
    q, k = prepare_qk(qr, kr)
    o, s, ck = recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0)
    assert ck is None
    for ref_fn in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        o_ref, s_ref = ref_fn(qr, kr, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        assert _rel(o, o_ref) <= 1e-5 and _rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("start,every", [(0, 8), (5, 8), (16, 16), (3, 1), (0, 64)])
def test_naive_checkpoints_are_prefix_states(start, every):
    """checkpoints[:, j] == the state after the tokens before the j-th multiple of C (absolute positions)."""
    q, k, v, g, beta, s0 = _inputs()
    o, s, ck = recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0, checkpoint_every=every,
                                          start=start)
    t = q.shape[1]
    stops = [p - start for p in range(start, start + t) if p % every == 0]
    assert ck.shape[1] == len(stops)
    for j, n in enumerate(stops):
        _, s_n, _ = recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g=g[:, :n], beta=beta[:, :n],
                                               initial_state=s0)
        assert torch.equal(ck[:, j], s_n)
    # splitting the sequence anywhere and carrying the state is exact
    o1, s1, _ = recurrent_gated_delta_rule(q[:, :11], k[:, :11], v[:, :11], g=g[:, :11], beta=beta[:, :11],
                                           initial_state=s0)
    o2, s2, _ = recurrent_gated_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], g=g[:, 11:], beta=beta[:, 11:],
                                           initial_state=s1)
    assert torch.equal(torch.cat([o1, o2], 1), o) and torch.equal(s2, s)


def test_masked_step_is_exact_noop():
    """g = 0, beta = 0 leaves the state bit-for-bit unchanged (used to pad replays of different lengths)."""
    q, k, v, g, beta, s0 = _inputs(t=1)
    s1, _ = gated_delta_step(s0, q[:, 0], k[:, 0], v[:, 0], torch.zeros_like(g[:, 0]), torch.zeros_like(beta[:, 0]))
    assert torch.equal(s1, s0)


CASES = [
    dict(b=2, t=21, h=3, kd=12, vd=20, start=5, every=8, h0=True, block_v=8),  # K, V not powers of 2, 3 v-blocks
    dict(b=1, t=16, h=2, kd=16, vd=16, start=0, every=None, h0=False, block_v=32),
    dict(b=1, t=9, h=1, kd=8, vd=8, start=16, every=4, h0=True, block_v=32),
]


def _triton_check(case) -> None:
    from specopd_kernels.gated_delta.fused_recurrent import fused_recurrent_gated_delta_rule

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta, s0 = _inputs(case["b"], case["t"], case["h"], case["kd"], case["vd"], device=dev)
    init = s0 if case["h0"] else None
    ref = recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=init,
                                     checkpoint_every=case["every"], start=case["start"])
    got = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=init,
                                           checkpoint_every=case["every"], start=case["start"],
                                           block_v=case["block_v"])
    assert _rel(got[0], ref[0]) <= 1e-5 and _rel(got[1], ref[1]) <= 1e-5, (_rel(got[0], ref[0]), _rel(got[1], ref[1]))
    if case["every"] is None:
        assert got[2] is None
    else:
        assert got[2].shape == ref[2].shape and (ref[2].numel() == 0 or _rel(got[2], ref[2]) <= 1e-5)


def test_triton_fused_recurrent_matches_naive():
    """On CUDA in-process; on the CPU in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before
    triton is first imported, which transformers may already have done in this process)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        for case in CASES:
            _triton_check(case)
        return
    _run_interpreted("kernel")


def _executor_triton_check() -> None:
    """The gdn executor with kernels="triton" (chunk prefill, extension, fused replay) equals kernels="torch"."""
    import tempfile

    from oracle import make_tiny_checkpoint
    from specopd.models import load_target
    from specopd.tree import ProposalTree

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = make_tiny_checkpoint("qwen3_5_text", tempfile.mkdtemp(), num_hidden_layers=2,
                                layer_types=["linear_attention", "full_attention"])
    target = load_target(path, device=dev)
    trunk = torch.randint(0, target.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).to(dev)
    tree = ProposalTree.from_branches(torch.tensor([0, 15, 16, 40, 69]), torch.randint(0, 256, (5, 3)))
    out = {}
    for backend in ("torch", "triton"):
        first = target.prefill(trunk[:30], gdn_checkpoint_every=16)
        first.options.kernels = backend
        cache = target.prefill(trunk[30:], first)
        out[backend] = (cache, target.score(tree, cache))
    (c0, p0), (c1, p1) = out["torch"], out["triton"]
    assert _rel(p1, p0) <= 1e-5 and _rel(c1.logits, c0.logits) <= 1e-5
    assert _rel(c1.layers[0].checkpoints[1:], c0.layers[0].checkpoints[1:]) <= 1e-5
    assert c1.layers[0].checkpoints.shape == c0.layers[0].checkpoints.shape


@pytest.mark.slow
def test_executor_with_triton_backend():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        _executor_triton_check()
        return
    _run_interpreted("executor")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_scoring_matches_cpu(tmp_path):
    """The same tiny hybrid on CUDA (Triton prefill + replay) and on the CPU (torch loop): fp32 agreement."""
    from oracle import make_tiny_checkpoint
    from specopd.models import load_target
    from specopd.tree import ProposalTree

    path = make_tiny_checkpoint("qwen3_next", tmp_path)
    trunk = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0))
    tree = ProposalTree.from_branches(torch.tensor([0, 63, 64, 65, 149]), torch.randint(0, 256, (5, 4)))
    out = []
    for dev in ("cpu", "cuda"):
        target = load_target(path, device=dev)
        cache = target.prefill(trunk.to(dev))
        out.append((target.score(tree, cache).cpu(), cache.logits.cpu(), target(trunk.view(1, -1).to(dev))[0].cpu()))
    for a, b in zip(*out):
        assert _rel(b, a) <= 1e-4


def _run_interpreted(what: str) -> None:
    import subprocess
    import sys

    from kernel_check import interpreter_env

    r = subprocess.run([sys.executable, os.path.abspath(__file__), what], env=interpreter_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and f"{what} ok" in r.stdout, r.stdout + r.stderr


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    if sys.argv[1] == "kernel":
        for c in CASES:
            _triton_check(c)
    else:
        _executor_triton_check()
    print(f"{sys.argv[1]} ok")
