"""``specopd`` command line: ``train RECIPE [key=value ...] [--dry-run]``, ``eval RECIPE [key=value ...] [--json PATH]``,
``prepare model NAME | data ...``, ``profile RUN_DIR``, ``export RUN_DIR|CHECKPOINT OUT_DIR [--dtype bfloat16]
[--target PATH]``; each command dispatches to its owner's module. Overrides: specopd/DESIGN.md ("Command line").
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys

from omegaconf import OmegaConf

from specopd import mainjob
from specopd.config import RecipeError, load_recipe
from specopd.data.formats import check_conversations_file
from specopd.data.packaged import conversations_file
from specopd.data.prepare import main as main_prepare
from specopd.distributed.ray_backend import ClusterTooSmallError, WorkerLostError, extend_plan
from specopd.drafters.config import MissingInitFrom
from specopd.drafters.layout import DTYPES, describe_export, export_folder
from specopd.drafters.mtp import describe_mtp_export, export_mtp_folder, is_mtp_folder
from specopd.engines import EngineFailed, EngineUnavailable
from specopd.errors import (BadInputError, DamagedFolderError, MissingInputError, UserError, dir_problem,
                            open_write, output_file_problem, refuse_link)
from specopd.eval.cli import main_eval
from specopd.eval.engine import eval_with_vllm, main_serve_check
from specopd.follow.job import follow
from specopd.memory import format_plan, memory_plan, target_shape
from specopd.profiling import render
from specopd.runs.checkpoint import MARKER, CheckpointError, find_latest, newest_good, read_state, verify
from specopd.runs.lock import busy
from specopd.signals import stop_on_signals, stopped_by
from specopd.train.checkpointer import RecipeChangeError, drafter_as_loaded
from specopd.train.loop import train
from specopd.train.metrics import check_loggers
from specopd.train.step import NonFiniteError


def _fail(msg: str, code: int = 2) -> int:
    print(f"specopd: error: {msg}", file=sys.stderr)
    return code


def _check_json(args) -> None:
    """``--json PATH`` that cannot be written is refused before any work (not after a finished training)."""
    path = getattr(args, "json", None)
    why = output_file_problem(path) if path else None
    if why is not None:
        raise BadInputError(f"--json {path!r} cannot be written: {why}")


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open_write(path) as f:
        json.dump(obj, f, indent=1, default=str)


def _load(recipe: str, overrides: list):
    try:
        return load_recipe(recipe, overrides)
    except (RecipeError, FileNotFoundError) as e:
        raise SystemExit(_fail(str(e)))


# ---------------------------------------------------------------------------------------------- the plan
def plan(cfg, device_bytes=None) -> dict:
    """What a run would do, from the recipe and the target's shape (config.json, or the recipe's model.shape);
    no weights are loaded. ``memory`` is ``specopd.memory.memory_plan`` of one GPU (None: shape unknown)."""
    m, r, t, d = cfg.model, cfg.runtime, cfg.trainer, cfg.data
    pipeline = bool(getattr(getattr(cfg, "pipeline", None), "enabled", False))
    notes = []
    shape, source = target_shape(cfg)
    if m.is_tiny:
        where = f"built on the fly under {os.path.join(t.output_dir, 'tiny-target-' + m.target[5:])}"
    else:
        where = source.rsplit("/config.json", 1)[0] if source.endswith("/config.json") else m.target
    if shape is None:
        notes.append(f"model.target={m.target!r} is prepared by the main job on first use (stage 1, cached); "
                     f"no memory estimate until then" if pipeline else f"no memory estimate: {source}")
    refuse_link(os.path.join(t.output_dir, "checkpoints"))  # the run refuses it before its first step
    holder = busy(t.output_dir)
    if holder:
        notes.append(f"trainer.output_dir={t.output_dir!r} is in use by {holder}: the run would be refused until "
                     f"that one ends (one writer per folder)")
    if t.resume != "none":
        found = t.resume if t.resume != "auto" else find_latest(t.output_dir)
        try:
            k = int(read_state(found)["step"]) if found else None
        except (CheckpointError, KeyError, ValueError):
            k = None
        if k is not None:
            notes.append(f"resume: {found} (step {k}): " + (
                "the run is complete; raise trainer.max_steps to train further" if k >= t.max_steps
                else f"{t.max_steps - k} steps left"))
    if (d.source == "prepared" and not pipeline and os.path.isdir(d.path)
            and not os.path.isfile(os.path.join(d.path, "data.jsonl"))):  # the run refuses it too
        raise MissingInputError(f"data.path={d.path!r} is a folder without data.jsonl; give a .jsonl file or the "
                                f"--out folder of `specopd prepare data`")
    if d.source == "prepared" and not os.path.exists(d.path):
        notes.append(f"data.path={d.path!r} is written by the main job on first use (stage 2: references)" if pipeline
                     else f"data.path={d.path!r} does not exist yet (run `specopd prepare data ...` before training)")
    if d.source == "conversations" and not os.path.isfile(conversations_file(d.path)):
        check_conversations_file(conversations_file(d.path))  # a folder or a missing file: refused, as the run does
    if pipeline:
        refs = ("trains on data.path's conversations as they are (nothing decoded)" if d.source == "conversations"
                else "prepares the references when missing")
        notes.append(f"pipeline: the main job (specopd.mainjob) prepares the target, {refs}, warms the drafter up "
                     f"when asked, trains and evaluates ({cfg.eval.bench}); no separate `specopd prepare` step is needed")
    mem = memory_plan(cfg, device_bytes) if shape is not None else None
    target = {"model_type": None if shape is None else shape.get("model_type"), "source": where,
              "pending": "prepared by the main job on first use" if pipeline and shape is None else None}
    if mem is not None:
        z = mem.sizes
        target.update(params=z["target_params"], weights_bytes=mem.terms[0].bytes, hidden_size=z["hidden"],
                      layers=int(shape["num_hidden_layers"]), vocab=z["vocab"], shape_source=mem.shape_source)
    per_worker = -(-d.batch_size // r.num_workers)
    return {
        "target": target, "method": t.method,
        "drafter": {"kind": cfg.drafter.kind, "num_layers": cfg.drafter.num_layers,
                    "block_size": cfg.drafter.block_size},
        "workers": r.num_workers, "backend": r.backend, "roles": r.roles, "placement": _placement(r, m.device),
        "tensor_parallel": r.tensor_parallel,
        "per_step": {"sequences": d.batch_size, "sequences_per_worker": per_worker,
                     "branches": d.batch_size * t.anchors_per_seq,
                     "supervised_tokens": d.batch_size * t.anchors_per_seq * (cfg.drafter.block_size - 1)},
        "memory": None if mem is None else mem.to_dict(),
        "kernels": dataclasses.asdict(cfg.kernels),
        "steps": t.max_steps, "output_dir": t.output_dir, "resume": t.resume, "notes": notes,
        "_memory_plan": mem,
    }


def _placement(r, device: str) -> list:
    """One entry per worker; runtime.roles=split: a drafter worker and a target worker per pair."""
    roles = ["drafter", "target"] if r.roles == "split" else ["prefill+propose+score+update"]
    return [{"worker": i, "role": role, "device": device, "cpus": r.cpus_per_worker, "gpus": r.gpus_per_worker}
            for role in roles for i in range(r.num_workers)]


def _print_plan(p: dict) -> None:
    tg = p["target"]
    if tg.get("params") is not None:
        tp = p.get("tensor_parallel", 1)
        print(f"target   {tg['model_type']} ({tg['source']}): {tg['params'] / 1e6:.2f}M params"
              + (f" per rank (tensor_parallel={tp})" if tp > 1 else "")
              + f", {tg['layers']} layers, hidden {tg['hidden_size']}, vocab {tg['vocab']}")
    else:
        print(f"target   {tg['source']} ({tg.get('pending') or 'config.json not readable here'})")
    dr = p["drafter"]
    print(f"drafter  {dr['kind']}, {dr['num_layers']} layer(s), block_size {dr['block_size']} (anchor + "
          f"W={dr['block_size'] - 1} drafted tokens)")
    print(f"method   {p['method']}, {p['steps']} steps, output {p['output_dir']} (resume={p['resume']})")
    if p["roles"] == "split":
        print(f"workers  {p['workers']} target + {p['workers']} drafter x {p['backend']} (roles split)")
    else:
        tp = p.get("tensor_parallel", 1)
        print(f"workers  {p['workers']} x {p['backend']} ({p['roles']})"
              + (f", each target sharded over tensor_parallel={tp} ranks" if tp > 1 else ""))
    for pl in p["placement"]:
        print(f"  worker {pl['worker']} ({pl.get('role', 'all phases')}): device={pl['device']} cpus={pl['cpus']} "
              f"gpus={pl['gpus']}")
    ps = p["per_step"]
    print("kernels  " + ", ".join(f"{k}={v}" for k, v in p["kernels"].items()))
    print(f"per step {ps['sequences']} sequences ({ps['sequences_per_worker']}/worker), up to {ps['branches']} "
          f"branches, {ps['supervised_tokens']} supervised tokens")
    for note in p.get("notes", []):
        print(f"note     {note}")
    if p.get("_memory_plan") is not None:
        print("\n".join(format_plan(p["_memory_plan"])))


# ---------------------------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    missing = None
    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except MissingInitFrom as e:
        if not args.dry_run:
            return _fail(str(e))
        missing = e  # the plan of the recipe's drafter shape, saying the folder is missing and how to make it
        cfg = _load(args.recipe, [*args.overrides, "drafter.init_from=null"])
    except (RecipeError, FileNotFoundError) as e:
        return _fail(str(e))
    _check_json(args)
    if args.dry_run:
        check_loggers(cfg.trainer.loggers)  # as the run does first: a missing package names its extra
        cfg = drafter_as_loaded(cfg)  # drafter.init_from: checked, and the plan shows the drafter that trains
        try:
            p = plan(cfg)
        except (FileNotFoundError, ValueError, KeyError) as e:
            return _fail(f"cannot plan the run: {e}")
        if cfg.runtime.backend == "ray":
            folder = p["target"].get("source")
            if not cfg.model.is_tiny and folder and folder != cfg.model.target:  # a resolved model name
                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=folder))
            p = extend_plan(cfg, p)
        if missing is not None:
            p.setdefault("notes", []).append(f"{missing}; until then this plan is of a fresh drafter of the "
                                             f"recipe's shape, and `specopd train` refuses the recipe")
        _print_plan(p)
        if args.json:
            _write_json(args.json, {k: v for k, v in p.items() if not k.startswith("_")})
        return 0
    try:
        if cfg.pipeline.enabled:  # the main job: prepare target + data, warm up, train, evaluate, export
            summary = mainjob.run(cfg)
        else:
            summary = train(cfg)
    except (CheckpointError, NonFiniteError, RecipeChangeError, WorkerLostError, ClusterTooSmallError,
            EngineFailed) as e:
        if os.environ.get("SPECOPD_DEBUG"):
            raise
        return _fail(str(e), 1)  # the message names the cause, the checkpoint and the fix
    if args.json:
        _write_json(args.json, summary)
    return 0


def cmd_follow(args) -> int:
    """Follow a moving policy: swap each new version in, train on its rollouts, publish its drafter."""
    try:
        follow(args.recipe, args.overrides)
    except (CheckpointError, RecipeChangeError, WorkerLostError, ClusterTooSmallError) as e:
        if os.environ.get("SPECOPD_DEBUG"):
            raise
        return _fail(str(e), 1)
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args.recipe, args.overrides)
    _check_json(args)
    judge = eval_with_vllm if getattr(args, "engine", "builtin") == "vllm" else None
    rc = main_eval(cfg, args, judge=judge)
    return rc if isinstance(rc, int) else 0


def cmd_serve_check(args) -> int:
    return int(main_serve_check(args) or 0)


def cmd_prepare(args) -> int:
    rc = main_prepare([args.what] + list(args.rest))
    return rc if isinstance(rc, int) else 0


def cmd_profile(args) -> int:
    if not os.path.isdir(args.run_dir):
        return _fail(f"run folder {args.run_dir!r} " + ("is a file, not a folder" if os.path.exists(args.run_dir)
                                                        else "does not exist") + " (give a trainer.output_dir)")
    out = render(args.run_dir)
    if out is not None:
        print(json.dumps(out, indent=1, default=str))
    return 0


def _run_target(run_dir) -> str | None:
    """The target folder a run trained on (its recipe.yaml), for the printed serving commands."""
    path = os.path.join(run_dir, "recipe.yaml") if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    tgt = OmegaConf.to_container(OmegaConf.load(path)).get("model", {}).get("target")
    if isinstance(tgt, str) and tgt.startswith("tiny:"):
        return os.path.join(run_dir, "tiny-target-" + tgt[len("tiny:"):])
    return tgt


def resolve_export_source(src: str) -> tuple:
    """RUN_DIR (-> its newest complete checkpoint) | a checkpoint / drafter folder -> (folder, run_dir or None)."""
    if os.path.exists(src) and not os.path.isdir(src):
        raise MissingInputError(f"{src!r} is a file, not a folder (give a run folder, i.e. a trainer.output_dir, or "
                                f"a checkpoint / drafter folder: the folder holding config.json + model.safetensors)")
    if not os.path.isdir(src):
        raise MissingInputError(f"{src!r} does not exist (give a run folder, i.e. a trainer.output_dir, or a "
                                f"checkpoint / drafter folder)")
    if os.path.isfile(os.path.join(src, "config.json")):
        parent = os.path.dirname(os.path.abspath(src))
        run = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None
        return src, run
    if os.path.isdir(os.path.join(src, "checkpoints")):
        ck = find_latest(src)
        if ck is None:
            raise MissingInputError(f"run {src!r} has no complete checkpoint yet (checkpoints/step-N with a COMPLETE "
                                    f"marker); train longer or give a checkpoint folder")
        return ck, src
    raise MissingInputError(f"{src!r} is neither a run folder (no checkpoints/) nor a drafter folder (no config.json)")


def check_source(src: str, run) -> None:
    """A damaged checkpoint (files against its manifest, with checksums) is refused, naming it and the newest
    checkpoint of its run that verifies."""
    if not os.path.isfile(os.path.join(src, MARKER)):
        return  # a released / drafter folder: load_drafter / export_folder check what it has
    why = verify(src)
    if why is None:
        return
    good = newest_good(run) if run else None
    raise DamagedFolderError(f"checkpoint {src} is damaged: {why}. " + (
        f"The newest checkpoint of the run that verifies is {good}: give that one" if good else
        "No other checkpoint of its run verifies: train again (trainer.resume=auto moves the damaged one aside)"))


def cmd_export(args) -> int:
    """RUN_DIR (its newest complete checkpoint) | CHECKPOINT | released folder -> the released layout."""
    src, run = resolve_export_source(args.source)
    if args.max_shard_gb <= 0 or args.max_shard_gb != args.max_shard_gb:
        return _fail(f"--max-shard-gb must be a number > 0; got {args.max_shard_gb}")
    why = dir_problem(args.out_dir)
    if why is not None:
        raise BadInputError(f"export folder {args.out_dir!r} cannot be written: {why}; give a new or empty folder")
    check_source(src, run)
    if is_mtp_folder(src):  # the export carries the target's embedding and lm_head: read from the target's folder
        tdir = args.target or _run_target(run)
        if not tdir or not os.path.isdir(tdir):
            raise BadInputError(f"{src} holds an MTP head, whose export (what vLLM's method mtp loads) carries the "
                                f"target's embedding and lm_head: give --target TARGET_DIR (the target's folder)")
        config = export_mtp_folder(src, tdir, args.out_dir, dtype=DTYPES[args.dtype] if args.dtype else None,
                                   force=args.force)
        print(describe_mtp_export(src, args.out_dir, config, tdir))
        return 0
    try:
        cfg = export_folder(src, args.out_dir, dtype=DTYPES[args.dtype] if args.dtype else None,
                            max_shard_bytes=int(args.max_shard_gb * 1024 ** 3), force=args.force)
    except (PermissionError, IsADirectoryError, NotADirectoryError) as e:  # the folder refused a write
        raise BadInputError(f"export folder {args.out_dir!r} cannot be written: {e.strerror} ({e.filename}); give "
                            f"a writable folder") from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            raise
        raise BadInputError(f"export folder {args.out_dir!r} cannot be written: {e.strerror}; free space or give "
                            f"another folder (a partial export may be left there)") from None
    print(describe_export(src, args.out_dir, cfg, args.target or _run_target(run)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specopd", description="On-policy drafter training without rollouts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a drafter from a recipe")
    tr.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny.yaml")
    tr.add_argument("overrides", nargs="*", help="section.key=value overrides (e.g. trainer.max_steps=10)")
    tr.add_argument("--dry-run", action="store_true", help="validate the recipe and print the plan; no training")
    tr.add_argument("--json", help="write the plan (--dry-run) or the run summary to this file")
    tr.set_defaults(fn=cmd_train)
    fo = sub.add_parser("follow", help="keep a drafter next to a moving policy (an RL run): watch policy versions "
                                       "and rollouts, train, publish per version")
    fo.add_argument("recipe", help="YAML recipe with a follow: section, e.g. recipes/tiny-follow.yaml")
    fo.add_argument("overrides", nargs="*", help="section.key=value overrides (e.g. follow.policies=DIR)")
    fo.set_defaults(fn=cmd_follow)
    ev = sub.add_parser("eval", help="speculative decoding with a trained drafter (acceptance length)")
    ev.add_argument("recipe")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--json", help="write the results to this file")
    ev.add_argument("--no-baseline", action="store_true", help="skip the autoregressive timing")
    ev.add_argument("--block-size", type=int, default=None, help="verify only the first k draft tokens")
    ev.add_argument("--prompts", default=None, help="prompts file: JSONL with 'prompt' or chat 'messages', or plain "
                                                    "text (one prompt a line); the target's chat template applies")
    ev.add_argument("--temperatures", default=None, help="comma-separated decoding temperatures, e.g. 0,1 "
                                                         "(default: eval.decode_temperature)")
    ev.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                    help="vllm: serve the drafter in vLLM (its own venv, `make vllm`) and report its counters next to "
                         "ours (specopd.eval.engine)")
    ev.add_argument("--bench", default=None, choices=["mt-bench"],
                    help="mt-bench: MT-Bench's 80 questions, AL per category too (instead of held-out prompts)")
    ev.add_argument("--turn", type=int, default=1, choices=[1, 2],
                    help="with --bench: 2 = second turns, after the target's own greedy first answer")
    ev.set_defaults(fn=cmd_eval)
    sc = sub.add_parser("serve-check", help="serve an exported drafter in vLLM and check it against ours")
    sc.add_argument("export", help="a `specopd export` folder (or a checkpoint folder: exported first)")
    sc.add_argument("--target", required=True, help="the target's Hugging Face folder")
    sc.add_argument("--checkpoint", default=None, help="the checkpoint the export came from: the export must hold "
                                                      "exactly its drafter")
    sc.add_argument("--prompts", default=None, help="prompts file (JSONL or text); default: held-out chat prompts")
    sc.add_argument("--num", type=int, default=8, help="prompts (default 8)")
    sc.add_argument("--max-new-tokens", type=int, default=32)
    sc.add_argument("--temperatures", default="0,1")
    sc.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32: the counts must agree exactly at T=0")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--vllm-default", action="store_true", help="also vLLM's default argmax drafts at T > 0")
    sc.add_argument("--work-dir", default=None, help="where the requests, outputs and vLLM logs go (default: a tmp dir)")
    sc.add_argument("--json", default=None, help="write the report here")
    sc.set_defaults(fn=cmd_serve_check)
    pr = sub.add_parser("prepare", help="prepare a model (`prepare model NAME`) or data (`prepare data ...`)")
    pr.add_argument("what", choices=["model", "data"])
    pr.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the prepare step (see `specopd prepare model|data -h`)")
    pr.set_defaults(fn=cmd_prepare)
    ex = sub.add_parser("export", help="write a trained drafter in the released DFlash layout (vLLM / SGLang)")
    ex.add_argument("source", help="run folder (trainer.output_dir: its newest complete checkpoint), a checkpoint "
                                   "step folder, or a drafter folder")
    ex.add_argument("out_dir", help="empty folder to write config.json + safetensors into")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="weights dtype (default: as trained)")
    ex.add_argument("--target", default=None, help="target model path for the printed serving commands "
                                                  "(default: the run's recipe)")
    ex.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into shards of this size")
    ex.add_argument("--force", action="store_true", help="write into a folder that holds other files (its "
                                                        "drafter files are replaced, the rest kept)")
    ex.set_defaults(fn=cmd_export)
    pf = sub.add_parser("profile", help="render profile outputs (trace.json, timeline.png, summary.json)")
    pf.add_argument("run_dir")
    pf.set_defaults(fn=cmd_profile)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    # overrides given after an option (``--dry-run a.b=c``) end up in extra: take them back
    bad = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        with stop_on_signals():  # SIGTERM, SIGHUP: as Ctrl-C (checkpoint, shutdown), exit 128 + the signal
            return int(args.fn(args) or 0)
    except (UserError, EngineUnavailable) as e:  # a user's mistake (specopd.errors), an engine that cannot run
        # here (no vLLM venv, no server listening): the message names the cause and the fix
        if os.environ.get("SPECOPD_DEBUG"):
            raise
        return _fail(str(e))
    except (FileNotFoundError, ValueError) as e:  # bad input: say what and how to fix it, no traceback
        if os.environ.get("SPECOPD_DEBUG"):
            raise
        return _fail(f"{type(e).__name__}: {e}  (SPECOPD_DEBUG=1 shows the traceback)")
    except SystemExit as e:
        if isinstance(e.code, str):  # raise SystemExit("message"): a refusal worded for the user
            print(f"specopd: error: {e.code}", file=sys.stderr)
        return int(e.code or 0) if isinstance(e.code, int) else 2
    except KeyboardInterrupt as e:
        stop = stopped_by(e)  # SIGTERM, SIGHUP
        return _fail(f"interrupted by {stop}", stop.exit_code) if stop else _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
