"""The memory plan: terms against a hand computation (tiny llama), cache terms against real prefill caches
(gqa, gdn, qsa + PLE conv), the three 8-GPU recipes fit 80 GB, clear errors (plan too large, chunk size
below 1, unknown shape) and the CLI dry run."""
import math
import os

import pytest
import torch

from specopd.cli import main
from specopd.config import RecipeError, load_recipe
from specopd.losses import CHUNK_WORKSET_FACTOR
from specopd.memory import (DEFAULT_DEVICE_BYTES, MEMORY_PHASES, MemoryPlanError, analyse_target, check_memory,
                            memory_plan, target_shape, trunk_cache_bytes)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES_8GPU = ["qwen3-8b-dflash-8gpu.yaml", "qwen3.5-27b-dflash-8gpu.yaml", "qwen4-exp-dflash-8gpu.yaml",
                "qsa-gdn-125b-dflash2-8gpu.yaml"]


def _tiny(tmp_path, *overrides, target="tiny:llama"):
    return load_recipe(None, [f"model.target={target}", f"trainer.output_dir={tmp_path}", *overrides])


def _term(plan, name):
    return next(t for t in plan.terms if t.name == name).bytes


def test_plan_terms_by_hand(tmp_path):
    """tiny llama: V=256, D=64, 2 layers, 4 heads / 2 KV heads of 16, MLP 128, untied; fp32 on the CPU."""
    cfg = _tiny(tmp_path, "data.batch_size=6", "runtime.num_workers=2", "data.seq_len=40", "data.prompt_len=8",
                "trainer.anchors_per_seq=5", "drafter.block_size=4", "drafter.num_layers=1",
                "trainer.loss_chunk_rows=7", "drafter.feature_layers=[0, 1]")
    p = memory_plan(cfg, device_bytes=10**9)
    V, D, L, H, KV, hd, I = 256, 64, 2, 4, 2, 16, 128
    attn = D * H * hd + 2 * D * KV * hd + H * hd * D  # q, k, v, o (llama: no q/k norms)
    target = 2 * V * D + L * (attn + 3 * D * I + 2 * D) + D
    assert p.sizes["target_params"] == target and _term(p, "target weights") == 4 * target
    S, T, N, W = 3, 40, 15, 3  # ceil(6 / 2) sequences per GPU, 3 x 5 branches of block_size - 1 = 3 drafted tokens
    assert (p.sizes["sequences_per_gpu"], p.sizes["branches"]) == (S, N)
    assert _term(p, "trunk caches") == S * (L * 2 * T * KV * hd * 4 + T * D * 4)  # K/V + final hidden, fp32
    assert _term(p, "drafter features") == S * T * 2 * D * 4
    assert _term(p, "target side hp") == N * W * D * 4
    assert _term(p, "loss / sampling chunk") == CHUNK_WORKSET_FACTOR * 7 * V * 4
    # the drafter: fc (2 D -> D), hidden_norm, mask vector, one layer (target-sized attention + MLP, 2 norms),
    # final norm; fp32 weights, 2 AdamW moments, gradients
    drafter = 2 * D * D + D + D + (attn + 2 * hd + 3 * D * I + 2 * D) + D  # + the drafter's q/k norms
    assert p.sizes["drafter_params"] == drafter
    assert _term(p, "drafter weights (fp32)") == 4 * drafter
    assert _term(p, "drafter AdamW state") == 8 * drafter
    assert _term(p, "drafter gradients (fp32)") == 4 * drafter
    # phases: the sum of the terms alive in each; the peak is the largest phase
    pb = p.phase_bytes()
    assert pb["optimizer"] == 4 * target + 16 * drafter + 8 * drafter  # weights, drafter + AdamW + grads, temps
    assert p.peak == max(pb.values()) and p.fits
    assert "CUDA runtime" not in [t.name for t in p.terms]  # a CPU recipe


