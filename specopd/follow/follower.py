"""``DrafterFollower``: keeps a drafter next to a moving policy. The RL loop hands it each new policy version
(``update_policy``: the target's weights swapped in place in every worker) and the rollouts that version sampled
(``add_rollouts``); ``train`` runs SpecOPD on the newest rollouts against the policy that wrote them, ``export``
publishes the drafter of a version atomically, ``metrics`` says how stale each version found the drafter.
Usable as it is and as a Ray actor. Design: specopd/follow/DESIGN.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

from tqdm import tqdm

from specopd.config import RecipeConfig, load_recipe, to_dict
from specopd.data.formats import encode_chat, normalise
from specopd.data.prepare import load_tokenizer
from specopd.data.references import token_ids_problem
from specopd.drafters.layout import export_folder
from specopd.drafters.mtp import export_mtp_folder, is_mtp_folder
from specopd.errors import BadInputError, UserError, own_dir, replacing, write_replace
from specopd.models.loading import read_config
from specopd.models.tiny import resolve_target_path
from specopd.runs import checkpoint as ck
from specopd.runs.lock import acquire, release
from specopd.train.checkpointer import (RecipeChangeError, drafter_as_loaded, move_run_aside, recipe_changes,
                                        trim_metrics, write_recipe)
from specopd.train.data import BatchOrder
from specopd.train.group import data_info, load_worker_state, worker_state
from specopd.train.loop import make_group
from specopd.train.metrics import make_logger
from specopd.train.step import train_step
from specopd.train.validator import evaluate_heldout
from specopd.train.worker import Worker
from specopd.follow.sources import policy_problem

FIGURE = "follow_staleness.png"


class FollowError(UserError, ValueError):
    """A call out of order or with arguments that do not fit (a version going back, rollouts of a version whose
    policy is not loaded); the message says what to call."""


def prepared_record(rec: dict, where: str, vocab_size: int, tokenizer=None) -> dict:
    """A rollout (prepared-data format, or a conversation) -> the prepared record the workers read
    (``id``, ``input_ids``, ``prompt_len``, and ``loss_mask`` / ``split`` when given).

    Args:
        rec: the rollout.
        where: where it came from (file:line, or the call), named in errors.
        vocab_size: the target's; token ids must lie below it.
        tokenizer: the policy's, for conversations (None: a conversation is an error).

    Returns:
        the record; a bad one is a BadInputError naming ``where``."""
    if "input_ids" in rec:
        pl = rec.get("response_start", rec.get("prompt_len"))
        bad = token_ids_problem(rec["input_ids"], vocab_size)
        if bad is None and type(pl) is not int:  # noqa: E721
            bad = "response_start (or prompt_len) is missing or not an integer"
        if bad is not None:
            raise BadInputError(f"{where}: {bad}; a rollout is {{\"id\", \"input_ids\", \"response_start\", "
                                f"\"policy_version\"}} or a conversation with a policy_version")
        out = {"id": str(rec.get("id", where)), "input_ids": rec["input_ids"], "prompt_len": pl}
        for k in ("loss_mask", "split"):
            if rec.get(k) is not None:
                out[k] = rec[k]
        return out
    if tokenizer is None:
        raise BadInputError(f"{where}: a conversation needs the policy's tokenizer (its chat template), and "
                            f"model.target has none: give rollouts as token ids (input_ids, response_start)")
    try:
        rid, msgs, split = normalise(rec)
    except Exception as e:  # noqa: BLE001  (formats' own record error: its message names the problem)
        raise BadInputError(f"{where}: {e}") from None
    ids, mask = encode_chat(tokenizer, msgs)
    ids, mask = [int(x) for x in ids], [int(x) for x in mask]
    if 1 not in mask:
        raise BadInputError(f"{where}: no assistant token after the chat template (nothing to train on)")
    out = {"id": rid or where, "input_ids": ids, "prompt_len": mask.index(1), "loss_mask": mask}
    if split:
        out["split"] = split
    return out


def plot_staleness(out_dir: str, versions: dict) -> str:
    """``<out_dir>/follow_staleness.png``: per policy version, the drafter's held-out expected AL on that version's
    rollouts before and after its update, and the share of wall time the follower spent on it. Written tmp +
    rename; returns the path."""
    import matplotlib  # matplotlib: slow to import, only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: slow to import, only when drawing

    vs = sorted(versions, key=int)
    x = [int(v) for v in vs]
    get = lambda k: [versions[v].get(k) if versions[v].get(k) is not None else float("nan") for v in vs]  # noqa: E731
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    a.plot(x, get("before"), marker="o", label="before its update (the drafter of the versions before)")
    a.plot(x, get("after"), marker="o", label="after its update")
    a.set_ylabel("held-out expected AL (incl. bonus)")
    a.set_title("Drafter staleness per policy version", fontsize=10)
    a.grid(alpha=0.3)
    a.legend(fontsize=8, frameon=False)
    b.bar(x, [100 * s for s in get("time_share")], color="#888888")
    b.set_ylabel("% of wall time following")
    b.set_xlabel("policy version")
    b.set_xticks(x)
    b.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, FIGURE)
    try:
        with replacing(path, "wb", tmp=os.path.join(out_dir, f".{FIGURE}.tmp-{os.getpid()}")) as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


class DrafterFollower:
    """A drafter that follows a policy; see the module docstring. ``recipe_path`` / ``overrides``: as ``specopd
    train`` reads them (the ``follow:`` section sets the budget per version). Holds ``trainer.output_dir``'s lock
    until ``close``; a folder with checkpoints resumes (``trainer.resume``). The workers start at the first
    ``train`` (they read that version's rollouts)."""

    def __init__(self, recipe_path: Optional[str], overrides=(), progress: bool = True):
        cfg = load_recipe(recipe_path, list(overrides))
        self.cfg: RecipeConfig = drafter_as_loaded(cfg)
        self.out = self.cfg.trainer.output_dir
        self.progress = progress
        self.group = None
        self.info: dict = {}
        self.policy: dict = {"version": None, "path": None}  # the policy the workers run (or will, once started)
        self.pending_policy = None  # (source, version) to swap in once the workers start
        self.versions: dict = {}  # str(version) -> its metrics (``metrics``)
        self.rollouts: dict = {}  # version -> prepared records not yet given to the workers (the newest version's)
        self.steps = 0  # optimizer steps over all versions
        self.data_version = None  # the version whose rollouts the workers hold
        self.order: Optional[BatchOrder] = None
        self.extra: dict = {}  # the caller's state saved with each checkpoint (``save(extra=...)``): the CLI's reader
        self.current = None  # the version training now (its budget and progress), saved every trainer.save_every
        self.mark = time.time()  # wall clock at the last export (the time share's denominator starts here)
        self.resume_state = None
        acquire(self.out, "trainer.output_dir")
        try:
            self.target_dir = resolve_target_path(self.cfg.model, self.out)
            self.vocab_size = int(read_config(self.target_dir)["vocab_size"])
            self.tokenizer = None
            self.sinks = None
            self._resume()
            write_recipe(self.out, self.cfg)
            self.sinks = make_logger(self.cfg, resume_step=self.steps if self.resume_state else None)
        except BaseException:
            release(self.out)
            raise

    # -- resume
    def _resume(self) -> None:
        """The newest checkpoint that verifies (``trainer.resume``: auto | none | a folder), checked against this
        recipe; its follower state is restored and its worker state loaded when the workers start."""
        r = self.cfg.trainer.resume
        c = None
        if r != "none":
            for note in ck.recover(self.out):
                print(f"[checkpoint] {note}")
            found = [d for _, d in ck.complete_checkpoints(self.out)] if r == "auto" else [r]
            c = ck.load_checkpoint(found[-1]) if found else None
        if c is None or "follow" not in c["state"]:
            if c is not None:
                raise RecipeChangeError(f"{c['path']} is a checkpoint of `specopd train`, not of a follow run: give "
                                        f"it as drafter.init_from and another trainer.output_dir")
            move_follow_aside(self.out)
            ck.seed_controller_rng(self.cfg.seed)
            return
        refused, _, _ = recipe_changes(c["state"].get("recipe"), to_dict(self.cfg))
        if refused:
            raise RecipeChangeError(f"cannot resume the follow run in {self.out} from {c['path']}: "
                                    f"{'; '.join(refused)}; undo the change or use another trainer.output_dir")
        st = c["state"]["follow"]
        self.versions, self.steps, self.extra = st["versions"], int(c["state"]["step"]), st.get("extra", {})
        self.current = st.get("current")
        if self.current is not None:  # killed mid-version: its workers read its rollouts file as it was then
            self.data_version = int(self.current["version"])
            keep_lines(self._rollout_file(self.data_version), int(self.current["rollouts"]))
        if st["policy"]["version"] is not None:
            self.policy = dict(st["policy"])
            if st["policy"]["path"] is not None:
                self.pending_policy = (st["policy"]["path"], st["policy"]["version"])
        if c.get("controller_rng"):
            ck.set_controller_rng(c["controller_rng"])
        trim_metrics(os.path.join(self.out, "metrics.jsonl"), self.steps)
        self.resume_state = c
        cur = self.current
        print(f"[follow] resumed from {c['path']} (policy version {self.policy['version']}, {self.steps} steps"
              + (f"; version {cur['version']} in progress: {cur['steps']} steps, {cur['seconds']:.1f} s of its budget "
                 f"done, the next train() does the rest" if cur else "") + ")")

    # -- the API
    def update_policy(self, path_or_state_dict, version: int) -> None:
        """The policy is now ``version``: its weights (a complete Hugging Face folder, or a state dict with
        Hugging Face names) replace the target's in place in every worker (no restart, the drafter kept)."""
        version = self._check_version(version)
        cur = self.policy["version"]
        if cur is not None and version < cur:
            raise FollowError(f"update_policy(version={version}): the policy is at version {cur} already; versions "
                              f"only go forward")
        if not isinstance(path_or_state_dict, dict):
            path_or_state_dict = os.fspath(path_or_state_dict)
            why = policy_problem(path_or_state_dict)
            if why is not None:
                raise BadInputError(f"policy version {version}: {path_or_state_dict} is not a complete Hugging Face "
                                    f"folder ({why})")
        t0 = time.perf_counter()
        if self.group is not None:
            self._run(Worker.swap_policy, (path_or_state_dict, version), both=True)
        else:
            self.pending_policy = (path_or_state_dict, version)
        self.policy = {"version": version,
                       "path": None if isinstance(path_or_state_dict, dict) else path_or_state_dict}
        self._version(version)["swap_s"] = time.perf_counter() - t0

    def add_rollouts(self, records, version: int) -> int:
        """Rollouts sampled by policy ``version``: records in the prepared-data format (``id``, ``input_ids``,
        ``response_start``) or conversations (``messages`` / ``conversations``), each with this
        ``policy_version`` (or none). Returns how many were taken: rollouts of a version older than the policy
        loaded are late (counted in ``metrics``, not trained on)."""
        version = self._check_version(version)
        cur = self.policy["version"]
        if cur is not None and version < cur:  # the target no longer runs that policy: counted, not trained on
            n = len(list(records))
            self._version(version)["late"] = self._version(version).get("late", 0) + n
            print(f"[follow] {n} rollouts of policy version {version} came after version {cur} was loaded: counted "
                  f"as late, not trained on", flush=True)
            return 0
        got = []
        for i, rec in enumerate(records):
            where = (rec.get("where") if isinstance(rec, dict) else None) or f"add_rollouts(version={version}) record {i}"
            if not isinstance(rec, dict):
                raise BadInputError(f"{where}: a rollout is a JSON object, got {type(rec).__name__}")
            pv = rec.get("policy_version", version)
            if pv != version:
                raise BadInputError(f"{where}: policy_version {pv!r} in a batch given as version {version}")
            if "input_ids" not in rec and self.tokenizer is None and not self.cfg.model.is_tiny:
                self.tokenizer = load_tokenizer(self.target_dir, self.vocab_size)
            got.append(prepared_record(rec, where, self.vocab_size, self.tokenizer))
        self.rollouts.setdefault(version, []).extend(got)
        v = self._version(version)
        v["rollouts"] = v.get("rollouts", 0) + len(got)
        return len(got)

    def train(self, steps: Optional[int] = None, seconds: Optional[float] = None) -> dict:
        """SpecOPD on the newest version's rollouts against that policy: ``steps`` steps and / or ``seconds``
        (defaults: ``follow.steps_per_version`` / ``follow.seconds_per_version``; whichever ends first). The
        held-out expected AL of that version is measured before its first update and after this call. Every
        ``trainer.save_every`` steps a checkpoint records the call's progress; after a resume from one, the call for
        that version trains only the rest of the budget it had (the arguments are ignored then), on the same
        rollouts in the same batch order. Returns the version's metrics."""
        if not self.rollouts and self.data_version is None:
            raise FollowError("train(): no rollouts yet; call add_rollouts(records, version) first")
        v = max(self.rollouts) if self.rollouts else self.data_version
        if v != self.policy["version"]:
            raise FollowError(f"train(): the newest rollouts are of policy version {v}, but the policy loaded is "
                              f"version {self.policy['version']}: call update_policy(weights, {v}) first")
        f, cur = self.cfg.follow, self.current
        if cur is not None and cur["version"] != v:  # the caller moved on from the version in progress
            cur = None
        if cur is None:
            steps = f.steps_per_version if steps is None else int(steps)
            seconds = f.seconds_per_version if seconds is None else float(seconds)
        else:
            steps, seconds = int(cur["budget_steps"]), float(cur["budget_seconds"])
        if steps <= 0 and seconds <= 0:
            raise FollowError(f"train(steps={steps}, seconds={seconds}): give a budget > 0")
        rec = self._version(v)
        t0 = time.perf_counter()
        self._feed(v)
        t1 = time.perf_counter()
        if "before" not in rec:
            rec["before"] = self._heldout()
        t_eval = time.perf_counter() - t1
        done, spent = (0, 0.0) if cur is None else (int(cur["steps"]), float(cur["seconds"]))
        if cur is not None:
            self.order.set_position(cur["position"])
        with open(self._rollout_file(v)) as fh:
            lines = sum(1 for _ in fh)
        self.current = {"version": v, "budget_steps": steps, "budget_seconds": seconds, "steps": done,
                        "seconds": spent, "position": self.order.position, "rollouts": lines}
        save_every = self.cfg.trainer.save_every
        bar = tqdm(total=steps if steps > 0 else None, initial=done, desc=f"follow v{v}", unit="step",
                   disable=not self.progress)
        start = time.perf_counter() - spent  # a resumed call counts the seconds spent before the kill
        while (steps <= 0 or done < steps) and (seconds <= 0 or time.perf_counter() - start < seconds):
            m = train_step(self.group, self.info, self.cfg, self.order.next(), self.steps)
            self.steps, done = self.steps + 1, done + 1
            m.update(step=self.steps, time=time.time(), **{"follow/version": v})
            if self.steps % self.cfg.trainer.log_every == 0:
                self.sinks.log(m)
            bar.set_postfix(loss=f"{m['loss']:.4f}", AL=f"{m['expected_al']:.3f}")
            bar.update(1)
            if save_every and self.steps % save_every == 0 and (steps <= 0 or done < steps):
                self.current.update(steps=done, seconds=time.perf_counter() - start, position=self.order.position)
                self.save()
        bar.close()
        self.current = None
        train_s = time.perf_counter() - start
        t2 = time.perf_counter()
        rec["after"] = self._heldout()
        t_eval += time.perf_counter() - t2
        rec.update(steps=rec.get("steps", 0) + done, train_s=rec.get("train_s", 0.0) + train_s,
                   eval_s=rec.get("eval_s", 0.0) + t_eval, busy_s=rec.get("busy_s", 0.0) + time.perf_counter() - t0
                   + spent + rec.pop("swap_s", 0.0))
        self.sinks.log({"step": self.steps, "time": time.time(), "follow/version": v,
                        "follow/staleness": {"before": rec["before"], "after": rec["after"]},
                        "follow/steps": rec["steps"], "follow/train_s": rec["train_s"]})
        print(f"[follow] policy version {v}: {rec['rollouts']} rollouts, {done} steps in {train_s:.1f} s; held-out "
              f"expected AL (incl. bonus) {_al(rec['before'])} before -> {_al(rec['after'])} after", flush=True)
        return dict(rec)

    def save(self, extra: Optional[dict] = None) -> str:
        """A checkpoint of the drafter, its optimizer and the follower's state (``extra``: the caller's, JSON, given
        back as ``self.extra`` on resume); returns its folder."""
        self._start()
        if extra is not None:
            self.extra = extra
        ws = worker_state(self.group)
        st = {"follow": {"versions": self.versions, "policy": self.policy, "extra": self.extra,
                         "current": self.current},
              "method": self.cfg.trainer.method, "recipe": to_dict(self.cfg)}
        return ck.save_checkpoint(self.out, self.steps, ws, st, self.cfg.trainer.keep_last)

    def export(self, version: int, extra: Optional[dict] = None) -> str:
        """Publish the drafter as trained through policy ``version``: a checkpoint (``save``), then
        ``<output_dir>/exports/v<version>/`` in the released layout, renamed into place whole, then
        ``exports/latest`` (one line: ``v<version>``) replaced; returns the folder. The version's time share is its
        busy seconds (swap, training, evaluation) over the wall time since the previous export."""
        version = self._check_version(version)
        rec, now = self._version(version), time.time()
        rec.update(export=os.path.join(self.out, "exports", f"v{version}"), wall_s=now - self.mark)
        rec["time_share"] = rec.get("busy_s", 0.0) / rec["wall_s"] if rec["wall_s"] > 0 else None
        self.mark = now
        path = publish(self.save(extra), os.path.join(self.out, "exports"), version, self.policy["path"])
        try:
            plot_staleness(self.out, self.versions)
        except Exception as e:  # noqa: BLE001  (a figure is a convenience; the numbers are in metrics.jsonl)
            print(f"warning: could not draw {os.path.join(self.out, FIGURE)} ({e})")
        write_replace(os.path.join(self.out, "follow_summary.json"), json.dumps(self.metrics(), indent=1))
        return path

    def metrics(self) -> dict:
        """{"policy_version", "steps", "versions": {version: {"rollouts", "before", "after" (held-out expected AL,
        incl. bonus, on that version's rollouts, before and after its update: the staleness), "steps", "train_s",
        "eval_s", "busy_s", "wall_s", "time_share", "export"}}}."""
        return {"policy_version": self.policy["version"], "steps": self.steps,
                "versions": json.loads(json.dumps(self.versions))}

    def close(self) -> None:
        """Stop the workers and give the output folder's lock back."""
        try:
            if self.group is not None:
                self.group.shutdown()
                self.group = None
            if self.sinks is not None:
                self.sinks.close()
                self.sinks = None
        finally:
            release(self.out)

    def __enter__(self) -> "DrafterFollower":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside
    def _check_version(self, version) -> int:
        if type(version) is not int or version < 0:  # noqa: E721
            raise FollowError(f"version={version!r}: a policy version is an integer >= 0")
        return version

    def _version(self, version: int) -> dict:
        return self.versions.setdefault(str(version), {"rollouts": 0})

    def _run(self, fn, args: tuple, both: bool = False) -> list:
        """``fn(worker, *args)`` on every worker (``both``: split roles' target workers too)."""
        g = self.group
        res = g.run(fn, [args] * g.num_workers)
        if both and g.split:
            g.run(fn, [args] * g.num_workers, role="target")
        return res

    def _rollout_file(self, version: int) -> str:
        return os.path.join(own_dir(os.path.join(self.out, "follow", "rollouts")), f"v{version}.jsonl")

    def _feed(self, version: int) -> None:
        """Give the workers version ``version``'s rollouts (all of them so far: appended to its file), starting the
        workers on them if they are not running yet."""
        new = self.rollouts.pop(version, [])
        for old in [k for k in self.rollouts if k < version]:  # older versions' rollouts no one trained on
            self._version(old)["late"] = self._version(old).get("late", 0) + len(self.rollouts.pop(old))
        if not new and self.data_version == version and self.group is not None:
            return
        path = self._rollout_file(version)
        have = open(path).read() if self.data_version == version and os.path.isfile(path) else ""
        with replacing(path) as f:
            f.write(have + "".join(json.dumps(r) + "\n" for r in new))
        if self.group is None:
            self._start(path)
        else:
            self._run(Worker.set_data, (path,), both=True)
        self.data_version = version
        self.info = data_info(self.group)
        self.order = BatchOrder(self.info["train_ids"], self.cfg.data.batch_size, self.cfg.data.seed + version)

    def _start(self, data_path: Optional[str] = None) -> None:
        """Start the workers (on ``data_path``, else the newest rollouts on disk), load the resumed state and swap
        in the policy named before they ran."""
        if self.group is not None:
            return
        if data_path is None:
            v = self.data_version if self.data_version is not None else self.policy["version"]
            data_path = self._rollout_file(v) if v is not None else None
            if data_path is None or not os.path.isfile(data_path):
                raise FollowError("no rollouts yet: call add_rollouts(records, version) and train() first")
        c = dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, source="prepared", path=data_path))
        print(placement(c), flush=True)
        self.group = make_group(c)
        if self.resume_state is not None:
            load_worker_state(self.group, self.resume_state["worker_state"])
            self.resume_state = None
        if self.pending_policy is not None:
            self._run(Worker.swap_policy, self.pending_policy, both=True)
            self.pending_policy = None

    def _heldout(self) -> Optional[float]:
        ids = self.info.get("heldout_ids") or []
        if not ids:
            return None
        return float(evaluate_heldout(self.group, ids, self.cfg.data.batch_size)["expected_al"])


