"""Baselines on the same target, drafter and data: Draft-OPD (``trainer.method: draft_opd``), a sequential
draft-and-verify rollout batched over the step's sequences (``specopd.speculative``), trained with the same fused
E2E-TV as SpecOPD; off-policy CE / E2E-TV need no code here. Design: specopd/train/DESIGN.md ("Baselines").
"""
from __future__ import annotations

import torch

from specopd import speculative as spec
from specopd.train.handoff import Proposals


def _prompt_hidden(target, sample, dev) -> torch.Tensor:
    """[1, D]: what lm_head reads after the prompt (a one-token prompt's verify pass does not cover it)."""
    ids = sample["input_ids"][: sample["prompt_len"]].to(dev)
    return target.prefill(ids, keep_logits=False, keep_hidden=True, keep_checkpoints=False).hidden[-1:]


@torch.no_grad()
def draft_opd_rollout(worker, sample_ids, step) -> tuple:
    """Run the rollout for ``sample_ids`` and return (Proposals, hp [N, W, D]) like the propose and score phases
    (``specopd.train.phases``): hp[b, j] is the target's hidden state (what lm_head reads) whose logits are p for
    block b's drafted token j.
    Target passes: one prefill per prompt + one per round (all active sequences together); a one-token prompt
    adds one pass of that token for its hidden state (its p came from the start's logits)."""
    t = worker.cfg.trainer
    target, drafter, dev = worker.target, worker.drafter, worker.device
    W = int(drafter.draft_len)
    samples = [worker.sample(s) for s in sample_ids]
    gens = [worker.generator("branch", step, int(s)) for s in sample_ids]
    with worker.span("prefill"):
        seqs = [spec.start(target, s["input_ids"][: s["prompt_len"]].to(dev), drafter.feature_layers,
                           worker.cfg.model.gdn_checkpoint_every) for s in samples]
    limit = [int(s["input_ids"].numel()) for s in samples]
    rounds, done = [0] * len(samples), [len(s) >= n for s, n in zip(seqs, limit)]
    blocks = []  # (sample index, anchor, anchor token, drafted [W], hp [W, D])
    while not all(done):
        active = [i for i in range(len(samples)) if not done[i]]
        cur, g = [seqs[i] for i in active], [gens[i] for i in active]
        anchors = [s.anchor for s in cur]
        with worker.span("propose"), worker.autocast():  # one drafter call over the context caches
            draft, q = spec.draft(drafter, cur, t.acceptance_temperature, g)  # [A, W], [A, W, V]
        with worker.span("score"):
            p, state = spec.verify(target, cur, draft)  # [A, W + 1, V]
            n, nxt = spec.accept(draft, q, p, t.acceptance_temperature, g)
            hid = state.tree.split(state.hidden)  # per sequence [W + 1, D] ([W, D] when its last is None)
        for k, i in enumerate(active):
            hk = hid[k]
            if cur[k].last is None:  # a one-token prompt: slot 0's p came from the prompt pass's logits
                hk = torch.cat([_prompt_hidden(target, samples[i], dev).to(hk.dtype), hk])
            blocks.append((i, anchors[k], cur[k].anchor_token, draft[k], hk[:W]))
            rounds[i] += 1
            done[i] = rounds[i] >= t.anchors_per_seq or len(seqs[i]) + n[k] + 1 >= limit[i]
        with worker.span("commit"):
            new = spec.commit(target, cur, state, n, nxt, keep=[not done[i] for i in active])
        for k, i in enumerate(active):
            seqs[i] = new[k]
    proposals = Proposals(
        anchors=torch.tensor([b[1] for b in blocks], device=dev),
        trunk_index=torch.tensor([b[0] for b in blocks], device=dev),
        anchor_tokens=torch.tensor([b[2] for b in blocks], device=dev),
        tokens=torch.stack([b[3] for b in blocks]),
        features=[s.cache.features for s in seqs],
        sample_ids=list(sample_ids), reference=False,
        trunk_tokens=[torch.cat([s.cache.token_ids.to(dev)] + ([torch.tensor([s.last], device=dev)]
                                                               if s.last is not None else [])) for s in seqs])
    return proposals, torch.stack([b[4] for b in blocks])
