"""A simulated RL run on the CPU: does a followed drafter keep up with a policy that drifts, and at what cost?

Policies: v0 is SmolLM2-135M-Instruct (`specopd prepare model smollm2-135m`); each next version is the one before
after ``--sft-steps`` full fine-tuning steps (AdamW, transformers) on chitchat-dataset's *train* conversations, the
assistant turns supervised: a drift toward chitchat's casual human style (``--drift-data chitchat``), or on the
first exchange of ShareGPT's *train* conversations whose reply is code or a long answer (``sharegpt-code``,
``sharegpt-long``; split by id as the shipped drafter's recipe splits ShareGPT). Written under
``<out>/policies/v<N>`` (never committed).

Per version v: rollouts sampled from policy v at T = 1 by vLLM (`prepare_data(engine="vllm")`, its own process):
``--rollouts`` train prompts (chitchat train first turns, new ones each version) and ``--eval-prompts`` held-out
prompts (chitchat's held-out conversations, the same every version), in the prepared-data format with
``policy_version``. Then three drafters, served in vLLM with policy v on the held-out prompts at T = 1 (one engine
each, one process; vLLM's counters, per request):

- frozen: the shipped drafter (recipes/drafters/smollm2-135m-dflash), never updated;
- followed: one ``DrafterFollower`` through all versions: ``update_policy(v)``, ``add_rollouts`` (v's train
  rollouts; the first ``--staleness-prompts`` held-out ones marked held out: its staleness measure),
  ``train()`` for ``--follow-steps`` (``--follow-budget steps``) or ``--passes`` over v's train rollouts
  (``epoch``: ceil(passes x rollouts / batch) steps), ``export(v)``;
- retrained: the shipped drafter retrained off-policy (``--retrain-method``) on v's rollouts from scratch each
  version, for the same training seconds the follower spent on v.

AL = 1 + accepted / rounds from vLLM's counters, pooled over the prompts. Standard errors are per prompt: vLLM
reports each request's accepted count per verify step (``per_request_spec_decode_metrics``; they add up to its
counters, checked), so each prompt's rounds give a pooled AL's SE and a paired difference's (``al_stderr``,
``al_diff_stderr``: the delta method, prompts as the units).
Every stage's output is cached under ``--out``: a rerun (after a kill) does only what is missing.

The follow cost is given with and without the follower's staleness measure (its held-out expected AL before and
after each version: a measurement, not part of following); the cost target is judged without it.

    python benchmarks/bench_follow.py [--versions 3] [--rollouts 24] [--eval-prompts 16] [--max-new-tokens 64]
        [--sft-steps 8] [--drift-data chitchat] [--follow-steps 4] [--follow-budget steps] [--passes 1]
        [--staleness-prompts N]
        [--out runs/bench-follow] [--json OUT] [--figure OUT.png]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHIPPED = os.path.join(ROOT, "recipes", "drafters", "smollm2-135m-dflash")
RECIPE = os.path.join(ROOT, "recipes", "smollm2-135m-dflash.yaml")
SEED, HELDOUT_FRACTION = 0, 0.1  # chitchat's train / held-out split (the data layer's defaults)
SHAREGPT_HELDOUT = 0.004  # ShareGPT's split by id in recipes/smollm2-135m-dflash-sharegpt.yaml (data.heldout)
DRIFTS = ("chitchat", "sharegpt-code", "sharegpt-long")
DRAFTERS = ("frozen", "followed", "retrained")


# ------------------------------------------------------------------------------------------- pure parts
def pooled(lengths: list) -> float:
    """AL = tokens / rounds over all prompts' rounds (vLLM's 1 + accepted / drafts)."""
    return sum(map(sum, lengths)) / max(1, sum(map(len, lengths)))


def diff(a: dict, b: dict) -> tuple:
    """AL(a) - AL(b) over the same prompts and its paired standard error (per prompt, ``al_diff_stderr``)."""
    from specopd.eval.cli import al_diff_stderr

    la, lb = a["accept_lengths"], b["accept_lengths"]
    return pooled(la) - pooled(lb), al_diff_stderr(la, lb)


def generation_rate(log_path: str):
    """vLLM's sampling rate in tokens/s over its generate calls alone (no start-up), from the runner's last
    progress line ("N/M R tok/s"); None when the log has none."""
    last = None
    with open(log_path, errors="replace") as f:
        for line in f:
            m = re.search(r"\[vllm-runner\] \d+/\d+ ([0-9.]+) tok/s", line)
            if m:
                last = float(m.group(1))
    return last


# ------------------------------------------------------------------------------------------- stages
def done_json(path: str):
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return None


def write_json(path: str, obj) -> None:
    from specopd.errors import write_replace

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_replace(path, json.dumps(obj, indent=1))


def make_policy(prev: str, out: str, convs: list, steps: int, batch: int, seq_len: int, lr: float,
                seed: int) -> dict:
    """Policy ``out`` = ``prev`` after ``steps`` SFT steps on ``convs`` (assistant tokens supervised), written as
    a Hugging Face folder beside it and renamed into place whole. -> {steps, loss: [per step], seconds}."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specopd.data.formats import encode_chat
    from specopd.data.prepare import load_tokenizer
    from specopd.models.loading import read_config

    t0 = time.perf_counter()
    cfg = read_config(prev)
    tok = load_tokenizer(prev, int(cfg["vocab_size"]))
    seqs = []
    for _, msgs in convs:
        ids, mask = encode_chat(tok, msgs)
        if any(mask[:seq_len]):  # a reply starts within seq_len (a long pasted prompt may leave none)
            seqs.append(([int(x) for x in ids[:seq_len]], [int(x) for x in mask[:seq_len]]))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(prev, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for s in range(steps):
        part = [seqs[(s * batch + i) % len(seqs)] for i in range(batch)]
        n = max(len(ids) for ids, _ in part)
        ids = torch.tensor([x + [0] * (n - len(x)) for x, _ in part])
        att = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in part])
        lab = torch.tensor([[t if k else -100 for t, k in zip(x, m)] + [-100] * (n - len(x)) for x, m in part])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        print(f"  sft step {s + 1}/{steps}: loss {losses[-1]:.4f}", flush=True)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    tmp = out + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(prev):
        if name != "model.safetensors" and not name.startswith(".") and os.path.isfile(os.path.join(prev, name)):
            shutil.copy2(os.path.join(prev, name), tmp)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, out)
    return {"steps": steps, "loss": losses, "seconds": time.perf_counter() - t0}


