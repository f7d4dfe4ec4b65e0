"""An MTP head follows a moving policy: each version's export is vLLM's MTP folder, the trained ``mtp.*`` tensors
with *that* policy's embedding and lm_head (specopd/follow/DESIGN.md)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specopd.follow import DrafterFollower
from specopd.follow.follower import FollowError
from specopd.follow.job import pickup_note
from specopd.models.tiny import build_tiny_target
from specopd.runs import checkpoint as ck
from test_follow import overrides, rollouts


def policy(root, version):
    """Policy ``version``: a tiny hybrid target (qwen3_next) that ships an MTP head, its own weights."""
    return build_tiny_target("qwen3_next", os.path.join(str(root), f"v{version}"), seed=version + 1,
                             overrides={"num_nextn_predict_layers": 1})


def mtp_args(tmp_path):
    return overrides(tmp_path / "run", "drafter.kind=mtp", "drafter.num_layers=1", "model.gdn_checkpoint_every=8",
                     f"model.target={policy(tmp_path / 'p', 0)}")


def tensors(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def test_each_versions_mtp_export_carries_that_policys_embedding_and_the_trained_head(tmp_path):
    with DrafterFollower(None, mtp_args(tmp_path), progress=False) as f:
        exports = []
        for v in (0, 1):
            f.update_policy(policy(tmp_path / "p", v), v)
            f.add_rollouts(rollouts(v), v)
            f.train(steps=1)
            exports.append(f.export(v))
    pol = [tensors(policy(tmp_path / "p", v)) for v in (0, 1)]
    trained = tensors(ck.find_latest(str(tmp_path / "run")))
    for v, path in enumerate(exports):
        got = tensors(path)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[name], pol[v][name]) and not torch.equal(got[name], pol[1 - v][name])
        assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3_next"
    head = {k: v for k, v in tensors(exports[1]).items() if k.startswith("mtp.")}
    assert head and head.keys() == {k for k in trained if k.startswith("mtp.")}
    assert all(torch.equal(head[k], trained[k]) for k in head)  # the head as trained through version 1
    assert not all(torch.equal(head[k], pol[0][k]) for k in head)  # trained, not the policy's own head
    note = pickup_note(exports[1], "http://localhost:8000", "/models/v1")
    assert '"method": "mtp"' in note and "vllm serve /models/v1" in note


def test_an_mtp_head_given_a_state_dict_policy_says_to_pass_a_folder(tmp_path):
    with DrafterFollower(None, mtp_args(tmp_path), progress=False) as f:
        f.update_policy(tensors(policy(tmp_path / "p", 1)), 1)
        f.add_rollouts(rollouts(1), 1)
        f.train(steps=1)
        with pytest.raises(FollowError, match="Hugging Face folder"):
            f.export(1)
    assert not os.path.exists(tmp_path / "run" / "exports" / "latest")
