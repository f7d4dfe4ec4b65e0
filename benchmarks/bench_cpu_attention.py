"""The bf16 attention kernels in C against the torch paths they replace, one layer's call at SmolLM2-135M's heads
(9 query / 3 kv heads, head dim 64) and the shapes of ``bench_cpu.py``'s settings, interleaved in one run.

- prefill: ``specopd_kernels.causal_attention.cpu.causal_attention`` (every trunk in one call) against torch's flash kernel
  (``F.scaled_dot_product_attention(is_causal=True)``, one call per trunk: the executor's "loop" path);
- score: ``specopd_kernels.tree_attention.cpu.tree_attention`` against the blocked plan with grouped fused calls
  (``tree_attention_blocked`` with ``block_groups``, the executor's bf16 CPU path before it), W - 1 = 3 nodes per
  branch, anchors drawn uniformly and sorted as the worker does.

Needs AVX512-BF16 (the kernels); the CPU is shared: only the ratios of one run mean anything.

    python benchmarks/bench_cpu_attention.py [--reps 20] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specopd_kernels.causal_attention import cpu as causal_cpu  # noqa: E402
from specopd_kernels.tree_attention import block_groups, build_tree_plan, tree_attention_blocked  # noqa: E402
from specopd_kernels.tree_attention import cpu as tree_cpu  # noqa: E402
from specopd.tree import ProposalTree  # noqa: E402

H, HKV, D = 9, 3, 64
SETTINGS = {"main": (8, 192, 16), "long": (4, 512, 64)}  # trunks, tokens per trunk, anchors per trunk
NODES = 3  # W - 1 drafted tokens scored per branch


def _best(fn, reps: int) -> float:
    """Best of 3 means over ``reps`` calls, seconds."""
    fn()
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps)
    return min(out)


def bench(setting: str, reps: int) -> list:
    n, t, b = SETTINGS[setting]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n * t, H, D, generator=g).bfloat16()
    k = torch.randn(n * t, HKV, D, generator=g).bfloat16()
    v = torch.randn(n * t, HKV, D, generator=g).bfloat16()
    cu = [i * t for i in range(n + 1)]
    scale = D ** -0.5

    def flash():
        for i in range(n):
            s = slice(cu[i], cu[i + 1])
            F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                           v[s].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)

    rows = []
    causal_flops = n * H * t * (t + 1) / 2 * D * 4
    ours, theirs = _best(lambda: causal_cpu.causal_attention(q, k, v, cu, cu, scale), reps), _best(flash, reps)
    rows.append((setting, "prefill (causal)", f"{n} x {t}", theirs, ours, causal_flops))

    trees = [ProposalTree.from_branches(torch.randint(0, t - NODES - 1, (b,), generator=g).sort().values,
                                        torch.zeros(b, NODES, dtype=torch.long)) for _ in range(n)]
    tree = ProposalTree.pack(trees)
    m = tree.anchor.numel()
    qn = torch.randn(m, H, D, generator=g).bfloat16()
    kn = torch.randn(m, HKV, D, generator=g).bfloat16()
    vn = torch.randn(m, HKV, D, generator=g).bfloat16()
    lens = [t] * n
    plan = build_tree_plan(tree.anchor, tree.parent, tree.trunk_index, lens, block_m=64, block_n=64)
    groups = block_groups(plan, 1 << 16)
    layout = tree_cpu.tree_layout(tree.anchor, tree.parent, tree.trunk_index, lens)
    tree_flops = float(((tree.anchor + 1).sum() + m * (NODES + 1) / 2) * H * D * 4)
    ours = _best(lambda: tree_cpu.tree_attention(qn, kn, vn, k, v, layout, scale), reps)
    theirs = _best(lambda: tree_attention_blocked(qn, kn, vn, k, v, plan, scale, groups), reps)
    rows.append((setting, "score (tree)", f"{n} x {b} x {NODES} nodes", theirs, ours, tree_flops))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not causal_cpu.LIB.available():
        print(f"the attention kernels do not build here: {causal_cpu.LIB.reason()}")
        return 1
    torch.set_num_threads(args.threads)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {args.threads} threads, bf16, H {H} / Hkv {HKV} / D {D}, one layer's call\n")
    print("| setting | call | shape | torch ms | C kernel ms | speed-up | torch GFLOP/s | C kernel GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in SETTINGS:
        for s, call, shape, theirs, ours, flops in bench(setting, args.reps):
            print(f"| {s} | {call} | {shape} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.2f}x | "
                  f"{flops / theirs / 1e9:.0f} | {flops / ours / 1e9:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