def move_follow_aside(out: str) -> None:
    """A fresh follow run in a used folder: what ``move_run_aside`` moves for a training run, and the exports, the
    rollouts given to the workers and the summary, moved to ``*.before-<time>``."""
    move_run_aside(out)
    stamp = int(time.time())
    for name in ("exports", "follow", "follow_summary.json", FIGURE):
        p = os.path.join(out, name)
        if os.path.lexists(p):
            root, ext = os.path.splitext(name)
            os.replace(p, os.path.join(out, f"{root}.before-{stamp}{ext}"))


def keep_lines(path: str, n: int) -> None:
    """``path`` cut to its first ``n`` lines (tmp + rename): the rollouts a version in progress trained on, without
    those added after its checkpoint."""
    with open(path) as f:
        lines = f.readlines()
    if len(lines) > n:
        write_replace(path, "".join(lines[:n]))


def placement(cfg) -> str:
    """Where the follower's target copy runs, in one line (the plan an RL team reads before attaching it)."""
    r, dev = cfg.runtime, cfg.model.device
    tp = int(r.tensor_parallel)
    if r.backend == "ray":
        where = (f"{r.num_workers * tp} Ray actor(s) of {r.cpus_per_worker:g} CPU / {r.gpus_per_worker:g} GPU each"
                 + (f" ({r.num_workers} worker(s), each target sharded over {tp} of them)" if tp > 1 else "")
                 + ", placed by Ray in the cluster it shares with the RL framework's actors")
    else:
        where = f"{r.num_workers} worker(s) in this process"
    return (f"[follow] the target copy (and the drafter) run in {where}, on model.device={dev}; on GPUs the rollout "
            f"engine also uses, they are time-sliced with it")


