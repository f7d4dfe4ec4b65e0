"""MT-Bench before / after by vLLM's counters: the main job's starting and final drafters served in vLLM on all 80
first turns, with ours on vLLM's schedule beside them (the main job's judge rows, without retraining anything).

    python benchmarks/mtbench_judge.py [--recipe recipes/smollm2-135m-dflash.yaml] [--temperatures 0,1]
        [--after CHECKPOINT] [--json OUT]

``--after`` defaults to the newest checkpoint of the recipe's run. Prints its command, the provenance line and one
table (AL incl. the bonus, acceptance per draft position, AL per category), and the judge's agree / disagree
verdict per drafter. Needs vLLM's venv (`make vllm`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "smollm2-135m-dflash.yaml"))
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--after", default=None, help="the trained drafter (default: the run's newest checkpoint)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="recipe keys, section.key=value")
    args = ap.parse_args(argv)
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])),
          flush=True)

    from specopd.config import load_recipe
    from specopd.eval.bench import provenance, provenance_line
    from specopd.eval.cli import parse_temperatures
    from specopd.eval.engine import judge_rows
    from specopd.data.prepare import MODELS
    from specopd.mainjob import format_al_table
    from specopd.runs.checkpoint import find_latest

    temps = parse_temperatures(args.temperatures)
    cfg = load_recipe(args.recipe, list(args.overrides) + [
        "eval.bench=mt-bench", f"pipeline.eval_temperatures=[{','.join(f'{t:g}' for t in temps)}]"])
    after = args.after or find_latest(cfg.trainer.output_dir)
    rows = [(f"before: {os.path.basename(os.path.normpath(cfg.drafter.init_from))}", cfg.drafter.init_from)]
    if after:
        rows.append((f"after: {os.path.relpath(after, ROOT)}", after))
    print(provenance_line(), flush=True)
    target = cfg.model.target if os.path.isdir(cfg.model.target) else MODELS[cfg.model.target]()
    results = judge_rows(cfg.eval, temps, cfg.model, cfg.kernels, target, rows, cfg.trainer.output_dir)
    if not results:
        print("no vLLM rows (see the line above): nothing to report")
        return 1
    w = cfg.drafter.block_size - 1
    print(format_al_table(results, temps, w, f"\nMT-Bench first turns (all {results[0]['num_prompts']}), "
                                             f"{cfg.eval.max_new_tokens} new tokens, AL incl. the bonus (max {w + 1})"))
    for r in results:
        if r.get("engine") == "vllm":
            print(f"judge, {r['drafter']}: " + ("agree" if not r["problems"] else "; ".join(r["problems"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "rows": results}, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
