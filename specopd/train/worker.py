"""One training worker: the target, a drafter replica, its optimizer and scheduler, and the SpecOPD step
(prefill -> propose -> score -> loss_backward -> optimizer_step) as separate methods the Ray backend calls one by
one; split roles (a target worker, a drafter worker) move only ids, features, proposals and hidden states.
No [N, W, V] tensor exists in a step. Design: specopd/train/DESIGN.md ("Workers").
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
import warnings
import zlib
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence, Union

import torch

from kernels import paths
from specopd.drafters import build_drafter, load_drafter, shift_tokens
from specopd.errors import BadInputError
from specopd.losses import (candidate_ce, candidate_e2e_tv, confidence_loss, FusedOut, fused_ce, fused_e2e_tv,
                            prefix_survival, target_argmax)
from specopd.models import load_target
from specopd.models.loading import resolve_dtype
from specopd.models.tensor_parallel import vocab_group
from specopd.models.tiny import resolve_target_path
from specopd.profiling import Profiler
from specopd.signals import uninterrupted
from specopd.train.baselines import draft_opd_rollout
from specopd.train.data import load_dataset, split_dataset, valid_anchors
from specopd.train.determinism import all_blocks, block_sum, blocks, combine
from specopd.train.handoff import Branches, GradBlocks, Proposals, Scored, Staged, Trunk
from specopd.tree import ProposalTree

if TYPE_CHECKING:
    from specopd.models.context import TargetCache


def seed_for(*parts) -> int:
    """A 63-bit seed from integers / strings (stable across processes and Python versions)."""
    return zlib.crc32(repr(tuple(parts)).encode()) * 2654435761 % (2**63 - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup (step s gets (s+1)/warmup) then cosine from 1 to min_lr_ratio at max_steps."""
    def f(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        prog = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * prog))
    return f


