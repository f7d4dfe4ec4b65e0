"""The SpecOPD training step, phase by phase: the file to open first.

One worker's share of a step (``sample_ids``, a part of the global batch) passes these phases, each a function
of the worker's state (``specopd.train.worker.Worker``: models, optimizer, data, generators, profiler) and the
records the phases hand each other (``specopd.train.handoff``):

    prefill         the target runs each reference sequence (trunk) once -> a TargetCache per trunk with the
                    drafter's features [T, F] and the final hidden [T, D] that lm_head reads (no [T, V] logits)
    anchors         B positions per sample where W supervised tokens follow, seeded by (seed, step, sample)
    propose         -> Proposals: ONE drafter forward h [N, W, D] over every branch (with its graph) and the
                    branch tokens sampled from it detached (off-policy: the reference's tokens after each anchor)
    score           -> hp [N, W, D]: the target's hidden states at the branch slots, one packed tree pass
    loss_backward   the fused chunked E2E-TV (or CE) of h against hp, / denom (the global branch count), backward
    optimizer_step  all-reduce the gradients, clip, AdamW, the LR schedule (a NaN / inf step is skipped everywhere)

The schedules compose them, one function each:

    colocated_step  every phase on one worker (``runtime.roles: colocated``)
    split_step      target workers prefill and score, drafter workers propose and train (``runtime.roles: split``);
                    only Trunk, Branches and hp cross between them
    invariant_step  each sample alone, the gradient summed in a fixed tree (``trainer.batch_invariant``)
    draft_opd_step  Draft-OPD: a sequential rollout (``specopd.train.baselines``) in place of prefill / propose /
                    score; the loss's denominator is known only once every worker has rolled out
    evaluate        held-out acceptance: prefill, propose, score in eval mode, alpha without a backward
                    (``split_evaluate`` over split roles)

Where a function runs is the group's business (``specopd.train.group``): ``group.run(colocated_step, args)``
calls ``colocated_step(worker, *args)`` on each worker, in this process or in a Ray actor. The global step around
these (shards, the denominator, the reduced metrics) is ``specopd.train.step``. Design: specopd/train/DESIGN.md
("The step").
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, List, Optional, Sequence, Union

import torch

from specopd.drafters import shift_tokens
from specopd.losses import (candidate_ce, candidate_e2e_tv, confidence_loss, FusedOut, fused_ce, fused_e2e_tv,
                            fused_ttt, prefix_survival, target_argmax)
from specopd.signals import uninterrupted
from specopd.train.baselines import draft_opd_rollout
from specopd.train.determinism import all_blocks, block_sum, blocks, combine
from specopd.train.handoff import Branches, GradBlocks, Proposals, Scored, Staged, Trunk
from specopd.train.worker import seed_for
from specopd.tree import ProposalTree

if TYPE_CHECKING:
    from specopd.models.context import TargetCache
    from specopd.train.worker import Worker


# ---------------------------------------------------------------------------------------------- the phases
def begin(worker: "Worker", zero_grad: bool = True) -> None:
    """A step starts on this worker: its phase times reset and (unless told not to) its gradients zeroed."""
    worker.phase_s = {}
    if zero_grad:
        worker.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def prefill(worker: "Worker", sample_ids, reuse: bool = False) -> list:
    """One target pass per reference sequence -> TargetCache list (layer caches, drafter features [T, F],
    the final hidden [T, D] that lm_head reads; no [T, V] logits). ``reuse`` (off-policy training steps with
    trainer.cache_trunks): caches without layer caches, each sequence run once and kept in the worker."""
    w = worker
    with w.span("prefill"):
        todo = [s for s in dict.fromkeys(int(s) for s in sample_ids) if s not in w.cached_trunks] if reuse \
            else list(sample_ids)
        new = w.target.prefill_batch([w.sample(s)["input_ids"].to(w.device) for s in todo],
                                     feature_layers=w.drafter.feature_layers,
                                     gdn_checkpoint_every=w.cfg.model.gdn_checkpoint_every,
                                     keep_logits=False, keep_hidden=True) if todo else []
        if not reuse:
            return new
        for s, c in zip(todo, new):  # trainer.cache_trunks: off-policy needs no K/V, only these
            w.cached_trunks[int(s)] = dataclasses.replace(c, layers=[], extra={})
        return [w.cached_trunks[int(s)] for s in sample_ids]


def anchors(worker: "Worker", sid: int, step, num: int) -> torch.Tensor:
    """B anchors of a sample, uniform without replacement on its valid anchors (sorted;
    ``specopd.train.data.valid_anchors``: the response, or the assistant tokens of a loss mask). For a
    response after ``prompt_len`` the valid anchors are the range lo..hi, and this is ``perm + lo`` exactly.

    Args:
        worker: the worker (its samples' valid anchors, the recipe's seed).
        sid: the sample's id.
        step: the step index, or "eval" (it seeds the draw with the sample id).
        num: B, at most that many anchors (fewer when the sample has fewer).

    Returns:
        [<= num] int64 trunk positions, sorted.
    """
    valid = worker.anchor_positions[int(sid)]
    if valid.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    g = torch.Generator().manual_seed(seed_for(worker.cfg.seed, "anchors", step, int(sid)))
    perm = torch.randperm(valid.numel(), generator=g)[:num]
    return valid[perm].sort().values


def propose(worker: "Worker", caches: Sequence[Union["TargetCache", Trunk]], sample_ids, step,
            anchors_per_seq: Optional[int] = None, temperature: Optional[float] = None,
            reference: bool = False) -> Proposals:
    """Anchors + ONE drafter forward ``hidden`` [N, W, D] (carrying the gradient when grad is enabled: the
    loss reuses it) + branch tokens [N, W] sampled from it detached, in row chunks (or, with ``reference``,
    the reference tokens after each anchor).

    Args:
        worker: the worker whose drafter proposes.
        caches: per sample, anything with ``token_ids`` [T] and ``features`` [T, F] (a TargetCache, or a Trunk
            from the target worker).
        sample_ids: the samples' ids (they seed the anchors and tokens).
        step: the step index (it seeds them too).
        anchors_per_seq: B; None: ``trainer.anchors_per_seq``.
        temperature: None: ``trainer.acceptance_temperature``.
        reference: take the reference tokens after each anchor (off-policy) instead of sampling.

    Returns:
        ``Proposals``.
    """
    w, t = worker, worker.cfg.trainer
    b = anchors_per_seq or t.anchors_per_seq
    temp = t.acceptance_temperature if temperature is None else temperature
    with w.span("propose"):
        starts, tix, rows, n = [], [], [], 0
        for i, sid in enumerate(sample_ids):
            a = anchors(w, sid, step, b)
            starts.append(a)
            tix.append(torch.full_like(a, i))
            rows.append(torch.arange(n, n + a.numel(), device=w.device))
            n += a.numel()
        starts, tix = torch.cat(starts).to(w.device), torch.cat(tix).to(w.device)
        if n == 0:
            raise ValueError(f"samples {list(sample_ids)} have no valid anchor (responses shorter than "
                             f"drafter.block_size tokens); lower drafter.block_size or use longer sequences")
        trunks = [c.token_ids for c in caches]
        feats = [c.features for c in caches]
        anchor_tokens = torch.cat([trunks[i][starts[r]] for i, r in enumerate(rows)])
        want_ce = t.ce_weight > 0
        ref_tokens = None
        if reference or want_ce:
            offs = starts[:, None] + 1 + torch.arange(w.W, device=w.device)
            ref_tokens = torch.cat([trunks[i][offs[r]] for i, r in enumerate(rows)])
        gens = None if reference else [w.generator("branch", step, int(s)) for s in sample_ids]
        if getattr(w.drafter, "autoregressive", False):  # EAGLE-3: each step reads the token drafted before
            with w.autocast():  # (reference: training-time test, the reference's tokens on its own hidden states)
                h, tokens = w.drafter.unroll(feats, trunks, starts, tix, temp, gens, rows,
                                             tokens=ref_tokens if reference else None, chunk_rows=t.loss_chunk_rows,
                                             steps=w.W)
        else:
            with w.autocast():
                h = w.drafter.hidden(feats, starts, tix, anchor_tokens)  # [N, W, D]
            tokens = ref_tokens if reference else \
                w.drafter.sample_tokens(h, anchor_tokens, temp, gens, rows, chunk_rows=t.loss_chunk_rows)
    return Proposals(anchors=starts, trunk_index=tix, anchor_tokens=anchor_tokens, tokens=tokens,
                     features=feats, sample_ids=list(sample_ids), reference=reference, hidden=h,
                     reference_tokens=ref_tokens if want_ce else None, trunk_tokens=trunks)


@torch.no_grad()
def score(worker: "Worker", proposals: Union[Proposals, Branches], caches) -> torch.Tensor:
    """The target side hp [N, W, D] (what lm_head reads) for each branch slot: k = 0 from the trunk, k >= 1
    from the packed tree pass (hidden states only: no [N, W, V] logits; ``losses.logits_at`` gives p for a
    few rows). Reference blocks (off-policy) need no tree pass: hp comes from the reference's trunk."""
    w = worker
    a, tix, tok = proposals.anchors, proposals.trunk_index, proposals.tokens
    with w.span("score"):
        if bool((tix[1:] < tix[:-1]).any()):
            raise ValueError("score: branches must be grouped by trunk (trunk_index non-decreasing), as "
                             "propose() returns them; the packed tree lists trunk 0's branches first")
        if any(c.hidden is None for c in caches):
            raise ValueError("score: the trunk caches need their final hidden states (prefill(..., "
                             "keep_hidden=True), as phases.prefill builds them)")
        rows = [torch.nonzero(tix == i).flatten() for i in range(len(caches))]
        if proposals.reference:
            offs = a[:, None] + torch.arange(w.W, device=a.device)
            return torch.cat([caches[i].hidden[offs[r]] for i, r in enumerate(rows)])
        h0 = torch.cat([caches[i].hidden[a[r]] for i, r in enumerate(rows)])[:, None]  # [N, 1, D]
        if w.W == 1:
            return h0
        trees = [ProposalTree.from_branches(a[tix == i].cpu(), tok[tix == i, : w.W - 1].cpu())
                 for i in range(len(caches))]
        rest = w.target.score(ProposalTree.pack(trees), caches, return_logits=False,
                              return_hidden=True)  # [N, W-1, D], trunk order == our order
        return torch.cat([h0, rest.to(h0.dtype)], 1)


