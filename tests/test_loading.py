"""load_target: bad inputs give errors that name the problem."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import make_tiny_checkpoint
from specopd.models import load_target


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("load"), tie_word_embeddings=False)


def _copy(good, tmp_path, name="ckpt"):
    dst = os.path.join(str(tmp_path), name)
    shutil.copytree(good, dst)
    return dst


def _edit_weights(path, fn):
    fp = os.path.join(path, "model.safetensors")
    sd = fn(load_file(fp))
    save_file(sd, fp, metadata={"format": "pt"})


def test_good_checkpoint_loads(good):
    m = load_target(good)
    assert not any(p.requires_grad for p in m.parameters()) and not m.training
    assert m.vocab_size == 256 and m.num_layers == 2 and m.layer_kinds == ["gqa", "gqa"]


def test_folder_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(str(tmp_path / "nope"))


def test_no_config_json(good, tmp_path):
    p = _copy(good, tmp_path)
    os.remove(os.path.join(p, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(p)


def test_no_weights(good, tmp_path):
    p = _copy(good, tmp_path)
    os.remove(os.path.join(p, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_target(p)


def test_unsupported_model_type(good, tmp_path):
    p = _copy(good, tmp_path)
    cfg_path = os.path.join(p, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*supported:.*llama"):
        load_target(p)


def test_missing_tensor(good, tmp_path):
    p = _copy(good, tmp_path)
    _edit_weights(p, lambda sd: {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        load_target(p)


def test_missing_lm_head_untied(good, tmp_path):
    p = _copy(good, tmp_path)
    _edit_weights(p, lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_target(p)


def test_misshaped_tensor(good, tmp_path):
    p = _copy(good, tmp_path)

    def cut(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:8].clone()
        return sd

    _edit_weights(p, cut)
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(8, 64\), expected \(32, 64\)"):
        load_target(p)


def test_unexpected_tensor(good, tmp_path):
    p = _copy(good, tmp_path)
    _edit_weights(p, lambda sd: {**sd, "model.layers.7.foo.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="model.layers.7.foo.weight.*no place"):
        load_target(p)


def test_missing_shard(tmp_path):
    p = make_tiny_checkpoint("qwen3", tmp_path, shards=True)
    shard = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(p, shard))
    with pytest.raises(FileNotFoundError, match=f"shard '{shard}'.*missing"):
        load_target(p)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda(good):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        load_target(good, device="cuda")


def test_bad_dtype_and_device(good):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_target(good, dtype="float8")
    with pytest.raises(ValueError, match="unsupported device"):
        load_target(good, device="mps")


def test_sliding_window_qwen3_is_refused(tmp_path):
    p = make_tiny_checkpoint("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(NotImplementedError, match=r"\['sliding_attention'\] \(sliding-window attention\)"):
        load_target(p)
    # an old-style config (no layer_types) whose window starts after the last layer has full attention only
    from specopd.models.llama import Qwen3Target

    cfg = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
               max_window_layers=2)
    with torch.device("meta"):
        Qwen3Target(cfg)
    with pytest.raises(NotImplementedError, match="sliding"), torch.device("meta"):
        Qwen3Target({**cfg, "max_window_layers": 1})


def test_bad_token_ids(good):
    m = load_target(good)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        m(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        m(torch.tensor([1, 2]))
