"""fla's own GDN path with its autotuning timed: the first call of fla's chunked prefill (``specopd_kernels.gated_delta.
fla_chunk``, fp32 checkpoints) and of its ``causal_conv1d`` at a shape, which tunes every autotuned kernel (each
config compiled and timed), against the second call, per dtype; rows "tuned" give each kernel's configs and
Triton's own timing of its tuning. With TRITON_PRINT_AUTOTUNING=1 Triton prints each kernel's tuning time as it
ends, so a cut run still shows how far it got; give it a fresh TRITON_CACHE_DIR so that nothing tuned before is
reused.

    python benchmarks/gpu_fla.py [--T 2048] [--heads 32] [--dim 128] [--dtypes bfloat16] [--json OUT.json]
    TRITON_INTERPRET=1 python benchmarks/gpu_fla.py --tiny     # CPU: interpreted, first config only (no tuning)

Rows are printed and written to --json as each finishes; SIGINT ends the run keeping them (exit 130).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "tests")) if p not in sys.path]

from specopd.errors import write_replace  # noqa: E402  (after the checkout is on sys.path)


def autotuners() -> dict:
    """{module.kernel: Triton Autotuner} of every loaded fla module (under ``triton.heuristics`` wrappers too)."""
    from triton.runtime.autotuner import Autotuner

    out = {}
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for attr, obj in vars(mod).items():
            for _ in range(4):  # heuristics(autotune(jit)): unwrap to the autotuner
                if isinstance(obj, Autotuner) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, Autotuner) and getattr(obj.base_fn, "__module__", None) == name:
                out[f"{name}.{attr}"] = obj
    return out


def tuned(tuners: dict) -> dict:
    """{kernel: {configs, bench_s}} for the autotuners that have tuned a key in this process (bench_s: Triton's
    own timing of that tuning, every config compiled and run; None when the result came from the disk cache)."""
    return {k: {"configs": len(t.configs), "bench_s": round(getattr(t, "bench_time", float("nan")), 3)
                if hasattr(t, "bench_time") else None}
            for k, t in tuners.items() if getattr(t, "cache", None)}


def first_and_second(fn, cuda: bool) -> tuple:
    """(seconds of the first call, seconds of the second), synchronised."""
    import torch

    times = []
    for _ in range(2):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[0], times[1]


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32, help="value heads (qwen4_exp's GDN layers: 32; 27B: 48)")
    ap.add_argument("--dim", type=int, default=128, help="key = value head dim")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="toy shape, CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print("command:", " ".join([os.path.basename(sys.executable)] + sys.argv), flush=True)
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--tiny runs fla interpreted: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        import fla_shims  # tests/fla_shims.py: fla's kernels under the interpreter

        fla_shims.install()
        args.T, args.heads, args.dim, args.dtypes = 40, 2, 16, "float32"
    import torch

    from specopd_kernels.gated_delta.fla_chunk import fla_available, fla_chunk_gated_delta_rule

    rows = []

    def add(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            write_replace(args.json, json.dumps(rows, indent=1))

    if not fla_available():
        add(kind="missing", note="fla-core does not import here (carry its wheel: benchmarks/gpu_wheels.txt)")
        return 3
    from fla.modules.causal_conv1d import causal_conv1d  # optional (gpu extra)

    from bench_kernels import gdn_inputs  # benchmarks/bench_kernels.py

    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    tuners = autotuners()
    add(kind="setup", device=torch.cuda.get_device_name() if cuda else "cpu (interpreted)",
        fla_autotuners_loaded=len(tuners), cache_dir=os.environ.get("TRITON_CACHE_DIR"),
        cache_autotuning=os.environ.get("TRITON_CACHE_AUTOTUNING"), f32_default=os.environ.get("TRITON_F32_DEFAULT"))
    g = torch.Generator().manual_seed(0)
    try:
        for name in [d for d in args.dtypes.split(",") if d]:
            dt = getattr(torch, name)
            q, k, v, gg, beta = gdn_inputs(1, args.T, args.heads, args.dim, args.dim, dev, dt, g)
            first, second = first_and_second(
                lambda: fla_chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, checkpoint_every=64), cuda)
            add(kind="prefill", dtype=name, T=args.T, heads=args.heads, dim=args.dim, first_call_s=round(first, 3),
                second_call_ms=round(1e3 * second, 3), tuning_and_compile_s=round(first - second, 3),
                tuned=tuned(tuners))
            x = torch.randn(1, args.T, 3 * args.heads * args.dim, generator=g).to(dev, dt)
            w = torch.randn(3 * args.heads * args.dim, 4, generator=g).to(dev, dt)
            before = set(tuned(tuners))
            first, second = first_and_second(lambda: causal_conv1d(x=x, weight=w, bias=None, activation="silu"), cuda)
            add(kind="causal_conv1d", dtype=name, T=args.T, channels=x.shape[-1], first_call_s=round(first, 3),
                second_call_ms=round(1e3 * second, 3), tuning_and_compile_s=round(first - second, 3),
                tuned={k: v for k, v in tuned(tuners).items() if k not in before})
        every = tuned(tuners)
        add(kind="total", tuned_kernels=len(every), configs=sum(v["configs"] for v in every.values()),
            bench_s=round(sum(v["bench_s"] or 0.0 for v in every.values()), 3))
    except KeyboardInterrupt:
        add(kind="cut", note="SIGINT (the step's time limit) during the first calls: Triton's autotuning lines "
                             "above say which kernels finished tuning")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
