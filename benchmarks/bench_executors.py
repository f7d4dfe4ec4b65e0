"""Packed branch scoring vs naive per-branch recomputation, side by side in one run.

    python benchmarks/bench_executors.py --kinds gqa --T 256 --branches 16 --W 8 --repeats 3

packed = prefill the trunk once + one ``target.score`` over all branches;
naive  = for every branch, run ``target(trunk[:a+1] + branch)`` from scratch.
Both give the same logits (checked: the max relative difference is printed). ``BENCHES`` names, per
attention kind, the builder of a small random target of that kind (tests/random_targets.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from random_targets import gdn_target, gqa_target, qsa_target  # noqa: E402  (tests/random_targets.py)

BENCHES = [("gqa", gqa_target), ("gdn", gdn_target), ("qsa", qsa_target)]  # (kind, fn(args) -> target)


def print_table(rows: list, width: int, fmt: str = ".4g", cols=None) -> None:
    """Rows of dicts as a ' | '-separated table of ``cols`` (default: the first row's keys); floats with ``fmt``."""
    cols = list(cols or rows[0])
    print(" | ".join(f"{c:>{width}}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>{width}{fmt}}" if isinstance(r[c], float) else f"{r[c]:>{width}}" for c in cols))


# ---------------------------------------------------------------------------------------------- gdn
@torch.no_grad()
def gdn_replay_table(args, target=None):
    """Replay cost vs checkpoint interval C: checkpoint bytes (GDN layers) and score time, one run."""
    from specopd.tree import ProposalTree

    target = target or gdn_target(args)
    g = torch.Generator().manual_seed(0)
    trunk = torch.randint(0, target.vocab_size, (args.T,), generator=g).to(args.device)
    anchors = torch.randint(0, args.T, (args.branches,), generator=g)
    tree = ProposalTree.from_branches(anchors, torch.randint(0, target.vocab_size, (args.branches, args.W), generator=g))
    gdn = [i for i, k in enumerate(target.layer_kinds) if k == "gdn"]
    rows, ref = [], None
    for every in (16, 32, 64, 128):
        cache = target.prefill(trunk, gdn_checkpoint_every=every)
        t_pre, _ = _timeit(lambda: target.prefill(trunk, gdn_checkpoint_every=every), args.repeats, args.device)
        t_score, p = _timeit(lambda: target.score(tree, cache), args.repeats, args.device)
        ref = p if ref is None else ref
        ck = sum(cache.layers[i].checkpoints.numel() * 4 for i in gdn)
        allb = sum(cache.layers[i].nbytes() for i in gdn)
        replay = int(((anchors + 1) % every).max())
        rows.append(dict(C=every, checkpoints=cache.layers[gdn[0]].checkpoints.shape[0], ckpt_MiB=ck / 2 ** 20,
                         gdn_cache_MiB=allb / 2 ** 20, max_replay=replay, prefill_ms=1e3 * t_pre,
                         score_ms=1e3 * t_score,
                         rel_diff_vs_C16=float((p - ref).abs().max() / ref.abs().max())))
    print(f"gdn replay cost vs C: T={args.T} branches={args.branches} W={args.W} gdn_layers={len(gdn)} "
          f"(max_replay = longest anchor-state replay, < C)")
    print_table(rows, 14)
    return rows


@torch.no_grad()
def gqa_score_paths(args, target=None):
    """The GQA executor's score through the block plan (torch "blocked", and "triton" when
    it can run) against the dense per-trunk tree mask of the previous executor ("dense"), side by side on the
    same target, trunk and tree. Also the attention work each visits (score entries computed)."""
    from specopd_executors.base import resolve_kernels
    from specopd_executors.options import ExecOptions
    from specopd_kernels.tree_attention import build_tree_plan
    from specopd.tree import ProposalTree

    target = target or gqa_target(args)
    g = torch.Generator().manual_seed(0)
    trunk = torch.randint(0, target.vocab_size, (args.T,), generator=g).to(args.device)
    anchors = torch.randint(0, args.T, (args.branches,), generator=g)
    tree = ProposalTree.from_branches(anchors, torch.randint(0, target.vocab_size, (args.branches, args.W),
                                                             generator=g))
    cache = target.prefill(trunk)
    m = tree.num_nodes
    paths = ["dense", "blocked"]
    try:
        resolve_kernels(ExecOptions(kernels="triton"), args.device)
        paths.append("triton")
    except ValueError:
        pass
    rows, ref = [], None
    for path in paths:
        cache.options.gqa_backend = path
        target.score(tree, cache)  # warm-up (plans are built once per tree)
        t_score, p = _timeit(lambda: target.score(tree, cache), args.repeats, args.device)
        ref = p if ref is None else ref
        if path == "dense":
            t_cut = int(anchors.max()) + 1
            entries, mask_mib = m * (t_cut + m), m * (t_cut + m) / 2 ** 20  # bool mask, one trunk
        else:
            from specopd_executors.gqa import BLOCKED
            from specopd_kernels.tree_attention.triton_fwd import plan_blocks

            attn = target.model.layers[0].self_attn
            blocks = BLOCKED if path == "blocked" else plan_blocks(attn.head_dim, attn.num_heads, attn.num_kv_heads)
            st = build_tree_plan(tree.anchor, tree.parent, tree.trunk_index, [args.T], **blocks).stats()
            entries, mask_mib = st["visited_entries"], blocks["block_m"] * (args.T + 4 * blocks["block_n"]) / 2 ** 20
        rows.append(dict(path=path, layers=args.layers, T=args.T, branches=args.branches, W=args.W, nodes=m,
                         score_ms=1e3 * t_score, score_entries_M=entries / 1e6, largest_mask_MiB=mask_mib,
                         rel_diff_vs_dense=float((p - ref).abs().max() / ref.abs().max())))
    cache.options.gqa_backend = "auto"
    base = rows[0]["score_ms"]
    for r in rows:
        r["speedup_vs_dense"] = base / r["score_ms"]
    print(f"gqa score paths: T={args.T} branches={args.branches} W={args.W} layers={args.layers} "
          f"(one trunk; entries = attention scores computed per head and layer)")
    print_table(rows, 17)
    return rows


EXTRAS = {"gdn": [gdn_replay_table], "gqa": [gqa_score_paths]}  # kind -> extra tables printed after the main one


def _timeit(fn, repeats, device):
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


@torch.no_grad()
def run_one(kind, target, args, naive_cache=None):
    """One row: prefill / score / packed (= prefill + score) times and the per-branch naive reference (timed once
    per target and kept in ``naive_cache`` for the other kernels modes of the same target)."""
    from specopd.tree import ProposalTree

    g = torch.Generator().manual_seed(0)
    trunk = torch.randint(0, target.vocab_size, (args.T,), generator=g).to(args.device)
    anchors = torch.randint(0, args.T, (args.branches,), generator=g)
    tokens = torch.randint(0, target.vocab_size, (args.branches, args.W), generator=g)
    tree = ProposalTree.from_branches(anchors, tokens)
    tokens_dev = tokens.to(args.device)

    def packed():
        cache = target.prefill(trunk)
        return target.score(tree, cache)

    def naive():
        return torch.stack([target(torch.cat([trunk[: int(a) + 1], tokens_dev[b]]).view(1, -1))[0, -args.W:]
                            for b, a in enumerate(anchors.tolist())])

    packed()  # warm-up
    cache = target.prefill(trunk)
    t_prefill, _ = _timeit(lambda: target.prefill(trunk), args.repeats, args.device)
    t_score, _ = _timeit(lambda: target.score(tree, cache), args.repeats, args.device)
    t_packed, p = _timeit(packed, args.repeats, args.device)
    naive_cache = {} if naive_cache is None else naive_cache
    if "ref" not in naive_cache:
        naive_cache["t"], naive_cache["ref"] = _timeit(naive, args.repeats, args.device)
    t_naive, ref = naive_cache["t"], naive_cache["ref"]
    err = float((p.float() - ref.float()).abs().max() / ref.float().abs().max())
    return dict(kind=kind, kernels=getattr(target, "kernels", "auto"), T=args.T, branches=args.branches, W=args.W,
                dtype=str(args.dtype).replace("torch.", ""), device=str(args.device), prefill_ms=1e3 * t_prefill,
                score_ms=1e3 * t_score, packed_ms=1e3 * t_packed, naive_ms=1e3 * t_naive, speedup=t_naive / t_packed,
                max_rel_diff=err)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(k for k, _ in BENCHES), help="comma list of attention kinds")
    ap.add_argument("--T", type=int, default=256, help="trunk length")
    ap.add_argument("--branches", type=int, default=16, help="branches N (one random anchor each)")
    ap.add_argument("--W", type=int, default=8, help="tokens per branch")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--kernels", default="auto", help="comma list of target.kernels modes to run side by side "
                                                       "(auto | torch | triton)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default); 1 gives "
                                                          "steadier CPU timings on a shared machine")
    ap.add_argument("--extras-only", action="store_true",
                    help="only the extra tables (e.g. gqa score paths), not the packed-vs-naive table")
    args = ap.parse_args(argv)
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    known = dict(BENCHES)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in known:
            ap.error(f"unknown kind {k!r}; available: {sorted(known)}")
    rows = []

    def save():  # after every row: a run cut short by a time limit still leaves its finished rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)

    if not args.extras_only:
        cols = ["kind", "kernels", "T", "branches", "W", "dtype", "prefill_ms", "score_ms", "packed_ms", "naive_ms",
                "speedup", "max_rel_diff"]
        print(f"threads={torch.get_num_threads()} device={args.device} (packed = prefill + score; "
              f"speedup = naive / packed); one row as each finishes:", flush=True)
        print(" | ".join(f"{c:>12}" for c in cols), flush=True)
        for k in kinds:
            t0 = time.perf_counter()
            target, cache = known[k](args), {}
            print(f"# {k}: target built in {time.perf_counter() - t0:.1f} s", flush=True)
            for mode in [m for m in args.kernels.split(",") if m]:
                target.kernels = mode
                t0 = time.perf_counter()
                rows.append(run_one(k, target, args, cache))
                r = rows[-1]
                print(" | ".join(f"{r[c]:>12.3g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols) +
                      f"   ({time.perf_counter() - t0:.1f} s incl. compile / autotune)", flush=True)
                save()
        print("table:")
        print_table([r for r in rows if r["kind"] in kinds], 12, ".3g", cols)
    for k in kinds:
        for extra in EXTRAS.get(k, []) if "EXTRAS" in globals() else []:
            rows.extend(dict(kind=f"{k}:{extra.__name__}", **r) for r in extra(args))
            save()
    save()
    return rows


if __name__ == "__main__":
    main()
