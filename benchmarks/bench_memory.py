"""Peak memory of the drafter loss: the fused chunked E2E-TV (``fused_e2e_tv`` from hidden states) against
the full-logit ``e2e_tv_loss`` (q and p logits [N, W, V] materialised, as the v0.1 worker does), over a grid
of branches N, drafted tokens W and vocabularies V; then a least-squares fit of how the peak grows:

    peak = a + b * (N W) + c * V + d * (N W V)      (bytes)

Full logits: d is the bytes per [N, W, V] entry alive at the peak (~16-20). Fused: d ~ 0, c ~ the chunk's
working set per vocabulary entry (``CHUNK_WORKSET_FACTOR * chunk_rows * 4``), b ~ the [N, W, D] inputs and
their gradients.

Each point runs in a fresh process (``--one``): the peak is the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs after the inputs exist) on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA, minus
what was live before the loss (inputs, weights). The forward + backward time is reported side by side.

    python benchmarks/bench_memory.py                    # the default grid (CPU: ~2 min on 1 core)
    python benchmarks/bench_memory.py --device cuda --V 151936 --NW 1024,4096,16384,61440

Round 2 (after the worker integration) adds ``--what step``: one whole SpecOPD step's peak against the
memory plan (``specopd.memory``) over a grid of V, N, W and T.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------ one measurement
def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_one(method: str, n: int, w: int, v: int, d: int, device: str, chunk, temperature: float,
                dtype: str, seed: int = 0) -> dict:
    """Loss forward + backward once; returns {peak_bytes, seconds, loss} (peak above the live inputs)."""
    import torch

    from specopd.losses import e2e_tv_loss, fused_e2e_tv, resolve_chunk_rows

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device=device, dtype=dt)
    hq = (torch.randn(n, w, d, generator=g) * 3).to(device=device, dtype=dt).requires_grad_(True)
    hp = (torch.randn(n, w, d, generator=g) * 3).to(device=device, dtype=dt)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        if not _rss_peak_reset():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
        base = _status("VmRSS")
    t0 = time.perf_counter()
    if method == "fused":
        loss = fused_e2e_tv(hq, weight, hp, temperature=temperature, chunk_rows=chunk).loss
    else:  # the v0.1 path: the drafter returns q logits [N, W, V], the target p logits [N, W, V]
        q = (hq @ weight.t()).float()
        with torch.no_grad():
            p = (hp @ weight.t()).float()
        loss = e2e_tv_loss(q, p, temperature=temperature)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - base
    return {"peak_bytes": int(peak), "seconds": sec, "loss": float(loss.detach()),
            "chunk_rows": resolve_chunk_rows(chunk, v, device) if method == "fused" else None}


# ------------------------------------------------------------------------------------------ the grid
def fit(rows: list) -> dict:
    """Least squares peak = a + b NW + c V + d NWV over the measured rows (needs >= 4 distinct points)."""
    import torch

    x = torch.tensor([[1.0, r["NW"], r["V"], r["NW"] * r["V"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([float(r["peak_bytes"]) for r in rows], dtype=torch.float64)
    if x.shape[0] < 4:
        return {}
    scale = x.abs().amax(0).clamp(min=1)
    coef = torch.linalg.lstsq(x / scale, y[:, None]).solution[:, 0] / scale
    pred = x @ coef
    r2 = 1 - float(((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum().clamp(min=1e-9))
    return {"a": float(coef[0]), "b_per_NW": float(coef[1]), "c_per_V": float(coef[2]), "d_per_NWV": float(coef[3]),
            "r2": r2}


def exponents(rows: list) -> dict:
    """log-log slopes: peak ~ (NW)^e1 V^e2 (a coarse summary next to the linear fit)."""
    import torch

    if len(rows) < 3:
        return {}
    x = torch.tensor([[1.0, math.log(r["NW"]), math.log(r["V"])] for r in rows], dtype=torch.float64)
    y = torch.tensor([math.log(max(r["peak_bytes"], 1)) for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    return {"NW": float(coef[1]), "V": float(coef[2])}


def run_point(args, method, n, w, v) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, str(n), str(w), str(v), "--D", str(args.D),
           "--device", args.device, "--chunk", str(args.chunk), "--temperature", str(args.temperature),
           "--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=4, metavar=("METHOD", "N", "W", "V"), help=argparse.SUPPRESS)
    ap.add_argument("--V", default="8192,32768,151936", help="vocabulary sizes")
    ap.add_argument("--NW", default="256,1024,4096", help="branch rows N * W (N = NW / W)")
    ap.add_argument("--W", type=int, default=16, help="drafted tokens per branch")
    ap.add_argument("--T", default="", help="trunk lengths (round 2: the whole-step grid; unused by the loss)")
    ap.add_argument("--D", type=int, default=256, help="hidden size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", default="auto", help="fused loss chunk rows (int or auto)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--full-limit-gb", type=float, default=1.0,
                    help="skip the full-logit reference when one [N, W, V] fp32 tensor exceeds this")
    ap.add_argument("--what", default="loss", choices=["loss", "step"])
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", help="write the rows and fits here")
    args = ap.parse_args(argv)
    if args.one:
        method, n, w, v = args.one[0], *map(int, args.one[1:])
        chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
        print(json.dumps(measure_one(method, n, w, v, args.D, args.device, chunk, args.temperature, args.dtype)))
        return 0
    if args.what == "step":
        print("bench_memory: --what step (one SpecOPD step against the memory plan) needs the fused loss wired "
              "into the worker (issue 10, round 2); only --what loss is available now", file=sys.stderr)
        return 2
    vs = [int(x) for x in args.V.split(",")]
    nws = [int(x) for x in args.NW.split(",")]
    print("command: python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"device {args.device}, {args.dtype}, D={args.D}, W={args.W}, T={args.temperature}, chunk {args.chunk}; "
          f"peak = {'max_memory_allocated' if args.device.startswith('cuda') else 'peak RSS'} above the live inputs")
    rows = []
    hdr = f"| V | N | W | N*W | full peak MiB | fused peak MiB | ratio | full s | fused s | chunk rows | |loss diff| |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for v in vs:
        for nw in nws:
            n, w = max(1, nw // args.W), args.W
            res = {}
            for method in ("full", "fused"):
                if method == "full" and n * w * v * 4 > args.full_limit_gb * 1e9:
                    res[method] = {"skipped": True}
                    continue
                res[method] = run_point(args, method, n, w, v)
                if "peak_bytes" in res[method]:
                    rows.append({"method": method, "V": v, "N": n, "W": w, "NW": n * w, **res[method]})
            f, u = res["full"], res["fused"]
            mib = lambda r: f"{r['peak_bytes'] / 2**20:.1f}" if "peak_bytes" in r else (  # noqa: E731
                "skipped" if r.get("skipped") else "error")
            sec = lambda r: f"{r['seconds']:.3f}" if "seconds" in r else "-"  # noqa: E731
            ratio = (f"{f['peak_bytes'] / max(u['peak_bytes'], 1):.1f}x" if "peak_bytes" in f and "peak_bytes" in u
                     else "-")
            diff = (f"{abs(f['loss'] - u['loss']):.1e}" if "loss" in f and "loss" in u else "-")
            print(f"| {v} | {n} | {w} | {n * w} | {mib(f)} | {mib(u)} | {ratio} | {sec(f)} | {sec(u)} | "
                  f"{u.get('chunk_rows', '-')} | {diff} |", flush=True)
            for r in (f, u):
                if "error" in r:
                    print(f"  error: {r['error']}")
    fits = {}
    for method in ("full", "fused"):
        sel = [r for r in rows if r["method"] == method]
        fits[method] = {"linear": fit(sel), "loglog": exponents(sel), "points": len(sel)}
    print("\nfit: peak = a + b * NW + c * V + d * NW * V (bytes); log-log exponents of NW and V")
    print("| method | points | a MiB | b B per row | c B per vocab entry | d B per [N,W,V] entry | R^2 | exp NW "
          "| exp V |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, fx in fits.items():
        lin, ll = fx["linear"], fx["loglog"]
        if not lin:
            print(f"| {method} | {fx['points']} | too few points | | | | | | |")
            continue
        print(f"| {method} | {fx['points']} | {lin['a'] / 2**20:.1f} | {lin['b_per_NW']:.0f} | {lin['c_per_V']:.0f} | "
              f"{lin['d_per_NWV']:.2f} | {lin['r2']:.4f} | {ll.get('NW', float('nan')):.2f} | "
              f"{ll.get('V', float('nan')):.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "fits": fits, "args": vars(args)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
