"""A target sharded over two gloo ranks (``load_target(..., tensor_parallel=)``) gives the unsharded target's
plain forward, prefill (logits, features, hidden), tree scores, verify + commit and the next round within fp32
reduction noise, for every family: GQA (llama with tied embeddings, qwen3), Gated DeltaNet in both projection
layouts (qwen3_next fused, qwen3_5 unfused), MoE with a shared expert, and qwen4_exp's QSA + GDN + PLE."""
import json

import pytest
import torch
import torch.multiprocessing as mp

import tp_ranks
from oracle import _MOE, make_tiny_checkpoint

TOL = 1e-5
FAMILIES = {"llama": {}, "qwen3": {}, "qwen3_next": {}, "qwen3_next-moe": _MOE, "qwen3_5_text": {},
            "qwen3_5_moe_text": {}, "qwen4_exp_text": {}}


def _run(tmp_path_factory, device: str) -> dict:
    tmp = tmp_path_factory.mktemp(f"tp-{device}")
    cases = []
    for name, over in FAMILIES.items():
        path = make_tiny_checkpoint(name.split("-")[0], tmp / name, **over)
        if name == "qwen4_exp_text":
            from tests.test_models_qsa import perturb_ple_conv
            perturb_ple_conv(path)
        cases.append((name, path))
    out = str(tmp / "out.json")
    mp.start_processes(tp_ranks.run, args=(2, str(tmp / "init"), cases, out, device), nprocs=2,
                       start_method="spawn")
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run(tmp_path_factory, "cpu")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_equal_one(results, family):
    r = results[family]
    bad = {k: v for k, v in r["err"].items() if not v <= TOL}
    assert bad == {}, f"{family}: sharded vs unsharded rel err above {TOL}: {bad}"
    n_full, n_shard = r["params"]
    assert n_shard < 0.8 * n_full, f"{family}: a rank holds {n_shard} of {n_full} parameters"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_equal_one(tmp_path_factory):
    """The same on two GPUs over NCCL (fp32, kernels "auto": Triton and fla on CUDA)."""
    res = _run(tmp_path_factory, "cuda")
    bad = {(f, k): v for f, r in res.items() for k, v in r["err"].items() if not v <= TOL}
    assert bad == {}, f"sharded vs unsharded rel err above {TOL} on CUDA: {bad}"
