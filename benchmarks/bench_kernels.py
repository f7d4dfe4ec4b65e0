"""Kernel benchmarks at the recipes' shapes, side by side in one run (CUDA; ``--tiny`` runs every piece at toy
sizes on the CPU, Triton interpreted, to check the script end to end).

    python benchmarks/bench_kernels.py --json OUT.json [--no-flex]         # H200: 8B, 27B, qwen4_exp shapes
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --tiny --json OUT.json   # CPU smoke

Sections (bf16 on CUDA; times are medians of CUDA-event timed repeats after a warm-up):
  tree_attention  GQA score of one trunk's tree (T = 2048, anchors x 15 drafted tokens, chains sorted by
                  anchor): our Triton kernel over the block plan vs SDPA with the dense [M, t_cut + M] tree mask
                  (what the executor did before) vs flex_attention (compiled, BlockMask from the same layout).
  gdn             Qwen3.5-27B GDN layer (48 value heads, K = V = 128): trunk prefill through our chunk kernel
                  (fp32 checkpoints every 64), fla's chunked rule (when installed) and the fused recurrent kernel;
                  scoring 128 anchors x 15 tokens through the fused replay vs re-prefilling every branch
                  (chunk kernel over [branches, a + 1 + 15], right-padded).
  qsa             qwen4_exp QSA layer (16 / 2 heads of 256, indexer 32 x 128, budget 2048): blockwise prefill
                  (indexer scores -> exact top-k -> sparse attention) vs SDPA with the dense [T, T] selection mask.
Rows are printed and saved as each finishes, every kind's first shape before any second one.
Columns: ms, TFLOP/s on useful FLOPs (attention: 4 * D * H * visible entries; GDN: 6 * K * V per token and head,
the state decay-read, update and output products), GB/s on the minimum bytes moved (inputs read once, outputs
and checkpoints written), and the max relative difference to the first row of the section.
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
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from specopd.errors import write_replace  # noqa: E402  (after the checkout is on sys.path)

# recipe: tree attention (T, anchors, W, hd, H, Hkv); GDN (T, anchors, W, H, K, V); QSA (T, hd, H, Hkv, Hi, di, topk)
FULL = {
    "8B": dict(tree=(2048, 256, 15, 128, 32, 8)),
    "27B": dict(tree=(2048, 128, 15, 256, 24, 4), gdn=(2048, 128, 15, 48, 128, 128)),
    "qwen4_exp": dict(gdn=(2048, 128, 15, 32, 128, 128), qsa=[(2048, 256, 16, 2, 32, 128, 512),
                                                              (8192, 256, 16, 2, 32, 128, 512)]),
}
TINY = {  # every code path once, at sizes the Triton interpreter runs in seconds
    "8B": dict(tree=(48, 6, 3, 16, 4, 2)),
    "27B": dict(tree=(40, 4, 3, 32, 6, 2), gdn=(40, 3, 2, 1, 16, 16)),
    "qwen4_exp": dict(qsa=[(32, 16, 2, 1, 1, 16, 2)]),
}


class Timer:
    def __init__(self, device, repeats):
        self.cuda = device.type == "cuda"
        self.repeats = repeats

    def __call__(self, fn):
        """(median seconds, last output) over ``repeats`` calls after one warm-up."""
        out = fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times), out


def _rel(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _row(section, recipe, impl, sec, flops, nbytes, out, ref, **extra):
    return dict(section=section, recipe=recipe, impl=impl, ms=1e3 * sec, tflops=flops / sec / 1e12,
                gbps=nbytes / sec / 1e9, rel_diff=_rel(out, ref), **extra)


def _sorted_chains(t, n, w, g):
    """n anchors (sorted) with a w-token chain each: anchor, parent, depth [n * w]."""
    anchors = torch.sort(torch.randperm(t, generator=g)[:n]).values
    anchor = anchors.repeat_interleave(w)
    idx = torch.arange(n * w).view(n, w)
    parent = torch.where(torch.arange(w) == 0, -1, idx - 1).flatten()
    depth = torch.arange(w).repeat(n)
    return anchor, parent, depth


# ---------------------------------------------------------------------------------------------- tree attention
def bench_tree(recipe, shape, dev, dt, timer, g, flex=True):
    """Rows as each finishes (flex: also the compiled flex_attention row)."""
    import torch.nn.functional as F

    from specopd_kernels.tree_attention import build_tree_plan
    from specopd_kernels.tree_attention.triton_fwd import plan_blocks, tree_attention

    t, n, w, hd, h, hkv = shape
    anchor, parent, depth = _sorted_chains(t, n, w, g)
    m = anchor.numel()
    q = torch.randn(m, h, hd, generator=g).to(dev, dt)
    k, v = (torch.randn(m, hkv, hd, generator=g).to(dev, dt) for _ in range(2))
    tk, tv = (torch.randn(t, hkv, hd, generator=g).to(dev, dt) for _ in range(2))
    scale = hd ** -0.5
    t0 = time.perf_counter()
    plan = build_tree_plan(anchor, parent, torch.zeros(m, dtype=torch.long), [t], **plan_blocks(hd, h, hkv))
    plan_dev = plan.to(dev)
    plan_ms = 1e3 * (time.perf_counter() - t0)
    visible = int((anchor + 1 + depth + 1).sum())
    flops = 4 * hd * h * visible
    t_cut = int(anchor.max()) + 1
    el = q.element_size()
    nbytes = el * (q.numel() * 2 + k.numel() * 2 + t_cut * hkv * hd * 2)
    sec, ours = timer(lambda: tree_attention(q, k, v, tk, tv, plan_dev, scale))
    st = plan.stats()
    yield _row("tree_attention", recipe, "triton tree kernel", sec, flops, nbytes, ours, ours,
               plan_ms=plan_ms, share_of_dense=st["fraction"], nodes=m)
    # dense tree mask [M, t_cut + M] + SDPA (GQA expanded, as the executor's "sdpa" path)
    vis_trunk = torch.arange(t_cut)[None, :] <= anchor[:, None]
    s_idx = torch.arange(m)
    vis_node = (s_idx[None, :] <= s_idx[:, None]) & (s_idx[None, :] >= (s_idx - depth)[:, None])
    mask = torch.cat([vis_trunk, vis_node], dim=1).to(dev)  # [M, t_cut + M]
    kk = torch.cat([tk[:t_cut], k]).repeat_interleave(h // hkv, dim=1).transpose(0, 1)[None]
    vv = torch.cat([tv[:t_cut], v]).repeat_interleave(h // hkv, dim=1).transpose(0, 1)[None]
    qq = q.transpose(0, 1)[None]

    def sdpa():
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)

    sec, out = timer(sdpa)
    yield _row("tree_attention", recipe, "SDPA dense tree mask", sec, flops, nbytes, out, ours,
               mask_MiB=mask.numel() / 2 ** 20)
    if not flex:
        return
    # flex_attention with a BlockMask from the same sorted layout
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        anc_d, dep_d = anchor.to(dev), depth.to(dev)

        def mask_mod(b, hh, qi, kv):
            node = kv - t_cut
            return torch.where(kv < t_cut, kv <= anc_d[qi], (node <= qi) & (node >= qi - dep_d[qi]))

        compiled = dev.type == "cuda"
        t0 = time.perf_counter()
        bm = create_block_mask(mask_mod, None, None, m, t_cut + m, device=dev, _compile=compiled)
        bm_ms = 1e3 * (time.perf_counter() - t0)
        fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        kg = torch.cat([tk[:t_cut], k]).transpose(0, 1)[None]
        vg = torch.cat([tv[:t_cut], v]).transpose(0, 1)[None]
        sec, out = timer(lambda: fn(qq, kg, vg, block_mask=bm, scale=scale, enable_gqa=h != hkv)[0].transpose(0, 1))
        row = _row("tree_attention", recipe, "flex_attention BlockMask", sec, flops, nbytes, out, ours,
                   block_mask_ms=bm_ms)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
        row = dict(section="tree_attention", recipe=recipe, impl="flex_attention BlockMask",
                   error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    yield row


# ---------------------------------------------------------------------------------------------- GDN
def gdn_inputs(b, t, h, kd, vd, dev, dt, g):
    """q, k (l2-normed, scaled), v in ``dt``; fp32 gates g <= 0 and beta in [0, 1): [b, t, h, ...] on ``dev``."""
    from specopd_kernels.gated_delta.naive import prepare_qk

    q, k = prepare_qk(torch.randn(b, t, h, kd, generator=g), torch.randn(b, t, h, kd, generator=g))
    v = torch.randn(b, t, h, vd, generator=g)
    gg = -torch.rand(b, t, h, generator=g) * 0.1
    beta = torch.rand(b, t, h, generator=g)
    return q.to(dev, dt), k.to(dev, dt), v.to(dev, dt), gg.to(dev), beta.to(dev)


def bench_gdn(recipe, shape, dev, dt, timer, g):
    """Rows as each finishes."""
    from specopd_kernels.gated_delta.chunk import chunk_gated_delta_rule
    from specopd_kernels.gated_delta.fla_chunk import fla_available, fla_chunk_gated_delta_rule
    from specopd_kernels.gated_delta.fused_recurrent import fused_recurrent_gated_delta_rule
    from specopd_kernels.gated_delta.replay import build_replay_plan, gdn_tree_replay, stack_states

    t, n, w, h, kd, vd = shape
    every = 64 if dev.type == "cuda" else 16
    q, k, v, gg, beta = gdn_inputs(1, t, h, kd, vd, dev, dt, g)
    el = q.element_size()
    flops = 6 * kd * vd * h * t
    n_ck = -(-t // every)
    nbytes = el * (q.numel() * 2 + v.numel()) + 4 * (gg.numel() * 2 + v.numel() + n_ck * h * kd * vd)
    sec, ref = timer(lambda: chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, checkpoint_every=every))
    yield _row("gdn_prefill", recipe, "triton chunk (ours)", sec, flops, nbytes, ref[0], ref[0], T=t)
    if dev.type == "cuda" and fla_available():
        try:
            sec, out = timer(lambda: fla_chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, checkpoint_every=every))
            row = _row("gdn_prefill", recipe, "fla chunk", sec, flops, nbytes, out[0], ref[0], T=t,
                       ckpt_rel_diff=_rel(out[2], ref[2]))
        except Exception as e:  # noqa: BLE001
            row = dict(section="gdn_prefill", recipe=recipe, impl="fla chunk",
                       error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        yield row
    sec, out = timer(lambda: fused_recurrent_gated_delta_rule(q, k, v, g=gg, beta=beta, checkpoint_every=every))
    yield _row("gdn_prefill", recipe, "triton fused recurrent", sec, flops, nbytes, out[0], ref[0], T=t)
    # scoring n anchors x w tokens: fused replay from the checkpoints vs re-prefilling every branch
    _, final, ck = ref
    anchor, parent, _ = _sorted_chains(t, n, w, g)
    m = anchor.numel()
    plan = build_replay_plan(anchor, parent, torch.zeros(m, dtype=torch.long), [t], every)
    plan_dev = plan.to(dev)
    states0 = stack_states([ck[0]], [final[0]])
    rr = plan.replay_rows.to(dev)
    nq, nk, nv, ng, nb = gdn_inputs(1, m, h, kd, vd, dev, torch.float32, g)
    nq, nk, nv, ng, nb = nq[0], nk[0], nv[0], ng[0], nb[0]
    rk, rv, rg, rb = k[0, rr].float(), v[0, rr].float(), gg[0, rr], beta[0, rr]
    score_flops = 6 * kd * vd * h * (m + rr.numel())
    score_bytes = 4 * (states0.numel() + rk.numel() + rv.numel() + nq.numel() * 2 + nv.numel() * 2)
    sec, (o_rep, _) = timer(lambda: gdn_tree_replay(states0, rk, rv, rg, rb, nq, nk, nv, ng, nb, plan_dev))
    yield _row("gdn_score", recipe, "fused replay (ours)", sec, score_flops, score_bytes, o_rep, o_rep,
               nodes=m, replay_rows=int(rr.numel()))
    # re-prefill: [n, a_max + 1 + w] right-padded sequences (zeros: g = beta = 0 no-op steps after the end)
    lens = (anchor.view(n, w)[:, 0] + 1).tolist()
    tmax = max(lens) + w
    rq, rkk, rvv = (torch.zeros(n, tmax, h, x.shape[-1], dtype=x.dtype, device=dev) for x in (q, k, v))
    rgg, rbb = (torch.zeros(n, tmax, h, device=dev) for _ in range(2))
    for i, a1 in enumerate(lens):
        rq[i, :a1], rkk[i, :a1], rvv[i, :a1], rgg[i, :a1], rbb[i, :a1] = q[0, :a1], k[0, :a1], v[0, :a1], \
            gg[0, :a1], beta[0, :a1]
        sl = slice(i * w, (i + 1) * w)
        rq[i, a1:a1 + w], rkk[i, a1:a1 + w], rvv[i, a1:a1 + w] = nq[sl].to(dt), nk[sl].to(dt), nv[sl].to(dt)
        rgg[i, a1:a1 + w], rbb[i, a1:a1 + w] = ng[sl], nb[sl]
    sec, out = timer(lambda: chunk_gated_delta_rule(rq, rkk, rvv, g=rgg, beta=rbb))
    o_re = torch.stack([out[0][i, a1:a1 + w] for i, a1 in enumerate(lens)]).reshape(m, h, vd)
    re_bytes = el * (rq.numel() * 2 + rvv.numel()) + 4 * (out[0].numel() + rgg.numel() * 2)
    yield _row("gdn_score", recipe, "re-prefill every branch (chunk)", sec, score_flops, re_bytes, o_re, o_rep,
               nodes=m, padded_tokens=n * tmax)


# ---------------------------------------------------------------------------------------------- QSA
def bench_qsa(recipe, shape, dev, dt, timer, g):
    """Rows as each finishes."""
    import torch.nn.functional as F

    from specopd_kernels.qsa.sparse_attention import group_rows, qsa_prefill

    t, hd, h, hkv, hi, di, topk = shape
    r = 4
    q = torch.randn(t, h, hd, generator=g).to(dev, dt)
    k, v = (torch.randn(t, hkv, hd, generator=g).to(dev, dt) for _ in range(2))
    # the indexer runs in fp32 for every target dtype (QSAttention.index_project): fp32 index queries and keys
    qi = torch.randn(t, hi, di, generator=g).to(dev, torch.float32)
    pooled = torch.randn(t // r, di, generator=g).to(dev, torch.float32)
    last = torch.arange(t, device=dev)
    scale = hd ** -0.5
    sec, (o, sel) = timer(lambda: qsa_prefill(q, k, v, qi, pooled, last, topk, r, scale, chunk=1024))
    idx, n_keys = group_rows(sel, last, r)
    keys = int(n_keys.sum())
    groups = int(((last + 1) // r).sum())
    flops = 4 * hd * h * keys + 2 * hi * di * groups
    el = q.element_size()
    nbytes = el * (q.numel() * 2 + keys * hkv * hd * 2) + 4 * (qi.numel() + pooled.numel()) + 8 * sel.numel()
    yield _row("qsa_prefill", recipe, "triton indexer + top-k + sparse attention", sec, flops, nbytes, o, o, T=t,
               keys_per_query=keys / t)
    # the dense baseline: the same selection as a [T, T] token mask through SDPA (attention only)
    mask = torch.zeros(t, t, dtype=torch.bool, device=dev)
    ok = torch.arange(idx.shape[1], device=dev)[None, :] < n_keys[:, None]
    mask[torch.arange(t, device=dev)[:, None].expand_as(idx)[ok], idx[ok]] = True
    qq = q.transpose(0, 1)[None]
    kk = k.repeat_interleave(h // hkv, dim=1).transpose(0, 1)[None]
    vv = v.repeat_interleave(h // hkv, dim=1).transpose(0, 1)[None]
    sec, out = timer(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1))
    yield _row("qsa_prefill", recipe, "SDPA dense [T, T] mask (attention only)", sec, flops, nbytes, out, o,
               T=t, mask_MiB=mask.numel() / 2 ** 20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="8B,27B,qwen4_exp")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke: set TRITON_INTERPRET=1)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None, help="rows so far, rewritten after every row")
    ap.add_argument("--no-flex", action="store_true", help="leave out the compiled flex_attention row")
    args = ap.parse_args(argv)
    print("$ python benchmarks/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]), flush=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA: run with TRITON_INTERPRET=1 and --tiny (Triton kernels interpreted on the CPU)",
              file=sys.stderr)
        return 2
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else FULL
    timer = Timer(dev, 1 if args.tiny else args.repeats)
    g = torch.Generator().manual_seed(0)
    rows = []

    def save():  # after every row: a run cut short by its time limit keeps what finished
        if args.json:
            write_replace(args.json, json.dumps(dict(
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreted)", dtype=str(dt),
                torch=torch.__version__, rows=rows), indent=1))

    recipes = [x for x in args.recipes.split(",") if x]
    for recipe in recipes:
        if recipe not in shapes:
            print(f"unknown recipe {recipe!r}; choose from {sorted(shapes)}", file=sys.stderr)
            return 2
    benches = {"tree": lambda r, sh: bench_tree(r, sh, dev, dt, timer, g, flex=not args.no_flex),
               "gdn": lambda r, sh: bench_gdn(r, sh, dev, dt, timer, g),
               "qsa": lambda r, sh: bench_qsa(r, sh, dev, dt, timer, g)}
    print_header(dev, dt)
    for recipe, kind, sh in section_order(recipes, shapes):
        t0 = time.perf_counter()
        with torch.no_grad():
            for row in benches[kind](recipe, sh):
                row["seconds_incl_compile"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                print_rows([row], dev, dt, header=False)
                save()
                t0 = time.perf_counter()
    save()
    return 1 if any("error" in r for r in rows if r["impl"] != "flex_attention BlockMask") else 0


def section_order(recipes: list, shapes: dict) -> list:
    """(recipe, kind, shape) with every kind's first shape before any second one: a cut run has met each kernel."""
    todo = [(r, kind, sh) for r in recipes for kind in ("tree", "gdn", "qsa")
            for sh in (shapes[r].get(kind, []) if kind == "qsa" else [shapes[r][kind]] if kind in shapes[r] else [])]
    seen, first, rest = set(), [], []
    for item in todo:
        (first if item[1] not in seen else rest).append(item)
        seen.add(item[1])
    return first + rest


def print_header(dev, dt):
    print(f"device={dev} dtype={str(dt).replace('torch.', '')}")
    print(f"{'section':<15} {'recipe':<10} {'impl':<44} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8} {'rel_diff':>9}  extra",
          flush=True)


def print_rows(rows, dev, dt, header=True):
    if header:
        print_header(dev, dt)
    for r in rows:
        if "error" in r:
            print(f"{r['section']:<15} {r['recipe']:<10} {r['impl']:<44} ERROR {r['error']}")
            continue
        extra = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("section", "recipe", "impl", "ms", "tflops", "gbps", "rel_diff")}
        print(f"{r['section']:<15} {r['recipe']:<10} {r['impl']:<44} {r['ms']:>9.3f} {r['tflops']:>8.2f} "
              f"{r['gbps']:>8.1f} {r['rel_diff']:>9.2e}  {extra}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
