"""The training controller: ``train(cfg)``.

Builds the worker group (``runtime.backend``: local -> ``LocalGroup``; ray -> ``RayGroup``), resumes from a
checkpoint if asked, and runs ``trainer.max_steps`` steps. Each global batch (``data.batch_size`` sample
ids) is split by sample across the workers; ``denom`` (the global branch count) is known before the step
for SpecOPD and the off-policy baselines (``train_step``), and formed after the rollouts for Draft-OPD
(``stage`` -> sum -> ``finish``). Writes ``<output_dir>/metrics.jsonl`` (one line per logged step),
checkpoints (always one when the run ends), profile spans, and ``train_summary.json`` with the held-out
expected acceptance length before and after training. ``trainer.eval_every`` = N: every N steps and at the
last one the same held-out evaluation (``evaluate_heldout``: fixed anchors and branches, per-sample
generators, so it never touches the training RNG streams) goes into that step's metrics line
(``heldout_expected_al``), the progress bar and ``<output_dir>/heldout_al.png``.

Nothing is lost, nothing is overwritten:
- resume (``trainer.resume``): ``auto`` takes the newest checkpoint that verifies (sizes + sha256) and moves
  damaged ones aside, saying so; an explicit folder that fails verification is an error. A resume whose
  recipe changed in a way that makes it another run (target, drafter shape, data, seed, method) is refused;
  other changes continue and are listed (``recipe_changes``). A finished run says so and how to extend it.
- one writer per run folder: ``train`` holds ``specopd.train.lock.run_lock(trainer.output_dir)`` throughout; a
  second run there is refused at once (``RunLockedError``) naming the holder's pid and host.
- a resume also compares the run's inputs (``specopd.train.inputs``: the prepared data's records and the target's
  files, by sha256) with the checkpoint's, and refuses one whose data or target changed, naming it.
- ``recipe.yaml`` is written only once the run is accepted (the workers are built, so the recipe, target and data
  are valid, and a resume passed its checks and loaded its checkpoint); a different recipe already there is kept
  in ``recipe.history/``. A fresh run in a used folder moves the
  old metrics, profile, checkpoints and summary aside (``*.before-<time>``).
- a step whose loss or gradient is NaN / inf is skipped on every worker (no update), logged (``skipped`` in
  its metrics line), and ``trainer.max_nonfinite_steps`` of them in a row stop the run with a checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from typing import Optional

from tqdm import tqdm

from specopd.config import RecipeConfig, RecipeError, to_dict, to_yaml
from specopd.memory import check_memory
from specopd.profiling import Profiler
from specopd.train import checkpoint as ck
from specopd.train.data import BatchOrder, num_branches
from specopd.train.inputs import input_changes, input_fingerprints


class NonFiniteError(RuntimeError):
    """``trainer.max_nonfinite_steps`` steps in a row had a NaN / inf loss or gradient; the message names the
    steps and the checkpoint written."""


class RecipeChangeError(RecipeError):
    """A resume whose recipe differs from the checkpoint's in a way that makes it another run."""


def make_group(cfg: RecipeConfig):
    if cfg.runtime.backend == "ray":
        try:
            from specopd.distributed.ray_backend import RayGroup
        except ModuleNotFoundError as e:
            raise RuntimeError(f"runtime.backend=ray needs specopd.distributed.ray_backend ({e}); "
                               f"use runtime.backend=local") from None
        return RayGroup(cfg)
    from specopd.train.group import LocalGroup

    return LocalGroup(cfg)


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


def evaluate_heldout(group, heldout_ids: list, batch_size: Optional[int] = None) -> dict:
    """Expected acceptance length (bonus included) of the drafter on held-out samples (on-policy estimate).

    The samples go ``batch_size`` at a time (split across the workers like a training batch), so a worker
    holds the trunk caches of at most its share of one batch, however many samples are held out; the cost is
    the forward passes of ceil(len / batch_size) steps. None: all at once."""
    ids = list(heldout_ids)
    chunk = batch_size or max(1, len(ids))
    res = []
    for lo in range(0, max(1, len(ids)), chunk):
        res += group.evaluate(shard(ids[lo: lo + chunk], group.num_workers))
    m = reduce_metrics(res, 0.0)
    return {"expected_al": m["expected_al"], "alpha": m["alpha"], "branches": m["branches"]}


