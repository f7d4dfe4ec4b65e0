"""Rank processes for the tensor-parallel tests: each rank loads the unsharded target and its own shard, runs the
same prefill / score / verify / commit on both, and rank 0 writes the largest relative differences per case."""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os

import torch
import torch.distributed as dist

FL = (0, 1)
C = 8  # GDN checkpoint interval: trunks and commits cross it


def _write_result(rank: int, res: dict, out: str) -> None:
    """Rank 0 writes the results the test reads (atomically: the test waits for the processes, then reads)."""
    if rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(out + ".tmp", out)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _ids(n, seed, vocab):
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ids[ids == 3] = 4  # qwen4_exp's EOS only where placed
    return ids


def compare(full, shard) -> dict:
    """The largest relative difference of each output between ``full`` and ``shard`` (fp32)."""
    from specopd.tree import ProposalTree

    v, t = full.vocab_size, 41
    ids = _ids(t + 12, 7, v)
    err = {"forward": _rel(shard(ids[:t].view(1, -1)), full(ids[:t].view(1, -1)))}
    caches = {}
    for name, m in (("full", full), ("shard", shard)):
        caches[name] = m.prefill(ids[:t], feature_layers=FL, gdn_checkpoint_every=C, keep_hidden=True)
    for f in ("logits", "features", "hidden"):
        err[f"prefill.{f}"] = _rel(getattr(caches["shard"], f), getattr(caches["full"], f))
    # anchors at 0, on a checkpoint / QSA group edge (15: 16 tokens visible), inside, and at the end with several
    # branches on it (one of a single drafted token)
    anchors = torch.tensor([0, 15, 22, t - 1, t - 1, t - 1])
    lens = [4, 4, 4, 4, 4, 1]
    toks = torch.stack([_ids(4, 100 + i, v) for i in range(len(lens))])
    tree = ProposalTree.from_parents(
        torch.cat([toks[i, :n] for i, n in enumerate(lens)]),
        torch.cat([torch.tensor([-int(a) - 1] + list(range(o, o + n - 1)))
                   for a, n, o in zip(anchors.tolist(), lens, [sum(lens[:i]) for i in range(len(lens))])]))
    out = {name: m.score(tree, caches[name], return_state=True) for name, m in (("full", full), ("shard", shard))}
    err["score.logits"] = _rel(out["shard"][0], out["full"][0])
    path = [sum(lens[:3]) + j for j in range(4)]  # the first branch on the last anchor
    committed = {name: m.commit([caches[name]], out[name][1], [path])[0] for name, m in (("full", full), ("shard", shard))}
    for f in ("logits", "features", "hidden"):
        err[f"commit.{f}"] = _rel(getattr(committed["shard"], f), getattr(committed["full"], f))
    nxt = ProposalTree.from_branches(torch.tensor([t + 3]), ids[t + 4: t + 8].view(1, -1))
    err["next_round.logits"] = _rel(shard.score(nxt, committed["shard"]), full.score(nxt, committed["full"]))
    ext = {name: m.prefill(ids[t: t + 4], cache=caches[name]) for name, m in (("full", full), ("shard", shard))}
    err["extend.logits"] = _rel(ext["shard"].logits, ext["full"].logits)
    return err


def spawn(fn, args: tuple, out: str) -> dict:
    """Run ``fn(rank, 2, *args)`` on two spawned ranks and read what rank 0 wrote to ``out``. A rank that dies says
    whether it died before or after the results were written (a crash in the work or in the teardown)."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(fn, args=(2, *args), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException as e:
        raise AssertionError(f"{fn.__name__}: {e} ({'after' if os.path.exists(out) else 'before'} rank 0 wrote "
                             f"the results; the rank's stacks are in the captured stderr)") from e
    with open(out) as f:
        return json.load(f)


@contextlib.contextmanager
def _group(rank: int, world: int, init_file: str, device: str):
    """(TensorParallel over ``world`` ranks, this rank's device) for the block: "cpu" over gloo, "cuda" over NCCL
    with one GPU per rank. A rank that finishes waits at a barrier before the group is torn down, so no rank
    closes its connections while another still runs; a crash prints every thread's Python stack."""
    from torch.distributed.device_mesh import init_device_mesh

    from specopd.models.tensor_parallel import TensorParallel

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    if device == "cuda":  # one GPU per rank, NCCL
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        yield TensorParallel(init_device_mesh(device, (world,))), (f"cuda:{rank}" if device == "cuda" else "cpu")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, init_file: str, cases: list, out: str, device: str = "cpu") -> None:
    from specopd.models import load_target

    with _group(rank, world, init_file, device) as (tp, dev):
        res = {}
        for name, path in cases:
            full = load_target(path, device=dev)
            shard = load_target(path, device=dev, tensor_parallel=tp)
            n_full = sum(p.numel() for p in full.parameters())
            n_shard = sum(p.numel() for p in shard.parameters())
            res[name] = {"err": compare(full, shard), "params": [n_full, n_shard]}
        _write_result(rank, res, out)


