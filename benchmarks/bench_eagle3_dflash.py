"""EAGLE-3 against DFlash at equal training time, both judged by vLLM's counters on MT-Bench: which drafter a
user of SmolLM2-135M-Instruct gets for the same pretraining time.

    python benchmarks/bench_eagle3_dflash.py [--steps 4] [--rounds 2] [--threads 1] [--dflash-steps 600]
        [--eagle3-run runs/eagle3-kept] [--dflash-drafter recipes/drafters/smollm2-135m-dflash]
        [--prompts 80] [--max-new-tokens 64] [--temperatures 0,1] [--no-k4] [--out runs/eagle3-vs-dflash]

1. step cost   the two pretraining recipes (recipes/smollm2-135m-dflash-sharegpt.yaml and
               recipes/smollm2-135m-eagle3-sharegpt.yaml, their own settings; the held-out evaluation off: it is
               not training time) train side by side on this machine, ``--steps`` steps each in turn for ``--rounds``
               rounds (each round resumes its run), in fresh folders <out>/steps-<time>/{dflash,eagle3}, with
               ``--threads`` torch threads for both; a step's cost = the median of its logged step times
2. equal time  the shipped DFlash drafter's ``--dflash-steps`` training steps (its README: 600) are worth
               dflash_steps x dflash_step_s / eagle3_step_s EAGLE-3 steps; the EAGLE-3 run's kept checkpoint
               (``--eagle3-run``: a run folder, or a folder of step-N checkpoints) nearest that, and how far
3. judge       vLLM serves both (one process) on ``--prompts`` MT-Bench first turns (all 80: the default; fewer: the
               same number per category) x ``--max-new-tokens`` at ``--temperatures``, fp32: DFlash at its k = 4
               (block 5), EAGLE-3 at its k = 7 and, unless ``--no-k4``, at k = 4 too (the same drafter, fewer
               drafted tokens: users compare at equal k). AL by vLLM's counters (its verify steps, prompt by
               prompt), its standard error, and each EAGLE-3 row minus DFlash, paired over the prompts

Prints its command, the provenance line and the tables; writes <out>/eagle3_vs_dflash.json. AL = tokens committed
per verification round, the bonus included. Exit 2 without a vLLM venv (``make vllm``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RECIPES = {"dflash": os.path.join(ROOT, "recipes", "smollm2-135m-dflash-sharegpt.yaml"),
           "eagle3": os.path.join(ROOT, "recipes", "smollm2-135m-eagle3-sharegpt.yaml")}


def step_costs(args, out: str) -> dict:
    """Both recipes trained in turn (``--rounds`` x ``--steps`` steps each) -> {kind: {"step_s": median,
    "steps_s": every logged step time, "run": folder}}."""
    import torch

    from specopd.config import load_recipe
    from specopd.train.loop import train

    torch.set_num_threads(args.threads)
    runs = {k: os.path.join(out, k) for k in RECIPES}
    for r in range(1, args.rounds + 1):
        for kind, recipe in RECIPES.items():
            print(f"[bench_eagle3_dflash] round {r}/{args.rounds}: {kind} to step {r * args.steps} -> {runs[kind]}",
                  flush=True)
            train(load_recipe(recipe, [f"trainer.output_dir={runs[kind]}", f"trainer.max_steps={r * args.steps}",
                                       "trainer.resume=auto", "trainer.eval_heldout=false", "trainer.eval_every=0",
                                       "profile.enabled=false",
                                       *args.overrides]), progress=False)
    res = {}
    for kind, run in runs.items():
        with open(os.path.join(run, "metrics.jsonl")) as f:
            times = [float(m["step_s"]) for m in map(json.loads, filter(str.strip, f)) if "step_s" in m]
        res[kind] = {"step_s": statistics.median(times), "steps_s": times, "run": run}
    return res


def kept_checkpoints(folder: str) -> list:
    """[(step, folder)] of the complete checkpoints of a run folder (its checkpoints/) or of a folder of step-N
    checkpoints (the kept copies of a run)."""
    from specopd.runs.checkpoint import checkpoints_in, complete_checkpoints

    return complete_checkpoints(folder) or checkpoints_in(folder)


def judge_both(args, target_dir: str, dflash: str, eagle3: str, out: str) -> list:
    """vLLM serves the DFlash drafter and the EAGLE-3 checkpoint (exported first) in one process -> table rows."""
    from specopd.data.prepare import load_tokenizer, stop_token_ids
    from specopd.drafters.layout import read_config
    from specopd.eval.bench import mtbench_prompts, stratified
    from specopd.eval.compare import lengths_result
    from specopd.eval.engine import ensure_export, run_judge_drafters, steps_accept_lengths
    from specopd.models import load_target

    target = load_target(target_dir)
    ids, meta = mtbench_prompts(target_dir, target.vocab_size)
    keep = stratified(meta, args.prompts)
    prompts, meta = [ids[i].tolist() for i in keep], [meta[i] for i in keep]
    stops = sorted(stop_token_ids(load_tokenizer(target_dir, target.vocab_size), target))
    d_export, _ = ensure_export(dflash, os.path.join(out, "dflash"))
    e_export, _ = ensure_export(eagle3, os.path.join(out, "eagle3"))
    kd, ke = (int(read_config(p)[0].draft_len) for p in (d_export, e_export))  # each export's own W
    served = [("DFlash (shipped)", d_export, kd), ("EAGLE-3", e_export, ke)]
    if not args.no_k4 and ke != kd:
        served.append((f"EAGLE-3 at k={kd}", e_export, kd))
    print(f"[bench_eagle3_dflash] vLLM serves {len(served)} drafter(s) on {len(prompts)} MT-Bench first turns x "
          f"{args.max_new_tokens} tokens at T={args.temperatures} (one process, fp32; work in {out})", flush=True)
    runs = run_judge_drafters(target_dir, [p for _, p, _ in served], prompts, args.max_new_tokens, args.temps, stops,
                              "float32", [k for _, _, k in served], work_dir=os.path.join(out, "vllm"))
    rows = []
    for (label, path, k), run in zip(served, runs):
        rows.append({"label": label, "export": path, "k": k,
                     "by_temperature": {f"{float(r['temperature']):g}": lengths_result(
                         steps_accept_lengths(r["outputs"]), k, meta) for r in run["runs"]}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="steps of each recipe per round (step cost)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both recipes in turn")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both recipes")
    ap.add_argument("--dflash-steps", type=int, default=600,
                    help="the shipped DFlash drafter's training steps (recipes/drafters/smollm2-135m-dflash/README.md)")
    ap.add_argument("--eagle3-run", default=os.path.join(ROOT, "runs", "eagle3-kept"),
                    help="the EAGLE-3 TTT run: its folder, or a folder of its step-N checkpoints")
    ap.add_argument("--dflash-drafter", default=os.path.join(ROOT, "recipes", "drafters", "smollm2-135m-dflash"))
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns (80: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--no-k4", action="store_true", help="leave out EAGLE-3 at DFlash's k")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "eagle3-vs-dflash"))
    ap.add_argument("overrides", nargs="*", help="overrides for both pretraining recipes (section.key=value)")
    args = ap.parse_args(argv)
    from specopd.engines import vllm_missing_reason
    from specopd.eval.bench import provenance_line
    from specopd.eval.cli import parse_temperatures

    args.temps = parse_temperatures(args.temperatures)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:]))
    print(cmd, flush=True)
    print(provenance_line(), flush=True)
    why = vllm_missing_reason()
    if why:
        print(f"bench_eagle3_dflash: vLLM cannot run here: {why}", file=sys.stderr)
        return 2
    for what, path in (("--eagle3-run", args.eagle3_run), ("--dflash-drafter", args.dflash_drafter)):
        if not os.path.isdir(path):
            print(f"bench_eagle3_dflash: {what} {path}: no such folder", file=sys.stderr)
            return 2
    kept = kept_checkpoints(args.eagle3_run)
    if not kept:
        print(f"bench_eagle3_dflash: --eagle3-run {args.eagle3_run} holds no complete step-N checkpoint (give the "
              f"TTT run's folder or a folder of its kept checkpoints)", file=sys.stderr)
        return 2

    from specopd.config import load_recipe
    from specopd.eval.compare import equal_time_steps, nearest_checkpoint, paired_table

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    costs = step_costs(args, os.path.join(args.out, time.strftime("steps-%Y%m%d-%H%M%S")))
    want = equal_time_steps(args.dflash_steps, costs["dflash"]["step_s"], costs["eagle3"]["step_s"])
    step, ck, off = nearest_checkpoint(kept, want)
    lines = [f"step cost on this machine ({args.threads} thread(s), {args.rounds} x {args.steps} steps each, in turn; "
             f"median of the logged step times): DFlash {costs['dflash']['step_s']:.3f} s, EAGLE-3 "
             f"{costs['eagle3']['step_s']:.3f} s (EAGLE-3 / DFlash "
             f"{costs['eagle3']['step_s'] / costs['dflash']['step_s']:.2f})",
             f"equal time: DFlash's {args.dflash_steps} steps = {want:.0f} EAGLE-3 steps; the nearest kept EAGLE-3 "
             f"checkpoint is step {step} ({off:+.0f} steps, {off / want:+.0%}; kept: "
             f"{', '.join(str(s) for s, _ in kept)}): {ck}"]
    print("\n".join(lines), flush=True)
    target_dir = load_recipe(RECIPES["eagle3"], []).model.target
    rows = judge_both(args, target_dir, args.dflash_drafter, ck, os.path.join(args.out, "judge"))
    table, diffs = paired_table(rows, args.temps)

    print(f"\n{provenance_line()}\n{cmd}\n" + "\n".join(lines))
    print(f"\nMT-Bench first turns ({len(next(iter(rows[0]['by_temperature'].values()))['accept_lengths'])}) x "
          f"{args.max_new_tokens} new tokens, AL by vLLM's counters (its verify steps, prompt by prompt), incl. the "
          f"bonus; k = drafted tokens per round")
    print("\n".join(table))
    for r in rows:
        for t, v in r["by_temperature"].items():
            print(f"  T={t:<3} {r['label']:<24} acceptance at draft position 1..{r['k']}: " + "  ".join(
                f"{a / n:.2f}" if n else "-" for a, n in zip(v["accepted_at"], v["reached_at"])))
    data = {"command": cmd, "provenance": provenance_line(), "step_costs": costs, "dflash_steps": args.dflash_steps,
            "equal_eagle3_steps": want, "eagle3_checkpoint": ck, "eagle3_step": step, "eagle3_step_off": off,
            "eagle3_kept_steps": [s for s, _ in kept], "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "temperatures": args.temps, "rows": rows, "minus_dflash": diffs, "al_includes_bonus": True,
            "judge": "vllm", "wall_s_total": time.perf_counter() - t0}
    path = os.path.join(args.out, "eagle3_vs_dflash.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
