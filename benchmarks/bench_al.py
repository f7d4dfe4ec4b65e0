"""Held-out acceptance length of SpecOPD against every baseline, from one warm drafter and one data set.

    python benchmarks/bench_al.py [--recipe recipes/smollm2-135m-dflash-chitchat.yaml] [--steps 60] [--eval-every 20]
        [--methods specopd,draft_opd,offpolicy_ce,offpolicy_e2e_tv] [--prompts 32] [--max-new-tokens 64]
        [--temperatures 0,1|none] [--real-at all|final] [--no-equal-time] [--references target|dataset]
        [--out runs/bench-al] [key=value ...]

1. prepare   the recipe's main-job stages 1-3 (``specopd.mainjob.prepare``: target, data, warm drafter; cached),
             so every method starts from the same warm drafter and trains on the same data
2. equal steps   each method trains ``--steps`` steps from the warm drafter (its own output folder, checkpoints
             every ``--eval-every`` steps); training wall time = the sum of the logged step times
3. equal time    each other method trains again from the warm drafter for round(budget / its mean step time)
             steps, where budget = SpecOPD's training wall time in 2 (each run with its own full LR schedule)
4. evaluate  every checkpoint (and the warm drafter, step 0) on ``--prompts`` held-out chat prompts x
             ``--max-new-tokens`` new tokens: T=0 AL replayed exactly on the target's greedy continuation
             (``specopd.eval.replay``: cheap, equal to real T=0 decoding), and real speculative decoding
             (``evaluate_al``) at each ``--temperatures`` on the checkpoints ``--real-at`` names (all: every
             checkpoint; final: the warm drafter and each run's last one)

``--references dataset``: every method trains on the dataset's own replies to the same prompts (the next turn of
each train conversation, ``write_dataset_replies``) instead of the target's answers: references the target did not
write, as a user's chat data comes before any regeneration.

Writes ``<out>/bench_al.json`` and two figures, ``al_vs_steps.png`` and ``al_vs_wall.png``; prints a table.
AL = tokens committed per target verification round, *including* the bonus token. Reruns reuse finished
training runs (``trainer.resume=auto``) and cached evaluations.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = ("specopd", "draft_opd", "offpolicy_ce", "offpolicy_e2e_tv")


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
    from specopd.train.checkpoint import complete_checkpoints

    return sorted(complete_checkpoints(run_dir))  # [(step, folder)]


class Evaluator:
    """Held-out AL of drafter checkpoints; results cached in <out>/eval_cache.json by (folder, what)."""

    def __init__(self, target_dir: str, args, out: str):
        import torch

        from specopd.data.conversations import heldout_prompt_ids
        from specopd.data.prepare import load_tokenizer, stop_token_ids
        from specopd.eval.replay import greedy_continuations
        from specopd.models import load_target

        self.args = args
        self.target = load_target(target_dir)
        bench = getattr(args, "bench", "chat")
        self.meta = None
        if bench == "mt-bench":  # MT-Bench's first turns: all 80, or --prompts of them, the same number per category
            from specopd.eval.bench import mtbench_prompts, stratified

            ids, meta = mtbench_prompts(target_dir, self.target.vocab_size)
            keep = stratified(meta, args.prompts)
            self.prompts, self.meta = [ids[i] for i in keep], [meta[i] for i in keep]
        else:
            self.prompts = heldout_prompt_ids(target_dir, self.target.vocab_size, args.prompts)
        self.stops = sorted(stop_token_ids(load_tokenizer(target_dir, self.target.vocab_size), self.target))
        # one cache per evaluation set: results of other prompt sets / counts / lengths never mix
        tag = "" if bench == "chat" else f"{bench}_"
        self.cache_path = os.path.join(out, f"eval_cache_{tag}{args.prompts}x{args.max_new_tokens}.json")
        self.cache = json.load(open(self.cache_path)) if os.path.isfile(self.cache_path) else {}
        cont_path = os.path.join(out, f"greedy_continuations_{tag}{args.prompts}x{args.max_new_tokens + 32}.pt")
        if os.path.isfile(cont_path):
            self.conts = torch.load(cont_path)
        else:  # + 32 covers every block size up to 32 drafted tokens
            self.conts = greedy_continuations(self.target, self.prompts, args.max_new_tokens + 32, progress=True)
            torch.save(self.conts, cont_path)

    def _save(self):
        tmp = self.cache_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.cache, f, indent=1)
        os.replace(tmp, self.cache_path)

    def __call__(self, folder: str, real: bool) -> dict:
        from specopd.drafters import load_drafter
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
        return res


def dataset_replies(cfg, prep: dict, out: str) -> str:
    """The dataset's own replies to the prompts the pipeline's references answer -> <out>/main/data/...jsonl."""
    from specopd.data.conversations import write_dataset_replies
    from specopd.data.prepare import load_tokenizer
    from specopd.mainjob import reference_prompts
    from specopd.models.loading import read_config

    tok = load_tokenizer(prep["target_dir"], int(read_config(prep["target_dir"])["vocab_size"]))
    path = os.path.join(out, "main", "data", f"dataset_replies_{cfg.pipeline.data_num}.jsonl")
    c = write_dataset_replies(tok, path, reference_prompts(cfg, tok), cfg.data.seq_len)
    print(f"[bench_al] the dataset's own replies: {c['written']} references ({c['supervised_tokens']} response "
          f"tokens; {c['skipped']} prompts without a reply skipped) -> {path}", flush=True)
    return path


def train_run(cfg, prep, method: str, steps: int, save_every: int, out_dir: str) -> dict:
    """Train ``method`` from the warm drafter for ``steps`` (resumable); -> {steps, wall_at, checkpoints}."""
    from specopd.mainjob import stage_cfg
    from specopd.train.loop import train

    c = stage_cfg(cfg, prep, method=method, output_dir=out_dir, max_steps=steps, save_every=save_every,
                  keep_last=max(2, steps // max(1, save_every) + 1),
                  cache_trunks=method.startswith("offpolicy"))  # the off-policy baselines as fast as they go
    done = [s for s, _ in _checkpoints(out_dir)]
    if not done or max(done) < steps:
        print(f"\n[bench_al] {method}: {steps} steps from the warm drafter (trainer.ce_weight="
              f"{c.trainer.ce_weight:g}) -> {out_dir}", flush=True)
        train(c, progress=True)
    m = _metrics(out_dir)
    return {"steps": steps, "wall_at": _wall_at(m), "checkpoints": _checkpoints(out_dir), "loss_at": _loss_at(m),
            "mean_step_s": (sum(x.get("step_s", 0.0) for x in m) / max(1, len(m))),
            "ce_weight": c.trainer.ce_weight}


def _row(label, steps, wall, res, temps, w, loss=None) -> dict:
    row = {"method": label, "steps": steps, "train_wall_s": round(wall, 1), "loss": loss,
           "al_t0_replay": res["replay_t0"]["mean_al"], "se_t0_replay": res["replay_t0"].get("se"),
           "_lengths": {"t0_replay": res["replay_t0"]["accept_lengths"]}}
    for t in temps:
        r = res.get(f"real_t{t:g}")
        if r:
            row[f"al_t{t:g}"] = r["mean_al"]
            row[f"se_t{t:g}"] = r.get("se")
            row["_lengths"][f"t{t:g}"] = r["accept_lengths"]
            row[f"accept_t{t:g}"] = [f"{a / n:.2f} ({a}/{n})" if n else "-"
                                     for a, n in zip(r["accepted_at"], r["reached_at"])][:w]
    return row


def _figures(out: str, data: dict, temps: list) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"specopd": "C3", "draft_opd": "C0", "offpolicy_ce": "C2", "offpolicy_e2e_tv": "C1"}
    paths = []
    for xkey, fname, xlabel in (("step", "al_vs_steps.png", "training steps from the warm drafter"),
                                ("wall_s", "al_vs_wall.png", "training wall time from the warm drafter (s)")):
        extra = 1 if xkey == "step" else 0  # a panel of each method's training loss (relative to its first)
        fig, axes = plt.subplots(1, 1 + len(temps) + extra, figsize=(5.2 * (1 + len(temps) + extra), 4.2),
                                 squeeze=False)
        if extra:
            ax = axes[0][-1]
            for method, pts in data["curves"].items():
                xs = [p["step"] for p in pts if p.get("loss") is not None]
                ys = [p["loss"] for p in pts if p.get("loss") is not None]
                if xs:
                    ax.plot(xs, [y / ys[0] for y in ys], "-o", ms=4, color=colors.get(method), label=method)
            ax.set_title("training loss / its value at the first checkpoint (10-step mean)", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        panels = [("replay_t0", "T=0 (replayed greedy decoding, every checkpoint)")] + [
            (f"real_t{t:g}", f"T={t:g} (real speculative decoding)") for t in temps]
        for ax, (key, title) in zip(axes[0], panels):
            for method, pts in data["curves"].items():
                xs = [p[xkey] for p in pts if key in p]
                ys = [p[key] for p in pts if key in p]
                if xs:
                    ax.plot(xs, ys, "-o", ms=4, color=colors.get(method), label=method)
            for method, p in data.get("equal_time", {}).items():
                if key in p and xkey == "wall_s":
                    ax.plot([p["wall_s"]], [p[key]], "*", ms=12, color=colors.get(method),
                            label=f"{method} (equal time: {p['step']} steps)")
            ax.axhline(data["warm"].get(key, float("nan")), color="gray", ls=":", lw=1, label="warm drafter")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out AL (incl. bonus)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(data["title"], fontsize=9)
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "smollm2-135m-dflash-chitchat.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--real-at", choices=["all", "final"], default="all")
    ap.add_argument("--no-equal-time", action="store_true")
    ap.add_argument("--references", choices=["target", "dataset"], default="target",
                    help="train on the target's answers (the pipeline's references) or the dataset's own replies")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-al"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value")
    args = ap.parse_args(argv)
    from specopd.eval.cli import parse_temperatures

    # "none": T = 0 only (replayed exactly at every checkpoint), no real decoding
    args.temperatures = [] if args.temperatures == "none" else parse_temperatures(args.temperatures)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or "specopd" not in methods:
        ap.error(f"--methods: choose from {METHODS} and include specopd (the equal-time budget); got {methods}")
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:]))
    print(cmd, flush=True)

    from specopd.config import load_recipe
    from specopd.eval.cli import al_diff_stderr
    from specopd.mainjob import prepare

    os.makedirs(args.out, exist_ok=True)
    cfg = load_recipe(args.recipe, [f"trainer.output_dir={os.path.join(args.out, 'main')}", *args.overrides])
    t0 = time.perf_counter()
    prep = prepare(cfg)
    if args.references == "dataset":
        prep["train_data"] = cfg.data.path = dataset_replies(cfg, prep, args.out)
    ev = Evaluator(prep["target_dir"], args, args.out)
    W = int(cfg.drafter.block_size) - 1  # drafted tokens (block_size counts the anchor)

    runs = {m: train_run(cfg, prep, m, args.steps, args.eval_every, os.path.join(args.out, "equal-steps", m))
            for m in methods}
    warm_res = ev(prep["warm"], real=True) if prep["warm"] else None
    curves, rows = {}, []
    if warm_res:
        rows.append(_row("warm drafter (start of every method)", 0, 0.0, warm_res, args.temperatures, W))
    for m, r in runs.items():
        pts = []
        last = r["checkpoints"][-1][0]
        for step, folder in r["checkpoints"]:
            res = ev(folder, real=args.real_at == "all" or step == last)
            pts.append({"step": step, "wall_s": r["wall_at"].get(step, float("nan")), "checkpoint": folder,
                        "loss": r["loss_at"].get(step), **{k: v["mean_al"] for k, v in res.items()}})
            if step == last:
                rows.append(_row(m, step, r["wall_at"].get(step, 0.0), res, args.temperatures, W,
                                 r["loss_at"].get(step)))
        if warm_res:
            pts.insert(0, {"step": 0, "wall_s": 0.0, "checkpoint": prep["warm"],
                           **{k: v["mean_al"] for k, v in warm_res.items()}})
        curves[m] = pts

    equal_time = {}
    if not args.no_equal_time:
        budget = runs["specopd"]["wall_at"][args.steps]
        for m in methods:
            if m == "specopd":
                continue
            n = max(1, round(budget / max(runs[m]["mean_step_s"], 1e-9)))
            r = train_run(cfg, prep, m, n, n, os.path.join(args.out, "equal-time", m))
            step, folder = r["checkpoints"][-1]
            res = ev(folder, real=True)
            equal_time[m] = {"step": step, "wall_s": r["wall_at"].get(step, float("nan")), "checkpoint": folder,
                             "budget_s": budget, **{k: v["mean_al"] for k, v in res.items()}}
            rows.append(_row(f"{m} (equal time)", step, r["wall_at"].get(step, 0.0), res, args.temperatures, W,
                             r["loss_at"].get(step)))

    title = (f"{os.path.basename(args.recipe)}: {len(ev.prompts)} held-out chat prompts x {args.max_new_tokens} "
             f"tokens, W={W}, from one warm drafter; AL incl. bonus")
    data = {"command": cmd, "title": title, "recipe": args.recipe, "overrides": args.overrides,
            "prepare": {k: v for k, v in prep.items() if k != "cfg"}, "warm": {k: v["mean_al"] for k, v in
                                                                              (warm_res or {}).items()},
            "curves": curves, "equal_time": equal_time, "rows": rows, "temperatures": args.temperatures,
            "ce_weight": {m: r["ce_weight"] for m, r in runs.items()},
            "prompts": len(ev.prompts), "max_new_tokens": args.max_new_tokens, "al_includes_bonus": True,
            "wall_s_total": time.perf_counter() - t0, "evaluations": ev.cache}
    with open(os.path.join(args.out, "bench_al.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    figs = _figures(args.out, data, args.temperatures)

    cols = ["al_t0_replay"] + [f"al_t{t:g}" for t in args.temperatures]
    print(f"\n{title}\n{cmd}")
    print(f"{'method':<40}{'steps':>6}{'train s':>9}{'loss':>9}" + "".join(f"{c + ' +- se':>20}" for c in cols))
    for r in rows:
        se = {c: r.get(c.replace("al_", "se_")) for c in cols}
        loss = f"{r['loss']:>9.4f}" if r.get("loss") is not None else f"{'':>9}"
        print(f"{r['method']:<40}{r['steps']:>6}{r['train_wall_s']:>9.0f}{loss}" +
              "".join(f"{r[c]:>12.3f} +- {se[c]:.3f}" if c in r else f"{'':>20}" for c in cols))
    print("trainer.ce_weight (a CE term beside E2E-TV): " + ", ".join(f"{m} {r['ce_weight']:g}"
                                                                      for m, r in runs.items()))
    ref = next(r for r in rows if r["method"] == "specopd")
    print(f"\nSpecOPD minus each row, paired over the same prompts (difference +- its standard error; > 2 se: "
          f"SpecOPD ahead beyond noise)")
    for r in rows:
        if r is ref:
            continue
        cells = []
        for c in cols:
            key = c.replace("al_", "")
            if c in r and key in r["_lengths"] and key in ref["_lengths"]:
                d = ref[c] - r[c]
                se = al_diff_stderr(ref["_lengths"][key], r["_lengths"][key])
                r.setdefault("specopd_minus", {})[c] = {"diff": d, "se": se}
                cells.append(f"{d:>+12.3f} +- {se:.3f}")
            else:
                cells.append(f"{'':>20}")
        print(f"{r['method']:<40}{'':>24}" + "".join(cells))
    for t in args.temperatures:
        print(f"\nacceptance at draft position 1..{W}, T={t:g} (accepted/reached; '-' never reached)")
        for r in rows:
            if f"accept_t{t:g}" in r:
                print(f"{r['method']:<40}" + "  ".join(r[f"accept_t{t:g}"]))
    with open(os.path.join(args.out, "bench_al.json"), "w") as f:  # again, with the paired differences
        json.dump(data, f, indent=1, default=str)
    print(f"\nwrote {os.path.join(args.out, 'bench_al.json')}, {', '.join(figs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