# ------------------------------------------------------------------ the vocabulary-parallel loss and sampler
LOSS_CASES = {  # name: (kind, temperature, ce_weight, markov, rows N x W, chunk_rows)
    "tv_t1": ("tv", 1.0, 0.0, False, (5, 4), 3),
    "tv_t07_ce_markov": ("tv", 0.7, 0.3, True, (5, 4), 3),
    "tv_t1_ce": ("tv", 1.0, 0.2, False, (5, 4), "auto"),
    "tv_greedy_ce_markov": ("tv", 0.0, 0.5, True, (5, 4), 4),
    "tv_greedy_ties": ("ties", 0.0, 0.0, False, (3, 2), 2),
    "ce_hp_t05_markov": ("ce", 0.5, 0.0, True, (5, 4), 3),
    "ce_no_hp": ("ce_nohp", 1.0, 0.0, False, (5, 4), 7),
    "one_row": ("tv", 1.3, 0.4, True, (1, 1), 1),
}


def _loss_inputs(case, vocab, dev="cpu", d=16, r=8):
    kind, temp, ce_w, markov, (n, w), chunk = LOSS_CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = {"hq": rnd(n, w, d) * 2, "weight": rnd(vocab, d), "hp": rnd(n, w, d) * 2,
         "targets": torch.randint(0, vocab, (n, w), generator=g)}
    x["p_weight"] = x["weight"] + 0.3 * rnd(vocab, d)
    if kind == "ties":  # every p logit of a row equal: the first index (rank 0's) is the argmax
        x["p_weight"] = rnd(1, d).expand(vocab, d).contiguous()
    if markov:
        x["e"], x["w2"] = rnd(n, w, r), rnd(vocab, r) * 0.5
    mask = torch.ones(n, w, dtype=torch.bool)
    if n > 1:
        mask[1, 2:] = False  # a branch cut short
        mask[-1, 0] = False  # a branch with no valid position
    x["mask"] = mask
    return {k: v.to(dev) for k, v in x.items()}  # drawn on the CPU: the same inputs on every device


def _loss_call(case, x, tp, lo, hi):
    """(loss, alpha, nll, {input: grad}) of the case, on this rank's vocabulary block [lo, hi) when tp is given."""
    from specopd.losses import fused_ce, fused_e2e_tv

    kind, temp, ce_w, markov, _, chunk = LOSS_CASES[case]
    leaves = {k: x[k].clone().requires_grad_(True) for k in ("hq", "e", "w2") if k in x}
    w, wp = (x["weight"], x["p_weight"]) if tp is None else (x["weight"][lo:hi], x["p_weight"][lo:hi])
    mk = (leaves["e"], leaves["w2"]) if markov else None
    kw = dict(markov=mk, mask=x["mask"], temperature=temp, chunk_rows=chunk, tp=tp, denom=4.0)
    if kind.startswith("ce"):
        out = fused_ce(leaves["hq"], w, x["targets"], weights="dflash", p_weight=None if kind == "ce_nohp" else wp,
                       hp=None if kind == "ce_nohp" else x["hp"], **kw)
    else:
        out = fused_e2e_tv(leaves["hq"], w, x["hp"], p_weight=wp, ce_targets=x["targets"], ce_weight=ce_w, **kw)
    out.loss.backward()
    return out, {k: v.grad for k, v in leaves.items()}