def _head_terms(worker: "Worker", proposals: Proposals):
    """(q's head weight: the target's lm_head [V, D] (this rank's block [V / N, D] with ``vocab_tp``), or an
    autoregressive drafter's own head [Vq, D]; DSpark's Markov term (W1[prev] [N, W, r], W2 [V, r]) or None;
    prev [N, W])."""
    prev = shift_tokens(proposals.anchor_tokens, proposals.tokens)
    if getattr(worker.drafter, "autoregressive", False):
        return worker.drafter.head_weight(), None, prev
    head = getattr(worker.drafter, "markov_head", None)
    markov = None if head is None else (worker.drafter.markov_features(prev), head.markov_w2.weight)
    return worker.target.lm_head.weight, markov, prev


def _own_head(worker: "Worker") -> dict:
    """The fused losses' extra arguments for a drafter with its own head (EAGLE-3): p from the target's lm_head,
    q on the head's columns (``q_ids``: their target ids, None when they are the whole vocabulary); {} else."""
    d = worker.drafter
    if not getattr(d, "autoregressive", False):
        return {}
    if worker.vocab_tp is not None and worker.vocab_tp.size > 1:
        raise NotImplementedError(f"a {d.kind} drafter has its own lm_head: model.vocab_parallel is not supported "
                                  f"with it; turn it off")
    return {"p_weight": worker.target.lm_head.weight, "q_ids": d.vocab_ids}


