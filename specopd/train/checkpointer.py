"""The run's checkpoints: where a run starts (fresh, or resumed from a checkpoint) and every checkpoint it writes;
nothing is lost, nothing is overwritten. The resume policy: specopd/train/DESIGN.md ("Resume").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Optional

from specopd.config import (FROM_HERE, REFUSE, SAME_RUN, RecipeConfig, RecipeError, recipe_record, recorded_recipe,
                            resume_policies, to_dict, to_yaml)
from specopd.drafters.layout import check_drafter, read_config, read_drafter
from specopd.drafters.mtp import is_mtp_folder
from specopd.errors import BadInputError, open_write, own_dir, refuse_link, write_replace
from specopd.profiling import Profiler
from specopd.runs import checkpoint as ck
from specopd.signals import stopped_by
from specopd.train.data import BatchOrder
from specopd.train.group import load_worker_state, worker_state
from specopd.train.inputs import input_changes, input_fingerprints
from specopd.train.step import NonFiniteError

SECTIONS = ("model", "drafter", "data", "trainer", "runtime", "eval", "profile", "pipeline", "kernels", "follow")


class RecipeChangeError(RecipeError):
    """A resume whose recipe differs from the checkpoint's in a way that makes it another run."""


# ---------------------------------------------------------------------------------------------- recipe changes
def flat_recipe(d: dict) -> dict:
    """section.key -> value (one level: a dict-valued key such as model.tiny compares as a whole)."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and k in SECTIONS:
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def target_fingerprint(model_cfg) -> Optional[str]:
    """sha256 of a target folder's config.json and its weight files' names and sizes (None for tiny
    targets, whose identity is their recipe keys, and for folders that cannot be read)."""
    if model_cfg.is_tiny or not os.path.isdir(model_cfg.target):
        return None
    try:
        h = hashlib.sha256(open(os.path.join(model_cfg.target, "config.json"), "rb").read())
        for n in sorted(os.listdir(model_cfg.target)):
            if n.endswith((".safetensors", ".bin")):
                h.update(f"{n}:{os.path.getsize(os.path.join(model_cfg.target, n))}".encode())
        return h.hexdigest()
    except OSError:
        return None


def _note(k: str, new: dict) -> str:
    """What a same-run change means, for the keys that need a word."""
    if k == "trainer.max_steps":
        return " (the cosine LR schedule now ends there)"
    if k == "runtime.num_workers":
        return (" (same global batches; bitwise the same numbers with trainer.batch_invariant=true"
                if new.get("trainer.batch_invariant") else
                " (same global batches; the loss matches to fp32 rounding, bitwise only with "
                "trainer.batch_invariant=true") + ")"
    if k == "drafter.init_from":
        return " (ignored on resume: the checkpoint's weights are loaded)"
    return ""


def recipe_changes(old: dict, new: dict, old_fp: Optional[str] = None, new_fp: Optional[str] = None) -> tuple:
    """"key a -> b" strings for keys that differ between a checkpoint's recipe and this one, by each key's declared
    resume policy (``specopd.config.resume_policies``). Keys unknown to the old recipe are skipped.

    Args:
        old: the checkpoint's recipe (a dict).
        new: this run's recipe (a dict).
        old_fp, new_fp: the target's fingerprints: a moved target folder with the same config.json and weight sizes
            is not a change of target.

    Returns:
        (refused, same_run, from_here). refused: another experiment (the resume is refused); same_run: bookkeeping
        that does not change the numbers; from_here: take effect from the resumed step on (also keys no field
        declares).
    """
    a, b = flat_recipe(old), flat_recipe(new)
    policies = resume_policies()
    refused, same, here = [], [], []
    for k in sorted(set(a) & set(b)):
        if a[k] == b[k]:
            continue
        line = f"{k} {a[k]!r} -> {b[k]!r}"
        policy = policies.get(k, FROM_HERE)
        if k == "model.target" and old_fp is not None and old_fp == new_fp:
            same.append(line + " (the same model: config.json and weight sizes match)")
        elif policy == REFUSE:
            refused.append(line)
        elif policy == SAME_RUN:
            same.append(line + _note(k, b))
        else:
            here.append(line)
    return refused, same, here


# ---------------------------------------------------------------------------------------------- drafter.init_from
INIT_FROM_KEYS = ("kind", "block_size", "num_layers")  # drafter.* keys a drafter.init_from folder decides


def drafter_as_loaded(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe of what trains: with drafter.init_from, the folder's drafter kind, block_size and num_layers
    replace the recipe's (a warning names each), so recipe.yaml, every checkpoint's recipe and a resume's
    comparison record the drafter that trains. The folder is verified and checked first, as ``specopd export``
    checks it (``check_drafter``), before anything is written."""
    d = cfg.drafter
    if not d.init_from:
        return cfg
    if is_mtp_folder(d.init_from):  # an MTP head (a target folder, ours, an export): the recipe's block_size drafts
        if d.kind == "mtp":
            return cfg
        print(f"warning: drafter.init_from={d.init_from} holds an MTP head; the run trains it (drafter.kind=mtp, the "
              f"recipe said {d.kind})")
        return dataclasses.replace(cfg, drafter=dataclasses.replace(d, kind="mtp", num_layers=1))
    f = read_drafter(d.init_from, what="drafter.init_from")
    check_drafter(f)
    changed = {k: getattr(f.cfg, k) for k in INIT_FROM_KEYS if getattr(f.cfg, k) != getattr(d, k)}
    if not changed:
        return cfg
    print(f"warning: drafter.init_from={d.init_from} is a {f.cfg.kind} drafter with block_size={f.cfg.block_size}, "
          f"num_layers={f.cfg.num_layers}; the run trains it as it is, and recipe.yaml and the checkpoints record "
          f"it: " + ", ".join(f"drafter.{k}={v} (the recipe said {getattr(d, k)})" for k, v in changed.items()))
    return dataclasses.replace(cfg, drafter=dataclasses.replace(d, **changed))


