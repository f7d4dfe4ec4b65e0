"""The target's own MTP head on a tiny hybrid target: trained off-policy (chained CE, as MTP heads are trained) to its
plateau, then continued from that checkpoint with SpecOPD, continued CE and off-policy E2E-TV, at equal steps and at
equal time. Measured by expected AL (the trainer's held-out evaluation, T = 1) and decoded AL (our
``SpeculativeDecoder`` on the same prompts, greedy and T = 1), with standard errors over prompts and paired ones for
the differences to continued CE (``al_diff_stderr``). AL counts the bonus token.

    python benchmarks/bench_mtp.py [--out runs/bench-mtp] [--plateau-steps 240] [--steps 60] [--prompts 32]
        [--max-new-tokens 32] [key=value ...]

Recipe: recipes/tiny-gdn-mtp.yaml (+ the key=value overrides). Prompts: random token ids (seeded apart from the
training data's), as the synthetic references' prompts are. Equal time: each continuation's checkpoint at the largest
step whose summed step time fits the fastest continuation's total (checkpoints every --steps / 6 steps).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = ["specopd", "offpolicy_ce", "offpolicy_e2e_tv"]


def _run(recipe, out, overrides):
    from specopd.config import load_recipe
    from specopd.train.loop import train

    cfg = load_recipe(recipe, [f"trainer.output_dir={out}", "profile.enabled=false", *overrides])
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    return summary, time.perf_counter() - t0


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def _step_times(out) -> dict:
    """step -> summed step time up to it (the trainer's own step_s: training only, no evaluation)."""
    total, at = 0.0, {}
    for m in _metrics(out):
        total += float(m.get("step_s", 0.0))
        at[int(m["step"])] = total
    return at


def _decode(target, folder, prompts, args, temperature):
    from specopd.drafters import load_drafter
    from specopd.eval.cli import al_stderr, evaluate_al

    r = evaluate_al(target, load_drafter(folder, target), prompts, args.max_new_tokens, temperature, seed=0)
    return {"al": r["mean_al"], "se": al_stderr(r["accept_lengths"]), "lengths": r["accept_lengths"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-mtp"))
    ap.add_argument("--plateau-steps", type=int, default=240)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args, extra = ap.parse_known_args(argv)
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])),
          flush=True)
    import torch

    from specopd.eval.cli import al_diff_stderr
    from specopd.models import load_target
    from specopd.runs.checkpoint import complete_checkpoints, find_latest

    recipe = os.path.join(ROOT, "recipes", "tiny-gdn-mtp.yaml")
    every = max(1, args.plateau_steps // 8)
    plateau_dir = os.path.join(args.out, "plateau")
    if find_latest(plateau_dir) is None or not os.path.isfile(os.path.join(plateau_dir, "train_summary.json")):
        _run(recipe, plateau_dir, ["trainer.method=offpolicy_ce", f"trainer.max_steps={args.plateau_steps}",
                                   f"trainer.save_every={every}", f"trainer.eval_every={every}", *extra])
    curve = [(int(m["step"]), m["heldout_expected_al"]) for m in _metrics(plateau_dir) if m.get("heldout_expected_al")]
    print("plateau (off-policy CE): held-out expected AL by step: " + ", ".join(f"{s}: {a:.4f}" for s, a in curve))
    start = find_latest(plateau_dir)
    target = load_target(os.path.join(plateau_dir, "tiny-target-qwen3_next"))
    g = torch.Generator().manual_seed(12345)
    prompts = [torch.randint(0, target.vocab_size, (8,), generator=g) for _ in range(args.prompts)]
    runs, save = {}, max(1, args.steps // 6)
    for m in METHODS:
        out = os.path.join(args.out, m)
        if not os.path.isfile(os.path.join(out, "train_summary.json")):
            _run(recipe, out, [f"trainer.method={m}", f"drafter.init_from={start}", f"trainer.max_steps={args.steps}",
                               f"trainer.save_every={save}", "trainer.keep_last=100", *extra])
        runs[m] = out
    budget = min(_step_times(o)[max(_step_times(o))] for o in runs.values())
    rows = {"start": {"folder": start, "expected": curve[-1][1] if curve else None}}
    for m, out in runs.items():
        times = _step_times(out)
        cks = complete_checkpoints(out)
        fit = max((s for s, _ in cks if times.get(s, 0.0) <= budget + 1e-9), default=cks[0][0])
        summ = json.load(open(os.path.join(out, "train_summary.json")))
        rows[m] = {"folder": dict(cks)[args.steps], "steps_equal_time": fit, "folder_equal_time": dict(cks)[fit],
                   "expected": (summ.get("eval_after") or {}).get("expected_al"), "train_s": times[max(times)],
                   "train_s_equal_time": times[fit]}
    results = {}
    for name, r in rows.items():
        for key in ("folder", "folder_equal_time"):
            if key in r:
                for t in (0.0, 1.0):
                    results[(name, key, t)] = _decode(target, r[key], prompts, args, t)
    print(f"\n{args.prompts} prompts x {args.max_new_tokens} new tokens; AL incl. bonus; +- one standard error over "
          f"prompts; diff = paired difference to continued CE (same prompts)")
    print("| run | steps | step time s | expected AL (held-out, T=1) | greedy AL | diff vs CE | T=1 AL | diff vs CE |")
    print("|---|---|---|---|---|---|---|---|")
    for key, label in (("folder", "equal steps"), ("folder_equal_time", "equal time")):
        for name, r in rows.items():
            if key not in r and name != "start":
                continue
            k = key if key in r else "folder"
            if name == "start" and key != "folder":
                continue
            cells = []
            for t in (0.0, 1.0):
                a = results[(name, k, t)]
                cells.append(f"{a['al']:.3f} +- {a['se']:.3f}")
                if name in METHODS and name != "offpolicy_ce":
                    b = results[("offpolicy_ce", k, t)]
                    d = al_diff_stderr(a["lengths"], b["lengths"])
                    cells.append(f"{a['al'] - b['al']:+.3f} +- {d:.3f}")
                else:
                    cells.append("-")
            steps = {"folder": args.steps, "folder_equal_time": r.get("steps_equal_time")}[k] if name != "start" else 0
            st = f"{r['train_s' if k == 'folder' else 'train_s_equal_time']:.1f}" if name != "start" else "-"
            exp = f"{r['expected']:.4f}" if r.get("expected") is not None and k == "folder" else "-"
            print(f"| {name} ({label}) | {steps} | {st} | {exp} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
