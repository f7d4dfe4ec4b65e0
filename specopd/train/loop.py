"""The training controller: ``train(cfg)``, a ``Trainer`` whose loop only calls its components (checkpointer, step,
validator, metrics), holding the run folder's lock throughout.
Components: specopd/train/DESIGN.md ("The training controller").
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch

from specopd.config import RecipeConfig, RecipeError
from specopd.distributed.ray_backend import RayGroup
from specopd.errors import write_replace
from specopd.memory import check_memory
from specopd.models.loading import check_device
from specopd.profiling import Profiler, append_spans, write_profile
from specopd.runs import checkpoint as ck
from specopd.runs.lock import run_lock
from specopd.train.checkpointer import Checkpointer, drafter_as_loaded
from specopd.train.data import BatchOrder, warm_conversation_cache
from specopd.train.determinism import apply_deterministic
from specopd.train.group import LocalGroup, data_info
from specopd.train.metrics import TrainMetrics, check_loggers, check_sink_folders
from specopd.train.step import NonFiniteGuard, train_step
from specopd.train.validator import Validator
from specopd.train.worker import Worker


def make_group(cfg: RecipeConfig):
    """The recipe's worker group (``runtime.backend``): Workers in this process, or in Ray actors."""
    if cfg.runtime.backend == "ray":
        return RayGroup(cfg, Worker)
    return LocalGroup(cfg)


