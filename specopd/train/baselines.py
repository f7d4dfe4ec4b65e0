"""Baselines on the same target, drafter and data.

Draft-OPD (``trainer.method: draft_opd``): a sequential draft-and-verify rollout from each prompt with
lossless rejection sampling at ``trainer.temperature``. Per round, for every still-active sequence: the
drafter drafts a W-token block after the last committed token (the anchor), the target scores the block
in one packed pass (all active sequences together), the block is verified (accept d_j with probability
min(1, p/q), on rejection resample from norm(max(0, p - q)); all accepted -> bonus token from p), the
committed tokens extend the trunk cache (``target.prefill(new, cache=...)``), and the accepted prefix
decides where the next block starts. Every drafted block with its target p is kept, and training waits
for the rollout to end (at most ``anchors_per_seq`` rounds per sequence, or when the sequence reaches the
reference's length). The loss is the same E2E-TV on (context, drafted block, p) as SpecOPD.

Off-policy CE / E2E-TV need no code here: ``Worker.propose(..., reference=True)`` takes the W reference
tokens after each anchor as the block and ``Worker.score`` reads p from the reference's trunk logits.
"""
from __future__ import annotations

import torch

from specopd.train.worker import sample_branches


def verify_block(p_logits: torch.Tensor, q_logits: torch.Tensor, draft: torch.Tensor, temperature: float,
                 generator: torch.Generator) -> tuple:
    """Lossless rejection sampling of one block.

    p_logits [W + 1, V] (p for draft positions 0..W-1 and the bonus position), q_logits [W, V], draft [W].
    Returns (number of accepted draft tokens k, the committed tokens: draft[:k] + one corrected/bonus token).
    """
    w = draft.numel()
    p = torch.softmax(p_logits.float() / temperature, -1)
    q = torch.softmax(q_logits.float() / temperature, -1)
    dev = p.device
    for j in range(w):
        x = int(draft[j])
        u = float(torch.rand((), generator=generator, device=dev))
        if u * float(q[j, x]) < float(p[j, x]):  # u < p/q, written without dividing by q
            continue
        resid = (p[j] - q[j]).clamp(min=0)
        if float(resid.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            resid = p[j]
        y = torch.multinomial(resid / resid.sum(), 1, generator=generator)
        return j, torch.cat([draft[:j], y.to(draft)])
    y = torch.multinomial(p[w], 1, generator=generator)
    return w, torch.cat([draft, y.to(draft)])


@torch.no_grad()
def draft_opd_rollout(worker, sample_ids, step) -> tuple:
    """Run the rollout for ``sample_ids`` and return (proposals, p_logits [N, W, V]) like propose/score."""
    from specopd.tree import ProposalTree

    t = worker.cfg.trainer
    target, drafter, W, dev = worker.target, worker.drafter, worker.W, worker.device
    samples = [worker.sample(s) for s in sample_ids]
    gens = [worker._gen("branch", step, int(s)) for s in sample_ids]
    with worker._span("prefill"):
        caches = [target.prefill(s["input_ids"][: s["prompt_len"]].to(dev), feature_layers=drafter.feature_layers,
                                 gdn_checkpoint_every=worker.cfg.model.gdn_checkpoint_every) for s in samples]
    limit = [int(s["input_ids"].numel()) for s in samples]
    rounds = [0] * len(samples)
    blocks = []  # (sample index, anchor, anchor token, drafted [W], p [W, V])
    while True:
        active = [i for i in range(len(samples)) if rounds[i] < t.anchors_per_seq and len(caches[i]) < limit[i]]
        if not active:
            break
        anchors = torch.tensor([len(caches[i]) - 1 for i in active], device=dev)
        atok = torch.stack([caches[i].token_ids[-1] for i in active])
        with worker._span("propose"), worker._autocast():
            draft, q = sample_branches(drafter, [caches[i].features for i in active], anchors,
                                       torch.arange(len(active), device=dev), atok, t.temperature,
                                       [torch.tensor([k], device=dev) for k in range(len(active))],
                                       [gens[i] for i in active])
        with worker._span("score"):
            trees = [ProposalTree.from_branches(anchors[k: k + 1].cpu(), draft[k: k + 1].cpu())
                     for k in range(len(active))]
            s = target.score(ProposalTree.pack(trees), [caches[i] for i in active])  # [A, W, V]
            p0 = torch.stack([caches[i].logits[-1] for i in active])[:, None]
            p_all = torch.cat([p0, s.to(p0.dtype)], 1)  # [A, W + 1, V]
            commits = []
            for k, i in enumerate(active):
                _, new = verify_block(p_all[k], q[k], draft[k], t.temperature, gens[i])
                commits.append(new)
                blocks.append((i, int(anchors[k]), atok[k], draft[k], p_all[k, :W]))
        with worker._span("prefill"):
            for k, i in enumerate(active):
                caches[i] = target.prefill(commits[k], cache=caches[i])
                rounds[i] += 1
    proposals = {
        "anchors": torch.tensor([b[1] for b in blocks], device=dev),
        "trunk_index": torch.tensor([b[0] for b in blocks], device=dev),
        "anchor_tokens": torch.stack([b[2] for b in blocks]),
        "tokens": torch.stack([b[3] for b in blocks]),
        "features": [c.features for c in caches],
        "sample_ids": list(sample_ids), "reference": False,
    }
    return proposals, torch.stack([b[4] for b in blocks])
