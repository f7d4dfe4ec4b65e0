"""Drafters compared by vLLM's counters (``specopd.eval.compare``): per-prompt accept lengths from vLLM's verify
steps, paired differences, the equal-time step conversion and the nearest kept checkpoint of
``benchmarks/bench_eagle3_dflash.py``, the table; the judge's work folders when two runs' checkpoints share a name;
``specopd train --dry-run`` of a recipe whose shipped drafter is not made yet; ``bench_al.py --judge vllm``
without vLLM (exit 2, the fix named) and, in the slow set with vLLM, end to end on a tiny target."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specopd.eval.cli import al_diff_stderr, al_stderr
from specopd.eval.compare import (equal_time_steps, judged_entries, lengths_result, nearest_checkpoint, paired_diff,
                                  paired_table)
from specopd.eval.engine import steps_accept_lengths, work_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_AL = os.path.join(ROOT, "benchmarks", "bench_al.py")
META = [{"id": i, "category": c} for i, c in enumerate(["writing", "writing", "math", "math"])]


def test_equal_time_steps_converts_by_the_step_cost_ratio():
    assert equal_time_steps(600, 2.0, 3.0) == pytest.approx(400.0)  # a dearer step: fewer steps in the same time
    assert equal_time_steps(600, 3.0, 1.5) == pytest.approx(1200.0)
    for bad in ((600, 0.0, 1.0), (600, 1.0, -1.0), (600, float("nan"), 1.0)):
        with pytest.raises(ValueError, match="positive and finite"):
            equal_time_steps(*bad)


def test_nearest_checkpoint_says_how_far_and_breaks_ties_to_the_earlier_step():
    kept = [(s, f"step-{s}") for s in (150, 200, 250, 286, 300, 350)]
    assert nearest_checkpoint(kept, 290.4) == (286, "step-286", pytest.approx(-4.4))
    assert nearest_checkpoint(kept, 225) == (200, "step-200", -25)  # 200 and 250 equally far: the less trained
    assert nearest_checkpoint(kept, 5000) == (350, "step-350", -4650)
    with pytest.raises(ValueError):
        nearest_checkpoint([], 10)


def test_lengths_result_from_vllm_steps_counts_positions_and_categories():
    outputs = [{"steps": {"accepted": [0, 2, 1]}}, {"steps": {"accepted": [3]}},
               {"steps": {"accepted": [0, 0]}}, {"steps": {"accepted": [1, 1]}}]
    lengths = steps_accept_lengths(outputs)
    assert lengths == [[1, 3, 2], [4], [1, 1], [2, 2]]
    r = lengths_result(lengths, 3, META)
    assert r["mean_al"] == pytest.approx(16 / 8) and r["rounds"] == 8
    assert r["accepted_at"] == [5, 2, 1] and r["reached_at"] == [8, 5, 2]  # a step accepting a drafts reached a+1
    assert r["se"] == pytest.approx(al_stderr(lengths))
    assert r["by_category"]["writing"]["al"] == pytest.approx(10 / 4)
    assert r["by_category"]["math"]["al"] == pytest.approx(6 / 4)
    with pytest.raises(ValueError, match="1..3"):
        lengths_result([[5]], 2)  # 5 tokens in one round cannot come from k = 2


def test_paired_diff_and_table_from_vllm_accept_lengths():
    a = [[3, 3, 2], [4, 1], [2, 2, 2], [3, 1]]
    b = [[2, 1, 1], [2, 1], [1, 2, 1], [2, 1, 1]]
    d, se = paired_diff(a, b)
    assert d == pytest.approx(23 / 10 - 15 / 11) and se == pytest.approx(al_diff_stderr(a, b)) and se > 0
    rows = [{"label": "DFlash", "k": 4, "by_temperature": {"0": lengths_result(b, 4)}},
            {"label": "EAGLE-3", "k": 7, "by_temperature": {"0": lengths_result(a, 7)}},
            {"label": "EAGLE-3 same", "k": 4, "by_temperature": {"0": lengths_result(b, 4)}}]
    lines, diffs = paired_table(rows, [0.0])
    assert lines[0].startswith("drafter") and "AL T=0 +- SE" in lines[0]
    assert f"{15 / 11:.3f} +- {al_stderr(b):.3f}" in lines[1] and f"{2.3:.3f}" in lines[2]
    assert [x["label"] for x in diffs] == ["EAGLE-3", "EAGLE-3 same"]
    assert diffs[0]["diff"] == pytest.approx(d) and diffs[0]["se"] == pytest.approx(se)
    assert abs(d) > 2 * se and diffs[0]["beyond_2se"] and lines[5].endswith(f"{d:+.3f} +- {se:.3f}*")
    assert diffs[1]["diff"] == 0 and not diffs[1]["beyond_2se"] and not lines[6].endswith("*")  # the same: no star


def test_judged_entries_keep_each_side_on_the_prompts_it_decoded(tmp_path):
    ck = str(tmp_path / "run" / "step-2")
    v = {"mean_al": 2.0, "accepted_at": [3, 1], "accept_lengths": [[2, 1], [3], [1, 2], [2]],
         "disagreements": ["T=1: position 1 apart"]}
    o = {"mean_al": 2.0, "accepted_at": [1, 0], "accept_lengths": [[2, 1], None, None, [1]]}
    rows = [{"drafter": "x | vLLM", "checkpoint": ck, "engine": "vllm", "by_temperature": {"1": v},
             "problems": ["T=1: position 1 apart"], "num_prompts": 4},
            {"drafter": "x | ours", "checkpoint": ck, "engine": "ours", "by_temperature": {"1": o}, "num_prompts": 4}]
    e = judged_entries(rows, META)[os.path.abspath(ck)]
    assert e["vllm"]["1"]["accept_lengths"] == v["accept_lengths"] and e["vllm"]["1"]["rounds"] == 6
    assert e["ours_vllm_schedule"]["1"]["accept_lengths"] == [[2, 1], [1]]  # the hot prompts only
    assert set(e["ours_vllm_schedule"]["1"]["by_category"]) == {"writing", "math"}
    assert e["problems"] == ["T=1: position 1 apart"] and e["disagreements"]["1"] == v["disagreements"]


def test_judge_work_folders_differ_when_two_runs_checkpoints_share_a_name(tmp_path):
    a, b, c = (str(tmp_path / x) for x in ("specopd/step-2", "offpolicy_ce/step-2", "warm/step-100"))
    names = work_names([a, b, c, a])
    assert names[2] == "step-100"  # a name only one drafter has is kept
    assert names[0] != names[1] and names[0].startswith("step-2-") and names[1].startswith("step-2-")
    assert names[3] == names[0]  # the same folder: the same work folder


def test_the_judge_serves_an_eagle3_export_at_its_own_k(tmp_path, monkeypatch):
    """An EAGLE-3 export keeps block_size in its specopd section (vLLM's top-level fields are LlamaForCausalLMEagle3's):
    the judge's default num_speculative_tokens is read from it, as for DFlash's top-level block_size."""
    import specopd.eval.engine as engine
    from oracle import make_tiny_checkpoint
    from specopd.drafters import build_drafter, export_drafter
    from specopd.models import load_target

    tdir = make_tiny_checkpoint("llama", tmp_path / "t", num_hidden_layers=6, vocab_size=64, hidden_size=32,
                                intermediate_size=48)
    target = load_target(tdir)
    e3, df = str(tmp_path / "e3"), str(tmp_path / "df")
    export_drafter(build_drafter("eagle3", target, block_size=6), e3)
    export_drafter(build_drafter("dflash", target, block_size=4, feature_layers=[1]), df)
    assert "block_size" not in json.loads(open(os.path.join(e3, "config.json")).read())
    seen = []

    def fake_vllm(args, log_path):  # what the runner would be asked; no vLLM here
        seen.append(args)
        raise RuntimeError("stop")

    monkeypatch.setattr(engine, "run_vllm", fake_vllm)
    with pytest.raises(RuntimeError, match="stop"):
        engine.run_judge_drafters(tdir, [e3, df], [[1, 2, 3]], 4, [0.0], [2], work_dir=str(tmp_path / "w"))
    args = seen[0]
    ks = [args[i + 1] for i, a in enumerate(args) if a == "--num-speculative-tokens"]
    assert ks == ["5", "3"]  # W = block_size - 1 of each


def test_dry_run_plans_a_recipe_whose_shipped_drafter_is_not_made_yet(tmp_path, capsys):
    from specopd.cli import main

    recipe = os.path.join(ROOT, "recipes", "smollm2-135m-eagle3.yaml")
    missing = str(tmp_path / "not-made")
    assert main(["train", recipe, "--dry-run", f"drafter.init_from={missing}",
                 f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert f"drafter.init_from={missing!r}: no such folder" in out and "specopd export" in out
    assert "plan is of a fresh drafter of the recipe's shape" in out and "workers" in out
    assert main(["train", recipe, f"drafter.init_from={missing}", f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and f"specopd export <its pretraining run>/checkpoints/step-N {missing}" in err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def need_vllm() -> None:
    """Skip, saying why, without a vLLM venv; with SPECOPD_REQUIRE_VLLM=1 (`make test`) fail instead."""
    from specopd.engines import vllm_missing_reason

    why = vllm_missing_reason()
    if why and os.environ.get("SPECOPD_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"SPECOPD_REQUIRE_VLLM=1 but {why}")
    if why:
        pytest.skip(f"no vLLM: {why}")


def bench_al(args: list, env: dict) -> subprocess.CompletedProcess:
    """benchmarks/bench_al.py in its own process, as a user runs it (tests import nothing from benchmarks/)."""
    return subprocess.run([sys.executable, BENCH_AL, *args], env=env, capture_output=True, text=True, timeout=1800)


def test_bench_al_judge_vllm_without_vllm_names_the_fix(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "SPECOPD_VLLM_PYTHON": str(tmp_path / "no-python")}
    r = bench_al(["--judge", "vllm", "--benches", "mt-bench", "--out", str(tmp_path / "b")], env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--judge vllm" in r.stderr and "SPECOPD_VLLM_PYTHON" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b" / "main").exists()  # refused before any work
    r = bench_al(["--judge", "vllm", "--benches", "sharegpt", "--out", str(tmp_path / "b")], env)
    assert r.returncode == 2 and "add mt-bench to --benches" in r.stderr


@pytest.mark.slow
def test_bench_al_judged_by_vllm_end_to_end_and_cached(tmp_path):
    """Every row decoded for real served by vLLM (one process) on 8 MT-Bench first turns: vLLM's columns, paired
    differences from its accept lengths, the round-for-round check; a rerun serves nothing again."""
    need_vllm()
    from oracle import make_tiny_checkpoint
    from test_data import write_char_tokenizer
    from test_sharegpt_mtbench import write_conversations

    # head_dim 32: vLLM's CPU attention takes head sizes of 32 and up
    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, hidden_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
                                      max_position_embeddings=1024, eos_token_id=2)
    write_char_tokenizer(target_dir)
    write_conversations(tmp_path / "c.jsonl", 30)
    out = tmp_path / "bench"
    args = ["--steps", "2", "--eval-every", "2", "--methods", "specopd,offpolicy_ce", "--benches", "mt-bench",
            "--prompts", "4", "--judge-prompts", "8", "--max-new-tokens", "6", "--judge", "vllm", "--out", str(out),
            f"model.target={target_dir}", f"data.path={tmp_path / 'c.jsonl'}", "data.heldout=0.2",
            "data.seq_len=200", "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false",
            "data.batch_size=2", "drafter.init_from=null", "pipeline.warmup_steps=2", "trainer.anchors_per_seq=2",
            "drafter.block_size=3", "drafter.feature_layers=[0]", "eval.dtype=float32"]
    # SPECOPD_VLLM_JUDGE=1: the test session turns the main job's judge off (conftest.py); --judge vllm needs it
    env = {**os.environ, "SPECOPD_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT, "SPECOPD_VLLM_JUDGE": "1"}
    off = bench_al(args, {**env, "SPECOPD_VLLM_JUDGE": "0"})  # vLLM asked for and not run: not a result
    assert off.returncode == 1 and "vLLM did not judge 4 row(s)" in off.stderr, off.stdout[-2000:] + off.stderr

    first = bench_al(args, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    text = first.stdout
    data = json.loads((out / "bench_al.json").read_text())
    assert data["judge"] == "vllm" and data["vllm_judged_prompts"] == 8
    # the rows decoded for real: the starting drafter, specopd, offpolicy_ce at equal steps and at equal time
    assert [r["setting"] for r in data["rows"]] == ["start", "equal_steps", "equal_steps", "equal_time"]
    for r in data["rows"]:
        for t in ("0", "1"):
            v = data["vllm_judge"][os.path.abspath(r["checkpoint"])]["vllm"][t]
            assert len(v["accept_lengths"]) == 8 and r["al"]["mt-bench"][f"vllm_t{t}"]["mean_al"] == v["mean_al"]
    assert "T=0 vLLM (8)" in text and "vLLM's counters against ours on vLLM's schedule" in text
    assert "DISAGREEMENT" not in text  # fp32: vLLM's T=0 rounds equal ours, T=1 within noise
    vd = [d for d in data["specopd_minus"] if d["what"] == "vllm_t0"]
    assert {d["setting"] for d in vd} == {"equal_steps", "equal_time", "start"}
    ref = next(r for r in data["rows"] if r["base"] == "specopd")
    entry = data["vllm_judge"]
    for d in vd:
        other = next(r for r in data["rows"] if r["method"] == d["method"])
        a = entry[os.path.abspath(ref["checkpoint"])]["vllm"]["0"]["accept_lengths"]
        b = entry[os.path.abspath(other["checkpoint"])]["vllm"]["0"]["accept_lengths"]
        assert (d["diff"], d["se"]) == pytest.approx(paired_diff(a, b))
    ours = json.loads(next(out.glob("eval_cache_mt-bench_*.json")).read_text())
    assert ours and not [k for v in ours.values() for k in v if k.startswith("vllm")]  # our cache keeps ours only
    cache = sorted(p.name for p in out.glob("vllm_judge_8x6_*.json"))
    assert len(cache) == 1
    before = (out / cache[0]).stat().st_mtime_ns
    again = bench_al(args, env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "vLLM judges" not in again.stdout and (out / cache[0]).stat().st_mtime_ns == before  # nothing served again


@pytest.mark.slow
def test_eagle3_against_dflash_at_equal_time_on_tiny_sizes(tmp_path):
    """benchmarks/bench_eagle3_dflash.py at tiny sizes: both pretraining recipes' step cost in turn, the shipped
    DFlash drafter's steps converted to the nearest kept EAGLE-3 checkpoint, both served by vLLM in one process
    (EAGLE-3 at its k and at DFlash's), paired differences from vLLM's accept lengths."""
    need_vllm()
    from specopd.config import load_recipe
    from specopd.train.loop import train
    from test_eagle3 import smollm2_target

    tdir = smollm2_target()
    small = [f"model.target={tdir}", "data.batch_size=2", "data.seq_len=128", "trainer.anchors_per_seq=4"]
    run = tmp_path / "eagle3-ttt"  # a TTT run with checkpoints at steps 1 and 2
    train(load_recipe(os.path.join(ROOT, "recipes", "smollm2-135m-eagle3-sharegpt.yaml"), [
        *small, f"trainer.output_dir={run}", "trainer.max_steps=2", "trainer.save_every=1",
        "trainer.eval_heldout=false"]), progress=False)
    out = tmp_path / "cmp"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_eagle3_dflash.py"), "--steps", "1",
                        "--rounds", "2", "--prompts", "2", "--max-new-tokens", "8", "--dflash-steps", "2",
                        "--eagle3-run", str(run), "--out", str(out), *small],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "eagle3_vs_dflash.json").read_text())
    costs = data["step_costs"]
    assert [len(costs[k]["steps_s"]) for k in ("dflash", "eagle3")] == [2, 2]  # 2 rounds x 1 step, each in turn
    want = equal_time_steps(2, costs["dflash"]["step_s"], costs["eagle3"]["step_s"])
    assert data["equal_eagle3_steps"] == pytest.approx(want)
    assert data["eagle3_kept_steps"] == [1, 2] and abs(data["eagle3_step"] - want) <= abs(3 - data["eagle3_step"] - want)
    assert [(x["label"], x["k"]) for x in data["rows"]] == [("DFlash (shipped)", 4), ("EAGLE-3", 7),
                                                             ("EAGLE-3 at k=4", 4)]
    base = data["rows"][0]["by_temperature"]
    for d in data["minus_dflash"]:
        row = next(x for x in data["rows"] if x["label"] == d["label"])["by_temperature"][f"{d['temperature']:g}"]
        assert (d["diff"], d["se"]) == pytest.approx(paired_diff(row["accept_lengths"],
                                                                 base[f"{d['temperature']:g}"]["accept_lengths"]))
    assert len(data["minus_dflash"]) == 4 and "EAGLE-3 at k=4" in r.stdout and "equal time: DFlash's 2 steps" in r.stdout
