"""Linear layers with the weight packed once for oneDNN (``kernels/layer_ops/cpu.py``: PackedWeight, linear) against
``F.linear``, side by side in one run: each SmolLM2-135M projection at the row counts the jobs use, then greedy
autoregressive decoding of the real target at batch 1 with the switch on and off (alternating per prompt).

fp32 rows: ``F.linear`` is MKL's sgemm; the packed call is oneDNN's fp32 kernel (``kernels.cpu_linear=all``, off by
default: not ``F.linear``'s bits). bf16 rows: both are oneDNN's kernel, the same bits; ``F.linear`` reorders the
weight on every call. Rates are the median of 7 interleaved repetitions; only ratios mean anything on a shared CPU.

    python benchmarks/bench_linear.py [--rows 1,5,32,341,1536] [--prompts 4] [--new 48]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specopd.models.common import hand_down  # noqa: E402
from specopd_kernels.paths import KernelsConfig  # noqa: E402
from specopd_kernels.layer_ops import cpu as layer_ops  # noqa: E402

LAYERS = {"q / o": (576, 576), "k / v": (576, 192), "gate + up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}  # SmolLM2-135M: name -> (in K, out N)


def _median_s(fns: dict, flops: float, reps: int = 7) -> dict:
    """{name: GFLOP/s}: median over ``reps`` interleaved timings of each fn, enough calls for ~20 ms each."""
    n = max(2, int(4e9 / flops))
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            times[k].append((time.perf_counter() - t0) / n)
    return {k: flops / statistics.median(v) / 1e9 for k, v in times.items()}


def bench_layers(rows: list) -> str:
    lines = ["| layer | rows | fp32 F.linear | fp32 packed | packed / F.linear | bf16 F.linear | bf16 packed | "
             "packed / F.linear | bf16 packed / fp32 packed |", "|---|---|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in LAYERS.items():
        for m in rows:
            if name == "lm_head" and m > 512:
                continue  # the jobs' lm_head rows are chunked
            x32, w32 = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
            fns = {}
            for dt in (torch.float32, torch.bfloat16):
                x, w = x32.to(dt), w32.to(dt)
                packed = layer_ops.PackedWeight().get(w)
                fns[(dt, "F")] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
                fns[(dt, "P")] = lambda x=x, p=packed: layer_ops.linear(x, p)
            r = _median_s(fns, 2.0 * m * k * n)
            f32, p32, f16, p16 = (r[(torch.float32, "F")], r[(torch.float32, "P")], r[(torch.bfloat16, "F")],
                                  r[(torch.bfloat16, "P")])
            lines.append(f"| {name} [{k} -> {n}] | {m} | {f32:.0f} | {p32:.0f} | {p32 / f32:.2f}x | {f16:.0f} | "
                         f"{p16:.0f} | {p16 / f16:.2f}x | {p16 / p32:.2f}x |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


@torch.no_grad()
def bench_decode(n_prompts: int, n_new: int) -> str:
    """Greedy autoregressive tokens/s of SmolLM2 at batch 1, each prompt decoded with the switch off then on."""
    from specopd.data.conversations import heldout_prompt_ids
    from specopd.eval import autoregressive
    from specopd.data.smollm2 import prepare_smollm2
    from specopd.models import load_target

    target_dir = prepare_smollm2()  # converted once (~30 s), then found
    prompts = heldout_prompt_ids(target_dir, 49152, n_prompts)
    lines = ["| target | kernels.cpu_linear | tokens/s | vs F.linear | same tokens |", "|---|---|---|---|---|"]
    for dt, on in ((torch.float32, "all"), (torch.bfloat16, "auto")):
        t = load_target(target_dir, dtype=dt)
        secs, toks, outs = {"torch": 0.0, on: 0.0}, {"torch": 0, on: 0}, {"torch": [], on: []}
        for i, p in enumerate(prompts):
            for mode in ("torch", on) if i % 2 == 0 else (on, "torch"):
                hand_down(t, KernelsConfig(cpu_linear=mode))
                autoregressive(t, p, 2, temperature=0.0)  # warm-up (packs on the first call)
                t0 = time.perf_counter()
                out = autoregressive(t, p, n_new, temperature=0.0).tokens
                secs[mode] += time.perf_counter() - t0
                toks[mode] += out.numel()
                outs[mode].append(out)
        same = all(torch.equal(a, b) for a, b in zip(outs["torch"], outs[on]))
        base = toks["torch"] / secs["torch"]
        for mode in ("torch", on):
            rate = toks[mode] / secs[mode]
            lines.append(f"| {str(dt)[6:]} | {mode} | {rate:.1f} | {rate / base:.2f}x | {same} |")
        print("\n".join(lines[-2:]), flush=True)
        del t
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,5,32,341,1536")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args(argv)
    print("command: python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] +
                                         list(argv if argv is not None else sys.argv[1:])))
    if not layer_ops.packing_available():
        print("oneDNN has no native bf16 on this CPU (or the probe failed): nothing to compare")
        return 1
    print(f"threads {torch.get_num_threads()}; GFLOP/s (median of 7 interleaved)")
    layers = bench_layers([int(r) for r in args.rows.split(",")])
    dec = "" if args.no_decode else bench_decode(args.prompts, args.new)
    print("\n" + layers + ("\n\n" + dec if dec else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
