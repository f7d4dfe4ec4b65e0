"""The main job (a recipe with ``pipeline.enabled``): target, references, warm-up, SpecOPD training, held-out
evaluation and export, each stage cached or resumable. Stages: specopd/DESIGN.md ("The main job").
"""
from __future__ import annotations

import copy
import filecmp
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from specopd.config import CE_TERM_METHODS, auto_dtype
from specopd.data.conversations import pretrain_chat_prompts, train_chat_prompts
from specopd.data.packaged import conversations_file
from specopd.data.prepare import ERRORS_FILE, MODELS, load_tokenizer, prepare_data, stop_token_ids
from specopd.data.references import DATA_FILE, read_records
from specopd.data.smollm2 import cache_root
from specopd.drafters import build_drafter, load_drafter
from specopd.drafters.layout import describe_export, export_folder
from specopd.engines import EngineFailed, auto_engine
from specopd.errors import open_write, remove_path, replacing
from specopd.eval.bench import by_category, format_categories, provenance_line, run_prompts
from specopd.eval.cli import acceptance_cells, evaluate_al
from specopd.eval.engine import judge_rows, torch_threads
from specopd.eval.replay import greedy_continuations, replay_greedy_al
from specopd.models import load_target
from specopd.models.loading import check_device, read_config, resolve_dtype
from specopd.runs.checkpoint import complete_checkpoints, find_latest
from specopd.runs.lock import run_lock
from specopd.train.loop import train


def _stage(name: str):
    print(f"\n[specopd] == {name}", flush=True)
    return time.perf_counter()


@dataclass(frozen=True)
class Prepared:
    """What stages 1-3 hand the later ones (paths, never the recipe): the target's folder, the trainer's data and
    the starting drafter."""
    target_dir: str
    """The target's Hugging Face folder (stage 1)."""
    references: str
    """Where the trunks come from (stage 2): the references' folder, or the conversations file."""
    train_data: str
    """The trainer's data (``data.path`` of the training stages)."""
    warm: Optional[str]
    """The starting drafter's folder (stage 3: the warm-up's checkpoint or ``drafter.init_from``); None: fresh."""
    num_references: int = 0
    reference_tokens: Optional[int] = None
    times: dict = field(default_factory=dict, compare=False)
    """Wall seconds per stage."""


def target_stage(model) -> str:
    """Stage 1 -> the target's folder; ``model``: the recipe's model section (``model.target``: a folder, or a
    `specopd prepare model` name, converted once)."""
    name = model.target
    if os.path.isdir(name):
        return name
    if name in MODELS:
        return MODELS[name](verbose=True)
    raise FileNotFoundError(f"model.target={name!r} is neither a folder nor a target `specopd prepare model` "
                            f"knows ({sorted(MODELS)})")


def reference_prompts(pl, tok) -> list:
    """The train chat prompts the references answer: the first ``pipeline.data_num`` of ``pipeline.data_prompts``
    (``train_chat_prompts`` or ``pretrain_chat_prompts``), in that order; ``pl``: the recipe's pipeline section,
    ``tok``: the target's tokenizer."""
    pick = train_chat_prompts if pl.data_prompts == "first_turns" else pretrain_chat_prompts
    return pick(pl.data_num, tokenizer=tok)