def sample_rollouts(policy: str, out: str, version: int, train_prompts: list, eval_prompts: list,
                    max_new_tokens: int) -> dict:
    """Rollouts of ``policy`` at T = 1 by vLLM on the train and held-out prompts -> {records (prepared format,
    policy_version, split: held-out prompts "heldout"), wall_s, gen_s}. Cached: prepare_data resumes."""
    from specopd.data.prepare import prepare_data
    from specopd.data.references import read_records

    held = {pid for pid, _ in eval_prompts}
    t0 = time.perf_counter()
    counts = prepare_data(policy, out, prompts=list(train_prompts) + list(eval_prompts), prompts_label="bench-follow",
                          max_new_tokens=max_new_tokens, temperature=1.0, seed=version, heldout_fraction=0.0,
                          engine="vllm", dtype="float32", progress=False)
    wall = time.perf_counter() - t0
    recs = read_records(os.path.join(out, "data.jsonl"))
    for r in recs:
        r["split"] = "heldout" if r["id"] in held else "train"
        r["policy_version"] = version
    n_tok = sum(len(r["input_ids"]) - r["response_start"] for r in recs)
    rate = generation_rate(os.path.join(out, ".engine", "vllm.log")) if counts["written"] else None
    return {"records": recs, "wall_s": wall, "gen_s": n_tok / rate if rate else None, "tokens": n_tok,
            "counts": counts}