def _sampler_errs(tp, lo, hi, vocab, dev="cpu"):
    """Tokens drawn through the gathered vocabulary against the whole one, and whether every rank drew the same."""
    import torch.distributed as dist

    from specopd.sampling import sample_from_hidden

    res = {}
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(6, 5, 16, generator=g) * 3, torch.randn(vocab, 16, generator=g)
    e, w2 = torch.randn(6, 5, 8, generator=g), torch.randn(vocab, 8, generator=g)
    h, w, e, w2 = (t.to(dev) for t in (h, w, e, w2))
    rows = [torch.tensor([0, 2, 3]), torch.tensor([1, 4])]
    for temp in (1.0, 0.8, 0.0):
        for mk in (False, True):
            def draw(weight, t):
                gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
                return sample_from_hidden(h, weight, temp, rows, gens, markov=(e, w2) if mk else None, chunk_rows=4,
                                          tp=t)
            full, shard = draw(w, None), draw(w[lo:hi], tp)
            every = [None] * tp.size
            dist.all_gather_object(every, shard.tolist())
            res[f"T={temp}{' markov' if mk else ''}"] = {"equal_unsharded": bool(torch.equal(full, shard)),
                                                          "equal_ranks": all(t == every[0] for t in every)}
    return res


def _argmax_errs(tp, lo, hi, vocab, dev="cpu") -> dict:
    """target_argmax over the split vocabulary against the whole one: random rows, a tie between a token of each
    rank's block (the lower index wins), a row of equal logits (token 0), chunks that cut the rows unevenly."""
    from specopd.losses import target_argmax

    g = torch.Generator().manual_seed(9)
    hp, w = torch.randn(5, 3, 16, generator=g), torch.randn(vocab, 16, generator=g)
    w[vocab - 2] = w[1]  # token 1 (rank 0's block) and vocab - 2 (the last rank's) tie ...
    hp[0, 0] = w[1] * 4  # ... at the maximum here
    hp[1, 2] = 0.0
    hp, w = hp.to(dev), w.to(dev)
    full = target_argmax(hp, w, chunk_rows=4)
    shard = target_argmax(hp, w[lo:hi], chunk_rows=4, tp=tp)
    return {"equal_whole": bool(torch.equal(full, shard)),
            "equal_full_logits": bool(torch.equal(full, (hp @ w.t()).argmax(-1))),
            "tie_to_lower": int(shard[0, 0]) == 1, "equal_logits_to_0": int(shard[1, 2]) == 0}


def run_loss(rank: int, world: int, init_file: str, out: str, vocab: int = 96, device: str = "cpu") -> None:
    """Every ``LOSS_CASES`` case whole and over the vocabulary split across ``world`` ranks (``device`` "cpu": gloo,
    "cuda": NCCL): rank 0 writes the largest relative differences of the loss, alpha, nll and every input's
    gradient, whether every rank got the same bits, and the sampler's agreement."""
    with _group(rank, world, init_file, device) as (tp, dev):
        lo, hi = tp.vocab_block(vocab)
        res = {"loss": {}, "same_on_ranks": {}}
        for case in LOSS_CASES:
            x = _loss_inputs(case, vocab, dev)
            full, gf = _loss_call(case, x, None, lo, hi)
            shard, gs = _loss_call(case, x, tp, lo, hi)
            err = {"loss": _rel(shard.loss.detach(), full.loss.detach())}
            for k in ("alpha", "nll"):
                if getattr(full, k) is not None:
                    err[k] = _rel(getattr(shard, k), getattr(full, k))
            err.update({f"grad.{k}": _rel(gs[k], gf[k]) for k in gf})
            res["loss"][case] = err
            mine = torch.cat([shard.loss.detach().view(1)] + [gs[k].reshape(-1) for k in sorted(gs)])
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            res["same_on_ranks"][case] = all(torch.equal(t, every[0]) for t in every)
        res["sampler"] = _sampler_errs(tp, lo, hi, vocab, dev)
        res["target_argmax"] = _argmax_errs(tp, lo, hi, vocab, dev)
        _write_result(rank, res, out)


# ------------------------------------------------------------------ DFlash V2 over a split vocabulary
V2_CASES = {  # name: (method, temperature, ce_weight, block_size, branches, masked)
    "tv_t1": ("tv", 1.0, 0.0, 4, 6, False),
    "tv_t05_ce_masked": ("tv", 0.5, 0.3, 4, 6, True),
    "tv_greedy_masked": ("tv", 0.0, 0.0, 4, 6, True),
    "ce_t1": ("ce", 1.0, 0.0, 4, 6, False),
    "one_row": ("tv", 1.0, 0.2, 2, 1, False),
}


