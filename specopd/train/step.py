"""One global training step across the workers: split the batch, pick the schedule, reduce their metrics.

Each global batch (``data.batch_size`` sample ids) is split by sample across the workers (``shard``). ``denom``
(the global branch count) is known before the step for SpecOPD and the off-policy baselines, and formed after the
rollouts for Draft-OPD. The schedules themselves (colocated, split roles, batch-invariant, Draft-OPD) are in
``specopd.train.phases``. A step whose loss or gradient is NaN / inf is skipped on every worker (no update);
``NonFiniteGuard`` counts them and stops the run at ``trainer.max_nonfinite_steps`` in a row.
"""
from __future__ import annotations

import math
import time

from specopd.config import RecipeConfig
from specopd.train import phases
from specopd.train.data import num_branches


class NonFiniteError(RuntimeError):
    """``trainer.max_nonfinite_steps`` steps in a row had a NaN / inf loss or gradient; the message names the
    steps and the checkpoint written."""


def shard_bounds(n_ids: int, n: int) -> list:
    """[(lo, hi)] of n contiguous, near-equal parts of n_ids (the first parts get the remainder)."""
    k, r = divmod(n_ids, n)
    out, i = [], 0
    for w in range(n):
        j = i + k + (1 if w < r else 0)
        out.append((i, j))
        i = j
    return out


def shard(ids: list, n: int) -> list:
    """Split ids into n contiguous, near-equal parts (the first parts get the remainder)."""
    return [ids[lo:hi] for lo, hi in shard_bounds(len(ids), n)]


def reduce_metrics(results: list, wall_s: float) -> dict:
    """Sum the workers' partial metrics; derive mean alpha per position and expected AL (incl. bonus).

    Sums are ``math.fsum`` (exactly rounded, so independent of order); with ``trainer.batch_invariant`` the
    workers send per-sample ``parts`` and the metrics are the same for any number of workers."""
    parts = [p for r in results for p in r["parts"]] if all("parts" in r for r in results) else results
    n = sum(int(r["branches"]) for r in parts)
    W = len(parts[0]["alpha_sum"])
    alpha = [math.fsum(r["alpha_sum"][j] for r in parts) / max(n, 1) for j in range(W)]
    surv = [math.fsum(r["surv_sum"][j] for r in parts) / max(n, 1) for j in range(W)]
    m = {"branches": n, "alpha": alpha, "expected_al": 1.0 + math.fsum(surv)}
    if "loss" in results[0]:
        sup = sum(r["supervised_tokens"] for r in parts)
        phases = {}
        for r in results:
            for k, v in r.get("phase_s", {}).items():
                phases[k] = max(phases.get(k, 0.0), v)
        m.update(loss=math.fsum(r["loss"] for r in parts), supervised_tokens=sup, step_s=wall_s,
                 supervised_tokens_per_s=sup / wall_s if wall_s > 0 else float("nan"),
                 lr=results[0]["lr"], grad_norm=results[0]["grad_norm"], phase_s=phases)
        if any(r.get("skipped") for r in results):
            m["skipped"] = True
    return m


def train_step(group, info: dict, cfg: RecipeConfig, ids: list, step: int) -> dict:
    """Step ``step`` + 1 of the run on the global batch.

    Args:
        group: the ``WorkerGroup`` (``specopd.train.group``).
        info: the workers' ``data_info`` (draft length, lengths, anchor counts).
        cfg: the recipe.
        ids: the global batch's sample ids.
        step: completed steps so far.

    Returns:
        its reduced metrics (``step_s``: the workers' wall time).
    """
    t, n = cfg.trainer, group.num_workers
    W, B = info["draft_len"], t.anchors_per_seq
    parts = shard(ids, n)
    t0 = time.perf_counter()
    if t.method == "draft_opd":  # the denominator: the rollouts' blocks, counted after them
        res = phases.draft_opd_step(group, parts, step)
    else:
        counts = info.get("anchor_counts")  # valid anchors per sample (response / loss mask)
        denom = sum(min(B, counts[i]) if counts is not None else
                    num_branches(info["lengths"][i], info["prompt_lens"][i], W, B) for i in ids)
        if t.batch_invariant:
            bounds = shard_bounds(len(ids), n)
            res = group.run(phases.invariant_step, [(p, step, denom, bounds, len(ids)) for p in parts])
        elif group.split:
            res = phases.split_step(group, parts, step, denom)
        else:
            res = group.run(phases.colocated_step, [(p, step, denom) for p in parts])
    return reduce_metrics(res, time.perf_counter() - t0)


class NonFiniteGuard:
    """Steps in a row whose loss or gradient was NaN / inf (``skipped`` in their metrics line)."""

    def __init__(self, limit: int):
        self.limit = limit  # trainer.max_nonfinite_steps
        self.bad = 0  # skipped steps in a row, up to the newest

    def update(self, m: dict, warn) -> bool:
        """Count step ``m["step"]`` (saying so through ``warn`` when it was skipped); True: the run must stop."""
        self.bad = self.bad + 1 if m.get("skipped") else 0
        if self.bad:
            warn(f"step {m['step']}: loss {m['loss']:.4g}, gradient norm {m['grad_norm']:.4g}: not finite, update "
                 f"skipped ({self.bad} in a row; the run stops at trainer.max_nonfinite_steps={self.limit})")
        return bool(self.bad) and self.bad >= self.limit

    def error(self, step: int, written: str, before, keep_last: int) -> NonFiniteError:
        """The stop at ``step``.

        Args:
            step: the step the run stops at.
            written: the checkpoint saved now.
            before: the newest checkpoint kept from before the skipped steps (None: pruned by ``trainer.keep_last``).
            keep_last: ``trainer.keep_last``.

        Returns:
            the ``NonFiniteError`` to raise.
        """
        bad = self.bad
        return NonFiniteError(
            f"stopped at step {step}: the loss or gradient was NaN/inf in {bad} steps in a row "
            f"(steps {step - bad + 1}-{step}); their updates were skipped, so the drafter is the one "
            f"after step {step - bad}. Checkpoint written: {written} ("
            + (f"the last one before these steps: {before}" if before else
               f"none from before these steps is kept, trainer.keep_last={keep_last}") + "). "
            f"Lower trainer.lr or check the data, then resume (trainer.resume=auto, or "
            f"trainer.resume=<an earlier step folder>)")
