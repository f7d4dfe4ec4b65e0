"""Ray backend: real Ray actors on this machine's CPUs (2 cores: 2 workers x 1 CPU).

One Ray instance for the module (ray.init takes seconds); every RayGroup joins it.
"""
import glob
import json
import os
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from specopd.config import load_recipe  # noqa: E402
from specopd.distributed import ClusterTooSmallError, RayGroup, WorkerLostError  # noqa: E402
from specopd.train.worker import Worker  # noqa: E402

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "tiny.yaml")
SMALL = ["data.num_samples=24", "data.batch_size=4", "trainer.anchors_per_seq=4", "trainer.max_steps=3",
         "trainer.eval_heldout=false", "trainer.save_every=0", "runtime.cpus_per_worker=1"]


@pytest.fixture(scope="module")
def ray_session():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(out, *extra, backend="ray", workers=2):
    return load_recipe(RECIPE, SMALL + [f"trainer.output_dir={out}", f"runtime.backend={backend}",
                                        f"runtime.num_workers={workers}", *extra])


def _weights(out):
    from safetensors.torch import load_file
    from specopd.runs.checkpoint import find_latest

    return load_file(os.path.join(find_latest(str(out)), "model.safetensors"))


def test_cluster_too_small_is_an_error_not_a_hang(ray_session, tmp_path, live_groups):
    with pytest.raises(ClusterTooSmallError, match=r"3 workers x \(1 CPU, 0 GPU\) = 3 CPU.*has 2 CPU"):
        RayGroup(_cfg(tmp_path, workers=3), Worker)
    with pytest.raises(ClusterTooSmallError, match="1 GPU.*0 GPU"):
        RayGroup(_cfg(tmp_path, "runtime.gpus_per_worker=1", workers=1), Worker)
    with pytest.raises(ClusterTooSmallError, match=r"2 target \+ 2 drafter workers.*4 workers x \(1 CPU"):
        RayGroup(_cfg(tmp_path, "runtime.roles=split"), Worker)
    assert live_groups() == []


def test_worker_that_fails_to_start_names_rank_node_and_cause(ray_session, tmp_path, live_groups):
    with pytest.raises(RuntimeError, match=r"worker rank 0 \(node .*, node id .*\) failed to start: .*nonexistent"):
        RayGroup(_cfg(tmp_path, "model.target=/nonexistent/target", workers=1), Worker)
    assert live_groups() == []


def test_a_users_mistake_in_a_worker_keeps_its_type(ray_session, tmp_path, live_groups):
    """A user error raised while a Ray worker starts (here: every record held out) reaches the driver as itself
    (a UserError: the CLI's exit 2 with its message), not as a "failed to start" RuntimeError."""
    from specopd.errors import BadInputError, UserError

    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(10, 40)), "prompt_len": 4, "split": "heldout"}) + "\n"
                            for _ in range(6)))
    with pytest.raises(BadInputError, match="every one of the 6 records .* is held out") as e:
        RayGroup(_cfg(tmp_path / "run", "data.source=prepared", f"data.path={data}", workers=1), Worker)
    assert isinstance(e.value, UserError)
    assert live_groups() == []


def test_two_ray_workers_train_like_one_local_worker(ray_session, tmp_path):
    """recipes/tiny.yaml, same global batches: 2 Ray actors (1 CPU each, gloo all-reduce) end with the
    drafter of 1 in-process worker that sees the whole batch, up to fp32 rounding of the split gradient
    sum (which AdamW's normalisation amplifies for near-zero gradients: hence atol 2e-5, not 1e-6)."""
    from specopd.train.loop import train

    train(_cfg(tmp_path / "local", backend="local", workers=1), progress=False)
    train(_cfg(tmp_path / "ray"), progress=False)
    ref, got = _weights(tmp_path / "local"), _weights(tmp_path / "ray")
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=0)
    prof = tmp_path / "ray" / "profile"
    s = json.loads((prof / "summary.json").read_text())
    assert {"worker0", "worker1"} <= set(s["workers"])
    assert {"prefill", "propose", "score", "loss_backward", "allreduce", "optimizer"} <= set(
        s["workers"]["worker1"]["phases"])
    assert s["gpu_activity_pct"] is None and "no GPU" in s["gpu_note"]
    assert (prof / "timeline.png").exists() and (prof / "trace.json").exists()


def test_split_roles_train_like_one_local_worker(ray_session, tmp_path):
    """runtime.roles=split: 1 target actor (prefill, trunk caches, packed scoring) + 1 drafter actor
    (proposals, loss, optimizer), 1 CPU each, end with the drafter of 1 colocated in-process worker."""
    from specopd.train.loop import train

    train(_cfg(tmp_path / "local", backend="local", workers=1), progress=False)
    train(_cfg(tmp_path / "split", "runtime.roles=split", workers=1), progress=False)
    ref, got = _weights(tmp_path / "local"), _weights(tmp_path / "split")
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=0)
    s = json.loads((tmp_path / "split" / "profile" / "summary.json").read_text())
    assert {"prefill", "score"} <= set(s["workers"]["target0"]["phases"])
    assert {"propose", "loss_backward", "optimizer"} <= set(s["workers"]["worker0"]["phases"])
    assert not {"prefill", "score"} & set(s["workers"]["worker0"]["phases"])