def _topk_cases(vocab, dev="cpu"):
    """(name, h [M, d], W [V, d], K, extra [M]) for ``top_candidates``: random logits, and integer ones with ties
    inside a rank's block and across the boundary (rank 1's block a copy of rank 0's: every tie crosses it)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k in (8, vocab // 2 + 5):  # K above V / N: a rank's whole block is its local top K
        h, w = torch.randn(11, 16, generator=g) * 2, torch.randn(vocab, 16, generator=g)
        out.append((f"random_k{k}", h, w, k))
        hn = torch.randint(-1, 2, (11, 6), generator=g).float()  # small integers: exact sums, many ties
        wi = torch.randint(-1, 2, (vocab, 6), generator=g).float()
        out.append((f"int_ties_k{k}", hn, wi, k))
        wd = wi.clone()
        wd[vocab // 2:] = wd[: vocab // 2]
        out.append((f"ties_across_ranks_k{k}", hn, wd, k))
    return [(n, h.to(dev), w.to(dev), k, torch.randint(0, vocab, (h.shape[0],), generator=g).to(dev))
            for n, h, w, k in out]


def _v2_topk(tp, lo, hi, vocab, dev="cpu"):
    """top_candidates over the split vocabulary against the whole one: ids bitwise, values, dh, and the whole
    row's stable sort (value descending, id ascending)."""
    from specopd.drafters.dflash2 import top_candidates

    res = {}
    for name, h, w, k, extra in _topk_cases(vocab, dev):
        outs = []
        for weight, t in ((w, None), (w[lo:hi], tp)):
            x = h.clone().requires_grad_(True)
            vals, ids = top_candidates(x, weight, k, extra, chunk_rows=4, tp=t)
            g = torch.linspace(-1, 1, vals.numel(), device=vals.device).view_as(vals)
            (vals * g).sum().backward()
            outs.append((vals.detach(), ids, x.grad))
        (vf, idf, gf), (vs, ids_, gs) = outs
        ref = torch.sort(h @ w.t(), dim=-1, descending=True, stable=True).indices[:, :k]
        res[name] = {"ids_equal": bool(torch.equal(ids_, idf)), "ids_stable_sort": bool(torch.equal(idf[:, :k], ref)),
                     "vals": _rel(vs, vf), "dh": _rel(gs, gf)}
    return res


def _v2_candidate_p(tp, lo, hi, vocab, dev="cpu"):
    """candidate_p over the split vocabulary against the whole one: T = 1, 0.5, 0 (and 0 with every logit of a row
    equal: the argmax is id 0, on rank 0), masked rows."""
    from specopd.losses import candidate_p

    g = torch.Generator().manual_seed(4)
    hp, wp = torch.randn(5, 3, 16, generator=g) * 2, torch.randn(vocab, 16, generator=g)
    ids = torch.randint(0, vocab, (5, 3, 8), generator=g)
    ids[..., 0] = (hp @ wp.t()).argmax(-1)  # greedy: p's argmax among them
    ids[0, 0, 1] = 0
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[1, 2], mask[3] = False, False
    tied = torch.randn(1, 16, generator=g).expand(vocab, 16).contiguous()
    hp, wp, ids, mask, tied = (t.to(dev) for t in (hp, wp, ids, mask, tied))
    res = {}
    for name, t, wt in (("t1", 1.0, wp), ("t05", 0.5, wp), ("greedy", 0.0, wp), ("greedy_all_tied", 0.0, tied)):
        full = candidate_p(hp, ids, wt, t, mask, chunk_rows=4)
        shard = candidate_p(hp, ids, wt[lo:hi], t, mask, chunk_rows=4, tp=tp)
        res[name] = {"rel": _rel(shard, full), "equal": bool(torch.equal(shard, full)) if t == 0.0 else True,
                     "hits": float(full.sum())}
    return res