def _columns(worker: "Worker", tokens: torch.Tensor) -> tuple:
    """Target ids [N, W] -> (q's columns [N, W], in q's vocabulary [N, W] bool) for a drafter with a draft
    vocabulary; (tokens, None) otherwise."""
    ids = getattr(worker.drafter, "vocab_ids", None)
    if ids is None:
        return tokens, None
    col = torch.full((int(worker.target.vocab_size),), -1, dtype=torch.long, device=ids.device)
    col[ids] = torch.arange(ids.numel(), device=ids.device)
    c = col[tokens.to(ids.device)]
    return c.clamp_min(0), c >= 0


def _ce_targets(worker: "Worker", proposals: Proposals, hp: torch.Tensor) -> Optional[torch.Tensor]:
    """The labels of the ``trainer.ce_weight`` term [N, W]: the reference's tokens, or with ``trainer.ce_labels:
    target`` the target's argmax at each scored position of hp (None without the term)."""
    t = worker.cfg.trainer
    if t.ce_weight > 0 and t.ce_labels == "target":
        return target_argmax(hp, worker.target.lm_head.weight, chunk_rows=t.loss_chunk_rows, tp=worker.vocab_tp)
    return proposals.reference_tokens


def _selector_loss(worker: "Worker", proposals: Proposals, h: torch.Tensor, hp: torch.Tensor, denom, method: str):
    """DFlash V2's loss (``FusedOut``): q = the realized candidate scores given each slot's previous token (the
    branch's own sampled tokens, or the reference's off-policy), alpha over the candidates, the CE over the
    candidates joined by the reference token, plus ``trainer.vocab_ce_weight`` x DFlash's full-vocabulary CE
    on the raw logits (specopd/drafters/DFLASH2.md); no [N, W, V]. method "eval": alpha only (no CE term)."""
    t, lm = worker.cfg.trainer, worker.target.lm_head.weight
    prev = shift_tokens(proposals.anchor_tokens, proposals.tokens)
    ce, ce_weight = method == "offpolicy_ce", t.ce_weight if method != "eval" else 0.0
    extra = proposals.tokens if ce else (_ce_targets(worker, proposals, hp) if ce_weight > 0 else None)
    with worker.autocast():
        r = worker.drafter.realized(h, prev, extra, chunk_rows=t.loss_chunk_rows)
    kw = dict(p_weight=lm, denom=denom, temperature=t.acceptance_temperature, chunk_rows=t.loss_chunk_rows,
              tp=worker.vocab_tp)
    if ce:
        out = candidate_ce(r.ids, r.scores, proposals.tokens, r.extra, hp=hp, **kw)
        if t.vocab_ce_weight > 0:  # DFlash's CE on the raw logits, over the whole vocabulary, chunked
            full = fused_ce(h, lm, proposals.tokens, denom=denom, chunk_rows=t.loss_chunk_rows, tp=worker.vocab_tp,
                            kernel_paths=worker.target.kernel_paths)
            out = FusedOut(out.loss + t.vocab_ce_weight * full.loss, out.alpha, out.nll)
        return out
    return candidate_e2e_tv(r.ids, r.scores, hp, ce_targets=extra, ce_scores=r.extra, ce_weight=ce_weight, **kw)


