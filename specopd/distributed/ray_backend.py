"""RayGroup: a group of workers as Ray actors, data-parallel, gradients summed with torch.distributed; the
interface of ``specopd.train.group.LocalGroup``. Each actor builds its worker with the factory it is given and runs
``fn(worker, *args)`` for the functions the controller sends (Ray pickles a module-level function by reference), so
this module knows nothing of training. Start-up, faults and roles: specopd/distributed/DESIGN.md ("Ray backend").
"""
from __future__ import annotations

import json
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from specopd.errors import UserError, own_dir, write_replace
from specopd.profiling import append_spans, start_gpu_sampler
from specopd.runs import checkpoint as ck
from specopd.signals import starting_ray

PG_READY_TIMEOUT_S = float(os.environ.get("SPECOPD_PG_TIMEOUT_S", "120"))


class ClusterTooSmallError(RuntimeError):
    pass


class WorkerLostError(RuntimeError):
    """A worker actor died. Attributes: rank, node_ip, node_id, method, checkpoint (path or None)."""

    def __init__(self, msg, *, rank, node_ip, node_id, method, checkpoint):
        super().__init__(msg)
        self.rank, self.node_ip, self.node_id = rank, node_ip, node_id
        self.method, self.checkpoint = method, checkpoint


def _get(cfg, path: str, default=None):
    cur = cfg
    for k in path.split("."):
        if cur is None:
            return default
        cur = cur.get(k, None) if isinstance(cur, dict) else getattr(cur, k, None)
    return default if cur is None else cur


# -- the actor ------------------------------------------------------------------------------------------

class _WorkerHost:
    """Runs in the actor process: hosts one worker (``make_worker(cfg, rank, world_size, ...)``; the worker applies
    the recipe's process settings itself) and its share of the process group."""

    def __init__(self, make_worker: Callable, cfg, rank: int, world_size: int, num_threads: int,
                 role: Optional[str] = None, tp_rank: int = 0, tp_size: int = 1):
        torch.set_num_threads(max(1, num_threads))
        self.rank, self.world_size = rank, world_size  # data-parallel
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.make_worker, self.cfg, self.role = make_worker, cfg, role
        self.init_error, self.worker, self.dp_group = None, None, None
        self.sampler, self.gpu_note = None, None
        if tp_size == 1:  # a sharded target needs the process group first: built in init_dist
            self._build(None)

    def _build(self, tensor_parallel) -> None:
        kw = {"role": self.role} if self.role else {}  # colocated: the plain constructor (custom worker classes too)
        if tensor_parallel is not None:
            kw["tensor_parallel"] = tensor_parallel
        try:
            self.worker = self.make_worker(self.cfg, self.rank, self.world_size, **kw)
        except UserError as e:  # a user's mistake (bad data, ...): raised by info() with its own type, so the
            self.init_error = e  # driver reports it as such (an actor that fails in __init__ loses the type)
            return
        who = f"{'target' if self.role == 'target' else 'worker'}{self.rank}"
        self.sampler, self.gpu_note = start_gpu_sampler(self.cfg, who + (f".tp{self.tp_rank}" if self.tp_size > 1
                                                                         else ""))

    def info(self) -> dict:
        import ray  # ray: slow to import; only in a Ray run

        if self.init_error is not None:
            raise self.init_error

        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids()}

    def master_endpoint(self):
        import ray  # ray: slow to import; only in a Ray run

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_dist(self, addr: str, port: int, backend: str, timeout_s: float):
        """Join the process group of every actor (data-parallel rank x tensor_parallel + tp rank); with
        tensor_parallel > 1 build the (dp, tp) mesh and then the worker, its target sharded over "tp"."""
        if "nccl" in backend:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        n, tp = self.world_size, self.tp_size
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank * tp + self.tp_rank,
                                world_size=n * tp, timeout=timedelta(seconds=timeout_s))
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from specopd.config import vocab_parallel_head
            from specopd.models.tensor_parallel import TensorParallel

            mesh = init_device_mesh("cuda" if "nccl" in backend else "cpu", (n, tp), mesh_dim_names=("dp", "tp"))
            self.dp_group = mesh["dp"].get_group()
            self._build(TensorParallel(mesh["tp"], shard_vocab=vocab_parallel_head(self.cfg)))
            if self.init_error is not None:
                raise self.init_error
        if n > 1:
            self.worker.set_allreduce(self._allreduce)
        return True

    def _allreduce(self, grads: Sequence) -> None:
        """Sum ``grads`` over all workers, in place. Every worker must pass the same list of shapes."""
        ts = [g for g in grads if g is not None]
        if len(ts) != len(grads):
            raise ValueError("all-reduce got None gradients; pass zeros for parameters without a gradient so "
                             "every worker reduces the same list")
        if not ts:
            return
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in ts])  # fp32 sum even for bf16
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)  # tp ranks hold equal gradients
        off = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[off: off + n].view_as(t))
            off += n

    def run(self, fn: Callable, args: tuple):
        """``fn(worker, *args)`` on this actor's worker."""
        return fn(self.worker, *args)

    def profile_take(self):
        """(spans, gpu_samples, note): the worker's spans since the last call, this actor's NVML samples, and why
        there are none."""
        spans = self.worker.take_spans()
        samples = self.sampler.take() if self.sampler is not None else []
        return spans, samples, self.gpu_note

    def close(self):
        if self.sampler is not None:
            self.sampler.stop()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        return True


