"""SpecOPD against a fair Draft-OPD on one GPU at a real target's size, in-process (no Ray, no CLI, no checkpoint).

The recipe's target shape (default recipes/qwen3-8b-dflash-8gpu.yaml: Qwen3-8B, 36 layers, hidden 4096, vocab 151,936)
with random weights drawn on the device (``specopd.models.tiny.random_target``), the recipe's drafter, random
reference token ids. Each method runs in a ``Worker`` of its own (the trainer's step: ``stage`` + ``finish``), one
after the other on the same target and the same batches: warm-up steps first (compiles), then timed steps.
Draft-OPD rolls out as the trainer's baseline does (``specopd.train.baselines``: caches, one batched target pass per
round). Per method: supervised tokens/s, the step's phase times (spans synchronised with the GPU, as the trainer's
profile takes them), GPU activity (NVML utilization.gpu every 0.1 s, ``specopd.profiling.GpuSampler``, the
profile's sampler) and the peak memory against the memory plan of ``specopd train --dry-run`` for the same shapes
(``specopd.memory.memory_plan``).

    python benchmarks/gpu_step.py [--recipe R] [--batch 4] [--seq-len 2048] [--prompt-len 256] [--anchors 64]
                                  [--warmup 1] [--steps 2] [--json OUT.json]
    python benchmarks/gpu_step.py --tiny [--no-omegaconf] [--json OUT.json]   # the same path at toy sizes, CPU

Every row is printed and written to --json (the whole file, replaced atomically) the moment it exists; SIGINT (a
time limit) ends the run keeping the rows so far (exit 130). The recipe is read by ``load_recipe``, or by PyYAML into
the same dataclasses where omegaconf is missing (``--no-omegaconf`` rehearses that). Defaults: the recipe's batch
per GPU (4 x 2048 tokens) with B = 64 anchors / rounds per sequence (the recipe's 256 makes a Draft-OPD step ~4x
longer).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import signal
import sys
import time
import traceback


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from specopd.errors import write_replace  # noqa: E402  (after the checkout is on sys.path)

METHODS = ("specopd", "draft_opd")
# --tiny: the recipe's depth (its drafter's feature layers 1..33 exist) and drafter, every width toy-sized
TINY_SHAPE = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=36,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False)
TINY_SIZES = dict(batch=2, seq_len=64, prompt_len=16, anchors=4)


class Rows:
    """Rows printed and written to a JSON file as each arrives (the file replaced whole: a kill keeps the last)."""

    def __init__(self, path, head: dict):
        self.path, self.doc = path, dict(head, rows=[])

    def add(self, **row) -> dict:
        self.doc["rows"].append(row)
        if self.path:
            write_replace(self.path, json.dumps(self.doc, indent=1, default=str))
        return row


def read_recipe(path: str):
    """(RecipeConfig, how it was read): ``load_recipe``, or PyYAML into the same dataclasses where omegaconf is
    missing (each section's checks run; values keep YAML's types, nothing is coerced)."""
    from specopd.config import RecipeConfig, load_recipe

    try:
        import omegaconf  # noqa: F401  (only to know whether load_recipe can run)
    except ImportError:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f)
        fields = {f.name: f for f in dataclasses.fields(RecipeConfig)}
        kw = {k: type(fields[k].default_factory())(**v) if isinstance(v, dict) else v for k, v in data.items()}
        return RecipeConfig(**kw), "PyYAML into RecipeConfig (omegaconf is not installed)"
    return load_recipe(path), "specopd.config.load_recipe"


def with_sections(cfg, sections: dict):
    """``cfg`` with {section: {key: value}} replaced; every dataclass's checks run again."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def method_recipe(base, args, method: str, shape: dict, data_path: str):
    """The recipe of one method's worker: the base recipe's drafter and trainer settings, this run's shapes."""
    mask = base.drafter.mask_token_id
    return with_sections(base, {
        "model": dict(target=f"random:{shape['model_type']}", device=args.device, dtype=args.dtype, shape=shape),
        "drafter": dict(mask_token_id=shape["vocab_size"] - 1 if mask is None else mask),  # random weights: any id
        "data": dict(source="prepared", path=data_path, seq_len=args.seq_len, batch_size=args.batch, heldout=0.0),
        "trainer": dict(method=method, anchors_per_seq=args.anchors, eval_every=0, save_every=0,
                        output_dir=os.path.join(args.work, f"run-{method}")),
        "runtime": dict(backend="local", num_workers=1, roles="colocated", tensor_parallel=1),
        "profile": dict(enabled=True, nvml=False),  # spans synchronise with the GPU; we sample NVML ourselves
    })