def _v2_loss(case, full, shard, tp):
    """The worker's DFlash V2 loss (realized scores given the previous tokens, candidate_e2e_tv / candidate_ce) on
    drafters with the same weights over the whole and the split lm_head: the largest relative differences of the
    loss, alpha, nll, ids and every drafter weight's gradient, and the walk's tokens."""
    from specopd.drafters import build_drafter, shift_tokens
    from specopd.losses import candidate_ce, candidate_e2e_tv
    from specopd.models.tensor_parallel import vocab_group

    method, temp, ce_w, bs, nb, masked = V2_CASES[case]
    v, dev = full.vocab_size, full.device
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    ids = _ids(9, 21, v)
    anchors = torch.randint(0, 9, (nb,), generator=g)
    atok = ids[anchors]
    tokens = torch.randint(0, v, (nb, bs - 1), generator=g)
    ref = torch.randint(0, v, (nb, bs - 1), generator=g)
    hp = torch.randn(nb, bs - 1, full.hidden_size, generator=g)
    mask = torch.ones(nb, bs - 1, dtype=torch.bool)
    if masked:
        mask[1, 1:], mask[-1, 0] = False, False
    ids, anchors, atok, tokens, ref, hp, mask = (t.to(dev) for t in (ids, anchors, atok, tokens, ref, hp, mask))
    feats = [full.hidden_states(ids.view(1, -1), [1, 2])[0]]
    drafters = []
    for t in (full, shard):
        d = build_drafter("dflash2", t, num_layers=1, block_size=bs, seed=0, feature_layers=[1, 2],
                          selector_top_k=6, output_multiplier=0.7, final_logit_softcapping=2.0)
        gg = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "base_kernel" in name or "kernel_projection" in name or "candidate_selector" in name:
                    p.copy_(torch.empty_like(p, device="cpu").normal_(0, 0.3, generator=gg))  # a CPU draw
        drafters.append(d)
    outs = []
    for d, t in zip(drafters, (full, shard)):
        tp_ = vocab_group(t.lm_head)
        h = d.hidden(feats, anchors, torch.zeros(nb, dtype=torch.long), atok)
        prev = shift_tokens(atok, tokens)
        extra = tokens if method == "ce" else (ref if ce_w > 0 else None)
        r = d.realized(h, prev, extra, chunk_rows=3)
        kw = dict(p_weight=t.lm_head.weight, mask=mask, denom=4.0, temperature=temp, chunk_rows=3, tp=tp_)
        if method == "ce":
            out = candidate_ce(r.ids, r.scores, tokens, r.extra, hp=hp, **kw)
        else:
            out = candidate_e2e_tv(r.ids, r.scores, hp, ce_targets=extra, ce_scores=r.extra, ce_weight=ce_w, **kw)
        out.loss.backward()
        with torch.no_grad():
            cands = d.candidates(h.detach())
            walk = d.walk(cands, atok, temp, torch.Generator().manual_seed(13))[0]
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        outs.append((out, r.ids, walk, grads))
    (of, idf, wf, gf), (os_, ids_, ws, gs) = outs
    err = {"loss": _rel(os_.loss.detach(), of.loss.detach()), "alpha": _rel(os_.alpha, of.alpha)}
    if of.nll is not None:
        err["nll"] = _rel(os_.nll, of.nll)
    err.update({f"grad.{n}": _rel(gs[n], gf[n]) for n in gf})
    flags = {"ids_equal": bool(torch.equal(ids_, idf)), "walk_equal": bool(torch.equal(ws, wf)),
             "same_grads": sorted(gs) == sorted(gf)}
    mine = torch.cat([os_.loss.detach().view(1)] + [gs[n].reshape(-1) for n in sorted(gs)])
    return err, flags, mine


def run_v2(rank: int, world: int, init_file: str, path: str, out: str, device: str = "cpu") -> None:
    """DFlash V2 over a vocabulary split across ``world`` ranks (``device`` "cpu": gloo, "cuda": NCCL):
    ``top_candidates``, ``candidate_p`` and the V2 loss of every ``V2_CASES`` case against the whole vocabulary;
    rank 0 writes the results."""
    from specopd.models import load_target
    from specopd.models.tensor_parallel import vocab_group

    with _group(rank, world, init_file, device) as (tp, dev):
        vocab = 96
        lo, hi = tp.vocab_block(vocab)
        res = {"topk": _v2_topk(tp, lo, hi, vocab, dev), "candidate_p": _v2_candidate_p(tp, lo, hi, vocab, dev),
               "loss": {}, "flags": {}, "same_on_ranks": {}}
        full, shard = load_target(path, device=dev), load_target(path, device=dev, tensor_parallel=tp)
        res["split_head"] = vocab_group(shard.lm_head) is tp
        for case in V2_CASES:
            err, flags, mine = _v2_loss(case, full, shard, tp)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            res["loss"][case], res["flags"][case] = err, flags
            res["same_on_ranks"][case] = all(torch.equal(t, every[0]) for t in every)
        _write_result(rank, res, out)