def loss_backward(worker: "Worker", proposals: Proposals, hp: torch.Tensor, denom) -> dict:
    """Fused chunked loss on the proposals' drafter forward (``proposals.hidden``, taken: this backward
    consumes its graph; Draft-OPD's proposals have none: one forward with grad here) against the target side,
    / denom, backward. DSpark teacher-forces its own sampled tokens through its Markov head.

    Args:
        worker: the worker whose drafter gets the gradients.
        proposals: this share's ``Proposals``.
        hp: [N, W, D] the target's hidden states at the branch slots (``score``).
        denom: the global branch count (the loss is a sum over branches / denom, so the workers' gradients add
            up to the global batch's).

    Returns:
        partial sums (the controller adds them over workers): loss, branches, supervised_tokens, alpha_sum and
        surv_sum per draft position; alpha comes from the loss's pass.
    """
    w, t = worker, worker.cfg.trainer
    method = t.method
    with w.span("loss_backward"):
        tokens = proposals.tokens
        h = proposals.take_hidden()  # the graph is consumed by this backward
        if h is None:
            with w.autocast():
                h = w.drafter.hidden(proposals.features, proposals.anchors, proposals.trunk_index,
                                     proposals.anchor_tokens, *([proposals.trunk_tokens, tokens] if
                                                                getattr(w.drafter, "autoregressive", False) else []))
        weight, markov, prev = _head_terms(w, proposals)
        kw = dict(markov=markov, denom=denom, temperature=t.acceptance_temperature, chunk_rows=t.loss_chunk_rows,
                  tp=w.vocab_tp, kernel_paths=w.target.kernel_paths, **_own_head(w))
        hp = hp.to(h.device)
        if getattr(w.drafter, "has_selector", False):  # DFlash V2: q lives on each slot's top K
            out = _selector_loss(w, proposals, h, hp, denom, method)
        elif method == "offpolicy_ce" and getattr(w.drafter, "soft_ttt", False):
            # training-time test as SpecForge: soft CE against the target's p on q's vocabulary, steps 0.8^k
            out = fused_ttt(h, weight, hp, p_weight=w.target.lm_head.weight, q_ids=w.drafter.vocab_ids, denom=denom,
                            temperature=t.acceptance_temperature, chunk_rows=t.loss_chunk_rows,
                            kernel_paths=w.target.kernel_paths)
        elif method == "offpolicy_ce":
            out = fused_ce(h, weight, tokens, hp=hp, **kw)
        else:
            ce, inside = _ce_targets(w, proposals, hp), None
            if ce is not None and t.ce_weight > 0:  # a draft vocabulary: labels as q's columns, those it lacks skipped
                ce, inside = _columns(w, ce)
            out = fused_e2e_tv(h, weight, hp, ce_targets=ce, ce_weight=t.ce_weight, ce_mask=inside, **kw)
        loss, alpha = out.loss, out.alpha
        if getattr(w.drafter, "has_confidence", False) and w.cfg.drafter.confidence_weight > 0:
            with w.autocast():
                conf = w.drafter.confidence_logits(h, prev)
            loss = loss + w.cfg.drafter.confidence_weight * confidence_loss(conf, alpha, denom=denom)
        loss.backward()
        surv = prefix_survival(alpha)
    n = int(tokens.shape[0])
    return {"loss": float(loss.detach()), "branches": n, "supervised_tokens": n * int(tokens.shape[1]),
            "alpha_sum": alpha.sum(0).tolist(), "surv_sum": surv.sum(0).tolist()}