def _al(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def publish(src: str, root: str, version: int, policy_dir: Optional[str] = None) -> str:
    """Export the drafter folder ``src`` to ``<root>/v<version>/`` and point ``<root>/latest`` at it, each step whole
    (``specopd.runs.checkpoint.publish_folder``; an earlier export of that version is replaced).

    Args:
        src: the drafter folder (a checkpoint).
        root: the exports folder.
        version: the policy version the drafter was trained through.
        policy_dir: that policy's folder. An MTP head's export carries the policy's own embedding and lm_head (what
            vLLM's method mtp loads beside the head), read from there; None for a policy given as a state dict.

    Returns:
        the export folder.
    """
    if not is_mtp_folder(src):
        return ck.publish_folder(root, f"v{version}", lambda tmp: export_folder(src, tmp))
    if policy_dir is None:
        raise FollowError(f"policy version {version}: an MTP head's export carries the policy's embedding and lm_head, "
                          f"read from the policy's folder, and this version was given as a state dict; save the "
                          f"policy as a Hugging Face folder and pass its path to update_policy")
    return ck.publish_folder(root, f"v{version}", lambda tmp: export_mtp_folder(src, policy_dir, tmp))


def latest_export(root: str) -> Optional[str]:
    """The folder ``<root>/latest`` names (None when there is none yet)."""
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except OSError:
        return None
    return os.path.join(root, name) if name else None
