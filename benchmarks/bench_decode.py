"""Decoding with the drafter's context cache vs recomputing the drafter over the whole context, side by side.

    python benchmarks/bench_decode.py --recipe recipes/tiny.yaml --checkpoint RUN_OR_STEP_DIR | none
           [--lengths 64,256,1024,4096] [--batch 8] [--commit 3] [--repeats 5]
           [--prompt-lens 32,512] [--new-tokens 48] [--prompts 2] [--temperature 0] [key=value ...]

Part 1, drafter time per round against the context length T (the recipe's drafter; random feature rows,
whose values do not change the cost). For A = 1 sequence (the decoder) and A = --batch sequences
(Draft-OPD's rollout), one round of drafting costs
- recompute (before): ``drafter.sample(features [T] per sequence, anchors T, ...)``: what the decoder and
  Draft-OPD called each round before the cache (fc, hidden_norm and every layer's K/V over all T rows);
- cache (after): ``drafter.extend_contexts(ctxs, --commit new rows each)`` + ``drafter.draft_batch(ctxs, ...)``
  (the committed rows projected once, the block attends to the cached K/V in place).
Median of --repeats, the two alternating.

Part 2, end to end: the recipe's target with that drafter on prompts of each --prompt-lens length (the run's
reference sequences concatenated: text like the drafter's training data),
--new-tokens tokens each at --temperature: autoregressive (``specopd.eval.autoregressive``), speculative with
the drafter recomputed over all features each round ("before": a wrapper whose ``draft_batch`` calls
``drafter.sample`` on the sequence's features, kept in a capacity-doubling buffer), and speculative with the
context cache ("after": ``SpeculativeDecoder`` as it is). The three alternate prompt by prompt. Reported:
tokens/s, mean AL (incl. bonus), drafter ms and verify ms per round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _Features:
    """The 'before' decoder's per-sequence context: the raw feature rows (no projection), grown amortised."""

    def __init__(self):
        self.rows, self.store = None, None

    def __len__(self):
        return 0 if self.rows is None else int(self.rows.shape[0])


