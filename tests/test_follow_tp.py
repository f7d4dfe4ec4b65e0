"""A policy swapped into a tensor-parallel target in place (``Worker.swap_policy`` with runtime.tensor_parallel > 1,
specopd/follow/DESIGN.md): over two gloo ranks, a shard of version 0 given version 1's full weights (a folder, or a
state dict with Hugging Face names) holds bitwise the parameters of a fresh shard of version 1 in the same tensors,
and so scores, prefills and gives the fused loss of the step bitwise as that fresh shard does, and as the unsharded
version 1 within fp32 reduction noise: GQA with tied embeddings (llama), Gated DeltaNet's permuted rows in both
projection layouts (qwen3_next fused; qwen3_5 MoE unfused, with its expert blocks and shared expert), the lm_head
split by vocabulary and whole. And (slow) a ``DrafterFollower`` with runtime.tensor_parallel=2 follows two versions
as one unsharded worker does."""
import pytest
import torch

import tp_ranks
from oracle import make_tiny_checkpoint

TOL = 1e-5
FAMILIES = ("llama", "qwen3_next", "qwen3_5_moe_text")


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-swap")
    cases = [(name, make_tiny_checkpoint(name, tmp / name, seed=0), make_tiny_checkpoint(name, tmp / name, seed=1))
             for name in FAMILIES]
    out = str(tmp / "out.json")
    return tp_ranks.spawn(tp_ranks.run_swap, (str(tmp / "init"), cases, out), out)


@pytest.mark.parametrize("head", ["vocab_parallel", "replicated"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_swapped_shard_equals_a_fresh_shard_of_the_new_version(swapped, family, head):
    r = swapped[f"{family}/{head}"]
    assert r["sharded"], "the target is not sharded: the test would not test a shard"
    assert r["outputs_as_version_0"] == [], "outputs the swap did not change (version 1 must differ from 0)"
    assert r["params_unequal_fresh"] == [], "parameters that differ from a fresh shard of version 1"
    assert r["outputs_unequal_fresh"] == [], "outputs (prefill, score, fused loss) that differ from a fresh shard"
    assert r["in_place"], "the swap replaced parameter tensors instead of copying into them"
    assert r["dtensor_params"] == []
    bad = {k: v for k, v in r["err_unsharded"].items() if not v <= TOL}
    assert bad == {}, f"swapped shard vs unsharded version 1: rel err above {TOL}: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_swap_that_does_not_fit_the_full_target_is_refused_before_any_copy(swapped, family):
    """A shard's own local weights given as the new ones, a tensor of another shape: ValueErrors naming the tensor
    and the unsharded shape expected; the shard's weights are untouched."""
    r = swapped[f"{family}/vocab_parallel"]
    assert "the target's (unsharded) is" in r["refused_local"]
    assert "has shape" in r["refused_shape"] and "expected" in r["refused_shape"]
    assert r["untouched_by_refusals"]


@pytest.mark.slow  # Ray and two actors (tens of seconds); the swap itself is tested over gloo above
def test_a_follower_with_a_sharded_target_follows_like_one_worker(tmp_path):
    """runtime.tensor_parallel=2 (two Ray actors, gloo): the first version swapped in when the workers start, the
    second into the running shards; each version's held-out AL before and after its training step equals that of
    one unsharded in-process worker, up to fp32 rounding of the row-parallel and vocabulary sums."""
    from test_follow import followed, ray_running

    with ray_running():
        one = followed(tmp_path / "one", "runtime.backend=local", "runtime.num_workers=1")
        tp = followed(tmp_path / "tp", "runtime.backend=ray", "runtime.num_workers=1", "runtime.tensor_parallel=2")
    assert tp == pytest.approx(one, rel=1e-5, abs=1e-6)
    assert one[2] != one[1]  # version 2's policy changes the AL the drafter gets
