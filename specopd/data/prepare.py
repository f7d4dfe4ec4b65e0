"""`specopd prepare model smollm2-135m` and `specopd prepare data`.

prepare data: prompts (a JSONL file, or chitchat-dataset's first user turns) are put through the target's
chat template and answered by the target itself (``generate_batch``: our trunk caches, several prompts
scored together in one packed tree pass per token), with temperature / top-p; records are appended to
``<out>/data.jsonl`` batch by batch (a second run skips finished prompt ids). See ``specopd.data.references`` for the record format and ``load_references``.
``generate_batch`` is also the evaluation's greedy continuations (``specopd.eval.replay``); why it is not
``specopd.eval.decoder.autoregressive``: that module's docstring.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from specopd.data.formats import DataError, conversation_prompts, tokenizer_files
from specopd.data.packaged import conversations_file
from specopd.data.references import (DATA_FILE, META_FILE, append_record, chitchat_prompts, read_prompts, read_records,
                                     repair_tail, split_of)
from specopd.data.smollm2 import MODEL_NAME, cache_root, default_model_dir, is_prepared, prepare_smollm2
from specopd.engines import EngineFailed, check_engine, run_vllm
from specopd.engines.openai_api import RequestFailed, check_ids, generate_openai
from specopd.errors import MissingInputError, open_write, own_dir, refuse_link
from specopd.models import load_target
from specopd.models.loading import read_config
from specopd.runs.lock import run_lock
from specopd.sampling import multinomial_tokens
from specopd.tree import ProposalTree

MODELS = {MODEL_NAME: prepare_smollm2}


@torch.no_grad()
def generate_batch(target, prompts: Sequence[torch.Tensor], max_new_tokens: int, temperature: float, top_p: float,
                   generators: Sequence, stop_ids: set, on_tokens=None) -> list:
    """Sample responses for several prompts at once with our target and its trunk caches.

    The prompts but their last token are prefilled once (``prefill_batch``, no logits). Then every step
    runs all live streams' pending tokens (first: the prompt's last) as one-node chains in *one* packed
    ``target.score`` pass (one new token per stream: O(1) target work a token) and folds them into the caches
    from that pass (``target.commit``, no second pass), as the speculative decoder does. Equal to one-at-a-time
    decoding (the same logits up to rounding).

    Args:
        target: a ``TargetModel``.
        prompts: n prompt ids [T_i].
        max_new_tokens: at most this many tokens per response.
        temperature, top_p: as in ``specopd.sampling.multinomial_tokens``.
        generators: one torch.Generator (or None at T = 0) per prompt.
        stop_ids: token ids that end a response.
        on_tokens: ``on_tokens(k)`` (progress) is told how much of the n * max_new_tokens budget each step used up.

    Returns:
        [(response ids, "eos" | "length")] in prompt order.
    """
    n = len(prompts)
    prompts = [torch.as_tensor(p, device=target.device).reshape(-1) for p in prompts]
    outs, done, caches, pending = [[] for _ in range(n)], [None] * n, [None] * n, [None] * n
    on_tokens = on_tokens or (lambda k: None)
    long = [i for i in range(n) if prompts[i].numel() > 1]  # prompt[:-1] prefilled, prompt[-1] pending
    for i, c in zip(long, target.prefill_batch([prompts[i][:-1] for i in long], keep_logits=False)):
        caches[i], pending[i] = c, int(prompts[i][-1])
    for i in sorted(set(range(n)) - set(long)):  # a 1-token prompt: run it, sample token 1 from its logits
        c = target.prefill(prompts[i], keep_logits=True)
        caches[i], pending[i] = dataclasses.replace(c, logits=None), _draw(c.logits[-1], temperature, top_p,
                                                                           generators[i])
        on_tokens(_push(i, pending[i], outs, done, stop_ids, max_new_tokens))
    while True:
        live = [i for i in range(n) if done[i] is None]
        if not live:
            return [(outs[i], done[i]) for i in range(n)]
        tree = ProposalTree.pack([ProposalTree.from_branches([len(caches[i]) - 1], [[pending[i]]]) for i in live])
        logits, state = target.score(tree, [caches[i] for i in live], return_state=True)  # [A, 1, V]
        grown = target.commit([caches[i] for i in live], state, [[j] for j in range(len(live))])
        for j, i in enumerate(live):
            caches[i] = grown[j]
            pending[i] = _draw(logits[j, -1], temperature, top_p, generators[i])
        on_tokens(sum(_push(i, pending[i], outs, done, stop_ids, max_new_tokens) for i in live))


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One token from one position's logits [V]."""
    return int(multinomial_tokens(logits, temperature, generator, top_p))


