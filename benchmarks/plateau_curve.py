"""Held-out greedy AL over a run's checkpoints: where off-policy pretraining flattens.

    python benchmarks/plateau_curve.py [--run runs/smollm2-135m-dflash-pretrain] [--prompts 64]
        [--max-new-tokens 64] [--out benchmarks/figures/pretrain_curve.png] [--continues EARLIER_RUN]
        [--bench chat | mt-bench]

Every complete checkpoint of ``--run`` is replayed exactly at
T = 0 on ``--prompts`` held-out chat prompts (``--bench mt-bench``: MT-Bench first turns) (``specopd.eval.replay``, equal to real greedy speculative decoding),
with the standard error over prompts; the run's own periodic held-out expected AL (``heldout_expected_al`` in
metrics.jsonl) and its training loss are drawn beside it. Prints its command and a table; AL includes the bonus.
``--continues``: ``--run`` started from the last checkpoint of that earlier run (``drafter.init_from``, a second
stage): the earlier run's rows come first and ``--run``'s steps are counted on from its last step, one curve.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=os.path.join(ROOT, "runs", "smollm2-135m-dflash-pretrain"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "figures", "pretrain_curve.png"))
    ap.add_argument("--continues", default=None, help="an earlier stage's run folder (see the module doc)")
    ap.add_argument("--bench", default="chat", choices=["chat", "mt-bench"],
                    help="chat: held-out chat prompts; mt-bench: MT-Bench first turns (--prompts of the 80, the same "
                         "number per category)")
    args = ap.parse_args(argv)
    args.temperatures = []
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:]))
    print(cmd, flush=True)

    from bench_al import Evaluator, _checkpoints, _loss_at, _metrics

    from specopd.config import load_recipe

    cfg = load_recipe(os.path.join(args.run, "recipe.yaml"), [])
    ev = Evaluator(cfg.model.target, args, args.run)
    rows, loss_at, offset, restarts = [], {}, 0, []
    for run in ([args.continues] if args.continues else []) + [args.run]:
        metrics = _metrics(run)
        expected = {int(m["step"]): m["heldout_expected_al"] for m in metrics if m.get("heldout_expected_al")}
        losses = _loss_at(metrics)
        loss_at.update({offset + k: v for k, v in losses.items()})
        last = offset
        for step, folder in _checkpoints(run):
            if rows and step == 0:
                continue  # a later stage's step 0 is the earlier stage's last checkpoint
            r = ev(folder, real=False)["replay_t0"]
            rows.append({"step": offset + step, "al": r["mean_al"], "se": r["se"], "loss": losses.get(step),
                         "expected_al": expected.get(step), "accepted_at": r["accepted_at"],
                         "reached_at": r["reached_at"], "checkpoint": folder, "run": run})
            last = offset + step
        if run != args.run:
            offset = last
            restarts.append(offset)
    what = "MT-Bench first turns" if args.bench == "mt-bench" else "held-out"
    from specopd.eval.bench import provenance_line

    title = (f"{os.path.basename(os.path.normpath(args.run))}: greedy AL (incl. bonus), {what}, {len(ev.prompts)} "
             f"prompts x {args.max_new_tokens} tokens, W={cfg.drafter.block_size - 1}")
    print(provenance_line())
    print(f"\n{title}\n{'step':>6}{'AL T=0':>9}{'+- se':>8}{'loss':>9}{'expected AL':>13}  acceptance 1..W")
    for r in rows:
        acc = "  ".join(f"{a / n:.2f}" if n else "-" for a, n in zip(r["accepted_at"], r["reached_at"]))
        ex = f"{r['expected_al']:>13.3f}" if r["expected_al"] else f"{'':>13}"
        loss = f"{r['loss']:>9.4f}" if r["loss"] is not None else f"{'':>9}"
        print(f"{r['step']:>6}{r['al']:>9.3f}{r['se']:>8.3f}{loss}{ex}  {acc}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"command": cmd, "title": title, "rows": rows}, f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["step"] for r in rows]
    a1.errorbar(xs, [r["al"] for r in rows], yerr=[2 * r["se"] for r in rows], fmt="-o", ms=4, capsize=3,
                label=f"greedy AL, {what} prompts (+- 2 se)")
    ex = [(r["step"], r["expected_al"]) for r in rows if r["expected_al"]]
    if ex:
        a1.plot(*zip(*ex), "--s", ms=3, label="expected AL (T=1), held-out references")
    for x in restarts:
        a1.axvline(x, color="grey", lw=0.8, ls=":")
        a1.text(x, a1.get_ylim()[0], " stage 2: new schedule", fontsize=7, color="grey", va="bottom")
    a1.set_xlabel("off-policy CE steps")
    a1.set_ylabel("AL (incl. bonus)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    lx = sorted(loss_at)
    a2.plot(lx, [loss_at[s] for s in lx], lw=1)
    a2.set_xlabel("off-policy CE steps")
    a2.set_ylabel("training loss (10-step mean)")
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
