"""Greedy acceptance at each draft depth, per method, from ``bench_al.py`` outputs: where SpecOPD's on-policy
branches differ from off-policy references (depth >= 2, docs/on_policy.md) and where they cannot (depth 1).

    python benchmarks/depth_acceptance.py --runs runs/bench-al-plateau runs/bench-al-dataset-120 runs/bench-al-t1refs \
        --labels "the target's greedy references" "the dataset's own replies" "the target's T=1 samples" \
        --out benchmarks/figures/depth_acceptance.png

Per run: the warm drafter and each method's last equal-steps checkpoint, T = 0 (exact replay). Acceptance at depth
i = accepted / reached there over all rounds of the held-out prompts; the bars' whiskers are binomial standard
errors sqrt(a (1 - a) / reached), which treat rounds as independent (they are not quite: rounds of one prompt
share it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("specopd", "offpolicy_e2e_tv", "offpolicy_ce", "draft_opd", "regen_ce")
COLORS = {"warm": "0.6", "specopd": "C3", "draft_opd": "C0", "offpolicy_ce": "C2", "offpolicy_e2e_tv": "C1",
          "regen_ce": "C4"}


def depth_rows(run: str) -> dict:
    """bench_al output folder -> {method: (steps, [(accepted, reached)] per depth)} (+ "warm": the start)."""
    data = json.load(open(os.path.join(run, "bench_al.json")))
    ev = data["evaluations"]
    out = {}
    warm = data["prepare"].get("warm")
    if warm and os.path.abspath(warm) in ev:
        r = ev[os.path.abspath(warm)]["replay_t0"]
        out["warm"] = (0, list(zip(r["accepted_at"], r["reached_at"])))
    for m in METHODS:
        pts = data["curves"].get(m)
        if pts:
            r = ev[os.path.abspath(pts[-1]["checkpoint"])]["replay_t0"]
            out[m] = (pts[-1]["step"], list(zip(r["accepted_at"], r["reached_at"])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--labels", nargs="+")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "figures", "depth_acceptance.png"))
    args = ap.parse_args(argv)
    labels = args.labels or args.runs
    if len(labels) != len(args.runs):
        ap.error("--labels: one per --runs")
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.runs), figsize=(6 * len(args.runs), 4.2), squeeze=False, sharey=True)
    for ax, run, label in zip(axes[0], args.runs, labels):
        rows = depth_rows(run)
        print(f"\n{label} ({run}): greedy acceptance at depth 1..W (accepted / reached)")
        print("| method | steps | " + " | ".join(f"depth {i + 1}" for i in range(len(next(iter(rows.values()))[1])))
              + " |")
        names = list(rows)
        width = 0.8 / len(names)
        for j, m in enumerate(names):
            steps, cells = rows[m]
            acc = [a / n if n else float("nan") for a, n in cells]
            se = [math.sqrt(p * (1 - p) / n) if n else 0.0 for p, (_, n) in zip(acc, cells)]
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cells))]
            name = "shipped drafter" if m == "warm" else f"{m} ({steps} steps)"
            ax.bar(xs, acc, width, yerr=se, color=COLORS.get(m), label=name, capsize=2)
            print(f"| {name} | {steps} | " + " | ".join(f"{p:.3f} ({a}/{n})" for p, (a, n) in zip(acc, cells)) + " |")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"depth {i + 1}" for i in range(len(cells))])
        ax.set_title(f"trained on {label}", fontsize=9)
        ax.set_ylabel("greedy acceptance at the depth (accepted / reached)")
        ax.set_ylim(0, 0.7)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle("Held-out greedy acceptance per draft depth, from the shipped drafter (64 prompts x 64 tokens)",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