def _push(i, tok, outs, done, stop_ids, max_new_tokens) -> int:
    """Append ``tok`` to stream i; -> budget used (1, or the rest of the budget when the stream stops)."""
    outs[i].append(tok)
    if tok in stop_ids:
        done[i] = "eos"
        return max_new_tokens - len(outs[i]) + 1
    if len(outs[i]) >= max_new_tokens:
        done[i] = "length"
    return 1


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") & (2**63 - 1)


TOKENIZER_FIX = "use a target folder that has its tokenizer files (e.g. `specopd prepare model smollm2-135m`)"


def check_tokenizer(target_dir: str, fix: str = TOKENIZER_FIX) -> None:
    """A ``MissingInputError`` naming ``target_dir`` and ``fix`` when the folder holds no tokenizer file at all
    (a ``tiny:`` target is built without one): text cannot become its token ids."""
    if os.path.isdir(target_dir) and not tokenizer_files(target_dir):
        raise MissingInputError(f"the target folder {target_dir} has no tokenizer (no tokenizer.json, "
                                f"tokenizer.model, vocab.json or other tokenizer file), so text cannot be turned into "
                                f"its token ids; {fix}")


def load_tokenizer(target_dir: str, vocab_size: int):
    """The target's own tokenizer (with its chat template); refuses one whose ids exceed the target's vocab, and a
    folder without one (``check_tokenizer``)."""
    check_tokenizer(target_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer  # optional (dev / demo extra)
    except ImportError:
        raise ImportError("prepare data needs transformers for the tokenizer + chat template; "
                          "run `pip install -e .[demo]`") from None
    tok = AutoTokenizer.from_pretrained(target_dir)
    if len(tok) > vocab_size:
        raise ValueError(f"the tokenizer in {target_dir} has {len(tok)} tokens but the target's config.json says "
                         f"vocab_size={vocab_size}: tokenizer and weights do not belong together (use the target's "
                         f"own tokenizer files)")
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {target_dir} has no chat template; prompts cannot be formatted "
                         f"(use an instruct model's tokenizer)")
    return tok


