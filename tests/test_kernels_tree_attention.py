"""Tree attention: the block plan, the blocked torch path and the Triton kernel against the dense masked
reference (fp32; the kernel on the CPU under TRITON_INTERPRET=1, bf16 on CUDA)."""
import pytest
import torch

import kernel_check
from specopd_kernels.tree_attention import build_tree_plan, tree_attention_blocked, tree_attention_reference
from specopd_kernels.tree_attention.naive import ancestor_or_self

FILE = __file__


def make_tree(lens, branches, widths, general=False, seed=0):
    """Branches per trunk: anchors at 0 and T-1, two branches sharing one anchor, the rest random; widths cycle
    (a width-1 branch included). ``general``: each non-root node hangs off a random earlier node of its branch.
    Nodes are *not* sorted by anchor (the plan sorts them). -> anchor, parent, trunk_index [M]."""
    g = torch.Generator().manual_seed(seed)
    anchor, parent, tix = [], [], []
    for i, t in enumerate(lens):
        a = torch.randint(0, t, (branches,), generator=g)
        a[0], a[1] = t - 1, 0
        if branches > 3:
            a[3] = a[2]  # two branches on one anchor
        for b in range(branches):
            w = widths[(b + i) % len(widths)]
            base = len(anchor)
            for j in range(w):
                anchor.append(int(a[b]))
                tix.append(i)
                if j == 0:
                    parent.append(-1)
                elif general:
                    parent.append(base + int(torch.randint(0, j, (1,), generator=g)))
                else:
                    parent.append(base + j - 1)
    return torch.tensor(anchor), torch.tensor(parent), torch.tensor(tix)


def make_inputs(lens, m, h, hkv, d, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(m, h, d, generator=g)
    k, v = torch.randn(m, hkv, d, generator=g), torch.randn(m, hkv, d, generator=g)
    tk = [torch.randn(t, hkv, d, generator=g) for t in lens]
    tv = [torch.randn(t, hkv, d, generator=g) for t in lens]
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), [cast(x) for x in tk], [cast(x) for x in tv]


def _dense_visibility(anchor, parent, tix, lens):
    """Per trunk i: [M_i, t_cut + M_i] bool, the reference's mask (trunk keys then the trunk's nodes)."""
    anc = ancestor_or_self(parent)
    out = []
    for i in range(len(lens)):
        nodes = torch.nonzero(tix == i).flatten()
        t_cut = int(anchor[nodes].max()) + 1
        out.append((nodes, torch.cat([torch.arange(t_cut)[None, :] <= anchor[nodes, None], anc[nodes][:, nodes]], 1)))
    return out


@pytest.mark.parametrize("general", [False, True])
def test_plan_covers_exactly_the_visible_keys(general):
    """Every visible (query, key) lies in a visited block; within visited blocks the plan's masks reproduce the
    reference visibility exactly; and the plan skips blocks of the dense grid."""
    lens = [150, 77, 40]
    anchor, parent, tix = make_tree(lens, 9, [4, 1, 3], general=general)
    plan = build_tree_plan(anchor, parent, tix, lens, block_m=8, block_n=16)
    assert plan.chain == (not general)
    from specopd_kernels.tree_attention.plan import block_visibility

    for i, (nodes, vis) in enumerate(_dense_visibility(anchor, parent, tix, lens)):
        got = torch.zeros_like(vis)
        t_cut = int(anchor[nodes].max()) + 1
        local = torch.full((anchor.numel(),), -1, dtype=torch.long)  # node id -> column among trunk i's nodes
        local[nodes] = torch.arange(nodes.numel())
        for b in torch.nonzero(plan.q_trunk == i).flatten().tolist():
            s = torch.arange(int(plan.q_start[b]), int(plan.q_end[b]))
            rows = local[plan.order[s]]
            assert bool((rows >= 0).all())  # query blocks never straddle trunks
            assert bool((plan.anchor[s] + 1 >= plan.t_full[b]).all())  # [0, t_full) needs no mask
            t_len = int(plan.t_len[b])
            got[rows, :t_len] = torch.arange(t_len)[None, :] <= plan.anchor[s, None]
            for e in range(int(plan.nb_ptr[b]), int(plan.nb_ptr[b + 1])):
                kp = int(plan.nb_idx[e]) * plan.block_n + torch.arange(plan.block_n)
                ok = kp < anchor.numel()
                m = block_visibility(plan, b, e)[:, ok]
                cols = local[plan.order[kp[ok]]]
                assert bool((cols[m.any(0)] >= 0).all())  # a visible key is a node of the same trunk
                m, cols = m[:, cols >= 0], cols[cols >= 0]
                got[rows[:, None], t_cut + cols[None, :]] |= m
        assert torch.equal(got, vis)
    st = plan.stats()
    assert st["visited_blocks"] < st["dense_blocks"] and 0 < st["density"] <= 1


