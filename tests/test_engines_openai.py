"""`prepare data --engine openai` against a tiny in-process OpenAI-compatible server (loopback only, a bounded
number of requests): round-robin, retries with backoff, errors that are not retried, resume, counts that add up
to the input, the re-tokenised fallback. The real vLLM server: tests/test_vllm.py (slow set)."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from oracle import make_tiny_checkpoint
from specopd.data import prepare as P
from specopd.data import references as R
from specopd.engines import openai_api as O
from test_data import write_char_tokenizer

EOS = 2  # the char tokenizer's <|im_end|>
PROMPTS = [{"prompt": f"question {i}?", "id": f"q{i}"} for i in range(7)]


def fake_response(prompt: list, n: int) -> list:
    """The fake model: a deterministic function of the prompt; 'stops' (EOS) after 3 tokens on some prompts."""
    s = sum(prompt)
    out = [3 + (s * 7 + 13 * i) % 90 for i in range(n)]
    return out[:3] + [EOS] if s % 3 == 0 and n > 3 else out


class FakeServer:
    """An OpenAI-compatible /v1/models + /v1/completions on 127.0.0.1 (port 0). ``flaky[key]``: answer 503 that
    many times first; ``refuse``: keys answered 400; ``reset[key]``: drop the connection that many times;
    ``ids``: return token_ids (vLLM) or only text; at most ``max_requests`` completions (then 500)."""

    def __init__(self, tok=None, ids=True, max_requests=100):
        self.tok, self.ids, self.max_requests = tok, ids, max_requests
        self.flaky, self.reset, self.refuse = {}, {}, set()
        self.requests, self.lock = [], threading.Lock()
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._send(404, {"error": "no such path"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = tuple(body["prompt"])
                with srv.lock:
                    srv.requests.append(body)
                    n_req = len(srv.requests)
                    reset = srv.reset.get(key, 0)
                    if reset:
                        srv.reset[key] = reset - 1
                    flaky = srv.flaky.get(key, 0)
                    if flaky and not reset:
                        srv.flaky[key] = flaky - 1
                if self.path != "/v1/completions" or body.get("model") != "fake-model":
                    return self._send(404, {"error": f"bad path {self.path} or model {body.get('model')}"})
                if n_req > srv.max_requests:
                    return self._send(500, {"error": "request budget of the test server used up"})
                if reset:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if flaky:
                    return self._send(503, {"error": "overloaded, try again"})
                if key in srv.refuse:
                    return self._send(400, {"error": "prompt longer than the maximum model length"})
                resp = fake_response(list(key), int(body["max_tokens"]))
                choice = {"index": 0, "finish_reason": "stop" if resp[-1] == EOS else "length",
                          "text": srv.tok.decode(resp, skip_special_tokens=True) if srv.tok else ""}
                if srv.ids and body.get("return_token_ids"):
                    choice.update(token_ids=resp, prompt_token_ids=list(key))
                self._send(200, {"id": "cmpl-1", "object": "text_completion", "choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("oa"), vocab_size=128, num_hidden_layers=1,
                                max_position_embeddings=96, eos_token_id=EOS)
    write_char_tokenizer(path)
    return path


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(O, "BACKOFF_S", 0.01)
    monkeypatch.setattr(O, "TIMEOUT_S", 20.0)


@pytest.fixture
def servers(target_dir):
    tok = P.load_tokenizer(target_dir, 128)
    made = []

    def make(**kw):
        s = FakeServer(tok, **kw)
        made.append(s)
        return s

    yield tok, make
    for s in made:
        s.close()


def _prompt_ids(tok, pf):
    return {pid: P.encode_prompt(tok, m) for pid, m in R.read_prompts(pf)}


def _write(path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_openai_round_robin_retries_errors_and_resume(target_dir, servers, fast_retries, tmp_path):
    tok, make = servers
    a, b = make(), make()
    pf = _write(tmp_path / "p.jsonl", PROMPTS + [{"prompt": "x" * 120, "id": "long"}])
    ids = _prompt_ids(tok, pf)
    a.flaky[tuple(ids["q1"])] = 1  # 503 once on each server (the retry goes to the next one), then fine
    b.flaky[tuple(ids["q1"])] = 1
    a.reset[tuple(ids["q2"])] = b.reset[tuple(ids["q2"])] = 1  # the connection dropped (once on each server)
    a.refuse.add(tuple(ids["q3"]))  # a 400: not retried
    b.refuse.add(tuple(ids["q3"]))
    out = str(tmp_path / "out")
    kw = dict(max_new_tokens=8, temperature=0.0, seed=1, heldout_fraction=0.5, progress=False, engine="openai",
              servers=f"{a.url},{b.url}/v1/", concurrency=3)
    c = P.prepare_data(target_dir, out, pf, **kw)
    assert c == dict(written=6, skipped_done=0, skipped_too_long=1, failed=1, total_records=6)
    assert c["written"] + c["skipped_done"] + c["skipped_too_long"] + c["failed"] == len(PROMPTS) + 1
    errs = R.read_records(os.path.join(out, P.ERRORS_FILE))
    assert [e["id"] for e in errs] == ["q3"] and "HTTP 400" in errs[0]["error"] and errs[0]["attempts"] == 1
    assert [json.loads(x)["id"] for x in open(os.path.join(out, P.SKIPPED_FILE))] == ["long"]
    recs = {r["id"]: r for r in R.read_records(os.path.join(out, R.DATA_FILE))}
    for pid, r in recs.items():  # prompt ids as sent, the response as the server sampled it
        assert r["input_ids"][: r["response_start"]] == ids[pid]
        assert r["input_ids"][r["response_start"]:] == fake_response(ids[pid], 8)
        assert r["finish"] == ("eos" if fake_response(ids[pid], 8)[-1] == EOS else "length")
        assert r["split"] == R.split_of(pid, 1, 0.5) and "retokenised" not in r
    assert any(r["finish"] == "eos" for r in recs.values()) and any(r["finish"] == "length" for r in recs.values())
    # round-robin: both servers answered; q1 and q2 took 3 attempts each (failed on both servers), q3 1 (a 400 is
    # not retried), the other four 1 each
    assert a.requests and b.requests
    sent = [tuple(r["prompt"]) for r in a.requests + b.requests]
    assert sent.count(tuple(ids["q1"])) == 3 and sent.count(tuple(ids["q2"])) == 3
    assert sent.count(tuple(ids["q3"])) == 1 and len(sent) == 4 + 3 + 3 + 1
    body = a.requests[0]
    assert body["max_tokens"] == 8 and body["temperature"] == 0.0 and body["return_token_ids"] is True
    # resume: the failed prompt is sent again, nothing else; the counts still add up to the input
    a.refuse.clear()
    b.refuse.clear()
    na, nb = len(a.requests), len(b.requests)
    c2 = P.prepare_data(target_dir, out, pf, **kw)
    assert c2 == dict(written=1, skipped_done=6, skipped_too_long=1, failed=0, total_records=7)
    assert [tuple(r["prompt"]) for r in a.requests[na:] + b.requests[nb:]] == [tuple(ids["q3"])]
    assert R.read_records(os.path.join(out, P.ERRORS_FILE)) == []
    assert sorted(r["id"] for r in R.read_records(os.path.join(out, R.DATA_FILE))) == sorted(ids.keys() - {"long"})
    # a third run has nothing to send
    n_before = len(a.requests) + len(b.requests)
    assert P.prepare_data(target_dir, out, pf, **kw)["skipped_done"] == 7
    assert len(a.requests) + len(b.requests) == n_before


def test_openai_retries_give_up_and_a_dead_server_is_dropped(target_dir, servers, fast_retries, tmp_path, capsys):
    tok, make = servers
    a = make(max_requests=20)
    pf = _write(tmp_path / "p.jsonl", PROMPTS[:3])
    ids = _prompt_ids(tok, pf)
    a.flaky[tuple(ids["q0"])] = 99  # always 503: 1 + RETRIES attempts, then an error line
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    c = P.prepare_data(target_dir, str(tmp_path / "o"), pf, max_new_tokens=4, temperature=1.0, progress=False,
                       engine="openai", servers=f"{dead},{a.url}", concurrency=2)
    assert c == dict(written=2, skipped_done=0, skipped_too_long=0, failed=1, total_records=2)
    errs = R.read_records(os.path.join(str(tmp_path / "o"), P.ERRORS_FILE))
    assert errs[0]["id"] == "q0" and errs[0]["attempts"] == O.RETRIES + 1 and "HTTP 503" in errs[0]["error"]
    assert len(a.requests) == O.RETRIES + 1 + 2
    assert f"not using {dead}" in capsys.readouterr().out
    assert all(r["temperature"] == 1.0 and isinstance(r["seed"], int) for r in a.requests)
    # no server at all: a clear error that says how to start one
    with pytest.raises(RuntimeError, match="no server answered.*vllm.entrypoints.openai.api_server"):
        P.prepare_data(target_dir, str(tmp_path / "o2"), pf, max_new_tokens=4, progress=False, engine="openai",
                       servers=dead)
    with pytest.raises(ValueError, match="--engine openai needs --server"):
        P.prepare_data(target_dir, str(tmp_path / "o3"), pf, progress=False, engine="openai")


def test_openai_without_token_ids_retokenises_and_says_so(target_dir, servers, fast_retries, tmp_path, capsys):
    tok, make = servers
    a = make(ids=False)
    pf = _write(tmp_path / "p.jsonl", PROMPTS)
    ids = _prompt_ids(tok, pf)
    out = str(tmp_path / "o")
    c = P.prepare_data(target_dir, out, pf, max_new_tokens=6, temperature=0.0, progress=False, engine="openai",
                       servers=a.url, concurrency=4)
    assert c["written"] == len(PROMPTS) and c["failed"] == 0
    assert "re-tokenised" in capsys.readouterr().out
    for r in R.read_records(os.path.join(out, R.DATA_FILE)):
        assert r["retokenised"] is True
        # the char tokenizer round-trips, and the EOS the text drops is put back
        assert r["input_ids"][r["response_start"]:] == fake_response(ids[r["id"]], 6)


def test_openai_server_that_changes_the_prompt_is_an_error(target_dir, tmp_path):
    tok = P.load_tokenizer(target_dir, 128)
    with pytest.raises(O.RequestFailed, match="other prompt ids") as e:
        O.completion_ids({"finish_reason": "length", "token_ids": [5], "prompt_token_ids": [1, 9]}, [9], tok, {EOS})
    assert not e.value.retry
    with pytest.raises(O.RequestFailed, match="finish_reason"):
        O.completion_ids({"finish_reason": "abort", "token_ids": [5]}, [9], tok, {EOS})
    assert O.parse_servers(" a:1/ ,http://b:2/v1") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="give one or more URLs"):
        O.parse_servers(" , ")