def _references(pl, model, target_dir: str, kernel_paths=None) -> tuple:
    """-> (reference folder, records of the wanted prompts): the first data_num distinct train prompts answered
    by the target (generated once, cached; a larger data_num generates only the new ones) with
    ``pipeline.data_engine`` (auto: vLLM when its venv is there). ``pl``, ``model``, ``kernel_paths``: the recipe's
    pipeline, model and kernels sections."""
    engine, why = auto_engine() if pl.data_engine == "auto" else (pl.data_engine, "pipeline.data_engine")
    name = os.path.basename(os.path.normpath(target_dir))
    kind = {"first_turns": "train", "all_turns": "train-turns"}[pl.data_prompts]
    # vLLM answers in bf16 where bf16 is native, else in fp32 (emulated bf16 is far slower than fp32 on an AVX2
    # CPU); builtin in model.dtype. Folder names of earlier runs kept: builtin none, vLLM bf16 "-vllm".
    ref_dtype = model.dtype if engine == "builtin" else auto_dtype(model.device)
    suffix = "" if engine == "builtin" else f"-{engine}" + ("" if ref_dtype == "bfloat16" else f"-{ref_dtype}")
    ref_dir = os.path.join(cache_root(), "data", f"chitchat-{kind}-{name}-t{pl.data_max_new_tokens}-"
                                                 f"T{pl.data_temperature:g}{suffix}")
    tok = load_tokenizer(target_dir, int(read_config(target_dir)["vocab_size"]))
    prompts = reference_prompts(pl, tok)
    want = {pid for pid, _ in prompts}
    have = {r["id"] for r in read_records(os.path.join(ref_dir, DATA_FILE))}
    if want - have:
        print(f"[specopd] the target answers {len(want - have)} of {len(want)} chat prompts (<= "
              f"{pl.data_max_new_tokens} tokens, T={pl.data_temperature:g}) with the {engine} engine ({why}); "
              f"cached in {ref_dir}, an interrupted run resumes", flush=True)
        dev = "cpu" if model.device == "auto" else model.device
        label = {"first_turns": "chitchat-train-distinct", "all_turns": "chitchat-train-turns"}[pl.data_prompts]
        counts = prepare_data(target_dir, ref_dir, prompts=prompts, prompts_label=label,
                              max_new_tokens=pl.data_max_new_tokens, temperature=pl.data_temperature, top_p=1.0,
                              seed=0, heldout_fraction=0.0, device=dev, dtype=ref_dtype,
                              batch_size=pl.data_batch_size, engine=engine, kernel_paths=kernel_paths)
        if counts["failed"]:  # training on part of the prompts would be another run than the recipe asks for
            raise EngineFailed(f"the {engine} engine failed on {counts['failed']} of {len(want)} prompts (listed in "
                               f"{os.path.join(ref_dir, ERRORS_FILE)}); rerun the same command to retry them (the "
                               f"answered ones are kept), or set pipeline.data_engine=builtin")
    else:
        print(f"[specopd] references cached in {ref_dir} ({len(want)} prompts)")
    recs = [r for r in read_records(os.path.join(ref_dir, DATA_FILE)) if r["id"] in want]
    return ref_dir, recs


