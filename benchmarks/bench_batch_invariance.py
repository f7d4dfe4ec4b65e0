"""Where bf16 rows differ between prefill and score (QSA / MoE target, torch path, CPU): per op and end to end.

    python benchmarks/bench_batch_invariance.py --seeds 20

1. ops: the same rows computed the way each path computes them, counting bitwise-different output elements:
   bf16 ``F.linear`` with M rows against the same rows inside M' rows (oneDNN / AMX blocking), the PLE conv as
   ``F.conv1d`` (prefill) vs a bf16 tap loop (score before this fix) vs ``DilatedConv.tap_sum`` (both now), QSA
   attention of a query over a [T]-masked row (prefill before) vs its gathered key list (score; prefill now).
2. end to end (tests/test_qsa_bf16.py's case: score + commit of a 7-token path vs prefilling it on the trunk
   cache): per seed, the first module whose output rows differ bitwise between the two passes (hooks on every
   module and every ``ctx.mix``), the commit-vs-prefill relative error, and whether every QSA selection agrees.
   Run with ``PYTHONPATH`` at another checkout to measure that code (the op table does not depend on it).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _ndiff(a, b) -> str:
    """Differing elements of a and b (one shape and dtype) and the largest difference in ulps of the larger one."""
    a, b = a.detach(), b.detach()
    n = int((a != b).sum())
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(a.dtype, 24)
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)))
                     - (bits - 1))
    return f"{n}/{a.numel()}" + (f" (max {float(((a.float() - b.float()).abs() / ulp).max()):.0f} ulp)" if n else "")


def _blocked_linear(x, w, block: int = 64):
    """F.linear over zero-padded blocks of ``block`` rows: every GEMM has one shape (a batch-invariant linear)."""
    outs = []
    for s in range(0, x.shape[0], block):
        xb = x[s: s + block]
        pad = block - xb.shape[0]
        outs.append(F.linear(F.pad(xb, (0, 0, 0, pad)), w)[: block - pad])
    return torch.cat(outs)


def op_rows() -> list:
    """(op, what is compared, differing elements) rows."""
    from specopd_executors.attention import masked_attention

    g = torch.Generator().manual_seed(0)
    out = []
    for din, dout in [(128, 384), (256, 32), (128, 512), (1024, 4096)]:
        w = (torch.randn(dout, din, generator=g) * 0.05).bfloat16()
        x = torch.randn(300, din, generator=g).bfloat16()
        full = F.linear(x, w)
        for m in (1, 7, 56):
            out.append((f"linear {din}->{dout} bf16", f"rows of M={m} vs the same rows of M=300",
                        _ndiff(F.linear(x[:m], w), full[:m])))
        bad = [m for m in range(1, 65) if not torch.equal(F.linear(x[:m], w), full[:m])]
        blocked = _blocked_linear(x, w)
        out.append((f"linear {din}->{dout} bf16", "M in 1..64 whose rows differ from M=300's",
                    f"{len(bad)} of 64" + (f" (M = {bad[0]}..{bad[-1]})" if bad else "")))
        out.append((f"linear {din}->{dout} bf16", "64-row zero-padded blocks: rows 3..9 alone vs inside M=300",
                    _ndiff(_blocked_linear(x[3:10], w), blocked[3:10])))
    # PLE conv (C channels, kernel 4, dilation 3)
    from specopd.models.qwen4_exp import DilatedConv

    conv = DilatedConv(256, 4, 3)
    with torch.no_grad():
        conv.weight.normal_(0, 0.3, generator=g)
    conv = conv.bfloat16()
    x = torch.randn(1, 300, 256, generator=g).bfloat16()
    span = 9
    ref = F.conv1d(F.pad(x.transpose(1, 2), (span, 0)), conv.weight, groups=256, dilation=3).transpose(1, 2)
    h = F.pad(x, (0, 0, span, 0))
    cols = [h[:, span - back: span - back + 300] for back, _ in conv.taps()]
    loop = torch.zeros_like(x)
    for j, c in enumerate(cols):
        loop = loop + c * conv.weight[:, 0, j]
    out.append(("PLE conv bf16", "F.conv1d (prefill) vs bf16 tap loop (score, before)", _ndiff(ref, loop)))
    with torch.no_grad():
        out.append(("PLE conv bf16", "tap_sum over 300 rows (prefill, now) vs over 7 gathered rows (score, now)",
                    _ndiff(conv(x)[0, 200:207], conv.tap_sum([c[0, 200:207] for c in cols], x.dtype))))
    # QSA attention: 7 queries at 300..306, 16 selected groups of 4 + tail, 8 heads / 2 KV heads, hd 16
    h_, hkv, hd, t, r, topk = 8, 2, 16, 307, 4, 16
    diff16, diff32, tot = 0, 0, 0
    for _ in range(20):
        q, k, v = (torch.randn(n, hh, hd, generator=g) for n, hh in ((7, h_), (t, hkv), (t, hkv)))
        mask, idx, ok = torch.zeros(7, t, dtype=torch.bool), [], []
        for i, p in enumerate(range(t - 7, t)):
            nc = (p + 1) // r
            keys = (torch.randperm(nc, generator=g)[:topk].sort().values[:, None] * r + torch.arange(r)).flatten()
            keys = keys.tolist() + list(range(r * nc, p + 1))
            mask[i, keys] = True
            pad = topk * r + r - 1 - len(keys)
            idx.append(keys + [0] * pad)
            ok.append([True] * len(keys) + [False] * pad)
        idx, ok = torch.tensor(idx), torch.tensor(ok)
        for dt in (torch.bfloat16, torch.float32):
            qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
            a = masked_attention(qq[None], kk[None], vv[None], mask[None], 0.25)[0]
            b = masked_attention(qq.unsqueeze(1), kk[idx], vv[idx], ok.unsqueeze(1), 0.25)[:, 0]
            if dt == torch.bfloat16:
                diff16 += int((a != b).sum())
                tot += a.numel()
            else:
                diff32 += int((a != b).sum())
    out.append(("QSA attention bf16", "[T]-masked row (prefill, before) vs gathered keys (score)", f"{diff16}/{tot}"))
    out.append(("QSA attention fp32", "the same (fp32 keeps the masked prefill)", f"{diff32}/{tot}"))
    return out


@torch.no_grad()
def first_divergence(seed: int):
    """(first module / mixer whose path rows differ bitwise, or "-", rel error, selections equal)."""
    import test_qsa_bf16 as T
    from specopd.models.context import RunContext

    target = T._target(seed)
    log = []

    def hook(name):
        def f(mod, inp, out):
            log.append((name, [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o)]))
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in target.named_modules() if n]
    orig = RunContext.mix

    def mix(self, li, mixer, x):
        y = orig(self, li, mixer, x)
        log.append((f"mix {li} ({mixer.kind})", [y]))
        return y

    RunContext.mix = mix
    try:
        trunks, tree = T._case(target.vocab_size, seed)
        caches = [target.prefill(t, feature_layers=(1,)) for t in trunks]
        log.clear()
        _, state = target.score(tree, caches, return_state=True)
        in_score, _ = list(log), log.clear()
        depth = int(tree.depth.max()) + 1
        root = int(torch.nonzero((tree.parent < 0) & (tree.anchor == len(trunks[0]) - 1)
                                 & (tree.trunk_index == 0))[0])
        path = torch.arange(root, root + depth)
        new = target.commit(caches, state, [path.tolist(), []])
        ref = target.prefill(tree.tokens[path], cache=caches[0])
        in_prefill = list(log)
    finally:
        RunContext.mix = orig
        for h in handles:
            h.remove()
    m = tree.num_nodes
    calls = defaultdict(list)
    for name, outs in in_score:
        calls[name].append(outs)
    seen = defaultdict(int)
    first = "-"
    for name, outs in in_prefill:
        k = seen[name]
        seen[name] += 1
        for a, b in zip(calls[name][k] if k < len(calls[name]) else [], outs):
            ra = a[0] if a.dim() >= 2 and a.shape[:2] == (1, m) else (a if a.shape[0] == m else None)
            rb = b[0] if b.dim() >= 2 and b.shape[:2] == (1, depth) else (b if b.shape[0] == depth else None)
            if ra is not None and rb is not None and ra[path].shape == rb.shape and not torch.equal(ra[path], rb):
                first = f"{name}: {_ndiff(ra[path], rb)} elements"
                break
        if first != "-":
            break
    _, rec_s, rec_p = T._commit_vs_prefill(target, seed, record=True)
    same = all(torch.equal(v, rec_p[key]) for key, v in rec_s.items())
    return first, T._rel(new[0].logits, ref.logits), same


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--no-ops", action="store_true")
    args = ap.parse_args()
    print("command: python benchmarks/bench_batch_invariance.py " + " ".join(sys.argv[1:]))
    import specopd

    print(f"specopd from {os.path.dirname(os.path.dirname(specopd.__file__))}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    if not args.no_ops:
        print("\n| op | compared | differing elements |\n|---|---|---|")
        for row in op_rows():
            print("| " + " | ".join(row) + " |")
    print("\n| seed | first differing module (path rows, score vs prefill) | commit vs prefill | selections equal |")
    print("|---|---|---|---|")
    for s in range(args.seeds):
        first, err, same = first_divergence(s)
        print(f"| {s} | {first} | {err:.3g} | {same} |", flush=True)


if __name__ == "__main__":
    main()