def test_plan_fraction_at_recipe_like_shapes():
    """At T = 2048, 256 anchors x 15 tokens, 4 trunks (the 8B recipe) the kernel's plan visits < 25% of the
    dense grid's blocks, and most entries of the visited blocks are visible."""
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks

    g = torch.Generator().manual_seed(0)
    t, n, w = 2048, 256, 15
    anchor = torch.cat([torch.sort(torch.randperm(t, generator=g)[:n]).values.repeat_interleave(w) for _ in range(4)])
    idx = torch.arange(4 * n * w).view(4 * n, w)
    parent = torch.where(torch.arange(w) == 0, -1, idx - 1).flatten()
    tix = torch.arange(4).repeat_interleave(n * w)
    st = build_tree_plan(anchor, parent, tix, [t] * 4, **plan_blocks(128, 32, 8)).stats()
    assert st["fraction"] < 0.25 and st["density"] > 0.8, st


def test_blocked_torch_path_matches_reference():
    """The plan-driven torch path equals dense masked attention (chains and general trees, GQA 6/2)."""
    lens = [150, 77]
    for general in (False, True):
        anchor, parent, tix = make_tree(lens, 7, [5, 1, 3], general=general)
        q, k, v, tk, tv = make_inputs(lens, anchor.numel(), 6, 2, 16)
        ref = tree_attention_reference(q, k, v, tk, tv, anchor, parent, tix, 0.3)
        plan = build_tree_plan(anchor, parent, tix, lens, block_m=8, block_n=32)
        got = tree_attention_blocked(q, k, v, torch.cat(tk), torch.cat(tv), plan, 0.3)
        assert kernel_check.rel(got, ref) <= 1e-5


@pytest.mark.parametrize("general", [False, True])
@pytest.mark.parametrize("max_keys", [0, 600, 1 << 16])
def test_bf16_block_groups_within_noise_of_the_reference(general, max_keys):
    """bf16 on the CPU: query blocks batched into groups (one fused-attention call each, padded keys and rows
    masked) stay within the bf16 noise of one call per block, against the fp32 reference of the same rounded
    inputs; every node is written once; the groups respect their key budget (a lone block may exceed it)."""
    from specopd_kernels.tree_attention import block_groups

    lens = [150, 77, 40]
    anchor, parent, tix = make_tree(lens, 9, [5, 1, 3], general=general)
    q, k, v, tk, tv = make_inputs(lens, anchor.numel(), 6, 2, 16, dtype=torch.bfloat16)
    f = lambda x: x.float()  # noqa: E731
    ref = tree_attention_reference(f(q), f(k), f(v), [f(x) for x in tk], [f(x) for x in tv], anchor, parent, tix, 0.3)
    plan = build_tree_plan(anchor, parent, tix, lens, block_m=8, block_n=16)
    groups = block_groups(plan, max_keys)
    assert sum(int(g.real.sum()) for g in groups) == anchor.numel()
    assert torch.equal(torch.sort(torch.cat([g.rows[g.real] for g in groups])).values, torch.arange(anchor.numel()))
    assert all(g.keys.numel() <= max(max_keys, g.keys.shape[1]) for g in groups)
    if max_keys == 1 << 16:
        assert len(groups) == 1 and bool((~groups[0].real).any())  # padding rows exist and are dropped
    got = tree_attention_blocked(q, k, v, torch.cat(tk), torch.cat(tv), plan, 0.3, groups)
    one = tree_attention_blocked(q, k, v, torch.cat(tk), torch.cat(tv), plan, 0.3, block_groups(plan, 0))
    unit = float((one - ref).abs().max())
    assert unit > 0 and float((got - ref).abs().max()) <= 2 * unit
    assert kernel_check.rel(got, ref) <= 1e-2


def test_plan_errors_name_the_fix():
    anchor, parent, tix = make_tree([20], 3, [2])
    with pytest.raises(ValueError, match="outside its trunk"):
        build_tree_plan(anchor, parent, tix, [10], block_m=8, block_n=16)
    with pytest.raises(ValueError, match="trunk length"):
        build_tree_plan(anchor, parent, tix + 1, [20], block_m=8, block_n=16)
    bad = parent.clone()
    bad[1] = 5
    with pytest.raises(ValueError, match="earlier node"):
        build_tree_plan(anchor, bad, tix, [20], block_m=8, block_n=16)


