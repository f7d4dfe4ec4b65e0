"""The main job end to end on a tiny target with a character tokenizer: stages, checkpoints, T=0 / T=1 table."""
from __future__ import annotations

import json
import os

import pytest

from oracle import make_tiny_checkpoint
from test_data import write_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_writes_warm_and_final_checkpoints_and_both_temperatures(tmp_path, monkeypatch, capsys):
    from specopd.config import load_recipe
    from specopd.mainjob import run

    monkeypatch.setenv("SPECOPD_CACHE", str(tmp_path / "cache"))
    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1,
                                      max_position_embeddings=256, eos_token_id=2)
    write_char_tokenizer(target_dir)
    out = tmp_path / "run"
    cfg = load_recipe(os.path.join(ROOT, "recipes", "smollm2-135m-dflash.yaml"), [
        f"model.target={target_dir}", f"trainer.output_dir={out}", f"data.path={out}/data/train.jsonl",
        "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false", "data.batch_size=2",
        "pipeline.data_num=4", "pipeline.data_max_new_tokens=12", "pipeline.warmup_steps=2",
        "trainer.max_steps=2", "trainer.save_every=0", "trainer.anchors_per_seq=2", "eval.prompts=2",
        "eval.max_new_tokens=4", "drafter.block_size=3", "drafter.feature_layers=[0]"])
    res = run(cfg, progress=False)
    assert os.path.isfile(out / "warmup" / "checkpoints" / "step-2" / "model.safetensors")
    assert os.path.isfile(out / "checkpoints" / "step-2" / "model.safetensors")
    assert res["warm_checkpoint"].endswith(os.path.join("warmup", "checkpoints", "step-2"))
    assert res["final_checkpoint"].endswith(os.path.join("run", "checkpoints", "step-2"))
    assert [r["checkpoint"] for r in res["table"]] == [res["warm_checkpoint"], res["final_checkpoint"]]
    for r in res["table"]:
        assert sorted(r["by_temperature"]) == ["0", "1"]
        assert all(x["mean_al"] >= 1.0 and x["rounds"] > 0 for x in r["by_temperature"].values())
    text = capsys.readouterr().out
    assert "AL T=0" in text and "AL T=1" in text and "incl. the bonus" in text
    # the trainer's data: the references of distinct *train* prompts only
    from specopd.data.references import split_of

    recs = [json.loads(line) for line in open(out / "data" / "train.jsonl")]
    assert len(recs) == 4 and all(split_of(r["id"], 0, 0.1) == "train" for r in recs)
    saved = json.loads(open(out / "mainjob_summary.json").read())
    assert saved["eval_temperatures"] == [0.0, 1.0] and saved["al_includes_bonus"]
    # a second run reuses the references and the warm drafter
    res2 = run(cfg, progress=False)
    assert res2["warm_checkpoint"] == res["warm_checkpoint"]
    assert "references cached" in capsys.readouterr().out
