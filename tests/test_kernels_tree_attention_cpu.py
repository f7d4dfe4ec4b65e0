"""Tree attention in bf16 on the CPU (kernels/tree_attention/cpu.py, ``tree_attention_bf16`` in
kernels/causal_attention/attention_cpu.c) against the fp32 reference (kernels/tree_attention/naive.py) and the
torch path it replaces in the GQA executor (the blocked plan with grouped fused attention); its rows'
independence; the executor's use of it.

The bound is the kernel's own rounding, as for the causal kernel (tests/test_kernels_causal_attention.py): P rounded
to bf16 (relative 2^-8 each: at most 2^-8 * sum_j p_j |v_j|), the output rounded to bf16 (half a unit), fp32 sums.
"""
import pytest
import torch

from specopd_kernels.paths import KernelsConfig
from specopd_kernels.causal_attention.cpu import LIB
from specopd_kernels.tree_attention import block_groups, build_tree_plan, tree_attention_blocked, tree_attention_reference
from specopd_kernels.tree_attention import cpu
from specopd_kernels.tree_attention.naive import ancestor_or_self
from specopd.tree import ProposalTree

pytestmark = pytest.mark.skipif(not LIB.available(), reason=f"attention kernel unavailable: {LIB.reason()}")


def _half_unit(x: torch.Tensor) -> torch.Tensor:
    e = torch.frexp(x.abs().clamp(min=2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(x), e - 9)


def _chains(lens, anchors, w):
    """Chain branches: anchors[i] = trunk i's anchors (any order, repeats allowed), w tokens each."""
    trees = [ProposalTree.from_branches(torch.tensor(a, dtype=torch.long), torch.zeros(len(a), w, dtype=torch.long))
             for a in anchors]
    return ProposalTree.pack(trees)


def _general(lens):
    """One trunk: a branching tree (two roots on one anchor, siblings, a 6-deep path) and roots at 0 and T - 1."""
    t = lens[0]
    parents = [-1, -1, 0, 0, 2, 4, 5, 6, 7, -t, -(t // 2 + 1), 10, 1]  # -p - 1 = trunk position p
    return ProposalTree.from_parents(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def _inputs(tree, lens, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    m = tree.anchor.numel()
    q = (2 * torch.randn(m, h, d, generator=g)).bfloat16()
    k = (2 * torch.randn(m, hkv, d, generator=g)).bfloat16()
    v = torch.randn(m, hkv, d, generator=g).bfloat16()
    tk = [(2 * torch.randn(t, hkv, d, generator=g)).bfloat16() for t in lens]
    tv = [torch.randn(t, hkv, d, generator=g).bfloat16() for t in lens]
    return q, k, v, tk, tv


CASES = [  # (name, lens, tree builder, H, Hkv, D)
    ("one token, one node", [1], lambda L: _chains(L, [[0]], 1), 1, 1, 32),
    ("anchors at 0 and at the end, on block / chunk edges",
     [300], lambda L: _chains(L, [[0, 15, 16, 17, 255, 256, 257, 299]], 4), 9, 3, 64),
    ("one drafted token per branch", [64, 40], lambda L: _chains(L, [[3, 9, 63], [0, 39]], 1), 9, 3, 64),
    ("many branches on one anchor", [100], lambda L: _chains(L, [[50] * 12 + [7] * 3], 4), 8, 1, 128),
    ("unsorted anchors, several trunks, one empty",
     [513, 20, 600], lambda L: _chains(L, [[512, 3, 200, 3], [], [599, 0, 256]], 3), 9, 3, 64),
    ("a branching tree, 6 deep", [70], _general, 4, 4, 96),
    ("D = 256, deep chains", [40], lambda L: _chains(L, [[5, 39]], 20), 2, 1, 256),
]


@pytest.mark.parametrize("name,lens,build,h,hkv,d", CASES, ids=[c[0] for c in CASES])
def test_within_its_rounding_of_fp32_and_as_close_as_torch(name, lens, build, h, hkv, d):
    tree = build(lens)
    q, k, v, tk, tv = _inputs(tree, lens, h, hkv, d, seed=sum(lens) + d)
    scale = d ** -0.5
    args = (tree.anchor, tree.parent, tree.trunk_index, scale)
    ref = tree_attention_reference(q, k, v, tk, tv, *args[:3], scale)
    weight = tree_attention_reference(q, k, v.abs(), tk, [x.abs() for x in tv], *args[:3], scale)
    layout = cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens)
    got = cpu.tree_attention(q, k, v, torch.cat(tk), torch.cat(tv), layout, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err = (got.float() - ref).abs()
    bound = _half_unit(torch.maximum(got.float().abs(), ref.abs())) + (2.0 ** -8 + 1e-4) * weight
    assert bool((err <= bound).all()), float((err / bound).max())
    plan = build_tree_plan(tree.anchor, tree.parent, tree.trunk_index, lens, block_m=64, block_n=64)
    old = tree_attention_blocked(q, k, v, torch.cat(tk), torch.cat(tv), plan, scale, block_groups(plan, 1 << 16))
    assert float(err.mean()) <= 1.1 * float((old.bfloat16().float() - ref).abs().mean()) + 1e-7


def test_layout_lists_each_nodes_path_root_first_and_sorts_by_anchor():
    tree = _general([70])
    lay = cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, [70])
    dense = ancestor_or_self(tree.parent)
    for u in range(tree.anchor.numel()):
        path = [int(x) for x in lay.ancestors[u] if x >= 0]
        assert path == sorted(path) and path[-1] == u  # root first (parents precede children), self last
        assert set(path) == set(torch.nonzero(dense[u]).flatten().tolist())
    assert lay.ancestors.shape[1] == 7  # the deepest path: nodes 0, 2, 4, 5, 6, 7, 8
    a = tree.anchor[lay.order]
    assert bool((a[1:] >= a[:-1]).all())
    with pytest.raises(ValueError):
        cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, [50])  # an anchor past the trunk


def test_a_rows_result_depends_only_on_its_query_and_its_keys():
    """Bitwise: one branch alone == packed with other branches and trunks; 1 thread == 2."""
    lens = [300, 17, 200]
    tree = _chains(lens, [[0, 255, 256, 299, 100], [16], [199, 5]], 4)
    q, k, v, tk, tv = _inputs(tree, lens, 9, 3, 64, seed=3)
    lay = cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens)
    packed = cpu.tree_attention(q, k, v, torch.cat(tk), torch.cat(tv), lay, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.tree_attention(q, k, v, torch.cat(tk), torch.cat(tv), lay, 0.125), packed)
    finally:
        torch.set_num_threads(threads)
    node = 0
    for i, anchors in enumerate([[0, 255, 256, 299, 100], [16], [199, 5]]):
        for a in anchors:
            one = ProposalTree.from_branches(torch.tensor([a]), torch.zeros(1, 4, dtype=torch.long))
            lay1 = cpu.tree_layout(one.anchor, one.parent, one.trunk_index, [lens[i]])
            rows = slice(node, node + 4)
            alone = cpu.tree_attention(q[rows], k[rows], v[rows], tk[i], tv[i], lay1, 0.125)
            assert torch.equal(alone, packed[rows])
            node += 4


def test_strided_inputs_and_bad_arguments():
    lens = [30]
    tree = _chains(lens, [[4, 29]], 3)
    q, k, v, tk, tv = _inputs(tree, lens, 4, 2, 64, seed=5)
    lay = cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens)
    qkv = torch.cat([q, k, v], 1)  # [M, 8, D]: q / k / v as views with a row stride of 8 heads
    got = cpu.tree_attention(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], tk[0], tv[0], lay, 0.125)
    assert torch.equal(got, cpu.tree_attention(q, k, v, tk[0], tv[0], lay, 0.125))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cpu.tree_attention(q[:, :3], k, v, tk[0], tv[0], lay, 0.125)
    with pytest.raises(ValueError, match="build it with tree_layout"):
        cpu.tree_attention(q, k, v, tk[0][:20], tv[0][:20], lay, 0.125)
    with pytest.raises(ValueError, match="bf16"):
        cpu.tree_attention(q.float(), k.float(), v.float(), tk[0].float(), tv[0].float(), lay, 0.125)