def optimizer_step(worker: "Worker", loss_finite: bool = True, grad_blocks: Optional[GradBlocks] = None) -> dict:
    """All-reduce (sum) gradients, clip the global norm, AdamW step, advance the LR schedule.

    Guard: a NaN / inf gradient norm after the all-reduce (or a non-finite loss on any worker,
    ``loss_finite=False``: its gradients are made NaN before the all-reduce, so every replica sees it)
    skips the AdamW step on every replica alike; the schedule and ``steps_done`` still advance (the
    step's data is consumed) and the result says ``skipped``. ``grad_blocks`` (``invariant_step``): the
    gradient as summation-tree blocks, exchanged and combined in a fixed order instead of the all-reduce."""
    w = worker
    grads = []
    for p in w.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if grad_blocks is not None:  # trainer.batch_invariant (invariant_step)
        _reduce_blocks(w, grad_blocks, grads, loss_finite)
    else:
        if not loss_finite:
            for g in grads:
                g.fill_(float("nan"))
        if w.allreduce is not None:
            with w.span("allreduce"):
                w.allreduce(grads)
    with w.span("optimizer"):
        clip = w.cfg.trainer.grad_clip
        if clip > 0:
            gn = torch.nn.utils.clip_grad_norm_(w.params, clip)
        else:
            gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        skipped = not bool(torch.isfinite(gn))
        lr = w.scheduler.get_last_lr()[0]
        with uninterrupted():  # a stop inside would checkpoint this step's weights as the step before
            if not skipped:
                w.optimizer.step()
            with warnings.catch_warnings():  # a skipped first step: "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore", UserWarning)
                w.scheduler.step()
            w.steps_done += 1
        w.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(gn), "lr": float(lr), "skipped": skipped}


def _reduce_blocks(worker: "Worker", grad_blocks: GradBlocks, grads: list, loss_finite: bool) -> None:
    """Exchange the tree blocks of every worker (summing all-reduce, one buffer per block, zeros but the
    owner's) and write their fixed-order combination into ``grads``."""
    mine, every, total = grad_blocks.mine, grad_blocks.every, grad_blocks.total
    numel = sum(g.numel() for g in grads)
    if not loss_finite:
        for v in mine.values():
            v.fill_(float("nan"))
    if worker.allreduce is not None:
        bufs = [mine[b] if b in mine else torch.zeros(numel, device=grads[0].device) for b in every]
        with worker.span("allreduce"):
            worker.allreduce(bufs)
        mine = dict(zip(every, bufs))
    flat = combine({b: v + 0.0 for b, v in mine.items()}, total)  # + 0.0: -0.0 -> +0.0, as an all-reduce does
    off = 0
    for g in grads:
        g.copy_(flat[off: off + g.numel()].view_as(g).to(g.dtype))
        off += g.numel()


