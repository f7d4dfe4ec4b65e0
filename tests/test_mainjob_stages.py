"""The main job's stages: each takes only its own sections and hands the next a ``Prepared`` (paths, never the
recipe); the evaluation decodes our side while vLLM's process runs, with the numbers of one after the other."""
from __future__ import annotations

import copy
import json
import os
import threading

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


def _judge_setup(tmp_path, monkeypatch):
    """A tiny target, two drafter checkpoints and a stand-in for vLLM's process (deterministic counters) that
    records whether our side decoded while it ran."""
    import torch

    import specopd.eval.engine as engine
    from specopd.drafters import build_drafter, export_drafter
    from specopd.models import load_target
    from test_data import write_char_tokenizer

    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1,
                                      max_position_embeddings=256, eos_token_id=2)
    write_char_tokenizer(target_dir)
    target = load_target(target_dir)
    paths = []
    for seed in (0, 1):
        d = build_drafter("dflash", target, num_layers=1, block_size=3, seed=seed, feature_layers=[0])
        paths.append(export_drafter(d, str(tmp_path / f"drafter-{seed}")))
    cfg = tiny_recipe(str(tmp_path / "run"), [f"model.target={target_dir}", "drafter.block_size=3",
                                              "drafter.feature_layers=[0]", "eval.prompts=2",
                                              "eval.max_new_tokens=5", "pipeline.eval_temperatures=[0.0,1.0]"])
    seen = {"ours_started": threading.Event()}
    real_greedy = engine.greedy_continuations

    def greedy(*a, **kw):
        seen["ours_started"].set()
        return real_greedy(*a, **kw)

    def fake_vllm(target_dir, exports, prompts, max_new_tokens, temps, stops, dtype, seed=0, work_dir=None):
        seen["vllm_first"] = not seen["ours_started"].is_set()
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["overlap"] = seen["vllm_first"] and seen["ours_started"].wait(timeout=30)  # ours starts meanwhile
        g = torch.Generator().manual_seed(len(prompts))
        return [{"num_speculative_tokens": 2, "patched": [], "runs": [
            {"temperature": t, "tokens_per_s": 1.0, "wall_s": 1.0,
             "counters": {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": int(a),
                          "accepted_per_pos": [int(a), 0]},
             "outputs": [{"token_ids": [], "finish": "length", "steps": None} for _ in prompts]}
            for t, a in zip(temps, torch.randint(0, 10, (len(temps),), generator=g))]} for _ in exports]

    monkeypatch.setenv("SPECOPD_VLLM_JUDGE", "1")
    monkeypatch.setattr(engine, "vllm_missing_reason", lambda: None)
    monkeypatch.setattr(engine, "greedy_continuations", greedy)
    monkeypatch.setattr(engine, "run_judge_drafters", fake_vllm)
    return cfg, target_dir, [("before", paths[0]), ("after", paths[1])], seen


def _judge(cfg, target_dir, rows, concurrent):
    """judge_rows given the recipe's sections as the main job gives them."""
    from specopd.eval.engine import judge_rows

    return judge_rows(cfg.eval, cfg.pipeline.eval_temperatures, cfg.model, cfg.kernels, target_dir, rows,
                      cfg.trainer.output_dir, progress=False, concurrent=concurrent)


def _numbers(rows):
    return [(r["drafter"], r["checkpoint"], {t: {k: v for k, v in x.items() if k != "times"}
                                             for t, x in r["by_temperature"].items()}) for r in rows]


