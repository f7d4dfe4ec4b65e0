"""Fused GDN tree replay (Triton) against the node-by-node reference: checkpoint -> < C replayed trunk tokens ->
branch nodes, chains and general trees (fp32; on the CPU under TRITON_INTERPRET=1)."""
import pytest
import torch

import kernel_check
from specopd_kernels.gated_delta.naive import prepare_qk, recurrent_gated_delta_rule, tree_replay_reference
from specopd_kernels.gated_delta.replay import build_replay_plan, stack_states

FILE = __file__


def make_case(lens, every, anchors, width, h, hq, kd, vd, general=False, seed=0, device="cpu"):
    """Trunks (prepared inputs + checkpoints from the recurrence) and a tree with branches at ``anchors`` (per
    trunk, clipped to the trunk) of ``width`` nodes; general: each non-root node hangs off a random earlier node
    of its branch. Node inputs use q/k with hq heads (shared by h // hq value heads)."""
    g_ = torch.Generator().manual_seed(seed)
    r = h // hq
    trunks, cks, fins = [], [], []
    for t in lens:
        _, k = prepare_qk(torch.randn(t, hq, kd, generator=g_), torch.randn(t, hq, kd, generator=g_))
        tr = dict(k=k, v=torch.randn(t, h, vd, generator=g_), g=-torch.rand(t, h, generator=g_),
                  beta=torch.rand(t, h, generator=g_))
        ke = k.repeat_interleave(r, 1)[None]
        _, fin, ck = recurrent_gated_delta_rule(ke, ke, tr["v"][None], g=tr["g"][None], beta=tr["beta"][None],
                                                checkpoint_every=every)
        trunks.append(tr)
        cks.append(ck[0])
        fins.append(fin[0])
    anchor, parent, tix = [], [], []
    for i, t in enumerate(lens):
        for b, a in enumerate(x for x in anchors if x < t):
            base = len(anchor)
            w = width if b % 3 else 1  # some one-token branches
            for j in range(w):
                anchor.append(a)
                tix.append(i)
                if j == 0:
                    parent.append(-1)
                else:
                    parent.append(base + int(torch.randint(0, j, (1,), generator=g_)) if general else base + j - 1)
    anchor, parent, tix = torch.tensor(anchor), torch.tensor(parent), torch.tensor(tix)
    m = anchor.numel()
    nq, nk = prepare_qk(torch.randn(m, hq, kd, generator=g_), torch.randn(m, hq, kd, generator=g_))
    nodes = dict(q=nq, k=nk, v=torch.randn(m, h, vd, generator=g_), g=-torch.rand(m, h, generator=g_),
                 beta=torch.rand(m, h, generator=g_))
    return trunks, cks, fins, anchor, parent, tix, nodes


def reference(trunks, cks, fins, every, anchor, parent, tix, nodes):
    r = nodes["v"].shape[1] // nodes["k"].shape[1]
    e = lambda x: x.repeat_interleave(r, 1)  # noqa: E731
    return tree_replay_reference(cks, fins, every, [e(t["k"]) for t in trunks], [t["v"] for t in trunks],
                                 [t["g"] for t in trunks], [t["beta"] for t in trunks], e(nodes["q"]), e(nodes["k"]),
                                 nodes["v"], nodes["g"], nodes["beta"], anchor, parent, tix)


# anchors with C = 8: 0, 7 (n = 8: exactly a checkpoint, no replay), 8, 9, 15, 3 twice (two branches on one
# anchor), 36 (last token of the 37-token trunk: final state), 15 (last token of the 16-token trunk, T % C == 0)
ANCHORS = [0, 7, 8, 9, 3, 15, 3, 36, 20]
CASES = {
    # name: (lens, every, width, H, HQ, K, V, general, share_replay, store_states)
    "chain_shared": ([37, 16], 8, 3, 2, 1, 16, 16, False, True, True),
    "chain_per_anchor": ([37, 16], 8, 3, 2, 2, 16, 24, False, False, False),
    "general_shared": ([37, 16], 8, 4, 2, 1, 16, 16, True, True, True),
    "general_per_anchor_nostates": ([37], 8, 5, 1, 1, 16, 16, True, False, False),
    "c64_k128": ([150], 64, 4, 2, 1, 128, 128, False, True, True),
}