def recorded_drafter(old: Optional[dict], path: str) -> Optional[dict]:
    """A checkpoint's recorded recipe with its drafter.init_from keys as the checkpoint's drafter has them: a run
    recorded before ``drafter_as_loaded`` kept the recipe's values although the folder's drafter trained."""
    d = (old or {}).get("drafter") or {}
    if not d.get("init_from") or is_mtp_folder(path):  # an MTP run records what trains (drafter_as_loaded)
        return old
    trained, _ = read_config(path)
    return {**old, "drafter": {**d, **{k: getattr(trained, k) for k in INIT_FROM_KEYS}}}


# ---------------------------------------------------------------------------------------------- files
def write_recipe(out: str, cfg: RecipeConfig) -> Optional[str]:
    """``<out>/recipe.yaml`` = this run's recipe (tmp + rename). A different recipe already there is kept as
    ``<out>/recipe.history/recipe-<its time>.yaml``; returns that path (None if nothing was kept)."""
    text = to_yaml(cfg)
    path = refuse_link(os.path.join(out, "recipe.yaml"))  # its text would be copied into recipe.history
    kept = None
    if os.path.isfile(path):
        with open(path) as f:
            old = f.read()
        if old == text:
            return None
        hist = own_dir(os.path.join(out, "recipe.history"))
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
        kept = os.path.join(hist, f"recipe-{stamp}.yaml")
        k = 1
        while os.path.exists(kept):
            k += 1
            kept = os.path.join(hist, f"recipe-{stamp}-{k}.yaml")
        write_replace(kept, old)
    write_replace(path, text)
    return kept


def trim_metrics(path: str, step: int) -> None:
    """On resume: keep metric lines of steps <= step; move later ones (from the interrupted run) aside. A
    line cut short by a kill is dropped (its step is recomputed)."""
    if not os.path.isfile(refuse_link(path)):  # its lines would be copied into the run folder
        return
    keep, later = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # half-written by a killed run
            if not line.endswith("\n"):
                line += "\n"
            (keep if rec.get("step", 0) <= step else later).append(line)
    if later:
        with open_write(path + ".orphaned", "a") as f:
            f.writelines(later)
    write_replace(path, "".join(keep))


