"""Released-layout folders: loading (single file, shards + index, mask_embedding.pt), the independent
reference on hand-written folders, load -> export -> load bit-exactness, mismatch errors, the
``specopd export`` command and ``drafter.init_from`` with a released folder."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specopd.drafters import build_drafter, export_drafter, load_drafter, shift_tokens
from specopd.models import load_target
from tests.dflash_reference import ReleasedReference, write_released_folder
from tests.oracle import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("export"), num_hidden_layers=4,
                                vocab_size=128, hidden_size=32, intermediate_size=48)


@pytest.fixture(scope="module")
def target(ckpt):
    return load_target(ckpt)


def _folder(path, **kw):
    args = dict(hidden=32, vocab=128, target_layers=4, num_layers=2, block_size=5, layer_ids=[1, 2])
    args.update(kw)
    return write_released_folder(str(path), **args)


def _branches(target, layer_ids, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (11,), generator=g)
    feats = target.hidden_states(ids[None], list(layer_ids))[0]
    anchors = torch.tensor([0, 4, 4, 7, 11])
    atok = torch.tensor([int(ids[a]) if a < 11 else 3 for a in anchors])
    return feats, anchors, atok


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind,shards,mask_vector", [("dflash", 1, False), ("dflash", 3, False),
                                                     ("dflash", 1, True), ("dspark", 2, False)])
def test_released_folder_matches_independent_reference(target, tmp_path, kind, shards, mask_vector):
    folder = _folder(tmp_path / "rel", kind=kind, shards=shards, mask_vector=mask_vector, seed=1)
    d = load_drafter(folder, target)
    assert d.kind == kind and d.block_size == 5 and d.draft_len == 4 and d.feature_layers == (1, 2)
    assert d.mask_token_id == 5 and d.config.learned_mask == mask_vector and d.dtype == torch.float32
    ref = ReleasedReference(folder, target.model.embed_tokens.weight, target.lm_head.weight)
    feats, anchors, atok = _branches(target, d.feature_layers)
    prev = shift_tokens(atok, (torch.arange(20).view(5, 4) * 11) % 128)
    with torch.no_grad():
        out = d([feats], anchors, None, atok, prev if kind == "dspark" else None)
        for b in range(len(anchors)):
            r = ref.logits(feats, int(anchors[b]), int(atok[b]), prev[b] if kind == "dspark" else None)
            torch.testing.assert_close(out[b], r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_load_export_load_is_bit_exact(target, tmp_path, kind):
    folder = _folder(tmp_path / "rel", kind=kind, shards=2, seed=2)
    d1 = load_drafter(folder, target)
    export_drafter(d1, str(tmp_path / "a"))  # float32 (as loaded)
    d2 = load_drafter(str(tmp_path / "a"), target)
    assert _state_equal(d1, d2) and d2.config == d1.config
    export_drafter(d2, str(tmp_path / "b"), dtype=torch.bfloat16)  # the released dtype: the original bytes
    orig = {}
    for n in os.listdir(folder):
        if n.endswith(".safetensors"):
            orig.update(load_file(os.path.join(folder, n)))
    back = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert orig.keys() == back.keys() and all(torch.equal(orig[k], back[k]) for k in orig)
    assert _state_equal(d1, load_drafter(str(tmp_path / "b"), target))
    cfg = json.load(open(tmp_path / "b" / "config.json"))
    src = json.load(open(os.path.join(folder, "config.json")))
    for key in ("architectures", "model_type", "block_size", "num_target_layers", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "tie_word_embeddings", "rope_theta"):
        assert cfg[key] == src[key], key
    for key in src["dflash_config"]:
        assert cfg["dflash_config"][key] == src["dflash_config"][key], key
    assert cfg["dtype"] == "bfloat16"


def test_our_drafter_export_roundtrip_with_learned_mask_and_shards(target, tmp_path):
    d = build_drafter("dspark", target, num_layers=2, block_size=7, mask_token_id=-1, seed=4)
    export_drafter(d, str(tmp_path / "out"), max_shard_bytes=20_000)
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and "mask_embedding.pt" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    mask = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == d.mask_token_id and torch.equal(mask["embedding"], d.mask_embedding.detach())
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["block_size"] == 7
    assert cfg["dflash_config"]["markov_rank"] == 256 and cfg["dflash_config"]["target_layer_ids"] == [1, 1]
    e = load_drafter(str(tmp_path / "out"), target)
    assert _state_equal(d, e) and e.config == d.config
    d.save(str(tmp_path / "ours"))  # our checkpoint format -> same drafter
    assert _state_equal(d, load_drafter(str(tmp_path / "ours"), target))
    with pytest.raises(FileExistsError, match="empty folder"):
        export_drafter(d, str(tmp_path / "out"))


def _edit(folder, **changes):
    p = os.path.join(folder, "config.json")
    cfg = json.load(open(p))
    for k, v in changes.items():
        if k.startswith("dflash_config."):
            cfg["dflash_config"][k.split(".", 1)[1]] = v
        else:
            cfg[k] = v
    json.dump(cfg, open(p, "w"))
    return folder


def test_mismatch_errors_name_both_values(target, ckpt, tmp_path):
    bad = lambda name, **kw: _folder(tmp_path / name, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"fc width mismatch.*\[32, 64\].*\[32, 96\]"):
        load_drafter(_edit(bad("fc"), **{"dflash_config.target_layer_ids": [0, 1, 2]}), target)
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 4\] are out of range.*4 layers"):
        load_drafter(bad("ids", layer_ids=[1, 4]), target)
    with pytest.raises(ValueError, match="number of target layers mismatch.*num_hidden_layers=36.*num_hidden_layers=4"):
        load_drafter(bad("ntl", target_layers=36), target)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_drafter(_edit(bad("mt"), model_type="llama"), target)
    with pytest.raises(ValueError, match="attention_bias"):
        load_drafter(_edit(bad("bias"), attention_bias=True), target)
    with pytest.raises(ValueError, match="sliding_attention"):
        load_drafter(_edit(bad("swa"), layer_types=["sliding_attention"] * 2), target)
    with pytest.raises(ValueError, match="mask_token_id 500 is outside.*vocab_size=128"):
        load_drafter(_edit(bad("mask"), **{"dflash_config.mask_token_id": 500}), target)
    wide = load_target(make_tiny_checkpoint("llama", tmp_path, hidden_size=48, vocab_size=128,
                                            intermediate_size=48, num_hidden_layers=4))
    with pytest.raises(ValueError, match="hidden size mismatch.*hidden_size=32.*hidden_size=48"):
        load_drafter(bad("hid"), wide)
    small_vocab = load_target(make_tiny_checkpoint("llama", tmp_path / "v", hidden_size=32, vocab_size=96,
                                                   intermediate_size=48, num_hidden_layers=4))
    with pytest.raises(ValueError, match="vocab size mismatch.*vocab_size=128.*vocab_size=96"):
        load_drafter(bad("voc"), small_vocab)
    missing = bad("miss")
    sd = load_file(os.path.join(missing, "model.safetensors"))
    sd.pop("layers.1.mlp.up_proj.weight")
    from safetensors.torch import save_file

    save_file(sd, os.path.join(missing, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_drafter(missing, target)
    v01 = tmp_path / "v01"  # a SpecOPD v0.1 checkpoint (no "format"): refused, not silently misread
    v01.mkdir()
    (v01 / "config.json").write_text(json.dumps({"kind": "dflash", "block_size": 4, "num_layers": 1}))
    with pytest.raises(ValueError, match="v0.1"):
        load_drafter(str(v01), target)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(str(tmp_path), target)


def test_cli_export_from_a_run(target, ckpt, tmp_path, capsys):
    from specopd.cli import main

    d = build_drafter("dflash", target, num_layers=2, block_size=16, seed=5, mask_token_id=9)
    from specopd.runs.checkpoint import MARKER, save_checkpoint

    run = tmp_path / "run"
    ws = {"drafter": {k: v.detach().clone() for k, v in d.state_dict().items()}, "drafter_config": d.config_dict(),
          "drafter_kind": d.kind}
    for step in (2, 4):  # step 4 is half-written (no COMPLETE marker): export takes step 2
        save_checkpoint(str(run), step, ws, {"data_position": 0}, keep_last=5)
    (run / "checkpoints" / "step-4" / MARKER).unlink()
    (run / "recipe.yaml").write_text(f"model:\n  target: {ckpt}\n")
    assert main(["export", str(run), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "step-2" in out and f'"num_speculative_tokens": 15' in out and f"vllm serve {ckpt}" in out
    assert "--speculative-algorithm DFLASH" in out and "--speculative-num-draft-tokens 16" in out
    e = load_drafter(str(tmp_path / "out"), target)
    assert all(torch.equal(v.to(torch.bfloat16), e.state_dict()[k].to(torch.bfloat16)) for k, v in d.state_dict().items())
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert main(["export", str(empty), str(tmp_path / "o3")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_init_from_a_released_folder(tmp_path):
    """A worker starts training from a released folder (the tiny recipe's target: hidden 64, vocab 256, 2 layers)."""
    from specopd.train import phases
    from tiny_runs import tiny_recipe
    from specopd.train.worker import Worker

    folder = write_released_folder(str(tmp_path / "rel"), hidden=64, vocab=256, target_layers=2, num_layers=1,
                                   block_size=4, layer_ids=[1], head_dim=16, intermediate=128, mask_token_id=7,
                                   seed=3)
    w = Worker(tiny_recipe(str(tmp_path / "run"), [f"drafter.init_from={folder}", "trainer.eval_heldout=false"]))
    start = {k: v.clone() for k, v in w.drafter.state_dict().items()}
    assert torch.equal(start["fc.weight"], load_file(os.path.join(folder, "model.safetensors"))["fc.weight"].float())
    assert w.W == 3 and w.drafter.mask_token_id == 7
    m = phases.colocated_step(w, w.train_ids[:2], 0, None)
    assert m["branches"] > 0 and not torch.equal(w.drafter.state_dict()["fc.weight"], start["fc.weight"])
