"""The training controller: ``train(cfg)``.

Builds the worker group (``runtime.backend``: local -> ``LocalGroup``; ray -> ``RayGroup``), resumes from a
checkpoint if asked, and runs ``trainer.max_steps`` steps. Each global batch (``data.batch_size`` sample
ids) is split by sample across the workers; ``denom`` (the global branch count) is known before the step
for SpecOPD and the off-policy baselines (``train_step``), and formed after the rollouts for Draft-OPD
(``stage`` -> sum -> ``finish``). Writes ``<output_dir>/metrics.jsonl`` (one line per logged step),
checkpoints (always one when the run ends), profile spans, and ``train_summary.json`` with the held-out
expected acceptance length before and after training.
"""
from __future__ import annotations

import json
import os
import time

from tqdm import tqdm

from specopd.config import RecipeConfig, to_dict, to_yaml
from specopd.profiling import Profiler
from specopd.train import checkpoint as ck
from specopd.train.data import BatchOrder, num_branches


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


def shard(ids: list, n: int) -> list:
    """Split ids into n contiguous, near-equal parts (the first parts get the remainder)."""
    k, r = divmod(len(ids), n)
    out, i = [], 0
    for w in range(n):
        j = i + k + (1 if w < r else 0)
        out.append(ids[i:j])
        i = j
    return out


def reduce_metrics(results: list, wall_s: float) -> dict:
    """Sum the workers' partial metrics; derive mean alpha per position and expected AL (incl. bonus)."""
    n = sum(r["branches"] for r in results)
    alpha = [sum(r["alpha_sum"][j] for r in results) / max(n, 1) for j in range(len(results[0]["alpha_sum"]))]
    surv = [sum(r["surv_sum"][j] for r in results) / max(n, 1) for j in range(len(results[0]["surv_sum"]))]
    m = {"branches": n, "alpha": alpha, "expected_al": 1.0 + sum(surv)}
    if "loss" in results[0]:
        sup = sum(r["supervised_tokens"] for r in results)
        phases = {}
        for r in results:
            for k, v in r.get("phase_s", {}).items():
                phases[k] = max(phases.get(k, 0.0), v)
        m.update(loss=sum(r["loss"] for r in results), supervised_tokens=sup, step_s=wall_s,
                 supervised_tokens_per_s=sup / wall_s if wall_s > 0 else float("nan"),
                 lr=results[0]["lr"], grad_norm=results[0]["grad_norm"], phase_s=phases)
    return m


def evaluate_heldout(group, heldout_ids: list) -> dict:
    """Expected acceptance length (bonus included) of the drafter on held-out samples (on-policy estimate)."""
    res = group.call("evaluate", [(s,) for s in shard(heldout_ids, group.num_workers)])
    m = reduce_metrics(res, 0.0)
    return {"expected_al": m["expected_al"], "alpha": m["alpha"], "branches": m["branches"]}


def _resume_path(cfg: RecipeConfig):
    r = cfg.trainer.resume
    if r == "none":
        return None
    if r == "auto":
        return ck.find_latest(cfg.trainer.output_dir)
    return r


def _changed(old, new, sections=("seed", "model", "drafter", "data", "trainer.method", "trainer.anchors_per_seq",
                                  "trainer.temperature")) -> list:
    """Keys that define the experiment and differ between a checkpoint's recipe and this one."""
    if not old:
        return []
    out = []
    for sec in sections:
        a, b = old, new
        for part in sec.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{sec}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(sec)
    return out


