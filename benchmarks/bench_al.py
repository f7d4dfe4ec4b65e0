"""Acceptance length of SpecOPD against every baseline, from one starting drafter and one data set: the comparison
that tells a user whether to regenerate their data or train on-policy.

    python benchmarks/bench_al.py [--recipe recipes/smollm2-135m-dflash.yaml] [--steps 60] [--eval-every 20]
        [--methods specopd,offpolicy_ce,offpolicy_e2e_tv,draft_opd,regen_ce] [--benches mt-bench,sharegpt]
        [--prompts 32] [--max-new-tokens 64] [--temperatures 1|none] [--real-at final|all|none] [--no-equal-time]
        [--regen-engine auto|vllm|builtin] [--regen-temperature 0.7] [--regen-max-new-tokens N]
        [--references target|dataset] [--no-keep-trunks] [--judge ours|vllm] [--judge-prompts N]
        [--out runs/bench-al] [key=value ...]

    EAGLE-3 (every method from the shipped TTT drafter, judged by vLLM):
    python benchmarks/bench_al.py --recipe recipes/smollm2-135m-eagle3.yaml --judge vllm

1. prepare   the recipe's main-job stages 1-3 (``specopd.mainjob.prepare``: target, data, starting drafter; cached).
             The main recipe: the shipped drafter (``drafter.init_from``) and ShareGPT's conversations as trunks
             (``data.source: conversations``); every method starts from that drafter and draws the same batches
             (``data.seed``)
2. equal steps   each method trains ``--steps`` steps (its own output folder, checkpoints every ``--eval-every``);
             training wall time = the sum of the logged step times. Methods: specopd, offpolicy_ce (continued CE),
             offpolicy_e2e_tv, draft_opd, and regen_ce: the target first regenerates the replies to the prompts of
             exactly the train conversations the other methods' ``--steps`` steps draw (``trained_ids``), with
             ``--regen-engine`` (auto: vLLM when its venv is there) at ``--regen-temperature`` (default 0.7,
             SpecForge's ``regenerate_train_data.py`` default; top-p 1), each reply <= ``--regen-max-new-tokens``
             (default data.seq_len) and stopped where prompt + reply reach data.seq_len (a trunk keeps no more);
             then off-policy CE continues on those references. Its wall
             time = the regeneration's + its training's (both recorded). Only the first reply is regenerated (the
             prompt: system and user turns before the first assistant turn, ``conversation_prompts``); SpecForge
             regenerates every turn, but a trunk is cut at data.seq_len tokens, where later turns rarely fit
3. equal time    each other method trains again from the starting drafter for round(budget / its mean step time)
             steps, budget = SpecOPD's training wall time in 2 (each run with its own full LR schedule); regen_ce
             gets round((budget - regeneration time) / its mean step time) steps: none when regenerating alone
             takes the budget (its row is then the starting drafter, at the regeneration's wall time)
4. evaluate  every checkpoint (and the starting drafter, step 0) on each of ``--benches`` x ``--prompts`` prompts x
             ``--max-new-tokens`` new tokens: mt-bench (its first turns, the same number per category; never
             trained on), mt-bench-2 (its second turns after the target's own greedy first answer of at most
             eval.max_new_tokens tokens, as ``specopd eval --turn 2`` builds them), sharegpt (held-out
             conversations of data.path, split by id as training splits them, ``heldout_conversation_prompts``),
             chat (held-out chitchat prompts: the chitchat recipe). T=0 AL replayed exactly on the target's
             greedy continuation (``specopd.eval.replay``: cheap, equal to real T=0 decoding) at every checkpoint;
             real speculative decoding (``evaluate_al``) at each ``--temperatures`` on the checkpoints ``--real-at``
             names (final: the starting drafter and each run's last one; all: every checkpoint; none: no real
             decoding by ours, for drafters whose decoding costs: with ``--judge vllm`` vLLM still decodes every
             row at every temperature, ours beside it on vLLM's schedule as its check)
5. compare   per prompt, SpecOPD's AL minus each other row's on the same prompts: mean +- its paired standard
             error, at equal steps and at equal wall time, and whether it exceeds two standard errors; with more
             than one set, also over all their prompts pooled (one ratio estimate over the union); and at every
             step both evaluated (equal steps along the curve: ``specopd_minus_along_curve``)

``--judge vllm`` (needs the vLLM venv: ``make vllm``; without it exit 2): the rows decoded for real (the starting
drafter, each method's last checkpoint at equal steps, each equal-time run) are exported and served by vLLM in one
process (``specopd.eval.engine.judge_rows``, the main job's path) on ``--judge-prompts`` MT-Bench first turns
(default all 80; fewer: the same number per category) x ``--max-new-tokens`` at T=0 and ``--temperatures``, with
ours on vLLM's schedule beside it as the check (T=0: every round of every prompt equal; T>0: within noise; every
disagreement printed). The MT-Bench table gains "T=.. vLLM (n)" columns, AL by vLLM's counters (its verify steps,
prompt by prompt) +- its standard error, and SpecOPD's paired differences there come from vLLM's per-prompt accept
lengths (``specopd.eval.compare``). Our own columns stay beside them. Cached in
``<out>/vllm_judge_<n>x<tokens>_<dtype>_seed<eval.seed>.json`` by checkpoint: a rerun serves only what is new.

``--references dataset`` (prepared data only): every method trains on the dataset's own replies to the same prompts
(the next turn of each train conversation, ``write_dataset_replies``) instead of the target's answers.

Prints the command line and the provenance line (date, commit, machine), then the tables; writes
``<out>/bench_al.json`` and two figures, ``al_vs_steps.png`` and ``al_vs_wall.png``. AL = tokens committed per
target verification round, *including* the bonus token. Reruns reuse finished training runs
(``trainer.resume=auto``), the regenerated references and cached evaluations.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = ("specopd", "offpolicy_ce", "offpolicy_e2e_tv", "draft_opd", "regen_ce")
BENCH_NAMES = {"mt-bench": "MT-Bench first turns", "mt-bench-2": "MT-Bench second turns",
               "sharegpt": "held-out ShareGPT conversations",
               "chat": "held-out chat prompts"}
SPECFORGE_REGEN_TEMPERATURE = 0.7  # scripts/regenerate_train_data.py's --temperature default (top-p unset: 1)


def _metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wall_at(metrics: list) -> dict:
    """step -> cumulative training wall time (sum of logged step times up to that step)."""
    out, total = {0: 0.0}, 0.0
    for m in sorted(metrics, key=lambda m: m["step"]):
        total += float(m.get("step_s", 0.0))
        out[int(m["step"])] = total
    return out


def _loss_at(metrics: list, window: int = 10) -> dict:
    """step -> mean training loss of the ``window`` logged steps up to it (the loss is noisy step to step)."""
    pts = sorted((int(m["step"]), float(m["loss"])) for m in metrics if m.get("loss") is not None)
    return {s: sum(v for _, v in pts[max(0, i - window + 1): i + 1]) / len(pts[max(0, i - window + 1): i + 1])
            for i, (s, _) in enumerate(pts)}


def _checkpoints(run_dir: str) -> list:
    from specopd.runs.checkpoint import complete_checkpoints

    return sorted(complete_checkpoints(run_dir))  # [(step, folder)]


class Evaluator:
    """AL of drafter checkpoints on one prompt set (``bench``: chat | mt-bench | sharegpt, default ``args.bench``
    or chat); results cached in <out>/eval_cache_<set>.json by (folder, what). ``target``: an already loaded
    target to share; ``cfg``: the recipe (sharegpt: its data.path and split)."""

    def __init__(self, target_dir: str, args, out: str, bench: str = None, target=None, cfg=None):
        import torch

        from specopd.data.conversations import heldout_prompt_ids
        from specopd.data.prepare import load_tokenizer, stop_token_ids
        from specopd.eval.replay import greedy_continuations
        from specopd.models import load_target

        self.args = args
        self.target = target if target is not None else load_target(target_dir)
        self.bench = bench = bench or getattr(args, "bench", "chat")
        self.meta = None
        tag = "" if bench == "chat" else f"{bench}_"  # one cache per evaluation set: results never mix
        self.stops = sorted(stop_token_ids(load_tokenizer(target_dir, self.target.vocab_size), self.target))
        if bench == "mt-bench":  # MT-Bench's first turns: all 80, or --prompts of them, the same number per category
            from specopd.eval.bench import mtbench_prompts, stratified

            ids, meta = mtbench_prompts(target_dir, self.target.vocab_size)
            keep = stratified(meta, args.prompts)
            self.prompts, self.meta = [ids[i] for i in keep], [meta[i] for i in keep]
        elif bench == "mt-bench-2":  # second turns after the target's own greedy first answers (cached: they cost)
            from specopd.eval.bench import mtbench_second_turns, stratified

            n_first = int(cfg.eval.max_new_tokens)
            ids, meta = mtbench_second_turns(self.target, target_dir, n_first, self.stops,
                                             os.path.join(out, f"mtbench_first_answers_{n_first}.json"))
            keep = stratified(meta, args.prompts)
            self.prompts, self.meta = [ids[i] for i in keep], [meta[i] for i in keep]
        elif bench == "sharegpt":
            from specopd.eval.bench import heldout_conversation_prompts

            self.prompts, self.meta = heldout_conversation_prompts(cfg, args.prompts)
            if not self.prompts:
                raise ValueError(f"no held-out conversation in data.path={cfg.data.path} (data.heldout="
                                 f"{cfg.data.heldout}): raise data.heldout or leave sharegpt out of --benches")
            # the set depends on the data and its split: its ids name the cache
            tag += hashlib.sha1(json.dumps([m["id"] for m in self.meta]).encode()).hexdigest()[:8] + "_"
        else:
            self.prompts = heldout_prompt_ids(target_dir, self.target.vocab_size, args.prompts)
        self.cache_path = os.path.join(out, f"eval_cache_{tag}{args.prompts}x{args.max_new_tokens}.json")
        self.cache = json.load(open(self.cache_path)) if os.path.isfile(self.cache_path) else {}
        cont_path = os.path.join(out, f"greedy_continuations_{tag}{args.prompts}x{args.max_new_tokens + 32}.pt")
        if os.path.isfile(cont_path):
            self.conts = torch.load(cont_path, weights_only=True)
        else:  # + 32 covers every block size up to 32 drafted tokens
            self.conts = greedy_continuations(self.target, self.prompts, args.max_new_tokens + 32, progress=True)
            torch.save(self.conts, cont_path)

    def _save(self):
        from specopd.errors import replacing

        with replacing(self.cache_path) as f:
            json.dump(self.cache, f, indent=1)

    def __call__(self, folder: str, real: bool) -> dict:
        from specopd.drafters import load_drafter
        from specopd.eval.bench import by_category
        from specopd.eval.cli import al_stderr, evaluate_al
        from specopd.eval.replay import replay_greedy_al

        a = self.args
        key = os.path.abspath(folder)
        res = self.cache.setdefault(key, {})
        drafter = None
        if "replay_t0" not in res or "accept_lengths" not in res["replay_t0"]:
            drafter = load_drafter(folder, self.target)
            r = replay_greedy_al(self.target, drafter, self.prompts, self.conts, a.max_new_tokens, self.stops)
            res["replay_t0"] = {**{k: r[k] for k in ("mean_al", "rounds", "accepted_at", "reached_at",
                                                     "accept_lengths")}, "se": al_stderr(r["accept_lengths"])}
            self._save()
        if real:
            for t in a.temperatures:
                tk = f"real_t{t:g}"
                if tk in res and "accept_lengths" in res[tk]:
                    continue
                drafter = drafter or load_drafter(folder, self.target)
                r = evaluate_al(self.target, drafter, self.prompts, a.max_new_tokens, t, seed=0,
                                stop_token_ids=self.stops, progress=True)
                res[tk] = {**{k: r[k] for k in ("mean_al", "rounds", "new_tokens", "accepted_at", "reached_at",
                                                "spec_tokens_per_s", "accept_lengths")},
                           "se": al_stderr(r["accept_lengths"])}
                self._save()
        if self.bench in ("mt-bench", "mt-bench-2"):
            for v in res.values():
                v["by_category"] = by_category(v["accept_lengths"], self.meta)
        return res


def dataset_replies(cfg, prep, out: str) -> str:
    """The dataset's own replies to the prompts the pipeline's references answer -> <out>/main/data/...jsonl."""
    from specopd.data.conversations import write_dataset_replies
    from specopd.data.prepare import load_tokenizer
    from specopd.mainjob import reference_prompts
    from specopd.models.loading import read_config

    tok = load_tokenizer(prep.target_dir, int(read_config(prep.target_dir)["vocab_size"]))
    path = os.path.join(out, "main", "data", f"dataset_replies_{cfg.pipeline.data_num}.jsonl")
    c = write_dataset_replies(tok, path, reference_prompts(cfg.pipeline, tok), cfg.data.seq_len)
    print(f"[bench_al] the dataset's own replies: {c['written']} references ({c['supervised_tokens']} response "
          f"tokens; {c['skipped']} prompts without a reply skipped) -> {path}", flush=True)
    return path


def regenerate(cfg, prep, args, out: str) -> dict:
    """regen_ce's references: the target answers the prompts of the train conversations the equal-steps runs
    draw (``--steps`` x data.batch_size, in their order), as a user regenerates their data before training.
    Resumable (``prepare_data`` skips answered prompts); the seconds of each attempt that ended are summed.
    -> {"path" (the references' data.jsonl), "regen_s", "prompts", "engine", ...}."""
    from specopd.config import auto_dtype
    from specopd.data.formats import conversation_prompts
    from specopd.data.packaged import conversations_file
    from specopd.data.prepare import ERRORS_FILE, encode_prompt, load_tokenizer, prepare_data
    from specopd.data.references import DATA_FILE, read_records
    from specopd.engines import EngineFailed, auto_engine
    from specopd.mainjob import stage_cfg
    from specopd.models.loading import read_config
    from specopd.train.data import conversation_split, trained_ids

    samples, train_ids, _ = conversation_split(stage_cfg(cfg, prep))
    order = trained_ids(train_ids, cfg.data.batch_size, cfg.data.seed, args.steps)
    want = list(dict.fromkeys(samples[i]["id"] for i in order))  # each conversation once, in the order drawn
    # ShareGPT's chunks that open with a reply keep it as context before their first user turn's answer
    by_id = dict(conversation_prompts(conversations_file(cfg.data.path), cfg.data.bad_lines, opening_context=True))
    tok = load_tokenizer(prep.target_dir, int(read_config(prep.target_dir)["vocab_size"]))
    room = {rid: cfg.data.seq_len - len(encode_prompt(tok, by_id[rid])) for rid in want if rid in by_id}
    prompts = [(rid, by_id[rid]) for rid in want if room.get(rid, 0) > cfg.drafter.block_size]
    engine, why = auto_engine() if args.regen_engine == "auto" else (args.regen_engine, "--regen-engine")
    dtype = cfg.model.dtype if engine == "builtin" else auto_dtype(cfg.model.device)  # as the main job's references
    n_new = args.regen_max_new_tokens or cfg.data.seq_len
    name = f"{engine}-{dtype}-T{args.regen_temperature:g}-{len(prompts)}x{n_new}-in{cfg.data.seq_len}"
    rdir = os.path.join(out, "regen", name)
    log_path = rdir + ".json"
    log = json.load(open(log_path)) if os.path.isfile(log_path) else {"attempts_s": [], "done": False}
    print(f"\n[bench_al] regen_ce: the prompts of {len(prompts)} of the {len(want)} train conversations "
          f"{args.steps} steps draw (left out: {len(want) - len(room)} without a user turn, {len(room) - len(prompts)} "
          f"whose prompt leaves no reply room in data.seq_len={cfg.data.seq_len})", flush=True)
    if not log["done"]:
        print(f"[bench_al] regen_ce: the target answers them (<= {n_new} tokens, T={args.regen_temperature:g}) with "
              f"the {engine} engine ({why}) -> {rdir}", flush=True)
        t0 = time.perf_counter()
        counts = prepare_data(prep.target_dir, rdir, prompts=prompts, prompts_label=f"bench_al: {cfg.data.path}",
                              max_new_tokens=n_new, temperature=args.regen_temperature, top_p=1.0, seed=0,
                              heldout_fraction=0.0, device="cpu" if cfg.model.device == "auto" else cfg.model.device,
                              dtype=dtype, batch_size=cfg.pipeline.data_batch_size, engine=engine,
                              max_total_tokens=cfg.data.seq_len)  # nothing a trunk would cut off is generated
        log["attempts_s"].append(time.perf_counter() - t0)
        log.update(done=not counts["failed"], counts=counts)
        with open(log_path, "w") as f:
            json.dump(log, f, indent=1)
        if counts["failed"]:
            raise EngineFailed(f"regen_ce: the {engine} engine failed on {counts['failed']} of {len(prompts)} "
                               f"prompts (listed in {os.path.join(rdir, ERRORS_FILE)}); rerun the same command to "
                               f"retry them (the answered ones are kept)")
    recs = read_records(os.path.join(rdir, DATA_FILE))
    n_tok = sum(len(r["input_ids"]) - int(r["response_start"]) for r in recs)
    regen_s = sum(log["attempts_s"])
    print(f"[bench_al] regen_ce references: {len(recs)} ({n_tok} response tokens) in {regen_s:.0f} s "
          f"({len(log['attempts_s'])} attempt(s); an attempt killed mid-way is not counted) -> {rdir}", flush=True)
    return {"name": name, "path": os.path.join(rdir, DATA_FILE), "regen_s": regen_s, "attempts_s": log["attempts_s"],
            "prompts": len(prompts), "trained_ids": want, "no_user_turn": len(want) - len(room),
            "no_reply_room": len(room) - len(prompts), "references": len(recs), "response_tokens": n_tok,
            "engine": engine, "dtype": dtype, "temperature": args.regen_temperature, "max_new_tokens": n_new}


def train_run(cfg, prep, method: str, steps: int, save_every: int, out_dir: str, regen: dict = None,
              keep_trunks: bool = True) -> dict:
    """Train ``method`` from the starting drafter for ``steps`` (resumable); regen_ce: off-policy CE on
    ``regen``'s references -> {steps, wall_at, checkpoints, ...}. The runs skip the trainer's own held-out
    evaluation (the benchmark evaluates every checkpoint itself; it does not change the training numbers).
    ``keep_trunks``: off-policy runs keep every trunk's features (``trainer.cache_trunks``), as fast as they go."""
    from specopd.mainjob import stage_cfg
    from specopd.train.loop import train

    c = stage_cfg(cfg, prep, method="offpolicy_ce" if method == "regen_ce" else method, output_dir=out_dir,
                  max_steps=steps, save_every=save_every, keep_last=max(2, steps // max(1, save_every) + 1),
                  eval_every=0, eval_heldout=False,
                  cache_trunks=keep_trunks and (method.startswith("offpolicy") or method == "regen_ce"))
    if method == "regen_ce":  # every regenerated reference is trained on (none held out)
        c.data.source, c.data.path, c.data.heldout = "prepared", regen["path"], 0.0
    done = [s for s, _ in _checkpoints(out_dir)]
    if not done or max(done) < steps:
        print(f"\n[bench_al] {method}: {steps} steps from the starting drafter (trainer.ce_weight="
              f"{c.trainer.ce_weight:g}) -> {out_dir}", flush=True)
        train(c, progress=True)
    m = _metrics(out_dir)
    return {"steps": steps, "wall_at": _wall_at(m), "checkpoints": _checkpoints(out_dir), "loss_at": _loss_at(m),
            "mean_step_s": (sum(x.get("step_s", 0.0) for x in m) / max(1, len(m))),
            "ce_weight": c.trainer.ce_weight, "regen_s": regen["regen_s"] if regen else 0.0}


def vllm_judge(cfg, prep, args, rows: list) -> tuple:
    """vLLM's counters (``specopd.eval.engine.judge_rows``, the main job's path: every drafter in one vLLM process,
    ours on vLLM's schedule beside it as the check) for each row's checkpoint on ``--judge-prompts`` MT-Bench first
    turns at T=0 and ``--temperatures``; cached in <out>/vllm_judge_<prompts>x<tokens>_<dtype>_seed<S>.json by
    checkpoint, so a rerun serves only what is new. Each row's MT-Bench results gain vllm_t<T> entries -> (prompts
    judged, cache)."""
    from dataclasses import replace

    from specopd.eval.bench import mtbench_prompts, stratified
    from specopd.eval.compare import judged_entries
    from specopd.errors import replacing
    from specopd.eval.engine import judge_rows
    from specopd.models.loading import read_config

    temps = [0.0, *args.temperatures]
    ev = replace(cfg.eval, bench="mt-bench", prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    _, meta = mtbench_prompts(prep.target_dir, int(read_config(prep.target_dir)["vocab_size"]))
    keep = stratified(meta, args.judge_prompts or len(meta))
    n, meta = len(keep), [meta[i] for i in keep]  # judge_rows(num_judged=n) picks the same prompts
    path = os.path.join(args.out, f"vllm_judge_{n}x{args.max_new_tokens}_{ev.target_dtype(cfg.model.dtype)}_seed"
                                  f"{ev.seed}.json")  # what the numbers depend on beside the checkpoint and T
    cache = {}
    if os.path.isfile(path):
        with open(path) as f:
            cache = json.load(f)
    todo = {}
    for r in rows:
        e = cache.get(os.path.abspath(r["checkpoint"]), {})
        if any(f"{t:g}" not in e.get("vllm", {}) for t in temps):
            todo.setdefault(r["checkpoint"], r["method"])
    if todo:
        print(f"\n[bench_al] vLLM judges {len(todo)} drafter(s) on {n} MT-Bench first turns at T="
              f"{', '.join(f'{t:g}' for t in temps)} (cached in {path})", flush=True)
        got = judge_rows(ev, temps, cfg.model, cfg.kernels, prep.target_dir, [(m, ck) for ck, m in todo.items()],
                         os.path.join(args.out, "vllm"), num_judged=n)
        cache.update(judged_entries(got, meta))
        with replacing(path) as f:
            json.dump(cache, f, indent=1)
    for r in rows:
        e = cache.get(os.path.abspath(r["checkpoint"]))
        if e is None:  # judge_rows said why (printed); the row keeps our numbers only
            continue
        # copies: the rows share the Evaluator's cache dicts, which keep our own numbers only
        r["_res"] = {**r["_res"], "mt-bench": {**r["_res"]["mt-bench"],
                                                **{f"vllm_t{t}": v for t, v in e["vllm"].items()}}}
        r["al"] = {**r["al"], "mt-bench": {**r["al"]["mt-bench"], **{
            f"vllm_t{t}": {"mean_al": v["mean_al"], "se": v["se"]} for t, v in e["vllm"].items()}}}
    return n, cache


def _judge_checks(rows: list, cache: dict) -> None:
    """Print, per row, whether vLLM and ours on vLLM's schedule agree (T=0: round for round; T>0: within noise),
    naming every disagreement, and the rows vLLM did not judge."""
    print("\nvLLM's counters against ours on vLLM's schedule (the judge's check: T=0 equal round for round, T>0 "
          "within noise)")
    for r in rows:
        e = cache.get(os.path.abspath(r["checkpoint"]))
        if e is None:
            print(f"  {r['method']:<42}not judged by vLLM (the reason is printed above); our numbers only")
            continue
        ours = ", ".join(f"T={t} {v['mean_al']:.3f} on {len(v['accept_lengths'])}"
                         for t, v in e.get("ours_vllm_schedule", {}).items())
        bad = e.get("problems") or []
        print(f"  {r['method']:<42}" + ("agree" if not bad else f"{len(bad)} DISAGREEMENT(S): " + "; ".join(bad))
              + f" (ours on vLLM's schedule: {ours})")


def run_dir(out: str, setting: str, method: str, regen: dict = None) -> str:
    """A run's folder; regen_ce's is named by its references (other references: another run)."""
    return os.path.join(out, setting, f"regen_ce-{regen['name']}" if method == "regen_ce" else method)


def _cols(temps: list, judged: int = 0) -> list:
    """(result key, column title) of the AL columns; ``judged``: the prompts vLLM judged (its columns), 0: none."""
    return [("replay_t0", "T=0 (replay)")] + [(f"real_t{t:g}", f"T={t:g} (real)") for t in temps] + (
        [(f"vllm_t{t:g}", f"T={t:g} vLLM ({judged})") for t in [0.0, *temps]] if judged else [])


def _row(label: str, method: str, setting: str, steps: int, train_s: float, regen_s: float, res: dict,
         loss=None, checkpoint: str = None) -> dict:
    """One table row: ``res`` = {bench: that checkpoint's cached results}; ``checkpoint``: its folder."""
    return {"method": label, "base": method, "setting": setting, "steps": steps, "checkpoint": checkpoint,
            "train_wall_s": round(train_s, 1),
            "regen_s": round(regen_s, 1), "wall_s": round(train_s + regen_s, 1), "loss": loss,
            "al": {b: {k: {"mean_al": v["mean_al"], "se": v.get("se")} for k, v in r.items()} for b, r in res.items()},
            "_res": res}


def _figures(out: str, data: dict, benches: list, temps: list) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"specopd": "C3", "draft_opd": "C0", "offpolicy_ce": "C2", "offpolicy_e2e_tv": "C1", "regen_ce": "C4"}
    panels = [c for c in _cols(temps) if any(f"{b}/{c[0]}" in p for b in benches for pts in data["curves"].values()
                                             for p in pts)]  # --real-at none: no real-decoding panels
    paths = []
    for xkey, fname, xlabel in (("step", "al_vs_steps.png", "training steps from the starting drafter"),
                                ("wall_s", "al_vs_wall.png", "wall time (s); regen_ce: regeneration + training")):
        extra = 1 if xkey == "step" else 0  # a panel of each method's training loss (relative to its first)
        ncol = len(panels) + extra
        fig, axes = plt.subplots(len(benches), ncol, figsize=(5.2 * ncol, 4.2 * len(benches)), squeeze=False)
        for bi, bench in enumerate(benches):
            if extra and bi:  # the loss does not depend on the prompt set: one panel
                axes[bi][-1].axis("off")
            elif extra:
                ax = axes[bi][-1]
                for method, pts in data["curves"].items():
                    xs = [p["step"] for p in pts if p.get("loss") is not None]
                    ys = [p["loss"] for p in pts if p.get("loss") is not None]
                    if xs:
                        ax.plot(xs, [y / ys[0] for y in ys], "-o", ms=4, color=colors.get(method), label=method)
                ax.set_title("training loss / its value at the first checkpoint (10-step mean)", fontsize=9)
                ax.set_xlabel(xlabel)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            for ax, (key, title) in zip(axes[bi], panels):
                k = f"{bench}/{key}"
                for method, pts in data["curves"].items():
                    xs = [p[xkey] for p in pts if k in p]
                    ys = [p[k] for p in pts if k in p]
                    if xs:
                        ax.plot(xs, ys, "-o", ms=4, color=colors.get(method), label=method)
                for method, p in data.get("equal_time", {}).items():
                    if k in p and xkey == "wall_s":
                        ax.plot([p["wall_s"]], [p[k]], "*", ms=12, color=colors.get(method),
                                label=f"{method} (equal time: {p['step']} steps)")
                ax.axhline(data["warm"].get(k, float("nan")), color="gray", ls=":", lw=1, label="starting drafter")
                ax.set_title(f"{BENCH_NAMES[bench]}: {title}", fontsize=9)
                ax.set_xlabel(xlabel)
                ax.set_ylabel("AL (incl. bonus)")
                ax.grid(alpha=0.3)
            axes[bi][0].legend(fontsize=7)
        fig.suptitle(textwrap.fill(data["title"], 40 * ncol), fontsize=9)
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _tables(rows: list, evs: dict, temps: list, w: int, judged: int = 0) -> list:
    """Print each set's AL table, SpecOPD's paired differences and the acceptance per draft position (``judged``:
    the prompts of vLLM's columns, 0: none); -> the differences as JSON rows."""
    from specopd.eval.bench import format_categories
    from specopd.eval.cli import acceptance_cells, al_diff_stderr
    from specopd.eval.compare import paired_diff

    ref = next(r for r in rows if r["base"] == "specopd")
    diffs = []
    for bench, ev in evs.items():
        cols = [c for c in _cols(temps, judged) if any(c[0] in r["_res"][bench] for r in rows)]
        print(f"\n== {BENCH_NAMES[bench]}: {len(ev.prompts)} prompts x {ev.args.max_new_tokens} new tokens, W={w}, AL "
              f"incl. the bonus (mean +- its standard error over prompts)")
        if any(k.startswith("vllm_") for k, _ in cols):
            print(f"judges: 'replay' and 'real' columns by our decoder on these {len(ev.prompts)} prompts; 'vLLM' "
                  f"columns by vLLM's counters (its verify steps, prompt by prompt) on {judged} prompts of the set, "
                  f"the same number per category, the differences below paired over those")
        print(f"{'method':<40}{'steps':>6}{'train s':>9}{'regen s':>9}{'wall s':>8}{'loss':>9}" +
              "".join(f"{t:>20}" for _, t in cols))
        for r in rows:
            res = r["_res"][bench]
            loss = f"{r['loss']:>9.4f}" if r.get("loss") is not None else f"{'':>9}"
            print(f"{r['method']:<40}{r['steps']:>6}{r['train_wall_s']:>9.0f}{r['regen_s']:>9.0f}{r['wall_s']:>8.0f}"
                  f"{loss}" + "".join(f"{res[k]['mean_al']:>12.3f} +- {res[k]['se']:.3f}" if k in res
                                      else f"{'':>20}" for k, _ in cols))
        print(f"SpecOPD ({ref['steps']} steps, {ref['wall_s']:.0f} s) minus each row, paired over the same prompts: "
              f"difference +- its standard error; '*': beyond two standard errors")
        for r in rows:
            if r is ref:
                continue
            cells = []
            for k, _ in cols:
                a, b = ref["_res"][bench].get(k), r["_res"][bench].get(k)
                if not (a and b):
                    cells.append(f"{'':>20}")
                    continue
                d = a["mean_al"] - b["mean_al"]
                se = al_diff_stderr(a["accept_lengths"], b["accept_lengths"])
                beyond = abs(d) > 2 * se
                diffs.append({"bench": bench, "what": k, "method": r["method"], "setting": r["setting"],
                              "steps": r["steps"], "wall_s": r["wall_s"], "diff": d, "se": se,
                              "beyond_2se": beyond})
                cells.append(f"{d:>+11.3f} +- {se:.3f}{'*' if beyond else ' '}")
            print(f"{r['method']:<40}{'':>41}" + "".join(cells))
        for k, title in cols:
            print(f"acceptance at draft position 1..{w}, {title} (accepted/reached; '-' never reached)")
            for r in rows:
                if k in r["_res"][bench]:
                    print(f"  {r['method']:<42}" + "  ".join(acceptance_cells(r["_res"][bench][k])))
        if bench in ("mt-bench", "mt-bench-2"):
            for k, title in cols:
                cats = [(r["method"], r["_res"][bench][k]["by_category"]) for r in rows if k in r["_res"][bench]]
                if cats:
                    print(f"{title}, per category\n" + format_categories(cats))
    if len(evs) > 1:  # every set's prompts pooled: the finest comparison the evaluated prompts allow
        names = " + ".join(f"{BENCH_NAMES[b]} ({len(e.prompts)})" for b, e in evs.items())
        print(f"\n== all sets pooled: {names}\nSpecOPD minus each row, paired over the pooled prompts, T=0 (replay)")
        a = [x for b in evs for x in ref["_res"][b]["replay_t0"]["accept_lengths"]]
        for r in rows:
            if r is ref or any("replay_t0" not in r["_res"][b] for b in evs):
                continue
            d, se = paired_diff(a, [x for b in evs for x in r["_res"][b]["replay_t0"]["accept_lengths"]])
            beyond = abs(d) > 2 * se
            diffs.append({"bench": "pooled", "what": "replay_t0", "method": r["method"], "setting": r["setting"],
                          "steps": r["steps"], "wall_s": r["wall_s"], "diff": d, "se": se, "beyond_2se": beyond})
            n_se = f"{abs(d) / se:.1f} SE" if se > 0 else "no spread"
            print(f"{r['method']:<40}{'':>41}{d:>+11.3f} +- {se:.3f}{'*' if beyond else ' '} ({n_se})")
    return diffs


def _curve_diffs(runs: dict, evs: dict) -> list:
    """SpecOPD minus each other method at every step both evaluated (equal steps along the curve), T=0 replay, per
    set and, with more than one set, pooled: whether a lead holds, grows or fades with training."""
    from specopd.eval.compare import paired_diff

    def lengths(folder, bench):
        return evs[bench].cache[os.path.abspath(folder)]["replay_t0"]["accept_lengths"]

    sets = list(evs) + (["pooled"] if len(evs) > 1 else [])
    ours = dict(runs["specopd"]["checkpoints"])
    out = []
    print("\n== SpecOPD minus each method at equal steps along the curve, T=0 (replay), paired over prompts; "
          "'*': beyond two standard errors")
    print(f"{'step':>6}  {'method':<18}" + "".join(f"{b:>22}" for b in sets))
    for m, r in runs.items():
        if m == "specopd":
            continue
        for step, folder in r["checkpoints"]:
            if step not in ours:
                continue
            cells = []
            for b in sets:
                bs = list(evs) if b == "pooled" else [b]
                d, se = paired_diff([x for s in bs for x in lengths(ours[step], s)],
                                     [x for s in bs for x in lengths(folder, s)])
                out.append({"step": step, "method": m, "bench": b, "diff": d, "se": se, "beyond_2se": abs(d) > 2 * se})
                cells.append(f"{d:>+12.3f} +- {se:.3f}{'*' if abs(d) > 2 * se else ' '}")
            print(f"{step:>6}  {m:<18}" + "".join(cells))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "smollm2-135m-dflash.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--methods", default=None, help=f"from {','.join(METHODS)} (default: all; regen_ce needs "
                                                    f"data.source conversations)")
    ap.add_argument("--benches", default=None, help="from mt-bench,sharegpt,chat (default: mt-bench,sharegpt for "
                                                    "conversations data, else chat)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per set (MT-Bench: the same number per category)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="1", help="real speculative decoding at these (T=0 is always replayed)")
    ap.add_argument("--real-at", choices=["all", "final", "none"], default="final",
                    help="none: no real decoding by ours (T=0 replayed; with --judge vllm, vLLM decodes at every T)")
    ap.add_argument("--no-equal-time", action="store_true")
    ap.add_argument("--regen-engine", choices=["auto", "vllm", "builtin"], default="auto")
    ap.add_argument("--regen-temperature", type=float, default=SPECFORGE_REGEN_TEMPERATURE)
    ap.add_argument("--regen-max-new-tokens", type=int, default=None, help="default data.seq_len")
    ap.add_argument("--references", choices=["target", "dataset"], default="target",
                    help="prepared data: train on the target's answers (the pipeline's references) or the dataset's "
                         "own replies")
    ap.add_argument("--no-keep-trunks", action="store_true",
                    help="off-policy runs prefill each trunk whenever it is drawn instead of keeping every trunk's "
                         "features (trainer.cache_trunks: ~1 MB a sequence for SmolLM2-135M, all of them on a long "
                         "run; the numbers are the same, the steps slower)")
    ap.add_argument("--judge", choices=["ours", "vllm"], default="ours",
                    help="vllm: also vLLM's counters for the rows decoded for real (MT-Bench; needs `make vllm`)")
    ap.add_argument("--judge-prompts", type=int, default=None,
                    help="MT-Bench first turns vLLM judges (default: all 80; fewer: the same number per category)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-al"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value")
    args = ap.parse_args(argv)
    from specopd.eval.bench import provenance_line
    from specopd.eval.cli import parse_temperatures

    # "none": T = 0 only (replayed exactly at every checkpoint), no real decoding
    args.temperatures = [] if args.temperatures == "none" else parse_temperatures(args.temperatures)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:]))
    print(cmd, flush=True)
    print(provenance_line(), flush=True)

    from dataclasses import asdict, replace

    from specopd.config import load_recipe
    from specopd.mainjob import prepare, stage_cfg
    from specopd.models import load_target

    os.makedirs(args.out, exist_ok=True)
    cfg = load_recipe(args.recipe, [f"trainer.output_dir={os.path.join(args.out, 'main')}", *args.overrides])
    convs = cfg.data.source == "conversations"
    methods = [m.strip() for m in (args.methods or ",".join(m for m in METHODS if convs or m != "regen_ce"))
               .split(",") if m.strip()]
    benches = [b.strip() for b in (args.benches or ("mt-bench,sharegpt" if convs else "chat")).split(",")
               if b.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or "specopd" not in methods:
        ap.error(f"--methods: choose from {METHODS} and include specopd (the equal-time budget); got {methods}")
    if "regen_ce" in methods and not convs:
        ap.error("--methods regen_ce regenerates a conversations file's replies: it needs data.source=conversations")
    if [b for b in benches if b not in BENCH_NAMES] or ("sharegpt" in benches and not convs):
        ap.error(f"--benches: choose from {sorted(BENCH_NAMES)} (sharegpt: data.source=conversations); got {benches}")
    if args.judge == "vllm" and "mt-bench" not in benches:
        ap.error(f"--judge vllm judges MT-Bench's first turns: add mt-bench to --benches (got {benches})")
    if args.judge == "vllm":
        from specopd.engines import vllm_missing_reason

        why = vllm_missing_reason()
        if why:
            print(f"bench_al --judge vllm: vLLM cannot run here: {why}; or leave out --judge vllm (our decoder "
                  f"only)", file=sys.stderr)
            return 2
    if args.references == "dataset" and convs:
        ap.error("--references dataset: prepared data only (conversations data are the dataset's replies already)")

    t0 = time.perf_counter()
    prep = prepare(cfg)
    if args.references == "dataset":
        cfg.data.path = dataset_replies(cfg, prep, args.out)
        prep = replace(prep, train_data=cfg.data.path)
    if not prep.warm:
        raise SystemExit("bench_al: the recipe gives no starting drafter (drafter.init_from or a warm-up)")
    W = int(cfg.drafter.block_size) - 1  # drafted tokens (block_size counts the anchor)

    runs, regen = {}, None
    for m in methods:
        if m == "regen_ce":
            regen = regenerate(cfg, prep, args, args.out)
        runs[m] = train_run(cfg, prep, m, args.steps, args.eval_every, run_dir(args.out, "equal-steps", m, regen),
                            regen if m == "regen_ce" else None, keep_trunks=not args.no_keep_trunks)
    equal_time_runs = {}
    budget = runs["specopd"]["wall_at"][args.steps]
    if not args.no_equal_time:
        for m in methods:
            if m == "specopd":
                continue
            left = budget - runs[m]["regen_s"]
            n = max(0 if m == "regen_ce" else 1, round(left / max(runs[m]["mean_step_s"], 1e-9)))
            equal_time_runs[m] = (train_run(cfg, prep, m, n, n, run_dir(args.out, "equal-time", m, regen),
                                            regen if m == "regen_ce" else None, keep_trunks=not args.no_keep_trunks)
                                  if n > 0 else None)

    target = load_target(prep.target_dir)
    scfg = stage_cfg(cfg, prep)  # model.target: the prepared folder
    evs = {b: Evaluator(prep.target_dir, args, args.out, bench=b, target=target, cfg=scfg) for b in benches}

    def ev(folder: str, real: bool) -> dict:
        return {b: e(folder, real) for b, e in evs.items()}

    def flat(res: dict) -> dict:
        return {f"{b}/{k}": v["mean_al"] for b, r in res.items() for k, v in r.items()}

    def real(final: bool) -> bool:  # decoded for real by ours (--real-at); the rest are T=0 replays only
        return args.real_at == "all" or (args.real_at == "final" and final)

    warm_res = ev(prep.warm, real=real(True))
    rows = [_row("starting drafter (every method's step 0)", "warm", "start", 0, 0.0, 0.0, warm_res,
                 checkpoint=prep.warm)]
    curves = {}
    for m, r in runs.items():
        pts = [{"step": 0, "wall_s": r["regen_s"], "checkpoint": prep.warm, **flat(warm_res)}]
        last = r["checkpoints"][-1][0]
        for step, folder in r["checkpoints"]:
            res = ev(folder, real=real(step == last))
            train_s = r["wall_at"].get(step, float("nan"))
            pts.append({"step": step, "wall_s": r["regen_s"] + train_s, "train_wall_s": train_s, "checkpoint": folder,
                        "loss": r["loss_at"].get(step), **flat(res)})
            if step == last:
                label = "specopd (its wall time: the budget)" if m == "specopd" else f"{m} (equal steps)"
                rows.append(_row(label, m, "equal_steps", step, r["wall_at"].get(step, 0.0), r["regen_s"], res,
                                 r["loss_at"].get(step), checkpoint=folder))
        curves[m] = pts
    equal_time = {}
    for m, r in equal_time_runs.items():
        if r is None:  # regen_ce: regenerating alone took the budget
            step, folder, train_s, loss = 0, prep.warm, 0.0, None
        else:
            step, folder = r["checkpoints"][-1]
            train_s, loss = r["wall_at"].get(step, float("nan")), r["loss_at"].get(step)
        regen_s = runs[m]["regen_s"]
        res = ev(folder, real=real(True))
        equal_time[m] = {"step": step, "wall_s": regen_s + train_s, "train_wall_s": train_s, "regen_s": regen_s,
                         "checkpoint": folder, "budget_s": budget, **flat(res)}
        rows.append(_row(f"{m} (equal time)", m, "equal_time", step, train_s, regen_s, res, loss, checkpoint=folder))

    judged, vllm_cache = 0, None
    if args.judge == "vllm":  # vLLM's counters for every row decoded for real, one vLLM process
        judged, vllm_cache = vllm_judge(cfg, prep, args, rows)
    title = (f"{os.path.basename(args.recipe)}: every method from {prep.warm}, "
             f"{', '.join(f'{BENCH_NAMES[b]} ({len(e.prompts)})' for b, e in evs.items())} x {args.max_new_tokens} "
             f"tokens, W={W}; AL incl. bonus")
    print(f"\n{provenance_line()}\n{cmd}\n{title}")
    diffs = _tables(rows, evs, args.temperatures, W, judged)
    if judged:
        _judge_checks(rows, vllm_cache)
    curve_diffs = _curve_diffs(runs, evs)
    print("trainer.ce_weight (a CE term beside E2E-TV): " + ", ".join(f"{m} {r['ce_weight']:g}"
                                                                      for m, r in runs.items()))
    if regen:
        print(f"regen_ce: {regen['references']} references regenerated in {regen['regen_s']:.0f} s ({regen['engine']}, "
              f"{regen['dtype']}, T={regen['temperature']:g}, <= {regen['max_new_tokens']} tokens); SpecOPD's budget "
              f"{budget:.0f} s" + (f"; equal time: {equal_time['regen_ce']['step']} training steps"
                                   if "regen_ce" in equal_time else ""))
    data = {"command": cmd, "provenance": provenance_line(), "title": title, "recipe": args.recipe,
            "overrides": args.overrides, "methods": methods, "benches": benches,
            "prepare": asdict(prep), "warm": flat(warm_res),
            "curves": curves, "equal_time": equal_time, "budget_s": budget, "regen": regen,
            "rows": [{k: v for k, v in r.items() if k != "_res"} for r in rows], "specopd_minus": diffs,
            "specopd_minus_along_curve": curve_diffs,
            "temperatures": args.temperatures, "ce_weight": {m: r["ce_weight"] for m, r in runs.items()},
            "prompts": {b: len(e.prompts) for b, e in evs.items()},
            "prompt_ids": {b: [m["id"] for m in e.meta] for b, e in evs.items() if e.meta},
            "max_new_tokens": args.max_new_tokens, "al_includes_bonus": True, "judge": args.judge,
            "vllm_judged_prompts": judged, "vllm_judge": vllm_cache,
            "wall_s_total": time.perf_counter() - t0,
            "evaluations": evs[benches[0]].cache,  # the first set's, as depth_acceptance.py reads it
            "evaluations_by_bench": {b: e.cache for b, e in evs.items()}}
    with open(os.path.join(args.out, "bench_al.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    figs = _figures(args.out, data, benches, args.temperatures)
    print(f"\nwrote {os.path.join(args.out, 'bench_al.json')}, {', '.join(figs)}")
    missed = [r["method"] for r in rows if judged and os.path.abspath(r["checkpoint"]) not in vllm_cache]
    if missed:  # asked for and not given: not a result to report
        print(f"bench_al --judge vllm: vLLM did not judge {len(missed)} row(s) ({'; '.join(missed)}; why: above); "
              f"rerun the same command to judge them (everything else is cached)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