def stop_token_ids(tok, target) -> set:
    ids = set()
    for v in (getattr(tok, "eos_token_id", None), getattr(target.config, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def encode_prompt(tok, messages) -> list:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------- prepare data
ENGINE_DIR = ".engine"      # <out>/.engine/: an engine's requests and raw outputs (ingested into data.jsonl)
SKIPPED_FILE = "skipped.jsonl"  # prompts not generated (too long for the target's context), one line each
ERRORS_FILE = "errors.jsonl"    # prompts whose generation failed (an engine's error), one line each


def prepare_data(target_dir: str, out_dir: str, prompts_file: Optional[str] = None, num: Optional[int] = None,
                 max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                 heldout_fraction: float = 0.1, device: str = "cpu", dtype: str = "float32",
                 progress: bool = True, batch_size: int = 4, prompts: Optional[list] = None,
                 prompts_label: Optional[str] = None, engine: str = "builtin", servers: Optional[str] = None,
                 concurrency: int = 8, timeout_s: Optional[float] = None, retry_time_s: Optional[float] = None,
                 max_total_tokens: Optional[int] = None, kernel_paths=None) -> dict:
    """Regenerate responses for the first ``num`` prompts (resumable: records are appended as they finish; a
    rerun skips finished ids). Holds the lock of ``out_dir`` (``specopd.runs.lock``): a second writer there is
    refused.

    Args:
        prompts / prompts_label: a list of (id, messages), named ``prompts_label`` in meta.json; else
            ``prompts_file``, else chitchat's first user turns.
        engine: ``builtin`` (our decoder, ``batch_size`` streams in one packed pass a step), ``vllm`` (offline
            generation in the vLLM venv, `specopd.engines`), ``openai`` (``servers``: OpenAI-compatible URLs,
            ``concurrency`` requests in flight, each with ``timeout_s``, a prompt's attempts within
            ``retry_time_s``; defaults in ``specopd.engines.openai_api``).
        max_total_tokens: with it, a response also stops where prompt + response reach this many tokens (what a
            trainer cutting sequences there keeps: nothing is generated past it); a prompt leaving no room is
            skipped. builtin and vllm only.
        kernel_paths: the recipe's ``kernels:`` section the builtin engine's target runs (``load_target``); None:
            all "auto".
    Returns:
        counts {written, skipped_done, skipped_too_long, failed, total_records}; written + skipped_done +
        skipped_too_long + failed = the number of prompts. Skipped and failed prompts are listed in
        <out>/skipped.jsonl and <out>/errors.jsonl. An engine's answer is checked before it is written (ids in the
        target's vocabulary, at most ``max_new_tokens``, a finish that matches the length); a bad one is a failed
        prompt.
    """
    if num is not None and num < 1:
        raise ValueError(f"--num must be >= 1 (the first N prompts); got {num}. Leave it out to use all prompts")
    if max_new_tokens < 1 or batch_size < 1 or concurrency < 1:
        raise ValueError(f"--max-new-tokens, --batch-size and --concurrency must be >= 1; got {max_new_tokens}, "
                         f"{batch_size}, {concurrency}")
    if not 0 <= temperature < float("inf") or not 0 < top_p <= 1:
        raise ValueError(f"need --temperature >= 0 and 0 < --top-p <= 1; got {temperature}, {top_p}")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be in [0, 1); got {heldout_fraction}")
    for name, v in (("--timeout", timeout_s), ("--retry-time", retry_time_s)):
        if v is not None and not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a number of seconds > 0; got {v}")
    engine = check_engine(engine, servers)
    if max_total_tokens is not None and engine == "openai":
        raise ValueError("max_total_tokens: the builtin and vllm engines only")
    with run_lock(out_dir, "prepare data --out"):  # one writer per data folder, for the whole run
        check_no_links(out_dir)
        return _prepare_data(target_dir, out_dir, prompts_file, num, max_new_tokens, temperature, top_p, seed,
                             heldout_fraction, device, dtype, progress, batch_size, prompts, prompts_label, engine,
                             servers, concurrency, timeout_s, retry_time_s, max_total_tokens, kernel_paths)


def check_no_links(out_dir: str) -> None:
    """Refuse (``LinkedPathError``) a data folder where a file this command writes is a symbolic link, before
    anything is written: the engines write some of them and import nothing of ours."""
    d, req_path, out_path = _engine_paths(out_dir)
    for p in [os.path.join(out_dir, n) for n in (META_FILE, DATA_FILE, SKIPPED_FILE, ERRORS_FILE)] + [
            d, req_path, out_path, os.path.join(d, "vllm.log")]:
        refuse_link(p)


def _prepare_data(target_dir, out_dir, prompts_file, num, max_new_tokens, temperature, top_p, seed, heldout_fraction,
                  device, dtype, progress, batch_size, prompts, prompts_label, engine, servers, concurrency,
                  timeout_s, retry_time_s, max_total_tokens, kernel_paths) -> dict:
    config = read_config(target_dir)
    vocab_size = int(config["vocab_size"])
    tok = load_tokenizer(target_dir, vocab_size)
    if prompts is None:
        prompts = read_prompts(prompts_file, num) if prompts_file else chitchat_prompts()
        prompts_label = os.path.abspath(prompts_file) if prompts_file else "chitchat"
    if num is not None:
        prompts = prompts[:num]
    meta = {"target": os.path.abspath(target_dir), "model_type": config.get("model_type"),
            "vocab_size": vocab_size, "prompts": prompts_label or "a list",
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
            "heldout_fraction": heldout_fraction, "dtype": str(dtype), "engine": engine}
    if max_total_tokens is not None:  # only then: folders written without it keep resuming
        meta["max_total_tokens"] = int(max_total_tokens)
    os.makedirs(out_dir, exist_ok=True)
    meta_path, data_path = os.path.join(out_dir, META_FILE), os.path.join(out_dir, DATA_FILE)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        old.setdefault("engine", "builtin")  # folders written before engines existed
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{out_dir} was prepared with other settings {diff} (old, new); resume with the same "
                             f"settings or choose a new --out")
    else:
        with open_write(meta_path) as f:
            json.dump(meta, f, indent=1)
    repair_tail(data_path)
    _ingest_engine_outputs(out_dir, tok, seed, heldout_fraction, vocab_size)  # what an interrupted engine run left
    done = {r["id"] for r in read_records(data_path)}
    pending = [(pid, m) for pid, m in prompts if pid not in done]
    counts = dict(written=0, skipped_done=len(prompts) - len(pending), skipped_too_long=0, failed=0)
    limit = config.get("max_position_embeddings")
    todo, budget = [], {}  # budget: each prompt's most new tokens
    with open_write(os.path.join(out_dir, SKIPPED_FILE)) as sk:
        for pid, msgs in pending:
            ids = encode_prompt(tok, msgs)
            n = max_new_tokens if max_total_tokens is None else min(max_new_tokens, max_total_tokens - len(ids))
            if limit is not None and len(ids) + n > int(limit):
                counts["skipped_too_long"] += 1
                sk.write(json.dumps({"id": pid, "reason": f"prompt {len(ids)} + max_new_tokens {max_new_tokens} "
                                                          f"tokens > the target's context {limit}"}) + "\n")
            elif n < 1:
                counts["skipped_too_long"] += 1
                sk.write(json.dumps({"id": pid, "reason": f"prompt {len(ids)} tokens leaves no room within "
                                                          f"max_total_tokens {max_total_tokens}"}) + "\n")
            else:
                todo.append((pid, ids))
                budget[pid] = n
    if engine == "builtin":
        _generate_builtin(target_dir, out_dir, todo, tok, counts, max_new_tokens, temperature, top_p, seed,
                          heldout_fraction, device, dtype, batch_size, progress, budget, kernel_paths)
    elif engine == "vllm":
        _generate_vllm(target_dir, out_dir, todo, tok, counts, max_new_tokens, temperature, top_p, seed,
                       heldout_fraction, dtype, progress, vocab_size, budget)
    else:
        generate_openai(servers, out_dir, todo, tok, counts, max_new_tokens, temperature, top_p, seed,
                        heldout_fraction, concurrency, progress, make_record=make_record, seed_of=_seed_of,
                        vocab_size=vocab_size, timeout_s=timeout_s, retry_time_s=retry_time_s)
    counts["total_records"] = len(read_records(data_path))
    parts = counts["written"] + counts["skipped_done"] + counts["skipped_too_long"] + counts["failed"]
    if parts != len(prompts):  # every prompt is written, skipped or failed (and listed): a bug otherwise
        raise AssertionError(f"prepare data: counts {counts} add up to {parts}, not the {len(prompts)} prompts")
    return counts


def make_record(pid: str, prompt_ids: list, resp: list, finish: str, tok, seed: int, heldout_fraction: float) -> dict:
    """One reference record (``specopd.data.references``): prompt + response ids, the split by prompt id.

    Args:
        pid: the prompt id.
        prompt_ids, resp: the prompt's and the response's token ids.
        finish: "eos" | "length".
        tok: the tokenizer (the record keeps the response's text).
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).

    Returns:
        the record: id, split, input_ids, response_start, prompt_len, finish, response.
    """
    return {"id": pid, "split": split_of(pid, seed, heldout_fraction), "input_ids": list(prompt_ids) + list(resp),
            "response_start": len(prompt_ids), "prompt_len": len(prompt_ids), "finish": finish,
            "response": tok.decode(resp)}


def _generate_builtin(target_dir, out_dir, todo, tok, counts, max_new_tokens, temperature, top_p, seed,
                      heldout_fraction, device, dtype, batch_size, progress, budget, kernel_paths) -> None:
    """Our decoder: ``batch_size`` prompts at a time in one packed target pass a token, appended per batch; a
    response longer than its prompt's ``budget`` is cut there (sampling is per stream: the same as stopping)."""
    target = load_target(target_dir, dtype=dtype, device=device, kernel_paths=kernel_paths)
    stops = stop_token_ids(tok, target)
    bar = tqdm(total=len(todo) * max_new_tokens, desc="references (token budget)", unit="tok", disable=not progress)
    n_tok, t0 = 0, time.perf_counter()
    with open_write(os.path.join(out_dir, DATA_FILE), "a") as f:
        for b in range(0, len(todo), batch_size):
            batch = todo[b: b + batch_size]
            gens = [torch.Generator().manual_seed(_seed_of(seed, pid)) for pid, _ in batch]
            res = generate_batch(target, [torch.tensor(ids) for _, ids in batch], max_new_tokens, temperature,
                                 top_p, gens, stops, on_tokens=bar.update)
            for (pid, ids), (resp, finish) in zip(batch, res):
                if len(resp) > budget[pid]:
                    resp, finish = resp[: budget[pid]], "length"
                append_record(f, make_record(pid, ids, resp, finish, tok, seed, heldout_fraction))
                counts["written"] += 1
                n_tok += len(resp)
            bar.set_postfix(written=counts["written"], tok_s=f"{n_tok / (time.perf_counter() - t0):.1f}")
    bar.close()


def _engine_paths(out_dir: str) -> tuple:
    d = os.path.join(out_dir, ENGINE_DIR)
    return d, os.path.join(d, "requests.jsonl"), os.path.join(d, "outputs.jsonl")


def _ingest_engine_outputs(out_dir: str, tok, seed: int, heldout_fraction: float, vocab_size: int,
                           bad: Optional[dict] = None) -> int:
    """Append the records of an engine's raw outputs (<out>/.engine/outputs.jsonl, matched to its requests) that
    data.jsonl lacks; -> how many. A torn last line (the engine was killed mid-write) is ignored; an output that
    fails ``check_ids`` (ids outside the vocabulary, more than max_tokens, a finish that does not match) is not
    written: ``bad[id]`` says why (the prompt is sent again by a rerun)."""
    d, req_path, out_path = _engine_paths(out_dir)
    if not os.path.isfile(out_path) or not os.path.isfile(req_path):
        return 0
    reqs = {r["id"]: r for r in read_records(req_path)}
    have = {r["id"] for r in read_records(os.path.join(out_dir, DATA_FILE))}
    bad = {} if bad is None else bad
    n = 0
    with open(out_path) as src, open_write(os.path.join(out_dir, DATA_FILE), "a") as f:
        for line in src:
            try:
                o = json.loads(line)
            except json.JSONDecodeError:
                continue
            pid = o.get("id") if isinstance(o, dict) else None
            if not isinstance(pid, str) or pid in have or pid not in reqs:
                continue
            finish = o.get("finish")
            try:
                if finish not in ("eos", "length"):
                    raise RequestFailed(f"finish {finish!r} (neither 'eos' nor 'length')", False)
                resp = check_ids(o.get("token_ids"), vocab_size, int(reqs[pid]["max_tokens"]), finish)
            except RequestFailed as e:
                bad[pid] = f"vLLM's output: {e}"
                continue
            append_record(f, make_record(pid, reqs[pid]["prompt_ids"], resp, finish, tok, seed, heldout_fraction))
            have.add(pid)
            n += 1
    os.remove(out_path)
    return n


def _generate_vllm(target_dir, out_dir, todo, tok, counts, max_new_tokens, temperature, top_p, seed,
                   heldout_fraction, dtype, progress, vocab_size, budget) -> None:
    """Offline generation in the vLLM venv (its own process): the requests carry our chat-templated prompt ids,
    so prompts are token-identical to the built-in engine's; outputs are ingested when it ends (or by the next
    run, if it was killed). A prompt it gave no good output for is a failed one (errors.jsonl), also when vLLM
    exited with an error (whose log tail is printed)."""
    err_path = os.path.join(out_dir, ERRORS_FILE)
    open_write(err_path).close()  # this run's failures (a rerun retries them)
    if not todo:
        return
    d, req_path, out_path = _engine_paths(out_dir)
    own_dir(d)
    with open_write(req_path) as f:
        for pid, ids in todo:
            f.write(json.dumps({"id": pid, "prompt_ids": ids, "max_tokens": budget[pid],
                                "temperature": temperature, "top_p": top_p, "seed": _seed_of(seed, pid) % 2**31})
                    + "\n")
    bar = tqdm(total=len(todo), desc="references (vLLM)", unit="prompt", disable=not progress)
    vdtype = "float32" if str(dtype) in ("float32", "torch.float32") else "bfloat16"
    failure, bad = None, {}
    try:
        ctx = min(2048, int(read_config(target_dir).get("max_position_embeddings") or 2048))  # vLLM refuses more
        run_vllm(["generate", "--model", target_dir, "--input", req_path, "--output", out_path, "--dtype", vdtype,
                  "--max-model-len", ctx],
                 log_path=os.path.join(d, "vllm.log"), on_progress=lambda k, n: bar.update(k - bar.n))
    except EngineFailed as e:  # the prompts it did not finish fail below, with this reason
        failure = str(e)
        print(f"[specopd] vllm: {failure}", file=sys.stderr, flush=True)
    finally:  # what it finished is kept, also when it failed
        bar.close()
        counts["written"] += _ingest_engine_outputs(out_dir, tok, seed, heldout_fraction, vocab_size, bad)
    have = {r["id"] for r in read_records(os.path.join(out_dir, DATA_FILE))}
    why = (failure or "").splitlines()[0] if failure else "vLLM ended without an output for it"
    with open_write(err_path, "a") as ef:
        for pid, _ in todo:
            if pid not in have:
                ef.write(json.dumps({"id": pid, "engine": "vllm", "error": bad.get(pid, why)}) + "\n")
                counts["failed"] += 1
    if counts["failed"]:
        print(f"[specopd] vllm: {counts['failed']} prompts failed (listed in {err_path}); rerun the same command "
              f"to retry them", flush=True)


# ---------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specopd prepare", description="Prepare the demo target and reference data.")
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("model", help="convert a demo target to a Hugging Face folder (once)")
    m.add_argument("name", choices=sorted(MODELS))
    m.add_argument("--cache-dir", default=None, help="data folder (default $SPECOPD_CACHE or ~/.cache/specopd)")
    d = sub.add_parser("data", help="regenerate responses with the target (resumable)")
    d.add_argument("--prompts", default=None, help="JSONL of {'prompt': ...} or {'messages': [...]}, or plain text "
                                                   "(one prompt a line) "
                                                   "(default: chitchat-dataset first user turns)")
    d.add_argument("--from", dest="from_file", default=None,
                   help="a conversations file (SpecForge / ShareGPT / OpenAI; .jsonl, .json or .parquet): keep each "
                        "conversation's prompt (system + user turns before its first answer), regenerate the answer; "
                        "'sharegpt' names the packaged ShareGPT file")
    d.add_argument("--bad-lines", default="error", choices=["error", "skip"],
                   help="--from: a bad record stops the run (error) or is skipped and counted (skip)")
    d.add_argument("--target", default=None, help="target HF folder (default: the prepared smollm2-135m)")
    d.add_argument("--out", default=None, help="output folder (default <cache>/data/<prompts>-<target>)")
    d.add_argument("--cache-dir", default=None)
    d.add_argument("--num", type=int, default=None, help="use the first N prompts (default all)")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=1.0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--heldout-fraction", type=float, default=0.1)
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--batch-size", type=int, default=4, help="builtin: prompts decoded together (one packed pass a step)")
    d.add_argument("--engine", default="builtin", choices=["builtin", "vllm", "openai"],
                   help="who generates: our decoder, vLLM in its own venv (`make vllm`), or OpenAI-compatible servers")
    d.add_argument("--server", default=None, help="--engine openai: URL[,URL...] of OpenAI-compatible servers")
    d.add_argument("--concurrency", type=int, default=8, help="--engine openai: requests in flight")
    d.add_argument("--timeout", type=float, default=None,
                   help="--engine openai: seconds one request may take (default 300); a slower one is retried")
    d.add_argument("--retry-time", type=float, default=None,
                   help="--engine openai: seconds one prompt may take over all its attempts (default 900); then it "
                        "fails (errors.jsonl) and a rerun retries it")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of `specopd prepare ...`; argv excludes the leading 'prepare'."""
    args = _parser().parse_args(list(sys.argv[2:] if argv is None else argv))
    if args.what == "model":
        MODELS[args.name](cache_dir=args.cache_dir)
        return 0
    target = args.target or default_model_dir(args.cache_dir)
    if args.target is None and not is_prepared(target):
        raise SystemExit(f"no --target given and the default target {target} is not prepared; run "
                         f"`specopd prepare model {MODEL_NAME}` first (or pass --target HF_DIR)")
    prompts = label = None
    if args.from_file:  # conversations as users have them -> (id, prompt messages)
        if args.prompts:
            raise SystemExit("give --prompts or --from, not both")
        args.from_file = conversations_file(args.from_file)
        st: dict = {}
        try:
            prompts = conversation_prompts(args.from_file, args.bad_lines, st)
        except DataError as e:
            if not e.skippable:  # a .json document that cannot be read on: --bad-lines skip would not help
                raise
            raise DataError(e.where, e.reason, e.msg, fix="fix or remove it, or pass --bad-lines skip to skip bad "
                                                          "records and count them") from None
        label = os.path.abspath(args.from_file)
        if st.get("bad") or st.get("later_turns_dropped"):
            print(f"[specopd] --from {args.from_file}: {len(prompts)} prompts; skipped " + (", ".join(
                f"{n} {r}" for r, n in sorted(st.get("bad", {}).items())) or "none") + f"; "
                  f"{st.get('later_turns_dropped', 0)} conversations had later turns (not kept: they answer the "
                  f"original reply)", flush=True)
    if args.out is None:
        named = args.prompts or args.from_file
        src = os.path.splitext(os.path.basename(named))[0] if named else "chitchat"
        args.out = os.path.join(cache_root(args.cache_dir), "data", f"{src}-{os.path.basename(os.path.normpath(target))}")
    counts = prepare_data(target, args.out, args.prompts, args.num, args.max_new_tokens, args.temperature,
                          args.top_p, args.seed, args.heldout_fraction, args.device, args.dtype,
                          batch_size=args.batch_size, engine=args.engine, servers=args.server,
                          concurrency=args.concurrency, prompts=prompts, prompts_label=label,
                          timeout_s=args.timeout, retry_time_s=args.retry_time)
    print(f"[specopd] references in {args.out}/{DATA_FILE}: {counts}")
    if counts["failed"]:  # a partial result: the counts are printed, the exit code says it is not complete
        print(f"specopd: error: {counts['failed']} of the prompts failed (listed in "
              f"{os.path.join(args.out, ERRORS_FILE)}); rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
