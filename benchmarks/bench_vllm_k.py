"""Does speculative decoding pay in vLLM on this CPU? Plain against DFlash decoding at batch 1, per drafter and per
``num_speculative_tokens`` k, on MT-Bench's first turns.

On a GPU a round's target pass over 1 + k tokens costs about one decoding step, so k = W (the block the drafter was
trained on) is the natural choice. On a CPU the target's pass grows with the tokens it verifies, and a drafter whose
acceptance falls off after the first positions pays for tokens it rarely lands: a smaller k verifies less and
keeps most of the accepted length. This measures it the way a user serves: vLLM as its own process (``make vllm``),
greedy, one request at a time (``max_num_seqs`` 1), no stop tokens (every request makes exactly
``--max-new-tokens``), prefill included. vLLM drafts only k tokens a round (a DFlash block of 1 + k; the drafter's
block attention is non-causal, so the first k drafts at k < W need not equal the first k of a W-token block).

Each repeat runs plain decoding in one vLLM process, then every (drafter, k) in a second one (vLLM's start-up paid
once; only ``generate`` is timed, after an untimed warm-up request in each engine); odd repeats run the speculative
process first. A row's ratio divides by the plain rate of the same repeat, so load that changes between repeats hits
both sides alike. AL is vLLM's (1 + accepted / rounds).

    python benchmarks/bench_vllm_k.py [--drafters DIR,DIR] [--ks 1,2,3,4] [--prompts 16] [--max-new-tokens 64]
                                      [--dtype bfloat16] [--repeats 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHIPPED = os.path.join(ROOT, "recipes", "drafters", "smollm2-135m-dflash")
FINAL = os.path.join(ROOT, "runs", "smollm2-135m-dflash", "export")  # the main job's export
WARMUP = 16  # untimed tokens of the first prompt in every engine before its timed run


def measure(target: str, drafters: list, ks: list, prompts: list, n_new: int, dtype: str, repeats: int,
            work: str) -> list:
    """-> rows {repeat, drafter (None: plain), k, tokens_per_s, al, accepted_per_pos}, in run order."""
    from specopd.eval.engine import run_judge, run_judge_drafters

    pairs = [(d, k) for d in drafters for k in ks]
    rows = []

    def plain(rep: int):
        r = run_judge(target, None, prompts, n_new, [0.0], [], dtype, work_dir=os.path.join(work, f"plain{rep}"),
                      max_num_seqs=1, warmup=WARMUP)["runs"][0]
        rows.append(dict(repeat=rep, drafter=None, k=0, tokens_per_s=r["tokens_per_s"], al=None,
                         accepted_per_pos=None))
        print(f"  repeat {rep}: plain {r['tokens_per_s']:.2f} tok/s", flush=True)

    def speculative(rep: int):
        res = run_judge_drafters(target, [d for d, _ in pairs], prompts, n_new, [0.0], [], dtype,
                                 num_speculative_tokens=[k for _, k in pairs],
                                 work_dir=os.path.join(work, f"spec{rep}"), max_num_seqs=1, warmup=WARMUP)
        for (d, k), x in zip(pairs, res):
            run = x["runs"][0]
            c = run["counters"]
            al = 1 + c["num_accepted_tokens"] / c["num_drafts"] if c and c["num_drafts"] else None
            rows.append(dict(repeat=rep, drafter=d, k=k, tokens_per_s=run["tokens_per_s"], al=al,
                             accepted_per_pos=c["accepted_per_pos"] if c else None, rounds=c["num_drafts"] if c else 0))
            print(f"  repeat {rep}: {os.path.relpath(d, ROOT)} k={k}: {run['tokens_per_s']:.2f} tok/s, AL "
                  f"{al:.3f}", flush=True)

    for rep in range(repeats):
        # odd repeats run the speculative process first, so a drift in the machine's speed over a repeat (or the
        # first engine of a run paying for cold caches) favours neither side
        for side in (plain, speculative) if rep % 2 == 0 else (speculative, plain):
            side(rep)
    return rows


def table(rows: list) -> str:
    """One line per (drafter, k): tokens/s (mean over repeats), AL, speculative / plain of the same repeat (mean,
    median and each repeat's), what a round costs in plain decoding steps (AL / ratio: speculative decoding pays
    only where the AL exceeds it), acceptance per position."""
    plain = {r["repeat"]: r["tokens_per_s"] for r in rows if r["drafter"] is None}
    keys = []
    for r in rows:
        if r["drafter"] is not None and (r["drafter"], r["k"]) not in keys:
            keys.append((r["drafter"], r["k"]))
    lines = ["| decoding | k | tokens/s | AL (vLLM) | speculative / plain (mean, median) | per repeat "
             "| a round in plain steps | acceptance at position 1..k |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    lines.append(f"| plain | - | {statistics.mean(plain.values()):.2f} | - | 1.00x | "
                 f"{' '.join(f'{x:.1f}' for x in plain.values())} tok/s | 1 | - |")
    for d, k in keys:
        rs = [r for r in rows if (r["drafter"], r["k"]) == (d, k)]
        ratios = [r["tokens_per_s"] / plain[r["repeat"]] for r in rs]
        acc, rounds = [0] * k, 0
        for r in rs:
            for i, a in enumerate((r["accepted_per_pos"] or [])[:k]):
                acc[i] += a
            rounds += r["rounds"]
        reached = [rounds] + acc[:-1]
        pos = " ".join(f"{a / n:.2f}" if n else "-" for a, n in zip(acc, reached))
        lines.append(f"| {os.path.relpath(d, ROOT)} | {k} | {statistics.mean(r['tokens_per_s'] for r in rs):.2f} | "
                     f"{statistics.mean(r['al'] for r in rs):.3f} | "
                     f"{statistics.mean(ratios):.2f}x, {statistics.median(ratios):.2f}x | "
                     f"{' '.join(f'{x:.2f}' for x in ratios)} | "
                     f"{statistics.mean(r['al'] / x for r, x in zip(rs, ratios)):.2f} | {pos} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared smollm2-135m)")
    ap.add_argument("--drafters", default=None,
                    help="comma-separated exports (default: the shipped drafter, and the main job's export if made)")
    ap.add_argument("--ks", default="1,2,3,4", help="num_speculative_tokens values")
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns, the same number per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    print("command: python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] +
                                          list(argv if argv is not None else sys.argv[1:])), flush=True)
    from specopd.engines import vllm_missing_reason
    from specopd.eval.bench import mtbench_prompts, provenance_line, stratified

    why = vllm_missing_reason()
    if why:
        print(f"vLLM is not available: {why}")
        return 2
    if args.target is None:
        from specopd.data.smollm2 import prepare_smollm2

        args.target = prepare_smollm2()
    drafters = ([os.path.abspath(d) for d in args.drafters.split(",") if d] if args.drafters else
                [SHIPPED] + ([FINAL] if os.path.isfile(os.path.join(FINAL, "config.json")) else []))
    missing = [d for d in drafters if not os.path.isfile(os.path.join(d, "config.json"))]
    if missing:
        ap.error(f"--drafters: no released-layout export (config.json) in {missing}; `make demo` writes "
                 f"runs/smollm2-135m-dflash/export")
    ks = [int(k) for k in args.ks.split(",") if k]
    with open(os.path.join(args.target, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    ids, meta = mtbench_prompts(args.target, vocab)
    prompts = [ids[i].tolist() for i in stratified(meta, args.prompts)]
    with tempfile.TemporaryDirectory(prefix="bench-vllm-k-") as work:
        rows = measure(args.target, drafters, ks, prompts, args.max_new_tokens, args.dtype, args.repeats, work)
    print()
    print(provenance_line())
    print(f"vLLM, {args.dtype} target, batch 1 (max_num_seqs 1), {len(prompts)} MT-Bench first turns x "
          f"{args.max_new_tokens} new tokens, greedy, no stop tokens, prefill included; {args.repeats} repeats")
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
