"""qwen4_exp (QSA + GDN, hyper-connections, PLE, MoE): our model against transformers' own, and the
vectorised QSA selection against the per-query sequential reference (kernels/qsa/naive.py)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specopd_kernels.qsa.naive import sequential_attention, sequential_selection
from specopd.models import load_target
from specopd.models.qwen4_exp import select_groups
from tests.oracle import hf_logits, load_hf, make_tiny_checkpoint, rel_err

T = 160  # > budget + 3 = 19 visible tokens: selection is sparse for most queries


def perturb_ple_conv(path: str, seed: int = 5) -> str:
    """transformers initialises PLE's dilated conv to zero; give it weights (in every shard) so it is tested."""
    g = torch.Generator().manual_seed(seed)
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            fp = os.path.join(path, f)
            sd = load_file(fp)
            hit = [k for k in sd if k.endswith("ple.conv1d.weight")]
            for k in hit:
                sd[k] = 0.3 * torch.randn(sd[k].shape, generator=g)
            if hit:
                save_file(sd, fp, metadata={"format": "pt"})
    return path


def make_qwen4_exp(tmp_path, **overrides) -> str:
    return perturb_ple_conv(make_tiny_checkpoint("qwen4_exp_text", tmp_path, **overrides))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The default tiny qwen4_exp (PLE on layer 1), built once for this file."""
    return make_qwen4_exp(tmp_path_factory.mktemp("q4"))


def _ids(b=2, t=T, seed=0, eos=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t), generator=g)
    ids[ids == eos] = 4
    ids[0, [t // 3, t // 3 + 1, t // 2 + 7]] = eos  # PLE n-grams restart after EOS
    ids[-1, 2] = eos
    return ids


@pytest.mark.parametrize("overrides", [
    {"ple_layer_ids": [], "hc_count": 3},
    {"ple_layer_ids": [1, 3], "shards": True, "indexer_budget": 8},
], ids=["no-ple-hc3", "ple2-sharded-budget8"])
def test_logits_match_transformers(tmp_path, overrides):
    path = make_qwen4_exp(tmp_path, **overrides)
    ids = _ids()
    ref = hf_logits(path, ids)
    ours = load_target(path)(ids)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= 1e-4


def test_logits_match_transformers_default_and_sparse_selection_matters(ckpt):
    """Default config (PLE on layer 1, hc_count 2, MoE), batch 2 with EOS tokens; then a dense model must
    differ (the comparison would notice a wrong selection)."""
    ids = _ids()
    ref = hf_logits(ckpt, ids)
    tgt = load_target(ckpt)
    assert rel_err(tgt(ids), ref) <= 1e-4
    for m in tgt.modules():
        if getattr(m, "kind", None) == "qsa":
            m.topk = T  # more than the T // 4 groups: dense
    assert rel_err(tgt(ids), ref) > 1e-3


def test_composite_checkpoint_and_features(ckpt, tmp_path):
    """A vision-language layout (text_config, model.language_model.*, vision and MTP tensors) loads to the
    same model; drafter features are the mean of the hyper-connection streams after each layer."""
    path = ckpt
    hf = load_hf(path)
    comp = os.path.join(str(tmp_path), "composite")
    os.makedirs(comp)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    with open(os.path.join(comp, "config.json"), "w") as f:
        json.dump({"model_type": "qwen4_exp", "text_config": text, "vision_config": {"depth": 1},
                   "tie_word_embeddings": False}, f)
    sd = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
          for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(sd, os.path.join(comp, "model.safetensors"), metadata={"format": "pt"})
    tgt = load_target(comp)
    ids = _ids(b=1, t=40)
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert rel_err(tgt(ids), out.logits) <= 1e-4
    feats = tgt.hidden_states(ids, [0, 2])  # [1, T, 2 * D]
    d, hc = tgt.hidden_size, tgt.hc
    for j, layer in enumerate([0, 2]):
        want = out.hidden_states[layer + 1].unflatten(-1, (hc, d)).mean(-2)
        assert rel_err(feats[..., j * d:(j + 1) * d], want) <= 1e-4


def test_missing_ngram_shard_is_a_clear_error(ckpt, tmp_path):
    import shutil

    path = shutil.copytree(ckpt, os.path.join(str(tmp_path), "broken"))
    fp = os.path.join(path, "model.safetensors")
    sd = load_file(fp)
    sd = {k: v for k, v in sd.items() if not k.endswith("ngram_embedding.shard_1.weight")}
    save_file(sd, fp, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="split_ngram_parts"):
        load_target(path)


def _qsa_layers(tgt):
    return [m for m in tgt.modules() if getattr(m, "kind", None) == "qsa"]


def _layer_inputs(tgt, ids):
    """Inputs x [1, T, D] each QSA mixer receives in the plain forward (captured with a hook)."""
    got = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: got.__setitem__(mod.layer_idx, args))
             for m in _qsa_layers(tgt)]
    tgt(ids)
    for h in hooks:
        h.remove()
    return got


def test_plain_selection_equals_sequential_reference(ckpt):
    """Vectorised selection (one shared [T, G] score matrix) == the per-query loop, query by query; the
    plain mixer output == attention over exactly those tokens."""
    tgt = load_target(ckpt)
    ids = _ids(b=1)
    for m in _qsa_layers(tgt):
        m.record = []
    args = _layer_inputs(tgt, ids)
    for m in _qsa_layers(tgt):
        x, pos = args[m.layer_idx]
        sel = m.record[0][0]  # [T, topk]
        seq = sequential_selection(m, x, pos)
        for i, (groups, _) in enumerate(seq):
            assert sel[i][sel[i] >= 0].tolist() == groups.tolist(), (m.layer_idx, i)
        assert any(len(g) == m.topk and (i + 1) // m.ratio > m.topk for i, (g, _) in enumerate(seq))
        assert rel_err(m(x, pos), sequential_attention(m, x, pos)) <= 1e-5
        m.record = None


def test_select_groups_ties_lowest_index():
    s = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [5.0, 5.0, 5.0, 9.0, 0.0, 0.0]])
    n = torch.tensor([6, 6, 2])
    sel = select_groups(s, n, 3)
    assert sel.tolist() == [[0, 1, 4], [0, 1, 2], [0, 1, -1]]
    assert select_groups(s[:, :0], torch.zeros(3, dtype=torch.long), 2).tolist() == [[-1, -1]] * 3


def test_all_tied_scores_pick_lowest_groups(ckpt):
    """With a zero index projection every group scores 0: the selection must be groups 0..topk-1."""
    tgt = load_target(ckpt)
    for m in _qsa_layers(tgt):
        m.indexer.index_qk_proj.weight.zero_()
        m.record = []
    tgt(_ids(b=1, t=60))
    for m in _qsa_layers(tgt):
        sel = m.record[0][0]
        assert sel[59].tolist() == list(range(m.topk))
        m.record = None


def test_bad_config_errors():
    from specopd.models.qwen4_exp import Qwen4ExpTarget
    from tests.oracle import CONFIGS

    cfg = CONFIGS["qwen4_exp_text"]()
    cfg["model_type"] = "qwen4_exp_text"
    with torch.device("meta"):
        Qwen4ExpTarget(cfg)  # builds on meta
        with pytest.raises(ValueError, match="ple_layer_ids"):
            Qwen4ExpTarget({**cfg, "ple_layer_ids": [2]})  # layer 2 is indexed_attention
        with pytest.raises(ValueError, match="indexer_budget"):
            Qwen4ExpTarget({**cfg, "indexer_budget": 10})
        with pytest.raises(ValueError, match="eos_token_id"):
            Qwen4ExpTarget({**cfg, "eos_token_id": None})
