"""The judge's arithmetic without vLLM (default set): vLLM's counters -> our table's numbers, what counts as a
disagreement (T=0: any count; T>0: beyond NOISE_SIGMAS standard errors), the static export checks, and the main
job's rows degrading to none (with the reason) when vLLM is off."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from specopd.eval import engine as E


def test_vllm_counters_become_table_numbers():
    v = E.vllm_numbers({"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 9,
                        "accepted_per_pos": [5, 3, 1]}, 4)
    assert v["mean_al"] == pytest.approx(1.9) and v["rounds"] == 10
    assert v["accepted_at"] == [5, 3, 1, 0] and v["reached_at"] == [10, 5, 3, 1]
    assert v["per_position_acceptance"] == [0.5, 0.6, pytest.approx(1 / 3), 0.0]


def test_per_request_steps_become_the_counters_of_those_requests():
    """A subset's numbers from vLLM's per-request steps (what ours on vLLM's schedule is compared with at T > 0
    when it decodes fewer prompts than vLLM serves): over every request they equal vLLM's counters."""
    outs = [{"steps": {"accepted": [2, 0, 4, 1], "drafted": [4] * 4}},
            {"steps": {"accepted": [0, 3], "drafted": [4] * 2}},
            {"steps": {"accepted": [1], "drafted": [4]}}]
    counters = {"num_drafts": 7, "num_draft_tokens": 28, "num_accepted_tokens": 11, "accepted_per_pos": [5, 3, 2, 1]}
    assert E.steps_numbers(outs, 4) == {k: v for k, v in E.vllm_numbers(counters, 4).items()
                                        if k != "num_draft_tokens"}
    one = E.steps_numbers(outs[1:2], 4)
    assert one["rounds"] == 2 and one["accepted_at"] == [1, 1, 1, 0] and one["reached_at"] == [2, 1, 1, 1]
    assert one["mean_al"] == pytest.approx(2.5)
    assert E.steps_numbers([outs[0], {"steps": None}], 4) is None  # a request without steps: no subset numbers


def test_round_by_round_rule():
    """vLLM's per-request steps (accepted drafts per verify step) + 1 == our tokens per round, prompt by prompt;
    a difference names the prompt and its first differing round; prompts outside ``same_text`` and outputs
    without steps are not compared."""
    ours = [[3, 1, 5, 2], [1, 1, 2], [2]]
    outs = [{"steps": {"accepted": [2, 0, 4, 1], "drafted": [4, 4, 4, 4]}},
            {"steps": {"accepted": [0, 0, 1], "drafted": [4, 4, 4]}},
            {"steps": {"accepted": [1], "drafted": [4]}}]
    assert E.round_disagreements(ours, outs) == []
    outs[1]["steps"]["accepted"] = [0, 2, 1]
    (msg,) = E.round_disagreements(ours, outs)
    assert "prompt 1: round 1 accepts 3 tokens in vLLM, 1 in ours" in msg
    assert E.round_disagreements(ours, outs, same_text=[0, 2]) == []
    outs[2]["steps"]["accepted"] = [1, 0]  # one round more in vLLM
    assert any("prompt 2: round 1 accepts 1 tokens in vLLM, - in ours" in m for m in E.round_disagreements(ours, outs))
    assert E.round_disagreements(ours, [{"steps": None}] * 3) == []


def test_disagreement_rules():
    a = dict(rounds=100, accepted_at=[50, 20, 5, 1], reached_at=[100, 50, 20, 5])
    assert E.disagreements(a, dict(a), 0.0) == []
    b = dict(a, accepted_at=[50, 21, 5, 1])
    assert "must be equal" in E.disagreements(a, b, 0.0)[0]
    near = dict(rounds=100, accepted_at=[45, 18, 5, 1], reached_at=[100, 45, 18, 5])
    assert E.disagreements(a, near, 1.0) == []  # within noise at T > 0
    far = dict(rounds=100, accepted_at=[5, 0, 0, 0], reached_at=[100, 5, 0, 0])
    d = E.disagreements(a, far, 1.0)
    assert len(d) == 1 and "position 1" in d[0] and "standard errors" in d[0]


def test_static_export_checks(tmp_path):
    from safetensors.torch import load_file, save_file

    from specopd.drafters import build_drafter, export_drafter
    from specopd.models import load_target
    from specopd.models.tiny import build_tiny_target

    tdir = build_tiny_target("llama", str(tmp_path / "t"), overrides={"vocab_size": 64})
    target = load_target(tdir)
    d = build_drafter("dflash", target, num_layers=1, block_size=3, seed=0, feature_layers=[1], mask_token_id=5)
    ck = str(tmp_path / "ck")
    d.save(ck)
    good = export_drafter(d, str(tmp_path / "good"))
    assert E.check_export(good, target, ck) == []
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["dflash_config"]["target_layer_ids"] = [0]
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    assert any("dflash_config" in p and "checkpoint" in p for p in E.check_export(bad, target, ck))
    assert E.check_export(bad, target) == []  # without the checkpoint a valid layer id cannot be told wrong
    sd = load_file(os.path.join(good, "model.safetensors"))
    sd.pop("fc.weight")
    save_file(sd, os.path.join(bad, "model.safetensors"))
    assert any("fc.weight is missing" in p for p in E.check_export(bad, target))


def test_main_job_rows_off_say_why(monkeypatch, capsys):
    monkeypatch.setenv("SPECOPD_VLLM_JUDGE", "0")
    assert E.judge_rows(None, [0.0], None, None, "unused", [("after", "x")], "unused") == []
    assert "no vLLM rows" in capsys.readouterr().out


def test_judge_drafters_pass_one_k_per_drafter_and_the_warmup(monkeypatch, tmp_path):
    """``num_speculative_tokens`` as a list gives each engine its own k (one export served at several k, as
    benchmarks/bench_vllm_k.py does), a list of the wrong length is refused before vLLM starts, and ``warmup``
    reaches the runner."""
    seen = []

    def fake_run(args, log_path=None):
        seen.append(list(args))
        out = args[args.index("--output") + 1]
        n = args.count("--drafter")
        res = [{"runs": [], "drafter": None} for _ in range(n)]
        with open(out, "w") as f:
            json.dump(res[0] if n == 1 else {"by_drafter": res}, f)

    monkeypatch.setattr(E, "run_vllm", fake_run)
    d = str(tmp_path / "export")
    with pytest.raises(ValueError, match="one per drafter"):
        E.run_judge_drafters("t", [d, d], [[1, 2]], 4, [0.0], [], num_speculative_tokens=[1], work_dir=str(tmp_path))
    assert not seen
    E.run_judge_drafters("t", [d, d, d], [[1, 2]], 4, [0.0], [], num_speculative_tokens=[1, 2, 4],
                         work_dir=str(tmp_path), warmup=16)
    args = seen[0]
    ks = [args[i + 1] for i, a in enumerate(args) if a == "--num-speculative-tokens"]
    assert ks == ["1", "2", "4"] and args[args.index("--warmup") + 1] == "16"
