"""Drafters compared by vLLM's counters (``benchmarks/bench_al.py --judge vllm``,
``benchmarks/bench_eagle3_dflash.py``): vLLM's per-prompt accept lengths and their paired differences, training
steps converted at equal time, and the table. Pure: no engine or model runs here."""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

from specopd.eval.bench import by_category
from specopd.eval.cli import al_diff_stderr, al_stderr


def paired_diff(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple:
    """AL(a) - AL(b) over the same prompts (each AL one ratio over all of its prompts' rounds) and its paired
    standard error; ``a``, ``b``: accept_lengths [prompts][rounds] (several sets' prompts may be concatenated)."""
    return sum(map(sum, a)) / sum(map(len, a)) - sum(map(sum, b)) / sum(map(len, b)), al_diff_stderr(a, b)


def position_numbers(acc: list, rounds: int, accepted: int) -> dict:
    """Acceptance per draft position from ``acc`` (rounds that accepted position i) over ``rounds`` rounds that
    accepted ``accepted`` drafts in all -> mean_al (1 + accepted / rounds, the bonus included), rounds, accepted_at,
    reached_at, per_position_acceptance: the numbers every AL table shows, from vLLM's counters or from lengths."""
    reached = [rounds] + acc[:-1]
    return dict(mean_al=1.0 + accepted / max(1, rounds), rounds=rounds, accepted_at=acc, reached_at=reached,
                per_position_acceptance=[a / r if r else None for a, r in zip(acc, reached)])


def lengths_result(accept_lengths: Sequence[Sequence[int]], k: int, meta: Optional[Sequence[dict]] = None) -> dict:
    """Per-prompt accept lengths (tokens per round, the bonus included) of a drafter drafting ``k`` tokens a round
    -> ``position_numbers``' keys over every prompt, se (``al_stderr``), accept_lengths, by_category (with
    ``meta``): what a bench table shows of one drafter at one temperature."""
    lengths = [[int(x) for x in p] for p in accept_lengths]
    rounds = sum(map(len, lengths))
    if any(x < 1 or x > k + 1 for p in lengths for x in p):
        raise ValueError(f"lengths_result: a round commits 1..{k + 1} tokens with k={k}; got "
                         f"{sorted({x for p in lengths for x in p})}")
    acc = [sum(1 for p in lengths for x in p if x - 1 > i) for i in range(k)]
    out = dict(position_numbers(acc, rounds, sum(acc)), se=al_stderr(lengths),
               accept_lengths=lengths)
    if meta is not None:
        out["by_category"] = by_category(lengths, meta)
    return out


def judged_entries(rows: Sequence[dict], meta: Optional[Sequence[dict]] = None) -> dict:
    """``judge_rows``' rows -> {checkpoint (absolute): {"vllm": {T: lengths_result}, "ours_vllm_schedule": {T: ...
    over the prompts ours decoded}, "disagreements": {T: [...]}, "problems": [...], "num_prompts"}}: one entry a
    drafter, what a cache keeps. vLLM's numbers are its per-request verify steps (its counters, prompt by prompt)."""
    out: dict = {}
    for r in rows:
        e = out.setdefault(os.path.abspath(r["checkpoint"]), {"num_prompts": r["num_prompts"]})
        side = "vllm" if r["engine"] == "vllm" else "ours_vllm_schedule"
        for t, v in r["by_temperature"].items():
            have = [i for i, a in enumerate(v["accept_lengths"]) if a is not None]
            e.setdefault(side, {})[t] = lengths_result([v["accept_lengths"][i] for i in have], len(v["accepted_at"]),
                                                      [meta[i] for i in have] if meta is not None else None)
            if side == "vllm":
                e.setdefault("disagreements", {})[t] = list(v.get("disagreements") or [])
        if side == "vllm":
            e["problems"] = list(r.get("problems") or [])
    return out


def equal_time_steps(steps: float, step_s: float, other_step_s: float) -> float:
    """The steps of another run that cost the time ``steps`` steps of ``step_s`` seconds each cost, at
    ``other_step_s`` seconds a step (both step costs measured on one machine, so the ratio carries over)."""
    if step_s <= 0 or other_step_s <= 0 or not (math.isfinite(step_s) and math.isfinite(other_step_s)):
        raise ValueError(f"equal_time_steps: step costs must be positive and finite; got {step_s} and {other_step_s}")
    return steps * step_s / other_step_s


def nearest_checkpoint(checkpoints: Sequence[tuple], want: float) -> tuple:
    """The (step, folder) of ``checkpoints`` [(step, folder)] nearest ``want`` steps (a tie: the earlier step, the
    less trained) -> (step, folder, step - want)."""
    if not checkpoints:
        raise ValueError("nearest_checkpoint: no checkpoint to choose from")
    step, folder = min(checkpoints, key=lambda c: (abs(c[0] - want), c[0]))
    return step, folder, step - want


def paired_table(rows: Sequence[dict], temps: Sequence[float], ref: int = 0) -> tuple:
    """AL by vLLM's counters per row and temperature, and each row's paired difference from row ``ref`` on the
    same prompts. ``rows``: [{"label", "k" (drafted tokens per round), "by_temperature": {"T": lengths_result}}].
    -> (the table's lines, [{label, temperature, diff, se, beyond_2se}])."""
    keys = [f"{float(t):g}" for t in temps]
    lines = [f"{'drafter':<44}{'k':>3}" + "".join(f"{'AL T=' + k + ' +- SE':>20}" for k in keys)]
    for r in rows:
        lines.append(f"{r['label']:<44}{r['k']:>3}" + "".join(
            f"{r['by_temperature'][k]['mean_al']:>12.3f} +- {r['by_temperature'][k]['se']:.3f}" for k in keys))
    base = rows[ref]
    lines.append(f"each row minus {base['label']}, paired over the same prompts: difference +- its standard error; "
                 f"'*': beyond two standard errors")
    diffs = []
    for i, r in enumerate(rows):
        if i == ref:
            continue
        cells = []
        for k in keys:
            d, se = paired_diff(r["by_temperature"][k]["accept_lengths"], base["by_temperature"][k]["accept_lengths"])
            beyond = abs(d) > 2 * se
            diffs.append({"label": r["label"], "temperature": float(k), "diff": d, "se": se, "beyond_2se": beyond})
            cells.append(f"{d:>+11.3f} +- {se:.3f}{'*' if beyond else ' '}")
        lines.append(f"{r['label']:<44}{r['k']:>3}" + "".join(cells))
    return lines, diffs