# ---------------------------------------------------------------------------------------------- the schedules
def prepare(worker: "Worker", sample_ids, step) -> Staged:
    """Everything before the loss, after ``begin``: prefill, propose, score (Draft-OPD: its rollout)."""
    begin(worker)
    method = worker.cfg.trainer.method
    if method == "draft_opd":
        proposals, hp = draft_opd_rollout(worker, sample_ids, step)
    else:
        caches = prefill(worker, sample_ids, reuse=worker.cfg.trainer.cache_trunks)
        proposals = propose(worker, caches, sample_ids, step, reference=method.startswith("offpolicy"))
        hp = score(worker, proposals, caches)
    return Staged(proposals, hp)


def update(worker: "Worker", staged: Staged, denom) -> dict:
    """Loss + backward on ``staged`` (its drafter forward is consumed), then the optimizer step; the metrics
    carry this step's phase times."""
    m = loss_backward(worker, staged.proposals, staged.hp, denom)
    m.update(optimizer_step(worker, loss_finite=math.isfinite(m["loss"])))
    m["phase_s"] = dict(worker.phase_s)
    return m


def colocated_step(worker: "Worker", sample_ids, step, denom) -> dict:
    """One step on this worker's share of the global batch, every phase here.

    Args:
        worker: this worker.
        sample_ids: its share of the global batch.
        step: the step index (it seeds anchors and branches).
        denom: the global branch count.

    Returns:
        the metrics of ``update``.
    """
    return update(worker, prepare(worker, sample_ids, step), denom)


def stage(worker: "Worker", sample_ids, step) -> dict:
    """``prepare``, kept in the worker for ``finish``. Returns {"branches": N} so the controller can form
    the global denominator first."""
    worker.staged = prepare(worker, sample_ids, step)
    return {"branches": int(worker.staged.proposals.tokens.shape[0])}


def finish(worker: "Worker", denom) -> dict:
    """``update`` on what ``stage`` kept."""
    if worker.staged is None:
        raise RuntimeError("finish() called without stage(): nothing to train on")
    staged, worker.staged = worker.staged, None
    return update(worker, staged, denom)


def draft_opd_step(group, shards: Sequence[list], step) -> List[dict]:
    """Draft-OPD (colocated): every worker rolls out its shard (``stage``), then all train on the global block
    count (``finish``). ``shards``: one list of sample ids per worker."""
    denom = sum(r["branches"] for r in group.run(stage, [(p, step) for p in shards]))
    return group.run(finish, [(denom,)] * group.num_workers)


def invariant_step(worker: "Worker", sample_ids, step, denom, bounds, total) -> dict:
    """``trainer.batch_invariant``: ``colocated_step`` with each sample run alone (prepare + loss_backward)
    and this shard's gradient kept as blocks of the fixed summation tree of ``specopd.train.determinism``;
    ``optimizer_step`` exchanges and combines them, so the update is bitwise the same for any number of workers.

    Args:
        worker: this worker.
        sample_ids: this worker's samples.
        step: the step index.
        denom: the global branch count.
        bounds: every worker's (lo, hi) in the global batch (this worker's is ``bounds[worker.rank]``).
        total: the global batch size.

    Returns:
        metrics; they carry ``parts`` (one dict per sample) for the controller to add up in a fixed order.
    """
    lo, hi = bounds[worker.rank]
    if hi - lo != len(sample_ids):
        raise ValueError(f"invariant_step: rank {worker.rank} got {len(sample_ids)} samples for shard [{lo}, {hi})")
    parts, phase_s = [], {}

    def leaf(i: int) -> torch.Tensor:
        staged = prepare(worker, [sample_ids[i - lo]], step)  # zeroes the gradients, then prefill / propose / score
        parts.append(loss_backward(worker, staged.proposals, staged.hp, denom))
        for k, v in worker.phase_s.items():
            phase_s[k] = phase_s.get(k, 0.0) + v
        return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).detach().reshape(-1).float()
                          for q in worker.params])

    mine = {b: block_sum(*b, leaf, total) for b in blocks(lo, hi, total)}
    worker.phase_s = {}
    m = optimizer_step(worker, loss_finite=all(math.isfinite(x["loss"]) for x in parts),
                       grad_blocks=GradBlocks(mine, all_blocks(bounds, total), total))
    for k, v in worker.phase_s.items():
        phase_s[k] = phase_s.get(k, 0.0) + v
    m.update(loss=sum(x["loss"] for x in parts), branches=sum(x["branches"] for x in parts),
             supervised_tokens=sum(x["supervised_tokens"] for x in parts), parts=parts, phase_s=phase_s,
             alpha_sum=[sum(c) for c in zip(*(x["alpha_sum"] for x in parts))],
             surv_sum=[sum(c) for c in zip(*(x["surv_sum"] for x in parts))])
    return m


