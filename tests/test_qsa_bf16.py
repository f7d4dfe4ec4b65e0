"""QSA / MoE targets in bf16 (torch path, CPU): the indexer (projection, q_layernorm, pooled keys, scores, top-k) and
the MoE router run in fp32 whatever the target's dtype, so selection depends only on the layer's input rows.

- With identical inputs (QSA as the first layer: its input is the embedding) prefill, score and the extension
  prefill select identical groups in bf16.
- Commit vs prefill (score + commit of a path against prefilling the same tokens) in bf16, with selection and
  routing forced equal (a budget that selects every group, every expert routed): within bf16 noise for 20 seeds.
  The bound is 2x the largest measured on this problem (6.6e-3 .. 8.9e-3 over seeds 0-19).
- With sparse selection and top-2 routing the same comparison is NOT within that noise for most seeds (0.008 to
  0.24 measured, seeds 0-19): upstream bf16 noise (layer inputs differ by ~1 bf16 ulp between the prefill and the
  score path, e.g. 0.7% at the first QSA layer after a GDN layer) flips near-tie top-k decisions. fp32 selection
  removes flips from the indexer's own rounding, not these. Kept as a strict xfail: it fails loudly once fixed.
"""
from types import SimpleNamespace

import pytest
import torch

from kernel_check import load_benchmark

SEEDS = range(20)
NOISE_BOUND = 2 * 8.9e-3  # 2x the largest commit-vs-prefill error measured with selection and routing forced equal


def _bench():
    return load_benchmark("bench_executors")


def _target(seed, budget=64, experts_per_tok=2, qsa_first=False):
    b = _bench()
    args = SimpleNamespace(hidden=128, layers=4, vocab=512, device=torch.device("cpu"), dtype=torch.float32)
    cfg = b._qsa_cfg(args)
    cfg.update(indexer_budget=budget, num_experts_per_tok=experts_per_tok)
    if qsa_first:
        cfg.update(layer_types=["indexed_attention", "linear_attention"] * 2, ple_layer_ids=[2])
    t = b.random_target("qwen4_exp_text", cfg, args.device, torch.float32, seed=seed).to(torch.bfloat16)
    t.kernels = "torch"
    return t


def _case(vocab, seed):
    from specopd.tree import ProposalTree

    g = torch.Generator().manual_seed(seed)
    trunks = [torch.randint(4, vocab, (t,), generator=g) for t in (300, 129)]
    trees = [ProposalTree.from_branches(torch.tensor([0, 63, 64, 150, 299, 299]),
                                        torch.randint(4, vocab, (6, 7), generator=g)),
             ProposalTree.from_branches(torch.tensor([128, 5]), torch.randint(4, vocab, (2, 7), generator=g))]
    return trunks, ProposalTree.pack(trees)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def _commit_vs_prefill(target, seed, record=False):
    """(rel error of the committed path's logits against prefilling it, score selections, prefill selections)."""
    trunks, tree = _case(target.vocab_size, seed)
    caches = [target.prefill(t, feature_layers=(1,)) for t in trunks]
    rec_s, rec_p = {}, {}
    if record:
        caches[0].options.qsa_record = rec_s
    _, state = target.score(tree, caches, return_state=True)
    depth = int(tree.depth.max()) + 1
    root = int(torch.nonzero((tree.parent < 0) & (tree.anchor == len(trunks[0]) - 1) & (tree.trunk_index == 0))[0])
    path = [root + j for j in range(depth)]  # a chain of the first trunk, anchored at its end
    new = target.commit(caches, state, [path, []])
    if record:
        caches[0].options.qsa_record = rec_p
    ref = target.prefill(tree.tokens[path], cache=caches[0])
    caches[0].options.qsa_record = None
    return _rel(new[0].logits, ref.logits), {k: v[path] for k, v in rec_s.items()}, rec_p


def test_indexer_and_router_run_in_fp32():
    target = _target(0)
    qsa = next(m for m in target.modules() if getattr(m, "kind", None) == "qsa")
    x = torch.randn(1, 9, 128).to(torch.bfloat16)
    q, raw = qsa.index_project(x, torch.arange(9).view(1, -1))
    assert q.dtype == raw.dtype == torch.float32
    assert qsa.pool_keys(raw[0, :8].view(2, 4, -1), torch.tensor([0, 4])).dtype == torch.float32
    from specopd.models.common import Router

    router = next(m for m in target.modules() if isinstance(m, Router))
    w, idx = router(x[0])
    ref = torch.topk(torch.softmax(torch.nn.functional.linear(x[0].float(), router.weight.float()), -1), 2).indices
    assert w.dtype == torch.bfloat16 and torch.equal(idx, ref)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_selection_identical_with_identical_inputs(seed):
    """QSA as the first layer sees the same embedding rows in prefill and score: the same groups are selected."""
    target = _target(seed, qsa_first=True)
    _, sel_score, sel_prefill = _commit_vs_prefill(target, seed, record=True)
    first = min(sel_score)
    assert sel_score[first].shape == sel_prefill[first].shape and (sel_score[first] >= 0).sum() > 0
    assert torch.equal(sel_score[first], sel_prefill[first])


@pytest.mark.slow
def test_bf16_commit_vs_prefill_within_noise_selection_forced_equal():
    errs = [_commit_vs_prefill(_target(s, budget=4096, experts_per_tok=8), s)[0] for s in SEEDS]
    assert max(errs) <= NOISE_BOUND, errs
    assert min(errs) > 1e-4, errs  # bf16 noise is there: the comparison is not vacuous


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known: upstream bf16 noise flips near-tie top-k selections / routing "
                                       "between prefill and score (see the module docstring)")
def test_bf16_commit_vs_prefill_within_noise_sparse_selection():
    errs = [_commit_vs_prefill(_target(s), s)[0] for s in SEEDS]
    assert max(errs) <= NOISE_BOUND, errs
