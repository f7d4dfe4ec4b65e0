"""Rank processes for the tensor-parallel tests: each rank loads the unsharded target and its own shard, runs the
same prefill / score / verify / commit on both, and rank 0 writes the largest relative differences per case."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

FL = (0, 1)
C = 8  # GDN checkpoint interval: trunks and commits cross it


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


def run(rank: int, world: int, init_file: str, cases: list, out: str, device: str = "cpu") -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from specopd.models import load_target
    from specopd.models.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    if device == "cuda":  # one GPU per rank, NCCL
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    try:
        tp = TensorParallel(init_device_mesh(device, (world,)))
        res = {}
        for name, path in cases:
            full = load_target(path, device=dev)
            shard = load_target(path, device=dev, tensor_parallel=tp)
            n_full = sum(p.numel() for p in full.parameters())
            n_shard = sum(p.numel() for p in shard.parameters())
            res[name] = {"err": compare(full, shard), "params": [n_full, n_shard]}
        if rank == 0:
            with open(out + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(out + ".tmp", out)
    finally:
        dist.destroy_process_group()
