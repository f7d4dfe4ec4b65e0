"""drafter.kind: mtp: the target's own MTP head (tiny hybrid targets with ``mtp.*`` tensors, the loader, the drafter
against a transcription of vLLM's qwen3_next_mtp / qwen3_5_mtp, folders)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specopd.errors import BadInputError
from specopd.models import load_mtp, load_target
from specopd.models.loading import NoMTPError
from specopd.models.tiny import build_tiny_target

KEYS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}


def tiny_mtp(tmp_path, mt="qwen3_next", layers=1, **over):
    return build_tiny_target(mt, str(tmp_path / f"{mt}-mtp{layers}"), seed=3, overrides={KEYS[mt]: layers, **over})


@pytest.mark.parametrize("mt", ["qwen3_next", "qwen3_5"])
def test_tiny_target_with_mtp_head_keeps_the_target(tmp_path, mt):
    """The MTP head is added under its released names; the target's own tensors (and so its outputs) are those of
    the same tiny target without one, and the fixture without the key has no MTP tensors."""
    plain = build_tiny_target(mt, str(tmp_path / "plain"), seed=3)
    with_mtp = tiny_mtp(tmp_path, mt)
    a, b = load_file(os.path.join(plain, "model.safetensors")), load_file(os.path.join(with_mtp, "model.safetensors"))
    assert not [k for k in a if k.startswith("mtp.")]
    mtp = sorted(k for k in b if k.startswith("mtp."))
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate_proj.weight",
                 "mtp.layers.0.input_layernorm.weight"):
        assert name in mtp
    assert set(b) - set(mtp) == set(a) and all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(with_mtp, "config.json")) as f:
        assert json.load(f)[KEYS[mt]] == 1
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(load_target(plain)(ids), load_target(with_mtp)(ids))


def test_loader_keeps_the_mtp_tensors(tmp_path):
    """load_mtp returns every mtp.* tensor of the folder bitwise (under MultiTokenPredictor's names); the target
    loaded from the same folder holds none of them."""
    path = tiny_mtp(tmp_path)
    target = load_target(path)
    assert not [n for n, _ in target.named_parameters() if "mtp" in n]
    mtp = load_mtp(path, target)
    raw = load_file(os.path.join(path, "model.safetensors"))
    sd = mtp.state_dict()
    assert sorted("mtp." + k for k in sd) == sorted(k for k in raw if k.startswith("mtp."))
    assert all(torch.equal(sd[k[4:]], raw[k]) for k in raw if k.startswith("mtp."))


def test_folder_without_mtp_head_is_a_user_error(tmp_path):
    path = build_tiny_target("qwen3_next", str(tmp_path / "plain"), seed=3)
    target = load_target(path)
    with pytest.raises(NoMTPError, match="no mtp.* tensors") as e:
        load_mtp(path, target)
    assert isinstance(e.value, BadInputError) and path in str(e.value)


def test_mtp_needs_a_hybrid_target(tmp_path):
    path = build_tiny_target("llama", str(tmp_path / "llama"), seed=0)
    target = load_target(path)
    with pytest.raises(BadInputError, match="qwen3_next, qwen3_5"):
        load_mtp(path, target)