# -- the controller side ---------------------------------------------------------------------------------

def quiet_ray_kwargs() -> dict:
    """Extra ``ray.init`` arguments that keep Ray's own info lines out of a run's output; also silences the
    notice that Ray turned on token authentication for a local cluster (its default: the setting itself
    is unchanged). Ray's other warnings and errors still show; ``SPECOPD_RAY_VERBOSE=1`` keeps everything."""
    if os.environ.get("SPECOPD_RAY_VERBOSE"):
        return {}
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    return {"logging_level": logging.WARNING}


def _node_capacity(nodes: list, cpus: float, gpus: float) -> list:
    """[(node_id, ip, workers that fit)] for alive nodes, most capacity first."""
    out = []
    for n in nodes:
        if not n.get("Alive", False):
            continue
        r = n.get("Resources", {})
        fit = [int(r.get("CPU", 0) // cpus)] if cpus > 0 else []
        if gpus > 0:
            fit.append(int(r.get("GPU", 0) // gpus))
        out.append((n["NodeID"], n.get("NodeManagerAddress", "?"), min(fit) if fit else 1 << 30))
    return sorted(out, key=lambda x: -x[2])


class RayGroup:
    """``cfg.runtime``'s workers as Ray actors, each built by ``make_worker(cfg, rank, world_size, role=...,
    tensor_parallel=...)`` (``specopd.train.worker.Worker``). The interface: ``specopd.train.group.WorkerGroup``."""

    def __init__(self, cfg, make_worker: Callable):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray  # ray: slow to import; only in a Ray run
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self.world_size = self.num_workers = n = int(_get(cfg, "runtime.num_workers", 1))
        cpus = float(_get(cfg, "runtime.cpus_per_worker", 1))
        gpus = float(_get(cfg, "runtime.gpus_per_worker", 0))
        roles = str(_get(cfg, "runtime.roles", "colocated"))
        if roles not in ("colocated", "split"):
            raise ValueError(f"runtime.roles must be colocated | split, got {roles!r}")
        if n < 1:
            raise ValueError(f"runtime.num_workers must be >= 1, got {n}")
        self.split = roles == "split"
        self.tp = tp = int(_get(cfg, "runtime.tensor_parallel", 1))  # actors per data-parallel worker, one node
        total_actors = 2 * n if self.split else n * tp  # split: n drafter actors, then n target actors
        self.output_dir = _get(cfg, "trainer.output_dir", ".")
        self.actors: list = []
        self.pgs: list = []
        self.infos: list = []
        self.closed = False
        self._started_ray = False

        address = _get(cfg, "runtime.address", None)
        if not ray.is_initialized():
            self._started_ray = True  # first: an interrupt inside ray.init still stops what it started
            try:
                with starting_ray():  # Ray's SIGTERM alarm dropped; its processes leave a hangup to the driver
                    ray.init(address=address or None, include_dashboard=False, log_to_driver=True,
                             **quiet_ray_kwargs())
            except BaseException:
                self._stop_ray()
                raise
        total = ray.cluster_resources()
        have_cpu, have_gpu = total.get("CPU", 0.0), total.get("GPU", 0.0)
        plan, left = [], total_actors
        caps = _node_capacity(ray.nodes(), cpus, gpus)
        for node_id, ip, cap in caps:
            k = min(cap - cap % tp, left)  # whole tensor-parallel groups per node
            if k > 0:
                plan.append((node_id, ip, k))
                left -= k
        if left > 0:
            biggest = max((c for _, _, c in caps), default=0)
            self._stop_ray()
            raise ClusterTooSmallError(
                (f"runtime.roles=split: {n} target + {n} drafter workers; " if self.split else "") +
                f"runtime asks for {total_actors} workers x ({cpus:g} CPU, {gpus:g} GPU) = {total_actors * cpus:g} CPU, "
                f"{total_actors * gpus:g} GPU, "
                f"but the Ray cluster{' at ' + address if address else ' (local)'} has {have_cpu:g} CPU, "
                f"{have_gpu:g} GPU on {len(caps)} node(s), and whole workers fit for only {total_actors - left} "
                f"(largest node: {biggest})" + (f", in whole groups of runtime.tensor_parallel={tp} on one node"
                                                if tp > 1 else "") + ". Lower runtime.num_workers / runtime.cpus_per_worker / "
                f"runtime.gpus_per_worker, or add nodes (ray start --address=...).")

        bundle = {"CPU": cpus}
        if gpus > 0:
            bundle["GPU"] = gpus
        remote = ray.remote(_WorkerHost)
        rank = 0
        nthreads = max(1, int(cpus))
        try:
            for node_id, ip, k in plan:
                pg = placement_group([dict(bundle) for _ in range(k)], strategy="STRICT_PACK",
                                     bundle_label_selector=[{"ray.io/node-id": node_id}] * k)
                self.pgs.append(pg)
                ready = pg.ready()
                done, _ = ray.wait([ready], timeout=PG_READY_TIMEOUT_S)
                if not done:
                    raise ClusterTooSmallError(
                        f"placement group of {k} x {bundle} on node {ip} ({node_id[:12]}) was not ready after "
                        f"{PG_READY_TIMEOUT_S:g} s: the resources exist but are in use (available now: "
                        f"{ray.available_resources()}). Free them (other Ray jobs) or lower runtime.num_workers.")
                for b in range(k):
                    self.infos.append({"rank": rank, "ip": ip, "node_id": node_id})  # until info() answers
                    strat = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)
                    role = (None if not self.split else "drafter" if rank < n else "target")
                    dp, t = (rank // tp, rank % tp) if not self.split else (rank % n, 0)
                    self.actors.append(remote.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strat)
                                       .remote(make_worker, cfg, dp, n, nthreads, role, t, tp))
                    rank += 1
            self.infos = self._wait([a.info.remote() for a in self.actors], "__init__")
            if n * tp > 1:
                # nccl for CUDA tensors (one GPU per rank), gloo for CPU tensors
                backend = "cpu:gloo,cuda:nccl" if gpus >= 1 else "gloo"
                addr, port = ray.get(self.actors[0].master_endpoint.remote())
                timeout = float(_get(cfg, "runtime.dist_timeout_s", 1800))
                self._wait([a.init_dist.remote(addr, port, backend, timeout) for a in self.actors[:n * tp]],
                           "init_dist")
        except BaseException:
            self.shutdown()
            raise

    # -- the worker-group interface -------------------------------------------------------------------
    def run(self, fn: Callable, per_worker_args: Sequence[tuple], role: str = "drafter") -> list:
        """``fn(worker, *args)`` on every worker of ``role`` with its own positional arguments (one tuple per
        worker) -> results in rank order. role: "drafter" (the drafter actors; colocated: all of them) or
        "target" (split roles' target actors). Every rank of a tensor-parallel group runs the call; its first
        rank answers for the group."""
        if len(per_worker_args) != self.world_size:
            raise ValueError(f"run({fn.__name__}) got {len(per_worker_args)} argument sets for "
                             f"{self.world_size} workers")
        if role not in ("drafter", "target") or (role == "target" and not self.split):
            raise ValueError(f"run({fn.__name__}, role={role!r}): the roles are drafter, and target with split roles")
        self._check_open()
        tp, base = self.tp, self.world_size if role == "target" else 0
        refs = [a.run.remote(fn, tuple(per_worker_args[i // tp]))
                for i, a in enumerate(self.actors[base: base + self.world_size * tp])]
        return self._wait(refs, fn.__name__, base)[::tp]

    def take_spans(self) -> list:
        """Every actor's profiler spans since the last call, in actor order, as one list. GPU samples and the
        workers' GPU note go straight to <output_dir>/profile/ (gpu.jsonl, meta.json), where profiling.render
        reads them: the controller may have no GPU while the workers do."""
        self._check_open()
        out = self._wait([a.profile_take.remote() for a in self.actors], "take_spans")
        samples = [x for o in out for x in o[1]]
        if samples:
            append_spans(self.output_dir, [], samples)
        notes = [o[2] for o in out if o[2]]
        meta = Path(self.output_dir) / "profile" / "meta.json"
        if notes and not meta.exists():
            own_dir(str(meta.parent))
            write_replace(str(meta), json.dumps({"gpu_note": f"Ray workers: {notes[0]}"}))
        return [e for o in out for e in o[0]]

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        import ray  # ray: slow to import; only in a Ray run

        if self.actors:
            try:  # polite close first (process group, NVML thread), bounded
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=5)
            except Exception:
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group  # ray: slow to import

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._stop_ray()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    # -- internals --------------------------------------------------------------------------------
    def _stop_ray(self):
        import ray  # ray: slow to import; only in a Ray run

        if self._started_ray:  # also after a ray.init cut short: the processes it started
            ray.shutdown()
            self._started_ray = False

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this RayGroup is shut down (a worker died or shutdown() was called); "
                               "start a new run, with trainer.resume=auto to continue from the last checkpoint")

    def _wait(self, refs: list, method: str, base: int = 0) -> list:
        """ray.get in rank order, but fail fast: the first dead actor ends the wait (others may block in
        the all-reduce forever otherwise). ``base``: the actor index of refs[0] (for error messages)."""
        import ray  # ray: slow to import; only in a Ray run
        from ray.exceptions import (ActorDiedError, ActorUnavailableError, NodeDiedError, OutOfMemoryError,
                                    RayActorError, RayTaskError, WorkerCrashedError)

        lost = (RayActorError, ActorDiedError, ActorUnavailableError, NodeDiedError, OutOfMemoryError,
                WorkerCrashedError)
        rank_of = {r: i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                rank = base + rank_of[r]
                try:
                    results[rank - base] = ray.get(r)
                except lost as e:
                    self._lost(rank, method, e)
                except RayTaskError as e:
                    self._lost_peer(pending, rank_of, base, method, lost)  # a dead peer broke its collective
                    self.shutdown()
                    cause = e.as_instanceof_cause()  # an instance of the worker's exception type too
                    if hasattr(cause, "add_note"):
                        cause.add_note(f"(raised by Ray worker rank {rank} in {method!r}; the run is stopped)")
                    raise cause from None
        return results

    def _lost_peer(self, pending: list, rank_of: dict, base: int, method: str, lost: tuple,
                   grace_s: float = 10.0) -> None:
        """A worker's error in a collective (gloo: "Connection reset by peer") is often a peer's death that Ray
        has not reported yet: wait up to ``grace_s`` for the other workers, and name a dead one (``_lost``)
        instead of the survivor's symptom."""
        import ray  # ray: slow to import; only in a Ray run

        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        for r in ready:
            try:
                ray.get(r)
            except lost as e:
                self._lost(base + rank_of[r], method, e)
            except Exception:  # noqa: BLE001 - the first worker's own error is raised by the caller
                pass

    def _lost(self, rank: int, method: str, err: Exception):
        info = self.infos[rank] if rank < len(self.infos) else {}
        ip, node = info.get("ip", "?"), info.get("node_id", "?")
        label = str(rank)
        if getattr(self, "split", False):  # actor index -> its role (drafters first, then targets)
            label = f"{rank % self.world_size} ({'target' if rank >= self.world_size else 'drafter'} role)"
        self.shutdown()
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
        if getattr(err, "_actor_init_failed", False):  # make_worker(cfg, rank, world_size) raised: not a fault
            raise RuntimeError(f"worker rank {label} (node {ip}, node id {node}) failed to start: "
                               f"{lines[-1] if lines else type(err).__name__}") from err
        last = ck.find_latest(self.output_dir)
        first = (lines or [""])[0].rstrip(".")
        msg = (f"worker rank {label} (node {ip}, node id {node}) died during {method!r}: {type(err).__name__}: "
               f"{first}. The run is stopped (all workers shut down). Last complete checkpoint: "
               f"{last or 'none yet'}. Fix the cause (out of memory? lower the batch or trainer.* sizes), then "
               f"rerun the same command with trainer.resume=auto to continue from "
               f"{'that checkpoint' if last else 'the start (no checkpoint was written)'}.")
        raise WorkerLostError(msg, rank=rank, node_ip=ip, node_id=node, method=method, checkpoint=last) from err


# -- the dry-run plan (``specopd train RECIPE --dry-run`` calls this for runtime.backend=ray) -------------

def extend_plan(cfg, p: dict) -> dict:
    """Add the Ray placement (one STRICT_PACK placement group per node) to the trainer's plan (the memory
    plan of each GPU is ``specopd.memory``'s, already in ``p["memory"]``)."""
    r = cfg.runtime
    n, cpus, gpus = int(r.num_workers), float(r.cpus_per_worker), float(r.gpus_per_worker)
    pairs = n
    if r.roles == "split":  # n drafter actors + n target actors
        n = 2 * pairs
    tp = int(r.tensor_parallel)
    n *= tp  # colocated: a group of tp actors on one node per data-parallel worker
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}
    notes = p.setdefault("notes", [])
    p["ray"] = {"address": r.address or "local (ray.init on this machine)", "bundle": bundle,
                "bundles": n, "strategy": "one STRICT_PACK placement group per node, workers packed node by node",
                "total": {"CPU": n * cpus, "GPU": n * gpus},
                "process_group": "nccl (CUDA) + gloo (CPU)" if gpus >= 1 else "gloo", "roles": r.roles}
    notes.append(f"ray: {n} actors x {bundle} = {n * cpus:g} CPU, {n * gpus:g} GPU "
                 f"({p['ray']['strategy']}; drafter gradients summed with {p['ray']['process_group']})")
    if tp > 1:
        notes.append(f"tensor parallel: each of the {pairs} worker(s) shards its target over {tp} actors on one node "
                     f"(a (dp, tp) device mesh); the memory plan below is one rank's")
    if r.roles == "split":
        notes.append(f"roles split: {pairs} drafter actor(s) (propose, loss, all-reduced optimizer step) + {pairs} "
                     f"target actor(s) (prefill, trunk caches, packed scoring); per step the controller moves "
                     f"trunk ids + features -> drafter, anchors + tokens -> target, the target's hidden states "
                     f"[N, W, D] -> drafter")
    if not r.address:
        try:
            here_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # pragma: no cover
            here_gpu = 0
        here_cpu = os.cpu_count() or 1
        fits = n * cpus <= here_cpu and n * gpus <= here_gpu
        notes.append(f"this machine: {here_cpu} CPU, {here_gpu} GPU -> the run "
                     f"{'fits here' if fits else 'does NOT fit here (needs a node with the resources above, or runtime.address of a cluster)'}")
    return p