# ------------------------------------------------------------------ split roles: the hops of each side
def target_prefill(worker: "Worker", sample_ids) -> List[Trunk]:
    """Target side: prefill and keep the caches here (``worker.trunk_caches``); return what the drafter needs of
    each trunk."""
    begin(worker, zero_grad=False)
    worker.trunk_caches = prefill(worker, sample_ids)
    return [Trunk(c.token_ids, c.features) for c in worker.trunk_caches]


def target_score(worker: "Worker", branches: Optional[Branches]) -> Scored:
    """Target side: hp [N, W, D] for the branches on the kept trunks (then drops them), and phase times."""
    caches, worker.trunk_caches = worker.trunk_caches, None
    if branches is None:  # an empty share (held-out evaluation)
        return Scored(None, {})
    return Scored(score(worker, branches.to(worker.device), caches), dict(worker.phase_s))


def drafter_propose(worker: "Worker", trunks: List[Trunk], sample_ids, step) -> Branches:
    """Drafter side: proposals on the received trunks (kept in ``worker.staged`` with the features).

    Args:
        worker: the drafter worker.
        trunks: per sample, what ``target_prefill`` sent.
        sample_ids: the pair's share of the global batch.
        step: the step index.

    Returns:
        the part of the proposals the target worker scores.
    """
    if worker.cfg.trainer.method == "draft_opd":
        raise NotImplementedError("runtime.roles=split does not support trainer.method=draft_opd")
    begin(worker)
    prop = propose(worker, [t.to(worker.device) for t in trunks], sample_ids, step,
                   reference=worker.cfg.trainer.method.startswith("offpolicy"))
    worker.staged = Staged(prop)
    return prop.branches()


def drafter_update(worker: "Worker", hp: torch.Tensor, denom) -> dict:
    """Drafter side: ``update`` on the kept proposals with the target's hidden states hp [N, W, D]."""
    if worker.staged is None:
        raise RuntimeError("drafter_update() called without drafter_propose(): nothing to train on")
    staged, worker.staged = worker.staged, None
    return update(worker, Staged(staged.proposals, hp.to(worker.device)), denom)


def split_step(group, shards: Sequence[list], step, denom) -> List[dict]:
    """``runtime.roles: split``: pair i = (target worker i, drafter worker i). Trunks (token ids + features) move
    target -> drafter, Branches (anchors, tokens) drafter -> target, the target's hidden states (``Scored``)
    back.

    Args:
        group: the ``WorkerGroup`` (split roles).
        shards: one list of sample ids per pair.
        step: the step index.
        denom: the global branch count.

    Returns:
        one metrics dict per pair (the target's phase times joined), in rank order.
    """
    trunks = group.run(target_prefill, [(p,) for p in shards], role="target")
    branches = group.run(drafter_propose, [(t, p, step) for t, p in zip(trunks, shards)])
    scored = group.run(target_score, [(b,) for b in branches], role="target")
    res = group.run(drafter_update, [(s.hp, denom) for s in scored])
    for r, s in zip(res, scored):  # the target's prefill / score times join the pair's metrics
        r["phase_s"] = {**s.phase_s, **r["phase_s"]}
    return res


