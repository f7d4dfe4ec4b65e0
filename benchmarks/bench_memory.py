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

``--what step``: one whole SpecOPD training step (``phases.colocated_step``: prefill, the one drafter forward,
chunked sampling, packed scoring, the fused loss, backward, AdamW) on a tiny llama-architecture target of
hidden size ``--D`` and vocabulary V, over a grid of V, N = S * B branches (S sequences x B anchors), W drafted
tokens and T trunk tokens (random token data: memory does not depend on the content). Each point runs in a fresh
process: one warm-up step (AdamW allocates its state), then the peak RSS of a second step above the RSS before
it, next to the memory plan's step part (``specopd.memory``: the peak phase minus the terms resident between
steps: weights and AdamW state). The fit

    step peak = a + b * (N W) + c * V + d * (N W V) + e * (S T) + f * (N T)      (bytes)

shows how it grows: linear in N * W, a chunk-sized V term, no N * W * V and no N * T term.

    python benchmarks/bench_memory.py --what step      # the default step grid (CPU: ~10 min on 1 core)
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


def _peak_start(cuda: bool) -> int:
    """Reset the peak counter (the allocator's on CUDA, VmHWM on the CPU) -> the bytes held now (base)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    if not _rss_peak_reset():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
    return _status("VmRSS")


def _peak_now(cuda: bool) -> int:
    """The peak since ``_peak_start`` (absolute bytes; after a CUDA sync)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status("VmHWM")


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
    base = _peak_start(cuda)
    t0 = time.perf_counter()
    if method == "fused":
        loss = fused_e2e_tv(hq, weight, hp, temperature=temperature, chunk_rows=chunk).loss
    else:  # the v0.1 path: the drafter returns q logits [N, W, V], the target p logits [N, W, V]
        q = (hq @ weight.t()).float()
        with torch.no_grad():
            p = (hp @ weight.t()).float()
        loss = e2e_tv_loss(q, p, temperature=temperature)
    loss.backward()
    peak = _peak_now(cuda) - base
    sec = time.perf_counter() - t0
    return {"peak_bytes": int(peak), "seconds": sec, "loss": float(loss.detach()),
            "chunk_rows": resolve_chunk_rows(chunk, v, device) if method == "fused" else None}


# ------------------------------------------------------------------------------------------ one step
STEP_RESIDENT = ("target weights", "drafter weights (fp32)", "drafter AdamW state")
"""Plan terms alive between steps (what the RSS before the measured step already holds)."""