def _plan_consistent(plan, anchor, parent, lens, every):
    m = anchor.numel()
    assert sorted(plan.node_id.tolist()) == list(range(m))  # every node once
    assert bool((plan.stop_len < every).all()) and bool((plan.stop_len >= 0).all())
    pos = {int(u): s for s, u in enumerate(plan.node_id.tolist())}
    for s, u in enumerate(plan.node_id.tolist()):
        p, src = int(parent[u]), int(plan.node_src[s])
        if p < 0:
            assert src == -2
        elif src == -1:
            assert int(plan.node_id[s - 1]) == p
        else:
            assert src >= 0 and int(plan.node_save[pos[p]]) == src and pos[p] < s
    assert bool((plan.replay_pos < torch.tensor(lens)[plan.replay_trunk]).all())


def test_plan_structure():
    """Chains need no scratch and share one replay per checkpoint interval; general trees reload parents only
    from scratch rows their parents wrote; every replay covers < C tokens."""
    for general in (False, True):
        trunks, cks, fins, anchor, parent, tix, nodes = make_case([37, 16], 8, ANCHORS, 4, 1, 1, 4, 4, general)
        plan = build_replay_plan(anchor, parent, tix, [37, 16], 8)
        _plan_consistent(plan, anchor, parent, [37, 16], 8)
        assert (plan.num_scratch == 0) == (not general)
        per_anchor = build_replay_plan(anchor, parent, tix, [37, 16], 8, share_replay=False)
        _plan_consistent(per_anchor, anchor, parent, [37, 16], 8)
        assert plan.num_segments < per_anchor.num_segments
        assert torch.equal(plan.replay_rows, per_anchor.replay_rows)  # replay rows are stored once either way
    with pytest.raises(ValueError, match="outside its trunk"):
        build_replay_plan(anchor, parent, tix, [37, 10], 8)


def check_replay(name: str) -> None:
    from specopd_kernels.gated_delta.replay import gdn_tree_replay

    lens, every, width, h, hq, kd, vd, general, share, store = CASES[name]
    trunks, cks, fins, anchor, parent, tix, nodes = make_case(lens, every, ANCHORS + [63, 64, 100, 149], width, h,
                                                              hq, kd, vd, general)
    ref_o, ref_s = reference(trunks, cks, fins, every, anchor, parent, tix, nodes)
    plan = build_replay_plan(anchor, parent, tix, lens, every, share_replay=share)
    dev = kernel_check.device()
    rr = plan.replay_rows
    trunk = {f: torch.cat([t[f] for t in trunks])[rr].to(dev) for f in ("k", "v", "g", "beta")}
    nd = {f: x.to(dev) for f, x in nodes.items()}
    o, s = gdn_tree_replay(stack_states(cks, fins).to(dev), trunk["k"], trunk["v"], trunk["g"], trunk["beta"],
                           nd["q"], nd["k"], nd["v"], nd["g"], nd["beta"], plan, store_states=store)
    assert kernel_check.rel(o, ref_o) <= 1e-5, (name, kernel_check.rel(o, ref_o))
    if store:
        assert kernel_check.rel(s, ref_s) <= 1e-5, (name, kernel_check.rel(s, ref_s))
    else:
        assert s is None


@pytest.mark.parametrize("name", list(CASES))
def test_replay_matches_reference(name):
    pytest.importorskip("triton")
    kernel_check.run(FILE, "replay", name)


CHECKS = {"replay": check_replay}

if __name__ == "__main__":
    kernel_check.main(CHECKS)
