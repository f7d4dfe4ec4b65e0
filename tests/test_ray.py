"""Ray backend: real Ray actors on this machine's CPUs (2 cores: 2 workers x 1 CPU).

One Ray session for the module (ray.init takes ~4 s); every RayGroup joins it.
"""
import os

import pytest
import torch

ray = pytest.importorskip("ray")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from specopd.config import load_recipe  # noqa: E402
from specopd.distributed import ClusterTooSmallError, RayGroup, WorkerLostError  # noqa: E402

TINY = ["data.num_samples=12", "data.seq_len=24", "data.prompt_len=4", "data.batch_size=4", "data.heldout=0.2",
        "trainer.anchors_per_seq=3", "drafter.block_size=3", "trainer.max_steps=3", "trainer.eval_heldout=false"]


@pytest.fixture(scope="module")
def ray_session():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(tmp, *extra, backend="ray", workers=2):
    return load_recipe(None, TINY + [f"trainer.output_dir={tmp}", f"runtime.backend={backend}",
                                     f"runtime.num_workers={workers}", "runtime.cpus_per_worker=1", *extra])


def _steps(group, order, steps):
    """The controller's step (stage on every worker, global denominator, finish) on a fixed batch order."""
    n = group.num_workers
    for step in range(steps):
        ids = order[step]
        shares = [ids[r::n] for r in range(n)]
        staged = group.call("stage", [(s, step) for s in shares])
        denom = sum(x["branches"] for x in staged)
        group.call("finish", [(denom,)] * n)
    return group.broadcast("state_dict")


def test_cluster_too_small_is_an_error_not_a_hang(ray_session, tmp_path):
    cfg = _cfg(tmp_path, workers=3)
    with pytest.raises(ClusterTooSmallError, match=r"3 workers x \(1 CPU, 0 GPU\) = 3 CPU.*has 2 CPU"):
        RayGroup(cfg)
    cfg = _cfg(tmp_path, "runtime.gpus_per_worker=1", workers=1)
    with pytest.raises(ClusterTooSmallError, match="0 GPU"):
        RayGroup(cfg)


def test_two_ray_workers_match_one_local_worker(ray_session, tmp_path):
    from specopd.train.group import LocalGroup

    local = LocalGroup(_cfg(tmp_path, backend="local", workers=1))
    info = local.workers[0].data_info()
    tr = info["train_ids"]
    order = [tr[(4 * s) % len(tr):][:4] or tr[:4] for s in range(3)]
    ref = _steps(local, order, 3)[0]["drafter"]
    local.shutdown()

    group = RayGroup(_cfg(tmp_path))
    try:
        assert len({i["pid"] for i in group.infos}) == 2
        sds = _steps(group, order, 3)
        spans, _, note = group.profile_take()
    finally:
        group.shutdown()
    w0, w1 = sds[0]["drafter"], sds[1]["drafter"]
    init = LocalGroup(_cfg(tmp_path, backend="local", workers=1)).workers[0].drafter.state_dict()
    moved = 0
    for k in ref:
        torch.testing.assert_close(w0[k], w1[k], atol=0, rtol=0)  # replicas identical
        torch.testing.assert_close(w0[k], ref[k], atol=1e-6, rtol=1e-5)  # == one worker, whole batch
        moved += int(not torch.equal(ref[k], init[k]))
    assert moved > 0, "training did not change the drafter"
    assert {s[0] for s in spans} == {"worker0", "worker1"}
    assert {"prefill", "propose", "score", "loss_backward", "allreduce", "optimizer"} <= {s[1] for s in spans}
    assert note and "no GPU" in note
