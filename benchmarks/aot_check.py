"""GPU readiness without a GPU: compile every Triton kernel of the project ahead of time for sm_90 (H100 / H200)
and sm_100 (B200) at the block sizes its launcher picks for the recipes' shapes, and read registers, shared
memory and local (spill) bytes from the cubin with the cuobjdump bundled in triton.

    python benchmarks/aot_check.py [--json OUT] [--arch 90,100] [--jobs 2] [--dtypes bf16,fp32] [--shapes recipes,tiny]
    PYTHONPATH=.tt36:. python benchmarks/aot_check.py --arch 90      # under triton 3.6 (`make tt36`)

Prints a table (kernel, arch, registers, shared bytes, local bytes) and the tree-attention block plan's share of
the dense grid at the 8B recipe's shapes; writes JSON as a list of {"kernel", "arch", "ok", "registers",
"shared_bytes", "local_bytes"}. Exits non-zero on any compile failure, shared memory over the arch's per-block
limit, or spills (local + stack bytes > 0) other than the measured, explained ``KNOWN_SPILLS`` (fp32 variants:
reported only, see ``FP32_SPILLS_ACCEPTED``); both, the variants and the compile live in tests/aot_kernels.py,
shared with tests/test_kernels_aot.py. Shapes (``SHAPES``, as the executors launch the kernels for bf16 targets):
  8B   (recipes/qwen3-8b-dflash-8gpu.yaml): GQA 32 / 8 heads, head_dim 128
  27B  (recipes/qwen3.5-27b-dflash-8gpu.yaml, Qwen3.5-27B): gated attention 24 / 4 heads, head_dim 256;
       GDN 48 value heads (q / k expanded to them), K = V = 128, C = 64
  qwen4_exp (recipes/qwen4-exp-dflash-8gpu.yaml): QSA 16 / 2 heads, head_dim 256, indexer 32 heads x 128,
       budget 2048 (top-k 512 groups of 4); GDN 32 value heads, K = V = 128
``--shapes tiny``: the tiny recipes' targets instead (recipes/tiny*.yaml, ``tiny_shapes``: head dims 8 and 16, which
the launchers pad to tl.dot's 16). Every compile refuses a tl.dot block dim below 16 (``strict_dot_rule``), which
the compilers themselves check only in part.
``launched_kernels()`` lists every Triton kernel in kernels/ (tests check each has a variant). The bundled ptxas
is older than the PTX triton emits, so the numbers come from the cubin triton builds (its own ptxas), never from
re-assembling PTX.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "tests")) if p not in sys.path]

from aot_kernels import SHAPES, SHARED_LIMIT, compile_one, tiny_shapes, variants  # noqa: E402  (tests/aot_kernels.py)

PLAN_SHAPES = {  # recipe: (trunk T, anchors per sequence, drafted tokens per branch, sequences per GPU, hd, H, Hkv)
    "8B": (2048, 256, 15, 4, 128, 32, 8),
    "27B": (2048, 128, 15, 4, 256, 24, 4),
}


def plan_fraction(recipe: str) -> dict:
    """The tree-attention plan at a recipe's shapes (block_size 16 counts the anchor: 15 drafted tokens per
    branch), anchors uniform over the trunk: blocks visited against the dense grid."""
    import torch

    from specopd_kernels.tree_attention import build_tree_plan
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks

    t, n, w, seqs, hd, h, hkv = PLAN_SHAPES[recipe]
    g = torch.Generator().manual_seed(0)
    anchor = torch.cat([torch.sort(torch.randperm(t, generator=g)[:n]).values.repeat_interleave(w)
                        for _ in range(seqs)])
    idx = torch.arange(seqs * n * w).view(seqs * n, w)
    parent = torch.where(torch.arange(w) == 0, -1, idx - 1).flatten()
    tix = torch.arange(seqs).repeat_interleave(n * w)
    blocks = plan_blocks(hd, h, hkv)
    st = build_tree_plan(anchor, parent, tix, [t] * seqs, **blocks).stats()
    return {**blocks, **st}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--arch", default="90,100", help="comma-separated compute capabilities (default 90,100)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
    ap.add_argument("--only", default="", help="compile only kernels whose label contains this text")
    ap.add_argument("--dtypes", default="bf16", help="target dtypes of the variants: bf16 (the recipes), fp32")
    ap.add_argument("--shapes", default="recipes", help="recipes (8B, 27B, qwen4_exp) and / or tiny (recipes/tiny*)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("aot_check compiles real kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    print("$ python benchmarks/aot_check.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    archs = [int(a) for a in args.arch.split(",") if a]
    bad = [a for a in archs if a not in SHARED_LIMIT]
    if bad:
        print(f"unknown arch {bad}; use 90 and/or 100", file=sys.stderr)
        return 2
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if not dtypes or set(dtypes) - {"bf16", "fp32"}:
        print(f"unknown --dtypes {args.dtypes!r}; use bf16 and/or fp32", file=sys.stderr)
        return 2
    import triton

    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)})")
    kinds = [k for k in args.shapes.split(",") if k]
    if not kinds or set(kinds) - {"recipes", "tiny"}:
        print(f"unknown --shapes {args.shapes!r}; use recipes and / or tiny", file=sys.stderr)
        return 2
    shapes = {**(SHAPES if "recipes" in kinds else {}), **(tiny_shapes() if "tiny" in kinds else {})}
    jobs = [(*v, a) for v in variants(dtypes, shapes) for a in archs if args.only in v[0]]
    t0 = time.time()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            rows = list(ex.map(compile_one, jobs))
    else:
        rows = [compile_one(j) for j in jobs]
    w = max(len(r["kernel"]) for r in rows) if rows else 10
    print(f"{'kernel':<{w}}  arch    regs  shared_B  local_B  ok")
    for r in rows:
        fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
        print(f"{r['kernel']:<{w}}  {r['arch']:<6} {fmt(r['registers']):>5} {fmt(r['shared_bytes']):>9} "
              f"{fmt(r['local_bytes']):>8}  {('ok' + ('  (' + r['note'] + ')' if r.get('note') else '')) if r['ok'] else 'FAIL: ' + r.get('error', '')}")
    print(f"{len(rows)} compiles in {time.time() - t0:.1f} s")
    for recipe, (t, n, w, seqs, hd, h, hkv) in PLAN_SHAPES.items():
        st = plan_fraction(recipe)
        print(f"tree attention plan at the {recipe} recipe's shapes (T={t}, {n} anchors x {w} tokens, {seqs} "
              f"sequences, {h}/{hkv} heads, block {st['block_m']} nodes x {st['block_n']} keys): "
              f"{st['visited_blocks']} of {st['dense_blocks']} blocks of the dense grid visited "
              f"({100 * st['fraction']:.1f}%); {100 * st['density']:.1f}% of the visited score entries are visible")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in ("kernel", "arch", "ok", "registers", "shared_bytes", "local_bytes")}
                       for r in rows], f, indent=1)
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} failed", file=sys.stderr)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
