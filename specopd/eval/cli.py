"""`specopd eval RECIPE [key=value ...] [--json PATH]`: speculative decoding over held-out prompts.

``evaluate_al`` is the measurement (also called by the trainer for its before/after table); ``main_eval``
loads the recipe's target and drafter, runs it, prints a table and optionally writes the numbers as JSON.
AL = tokens committed per target verification round, *including* the bonus token.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from specopd.config import eval_dtype
from specopd.data.conversations import heldout_prompt_ids
from specopd.data.prepare import MODELS, check_tokenizer, encode_prompt, load_tokenizer
from specopd.data.references import read_prompts
from specopd.drafters import build_drafter, load_drafter
from specopd.errors import DamagedFolderError, open_write
from specopd.eval.bench import (BENCHES, by_category, format_categories, mtbench_prompts, mtbench_second_turns,
                                 provenance, provenance_line)
from specopd.eval.decoder import SpeculativeDecoder, autoregressive
from specopd.models import load_target
from specopd.models.loading import check_device
from specopd.models.tiny import resolve_target_path
from specopd.runs.checkpoint import MARKER, find_latest, newest_good, verify
from specopd.train.data import load_dataset, split_dataset


def evaluate_al(target, drafter, prompts: Sequence[torch.Tensor], max_new_tokens: int, temperature: float = 0.0,
                seed: int = 0, block_size: Optional[int] = None, baseline: bool = False,
                stop_token_ids: Sequence[int] = (), progress: bool = False) -> dict:
    """Decode every prompt with speculation (and, with ``baseline``, plain autoregressively). Generators are seeded per
    prompt: (seed, i).

    Args:
        target: the TargetModel.
        drafter: the drafter.
        prompts: list of [T_i] token ids.
        max_new_tokens: tokens generated per prompt.
        temperature: 0 = greedy (exact match).
        seed: the per-prompt generators' seed.
        block_size: verify only the first k draft tokens (default: all W).
        baseline: also decode autoregressively, for the speed-up.
        stop_token_ids: ids that end a generation.
        progress: a progress bar.

    Returns:
        dict: mean_al (incl. the bonus), rounds, new_tokens, per_position_acceptance [W] (P(accept i | reached i);
        None where never reached), accepted_at / reached_at [W], survival [W] (P(first i+1 accepted)),
        spec_tokens_per_s, spec_wall_s, times, ...; with baseline also ar_tokens_per_s, ar_wall_s, speedup.
    """
    if len(prompts) == 0:
        raise ValueError("evaluate_al: no prompts")
    dec = SpeculativeDecoder(target, drafter, temperature=temperature, block_size=block_size,
                             stop_token_ids=stop_token_ids)
    w = dec.block_size
    dev = target.device
    was_training = drafter.training
    drafter.eval()
    rounds = committed = new_tokens = 0
    accepted_at, per_prompt = [0] * w, []
    spec_wall = ar_wall = 0.0
    ar_tokens = 0
    times: dict = {}
    try:
        for i, p in enumerate(tqdm(prompts, desc="eval", unit="prompt", disable=not progress)):
            g = torch.Generator(device=dev).manual_seed(int(seed) * 1_000_003 + i)
            res = dec.generate(p, max_new_tokens=max_new_tokens, generator=g)
            rounds += res.rounds
            committed += sum(res.accept_lengths)
            per_prompt.append([int(x) for x in res.accept_lengths])
            new_tokens += res.tokens.numel()
            accepted_at = [a + b for a, b in zip(accepted_at, res.accepted_at)]
            spec_wall += res.wall_time
            for k, v in res.times.items():
                times[k] = times.get(k, 0.0) + v
            if baseline:
                g = torch.Generator(device=dev).manual_seed(int(seed) * 1_000_003 + i)
                ar = autoregressive(target, p, max_new_tokens, temperature, g, stop_token_ids)
                ar_wall += ar.wall_time
                ar_tokens += ar.tokens.numel()
    finally:
        drafter.train(was_training)
    reached = [rounds] + accepted_at[:-1]  # position i is reached when positions < i were all accepted
    out = dict(mean_al=committed / max(1, rounds), rounds=rounds, new_tokens=new_tokens, block_size=w,
               temperature=float(temperature), num_prompts=len(prompts), max_new_tokens=int(max_new_tokens),
               per_position_acceptance=[a / r if r else None for a, r in zip(accepted_at, reached)],
               survival=[a / max(1, rounds) for a in accepted_at], accepted_at=accepted_at, reached_at=reached,
               accept_lengths=per_prompt, spec_wall_s=spec_wall, spec_tokens_per_s=new_tokens / max(spec_wall, 1e-9),
               times={k: round(v, 4) for k, v in times.items()})
    if baseline:
        out.update(ar_wall_s=ar_wall, ar_tokens_per_s=ar_tokens / max(ar_wall, 1e-9), ar_new_tokens=ar_tokens)
        out["speedup"] = out["spec_tokens_per_s"] / max(out["ar_tokens_per_s"], 1e-9)
    return out


def al_stderr(accept_lengths: Sequence[Sequence[int]]) -> float:
    """Standard error of the AL (a ratio: committed tokens / rounds) over prompts, the unit that is sampled:
    ``accept_lengths`` [prompts][rounds]. Delta method for a ratio of sums (rounds of one prompt are not
    independent, so this is wider than a per-round error). nan below 2 prompts."""
    tok = [float(sum(x)) for x in accept_lengths if len(x)]
    rnd = [float(len(x)) for x in accept_lengths if len(x)]
    n = len(tok)
    if n < 2:
        return float("nan")
    al = sum(tok) / sum(rnd)
    mr = sum(rnd) / n
    var = sum((t - al * r) ** 2 for t, r in zip(tok, rnd)) / (n - 1)
    return (var / n) ** 0.5 / mr


def _influence(accept_lengths: Sequence[Sequence[int]]) -> list:
    """Each prompt's linearised contribution to the AL ratio (delta method), one value a prompt."""
    tok = [float(sum(x)) for x in accept_lengths]
    rnd = [float(len(x)) for x in accept_lengths]
    al, mr = sum(tok) / max(1.0, sum(rnd)), sum(rnd) / max(1, len(rnd))
    return [(t - al * r) / mr for t, r in zip(tok, rnd)]


