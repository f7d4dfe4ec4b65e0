"""Engines that answer badly: every answer is checked before a record is written (integer ids in [0, vocab), the
shape, at most max_tokens, a finish that matches the length), a bad one is a failed prompt (errors.jsonl, with the
server and the reason), never a record and never a traceback; bodies cut short are retried; time-outs are bounded
and Ctrl-C ends the run at once whatever the server does; an engine that cannot run is a message (exit 2), and a run
with failed prompts exits 1 after its counts. A fake OpenAI server on 127.0.0.1 (each request bounded in time) and a
fake vLLM python; the well-behaved paths: tests/test_engines_openai.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from oracle import make_tiny_checkpoint
from specopd.cli import main
from specopd.data import prepare as P
from specopd.data import references as R
from specopd.engines import EngineUnavailable, check_engine
from specopd.engines import openai_api as O
from test_data import write_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS, VOCAB, MAX = 2, 128, 4  # the char tokenizer's <|im_end|>, the target's vocabulary, max_new_tokens
HANG_S = 60.0  # the longest a "hang" request is held (the test releases it sooner)


def good(prompt: list, n: int) -> list:
    s = sum(prompt)
    return [3 + (s * 7 + 13 * i) % 90 for i in range(n)]


# mode -> the choice the server answers (a dict), or how it misbehaves (a string handled in the server)
BAD_CHOICES = {
    "out_of_vocab": dict(token_ids=[5, 6, 7, 500], finish_reason="length"),
    "float_id": dict(token_ids=[5, 3.7, 6, 7], finish_reason="length"),
    "negative_id": dict(token_ids=[5, -1, 6, 7], finish_reason="length"),
    "null_id": dict(token_ids=[5, None, 6, 7], finish_reason="length"),
    "bool_id": dict(token_ids=[5, True, 6, 7], finish_reason="length"),
    "too_many": dict(token_ids=[5, 6, 7, 8, 9], finish_reason="length"),
    "too_few": dict(token_ids=[5, 6], finish_reason="length"),
    "empty": dict(token_ids=[], finish_reason="stop"),
    "ids_not_a_list": dict(token_ids="5 6 7", finish_reason="length"),
}
REASONS = {  # mode -> what errors.jsonl must say
    "out_of_vocab": "holds 500, not a token id of the target", "float_id": "holds 3.7",
    "negative_id": "holds -1", "null_id": "holds None", "bool_id": "holds True",
    "too_many": "5 token_ids, more than the max_tokens=4", "too_few": "finish 'length' after 2 token_ids",
    "empty": "an empty answer", "ids_not_a_list": "token_ids is not a list",
    "choices_str": "no list of choices", "choices_empty": "no list of choices", "choice_str": "choices[0] is not an object",
    "http500": "HTTP 500", "not_json": "not JSON", "closed": "RemoteDisconnected", "cut": "IncompleteRead",
}
TRANSIENT = ("http500", "not_json", "closed", "cut")  # retried: 1 + RETRIES attempts


class BadServer:
    """/v1/models + /v1/completions on 127.0.0.1; ``modes[prompt key]`` says how a prompt is answered (default:
    well; a mode ending in ``_once`` misbehaves on the first request only). A "hang" request waits for
    ``release`` (at most HANG_S), so the server never outlives the test by long."""

    def __init__(self):
        self.modes, self.requests = {}, []
        self.release, self.lock = threading.Event(), threading.Lock()
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _raw(self, code, data: bytes, length=None):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._raw(200, json.dumps({"data": [{"id": "m"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = tuple(body["prompt"])
                with srv.lock:
                    srv.requests.append(key)
                    mode = srv.modes.get(key, "good")
                    if mode.endswith("_once"):  # misbehaves on the first request only
                        mode = mode.removesuffix("_once") if srv.requests.count(key) == 1 else "good"
                n = int(body["max_tokens"])
                if mode == "hang":
                    srv.release.wait(HANG_S)
                    mode = "good"
                if mode == "http500":
                    return self._raw(500, b'{"error": "internal"}')
                if mode == "not_json":
                    return self._raw(200, b"<html>Bad Gateway</html>")
                if mode == "closed":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if mode == "cut":  # a Content-Length the body does not reach, then the connection closes
                    self._raw(200, b'{"choices": [{"token_ids": [5, 6', length=400)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if mode == "choices_str":
                    return self._raw(200, b'{"choices": "x"}')
                if mode == "choices_empty":
                    return self._raw(200, b'{"choices": []}')
                if mode == "choice_str":
                    return self._raw(200, b'{"choices": ["x"]}')
                choice = dict(BAD_CHOICES[mode]) if mode in BAD_CHOICES else dict(
                    token_ids=good(list(key), n), finish_reason="length")
                choice.update(index=0, prompt_token_ids=list(key), text="")
                self._raw(200, json.dumps({"choices": [choice]}).encode())

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that went away (a time-out, Ctrl-C) while a bad answer was written: expected

        self.httpd = Quiet(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bad"), vocab_size=VOCAB, num_hidden_layers=1,
                                max_position_embeddings=96, eos_token_id=EOS)
    write_char_tokenizer(path)
    return path


@pytest.fixture
def server():
    s = BadServer()
    yield s
    s.close()


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(O, "RETRIES", 1)
    monkeypatch.setattr(O, "BACKOFF_S", 0.01)
    monkeypatch.setattr(O, "TIMEOUT_S", 10.0)


def _prompts(tmp_path, names):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": n, "prompt": f"say {n}"}) + "\n" for n in names))
    return str(p)


def _ids(target_dir, pf):
    tok = P.load_tokenizer(target_dir, VOCAB)
    return {pid: tuple(P.encode_prompt(tok, m)) for pid, m in R.read_prompts(pf)}


def test_bad_answers_are_failed_prompts_never_records(target_dir, server, fast, tmp_path):
    modes = list(REASONS)
    pf = _prompts(tmp_path, ["ok1", "ok2", "cut_once", *modes])
    ids = _ids(target_dir, pf)
    for m in modes:
        server.modes[ids[m]] = m
    server.modes[ids["cut_once"]] = "cut_once"  # cut short once, then answered: retried and written
    out = str(tmp_path / "out")
    kw = dict(max_new_tokens=MAX, temperature=0.0, progress=False, engine="openai", servers=server.url, concurrency=4)
    c = P.prepare_data(target_dir, out, pf, **kw)
    assert c == dict(written=3, skipped_done=0, skipped_too_long=0, failed=len(modes), total_records=3)
    recs = R.read_records(os.path.join(out, R.DATA_FILE))
    assert sorted(r["id"] for r in recs) == ["cut_once", "ok1", "ok2"]
    for r in recs:
        assert r["input_ids"][r["response_start"]:] == good(list(ids[r["id"]]), MAX)
    errs = {e["id"]: e for e in R.read_records(os.path.join(out, P.ERRORS_FILE))}
    assert sorted(errs) == sorted(modes)
    for m, why in REASONS.items():
        assert why in errs[m]["error"] and errs[m]["server"] == server.url, (m, errs[m])
        assert errs[m]["attempts"] == (1 + O.RETRIES if m in TRANSIENT else 1), (m, errs[m])
    assert server.requests.count(ids["cut_once"]) == 2
    # the rerun sends exactly the failed prompts again (nothing bad was stored as done); now answered well
    server.modes.clear()
    n = len(server.requests)
    c2 = P.prepare_data(target_dir, out, pf, **kw)
    assert c2 == dict(written=len(modes), skipped_done=3, skipped_too_long=0, failed=0, total_records=3 + len(modes))
    assert sorted(server.requests[n:]) == sorted(ids[m] for m in modes)
    assert R.read_records(os.path.join(out, P.ERRORS_FILE)) == []


def test_check_ids_and_completion_ids_say_what_is_wrong(target_dir):
    tok = P.load_tokenizer(target_dir, VOCAB)
    assert O.check_ids([0, VOCAB - 1], VOCAB, 2, "length") == [0, VOCAB - 1]
    assert O.check_ids([7, EOS], VOCAB, 4, "stop") == [7, EOS]  # stopped early: fewer ids are fine
    for ids, why in (([VOCAB], "holds 128"), ([1.0], "holds 1.0"), ([], "empty"), ([1, 2, 3], "more than"),
                     ([1], "finish 'length' after 1"), (None, "not a list")):
        with pytest.raises(O.RequestFailed, match=why) as e:
            O.check_ids(ids, VOCAB, 2, "length")
        assert not e.value.retry
    with pytest.raises(O.RequestFailed, match="choices\\[0\\] is not an object"):
        O.completion_ids("x", [1], tok, {EOS}, VOCAB, 4)
    with pytest.raises(O.RequestFailed, match="other prompt ids"):
        O.completion_ids({"finish_reason": "stop", "token_ids": [5], "prompt_token_ids": "abc"}, [1], tok, {EOS})
    with pytest.raises(O.RequestFailed, match="'text' is not a string"):
        O.completion_ids({"finish_reason": "stop", "text": 5}, [1], tok, {EOS})


def test_a_server_that_never_answers_is_bounded_by_timeout_and_retry_time(target_dir, server, fast, tmp_path):
    pf = _prompts(tmp_path, ["slow", "ok"])
    ids = _ids(target_dir, pf)
    server.modes[ids["slow"]] = "hang"
    t0 = time.monotonic()
    c = P.prepare_data(target_dir, str(tmp_path / "o"), pf, max_new_tokens=MAX, temperature=0.0, progress=False,
                       engine="openai", servers=server.url, concurrency=2, timeout_s=0.3, retry_time_s=0.5)
    took = time.monotonic() - t0
    assert c["written"] == 1 and c["failed"] == 1
    err = R.read_records(str(tmp_path / "o" / P.ERRORS_FILE))[0]
    assert err["id"] == "slow" and ("timed out" in err["error"] or "--retry-time" in err["error"]), err
    assert took < HANG_S / 2, took  # bounded by the time-outs, not by the server
    with pytest.raises(ValueError, match="--timeout must be a number of seconds > 0"):
        P.prepare_data(target_dir, str(tmp_path / "o2"), pf, engine="openai", servers=server.url, timeout_s=0)


def test_prepare_mistakes_and_failures_through_the_cli(target_dir, server, fast, tmp_path, capsys, monkeypatch):
    """Exit 1 after the counts when prompts failed; exit 2 and a message (no exception out of ``main``) for an
    engine that cannot run or an option out of range."""
    pf = _prompts(tmp_path, ["a", "b", "c"])
    ids = _ids(target_dir, pf)
    server.modes[ids["b"]] = "http500"
    base = ["prepare", "data", "--target", target_dir, "--prompts", pf, "--max-new-tokens", str(MAX),
            "--temperature", "0"]
    assert main(base + ["--out", str(tmp_path / "o1"), "--engine", "openai", "--server", server.url]) == 1
    cap = capsys.readouterr()
    assert "'written': 2" in cap.out and "'failed': 1" in cap.out
    assert "1 of the prompts failed" in cap.err and "errors.jsonl" in cap.err
    server.modes[ids["a"]] = server.modes[ids["c"]] = "http500"  # every prompt fails: still exit 1, not 0
    assert main(base + ["--out", str(tmp_path / "o1b"), "--engine", "openai", "--server", server.url]) == 1
    assert "'failed': 3" in capsys.readouterr().out
    no_vllm = tmp_path / "python-without-vllm"  # a python that runs but has no vllm package
    no_vllm.write_text(f"#!/bin/sh\nexec {sys.executable} -I \"$@\"\n")
    no_vllm.chmod(0o755)
    cases = [
        (["--engine", "openai", "--server", "http://127.0.0.1:9"], {}, ["no server answered GET /v1/models",
                                                                      "vllm.entrypoints.openai.api_server"]),
        (["--num", "-3"], {}, ["--num must be >= 1"]),
        (["--num", "0"], {}, ["--num must be >= 1"]),
        (["--engine", "openai", "--server", server.url, "--timeout", "0"], {}, ["--timeout must be"]),
        (["--engine", "vllm"], {"SPECOPD_VLLM_PYTHON": "/usr/bin/true"}, ["/usr/bin/true does not run as a python"]),
        (["--engine", "vllm"], {"SPECOPD_VLLM_PYTHON": str(no_vllm)}, ["has no vllm package"]),
        (["--engine", "vllm"], {"SPECOPD_VLLM_PYTHON": str(tmp_path / "nope")}, ["is not an executable python"]),
    ]
    for k, (extra, env, needles) in enumerate(cases):
        with monkeypatch.context() as m:
            for key, v in env.items():
                m.setenv(key, v)
            rc = main(base + ["--out", str(tmp_path / f"c{k}"), *extra])
        err = capsys.readouterr().err
        assert rc == 2, (extra, rc, err)
        for n in needles:
            assert n in err, (extra, n, err)
    monkeypatch.setenv("SPECOPD_VLLM_PYTHON", "/usr/bin/true")
    with pytest.raises(EngineUnavailable, match="does not run as a python"):
        check_engine("vllm")
    rc = main(["serve-check", str(tmp_path), "--target", target_dir])
    assert rc == 2 and "does not run as a python" in capsys.readouterr().out


FAKE_VLLM = """#!{python}
import json, sys
if sys.argv[1] == "-c":  # the probe: a python with vllm
    print("specopd-vllm-probe True 3")
    sys.exit(0)
