"""How far the bf16 target's paths are from fp32, and from each other: the measurement behind the bf16
tolerances (docs/exactness.md, tests/test_bf16.py).

The fp32 reference is the SAME bf16 weights upcast to fp32 (``load_target(dtype=bf16).float()``), so every
difference below is activation rounding, not weight rounding. For each prompt (held-out chat prompts through
the chat template) and its fp32 greedy continuation, logits of every path are compared with the fp32 plain
forward of the same prefix:

    plain     target(ids) in bf16 (the reference path's own noise: the "bf16 noise" unit)
    prefill   target.prefill(ids) (executor path, one trunk)
    score     target.score on 16 anchors x W = 4 branch tokens (the training scoring pass)
    verify    speculative verify of the chain [last, d_1..d_4] (5 tokens in one pass) at the end of the prompt
    ar        autoregressive: the same 5 tokens one at a time (prefill(token, cache=...)): 1-token passes

err = max |logit - fp32 logit| over the vocabulary, as a multiple of the plain bf16 forward's err on the same
positions (ratio; "max" = the largest over positions); the last column is what docs/exactness.md promises and
tests/test_bf16.py checks: per prompt, the path's largest error over the compared positions over the plain
forward's largest there (the max over prompts). ``verify - ar`` compares the two bf16 paths with each
other (a batch of 5 and a single token need not round alike). Greedy: bf16 autoregressive and speculative
(random-init drafter, T = 0) decoding against fp32 autoregressive: identical prompts, and at the first
divergence the fp32 logit margin between the two tokens (a near tie: within bf16 noise).

    python benchmarks/bench_bf16_noise.py [--target DIR] [--prompts 8] [--new 32]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] max abs difference over the vocabulary (fp32)."""
    return (a.float() - b.float()).abs().amax(-1)