# ---------------------------------------------------------------------------------------------- resume
def find_resume(cfg: RecipeConfig) -> Optional[dict]:
    """The checkpoint to resume from, loaded (``ck.load_checkpoint``), or None for a fresh start.

    ``auto``: the newest checkpoint that verifies; each damaged one on the way is moved aside (named, with
    what is wrong). An explicit folder that fails verification raises ``CheckpointError``."""
    r, out = cfg.trainer.resume, cfg.trainer.output_dir
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
        except ck.CheckpointError as e:
            moved = ck.quarantine(d)
            damaged.append(d)
            print(f"warning: {e}; moved it aside to {moved} (kept, not deleted) and trying the previous checkpoint")
            continue
        if damaged:
            print(f"resuming from {d} (step {step}), the newest checkpoint that verifies")
        return c
    if damaged:
        print(f"warning: no checkpoint in {ck.ckpt_root(out)} verifies; starting from step 0")
    return None


# keys whose change makes the resumed run another experiment (refused) / that do not change the run
_REFUSE = ("seed", "model.target", "model.tiny_seed", "model.tiny", "drafter.kind", "drafter.num_layers",
           "drafter.block_size", "drafter.feature_layers", "data.source", "data.path", "data.num_samples",
           "data.prompt_len", "data.seq_len", "data.sample_temperature", "data.seed", "data.heldout",
           "trainer.method", "data.overlong", "data.bad_lines")
_SAME_RUN = ("trainer.max_steps", "trainer.save_every", "trainer.keep_last", "trainer.log_every",
             "trainer.eval_heldout", "trainer.eval_anchors_per_seq", "trainer.eval_every", "trainer.output_dir",
             "trainer.resume", "trainer.cache_trunks", "trainer.loggers", "trainer.logger_project",
             "trainer.run_name", "trainer.wandb_mode", "trainer.mlflow_tracking_uri",
             "trainer.max_nonfinite_steps", "drafter.init_from", "model.device", "model.gdn_checkpoint_every",
             "runtime", "profile", "eval", "pipeline")


