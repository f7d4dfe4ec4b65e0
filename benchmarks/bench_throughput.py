"""SpecOPD vs Draft-OPD supervised-token throughput, side by side in one run.

Same target (one shared frozen instance), same initial drafter (same seed), same batches (same sample ids
per step), same anchors_per_seq B and block size W: SpecOPD samples B branches per sequence in parallel;
Draft-OPD runs up to B sequential draft-and-verify rounds per sequence from the prompt, the way a serving
engine rolls out (``specopd.speculative``: prompts prefilled once, one batched target pass per round for all
active sequences, commits from the verify pass). Steps of the two methods alternate (A, B, A, B, ...) so that
load changes on a shared machine hit both alike; the first ``--warmup`` steps of each are not timed.

    python benchmarks/bench_throughput.py [--recipe recipes/tiny.yaml] [--steps 6] [--warmup 1]
                                          [--preset long] [--json out.json] [key=value ...]

``--preset long``: 512-token sequences (32 prompt tokens), B = 64 anchors / rounds per sequence, batch 4,
where Draft-OPD's rounds are many (overrides given after it win).

Before / after a change, side by side: ``--against DIR`` (another source tree of the repository, e.g.
``git archive <commit> | tar -x -C DIR``) runs this script from both trees in fresh processes, alternating
(this tree, DIR, this tree, DIR, ...) for ``--rounds`` rounds with the same arguments, and prints each tree's
supervised tokens/s per method (median over rounds, and every round).

ratio = SpecOPD supervised tokens/s / Draft-OPD supervised tokens/s (supervised tokens: draft positions
that enter the loss, W per branch / block).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {"long": ["data.seq_len=512", "data.prompt_len=32", "data.num_samples=24", "data.batch_size=4",
                    "trainer.anchors_per_seq=64"]}


def run(recipe: str, overrides: list, steps: int, warmup: int, progress: bool = True) -> dict:
    import torch
    from tqdm import tqdm

    from specopd.config import load_recipe
    from specopd.train import phases
    from specopd.train.data import BatchOrder
    from specopd.train.worker import Worker

    base = load_recipe(recipe, ["profile.enabled=false", *overrides])
    torch.manual_seed(base.seed)
    workers = {}
    for method in ("specopd", "draft_opd"):
        cfg = load_recipe(recipe, ["profile.enabled=false", *overrides, f"trainer.method={method}"])
        shared = next(iter(workers.values())).target if workers else None
        workers[method] = Worker(cfg, target=shared)
    w0 = workers["specopd"]
    order = BatchOrder(w0.train_ids, base.data.batch_size, base.data.seed)
    stats = {m: {"steps": 0, "supervised_tokens": 0, "seconds": 0.0, "branches": 0, "phase_s": {}} for m in workers}
    bar = tqdm(total=2 * (steps + warmup), desc="bench (specopd | draft_opd alternating)", disable=not progress)
    for step in range(steps + warmup):
        ids = order.next()
        for method, w in workers.items():
            t0 = time.perf_counter()
            n = phases.stage(w, ids, step)["branches"]
            m = phases.finish(w, n)
            dt = time.perf_counter() - t0
            bar.update(1)
            if step < warmup:
                continue
            s = stats[method]
            s["steps"] += 1
            s["supervised_tokens"] += m["supervised_tokens"]
            s["branches"] += m["branches"]
            s["seconds"] += dt
            for k, v in m["phase_s"].items():
                s["phase_s"][k] = s["phase_s"].get(k, 0.0) + v
    bar.close()
    for s in stats.values():
        s["supervised_tokens_per_s"] = s["supervised_tokens"] / s["seconds"] if s["seconds"] > 0 else float("nan")
    sp, do = stats["specopd"], stats["draft_opd"]
    return {
        "specopd_supervised_tokens_per_s": sp["supervised_tokens_per_s"],
        "draft_opd_supervised_tokens_per_s": do["supervised_tokens_per_s"],
        "ratio": sp["supervised_tokens_per_s"] / do["supervised_tokens_per_s"],
        "methods": stats, "timed_steps": steps, "warmup_steps": warmup,
        "setup": {"recipe": recipe, "overrides": overrides, "target": base.model.target,
                  "vocab_size": w0.target.vocab_size, "drafter": base.drafter.kind, "draft_len": w0.W,
                  "anchors_per_seq": base.trainer.anchors_per_seq, "batch_size": base.data.batch_size,
                  "seq_len": base.data.seq_len, "device": str(w0.device), "dtype": base.model.dtype,
                  "torch_threads": torch.get_num_threads()},
    }


def table(r: dict) -> str:
    rows = [("method", "steps", "branches", "sup. tokens", "seconds", "sup. tokens/s", "prefill s", "propose s",
             "score s", "commit s", "loss+bwd s")]
    for name, s in r["methods"].items():
        ph = s["phase_s"]
        rows.append((name, str(s["steps"]), str(s["branches"]), str(s["supervised_tokens"]), f"{s['seconds']:.2f}",
                     f"{s['supervised_tokens_per_s']:.1f}", f"{ph.get('prefill', 0):.2f}",
                     f"{ph.get('propose', 0):.2f}", f"{ph.get('score', 0):.2f}", f"{ph.get('commit', 0):.2f}",
                     f"{ph.get('loss_backward', 0):.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"ratio (SpecOPD / Draft-OPD supervised tokens/s) = {r['ratio']:.2f}x")
    return "\n".join(lines)


def compare(args) -> int:
    """This tree against ``args.against``: fresh processes, alternating, the same arguments; medians."""
    import statistics
    import subprocess
    import tempfile

    trees = {"this tree": ROOT, "against": os.path.abspath(args.against)}
    rel = os.path.relpath(os.path.abspath(__file__), ROOT)
    res = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name, root in trees.items():
                out = os.path.join(tmp, f"{name.replace(' ', '_')}-{rnd}.json")
                cmd = [sys.executable, os.path.join(root, rel), "--recipe", args.recipe, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--json", out,
                       "--output-dir", args.output_dir or os.path.join(tmp, f"run-{name.replace(' ', '_')}")]
                cmd += (["--preset", args.preset] if args.preset else []) + list(args.overrides)
                env = dict(os.environ, PYTHONPATH=root)
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
                if p.returncode != 0:
                    print(f"{name} ({root}) failed:\n{p.stderr[-3000:]}")
                    return 1
                with open(out) as f:
                    res[name].append(json.load(f))
                r = res[name][-1]
                print(f"round {rnd + 1} {name}: SpecOPD {r['specopd_supervised_tokens_per_s']:.1f} | Draft-OPD "
                      f"{r['draft_opd_supervised_tokens_per_s']:.1f} supervised tokens/s", flush=True)
    st = res["this tree"][0]["setup"]
    print(f"\ntarget {st['target']} (vocab {st['vocab_size']}), drafter {st['drafter']} W={st['draft_len']}, "
          f"B={st['anchors_per_seq']}, batch {st['batch_size']} x {st['seq_len']} tokens, {st['device']} "
          f"{st['dtype']}, {st['torch_threads']} torch threads; {args.rounds} rounds x {args.steps} timed steps "
          f"per tree (against = {trees['against']})")
    print("| tree | method | supervised tokens/s (median) | every round | loss+bwd s / step | propose s / step |")
    print("|---|---|---|---|---|---|")
    for name, rs in res.items():
        for m, key in (("specopd", "specopd_supervised_tokens_per_s"), ("draft_opd", "draft_opd_supervised_tokens_per_s")):
            vals = [r[key] for r in rs]
            ph = [r["methods"][m]["phase_s"] for r in rs]
            steps = sum(r["methods"][m]["steps"] for r in rs)
            lb = sum(p.get("loss_backward", 0.0) for p in ph) / steps
            pr = sum(p.get("propose", 0.0) for p in ph) / steps
            print(f"| {name} | {m} | {statistics.median(vals):.1f} | {', '.join(f'{v:.1f}' for v in vals)} | "
                  f"{lb:.3f} | {pr:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=6, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per method first")
    ap.add_argument("--output-dir", default=None, help="trainer.output_dir (tiny target + data cache)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="recipe overrides for a named setting (see above)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--against", help="another source tree: run both, alternating (see above)")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: processes per tree")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. trainer.anchors_per_seq=16")
    args = ap.parse_args(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv))
    if args.against:
        return compare(args)

    ov = (PRESETS[args.preset] if args.preset else []) + list(args.overrides)
    if args.output_dir:
        ov.append(f"trainer.output_dir={args.output_dir}")
    r = run(args.recipe, ov, args.steps, args.warmup)
    st = r["setup"]
    print(f"target {st['target']} (vocab {st['vocab_size']}), drafter {st['drafter']} W={st['draft_len']}, "
          f"B={st['anchors_per_seq']} anchors/rounds per sequence, batch {st['batch_size']} x {st['seq_len']} tokens, "
          f"{st['device']} {st['dtype']}, {st['torch_threads']} torch threads")
    print(table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