def test_judge_rows_decode_ours_beside_vllm_with_the_same_numbers(tmp_path, monkeypatch):
    """judge_rows: our side (greedy continuations, ours on vLLM's schedule at T=0 and T=1) decodes while vLLM's
    process runs, and every number equals the one-after-the-other run's."""
    cfg, target_dir, rows, seen = _judge_setup(tmp_path, monkeypatch)
    alone = _judge(cfg, target_dir, rows, concurrent=False)
    assert (seen["vllm_first"], seen["thread"]) == (False, False)  # one after the other, in this thread
    seen["ours_started"].clear()
    beside = _judge(cfg, target_dir, rows, concurrent=True)
    assert (seen["vllm_first"], seen["thread"], seen["overlap"]) == (True, True, True)  # ours began beside it
    assert [r["drafter"] for r in alone] == ["before | vLLM", "before | ours, vLLM's schedule", "after | vLLM",
                                             "after | ours, vLLM's schedule"]
    assert _numbers(beside) == _numbers(alone)
    ours = [r for r in alone if r["engine"] == "ours"]
    assert all(r["by_temperature"][t]["rounds"] > 0 for r in ours for t in ("0", "1"))
    assert ours[0]["by_temperature"]["1"] != ours[1]["by_temperature"]["1"]  # two drafters, two results


def test_judge_rows_greedy_continuations_serve_the_longest_drafting_drafter(tmp_path, monkeypatch):
    """Drafters of different W judged together (a DFlash of block 3 beside one of block 5): the shared greedy
    continuations are long enough for the longer one's T = 0 replay, whatever the recipe's block_size says."""
    import specopd.eval.engine as engine
    from specopd.drafters import build_drafter, export_drafter
    from specopd.models import load_target

    cfg, target_dir, rows, _ = _judge_setup(tmp_path, monkeypatch)
    longer = export_drafter(build_drafter("dflash", load_target(target_dir), num_layers=1, block_size=5, seed=2,
                                          feature_layers=[0]), str(tmp_path / "drafter-w4"))
    asked, real = [], engine.greedy_continuations

    def greedy(target, prompts, num_tokens, **kw):
        asked.append(num_tokens)
        return real(target, prompts, num_tokens, **kw)

    fake = engine.run_judge_drafters

    def per_drafter_k(target_dir, exports, *a, **kw):  # the stand-in's counters at each export's own k
        res = fake(target_dir, exports, *a, **kw)
        for r, e in zip(res, exports):
            with open(os.path.join(e, "config.json")) as f:
                k = json.load(f)["block_size"] - 1
            r["num_speculative_tokens"] = k
            for run in r["runs"]:
                run["counters"]["accepted_per_pos"] += [0] * (k - 2)
        return res

    monkeypatch.setattr(engine, "greedy_continuations", greedy)
    monkeypatch.setattr(engine, "run_judge_drafters", per_drafter_k)
    out = _judge(cfg, target_dir, [rows[0], ("longer", longer)], concurrent=False)
    assert asked == [cfg.eval.max_new_tokens + 4]  # the block-5 drafter's 4 drafts, not the recipe's 2
    ours = {r["drafter"]: r for r in out if r["engine"] == "ours"}
    assert set(ours) == {"before | ours, vLLM's schedule", "longer | ours, vLLM's schedule"}
    assert ours["longer | ours, vLLM's schedule"]["by_temperature"]["0"]["rounds"] > 0


def test_judge_rows_a_failed_vllm_process_leaves_the_rows_to_ours(tmp_path, monkeypatch, capsys):
    """vLLM's process fails while our side decodes: the job goes on without the vLLM rows, saying why."""
    import specopd.eval.engine as engine

    cfg, target_dir, rows, _ = _judge_setup(tmp_path, monkeypatch)

    def broken(*a, **kw):
        raise engine.EngineUnavailable("the stand-in vLLM died")

    monkeypatch.setattr(engine, "run_judge_drafters", broken)
    assert _judge(cfg, target_dir, rows, concurrent=True) == []
    assert "vLLM judge failed: the stand-in vLLM died" in capsys.readouterr().out


