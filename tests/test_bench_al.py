"""benchmarks/bench_al.py end to end on a tiny target (slow): every method from one warm drafter, figures, JSON."""
from __future__ import annotations

import json
import os
import sys

import pytest

from oracle import make_tiny_checkpoint
from test_data import write_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_al_runs_every_method_from_one_warm_drafter(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_al

    monkeypatch.setenv("SPECOPD_CACHE", str(tmp_path / "cache"))
    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1,
                                      max_position_embeddings=256, eos_token_id=2)
    write_char_tokenizer(target_dir)
    out = tmp_path / "bench"
    rc = bench_al.main(["--steps", "2", "--eval-every", "1", "--prompts", "2", "--max-new-tokens", "4",
                        "--out", str(out), f"model.target={target_dir}", f"data.path={out}/data/train.jsonl",
                        "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false",
                        "data.batch_size=2", "pipeline.data_num=4", "pipeline.data_max_new_tokens=12",
                        "pipeline.warmup_steps=2", "trainer.anchors_per_seq=2", "drafter.block_size=3",
                        "drafter.feature_layers=[0]", "pipeline.data_engine=builtin"])
    assert rc == 0
    data = json.loads((out / "bench_al.json").read_text())
    assert sorted(data["curves"]) == sorted(bench_al.METHODS)
    # the main recipe's CE term goes to the methods that take one; CE and Draft-OPD train without it
    assert data["ce_weight"] == {"specopd": 0.3, "offpolicy_e2e_tv": 0.3, "offpolicy_ce": 0.0, "draft_opd": 0.0}
    for method, pts in data["curves"].items():
        assert [p["step"] for p in pts] == [0, 1, 2]  # the warm drafter, then every checkpoint
        assert pts[0]["checkpoint"] == data["prepare"]["warm"]  # every method starts from the same drafter
        assert all(p["replay_t0"] >= 1.0 for p in pts) and "real_t0" in pts[-1] and "real_t1" in pts[-1]
        assert pts[-1]["wall_s"] > 0
    assert sorted(data["equal_time"]) == sorted(set(bench_al.METHODS) - {"specopd"})
    assert all(v["budget_s"] > 0 and v["step"] >= 1 for v in data["equal_time"].values())
    assert (out / "al_vs_steps.png").stat().st_size > 0 and (out / "al_vs_wall.png").stat().st_size > 0
