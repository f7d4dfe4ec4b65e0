"""One EAGLE-3 training-time-test (TTT) step on the CPU, part by part, two ways side by side in one run.

The step of recipes/smollm2-135m-eagle3-sharegpt.yaml (``trainer.method: offpolicy_ce`` with ``drafter.kind:
eagle3``: the reference's tokens fed for W steps on the drafter's own hidden states, SpecForge's soft CE against
the target's p), on ONE worker in this process, its parts timed:

    prefill    the target over the step's trunks (features + final hidden states)
    context    the drafter's causal pass over the trunk rows (forward)
    unroll     the W - 1 TTT steps after it (forward)
    loss       ``fused_ttt``'s forward (q's and p's logits, chunk by chunk)
    backward   the loss's and the drafter's backward
    optimizer  clip + AdamW
    other      the rest (score: hp taken from the trunk; anchors, bookkeeping)
Times are CPU seconds of this process (``time.process_time``), not wall time: on a shared machine other jobs'
load then hardly counts (run with OMP_NUM_THREADS=1 for the work of one core).

Ways (``--ways``), each on its own drafter (same seed, same target, same batches, steps alternating so a
load change on the shared machine hits all alike; the first ``--warmup`` steps are not timed):
    early      ``fused_ttt``'s gradient made in its forward pass (the default)
    recompute  ``fused_ttt(early_grad=False)``: each chunk's logits made again in the backward
    dnn        ``early`` with ``kernels.cpu_linear=all``: q's fp32 head products through oneDNN (opt-in; within
               fp32 rounding, not torch.mm's bits)
    base       with ``--base REV``: the ``fused_ttt`` of specopd/losses.py at git revision REV (the code before a
               change), loaded beside this one in the same process
early, recompute and base compute the same numbers: the table says whether their losses agreed bit for bit at every
step (dnn: its largest relative distance from the first way's). Only the loss differs between the ways; a change
elsewhere is measured with benchmarks/compare_commits.py.
The machine is shared: only the ratios of one run mean anything.

    python benchmarks/bench_eagle3_ttt.py [--recipe R] [--batch 4] [--steps 3] [--warmup 1]
                                          [--ways early,recompute,base] [--base main] [--json out.json] [key=value ...]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "smollm2-135m-eagle3-sharegpt.yaml")
PARTS = ("prefill", "context", "unroll", "loss", "backward", "optimizer", "other", "step")
WAYS = ("early", "recompute", "dnn", "base")
EXACT = ("early", "recompute", "base")  # the same bits


def base_fused_ttt(rev: str):
    """``fused_ttt`` of specopd/losses.py at git revision ``rev``, imported from a temporary copy of that file."""
    import importlib.util

    text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:specopd/losses.py"], capture_output=True, text=True,
                          check=True).stdout
    folder = tempfile.mkdtemp(prefix="bench-eagle3-ttt-")
    path = os.path.join(folder, "losses_base.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("losses_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_ttt


CLOCK = time.process_time  # CPU seconds of this process: on a shared machine, others' load does not count (with
# one thread, the work of this step only; with more, summed over them)


class Timed:
    """``fn`` with the CPU seconds of each call kept in ``self.s``."""

    def __init__(self, fn):
        self.fn, self.s = fn, []

    def __call__(self, *a, **k):
        t0 = CLOCK()
        out = self.fn(*a, **k)
        self.s.append(CLOCK() - t0)
        return out


def build(recipe: str, overrides: list, out: str, target=None):
    from specopd.config import load_recipe
    from specopd.train.worker import Worker

    cfg = load_recipe(recipe, ["profile.enabled=false", "trainer.eval_heldout=false", "trainer.eval_every=0",
                               "runtime.backend=local", "runtime.num_workers=1", f"trainer.output_dir={out}",
                               *overrides])
    return Worker(cfg, target=target)


def one_step(w, ids, step, loss_fn) -> dict:
    """One step of worker ``w`` on samples ``ids`` with ``loss_fn`` as ``fused_ttt``; its parts' CPU seconds and the
    loss."""
    from specopd.train import phases

    wrapped = {name: Timed(getattr(phases, name)) for name in
               ("fused_ttt", "prefill", "propose", "score", "loss_backward", "optimizer_step")}
    wrapped["fused_ttt"] = Timed(loss_fn)
    real = {name: getattr(phases, name) for name in wrapped}
    rows = Timed(w.drafter.rows)
    w.drafter.rows = rows  # an instance attribute over the method: its first call is the context pass
    for name, fn in wrapped.items():
        setattr(phases, name, fn)
    try:
        t0 = CLOCK()
        m = phases.finish(w, phases.stage(w, ids, step)["branches"])
        total = CLOCK() - t0
    finally:
        for name, fn in real.items():
            setattr(phases, name, fn)
        del w.drafter.rows
    t = {name: sum(f.s) for name, f in wrapped.items()}
    ctx = rows.s[0] if rows.s else 0.0
    parts = {"prefill": t["prefill"], "context": ctx, "unroll": t["propose"] - ctx, "loss": t["fused_ttt"],
             "backward": t["loss_backward"] - t["fused_ttt"], "optimizer": t["optimizer_step"], "step": total}
    parts["other"] = total - sum(v for k, v in parts.items() if k != "step")
    return {"parts": parts, "loss": m["loss"], "branches": m["branches"]}


def run(recipe: str, overrides: list, ways: list, steps: int, warmup: int, base: str = "") -> dict:
    import torch

    from specopd.losses import fused_ttt
    from specopd.train.data import BatchOrder

    from specopd_kernels.paths import KernelsConfig

    dnn = KernelsConfig(cpu_linear="all")
    fns = {"early": fused_ttt, "recompute": functools.partial(fused_ttt, early_grad=False),
           "dnn": lambda *a, **k: fused_ttt(*a, **{**k, "kernel_paths": dnn})}
    if "base" in ways:
        old = base_fused_ttt(base)
        fns["base"] = lambda *a, kernel_paths=None, **k: old(*a, **k)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        workers, shared = {}, None
        for way in ways:
            workers[way] = build(recipe, overrides, os.path.join(tmp, way), target=shared)
            shared = workers[way].target
        w0 = workers[ways[0]]
        order = BatchOrder(w0.train_ids, w0.cfg.data.batch_size, w0.cfg.data.seed)
        times = {way: {p: [] for p in PARTS} for way in ways}
        losses = {way: [] for way in ways}
        branches = 0
        for step in range(steps + warmup):
            ids = order.next()
            for way, w in workers.items():
                r = one_step(w, ids, step, fns[way])
                losses[way].append(r["loss"])
                branches = r["branches"]
                print(f"  step {step} {way:9s} {r['parts']['step']:.2f} CPU s  loss {r['loss']:.6f}", flush=True)
                if step >= warmup:
                    for p in PARTS:
                        times[way][p].append(r["parts"][p])
        c = w0.cfg
        setup = {"recipe": os.path.relpath(recipe, ROOT), "overrides": overrides, "batch_size": c.data.batch_size,
                 "seq_len": c.data.seq_len, "anchors_per_seq": c.trainer.anchors_per_seq, "W": w0.W,
                 "branches": branches, "vocab": int(w0.target.vocab_size), "dtype": str(w0.target.dtype),
                 "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup}
    return {"setup": setup, "median_s": {way: {p: statistics.median(v) for p, v in t.items()} for way, t in
                                         times.items()},
            "losses": losses, "losses_equal": all(losses[way] == losses[ways[0]] for way in ways if way in EXACT),
            "max_rel_loss_diff": {way: max(abs(a - b) / abs(b) for a, b in zip(losses[way], losses[ways[0]]))
                                  for way in ways}}


def table(r: dict) -> str:
    ways = list(r["median_s"])
    med = r["median_s"]
    head = "| part | " + " | ".join(f"{w} share" for w in ways) + " |" + \
        "".join(f" {w} / {ways[0]} |" for w in ways[1:])
    lines = [head, "|" + "---|" * (1 + 2 * len(ways) - 1)]
    for p in PARTS:
        cells = [f"{med[w][p] / med[w]['step']:.1%}" if p != "step" else f"{med[w][p]:.2f} CPU s" for w in ways]
        ratios = [f"{med[w][p] / med[ways[0]][p]:.2f}x" if med[ways[0]][p] > 0 else "-" for w in ways[1:]]
        lines.append(f"| {p} | " + " | ".join(cells) + " |" + "".join(f" {x} |" for x in ratios))
    return "\n".join(lines)


def main(argv=None) -> int:
    from specopd.eval.bench import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--batch", type=int, default=4, help="data.batch_size (the recipe's: 16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ways", default="early,recompute", help=f"comma-separated, from {list(WAYS)}")
    ap.add_argument("--base", default="main", help="the git revision of the way 'base'")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    a = ap.parse_args(argv)
    ways = [x for x in a.ways.split(",") if x]
    if not ways or any(x not in WAYS for x in ways):
        ap.error(f"--ways: comma-separated names from {list(WAYS)}; got {a.ways!r}")
    print("command: python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]))
    import torch

    print(f"CPU: {cpu_name()}, torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    r = run(a.recipe, [f"data.batch_size={a.batch}", *a.overrides], ways, a.steps, a.warmup, a.base)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    s = r["setup"]
    print(f"\n{s['recipe']} {' '.join(s['overrides'])}: {s['branches']} branches x W = {s['W']} TTT steps, "
          f"vocabulary {s['vocab']}, target {s['dtype']}; median of {s['steps']} steps after {s['warmup']}")
    print(table(r))
    exact = [w for w in ways if w in EXACT]
    print(f"losses of {', '.join(exact)} equal bit for bit at every step: {'yes' if r['losses_equal'] else 'NO'}")
    for w in ways:
        if w not in EXACT:
            print(f"{w}: largest relative distance of its loss from {ways[0]}'s: {r['max_rel_loss_diff'][w]:.2e}")
    if "base" in ways:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", a.base], capture_output=True, text=True)
        print(f"base: specopd/losses.py at {a.base} ({sha.stdout.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
