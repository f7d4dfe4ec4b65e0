"""Inputs that change quietly and data rules said out loud: a conversations file is fingerprinted (with the tokenizer
that tokenises it), an edit in place that keeps size and mtime (``touch -r``) is still a change, unknown ``split``
values and empty recipes are refused with the fix, a byte-order mark is read as nothing, a pretty-printed JSON array
in a .jsonl file is read and named, messages offer only fixes that work, folders given as files are named as
folders, a cache of another structure is rebuilt, and every metrics sink's folder is checked before a resume (and
``--dry-run`` checks what the run checks)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from specopd.cli import main
from specopd.config import RecipeError, load_recipe
from specopd.data import formats as F
from specopd.data.prepare import load_tokenizer
from specopd.data.references import read_prompts
from specopd.errors import BadInputError
from specopd.train.checkpointer import RecipeChangeError
from specopd.train.data import read_prepared
from specopd.train.inputs import input_changes, input_fingerprints
from specopd.train.loop import train
from specopd.train.metrics import check_sink_folders
from test_data import char_target
from tiny_runs import TINY_TEST_OVERRIDES, tiny_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
BOM = b"\xef\xbb\xbf"
CONV = [{"id": f"c{i}", "conversations": [{"role": "user", "content": f"hi {i}"},
                                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(4)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return char_target(tmp_path_factory.mktemp("rules"))


def _jsonl(path, recs, prefix=b""):
    path.write_bytes(prefix + "".join(json.dumps(r) + "\n" for r in recs).encode())
    return str(path)


# ---------------------------------------------------------------------------------------------- data rules
def test_an_unknown_split_is_refused_naming_the_values(tmp_path):
    recs = CONV[:2] + [dict(CONV[2], split="test"), dict(CONV[3], split="heldout")]
    p = _jsonl(tmp_path / "c.jsonl", recs)
    with pytest.raises(F.DataError, match=r"c.jsonl:3: 'split' is 'test'; records may say 'train' or 'heldout'.*"
                                          r"data.bad_lines=skip"):
        F.read_conversations(p)
    st: dict = {}
    got = F.read_conversations(p, "skip", st)
    assert [r[1] for r in got] == ["c0", "c1", "c3"] and got[2][3] == "heldout" and st["bad"] == {"unknown_split": 1}
    prepared = _jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(3, 13)), "prompt_len": 2, "split": "test"}])
    with pytest.raises(BadInputError, match=r"d.jsonl:1: 'split' is \"test\"; records may say 'train' or 'heldout'"):
        read_prepared(prepared, 16)


def test_a_byte_order_mark_is_read_as_nothing(tmp_path):
    plain = F.read_conversations(_jsonl(tmp_path / "a.jsonl", CONV))
    assert [r[1:] for r in F.read_conversations(_jsonl(tmp_path / "b.jsonl", CONV, BOM))] == [r[1:] for r in plain]
    js = tmp_path / "c.json"
    js.write_bytes(BOM + json.dumps(CONV, indent=1).encode())
    assert [r[1:] for r in F.read_conversations(str(js))] == [r[1:] for r in plain]
    pf = tmp_path / "p.jsonl"
    pf.write_bytes(BOM + b'{"id": "x", "prompt": "hello"}\n')
    assert read_prompts(str(pf)) == [("x", [{"role": "user", "content": "hello"}])]


def test_a_pretty_printed_array_in_a_jsonl_file_is_read_and_named(tmp_path, capsys):
    p = tmp_path / "pretty.jsonl"
    p.write_text(json.dumps(CONV, indent=2))
    got = F.read_conversations(str(p))
    assert [r[1] for r in got] == ["c0", "c1", "c2", "c3"]
    assert "pretty.jsonl holds one JSON array" in capsys.readouterr().err
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(json.dumps([{"id": "a", "prompt": "hi"}, {"prompt": "there"}], indent=2))
    assert read_prompts(str(pf)) == [("a", [{"role": "user", "content": "hi"}]),
                                     ("line2", [{"role": "user", "content": "there"}])]
    assert "prompts.jsonl holds one JSON array" in capsys.readouterr().err
    q = _jsonl(tmp_path / "arrays.jsonl", [[1, 2], [3]])  # one array a line: JSONL whose records are not objects
    with pytest.raises(F.DataError, match="arrays.jsonl:1: expected a JSON object"):
        F.read_conversations(q)


def test_messages_offer_only_fixes_that_work(target_dir, tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"conversations": []}, {"x": ]')
    with pytest.raises(F.DataError) as e:  # a .json document cannot be read past a syntax error: skip won't help
        F.read_conversations(str(bad_json), "skip")
    assert "bad_lines=skip" not in str(e.value) and "fix the file" in str(e.value)
    base = ["prepare", "data", "--target", target_dir, "--out"]
    assert main(base + [str(tmp_path / "o1"), "--from", str(bad_json), "--bad-lines", "skip"]) == 2
    err = capsys.readouterr().err
    assert "bad.json:1: not valid JSON" in err and "--bad-lines skip" not in err and "data.bad_lines" not in err
    bad_jsonl = _jsonl(tmp_path / "bad.jsonl", CONV[:1] + [{"conversations": []}])
    assert main(base + [str(tmp_path / "o2"), "--from", bad_jsonl]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: the conversation is empty" in err and "pass --bad-lines skip" in err
    assert "data.bad_lines" not in err  # prepare data's own option, not the recipe key
    folder = tmp_path / "chats"
    folder.mkdir()
    assert main(base + [str(tmp_path / "o3"), "--from", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"conversations file '{folder}' is a folder" in err and "does not exist" not in err


def test_a_cache_of_another_structure_is_rebuilt(target_dir, tmp_path):
    tok = load_tokenizer(target_dir, 128)
    p = _jsonl(tmp_path / "c.jsonl", CONV)
    first = F.build_cache(p, tok, target_dir, str(tmp_path / "run"))
    assert first["hit"] is False and os.path.isfile(first["path"])
    for junk in ([("x", "ok", "c0")], {"a": 1}, [("x", "ok", "c0", None, torch.zeros(3), torch.zeros(2))]):
        assert not F.cache_items_ok(junk)
        torch.save(junk, first["path"])
        assert F.build_cache(p, tok, target_dir, str(tmp_path / "run"))["hit"] is False  # rebuilt, not unpacked
    assert F.build_cache(p, tok, target_dir, str(tmp_path / "run"))["hit"] is True
    samples = F.conversation_samples(p, tok, target_dir, str(tmp_path / "run"), 64, 96)
    assert [s["id"] for s in samples] == ["c0", "c1", "c2", "c3"]


def test_an_empty_recipe_is_refused(tmp_path, capsys):
    for text in ("", "# only a comment\n"):
        r = tmp_path / "empty.yaml"
        r.write_text(text)
        with pytest.raises(RecipeError, match="is empty"):
            load_recipe(str(r))
        assert main(["train", str(r), "--dry-run"]) == 2
        assert "is empty (no keys)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- fingerprints
def test_a_conversations_file_is_fingerprinted_with_its_tokenizer(target_dir, tmp_path):
    p = tmp_path / "c.jsonl"
    _jsonl(p, CONV)
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_recipe(None, ["data.source=conversations", f"data.path={p}", f"model.target={target_dir}",
                             f"trainer.output_dir={out}"])
    a = input_fingerprints(cfg)
    assert a["data"]["path"] == str(p) and a["data"]["source"] == "conversations"
    assert len(a["data"]["sha256"]) == 64 and len(a["data"]["tokenizer"]) == 64
    assert input_changes(a, input_fingerprints(cfg)) == []
    _jsonl(p, CONV[:3])
    changes = input_changes(a, input_fingerprints(cfg))
    assert len(changes) == 1 and "c.jsonl changed since the checkpoint (sha256 of the file" in changes[0]
    _jsonl(p, CONV)
    tj = os.path.join(target_dir, "tokenizer_config.json")
    orig = open(tj).read()
    try:  # the same conversations through another tokenizer config: other tokens
        cfg_json = json.loads(orig)
        cfg_json["model_max_length"] = 12345
        open(tj, "w").write(json.dumps(cfg_json))
        changes = input_changes(a, input_fingerprints(cfg))
        assert len(changes) == 1 and "the target's tokenizer changed" in changes[0]
    finally:
        open(tj, "w").write(orig)


def _prepared(path, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    recs = [{"input_ids": torch.randint(10, 90, (20,), generator=g).tolist(), "prompt_len": 4} for _ in range(n)]
    _jsonl(path, recs)


def _edit_in_place_keeping_size_and_mtime(path):
    """Swap two digits of the first record (same size), then set the mtime back, as ``touch -r`` does."""
    st = os.stat(path)
    raw = bytearray(open(path, "rb").read())
    i = next(k for k in range(len(raw) - 1) if chr(raw[k]).isdigit() and chr(raw[k + 1]).isdigit()
             and raw[k] != raw[k + 1])
    raw[i], raw[i + 1] = raw[i + 1], raw[i]
    with open(path, "r+b") as f:
        f.write(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_an_edit_that_keeps_size_and_mtime_is_still_a_change(tmp_path):
    data = tmp_path / "d.jsonl"
    _prepared(data, 32)
    out = tmp_path / "run"
    prep = ["data.source=prepared", f"data.path={data}", "trainer.eval_heldout=false"]
    train(tiny_recipe(str(out), [*prep, "trainer.max_steps=2"]), progress=False)
    _edit_in_place_keeping_size_and_mtime(data)
    with pytest.raises(RecipeChangeError, match=r"d.jsonl changed since the checkpoint \(the same 32 records, other "
                                                r"content or order"):
        train(tiny_recipe(str(out), [*prep, "trainer.max_steps=3"]), progress=False)


def test_data_edited_while_the_workers_read_it_is_refused(tmp_path, monkeypatch):
    """A checkpoint records the hash of the data the workers read: the inputs are fingerprinted before the
    workers start and again after they loaded them; an edit in between stops the run before its first step."""
    import specopd.train.loop as loop

    data = tmp_path / "d.jsonl"
    _prepared(data, 32)
    start = loop.make_group

    def edit_then_start(cfg):
        group = start(cfg)
        _prepared(data, 32, seed=1)  # after the workers read it, before its hash is recorded
        return group

    monkeypatch.setattr(loop, "make_group", edit_then_start)
    out = tmp_path / "run"
    prep = ["data.source=prepared", f"data.path={data}", "trainer.eval_heldout=false", "trainer.max_steps=2"]
    with pytest.raises(BadInputError, match=r"inputs changed while its workers read them: the data .*d.jsonl changed "
                                            r"\(the same 32 records, other content or order"):
        train(tiny_recipe(str(out), prep), progress=False)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


# ---------------------------------------------------------------------------------------------- metrics sinks
def test_a_metrics_folder_that_is_a_file_is_named_before_a_resume(tmp_path, capsys):
    out = tmp_path / "run"
    args = TINY_TEST_OVERRIDES + ["model.target=tiny:llama", f"trainer.output_dir={out}", "trainer.eval_heldout=false",
                                  "trainer.loggers=[jsonl,tensorboard]", "trainer.save_every=2"]
    assert main(["train", RECIPE, *args, "trainer.max_steps=2"]) == 0
    tb = out / "tensorboard"
    assert tb.is_dir()
    os.rename(tb, out / "tb-events")
    tb.write_text("not a folder")
    cfg = tiny_recipe(str(out), ["trainer.loggers=[jsonl,tensorboard]"])
    check_sink_folders(cfg, resuming=False)  # a fresh run moves it aside: nothing to refuse
    with pytest.raises(BadInputError, match="tensorboard, which writes .*tensorboard, but that is a file"):
        check_sink_folders(cfg, resuming=True)
    capsys.readouterr()
    before = open(out / "metrics.jsonl").read()
    assert main(["train", RECIPE, *args, "trainer.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "remove tensorboard from trainer.loggers" in err
    assert open(out / "metrics.jsonl").read() == before and tb.read_text() == "not a folder"
    cfg = tiny_recipe(str(out), ["trainer.loggers=[jsonl,mlflow]"])
    (out / "mlruns").write_text("x")
    with pytest.raises(BadInputError, match="mlflow, which writes .*mlruns, but that is a file"):
        check_sink_folders(cfg, resuming=False)  # mlflow's store is not moved aside by a fresh run


def test_dry_run_checks_what_the_run_checks(tmp_path, capsys):
    folder = tmp_path / "chats"
    folder.mkdir()
    out = tmp_path / "o"
    base = ["train", RECIPE, f"trainer.output_dir={out}"]
    assert main(base + ["data.source=conversations", f"data.path={folder}", "--dry-run"]) == 2
    assert f"conversations file '{folder}' is a folder" in capsys.readouterr().err
    empty = tmp_path / "prepared"
    empty.mkdir()
    assert main(base + ["data.source=prepared", f"data.path={empty}", "--dry-run"]) == 2
    assert "is a folder without data.jsonl" in capsys.readouterr().err
    if importlib.util.find_spec("mlflow") is None:
        assert main(base + ["trainer.loggers=[jsonl,mlflow]", "--dry-run"]) == 2
        assert "the mlflow package is not installed" in capsys.readouterr().err
    assert not out.exists()