def al_diff_stderr(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Standard error of AL(a) - AL(b) for two drafters decoded on the *same* prompts (paired over prompts:
    the prompt-to-prompt spread that both share cancels). ``a``, ``b``: accept_lengths [prompts][rounds]."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"al_diff_stderr needs the same >= 2 prompts on both sides; got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(_influence(a), _influence(b))]
    m = sum(d) / len(d)
    return (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5


def acceptance_cells(r: dict) -> list:
    """Per draft position: ``"0.41 (52/127)"`` (accepted / reached), or ``"-"`` where it was never reached."""
    return [f"{a / n:.2f} ({a}/{n})" if n else "-" for a, n in zip(r["accepted_at"], r["reached_at"])]


def format_table(r: dict, title: str = "") -> str:
    """The numbers of ``evaluate_al`` as a plain-text table (acceptance with the counts behind each rate)."""
    w = r["block_size"]
    cells = acceptance_cells(r)
    cw = max(6, *(len(c) for c in cells))
    lines = [title] if title else []
    lines += [f"{'mean AL (tokens / verification round, incl. bonus)':<52}{r['mean_al']:.3f}",
              f"{'rounds / new tokens / prompts':<52}{r['rounds']} / {r['new_tokens']} / {r['num_prompts']}",
              f"{'temperature / block size W':<52}{r['temperature']:g} / {w}",
              "draft position i        " + " ".join(f"{i + 1:>{cw}d}" for i in range(w)),
              "accepted | reached      " + " ".join(f"{c:>{cw}}" for c in cells),
              "P(first i accepted)     " + " ".join(f"{a:>{cw}.3f}" for a in r["survival"]),
              f"{'speculative tokens/s':<52}{r['spec_tokens_per_s']:.2f}"]
    if "ar_tokens_per_s" in r:
        lines += [f"{'autoregressive tokens/s (same target + cache)':<52}{r['ar_tokens_per_s']:.2f}",
                  f"{'speedup':<52}{r['speedup']:.3f}x"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- recipe plumbing
def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_eval_drafter(cfg, target):
    """eval.checkpoint: latest | none (fresh, untrained, seeded by cfg.seed) | a drafter folder."""
    ck = cfg.eval.checkpoint
    if ck == "none":
        d = cfg.drafter
        fl = list(d.feature_layers) if d.feature_layers is not None else None
        tdir = None if cfg.model.is_tiny else cfg.model.target
        if d.kind == "mtp":  # the target's own head, as the target folder ships it (a tiny one's too)
            tdir = d.init_from or resolve_target_path(cfg.model, cfg.trainer.output_dir)
        return build_drafter(d.kind, target, num_layers=d.num_layers, block_size=d.block_size, seed=cfg.seed,
                             feature_layers=fl, mask_token_id=d.mask_token_id, target_dir=tdir,
                             **dict(d.architecture)), "untrained"
    if ck == "latest":
        path = find_latest(cfg.trainer.output_dir)
        if path is None:
            raise FileNotFoundError(f"eval.checkpoint=latest but {cfg.trainer.output_dir}/checkpoints has no "
                                    f"step-N drafter; train first, or pass eval.checkpoint=none (untrained) or a folder")
    else:
        path = ck
        if not os.path.isdir(path):
            raise FileNotFoundError(f"eval.checkpoint={ck!r}: no such folder (use latest, none, or a drafter folder)")
    _check_checkpoint(path, cfg.trainer.output_dir if ck == "latest" else None)
    return load_drafter(path, target), path


def _check_checkpoint(path: str, run_dir: Optional[str]) -> None:
    """A damaged checkpoint is refused naming what is wrong and the newest one of its run that verifies."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        return
    why = verify(path)
    if why is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    run = run_dir or (os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None)
    good = newest_good(run) if run else None
    raise DamagedFolderError(f"checkpoint {path} is damaged: {why}. " + (
        f"The newest checkpoint of the run that verifies is {good}: pass eval.checkpoint={good}" if good else
        "No other checkpoint of its run verifies: train again (trainer.resume=auto moves the damaged one aside)"))


def sample_prompt_ids(cfg, target, num: int) -> list:
    """The prompts of the run's held-out samples (the trainer's own dataset and split)."""
    samples = load_dataset(cfg, target)
    _, held = split_dataset(samples, cfg.data.heldout, cfg.data.seed)  # honours the records' own split fields
    if not held:
        raise ValueError("the run has no held-out samples (data.heldout=0); set data.heldout > 0 to evaluate")
    return [samples[i]["input_ids"][: samples[i]["prompt_len"]] for i in held[:num]]


def parse_temperatures(text) -> list:
    """``"0,1"`` (or a list / number) -> [0.0, 1.0]; each must be >= 0 (0 = greedy)."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        temps = [float(x) for x in items if str(x).strip() != ""]
    except ValueError:
        raise ValueError(f"--temperatures {text!r}: give numbers separated by commas, e.g. 0,1") from None
    if not temps or any(not t == t or t < 0 or t == float("inf") for t in temps):
        raise ValueError(f"--temperatures {text!r}: give one or more temperatures >= 0 (0 = greedy), e.g. 0,1")
    return temps


def _parse_args(args) -> argparse.Namespace:
    if isinstance(args, argparse.Namespace):
        return args
    p = argparse.ArgumentParser(prog="specopd eval", add_help=False)
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    p.add_argument("--no-baseline", action="store_true", help="skip the autoregressive timing")
    p.add_argument("--block-size", type=int, default=None, help="verify only the first k draft tokens")
    p.add_argument("--prompts", default=None, help="prompts file: JSONL with 'prompt' or chat 'messages', or "
                                                   "plain text (one prompt a line); the target's chat template applies")
    p.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,1 (default: eval.decode_temperature)")
    p.add_argument("--engine", default="builtin", choices=["builtin", "vllm"],
                   help="vllm: also serve the drafter in vLLM and put its counters next to ours")
    p.add_argument("--bench", default=None, choices=list(BENCHES),
                   help="mt-bench: MT-Bench's 80 questions (AL per category too), instead of held-out prompts")
    p.add_argument("--turn", type=int, default=1, choices=[1, 2],
                   help="with --bench mt-bench: 2 = second turns, after the target's own greedy first answer")
    ns, rest = p.parse_known_args(list(args or []))
    if rest:
        raise SystemExit(f"specopd eval: unknown arguments {rest}; options: --json PATH, --no-baseline, "
                         f"--block-size K, --prompts FILE, --temperatures 0,1, --engine builtin|vllm, --bench mt-bench, "
                         f"--turn 1|2 (recipe keys go as section.key=value)")
    return ns


NO_TOKENIZER_FIX = ("give model.target a Hugging Face folder with its tokenizer files (e.g. `specopd prepare model "
                    "smollm2-135m`), or --prompts FILE with the prompts as token ids (one {\"input_ids\": [...]} a "
                    "line)")


def file_prompt_ids(path: str, target_dir: str, vocab_size: int, limit: Optional[int] = None,
                    stats: Optional[dict] = None) -> list:
    """A prompts file (``specopd.data.references.read_prompts``: JSONL or plain text through the target's chat
    template, or token ids as they are) -> prompt ids [T_i].

    Args:
        path: the prompts file; target_dir, vocab_size: the target (its tokenizer, for text prompts).
        limit: only the first ``limit`` prompts are read (None: all).
        stats: filled with ``total``, the prompts in the file.
    """
    prompts = [p for _, p in read_prompts(path, limit, vocab_size, stats)]  # messages, or token ids [int]
    if all(isinstance(p[0], int) for p in prompts):  # token ids only: no tokenizer needed
        return [torch.tensor(p, dtype=torch.long) for p in prompts]
    check_tokenizer(target_dir, f"--prompts {path} holds text prompts: {NO_TOKENIZER_FIX}")
    try:
        tok = load_tokenizer(target_dir, vocab_size)
    except (OSError, ValueError) as e:
        raise ValueError(f"--prompts {path}: the target in {target_dir} needs a tokenizer with a chat template to "
                         f"format prompts ({e})") from None
    return [torch.tensor(p if isinstance(p[0], int) else encode_prompt(tok, p), dtype=torch.long) for p in prompts]


def main_eval(cfg, args=None, judge=None) -> dict:
    """Entry of `specopd eval`: cfg is the loaded RecipeConfig; args an argparse Namespace or extra argv.

    Prompts: ``--prompts FILE``, else the main job's held-out chat prompts (a recipe with ``pipeline``), else
    the run's held-out samples. One table per temperature (``--temperatures``, default ``eval.decode_temperature``).
    Returns the first temperature's numbers at the top level and every temperature's under ``by_temperature``.
    ``--engine vllm``: ``judge(cfg.eval, trainer.output_dir, target_dir, target, drafter, source, prompts, stops,
    temps, ns)`` instead (``specopd.eval.engine.eval_with_vllm``: vLLM's counters next to ours), which returns the
    report.
    """
    ns = _parse_args(args)
    check_device(cfg)
    temps = parse_temperatures(getattr(ns, "temperatures", None) or [cfg.eval.decode_temperature])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_target_path(cfg.model, cfg.trainer.output_dir)
    if not os.path.isdir(path):  # a `specopd prepare model` name (e.g. smollm2-135m): prepared once, cached
        if path not in MODELS:
            raise FileNotFoundError(f"model.target={path!r} is neither a folder nor a `specopd prepare model` "
                                    f"name ({sorted(MODELS)})")
        path = MODELS[path]()
    prompts_file = getattr(ns, "prompts", None)
    if prompts_file and getattr(ns, "bench", None):
        raise ValueError("specopd eval: give --bench or --prompts, not both")
    if prompts_file and not os.path.isfile(prompts_file):
        raise FileNotFoundError(f"--prompts {prompts_file!r} " + ("is a folder" if os.path.isdir(prompts_file) else
                                                                "does not exist") + " (give a JSONL or text file)")
    if getattr(ns, "bench", None):  # MT-Bench's questions are text: refused before the weights load
        check_tokenizer(path, f"--bench {ns.bench} formats its questions with the target's tokenizer and chat template"
                              + (f" (model.target={cfg.model.target} is built without a tokenizer)" if
                                 cfg.model.is_tiny else "") + f": {NO_TOKENIZER_FIX}")
    target = load_target(path, dtype=eval_dtype(cfg), device=_device(cfg.model.device), kernels=cfg.model.kernels,
                         kernel_paths=cfg.kernels)
    drafter, source = load_eval_drafter(cfg, target)
    drafter = drafter.to(target.device)
    stops = () if cfg.model.is_tiny else _eos_ids(target)
    meta = None  # per prompt {"id", "category"}: a benchmark's prompts
    if getattr(ns, "bench", None):
        prompts, meta, where = bench_prompt_ids(ns, cfg, path, target, stops)
    elif prompts_file:  # its first eval.prompts prompts
        st: dict = {}
        prompts = file_prompt_ids(prompts_file, path, target.vocab_size, cfg.eval.prompts, st)
        where = f"{prompts_file}: the first {len(prompts)} of {st['total']}, eval.prompts={cfg.eval.prompts}"
        print(f"[eval] --prompts {prompts_file}: decoding the first {len(prompts)} of its {st['total']} prompts "
              f"(eval.prompts={cfg.eval.prompts}" + ("; raise it to decode more)" if st["total"] > len(prompts)
                                                     else ")"), flush=True)
    elif getattr(getattr(cfg, "pipeline", None), "enabled", False):  # the main job's own held-out prompts
        prompts, where = heldout_prompt_ids(path, target.vocab_size, cfg.eval.prompts), "held-out chat prompts"
    else:
        prompts, where = sample_prompt_ids(cfg, target, cfg.eval.prompts), "held-out samples"
    if getattr(ns, "engine", "builtin") == "vllm":  # vLLM judges: its counters next to ours (specopd.eval.engine)
        if judge is None:
            raise ValueError("--engine vllm: main_eval needs judge=specopd.eval.engine.eval_with_vllm (the `specopd "
                             "eval` command passes it)")
        return judge(cfg.eval, cfg.trainer.output_dir, path, target, drafter, source, prompts, stops, temps, ns,
                     meta=meta)
    print(provenance_line())
    runs = []
    for temp in temps:
        r = evaluate_al(target, drafter, prompts, cfg.eval.max_new_tokens, temp, cfg.eval.seed,
                        block_size=getattr(ns, "block_size", None), baseline=not getattr(ns, "no_baseline", False),
                        stop_token_ids=stops, progress=True)
        r.update(target=path, drafter=source, drafter_kind=cfg.drafter.kind if source == "untrained" else
                 getattr(drafter, "kind", None), device=str(target.device), stop_token_ids=list(stops),
                 prompts=where)
        print(format_table(r, f"specopd eval: target {path} | drafter {source} | {len(prompts)} prompts ({where}) x "
                              f"{cfg.eval.max_new_tokens} new tokens | T={temp:g}"))
        if meta is not None:
            r["by_category"] = by_category(r["accept_lengths"], meta)
            print(format_categories([(f"ours T={temp:g}", r["by_category"])]))
        runs.append(r)
    if len(runs) > 1:
        print("mean AL (incl. bonus): " + ", ".join(f"T={r['temperature']:g} {r['mean_al']:.3f}" for r in runs))
    out = dict(runs[0], by_temperature={f"{r['temperature']:g}": r for r in runs}, provenance=provenance())
    if getattr(ns, "json", None):
        os.makedirs(os.path.dirname(os.path.abspath(ns.json)), exist_ok=True)
        with open_write(ns.json) as f:
            json.dump(out, f, indent=1)
        print(f"wrote {ns.json}")
    return out


def bench_prompt_ids(ns, cfg, target_dir: str, target, stops) -> tuple:
    """``--bench mt-bench`` -> (prompt ids, per prompt {"id", "category"}, a label).

    Args:
        ns: the CLI's arguments (``--turn``: 1 = first turns; 2 = second turns after the target's own greedy
            first answer of at most ``eval.max_new_tokens`` tokens).
        cfg: the recipe; target_dir, target: the target's folder and model; stops: stop token ids.
    """
    if ns.turn == 1:
        first, meta = mtbench_prompts(target_dir, target.vocab_size)
        return first, meta, f"MT-Bench first turns ({len(first)})"
    second, meta = mtbench_second_turns(target, target_dir, cfg.eval.max_new_tokens, stops)
    return second, meta, f"MT-Bench second turns ({len(second)}) after the target's own first answers"


def _eos_ids(target) -> tuple:
    e = getattr(target.config, "eos_token_id", None)
    if isinstance(e, int):
        return (e,)
    return tuple(int(x) for x in e) if isinstance(e, (list, tuple)) else ()