# ---------------------------------------------------------------------------------------------- held-out
@torch.no_grad()
def _eval_sums(worker: "Worker", prop: Proposals, hp: torch.Tensor) -> dict:
    """alpha of the proposals' own drafter forward (``prop.hidden``, eval mode) from one fused pass."""
    w = worker
    if getattr(w.drafter, "has_selector", False):
        alpha = _selector_loss(w, prop, prop.hidden, hp, None, "eval").alpha
    else:
        weight, markov, _ = _head_terms(w, prop)
        alpha = fused_e2e_tv(prop.hidden, weight, hp, markov=markov,
                             temperature=w.cfg.trainer.acceptance_temperature,
                             chunk_rows=w.cfg.trainer.loss_chunk_rows, tp=w.vocab_tp,
                             kernel_paths=w.target.kernel_paths, **_own_head(w)).alpha
    return {"branches": int(alpha.shape[0]), "alpha_sum": alpha.sum(0).tolist(),
            "surv_sum": prefix_survival(alpha).sum(0).tolist()}


def _no_branches(worker: "Worker") -> dict:
    """The sums of an empty share."""
    return {"branches": 0, "alpha_sum": [0.0] * worker.W, "surv_sum": [0.0] * worker.W}


@torch.no_grad()
def evaluate(worker: "Worker", sample_ids, anchors_per_seq: Optional[int] = None) -> dict:
    """On-policy acceptance on held-out samples with fixed anchors/branches (independent of the step):
    sums of alpha and of prod_{i<=j} alpha_i per draft position, and the branch count. One drafter forward
    (eval mode) gives the branches and, with the target's hp, alpha (one fused pass, no second TV)."""
    w = worker
    if not sample_ids:
        return _no_branches(w)
    was = w.drafter.training
    w.drafter.eval()
    keep, recording = w.phase_s, w.prof.enabled
    try:
        with w.prof.span("eval"):  # one "eval" span in the profile (not its prefill / propose / score)
            w.prof.enabled = False
            caches = prefill(w, sample_ids)
            prop = propose(w, caches, sample_ids, "eval", anchors_per_seq or w.cfg.trainer.eval_anchors_per_seq)
            hp = score(w, prop, caches)
            return _eval_sums(w, prop, hp)
    finally:
        w.prof.enabled = recording
        w.drafter.train(was)
        w.phase_s = keep


@torch.no_grad()
def drafter_propose_eval(worker: "Worker", trunks: List[Trunk], sample_ids,
                         anchors_per_seq: Optional[int] = None) -> Optional[Branches]:
    """Drafter side of ``split_evaluate``: the held-out proposals (kept in ``worker.staged``).

    Args:
        worker: the drafter worker.
        trunks: per sample, what ``target_prefill`` sent.
        sample_ids: the pair's held-out samples.
        anchors_per_seq: None: ``trainer.eval_anchors_per_seq``.

    Returns:
        the part of the proposals the target worker scores; None for an empty share.
    """
    w = worker
    if not sample_ids:
        w.staged = None
        return None
    was, keep = w.drafter.training, w.phase_s
    w.drafter.eval()
    try:
        prop = propose(w, [t.to(w.device) for t in trunks], sample_ids, "eval",
                       anchors_per_seq or w.cfg.trainer.eval_anchors_per_seq)
    finally:
        w.drafter.train(was)
        w.phase_s = keep
    w.staged = Staged(prop)
    return prop.branches()


@torch.no_grad()
def drafter_evaluate(worker: "Worker", hp: Optional[torch.Tensor]) -> dict:
    """Drafter side of ``split_evaluate``: alpha sums of the kept held-out proposals against hp [N, W, D]."""
    staged, worker.staged = worker.staged, None
    if staged is None:
        return _no_branches(worker)
    return _eval_sums(worker, staged.proposals, hp.to(worker.device))


def split_evaluate(group, shards: Sequence[list]) -> List[dict]:
    """``evaluate`` over split roles: the same four hops as ``split_step``, without the update."""
    trunks = group.run(target_prefill, [(p,) for p in shards], role="target")
    branches = group.run(drafter_propose_eval, [(t, p) for t, p in zip(trunks, shards)])
    scored = group.run(target_score, [(b,) for b in branches], role="target")
    return group.run(drafter_evaluate, [(s.hp,) for s in scored])
