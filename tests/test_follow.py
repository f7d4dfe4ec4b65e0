"""``specopd follow`` and ``specopd.follow.DrafterFollower`` on tiny targets: the policy's weights swapped in place
are the ones used, a kill between versions resumes without skipping or repeating a rollout, a half-written policy
folder is not a version, ``exports/latest`` names only complete exports, the Ray-actor form, the staleness metrics
and figure (specopd/follow/DESIGN.md)."""
import contextlib
import json
import os
import shutil

import pytest
import torch

from specopd.follow import DrafterFollower
from specopd.follow.follower import FIGURE, latest_export, publish
from specopd.follow.sources import RolloutReader, complete_policies, policy_problem, version_of
from specopd.models import load_target
from specopd.models.tiny import build_tiny_target
from specopd.tree import ProposalTree
from tiny_runs import TINY_TEST_OVERRIDES, run_cli

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny-follow.yaml")
FOLLOW = ["follow.steps_per_version=2", "follow.min_rollouts=8", "follow.poll_s=0.05", "trainer.min_lr_ratio=1.0",
          "trainer.log_every=1"]


def overrides(out, *extra):
    return TINY_TEST_OVERRIDES + FOLLOW + [f"trainer.output_dir={out}", *extra]


def policy(root, version):
    """Policy version ``version``: a tiny llama of its own weights (seed version + 1), as an RL trainer saves it."""
    return build_tiny_target("llama", os.path.join(str(root), f"v{version}"), seed=version + 1)


def rollouts(version, n=8, first=0):
    """``n`` rollouts of ``version`` in the prepared-data format (fixed token ids per id)."""
    g = torch.Generator().manual_seed(1000 * version + first)
    return [{"id": f"v{version}-{i}", "input_ids": torch.randint(0, 256, (20,), generator=g).tolist(),
             "response_start": 4, "policy_version": version} for i in range(first, first + n)]


@contextlib.contextmanager
def ray_running():
    """Ray for the block: started (2 CPUs) unless it runs already, then stopped; skips without Ray."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def followed(out, *extra) -> list:
    """A follower in ``out`` (``extra`` overrides) on policies 1 and 2, one training step on 8 rollouts each: the
    held-out expected AL before and after each version's update, in order."""
    with DrafterFollower(None, overrides(out, *extra), progress=False) as f:
        for v in (1, 2):
            f.update_policy(policy(os.path.join(os.path.dirname(str(out)), "p"), v), v)
            f.add_rollouts(rollouts(v), v)
            f.train(steps=1)
        return [x for r in f.metrics()["versions"].values() for x in (r["before"], r["after"])]


def append(path, recs, cut_last=False):
    text = "".join(json.dumps(r) + "\n" for r in recs)
    with open(path, "a") as f:
        f.write(text[:-1] if cut_last else text)


# ---------------------------------------------------------------------------------------------- weights in place
def test_weights_swapped_in_place_are_the_ones_used(tmp_path):
    """After update_policy the workers' target scores branches exactly as a fresh load of that version, in the
    same tensors (no reload), with the same drafter object."""
    root = tmp_path / "policies"
    with DrafterFollower(None, overrides(tmp_path / "run"), progress=False) as f:
        f.update_policy(policy(root, 1), 1)
        f.add_rollouts(rollouts(1), 1)
        f.train(steps=1)
        w = f.group.workers[0]
        target, drafter = w.target, w.drafter
        ptrs = {k: p.data_ptr() for k, p in target.named_parameters()}
        f.update_policy(policy(root, 2), 2)
        assert w.target is target and w.drafter is drafter and drafter.target is target
        assert {k: p.data_ptr() for k, p in target.named_parameters()} == ptrs
        fresh = load_target(policy(root, 2), dtype=torch.float32)
        trunk = torch.tensor(rollouts(2)[0]["input_ids"])
        tree = ProposalTree.from_branches(torch.tensor([5, 9]), torch.randint(0, 256, (2, 3)))
        got = target.score(tree, target.prefill(trunk))
        want = fresh.score(tree, fresh.prefill(trunk))
        assert torch.equal(got, want)
        old = load_target(policy(root, 1), dtype=torch.float32)
        assert not torch.equal(got, old.score(tree, old.prefill(trunk)))
        assert f.add_rollouts(rollouts(1, 3, first=8), 1) == 0  # version 1's policy is gone: late, not trained on
        assert f.metrics()["versions"]["1"]["late"] == 3


def test_a_policy_of_another_shape_or_config_is_refused_naming_it(tmp_path):
    target = load_target(build_tiny_target("llama", str(tmp_path / "a"), seed=1), dtype=torch.float32)
    sd = {k: v.clone() for k, v in target.named_parameters()}
    sd["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        target.copy_weights_(sd)
    sd["model.norm.weight"] = torch.ones(64, dtype=torch.float64)
    with pytest.raises(ValueError, match="'model.norm.weight' is torch.float64"):
        target.copy_weights_(sd)
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match="lack 'model.norm.weight'"):
        target.copy_weights_(sd)
    from specopd.models.loading import policy_weights

    other = build_tiny_target("llama", str(tmp_path / "b"), seed=1, overrides={"rms_norm_eps": 1e-3})
    with pytest.raises(ValueError, match="rms_norm_eps"):
        policy_weights(target, other)