# ---------------------------------------------------------------------------------------------- train
class Trainer:
    """One run of the recipe: the worker group and the components the loop calls (``checkpointer``,
    ``validator``, ``metrics``, the controller's profiler ``prof``)."""

    def __init__(self, cfg: RecipeConfig, progress: bool = True):
        self.cfg, self.t, self.out, self.progress = cfg, cfg.trainer, cfg.trainer.output_dir, progress
        self.prof = Profiler("controller", enabled=cfg.profile.enabled)  # the controller's phases: step, checkpoint
        self.checkpointer = Checkpointer(cfg, self.prof)
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self.group = self.metrics = self.validator = self.order = None
        self.info: dict = {}  # the workers' data_info: sample ids, lengths, draft length, data stats
        self.last: dict = {}  # the metrics line of the newest step
        self.warm_cache: Optional[dict] = None  # the conversations cache built by the controller (ray)

    def train(self) -> dict:
        """Resume or start, run the steps up to trainer.max_steps, save, summarise; returns the summary."""
        c = self.checkpointer.find()  # the checkpoint to resume from, checked; None: a fresh start
        done = self.checkpointer.finished(c) if c is not None else None
        if done is not None:
            return done
        self.prepare(fresh=c is None)
        try:
            step = self.start(c)
            while step < self.t.max_steps:
                with self.prof.span("step", step=step + 1):
                    step = self.step(step)
            self.metrics.end()
        except BaseException as e:
            try:
                self.checkpointer.save_on_interrupt(self.group, e)
            finally:
                self.close()  # the workers and Ray go down even when the checkpoint's message cannot be printed
            raise
        try:
            return self.finish(step)
        finally:
            self.close()

    def prepare(self, fresh: bool) -> None:
        """Everything before the workers: determinism, the controller's seeds, the checks, the worker group."""
        apply_deterministic(self.t.deterministic)
        if fresh:
            ck.seed_controller_rng(self.cfg.seed)  # byte-reproducible checkpoints (a resume restores the saved states)
        check_loggers(self.t.loggers)  # a missing optional package (tensorboard / wandb / mlflow) names its extra first
        check_sink_folders(self.cfg, resuming=not fresh)  # a logger folder that is a file / read-only: named now
        check_memory(self.cfg)  # a step larger than one device is a clear error (MemoryPlanError) before any work
        if self.cfg.runtime.backend == "ray":  # conversations: tokenise once here, not in every worker actor at once
            self.warm_cache = warm_conversation_cache(self.cfg)
        self.checkpointer.note_inputs()  # the data and target as the workers are about to read them
        self.group = make_group(self.cfg)

    def start(self, c: Optional[dict]) -> int:
        """Load the checkpoint ``c`` into the workers (or start fresh), then the components; returns the step."""
        g, cfg = self.group, self.cfg
        self.info = data_info(g)
        self.validator = Validator(cfg, g, self.info["heldout_ids"])
        self.order = BatchOrder(self.info["train_ids"], cfg.data.batch_size, cfg.data.seed)
        if c is not None:
            step, before = self.checkpointer.load(c, g, self.order), c["state"].get("eval_before")
        else:
            self.checkpointer.start_fresh()
            step, before = 0, self.validator.start_fresh()
        self.checkpointer.carry(before, c)
        self.metrics = TrainMetrics(cfg, step, resumed=c is not None, progress=self.progress)
        self.checkpointer.begin(step, self.order)
        self.validator.start(step, before)
        return step

    def step(self, step: int) -> int:
        """Step ``step`` + 1: train, log, evaluate and checkpoint when due; returns the steps done."""
        ids = self.order.next()
        self.checkpointer.track(step + 1, self.order)
        m = self.last = train_step(self.group, self.info, self.cfg, ids, step)
        step += 1
        m.update(step=step, time=time.time())
        if self.cfg.profile.enabled:
            append_spans(self.out, self.spans())
        due = self.validator.due(step)
        if due:  # after the step's timing (step_s excludes it); its worker spans are named "eval"
            m.update(self.validator.run(step))
        self.metrics.log(m, force=due)
        if due:
            self.validator.plot(self.metrics.warn)
        self.metrics.show(m, self.validator.latest)
        if self.guard.update(m, self.metrics.warn):
            p, _ = self.checkpointer.save(self.group)
            raise self.guard.error(step, p, self.checkpointer.kept_until(step - self.guard.bad), self.t.keep_last)
        if self.t.save_every and step % self.t.save_every == 0:
            self.checkpointer.save(self.group)
        return step

    def finish(self, step: int) -> dict:
        """The run ended at ``step``: its checkpoint, train_summary.json (returned) and the profile."""
        self.checkpointer.save_if_new(self.group, step)
        summary = {"method": self.t.method, "steps": step, "final_checkpoint": ck.find_latest(self.out),
                   "eval_before": self.validator.before, "last_step": self.last,
                   "data": self.info.get("data_stats")}  # what was read, dropped, cut, skipped: nothing silently
        if self.warm_cache is not None and summary["data"]:
            summary["data"]["cache"] = self.warm_cache  # built (or found) by the controller before the workers
        summary.update(self.validator.summary(step))
        if self.cfg.profile.enabled:
            try:
                write_profile(self.out, self.spans(), gpu_note=getattr(self.group, "gpu_note", None))
            except Exception as e:  # noqa: BLE001  (plots are a convenience; the raw spans are saved)
                print(f"profile rendering failed ({e}); raw spans are in {self.out}/profile/spans.jsonl")
        write_replace(os.path.join(self.out, "train_summary.json"), json.dumps(summary, indent=1))
        return summary

    def spans(self) -> list:
        """The workers' and the controller's spans recorded since the last call."""
        return self.group.take_spans() + self.prof.take()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.group.shutdown()


def train(cfg: RecipeConfig, progress: bool = True) -> dict:
    """Run the recipe; returns the summary (also written to <output_dir>/train_summary.json). Holds the run
    folder's lock (``specopd.runs.lock``) throughout: a second writer is refused."""
    if cfg.pipeline.enabled:
        raise RecipeError("pipeline.enabled=true is the main job (prepare, warm up, train, evaluate, export), which "
                          "runs this training loop itself: run `specopd train RECIPE` or specopd.mainjob.run(cfg), "
                          "or set pipeline.enabled=false to train on the recipe's data alone")
    if cfg.data.batch_size < cfg.runtime.num_workers:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} < runtime.num_workers={cfg.runtime.num_workers}: "
                         f"every worker needs at least one sample per step")
    check_device(cfg)
    cfg = drafter_as_loaded(cfg)  # drafter.init_from: checked, and its drafter is what the run records
    with run_lock(cfg.trainer.output_dir, "trainer.output_dir"):
        return Trainer(cfg, progress).train()
