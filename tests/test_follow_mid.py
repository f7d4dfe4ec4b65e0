"""``specopd follow`` killed while a version trains resumes from its last ``trainer.save_every`` checkpoint: the
drafter ends bitwise equal to an unkilled run's, no rollout is skipped or repeated, ``exports/latest`` never names
the half-trained version, and a seconds budget resumes with only the seconds left (specopd/follow/DESIGN.md)."""
import json
import os
import types

import torch
from safetensors.torch import load_file

from specopd.follow import DrafterFollower
from specopd.follow import follower as fw
from specopd.follow.follower import latest_export
from specopd.runs import checkpoint as ck
from test_follow import RECIPE, append, overrides, policy, rollouts
from tiny_runs import run_cli

MID = ["follow.steps_per_version=3", "trainer.save_every=2"]


def job(tmp_path, out):
    """The CLI arguments of a follow run in ``out`` on policies 0..2 and the rollouts in tmp_path/rollouts; steps
    3 per version, a checkpoint every 2 steps (version 2 trains steps 7..9: the one at 8 is mid-version)."""
    pol, log = tmp_path / "policies", tmp_path / "rollouts"
    if not log.is_dir():
        log.mkdir()
        for v in range(3):
            policy(pol, v)
        append(log / "a.jsonl", rollouts(0) + rollouts(1, 5))
        append(log / "b.jsonl", rollouts(1, 3, first=5) + rollouts(2, 8))
    return ["follow", RECIPE] + overrides(out, *MID, f"follow.policies={pol}", f"follow.rollouts={log}",
                                          "follow.idle_exit_s=1")


def losses(out):
    return [(x["step"], x["loss"]) for x in map(json.loads, open(out / "metrics.jsonl")) if "loss" in x]


def test_a_kill_mid_version_resumes_to_the_unkilled_runs_drafter_bitwise(tmp_path, capsys, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "run"
    rc, _, err = run_cli(capsys, *job(tmp_path, ref))
    assert rc == 0, err
    calls, seen, real = [], [], fw.train_step

    def killed_in_version_2(group, info, cfg, ids, step):
        calls.append(step)
        seen.append(latest_export(str(out / "exports")))
        if len(calls) == 9:  # version 2's last step (its checkpoint at step 8 is written): the process dies
            raise KeyboardInterrupt
        return real(group, info, cfg, ids, step)

    monkeypatch.setattr(fw, "train_step", killed_in_version_2)
    rc, _, err = run_cli(capsys, *job(tmp_path, out))
    assert rc == 130, err
    root = out / "exports"
    assert latest_export(str(root)) == str(root / "v1") and sorted(os.listdir(root)) == ["latest", "v0", "v1"]
    c = ck.load_checkpoint(ck.find_latest(str(out)))
    st = c["state"]["follow"]
    assert c["state"]["step"] == 8 and st["current"]["version"] == 2 and st["current"]["steps"] == 2
    assert st["extra"]["done"] == 1 and len(st["extra"]["training"]) == 8
    pending = sum(len(f["pending"]) for f in st["extra"]["reader"].values())
    assert pending == 8  # version 2's rollouts: read, not consumed
    append(tmp_path / "rollouts" / "b.jsonl", rollouts(2, 3, first=8))  # arrive after the kill: late for version 2
    monkeypatch.undo()
    calls_after = []

    def counted(group, info, cfg, ids, step):
        calls_after.append(step)
        seen.append(latest_export(str(root)))
        return real(group, info, cfg, ids, step)

    monkeypatch.setattr(fw, "train_step", counted)
    rc, text, err = run_cli(capsys, *job(tmp_path, out))
    assert rc == 0, err
    assert "resumed mid-version" in text and calls_after == [8]  # only the step left of version 2's budget
    assert all(x != str(root / "v2") for x in seen)  # latest never named version 2 while it trained
    assert latest_export(str(root)) == str(root / "v2")
    want = load_file(str(ref / "exports" / "v2" / "model.safetensors"))
    got = load_file(str(root / "v2" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert losses(out) == losses(ref) and [s for s, _ in losses(out)] == list(range(1, 10))
    m = json.load(open(out / "follow_summary.json"))
    assert {v: (r["rollouts"], r["steps"]) for v, r in m["versions"].items()} == {"0": (8, 3), "1": (8, 3),
                                                                                   "2": (8, 3)}
    for v in range(3):  # each rollout trained on once, by its own version
        got_ids = [json.loads(x)["id"] for x in open(out / "follow" / "rollouts" / f"v{v}.jsonl")]
        assert got_ids == [r["id"] for r in rollouts(v)]
    end = ck.load_checkpoint(ck.find_latest(str(out)))["state"]["follow"]
    assert end["current"] is None and end["extra"]["late"] == 3 and end["extra"]["done"] == 2
    assert all(f["pending"] == [] for f in end["extra"]["reader"].values())  # every rollout consumed


def test_a_seconds_budget_resumes_with_only_the_seconds_left(tmp_path, monkeypatch):
    """A clock that moves one second per step: a 10-second budget is 10 steps. Killed after step 5 (checkpoint at
    4 s), the resumed call trains 6 steps (10 - 4 s), not 10 again."""
    now = [0.0]
    monkeypatch.setattr(fw, "time", types.SimpleNamespace(perf_counter=lambda: now[0], time=fw.time.time))
    real, calls, die_at = fw.train_step, [], [6]

    def one_second(group, info, cfg, ids, step):
        calls.append(step)
        if len(calls) == die_at[0]:
            raise KeyboardInterrupt
        m = real(group, info, cfg, ids, step)
        now[0] += 1.0
        return m

    monkeypatch.setattr(fw, "train_step", one_second)
    args = overrides(tmp_path / "run", "trainer.save_every=2")
    with DrafterFollower(None, args, progress=False) as f:
        f.update_policy(policy(tmp_path / "p", 0), 0)
        f.add_rollouts(rollouts(0), 0)
        try:
            f.train(steps=0, seconds=10)
        except KeyboardInterrupt:
            pass
    calls.clear()
    die_at[0] = 0
    with DrafterFollower(None, args, progress=False) as f:
        assert f.current["seconds"] == 4.0 and f.steps == 4
        rec = f.train()
        assert calls == [4, 5, 6, 7, 8, 9] and f.steps == 10 and rec["steps"] == 10
        assert rec["train_s"] == 10.0


def test_specopd_follow_refuses_a_python_followers_mid_version_checkpoint(tmp_path, capsys, monkeypatch):
    """A checkpoint a DrafterFollower saved mid-version from Python records no rollout positions: ``specopd follow``
    on that folder is a message naming both ways out, exit 2, not a KeyError."""
    real, calls = fw.train_step, []

    def killed_at_3(group, info, cfg, ids, step):
        calls.append(step)
        if len(calls) == 3:  # after the checkpoint at step 2
            raise KeyboardInterrupt
        return real(group, info, cfg, ids, step)

    monkeypatch.setattr(fw, "train_step", killed_at_3)
    out = tmp_path / "run"
    argv = job(tmp_path, out)  # the same recipe and overrides as the CLI's below: only the writer differs
    with DrafterFollower(argv[1], argv[2:], progress=False) as f:
        f.update_policy(str(tmp_path / "policies" / "v0"), 0)
        f.add_rollouts(rollouts(0), 0)
        try:
            f.train()
        except KeyboardInterrupt:
            pass
    monkeypatch.undo()
    assert ck.load_checkpoint(ck.find_latest(str(out)))["state"]["follow"]["current"]["version"] == 0
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert "DrafterFollower" in err and "trainer.output_dir" in err and "Traceback" not in err