a = sys.argv
reqs = [json.loads(x) for x in open(a[a.index("--input") + 1])]
with open(a[a.index("--output") + 1], "a") as f:
    for r in reqs:
        if r["id"] == "good":
            f.write(json.dumps({{"id": r["id"], "token_ids": [5] * r["max_tokens"], "finish": "length"}}) + "\\n")
        elif r["id"] == "oov":
            f.write(json.dumps({{"id": r["id"], "token_ids": [5, 999], "finish": "eos"}}) + "\\n")
        elif r["id"] == "long":
            f.write(json.dumps({{"id": r["id"], "token_ids": [5] * (r["max_tokens"] + 1), "finish": "length"}}) + "\\n")
print("[vllm-runner] something broke", file=sys.stderr)
sys.exit(3)
"""


def test_a_vllm_run_that_fails_or_answers_badly_fails_those_prompts(target_dir, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("SPECOPD_VLLM_PYTHON", str(fake))
    pf = _prompts(tmp_path, ["good", "oov", "long", "missing"])
    out = str(tmp_path / "o")
    c = P.prepare_data(target_dir, out, pf, max_new_tokens=MAX, temperature=0.0, progress=False, engine="vllm")
    assert c == dict(written=1, skipped_done=0, skipped_too_long=0, failed=3, total_records=1)
    errs = {e["id"]: e["error"] for e in R.read_records(os.path.join(out, P.ERRORS_FILE))}
    assert "holds 999" in errs["oov"] and "more than the max_tokens=4" in errs["long"]
    assert "vLLM exited with code 3" in errs["missing"]
    assert "something broke" in capsys.readouterr().err
    assert [r["id"] for r in R.read_records(os.path.join(out, R.DATA_FILE))] == ["good"]


CTRL_C_WAIT_S = 40.0


def _sigint_default():
    """A shell starts background jobs with SIGINT ignored and children inherit that (so Python installs no
    KeyboardInterrupt handler): the child gets SIGINT's default whatever started the test run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_the_run_at_once_whatever_the_server_does(target_dir, server, tmp_path):
    """The prompts after the first hang on the server; SIGINT once a request is waiting: the process ends within
    seconds (exit 130), data.jsonl holds whole records only, and a rerun goes on from them."""
    pf = _prompts(tmp_path, [f"p{i}" for i in range(6)])
    ids = _ids(target_dir, pf)
    for i in range(1, 6):
        server.modes[ids[f"p{i}"]] = "hang"
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("SPECOPD_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "specopd.cli", "prepare", "data", "--target", target_dir,
                          "--prompts", pf, "--out", str(out), "--max-new-tokens", str(MAX), "--temperature", "0",
                          "--engine", "openai", "--server", server.url, "--concurrency", "1", "--timeout", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         preexec_fn=_sigint_default)
    try:
        t0 = time.monotonic()
        while ids["p1"] not in server.requests and time.monotonic() - t0 < 120 and p.poll() is None:
            time.sleep(0.05)
        assert ids["p1"] in server.requests, p.communicate(timeout=5)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        t1 = time.monotonic()
        so, err = p.communicate(timeout=CTRL_C_WAIT_S)
        took = time.monotonic() - t1
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, (p.returncode, err[-2000:])
    assert took < HANG_S / 3, took  # the server holds the request for HANG_S (and --timeout is 60): not waited for
    text = (out / R.DATA_FILE).read_text()
    assert text.endswith("\n") and [json.loads(x)["id"] for x in text.splitlines()] == ["p0"]
