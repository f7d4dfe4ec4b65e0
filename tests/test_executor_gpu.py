"""CUDA checks of the executors' kernels (``pytest -m gpu``; skipped without CUDA; ``benchmarks/gpu_check.sh`` runs
them on the H200). Random targets from our own model classes (no transformers needed there):

- kernels="triton" equals kernels="torch" on the same CUDA target in fp32 (prefill logits and caches, score,
  verify + commit), and in bf16 it is as close to the fp32 reference as the bf16 torch path (bf16 noise),
  for a GQA (llama), a GDN hybrid (qwen3_5) and a QSA hybrid (qwen4_exp) target;
- packed prefill (torch varlen / flash-attn, fla varlen when installed) equals per-trunk prefill;
- fla's chunked prefill (when installed) equals our chunk kernel, checkpoints included;
- the drafter's flex_attention path (compiled, BlockMask from the sorted layout) equals the chunked path,
  forward and backward, and really ran (no silent fallback to the chunked path).
"""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
import random_targets as b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _target(kind, dtype=torch.float32, layers=4, forced_equal=False, qsa_first=False):
    """``forced_equal`` (qsa): a budget that selects every group and every expert routed, so bf16 rounding cannot
    flip a discrete decision (tests/test_qsa_bf16.py: the torch path now gives every row the same bits in prefill and
    score, so sparse selection agrees there; on CUDA cuBLAS GEMMs and the GDN chunk prefill vs the replay kernel
    still differ by ~1 ulp per row, which can flip near ties: benchmarks/results/, the GPU paths on the CPU).
    ``qsa_first``: QSA layers first and third (the first one's input is the embedding: the same in every path)."""
    args = SimpleNamespace(hidden=128, layers=layers, vocab=512, device=torch.device("cuda"), dtype=dtype)
    if kind == "qsa" and (forced_equal or qsa_first):
        cfg = b.qsa_config(args)
        if forced_equal:
            cfg.update(indexer_budget=4096, num_experts_per_tok=cfg["num_experts"])
        if qsa_first:
            cfg.update(layer_types=["indexed_attention", "linear_attention"] * (layers // 2), ple_layer_ids=[2])
        return b.random_target("qwen4_exp_text", cfg, args.device, dtype)
    return {"gqa": b.gqa_target, "gdn": b.gdn_target, "qsa": b.qsa_target}[kind](args)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _case(vocab, seed=0):
    from specopd.tree import ProposalTree

    g = torch.Generator().manual_seed(seed)
    trunks = [torch.randint(4, vocab, (t,), generator=g).cuda() for t in (300, 129)]
    trees = [ProposalTree.from_branches(torch.tensor([0, 63, 64, 150, 299, 299]), torch.randint(4, vocab, (6, 7),
                                                                                             generator=g)),
             ProposalTree.from_branches(torch.tensor([128, 5]), torch.randint(4, vocab, (2, 7), generator=g))]
    return trunks, ProposalTree.pack(trees)


def _run(target, kernels, trunks, tree):
    target.kernels = kernels
    caches = [target.prefill(t, feature_layers=(1,)) for t in trunks]
    p = target.score(tree, caches)
    logits, state = target.score(tree, caches, return_state=True)
    depth = int(tree.depth.max()) + 1
    root = int(torch.nonzero((tree.parent < 0) & (tree.anchor == len(trunks[0]) - 1) & (tree.trunk_index == 0))[0])
    path = [root + j for j in range(depth)]  # a chain of the first trunk, anchored at its end
    new = target.commit(caches, state, [path, []])
    ref = target.prefill(tree.tokens[path].cuda(), cache=caches[0])
    return caches, p, new[0], ref


@pytest.mark.parametrize("kind", ["gqa", "gdn", "qsa"])
def test_triton_equals_torch_fp32(kind):
    target = _target(kind)
    trunks, tree = _case(target.vocab_size)
    c_t, p_t, _, _ = _run(target, "torch", trunks, tree)
    c_k, p_k, new_k, ref_k = _run(target, "triton", trunks, tree)
    assert _rel(p_k, p_t) <= 2e-4
    for a, b in zip(c_k, c_t):
        assert _rel(a.logits, b.logits) <= 2e-4 and _rel(a.features, b.features) <= 2e-4
    assert _rel(new_k.logits, ref_k.logits) <= 2e-4 and _rel(new_k.features, ref_k.features) <= 2e-4
    plain = target(torch.cat([trunks[0][:1], tree.tokens[:7].cuda()]).view(1, -1))[0, 1:]  # branch 0: anchor 0
    assert _rel(p_k[0], plain) <= 2e-4


@pytest.mark.parametrize("kind", ["gqa", "gdn", "qsa"])
def test_triton_bf16_within_bf16_noise(kind):
    """bf16 triton within 1.5x the bf16 torch path's distance to fp32 (+1e-2); that noise itself must be bf16-sized
    (<= 2x what the torch path measures on the CPU for this case: gqa 1.45e-2, gdn 4.57e-2, qsa forced equal 9.9e-3)
    so the bound cannot pass a broken kernel; commit vs prefill within 2e-2 (measured on the CPU: 8.9e-3, 2.9e-3,
    9.1e-3)."""
    target = _target(kind, forced_equal=True)
    trunks, tree = _case(target.vocab_size, seed=1)
    _, ref, _, _ = _run(target, "torch", trunks, tree)  # fp32
    t16 = target.to(torch.bfloat16)
    _, p_torch, _, _ = _run(t16, "torch", trunks, tree)
    _, p_triton, new, pre = _run(t16, "triton", trunks, tree)
    noise = _rel(p_torch, ref)
    print(f"{kind}: bf16 noise (torch vs fp32) {noise:.2e}, triton vs fp32 {_rel(p_triton, ref):.2e}, "
          f"commit vs prefill {_rel(new.logits, pre.logits):.2e}")
    assert 0 < noise <= {"gqa": 3e-2, "gdn": 1e-1, "qsa": 2e-2}[kind], noise
    assert _rel(p_triton, ref) <= 1.5 * noise + 1e-2, (noise, _rel(p_triton, ref))
    assert _rel(new.logits, pre.logits) <= 2e-2, _rel(new.logits, pre.logits)


def test_qsa_bf16_selection_triton_equals_torch_first_layer():
    """Sparse selection (budget 64) in bf16: the first QSA layer (layer 0: the same embedding rows in both paths)
    selects identical groups with kernels="triton" and kernels="torch" at every trunk query: the indexer runs in
    fp32 with IEEE dots on both paths (only fp32 summation order differs)."""
    target = _target("qsa", qsa_first=True).to(torch.bfloat16)
    trunks, _ = _case(target.vocab_size, seed=2)
    sels = {}
    for mode in ("torch", "triton"):
        target.kernels = mode
        rec = {}
        c = target.prefill(trunks[0][:4])
        c.options.qsa_record = rec
        target.prefill(trunks[0][4:], cache=c)
        sels[mode] = rec
    first = min(sels["torch"])
    assert (sels["torch"][first] >= 0).any()
    agree = float((sels["torch"][first] == sels["triton"][first]).all(-1).float().mean())
    print(f"first QSA layer: {100 * agree:.1f}% of trunk queries select identical groups")
    assert agree == 1.0, agree


@pytest.mark.parametrize("kind", ["gqa", "gdn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_equals_per_trunk(kind, dtype, monkeypatch):
    """Packed prefill equals per-trunk prefill, and the varlen backend that ran is the documented one: "loop" in
    fp32, flash-attn when it imports, else torch's varlen_attn (bf16)."""
    import specopd_executors.gqa as gqa

    ran = []
    orig = gqa.varlen_backend
    monkeypatch.setattr(gqa, "varlen_backend", lambda q, o: ran.append(orig(q, o)) or ran[-1])
    target = _target(kind, dtype)
    target.kernels = "triton"
    g = torch.Generator().manual_seed(2)
    trunks = [torch.randint(4, target.vocab_size, (t,), generator=g).cuda() for t in (300, 1, 129, 64)]
    packed = target.prefill_batch(trunks, packed=True, feature_layers=(1,))
    assert target.packed_ok, "packed prefill fell back to per-trunk prefill"
    singles = [target.prefill(t, feature_layers=(1,)) for t in trunks]
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(packed, singles):
        assert _rel(a.logits, b.logits) <= tol and _rel(a.features, b.features) <= tol
    if dtype == torch.float32:
        want = "loop"
    elif importlib.util.find_spec("flash_attn") is not None:
        want = "flash_attn"
    else:
        want = "torch" if importlib.util.find_spec("torch.nn.attention.varlen") is not None else "loop"
    print(f"varlen backends that ran for {dtype}: {sorted(set(ran))} (expected {want})")
    assert ran and set(ran) == {want}, (ran, want)


def test_fla_prefill_matches_chunk_kernel():
    from specopd_kernels.gated_delta.fla_chunk import fla_available

    if not fla_available():
        pytest.skip("fla-core is not installed")
    target = _target("gdn", torch.bfloat16)
    target.kernels = "triton"
    g = torch.Generator().manual_seed(3)
    trunk = torch.randint(4, target.vocab_size, (300,), generator=g).cuda()
    out = {}
    for name in ("chunk", "fla"):
        c = target.prefill(trunk[:100])
        c.options.gdn_prefill = name
        out[name] = target.prefill(trunk[100:], cache=c)  # extension: start not chunk-aligned
    a, b = out["fla"], out["chunk"]
    assert _rel(a.logits, b.logits) <= 3e-2
    gdn = [i for i, k in enumerate(target.layer_kinds) if k == "gdn"]
    for i in gdn:
        assert a.layers[i].checkpoints.shape == b.layers[i].checkpoints.shape
        assert a.layers[i].checkpoints.dtype == torch.float32
        assert _rel(a.layers[i].checkpoints, b.layers[i].checkpoints) <= 3e-2
        assert _rel(a.layers[i].final, b.layers[i].final) <= 3e-2


def _autograd_ops(t) -> set:
    """The names of the autograd nodes ``t``'s backward runs (its whole graph)."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_flex_attention_matches_chunked(dtype):
    """flex_attention (compiled forward and backward) equals the chunked path; flex really ran: the layout records
    "flex", not the chunked fallback a compile error would take (with a warning), and the backward graph is the
    compiled one, with no chunked node in it."""
    from specopd.drafters.attention import (BranchLayout, chunked_branch_attention, flex_branch_attention,
                                            flex_failed)

    g = torch.Generator().manual_seed(4)
    starts, anchors, off = [], [], 0
    for t, n in ((300, 9), (0, 2), (129, 5)):  # one trunk without context
        a = sorted(torch.randint(0, t + 1, (n,), generator=g).tolist() + [0, t])
        starts += [off] * len(a)
        anchors += a
        off += t
    s, h, hkv, hd = 16, 8, 2, 64
    n = len(anchors)
    args = [torch.randn(*sh, generator=g).to("cuda", dtype).requires_grad_() for sh in
            ((n, s, h, hd), (n, s, hkv, hd), (n, s, hkv, hd), (off, hkv, hd), (off, hkv, hd))]
    outs, grads = [], []
    for fn, path in ((flex_branch_attention, "flex"), (chunked_branch_attention, "chunked")):
        layout = BranchLayout(torch.tensor(starts).cuda(), torch.tensor(anchors).cuda(), off, s)
        o = fn(*args, layout, hd ** -0.5)
        ops = _autograd_ops(o)
        assert layout.ran == {path}, (layout.ran, flex_failed())
        assert any("Chunked" in op for op in ops) == (path == "chunked"), ops
        if path == "flex":
            assert any(op.startswith("CompiledFunction") for op in ops), ops  # torch.compile's backward
        (o.float() * torch.linspace(-1, 1, o.numel(), device="cuda").view_as(o)).sum().backward()
        outs.append(o.detach().float())
        grads.append([a.grad.float().clone() for a in args])
        for a in args:
            a.grad = None
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(outs[0], outs[1]) <= tol
    for ga, gb in zip(*grads):
        assert _rel(ga, gb) <= tol * 5