# ---------------------------------------------------------------------------------------------- policy folders
def test_a_half_written_policy_folder_is_not_a_version(tmp_path):
    root = tmp_path / "policies"
    good = policy(root, 1)
    assert policy_problem(good) is None and complete_policies(str(root)) == [(1, good)]
    half = root / "v2"
    half.mkdir()
    assert "config.json" in policy_problem(str(half))
    shutil.copy(os.path.join(good, "config.json"), half / "config.json")
    assert "no model.safetensors" in policy_problem(str(half))
    data = open(os.path.join(good, "model.safetensors"), "rb").read()
    (half / "model.safetensors").write_bytes(data[: len(data) // 2])  # a copy in progress
    assert "bytes" in policy_problem(str(half))
    assert complete_policies(str(root)) == [(1, good)]
    (half / "model.safetensors").write_bytes(data)
    assert complete_policies(str(root)) == [(1, good), (2, str(half))]
    assert "no DONE marker" in policy_problem(str(half), "DONE")
    # sharded: every shard of the index present and complete
    sharded = root / "step-3"
    sharded.mkdir()
    shutil.copy(os.path.join(good, "config.json"), sharded / "config.json")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(data)
    assert "model-00002-of-00002.safetensors" in policy_problem(str(sharded))
    (sharded / "model-00002-of-00002.safetensors").write_bytes(data)
    assert policy_problem(str(sharded)) is None
    shutil.copytree(good, root / "v4.tmp-123")  # a writer's temporary folder
    assert [v for v, _ in complete_policies(str(root))] == [1, 2, 3]
    assert (version_of("global_step_30"), version_of(".v5"), version_of("latest")) == (30, None, None)


def test_rollout_lines_are_read_once_and_only_when_complete(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    recs = rollouts(0, 3)
    append(path, recs[:2])
    append(path, recs[2:], cut_last=True)  # the writer has not finished the last line
    r = RolloutReader(str(path))
    first = r.poll()
    assert [i["record"]["id"] for i in first] == ["v0-0", "v0-1"]
    with open(path, "a") as f:
        f.write("\n")
    second = r.poll()
    assert [i["record"]["id"] for i in second] == ["v0-2"] and r.poll() == []
    r.consumed(first[:1])
    again = RolloutReader(str(path), json.loads(json.dumps(r.state())))  # a resume: the unconsumed ones come back
    assert [i["record"]["id"] for i in again.poll()] == ["v0-1", "v0-2"]
    append(path, [{"id": "x"}])
    with pytest.raises(Exception, match=r"rollouts.jsonl:4: .*policy_version"):
        again.poll()
    path.write_text("")
    with pytest.raises(Exception, match="only appended to"):
        again.poll()


# ---------------------------------------------------------------------------------------------- exports
def test_latest_always_names_a_complete_export(tmp_path, monkeypatch):
    from specopd.drafters.layout import check_folder
    from specopd.follow import follower as fw

    with DrafterFollower(None, overrides(tmp_path / "run"), progress=False) as f:
        f.update_policy(policy(tmp_path / "p", 0), 0)
        f.add_rollouts(rollouts(0), 0)
        f.train(steps=1)
        first = f.export(0)
        root = os.path.join(f.out, "exports")
        assert latest_export(root) == first
        check_folder(first)
        src = f.save()

    def dies(src_, out, *a, **k):  # killed half way through writing the export
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "model.safetensors"), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fw, "export_folder", dies)
    with pytest.raises(KeyboardInterrupt):
        publish(src, root, 1)
    assert latest_export(root) == first and sorted(os.listdir(root)) == ["latest", "v0"]
    check_folder(first)
    monkeypatch.undo()
    again = publish(src, root, 1)
    assert latest_export(root) == again == os.path.join(root, "v1")
    check_folder(os.path.join(root, "v1"))


# ---------------------------------------------------------------------------------------------- the CLI job
def test_a_kill_between_versions_resumes_without_skipping_or_repeating_a_rollout(tmp_path, capsys, monkeypatch):
    from specopd.follow import follower as fw

    pol, log, out = tmp_path / "policies", tmp_path / "rollouts", tmp_path / "run"
    log.mkdir()
    for v in range(3):
        policy(pol, v)
    append(log / "a.jsonl", rollouts(0) + rollouts(1, 5))
    append(log / "b.jsonl", rollouts(1, 3, first=5) + rollouts(2, 8))
    args = ["follow", RECIPE] + overrides(out, f"follow.policies={pol}", f"follow.rollouts={log}", "follow.idle_exit_s=1")
    calls, real = [], fw.train_step

    def killed_in_version_2(group, info, cfg, ids, step):
        calls.append(step)
        if len(calls) == 5:  # versions 0 and 1 done (2 steps each), version 2's first step: the process dies
            raise KeyboardInterrupt
        return real(group, info, cfg, ids, step)

    monkeypatch.setattr(fw, "train_step", killed_in_version_2)
    rc, _, err = run_cli(capsys, *args)
    assert rc == 130, err
    root = out / "exports"
    assert latest_export(str(root)) == str(root / "v1")
    monkeypatch.undo()
    rc, text, err = run_cli(capsys, *args)
    assert rc == 0, err
    assert "continuing after policy version 1" in text and "published policy version 2" in text
    m = json.load(open(out / "follow_summary.json"))
    assert {v: (r["rollouts"], r["steps"]) for v, r in m["versions"].items()} == {"0": (8, 2), "1": (8, 2),
                                                                                   "2": (8, 2)}
    for v, want in ((0, rollouts(0)), (1, rollouts(1)), (2, rollouts(2))):
        got = [json.loads(x)["id"] for x in open(out / "follow" / "rollouts" / f"v{v}.jsonl")]
        assert got == [r["id"] for r in want]  # each once, none from another version
    assert latest_export(str(root)) == str(root / "v2")
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    stale = [x for x in lines if "follow/staleness" in x]
    assert [x["follow/version"] for x in stale] == [0, 1, 2]
    assert all(x["follow/staleness"]["before"] > 1 and x["follow/staleness"]["after"] > 1 for x in stale)
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 6]  # the killed step's line is not kept
    assert os.path.getsize(out / FIGURE) > 0
    assert all(0 < r.get("time_share", -1) <= 1 for r in m["versions"].values()), m


