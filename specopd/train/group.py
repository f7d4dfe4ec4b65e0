"""In-process worker group (``runtime.backend: local``), and the worker-group interface that
``specopd.distributed.ray_backend.RayGroup`` shares; ``split_call`` runs a step over split roles.
Interface, threads and split roles: specopd/train/DESIGN.md ("Worker groups").
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Protocol, Sequence, runtime_checkable

from specopd.profiling import append_spans, start_gpu_sampler
from specopd.train.worker import Worker


@runtime_checkable
class WorkerGroup(Protocol):
    """What the training controller needs of a group of Workers (``LocalGroup``, ``RayGroup``)."""

    num_workers: int
    closed: bool  # True once shutdown() ran (or a lost worker shut the group down): no call may follow

    def call(self, method: str, per_worker_args: Sequence[tuple]) -> list:
        """``Worker.<method>`` on every worker with its own positional arguments -> results in rank order."""

    def call_role(self, role: str, method: str, per_worker_args: Sequence[tuple]) -> list:
        """``method`` on the drafter workers (colocated: all workers) or, split roles, the target workers."""

    def broadcast(self, method: str, *args) -> list:
        """``method`` with the same arguments on every worker."""

    def shutdown(self) -> None:
        ...

    def data_info(self) -> dict:
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, sd: dict) -> None:
        ...

    def take_spans(self) -> list:
        ...

    def stage(self, shards: Sequence[list], step: int) -> int:
        ...

    def finish(self, denom) -> List[dict]:
        ...

    def train_step(self, shards: Sequence[list], step: int, denom) -> List[dict]:
        ...

    def train_step_invariant(self, shards: Sequence[list], step: int, denom, bounds: list, total: int
                             ) -> List[dict]:
        """``Worker.train_step_invariant`` on every worker (``trainer.batch_invariant``).

        Args:
            shards: one list of sample ids per worker.
            step: the step index.
            denom: the global branch count.
            bounds: every worker's (lo, hi) in the global batch.
            total: the global batch size.

        Returns:
            one metrics dict per worker, in rank order.
        """
        ...

    def evaluate(self, shards: Sequence[list]) -> List[dict]:
        ...


class WorkerCalls:
    """Typed calls of the Worker methods the controller uses, on top of ``call`` / ``broadcast`` (a group
    class inherits them). ``shards``: one list of sample ids per worker."""

    num_workers: int

    def call(self, method: str, per_worker_args: Sequence[tuple]) -> list:
        raise NotImplementedError

    def broadcast(self, method: str, *args) -> list:
        raise NotImplementedError

    def data_info(self) -> dict:
        """Rank 0's ``Worker.data_info`` (every worker reads the same data)."""
        return self.call("data_info", [()] * self.num_workers)[0]

    def state_dict(self) -> dict:
        """Rank 0's ``Worker.state_dict`` (the replicas are identical)."""
        return self.call("state_dict", [()] * self.num_workers)[0]

    def load_state_dict(self, sd: dict) -> None:
        self.broadcast("load_state_dict", sd)

    def take_spans(self) -> list:
        """Every worker's profiler spans since the last call, in worker order, as one list."""
        return [e for r in self.call("take_spans", [()] * self.num_workers) for e in r]

    def stage(self, shards: Sequence[list], step: int) -> int:
        """``Worker.stage`` on every shard (Draft-OPD) -> the global branch count (the loss's denominator)."""
        return sum(r["branches"] for r in self.call("stage", [(p, step) for p in shards]))

    def finish(self, denom) -> List[dict]:
        return self.call("finish", [(denom,)] * self.num_workers)

    def train_step(self, shards: Sequence[list], step: int, denom) -> List[dict]:
        return self.call("train_step", [(p, step, denom) for p in shards])

    def train_step_invariant(self, shards: Sequence[list], step: int, denom, bounds: list, total: int
                             ) -> List[dict]:
        """Args / Returns: as ``specopd.train.group.WorkerGroup.train_step_invariant``."""
        return self.call("train_step_invariant", [(p, step, denom, bounds, total) for p in shards])

    def evaluate(self, shards: Sequence[list]) -> List[dict]:
        return self.call("evaluate", [(s,) for s in shards])


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


def split_call(group: WorkerGroup, method: str, per_worker_args) -> list:
    """The controller of ``runtime.roles: split``: pair i = (target worker i, drafter worker i). Moves trunks
    (token ids + features) target -> drafter, Branches (anchors, tokens) drafter -> target, the target's
    hidden states (``Scored``) back."""
    per_worker_args = [tuple(a) for a in per_worker_args]
    call = group.call_role
    if method == "train_step":
        ids = [a[0] for a in per_worker_args]
        trunks = call("target", "stage_trunks", [(i,) for i in ids])
        branches = call("drafter", "stage_proposals", [(t, i, a[1]) for t, i, a in zip(trunks, ids, per_worker_args)])
        scored = call("target", "score_staged", [(x,) for x in branches])
        res = call("drafter", "finish_scored", [(s.hp, a[2]) for s, a in zip(scored, per_worker_args)])
        for r, s in zip(res, scored):  # the target's prefill / score times join the pair's metrics
            r["phase_s"] = {**s.phase_s, **r["phase_s"]}
        return res
    if method == "evaluate":
        ids = [a[0] for a in per_worker_args]
        trunks = call("target", "stage_trunks", [(i,) for i in ids])
        branches = call("drafter", "propose_eval",
                        [(t, i) + tuple(a[1:]) for t, i, a in zip(trunks, ids, per_worker_args)])
        scored = call("target", "score_staged", [(x,) for x in branches])
        return call("drafter", "evaluate_scored", [(s.hp,) for s in scored])
    if method in ("stage", "finish"):
        raise NotImplementedError("runtime.roles=split runs train_step only (trainer.method=draft_opd needs "
                                  "runtime.roles=colocated)")
    if method == "take_spans":
        return call("drafter", method, per_worker_args) + call("target", method, per_worker_args)
    return call("drafter", method, per_worker_args)


class LocalGroup(WorkerCalls):
    """The Workers in this process (``runtime.backend: local``); see the module docstring."""

    def __init__(self, cfg, num_workers: int | None = None):
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
        self.closed = False
        try:  # NVML utilisation samples (profile.nvml on a GPU); None and a reason otherwise
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
            append_spans(self.output_dir, [], self.sampler.take())
        if self._pool is None:
            return [getattr(workers[0], method)(*per_worker_args[0])]
        futs = [self._pool.submit(self._run, w, method, a) for w, a in zip(workers, per_worker_args)]
        return [f.result() for f in futs]

    def broadcast(self, method: str, *args) -> list:
        return self.call(method, [args] * self.num_workers)

    def shutdown(self) -> None:
        self.closed = True
        if getattr(self, "sampler", None) is not None:
            self.sampler.stop()
            self.sampler = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
