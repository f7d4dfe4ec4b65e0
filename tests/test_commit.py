"""Commit from the verify pass: ``target.commit(caches, state, paths)`` after
``target.score(tree, caches, return_state=True)`` equals ``target.prefill(path tokens, cache=cache)`` for every
executor kind in fp32 (token ids, features, logits, GQA K/V, GDN conv inputs / g / beta / checkpoints / final
state, QSA K/V / raw / pooled keys, PLE conv inputs), on chunk and group edges, for the bonus token alone, an
empty path and packed trunks; caches grow in place (amortised); bad paths get clear errors."""
import dataclasses

import pytest
import torch

from kernel_check import kernel_modes
from oracle import make_tiny_checkpoint
from specopd.models import load_target
from specopd.tree import ProposalTree
from tests.test_models_qsa import perturb_ple_conv

C = 8  # GDN checkpoint interval (small, so commits cross it often)
TOL = 1e-5


@pytest.fixture(scope="module", params=kernel_modes())
def kernels(request):
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "qwen4_exp_text"])
def target(request, kernels, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    if request.param == "qwen4_exp_text":
        perturb_ple_conv(path)
    return load_target(path, kernels=kernels)


def _ids(n, seed, vocab=256):
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ids[ids == 3] = 4  # qwen4_exp's EOS only where placed
    return ids


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_same_cache(got, ref, tol=TOL):
    """Every tensor of two TargetCaches (and of each layer's executor cache) equal within tol (rel, fp32)."""
    assert torch.equal(got.token_ids, ref.token_ids)
    for name in ("features", "logits", "hidden"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and _rel(a, b) <= tol, f"{name}: rel err {_rel(a, b):.2e}"
    assert got.options == ref.options and got.feature_layers == ref.feature_layers
    pairs = list(zip(got.layers, ref.layers)) + [(got.extra[k], ref.extra[k]) for k in ref.extra]
    assert len(got.extra) == len(ref.extra)
    for i, (a, b) in enumerate(pairs):
        assert type(a) is type(b)
        for f in dataclasses.fields(b):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if f.name == "_rows":
                continue
            if torch.is_tensor(y):
                assert x.shape == y.shape and x.dtype == y.dtype, f"layer {i} {f.name}: {x.shape} vs {y.shape}"
                assert _rel(x, y) <= tol, f"layer {i} {type(b).__name__}.{f.name}: rel err {_rel(x, y):.2e}"
            else:
                assert x == y, f"layer {i} {f.name}: {x} vs {y}"


def _chain_tree(anchor, tokens, extra_branches=()):
    """The chain ``tokens`` anchored at ``anchor`` (nodes 0..L-1), then other branches (anchor, tokens)."""
    toks, par = [tokens], [torch.tensor([-anchor - 1] + list(range(tokens.numel() - 1)))]
    off = tokens.numel()
    for a, t in extra_branches:
        toks.append(t)
        par.append(torch.tensor([-a - 1] + list(range(off, off + t.numel() - 1))))
        off += t.numel()
    return ProposalTree.from_parents(torch.cat(toks), torch.cat(par))


# (trunk length, path length): crossing a GDN checkpoint edge (multiple of C = 8) and QSA 4-token group
# edges, the bonus token alone, a commit ending exactly on an edge, one starting on an edge
CASES = [(13, 5), (15, 1), (16, 1), (21, 3), (7, 9), (24, 8), (1, 4)]


@pytest.mark.parametrize("t0,length", CASES)
@pytest.mark.parametrize("keep_checkpoints", [True, False])
def test_commit_equals_prefill(target, t0, length, keep_checkpoints):
    fl = (0, 1)
    ids = _ids(t0 + length + 4, seed=t0 * 31 + length)
    base = target.prefill(ids[:t0], feature_layers=fl, gdn_checkpoint_every=C, keep_checkpoints=keep_checkpoints)
    chain = ids[t0: t0 + length]
    # other nodes in the tree: a sibling branch on the same anchor, and (with checkpoints) one inside the trunk
    extra = [(t0 - 1, _ids(3, seed=99))]
    if keep_checkpoints and t0 > 2:
        extra.append((t0 // 2, _ids(2, seed=98)))
    tree = _chain_tree(t0 - 1, chain, extra)
    logits, state = target.score(tree, base, return_state=True)
    assert torch.equal(logits, target.score(tree, base))  # keeping the state changes nothing
    got = target.commit([base], state, [torch.arange(length)])[0]
    ref = target.prefill(chain, cache=base)
    assert len(got) == t0 + length
    assert_same_cache(got, ref)
    for a, kind in zip(got.layers, target.layer_kinds):
        if kind == "gdn":  # a checkpoint every C tokens (or none), as a one-shot prefill keeps
            n_ck = -(-(t0 + length) // C) if keep_checkpoints else 0
            assert a.checkpoints.shape[0] == n_ck
    one_shot = target.prefill(ids[: t0 + length], feature_layers=fl, gdn_checkpoint_every=C,
                              keep_checkpoints=keep_checkpoints)
    assert_same_cache(got, one_shot, tol=5e-5)  # pieces vs one pass: fp32 GEMV-vs-GEMM rounding only
    # the committed cache scores the next round like the prefilled one
    nxt = ProposalTree.from_branches(torch.tensor([t0 + length - 1]), ids[t0 + length: t0 + length + 3].view(1, -1))
    assert _rel(target.score(nxt, got), target.score(nxt, ref)) <= TOL


def test_commit_logits_and_base_untouched(target):
    ids = _ids(30, seed=1)
    base = target.prefill(ids[:17], feature_layers=(1,), gdn_checkpoint_every=C)  # keeps logits
    before = [t.clone() for c in base.layers for t in c.tensors()] + [base.token_ids.clone(), base.logits.clone()]
    tree = ProposalTree.from_branches(torch.tensor([16]), ids[17:22].view(1, -1))
    _, state = target.score(tree, base, return_state=True)
    got = target.commit(base, state, [[0, 1, 2]])[0]
    assert_same_cache(got, target.prefill(ids[17:20], cache=base))
    assert got.logits.shape[0] == 20
    # a second, different commit from the same base (a fork) must not clobber the first one
    other = target.commit(base, state, [[0]])[0]
    assert_same_cache(other, target.prefill(ids[17:18], cache=base))
    assert_same_cache(got, target.prefill(ids[17:20], cache=base))
    after = [t for c in base.layers for t in c.tensors()] + [base.token_ids, base.logits]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and len(base) == 17


def test_empty_path_and_packed_trunks(target):
    trunks = [_ids(19, seed=2), _ids(12, seed=3), _ids(9, seed=4)]
    lens = [13, 8, 9]
    caches = [target.prefill(t[:n], feature_layers=(0,), gdn_checkpoint_every=C, keep_checkpoints=False)
              for t, n in zip(trunks, lens)]
    chains = [trunks[0][13:19], trunks[1][8:12], _ids(2, seed=5)]
    trees = [ProposalTree.from_branches(torch.tensor([n - 1]), c.view(1, -1)) for n, c in zip(lens, chains)]
    packed = ProposalTree.pack(trees)
    _, state = target.score(packed, caches, return_state=True)
    # trunk 0 takes 6 nodes (crosses 16 = 2C), trunk 1 takes 1 (the bonus token alone), trunk 2 nothing
    got = target.commit(caches, state, [torch.arange(6), torch.tensor([6]), []])
    assert_same_cache(got[0], target.prefill(chains[0], cache=caches[0]))
    assert_same_cache(got[1], target.prefill(chains[1][:1], cache=caches[1]))
    assert got[2] is caches[2]


def test_growth_is_amortised(target):
    """Committing one token per round: the layer buffers are reallocated O(log n) times, not every round."""
    ids = _ids(80, seed=6)
    cache = target.prefill(ids[:4], gdn_checkpoint_every=C, keep_checkpoints=False, keep_logits=False)
    ptrs = set()
    for t in range(4, 68):
        tree = ProposalTree.from_branches(torch.tensor([t - 1]), ids[t: t + 2].view(1, -1))
        _, state = target.score(tree, cache, return_state=True)
        cache = target.commit([cache], state, [[0]])[0]
        ptrs.add(cache.layers[0].tensors()[0].data_ptr())
    assert len(cache) == 68 and len(ptrs) <= 6, f"{len(ptrs)} reallocations for 64 one-token commits"
    assert_same_cache(cache, target.prefill(ids[:68], gdn_checkpoint_every=C, keep_checkpoints=False,
                                            keep_logits=False), tol=5e-5)


def test_bad_paths_are_clear_errors(target):
    ids = _ids(20, seed=7)
    caches = [target.prefill(ids[:10], gdn_checkpoint_every=C), target.prefill(ids[:6], gdn_checkpoint_every=C)]
    trees = [ProposalTree.from_branches(torch.tensor([9, 4]), _ids(6, seed=8).view(2, 3)),
             ProposalTree.from_branches(torch.tensor([5]), _ids(3, seed=9).view(1, 3))]
    _, state = target.score(ProposalTree.pack(trees), caches, return_state=True)
    bad = {
        "not a root-first parent chain": [[0, 2], []],
        "not a root anchored at the trunk's last position": [[3, 4], []],  # branch anchored at 4, trunk ends at 9
        "belongs to trunk 1": [[6], []],
        "outside the verified tree": [[0, 1, 99], []],
        "deeper than the verified tree": [[0, 1, 2, 3], []],
        "one path per trunk": [[0]],
    }
    for msg, paths in bad.items():
        with pytest.raises(ValueError, match=msg):
            target.commit(caches, state, paths)
    with pytest.raises(ValueError, match="verified at"):
        target.commit([target.prefill(ids[10:11], cache=caches[0]), caches[1]], state, [[], []])
    if "gdn" in target.layer_kinds:  # a decoding cache keeps no checkpoints: only end anchors can be scored
        dec = target.prefill(ids[:10], keep_checkpoints=False)
        with pytest.raises(ValueError, match="keeps no GDN checkpoints"):
            target.score(ProposalTree.from_branches(torch.tensor([4]), ids[:2].view(1, 2)), dec)
