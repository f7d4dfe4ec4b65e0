"""``specopd`` command line.

    specopd train RECIPE [key=value ...] [--dry-run]
    specopd eval RECIPE [key=value ...] [--json PATH]
    specopd prepare model NAME | specopd prepare data ...
    specopd profile RUN_DIR

Overrides are ``section.key=value`` (e.g. ``trainer.max_steps=10 seed=3``). ``train`` is implemented
here (specopd.train.loop); eval, prepare and profile dispatch to their owners' modules, imported lazily.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


def _fail(msg: str, code: int = 2) -> int:
    print(f"specopd: error: {msg}", file=sys.stderr)
    return code


def _load(recipe: str, overrides: list):
    from specopd.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe, overrides)
    except (RecipeError, FileNotFoundError) as e:
        raise SystemExit(_fail(str(e)))


def _lazy(module: str, func: str):
    """Import module.func; a clear 'not built yet' error (exit 2) when the module does not exist."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise SystemExit(_fail(f"{module} is not built yet (this command needs {module}.{func})"))
        raise
    if not hasattr(mod, func):
        raise SystemExit(_fail(f"{module}.{func} is not built yet"))
    return getattr(mod, func)


# ---------------------------------------------------------------------------------------------- the plan
def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def estimate_params(c: dict) -> int:
    """Target parameter count from config.json alone (dense attention + MLP / MoE; approximate for
    GDN / QSA extras). No weights are read."""
    d, L, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    h = c.get("num_attention_heads", 1)
    hd = c.get("head_dim") or d // h
    kv = c.get("num_key_value_heads", h)
    attn = d * hd * (2 * h + 2 * kv)
    if c.get("num_experts"):
        mlp = c["num_experts"] * 3 * d * c.get("moe_intermediate_size", 0) + 3 * d * (
            c.get("shared_expert_intermediate_size") or 0)
    else:
        mlp = 3 * d * c.get("intermediate_size", 4 * d)
    emb = v * d * (1 if c.get("tie_word_embeddings") else 2)
    return int(L * (attn + mlp + 2 * d) + emb + d)


