"""QSA executor (and the PLE conv executor) on tiny qwen4_exp targets: every tree node's logits equal the
plain forward of ``trunk[:a+1] + path`` (fp32 rel 1e-5) and every QSA selection equals the sequential one."""
import pytest
import torch

from kernel_check import kernel_modes
from specopd.models import load_target
from specopd.tree import ProposalTree
from tests.oracle import make_tiny_checkpoint, rel_err
from tests.test_models_qsa import perturb_ple_conv

T = 160
TOL = 1e-5


@pytest.fixture(scope="module", params=kernel_modes())
def kernels(request):
    return request.param


@pytest.fixture(scope="module", params=["ple", "no-ple"])
def target(request, kernels, tmp_path_factory):
    ov = {} if request.param == "ple" else {"ple_layer_ids": []}
    path = perturb_ple_conv(make_tiny_checkpoint("qwen4_exp_text", tmp_path_factory.mktemp("q4x"), **ov))
    tgt = load_target(path, kernels=kernels)
    tgt.ckpt_path = path
    return tgt


def _trunk(seed, t=T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (t,), generator=g)
    ids[ids == 3] = 4
    ids[[t // 4, t // 4 + 1, t // 2]] = 3  # EOS inside the trunk (PLE n-grams restart)
    return ids


def _qsa(tgt):
    return [m for m in tgt.modules() if getattr(m, "kind", None) == "qsa"]


def check_tree(tgt, tree, caches, trunks):
    """Score the tree once; compare every node with a from-scratch plain forward (logits and selections).
    One reference forward per leaf covers the whole path of the leaf. Returns the node logits [M, V]."""
    rec = {}
    for c in caches:
        c.options.qsa_record = rec
    out = tgt.score(tree, caches if len(caches) > 1 else caches[0])
    for c in caches:
        c.options.qsa_record = None
    out = out.reshape(tree.num_nodes, -1)
    mods = _qsa(tgt)
    has_child = torch.zeros(tree.num_nodes, dtype=torch.bool)
    has_child[tree.parent[tree.parent >= 0]] = True
    for leaf in torch.nonzero(~has_child).flatten().tolist():
        nodes = []
        u = leaf
        while u >= 0:
            nodes.append(u)
            u = int(tree.parent[u])
        nodes = nodes[::-1]  # root first: node nodes[j] sits at sequence index a + 1 + j
        a, ti = int(tree.anchor[leaf]), int(tree.trunk_index[leaf])
        seq = torch.cat([trunks[ti][: a + 1], tree.tokens[nodes]]).view(1, -1)
        for m in mods:
            m.record = []
        ref = tgt(seq)[0]
        for j, u in enumerate(nodes):
            err = rel_err(out[u], ref[a + 1 + j])
            assert err <= TOL, f"node {u} (anchor {a}, depth {j}): rel err {err:.2e}"
            for m in mods:
                want = m.record[0][0, a + 1 + j]
                assert torch.equal(rec[m.layer_idx][u], want), \
                    f"node {u} layer {m.layer_idx}: selection {rec[m.layer_idx][u].tolist()} != {want.tolist()}"
        for m in mods:
            m.record = None
    return out


def test_prefill_matches_plain_and_nbytes(target):
    trunk = _trunk(0)
    cache = target.prefill(trunk)
    assert rel_err(cache.logits, target(trunk.view(1, -1))[0]) <= TOL
    per = [c.nbytes() for c in cache.layers] + [c.nbytes() for c in cache.extra.values()]
    assert cache.nbytes() == sum(per) > 0
    q = cache.layers[_qsa(target)[0].layer_idx]
    assert q.pooled.shape[0] == T // 4 and q.k.shape[0] == T


@pytest.mark.parametrize("w", [1, 5])
def test_chain_branches_edge_anchors(target, w):
    """Anchors 0, T-1, every residue mod 4 around group boundaries (incl. the dense/sparse switch at
    budget + 3 = 19 visible tokens), several branches on one anchor, random anchors."""
    trunk = _trunk(1)
    cache = target.prefill(trunk)
    g = torch.Generator().manual_seed(2)
    anchors = [0, 1, 2, 3, 14, 15, 16, 17, 18, 19, 20, 63, 64, 65, 66, 100, 100, 100, T - 2, T - 1]
    anchors += torch.randint(0, T, (4,), generator=g).tolist()
    toks = torch.randint(0, 256, (len(anchors), w), generator=g)
    toks[5, 0] = 3  # an EOS drafted inside a branch
    tree = ProposalTree.from_branches(torch.tensor(anchors), toks)
    out = check_tree(target, tree, [cache], [trunk])
    assert out.shape == (len(anchors) * w, target.vocab_size)


def test_general_tree(target):
    """Random trees with several children per node, on several anchors."""
    trunk = _trunk(3)
    cache = target.prefill(trunk)
    g = torch.Generator().manual_seed(4)
    toks, parents = [], []
    for a in (7, 18, 41, 42, 119):
        base = len(toks)
        for j in range(7):
            toks.append(int(torch.randint(0, 256, (1,), generator=g)))
            parents.append(-a - 1 if j < 2 else base + int(torch.randint(0, j, (1,), generator=g)))
    tree = ProposalTree.from_parents(torch.tensor(toks), torch.tensor(parents))
    assert int(tree.depth.max()) >= 2
    check_tree(target, tree, [cache], [trunk])


def test_packed_trunks_equal_one_by_one(target):
    trunks = [_trunk(5), _trunk(6, t=T - 37)]
    caches = [target.prefill(t) for t in trunks]
    g = torch.Generator().manual_seed(7)
    trees = [ProposalTree.from_branches(torch.tensor([3, 21, 77, len(t) - 1]), torch.randint(0, 256, (4, 3), generator=g))
             for t in trunks]
    packed = check_tree(target, ProposalTree.pack(trees), caches, trunks)
    single = torch.cat([target.score(tr, c).reshape(tr.num_nodes, -1) for tr, c in zip(trees, caches)])
    assert rel_err(packed, single) <= TOL


def test_prefill_extension(target):
    """prefill(trunk[:k]) then prefill(trunk[k:], cache=prev) == prefill(trunk): logits, QSA pooled keys,
    and branch scores on the extended cache. k % 4 != 0 so a group crosses the boundary."""
    trunk = _trunk(8)
    full = target.prefill(trunk)
    part = target.prefill(trunk[:101])
    ext = target.prefill(trunk[101:], cache=part)
    assert len(part) == 101 and len(ext) == T
    assert rel_err(ext.logits, full.logits) <= TOL
    chunked = target.prefill(trunk[:101])
    chunked.options.qsa_prefill_chunk = 7  # attention in blocks of 7 queries
    assert rel_err(target.prefill(trunk[101:], cache=chunked).logits, full.logits) <= TOL
    for m in _qsa(target):
        assert rel_err(ext.layers[m.layer_idx].pooled, full.layers[m.layer_idx].pooled) <= TOL
    tree = ProposalTree.from_branches(torch.tensor([99, 100, 101, 150]), torch.randint(0, 256, (4, 2)))
    assert rel_err(target.score(tree, ext), target.score(tree, full)) <= TOL
    check_tree(target, tree, [ext], [trunk])


def test_bf16_within_bf16_noise(target):
    """bf16 packed scoring is as close to the fp32 reference as a bf16 plain forward is (selections may
    differ where bf16 rounding reorders near-tied group scores, in packed and plain runs alike). The triton
    instance runs in fp16 instead: the interpreter's tl.dot on bf16 is wrong, fp16 is its stand-in."""
    dtype = torch.float16 if target.kernels == "triton" else torch.bfloat16
    t16 = load_target(target.ckpt_path, dtype=dtype)
    t16.kernels = target.kernels
    trunk = _trunk(9)
    g = torch.Generator().manual_seed(10)
    anchors, toks = torch.tensor([5, 40, 97, T - 1]), torch.randint(0, 256, (4, 3), generator=g)
    packed = t16.score(ProposalTree.from_branches(anchors, toks), t16.prefill(trunk)).float()
    for b, a in enumerate(anchors.tolist()):
        seq = torch.cat([trunk[: a + 1], toks[b]]).view(1, -1)
        ref = target(seq)[0, -3:]
        assert rel_err(packed[b], ref) <= 2 * rel_err(t16(seq)[0, -3:].float(), ref) + 2e-2


def test_triton_kernels_are_launched(target, monkeypatch):
    """With kernels="triton", QSA prefill runs ``qsa_prefill`` and score the indexer / top-k / sparse kernels."""
    if target.kernels != "triton":
        pytest.skip("the triton instance checks the Triton path")
    import specopd_kernels.qsa.indexer as ix
    import specopd_kernels.qsa.sparse_attention as sa

    calls = []
    for mod, name in ((sa, "qsa_prefill"), (sa, "sparse_attention"), (ix, "topk_groups")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    n_qsa = len(_qsa(target))
    cache = target.prefill(_trunk(1, t=24))
    target.score(ProposalTree.from_branches([23, 5], [[4, 5], [6, 7]]), cache)
    assert calls.count("qsa_prefill") == n_qsa and calls.count("topk_groups") == n_qsa
    assert calls.count("sparse_attention") == 2 * n_qsa  # one prefill chunk and score, per layer