# ------------------------------------------------------------------ Triton kernel (interpreted on the CPU)
CASES = {
    # name: (trunk lens, branches per trunk, widths, H, Hkv, head_dim, general)
    "chain_d64_g4": ([150, 77, 40], 6, [4, 1, 3], 8, 2, 64, False),
    "chain_d128_g4": ([70, 33], 5, [15, 2], 4, 1, 128, False),
    "chain_d256_g6": ([100], 6, [3, 1], 6, 1, 256, False),
    "general_d64_g1": ([90, 20], 5, [6, 1], 2, 2, 64, True),
    "general_d128_g6": ([130], 7, [5, 2], 12, 2, 128, True),
    "chain_d8_g2": ([40, 21], 4, [3, 1], 4, 2, 8, False),  # head dim 8: padded to tl.dot's 16 columns
}


def check_triton(name: str) -> None:
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks, tree_attention

    lens, branches, widths, h, hkv, d, general = CASES[name]
    dev = kernel_check.device()
    anchor, parent, tix = make_tree(lens, branches, widths, general=general)
    plan = build_tree_plan(anchor, parent, tix, lens, **plan_blocks(d, h, hkv))
    assert plan.chain == (not general)
    q, k, v, tk, tv = make_inputs(lens, anchor.numel(), h, hkv, d)
    ref = tree_attention_reference(q, k, v, tk, tv, anchor, parent, tix, d ** -0.5)
    cast = lambda x: x.to(dev)  # noqa: E731
    got = tree_attention(cast(q), cast(k), cast(v), cast(torch.cat(tk)), cast(torch.cat(tv)),
                         plan.to(dev) if general else plan, d ** -0.5)  # a plan kept on the device, or not
    assert kernel_check.rel(got, ref) <= 1e-5, (name, kernel_check.rel(got, ref))
    with pytest.raises(ValueError, match="plan_blocks"):
        tree_attention(cast(q), cast(k), cast(v), cast(torch.cat(tk)), cast(torch.cat(tv)),
                       build_tree_plan(anchor, parent, tix, lens, block_m=3, block_n=16), d ** -0.5)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    pytest.importorskip("triton")
    kernel_check.run(FILE, "triton", name)


def check_triton_bf16() -> None:
    """bf16 inputs on CUDA at a recipe-like size: within bf16 noise of the fp32 reference."""
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks, tree_attention

    for (h, hkv, d) in ((32, 8, 128), (24, 4, 256)):
        lens = [1000, 700]
        anchor, parent, tix = make_tree(lens, 40, [15])
        q, k, v, tk, tv = make_inputs(lens, anchor.numel(), h, hkv, d)
        ref = tree_attention_reference(q, k, v, tk, tv, anchor, parent, tix, d ** -0.5)
        plan = build_tree_plan(anchor, parent, tix, lens, **plan_blocks(d, h, hkv))
        b = lambda x: x.to("cuda", torch.bfloat16)  # noqa: E731
        got = tree_attention(b(q), b(k), b(v), b(torch.cat(tk)), b(torch.cat(tv)), plan, d ** -0.5)
        assert kernel_check.rel(got, ref) <= 2e-2, kernel_check.rel(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_bf16_on_cuda():
    check_triton_bf16()


def check_triton_fp16() -> None:
    """fp16 (the interpreter's stand-in for bf16, whose tl.dot it gets wrong) at small sizes, chain and general
    trees, head dims 32 and 256: within 2.5x the fp32 reference's own input rounding noise."""
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks, tree_attention

    dev = kernel_check.device()
    for (h, hkv, d, general) in ((4, 2, 32, False), (4, 2, 32, True), (6, 1, 256, False)):
        lens = [90, 40]
        anchor, parent, tix = make_tree(lens, 5, [3], general=general)
        q, k, v, tk, tv = make_inputs(lens, anchor.numel(), h, hkv, d)
        ref = tree_attention_reference(q, k, v, tk, tv, anchor, parent, tix, d ** -0.5)
        r16 = lambda x: x.half().float()  # noqa: E731
        rounded = tree_attention_reference(r16(q), r16(k), r16(v), [r16(x) for x in tk], [r16(x) for x in tv],
                                           anchor, parent, tix, d ** -0.5)
        plan = build_tree_plan(anchor, parent, tix, lens, **plan_blocks(d, h, hkv))
        b = lambda x: x.to(dev, torch.float16)  # noqa: E731
        got = tree_attention(b(q), b(k), b(v), b(torch.cat(tk)), b(torch.cat(tv)), plan, d ** -0.5)
        assert got.dtype == torch.float16
        kernel_check.lowp_check(got, ref, rounded, what=f"tree attention fp16 h{h}/{hkv} d{d} general={general}")


def test_triton_fp16_within_noise():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "fp16")


CHECKS = {"triton": check_triton, "bf16": check_triton_bf16, "fp16": check_triton_fp16}

if __name__ == "__main__":
    kernel_check.main(CHECKS)
