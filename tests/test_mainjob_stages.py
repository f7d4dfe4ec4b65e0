"""The main job's stages: each takes only its own sections and hands the next a ``Prepared`` (paths, never the
recipe)."""
from __future__ import annotations

import copy
import os

import pytest

from oracle import make_tiny_checkpoint
from tiny_runs import tiny_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_training_stages_take_a_plain_recipe_and_the_hand_off(tmp_path):
    """stage_cfg: the training recipe (pipeline off, the main recipe untouched) on the hand-off's target, data and
    starting drafter; the warm-up stage without warm-up steps hands on drafter.init_from (or a fresh drafter)."""
    from specopd.mainjob import Prepared, stage_cfg, training_recipe, warmup_stage

    cfg = tiny_recipe(str(tmp_path / "run"), ["pipeline.enabled=true", "pipeline.warmup_steps=0"])
    before = copy.deepcopy(cfg)
    prep = Prepared(str(tmp_path / "target"), "refs", str(tmp_path / "data.jsonl"), str(tmp_path / "warm"))
    c = stage_cfg(training_recipe(cfg), prep, max_steps=7)
    assert not c.pipeline.enabled and c.pipeline.warmup_steps == 0  # inert, recorded as the job had it
    assert (c.model.target, c.data.path, c.drafter.init_from) == (prep.target_dir, prep.train_data, prep.warm)
    assert c.trainer.max_steps == 7 and cfg == before  # the main recipe is not changed
    with pytest.raises(KeyError, match="trainer has no key"):
        stage_cfg(cfg, prep, no_such_key=1)
    # no warm-up: the starting drafter is drafter.init_from, else a fresh one (nothing is trained either way)
    run = training_recipe(cfg)
    run.drafter.init_from = str(tmp_path / "shipped")
    assert warmup_stage(run, cfg.pipeline, prep, progress=False) == str(tmp_path / "shipped")
    run.drafter.init_from = None
    assert warmup_stage(run, cfg.pipeline, prep, progress=False) is None
    assert not os.path.exists(tmp_path / "run")


def test_target_and_references_stages_take_their_sections(tmp_path, monkeypatch):
    """target_stage takes the model section, references_stage the pipeline, model, data and kernels sections: a
    conversations file is handed on as it is (nothing decoded, nothing written)."""
    import shutil

    from specopd.mainjob import references_stage, target_stage

    cfg = tiny_recipe(str(tmp_path / "run"))
    folder = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=64, num_hidden_layers=1)
    cfg.model.target = str(folder)
    assert target_stage(cfg.model) == str(folder)
    cfg.model.target = "no-such-target"
    with pytest.raises(FileNotFoundError, match="model.target='no-such-target'"):
        target_stage(cfg.model)
    data = tmp_path / "sg.json"
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "conversations", "sharegpt_multiturn.json"), data)
    cfg.data.source, cfg.data.path = "conversations", str(data)
    ref, n, tokens = references_stage(cfg.pipeline, cfg.model, cfg.data, cfg.kernels, "unused: nothing is decoded")
    assert (ref, n, tokens) == (str(data), 0, None)
    assert sorted(os.listdir(tmp_path)) == ["sg.json", "t"]