@pytest.mark.parametrize("target", ["tiny:llama", "tiny:qwen3_next", "tiny:qwen4_exp"])
def test_cache_terms_equal_real_prefill_caches(tmp_path, target):
    """The plan's per-mixer cache sizes equal what the executors store (gqa / gdn / qsa / PLE conv)."""
    from specopd.models import load_target
    from specopd.models.tiny import resolve_target_path

    cfg = _tiny(tmp_path, "model.gdn_checkpoint_every=8", target=target)
    model = load_target(resolve_target_path(cfg.model, str(tmp_path)))
    info = analyse_target(target_shape(cfg)[0], "float32")
    for t in (37, 40):  # not / a multiple of C
        ids = torch.randint(0, model.vocab_size, (t,), generator=torch.Generator().manual_seed(t))
        cache = model.prefill(ids, gdn_checkpoint_every=8)
        planned = sum(trunk_cache_bytes(m, t, 8, 4)[0] for m in info.mixers)
        assert planned == cache.nbytes(), (target, t, planned, cache.nbytes())
    kinds = {type(m).kind for m in info.mixers}
    assert kinds == {"llama": {"gqa"}, "qwen3_next": {"gdn", "gqa"}, "qwen4_exp": {"gdn", "qsa", "conv"}}[target[5:]]


H200_BYTES = 141 * 10**9
# the GPU each 8-GPU recipe is planned for: qwen4_exp's 512 experts need two H200s per target
DEVICE_OF = {"qwen4-exp-dflash-8gpu.yaml": H200_BYTES, "qsa-gdn-125b-dflash2-8gpu.yaml": H200_BYTES}


@pytest.mark.parametrize("recipe", RECIPES_8GPU)
def test_8gpu_recipes_fit_their_gpu(recipe):
    cfg = load_recipe(os.path.join(ROOT, "recipes", recipe))
    dev = DEVICE_OF.get(recipe, DEFAULT_DEVICE_BYTES)
    p = check_memory(cfg, device_bytes=dev)
    assert p is not None and p.fits and p.peak <= dev
    assert p.shape_source.startswith("recipe model.shape")
    assert p.sizes["vocab"] in (151_936, 248_320) and p.device_bytes == dev
    assert set(p.phase_bytes()) == set(MEMORY_PHASES)
    assert p.sizes["branches"] >= 256  # paper scale: hundreds of branches per GPU


