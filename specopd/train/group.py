"""In-process worker group (``runtime.backend: local``).

The group interface (shared with ``specopd.distributed.ray_backend.RayGroup``):
``group.call(method, per_worker_args) -> list of results`` (per_worker_args: one tuple of positional
args per worker), ``group.broadcast(method, *args) -> list``, ``group.shutdown()``, ``group.num_workers``.

With several workers, each ``call`` runs the workers' methods in parallel threads, and their all-reduce is
a thread barrier whose action sums the gradients in rank order (deterministic) and writes the sum back
into every worker's gradients, so the math equals the Ray path (sum all-reduce across actors).

``runtime.roles: split``: worker i of the group is a pair (target worker i, drafter worker i); both groups
also answer ``call_role(role, method, per_worker_args)``, and ``call`` goes through ``split_call``, which runs
``train_step`` / ``evaluate`` as the four-hop exchange of Worker's split-role methods and sends every other
method (data_info, state_dict, load_state_dict, ...) to the drafter workers. Draft-OPD is not supported split.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class ThreadAllReduce:
    """Summing all-reduce over n in-process workers; ``fn(rank)`` is the per-worker callable."""

    def __init__(self, n: int):
        self.n = n
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, action=self._reduce)

    def _reduce(self):
        for i in range(len(self.slots[0])):
            total = self.slots[0][i].clone()
            for r in range(1, self.n):
                total += self.slots[r][i]
            for r in range(self.n):
                self.slots[r][i].copy_(total)
        self.slots = [None] * self.n

    def fn(self, rank: int):
        def allreduce(grads):
            self.slots[rank] = grads
            self.barrier.wait(timeout=600)
        return allreduce


def split_call(group, method: str, per_worker_args) -> list:
    """The controller of ``runtime.roles: split``: pair i = (target worker i, drafter worker i). Moves trunk
    token ids + features target -> drafter, proposals (anchors, tokens) drafter -> target, p logits back."""
    per_worker_args = [tuple(a) for a in per_worker_args]
    call = group.call_role
    if method == "train_step":
        ids = [a[0] for a in per_worker_args]
        trunks = call("target", "stage_trunks", [(i,) for i in ids])
        light = call("drafter", "stage_proposals", [(t, i, a[1]) for t, i, a in zip(trunks, ids, per_worker_args)])
        scored = call("target", "score_staged", [(x,) for x in light])
        res = call("drafter", "finish_scored", [(p, a[2]) for (p, _), a in zip(scored, per_worker_args)])
        for r, (_, phases) in zip(res, scored):  # the target's prefill / score times join the pair's metrics
            r["phase_s"] = {**phases, **r["phase_s"]}
        return res
    if method == "evaluate":
        ids = [a[0] for a in per_worker_args]
        trunks = call("target", "stage_trunks", [(i,) for i in ids])
        light = call("drafter", "propose_eval", [(t, i) + tuple(a[1:]) for t, i, a in zip(trunks, ids, per_worker_args)])
        scored = call("target", "score_staged", [(x,) for x in light])
        return call("drafter", "evaluate_scored", [(p,) for p, _ in scored])
    if method in ("stage", "finish"):
        raise NotImplementedError("runtime.roles=split runs train_step only (trainer.method=draft_opd needs "
                                  "runtime.roles=colocated)")
    if method == "take_spans":
        return call("drafter", method, per_worker_args) + call("target", method, per_worker_args)
    return call("drafter", method, per_worker_args)


class LocalGroup:
    def __init__(self, cfg, num_workers: int | None = None):
        from specopd.train.worker import Worker

        n = int(num_workers or cfg.runtime.num_workers)
        self.num_workers = n
        self.split = cfg.runtime.roles == "split"
        first = Worker(cfg, rank=0, world_size=n, role="drafter" if self.split else "both")
        # the frozen target is shared read-only by the in-process replicas (no copies)
        self.workers = [first] + [Worker(cfg, rank=r, world_size=n, target=first.target,
                                         role="drafter" if self.split else "both") for r in range(1, n)]
        self.targets = [Worker(cfg, rank=r, world_size=n, target=first.target, role="target")
                        for r in range(n)] if self.split else []
        self._pool = ThreadPoolExecutor(max_workers=n) if n > 1 else None
        self._ar = ThreadAllReduce(n) if n > 1 else None
        self.output_dir = cfg.trainer.output_dir
        try:  # NVML utilisation samples (profile.nvml on a GPU); None and a reason otherwise
            from specopd.profiling import start_gpu_sampler

            self.sampler, self.gpu_note = start_gpu_sampler(cfg, "local")
        except ImportError:
            self.sampler, self.gpu_note = None, None
        for r, w in enumerate(self.workers if n > 1 else []):
            w.set_allreduce(self._ar.fn(r))

    def _run(self, w, method, args):
        try:
            return getattr(w, method)(*args)
        except BaseException:
            self._ar.barrier.abort()  # release the other workers instead of leaving them waiting
            raise

    def call(self, method: str, per_worker_args) -> list:
        per_worker_args = list(per_worker_args)
        if len(per_worker_args) != self.num_workers:
            raise ValueError(f"call({method!r}): {len(per_worker_args)} argument tuples for {self.num_workers} workers")
        if self.split:
            return split_call(self, method, per_worker_args)
        return self.call_role("drafter", method, per_worker_args)

    def call_role(self, role: str, method: str, per_worker_args) -> list:
        """``method`` on the drafter workers (colocated: all workers) or, split, on the target workers."""
        workers = self.targets if role == "target" else self.workers
        if method == "take_spans" and self.sampler is not None:  # drain the NVML samples with the spans
            from specopd.profiling import append_spans

            append_spans(self.output_dir, [], self.sampler.take())
        if self._pool is None:
            return [getattr(workers[0], method)(*per_worker_args[0])]
        futs = [self._pool.submit(self._run, w, method, a) for w, a in zip(workers, per_worker_args)]
        return [f.result() for f in futs]

    def broadcast(self, method: str, *args) -> list:
        return self.call(method, [args] * self.num_workers)

    def shutdown(self) -> None:
        if getattr(self, "sampler", None) is not None:
            self.sampler.stop()
            self.sampler = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