class Worker:
    """Hosts the target, a drafter replica, AdamW and the LR schedule. See the module docstring."""

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, target=None, role: str = "both",
                 tensor_parallel=None):
        """role: "both" (colocated) | "target" | "drafter" (split roles; both still build the target and a
        drafter: the drafter worker needs the frozen embeddings / lm_head, the target worker the drafter's
        feature layers). tensor_parallel: this rank's ``TensorParallel`` group (runtime.tensor_parallel > 1):
        the target is its shard; ``rank`` / ``world_size`` stay the data-parallel ones."""
        if role not in ("both", "target", "drafter"):
            raise ValueError(f"Worker role must be both | target | drafter, got {role!r}")
        self.cfg, self.rank, self.world_size, self.role = cfg, int(rank), int(world_size), role
        paths.configure_from(getattr(cfg, "kernels", {}))  # the recipe's compute paths, in whichever process hosts this worker
        self.device = resolve_device(cfg.model.device)
        if target is None:
            path = resolve_target_path(cfg.model, cfg.trainer.output_dir)
            target = load_target(path, dtype=resolve_dtype(cfg.model.dtype), device=self.device, kernels=cfg.model.kernels,
                                 tensor_parallel=tensor_parallel)
        self.target = target
        self.vocab_tp = vocab_group(target.lm_head)  # runtime.tp_lm_head: the loss's group, or None (whole head)
        d = cfg.drafter
        if d.init_from:  # ours or a released DFlash / DSpark folder
            self.drafter = load_drafter(d.init_from, target)
            got = (self.drafter.kind, int(self.drafter.block_size), len(self.drafter.layers))
            if got != (d.kind, d.block_size, d.num_layers) and rank == 0:
                print(f"warning: drafter.init_from={d.init_from} is a {got[0]} drafter with block_size={got[1]}, "
                      f"num_layers={got[2]}; the recipe's drafter.kind/block_size/num_layers "
                      f"({d.kind}, {d.block_size}, {d.num_layers}) are ignored")
        else:
            self.drafter = build_drafter(d.kind, target, num_layers=d.num_layers, block_size=d.block_size,
                                         seed=cfg.seed, feature_layers=d.feature_layers,
                                         mask_token_id=d.mask_token_id,  # the target's tokenizer picks MASK
                                         target_dir=None if cfg.model.is_tiny else cfg.model.target,
                                         **dict(d.architecture))
        self.drafter.train()
        self.W = int(self.drafter.draft_len)
        self.data_stats: dict = {}  # what the data reading read, dropped, cut, skipped (-> train_summary.json)
        self.dataset = load_dataset(cfg, target, progress=rank == 0, stats=self.data_stats)
        train_ids, heldout_ids = split_dataset(self.dataset, cfg.data.heldout, cfg.data.seed)
        self._anchor_pos = [valid_anchors(s, self.W) for s in self.dataset]  # per sample, sorted
        ok = lambda i: self._anchor_pos[i].numel() > 0  # noqa: E731
        self.train_ids, self.heldout_ids = [i for i in train_ids if ok(i)], [i for i in heldout_ids if ok(i)]
        dropped = len(train_ids) + len(heldout_ids) - len(self.train_ids) - len(self.heldout_ids)
        self.data_stats.update(sequences=len(self.dataset), train=len(self.train_ids), heldout=len(self.heldout_ids),
                               skipped_short_response=dropped)
        if dropped and rank == 0:
            print(f"[data] {dropped} sequence(s) skipped: no {self.W} supervised tokens in a row after an anchor "
                  f"(response or assistant turns shorter than block_size = {self.W + 1} tokens)")
        if not train_ids:
            raise BadInputError(
                f"every one of the {len(self.dataset)} records of data.path={cfg.data.path!r} is held out (\"split\": "
                f"\"heldout\"), so there is nothing to train on: mark the training records \"split\": \"train\" (or "
                f"remove the split fields to let data.heldout={cfg.data.heldout} choose the held-out ones)")
        if not self.train_ids:
            raise ValueError(f"no training sequence has a response of at least drafter.block_size={self.W + 1} "
                             f"tokens; lower drafter.block_size or raise data.seq_len")
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        t = cfg.trainer
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=tuple(t.betas), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_warmup_steps, t.max_steps, t.min_lr_ratio))
        self.prof = Profiler(f"target{rank}" if role == "target" else f"worker{rank}", enabled=cfg.profile.enabled)
        self._phase: dict = {}  # seconds per phase of the current step (``span``), reset when a step starts
        self._allreduce: Optional[Callable] = None
        self._trunk_cache: dict = {}  # trainer.cache_trunks: sample id -> TargetCache without layer caches
        self.staged: Optional[Staged] = None  # a step's share between stage and finish (split: the drafter's hops)
        self.trunk_caches: Optional[list] = None  # split roles, target side: between stage_trunks and score_staged
        self.steps_done = 0  # optimizer steps applied to this replica (checkpoints are labelled with it)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time a phase: a profiler span, and its seconds added to this step's ``phase_s``."""
        t0 = time.perf_counter()
        with self.prof.span(name):
            yield
        self._phase[name] = self._phase.get(name, 0.0) + time.perf_counter() - t0

    def autocast(self):
        """bf16 autocast for the drafter on CUDA (nothing on the CPU)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def generator(self, *parts) -> torch.Generator:
        """A generator on the worker's device seeded from (seed, *parts): e.g. ("branch", step, sample id)."""
        return torch.Generator(device=self.device).manual_seed(seed_for(self.cfg.seed, *parts))

    def sample(self, sid: int) -> dict:
        return self.dataset[int(sid)]

    def data_info(self) -> dict:
        """Sample lengths / prompt lengths and the train / held-out ids (the controller batches with it)."""
        return {"lengths": [int(s["input_ids"].numel()) for s in self.dataset],
                "prompt_lens": [int(s["prompt_len"]) for s in self.dataset],
                "train_ids": list(self.train_ids), "heldout_ids": list(self.heldout_ids),
                "draft_len": self.W, "vocab_size": self.target.vocab_size,
                "anchor_counts": [int(a.numel()) for a in self._anchor_pos], "data_stats": dict(self.data_stats)}

    def target_shard(self) -> dict:
        """What this worker holds of the target: its parameters, lm_head rows and tensor-parallel rank / size."""
        tp = getattr(self.target, "tensor_parallel", None)
        return {"params": sum(p.numel() for p in self.target.parameters()),
                "lm_head_rows": int(self.target.lm_head.weight.shape[0]),
                "tp_rank": 0 if tp is None else tp.rank, "tp_size": 1 if tp is None else tp.size}

    def set_allreduce(self, fn: Optional[Callable]) -> None:
        """fn(list_of_grads) sums gradients across workers in place (None = single worker, no-op)."""
        self._allreduce = fn

    def take_spans(self) -> list:
        return self.prof.take()

    def anchors(self, sid: int, step, num: int) -> torch.Tensor:
        """B anchors of sample ``sid`` at ``step``, uniform without replacement on its valid anchors (sorted;
        ``specopd.train.data.valid_anchors``: the response, or the assistant tokens of a loss mask). For a
        response after ``prompt_len`` the valid anchors are the range lo..hi, and this is ``perm + lo`` exactly."""
        valid = self._anchor_pos[int(sid)]
        if valid.numel() == 0:
            return torch.empty(0, dtype=torch.long)
        g = torch.Generator().manual_seed(seed_for(self.cfg.seed, "anchors", step, int(sid)))
        perm = torch.randperm(valid.numel(), generator=g)[:num]
        return valid[perm].sort().values

    # ------------------------------------------------------------------ the SpecOPD step, phase by phase
    @torch.no_grad()
    def prefill(self, sample_ids, reuse: bool = False) -> list:
        """One target pass per reference sequence -> TargetCache list (layer caches, drafter features [T, F],
        the final hidden [T, D] that lm_head reads; no [T, V] logits). ``reuse`` (off-policy training steps with
        trainer.cache_trunks): caches without layer caches, each sequence run once and kept."""
        keep = reuse
        with self.span("prefill"):
            todo = [s for s in dict.fromkeys(int(s) for s in sample_ids) if s not in self._trunk_cache] if keep \
                else list(sample_ids)
            new = self.target.prefill_batch([self.sample(s)["input_ids"].to(self.device) for s in todo],
                                            feature_layers=self.drafter.feature_layers,
                                            gdn_checkpoint_every=self.cfg.model.gdn_checkpoint_every,
                                            keep_logits=False, keep_hidden=True) if todo else []
            if not keep:
                return new
            for s, c in zip(todo, new):  # trainer.cache_trunks: off-policy needs no K/V, only these
                self._trunk_cache[int(s)] = dataclasses.replace(c, layers=[], extra={})
            return [self._trunk_cache[int(s)] for s in sample_ids]

    def propose(self, caches: Sequence[Union["TargetCache", Trunk]], sample_ids, step,
                anchors_per_seq: Optional[int] = None, temperature: Optional[float] = None,
                reference: bool = False) -> Proposals:
        """Anchors + ONE drafter forward ``hidden`` [N, W, D] (carrying the gradient when grad is enabled: the
        loss reuses it) + branch tokens [N, W] sampled from it detached, in row chunks (or, with ``reference``,
        the reference tokens after each anchor).

        Args:
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
        b = anchors_per_seq or self.cfg.trainer.anchors_per_seq
        temp = self.cfg.trainer.acceptance_temperature if temperature is None else temperature
        with self.span("propose"):
            anchors, tix, rows, n = [], [], [], 0
            for i, sid in enumerate(sample_ids):
                a = self.anchors(sid, step, b)
                anchors.append(a)
                tix.append(torch.full_like(a, i))
                rows.append(torch.arange(n, n + a.numel(), device=self.device))
                n += a.numel()
            anchors, tix = torch.cat(anchors).to(self.device), torch.cat(tix).to(self.device)
            if n == 0:
                raise ValueError(f"samples {list(sample_ids)} have no valid anchor (responses shorter than "
                                 f"drafter.block_size tokens); lower drafter.block_size or use longer sequences")
            trunks = [c.token_ids for c in caches]
            feats = [c.features for c in caches]
            anchor_tokens = torch.cat([trunks[i][anchors[r]] for i, r in enumerate(rows)])
            with self.autocast():
                h = self.drafter.hidden(feats, anchors, tix, anchor_tokens)  # [N, W, D]
            want_ce = self.cfg.trainer.ce_weight > 0
            ref_tokens = None
            if reference or want_ce:
                offs = anchors[:, None] + 1 + torch.arange(self.W, device=self.device)
                ref_tokens = torch.cat([trunks[i][offs[r]] for i, r in enumerate(rows)])
            if reference:
                tokens = ref_tokens
            else:
                gens = [self.generator("branch", step, int(s)) for s in sample_ids]
                tokens = self.drafter.sample_tokens(h, anchor_tokens, temp, gens, rows,
                                                    chunk_rows=self.cfg.trainer.loss_chunk_rows)
        return Proposals(anchors=anchors, trunk_index=tix, anchor_tokens=anchor_tokens, tokens=tokens,
                         features=feats, sample_ids=list(sample_ids), reference=reference, hidden=h,
                         reference_tokens=ref_tokens if want_ce else None)

    @torch.no_grad()
    def score(self, proposals: Union[Proposals, Branches], caches) -> torch.Tensor:
        """The target side hp [N, W, D] (what lm_head reads) for each branch slot: k = 0 from the trunk, k >= 1
        from the packed tree pass (hidden states only: no [N, W, V] logits; ``losses.logits_at`` gives p for a
        few rows). Reference blocks (off-policy) need no tree pass: hp comes from the reference's trunk."""
        a, tix, tok = proposals.anchors, proposals.trunk_index, proposals.tokens
        with self.span("score"):
            if bool((tix[1:] < tix[:-1]).any()):
                raise ValueError("score: branches must be grouped by trunk (trunk_index non-decreasing), as "
                                 "propose() returns them; the packed tree lists trunk 0's branches first")
            if any(c.hidden is None for c in caches):
                raise ValueError("score: the trunk caches need their final hidden states (prefill(..., "
                                 "keep_hidden=True), as Worker.prefill builds them)")
            rows = [torch.nonzero(tix == i).flatten() for i in range(len(caches))]
            if proposals.reference:
                offs = a[:, None] + torch.arange(self.W, device=a.device)
                return torch.cat([caches[i].hidden[offs[r]] for i, r in enumerate(rows)])
            h0 = torch.cat([caches[i].hidden[a[r]] for i, r in enumerate(rows)])[:, None]  # [N, 1, D]
            if self.W == 1:
                return h0
            trees = [ProposalTree.from_branches(a[tix == i].cpu(), tok[tix == i, : self.W - 1].cpu())
                     for i in range(len(caches))]
            rest = self.target.score(ProposalTree.pack(trees), caches, return_logits=False,
                                     return_hidden=True)  # [N, W-1, D], trunk order == our order
            return torch.cat([h0, rest.to(h0.dtype)], 1)

    def _head_terms(self, proposals: Proposals):
        """(lm_head weight [V, D] (this rank's block [V / N, D] with ``vocab_tp``), DSpark's Markov term (W1[prev] [N, W, r], W2 [V, r]) or None, prev [N, W])."""
        prev = shift_tokens(proposals.anchor_tokens, proposals.tokens)
        head = getattr(self.drafter, "markov_head", None)
        markov = None if head is None else (self.drafter.markov_features(prev), head.markov_w2.weight)
        return self.target.lm_head.weight, markov, prev

    def _ce_targets(self, proposals: Proposals, hp: torch.Tensor) -> Optional[torch.Tensor]:
        """The labels of the ``trainer.ce_weight`` term [N, W]: the reference's tokens, or with ``trainer.ce_labels:
        target`` the target's argmax at each scored position of hp (None without the term)."""
        t = self.cfg.trainer
        if t.ce_weight > 0 and t.ce_labels == "target":
            return target_argmax(hp, self.target.lm_head.weight, chunk_rows=t.loss_chunk_rows, tp=self.vocab_tp)
        return proposals.reference_tokens

    def _selector_loss(self, proposals: Proposals, h: torch.Tensor, hp: torch.Tensor, denom, method: str):
        """DFlash V2's loss (``FusedOut``): q = the realized candidate scores given each slot's previous token (the
        branch's own sampled tokens, or the reference's off-policy), alpha over the candidates, the CE over the
        candidates joined by the reference token, plus ``trainer.vocab_ce_weight`` x DFlash's full-vocabulary CE
        on the raw logits (specopd/drafters/DFLASH2.md); no [N, W, V]. method "eval": alpha only (no CE term)."""
        t = self.cfg.trainer
        prev = shift_tokens(proposals.anchor_tokens, proposals.tokens)
        ce, ce_weight = method == "offpolicy_ce", t.ce_weight if method != "eval" else 0.0
        extra = proposals.tokens if ce else (self._ce_targets(proposals, hp) if ce_weight > 0 else None)
        with self.autocast():
            r = self.drafter.realized(h, prev, extra, chunk_rows=t.loss_chunk_rows)
        kw = dict(p_weight=self.target.lm_head.weight, denom=denom, temperature=t.acceptance_temperature,
                  chunk_rows=t.loss_chunk_rows, tp=self.vocab_tp)
        if ce:
            out = candidate_ce(r.ids, r.scores, proposals.tokens, r.extra, hp=hp, **kw)
            if t.vocab_ce_weight > 0:  # DFlash's CE on the raw logits, over the whole vocabulary, chunked
                full = fused_ce(h, self.target.lm_head.weight, proposals.tokens, denom=denom,
                                chunk_rows=t.loss_chunk_rows, tp=self.vocab_tp)
                out = FusedOut(out.loss + t.vocab_ce_weight * full.loss, out.alpha, out.nll)
            return out
        return candidate_e2e_tv(r.ids, r.scores, hp, ce_targets=extra, ce_scores=r.extra, ce_weight=ce_weight, **kw)

    def loss_backward(self, proposals: Proposals, hp: torch.Tensor, denom) -> dict:
        """Fused chunked loss on the proposals' drafter forward (``proposals.hidden``, taken: this backward
        consumes its graph; Draft-OPD's proposals have none: one forward with grad here) against the target side
        hp [N, W, D], / denom, backward. DSpark teacher-forces its own sampled tokens through its Markov head.
        Returns partial sums (the controller adds them over workers); alpha comes from the loss's pass."""
        t, method = self.cfg.trainer, self.cfg.trainer.method
        with self.span("loss_backward"):
            tokens = proposals.tokens
            h = proposals.take_hidden()  # the graph is consumed by this backward
            if h is None:
                with self.autocast():
                    h = self.drafter.hidden(proposals.features, proposals.anchors, proposals.trunk_index,
                                            proposals.anchor_tokens)
            weight, markov, prev = self._head_terms(proposals)
            kw = dict(markov=markov, denom=denom, temperature=t.acceptance_temperature, chunk_rows=t.loss_chunk_rows,
                      tp=self.vocab_tp)
            hp = hp.to(h.device)
            if getattr(self.drafter, "has_selector", False):  # DFlash V2: q lives on each slot's top K
                out = self._selector_loss(proposals, h, hp, denom, method)
            elif method == "offpolicy_ce":
                out = fused_ce(h, weight, tokens, hp=hp, **kw)
            else:
                out = fused_e2e_tv(h, weight, hp, ce_targets=self._ce_targets(proposals, hp), ce_weight=t.ce_weight,
                                   **kw)
            loss, alpha = out.loss, out.alpha
            if getattr(self.drafter, "has_confidence", False) and self.cfg.drafter.confidence_weight > 0:
                with self.autocast():
                    conf = self.drafter.confidence_logits(h, prev)
                loss = loss + self.cfg.drafter.confidence_weight * confidence_loss(conf, alpha, denom=denom)
            loss.backward()
            surv = prefix_survival(alpha)
        n = int(tokens.shape[0])
        return {"loss": float(loss.detach()), "branches": n, "supervised_tokens": n * int(tokens.shape[1]),
                "alpha_sum": alpha.sum(0).tolist(), "surv_sum": surv.sum(0).tolist()}

    def optimizer_step(self, loss_finite: bool = True, blocks: Optional[GradBlocks] = None) -> dict:
        """All-reduce (sum) gradients, clip the global norm, AdamW step, advance the LR schedule.

        Guard: a NaN / inf gradient norm after the all-reduce (or a non-finite loss on any worker,
        ``loss_finite=False``: its gradients are made NaN before the all-reduce, so every replica sees it)
        skips the AdamW step on every replica alike; the schedule and ``steps_done`` still advance (the
        step's data is consumed) and the result says ``skipped``. ``blocks`` (``train_step_invariant``): the
        gradient as summation-tree blocks, exchanged and combined in a fixed order instead of the all-reduce."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if blocks is not None:  # trainer.batch_invariant (train_step_invariant)
            self._reduce_blocks(blocks, grads, loss_finite)
        else:
            if not loss_finite:
                for g in grads:
                    g.fill_(float("nan"))
            if self._allreduce is not None:
                with self.span("allreduce"):
                    self._allreduce(grads)
        with self.span("optimizer"):
            clip = self.cfg.trainer.grad_clip
            if clip > 0:
                gn = torch.nn.utils.clip_grad_norm_(self.params, clip)
            else:
                gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            skipped = not bool(torch.isfinite(gn))
            lr = self.scheduler.get_last_lr()[0]
            with uninterrupted():  # a stop inside would checkpoint this step's weights as the step before
                if not skipped:
                    self.optimizer.step()
                with warnings.catch_warnings():  # a skipped first step: "lr_scheduler.step() before optimizer.step()"
                    warnings.simplefilter("ignore", UserWarning)
                    self.scheduler.step()
                self.steps_done += 1
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(gn), "lr": float(lr), "skipped": skipped}

    # ------------------------------------------------------------------ whole steps
    def prepare(self, sample_ids, step) -> Staged:
        """Everything before the loss (prefill, proposals / rollout, scoring), with the gradients zeroed and
        this step's phase times reset."""
        self._phase = {}
        self.optimizer.zero_grad(set_to_none=True)
        method = self.cfg.trainer.method
        if method == "draft_opd":
            proposals, hp = draft_opd_rollout(self, sample_ids, step)
        else:
            caches = self.prefill(sample_ids, reuse=self.cfg.trainer.cache_trunks)
            proposals = self.propose(caches, sample_ids, step, reference=method.startswith("offpolicy"))
            hp = self.score(proposals, caches)
        return Staged(proposals, hp)

    def stage(self, sample_ids, step) -> dict:
        """``prepare``, kept in ``staged`` for ``finish``. Returns {"branches": N} so the controller can form
        the global denominator first."""
        self.staged = self.prepare(sample_ids, step)
        return {"branches": int(self.staged.proposals.tokens.shape[0])}

    def finish(self, denom) -> dict:
        """Loss + backward on the staged proposals, then the optimizer step."""
        if self.staged is None:
            raise RuntimeError("finish() called without stage(): nothing to train on")
        staged, self.staged = self.staged, None
        return self.update(staged, denom)

    def update(self, staged: Staged, denom) -> dict:
        """Loss + backward on ``staged`` (its drafter forward is consumed), then the optimizer step."""
        m = self.loss_backward(staged.proposals, staged.hp, denom)
        m.update(self.optimizer_step(loss_finite=math.isfinite(m["loss"])))
        m["phase_s"] = dict(self._phase)
        return m

    def train_step(self, sample_ids, step, denom) -> dict:
        """One step on this worker's share of the global batch (denom = global branch count)."""
        return self.update(self.prepare(sample_ids, step), denom)

    # ------------------------------------------------------------------ split roles (see the module docstring)
    def stage_trunks(self, sample_ids) -> List[Trunk]:
        """Target side: prefill and keep the caches here (``trunk_caches``); return what the drafter needs of
        each trunk."""
        self._phase = {}
        self.trunk_caches = self.prefill(sample_ids)
        return [Trunk(c.token_ids, c.features) for c in self.trunk_caches]

    def score_staged(self, branches: Optional[Branches]) -> Scored:
        """Target side: hp [N, W, D] for the branches on the kept trunks (then drops them), and phase times."""
        caches, self.trunk_caches = self.trunk_caches, None
        if branches is None:  # an empty share (held-out evaluation)
            return Scored(None, {})
        return Scored(self.score(branches.to(self.device), caches), dict(self._phase))

    def stage_proposals(self, trunks: List[Trunk], sample_ids, step) -> Branches:
        """Drafter side: proposals on the received trunks (kept in ``staged`` with the features); returns the
        part the target worker scores."""
        if self.cfg.trainer.method == "draft_opd":
            raise NotImplementedError("runtime.roles=split does not support trainer.method=draft_opd")
        self._phase = {}
        self.optimizer.zero_grad(set_to_none=True)
        prop = self.propose([t.to(self.device) for t in trunks], sample_ids, step,
                            reference=self.cfg.trainer.method.startswith("offpolicy"))
        self.staged = Staged(prop)
        return prop.branches()

    def finish_scored(self, hp: torch.Tensor, denom) -> dict:
        """Drafter side: attach the target's hidden states hp [N, W, D] to the staged proposals, then ``finish``."""
        if self.staged is None:
            raise RuntimeError("finish_scored() called without stage_proposals(): nothing to train on")
        self.staged = Staged(self.staged.proposals, hp.to(self.device))
        return self.finish(denom)

    @torch.no_grad()
    def propose_eval(self, trunks: List[Trunk], sample_ids, anchors_per_seq: Optional[int] = None
                     ) -> Optional[Branches]:
        """Drafter side of ``evaluate``: the held-out proposals (kept in ``staged``); None for an empty share."""
        if not sample_ids:
            self.staged = None
            return None
        was, keep = self.drafter.training, self._phase
        self.drafter.eval()
        try:
            prop = self.propose([t.to(self.device) for t in trunks], sample_ids, "eval",
                                anchors_per_seq or self.cfg.trainer.eval_anchors_per_seq)
        finally:
            self.drafter.train(was)
            self._phase = keep
        self.staged = Staged(prop)
        return prop.branches()

    @torch.no_grad()
    def evaluate_scored(self, hp: Optional[torch.Tensor]) -> dict:
        """Drafter side of ``evaluate``: alpha sums of the staged held-out proposals against hp [N, W, D]."""
        staged, self.staged = self.staged, None
        if staged is None:
            return {"branches": 0, "alpha_sum": [0.0] * self.W, "surv_sum": [0.0] * self.W}
        return self._eval_sums(staged.proposals, hp.to(self.device))

    @torch.no_grad()
    def _eval_sums(self, prop: Proposals, hp: torch.Tensor) -> dict:
        """alpha of the proposals' own drafter forward (``prop.hidden``, eval mode) from one fused pass."""
        if getattr(self.drafter, "has_selector", False):
            alpha = self._selector_loss(prop, prop.hidden, hp, None, "eval").alpha
        else:
            weight, markov, _ = self._head_terms(prop)
            alpha = fused_e2e_tv(prop.hidden, weight, hp, markov=markov,
                                 temperature=self.cfg.trainer.acceptance_temperature,
                                 chunk_rows=self.cfg.trainer.loss_chunk_rows, tp=self.vocab_tp).alpha
        return {"branches": int(alpha.shape[0]), "alpha_sum": alpha.sum(0).tolist(),
                "surv_sum": prefix_survival(alpha).sum(0).tolist()}

    @torch.no_grad()
    def evaluate(self, sample_ids, anchors_per_seq: Optional[int] = None) -> dict:
        """On-policy acceptance on held-out samples with fixed anchors/branches (independent of the step):
        sums of alpha and of prod_{i<=j} alpha_i per draft position, and the branch count. One drafter forward
        (eval mode) gives the branches and, with the target's hp, alpha (one fused pass, no second TV)."""
        if not sample_ids:
            return {"branches": 0, "alpha_sum": [0.0] * self.W, "surv_sum": [0.0] * self.W}
        was = self.drafter.training
        self.drafter.eval()
        keep, recording = self._phase, self.prof.enabled
        try:
            with self.prof.span("eval"):  # one "eval" span in the profile (not its prefill / propose / score)
                self.prof.enabled = False
                caches = self.prefill(sample_ids)
                prop = self.propose(caches, sample_ids, "eval",
                                    anchors_per_seq or self.cfg.trainer.eval_anchors_per_seq)
                hp = self.score(prop, caches)
                return self._eval_sums(prop, hp)
        finally:
            self.prof.enabled = recording
            self.drafter.train(was)
            self._phase = keep

    # ------------------------------------------------------------------ state
    def drafter_config(self) -> dict:
        """The drafter's config.json content, as ``drafter.save`` writes it."""
        return self.drafter.config_dict()

    def state_dict(self) -> dict:
        return {"drafter": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
                "drafter_config": self.drafter_config(), "drafter_kind": self.drafter.kind,
                "steps_done": self.steps_done,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}

    def load_state_dict(self, sd: dict) -> None:
        self.drafter.load_state_dict({k: v.to(self.device) for k, v in sd["drafter"].items()}, strict=True)
        if sd.get("optimizer") is not None:  # a copy: in-process replicas get the same dict (their AdamW
            # moments must not share tensors)
            self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        if sd.get("scheduler") is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        self.steps_done = int(sd.get("steps_done", self.scheduler.last_epoch))
        self._apply_recipe_hparams()
        rng = sd.get("rng") or {}
        if rng.get("torch") is not None:
            torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _apply_recipe_hparams(self) -> None:
        """After a resume: the recipe's lr / schedule / betas / weight decay win over the checkpoint's (loading
        an optimizer restores its old ones). Unchanged values give exactly the saved learning rate."""
        t = self.cfg.trainer
        f = lr_lambda(t.lr_warmup_steps, t.max_steps, t.min_lr_ratio)
        self.scheduler.lr_lambdas = [f] * len(self.optimizer.param_groups)
        self.scheduler.base_lrs = [float(t.lr)] * len(self.optimizer.param_groups)
        for i, g in enumerate(self.optimizer.param_groups):
            g["initial_lr"] = float(t.lr)
            g["betas"] = tuple(t.betas)
            g["weight_decay"] = t.weight_decay if i == 0 else 0.0
            g["lr"] = float(t.lr) * f(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ batch-invariant step
    def train_step_invariant(self, sample_ids, step, denom, bounds, total) -> dict:
        """``trainer.batch_invariant``: ``train_step`` with each sample run alone (stage + loss_backward)
        and this shard's gradient kept as blocks of the fixed summation tree of ``specopd.train.determinism``;
        ``optimizer_step`` exchanges and combines them, so the update is bitwise the same for any number of workers.

        Args:
            sample_ids: this worker's samples.
            step: the step index.
            denom: the global branch count.
            bounds: every worker's (lo, hi) in the global batch (this worker's is ``bounds[rank]``).
            total: the global batch size.

        Returns:
            metrics; they carry ``parts`` (one dict per sample) for the controller to add up in a fixed order.
        """
        lo, hi = bounds[self.rank]
        if hi - lo != len(sample_ids):
            raise ValueError(f"train_step_invariant: rank {self.rank} got {len(sample_ids)} samples for shard "
                             f"[{lo}, {hi})")
        parts, phases = [], {}

        def leaf(i: int) -> torch.Tensor:
            staged = self.prepare([sample_ids[i - lo]], step)  # zeroes the gradients, then prefill / propose / score
            parts.append(self.loss_backward(staged.proposals, staged.hp, denom))
            for k, v in self._phase.items():
                phases[k] = phases.get(k, 0.0) + v
            return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).detach().reshape(-1).float()
                              for q in self.params])

        mine = {b: block_sum(*b, leaf, total) for b in blocks(lo, hi, total)}
        self._phase = {}
        m = self.optimizer_step(loss_finite=all(math.isfinite(x["loss"]) for x in parts),
                                blocks=GradBlocks(mine, all_blocks(bounds, total), total))
        for k, v in self._phase.items():
            phases[k] = phases.get(k, 0.0) + v
        m.update(loss=sum(x["loss"] for x in parts), branches=sum(x["branches"] for x in parts),
                 supervised_tokens=sum(x["supervised_tokens"] for x in parts), parts=parts, phase_s=phases,
                 alpha_sum=[sum(c) for c in zip(*(x["alpha_sum"] for x in parts))],
                 surv_sum=[sum(c) for c in zip(*(x["surv_sum"] for x in parts))])
        return m

    def _reduce_blocks(self, blocks: GradBlocks, grads: list, loss_finite: bool) -> None:
        """Exchange the tree blocks of every worker (summing all-reduce, one buffer per block, zeros but the
        owner's) and write their fixed-order combination into ``grads``."""
        mine, every, total = blocks.mine, blocks.every, blocks.total
        numel = sum(g.numel() for g in grads)
        if not loss_finite:
            for v in mine.values():
                v.fill_(float("nan"))
        if self._allreduce is not None:
            bufs = [mine[b] if b in mine else torch.zeros(numel, device=grads[0].device) for b in every]
            with self.span("allreduce"):
                self._allreduce(bufs)
            mine = dict(zip(every, bufs))
        flat = combine({b: v + 0.0 for b, v in mine.items()}, total)  # + 0.0: -0.0 -> +0.0, as an all-reduce does
        off = 0
        for g in grads:
            g.copy_(flat[off: off + g.numel()].view_as(g).to(g.dtype))
            off += g.numel()
