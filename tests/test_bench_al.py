"""benchmarks/bench_al.py end to end on a tiny target (slow): the main recipe's shape (conversations as trunks, one
starting drafter), every method including regen_ce (the target regenerates the replies of the conversations the
runs draw, then CE), MT-Bench first and second turns and held-out ShareGPT-style prompts, paired differences (per
set and pooled), figures, JSON, and a rerun that reuses everything. The script runs in its own process, as a user
runs it: tests import nothing from benchmarks/."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_data import char_target
from test_sharegpt_mtbench import write_conversations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("specopd", "offpolicy_ce", "offpolicy_e2e_tv", "draft_opd", "regen_ce")  # every method it compares


def bench_runner(tmp_path, *options: str, overrides=()):
    """A tiny target, 40 ShareGPT-style conversations and a starting drafter warmed up by the main job -> (out,
    run): run() calls bench_al.py with ``options`` (and recipe ``overrides``) as a user does, asserts exit 0 and
    returns its stdout."""
    target_dir = char_target(tmp_path / "t", max_position_embeddings=1024)
    write_conversations(tmp_path / "c.jsonl", 40)
    out = tmp_path / "bench"
    args = ["--steps", "2", "--eval-every", "1", "--prompts", "8", "--max-new-tokens", "4", *options, "--out",
            str(out), f"model.target={target_dir}", f"data.path={tmp_path / 'c.jsonl'}", "data.heldout=0.3",
            "data.seq_len=200", "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false",
            "data.batch_size=2", "drafter.init_from=null", "pipeline.warmup_steps=2", "trainer.anchors_per_seq=2",
            "drafter.block_size=3", "drafter.feature_layers=[0]", *overrides]
    env = {**os.environ, "SPECOPD_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT}

    def run() -> str:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_al.py"), *args], env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    return out, run


@pytest.mark.slow
def test_bench_al_compares_every_method_from_one_drafter_on_mtbench_and_heldout_conversations(tmp_path):
    out, run = bench_runner(tmp_path, "--benches", "mt-bench,mt-bench-2,sharegpt", "--regen-engine", "builtin",
                            "--regen-max-new-tokens", "16", overrides=["trainer.ce_weight=0.3"])
    text = run()
    assert text.startswith("python benchmarks/bench_al.py --steps 2") and "\nmeasured " in text
    data = json.loads((out / "bench_al.json").read_text())
    assert sorted(data["curves"]) == sorted(METHODS) and data["benches"] == ["mt-bench", "mt-bench-2", "sharegpt"]
    # a CE term goes to the methods that take one; CE, Draft-OPD and regen_ce (CE) train without it
    assert data["ce_weight"] == {"specopd": 0.3, "offpolicy_e2e_tv": 0.3, "offpolicy_ce": 0.0, "draft_opd": 0.0,
                                 "regen_ce": 0.0}
    assert data["prompts"]["mt-bench"] == data["prompts"]["mt-bench-2"] == 8 and data["prompts"]["sharegpt"] >= 2
    assert data["prompt_ids"]["mt-bench"] == data["prompt_ids"]["mt-bench-2"]  # the same questions' second turns
    held = {json.loads(x)["id"] for x in open(tmp_path / "c.jsonl")} - set(data["regen"]["trained_ids"])
    assert set(data["prompt_ids"]["sharegpt"]) <= held  # held-out conversations were never trained on
    regen = data["regen"]
    assert regen["references"] == regen["prompts"] == len(set(regen["trained_ids"])) and regen["regen_s"] > 0
    assert regen["temperature"] == 0.7 and regen["max_new_tokens"] == 16
    for method, pts in data["curves"].items():
        assert [p["step"] for p in pts] == [0, 1, 2]  # the starting drafter, then every checkpoint
        assert pts[0]["checkpoint"] == data["prepare"]["warm"]  # every method starts from the same drafter
        for b in ("mt-bench", "mt-bench-2", "sharegpt"):
            assert all(p[f"{b}/replay_t0"] >= 1.0 for p in pts) and f"{b}/real_t1" in pts[-1]
        assert pts[-1]["wall_s"] > pts[0]["wall_s"] == (regen["regen_s"] if method == "regen_ce" else 0.0)
    assert sorted(data["equal_time"]) == sorted(set(METHODS) - {"specopd"})
    for m, v in data["equal_time"].items():
        assert v["budget_s"] == data["budget_s"] > 0 and v["step"] >= (0 if m == "regen_ce" else 1)
    assert data["equal_time"]["regen_ce"]["wall_s"] >= regen["regen_s"]
    # SpecOPD against every other row (4 methods x 2 settings + the starting drafter), per set and AL column
    diffs = data["specopd_minus"]
    per_set = [d for d in diffs if d["bench"] != "pooled"]
    assert len(per_set) == 9 * 3 * 2 and all(d["se"] >= 0 and d["beyond_2se"] == (abs(d["diff"]) > 2 * d["se"])
                                             for d in diffs)
    # pooled over the three sets' prompts: one ratio estimate over the union, recomputed here from the caches
    from specopd.eval.cli import al_diff_stderr

    pooled = [d for d in diffs if d["bench"] == "pooled"]
    assert len(pooled) == 9
    ev = data["evaluations_by_bench"]
    row_ckpt = {r["method"]: r["checkpoint"] for r in data["rows"]}
    sets = ("mt-bench", "mt-bench-2", "sharegpt")

    def lengths(folder):
        return [x for b in sets for x in ev[b][os.path.abspath(folder)]["replay_t0"]["accept_lengths"]]

    a = lengths(row_ckpt[next(m for m in row_ckpt if m.startswith("specopd"))])
    for d in pooled:
        bl = lengths(row_ckpt[d["method"]])
        want = sum(map(sum, a)) / sum(map(len, a)) - sum(map(sum, bl)) / sum(map(len, bl))
        assert abs(d["diff"] - want) < 1e-12 and abs(d["se"] - al_diff_stderr(a, bl)) < 1e-12
    # along the curve: every step both runs evaluated, per set and pooled; the last step is the equal-steps table's
    curve = data["specopd_minus_along_curve"]
    assert len(curve) == 4 * 2 * 4 and {d["step"] for d in curve} == {1, 2}
    final = {(d["method"].split(" ")[0], d["bench"]): d for d in diffs
             if d["setting"] == "equal_steps" and d["what"] == "replay_t0"}
    for d in curve:
        if d["step"] == 2:
            f = final[(d["method"], d["bench"])]
            assert abs(d["diff"] - f["diff"]) < 1e-9 and abs(d["se"] - f["se"]) < 1e-9
    assert "regen_ce (equal time)" in text and "beyond two standard errors" in text and "AL per category" in text
    assert (out / "al_vs_steps.png").stat().st_size > 0 and (out / "al_vs_wall.png").stat().st_size > 0

    text = run()  # a rerun reuses the runs, the references and the evaluations
    assert "steps from the starting drafter" not in text and "the target answers" not in text
    assert json.loads((out / "bench_al.json").read_text())["specopd_minus"] == diffs


@pytest.mark.slow
def test_bench_al_real_at_none_decodes_nothing_for_real_and_replays_every_checkpoint(tmp_path):
    """``--real-at none``: T=0 is replayed at every checkpoint and no row is decoded for real (no T=1 column or
    panel), for drafters whose own decoding costs more than vLLM's judge of the same rows."""
    out, run = bench_runner(tmp_path, "--methods", "specopd,offpolicy_ce", "--benches", "mt-bench", "--real-at",
                            "none")
    text = run()
    data = json.loads((out / "bench_al.json").read_text())
    assert [p["step"] for p in data["curves"]["specopd"]] == [0, 1, 2]
    for pts in data["curves"].values():
        assert all("mt-bench/replay_t0" in p and not any("real_" in k for k in p) for p in pts)
    for cache in data["evaluations_by_bench"].values():
        assert cache and all(set(v) == {"replay_t0"} for v in cache.values())
    assert "T=0 (replay)" in text and "T=1 (real)" not in text
    assert {d["what"] for d in data["specopd_minus"]} == {"replay_t0"}
