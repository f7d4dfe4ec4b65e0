"""A target sharded over two gloo ranks (``load_target(..., tensor_parallel=)``) gives the unsharded target's
plain forward, prefill (logits, features, hidden), tree scores, verify + commit and the next round within fp32
reduction noise, for every family: GQA (llama with tied embeddings, qwen3), Gated DeltaNet in both projection
layouts (qwen3_next fused, qwen3_5 unfused), MoE with a shared expert, and qwen4_exp's QSA + GDN + PLE.
The fused losses and the branch sampler over a vocabulary split across two ranks give the whole vocabulary's loss,
alpha, nll and gradients (the same bits on both ranks) and its tokens. Each runs over gloo on the CPU, and its
``gpu`` twin the same cases over NCCL on two GPUs (skipped with fewer)."""
import pytest
import torch

import tp_ranks
from oracle import _MOE, make_tiny_checkpoint

TOL = 1e-5
FAMILIES = {"llama": {}, "qwen3": {}, "qwen3_next": {}, "qwen3_next-moe": _MOE, "qwen3_5_text": {},
            "qwen3_5_moe_text": {}, "qwen4_exp_text": {}}


def two_gpus(test):
    """A ``gpu`` twin: NCCL over two GPUs, skipped with fewer (benchmarks/gpu_check.sh runs ``-m gpu``)."""
    return pytest.mark.gpu(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")(test))


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
    return tp_ranks.spawn(tp_ranks.run, (str(tmp / "init"), cases, out, device), out)


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


@two_gpus
def test_two_gpus_equal_one(tmp_path_factory):
    """The same on two GPUs over NCCL (fp32, kernels "auto": Triton and fla on CUDA)."""
    res = _run(tmp_path_factory, "cuda")
    bad = {(f, k): v for f, r in res.items() for k, v in r["err"].items() if not v <= TOL}
    assert bad == {}, f"sharded vs unsharded rel err above {TOL} on CUDA: {bad}"


def _run_loss(tmp_path_factory, device: str) -> dict:
    tmp = tmp_path_factory.mktemp(f"tp-loss-{device}")
    out = str(tmp / "out.json")
    return tp_ranks.spawn(tp_ranks.run_loss, (str(tmp / "init"), out, 96, device), out)


@pytest.fixture(scope="module")
def loss_results(tmp_path_factory):
    return _run_loss(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def loss_results_cuda(tmp_path_factory):
    return _run_loss(tmp_path_factory, "cuda")


def _check_loss(res, case):
    err = res["loss"][case]
    bad = {k: v for k, v in err.items() if not v <= TOL}
    assert bad == {}, f"{case}: vocabulary-parallel vs whole rel err above {TOL}: {bad}"
    assert res["same_on_ranks"][case], f"{case}: the ranks' losses or gradients differ"


def _check_sampler(res):
    bad = {k: v for k, v in res["sampler"].items() if not all(v.values())}
    assert bad == {}, f"gathered sampling differs from the whole vocabulary's or between ranks: {bad}"


@pytest.mark.parametrize("case", list(tp_ranks.LOSS_CASES))
def test_vocab_parallel_loss_equals_whole(loss_results, case):
    """fused_e2e_tv / fused_ce at T = 1, 0.7, 0.5, 1.3 and greedy (ties across ranks too), with the CE term, DSpark's
    Markov term, cut and empty branches, one row, one and several chunks: loss, alpha, nll and the gradients of hq,
    e and W2 within 1e-5 of the whole vocabulary's, and the same bits on both ranks."""
    _check_loss(loss_results, case)


@pytest.mark.parametrize("case", list(tp_ranks.LOSS_CASES))
@two_gpus
def test_vocab_parallel_loss_equals_whole_on_two_gpus(loss_results_cuda, case):
    """The same over NCCL on two GPUs (fp32, kernels "auto")."""
    _check_loss(loss_results_cuda, case)


ARGMAX_OK = {"equal_whole": True, "equal_full_logits": True, "tie_to_lower": True, "equal_logits_to_0": True}


def test_vocab_parallel_target_argmax_equals_whole(loss_results):
    """trainer.ce_labels=target over a split vocabulary: the labels equal the whole vocabulary's argmax, a tie
    between two ranks' blocks goes to the lower index and a row of equal logits to token 0."""
    assert loss_results["target_argmax"] == ARGMAX_OK


@two_gpus
def test_vocab_parallel_target_argmax_on_two_gpus(loss_results_cuda):
    assert loss_results_cuda["target_argmax"] == ARGMAX_OK


def test_vocab_parallel_sampler_draws_the_whole_vocabularys_tokens(loss_results):
    _check_sampler(loss_results)


@two_gpus
def test_vocab_parallel_sampler_on_two_gpus(loss_results_cuda):
    _check_sampler(loss_results_cuda)


def test_vocab_parallel_refuses_a_vocabulary_the_group_does_not_divide():
    from specopd.models.common import Linear
    from specopd.models.tensor_parallel import TensorParallel, VocabParallelHead, vocab_group

    head = Linear(4, 49, bias=False)
    head.__class__ = VocabParallelHead
    head.tp, head.full_vocab = TensorParallel.planned(2, shard_vocab=True), 97
    with pytest.raises(ValueError, match="vocab_size = 97 does not divide .* runtime.tp_lm_head=replicated"):
        vocab_group(head)
    head.full_vocab = 98
    assert vocab_group(head) is head.tp


def test_tp_lm_head_recipe_key():
    """auto splits the head for every drafter kind (DFlash V2 too: its candidates are merged over the ranks), and
    replicated, N = 1 or an unknown value keep it whole or are refused."""
    from specopd.config import RecipeError, load_recipe, vocab_parallel_head

    ray = ["runtime.backend=ray", "runtime.tensor_parallel=2"]
    assert vocab_parallel_head(load_recipe(None, ray))
    assert vocab_parallel_head(load_recipe(None, ray + ["drafter.kind=dspark"]))
    assert vocab_parallel_head(load_recipe(None, ray + ["drafter.kind=dflash2"]))
    assert vocab_parallel_head(load_recipe(None, ray + ["drafter.kind=dflash2", "runtime.tp_lm_head=vocab_parallel"]))
    assert not vocab_parallel_head(load_recipe(None, ray + ["runtime.tp_lm_head=replicated"]))
    assert not vocab_parallel_head(load_recipe(None, ["runtime.tp_lm_head=vocab_parallel"]))  # N = 1: whole
    with pytest.raises(RecipeError, match="tp_lm_head"):
        load_recipe(None, ["runtime.tp_lm_head=gathered"])


def test_v2_drafter_refuses_a_vocabulary_the_group_does_not_divide(tmp_path):
    """A DFlash V2 drafter on a head split in unequal blocks is refused naming runtime.tp_lm_head=replicated."""
    from specopd.drafters import build_drafter
    from specopd.models import load_target
    from specopd.models.tensor_parallel import TensorParallel, VocabParallelHead

    target = load_target(make_tiny_checkpoint("llama", tmp_path, num_hidden_layers=2, vocab_size=97, hidden_size=32,
                                              intermediate_size=48))
    head = target.lm_head
    head.__class__ = VocabParallelHead
    head.tp, head.full_vocab = TensorParallel.planned(2, shard_vocab=True), 97
    with pytest.raises(ValueError, match="vocab_size = 97 does not divide .* runtime.tp_lm_head=replicated"):
        build_drafter("dflash2", target, num_layers=1, block_size=4, seed=0, feature_layers=[1])


def _run_v2(tmp_path_factory, device: str) -> dict:
    tmp = tmp_path_factory.mktemp(f"tp-v2-{device}")
    path = make_tiny_checkpoint("llama", tmp / "llama", num_hidden_layers=3, vocab_size=96, hidden_size=32,
                                intermediate_size=48)
    out = str(tmp / "out.json")
    return tp_ranks.spawn(tp_ranks.run_v2, (str(tmp / "init"), path, out, device), out)


@pytest.fixture(scope="module")
def v2_results(tmp_path_factory):
    return _run_v2(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def v2_results_cuda(tmp_path_factory):
    return _run_v2(tmp_path_factory, "cuda")


def _check_v2_topk(res):
    assert res["split_head"]
    for name, r in res["topk"].items():
        assert r["ids_equal"] and r["ids_stable_sort"], f"{name}: candidate ids differ: {r}"
        assert r["vals"] <= TOL and r["dh"] <= TOL, f"{name}: {r}"


def _check_v2_candidate_p(res):
    for name, r in res["candidate_p"].items():
        assert r["rel"] <= TOL and r["equal"], f"{name}: {r}"
        assert r["hits"] > 0, f"{name}: no candidate carries p"


def _check_v2_loss(res, case):
    err = res["loss"][case]
    bad = {k: v for k, v in err.items() if not v <= TOL}
    assert bad == {}, f"{case}: split vs whole lm_head rel err above {TOL}: {bad}"
    assert all(res["flags"][case].values()), f"{case}: {res['flags'][case]}"
    assert res["same_on_ranks"][case], f"{case}: the ranks' losses or gradients differ"


def test_v2_top_candidates_over_a_split_vocabulary(v2_results):
    """DFlash V2's top-K over the vocabulary split across two ranks: the whole vocabulary's ids bit for bit (random
    logits; integer logits with ties inside a block and across the boundary; K above V / N), in the order of a
    stable descending sort of the whole row (value, then the smaller id), its values and dh within 1e-5."""
    _check_v2_topk(v2_results)


def test_v2_candidate_p_over_a_split_vocabulary(v2_results):
    """candidate_p over the split vocabulary: T = 1 and 0.5 within 1e-5, greedy (also every logit tied: the argmax
    is id 0, on rank 0) bit for bit, masked rows 0."""
    _check_v2_candidate_p(v2_results)


@pytest.mark.parametrize("case", list(tp_ranks.V2_CASES))
def test_v2_loss_over_a_split_vocabulary(v2_results, case):
    """The worker's DFlash V2 loss on two ranks with the lm_head split by vocabulary (E2E-TV at T = 1, 0.5 with
    the CE term, greedy, off-policy CE, one row, cut and empty branches; multiplier and soft cap set): the same
    candidates and walk as the whole head, loss, alpha, nll and every drafter weight's gradient within 1e-5, the
    same bits on both ranks."""
    _check_v2_loss(v2_results, case)


@two_gpus
def test_v2_top_candidates_on_two_gpus(v2_results_cuda):
    """The same over NCCL on two GPUs (fp32, kernels "auto")."""
    _check_v2_topk(v2_results_cuda)


@two_gpus
def test_v2_candidate_p_on_two_gpus(v2_results_cuda):
    _check_v2_candidate_p(v2_results_cuda)


@pytest.mark.parametrize("case", list(tp_ranks.V2_CASES))
@two_gpus
def test_v2_loss_on_two_gpus(v2_results_cuda, case):
    _check_v2_loss(v2_results_cuda, case)