def move_run_aside(out: str) -> None:
    """A fresh run in a used folder: the old metrics, profile, checkpoints and summary are moved aside (and the
    old TensorBoard events, wandb runs and mlflow run id, so the sinks start a new run too)."""
    stamp = int(time.time())
    moved = []
    for name in ("metrics.jsonl", "profile", "train_summary.json", "tensorboard", "wandb", "mlflow_run_id"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            root, ext = os.path.splitext(name)
            os.replace(p, os.path.join(out, f"{root}.before-{stamp}{ext}"))
            moved.append(name)
    if ck.move_aside(out, stamp):
        moved.append("checkpoints")
    if moved:
        print(f"fresh run in a used folder: the previous {', '.join(moved)} moved aside to *.before-{stamp}")


def read_summary(out: str) -> Optional[dict]:
    """``<out>/train_summary.json`` (None when missing or unreadable)."""
    try:
        with open(os.path.join(out, "train_summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- Checkpointer
class Checkpointer:
    """Finds, checks and loads the checkpoint a run resumes from (or starts it fresh), and saves its checkpoints
    (``save``; ``save_on_interrupt`` keeps the completed steps of an interrupted run).

    A checkpoint ``c`` is ``specopd.runs.checkpoint.load_checkpoint``'s dict (worker_state, state, path)."""

    def __init__(self, cfg: RecipeConfig, prof: Profiler):
        self.cfg, self.t, self.out = cfg, cfg.trainer, cfg.trainer.output_dir
        self.prof = prof  # the controller's spans: "checkpoint" around each save
        self.state: dict = {}  # carried into every state.json: eval_before, resumed_from, target / input fingerprints
        self.positions: dict = {}  # k -> the data position after k completed steps (empty: training not begun)
        self.saved_step: Optional[int] = None  # the step of the newest checkpoint (written or resumed from)
        self.inputs_before: Optional[dict] = None  # the inputs' fingerprints before the workers read them

    # -- find / verify
    def find(self) -> Optional[dict]:
        """The checkpoint to resume from, loaded and checked against this recipe and its inputs, or None for a
        fresh start (``find_resume``, ``check_resume``, ``check_inputs``). A linked ``checkpoints/`` is refused
        here, before the first step, not at the first save."""
        refuse_link(ck.ckpt_root(self.out))
        c = self.find_resume()
        if c is not None:
            self.check_resume(c)
            self.check_inputs(c)
        return c

    def find_resume(self) -> Optional[dict]:
        """The checkpoint to resume from, loaded (``ck.load_checkpoint``), or None for a fresh start.

        ``auto``: the newest checkpoint that verifies; each damaged one on the way is moved aside (named, with
        what is wrong). An explicit folder that fails verification raises ``CheckpointError``."""
        r, out = self.t.resume, self.out
        if r == "none":
            return None
        for note in ck.recover(out):
            print(f"[checkpoint] {note}")
        if r != "auto":
            try:
                return ck.load_checkpoint(r)
            except ck.CheckpointError as e:
                raise ck.CheckpointError(f"trainer.resume={r}: {e}. Resume from another step folder, or use "
                                         f"trainer.resume=auto (the newest checkpoint of trainer.output_dir that "
                                         f"verifies)") from None
        damaged = []
        for step, d in reversed(ck.complete_checkpoints(out)):
            try:
                c = ck.load_checkpoint(d)
            except ck.ForeignObjectsError:  # planted, not damaged: stop here, touch nothing
                raise
            except ck.CheckpointError as e:
                moved = ck.quarantine(d)
                damaged.append(d)
                print(f"warning: {e}; moved it aside to {moved} (kept, not deleted) and trying the previous "
                      f"checkpoint")
                continue
            if damaged:
                print(f"resuming from {d} (step {step}), the newest checkpoint that verifies")
            return c
        if damaged:
            print(f"warning: no checkpoint in {ck.ckpt_root(out)} verifies; starting from step 0")
        return None

    def check_resume(self, c: dict) -> None:
        """Refuse a resume that would be another run; list the other changes (RecipeChangeError / prints)."""
        st = c["state"]
        old = recorded_drafter(recorded_recipe(st.get("recipe")), c["path"])
        refused, same, here = recipe_changes(old, to_dict(self.cfg), st.get("target_fingerprint"),
                                             target_fingerprint(self.cfg.model))
        init, decided = self.cfg.drafter.init_from, {f"drafter.{k}" for k in INIT_FROM_KEYS}
        refused = [r + (f" (the drafter of drafter.init_from={init}; a resume trains its checkpoint's drafter: give "
                        f"the drafter.init_from the run started from, or none)"
                        if init and r.split(" ")[0] in decided else "") for r in refused]
        if refused:
            raise RecipeChangeError(
                f"cannot resume from {c['path']} (step {st['step']}): the recipe changed in a way that makes this "
                f"another run: {'; '.join(refused)}. Undo the change to continue that run, or start a new one: "
                f"another trainer.output_dir (or trainer.resume=none here: the old run is moved aside, not "
                f"deleted); to start from its weights without its optimizer state, add drafter.init_from={c['path']}")
        if same:
            print(f"resuming with changed settings that do not change the run: {'; '.join(same)}")
        if here:
            print(f"resuming with changed settings that take effect from step {st['step'] + 1} on (the run differs "
                  f"from an uninterrupted one from there): {'; '.join(here)}")

    def check_inputs(self, c: dict) -> None:
        """Refuse a resume whose data or target changed since the checkpoint (``input_changes``:
        RecipeChangeError)."""
        changes = input_changes(c["state"].get("inputs"), input_fingerprints(self.cfg))
        if changes:
            raise RecipeChangeError(
                f"cannot resume from {c['path']} (step {c['state']['step']}): {'; '.join(changes)}. Restore the "
                f"original to continue that run, or start a new one on the new inputs: another trainer.output_dir "
                f"(or trainer.resume=none here: the old run is moved aside, not deleted)")

    def finished(self, c: dict) -> Optional[dict]:
        """The summary of the run ``c`` ends, when it is complete (checkpoint and summary at trainer.max_steps or
        beyond; says so and how to extend it), else None."""
        k, prev = int(c["state"]["step"]), read_summary(self.out)
        if k >= self.t.max_steps and prev is not None and prev.get("steps") == k:
            print(f"the run in {self.out} is complete: its checkpoint {c['path']} is at step {k} "
                  f"(trainer.max_steps={self.t.max_steps}); nothing to do. To train further, run the same command "
                  f"with trainer.max_steps={max(2 * k, k + 1)} (it resumes from step {k}); to start over, "
                  f"trainer.resume=none (the old run is moved aside) or another trainer.output_dir.")
            return {**prev, "already_complete": True}
        return None

    # -- load / start
    def start_fresh(self) -> None:
        """A fresh run: the old run in the folder moved aside, then this recipe written (the workers are built,
        so the recipe, the target and the data are valid)."""
        move_run_aside(self.out)
        write_recipe(self.out, self.cfg)

    def load(self, c: dict, group, order: BatchOrder) -> int:
        """Resume from ``c``: the workers' state, the controller's RNGs, the data position; the metrics lines
        after its step moved aside; this recipe written. Returns the step."""
        try:
            load_worker_state(group, c["worker_state"])
        except RuntimeError as e:  # a drafter of another shape (e.g. drafter.init_from changed it)
            if "state_dict" not in str(e):  # torch's "Error(s) in loading state_dict ..."; others pass on
                raise
            raise RecipeChangeError(f"cannot resume from {c['path']}: its drafter does not fit this recipe's "
                                    f"({str(e).splitlines()[0][:300]}); use another trainer.output_dir") from None
        if c.get("controller_rng"):
            ck.set_controller_rng(c["controller_rng"])
        order.set_position(c["state"]["data_position"])
        step = self.saved_step = int(c["state"]["step"])
        trim_metrics(os.path.join(self.out, "metrics.jsonl"), step)
        print(f"resumed from {c['path']} (step {step})")
        if step >= self.t.max_steps:
            print(f"the run is complete at step {step}; writing the summary it had not finished")
        write_recipe(self.out, self.cfg)  # the resume passed its checks and its checkpoint is loaded
        return step

    def carry(self, eval_before: Optional[dict], c: Optional[dict]) -> None:
        """What every checkpoint of this run carries: ``eval_before``, the checkpoints ``c`` resumed from, the
        target's and the inputs' fingerprints."""
        self.state = {"eval_before": eval_before}
        if c is not None:
            self.state["resumed_from"] = [c["path"]] + list(c["state"].get("resumed_from", []))
        self.state["target_fingerprint"] = target_fingerprint(self.cfg.model)
        self.state["inputs"] = input_fingerprints(self.cfg)
        changed = input_changes(self.inputs_before, self.state["inputs"])
        if changed:  # the recorded hashes must be those of what the workers read
            raise BadInputError("the run's inputs changed while its workers read them: "
                                + "; ".join(c.replace(" since the checkpoint", "") for c in changed)
                                + ". Nothing was trained; rerun the same command once the files stay as they are")

    def note_inputs(self) -> None:
        """Fingerprint the inputs before the workers read them (``carry`` compares them after)."""
        self.inputs_before = input_fingerprints(self.cfg)

    def begin(self, step: int, order: BatchOrder) -> None:
        """Training begins at ``step``: from now on an interrupt saves the completed steps."""
        self.positions = {step: order.position}

    def track(self, step: int, order: BatchOrder) -> None:
        """Step ``step`` took its batch: the data position a checkpoint after it records."""
        self.positions[step] = order.position

    # -- save
    def save(self, group) -> tuple:
        """Checkpoint the steps the workers completed (an interrupt may hit mid-step); returns (folder, step)."""
        with self.prof.span("checkpoint"):
            ws = worker_state(group)
            k = int(ws["steps_done"])  # what the workers really completed (an interrupt may hit mid-step)
            st = {**self.state, "data_position": self.positions[k], "method": self.t.method,
                  "recipe": recipe_record(self.cfg)}
            path = ck.save_checkpoint(self.out, k, ws, st, self.t.keep_last)
        self.saved_step = k
        return path, k

    def save_if_new(self, group, step: int) -> None:
        """The run ends at ``step``: a checkpoint of it, unless it is the newest one already."""
        if step != self.saved_step:
            self.save(group)

    def kept_until(self, step: int) -> Optional[str]:
        """The newest complete checkpoint at or before ``step`` (None: none is kept)."""
        good = [d for k, d in ck.complete_checkpoints(self.out) if k <= step]
        return good[-1] if good else None

    def save_on_interrupt(self, group, e: BaseException) -> None:
        """The run stops on ``e`` after training began: keep every completed step (unless that checkpoint exists
        already, or ``e`` is a failed save or a NaN stop, which wrote its own), saying what was kept."""
        closed = group.closed
        said = False
        stop = stopped_by(e)  # SIGTERM, SIGHUP
        run = f"run interrupted by {stop}" if stop else "run interrupted"
        if self.positions and not closed and not isinstance(e, (ck.CheckpointError, NonFiniteError)):
            try:
                done = int(worker_state(group)["steps_done"])
                if done not in (self.saved_step, 0):
                    p, k = self.save(group)
                    print(f"{run}; checkpoint of step {k} written to {p}")
                elif isinstance(e, KeyboardInterrupt):
                    print(f"{run} before its first step: no checkpoint written (nothing to keep)" if done == 0
                          else f"{run}; the checkpoint of step {done} exists already")
                said = True
            except Exception as e2:  # noqa: BLE001
                print(f"{run} and the checkpoint could not be written: {e2}")
                said = True
        if isinstance(e, KeyboardInterrupt) and not said:
            print(f"{run} before training started: no checkpoint written")