class Recompute:
    """A drafter that recomputes everything each round, as the decoder did before the cache: its draft_batch
    runs ``drafter.sample`` over all feature rows of each sequence (same weights, same draws)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def context_cache(self):
        return _Features()

    def extend_contexts(self, ctxs, features):
        from specopd_executors.base import append_rows

        for c, f in zip(ctxs, features):
            c.rows, c.store = append_rows(c.rows, f, c.store)

    def draft_batch(self, ctxs, anchor_tokens, temperature, generators=None):
        import torch

        d = self.drafter
        feats = [c.rows if c.rows is not None else torch.zeros(0, d.fc.in_features) for c in ctxs]
        rows = [torch.tensor([b]) for b in range(len(ctxs))] if isinstance(generators, list) else None
        return d.sample(feats, torch.tensor([len(c) for c in ctxs]), torch.arange(len(ctxs)), anchor_tokens,
                        temperature, generators, rows=rows)


def _median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def part1(drafter, lengths, batch: int, commit: int, repeats: int, temperature: float) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    f_dim = drafter.fc.in_features
    feats = torch.randn(max(lengths), f_dim, generator=g)
    v = int(drafter.target.vocab_size)
    out = []
    for a in sorted({1, batch}):
        atok = torch.randint(0, v, (a,), generator=g)
        for t in lengths:
            n = min(commit, t)
            ctxs = [drafter.context_cache(feats[: t - n]) for _ in range(a)]
            gens = [torch.Generator().manual_seed(b) for b in range(a)]
            rows = [torch.tensor([b]) for b in range(a)]

            def recompute():
                drafter.sample([feats[:t]] * a, torch.full((a,), t), torch.arange(a), atok, temperature, gens,
                               rows=rows)

            def cached():
                for c in ctxs:  # roll back the last round's rows (benchmark only), then one round
                    c.length = t - n
                drafter.extend_contexts(ctxs, [feats[t - n:t]] * a)
                drafter.draft_batch(ctxs, atok, temperature, gens)

            with torch.no_grad():
                recompute(), cached()  # warm-up
                r, c = [], []
                for _ in range(repeats):
                    r.append(_median_ms(recompute, 1))
                    c.append(_median_ms(cached, 1))
            out.append(dict(A=a, T=t, recompute_ms=statistics.median(r), cache_ms=statistics.median(c)))
            print(f"  A={a:3d} T={t:5d} recompute {out[-1]['recompute_ms']:8.2f} ms  cache "
                  f"{out[-1]['cache_ms']:8.2f} ms", flush=True)
    return out


def text_prompt(samples: list, length: int, seed: int):
    """A prompt of ``length`` tokens: the run's reference sequences (prompt + response) concatenated in a
    seeded order (repeated when they run out), so that a trained drafter sees text like its training data."""
    import torch

    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    parts, n = [], 0
    while n < length:
        for i in order:
            parts.append(torch.as_tensor(samples[i]["input_ids"]).reshape(-1))
            n += parts[-1].numel()
            if n >= length:
                break
    return torch.cat(parts)[:length]


def part2(target, drafter, samples, prompt_lens, new_tokens: int, prompts: int, temperature: float) -> list:
    import torch

    from specopd.eval import SpeculativeDecoder, autoregressive

    limit = getattr(target.config, "max_position_embeddings", None)
    out = []
    for plen in prompt_lens:
        if limit is not None and plen + new_tokens + drafter.block_size > int(limit):
            print(f"  prompt length {plen}: past the target's context limit {limit}, skipped")
            continue
        acc = {m: dict(tokens=0, wall=0.0, rounds=0, committed=0, draft=0.0, verify=0.0)
               for m in ("autoregressive", "before (recompute)", "after (cache)")}
        for i in range(prompts):
            prompt = text_prompt(samples, plen, seed=1000 * plen + i)
            got = {}
            runs = {"autoregressive": lambda: autoregressive(target, prompt, new_tokens, temperature,
                                                             torch.Generator().manual_seed(i)),
                    "before (recompute)": lambda: SpeculativeDecoder(target, Recompute(drafter), temperature).generate(
                        prompt, new_tokens, torch.Generator().manual_seed(i)),
                    "after (cache)": lambda: SpeculativeDecoder(target, drafter, temperature).generate(
                        prompt, new_tokens, torch.Generator().manual_seed(i))}
            for name, fn in runs.items():
                res = got[name] = fn()
                a = acc[name]
                a["tokens"] += res.tokens.numel()
                a["wall"] += res.wall_time
                a["rounds"] += res.rounds
                a["committed"] += sum(res.accept_lengths)
                a["draft"] += res.times.get("draft", 0.0)
                a["verify"] += res.times.get("verify", 0.0)
            same = torch.equal(got["before (recompute)"].tokens, got["after (cache)"].tokens)
            print(f"  P={plen:5d} prompt {i}: before and after decoded the same tokens: {same}", flush=True)
        for name, a in acc.items():
            spec = name != "autoregressive"
            out.append(dict(P=plen, decoder=name, tok_s=a["tokens"] / a["wall"],
                            al=a["committed"] / a["rounds"] if spec else 1.0,
                            draft_ms=1000 * a["draft"] / a["rounds"] if spec else None,
                            verify_ms=1000 * a["verify"] / a["rounds"] if spec else None))
            print(f"  P={plen:5d} {name:20s} {out[-1]['tok_s']:8.1f} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "tiny.yaml"))
    ap.add_argument("--checkpoint", default="none", help="a run folder, a drafter folder, or none (untrained)")
    ap.add_argument("--lengths", default="64,256,1024,4096")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--commit", type=int, default=3, help="rows committed per round (part 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-lens", default="32,512")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-e2e", action="store_true")
    args, overrides = ap.parse_known_args()

    import torch

    from specopd.config import load_recipe
    from specopd.eval.cli import load_eval_drafter
    from specopd.models import load_target
    from specopd.models.tiny import resolve_target_path
    from specopd.runs.checkpoint import find_latest

    torch.set_num_threads(args.threads)
    ck = args.checkpoint
    if ck not in ("none", "latest") and os.path.isdir(os.path.join(ck, "checkpoints")):
        ck = find_latest(ck)
    out_dir = (os.path.dirname(os.path.dirname(ck)) if ck not in ("none", "latest") and
               os.path.basename(os.path.dirname(ck)) == "checkpoints" else "/tmp/bench-decode")
    cfg = load_recipe(args.recipe, [f"trainer.output_dir={out_dir}", f"eval.checkpoint={ck}", *overrides])
    path = resolve_target_path(cfg.model, cfg.trainer.output_dir)
    if not os.path.isdir(path):
        from specopd.data.prepare import MODELS

        path = MODELS[path]()
    target = load_target(path, dtype=cfg.model.dtype, device="cpu")
    drafter, source = load_eval_drafter(cfg, target)
    drafter.eval()
    print("command: python benchmarks/bench_decode.py " + " ".join(sys.argv[1:]))
    print(f"target {path} ({target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}); "
          f"drafter {source}: {drafter.kind}, {len(drafter.layers)} layer(s), block_size {drafter.block_size}, "
          f"{len(drafter.feature_layers)} feature layers; torch threads {args.threads}; T = {args.temperature}")
    lengths = [int(x) for x in args.lengths.split(",")]
    print("part 1: drafter time per round")
    p1 = part1(drafter, lengths, args.batch, args.commit, args.repeats, args.temperature)
    p2 = []
    if not args.skip_e2e:
        from specopd.train.data import load_dataset

        print("part 2: end to end")
        p2 = part2(target, drafter, load_dataset(cfg, target), [int(x) for x in args.prompt_lens.split(",")],
                   args.new_tokens, args.prompts, args.temperature)
    print(f"\ndrafter per round ({args.commit} committed rows per round; median of {args.repeats})")
    print("| sequences A | context T | recompute (before) ms | cache (after) ms | before / after |")
    print("|---|---|---|---|---|")
    for r in p1:
        print(f"| {r['A']} | {r['T']} | {r['recompute_ms']:.2f} | {r['cache_ms']:.2f} | "
              f"{r['recompute_ms'] / r['cache_ms']:.1f}x |")
    if p2:
        print(f"\nend to end: {args.prompts} prompts per length x {args.new_tokens} new tokens, "
              f"T = {args.temperature}")
        print("| prompt P | decoder | tokens/s | mean AL (incl. bonus) | drafter ms / round | verify ms / round |")
        print("|---|---|---|---|---|---|")
        for r in p2:
            dm = "" if r["draft_ms"] is None else f"{r['draft_ms']:.1f}"
            vm = "" if r["verify_ms"] is None else f"{r['verify_ms']:.1f}"
            al = "" if r["decoder"] == "autoregressive" else f"{r['al']:.2f}"
            print(f"| {r['P']} | {r['decoder']} | {r['tok_s']:.1f} | {al} | {dm} | {vm} |")


if __name__ == "__main__":
    main()