def drift_data(name: str):
    """``--drift-data`` -> f(num, offset) giving the SFT conversations [(id, messages)] of one policy update (train
    conversations only, successive slices)."""
    from specopd.data.conversations import chitchat_conversations, domain_train_exchanges, train_conversations

    if name == "chitchat":
        convs = chitchat_conversations()
        return lambda num, offset: train_conversations(num, offset, SEED, HELDOUT_FRACTION, convs)
    from specopd.data.formats import read_conversations
    from specopd.data.packaged import packaged_file

    convs = [(cid, msgs, split) for _, cid, msgs, split in read_conversations(packaged_file("sharegpt"),
                                                                               bad_lines="skip")]
    domain = name.split("-", 1)[1]
    return lambda num, offset: domain_train_exchanges(convs, domain, num, offset, SEED, SHAREGPT_HELDOUT)


def recipe_overrides(target: str, out: str, args, method: str) -> list:
    """The main recipe as one local worker training ``method`` into ``out``: the learning rate kept (no warm-up,
    no decay), the budget per version ``--follow-steps``."""
    return [f"model.target={target}", f"trainer.output_dir={out}", f"trainer.method={method}", "runtime.backend=local",
            "runtime.num_workers=1", f"data.batch_size={args.batch_size}", "trainer.min_lr_ratio=1.0",
            "trainer.lr_warmup_steps=0", "profile.enabled=false", "pipeline.enabled=false",
            f"follow.steps_per_version={args.follow_steps}"]


def evaluate(policy: str, drafters: list, prompts: list, max_new_tokens: int, k: int, seed: int, work: str,
             stops: list) -> list:
    """Each drafter served with ``policy`` in vLLM at T = 1 -> [{al, se, accept_lengths [prompts][rounds],
    counters}] in order."""
    from specopd.eval.cli import al_stderr
    from specopd.eval.engine import run_judge_drafters, steps_accept_lengths

    res = run_judge_drafters(policy, drafters, prompts, max_new_tokens, [1.0], stops, "float32",
                             num_speculative_tokens=k, seed=seed, work_dir=work)
    out = []
    for r in res:
        run = r["runs"][0]
        lengths = steps_accept_lengths(run["outputs"])
        c = run["counters"]
        rounds = sum(map(len, lengths))
        if sum(map(sum, lengths)) - rounds != c["num_accepted_tokens"] or rounds != c["num_drafts"]:
            raise RuntimeError(f"vLLM's per-request steps do not add up to its counters {c} ({r['log']})")
        out.append({"al": pooled(lengths), "se": al_stderr(lengths), "accept_lengths": lengths, "counters": c,
                    "wall_s": run["wall_s"]})
    return out