@torch.no_grad()
def measure(target_dir: str, n_prompts: int, n_new: int, seed: int = 0) -> dict:
    from specopd.data.conversations import heldout_prompt_ids
    from specopd.drafters import build_drafter
    from specopd.eval import SpeculativeDecoder, autoregressive
    from specopd.models import load_target
    from specopd.tree import ProposalTree

    t16 = load_target(target_dir, dtype=torch.bfloat16)
    t32 = load_target(target_dir, dtype=torch.bfloat16).float()  # the same (bf16-rounded) weights in fp32
    W = 4
    prompts = heldout_prompt_ids(target_dir, t16.vocab_size, n_prompts, seed)
    ratios = {k: [] for k in ("prefill", "score", "verify", "ar", "verify-ar")}
    promise = {k: [] for k in ratios}  # per prompt: max err over its positions / max plain err over them
    plain_err, margins, same_ar, same_spec, greedy_rows = [], [], 0, 0, []
    drafter = build_drafter("dflash", t16, num_layers=1, block_size=W + 1, seed=seed, feature_layers=[t16.num_layers - 1])
    drafter.eval()
    for i, prompt in enumerate(prompts):
        ar32 = autoregressive(t32, prompt, n_new + W, temperature=0.0).tokens
        ids = torch.cat([prompt, ar32])  # prompt + fp32 greedy continuation
        ref = t32(ids[None])[0]  # [T, V] fp32
        plain = _err(t16(ids[None])[0], ref)  # [T]
        plain_err.append(plain)
        unit = plain.clamp_min(1e-6)
        cache = t16.prefill(ids)
        ratios["prefill"].append(_err(cache.logits, ref) / unit)
        promise["prefill"].append(float(_err(cache.logits, ref).max() / unit.max()))
        # score: 16 anchors on the continuation, branches = the next W reference tokens
        lo = prompt.numel() - 1
        anchors = torch.linspace(lo, ids.numel() - W - 2, 16).long().unique()
        toks = torch.stack([ids[a + 1: a + 1 + W] for a in anchors])
        p = t16.score(ProposalTree.from_branches(anchors, toks), cache)  # [N, W, V]
        pos = anchors[:, None] + 1 + torch.arange(W)
        ratios["score"].append((_err(p, ref[pos]) / unit[pos]).flatten())
        promise["score"].append(float(_err(p, ref[pos]).max() / unit[pos].max()))
        # verify [last, d_1..d_4] at the end of the prompt vs the same tokens one at a time
        base = t16.prefill(prompt[:-1], keep_logits=False)
        chain = ids[prompt.numel() - 1: prompt.numel() + W]  # [W + 1]
        v, _ = t16.score(ProposalTree.from_branches(torch.tensor([base.token_ids.numel() - 1]), chain[None]), base,
                         return_state=True)
        v = v[0]  # [W + 1, V]
        c, singles = base, []
        for t in chain:
            c = t16.prefill(t.view(1), cache=c, keep_logits=True)
            singles.append(c.logits[-1])
        singles = torch.stack(singles)
        at = torch.arange(prompt.numel() - 1, prompt.numel() + W)
        ratios["verify"].append(_err(v, ref[at]) / unit[at])
        ratios["ar"].append(_err(singles, ref[at]) / unit[at])
        ratios["verify-ar"].append(_err(v, singles) / unit[at])
        for k, e in (("verify", _err(v, ref[at])), ("ar", _err(singles, ref[at])), ("verify-ar", _err(v, singles))):
            promise[k].append(float(e.max() / unit[at].max()))
        # greedy decoding in bf16 against fp32
        ar16 = autoregressive(t16, prompt, n_new, temperature=0.0).tokens
        sp16 = SpeculativeDecoder(t16, drafter, temperature=0.0).generate(prompt, n_new).tokens[:n_new]
        row = [i]
        for name, toks16 in (("ar", ar16), ("spec", sp16)):
            diff = (toks16 != ar32[:n_new]).nonzero()
            if diff.numel() == 0:
                same_ar += name == "ar"
                same_spec += name == "spec"
                row.append("-")
                continue
            j = int(diff[0])
            z = ref[prompt.numel() - 1 + j]
            m = float(z[ar32[j]] - z[toks16[j]])
            margins.append(m / float(unit[prompt.numel() - 1 + j]))
            row.append(f"@{j} margin {m:.3f} ({margins[-1]:.2f} x noise)")
        sp_vs_ar = (sp16 != ar16).nonzero()
        row.append("-" if sp_vs_ar.numel() == 0 else f"@{int(sp_vs_ar[0])}")
        greedy_rows.append(row)
    out = {"prompts": len(prompts), "new": n_new, "plain_err": torch.cat(plain_err),
           "ratios": {k: torch.cat(v) for k, v in ratios.items()}, "promise": {k: max(v) for k, v in promise.items()},
           "margins": margins,
           "same_ar": same_ar, "same_spec": same_spec, "greedy": greedy_rows}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared smollm2-135m)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv))
    if args.target is None:
        from specopd.data.smollm2 import prepare_smollm2

        args.target = prepare_smollm2()  # converted once (~30 s), then found
    r = measure(args.target, args.prompts, args.new)
    pe = r["plain_err"]
    print(f"\n{r['prompts']} prompts, fp32 reference = the bf16 weights in fp32; torch threads {torch.get_num_threads()}")
    print(f"bf16 noise unit (plain bf16 forward, max |logit err| per position): median {pe.median():.4f}, "
          f"max {pe.max():.4f} over {pe.numel()} positions")
    print("| path | err / plain bf16 err: median | p95 | max | max err / max plain err (docs/exactness.md: <= 3) |")
    print("|---|---|---|---|---|")
    for k, v in r["ratios"].items():
        print(f"| {k} | {v.median():.2f} | {v.quantile(0.95):.2f} | {v.max():.2f} | {r['promise'][k]:.2f} |")
    print(f"\ngreedy, {r['new']} new tokens: bf16 AR == fp32 AR on {r['same_ar']}/{r['prompts']} prompts, bf16 spec "
          f"== fp32 AR on {r['same_spec']}/{r['prompts']}")
    print("| prompt | bf16 AR first divergence from fp32 | bf16 spec first divergence from fp32 | spec vs AR (bf16) |")
    print("|---|---|---|---|")
    for row in r["greedy"]:
        print("| " + " | ".join(str(c) for c in row) + " |")
    if r["margins"]:
        m = torch.tensor(r["margins"])
        print(f"fp32 margin at divergences, in units of that position's bf16 noise: max {m.max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
