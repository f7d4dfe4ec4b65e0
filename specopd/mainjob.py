"""The main job: ``specopd train recipes/smollm2-135m-dflash.yaml`` (a recipe with ``pipeline.enabled``).

``specopd.train.loop.train`` hands such a recipe to ``run(cfg)``, which does, each stage cached:

1. target      ``model.target`` names a `specopd prepare model` target (smollm2-135m): converted once into
               $SPECOPD_CACHE/models/<name> (or an existing Hugging Face folder is used as is)
2. references  the first ``pipeline.data_num`` chitchat prompts answered by the target itself
               (`specopd prepare data`, resumable) into $SPECOPD_CACHE/data/chitchat-<name>-t<tokens>; the
               *train* split is written to ``data.path`` for the trainer; held-out prompts = the data's
               held-out split plus unseen chitchat prompts (never trained on)
3. warm-up     a drafter trained with off-policy CE for ``pipeline.warmup_steps`` (skipped when
               <output_dir>/warmup already holds that checkpoint)
4. train       ``trainer.method`` (SpecOPD) from the warm drafter, on ``runtime`` (Ray: 2 workers x 1 CPU)
5. evaluate    speculative decoding (``specopd.eval.evaluate_al``) of the held-out prompts with the warm and
               the trained drafter: a table of acceptance length (incl. the bonus token) before / after;
               the profile figures of step 4 are in <output_dir>/profile/

Writes <output_dir>/mainjob_summary.json (stage wall times, the table's numbers).
"""
from __future__ import annotations

import copy
import json
import os
import time


def _stage(name: str):
    print(f"\n[specopd] == {name}", flush=True)
    return time.perf_counter()


def _target_dir(name: str) -> str:
    from specopd.data.prepare import MODELS

    if os.path.isdir(name):
        return name
    if name in MODELS:
        return MODELS[name](verbose=True)
    raise FileNotFoundError(f"model.target={name!r} is neither a folder nor a target `specopd prepare model` "
                            f"knows ({sorted(MODELS)})")


def _references(cfg, target_dir: str) -> tuple:
    """(reference folder, chitchat prompts used) with the first data_num prompts answered."""
    from specopd.data.prepare import prepare_data
    from specopd.data.references import DATA_FILE, chitchat_prompts, read_records
    from specopd.data.smollm2 import cache_root

    pl = cfg.pipeline
    name = os.path.basename(os.path.normpath(target_dir))
    ref_dir = os.path.join(cache_root(), "data", f"chitchat-{name}-t{pl.data_max_new_tokens}")
    prompts = chitchat_prompts()
    want = {pid for pid, _ in prompts[: pl.data_num]}
    have = {r["id"] for r in read_records(os.path.join(ref_dir, DATA_FILE))}
    if want - have:
        print(f"[specopd] regenerating {len(want - have)} of {len(want)} chitchat responses with the target "
              f"(cached in {ref_dir}; an interrupted run resumes)", flush=True)
        dev = "cpu" if cfg.model.device == "auto" else cfg.model.device
        prepare_data(target_dir, ref_dir, None, pl.data_num, pl.data_max_new_tokens, temperature=1.0, top_p=1.0,
                     seed=0, heldout_fraction=0.1, device=dev, dtype=cfg.model.dtype, batch_size=16)
    else:
        print(f"[specopd] references cached in {ref_dir} ({len(want)} prompts)")
    return ref_dir, prompts


def _write_train_split(ref_dir: str, want: set, path: str) -> tuple:
    """Train-split records of the wanted prompts -> ``path`` (the trainer's prepared data). Returns
    (train count, held-out records)."""
    from specopd.data.references import DATA_FILE, read_records

    recs = [r for r in read_records(os.path.join(ref_dir, DATA_FILE)) if r["id"] in want]
    train = [r for r in recs if r.get("split", "train") == "train"]
    held = [r for r in recs if r.get("split") == "heldout"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for r in train:
            f.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"],
                                "prompt_len": int(r.get("response_start", r["prompt_len"]))}) + "\n")
    os.replace(tmp, path)
    return len(train), held


def _heldout_prompts(cfg, target_dir, held: list, prompts: list, vocab: int) -> list:
    """cfg.eval.prompts prompt-id tensors: the data's held-out prompts, then unseen chitchat prompts."""
    import torch

    out = [torch.tensor(r["input_ids"][: int(r.get("response_start", r["prompt_len"]))]) for r in held]
    if len(out) < cfg.eval.prompts:
        from specopd.data.prepare import encode_prompt, load_tokenizer

        tok = load_tokenizer(target_dir, vocab)
        for _, msgs in prompts[cfg.pipeline.data_num:]:
            if len(out) >= cfg.eval.prompts:
                break
            ids = encode_prompt(tok, msgs)
            if len(ids) <= 96:  # short chat prompts keep the CPU evaluation quick
                out.append(torch.tensor(ids))
    return out[: cfg.eval.prompts]


def pipeline_heldout_prompts(cfg, target_dir: str, vocab: int) -> list:
    """The main job's held-out prompts (what its before/after table measures), for ``specopd eval``."""
    from specopd.data.references import DATA_FILE, read_records

    ref_dir, prompts = _references(cfg, target_dir)  # cached after the first run
    want = {pid for pid, _ in prompts[: cfg.pipeline.data_num]}
    held = [r for r in read_records(os.path.join(ref_dir, DATA_FILE)) if r["id"] in want
            and r.get("split") == "heldout"]
    return _heldout_prompts(cfg, target_dir, held, prompts, vocab)


def _sub(cfg, **kw):
    """A copy of cfg with section.key overrides given as section__key=value; pipeline off."""
    c = copy.deepcopy(cfg)
    c.pipeline.enabled = False
    for k, v in kw.items():
        sec, key = k.split("__")
        setattr(getattr(c, sec), key, v)
    return c