def _trim_metrics(path: str, step: int) -> None:
    """On resume: keep metric lines of steps <= step; move later ones (from the interrupted run) aside."""
    if not os.path.isfile(path):
        return
    keep, later = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                (keep if json.loads(line).get("step", 0) <= step else later).append(line)
    if later:
        with open(path + ".orphaned", "a") as f:
            f.writelines(later)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def train(cfg: RecipeConfig, progress: bool = True) -> dict:
    """Run the recipe; returns the summary (also written to <output_dir>/train_summary.json)."""
    if getattr(getattr(cfg, "pipeline", None), "enabled", False):  # the main job (prepare, warm up, train, eval)
        return __import__("specopd.mainjob", fromlist=["run"]).run(cfg, progress=progress)
    t, out = cfg.trainer, cfg.trainer.output_dir
    os.makedirs(out, exist_ok=True)
    if cfg.data.batch_size < cfg.runtime.num_workers:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} < runtime.num_workers={cfg.runtime.num_workers}: "
                         f"every worker needs at least one sample per step")
    with open(os.path.join(out, "recipe.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    metrics_path = os.path.join(out, "metrics.jsonl")
    group = make_group(cfg)
    n = group.num_workers
    step, saved_step, state = 0, None, {}
    try:
        info = group.call("data_info", [()] * n)[0]
        W, B = info["draft_len"], t.anchors_per_seq
        order = BatchOrder(info["train_ids"], cfg.data.batch_size, cfg.data.seed)
        path = _resume_path(cfg)
        if path is not None:
            c = ck.load_checkpoint(path)
            group.broadcast("load_state_dict", c["worker_state"])
            if c.get("controller_rng"):
                ck.set_controller_rng(c["controller_rng"])
            order.set_position(c["state"]["data_position"])
            step = saved_step = int(c["state"]["step"])
            state = {"eval_before": c["state"].get("eval_before"), "resumed_from": [path] +
                     list(c["state"].get("resumed_from", []))}
            _trim_metrics(metrics_path, step)
            print(f"resumed from {path} (step {step})")
            for k in _changed(c["state"].get("recipe"), to_dict(cfg)):
                print(f"warning: {k} differs from the checkpoint's recipe; the resumed run is not a continuation "
                      f"of the same experiment (use trainer.resume=none or another output_dir to start fresh)")
        else:
            stamp = int(time.time())
            if os.path.isfile(metrics_path):  # a fresh run in a used folder: keep the old metrics aside
                os.replace(metrics_path, metrics_path + f".before-{stamp}")
            if os.path.isdir(os.path.join(out, "profile")):  # ... and the old profile, so spans do not pile up
                os.replace(os.path.join(out, "profile"), os.path.join(out, f"profile.before-{stamp}"))
            state = {"eval_before": evaluate_heldout(group, info["heldout_ids"]) if t.eval_heldout else None}
            if state["eval_before"]:
                print(f"held-out expected AL (incl. bonus) before training: {state['eval_before']['expected_al']:.4f}")

        positions = {step: order.position}  # data position after `k` completed steps

        ctrl = Profiler("controller", enabled=cfg.profile.enabled)  # the controller's own phase: checkpoint

        def save():
            with ctrl.span("checkpoint"):
                ws = group.call("state_dict", [()] * n)[0]
                k = int(ws["steps_done"])  # what the workers really completed (an interrupt may hit mid-step)
                st = {**state, "data_position": positions[k], "method": t.method, "recipe": to_dict(cfg)}
                return ck.save_checkpoint(out, k, ws, st, t.keep_last), k

        def spans():
            return [e for r in group.call("take_spans", [()] * n) for e in r] + ctrl.take()

        bar = tqdm(total=t.max_steps, initial=step, desc=f"train {t.method}", unit="step", disable=not progress)
        last = {}
        while step < t.max_steps:
            ids = order.next()
            positions[step + 1] = order.position
            parts = shard(ids, n)
            t0 = time.perf_counter()
            if t.method == "draft_opd":
                denom = sum(r["branches"] for r in group.call("stage", [(p, step) for p in parts]))
                res = group.call("finish", [(denom,)] * n)
            else:
                denom = sum(num_branches(info["lengths"][i], info["prompt_lens"][i], W, B) for i in ids)
                res = group.call("train_step", [(p, step, denom) for p in parts])
            last = reduce_metrics(res, time.perf_counter() - t0)
            step += 1
            last.update(step=step, time=time.time())
            if cfg.profile.enabled:
                from specopd.profiling import append_spans

                append_spans(out, spans())
            if step % t.log_every == 0 or step == t.max_steps:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(last) + "\n")
            bar.set_postfix(loss=f"{last['loss']:.4f}", AL=f"{last['expected_al']:.3f}",
                            sup_tok_s=f"{last['supervised_tokens_per_s']:.0f}")
            bar.update(1)
            if t.save_every and step % t.save_every == 0:
                _, saved_step = save()
        bar.close()
    except BaseException:
        if "positions" in locals():  # keep every completed step (unless that checkpoint exists already)
            try:
                if group.call("state_dict", [()] * n)[0]["steps_done"] not in (saved_step, 0):
                    p, k = save()
                    print(f"run interrupted; checkpoint of step {k} written to {p}")
            except Exception as e:  # noqa: BLE001
                print(f"run interrupted and the checkpoint could not be written: {e}")
        group.shutdown()
        raise
    try:
        if step != saved_step:
            save()
        summary = {"method": t.method, "steps": step, "final_checkpoint": ck.find_latest(out),
                   "eval_before": state.get("eval_before"), "last_step": last}
        if t.eval_heldout:
            summary["eval_after"] = evaluate_heldout(group, info["heldout_ids"])
            b = summary["eval_before"]["expected_al"] if summary["eval_before"] else float("nan")
            print(f"held-out expected AL (incl. bonus): before {b:.4f} -> after {summary['eval_after']['expected_al']:.4f}")
        if cfg.profile.enabled:
            from specopd.profiling import write_profile

            try:
                write_profile(out, spans(),
                              gpu_note=getattr(group, "gpu_note", None))
            except Exception as e:  # noqa: BLE001  (plots are a convenience; the raw spans are saved)
                print(f"profile rendering failed ({e}); raw spans are in {out}/profile/spans.jsonl")
        tmp = os.path.join(out, "train_summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, os.path.join(out, "train_summary.json"))
        return summary
    finally:
        group.shutdown()