@pytest.mark.slow
def test_killed_worker_stops_the_run_and_resume_continues(ray_session, tmp_path, live_groups):
    from specopd.runs.checkpoint import complete_checkpoints
    from specopd.train.loop import train

    out = tmp_path / "run"
    killed = {}

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline:
            if complete_checkpoints(str(out)) and live_groups():
                g = live_groups()[0]
                killed["info"] = g.infos[1]
                ray.kill(g.actors[1])
                return
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    with pytest.raises(WorkerLostError) as ei:
        train(_cfg(out, "trainer.max_steps=200", "trainer.save_every=2"), progress=False)
    th.join()
    e = ei.value
    msg = str(e)
    assert e.rank == 1 and "worker rank 1" in msg
    assert killed["info"]["ip"] in msg and killed["info"]["node_id"] in msg
    assert "trainer.resume=auto" in msg and e.checkpoint is not None and e.checkpoint in msg
    assert live_groups() == []
    saved = complete_checkpoints(str(out))[-1][0]
    assert 2 <= saved < 200
    summary = train(_cfg(out, f"trainer.max_steps={saved + 2}", "trainer.resume=auto"), progress=False)
    assert summary["steps"] == saved + 2
    assert complete_checkpoints(str(out))[-1][0] == saved + 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in lines][-2:] == [saved + 1, saved + 2]


def test_dry_run_every_recipe(capsys):
    from specopd.cli import main

    recipes = sorted(glob.glob(os.path.join(os.path.dirname(RECIPE), "*.yaml")))
    assert len(recipes) >= 5
    for r in recipes:
        assert main(["train", r, "--dry-run"]) == 0, r
        text = capsys.readouterr().out
        assert "workers" in text, r


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_tensor_parallel_group_trains_like_one_local_worker(ray_session, tmp_path, kind, live_groups):
    """runtime.tensor_parallel=2: one data-parallel worker whose target is sharded over 2 Ray actors (gloo, a
    (dp, tp) DeviceMesh), its lm_head split by vocabulary (the vocabulary-parallel loss, the gathered sampler;
    DFlash V2: the merged top-K candidates and p at them), ends with the drafter of 1 unsharded in-process worker,
    up to fp32 rounding of the row-parallel and vocabulary sums (the tolerance of the data-parallel test above).
    Resuming its checkpoint unsharded (and the other way round) continues the run."""
    from specopd.train.loop import train

    tp2 = ["runtime.tensor_parallel=2", f"drafter.kind={kind}"]
    one = f"drafter.kind={kind}"
    def target_shard(w) -> dict:  # nested: Ray pickles it by value (tests/ is not on the actors' path)
        tp = w.target.tensor_parallel
        return {"params": sum(p.numel() for p in w.target.parameters()), "tp_rank": tp.rank, "tp_size": tp.size,
                "lm_head_rows": int(w.target.lm_head.weight.shape[0])}

    with RayGroup(_cfg(tmp_path / "g", *tp2, workers=1), Worker) as g:
        shards = [ray.get(a.run.remote(target_shard, ())) for a in g.actors]
    from specopd.models import load_target

    (path,) = glob.glob(str(tmp_path / "g" / "tiny-target-*"))
    full = sum(p.numel() for p in load_target(path).parameters())
    assert [(s["tp_rank"], s["tp_size"]) for s in shards] == [(0, 2), (1, 2)]
    assert all(s["params"] == shards[0]["params"] < full for s in shards)
    vocab = load_target(path).vocab_size
    assert [s["lm_head_rows"] for s in shards] == [vocab // 2] * 2  # runtime.tp_lm_head: auto splits it
    train(_cfg(tmp_path / "local", one, backend="local", workers=1), progress=False)
    train(_cfg(tmp_path / "tp", *tp2, workers=1), progress=False)
    ref, got = _weights(tmp_path / "local"), _weights(tmp_path / "tp")
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=0)
    # resume across tensor_parallel: the sharded run's checkpoint unsharded, the unsharded one sharded
    train(_cfg(tmp_path / "tp", "trainer.max_steps=5", "trainer.resume=auto", one, backend="local", workers=1),
          progress=False)
    train(_cfg(tmp_path / "local", "trainer.max_steps=5", "trainer.resume=auto", *tp2, workers=1),
          progress=False)
    ref, got = _weights(tmp_path / "local"), _weights(tmp_path / "tp")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=0)
    assert live_groups() == []