def test_tensor_parallel_plans_one_ranks_shard():
    """runtime.tensor_parallel=2 halves the sharded weights (attention, GDN, MLP and expert blocks, lm_head by
    vocabulary unless runtime.tp_lm_head=replicated; embeddings, norms and the indexer stay whole) and the
    per-layer caches, and refuses a count that does not divide the key/value heads."""
    path = os.path.join(ROOT, "recipes", "qwen4-exp-dflash-8gpu.yaml")
    one = check_memory(load_recipe(path, ["runtime.tensor_parallel=1"]), device_bytes=10**15)
    two = check_memory(load_recipe(path), device_bytes=10**15)
    w1, w2 = one.terms[0].bytes, two.terms[0].bytes
    assert one.terms[0].name == two.terms[0].name == "target weights"
    assert 0.5 * w1 < w2 < 0.55 * w1
    rep = check_memory(load_recipe(path, ["runtime.tp_lm_head=replicated"]), device_bytes=10**15)
    v, d = one.sizes["vocab"], one.sizes["hidden"]
    assert (one.sizes["lm_head_rows"], rep.sizes["lm_head_rows"], two.sizes["lm_head_rows"]) == (v, v, v // 2)
    assert two.sizes["lm_head_bytes"] == v // 2 * d * 2  # bf16
    assert rep.terms[0].bytes - two.terms[0].bytes == v // 2 * d * 2
    assert any("V / 2 rows (runtime.tp_lm_head=vocab_parallel)" in n for n in two.notes)
    assert [t.name for t in two.terms if "chunk" in t.name] == ["loss chunk", "sampling chunk"]
    c1, c2 = [sum(t.bytes for t in plan.terms if t.name == "trunk caches") for plan in (one, two)]
    assert c2 < 0.6 * c1
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not divide over runtime.tensor_parallel = 4"):
        check_memory(load_recipe(path, ["runtime.tensor_parallel=4"]), device_bytes=10**15)



def test_dflash2_plans_the_split_lm_head():
    """DFlash V2 splits the lm_head by vocabulary too (auto): one rank of the 125B recipe holds V / 4 rows, and its
    one chunk term (the candidates' top K and p at them, no gathered sampler) is planned at V / 4 columns."""
    path = os.path.join(ROOT, "recipes", "qsa-gdn-125b-dflash2-8gpu.yaml")
    four = check_memory(load_recipe(path), device_bytes=10**15)
    rep = check_memory(load_recipe(path, ["runtime.tp_lm_head=replicated"]), device_bytes=10**15)
    v, d = four.sizes["vocab"], four.sizes["hidden"]
    assert (four.sizes["lm_head_rows"], rep.sizes["lm_head_rows"]) == (v // 4, v)
    assert rep.terms[0].bytes - four.terms[0].bytes == (v - v // 4) * d * 2  # bf16
    assert any("V / 4 rows (runtime.tp_lm_head=vocab_parallel)" in n for n in four.notes)
    chunks = [t for t in four.terms if "chunk" in t.name]
    assert [t.name for t in chunks] == ["loss / sampling chunk"] and "V / 4" in chunks[0].how
    assert four.peak < rep.peak

def test_plan_larger_than_device_is_a_clear_error():
    cfg = load_recipe(os.path.join(ROOT, "recipes", RECIPES_8GPU[0]), ["data.batch_size=256"])
    with pytest.raises(MemoryPlanError, match="data.batch_size|trainer.anchors_per_seq") as e:
        check_memory(cfg, device_bytes=DEFAULT_DEVICE_BYTES)
    assert "--dry-run" in str(e.value) and "GiB" in str(e.value)
    # a GPU too small for the weights alone says so
    with pytest.raises(MemoryPlanError, match="fixed by the model"):
        check_memory(cfg, device_bytes=8 * 10**9)
    # the GDN checkpoint interval is to be raised, not lowered
    cfg = load_recipe(os.path.join(ROOT, "recipes", RECIPES_8GPU[1]), ["model.gdn_checkpoint_every=4"])
    p = memory_plan(cfg, device_bytes=DEFAULT_DEVICE_BYTES)
    assert not p.fits and any(a.startswith("raise model.gdn_checkpoint_every") for a in p.advice())


def test_train_checks_the_plan_before_any_work(tmp_path, monkeypatch):
    """train() refuses a step larger than the device before building the target or any worker."""
    import specopd.memory
    from specopd.train.loop import train

    monkeypatch.setattr(specopd.memory, "device_memory", lambda cfg: (1 << 20, "a 1 MiB test device"))
    out = tmp_path / "run"
    with pytest.raises(MemoryPlanError, match="1 MiB test device") as e:
        train(_tiny(out, "trainer.max_steps=1"), progress=False)
    assert "--dry-run" in str(e.value)
    assert not any(n.startswith("tiny-target") for n in os.listdir(out))  # nothing was built


def test_growth_is_linear_in_branches_and_chunk_sized_in_vocab(tmp_path):
    """Doubling anchors doubles the branch terms; the vocabulary reaches the step only through the weights and
    the loss chunk (fixed rows), never through an [N, W, V] term."""
    base = ["data.batch_size=2", "data.seq_len=64", "trainer.loss_chunk_rows=16", "model.device=cuda"]  # GPU plan
    p1, p2, p3 = (memory_plan(_tiny(tmp_path, *base, f"trainer.anchors_per_seq={b}"), device_bytes=10**10)
                  for b in (8, 16, 24))
    assert _term(p2, "target side hp") == 2 * _term(p1, "target side hp")
    a, b, c = (_term(p, "drafter activations") for p in (p1, p2, p3))
    assert c - b == b - a > 0  # affine in N: the context (once per trunk) + N x per branch
    # the scoring pass is affine in N too: the gqa executor visits one query block of the tree-attention plan at a
    # time (no [Mi, T + Mi] tree mask, which made it quadratic in the branches of one trunk)
    a, b, c = (_term(p, "scoring pass") for p in (p1, p2, p3))
    assert c - b == b - a > 0
    for name in ("loss / sampling chunk", "trunk caches", "drafter features"):
        assert _term(p2, name) == _term(p1, name)
    pv = memory_plan(_tiny(tmp_path, *base, "trainer.anchors_per_seq=8", "model.tiny={vocab_size: 4096}"),
                     device_bytes=10**10)
    grow = {t.name: _term(pv, t.name) - t.bytes for t in p1.terms}
    changed = {k for k, v in grow.items() if v}
    assert changed <= {"target weights", "loss / sampling chunk"}, changed
    assert grow["loss / sampling chunk"] == CHUNK_WORKSET_FACTOR * 16 * (4096 - 256) * 4


def test_loss_chunk_rows_validation(tmp_path):
    for bad in ("0", "-4", "1.5", "lots"):
        with pytest.raises(RecipeError, match="trainer.loss_chunk_rows"):
            _tiny(tmp_path, f"trainer.loss_chunk_rows={bad}")
    assert _tiny(tmp_path, "trainer.loss_chunk_rows=64").trainer.loss_chunk_rows == 64
    p = memory_plan(_tiny(tmp_path, "trainer.loss_chunk_rows=auto"), device_bytes=10**10)
    assert p.sizes["chunk_rows"] >= 1


def test_unknown_shape_and_bad_shape(tmp_path):
    cfg = load_recipe(os.path.join(ROOT, "recipes", RECIPES_8GPU[0]), [f"model.target={tmp_path}/absent"])
    import dataclasses

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, shape={}))
    assert memory_plan(cfg) is None and check_memory(cfg) is None
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, shape={"model_type": "qwen3", "vocab_size": 8}))
    with pytest.raises(ValueError, match="model.shape|lacks"):
        memory_plan(bad)
    alien = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, shape={"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        memory_plan(alien)


def test_cli_dry_run_prints_terms_and_advice(tmp_path, capsys):
    recipe = os.path.join(ROOT, "recipes", RECIPES_8GPU[1])
    rc = main(["train", recipe, "--dry-run", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("target weights", "gdn state checkpoints", "scoring pass", "drafter activations",
                 "loss / sampling chunk"):
        assert name in out
    assert "fits" in out and "peak" in out
    import json

    mem = json.load(open(tmp_path / "p.json"))["memory"]
    assert mem["fits"] and mem["peak"] == max(mem["phases"].values())
    rc = main(["train", os.path.join(ROOT, "recipes", RECIPES_8GPU[1]), "--dry-run", "data.batch_size=64"])
    out = capsys.readouterr().out
    assert rc == 0 and "DOES NOT FIT" in out and "lower data.batch_size" in out
    rc = main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), "--dry-run", f"trainer.output_dir={tmp_path}"])
    assert rc == 0 and "host RAM" in capsys.readouterr().out


