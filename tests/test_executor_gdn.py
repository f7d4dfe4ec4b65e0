"""GDN executor: branch scoring over prefix caches equals running each branch's full sequence from scratch.

Tiny qwen3_next / qwen3_5 hybrids (3 GDN layers + 1 gated-attention layer, run by the gqa executor),
T >= 150 so that checkpoints, replays and chunk boundaries all matter. fp32: relative error <= 1e-5.
"""
import math

import pytest
import torch

from specopd_executors.gdn import GDNCache, GDNExecutor
from specopd_executors.options import ExecOptions
from kernel_check import kernel_modes
from oracle import make_tiny_checkpoint
from specopd.models import load_target
from specopd.tree import ProposalTree

T = 150
TOL = 1e-5


@pytest.fixture(scope="module", params=kernel_modes())
def kernels(request):
    return request.param


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def target(request, kernels, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return load_target(path, kernels=kernels)


def _trunk(vocab, t=T, seed=0):
    return torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(seed))


def _node_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over nodes of max|got - ref| / max|ref| (per node's logits row)."""
    err = (got - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return float(err.max())


def _reference_branches(target, trunk, anchors, tokens):
    """[N, W, V]: target(trunk[:a+1] + tokens[b, :j+1])[-1], one causal forward per branch."""
    out = []
    for a, toks in zip(anchors.tolist(), tokens):
        seq = torch.cat([trunk[: a + 1], toks]).view(1, -1)
        out.append(target(seq)[0, a + 1:])
    return torch.stack(out)


def _reference_tree(target, trunks, tree):
    """[M, V] for a general (possibly packed) tree: one forward per node path."""
    ref = []
    for u in range(tree.num_nodes):
        path, p = [], u
        while p >= 0:
            path.append(int(tree.tokens[p]))
            p = int(tree.parent[p])
        a, tr = int(tree.anchor[u]), trunks[int(tree.trunk_index[u])]
        seq = torch.cat([tr[: a + 1], torch.tensor(path[::-1])]).view(1, -1)
        ref.append(target(seq)[0, -1])
    return torch.stack(ref)


@pytest.mark.parametrize("every", [16, 64])
@pytest.mark.parametrize("width", [1, 5])
def test_branches_match_sequential(target, every, width):
    V = target.vocab_size
    trunk = _trunk(V)
    cache = target.prefill(trunk, gdn_checkpoint_every=every)
    g = torch.Generator().manual_seed(every + width)
    edge = [0, 1, 2, every - 1, every, every + 1, 2 * every - 1, T - 2, T - 1]
    rand = torch.randint(0, T, (3,), generator=g).tolist()
    anchors = torch.tensor(edge + rand + [every, every, T - 1])  # several branches on one anchor
    tokens = torch.randint(0, V, (anchors.numel(), width), generator=g)
    p = target.score(ProposalTree.from_branches(anchors, tokens), cache)
    ref = _reference_branches(target, trunk, anchors, tokens)
    assert p.shape == ref.shape
    assert _node_rel_err(p, ref) <= TOL


def test_general_trees_match_sequential(target):
    V = target.vocab_size
    trunk = _trunk(V, seed=1)
    cache = target.prefill(trunk, gdn_checkpoint_every=16)
    g = torch.Generator().manual_seed(7)
    m = 24
    parents = []
    for u in range(m):  # random forest: a parent among earlier nodes, or a trunk position
        if u == 0 or torch.rand((), generator=g) < 0.3:
            parents.append(-int(torch.randint(0, T, (), generator=g)) - 1)
        else:
            parents.append(int(torch.randint(0, u, (), generator=g)))
    parents[1], parents[2] = 0, 0  # siblings
    tree = ProposalTree.from_parents(torch.randint(0, V, (m,), generator=g), parents)
    p = target.score(tree, cache)
    assert _node_rel_err(p, _reference_tree(target, [trunk], tree)) <= TOL


def test_checkpoint_count_and_bytes(target):
    V = target.vocab_size
    for t, every in [(T, 16), (160, 16), (T, 64), (5, 64), (T, 1)]:
        cache = target.prefill(_trunk(V, t), gdn_checkpoint_every=every)
        gdn = [c for c, kind in zip(cache.layers, target.layer_kinds) if kind == "gdn"]
        assert len(gdn) == 3
        for c in gdn:
            assert isinstance(c, GDNCache) and len(c) == t
            assert c.checkpoints.shape[0] == math.ceil(t / every)
            assert c.checkpoints.dtype == torch.float32 and c.final.dtype == torch.float32
            assert torch.count_nonzero(c.checkpoints[0]) == 0  # checkpoint 0 = the empty prefix
            state = c.final.numel() * 4
            assert c.nbytes() == c.conv_in.numel() * c.conv_in.element_size() + 2 * c.g.numel() * 4 + \
                (c.checkpoints.shape[0] + 1) * state
    c16 = target.prefill(_trunk(V), gdn_checkpoint_every=16).nbytes()
    c64 = target.prefill(_trunk(V), gdn_checkpoint_every=64).nbytes()
    assert c16 > c64


def test_trunk_end_multiple_of_every(target):
    """T a multiple of C: the anchor T-1 uses the final state (there is no checkpoint at T)."""
    V = target.vocab_size
    trunk = _trunk(V, 160, seed=3)
    cache = target.prefill(trunk, gdn_checkpoint_every=16)
    anchors = torch.tensor([159, 143, 144, 15, 16])
    tokens = torch.randint(0, V, (5, 3), generator=torch.Generator().manual_seed(3))
    p = target.score(ProposalTree.from_branches(anchors, tokens), cache)
    assert _node_rel_err(p, _reference_branches(target, trunk, anchors, tokens)) <= TOL


def test_replay_is_shorter_than_every(target, monkeypatch):
    """Restoring any anchor replays at most C-1 recurrent steps, one replay per checkpoint segment."""
    import specopd_executors.gdn as gdn

    calls = []
    real = gdn.gated_delta_step
    monkeypatch.setattr(gdn, "gated_delta_step", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    every = 16
    cache = target.prefill(_trunk(target.vocab_size), gdn_checkpoint_every=every)
    mixer = target.model.layers[0].mixer
    anchors = torch.arange(T)
    S = GDNExecutor().anchor_states(mixer, [cache.layers[0]], torch.zeros(T, dtype=torch.long), anchors)
    assert len(calls) == every - 1 and S.shape[0] == T
    assert max(calls) <= math.ceil(T / every)  # anchors of one checkpoint segment share its replay
    # and each restored state equals the plain recurrence's state after trunk[0..a]
    ref = target.prefill(_trunk(target.vocab_size)[:40], gdn_checkpoint_every=every).layers[0].final
    assert torch.allclose(S[39], ref, rtol=0, atol=1e-6)


def test_packed_trunks_equal_one_by_one(target):
    V = target.vocab_size
    trunks = [_trunk(V, T, seed=10), _trunk(V, 97, seed=11)]
    caches = [target.prefill(t, gdn_checkpoint_every=16) for t in trunks]
    g = torch.Generator().manual_seed(5)
    trees = [ProposalTree.from_branches(torch.tensor([0, 16, T - 1, 40]), torch.randint(0, V, (4, 3), generator=g)),
             ProposalTree.from_branches(torch.tensor([96, 16, 17]), torch.randint(0, V, (3, 3), generator=g))]
    packed = target.score(ProposalTree.pack(trees), caches)
    single = torch.cat([target.score(t, c) for t, c in zip(trees, caches)])
    assert torch.allclose(packed, single, rtol=0, atol=1e-5 * float(single.abs().max()))
    ref = torch.cat([_reference_branches(target, tr, t.anchor.view(-1, 3)[:, 0], t.tokens.view(-1, 3))
                     for tr, t in zip(trunks, trees)])
    assert _node_rel_err(packed, ref) <= TOL


def test_prefill_extension_equals_one_shot(target):
    V = target.vocab_size
    trunk = _trunk(V, T, seed=4)
    full = target.prefill(trunk, gdn_checkpoint_every=16)
    cache = None
    for lo, hi in [(0, 2), (2, 3), (3, 40), (40, 48), (48, 49), (49, T)]:  # short pieces test the conv history
        cache = target.prefill(trunk[lo:hi], cache, gdn_checkpoint_every=16)
    assert len(cache) == T and torch.equal(cache.token_ids, trunk)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    # equal up to fp32 rounding of projections run on pieces vs the whole (measured <= 6e-6 here)
    assert rel(cache.logits, full.logits) <= 5e-5
    for a, b, kind in zip(cache.layers, full.layers, target.layer_kinds):
        if kind == "gdn":
            assert a.checkpoints.shape == b.checkpoints.shape
            assert rel(a.checkpoints[1:], b.checkpoints[1:]) <= 5e-5 and rel(a.final, b.final) <= 5e-5
            assert rel(a.conv_in, b.conv_in) <= 5e-5 and rel(a.g, b.g) <= 5e-5
    anchors, tokens = torch.tensor([3, 47, 48, T - 1]), torch.randint(0, V, (4, 2))
    tree = ProposalTree.from_branches(anchors, tokens)
    assert _node_rel_err(target.score(tree, cache), target.score(tree, full)) <= TOL


def test_prefill_does_not_modify_prev(target):
    V = target.vocab_size
    first = target.prefill(_trunk(V, 30), gdn_checkpoint_every=16)
    before = [(c.conv_in.clone(), c.checkpoints.clone(), c.final.clone()) for c in first.layers[:1]]
    target.prefill(_trunk(V, 20, seed=9), first)
    c = first.layers[0]
    assert len(c) == 30 and torch.equal(c.conv_in, before[0][0]) and torch.equal(c.checkpoints, before[0][1])
    assert torch.equal(c.final, before[0][2])


def test_mismatched_every_is_an_error(target):
    cache = target.prefill(_trunk(target.vocab_size, 20), gdn_checkpoint_every=16)
    mixer = target.model.layers[0].mixer
    x = torch.zeros(1, 3, target.hidden_size)
    with pytest.raises(ValueError, match="gdn_checkpoint_every"):
        GDNExecutor().prefill(mixer, x, None, prev=cache.layers[0], options=ExecOptions(gdn_checkpoint_every=32))


def test_bf16_scoring_matches_bf16_sequential(tmp_path):
    """bf16 weights: conv inputs cached in bf16, states and checkpoints fp32; scoring equals the bf16 plain
    forward (within bf16 noise; in practice bit-identical here)."""
    target = load_target(make_tiny_checkpoint("qwen3_5_text", tmp_path), dtype=torch.bfloat16)
    V = target.vocab_size
    trunk = _trunk(V, 100, seed=6)
    cache = target.prefill(trunk, gdn_checkpoint_every=16)
    assert cache.layers[0].conv_in.dtype == torch.bfloat16 and cache.layers[0].checkpoints.dtype == torch.float32
    anchors, tokens = torch.tensor([0, 15, 16, 57, 99]), torch.randint(0, V, (5, 4))
    p = target.score(ProposalTree.from_branches(anchors, tokens), cache).float()
    ref = _reference_branches(target, trunk, anchors, tokens).float()
    assert _node_rel_err(p, ref) <= 1e-2


def test_moe_hybrid_branches_match_sequential(tmp_path):
    """qwen3_5_moe (every layer MoE): routing is per token, so scoring stays exact."""
    target = load_target(make_tiny_checkpoint("qwen3_5_moe_text", tmp_path))
    V = target.vocab_size
    trunk = _trunk(V, T, seed=8)
    cache = target.prefill(trunk, gdn_checkpoint_every=16)
    anchors, tokens = torch.tensor([0, 31, 32, 77, T - 1]), torch.randint(0, V, (5, 3))
    p = target.score(ProposalTree.from_branches(anchors, tokens), cache)
    assert _node_rel_err(p, _reference_branches(target, trunk, anchors, tokens)) <= TOL


def test_one_token_trunk_and_token_by_token_decoding(target):
    """A trunk of one token (the anchor is its only position), then extended one token at a time (the
    speculative decoder's commit path): every step scores like the sequential reference. Tolerance 1e-4:
    a cache built one token at a time differs from a one-shot forward by fp32 GEMV-vs-GEMM rounding
    (~3e-7 per projection, ~1e-5 at the logits of this tiny random model: measured for the trunk logits
    themselves), not by anything the executor does."""
    V = target.vocab_size
    trunk = _trunk(V, 20, seed=12)
    cache = target.prefill(trunk[:1], gdn_checkpoint_every=4)
    g = torch.Generator().manual_seed(12)
    for t in range(1, 20):
        tokens = torch.randint(0, V, (2, 3), generator=g)
        anchors = torch.tensor([t - 1, max(t - 4, 0)])
        p = target.score(ProposalTree.from_branches(anchors, tokens), cache)
        assert _node_rel_err(p, _reference_branches(target, trunk[:t], anchors, tokens)) <= 1e-4
        cache = target.prefill(trunk[t:t + 1], cache)
    assert cache.layers[0].checkpoints.shape[0] == math.ceil(20 / 4)


def test_triton_kernels_are_launched(target, monkeypatch):
    """With kernels="triton", GDN prefill runs the chunk kernel (C % 16 == 0) or the fused recurrent one, and
    score / verify the fused replay (per-node states only for verify)."""
    if target.kernels != "triton":
        pytest.skip("the triton instance checks the Triton path")
    import specopd_kernels.gated_delta.chunk as chunk
    import specopd_kernels.gated_delta.fused_recurrent as fr
    import specopd_kernels.gated_delta.replay as rp

    calls = []
    for mod, name in ((chunk, "chunk_gated_delta_rule"), (fr, "fused_recurrent_gated_delta_rule"),
                      (rp, "gdn_tree_replay")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append((_n, k.get("store_states")))
                            or _r(*a, **k))
    n_gdn = target.layer_kinds.count("gdn")
    cache = target.prefill(_trunk(target.vocab_size, 40), gdn_checkpoint_every=16)
    target.prefill(_trunk(target.vocab_size, 5), gdn_checkpoint_every=8)
    tree = ProposalTree.from_branches([39, 3], [[1, 2], [3, 4]])
    target.score(tree, cache)
    target.score(tree, cache, return_state=True)
    names = [c[0] for c in calls]
    assert names.count("chunk_gated_delta_rule") == n_gdn and names.count("fused_recurrent_gated_delta_rule") == n_gdn
    assert [c[1] for c in calls if c[0] == "gdn_tree_replay"] == [False] * n_gdn + [True] * n_gdn
