"""Training at this CPU's limit: fp32 vs bf16 target, SpecOPD vs fair Draft-OPD, against the roofline, in one run.

For each setting (``main``: the main job's shapes, recipes/smollm2-135m-dflash-chitchat.yaml: chat sequences cut to 192
tokens, batch 8, 16 anchors, block_size 5; ``long``: 512-token trunks, batch 4, 64 anchors / rounds per sequence,
as ``bench_throughput.py --preset long``) and each target dtype, SpecOPD and Draft-OPD (the serving-engine
rollout: one batched target pass per round, caches, commits from the verify pass) train the same fresh drafter
(fp32 master weights) on the same batches, ONE worker in this process; steps alternate over (dtype, method) so
that load changes on the shared machine hit all four alike. The first ``--warmup`` steps are not timed.

Roofline: the matmul FLOPs of one step of each method (``torch.utils.flop_counter.FlopCounterMode``: mm / bmm /
addmm / attention; elementwise work is not counted), at the best matmul rate measured in this run for that dtype
(``[2048x576] @ [576x1536]`` and ``[512x576] @ [576x49152]``, the target's MLP and the vocabulary projection,
each as ``a @ b`` and through oneDNN with the weight packed once, the faster; measured before and after the steps,
the larger taken): roofline tokens/s = rate / (FLOPs per supervised token);
share = measured tokens/s / roofline tokens/s.

Decoding (``--decode``): our and vLLM's autoregressive and speculative decoding (T = 0, the shipped drafter) on
the same held-out chat prompts, fp32 and bf16, at batch 1 and 16 (``bench_decode``). vLLM runs in its own venv
(``make vllm``); without it the vLLM columns are skipped and say why.

``--profile``: torch.profiler op tables (top ops by self CPU time) and per-phase time + achieved matmul FLOP/s
for one SpecOPD step, one Draft-OPD round (8 sequences), one autoregressive token and one speculative round
(batch 1), in the bf16 (``--profile-dtype``) target.

The CPU is shared with other jobs: only ratios measured side by side in one run mean anything.

    python benchmarks/bench_cpu.py [--settings main,long] [--dtypes float32,bfloat16] [--steps 2] [--warmup 1]
                                   [--paths torch,tv,auto] [--decode] [--profile] [--json out.json]
                                   [--figure benchmarks/figures/cpu_paths.png]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "smollm2-135m-dflash-chitchat.yaml")
SETTINGS = {  # seq_len, recipe overrides
    "main": (192, ["data.batch_size=8", "trainer.anchors_per_seq=16"]),
    "long": (512, ["data.batch_size=4", "trainer.anchors_per_seq=64"]),
}
SHAPES = ((2048, 576, 1536), (512, 576, 49152))
PATHS = {  # --paths: the CPU code paths of a step as the recipe's kernels keys, measured side by side (each on
    # its own worker); a path of an earlier commit is measured at that commit: benchmarks/compare_commits.py
    "auto": {},  # the default: every C kernel where it applies
    # torch's ops everywhere: the fused loss in torch, eager norm / SiLU / RoPE, torch's attention and draws
    "torch": {"cpu_tv_loss": "torch", "cpu_layer_ops": "torch", "cpu_sampling": "torch", "cpu_attention": "torch"},
    # the fused loss's C kernel only (kernels/e2e_tv)
    "tv": {"cpu_layer_ops": "torch", "cpu_sampling": "torch", "cpu_attention": "torch"},
    # the bf16 linear layers through F.linear (the weight reordered per call)
    "unpacked": {"cpu_linear": "torch"},
    # the fp32 linear layers through oneDNN too (not F.linear's bits): fp32 at the CPU's best matmul rate where
    # MKL's fp32 is not; bf16 rows as "auto"
    "fp32dnn": {"cpu_linear": "all"},
    # the C attention kernels on every CPU where they build: on an AMX CPU, where "auto" keeps torch's kernels,
    # `--paths auto,cattn` measures ours against them
    "cattn": {"cpu_attention": "cpu"},
}


def use_path(w, name: str) -> None:
    """Hand a ``PATHS`` entry (the recipe's kernels keys) to worker ``w``'s target and drafter: the workers of one
    dtype share their target, so each step first gives it its own path."""
    from specopd.models.common import hand_down
    from specopd_kernels.paths import KernelsConfig

    choice = KernelsConfig(**PATHS[name])
    hand_down(w.target, choice)
    hand_down(w.drafter, choice)


def cpu_name() -> str:
    """The CPU's model name, torch's vector capability and whether bf16 matmuls are native here: the ratios of
    this script mean nothing without it (an AVX2 CPU emulates bf16, far slower than fp32)."""
    from specopd_kernels.cpu_features import cpu_bf16_native
    from specopd.eval.bench import cpu_name as model_name

    return (f"{model_name()}, torch {torch.backends.cpu.get_cpu_capability()}, bf16 matmuls "
            f"{'native (AMX / AVX512-BF16)' if cpu_bf16_native() else 'emulated'}")


def matmul_rates(reps: int = 5) -> dict:
    """{dtype name: {"MxKxN": GFLOP/s}} best of ``reps`` per shape over torch's ways to run it (``a @ b``, and
    oneDNN with the weight packed once where torch has it: on an AMD CPU MKL's fp32 ``a @ b`` may not be the
    fastest), fp32 and bf16 alternating."""
    from specopd_kernels.layer_ops import cpu as layer_ops

    out = {"float32": {}, "bfloat16": {}}
    for m, k, n in SHAPES:
        a32, w32 = torch.randn(m, k), torch.randn(n, k)
        ops = {}
        for d, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            a, w = a32.to(dt), w32.to(dt)
            ops[d] = [lambda a=a, b=w.t(): a @ b]
            if layer_ops.packing_available():
                ops[d].append(lambda a=a, p=layer_ops.PackedWeight().get(w): layer_ops.linear(a, p))
        best = {d: float("inf") for d in ops}
        for _ in range(reps):
            for d, fs in ops.items():
                for f in fs:
                    f()
                    t0 = time.perf_counter()
                    f()
                    best[d] = min(best[d], time.perf_counter() - t0)
        for d in ops:
            out[d][f"{m}x{k}x{n}"] = 2 * m * k * n / best[d] / 1e9
    return out


def chat_data(target_dir: str, vocab: int, seq_len: int, path: str, exact: bool, num: int = 64) -> str:
    """Chat conversations (chitchat, the target's chat template) cut to ``seq_len`` tokens -> prepared JSONL;
    ``exact``: keep only those that reach seq_len (full-length trunks)."""
    from specopd.data.conversations import write_conversation_data
    from specopd.data.prepare import load_tokenizer

    tok = load_tokenizer(target_dir, vocab)
    write_conversation_data(tok, path, num, seq_len, min_response_tokens=seq_len // 3)
    if exact:
        recs = [json.loads(line) for line in open(path)]
        with open(path, "w") as f:
            for r in recs:
                if len(r["input_ids"]) == seq_len:
                    f.write(json.dumps(r) + "\n")
    return path


def count_flops(fn) -> tuple:
    """(result, matmul FLOPs) of fn() under FlopCounterMode (with the packed linears' formula)."""
    from torch.utils.flop_counter import FlopCounterMode

    from specopd_kernels.layer_ops import cpu as layer_ops

    with FlopCounterMode(display=False, custom_mapping=layer_ops.FLOP_FORMULAS) as fc:
        r = fn()
    return r, int(fc.get_total_flops())


def make_workers(target_dir: str, data: str, seq_len: int, overrides: list, dtypes: list, out_dir: str,
                 paths=("auto",)) -> dict:
    """{(dtype, method, CPU path): Worker}, one target per dtype shared by its workers."""
    from specopd.config import load_recipe
    from specopd.train.worker import Worker

    workers = {}
    for dt in dtypes:
        shared = None
        for method in ("specopd", "draft_opd"):
            ov = [f"model.target={target_dir}", f"model.dtype={dt}", f"data.path={data}", f"data.seq_len={seq_len}",
                  "data.heldout=0.0", "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false",
                  f"trainer.method={method}", f"trainer.output_dir={out_dir}", "trainer.eval_heldout=false", "trainer.eval_every=0",
                  "trainer.ce_weight=0", *overrides]  # both methods on E2E-TV alone (the paper's loss)
            for path in paths:
                w = Worker(load_recipe(RECIPE, ov), target=shared)
                shared = w.target
                workers[(dt, method, path)] = w
    return workers


def bench_training(target_dir: str, setting: str, dtypes: list, steps: int, warmup: int, tmp: str,
                   paths=("auto",)) -> dict:
    """Steps of every (dtype, method, CPU path) worker, alternating, on the same batches; tokens/s, phases,
    FLOPs per supervised token. ``paths``: names in ``PATHS``."""
    from specopd.train import phases
    from specopd.train.data import BatchOrder

    seq_len, ov = SETTINGS[setting]
    data = chat_data(target_dir, 49152, seq_len, os.path.join(tmp, f"chat{seq_len}.jsonl"), exact=setting == "long")
    workers = make_workers(target_dir, data, seq_len, ov, dtypes, os.path.join(tmp, f"run-{setting}"), paths)
    w0 = next(iter(workers.values()))
    order = BatchOrder(w0.train_ids, w0.cfg.data.batch_size, w0.cfg.data.seed)
    batches = [order.next() for _ in range(steps + warmup)]
    stats = {k: {"steps": 0, "tokens": 0, "seconds": 0.0, "phase_s": {}} for k in workers}
    for step, ids in enumerate(batches):
        for key, w in workers.items():
            use_path(w, key[2])
            t0 = time.perf_counter()
            n = phases.stage(w, ids, step)["branches"]
            m = phases.finish(w, n)
            dt = time.perf_counter() - t0
            print(f"  [{setting}] step {step} {' '.join(key)}: {dt:.2f} s, {m['supervised_tokens']} tokens",
                  flush=True)
            if step < warmup:
                continue
            s = stats[key]
            s["steps"] += 1
            s["tokens"] += m["supervised_tokens"]
            s["seconds"] += dt
            for k, v in m["phase_s"].items():
                s["phase_s"][k] = s["phase_s"].get(k, 0.0) + v
    for key, w in workers.items():  # FLOPs of one more step (same batch as the first timed one)
        def one(w=w):
            n = phases.stage(w, batches[warmup], warmup)["branches"]
            return phases.finish(w, n)
        use_path(w, key[2])
        m, flops = count_flops(one)
        stats[key]["flops_per_token"] = flops / m["supervised_tokens"]
        stats[key]["tokens_per_s"] = stats[key]["tokens"] / stats[key]["seconds"]
    return {"setting": setting, "seq_len": seq_len, "batch": w0.cfg.data.batch_size,
            "anchors": w0.cfg.trainer.anchors_per_seq, "W": w0.W, "stats": stats}


def roofline_tokens_per_s(s: dict, rates: dict) -> float:
    """Supervised tokens/s at the dtype's best measured matmul rate ``rates`` (GFLOP/s by shape) for a row's
    matmul FLOPs per token."""
    return max(rates.values()) * 1e9 / s["flops_per_token"]


def training_table(results: list, rates: dict) -> str:
    lines = ["| setting | target | method | CPU path | supervised tokens/s | vs fp32 | vs torch path | "
             "SpecOPD / Draft-OPD | GFLOP / token | roofline tokens/s | share of roofline | prefill s | propose s | "
             "score s | commit s | loss+bwd s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        st = r["stats"]
        for (dt, method, path), s in st.items():
            roof = roofline_tokens_per_s(s, rates[dt])
            fp32 = st.get(("float32", method, path))
            vs = f"{s['tokens_per_s'] / fp32['tokens_per_s']:.2f}x" if fp32 else "-"
            tor = st.get((dt, method, "torch"))
            vs_t = f"{s['tokens_per_s'] / tor['tokens_per_s']:.2f}x" if tor and path != "torch" else "-"
            ratio = (f"{s['tokens_per_s'] / st[(dt, 'draft_opd', path)]['tokens_per_s']:.2f}x"
                     if method == "specopd" else "-")
            ph = {k: v / max(1, s["steps"]) for k, v in s["phase_s"].items()}
            lines.append(
                f"| {r['setting']} ({r['seq_len']} tok, batch {r['batch']}, B {r['anchors']}, W {r['W']}) | {dt} | "
                f"{method} | {path} | {s['tokens_per_s']:.1f} | {vs} | {vs_t} | {ratio} | "
                f"{s['flops_per_token'] / 1e9:.2f} | "
                f"{roof:.0f} | {100 * s['tokens_per_s'] / roof:.0f}% | {ph.get('prefill', 0):.2f} | "
                f"{ph.get('propose', 0):.2f} | {ph.get('score', 0):.2f} | {ph.get('commit', 0):.2f} | "
                f"{ph.get('loss_backward', 0):.2f} |")
    return "\n".join(lines)


PHASES = ("prefill", "propose", "score", "commit", "loss_backward")


def training_figure(results: list, rates: dict, path: str) -> None:
    """Seconds per step by phase (stacked), one bar per (method, CPU path) of the bf16 target (the paths differ
    there; fp32 rows only when no bf16 row exists), a panel per setting; each bar labelled with its share of the
    roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        keys = [k for k in r["stats"] if k[0] == "bfloat16"] or list(r["stats"])
        bottoms = [0.0] * len(keys)
        for ph in PHASES:
            vals = [r["stats"][k]["phase_s"].get(ph, 0.0) / max(1, r["stats"][k]["steps"]) for k in keys]
            ax.bar(range(len(keys)), vals, bottom=bottoms, label=ph.replace("_", " + "))
            bottoms = [b + v for b, v in zip(bottoms, vals)]
        for i, k in enumerate(keys):
            s = r["stats"][k]
            share = s["tokens_per_s"] / roofline_tokens_per_s(s, rates[k[0]])
            ax.text(i, bottoms[i], f"{100 * share:.0f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{'bf16' if k[0] == 'bfloat16' else 'fp32'}\n{k[1]}\n{k[2]}" for k in keys], fontsize=7)
        ax.set_ylabel("seconds per step (phases)")
        ax.set_title(f"{r['setting']}: {r['seq_len']} tokens, batch {r['batch']}, B {r['anchors']}, W {r['W']} "
                     f"(% = share of the roofline)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


DRAFTER = os.path.join(ROOT, "recipes", "drafters", "smollm2-135m-dflash")


@torch.no_grad()
def spec_batch(target, drafter, prompts: list, n_new: int) -> tuple:
    """Greedy speculative decoding of several prompts at once (one drafter call, one verify pass, one commit a
    round over all live sequences; the Draft-OPD rollout's engine-style round) -> (tokens, rounds, accepted)."""
    from specopd import speculative as spec

    seqs = [spec.start(target, p, drafter.feature_layers) for p in prompts]
    made, rounds, acc = [0] * len(seqs), 0, 0
    live = list(range(len(seqs)))
    while live:
        cur = [seqs[i] for i in live]
        d, q = spec.draft(drafter, cur, 0.0)
        p, state = spec.verify(target, cur, d)
        nacc, nxt = spec.accept(d, q, p, 0.0)
        keep = [made[i] + n + 1 < n_new for i, n in zip(live, nacc)]
        new = spec.commit(target, cur, state, nacc, nxt, keep)
        for i, s, n in zip(live, new, nacc):
            seqs[i], made[i] = s, min(n_new, made[i] + n + 1)
        rounds, acc = rounds + len(live), acc + sum(nacc)
        live = [i for i in live if made[i] < n_new]
    return sum(made), rounds, acc


@torch.no_grad()
def bench_decode(target_dir: str, dtypes: list, n_prompts: int, n_new: int, batches: list, drafter_dir: str,
                 tmp: str) -> list:
    """Greedy tokens/s of autoregressive and speculative decoding (the shipped drafter), ours and vLLM's, on the
    same held-out prompts, no stop tokens (every request makes exactly n_new tokens), at each batch size: batch 1
    runs the prompts one after another, batch b > 1 runs b prompts together (ours: one packed target pass a step;
    vLLM: ``max_num_seqs`` b). Prefill included. -> rows {dtype, batch, mode, engine, tokens_per_s, al}."""
    from specopd.data.conversations import heldout_prompt_ids
    from specopd.data.prepare import generate_batch
    from specopd.drafters.layout import load_drafter
    from specopd.engines import vllm_missing_reason
    from specopd.eval import SpeculativeDecoder, autoregressive
    from specopd.eval.engine import run_judge
    from specopd.models import load_target

    rows = []
    prompts = heldout_prompt_ids(target_dir, 49152, max(n_prompts, max(batches)))
    for dt in dtypes:
        t = load_target(target_dir, dtype=getattr(torch, dt))
        drafter = load_drafter(drafter_dir, t).eval()
        autoregressive(t, prompts[0], 4, temperature=0.0)  # warm-up
        SpeculativeDecoder(t, drafter, temperature=0.0).generate(prompts[0], 4)
        for b in batches:
            ps = prompts[:n_prompts] if b == 1 else prompts[:b]
            t0 = time.perf_counter()
            if b == 1:
                n_ar = sum(autoregressive(t, p, n_new, temperature=0.0).tokens.numel() for p in ps)
            else:
                n_ar = sum(len(o) for o, _ in generate_batch(t, ps, n_new, 0.0, 1.0, [None] * b, set()))
            t1 = time.perf_counter()
            if b == 1:
                rs = [SpeculativeDecoder(t, drafter, temperature=0.0).generate(p, n_new) for p in ps]
                n_sp, rounds, acc = (sum(r.tokens.numel() for r in rs), sum(len(r.accept_lengths) for r in rs),
                                     sum(sum(r.accept_lengths) - len(r.accept_lengths) for r in rs))
            else:
                n_sp, rounds, acc = spec_batch(t, drafter, ps, n_new)
            t2 = time.perf_counter()
            rows.append(dict(dtype=dt, batch=b, mode="autoregressive", engine="ours", tokens_per_s=n_ar / (t1 - t0),
                             al=None))
            rows.append(dict(dtype=dt, batch=b, mode="speculative", engine="ours", tokens_per_s=n_sp / (t2 - t1),
                             al=1 + acc / rounds))
            print(f"  decode ours {dt} batch {b}: AR {rows[-2]['tokens_per_s']:.1f} tok/s, spec "
                  f"{rows[-1]['tokens_per_s']:.1f} tok/s (AL {rows[-1]['al']:.2f})", flush=True)
        del t, drafter
    why = vllm_missing_reason()
    if why:
        print(f"vLLM columns skipped: {why}")
        return rows
    ids = [p.tolist() for p in prompts]
    for dt in dtypes:
        for b in batches:
            ps = ids[:n_prompts] if b == 1 else ids[:b]
            for mode, d in (("autoregressive", None), ("speculative", drafter_dir)):
                r = run_judge(target_dir, d, ps, n_new, [0.0], [], dt, work_dir=os.path.join(tmp, "vllm"),
                              max_num_seqs=b)["runs"][0]  # with the runner's CPU fixes, both modes
                c = r["counters"]
                al = 1 + c["num_accepted_tokens"] / c["num_drafts"] if c and c["num_drafts"] else None
                rows.append(dict(dtype=dt, batch=b, mode=mode, engine="vLLM", tokens_per_s=r["tokens_per_s"], al=al))
                print(f"  decode vLLM {dt} batch {b} {mode}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def decode_table(rows: list, n_prompts: int, n_new: int, drafter_dir: str) -> str:
    key = {(r["dtype"], r["batch"], r["mode"], r["engine"]): r for r in rows}
    lines = [f"held-out chat prompts x {n_new} new tokens, greedy, no stop tokens, prefill included; batch 1: "
             f"{n_prompts} prompts one after another; drafter {os.path.relpath(drafter_dir, ROOT)} (W = 4)",
             "| target | batch | decoding | ours tokens/s | ours AL | vLLM tokens/s | vLLM AL | ours / vLLM | "
             "ours spec / ours AR |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["engine"] != "ours":
            continue
        v = key.get((r["dtype"], r["batch"], r["mode"], "vLLM"))
        ar = key[(r["dtype"], r["batch"], "autoregressive", "ours")]
        f = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['mode']} | {r['tokens_per_s']:.1f} | {f(r['al'])} | "
                     f"{v['tokens_per_s']:.1f} | {f(v['al'])} | {r['tokens_per_s'] / v['tokens_per_s']:.2f}x | "
                     if v else f"| {r['dtype']} | {r['batch']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                     f"{f(r['al'])} | - | - | - | ")
        lines[-1] += f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x |"
    vs = [r for r in rows if r["engine"] == "vLLM"]
    for r in vs:
        if r["mode"] == "speculative":
            ar = key[(r["dtype"], r["batch"], "autoregressive", "vLLM")]
            lines.append(f"vLLM {r['dtype']} batch {r['batch']}: speculative / autoregressive "
                         f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- profiling
def _op_table(fn, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=28)


def _phase(name: str, fn, out: list):
    """Time fn() once, then count its FLOPs in a second identical call; append (name, s, GFLOP)."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    r, flops = count_flops(fn)
    out.append((name, dt, flops / 1e9))
    return r


def profile_all(target_dir: str, dtype: str, tmp: str, rates: dict) -> str:
    from specopd import speculative as spec
    from specopd.data.conversations import heldout_prompt_ids
    from specopd.train import phases

    seq_len, ov = SETTINGS["main"]
    data = chat_data(target_dir, 49152, seq_len, os.path.join(tmp, f"chat{seq_len}.jsonl"), exact=False)
    ws = make_workers(target_dir, data, seq_len, ov, [dtype], os.path.join(tmp, "run-profile"))
    w = ws[(dtype, "specopd", "auto")]
    target, drafter = w.target, w.drafter
    ids = w.train_ids[:8]
    n = phases.stage(w, ids, 0)["branches"]
    phases.finish(w, n)  # warm-up
    rate = max(rates[dtype].values())
    out = [f"### one SpecOPD step ({dtype}, main shapes)"]
    timings = []
    caches = _phase("prefill", lambda: phases.prefill(w, ids), timings)
    prop = phases.propose(w, caches, ids, 1)
    t0 = time.perf_counter()
    phases.propose(w, caches, ids, 1)
    tp = time.perf_counter() - t0
    _, fl = count_flops(lambda: phases.propose(w, caches, ids, 1))
    timings.append(("propose (drafter fwd + sampling)", tp, fl / 1e9))
    hp = _phase("score", lambda: phases.score(w, prop, caches), timings)
    denom = prop.tokens.shape[0]

    def lb():
        p = phases.propose(w, caches, ids, 1)
        phases.loss_backward(w, p, hp, denom)
    t0 = time.perf_counter()
    lb()
    tl = time.perf_counter() - t0 - tp
    _, fl2 = count_flops(lb)
    timings.append(("loss + backward", tl, fl2 / 1e9 - fl / 1e9))
    out.append(_phase_table(timings, rate))

    def step():
        k = phases.stage(w, ids, 2)["branches"]
        phases.finish(w, k)
    out.append(_op_table(step))

    # one Draft-OPD round over 8 sequences (engine-style: one drafter call, one verify pass, commit)
    samples = [w.sample(s) for s in ids]
    seqs = [spec.start(target, s["input_ids"][: s["prompt_len"]], drafter.feature_layers) for s in samples]
    gens = [torch.Generator().manual_seed(i) for i in range(len(seqs))]
    drafter.eval()

    def rnd(seqs=seqs, record=None):
        t = [time.perf_counter()]
        with torch.no_grad():
            g = gens[: len(seqs)]
            d, q = spec.draft(drafter, seqs, 1.0, g)
            t.append(time.perf_counter())
            p, state = spec.verify(target, seqs, d)
            t.append(time.perf_counter())
            nacc, nxt = spec.accept(d, q, p, 1.0, g)
            new = spec.commit(target, seqs, state, nacc, nxt)
            t.append(time.perf_counter())
        if record is not None:
            record.extend(zip(("draft", "verify", "accept + commit"), [b - a for a, b in zip(t, t[1:])]))
        return new
    seqs = rnd(seqs)  # warm
    out.append(f"### one Draft-OPD round ({dtype}, 8 sequences, W = {drafter.draft_len})")
    rec = []
    nxt = rnd(seqs, rec)
    fl_round = count_flops(lambda: rnd(nxt))[1]
    out.append(f"draft / verify / accept+commit s: {', '.join(f'{k} {v:.3f}' for k, v in rec)}; round "
               f"{sum(v for _, v in rec):.3f} s, {fl_round / 1e9:.1f} GFLOP -> "
               f"{fl_round / 1e9 / sum(v for _, v in rec):.0f} GFLOP/s ({100 * fl_round / 1e9 / sum(v for _, v in rec) / rate:.0f}% "
               f"of {rate:.0f})")
    out.append(_op_table(lambda: rnd(nxt)))

    # one autoregressive token and one speculative round at batch 1
    prompt = heldout_prompt_ids(target_dir, 49152, 1)[0]
    cache = target.prefill(prompt[:-1], keep_logits=False, keep_checkpoints=False)
    last = prompt[-1:]

    def ar_token():
        with torch.no_grad():
            return target.prefill(last, cache=cache, keep_logits=True, keep_checkpoints=False)
    ar_token()
    t0 = time.perf_counter()
    for _ in range(5):
        ar_token()
    t_ar = (time.perf_counter() - t0) / 5
    fl_ar = count_flops(ar_token)[1]
    out.append(f"### one autoregressive token ({dtype}, batch 1, context {prompt.numel()})")
    out.append(f"{t_ar * 1e3:.1f} ms/token ({1 / t_ar:.1f} tokens/s), {fl_ar / 1e9:.3f} GFLOP -> "
               f"{fl_ar / 1e9 / t_ar:.1f} GFLOP/s ({100 * fl_ar / 1e9 / t_ar / rate:.1f}% of {rate:.0f})")
    out.append(_op_table(ar_token))
    one = [spec.start(target, prompt, drafter.feature_layers)]
    one = rnd(one)
    rec = []
    rnd(one, rec)
    fl_sr = count_flops(lambda: rnd(one))[1]
    t_sr = sum(v for _, v in rec)
    out.append(f"### one speculative round ({dtype}, batch 1, W = {drafter.draft_len})")
    out.append(f"draft / verify / accept+commit s: {', '.join(f'{k} {v * 1e3:.1f} ms' for k, v in rec)}; round "
               f"{t_sr * 1e3:.1f} ms, {fl_sr / 1e9:.3f} GFLOP -> {fl_sr / 1e9 / t_sr:.1f} GFLOP/s")
    out.append(_op_table(lambda: rnd(one)))
    return "\n\n".join(out)


def _phase_table(phases: list, rate: float) -> str:
    lines = ["| phase | s | GFLOP (matmul) | GFLOP/s | % of matmul rate |", "|---|---|---|---|---|"]
    tot_s, tot_f = 0.0, 0.0
    for name, s, gf in phases:
        tot_s, tot_f = tot_s + s, tot_f + gf
        lines.append(f"| {name} | {s:.3f} | {gf:.1f} | {gf / s:.0f} | {100 * gf / s / rate:.0f}% |")
    lines.append(f"| step | {tot_s:.3f} | {tot_f:.1f} | {tot_f / tot_s:.0f} | {100 * tot_f / tot_s / rate:.0f}% |")
    return "\n".join(lines)


def rates_table(before: dict, after: dict) -> str:
    lines = ["| matmul | fp32 GFLOP/s (before / after) | bf16 GFLOP/s (before / after) |", "|---|---|---|"]
    for key in before["float32"]:
        lines.append(f"| {key} | {before['float32'][key]:.0f} / {after['float32'][key]:.0f} | "
                     f"{before['bfloat16'][key]:.0f} / {after['bfloat16'][key]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared smollm2-135m)")
    ap.add_argument("--settings", default="main,long")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per (dtype, method)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--decode", action="store_true", help="also decoding tokens/s at batch 1")
    ap.add_argument("--decode-prompts", type=int, default=4, help="batch 1: prompts decoded one after another")
    ap.add_argument("--decode-new", type=int, default=64)
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--drafter", default=DRAFTER, help="decoding: the drafter (default: the shipped one)")
    ap.add_argument("--profile", action="store_true", help="also the op tables (see the module doc)")
    ap.add_argument("--profile-dtype", default="bfloat16")
    ap.add_argument("--paths", default="auto",
                    help=f"CPU code paths, side by side, comma-separated: {' | '.join(PATHS)} (PATHS)")
    ap.add_argument("--json")
    ap.add_argument("--figure", help="a PNG of the steps' phases per CPU path (one panel per setting)")
    args = ap.parse_args(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), flush=True)
    if args.target is None:
        from specopd.data.smollm2 import prepare_smollm2

        args.target = prepare_smollm2()  # converted once (~30 s), then found
    dtypes = args.dtypes.split(",")
    settings = [s for s in args.settings.split(",") if s]
    out = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_name()}
    print(f"CPU: {out['cpu']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        before = matmul_rates()
        paths = tuple(k for k in args.paths.split(",") if k)
        bad = [k for k in paths if k not in PATHS]
        if bad:
            ap.error(f"--paths: unknown {bad}; known: {sorted(PATHS)}")
        results = [bench_training(args.target, s, dtypes, args.steps, args.warmup, tmp, paths) for s in settings]
        after = matmul_rates()
        rates = {d: {k: max(before[d][k], after[d][k]) for k in before[d]} for d in before}
        print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; target {args.target}; one worker; "
              f"{args.steps} timed steps per row after {args.warmup} warm-up; drafter 1-layer DFlash, fp32 master "
              f"weights; roofline rate = the best matmul rate of the dtype")
        print(rates_table(before, after))
        print()
        print(training_table(results, rates), flush=True)
        if args.figure and results:
            training_figure(results, rates, args.figure)
        dec = (bench_decode(args.target, dtypes, args.decode_prompts, args.decode_new,
                            [int(b) for b in args.decode_batches.split(",")], args.drafter, tmp)
               if args.decode else None)
        if dec:
            print()
            print(decode_table(dec, args.decode_prompts, args.decode_new, args.drafter), flush=True)
        if args.profile:
            print()
            print(profile_all(args.target, args.profile_dtype, tmp, rates), flush=True)
    if args.json:
        out.update(rates=rates, training=[{**r, "stats": {"/".join(k): v for k, v in r["stats"].items()}}
                                          for r in results], decode=dec)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
