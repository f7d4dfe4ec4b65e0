"""Packed trunk prefill (``target.prefill_batch``): one varlen pass over several trunks equals one prefill per
trunk (token ids, logits, features, every layer's cache) in fp32, for GQA and GDN hybrids; models with layers
that cannot run packed (qwen4_exp: QSA, PLE) fall back. "auto" packs on the CPU for bf16 / fp16 targets (fp32 stays per trunk). On the CPU the varlen attention is the per-trunk loop
and GDN runs per trunk: the flash-attn / torch varlen / fla paths are CUDA-only (benchmarks/gpu_check.sh)."""
import pytest
import torch

from kernel_check import kernel_modes
from oracle import make_tiny_checkpoint
from specopd.models import load_target
from specopd.tree import ProposalTree
from test_commit import assert_same_cache


@pytest.fixture(scope="module", params=kernel_modes())
def kernels(request):
    return request.param


def _ids(n, seed):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    ids[ids == 3] = 4
    return ids


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_packed_prefill_equals_one_by_one(model_type, kernels, tmp_path):
    target = load_target(make_tiny_checkpoint(model_type, tmp_path), kernels=kernels)
    trunks = [_ids(37, 0), _ids(1, 1), _ids(70, 2), _ids(16, 3)]  # one token; a chunk / checkpoint edge
    layers = (0, target.num_layers - 1)
    kw = dict(feature_layers=layers, gdn_checkpoint_every=16, keep_hidden=True)
    packed = target.prefill_batch(trunks, packed=True, **kw)
    assert target.packed_ok  # ran packed, no fallback
    singles = [target.prefill(t, **kw) for t in trunks]
    for got, ref in zip(packed, singles):
        assert_same_cache(got, ref)
    # the packed caches score and extend like the per-trunk ones
    tree = ProposalTree.pack([ProposalTree.from_branches([36, 0, 20], _ids(9, 4).view(3, 3)),
                              ProposalTree.from_branches([0], _ids(2, 5).view(1, 2))])
    got = target.score(tree, packed[:2])
    ref = target.score(tree, singles[:2])
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    ext = target.prefill(_ids(5, 6), cache=packed[2])
    assert_same_cache(ext, target.prefill(_ids(5, 6), cache=singles[2]))


def test_unpackable_model_falls_back(tmp_path):
    from test_models_qsa import perturb_ple_conv

    target = load_target(perturb_ple_conv(make_tiny_checkpoint("qwen4_exp_text", tmp_path)))
    trunks = [_ids(21, 7), _ids(9, 8)]
    out = target.prefill_batch(trunks, packed=True)
    assert target.packed_ok is False  # remembered: later calls go per trunk at once
    for got, t in zip(out, trunks):
        assert_same_cache(got, target.prefill(t))
    assert len(target.prefill_batch(trunks, packed=True)) == 2


def test_packed_auto_on_cpu_packs_bf16_only(tmp_path, monkeypatch):
    """fp32 on the CPU stays per trunk (bitwise independent of batch-mates); bf16 packs (M = sum T_i matmuls)."""
    for dtype, per_trunk in ((torch.float32, [5, 6]), (torch.bfloat16, [])):
        target = load_target(make_tiny_checkpoint("llama", tmp_path), dtype=dtype)
        calls = []
        real = target.prefill
        monkeypatch.setattr(target, "prefill", lambda t, real=real, calls=calls, **kw: calls.append(len(t)) or real(t, **kw))
        target.prefill_batch([_ids(5, 0), _ids(6, 1)])
        assert calls == per_trunk and target.packed_ok, dtype
        target.prefill_batch([_ids(5, 0), _ids(6, 1)], packed=False)
        assert calls == per_trunk + [5, 6], dtype
    with pytest.raises(ValueError, match="packed must be"):
        target.prefill_batch([_ids(5, 0), _ids(6, 1)], packed="yes")