def write_references(path: str, n: int, seq_len: int, prompt_len: int, vocab: int, seed: int) -> None:
    """n prepared records of uniform random token ids (a random target has no better text)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "prompt_len": prompt_len}) + "\n")


def gib(n) -> float:
    return round(n / 2**30, 2) if n is not None else None


def memory_now(cuda: bool) -> dict:
    import torch

    if not cuda:
        return {"allocated_peak_gib": None, "reserved_peak_gib": None}
    return {"allocated_peak_gib": gib(torch.cuda.max_memory_allocated()),
            "reserved_peak_gib": gib(torch.cuda.max_memory_reserved())}


def drafter_attention_path(cfg, cuda: bool) -> str:
    """Which branch attention the drafter's steps took: the recipe's choice and, for auto on CUDA, whether
    flex_attention compiled in this process."""
    from specopd.drafters import attention

    want = cfg.kernels.drafter_attention
    failed = getattr(attention, "flex_failed", lambda: None)()
    if want == "auto":
        want = "flex" if cuda and not failed else "chunked"
    return want + (f" (flex failed: {failed})" if failed else "")


def run_step(w, ids, step: int, sampler_cls, method: str) -> tuple:
    """One training step of worker ``w`` on ``ids``: (seconds, metrics, GPU samples or None)."""
    from specopd.train import phases

    sampler = sampler_cls(method).start() if sampler_cls else None
    t0 = time.perf_counter()
    n = phases.stage(w, ids, step)["branches"]
    m = phases.finish(w, n)
    dt = time.perf_counter() - t0
    samples = sampler.stop().take() if sampler else None
    return dt, m, samples


def run_method(method: str, base, args, target, shape, data_path, batches, out: Rows) -> dict:
    """Warm-up then timed steps of one method in a fresh Worker; rows as they finish; the method's totals."""
    import torch

    from specopd.memory import memory_plan
    from specopd.profiling import GpuSampler, gpu_unavailable_reason
    from specopd.train.worker import Worker

    cuda = args.device == "cuda"
    cfg = method_recipe(base, args, method, shape, data_path)
    plan = memory_plan(cfg)
    out.add(kind="plan", method=method, peak_gib=gib(plan.peak), peak_phase=plan.peak_phase,
            phases_gib={k: gib(v) for k, v in plan.phase_bytes().items()}, device_gib=gib(plan.device_bytes),
            device_source=plan.device_source, fits=plan.fits, sizes=plan.sizes)
    why = gpu_unavailable_reason()
    sampler_cls = GpuSampler if why is None else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    w = Worker(cfg, target=target)
    print(f"[{method}] worker built in {time.perf_counter() - t0:.1f} s", flush=True)
    tot = {"steps": 0, "supervised_tokens": 0, "seconds": 0.0, "branches": 0, "phase_s": {}, "gpu": [], "mem": []}
    try:
        for step, ids in enumerate(batches):
            timed = step >= args.warmup
            dt, m, samples = run_step(w, ids, step, sampler_cls if timed else None, method)
            act = [s[2] for s in samples] if samples else []
            row = out.add(kind="step", method=method, step=step, timed=timed, seconds=round(dt, 4),
                          supervised_tokens=m["supervised_tokens"], branches=m["branches"],
                          supervised_tokens_per_s=round(m["supervised_tokens"] / dt, 1), loss=m["loss"],
                          phase_s={k: round(v, 4) for k, v in m["phase_s"].items()},
                          gpu_activity_pct=round(sum(act) / len(act), 1) if act else None,
                          nvml_used_peak_gib=gib(max(s[3] for s in samples)) if samples else None,
                          **memory_now(cuda))
            print(f"[{method}] step {step} ({'timed' if timed else 'warm-up'}): {dt:.2f} s, "
                  f"{row['supervised_tokens']} supervised tokens ({row['supervised_tokens_per_s']:.0f}/s), GPU "
                  f"activity {row['gpu_activity_pct']}%, peak {row['allocated_peak_gib']} GiB | "
                  + " ".join(f"{k} {v:.3f}" for k, v in row["phase_s"].items()), flush=True)
            if timed:
                tot["steps"] += 1
                tot["seconds"] += dt
                tot["supervised_tokens"] += m["supervised_tokens"]
                tot["branches"] += m["branches"]
                tot["gpu"] += act
                tot["mem"] += [s[3] for s in samples or []]
                for k, v in m["phase_s"].items():
                    tot["phase_s"][k] = tot["phase_s"].get(k, 0.0) + v
        tot["supervised_tokens_per_s"] = tot["supervised_tokens"] / tot["seconds"] if tot["seconds"] else float("nan")
        mem = memory_now(cuda)
        out.add(kind="method", method=method, timed_steps=tot["steps"], seconds=round(tot["seconds"], 3),
                supervised_tokens=tot["supervised_tokens"],
                supervised_tokens_per_s=round(tot["supervised_tokens_per_s"], 1),
                phase_s_per_step={k: round(v / max(1, tot["steps"]), 4) for k, v in tot["phase_s"].items()},
                gpu_activity_pct=round(sum(tot["gpu"]) / len(tot["gpu"]), 1) if tot["gpu"] else None,
                gpu_note=why or "NVML utilization.gpu: share of time a kernel was running, sampled every ~0.1 s",
                **mem, nvml_used_peak_gib=gib(max(tot["mem"])) if tot["mem"] else None, plan_peak_gib=gib(plan.peak),
                plan_over_measured=(round(plan.peak / 2**30 / mem["allocated_peak_gib"], 3)
                                    if mem["allocated_peak_gib"] else None),
                drafter_attention=drafter_attention_path(cfg, cuda))
        return tot
    finally:
        del w
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "qwen3-8b-dflash-8gpu.yaml"))
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU, fp32 (the same code path)")
    ap.add_argument("--no-omegaconf", action="store_true", help="act as if omegaconf were not installed")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (the recipe's per GPU: 32 / 8)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=64, help="B: anchors (SpecOPD) / rounds (Draft-OPD) per sequence")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per method first")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per method")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--work", default="/tmp/specopd-gpu-step", help="references and run folders")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        for k in ("batch", "seq_len", "prompt_len", "anchors"):
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, TINY_SIZES[k])
    return args


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a time limit's SIGINT ends the run, rows kept
    args = parse(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), flush=True)
    if args.no_omegaconf:
        sys.modules["omegaconf"] = None  # import omegaconf now raises ImportError, as where it is not installed
    import torch

    from specopd.models.tiny import random_target

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA here: run with --tiny (toy sizes on the CPU)", file=sys.stderr)
        return 2
    args.device, args.dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    os.makedirs(args.work, exist_ok=True)
    out = Rows(args.json, {"command": sys.argv, "device": torch.cuda.get_device_name() if args.device == "cuda"
                           else "cpu", "torch": torch.__version__})
    try:
        base, how = read_recipe(args.recipe)
        shape = dict(TINY_SHAPE) if args.tiny else dict(base.model.shape)
        t0 = time.perf_counter()
        target = random_target(shape, dtype=args.dtype, device=args.device, seed=base.seed)
        if args.device == "cuda":
            torch.cuda.synchronize()
        n_params = sum(p.numel() for p in target.parameters())
        out.add(kind="setup", recipe=os.path.relpath(args.recipe, ROOT), read_by=how, shape=shape,
                target_params=n_params, target_build_s=round(time.perf_counter() - t0, 2), dtype=args.dtype,
                batch=args.batch, seq_len=args.seq_len, prompt_len=args.prompt_len, anchors_per_seq=args.anchors,
                warmup=args.warmup, steps=args.steps, target_memory_gib=gib(torch.cuda.memory_allocated())
                if args.device == "cuda" else None)
        print(f"target: {shape['model_type']} {n_params / 1e9:.3f}B random params ({args.dtype}, {args.device}) in "
              f"{time.perf_counter() - t0:.1f} s; recipe read by {how}", flush=True)
        nb = args.warmup + args.steps
        data_path = os.path.join(args.work, "references.jsonl")
        write_references(data_path, args.batch * nb, args.seq_len, args.prompt_len, shape["vocab_size"], base.seed)
        batches = [list(range(i * args.batch, (i + 1) * args.batch)) for i in range(nb)]
        done = {}
        for method in [m for m in args.methods.split(",") if m]:
            try:
                done[method] = run_method(method, base, args, target, shape, data_path, batches, out)
            except Exception as e:  # noqa: BLE001  (report, go on with the other method)
                traceback.print_exc()
                out.add(kind="error", method=method, error=f"{type(e).__name__}: {str(e)[:500]}")
        return report(done, [m for m in args.methods.split(",") if m], out)
    except KeyboardInterrupt:
        out.add(kind="cut", note="SIGINT (the step's time limit): the rows above are what finished")
        print("cut by SIGINT: the rows so far are written", flush=True)
        return 130


def report(done: dict, wanted: list, out: Rows) -> int:
    """The side-by-side table (benchmarks/bench_throughput.py's) and the ratio row; 1 if a method failed."""
    from bench_throughput import table

    if not done:
        return 1
    r = {"methods": done}
    if set(METHODS) <= set(done):
        r["ratio"] = done["specopd"]["supervised_tokens_per_s"] / done["draft_opd"]["supervised_tokens_per_s"]
        out.add(kind="result", ratio=round(r["ratio"], 3),
                **{f"{m}_supervised_tokens_per_s": round(done[m]["supervised_tokens_per_s"], 1) for m in METHODS})
    lines = table({**r, "ratio": r.get("ratio", float("nan"))}).splitlines()
    print("\n".join(lines if "ratio" in r else lines[:-1]), flush=True)
    return 0 if set(wanted) <= set(done) else 1


if __name__ == "__main__":
    sys.exit(main())
