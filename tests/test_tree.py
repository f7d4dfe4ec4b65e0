"""ProposalTree: structure, packing, ancestor masks and paths back into the trunk."""
import pytest
import torch

from specopd.tree import ProposalTree


def _random_tree(seed, m=12, t=9):
    g = torch.Generator().manual_seed(seed)
    parents = []
    for u in range(m):
        if u == 0 or torch.rand(1, generator=g) < 0.35:
            parents.append(-int(torch.randint(0, t, (1,), generator=g)) - 1)
        else:
            parents.append(int(torch.randint(0, u, (1,), generator=g)))
    return ProposalTree.from_parents(torch.randint(0, 50, (m,), generator=g), parents)


def _path(tree, u):
    """Node indices root..u."""
    out = []
    while u >= 0:
        out.append(u)
        u = int(tree.parent[u])
    return out[::-1]


def test_from_branches_structure():
    tree = ProposalTree.from_branches([4, 0], [[10, 11, 12], [20, 21, 22]])
    assert tree.shape == (2, 3) and tree.num_nodes == 6
    assert tree.tokens.tolist() == [10, 11, 12, 20, 21, 22]
    assert tree.parent.tolist() == [-1, 0, 1, -1, 3, 4]
    assert tree.anchor.tolist() == [4, 4, 4, 0, 0, 0]
    assert tree.depth.tolist() == [0, 1, 2, 0, 1, 2]
    assert tree.positions.tolist() == [5, 6, 7, 1, 2, 3]
    assert tree.reshape_nodes(tree.tokens).tolist() == [[10, 11, 12], [20, 21, 22]]


def test_from_parents_anchor_encoding():
    tree = ProposalTree.from_parents([1, 2, 3, 4], [-1, 0, -6, 1])
    assert tree.anchor.tolist() == [0, 0, 5, 0]
    assert tree.parent.tolist() == [-1, 0, -1, 1]
    assert tree.depth.tolist() == [0, 1, 0, 2]
    assert tree.positions.tolist() == [1, 2, 6, 3]
    assert tree.shape is None
    assert tree.reshape_nodes(tree.tokens) is tree.tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_levels_and_ancestor_mask(seed):
    tree = _random_tree(seed)
    levels = tree.levels()
    seen = set()
    for k, lvl in enumerate(levels):
        for u in lvl.tolist():
            assert int(tree.depth[u]) == k
            p = int(tree.parent[u])
            assert p < 0 or p in seen
        seen |= set(lvl.tolist())
    assert seen == set(range(tree.num_nodes))
    anc = tree.ancestor_mask()
    expect = torch.zeros_like(anc)
    for u in range(tree.num_nodes):
        expect[u, _path(tree, u)] = True
    assert torch.equal(anc, expect)


@pytest.mark.parametrize("seed", [0, 3])
def test_path_back_matches_brute_force(seed):
    tree = _random_tree(seed)
    trunk = torch.arange(100, 109)
    k = 6
    node_ref, trunk_pos, token = tree.path_back(k, [trunk])
    for u in range(tree.num_nodes):
        path = _path(tree, u)[:-1]  # strict ancestors, root first
        a = int(tree.anchor[u])
        # sequence before u: trunk[0..a] then the ancestors
        before = [("t", j) for j in range(a + 1)] + [("n", w) for w in path]
        for s in range(k):
            if s < len(before):
                kind, ref = before[-1 - s]
                if kind == "n":
                    assert (int(node_ref[u, s]), int(trunk_pos[u, s])) == (ref, -1)
                    assert int(token[u, s]) == int(tree.tokens[ref])
                else:
                    assert (int(node_ref[u, s]), int(trunk_pos[u, s])) == (-1, ref)
                    assert int(token[u, s]) == int(trunk[ref])
            else:
                assert (int(node_ref[u, s]), int(trunk_pos[u, s]), int(token[u, s])) == (-1, -1, -1)


def test_pack_and_split():
    a = ProposalTree.from_branches([1, 2], [[1, 2], [3, 4]])
    b = ProposalTree.from_branches([0], [[5, 6]])
    c = ProposalTree.from_parents([7, 8], [-1, 0])
    p = ProposalTree.pack([a, b])
    assert p.num_trunks == 2 and p.shape == (3, 2)
    assert p.parent.tolist() == [-1, 0, -1, 2, -1, 4]
    assert p.trunk_index.tolist() == [0, 0, 0, 0, 1, 1]
    assert p.anchor.tolist() == [1, 1, 2, 2, 0, 0]
    parts = p.split(p.tokens)
    assert [x.tolist() for x in parts] == [[1, 2, 3, 4], [5, 6]]
    anc = p.ancestor_mask()
    assert not anc[4:, :4].any() and not anc[:4, 4:].any()
    for i in range(2):  # one trunk's block, built alone, equals that block of the full matrix
        nodes = torch.nonzero(p.trunk_index == i).flatten()
        assert torch.equal(p.ancestor_mask(nodes), anc[nodes][:, nodes])
    with pytest.raises(ValueError, match="every ancestor"):
        p.ancestor_mask(torch.tensor([1]))  # node 1's parent (node 0) is missing
    mixed = ProposalTree.pack([a, c])
    assert mixed.shape is None and mixed.parent.tolist() == [-1, 0, -1, 2, -1, 4]
    w_diff = ProposalTree.pack([a, ProposalTree.from_branches([0], [[1, 2, 3]])])
    assert w_diff.shape is None
    with pytest.raises(ValueError, match="no trees"):
        ProposalTree.pack([])
    with pytest.raises(ValueError, match="one trunk"):
        ProposalTree.pack([p])


def test_path_back_packed_uses_each_trunk():
    p = ProposalTree.pack([ProposalTree.from_branches([1], [[9]]), ProposalTree.from_branches([2], [[8]])])
    _, pos, tok = p.path_back(2, [torch.tensor([10, 11]), torch.tensor([20, 21, 22])])
    assert pos.tolist() == [[1, 0], [2, 1]]
    assert tok.tolist() == [[11, 10], [22, 21]]


def test_validate_errors():
    tree = ProposalTree.from_branches([3, 5], [[1, 2], [3, 4]])
    tree.validate([6], vocab_size=10)
    with pytest.raises(ValueError, match="anchor 5 is outside its trunk of length 5"):
        tree.validate([5])
    with pytest.raises(ValueError, match="token 4 is outside the vocab"):
        tree.validate([6], vocab_size=4)
    with pytest.raises(ValueError, match="2 cache"):
        tree.validate([6, 6])
    with pytest.raises(ValueError, match="anchors \\[N\\] and tokens \\[N, W\\]"):
        ProposalTree.from_branches([1, 2], [[1, 2]])
    with pytest.raises(ValueError, match="W = 0"):
        ProposalTree.from_branches([1], torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty tree"):
        ProposalTree.from_parents([], [])
    with pytest.raises(ValueError, match="not an earlier node"):
        ProposalTree.from_parents([1, 2], [1, -1])