def _write_train_data(recs: list, path: str) -> None:
    """Reference records -> ``path`` (the trainer's prepared JSONL: input_ids + prompt_len), atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as f:
        for r in recs:
            f.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"],
                                "prompt_len": int(r.get("response_start", r["prompt_len"]))}) + "\n")


def training_recipe(cfg):
    """The recipe the training stages take: a copy of the main recipe with its pipeline off, a plain training
    recipe (the pipeline's keys stay, inert, so that each checkpoint records the job it came from)."""
    c = copy.deepcopy(cfg)
    c.pipeline.enabled = False
    return c


def stage_cfg(run, prep: Prepared, **kw):
    """The recipe of one training stage: ``training_recipe`` ``run`` (a main recipe is turned into one) on the
    prepared target and data, the drafter initialised from the starting drafter (``prep.warm``, if any), and
    ``kw`` as trainer overrides (e.g. method=..., output_dir=..., max_steps=..., lr=...). A stage whose method takes
    no CE term (off-policy CE, Draft-OPD: ``CE_TERM_METHODS``) trains with ``trainer.ce_weight`` 0 (and reference
    labels, so that its recorded recipe loads again)."""
    c = training_recipe(run)
    c.model.target = prep.target_dir
    c.data.path = prep.train_data
    if prep.warm:
        c.drafter.init_from = prep.warm
    for k, v in kw.items():
        if not hasattr(c.trainer, k):
            raise KeyError(f"stage_cfg: trainer has no key {k!r}")
        setattr(c.trainer, k, v)
    if c.trainer.method not in CE_TERM_METHODS:
        c.trainer.ce_weight, c.trainer.ce_labels = 0.0, "reference"
    return c


def _warmup_cfg(run, pl, prep: Prepared, out: str):
    c = stage_cfg(run, prep, method=pl.warmup_method, output_dir=out, max_steps=pl.warmup_steps, save_every=0,
                  lr=pl.warmup_lr, min_lr_ratio=pl.warmup_min_lr_ratio,
                  lr_warmup_steps=min(run.trainer.lr_warmup_steps, pl.warmup_steps), eval_heldout=False,
                  cache_trunks=pl.warmup_method.startswith("offpolicy"))  # each reference prefilled once
    c.drafter.init_from = None
    c.profile.enabled = False
    return c


def references_stage(pl, model, data, kernels, target_dir: str) -> tuple:
    """Stage 2: the target's answers to the chat prompts written to ``data.path``, or (``data.source:
    conversations``) the file as it is.

    Args:
        pl: the recipe's pipeline section (``data_*``).
        model: its model section (the references' engine and dtype).
        data: its data section (``source``, ``path``).
        kernels: its kernels section (the compute paths of the built-in engine's target).
        target_dir: the target's folder (stage 1).

    Returns:
        (where the trunks come from, the number of references, their response tokens or None).
    """
    if data.source == "conversations":  # trunks as the file has them: the target scores, nothing is decoded
        _stage(f"2/5 trunks: the conversations of data.path={data.path} as they are (no regeneration)")
        ref_dir = conversations_file(data.path)
        print(f"[specopd] {ref_dir}: the target's chat template, the loss on assistant turns (data.source: "
              f"conversations)")
        return ref_dir, 0, None
    _stage(f"2/5 references: {pl.data_num} chat prompts x <= {pl.data_max_new_tokens} tokens answered by "
           f"the target (T={pl.data_temperature:g})")
    ref_dir, recs = _references(pl, model, target_dir, kernels)
    _write_train_data(recs, data.path)
    n_tok = sum(len(r["input_ids"]) - int(r.get("response_start", r["prompt_len"])) for r in recs)
    print(f"[specopd] {len(recs)} references ({n_tok} response tokens) -> {data.path}")
    return ref_dir, len(recs), n_tok


def warmup_stage(run, pl, prep: Prepared, progress: bool = True) -> Optional[str]:
    """Stage 3: ``drafter.init_from`` without a warm-up, else the warm-up's last checkpoint (trained once into
    <output_dir>/warmup).

    Args:
        run: the training recipe (``training_recipe``).
        pl: the pipeline section (``warmup_*``).
        prep: stages 1-2's hand-off (the target, the data).
        progress: progress bars.

    Returns:
        the starting drafter's folder, or None (a fresh drafter).
    """
    init = run.drafter.init_from
    if pl.warmup_steps == 0:
        _stage(f"3/5 starting drafter: {init} (drafter.init_from; no warm-up)" if init else
               f"3/5 warm-up: {pl.warmup_method}, 0 steps from a fresh drafter")
        return init or None
    _stage(f"3/5 warm-up: {pl.warmup_method}, {pl.warmup_steps} steps from a fresh drafter")
    wout = os.path.join(run.trainer.output_dir, "warmup")
    done = [s for s, _ in complete_checkpoints(wout)]
    if done and max(done) >= pl.warmup_steps:
        print(f"[specopd] warm drafter exists: {find_latest(wout)}")
    else:
        train(_warmup_cfg(run, pl, prep, wout), progress=progress)
    warm = find_latest(wout)
    print(f"[specopd] warm drafter: {warm}")
    return warm


def prepare(cfg, progress: bool = True) -> Prepared:
    """Stages 1-3 (each cached) of the main recipe ``cfg``, each given only its sections -> ``Prepared``."""
    times = {}
    t0 = _stage(f"1/5 target {cfg.model.target}")
    target_dir = target_stage(cfg.model)
    times["target"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_dir, n_refs, n_tok = references_stage(cfg.pipeline, cfg.model, cfg.data, cfg.kernels, target_dir)
    times["references"] = time.perf_counter() - t0
    prep = Prepared(target_dir, ref_dir, cfg.data.path, None, n_refs, n_tok, times)
    t0 = time.perf_counter()
    warm = warmup_stage(training_recipe(cfg), cfg.pipeline, prep, progress=progress)
    times["warmup"] = time.perf_counter() - t0
    return replace(prep, warm=warm)


def train_stage(run, prep: Prepared, progress: bool = True) -> tuple:
    """Stage 4 -> (the training summary, the final checkpoint's folder or None): ``trainer.method`` from the
    starting drafter on ``runtime``. ``run``: the training recipe (``training_recipe``); ``prep``: stages 1-3's
    hand-off (the target, the data, the starting drafter)."""
    t = run.trainer
    _stage(f"4/5 train: {t.method}, {t.max_steps} steps from the warm drafter on {run.runtime.backend} "
           f"({run.runtime.num_workers} workers)")
    summary = train(stage_cfg(run, prep), progress=progress)
    return summary, find_latest(t.output_dir)


def evaluate_rows(ev, temps, model, kernels, target_dir: str, rows: list, drafter=None, seed: int = 0,
                  progress: bool = True) -> list:
    """Speculative decoding of the held-out chat prompts with each drafter of ``rows`` at every temperature of
    ``temps``: T > 0 decoded for real; T = 0 replayed exactly on the target's greedy continuations
    (``specopd.eval.replay``: the same rounds and counts as real greedy decoding, at a fraction of the cost).

    Args:
        ev: the recipe's eval section (the prompts, ``max_new_tokens``, ``seed``, ``dtype``).
        temps: the temperatures (``pipeline.eval_temperatures``).
        model: its model section (``dtype``, ``kernels``: the target's).
        kernels: its kernels section (the target's compute paths).
        target_dir: the target's Hugging Face folder.
        rows: (label, checkpoint or None) pairs; None: an untrained drafter.
        drafter: the drafter section an untrained row is built from (``kind``, ``num_layers``, ...).
        seed: that drafter's seed (the recipe's ``seed``).
        progress: show progress bars.

    Returns:
        [{drafter, checkpoint, by_temperature: {T: numbers}}].
    """
    with torch_threads(os.cpu_count() or 1):  # the driver's evaluation: every core, then back
        return _evaluate_rows(ev, temps, model, kernels, target_dir, rows, drafter, seed, progress)


def _evaluate_rows(ev, temps, model, kernels, target_dir: str, rows: list, drafter, seed: int,
                   progress: bool) -> list:
    target = load_target(target_dir, dtype=resolve_dtype(ev.target_dtype(model.dtype)), device="cpu",
                         kernels=model.kernels, kernel_paths=kernels)
    prompts, meta, _ = run_prompts(ev, target_dir, target.vocab_size)
    stops = sorted(stop_token_ids(load_tokenizer(target_dir, target.vocab_size), target))
    out, greedy = [], None  # greedy: the target's greedy continuations, shared by every drafter's T=0 replay
    for label, path in rows:
        if not path and drafter is None:
            raise ValueError(f"evaluate_rows: row {label!r} has no checkpoint and no drafter section to build it")
        d = load_drafter(path, target) if path else build_drafter(
            drafter.kind, target, num_layers=drafter.num_layers, block_size=drafter.block_size, seed=seed,
            feature_layers=drafter.feature_layers, mask_token_id=drafter.mask_token_id, target_dir=target_dir,
            **dict(drafter.architecture))
        res = {}
        for t in temps:
            if float(t) == 0:  # exact: equal to real greedy decoding, round by round (tests/test_replay.py)
                if greedy is None:
                    greedy = greedy_continuations(target, prompts, ev.max_new_tokens + d.draft_len, progress=progress)
                r = dict(replay_greedy_al(target, d, prompts, greedy, ev.max_new_tokens, stop_token_ids=stops),
                         spec_tokens_per_s=None, times={}, how="replay")
            else:
                r = dict(evaluate_al(target, d, prompts, ev.max_new_tokens, float(t), seed=ev.seed,
                                     stop_token_ids=stops, progress=progress), how="decode")
            res[f"{float(t):g}"] = {k: r[k] for k in ("mean_al", "rounds", "new_tokens", "accepted_at", "reached_at",
                                                      "per_position_acceptance", "spec_tokens_per_s", "times", "how")}
            if meta is not None:
                res[f"{float(t):g}"]["by_category"] = by_category(r["accept_lengths"], meta)
        out.append({"drafter": label, "checkpoint": path, "by_temperature": res})
    return out


def format_al_table(results: list, temps, w: int, title: str) -> str:
    """Before / after AL at each temperature, then acceptance per draft position with its counts.

    Args:
        results: what ``evaluate_rows`` returns.
        temps: the temperatures (columns).
        w: drafted tokens per block W.
        title: the table's first line.

    Returns:
        the table as text.
    """
    keys = [f"{float(t):g}" for t in temps]
    lines = [title, f"{'drafter':<54}" + "".join(f"{'AL T=' + k:>10}" for k in keys)]
    for r in results:
        lines.append(f"{r['drafter']:<54}" + "".join(f"{r['by_temperature'][k]['mean_al']:>10.3f}" for k in keys))
    lines.append(f"acceptance at draft position 1..{w}: accepted/reached ('-': never reached)")
    for k in keys:
        for r in results:
            lines.append(f"  T={k:<4}{r['drafter'][:44]:<46}" + "  ".join(acceptance_cells(r['by_temperature'][k])))
    for k in keys:
        cats = [(r["drafter"], r["by_temperature"][k]["by_category"]) for r in results
                if r["by_temperature"][k].get("by_category")]
        if cats:
            lines.append(f"T={k} " + format_categories(cats))
    return "\n".join(lines)


def run(cfg, progress: bool = True) -> dict:
    """The main job (specopd/DESIGN.md); holds the lock of ``trainer.output_dir`` throughout (one writer)."""
    check_device(cfg)
    with run_lock(cfg.trainer.output_dir, "trainer.output_dir"):
        return _run(cfg, progress)


def _run(cfg, progress: bool) -> dict:
    t_all = time.perf_counter()
    out = cfg.trainer.output_dir
    prep = prepare(cfg, progress=progress)
    times = dict(prep.times)
    warm = prep.warm

    t0 = time.perf_counter()
    summary, final = train_stage(training_recipe(cfg), prep, progress=progress)
    times["train"] = time.perf_counter() - t0

    temps = list(cfg.pipeline.eval_temperatures)
    where = "MT-Bench first turns" if cfg.eval.bench == "mt-bench" else "held-out chat prompts"
    t0 = _stage(f"5/5 speculative decoding of {where} ({cfg.eval.prompts} prompts for ours x "
                f"{cfg.eval.max_new_tokens} tokens, T={', '.join(f'{float(t):g}' for t in temps)})")
    if warm and cfg.pipeline.warmup_steps == 0:
        before = (f"before: {os.path.basename(os.path.normpath(warm))} (drafter.init_from)", warm)
    elif warm:
        before = (f"before: {cfg.pipeline.warmup_method} warm-up ({cfg.pipeline.warmup_steps} steps)", warm)
    else:
        before = ("before: untrained drafter", None)
    rows = [before,
            (f"after: + {cfg.trainer.method} ({summary['steps']} steps)", final)]
    # vLLM's counters and ours on vLLM's schedule side by side, when vLLM is there; ours alone for the rest
    sections = (cfg.eval, temps, cfg.model, cfg.kernels, prep.target_dir)  # what stage 5 reads of the recipe
    results = judge_rows(*sections, rows, out, progress=progress)
    done = {r["checkpoint"] for r in results}
    rest = [(label, path) for label, path in rows if not path or path not in done]
    if rest:
        results = evaluate_rows(*sections, rest, cfg.drafter, cfg.seed, progress=progress) + results
    times["eval"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_all

    w = cfg.drafter.block_size - 1  # W drafted tokens
    judged = next((r["num_prompts"] for r in results if r.get("num_prompts")), None)
    per_cat = " (the same number per category)" if cfg.eval.bench == "mt-bench" else ""
    if judged:
        hot = ", ".join(f"{float(t):g}" for t in temps if float(t) > 0)
        parts = ([f"on all {judged} at T=0"] if any(float(t) == 0 for t in temps) else []) + (
            [f"on {min(cfg.eval.prompts, judged)} of them{per_cat} at T={hot}"] if hot else [])
        what = (f"{where}: vLLM on all {judged}; ours on vLLM's schedule " + ", ".join(parts)
                + (f"; ours alone on {cfg.eval.prompts} for the rows vLLM did not judge" if rest else ""))
    else:
        what = f"{where}: ours on {cfg.eval.prompts}{per_cat}"
    title = (f"\nAcceptance length (AL = tokens committed per target verification round, incl. the bonus token; max "
             f"{w + 1})\n{provenance_line()}\n{what}, {cfg.eval.max_new_tokens} new tokens each, speculative decoding "
             f"(T=0: greedy, exact match, replayed exactly on the target's greedy continuation; T>0: decoded), "
             f"{cfg.drafter.kind} W={w}, target {os.path.basename(prep.target_dir)}")
    print(format_al_table(results, temps, w, title))
    print(f"\nwarm-up drafter: {warm}\nfinal drafter:   {final}")
    export = _export_final(final, out, prep.target_dir)
    if cfg.profile.enabled:
        print(f"profile: {os.path.join(out, 'profile')}/timeline.png, trace.json, summary.json")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    res = {"table": results, "times_s": times, "train_summary": summary, "references": prep.references,
           "num_references": prep.num_references, "reference_tokens": prep.reference_tokens,
           "warm_checkpoint": warm, "final_checkpoint": final, "export": export, "eval_prompts": cfg.eval.prompts,
           "eval_temperatures": temps, "al_includes_bonus": True}
    with open_write(os.path.join(out, "mainjob_summary.json")) as f:
        json.dump(res, f, indent=1, default=str)
    return res


def _export_final(final, out: str, target_dir: str):
    """The final drafter in the released DFlash layout at ``<out>/export`` (what ``specopd export`` writes, from
    the checkpoint folder: no second target load); prints where it is and how to serve it. A rerun that ends
    with the same drafter keeps the folder; an export of another drafter there is moved aside (nothing lost).
    Returns the folder (None without a final checkpoint)."""
    if final is None:
        print("[specopd] no final checkpoint: nothing to export")
        return None
    dst = os.path.join(out, "export")
    tmp = f"{dst}.tmp-{os.getpid()}"
    remove_path(tmp)
    dcfg = export_folder(final, tmp)
    if os.path.isdir(dst):
        names = sorted(os.listdir(tmp))
        if sorted(os.listdir(dst)) == names and all(filecmp.cmp(os.path.join(dst, n), os.path.join(tmp, n),
                                                                shallow=False) for n in names):
            shutil.rmtree(tmp)  # the same drafter is exported there already
        else:
            old = f"{dst}.before-{int(time.time())}"
            os.replace(dst, old)
            print(f"[specopd] the previous export (another drafter) moved aside to {old}")
    if os.path.isdir(tmp):
        os.replace(tmp, dst)
    print("\n" + describe_export(final, dst, dcfg, target_dir))
    return dst
