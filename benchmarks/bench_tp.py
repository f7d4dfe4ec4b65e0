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

``--loss smollm2:512,125b:128`` (``--targets ""`` for that section alone) times the fused E2E-TV loss, forward and
backward, on random hidden states at a vocabulary's size (smollm2: SmolLM2-135M's 49,152 x 576; 125b:
recipes/qsa-gdn-125b-dflash2-8gpu.yaml's 248,320 x 4,096), ROWS rows, ``--loss-dtype`` lm_head: whole at N = 1,
split over the vocabulary at N = ``--tp`` (``runtime.tp_lm_head=vocab_parallel``: softmax statistics and alpha
all-reduced), and at N = ``--tp`` with each chunk's logits gathered whole (the alternative, built here); N = 1 runs
twice: with kernels/e2e_tv (the CPU default) and in torch ops (what the split vocabulary runs). Per rank:
the lm_head's bytes, the loss's peak resident memory above what the process held before it (VmHWM after a reset,
pooled chunk buffers included), and the median time; and the loss and hq's gradient against N = 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from specopd.eval.bench import cpu_name  # noqa: E402
from specopd.losses import chunk_logits, e2e_tv_from_alpha, fused_e2e_tv, resolve_chunk_rows, softmax_  # noqa: E402
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
    from specopd.models.tiny import build_tiny_target

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


# ------------------------------------------------------------------ the fused loss over a split vocabulary
LOSS_SHAPES = {"smollm2": (49152, 576), "125b": (248320, 4096)}  # vocabulary, hidden
LOSS_W = 8  # drafted slots per branch: rows = branches x LOSS_W
LOSS_PARTS = 2  # the weight is generated in this many blocks, so that every N gets the same weight


class GatherTV(torch.autograd.Function):
    """alpha [R] of E2E-TV at temperature T from logits gathered whole: each rank computes its [R, V / N] block of
    q's and p's logits per chunk, all-gathers [R, V] and runs the whole vocabulary's softmaxes and TV; the backward
    recomputes and gathers again, and sums G[:, own block] @ w_block over the ranks."""

    @staticmethod
    def forward(ctx, x, hp, w, tp, temperature, chunk):
        alpha = torch.zeros(x.shape[0])
        for s in range(0, x.shape[0], chunk):
            r = torch.arange(s, min(s + chunk, x.shape[0]))
            q, _ = softmax_(tp.gather_cols(chunk_logits((x,), (w,), r)).div_(temperature))
            p, _ = softmax_(tp.gather_cols(chunk_logits((hp,), (w,), r)).div_(temperature))
            alpha[r] = torch.minimum(q, p, out=p).sum(-1)
            del q, p
        ctx.save_for_backward(x, hp, w)
        ctx.tp, ctx.temperature, ctx.chunk = tp, temperature, chunk
        return alpha

    @staticmethod
    def backward(ctx, g_alpha):
        x, hp, w = ctx.saved_tensors
        tp, t = ctx.tp, ctx.temperature
        lo, hi = tp.vocab_block(w.shape[0] * tp.size)
        dx = torch.zeros(x.shape, dtype=torch.float32)
        for s in range(0, x.shape[0], ctx.chunk):
            r = torch.arange(s, min(s + ctx.chunk, x.shape[0]))
            q, _ = softmax_(tp.gather_cols(chunk_logits((x,), (w,), r)).div_(t))
            p, _ = softmax_(tp.gather_cols(chunk_logits((hp,), (w,), r)).div_(t))
            ind = p.sub_(q).sign_().add_(1.0).mul_(0.5)
            qi = (q * ind).sum(-1, keepdim=True)
            g = ind.sub_(qi).mul_(q).mul_(g_alpha[r, None] / t)
            dx[r] = (g[:, lo:hi].to(w.dtype) @ w).float()
            del q, p, ind, g
        return tp.all_reduce_(dx).to(x.dtype), None, None, None, None, None


