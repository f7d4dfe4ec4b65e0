"""More than one node: a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, 1 CPU per node).

Checks one placement group per node, gradients synced across the nodes (with trainer.batch_invariant the
2-node run equals 1 in-process worker bit for bit), and that killing one node's worker processes gives
WorkerLostError naming the node, after which the run resumes. Also: a Ray run's output carries none of
Ray's own info lines. Slow (a cluster and its actors start in ~30 s on 2 cores)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from specopd.distributed import RayGroup, WorkerLostError  # noqa: E402
from specopd.runs import checkpoint as ck  # noqa: E402
from specopd.train import phases  # noqa: E402
from specopd.train.group import data_info, worker_state  # noqa: E402
from specopd.train.loop import train  # noqa: E402
from specopd.train.worker import Worker  # noqa: E402
from tiny_runs import tiny_recipe  # noqa: E402

INV = ["trainer.batch_invariant=true", "trainer.eval_heldout=false", "runtime.cpus_per_worker=1"]


def test_ray_output_is_quiet(tmp_path):
    """A fresh process starting its own Ray: no 'Token authentication' notice, no 'Started a local Ray'."""
    code = ("from specopd.train.loop import train; from tiny_runs import tiny_recipe; "
            f"train(tiny_recipe({str(tmp_path)!r}, ['runtime.backend=ray', 'trainer.max_steps=1', "
            "'trainer.eval_heldout=false', 'runtime.cpus_per_worker=1']), progress=False)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd()] + sys.path)}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert "Token authentication" not in text and "Started a local Ray instance" not in text, text[-2000:]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _cfg(out, *extra, backend="ray", workers=2):
    return tiny_recipe(str(out), INV + [f"runtime.backend={backend}", f"runtime.num_workers={workers}", *extra])


def test_one_placement_group_per_node_and_gradients_synced(cluster, tmp_path):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    from ray.util.placement_group import placement_group_table

    g = RayGroup(_cfg(tmp_path / "g"), Worker)
    try:
        assert len(g.pgs) == 2
        pg_nodes = []
        for pg in g.pgs:
            t = placement_group_table(pg)
            assert t["strategy"] == "STRICT_PACK" and len(t["bundles"]) == 1
            pg_nodes.append(set(t["bundles_to_node_id"].values()))
        assert pg_nodes[0] | pg_nodes[1] == nodes and not pg_nodes[0] & pg_nodes[1]  # one per node
        assert {i["node_id"] for i in g.infos} == nodes  # rank 0 and rank 1 on different nodes
        ids = data_info(g)["train_ids"][:4]
        start = worker_state(g)["drafter"]
        for step in range(2):
            g.run(phases.colocated_step, [(ids[:2], step, None), (ids[2:], step, None)])
        a, b = (s["drafter"] for s in g.run(Worker.state_dict, [(), ()]))
        assert all(torch.equal(a[k], b[k]) for k in a)  # the all-reduce crossed the nodes: replicas identical
        assert not all(torch.equal(a[k], start[k]) for k in a)  # and they did train
    finally:
        g.shutdown()
    # a whole run: 2 nodes == 1 in-process worker, bit for bit (batch-invariant reduction)
    train(_cfg(tmp_path / "local", backend="local", workers=1), progress=False)
    train(_cfg(tmp_path / "nodes"), progress=False)
    from safetensors.torch import load_file

    ref = load_file(os.path.join(ck.find_latest(str(tmp_path / "local")), "model.safetensors"))
    got = load_file(os.path.join(ck.find_latest(str(tmp_path / "nodes")), "model.safetensors"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    m1 = [json.loads(x)["loss"] for x in open(tmp_path / "local" / "metrics.jsonl")]
    m2 = [json.loads(x)["loss"] for x in open(tmp_path / "nodes" / "metrics.jsonl")]
    assert m1 == m2


def test_killing_one_nodes_workers_names_it_and_the_run_resumes(cluster, tmp_path, live_groups):
    out = tmp_path / "run"
    killed = {}

    def killer():
        deadline = time.time() + 300
        while time.time() < deadline:
            if ck.complete_checkpoints(str(out)) and live_groups():
                g = live_groups()[0]
                victim = next(i for i in g.infos if i["node_id"] != ray.get_runtime_context().get_node_id())
                killed.update(victim)
                os.kill(victim["pid"], signal.SIGKILL)  # the worker process on the second node
                return
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    with pytest.raises(WorkerLostError) as ei:
        train(_cfg(out, "trainer.max_steps=200", "trainer.save_every=2"), progress=False)
    th.join()
    e, msg = ei.value, str(ei.value)
    assert e.rank == killed["rank"] and f"worker rank {killed['rank']}" in msg
    assert killed["node_id"] in msg and "trainer.resume=auto" in msg and e.checkpoint in msg
    assert live_groups() == []
    saved = ck.complete_checkpoints(str(out))[-1][0]
    s = train(_cfg(out, f"trainer.max_steps={saved + 2}"), progress=False)
    assert s["steps"] == saved + 2
    lines = [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]
    assert lines == list(range(1, saved + 3))