def _flat(d: dict) -> dict:
    """section.key -> value (one level: a dict-valued key such as model.tiny compares as a whole)."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and k in ("model", "drafter", "data", "trainer", "runtime", "eval", "profile",
                                         "pipeline"):
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


def recipe_changes(old: dict, new: dict, old_fp: Optional[str] = None, new_fp: Optional[str] = None) -> tuple:
    """(refused, same_run, from_here): "key a -> b" strings for keys that differ between a checkpoint's recipe
    and this one. refused: another experiment (the resume is refused); same_run: bookkeeping that does not
    change the numbers; from_here: take effect from the resumed step on. Keys unknown to the old recipe are
    skipped. A moved target folder with the same config.json and weight sizes is not a change of target."""
    a, b = _flat(old), _flat(new)
    refused, same, here = [], [], []
    for k in sorted(set(a) & set(b)):
        if a[k] == b[k]:
            continue
        line = f"{k} {a[k]!r} -> {b[k]!r}"
        sec = k.split(".")[0]
        if k == "model.target" and old_fp is not None and old_fp == new_fp:
            same.append(line + " (the same model: config.json and weight sizes match)")
        elif k in _REFUSE:
            refused.append(line)
        elif k in _SAME_RUN or sec in _SAME_RUN:
            if k == "trainer.max_steps":
                line += " (the cosine LR schedule now ends there)"
            if k == "runtime.num_workers":
                line += (" (same global batches; bitwise the same numbers with trainer.batch_invariant=true"
                         if b.get("trainer.batch_invariant") else
                         " (same global batches; the loss matches to fp32 rounding, bitwise only with "
                         "trainer.batch_invariant=true")
                line += ")"
            if k == "drafter.init_from":
                line += " (ignored on resume: the checkpoint's weights are loaded)"
            same.append(line)
        else:
            here.append(line)
    return refused, same, here


def check_inputs(cfg: RecipeConfig, c: dict) -> None:
    """Refuse a resume whose data or target changed since the checkpoint (``input_changes``: RecipeChangeError)."""
    changes = input_changes(c["state"].get("inputs"), input_fingerprints(cfg))
    if changes:
        raise RecipeChangeError(
            f"cannot resume from {c['path']} (step {c['state']['step']}): {'; '.join(changes)}. Restore the "
            f"original to continue that run, or start a new one on the new inputs: another trainer.output_dir (or "
            f"trainer.resume=none here: the old run is moved aside, not deleted)")


def check_resume(cfg: RecipeConfig, c: dict) -> None:
    """Refuse a resume that would be another run; list the other changes (RecipeChangeError / prints)."""
    st = c["state"]
    refused, same, here = recipe_changes(st.get("recipe"), to_dict(cfg), st.get("target_fingerprint"),
                                         target_fingerprint(cfg.model))
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


def _read_summary(out: str) -> Optional[dict]:
    try:
        with open(os.path.join(out, "train_summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- files
def write_recipe(out: str, cfg: RecipeConfig) -> Optional[str]:
    """``<out>/recipe.yaml`` = this run's recipe (tmp + rename). A different recipe already there is kept as
    ``<out>/recipe.history/recipe-<its time>.yaml``; returns that path (None if nothing was kept)."""
    text = to_yaml(cfg)
    path = os.path.join(out, "recipe.yaml")
    kept = None
    if os.path.isfile(path):
        with open(path) as f:
            old = f.read()
        if old == text:
            return None
        hist = os.path.join(out, "recipe.history")
        os.makedirs(hist, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
        kept = os.path.join(hist, f"recipe-{stamp}.yaml")
        k = 1
        while os.path.exists(kept):
            k += 1
            kept = os.path.join(hist, f"recipe-{stamp}-{k}.yaml")
        _atomic_write(kept, old)
    _atomic_write(path, text)
    return kept


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _trim_metrics(path: str, step: int) -> None:
    """On resume: keep metric lines of steps <= step; move later ones (from the interrupted run) aside. A
    line cut short by a kill is dropped (its step is recomputed)."""
    if not os.path.isfile(path):
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
        with open(path + ".orphaned", "a") as f:
            f.writelines(later)
    _atomic_write(path, "".join(keep))


def _fresh_start(out: str) -> None:
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


def _log(msg: str, bar) -> None:
    (tqdm.write if bar is not None and not bar.disable else print)(msg)


def _plot_heldout(out: str, start: Optional[dict], bar) -> None:
    """Redraw <out>/heldout_al.png from metrics.jsonl (a convenience: a failure is reported, not raised)."""
    from specopd.profiling import plot_heldout_al

    try:
        plot_heldout_al(out, start=start["expected_al"] if start else None)
    except Exception as e:  # noqa: BLE001
        _log(f"warning: could not draw {os.path.join(out, 'heldout_al.png')} ({e}); the numbers are in "
             f"metrics.jsonl (heldout_expected_al)", bar)


def _al(m: Optional[dict]) -> str:
    """An expected AL for display: "-" when it was taken over no branch (no held-out sequence)."""
    return "-" if not m or not m.get("branches", 1) else f"{m['expected_al']:.4f}"


def check_device(cfg: RecipeConfig) -> None:
    """model.device=cuda on a machine whose torch sees no CUDA device: a RecipeError (Ray clusters given by
    runtime.address are not checked here: their workers may have GPUs the driver lacks)."""
    if cfg.model.device == "cuda" and cfg.runtime.address is None:
        import torch

        if not torch.cuda.is_available():
            raise RecipeError(f"model.device=cuda, but torch sees no CUDA device on this machine (torch "
                              f"{torch.__version__}, torch.cuda.is_available() is False): use model.device=cpu, or "
                              f"model.device=auto (cuda when available)")


# ---------------------------------------------------------------------------------------------- train
def train(cfg: RecipeConfig, progress: bool = True) -> dict:
    """Run the recipe; returns the summary (also written to <output_dir>/train_summary.json). Holds the run
    folder's lock (``specopd.train.lock``) throughout: a second writer is refused."""
    if cfg.pipeline.enabled:
        raise RecipeError("pipeline.enabled=true is the main job (prepare, warm up, train, evaluate, export), which "
                          "runs this training loop itself: run `specopd train RECIPE` or specopd.mainjob.run(cfg), "
                          "or set pipeline.enabled=false to train on the recipe's data alone")
    if cfg.data.batch_size < cfg.runtime.num_workers:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} < runtime.num_workers={cfg.runtime.num_workers}: "
                         f"every worker needs at least one sample per step")
    check_device(cfg)
    if cfg.drafter.init_from:
        from specopd.drafters.layout import check_folder

        check_folder(cfg.drafter.init_from, "drafter.init_from")
    from specopd.train.lock import run_lock

    with run_lock(cfg.trainer.output_dir, "trainer.output_dir"):
        return _train(cfg, progress)