def step_recipe(out: str, v: int, b: int, w: int, t: int, s: int, d: int, chunk, device: str, kind: str):
    """The recipe of one step point: tiny llama (hidden d, vocab v), random prepared data of S + 1 sequences."""
    import torch

    from specopd.config import load_recipe

    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "data.jsonl")
    g = torch.Generator().manual_seed(0)
    with open(data, "w") as f:
        for i in range(s + 1):
            ids = torch.randint(0, v, (t,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "prompt_len": 8, **({"split": "heldout"} if i == s else {})}) + "\n")
    heads = max(1, d // 64)
    tiny = {"vocab_size": v, "hidden_size": d, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "head_dim": d // heads, "intermediate_size": 2 * d, "max_position_embeddings": max(2048, t)}
    return load_recipe(None, [
        "model.target=tiny:llama", f"model.tiny={json.dumps(tiny)}", f"model.device={device}",
        f"drafter.kind={kind}", f"drafter.block_size={w + 1}", "drafter.num_layers=1",
        "data.source=prepared", f"data.path={data}", f"data.seq_len={t}", f"data.batch_size={s}",
        f"trainer.anchors_per_seq={b}", f"trainer.loss_chunk_rows={chunk}", "trainer.eval_heldout=false",
        f"trainer.output_dir={out}", "profile.enabled=false"])


def measure_step(v: int, b: int, w: int, t: int, s: int, d: int, chunk, device: str, kind: str, out: str) -> dict:
    """Two training steps; the peak of the second above the memory before it, and the plan's step part."""
    import torch

    from specopd.memory import memory_plan
    from specopd.train import phases
    from specopd.train.worker import Worker

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    cfg = step_recipe(out, v, b, w, t, s, d, chunk, device, kind)
    plan = memory_plan(cfg)
    wk = Worker(cfg)
    ids = wk.train_ids[:s]
    phases.colocated_step(wk, ids, 0, None)  # warm-up: AdamW state, allocator pools
    cuda = device.startswith("cuda")
    base = _peak_start(cuda)
    t0 = time.perf_counter()
    m = phases.colocated_step(wk, ids, 1, None)
    peak = _peak_now(cuda)
    sec = time.perf_counter() - t0
    pb = plan.phase_bytes()
    resident = sum(x.bytes for x in plan.terms if x.name in STEP_RESIDENT)
    return {"step_peak_bytes": int(peak - base), "process_peak_bytes": int(peak), "seconds": sec,
            "plan_peak_bytes": int(plan.peak), "plan_step_bytes": int(plan.peak - resident),
            "plan_phase": plan.peak_phase, "plan_phases": pb, "branches": m["branches"],
            "chunk_rows": plan.sizes["chunk_rows"], "loss": m["loss"]}


def step_points(args) -> list:
    """(V, B, W, T): the base point (first value of each list), each axis varied alone, and cross points that
    separate the N W V and N T columns of the fit from the others."""
    vs, bs = [int(x) for x in args.V.split(",")], [int(x) for x in args.B.split(",")]
    ws, ts = [int(x) for x in args.Ws.split(",")], [int(x) for x in args.T.split(",")]
    base = (vs[0], bs[0], ws[0], ts[0])
    pts = [base]
    for axis, vals in enumerate((vs, bs, ws, ts)):
        for x in vals[1:]:
            p = list(base)
            p[axis] = x
            pts.append(tuple(p))
    pts += [(max(vs), max(bs), ws[0], ts[0]), (max(vs), bs[0], max(ws), max(ts)), (min(vs), max(bs), max(ws), max(ts)),
            (min(vs), max(bs), min(ws), min(ts))]
    return list(dict.fromkeys(pts))


def fit_step(rows: list) -> dict:
    """Least squares step peak = a + b NW + c V + d NWV + e ST + f NT over the measured rows."""
    import torch

    cols = ["a", "b_per_NW", "c_per_V", "d_per_NWV", "e_per_ST", "f_per_NT"]
    x = torch.tensor([[1.0, r["NW"], r["V"], r["NW"] * r["V"], r["S"] * r["T"], r["N"] * r["T"]] for r in rows],
                     dtype=torch.float64)
    if x.shape[0] < len(cols) + 1:
        return {}
    out = {}
    for key in ("step_peak_bytes", "plan_step_bytes"):
        y = torch.tensor([float(r[key]) for r in rows], dtype=torch.float64)
        scale = x.abs().amax(0).clamp(min=1)
        coef = torch.linalg.lstsq(x / scale, y[:, None]).solution[:, 0] / scale
        pred = x @ coef
        r2 = 1 - float(((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum().clamp(min=1e-9))
        out[key] = {**{c: float(v) for c, v in zip(cols, coef)}, "r2": r2}
    return out


def run_step_point(args, v, b, w, t) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--one-step", str(v), str(b), str(w), str(t),
               "--S", str(args.S), "--D", str(args.D), "--device", args.device, "--chunk", str(args.chunk),
               "--kind", args.kind, "--out", tmp]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   MALLOC_MMAP_THRESHOLD_="65536")  # large blocks go back to the OS when freed: RSS follows use
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main_step(args, argv) -> int:
    print("command: python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"one training step (the second; the first warms up), tiny llama D={args.D}, S={args.S} sequences, "
          f"{args.kind}, device {args.device}, chunk {args.chunk}; step peak = "
          f"{'max_memory_allocated' if args.device.startswith('cuda') else 'peak RSS'} of the step above the memory "
          f"before it; plan step = the plan's peak phase minus {', '.join(STEP_RESIDENT)}")
    hdr = ("| V | N | W | T | N*W | step peak MiB | plan step MiB | plan / measured | process peak MiB | "
           "plan peak MiB (phase) | chunk rows | step s |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    rows = []
    for v, b, w, t in step_points(args):
        r = run_step_point(args, v, b, w, t)
        if "error" in r:
            print(f"| {v} | {args.S * b} | {w} | {t} | error: {r['error']} |", flush=True)
            continue
        n = r["branches"]
        rows.append({"V": v, "N": n, "W": w, "T": t, "S": args.S, "NW": n * w, **r})
        mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
        print(f"| {v} | {n} | {w} | {t} | {n * w} | {mib(r['step_peak_bytes'])} | {mib(r['plan_step_bytes'])} | "
              f"{r['plan_step_bytes'] / max(r['step_peak_bytes'], 1):.2f} | {mib(r['process_peak_bytes'])} | "
              f"{mib(r['plan_peak_bytes'])} ({r['plan_phase']}) | {r['chunk_rows']} | {r['seconds']:.1f} |", flush=True)
    fits = fit_step(rows)
    if fits:
        print("\nfit: step peak = a + b * NW + c * V + d * NW * V + e * S * T + f * N * T (bytes)")
        print("| of | a MiB | b B per branch row | c B per vocab entry | d B per [N,W,V] entry | e B per trunk token "
              "| f B per branch x trunk token | R^2 |")
        print("|---|---|---|---|---|---|---|---|")
        for key, f in fits.items():
            print(f"| {'measured' if key == 'step_peak_bytes' else 'plan'} | {f['a'] / 2**20:.1f} | {f['b_per_NW']:.0f} "
                  f"| {f['c_per_V']:.0f} | {f['d_per_NWV']:.3f} | {f['e_per_ST']:.0f} | {f['f_per_NT']:.1f} | "
                  f"{f['r2']:.4f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "fits": fits, "args": vars(args)}, fh, indent=1)
    return 0


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
    ap.add_argument("--T", default="256,128,512", help="--what step: trunk lengths (first = base point)")
    ap.add_argument("--D", type=int, default=256, help="hidden size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", default="auto", help="fused loss chunk rows (int or auto)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--full-limit-gb", type=float, default=1.0,
                    help="skip the full-logit reference when one [N, W, V] fp32 tensor exceeds this")
    ap.add_argument("--what", default="loss", choices=["loss", "step"])
    ap.add_argument("--one-step", nargs=4, metavar=("V", "B", "W", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--B", default="32,8,64", help="--what step: anchors per sequence (first = base point)")
    ap.add_argument("--Ws", default="15,7", help="--what step: drafted tokens per branch (block_size - 1)")
    ap.add_argument("--S", type=int, default=2, help="--what step: sequences per step")
    ap.add_argument("--kind", default="dflash", choices=["dflash", "dspark"], help="--what step: drafter")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", help="write the rows and fits here")
    args = ap.parse_args(argv)
    if args.one:
        method, n, w, v = args.one[0], *map(int, args.one[1:])
        chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
        print(json.dumps(measure_one(method, n, w, v, args.D, args.device, chunk, args.temperature, args.dtype)))
        return 0
    if args.one_step:
        v, b, w, t = map(int, args.one_step)
        chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
        print(json.dumps(measure_step(v, b, w, t, args.S, args.D, chunk, args.device, args.kind, args.out)))
        return 0
    if args.what == "step":
        if args.V == ap.get_default("V"):
            args.V = "32768,8192,151936"  # the step grid's base point first
        return main_step(args, argv)
    vs = [int(x) for x in args.V.split(",")]
    nws = [int(x) for x in args.NW.split(",")]
    print("command: python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"device {args.device}, {args.dtype}, D={args.D}, W={args.W}, T={args.temperature}, chunk {args.chunk}; "
          f"peak = {'max_memory_allocated' if args.device.startswith('cuda') else 'peak RSS'} above the live inputs")
    rows = []
    hdr = "| V | N | W | N*W | full peak MiB | fused peak MiB | ratio | full s | fused s | chunk rows | |loss diff| |"
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