# ------------------------------------------------------------------ a policy swapped into a shard in place
def _swap_outputs(m) -> dict:
    """What a training step reads from the target ``m``: a prefill's logits, hidden states and features, a tree's
    scores and hidden states, and the fused E2E-TV loss (with its CE term) on them over ``m``'s lm_head (this
    rank's vocabulary block when it is split), with the gradient of the drafter side's hidden states."""
    from specopd.losses import fused_e2e_tv
    from specopd.models.tensor_parallel import vocab_group
    from specopd.tree import ProposalTree

    v = m.vocab_size
    cache = m.prefill(_ids(30, 7, v), feature_layers=FL, gdn_checkpoint_every=C, keep_hidden=True)
    tree = ProposalTree.from_branches(torch.tensor([3, 11, 29]), torch.stack([_ids(4, 50 + i, v) for i in range(3)]))
    logits, hp = m.score(tree, cache, return_hidden=True)
    g = torch.Generator().manual_seed(1)
    hq = (torch.randn(hp.shape, generator=g) * 2).requires_grad_(True)
    w = m.lm_head.weight
    out = fused_e2e_tv(hq, w, hp, p_weight=w, ce_targets=torch.randint(0, v, hp.shape[:2], generator=g), ce_weight=0.2,
                       temperature=1.0, chunk_rows=2, denom=3.0, tp=vocab_group(m.lm_head), kernel_paths=m.kernel_paths)
    out.loss.backward()
    return {"prefill.logits": cache.logits, "prefill.hidden": cache.hidden, "prefill.features": cache.features,
            "score.logits": logits, "score.hidden": hp, "loss": out.loss.detach(), "alpha": out.alpha,
            "grad.hq": hq.grad}


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def run_swap(rank: int, world: int, init_file: str, cases: list, out: str) -> None:
    """Each case's (name, version 0 folder, version 1 folder): the target sharded over ``world`` gloo ranks at
    version 0 and run, then version 1 swapped in place as ``Worker.swap_policy`` does (``policy_weights`` then
    ``copy_weights_``; from the folder with the lm_head split by vocabulary, from a state dict with Hugging Face
    names with it whole). Rank 0 writes, per case and head: whether every parameter and every output of
    ``_swap_outputs`` equals a fresh shard of version 1 bitwise (the names that do not), the largest relative differences from the
    unsharded version 1 (``compare`` and the outputs), whether the tensors stayed the same, and the messages of two
    refused swaps (a shard's local weights given as the new ones, a tensor of another shape in the state dict)."""
    from torch.distributed.tensor import DTensor

    from specopd.models import load_target
    from specopd.models.loading import policy_weights, read_state_dict
    from specopd.models.tensor_parallel import TensorParallel

    with _group(rank, world, init_file, "cpu") as (group, dev):
        res = {}
        for name, v0, v1 in cases:
            full = load_target(v1)
            want_full = _swap_outputs(full)
            for split in (True, False):
                shard = load_target(v0, tensor_parallel=TensorParallel(group.mesh, shard_vocab=split))
                before = _swap_outputs(shard)  # runs it: what it caches of its weights is version 0's
                params = dict(shard.named_parameters())
                ptrs = {k: p.data_ptr() for k, p in params.items()}
                kept = {k: p.clone() for k, p in params.items()}
                fresh = load_target(v1, tensor_parallel=TensorParallel(group.mesh, shard_vocab=split))
                local = {k: p.clone() for k, p in fresh.named_parameters()}
                bad_local = _refusal(lambda: shard.copy_weights_(local))
                raw = read_state_dict(v1)
                norm = min(k for k in raw if k.endswith("norm.weight"))
                wrong = {**raw, norm: raw[norm][:-1]}
                bad_shape = _refusal(lambda: shard.copy_weights_(policy_weights(shard, wrong)))
                untouched = all(torch.equal(p, kept[k]) for k, p in params.items())
                shard.copy_weights_(policy_weights(shard, v1 if split else raw))
                got, want = _swap_outputs(shard), _swap_outputs(fresh)
                res[f"{name}/{'vocab_parallel' if split else 'replicated'}"] = {
                    "params_unequal_fresh": sorted(k for k, p in shard.named_parameters() if not torch.equal(p, local[k])),
                    "outputs_unequal_fresh": sorted(k for k in want if not torch.equal(got[k], want[k])),
                    "outputs_as_version_0": sorted(k for k in want if torch.equal(got[k], before[k])),
                    "err_unsharded": {**compare(full, shard), **{k: _rel(got[k], want_full[k]) for k in want_full}},
                    "in_place": {k: p.data_ptr() for k, p in shard.named_parameters()} == ptrs,
                    "dtensor_params": [k for k, p in shard.named_parameters() if isinstance(p, DTensor)],
                    "sharded": sum(p.numel() for p in params.values()) < sum(p.numel() for p in full.parameters()),
                    "refused_local": bad_local, "refused_shape": bad_shape, "untouched_by_refusals": untouched}
        _write_result(rank, res, out)