def test_evaluation_stage_takes_its_sections_and_builds_the_untrained_row(tmp_path, monkeypatch):
    """evaluate_rows takes the eval, model and kernels sections (no recipe): an untrained row is the drafter
    section's drafter at the recipe's seed, numbers equal to that drafter saved and loaded from its folder; without
    a drafter section such a row is refused."""
    from specopd.drafters import build_drafter, export_drafter
    from specopd.mainjob import evaluate_rows
    from specopd.models import load_target

    cfg, target_dir, rows, _ = _judge_setup(tmp_path, monkeypatch)
    d = cfg.drafter
    fresh = build_drafter(d.kind, load_target(target_dir), num_layers=d.num_layers, block_size=d.block_size,
                          seed=cfg.seed, feature_layers=d.feature_layers, mask_token_id=d.mask_token_id,
                          target_dir=target_dir, **dict(d.architecture))
    saved = export_drafter(fresh, str(tmp_path / "fresh"))
    sections = (cfg.eval, cfg.pipeline.eval_temperatures, cfg.model, cfg.kernels, target_dir)
    got = evaluate_rows(*sections, [("untrained", None), ("saved", saved), rows[1]], d, cfg.seed, progress=False)
    assert [r["drafter"] for r in got] == ["untrained", "saved", "after"]
    counts = [{t: {k: v for k, v in x.items() if k not in ("times", "spec_tokens_per_s")}
               for t, x in r["by_temperature"].items()} for r in got]
    assert counts[0] == counts[1]  # the same drafter, the same numbers
    assert got[0]["by_temperature"]["1"] != got[2]["by_temperature"]["1"]
    assert all(r["by_temperature"][t]["rounds"] > 0 for r in got for t in ("0", "1"))
    with pytest.raises(ValueError, match="row 'untrained' has no checkpoint and no drafter section"):
        evaluate_rows(*sections, [("untrained", None)], progress=False)


def test_specopd_eval_with_vllm_unpacks_its_recipe_at_the_edge(tmp_path, monkeypatch):
    """``specopd eval --engine vllm``: main_eval hands the judge the eval section and trainer.output_dir (its work
    folder <output_dir>/vllm-judge/eval), not the recipe; the untrained drafter is exported there first."""
    import specopd.eval.engine as engine
    from specopd.eval.cli import main_eval

    cfg = tiny_recipe(str(tmp_path / "run"), ["eval.checkpoint=none", "eval.prompts=2", "eval.max_new_tokens=3",
                                              "eval.seed=5"])
    seen = {}

    def fake_judge(target_dir, path, prompts, max_new_tokens, temps, stops, dtype, seed=0, work_dir=None, **kw):
        seen.update(path=path, n=len(prompts), max_new_tokens=max_new_tokens, seed=seed, work_dir=work_dir)
        return {"problems": []}

    monkeypatch.setattr(engine, "vllm_missing_reason", lambda: None)
    monkeypatch.setattr(engine, "judge", fake_judge)
    monkeypatch.setattr(engine, "format_judge", lambda rep, title="": title)
    assert main_eval(cfg, ["--engine", "vllm"], judge=engine.eval_with_vllm) == {"problems": []}
    work = os.path.join(str(tmp_path / "run"), "vllm-judge", "eval")
    assert seen == {"path": os.path.join(work, "untrained-export"), "n": 2, "max_new_tokens": 3, "seed": 5,
                    "work_dir": work}


def test_the_recipe_does_not_reach_the_evaluation_stage():
    """benchmarks/config_walk.py (run as a user runs it): no function of specopd.eval.engine receives the whole
    recipe, and its walk from specopd.mainjob.run reaches the training stages but never the evaluation."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "config_walk.py"), "--list"], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    receives = [ln for ln in out.splitlines() if ln.strip().startswith("receives:")]
    passes = [ln.split("->")[1].strip() for ln in out.splitlines() if ln.strip().startswith("passes:")]
    assert "specopd.mainjob.train_stage" in passes and "specopd.train.loop.train" in passes  # the walk walks
    assert any("specopd.mainjob:" in ln and "run(cfg)" in ln for ln in receives)
    assert not [ln for ln in receives if "specopd.eval.engine:" in ln or "evaluate_rows" in ln]
    assert not [p for p in passes if p.startswith("specopd.eval.") or p.endswith(("evaluate_rows", "judge_rows"))]
