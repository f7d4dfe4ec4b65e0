"""Where a step's functions run: ``LocalGroup``, the Workers in this process (``runtime.backend: local``), and the
worker-group interface it shares with ``specopd.distributed.ray_backend.RayGroup``. A group runs a function given
as an object, ``group.run(phases.colocated_step, per_worker_args)`` -> ``colocated_step(worker, *args)`` on each
worker; what the function does is ``specopd.train.phases``. Threads, roles: specopd/train/DESIGN.md ("Worker groups").
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence, runtime_checkable

from specopd.profiling import append_spans, start_gpu_sampler
from specopd.train.worker import Worker


@runtime_checkable
class WorkerGroup(Protocol):
    """What the training controller needs of a group of Workers (``LocalGroup``, ``RayGroup``)."""

    num_workers: int
    split: bool  # runtime.roles == split: each worker is a pair, a drafter worker and a target worker
    closed: bool  # True once shutdown() ran (or a lost worker shut the group down): no call may follow

    def run(self, fn: Callable, per_worker_args: Sequence[tuple], role: str = "drafter") -> list:
        """``fn(worker, *args)`` on every worker with its own positional arguments -> results in rank order.
        role: "drafter" (the drafter workers; colocated: every worker) or "target" (split roles' target workers)."""

    def take_spans(self) -> list:
        """Every worker's profiler spans since the last call, in worker order, as one list."""

    def shutdown(self) -> None:
        ...


def data_info(group: WorkerGroup) -> dict:
    """Rank 0's ``Worker.data_info`` (every worker reads the same data)."""
    return group.run(Worker.data_info, [()] * group.num_workers)[0]


def worker_state(group: WorkerGroup) -> dict:
    """Rank 0's ``Worker.state_dict`` (the replicas are identical)."""
    return group.run(Worker.state_dict, [()] * group.num_workers)[0]


def load_worker_state(group: WorkerGroup, sd: dict) -> None:
    """``Worker.load_state_dict(sd)`` on every drafter worker."""
    group.run(Worker.load_state_dict, [(sd,)] * group.num_workers)


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


class LocalGroup:
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

    def _run(self, fn, w, args):
        try:
            return fn(w, *args)
        except BaseException:
            self._ar.barrier.abort()  # release the other workers instead of leaving them waiting
            raise

    def run(self, fn: Callable, per_worker_args: Sequence[tuple], role: str = "drafter") -> list:
        """As ``WorkerGroup.run``: in parallel threads with several workers."""
        per_worker_args = list(per_worker_args)
        if len(per_worker_args) != self.num_workers:
            raise ValueError(f"run({fn.__name__}): {len(per_worker_args)} argument tuples for {self.num_workers} "
                             f"workers")
        if role not in ("drafter", "target") or (role == "target" and not self.split):
            raise ValueError(f"run({fn.__name__}, role={role!r}): the roles are drafter, and target with split roles")
        workers = self.targets if role == "target" else self.workers
        if self._pool is None:
            return [fn(workers[0], *per_worker_args[0])]
        futs = [self._pool.submit(self._run, fn, w, a) for w, a in zip(workers, per_worker_args)]
        return [f.result() for f in futs]

    def take_spans(self) -> list:
        """The workers' spans (drafter workers, then target workers); the NVML samples go to the profile folder."""
        if self.sampler is not None:
            append_spans(self.output_dir, [], self.sampler.take())
        return [e for w in self.workers + self.targets for e in w.take_spans()]

    def shutdown(self) -> None:
        self.closed = True
        if getattr(self, "sampler", None) is not None:
            self.sampler.stop()
            self.sampler = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