def test_a_version_waits_for_its_rollouts_and_a_newer_policy_closes_it(tmp_path):
    from specopd.follow.job import Watcher

    pol, log = tmp_path / "policies", tmp_path / "r.jsonl"
    append(log, rollouts(0, 3))
    with DrafterFollower(None, overrides(tmp_path / "run", f"follow.policies={pol}", f"follow.rollouts={log}"),
                         progress=False) as f:
        w = Watcher(f)
        w.poll()
        assert w.due([(0, policy(pol, 0))]) is None  # 3 < follow.min_rollouts: wait
        assert w.due([(0, policy(pol, 0)), (1, policy(pol, 1))]) == (0, policy(pol, 0))  # version 1 closes version 0
        assert w.due([(1, policy(pol, 1)), (2, policy(pol, 2))]) is None and w.skipped == [1]


# ---------------------------------------------------------------------------------------------- Ray
def test_the_follower_runs_as_a_ray_actor(tmp_path):
    with ray_running() as ray:
        actor = ray.remote(DrafterFollower).remote(None, overrides(tmp_path / "run"), False)
        sd = {k: v for k, v in load_target(policy(tmp_path / "p", 3), dtype=torch.float32).state_dict().items()}
        ray.get(actor.update_policy.remote(sd, 3))
        assert ray.get(actor.add_rollouts.remote(rollouts(3), 3)) == 8
        rec = ray.get(actor.train.remote(2))
        path = ray.get(actor.export.remote(3))
        m = ray.get(actor.metrics.remote())
        ray.get(actor.close.remote())
        assert rec["steps"] == 2 and m["versions"]["3"]["steps"] == 2 and m["policy_version"] == 3
        assert os.path.isfile(os.path.join(path, "model.safetensors"))


def test_a_follow_recipe_without_a_budget_or_sources_is_a_users_mistake(tmp_path, capsys):
    from specopd.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="follow.steps_per_version=0 and follow.seconds_per_version=0"):
        load_recipe(RECIPE, ["follow.steps_per_version=0"])
    rc, _, err = run_cli(capsys, "follow", RECIPE, f"trainer.output_dir={tmp_path / 'run'}", "follow.policies=''")
    assert rc == 2 and "needs follow.policies" in err


def test_ray_workers_swap_the_policy_in_place_too(tmp_path):
    """runtime.backend=ray: the actors swap each version in; their held-out AL before and after the update equals
    that of in-process workers on the same rollouts (the same weights are used)."""
    with ray_running():
        got = {b: followed(tmp_path / b, f"runtime.backend={b}", "runtime.num_workers=2") for b in ("local", "ray")}
    assert got["ray"] == pytest.approx(got["local"], rel=1e-6, abs=1e-6)
    assert got["local"][2] != got["local"][1]  # version 2's policy changes the AL the drafter gets


@pytest.mark.parametrize("kind", ["dspark", "dflash2", "eagle3"])
def test_every_trained_drafter_kind_follows_and_exports(tmp_path, kind):
    from specopd.drafters import load_drafter

    with DrafterFollower(None, overrides(tmp_path / "run", f"drafter.kind={kind}"), progress=False) as f:
        for v in (0, 1):
            f.update_policy(policy(tmp_path / "p", v), v)
            f.add_rollouts(rollouts(v), v)
            f.train(steps=1)
            path = f.export(v)
        want = f.group.workers[0].drafter.state_dict()
    got = load_drafter(path, load_target(policy(tmp_path / "p", 1), dtype=torch.float32))
    assert got.kind == kind and all(torch.equal(got.state_dict()[k], v.cpu()) for k, v in want.items())
