"""One verify pass ([last, d_1..d_4], 5 tokens) against one autoregressive step (1 token), on the same cache, per
target dtype: wall time and the share spent in ``aten::mm`` (torch.profiler, self CPU). Why our fp32 speculative
decoding is slower than autoregressive on the CPU while bf16 is not (the plateau experiment, item 6, in benchmarks/results/).

    python benchmarks/bench_verify.py [--target DIR] [--context 120] [--repeats 15] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _median_s(f, repeats: int) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _mm_s(f, n: int = 5) -> float:
    from torch.profiler import profile

    with profile() as p:
        for _ in range(n):
            f()
    return sum(e.self_cpu_time_total for e in p.key_averages() if e.key == "aten::mm") / 1e6 / n


def main(argv=None) -> int:
    from specopd.data.smollm2 import cache_root
    from specopd.models import load_target
    from specopd.tree import ProposalTree

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(cache_root(), "models", "smollm2-135m"))
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])))
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in args.dtypes.split(","):
        t = load_target(args.target, dtype=getattr(torch, name))
        prompt = torch.randint(0, t.vocab_size, (args.context,), generator=g)
        chain = torch.randint(0, t.vocab_size, (1, 5), generator=g)
        cache = t.prefill(prompt[:-1], keep_logits=False, feature_layers=(t.num_layers - 1,))

        def ar():
            return t.prefill(prompt[-1:], cache=cache, keep_logits=True)

        def verify():
            tree = ProposalTree.pack([ProposalTree.from_branches(torch.tensor([len(cache) - 1]), chain)])
            return t.score(tree, [cache], return_state=True)

        for label, f in (("autoregressive step (1 token)", ar), ("verify pass (5 tokens)", verify)):
            rows.append((name, label, _median_s(f, args.repeats), _mm_s(f)))
    print(f"\nSmolLM2-135M, cache of {args.context - 1} tokens, {torch.get_num_threads()} threads, median of "
          f"{args.repeats}\n")
    print("| target | pass | ms | aten::mm ms | mm share | vs the autoregressive step |")
    print("|---|---|---|---|---|---|")
    for i, (name, label, s, mm) in enumerate(rows):
        base = rows[i - i % 2][2]
        print(f"| {name} | {label} | {s * 1e3:.1f} | {mm * 1e3:.1f} | {mm / s:.0%} | {s / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