def run(cfg, progress: bool = True) -> dict:
    import torch

    from specopd.train.checkpoint import complete_checkpoints, find_latest
    from specopd.train.loop import train

    t_all = time.perf_counter()
    out = cfg.trainer.output_dir
    os.makedirs(out, exist_ok=True)
    times = {}

    t0 = _stage(f"1/5 target {cfg.model.target}")
    target_dir = _target_dir(cfg.model.target)
    times["target"] = time.perf_counter() - t0

    t0 = _stage(f"2/5 references: {cfg.pipeline.data_num} chitchat prompts x <= {cfg.pipeline.data_max_new_tokens} "
                f"tokens answered by the target")
    ref_dir, prompts = _references(cfg, target_dir)
    want = {pid for pid, _ in prompts[: cfg.pipeline.data_num]}
    n_train, held = _write_train_split(ref_dir, want, cfg.data.path)
    print(f"[specopd] {n_train} training references -> {cfg.data.path}; {len(held)} held-out")
    times["references"] = time.perf_counter() - t0

    warm = None
    t0 = _stage(f"3/5 warm-up: off-policy CE, {cfg.pipeline.warmup_steps} steps")
    if cfg.pipeline.warmup_steps > 0:
        wout = os.path.join(out, "warmup")
        done = [s for s, _ in complete_checkpoints(wout)]
        if done and max(done) >= cfg.pipeline.warmup_steps:
            print(f"[specopd] warm drafter exists: {find_latest(wout)}")
        else:
            train(_sub(cfg, model__target=target_dir, trainer__method="offpolicy_ce", trainer__output_dir=wout,
                       trainer__max_steps=cfg.pipeline.warmup_steps, trainer__save_every=0,
                       trainer__lr=cfg.pipeline.warmup_lr,
                       trainer__eval_heldout=False, trainer__warmup_steps=min(cfg.trainer.warmup_steps,
                                                                              cfg.pipeline.warmup_steps),
                       profile__enabled=False), progress=progress)
        warm = find_latest(wout)
    times["warmup"] = time.perf_counter() - t0

    t0 = _stage(f"4/5 train: {cfg.trainer.method}, {cfg.trainer.max_steps} steps on {cfg.runtime.backend} "
                f"({cfg.runtime.num_workers} workers)")
    main_cfg = _sub(cfg, model__target=target_dir)
    if warm is not None:
        main_cfg.drafter.init_from = warm
    summary = train(main_cfg, progress=progress)
    final = find_latest(out)
    times["train"] = time.perf_counter() - t0

    t0 = _stage(f"5/5 held-out speculative decoding ({cfg.eval.prompts} prompts x {cfg.eval.max_new_tokens} tokens, "
                f"T={cfg.eval.temperature:g})")
    from specopd.data.prepare import load_tokenizer, stop_token_ids
    from specopd.drafters import build_drafter, load_drafter
    from specopd.eval.cli import evaluate_al
    from specopd.models import load_target
    from specopd.models.loading import resolve_dtype

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target = load_target(target_dir, dtype=resolve_dtype(cfg.model.dtype), device="cpu", kernels=cfg.model.kernels)
    eval_prompts = _heldout_prompts(cfg, target_dir, held, prompts, target.vocab_size)
    stops = sorted(stop_token_ids(load_tokenizer(target_dir, target.vocab_size), target))
    rows = []
    if warm is not None:
        rows.append((f"before: off-policy CE warm-up ({cfg.pipeline.warmup_steps} steps)", warm))
    else:
        rows.append(("before: untrained drafter", None))
    rows.append((f"after: + {cfg.trainer.method} ({summary['steps']} steps, {cfg.runtime.backend} x "
                 f"{cfg.runtime.num_workers})", final))
    results = []
    for label, path in rows:
        d = load_drafter(path, target) if path else build_drafter(
            cfg.drafter.kind, target, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
            seed=cfg.seed, feature_layers=cfg.drafter.feature_layers, mask_token_id=cfg.drafter.mask_token_id,
            target_dir=target_dir)
        r = evaluate_al(target, d, eval_prompts, cfg.eval.max_new_tokens, cfg.eval.temperature, seed=cfg.eval.seed,
                        stop_token_ids=stops, progress=progress)
        results.append({"drafter": label, "checkpoint": path, **{k: r[k] for k in (
            "mean_al", "rounds", "new_tokens", "per_position_acceptance", "spec_tokens_per_s", "times")}})
    times["eval"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_all

    w = cfg.drafter.block_size - 1  # W drafted tokens
    print(f"\nHeld-out acceptance length (AL = tokens committed per target verification round, incl. the bonus "
          f"token; max {w + 1})\n{len(eval_prompts)} chitchat prompts never trained on, {cfg.eval.max_new_tokens} new "
          f"tokens each, T={cfg.eval.temperature:g}{' (greedy: exact match)' if cfg.eval.temperature == 0 else ''}, "
          f"{cfg.drafter.kind} W={w}, target {os.path.basename(target_dir)}")
    print(f"{'drafter':<52}{'AL':>7}{'rounds':>8}  accept rate at draft position 1..W")
    for r in results:
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"{r['drafter']:<52}{r['mean_al']:>7.3f}{r['rounds']:>8}  {acc}")
    print(f"\nprofile: {os.path.join(out, 'profile')}/timeline.png, trace.json, summary.json")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    res = {"table": results, "times_s": times, "train_summary": summary, "references": ref_dir,
           "eval_prompts": len(eval_prompts), "al_includes_bonus": True}
    with open(os.path.join(out, "mainjob_summary.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res