def _train(cfg: RecipeConfig, progress: bool) -> dict:
    from specopd.train.determinism import apply_deterministic

    t, out = cfg.trainer, cfg.trainer.output_dir
    c = find_resume(cfg)
    if c is not None:
        check_resume(cfg, c)
        check_inputs(cfg, c)
        k, prev = int(c["state"]["step"]), _read_summary(out)
        if k >= t.max_steps and prev is not None and prev.get("steps") == k:
            print(f"the run in {out} is complete: its checkpoint {c['path']} is at step {k} "
                  f"(trainer.max_steps={t.max_steps}); nothing to do. To train further, run the same command with "
                  f"trainer.max_steps={max(2 * k, k + 1)} (it resumes from step {k}); to start over, "
                  f"trainer.resume=none (the old run is moved aside) or another trainer.output_dir.")
            return {**prev, "already_complete": True}
    apply_deterministic(t.deterministic)
    if c is None:
        ck.seed_controller_rng(cfg.seed)  # byte-reproducible checkpoints (a resume restores the saved states)
    from specopd.train.metrics import check_loggers, make_logger

    check_loggers(t.loggers)  # a missing optional package (tensorboard / wandb / mlflow) names its extra first
    check_memory(cfg)  # a step larger than one device is a clear error (MemoryPlanError) before any work
    metrics_path = os.path.join(out, "metrics.jsonl")
    warm_cache = None
    if cfg.runtime.backend == "ray":  # conversations: tokenise once here, not in every worker actor at once
        from specopd.train.data import warm_conversation_cache

        warm_cache = warm_conversation_cache(cfg)
    group = make_group(cfg)
    n = group.num_workers
    step, saved_step, state, sinks = 0, None, {}, None
    try:
        info = group.data_info()
        if t.eval_every and not info["heldout_ids"]:
            raise RecipeError(f"trainer.eval_every={t.eval_every} needs held-out sequences, and this data has none "
                              f"(data.heldout={cfg.data.heldout}, or every held-out response is shorter than "
                              f"drafter.block_size): raise data.heldout, or set trainer.eval_every=0")
        W, B = info["draft_len"], t.anchors_per_seq
        order = BatchOrder(info["train_ids"], cfg.data.batch_size, cfg.data.seed)
        if c is not None:
            try:
                group.load_state_dict(c["worker_state"])
            except RuntimeError as e:  # a drafter of another shape (e.g. drafter.init_from changed it)
                if "state_dict" not in str(e):  # torch's "Error(s) in loading state_dict ..."; others pass on
                    raise
                raise RecipeChangeError(f"cannot resume from {c['path']}: its drafter does not fit this recipe's "
                                        f"({str(e).splitlines()[0][:300]}); use another trainer.output_dir") from None
            if c.get("controller_rng"):
                ck.set_controller_rng(c["controller_rng"])
            order.set_position(c["state"]["data_position"])
            step = saved_step = int(c["state"]["step"])
            state = {"eval_before": c["state"].get("eval_before"), "resumed_from": [c["path"]] +
                     list(c["state"].get("resumed_from", []))}
            _trim_metrics(metrics_path, step)
            print(f"resumed from {c['path']} (step {step})")
            if step >= t.max_steps:
                print(f"the run is complete at step {step}; writing the summary it had not finished")
            write_recipe(out, cfg)  # the resume passed its checks and its checkpoint is loaded
        else:
            _fresh_start(out)
            write_recipe(out, cfg)  # the recipe, the target and the data are valid: the workers are built
            evaluate = t.eval_heldout or t.eval_every  # eval_every: the curve starts at step 0
            state = {"eval_before": evaluate_heldout(group, info["heldout_ids"], cfg.data.batch_size) if evaluate else None}
            if state["eval_before"]:
                print(f"held-out expected AL (incl. bonus) before training: {_al(state['eval_before'])}"
                      + ("" if info["heldout_ids"] else " (no held-out sequence: data.heldout=0 or none usable)"))
        state["target_fingerprint"] = target_fingerprint(cfg.model)
        state["inputs"] = input_fingerprints(cfg)
        sinks = make_logger(cfg, resume_step=step if c is not None else None)  # metrics.jsonl + trainer.loggers

        positions = {step: order.position}  # data position after `k` completed steps

        ctrl = Profiler("controller", enabled=cfg.profile.enabled)  # the controller's own phases: step, checkpoint

        def save():
            with ctrl.span("checkpoint"):
                ws = group.state_dict()
                k = int(ws["steps_done"])  # what the workers really completed (an interrupt may hit mid-step)
                st = {**state, "data_position": positions[k], "method": t.method, "recipe": to_dict(cfg)}
                return ck.save_checkpoint(out, k, ws, st, t.keep_last), k

        def spans():
            return group.take_spans() + ctrl.take()

        bar = tqdm(total=t.max_steps, initial=min(step, t.max_steps), desc=f"train {t.method}", unit="step",
                   disable=not progress)
        last, bad, heldout = {}, 0, None  # heldout: (step, evaluate_heldout result) of the newest evaluation
        if t.eval_every and step == 0 and state.get("eval_before"):
            heldout = (0, state["eval_before"])
        elif t.eval_every and step > 0:  # resumed: the newest evaluation the kept metrics lines carry
            from specopd.profiling import read_heldout_al

            pts = read_heldout_al(out)
            heldout = (pts[-1][0], {"expected_al": pts[-1][1]}) if pts else None
        while step < t.max_steps:
            with ctrl.span("step", step=step + 1):
                ids = order.next()
                positions[step + 1] = order.position
                parts = shard(ids, n)
                t0 = time.perf_counter()
                if t.method == "draft_opd":
                    denom = group.stage(parts, step)
                    res = group.finish(denom)
                else:
                    counts = info.get("anchor_counts")  # valid anchors per sample (response / loss mask)
                    denom = sum(min(B, counts[i]) if counts is not None else
                                num_branches(info["lengths"][i], info["prompt_lens"][i], W, B) for i in ids)
                    if t.batch_invariant:
                        bounds = shard_bounds(len(ids), n)
                        res = group.train_step_invariant(parts, step, denom, bounds, len(ids))
                    else:
                        res = group.train_step(parts, step, denom)
                last = reduce_metrics(res, time.perf_counter() - t0)
                step += 1
                last.update(step=step, time=time.time())
                if cfg.profile.enabled:
                    from specopd.profiling import append_spans

                    append_spans(out, spans())
                due = t.eval_every and (step % t.eval_every == 0 or step == t.max_steps)
                if due:  # after the step's timing (step_s excludes it); its worker spans are named "eval"
                    t1 = time.perf_counter()
                    heldout = (step, evaluate_heldout(group, info["heldout_ids"], cfg.data.batch_size))
                    last.update(heldout_expected_al=heldout[1]["expected_al"], heldout_alpha=heldout[1]["alpha"],
                                heldout_branches=heldout[1]["branches"], heldout_eval_s=time.perf_counter() - t1)
                if step % t.log_every == 0 or step == t.max_steps or last.get("skipped") or due:
                    sinks.log(last)  # metrics.jsonl (the source of truth) and every trainer.loggers sink
                if due:
                    _plot_heldout(out, state.get("eval_before"), bar)
                post = dict(loss=f"{last['loss']:.4f}", AL=f"{last['expected_al']:.3f}")
                if heldout is not None and heldout[1].get("branches", 1):
                    post["heldout_AL"] = f"{heldout[1]['expected_al']:.3f}@{heldout[0]}"
                bar.set_postfix(**post, sup_tok_s=f"{last['supervised_tokens_per_s']:.0f}")
                bar.update(1)
                bad = bad + 1 if last.get("skipped") else 0
                if bad:
                    _log(f"step {step}: loss {last['loss']:.4g}, gradient norm {last['grad_norm']:.4g}: not finite, "
                         f"update skipped ({bad} in a row; the run stops at trainer.max_nonfinite_steps="
                         f"{t.max_nonfinite_steps})", bar)
                if bad and bad >= t.max_nonfinite_steps:
                    p, _ = save()
                    good = [d for k, d in ck.complete_checkpoints(out) if k <= step - bad]
                    saved_step = step
                    raise NonFiniteError(
                        f"stopped at step {step}: the loss or gradient was NaN/inf in {bad} steps in a row "
                        f"(steps {step - bad + 1}-{step}); their updates were skipped, so the drafter is the one "
                        f"after step {step - bad}. Checkpoint written: {p} ("
                        + (f"the last one before these steps: {good[-1]}" if good else
                           f"none from before these steps is kept, trainer.keep_last={t.keep_last}") + "). "
                        f"Lower trainer.lr or check the data, then resume (trainer.resume=auto, or "
                        f"trainer.resume=<an earlier step folder>)")
                if t.save_every and step % t.save_every == 0:
                    _, saved_step = save()
        bar.close()
    except BaseException as e:
        closed = getattr(group, "_closed", False)
        said = False
        if "positions" in locals() and not closed and not isinstance(e, (ck.CheckpointError, NonFiniteError)):
            try:  # keep every completed step (unless that checkpoint exists already)
                done = int(group.state_dict()["steps_done"])
                if done not in (saved_step, 0):
                    p, k = save()
                    print(f"run interrupted; checkpoint of step {k} written to {p}")
                elif isinstance(e, KeyboardInterrupt):
                    print("run interrupted before its first step: no checkpoint written (nothing to keep)" if done == 0
                          else f"run interrupted; the checkpoint of step {done} exists already")
                said = True
            except Exception as e2:  # noqa: BLE001
                print(f"run interrupted and the checkpoint could not be written: {e2}")
                said = True
        if isinstance(e, KeyboardInterrupt) and not said:
            print("run interrupted before training started: no checkpoint written")
        if sinks is not None:
            sinks.close()
        group.shutdown()
        raise
    try:
        if step != saved_step:
            save()
        summary = {"method": t.method, "steps": step, "final_checkpoint": ck.find_latest(out),
                   "eval_before": state.get("eval_before"), "last_step": last,
                   "data": info.get("data_stats")}  # what was read, dropped, cut, skipped: nothing silently
        if warm_cache is not None and summary["data"]:
            summary["data"]["cache"] = warm_cache  # built (or found) by the controller before the workers
        if t.eval_every and heldout is not None:
            summary["heldout_expected_al"] = {"step": heldout[0], "expected_al": heldout[1]["expected_al"],
                                              "figure": os.path.join(out, "heldout_al.png")}
        if t.eval_heldout:  # the drafter after the last step: already evaluated there with eval_every
            done = heldout is not None and heldout[0] == step and step > 0 and "alpha" in heldout[1]
            summary["eval_after"] = heldout[1] if done else evaluate_heldout(group, info["heldout_ids"], cfg.data.batch_size)
            print(f"held-out expected AL (incl. bonus): before {_al(summary['eval_before'])} -> after "
                  f"{_al(summary['eval_after'])}" + ("" if summary["eval_after"].get("branches", 1) else
                                                     " (no held-out sequence to evaluate on: raise data.heldout)"))
        if cfg.profile.enabled:
            from specopd.profiling import write_profile

            try:
                write_profile(out, spans(),
                              gpu_note=getattr(group, "gpu_note", None))
            except Exception as e:  # noqa: BLE001  (plots are a convenience; the raw spans are saved)
                print(f"profile rendering failed ({e}); raw spans are in {out}/profile/spans.jsonl")
        _atomic_write(os.path.join(out, "train_summary.json"), json.dumps(summary, indent=1))
        return summary
    finally:
        if sinks is not None:
            sinks.close()
        group.shutdown()