def test_split_roles_plan_each_gpu(tmp_path):
    p = memory_plan(_tiny(tmp_path, "runtime.roles=split", "runtime.num_workers=2"), device_bytes=10**10)
    rp = p.role_peaks()
    assert set(rp) == {"target", "drafter"}
    assert rp["target"][1] in ("prefill", "score") and rp["drafter"][1] in ("propose", "loss_backward", "optimizer")
    assert p.peak == max(b for b, _ in rp.values())
    assert math.isclose(p.peak, max(p.phase_bytes().values()))


def test_one_forward_activations_span_propose_to_loss(tmp_path):
    """The step's one drafter forward (with grad) is planned from propose to the loss: through the scoring pass
    when colocated, on the drafter GPU only with split roles; Draft-OPD drafts without grad (its forward with grad
    is in the loss phase)."""
    def term(*ov):
        p = memory_plan(_tiny(tmp_path, *ov), device_bytes=10**10)
        return next(t for t in p.terms if t.name == "drafter activations"), p

    col, p = term()
    assert col.phases == ("propose", "score", "loss_backward") and "drafter forward (no grad)" not in [t.name for t in p.terms]
    split, p = term("runtime.roles=split")
    assert split.phases == ("propose", "loss_backward") and split.bytes == col.bytes
    assert p.role_peaks()["target"][0] == max(p.phase_bytes()[k] for k in ("prefill", "score"))
    opd, p = term("trainer.method=draft_opd")
    assert opd.phases == ("loss_backward",) and "drafter forward (no grad)" in [t.name for t in p.terms]


def test_cache_trunks_is_planned_and_named(tmp_path):
    """trainer.cache_trunks keeps every training sequence's features + hidden on every worker: planned from the
    data size, and named (turn off) when it does not fit."""
    base = ["trainer.method=offpolicy_ce", "data.seq_len=40", "data.prompt_len=8", "drafter.feature_layers=[0, 1]"]
    p = memory_plan(_tiny(tmp_path, *base, "data.num_samples=100", "trainer.cache_trunks=true"), device_bytes=10**9)
    assert _term(p, "kept trunks (cache_trunks)") == 100 * 40 * (2 + 1) * 64 * 4  # tiny llama: D = 64, fp32
    assert "kept trunks (cache_trunks)" not in [t.name for t in memory_plan(_tiny(tmp_path, *base),
                                                                           device_bytes=10**9).terms]
    big = memory_plan(_tiny(tmp_path, *base, "data.num_samples=400000", "trainer.cache_trunks=true"),
                      device_bytes=10**9)
    assert not big.fits and any(a.startswith("turn off trainer.cache_trunks") for a in big.advice())
