"""MT-Bench greedy AL of several drafter folders, each paired over the same prompts against the first.

    python benchmarks/mtbench_replay.py DRAFTER [DRAFTER ...] [--target ~/.cache/specopd/models/smollm2-135m]
        [--prompts 80] [--max-new-tokens 64]

T = 0 speculative decoding of MT-Bench's first turns replayed exactly on the target's greedy continuations
(``specopd.eval.replay``: the same rounds and counts as real greedy decoding), fp32. Prints its command, the
machine, and per drafter the AL (incl. the bonus token), its difference from the first drafter's with the paired
standard error over prompts, and the acceptance at each draft position. For quick comparisons of checkpoints
(a main job's settings, say); ``plateau_curve.py`` draws one run's checkpoints, ``mtbench_judge.py`` asks vLLM.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafters", nargs="+", help="drafter folders (checkpoints or exports); the first is the baseline")
    ap.add_argument("--target", default=os.path.join(os.path.expanduser("~"), ".cache", "specopd", "models",
                                                     "smollm2-135m"))
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns, the same number per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:])))

    import torch

    from specopd.data.prepare import load_tokenizer, stop_token_ids
    from specopd.drafters import load_drafter
    from specopd.eval.bench import mtbench_prompts, provenance_line, stratified
    from specopd.eval.cli import al_diff_stderr
    from specopd.eval.replay import greedy_continuations, replay_greedy_al
    from specopd.models import load_target

    print(provenance_line(), flush=True)
    target = load_target(args.target, dtype=torch.float32, device="cpu")
    ids, meta = mtbench_prompts(args.target, target.vocab_size)
    ids = [ids[i] for i in stratified(meta, args.prompts)]
    stops = sorted(stop_token_ids(load_tokenizer(args.target, target.vocab_size), target))
    drafters = [load_drafter(d, target) for d in args.drafters]
    greedy = greedy_continuations(target, ids, args.max_new_tokens + max(d.draft_len for d in drafters))
    print(f"MT-Bench first turns: {len(ids)} prompts x {args.max_new_tokens} tokens, T=0 (exact replay), AL incl. "
          f"the bonus; difference: paired over prompts against the first drafter, +- one standard error")
    base = None
    for path, d in zip(args.drafters, drafters):
        r = replay_greedy_al(target, d, ids, greedy, args.max_new_tokens, stop_token_ids=stops)
        base = base or r
        diff, se = r["mean_al"] - base["mean_al"], al_diff_stderr(r["accept_lengths"], base["accept_lengths"])
        pos = "  ".join(f"{x:.3f}" if x is not None else "-" for x in r["per_position_acceptance"])
        print(f"{path:<60} AL {r['mean_al']:.4f}  {diff:+.4f} +- {se:.4f}  per position {pos}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
