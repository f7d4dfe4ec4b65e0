"""``specopd follow RECIPE``: watch ``follow.policies`` and ``follow.rollouts``, and for each policy version in
turn swap it in, train on its rollouts (``follow.steps_per_version`` / ``seconds_per_version``), publish its drafter
(``<output_dir>/exports/v<version>/`` + ``exports/latest``) and checkpoint, the rollouts consumed included, so that a
killed run resumes without skipping or repeating one. When to train a version: specopd/follow/DESIGN.md.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from specopd.drafters.layout import read_config as drafter_config
from specopd.drafters.layout import serving_commands
from specopd.drafters.mtp import is_mtp_folder, mtp_serving_command
from specopd.runs import checkpoint as ck
from specopd.settings import RecipeError
from specopd.follow.follower import DrafterFollower, latest_export, publish
from specopd.follow.sources import RolloutReader, complete_policies


def pickup_note(export: str, server: str, target: str) -> str:
    """How the vLLM server at ``server`` picks the export up. vLLM (0.32, checked in the project's vLLM venv)
    updates a draft model's weights in place only in its development mode (``VLLM_SERVER_DEV_MODE=1``: POST
    /start_draft_weight_update, /update_weights, /finish_weight_update), with the tensors sent by a process of a
    weight-transfer group (nccl / ipc) it was started with; it cannot load a folder. So: restart it on the export."""
    if is_mtp_folder(export):
        with open(os.path.join(export, "config.json")) as fh:
            cmd = mtp_serving_command(export, json.load(fh), target)
    else:
        cfg, _ = drafter_config(export)
        cmd = serving_commands(export, cfg, target)[0]
    return (f"[follow] vLLM server {server}: vLLM reloads a drafter in place only from tensors pushed over its "
            f"weight-transfer API (VLLM_SERVER_DEV_MODE=1, /start_draft_weight_update), not from a folder; restart it "
            f"on the new drafter:\n  {cmd}")


class Watcher:
    """The loop of ``specopd follow`` around a ``DrafterFollower``: ``poll`` reads what is new, ``due`` says which
    version trains next, ``run_version`` trains and publishes it."""

    def __init__(self, follower: DrafterFollower):
        self.f = follower
        self.cfg = follower.cfg.follow
        if not self.cfg.policies or not self.cfg.rollouts:
            raise RecipeError("specopd follow needs follow.policies (the folder of policy versions) and follow.rollouts "
                             "(a JSONL file or a folder of them); set both in the recipe or as overrides")
        extra = follower.extra
        self.done = extra.get("done")  # the newest version trained and published (None: none yet)
        self.reader = RolloutReader(self.cfg.rollouts, extra.get("reader"))
        self.pending: dict = {}  # version -> rollouts read ({"where", "pos", "record"}) not yet consumed
        self.late: list = []  # rollouts of versions already trained (consumed at the next checkpoint, not trained on)
        self.skipped: list = extra.get("skipped", [])

    def extra(self, late: int = 0, training: Optional[list] = None) -> dict:
        """The job's state a checkpoint carries: the last version done, the reader's state, the versions skipped,
        the late rollouts counted (``late`` more now) and the positions of the rollouts of the version training."""
        out = {"done": self.done, "reader": self.reader.state(), "skipped": self.skipped,
               "late": self.f.extra.get("late", 0) + late}
        return out if training is None else {**out, "training": training}

    def poll(self) -> bool:
        """Read the rollouts whose lines completed; True when there were any."""
        new = self.reader.poll()
        for item in new:
            v = item["record"]["policy_version"]
            if self.done is not None and v <= self.done:
                self.late.append(item)
            else:
                self.pending.setdefault(v, []).append(item)
        return bool(new)

    def due(self, policies: list) -> Optional[tuple]:
        """(version, folder) to train now: the oldest complete version after the last one trained that has
        ``follow.min_rollouts`` rollouts, or any once a newer version is complete; a version with none when a newer
        one is complete is skipped (noted)."""
        todo = [(v, p) for v, p in policies if (self.done is None or v > self.done) and v not in self.skipped]
        for i, (v, p) in enumerate(todo):
            n, newer = len(self.pending.get(v, [])), i + 1 < len(todo)
            if n >= self.cfg.min_rollouts or (newer and n > 0):
                return v, p
            if newer and n == 0:
                print(f"[follow] policy version {v}: no rollouts before version {todo[i + 1][0]} was complete; skipped",
                      flush=True)
                self.skipped.append(v)
                continue
            return None
        return None

    def run_version(self, v: int, path: str) -> str:
        """Swap policy ``v`` in, train on its rollouts, publish; the checkpoint records the rollouts consumed. The
        checkpoints written while it trains (``trainer.save_every``) record them as read and not consumed, and
        which they are (``resume_version`` finishes the version from one)."""
        items = self.pending.pop(v)
        for old in [k for k in self.pending if k < v]:  # versions skipped over: their rollouts are late now
            self.late += self.pending.pop(old)
        print(f"[follow] policy version {v} ({path}): {len(items)} rollouts", flush=True)
        self.f.update_policy(path, v)
        self.f.add_rollouts([{**i["record"], "where": i["where"]} for i in items], v)
        return self.finish(v, path, items)

    def resume_version(self) -> str:
        """The version the last checkpoint was training (its policy and rollouts already in the follower): its
        rollouts taken out of those read again, the rest of its budget trained, then published. Rollouts of it
        read after that checkpoint are late, as they are for a run that was not killed."""
        v, path = self.f.current["version"], self.f.policy["path"]
        if "training" not in self.f.extra:
            raise RecipeError(f"{self.f.out}: its last checkpoint was saved mid-version by a DrafterFollower used from "
                              f"Python, which records no rollout positions for `specopd follow` to resume from; "
                              f"resume it with DrafterFollower, or give `specopd follow` a new trainer.output_dir")
        mine = {tuple(p) for p in self.f.extra["training"]}
        got = self.pending.pop(v, [])
        items = [i for i in got if tuple(i["pos"]) in mine]
        if len(items) != len(mine):  # internal: the reader's state lists every rollout of the version as read
            raise RuntimeError(f"policy version {v}: {len(mine)} rollouts in training, {len(items)} read again")
        self.late += [i for i in got if tuple(i["pos"]) not in mine]
        for old in [k for k in self.pending if k < v]:
            self.late += self.pending.pop(old)
        print(f"[follow] policy version {v} ({path}): {len(items)} rollouts, resumed mid-version", flush=True)
        return self.finish(v, path, items)

    def finish(self, v: int, path: str, items: list) -> str:
        """Train version ``v`` (its rollouts ``items`` in the follower) and publish it."""
        self.f.extra = self.extra(training=[list(i["pos"]) for i in items])
        self.f.train()
        self.reader.consumed(items + self.late)
        late, self.late = len(self.late), []
        self.done = v
        export = self.f.export(v, extra=self.extra(late=late))
        print(f"[follow] published policy version {v}'s drafter: {export} (exports/latest -> v{v})"
              + (f"; {late} late rollouts of versions already trained were not trained on" if late else ""),
              flush=True)
        if self.cfg.vllm_server:
            print(pickup_note(export, self.cfg.vllm_server, path), flush=True)
        return export


def follow(recipe: Optional[str], overrides=(), progress: bool = True) -> dict:
    """Run ``specopd follow`` until ``follow.stop_at_version`` is published, ``follow.idle_exit_s`` pass with
    nothing new, or it is stopped (Ctrl-C, SIGTERM). The resume point is the newest checkpoint: the last published
    version's, or one written every ``trainer.save_every`` steps while a version trains; from one of those the
    version finishes first (its policy and exactly its rollouts, the rest of its steps / seconds budget, the batch
    order continued), then it is published. ``exports/latest`` only ever names published versions. Returns the
    follower's metrics."""
    with DrafterFollower(recipe, overrides, progress=progress) as f:
        w = Watcher(f)
        c = w.cfg
        last_new = time.monotonic()
        if w.done is not None:
            print(f"[follow] continuing after policy version {w.done}", flush=True)
            root = os.path.join(f.out, "exports")
            if latest_export(root) != os.path.join(root, f"v{w.done}"):  # killed between checkpoint and publication
                publish(ck.find_latest(f.out), root, w.done, f.policy["path"])
        while True:
            got = w.poll()
            if f.current is not None:  # killed while a version trained: it finishes first
                job = (f.current["version"], f.policy["path"])
                w.resume_version()
            else:
                job = w.due(complete_policies(c.policies, c.complete_marker))
                if job is not None:
                    w.run_version(*job)
            if job is not None:
                last_new = time.monotonic()
                if 0 <= c.stop_at_version <= job[0]:
                    break
                continue
            if got:
                last_new = time.monotonic()
            if c.idle_exit_s and time.monotonic() - last_new > c.idle_exit_s:
                print(f"[follow] nothing new for {c.idle_exit_s:g} s (follow.idle_exit_s): stopping", flush=True)
                break
            time.sleep(c.poll_s)
        out = f.metrics()
    print(json.dumps({"policy_version": out["policy_version"], "steps": out["steps"],
                      "exports": os.path.join(f.out, "exports")}))
    return out