# ------------------------------------------------------------------------------------------- the run
def run(args) -> dict:
    from specopd.data.conversations import heldout_chat_prompts, train_chat_prompts
    from specopd.data.prepare import encode_prompt, load_tokenizer
    from specopd.data.smollm2 import prepare_smollm2
    from specopd.follow import DrafterFollower
    from specopd.models.loading import read_config

    out = os.path.abspath(args.out)
    base = prepare_smollm2(verbose=False)
    cfg = read_config(base)
    tok = load_tokenizer(base, int(cfg["vocab_size"]))
    eos = cfg.get("eos_token_id")
    stops = sorted({int(x) for x in ([eos] if isinstance(eos, int) else eos or [])} | (
        {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()))
    n_ver = args.versions + 1
    train_p = train_chat_prompts(args.rollouts * n_ver, seed=SEED, tokenizer=tok)
    eval_p = [(f"heldout-{cid}", m) for cid, m in heldout_chat_prompts(args.eval_prompts, seed=SEED, tokenizer=tok,
                                                                       max_prompt_tokens=96)]
    eval_ids = [encode_prompt(tok, m) for _, m in eval_p]
    drift = drift_data(args.drift_data)
    staleness_ids = {pid for pid, _ in eval_p[:args.staleness_prompts or len(eval_p)]}
    policies = [base]
    rows = []
    follower = None
    try:
        for v in range(n_ver):
            print(f"== policy version {v}", flush=True)
            pol = os.path.join(out, "policies", f"v{v}")
            if v > 0:
                meta = os.path.join(out, "policies", f"v{v}.sft.json")
                if done_json(meta) is None or not os.path.isdir(pol):
                    data = drift(args.sft_steps * args.sft_batch, (v - 1) * args.sft_steps * args.sft_batch)
                    shutil.rmtree(pol, ignore_errors=True)
                    write_json(meta, make_policy(policies[-1], pol, data, args.sft_steps, args.sft_batch,
                                                 args.sft_seq_len, args.sft_lr, seed=v))
                policies.append(pol)
            pol = policies[v]
            row = {"version": v, "policy": os.path.relpath(pol, ROOT) if pol.startswith(ROOT) else pol}
            if v > 0:
                row["sft"] = done_json(os.path.join(out, "policies", f"v{v}.sft.json"))
            # rollouts
            ro_dir = os.path.join(out, "rollouts", f"v{v}")
            ro_meta = os.path.join(out, "rollouts", f"v{v}.timing.json")
            ro = sample_rollouts(pol, ro_dir, v, train_p[v * args.rollouts:(v + 1) * args.rollouts], eval_p,
                                 args.max_new_tokens)
            if done_json(ro_meta) is None:
                write_json(ro_meta, {"wall_s": ro["wall_s"], "gen_s": ro["gen_s"], "tokens": ro["tokens"]})
            row["sampling"] = done_json(ro_meta)
            recs = ro["records"]
            row["response_tokens"] = sum(len(r["input_ids"]) - r["response_start"] for r in recs) / len(recs)
            train_recs = [r for r in recs if r["split"] == "train"]
            given = train_recs + [r for r in recs if r["id"] in staleness_ids]  # the follower's held-out: a subset
            # followed
            f_meta = os.path.join(out, "follow", f"v{v}.timing.json")
            if done_json(f_meta) is None:
                if follower is None:
                    follower = DrafterFollower(RECIPE, recipe_overrides(base, os.path.join(out, "follow", "run"), args,
                                                                        "specopd"), progress=False)
                steps = (math.ceil(args.passes * len(train_recs) / args.batch_size) if args.follow_budget == "epoch"
                         else args.follow_steps)
                t0 = time.perf_counter()
                follower.update_policy(pol, v)
                follower.add_rollouts(given, v)
                m = follower.train(steps=steps)
                exp = follower.export(v)
                write_json(f_meta, {"follow_s": time.perf_counter() - t0, "export": exp, **m})
            row["follow"] = done_json(f_meta)
            # retrained at equal training time
            r_meta = os.path.join(out, "retrain", f"v{v}.timing.json")
            if done_json(r_meta) is None:
                with DrafterFollower(RECIPE, recipe_overrides(base, os.path.join(out, "retrain", f"v{v}"), args,
                                                              args.retrain_method) + ["trainer.resume=none"],
                                     progress=False) as rt:
                    t0 = time.perf_counter()
                    rt.update_policy(pol, v)
                    rt.add_rollouts(given, v)
                    m = rt.train(steps=0, seconds=row["follow"]["train_s"])
                    exp = rt.export(v)
                    write_json(r_meta, {"retrain_s": time.perf_counter() - t0, "export": exp, **m})
            row["retrain"] = done_json(r_meta)
            # judged by vLLM
            e_meta = os.path.join(out, "eval", f"v{v}.json")
            if done_json(e_meta) is None:
                ev = evaluate(pol, [SHIPPED, row["follow"]["export"], row["retrain"]["export"]], eval_ids,
                              args.max_new_tokens, args.k, 1000 + v, os.path.join(out, "eval", f"v{v}"), stops)
                write_json(e_meta, dict(zip(DRAFTERS, ev)))
            row["eval"] = done_json(e_meta)
            rows.append(row)
    finally:
        if follower is not None:
            follower.close()
    return {"rows": rows, "targets": targets(rows)}


def targets(rows: list) -> dict:
    """The issue's targets from the rows: the followed drafter's AL on the newest policy against the shipped
    drafter's on v0 (the start), the frozen drafter's loss, and the follow cost against the sampling."""
    first, last = rows[0]["eval"], rows[-1]["eval"]
    d = diff
    start = first["frozen"]
    keep = last["followed"]["al"] / start["al"]
    later = rows[1:] or rows
    follow_s = sum(r["follow"]["follow_s"] for r in later)
    measure_s = sum(r["follow"]["eval_s"] for r in later)
    gen_s = sum(r["sampling"]["gen_s"] or float("nan") for r in later)
    wall_s = sum(r["sampling"]["wall_s"] for r in later)
    return {"start_al": start["al"], "followed_last_al": last["followed"]["al"], "followed_keeps": keep,
            "followed_minus_start": d(last["followed"], start), "frozen_minus_start": d(last["frozen"], start),
            "followed_minus_frozen_last": d(last["followed"], last["frozen"]),
            "followed_minus_retrained_last": d(last["followed"], last["retrained"]),
            "follow_s": follow_s, "sampling_gen_s": gen_s, "sampling_wall_s": wall_s,
            "staleness_measure_s": measure_s, "cost_vs_generation": (follow_s - measure_s) / gen_s,
            "cost_vs_generation_with_measure": follow_s / gen_s, "cost_vs_sampling_wall": (follow_s - measure_s) / wall_s,
            "kept_95": keep >= 0.95, "frozen_lost": d(last["frozen"], start)[0] < -2 * d(last["frozen"], start)[1],
            "cost_below_25": (follow_s - measure_s) / gen_s < 0.25}


def table(res: dict) -> str:
    lines = ["| version | SFT loss | rollout tokens | frozen AL | followed AL | retrained AL | followed - frozen "
             "| followed - retrained | follow exp. AL before -> after | follow steps / train s | retrain steps "
             "| sampling s (gen / wall) | follow s (train / swap, export, start) | staleness measure s (not following) |",
             "|" + "---|" * 14]
    for r in res["rows"]:
        e, f, s = r["eval"], r["follow"], r["sampling"]
        fd, rd = diff(e["followed"], e["frozen"]), diff(e["followed"], e["retrained"])
        sft = f"{r['sft']['loss'][0]:.2f} -> {r['sft']['loss'][-1]:.2f}" if r.get("sft") else "-"
        other = f["follow_s"] - f["train_s"] - f["eval_s"]
        cells = [f"v{r['version']}", sft, f"{r['response_tokens']:.1f}",
                 *(f"{e[k]['al']:.3f} +- {e[k]['se']:.3f}" for k in DRAFTERS),
                 f"{fd[0]:+.3f} +- {fd[1]:.3f}", f"{rd[0]:+.3f} +- {rd[1]:.3f}",
                 f"{fmt(f['before'])} -> {fmt(f['after'])}", f"{f['steps']} / {f['train_s']:.1f}",
                 str(r["retrain"]["steps"]), f"{s['gen_s'] or float('nan'):.1f} / {s['wall_s']:.0f}",
                 f"{f['follow_s'] - f['eval_s']:.1f} ({f['train_s']:.1f} / {other:.1f})", f"{f['eval_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    t = res["targets"]
    lines += ["", f"- followed drafter on the newest policy: AL {t['followed_last_al']:.3f} = "
                  f"{100 * t['followed_keeps']:.1f}% of the start (the shipped drafter on v0, {t['start_al']:.3f}); "
                  f"paired {t['followed_minus_start'][0]:+.3f} +- {t['followed_minus_start'][1]:.3f}: target >= 95% "
                  f"{'reached' if t['kept_95'] else 'NOT reached'}",
              f"- frozen drafter on the newest policy minus the start: {t['frozen_minus_start'][0]:+.3f} +- "
              f"{t['frozen_minus_start'][1]:.3f}: "
              f"{'loses measurably (> 2 SE)' if t['frozen_lost'] else 'NO measurable loss'}",
              f"- follow cost (versions >= 1): {t['follow_s'] - t['staleness_measure_s']:.0f} s against "
              f"{t['sampling_gen_s']:.0f} s of vLLM generation ({100 * t['cost_vs_generation']:.0f}%; "
              f"{100 * t['cost_vs_sampling_wall']:.0f}% of the sampling wall incl. vLLM's start-up): target < 25% "
              f"{'reached' if t['cost_below_25'] else 'NOT reached'}; with the staleness measure "
              f"(+{t['staleness_measure_s']:.0f} s) {100 * t['cost_vs_generation_with_measure']:.0f}%"]
    return "\n".join(lines)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def figure(res: dict, path: str) -> None:
    import matplotlib  # only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # only when drawing

    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r["version"] for r in res["rows"]]
    for k, mk in zip(DRAFTERS, "osd"):
        ax.errorbar(xs, [r["eval"][k]["al"] for r in res["rows"]], yerr=[r["eval"][k]["se"] for r in res["rows"]],
                    marker=mk, capsize=3, label=k)
    ax.set_xlabel("policy version")
    ax.set_xticks(xs)
    ax.set_ylabel("AL by vLLM's counters (T = 1, held-out prompts)")
    ax.set_title("Drafters on a drifting SmolLM2-135M policy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=3, help="policy updates (policies v0 .. vN)")
    ap.add_argument("--rollouts", type=int, default=24, help="train rollouts per version")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts, the same every version")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=8)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-seq-len", type=int, default=128)
    ap.add_argument("--sft-lr", type=float, default=2e-4)
    ap.add_argument("--drift-data", choices=DRIFTS, default="chitchat",
                    help="what each policy update fine-tunes on (train conversations only)")
    ap.add_argument("--follow-steps", type=int, default=4, help="SpecOPD steps per version (--follow-budget steps)")
    ap.add_argument("--follow-budget", choices=("steps", "epoch"), default="steps",
                    help="steps: --follow-steps a version; epoch: --passes over the version's train rollouts")
    ap.add_argument("--passes", type=float, default=1.0,
                    help="passes over a version's train rollouts (--follow-budget epoch): 0.5 trains on half of them")
    ap.add_argument("--staleness-prompts", type=int, default=0,
                    help="held-out rollouts the follower measures staleness on (0: all --eval-prompts)")
    ap.add_argument("--batch-size", type=int, default=8, help="drafter training sequences a step")
    ap.add_argument("--retrain-method", default="offpolicy_ce")
    ap.add_argument("--k", type=int, default=4, help="vLLM's num_speculative_tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-follow"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--figure", default=None)
    args = ap.parse_args(argv)
    print("python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + list(
        sys.argv[1:] if argv is None else argv)), flush=True)
    from specopd.eval.bench import provenance, provenance_line

    prov = provenance()
    print(provenance_line(prov), flush=True)
    t0 = time.perf_counter()
    res = run(args)
    res.update(provenance=prov, args=vars(args), total_s=time.perf_counter() - t0)
    print(provenance_line(prov))
    print(table(res))
    if args.json:
        write_json(os.path.abspath(args.json), res)
    figure(res, args.figure or os.path.join(os.path.abspath(args.out), "al_per_version.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
