"""Runs *inside the vLLM venv* as its own process (stdlib + vllm only; never imported by specopd).

    python vllm_runner.py generate --model HF_DIR --input REQS.jsonl --output OUT.jsonl [--dtype bfloat16]
    python vllm_runner.py judge    --model HF_DIR --drafter EXPORT --input REQS.jsonl --output OUT.json

``generate``: each input line ``{"id", "prompt_ids": [...], "max_tokens", "temperature", "top_p", "seed"}`` ->
one output line ``{"id", "token_ids": [...], "finish": "eos" | "length"}`` per request, appended and flushed
chunk by chunk (the caller resumes by sending only the ids it does not have). ``judge``: the same requests,
optionally with the drafter as DFlash (``--drafter``), -> one JSON with every output and vLLM's own
speculative-decoding counters. Progress goes to stderr as ``[vllm-runner] done/total tok/s`` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _log(msg: str) -> None:
    print(f"[vllm-runner] {msg}", file=sys.stderr, flush=True)


def _llm(args, speculative_config=None):
    from vllm import LLM

    kw = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              disable_log_stats=False, seed=0, enable_prefix_caching=False)
    if speculative_config:
        kw["speculative_config"] = speculative_config
    return LLM(**kw)


def _params(r: dict):
    from vllm import SamplingParams

    return SamplingParams(temperature=float(r["temperature"]), top_p=float(r.get("top_p", 1.0)),
                          max_tokens=int(r["max_tokens"]), seed=int(r.get("seed", 0)), ignore_eos=False)


def _read(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finish(o) -> str:
    return "length" if o.finish_reason == "length" else "eos"


def _counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (``llm.get_metrics()``), summed over label sets."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "num_drafts",
             "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return out


def generate(args) -> int:
    reqs = _read(args.input)
    llm = _llm(args)
    _log(f"loaded {args.model}; {len(reqs)} requests")
    t0, n_tok = time.perf_counter(), 0
    with open(args.output, "a") as f:
        for b in range(0, len(reqs), args.chunk):
            chunk = reqs[b: b + args.chunk]
            outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in chunk],
                                [_params(r) for r in chunk], use_tqdm=False)
            for r, o in zip(chunk, outs):
                c = o.outputs[0]
                f.write(json.dumps({"id": r["id"], "token_ids": list(c.token_ids), "finish": _finish(c)}) + "\n")
                n_tok += len(c.token_ids)
            f.flush()
            os.fsync(f.fileno())
            _log(f"{min(b + args.chunk, len(reqs))}/{len(reqs)} {n_tok / (time.perf_counter() - t0):.1f} tok/s")
    return 0


def judge(args) -> int:
    reqs = _read(args.input)
    spec = None
    if args.drafter:
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    llm = _llm(args, spec)
    _log(f"loaded {args.model}" + (f" with DFlash drafter {args.drafter}" if spec else "") + f"; {len(reqs)} requests")
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in reqs], [_params(r) for r in reqs],
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    res = {"outputs": [{"id": r["id"], "token_ids": list(o.outputs[0].token_ids), "finish": _finish(o.outputs[0])}
                       for r, o in zip(reqs, outs)],
           "wall_s": wall, "counters": _counters(llm) if spec else None}
    with open(args.output, "w") as f:
        json.dump(res, f)
    _log(f"{sum(len(o['token_ids']) for o in res['outputs']) / wall:.1f} tok/s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vllm_runner")
    p.add_argument("what", choices=["generate", "judge"])
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256, help="requests per llm.generate call (one flush each)")
    p.add_argument("--drafter", default=None, help="judge: a DFlash export folder")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args(argv)
    return generate(args) if args.what == "generate" else judge(args)


if __name__ == "__main__":
    sys.exit(main())