def plan(cfg) -> dict:
    """What a run would do, from the recipe and the target's config.json (no weights loaded)."""
    from specopd.models.loading import read_config, resolve_dtype
    from specopd.train.tiny import _tiny_config

    m, r, t, d = cfg.model, cfg.runtime, cfg.trainer, cfg.data
    notes = []
    if m.is_tiny:
        tcfg, _ = _tiny_config(m.target[len("tiny:"):], dict(m.tiny))
        where = f"built on the fly under {os.path.join(t.output_dir, 'tiny-target-' + m.target[5:])}"
    else:
        where = m.target
        folder = m.target
        if not os.path.isdir(folder):  # a `specopd prepare model` name (e.g. smollm2-135m), once prepared
            try:
                from specopd.data.smollm2 import MODEL_NAME, default_model_dir, is_prepared

                if folder == MODEL_NAME and is_prepared(default_model_dir()):
                    folder = where = default_model_dir()
            except ImportError:
                pass
        try:
            tcfg = read_config(folder)
        except FileNotFoundError as e:
            tcfg = None
            notes.append(f"no memory estimate: {e}")
    if d.source == "prepared" and not os.path.exists(d.path):
        notes.append(f"data.path={d.path!r} does not exist yet (run `specopd prepare data ...` before training)")
    if tcfg is None:
        return {"target": {"model_type": None, "source": where}, "method": t.method, "notes": notes,
                "drafter": {"kind": cfg.drafter.kind, "num_layers": cfg.drafter.num_layers,
                            "block_size": cfg.drafter.block_size},
                "workers": r.num_workers, "backend": r.backend, "roles": r.roles,
                "placement": _placement(r, m.device),
                "per_step": {"sequences": d.batch_size, "sequences_per_worker": -(-d.batch_size // r.num_workers),
                             "branches": d.batch_size * t.anchors_per_seq,
                             "supervised_tokens": d.batch_size * t.anchors_per_seq * cfg.drafter.block_size},
                "memory_estimate_per_worker_bytes": None, "steps": t.max_steps, "output_dir": t.output_dir,
                "resume": t.resume}
    bpe = {"float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    _ = resolve_dtype(m.dtype)
    n_params = estimate_params(tcfg)
    w, b = cfg.drafter.block_size, t.anchors_per_seq
    seq = d.seq_len
    hid, layers, vocab = tcfg["hidden_size"], tcfg["num_hidden_layers"], tcfg["vocab_size"]
    per_worker_batch = -(-d.batch_size // r.num_workers)
    kv = 2 * layers * seq * tcfg.get("num_key_value_heads", tcfg.get("num_attention_heads", 1)) * (
        tcfg.get("head_dim") or hid // tcfg.get("num_attention_heads", 1)) * bpe
    logits = (seq + b * w) * vocab * 4  # trunk logits + branch p, fp32
    act = per_worker_batch * (kv + logits)
    return {
        "target": {"model_type": tcfg.get("model_type"), "source": where, "params": n_params,
                   "weights_bytes": n_params * bpe, "hidden_size": hid, "layers": layers, "vocab": vocab},
        "method": t.method, "drafter": {"kind": cfg.drafter.kind, "num_layers": cfg.drafter.num_layers,
                                        "block_size": w},
        "workers": r.num_workers, "backend": r.backend, "roles": r.roles,
        "placement": _placement(r, m.device),
        "per_step": {"sequences": d.batch_size, "sequences_per_worker": per_worker_batch,
                     "branches": d.batch_size * b, "supervised_tokens": d.batch_size * b * w},
        "memory_estimate_per_worker_bytes": {"target_weights": n_params * bpe,
                                             "trunk_caches_and_logits": act,
                                             "total": n_params * bpe + act},
        "steps": t.max_steps, "output_dir": t.output_dir, "resume": t.resume, "notes": notes,
    }


def _placement(r, device: str) -> list:
    """One entry per worker; runtime.roles=split: a drafter worker and a target worker per pair."""
    roles = ["drafter", "target"] if r.roles == "split" else ["prefill+propose+score+update"]
    return [{"worker": i, "role": role, "device": device, "cpus": r.cpus_per_worker, "gpus": r.gpus_per_worker}
            for role in roles for i in range(r.num_workers)]


def _print_plan(p: dict) -> None:
    tg = p["target"]
    if tg.get("params") is not None:
        print(f"target   {tg['model_type']} ({tg['source']}): {tg['params'] / 1e6:.2f}M params, "
              f"{tg['layers']} layers, hidden {tg['hidden_size']}, vocab {tg['vocab']}")
    else:
        print(f"target   {tg['source']} (config.json not readable here)")
    dr = p["drafter"]
    print(f"drafter  {dr['kind']}, {dr['num_layers']} layer(s), block W={dr['block_size']}")
    print(f"method   {p['method']}, {p['steps']} steps, output {p['output_dir']} (resume={p['resume']})")
    if p["roles"] == "split":
        print(f"workers  {p['workers']} target + {p['workers']} drafter x {p['backend']} (roles split)")
    else:
        print(f"workers  {p['workers']} x {p['backend']} ({p['roles']})")
    for pl in p["placement"]:
        print(f"  worker {pl['worker']} ({pl.get('role', 'all phases')}): device={pl['device']} cpus={pl['cpus']} "
              f"gpus={pl['gpus']}")
    ps = p["per_step"]
    print(f"per step {ps['sequences']} sequences ({ps['sequences_per_worker']}/worker), up to {ps['branches']} "
          f"branches, {ps['supervised_tokens']} supervised tokens")
    mem = p["memory_estimate_per_worker_bytes"]
    for note in p.get("notes", []):
        print(f"note     {note}")
    if mem is None:
        return
    print(f"memory   per worker ~{_human(mem['total'])} (weights {_human(mem['target_weights'])}, trunk caches + "
          f"logits {_human(mem['trunk_caches_and_logits'])})")


# ---------------------------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    cfg = _load(args.recipe, args.overrides)
    if args.dry_run:
        try:
            p = plan(cfg)
        except (FileNotFoundError, ValueError, KeyError) as e:
            return _fail(f"cannot plan the run: {e}")
        extend = None
        if cfg.runtime.backend == "ray":
            try:
                extend = getattr(importlib.import_module("specopd.distributed.ray_backend"), "extend_plan", None)
            except ModuleNotFoundError:
                extend = None
        if extend is not None:
            folder = p["target"].get("source")
            if not cfg.model.is_tiny and folder and folder != cfg.model.target:  # a resolved model name
                import dataclasses

                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=folder))
            p = extend(cfg, p)
        _print_plan(p)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(p, f, indent=1)
        return 0
    pipe = getattr(cfg, "pipeline", None)
    if pipe is not None and pipe.enabled:  # the main job: prepare target + data, warm up, train, evaluate
        summary = _lazy("specopd.mainjob", "run")(cfg)
    else:
        from specopd.train.loop import train

        summary = train(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args.recipe, args.overrides)
    fn = _lazy("specopd.eval.cli", "main_eval")
    rc = fn(cfg, args)
    return rc if isinstance(rc, int) else 0


def cmd_prepare(args) -> int:
    fn = _lazy("specopd.data.prepare", "main")
    rc = fn([args.what] + list(args.rest))
    return rc if isinstance(rc, int) else 0


def cmd_profile(args) -> int:
    if not os.path.isdir(args.run_dir):
        return _fail(f"run folder {args.run_dir!r} does not exist (give a trainer.output_dir)")
    fn = _lazy("specopd.profiling", "render")
    out = fn(args.run_dir)
    if out is not None:
        print(json.dumps(out, indent=1, default=str))
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
    ev = sub.add_parser("eval", help="speculative decoding with a trained drafter (acceptance length)")
    ev.add_argument("recipe")
    ev.add_argument("overrides", nargs="*")
    ev.add_argument("--json", help="write the results to this file")
    ev.add_argument("--no-baseline", action="store_true", help="skip the autoregressive timing")
    ev.add_argument("--block-size", type=int, default=None, help="verify only the first k draft tokens")
    ev.add_argument("--prompts", default=None, help="prompts file: JSONL with 'prompt' or chat 'messages', or plain "
                                                    "text (one prompt a line); the target's chat template applies")
    ev.add_argument("--temperatures", default=None, help="comma-separated decoding temperatures, e.g. 0,1 "
                                                         "(default: eval.temperature)")
    ev.set_defaults(fn=cmd_eval)
    pr = sub.add_parser("prepare", help="prepare a model (`prepare model NAME`) or data (`prepare data ...`)")
    pr.add_argument("what", choices=["model", "data"])
    pr.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the prepare step (see `specopd prepare model|data -h`)")
    pr.set_defaults(fn=cmd_prepare)
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
        return int(args.fn(args) or 0)
    except (FileNotFoundError, ValueError) as e:  # bad input: say what and how to fix it, no traceback
        if os.environ.get("SPECOPD_DEBUG"):
            raise
        return _fail(f"{type(e).__name__}: {e}  (SPECOPD_DEBUG=1 shows the traceback)")
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        return _fail("interrupted (a checkpoint of the completed steps was written)", 130)


if __name__ == "__main__":
    sys.exit(main())
