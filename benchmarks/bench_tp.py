"""The target's side of a SpecOPD step (trunk prefill + packed tree scoring) at runtime.tensor_parallel = N
against N = 1, side by side in one run on this machine's CPUs (gloo): wall time, the collectives' share of it,
and the bytes all-reduced per pass against the formula of ``specopd/models/tensor_parallel.py``:

    bytes per pass = tokens x hidden x bytes per element x sum over layers of (1 + m_l)

one all-reduce after each token mixer and m_l after its MLP (1 dense, 1 MoE without a shared expert, 2 with one:
the routed experts and the shared expert reduce separately). A ring all-reduce sends 2 (N - 1) / N of it per rank.

    python benchmarks/bench_tp.py [--targets tiny:llama,tiny:qwen3_next,tiny:qwen4_exp,smollm2] [--tp 2]
        [--trunk 512] [--branches 64] [--width 8] [--repeats 3] [--steps 4] [--out runs/bench-tp/bench_tp.json]

``--steps K`` (K >= 2) also trains recipes/tiny.yaml on each target for K SpecOPD steps on Ray, one worker of N
actors against one worker of one actor with the same CPUs in all, and reports the median step time after the
first step and its target phases (prefill, score).

SmolLM2-135M has 3 key/value heads: it runs at N = 3 (``specopd prepare model smollm2-135m`` first).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from specopd.eval.bench import cpu_name  # noqa: E402
from specopd.models.tensor_parallel import TensorParallel  # noqa: E402


class CountingTP(TensorParallel):
    """TensorParallel that counts the bytes it all-reduces / gathers and the time spent in them."""

    def __init__(self, mesh):
        super().__init__(mesh, shard_vocab=False)
        self.bytes, self.seconds = 0, 0.0

    def reduce(self, t):
        t0 = time.perf_counter()
        out = super().reduce(t)
        self.seconds += time.perf_counter() - t0
        self.bytes += t.numel() * t.element_size()
        return out


def target_path(name: str, work: str) -> str:
    if name == "smollm2":
        from specopd.data.smollm2 import default_model_dir, is_prepared

        d = default_model_dir()
        if not is_prepared(d):
            raise SystemExit(f"{d} is not prepared: run `specopd prepare model smollm2-135m` first")
        return d
    from specopd.train.tiny import build_tiny_target

    return build_tiny_target(name.split(":", 1)[1], os.path.join(work, name.replace(":", "-")))


def reductions_per_token(model) -> int:
    """sum over layers of (1 + m_l): the formula's count, read off the model's structure."""
    from specopd.models.common import MoE

    n = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        n += 1 + (1 + (mlp.shared_expert is not None) if isinstance(mlp, MoE) else 1)
    return n


def _work(model, tp, args):
    from specopd.tree import ProposalTree

    g = torch.Generator().manual_seed(0)
    v = model.vocab_size
    ids = torch.randint(4, v, (args.trunk,), generator=g)
    anchors = torch.linspace(0, args.trunk - 1, args.branches).long()
    toks = torch.randint(4, v, (args.branches, args.width), generator=g)
    tree = ProposalTree.from_branches(anchors, toks)
    times = []
    for _ in range(args.repeats + 1):  # the first is warm-up
        if tp is not None:
            tp.bytes, tp.seconds = 0, 0.0
            dist.barrier()
        t0 = time.perf_counter()
        cache = model.prefill(ids, gdn_checkpoint_every=64, keep_logits=False, keep_hidden=True)
        model.score(tree, cache, return_hidden=True, return_logits=False)
        times.append((time.perf_counter() - t0, 0 if tp is None else tp.bytes, 0.0 if tp is None else tp.seconds))
    return times[1:]


def rank_main(rank: int, world: int, init: str, path: str, args, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from specopd.models import load_target

    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        tp = CountingTP(init_device_mesh("cpu", (world,)))
        model = load_target(path, tensor_parallel=tp)
        res = _work(model, tp, args)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def measure(name: str, path: str, n: int, args, work: str) -> dict:
    from specopd.models import load_target

    torch.set_num_threads(args.threads)
    full = load_target(path)
    one = _work(full, None, args)
    tokens = args.trunk + args.branches * args.width
    formula = tokens * full.hidden_size * 4 * reductions_per_token(full)
    out = os.path.join(work, f"{name.replace(':', '-')}-tp.json")
    init = os.path.join(work, f"{name.replace(':', '-')}-init")
    mp.start_processes(rank_main, args=(n, init, path, args, out), nprocs=n, start_method="spawn")
    with open(out) as f:
        ranks = json.load(f)
    wall_n = [max(r[i][0] for r in ranks) for i in range(args.repeats)]
    comm = [max(r[i][2] for r in ranks) for i in range(args.repeats)]
    return {"target": name, "tp": n, "tokens": tokens, "t1_s": min(t for t, _, _ in one), "tn_s": min(wall_n),
            "comm_share": min(c / w for c, w in zip(comm, wall_n)), "bytes_measured": ranks[0][0][1],
            "bytes_formula": formula, "params_full": sum(p.numel() for p in full.parameters())}


def whole_step(name: str, path: str, n: int, steps: int, work: str) -> dict:
    """Median SpecOPD step time (steps 2..K) and target phases on Ray at tensor_parallel 1 and n."""
    import statistics

    from specopd.config import load_recipe
    from specopd.train.loop import train

    cpus = os.cpu_count() or 1
    out = {}
    for tp in (1, n):
        run = os.path.join(work, f"{name.replace(':', '-')}-steps-tp{tp}")
        cfg = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"), [
            f"model.target={path}", "runtime.backend=ray", "runtime.num_workers=1", f"runtime.tensor_parallel={tp}",
            f"runtime.cpus_per_worker={max(cpus // tp, 0.5):g}", f"trainer.max_steps={steps}", "trainer.save_every=0",
            "trainer.eval_heldout=false", "data.num_samples=24", "data.batch_size=4", f"trainer.output_dir={run}"])
        train(cfg, progress=False)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if '"step_s"' in line][1:]
        out[tp] = {"step_s": statistics.median(r["step_s"] for r in recs),
                   "target_s": statistics.median(r["phase_s"]["prefill"] + r["phase_s"]["score"] for r in recs)}
    return {"step_1_s": out[1]["step_s"], "step_n_s": out[n]["step_s"], "target_1_s": out[1]["target_s"],
            "target_n_s": out[n]["target_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="tiny:llama,tiny:qwen3_next,tiny:qwen4_exp,smollm2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--trunk", type=int, default=512)
    ap.add_argument("--branches", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="also time K SpecOPD steps on Ray (0: no)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads, split over the ranks")
    ap.add_argument("--out", default="runs/bench-tp/bench_tp.json")
    args = ap.parse_args(argv)
    print("command: python benchmarks/bench_tp.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; fp32; {args.threads} threads "
          f"in all (N ranks x threads / N)")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.targets.split(","):
            n = 3 if name == "smollm2" else args.tp
            path = target_path(name, work)
            rows.append(measure(name, path, n, args, work))
            if args.steps >= 2:
                rows[-1].update(whole_step(name, path, n, args.steps, work))
    print(f"\n{'target':<16} {'N':>2} {'tokens':>7} {'N=1 s':>8} {'N s':>8} {'N / 1':>6} {'comm':>6} "
          f"{'bytes measured':>15} {'bytes formula':>14}")
    for r in rows:
        print(f"{r['target']:<16} {r['tp']:>2} {r['tokens']:>7} {r['t1_s']:>8.3f} {r['tn_s']:>8.3f} "
              f"{r['tn_s'] / r['t1_s']:>6.2f} {r['comm_share']:>6.0%} {r['bytes_measured']:>15,} "
              f"{r['bytes_formula']:>14,}")
    if args.steps >= 2:
        print(f"\nSpecOPD steps on Ray (recipes/tiny.yaml on each target, median of steps 2..{args.steps}; "
              f"{os.cpu_count()} CPUs in all at either N)")
        print(f"{'target':<16} {'N':>2} {'step N=1 s':>11} {'step N s':>9} {'N / 1':>6} {'target N=1 s':>13} "
              f"{'target N s':>11} {'N / 1':>6}")
        for r in rows:
            print(f"{r['target']:<16} {r['tp']:>2} {r['step_1_s']:>11.3f} {r['step_n_s']:>9.3f} "
                  f"{r['step_n_s'] / r['step_1_s']:>6.2f} {r['target_1_s']:>13.3f} {r['target_n_s']:>11.3f} "
                  f"{r['target_n_s'] / r['target_1_s']:>6.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_name(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
