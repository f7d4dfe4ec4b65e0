"""DFlash V2 against DFlash (V1) at equal wall time, pretraining and SpecOPD, and SpecOPD against off-policy E2E-TV
for V2: the measurement DFLASH2.md owes, on the main job's data and MT-Bench.

    python benchmarks/bench_v2.py [--budget-s 750] [--probe-steps 6] [--pretrain-eval-every 25] [--opd-steps 80]
        [--opd-eval-every 40] [--prompts 80] [--max-new-tokens 64] [--stages pretrain,specopd,e2e]
        [--out runs/bench-v2] [--both key=value ...] [--v2 key=value ...] [--v2-pretrain key=value ...] [--t1]

Every training run is on one process (``runtime.backend=local``, one worker): pin the whole script to one core
(``taskset -c 1 env OMP_NUM_THREADS=1``) so V1 and V2 get the same machine.

1. pretrain  from scratch, recipes/smollm2-135m-dflash-sharegpt.yaml (off-policy CE on ShareGPT's replies), V1 =
             ``drafter.kind=dflash`` as shipped (2 layers, block 5, features [2,15,27]), V2 = ``drafter.kind=dflash2``
             of the same shape (``--v2``: its recipe overrides, e.g. ``drafter.architecture.*``, default none,
             DFLASH2.md's defaults; ``--v2-pretrain``: more for its pretraining alone, e.g.
             ``trainer.vocab_ce_weight=1``). Each kind first trains ``--probe-steps`` steps (its own folder) for
             its mean step time (the first step left out: warm-up); then max_steps = round(``--budget-s`` / that time), so the LR
             schedule of each ends at the budget. Held-out expected AL every ``--pretrain-eval-every`` steps
             (the recipe's held-out ShareGPT split), against the training wall time (sum of logged step times;
             the held-out evaluations are not counted)
2. specopd   from each pretrained drafter, SpecOPD with the main job's recipe (recipes/smollm2-135m-dflash.yaml,
             ``drafter.init_from`` = the pretrained final checkpoint, ``drafter.kind`` matching, one local
             worker instead of 2 Ray workers: the same global batch). V2 trains ``--opd-steps`` steps (this run is
             stage 3's SpecOPD run: ``bench_al.py``'s equal-steps/specopd folder); V1 then trains
             round(V2's training wall time / V1's probed SpecOPD step time) steps
3. e2e       ``bench_al.py --methods specopd,offpolicy_e2e_tv --benches mt-bench --temperatures none`` from the
             pretrained V2 drafter, ``--steps --opd-steps``: equal steps and equal time, paired standard errors
4. evaluate  every final drafter on MT-Bench's first turns (``--prompts``, the same number per category) x
             ``--max-new-tokens``, T=0 by exact replay (``specopd.eval.replay``; ``bench_al.Evaluator``, whose cache
             in ``--out`` stage 3 shares); differences paired over the same prompts, +- one standard error. Also
             each pretraining's checkpoint before its last; V2's drafters again with the selector's pair term off
             (successor codebook zeroed: the top raw candidate is drafted); and the first drafted slot teacher-forced
             at every anchor (``first_slot_recall``: the target's greedy token among the top K raw logits, and
             drafted): where V2 loses, its candidate set or its selector. ``--t1``: the final drafters also
             decoded at ``--t1-temperature`` by our lossless speculative decoder on the same prompts, paired

Prints its command, the provenance line, the tables; writes ``<out>/bench_v2.json`` and ``<out>/pretrain_al.png``.
Resumable: finished runs (``trainer.resume=auto``) and cached evaluations are reused.
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PRETRAIN = os.path.join(ROOT, "recipes", "smollm2-135m-dflash-sharegpt.yaml")
MAIN = os.path.join(ROOT, "recipes", "smollm2-135m-dflash.yaml")
KINDS = {"v1": "dflash", "v2": "dflash2"}
LOCAL = ["runtime.backend=local", "runtime.num_workers=1"]


def _metrics(d: str) -> list:
    from bench_al import _metrics as m

    return m(d)


def _mean_step_s(d: str) -> float:
    ms = sorted(_metrics(d), key=lambda m: m["step"])[1:]  # the first step warms up
    return sum(m["step_s"] for m in ms) / len(ms)


def _checkpoints(d: str) -> list:
    from bench_al import _checkpoints as c

    return c(d)


def _final(d: str):
    cks = _checkpoints(d)
    return cks[-1] if cks else (0, None)


def _train(recipe: str, overrides: list, steps: int) -> None:
    from specopd.config import load_recipe
    from specopd.train.loop import train

    cfg = load_recipe(recipe, overrides)
    done = _final(cfg.trainer.output_dir)[0]
    if done >= steps:
        print(f"[bench_v2] {cfg.trainer.output_dir}: {done} steps exist", flush=True)
        return
    print(f"[bench_v2] train {os.path.basename(recipe)} {' '.join(overrides)}", flush=True)
    train(cfg, progress=True)


def probe(recipe: str, kind_overrides: list, out: str, steps: int) -> float:
    """Mean step time (s) of ``steps`` training steps (the first left out)."""
    _train(recipe, [*kind_overrides, f"trainer.output_dir={out}", f"trainer.max_steps={steps}",
                    "trainer.eval_heldout=false", "trainer.eval_every=0", f"trainer.save_every={steps}",
                    "profile.enabled=false"], steps)
    return _mean_step_s(out)


def pretrain(args, kind: str, extra: list) -> dict:
    base = [f"drafter.kind={KINDS[kind]}", *extra]
    step_s = probe(PRETRAIN, base, os.path.join(args.out, "probe", f"pretrain-{kind}"), args.probe_steps)
    n = max(1, round(args.budget_s / step_s))
    d = os.path.join(args.out, "pretrain", kind)
    _train(PRETRAIN, [*base, f"trainer.output_dir={d}", f"trainer.max_steps={n}", "trainer.eval_heldout=true",
                      f"trainer.eval_every={args.pretrain_eval_every}",
                      f"trainer.save_every={2 * args.pretrain_eval_every}", "trainer.keep_last=2"], n)
    ms = sorted(_metrics(d), key=lambda m: m["step"])
    wall, curve = 0.0, []
    for m in ms:
        wall += m["step_s"]
        if "heldout_expected_al" in m:
            curve.append({"step": m["step"], "train_wall_s": round(wall, 1), "heldout_al": m["heldout_expected_al"],
                          "heldout_alpha": m.get("heldout_alpha")})
    step, folder = _final(d)
    return {"kind": KINDS[kind], "overrides": base, "probe_step_s": step_s, "steps": n, "train_wall_s": wall,
            "curve": curve, "final": folder, "final_step": step}


def first_slot_recall(drafter, target, prompts, conts, max_new_tokens: int, k: int) -> dict:
    """The first drafted slot teacher-forced at every anchor of the greedy continuations (prompt's last token to
    the ``max_new_tokens``-th new one): how often the target's next greedy token is among the drafter's top ``k``
    raw logits (V2: its K candidates), and how often the drafted token (V1: argmax; V2: the selector's pick after
    the anchor token) is that token."""
    import torch

    hits = top1 = n = 0
    fl = tuple(drafter.feature_layers)
    drafter.eval()
    with torch.no_grad():
        for p, c in zip(prompts, conts):
            p, c = torch.as_tensor(p).reshape(-1), torch.as_tensor(c).reshape(-1)
            seq = torch.cat([p, c])
            first, last = p.numel() - 1, p.numel() - 1 + max_new_tokens - 1
            feats = target.prefill(seq[:last], feature_layers=fl, keep_logits=False).features
            a = torch.arange(first, last + 1)
            h = drafter.hidden([feats], a, torch.zeros_like(a), seq[a])[:, :1]  # [n, 1, D]
            ref = seq[a + 1]
            if drafter.kind == "dflash2":
                cands = drafter.candidates(h)
                ids = cands.ids[:, 0]
                pick, _, _ = drafter.walk(cands, seq[a], 0.0)
                pick = pick[:, 0]
            else:
                logits = drafter.logits_from_hidden(h)[:, 0]
                ids = logits.topk(k, -1).indices
                pick = logits.argmax(-1)
            hits += int((ids == ref[:, None]).any(-1).sum())
            top1 += int((pick == ref).sum())
            n += int(ref.numel())
    return {"k": k, "slots": n, "in_top_k": hits / n, "drafted_is_greedy": top1 / n}


def _figure(out: str, pre: dict, name: str = "pretrain_al.png") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for kind, r in pre.items():
        xs = [0.0] + [p["train_wall_s"] for p in r["curve"]]
        ys = [r.get("heldout_al_0", 1.0)] + [p["heldout_al"] for p in r["curve"]]
        ax.plot(xs[1:], ys[1:], "-o", ms=3, label=f"{kind} ({r['kind']}, {r['steps']} steps)")
    ax.set_xlabel("training wall time (s, sum of step times; one core)")
    ax.set_ylabel("held-out expected AL (ShareGPT)")
    ax.set_title("pretraining, off-policy CE, equal budget", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_runs(path: str, runs: list) -> str:
    """One figure of the pretraining curves of finished runs: ``runs`` = [LABEL=OUT_DIR, ...] (V1 from the
    first; each run's V2 under its label)."""
    pre = {}
    for i, spec in enumerate(runs):
        label, out = spec.rsplit("=", 1)
        data = json.load(open(os.path.join(out, "bench_v2.json")))["pretrain"]
        if i == 0:
            pre["V1"] = data["v1"]
        pre[label] = data["v2"]
    return _figure(os.path.dirname(os.path.abspath(path)), pre, os.path.basename(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=750.0, help="pretraining wall-time budget of each kind (s)")
    ap.add_argument("--probe-steps", type=int, default=6)
    ap.add_argument("--pretrain-eval-every", type=int, default=25)
    ap.add_argument("--opd-steps", type=int, default=80, help="V2's SpecOPD steps (and bench_al's --steps)")
    ap.add_argument("--opd-eval-every", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stages", default="pretrain,specopd,e2e")
    ap.add_argument("--t1", action="store_true", help="also decode the final drafters at --t1-temperature")
    ap.add_argument("--t1-temperature", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-v2"))
    ap.add_argument("--v2", nargs="*", default=[], help="V2's recipe overrides, every stage (drafter.architecture.*)")
    ap.add_argument("--both", nargs="*", default=[], help="overrides for both kinds, every stage (seed=1)")
    ap.add_argument("--v2-pretrain", nargs="*", default=[],
                    help="V2's overrides for its pretraining only (trainer.vocab_ce_weight=1)")
    ap.add_argument("--plot-runs", nargs="*", metavar="LABEL=OUT",
                    help="only draw the pretraining curves of finished runs into one figure (--plot-to) and exit")
    ap.add_argument("--plot-to", default="pretrain_al.png")
    args = ap.parse_args(argv)
    if args.plot_runs:
        print(plot_runs(args.plot_to, args.plot_runs))
        return 0
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(argv or sys.argv[1:]))
    print(cmd, flush=True)
    from specopd.config import load_recipe
    from specopd.eval.bench import provenance_line

    print(provenance_line(), flush=True)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    extra = {"v1": list(args.both), "v2": [*args.both, *args.v2]}
    extra_pre = {"v1": list(args.both), "v2": [*args.both, *args.v2, *args.v2_pretrain]}

    # 1. pretraining at equal wall time
    pre = {k: pretrain(args, k, extra_pre[k]) for k in KINDS}
    data = {"command": cmd, "provenance": provenance_line(), "budget_s": args.budget_s, "pretrain": pre}

    # 2./3. SpecOPD from each; V2's run is bench_al's equal-steps SpecOPD run
    bench_out = os.path.join(args.out, "bench-al-v2")
    opd = {}
    if "specopd" in stages or "e2e" in stages:
        import bench_al

        methods = "specopd,offpolicy_e2e_tv" if "e2e" in stages else "specopd"
        al_argv = ["--recipe", MAIN, "--steps", str(args.opd_steps), "--eval-every", str(args.opd_eval_every),
                   "--methods", methods, "--benches", "mt-bench", "--prompts", str(args.prompts),
                   "--max-new-tokens", str(args.max_new_tokens), "--temperatures", "none", "--out", bench_out,
                   f"drafter.kind=dflash2", f"drafter.init_from={pre['v2']['final']}", *extra["v2"], *LOCAL]
        print(f"\n[bench_v2] stage 3 (and V2's SpecOPD): bench_al.py {' '.join(shlex.quote(a) for a in al_argv)}",
              flush=True)
        bench_al.main(al_argv)
        v2_dir = os.path.join(bench_out, "equal-steps", "specopd")
        v2_wall = sum(m["step_s"] for m in _metrics(v2_dir))
        opd["v2"] = {"dir": v2_dir, "steps": args.opd_steps, "train_wall_s": v2_wall, "final": _final(v2_dir)[1]}
        data["bench_al"] = json.load(open(os.path.join(bench_out, "bench_al.json")))
        data["bench_al"].pop("evaluations", None)
        data["bench_al"].pop("evaluations_by_bench", None)
        # V1: SpecOPD at V2's training wall time
        from specopd.mainjob import prepare

        cfg = load_recipe(MAIN, [f"trainer.output_dir={os.path.join(args.out, 'specopd-v1-main')}",
                                 "drafter.kind=dflash", f"drafter.init_from={pre['v1']['final']}", *extra["v1"],
                                 *LOCAL])
        prep = prepare(cfg)
        pdir = os.path.join(args.out, "probe", "specopd-v1")
        bench_al.train_run(cfg, prep, "specopd", args.probe_steps, args.probe_steps, pdir)
        v1_step = _mean_step_s(pdir)
        n1 = max(1, round(v2_wall / v1_step))
        v1_dir = os.path.join(args.out, "specopd", "v1")
        bench_al.train_run(cfg, prep, "specopd", n1, n1, v1_dir)
        opd["v1"] = {"dir": v1_dir, "steps": n1, "probe_step_s": v1_step,
                     "train_wall_s": sum(m["step_s"] for m in _metrics(v1_dir)), "final": _final(v1_dir)[1]}
        data["specopd"] = opd

    # 4. MT-Bench T=0 replay of every final drafter
    from types import SimpleNamespace

    from bench_al import Evaluator
    from specopd.eval.cli import acceptance_cells, al_diff_stderr
    from specopd.models import load_target

    target_dir = load_recipe(PRETRAIN).model.target  # the converted target's folder
    temps = [float(args.t1_temperature)] if args.t1 else []
    ev = Evaluator(target_dir, SimpleNamespace(prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                               temperatures=temps), bench_out if opd else args.out, bench="mt-bench",
                   target=load_target(target_dir))
    rows = [("V1 pretrained", pre["v1"]["final"]), ("V2 pretrained", pre["v2"]["final"])]
    if opd:
        rows += [("V1 + SpecOPD", opd["v1"]["final"]), ("V2 + SpecOPD", opd["v2"]["final"])]
    # the checkpoint before each pretraining's last (is the final one typical of its run?)
    for k in KINDS:
        cks = _checkpoints(os.path.join(args.out, "pretrain", k))
        if len(cks) > 1:
            rows.append((f"{k.upper()} pretrained, step {cks[-2][0]}", cks[-2][1]))
    res = {label: ev(folder, real=False)["replay_t0"] for label, folder in rows}
    # V2 with its selector's pair term off (successor codebook zeroed): the top-1 raw candidate, V2's backbone
    # drafting as DFlash does; tells the candidate set's loss from the selector's
    diag_path = os.path.join(args.out, "diagnosis.json")
    diag = json.load(open(diag_path)) if os.path.isfile(diag_path) else {}
    for label, folder in list(rows):
        if not label.startswith("V2"):
            continue
        key = os.path.abspath(folder)
        if key not in diag:
            import torch

            from specopd.drafters import load_drafter
            from specopd.eval.cli import al_stderr
            from specopd.eval.replay import replay_greedy_al

            d = load_drafter(folder, ev.target)
            with torch.no_grad():
                d.candidate_selector.successor_codebook.zero_()
            r = replay_greedy_al(ev.target, d, ev.prompts, ev.conts, args.max_new_tokens, ev.stops)
            diag[key] = {**{k: r[k] for k in ("mean_al", "accepted_at", "reached_at", "accept_lengths")},
                         "se": al_stderr(r["accept_lengths"])}
            with open(diag_path, "w") as f:
                json.dump(diag, f)
        res[f"{label}, pair term off"] = diag[key]
        rows.append((f"{label}, pair term off", folder))
    recall = diag.setdefault("first_slot", {})
    for label, folder in [r for r in rows if "pair term off" not in r[0]]:
        key = os.path.abspath(folder)
        if key not in recall:
            from specopd.drafters import load_drafter

            d = load_drafter(folder, ev.target)
            v2_k = json.load(open(os.path.join(pre["v2"]["final"], "config.json")))["selector_top_k"]
            k = d.top_k if d.kind == "dflash2" else int(v2_k)  # V1: its top K at V2's K
            recall[key] = first_slot_recall(d, ev.target, ev.prompts, ev.conts, args.max_new_tokens, k)
            with open(diag_path, "w") as f:
                json.dump(diag, f)
    data["first_slot"] = {label: recall[os.path.abspath(folder)] for label, folder in rows
                          if "pair term off" not in label}

    def diff(a: str, b: str) -> dict:
        x, y = res[a], res[b]
        return {"a": a, "b": b, "diff": x["mean_al"] - y["mean_al"],
                "se": al_diff_stderr(x["accept_lengths"], y["accept_lengths"])}

    pairs = [("V2 pretrained", "V1 pretrained"), ("V2 pretrained, pair term off", "V2 pretrained")]
    if opd:
        pairs += [("V2 + SpecOPD", "V1 + SpecOPD"), ("V1 + SpecOPD", "V1 pretrained"),
                  ("V2 + SpecOPD", "V2 pretrained")]
    diffs = [diff(a, b) for a, b in pairs]
    # T > 0 (--t1): the final drafters decoded for real by our lossless speculative decoder, the same prompts
    real, real_diffs = {}, []
    if temps:
        tk = f"real_t{temps[0]:g}"
        finals = [(label, folder) for label, folder in rows[: 4 if opd else 2]]
        real = {label: ev(folder, real=True)[tk] for label, folder in finals}
        for a, b in [p for p in pairs if p[0] in real and p[1] in real]:
            real_diffs.append({"a": a, "b": b, "diff": real[a]["mean_al"] - real[b]["mean_al"],
                               "se": al_diff_stderr(real[a]["accept_lengths"], real[b]["accept_lengths"])})

    print(f"\n{provenance_line()}\n{cmd}")
    print(f"\n== pretraining at equal wall time ({args.budget_s:.0f} s budget each, one core): held-out expected AL "
          f"(ShareGPT) against training wall time")
    for k, r in pre.items():
        print(f"{k} ({r['kind']}): probed step time / V1's {r['probe_step_s'] / pre['v1']['probe_step_s']:.2f}, "
              f"{r['steps']} steps, training wall / budget {r['train_wall_s'] / args.budget_s:.2f}")
        print("   " + "  ".join(f"{p['step']}@{p['train_wall_s']:.0f}s:{p['heldout_al']:.4f}" for p in r["curve"]))
    if opd:
        print(f"\n== SpecOPD at equal wall time (main recipe, one worker): V2 {opd['v2']['steps']} steps, V1 "
              f"{opd['v1']['steps']} steps; training wall V1 / V2 "
              f"{opd['v1']['train_wall_s'] / opd['v2']['train_wall_s']:.2f}")
    print(f"\n== MT-Bench first turns: {len(ev.prompts)} prompts x {args.max_new_tokens} new tokens, T=0 (exact "
          f"replay), AL incl. the bonus (mean +- standard error over prompts)")
    for label, folder in rows:
        r = res[label]
        print(f"{label:<40} {r['mean_al']:.4f} +- {r['se']:.4f}   per position "
              f"{'  '.join(acceptance_cells(r))}   {os.path.relpath(folder, ROOT)}")
    print("first drafted slot, teacher-forced at every anchor: the target's greedy token among the top K raw "
          "logits (V2: its candidates), and the drafted token equal to it")
    for label, r in data["first_slot"].items():
        print(f"  {label:<40} in top {r['k']}: {r['in_top_k']:.3f}   drafted: {r['drafted_is_greedy']:.3f}   "
              f"({r['slots']} slots)")
    print("paired differences over the same prompts, +- one standard error ('*': beyond two)")
    for d in diffs:
        star = " *" if abs(d["diff"]) > 2 * d["se"] else ""
        print(f"  {d['a']} minus {d['b']}: {d['diff']:+.4f} +- {d['se']:.4f}{star}")
    if real:
        print(f"\n== the same prompts, T={temps[0]:g}: decoded by our speculative decoder (lossless), AL incl. the bonus")
        for label, r in real.items():
            print(f"{label:<40} {r['mean_al']:.4f} +- {r['se']:.4f}   per position {'  '.join(acceptance_cells(r))}")
        for d in real_diffs:
            star = " *" if abs(d["diff"]) > 2 * d["se"] else ""
            print(f"  {d['a']} minus {d['b']}: {d['diff']:+.4f} +- {d['se']:.4f}{star}")
        data.update(mtbench_real={label: {k: r[k] for k in ("mean_al", "se", "accepted_at", "reached_at")}
                                  for label, r in real.items()}, real_temperature=temps[0], real_diffs=real_diffs)
    data.update(mtbench={label: {k: r[k] for k in ("mean_al", "se", "accepted_at", "reached_at")}
                         for label, r in res.items()}, diffs=diffs, prompts=len(ev.prompts),
                max_new_tokens=args.max_new_tokens, wall_s_total=time.perf_counter() - t0)
    fig = _figure(args.out, pre)
    with open(os.path.join(args.out, "bench_v2.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"\nwrote {os.path.join(args.out, 'bench_v2.json')}, {fig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
