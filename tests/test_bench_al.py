"""benchmarks/bench_al.py end to end on a tiny target (slow): every method from one warm drafter, figures, JSON.
The script runs in its own process, as a user runs it: tests import nothing from benchmarks/."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oracle import make_tiny_checkpoint
from test_data import write_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("specopd", "draft_opd", "offpolicy_ce", "offpolicy_e2e_tv")  # every method the script compares


@pytest.mark.slow
def test_bench_al_runs_every_method_from_one_warm_drafter(tmp_path):
    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1,
                                      max_position_embeddings=256, eos_token_id=2)
    write_char_tokenizer(target_dir)
    out = tmp_path / "bench"
    args = ["--steps", "2", "--eval-every", "1", "--prompts", "2", "--max-new-tokens", "4",
            "--out", str(out), f"model.target={target_dir}", f"data.path={out}/data/train.jsonl",
            "runtime.backend=local", "runtime.num_workers=1", "profile.enabled=false",
            "data.batch_size=2", "pipeline.data_num=4", "pipeline.data_max_new_tokens=12",
            "pipeline.warmup_steps=2", "trainer.anchors_per_seq=2", "drafter.block_size=3",
            "drafter.feature_layers=[0]", "pipeline.data_engine=builtin"]
    env = {**os.environ, "SPECOPD_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_al.py"), *args], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((out / "bench_al.json").read_text())
    assert sorted(data["curves"]) == sorted(METHODS)
    # the main recipe's CE term goes to the methods that take one; CE and Draft-OPD train without it
    assert data["ce_weight"] == {"specopd": 0.3, "offpolicy_e2e_tv": 0.3, "offpolicy_ce": 0.0, "draft_opd": 0.0}
    for method, pts in data["curves"].items():
        assert [p["step"] for p in pts] == [0, 1, 2]  # the warm drafter, then every checkpoint
        assert pts[0]["checkpoint"] == data["prepare"]["warm"]  # every method starts from the same drafter
        assert all(p["replay_t0"] >= 1.0 for p in pts) and "real_t0" in pts[-1] and "real_t1" in pts[-1]
        assert pts[-1]["wall_s"] > 0
    assert sorted(data["equal_time"]) == sorted(set(METHODS) - {"specopd"})
    assert all(v["budget_s"] > 0 and v["step"] >= 1 for v in data["equal_time"].values())
    assert (out / "al_vs_steps.png").stat().st_size > 0 and (out / "al_vs_wall.png").stat().st_size > 0