def _hwm_reset() -> int:
    """Reset this process's peak resident set (Linux: VmHWM) and return the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _loss_inputs(vocab: int, d: int, rows: int, dtype, blocks):
    """(hq [rows / W, W, d] fp32 with grad, hp in ``dtype``, this rank's lm_head blocks in ``dtype``), the same
    values for any N: block b of the weight comes from its own generator."""
    c = vocab // LOSS_PARTS
    w = torch.empty(len(blocks) * c, d, dtype=dtype)
    for i, b in enumerate(blocks):
        g = torch.Generator().manual_seed(100 + b)
        for s in range(0, c, 4096):  # row blocks: no weight-sized fp32 temporary
            n = min(4096, c - s)
            w[i * c + s: i * c + s + n] = torch.randn(n, d, generator=g).mul_(d ** -0.5).to(dtype)
    g = torch.Generator().manual_seed(7)
    hq = torch.randn(rows // LOSS_W, LOSS_W, d, generator=g) * 2
    hp = (hq + torch.randn(hq.shape, generator=g)).to(dtype)
    return hq.requires_grad_(True), hp, w


def loss_rank(rank: int, world: int, init: str, spec: dict, out: str) -> None:
    """One rank of a loss measurement (``spec``: vocab, d, rows, dtype, mode whole | whole_torch (without
    kernels/e2e_tv) | vocab_parallel | gather, threads, repeats); writes its times, peak and hq's gradient to
    ``out``.RANK."""
    from torch.distributed.device_mesh import init_device_mesh

    from specopd_kernels.paths import KernelsConfig

    choice = KernelsConfig(cpu_tv_loss="torch" if spec["mode"] == "whole_torch" else "auto")
    torch.set_num_threads(max(1, spec["threads"] // world))
    tp = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        tp = TensorParallel(init_device_mesh("cpu", (world,)))
    try:
        blocks = range(LOSS_PARTS) if world == 1 else range(rank * LOSS_PARTS // world, (rank + 1) * LOSS_PARTS // world)
        hq, hp, w = _loss_inputs(spec["vocab"], spec["d"], spec["rows"], getattr(torch, spec["dtype"]), blocks)
        chunk = resolve_chunk_rows("auto", spec["vocab"], "cpu")

        def step():
            hq.grad = None
            if spec["mode"] == "gather":
                alpha = GatherTV.apply(hq.reshape(-1, hq.shape[-1]), hp.reshape(-1, hp.shape[-1]), w, tp, 1.0, chunk)
                loss = e2e_tv_from_alpha(alpha.view(hq.shape[:2]))
            else:
                loss = fused_e2e_tv(hq, w, hp, temperature=1.0, tp=tp, kernel_paths=choice).loss
            loss.backward()
            return float(loss.detach())

        base = _hwm_reset()
        times = []
        for _ in range(spec["repeats"] + 1):  # the first is warm-up
            if tp is not None:
                dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
        peak = _status("VmHWM") - base
        torch.save({"times": times[1:], "peak": peak, "lm_head_bytes": w.numel() * w.element_size(), "loss": loss,
                    "grad": hq.grad.clone()}, f"{out}.{rank}")
        if tp is not None:  # no rank tears the group down while the other still runs
            dist.barrier()
    finally:
        if tp is not None:
            dist.destroy_process_group()


def measure_loss(case: str, rows: int, args, work: str) -> list:
    """N = 1 whole (kernels/e2e_tv where it builds, and torch ops), N = args.tp vocabulary-parallel and gathered:
    one row each."""
    import statistics

    vocab, d = LOSS_SHAPES[case]
    res = []
    for mode, n in (("whole", 1), ("whole_torch", 1), ("vocab_parallel", args.tp), ("gather", args.tp)):
        out = os.path.join(work, f"loss-{case}-{mode}")
        spec = {"vocab": vocab, "d": d, "rows": rows, "dtype": args.loss_dtype, "mode": mode,
                "threads": args.threads, "repeats": args.repeats}
        mp.start_processes(loss_rank, args=(n, out + ".init", spec, out), nprocs=n, start_method="spawn")
        ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(n)]
        times = [max(r["times"][i] for r in ranks) for i in range(args.repeats)]
        res.append({"case": case, "vocab": vocab, "hidden": d, "rows": rows, "mode": mode, "tp": n,
                    "time_s": statistics.median(times), "peak_bytes": max(r["peak"] for r in ranks),
                    "lm_head_bytes": ranks[0]["lm_head_bytes"], "loss": ranks[0]["loss"],
                    "grad": ranks[0]["grad"], "ranks_equal": all(torch.equal(r["grad"], ranks[0]["grad"])
                                                                 for r in ranks)})
    ref = res[0]
    for r in res:
        r["loss_rel"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        r["grad_rel"] = float((r["grad"] - ref["grad"]).abs().max() / ref["grad"].abs().max())
        r["time_vs_1"] = r["time_s"] / ref["time_s"]
    for r in res:
        del r["grad"]
    return res


def print_loss(rows: list, args) -> None:
    print(f"\nfused E2E-TV loss, forward + backward (T = 1, chunk_rows auto, lm_head {args.loss_dtype}, hq fp32; "
          f"median of {args.repeats}; {args.threads} threads in all)")
    print(f"{'vocab x D':<16} {'rows':>5} {'lm_head':<15} {'N':>2} {'lm_head/rank':>13} {'loss peak/rank':>15} "
          f"{'time s':>8} {'vs N=1':>7} {'loss rel':>9} {'dx rel':>9} {'ranks equal':>11}")
    for r in rows:
        print(f"{r['vocab']:,} x {r['hidden']:<6,} {r['rows']:>5} {r['mode']:<15} {r['tp']:>2} "
              f"{r['lm_head_bytes'] / 2**20:>9.1f} MiB {r['peak_bytes'] / 2**20:>11.1f} MiB {r['time_s']:>8.3f} "
              f"{r['time_vs_1']:>7.2f} {r['loss_rel']:>9.1e} {r['grad_rel']:>9.1e} {str(r['ranks_equal']):>11}")


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
    ap.add_argument("--loss", default="", help="time the fused loss: CASE:ROWS,... (cases: smollm2, 125b)")
    ap.add_argument("--loss-dtype", default="bfloat16", help="the lm_head's dtype in --loss")
    ap.add_argument("--out", default="runs/bench-tp/bench_tp.json")
    args = ap.parse_args(argv)
    print("command: python benchmarks/bench_tp.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; fp32; {args.threads} threads "
          f"in all (N ranks x threads / N)")
    rows, loss_rows = [], []
    with tempfile.TemporaryDirectory() as work:
        for item in filter(None, args.loss.split(",")):
            case, n = item.split(":")
            loss_rows += measure_loss(case, int(n), args, work)
        for name in filter(None, args.targets.split(",")):
            n = 3 if name == "smollm2" else args.tp
            path = target_path(name, work)
            rows.append(measure(name, path, n, args, work))
            if args.steps >= 2:
                rows[-1].update(whole_step(name, path, n, args.steps, work))
    if loss_rows:
        print_loss(loss_rows, args)
    if rows:
        print_targets(rows, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_name(), "args": vars(args), "rows": rows, "loss": loss_rows}, f, indent=1)
    return 0


def print_targets(rows: list, args) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
