"""Drafter forward + backward at scale: shared-context branch attention vs the per-branch reference.

    python benchmarks/bench_drafter.py                      # N sweep at T = 2048, T sweep at N = 128
    python benchmarks/bench_drafter.py --quick              # smaller sweeps

What is measured: ``drafter.hidden(features, anchors, ...)`` (all draft layers, context fc + K/V, the
branch attention, the final norm; the lm_head / loss are the fused loss's business) and the backward of
``(h * g).sum()``, for N branches on one trunk of T feature rows, anchors spread over [1, T], block_size S.
Two attention paths, same weights and inputs:
- shared:     ``specopd.drafters.attention`` (CPU: the exact chunked path; CUDA: flex_attention)
- per-branch: ``tests.dflash_reference.per_branch_attention`` (each branch gathers its own copy of the
              context K/V, [N, T, Hkv, hd] per layer, and a dense mask: v0.1's way)
Points: an N sweep at fixed T, a T sweep at fixed N, and a few "cross" points off both lines.
Memory: every point runs in a fresh subprocess; CPU = peak RSS during forward + backward minus the RSS
before it (``ru_maxrss``); CUDA = ``torch.cuda.max_memory_allocated`` minus the allocation before. Time =
median of ``--repeats`` forward + backward. Exponents: least-squares slope of log(memory) and log(time)
against log(N) (resp. log(T)); a least-squares fit mem = c0 + c1 * T + c2 * N * S + c3 * N * T over all
points shows which term each path pays (c3: bytes per branch per context row, the per-branch copy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_point(args) -> dict:
    """One (method, N, T) measurement in this process."""
    import torch

    sys.path.insert(0, ROOT)
    from specopd.drafters import build_drafter
    from specopd.models import load_target
    from specopd.models.tiny import build_tiny_target
    from tests.dflash_reference import per_branch_attention

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    folder = build_tiny_target("llama", os.path.join(args.cache, f"bench-target-{args.hidden}"), seed=0, overrides={
        "hidden_size": args.hidden, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads, "intermediate_size": 2 * args.hidden, "vocab_size": 512,
        "num_hidden_layers": 4})
    target = load_target(folder, device=dev)
    d = build_drafter("dflash", target, num_layers=args.layers, block_size=args.block, seed=0)
    if args.method == "per_branch":
        d.attention_backend = per_branch_attention
    g = torch.Generator().manual_seed(0)
    n, t = args.n, args.t
    feats = [torch.randn(t, len(d.feature_layers) * args.hidden, generator=g).to(dev)]
    anchors = torch.linspace(1, t, n).round().long().to(dev)  # sorted, spread over the trunk, last = T
    atok = torch.randint(0, 512, (n,), generator=g).to(dev)
    grad = torch.randn(n, args.block - 1, args.hidden, generator=g).to(dev)

    def step():
        h = d.hidden(feats, anchors, None, atok)
        (h * grad).sum().backward()
        d.zero_grad(set_to_none=True)

    if dev.type == "cuda":
        step()  # warm-up: flex_attention compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        mem = torch.cuda.max_memory_allocated() - base
    else:
        # the first step measures memory: the setup (tiny target, features) peaks far below it, and with a fixed
        # glibc mmap threshold (set by the parent) freed blocks go back to the OS, so RSS follows the tensors
        base = _rss_bytes()
        step()
        mem = _peak_rss_bytes() - base
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"method": args.method, "N": n, "T": t, "mem_bytes": int(mem), "time_s": statistics.median(times)}


def _spawn(args, method, n, t) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--point", "--method", method, "--n", str(n), "--t", str(t)]
    for k in ("threads", "device", "hidden", "heads", "kv_heads", "layers", "block", "repeats", "cache"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_="65536")  # a fixed threshold: see run_point
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        return {"method": method, "N": n, "T": t, "error": out.stderr.strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _slope(xs, ys) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1)) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _linfit(rows, s) -> list:
    """Least squares mem = c0 + c1 T + c2 N S + c3 N T (bytes per unit)."""
    import torch

    a = torch.tensor([[1.0, r["T"], r["N"] * s, r["N"] * r["T"]] for r in rows], dtype=torch.float64)
    b = torch.tensor([float(r["mem_bytes"]) for r in rows], dtype=torch.float64)
    return torch.linalg.lstsq(a, b[:, None]).solution[:, 0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="shared", choices=["shared", "per_branch"])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--ns", default="64,128,256,512", help="N sweep (at --t-fixed)")
    ap.add_argument("--ts", default="512,1024,2048,4096", help="T sweep (at --n-fixed)")
    ap.add_argument("--cross", default="512x512,64x4096", help="NxT points off both sweeps (they make the linear "
                                                             "fit well posed: on the two sweeps N*T is collinear)")
    ap.add_argument("--t-fixed", type=int, default=2048)
    ap.add_argument("--n-fixed", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="--ns 32,64,128 --ts 256,512,1024 --t-fixed 1024 --n-fixed 64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="block_size S (counts the anchor)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(ROOT, "runs", "bench-drafter"))
    ap.add_argument("--json", help="write all points here")
    args = ap.parse_args()
    if args.point:
        print(json.dumps(run_point(args)))
        return
    if args.quick:
        args.ns, args.ts, args.t_fixed, args.n_fixed, args.cross = "32,64,128", "256,512,1024", 1024, 64, "128x256"
    print("command: python benchmarks/bench_drafter.py " + " ".join(sys.argv[1:]))
    print(f"drafter: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv heads, "
          f"block_size S={args.block}; {args.device}, {args.threads} thread(s); forward + backward of hidden()")
    ns, ts = [int(x) for x in args.ns.split(",")], [int(x) for x in args.ts.split(",")]
    sweeps = {"N": [(n, args.t_fixed) for n in ns], "T": [(args.n_fixed, t) for t in ts],
              "cross": [tuple(int(v) for v in p.split("x")) for p in args.cross.split(",") if p]}
    rows = []
    for name, pts in sweeps.items():
        for n, t in pts:
            for method in ("shared", "per_branch"):
                r = _spawn(args, method, n, t)
                r["sweep"] = name
                rows.append(r)
                msg = r.get("error") or f"{r['mem_bytes'] / 2**20:9.1f} MiB {r['time_s'] * 1e3:9.1f} ms"
                print(f"  {name}-sweep N={n:5d} T={t:5d} {method:10s} {msg}", flush=True)
    print("\n| sweep | N | T | N*S | shared MiB | per-branch MiB | mem ratio | shared ms | per-branch ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, pts in sweeps.items():
        for n, t in pts:
            a = next(r for r in rows if r["sweep"] == name and r["N"] == n and r["T"] == t and r["method"] == "shared")
            b = next(r for r in rows if r["sweep"] == name and r["N"] == n and r["T"] == t and r["method"] == "per_branch")
            if "error" in a or "error" in b:
                print(f"| {name} | {n} | {t} | {n * args.block} | {a.get('error', '')} | {b.get('error', '')} | | | |")
                continue
            print(f"| {name} | {n} | {t} | {n * args.block} | {a['mem_bytes'] / 2**20:.1f} | {b['mem_bytes'] / 2**20:.1f} "
                  f"| {b['mem_bytes'] / max(a['mem_bytes'], 1):.1f}x | {a['time_s'] * 1e3:.0f} | {b['time_s'] * 1e3:.0f} |")
    print("\nexponents (log-log slope) | memory vs N | memory vs T | time vs N | time vs T")
    for method in ("shared", "per_branch"):
        rn = [r for r in rows if r["method"] == method and r["sweep"] == "N" and "error" not in r]
        rt = [r for r in rows if r["method"] == method and r["sweep"] == "T" and "error" not in r]
        if len(rn) > 1 and len(rt) > 1:
            print(f"{method:10s} | {_slope([r['N'] for r in rn], [r['mem_bytes'] for r in rn]):.2f} | "
                  f"{_slope([r['T'] for r in rt], [r['mem_bytes'] for r in rt]):.2f} | "
                  f"{_slope([r['N'] for r in rn], [r['time_s'] * 1e6 for r in rn]):.2f} | "
                  f"{_slope([r['T'] for r in rt], [r['time_s'] * 1e6 for r in rt]):.2f}")
    print("\nlinear fit mem = c0 + c1*T + c2*N*S + c3*N*T (bytes per unit; c3 is the per-branch context copy)")
    for method in ("shared", "per_branch"):
        ok = [r for r in rows if r["method"] == method and "error" not in r]
        if len(ok) >= 4:
            c = _linfit(ok, args.block)
            print(f"{method:10s} c0 {c[0] / 2**20:8.1f} MiB  c1 {c[1]:9.0f}  c2 {c[2]:9.0f}  c3 {c[3]:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