def test_the_executor_scores_and_verifies_with_it():
    """specopd_executors.gqa: gqa_backend "auto" takes the kernel for bf16 where ``enabled`` (kernels.cpu_attention=cpu forces
    it on any CPU where it builds), the same bits as "cpu" named; "torch" keeps the blocked path; "cpu" on fp32 is a
    clear error."""
    from specopd_executors.gqa import score_backend
    from specopd_executors.options import ExecOptions

    q = torch.zeros(1, 4, 9, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16)
    ours = KernelsConfig(cpu_attention="cpu")
    assert score_backend(q.device, ExecOptions(kernel_paths=ours), q[0], k[0]) == "cpu"
    assert score_backend(q.device, ExecOptions(gqa_backend="cpu"), q[0], k[0]) == "cpu"
    theirs = ExecOptions(kernel_paths=KernelsConfig(cpu_attention="torch"))
    assert score_backend(q.device, theirs, q[0], k[0]) == "blocked"
    with pytest.raises(ValueError, match="gqa_backend='cpu' scores bf16"):
        score_backend(q.device, ExecOptions(gqa_backend="cpu"), q[0].float(), k[0].float())


def test_no_node_sees_a_later_node_or_another_branch():
    """Changing a node's key / value (or a trunk key past an anchor) moves only the rows that may attend to it:
    the node itself and its descendants, bitwise."""
    lens = [64]
    tree = _chains(lens, [[10, 10, 40]], 4)  # two branches on one anchor, one further on
    q, k, v, tk, tv = _inputs(tree, lens, 9, 3, 64, seed=11)
    lay = cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens)
    base = cpu.tree_attention(q, k, v, tk[0], tv[0], lay, 0.125)
    for node in range(12):
        k2, v2 = k.clone(), v.clone()
        k2[node] += 1
        v2[node] -= 1
        out = cpu.tree_attention(q, k2, v2, tk[0], tv[0], lay, 0.125)
        moved = {int(u) for u in torch.nonzero((out != base).flatten(1).any(1)).flatten()}
        assert moved == set(range(node, node // 4 * 4 + 4)), (node, moved)  # itself and the rest of its branch
    tk2, tv2 = tk[0].clone(), tv[0].clone()
    tk2[11:] += 1  # past the first two branches' anchor (10)
    tv2[11:] -= 1
    out = cpu.tree_attention(q, k, v, tk2, tv2, lay, 0.125)
    assert torch.equal(out[:8], base[:8]) and not torch.equal(out[8:], base[8:])
