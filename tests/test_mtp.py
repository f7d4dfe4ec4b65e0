"""drafter.kind: mtp: the target's own MTP head (tiny hybrid targets with ``mtp.*`` tensors, the loader, the drafter
against a transcription of vLLM's qwen3_next_mtp / qwen3_5_mtp, folders)."""
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mtp_reference import add_mtp_head, vllm_propose
from oracle import _MOE, make_tiny_checkpoint
from specopd.drafters import build_drafter, export_drafter, load_drafter, shift_tokens
from specopd.errors import BadInputError, FolderNotEmptyError
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
        build_drafter("mtp", target, block_size=3, target_dir=path)
    assert isinstance(e.value, BadInputError) and path in str(e.value)


def _hf_target(tmp_path, kind):
    """A transformers-written tiny hybrid checkpoint + an MTP head added as the releases name it."""
    if kind == "qwen3_next_moe":
        path = make_tiny_checkpoint("qwen3_next", tmp_path, seed=1, head_dim=64, **_MOE)
    else:
        path = make_tiny_checkpoint(kind, tmp_path, seed=1)
    return add_mtp_head(path, seed=2)


@pytest.mark.parametrize("kind", ["tiny", "qwen3_next_moe", "qwen3_5_text"])
def test_drafts_equal_vllm_transcription(tmp_path, kind):
    """Greedy drafts and their logits equal vLLM's proposer + qwen3_next_mtp / qwen3_5_mtp, transcribed in plain torch
    (tests/mtp_reference.py), <= 1e-5 fp32: in training (``unroll``, branches at the trunk's end, whose anchor token
    is the bonus token, and at interior anchors, all in one call) and in decoding (``context_cache`` +
    ``draft_batch``)."""
    path = tiny_mtp(tmp_path) if kind == "tiny" else _hf_target(tmp_path, kind)
    target = load_target(path)
    drafter = build_drafter("mtp", target, block_size=5, target_dir=path)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (14,), generator=g)
    feats = target.hidden_states(ids[None], drafter.feature_layers)[0]
    hidden = target.head_input(feats)
    bonus = 11
    trunk = torch.cat([ids, torch.tensor([bonus])])  # row T - 1 reads the bonus token
    anchors = [14, 1, 6, 13]
    with torch.no_grad():
        h, toks = drafter.unroll([feats], [trunk], anchors, temperature=0.0)
        logits = drafter.logits_from_hidden(h)
        ctx = drafter.context_cache(feats, next_tokens=trunk[1:])
        dec_toks, dec_logits = drafter.draft_batch([ctx], [bonus], temperature=0.0)
    runs = [(toks[b], logits[b], a) for b, a in enumerate(anchors)] + [(dec_toks[0], dec_logits[0], 14)]
    for got_tok, got_logits, a in runs:
        ref_tok, ref_logits = vllm_propose(path, target.model.embed_tokens.weight, target.lm_head.weight, ids[:a],
                                           hidden[:a], int(trunk[a]), drafter.draft_len)
        assert torch.equal(got_tok, ref_tok), (a, got_tok, ref_tok)
        err = float((got_logits - ref_logits).abs().max() / ref_logits.abs().max())
        assert err <= 1e-5, (a, err)


def test_teacher_forced_chain_equals_the_sampled_chain(tmp_path):
    """forward(tokens = the drafted tokens) gives the logits sampling produced: each step reads the token before it
    and the head's own output of the step before (K chained steps)."""
    path = tiny_mtp(tmp_path)
    target = load_target(path)
    drafter = build_drafter("mtp", target, block_size=4, target_dir=path)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    feats = [target.hidden_states(t[None], drafter.feature_layers)[0] for t in ids]
    anchors, trunk = [3, 9, 5], [0, 1, 1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h, toks = drafter.unroll(feats, list(ids), anchors, trunk, temperature=1.0, generators=g)
        forced = drafter(feats, list(ids), anchors, trunk, tokens=toks)
    assert torch.equal(forced, drafter.logits_from_hidden(h))


def test_layer_zero_drafts_every_step(tmp_path):
    """vLLM 0.32 drafts every step with mtp.layers.0 (its proposer passes no spec_step_idx): with a two-layer head,
    changing layer 1 changes no draft; layer 1 is frozen and exported as loaded."""
    path = tiny_mtp(tmp_path, layers=2)
    target = load_target(path)
    drafter = build_drafter("mtp", target, block_size=4, target_dir=path)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(6))
    feats = target.hidden_states(ids[None], drafter.feature_layers)[0]
    tokens = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        before = drafter([feats], [ids], [5], tokens=tokens)
        drafter.mtp.layers[1].mlp.down_proj.weight.mul_(3.0)
        after = drafter([feats], [ids], [5], tokens=tokens)
        drafter.mtp.layers[0].mlp.down_proj.weight.mul_(3.0)
        moved = drafter([feats], [ids], [5], tokens=tokens)
    assert torch.equal(before, after) and not torch.allclose(before, moved)
    assert not any(p.requires_grad for p in drafter.mtp.layers[1].parameters())
    assert all(p.requires_grad for p in drafter.mtp.layers[0].parameters())
    assert len(drafter.mtp.layers) == 2 and "mtp.layers.1.mlp.down_proj.weight" in drafter.state_dict()


@pytest.mark.parametrize("kind", ["tiny", "qwen3_next_moe"])
def test_load_export_round_trip_is_bitwise(tmp_path, kind):
    """Target folder -> drafter -> export -> load_drafter: the same bits; the export holds the mtp.* tensors under
    their released names (bitwise the folder's), the target's embedding and lm_head, and the target's config.json
    with the layer count; exporting the loaded drafter again writes the same bytes."""
    path = tiny_mtp(tmp_path) if kind == "tiny" else _hf_target(tmp_path, kind)
    target = load_target(path)
    drafter = build_drafter("mtp", target, block_size=4, target_dir=path)
    out = export_drafter(drafter, str(tmp_path / "export"))
    back = load_drafter(out, target)
    a, b = drafter.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a) and back.block_size == 4
    src = load_file(os.path.join(path, "model.safetensors"))
    exp = load_file(os.path.join(out, "model.safetensors"))
    assert {k for k in exp if k.startswith("mtp.")} == {k for k in src if k.startswith("mtp.")}
    assert all(torch.equal(exp[k], src[k]) for k in exp if k.startswith("mtp."))
    assert kind == "tiny" or "mtp.layers.0.mlp.experts.3.down_proj.weight" in exp  # experts one by one, as released
    assert torch.equal(exp["model.embed_tokens.weight"], target.model.embed_tokens.weight)
    assert torch.equal(exp["lm_head.weight"], target.lm_head.weight)
    with open(os.path.join(path, "config.json")) as f:
        src_cfg = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        exp_cfg = json.load(f)
    assert exp_cfg.pop("specopd")["kind"] == "mtp"
    assert exp_cfg == {**src_cfg, KEYS["qwen3_next"]: 1}
    again = export_drafter(back, str(tmp_path / "again"))
    with open(os.path.join(out, "model.safetensors"), "rb") as f1, \
            open(os.path.join(again, "model.safetensors"), "rb") as f2:
        assert f1.read() == f2.read()
    with pytest.raises(FolderNotEmptyError):
        export_drafter(drafter, out)


def test_export_is_read_as_vllm_reads_it(tmp_path):
    """What vLLM's Qwen3NextMTP.load_weights keeps from the export (names starting with mtp., and embed_tokens /
    lm_head) covers every tensor written, and each mtp.* name maps to a module path of vLLM's predictor
    (mtp. -> model.)."""
    path = tiny_mtp(tmp_path)
    target = load_target(path)
    out = export_drafter(build_drafter("mtp", target, target_dir=path), str(tmp_path / "export"))
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    kept = [n for n in names if n.startswith("mtp.") or "embed_tokens" in n or "lm_head" in n]
    assert kept == names and "mtp.fc.weight" in names


def test_mtp_needs_a_hybrid_target(tmp_path):
    path = build_tiny_target("llama", str(tmp_path / "llama"), seed=0)
    target = load_target(path)
    with pytest.raises(BadInputError, match="qwen3_next, qwen3_5"):
        load_mtp(path, target)


# ------------------------------------------------------------------ training: every method, the recipe
MTP_RUN = ["drafter.kind=mtp", "model.tiny.num_nextn_predict_layers=1", "trainer.eval_heldout=false"]


@pytest.mark.parametrize("method", ["specopd", "offpolicy_ce", "offpolicy_e2e_tv", "draft_opd"])
def test_every_method_trains_the_mtp_head(tmp_path, method):
    """Each method trains the target's own head (loaded from the tiny target's folder): finite losses, branches
    supervised, the head's weights move (the target's embedding and lm_head never), the checkpoint loads back as the
    MTP drafter."""
    from specopd.train.loop import train
    from tests.tiny_runs import tiny_recipe

    out = str(tmp_path / "run")
    summary = train(tiny_recipe(out, MTP_RUN + [f"trainer.method={method}", "trainer.max_steps=2"],
                                target="tiny:qwen3_next"), progress=False)
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert summary["steps"] == 2 and [m["step"] for m in lines] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["branches"] > 0 for m in lines)
    tdir = os.path.join(out, "tiny-target-qwen3_next")
    target = load_target(tdir)
    trained = load_drafter(summary["final_checkpoint"], target)
    start = build_drafter("mtp", target, block_size=4, target_dir=tdir)
    assert trained.kind == "mtp" and trained.draft_len == 3
    moved = [k for k, v in trained.state_dict().items() if not torch.equal(v, start.state_dict()[k])]
    assert "mtp.fc.weight" in moved and "mtp.layers.0.self_attn.q_proj.weight" in moved
    with safe_open(os.path.join(summary["final_checkpoint"], "model.safetensors"), framework="pt") as f:
        assert all(k.startswith("mtp.") for k in f.keys())  # the head only: the target's tensors stay the target's


def test_recipe_trains_resumes_bitwise_and_exports(tmp_path, capsys):
    """recipes/tiny-gdn-mtp.yaml: a run of 4 steps and one stopped at 2 then resumed to 4 end with the same bits; the
    CLI export of the run is the folder vLLM reads, and loads back to the trained bits."""
    from specopd.config import load_recipe
    from specopd.runs.checkpoint import find_latest
    from specopd.train.loop import train
    from tests.tiny_runs import run_cli

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["data.num_samples=16", "data.seq_len=24", "data.batch_size=4", "trainer.anchors_per_seq=4",
             "trainer.eval_heldout=false", "profile.enabled=false", "trainer.save_every=2"]

    def run(out, steps):
        cfg = load_recipe(os.path.join(repo, "recipes", "tiny-gdn-mtp.yaml"),
                          small + [f"trainer.output_dir={out}", f"trainer.max_steps={steps}"])
        return train(cfg, progress=False)

    straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
    run(straight, 4)
    run(resumed, 2)
    run(resumed, 4)  # trainer.resume=auto: from step-2
    a = load_file(os.path.join(find_latest(straight), "model.safetensors"))
    b = load_file(os.path.join(find_latest(resumed), "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loss = lambda d: [json.loads(x)["loss"] for x in open(os.path.join(d, "metrics.jsonl"))]  # noqa: E731
    assert loss(straight) == loss(resumed)
    out = str(tmp_path / "export")
    rc, stdout, _ = run_cli(capsys, "export", straight, out)
    assert rc == 0 and '"method": "mtp"' in stdout
    target = load_target(os.path.join(straight, "tiny-target-qwen3_next"))
    back = load_drafter(out, target)
    assert all(torch.equal(v, a[k]) for k, v in back.state_dict().items())
    exp = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(exp["lm_head.weight"], target.lm_head.weight)


def test_export_of_a_run_needs_its_target(tmp_path, capsys):
    """An MTP checkpoint exported without a run folder to find the target: exit 2 naming --target."""
    from tests.tiny_runs import run_cli

    path = tiny_mtp(tmp_path)
    target = load_target(path)
    ck = str(tmp_path / "ck")
    d = build_drafter("mtp", target, target_dir=path)
    os.makedirs(ck)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(d.config_dict(), f)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, os.path.join(ck, "model.safetensors"))
    rc, _, err = run_cli(capsys, "export", ck, str(tmp_path / "out"))
    assert rc == 2 and "--target" in err
    rc, _, _ = run_cli(capsys, "export", ck, str(tmp_path / "out"), "--target", path)
    assert rc == 0 and torch.equal(load_drafter(str(tmp_path / "out"), target).mtp.fc.weight, d.mtp.fc.weight)


# ------------------------------------------------------------------ decoding: lossless on a hybrid target
def test_greedy_speculative_decoding_equals_plain_greedy(tmp_path):
    from specopd.eval import SpeculativeDecoder, autoregressive

    path = tiny_mtp(tmp_path)
    target = load_target(path)
    d = build_drafter("mtp", target, block_size=4, target_dir=path)
    prompt = torch.tensor([3, 9, 4, 1, 7])
    for p in (prompt, prompt[:1]):  # a one-token prompt: anchor 0 has no context row
        res = SpeculativeDecoder(target, d, temperature=0.0).generate(p, 24)
        assert res.tokens[:24].tolist() == autoregressive(target, p, 24, temperature=0.0).tokens.tolist()


def test_lossless_at_t1_with_the_mtp_head(tmp_path):
    """T = 1 on a tiny hybrid target of vocab 8 with its MTP head: the first two tokens are distributed as the
    target's (chi-square against the exact table); the head made confident so that rounds accept and reject."""
    from specopd.eval import SpeculativeDecoder
    from tests.test_eval import PROMPT, chi2, chi2_threshold, empirical_two_tokens, exact_two_tokens

    path = tiny_mtp(tmp_path, vocab_size=8)
    target = load_target(path)
    d = build_drafter("mtp", target, block_size=3, target_dir=path)
    with torch.no_grad():
        d.mtp.norm.weight.add_(6.0)  # (1 + w): logits about 7x larger
    dec = SpeculativeDecoder(target, d, temperature=1.0)
    res = dec.generate(PROMPT, 40, generator=torch.Generator().manual_seed(0))
    assert 1 < max(res.accept_lengths) and min(res.accept_lengths) == 1  # some rounds accept, some reject
    exact = exact_two_tokens(target, PROMPT, 1.0).flatten()
    stat, df = chi2(empirical_two_tokens(dec, PROMPT, 800), exact)
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} (df {df})"


def test_qwen35_27b_mtp_recipe_plans(capsys):
    """recipes/qwen3.5-27b-mtp-8gpu.yaml: --dry-run plans an MTP run of the 27B shape on 80 GB GPUs (its head: one
    layer of the target's width, fc over 2 x 5120)."""
    from specopd.config import load_recipe
    from specopd.memory import check_memory
    from tests.tiny_runs import run_cli

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes",
                        "qwen3.5-27b-mtp-8gpu.yaml")
    p = check_memory(load_recipe(path), device_bytes=80 * 10**9)
    assert p.fits and p.sizes["vocab"] == 248_320 and p.sizes["branches"] >= 256
    d, i = 5120, 17408
    head = 2 * d * d + d * 24 * 256 * 2 + 2 * d * 4 * 256 + 24 * 256 * d + 3 * d * i + 5 * d + 2 * 256  # 5 norms
    assert _term(p, "drafter weights (fp32)") == 4 * head
    rc, out, _ = run_cli(capsys, "train", path, "--dry-run")
    assert rc == 0 and "drafter  mtp, 1 layer(s), block_size 4" in out and "fits" in out


def _term(plan, name):
    return next(t for t in plan.terms if t.name == name).bytes


def test_init_from_an_export_starts_from_its_bits(tmp_path):
    """drafter.init_from: an export (or any MTP folder) is where the run starts; a bf16 target trains an fp32 head."""
    from specopd.models.tiny import resolve_target_path
    from specopd.train.loop import train
    from specopd.train.worker import Worker
    from tests.tiny_runs import tiny_recipe

    out = str(tmp_path / "run")
    cfg = tiny_recipe(out, MTP_RUN, target="tiny:qwen3_next")
    tdir = resolve_target_path(cfg.model, out)  # the run's own tiny target, built first
    target = load_target(tdir)
    d = build_drafter("mtp", target, block_size=4, target_dir=tdir)
    with torch.no_grad():
        d.mtp.fc.weight.mul_(0.5)  # not the target folder's head
    export = export_drafter(d, str(tmp_path / "export"))
    cfg = tiny_recipe(out, MTP_RUN + [f"drafter.init_from={export}", "trainer.max_steps=1"], target="tiny:qwen3_next")
    w = Worker(cfg)
    assert torch.equal(w.drafter.mtp.fc.weight, d.mtp.fc.weight)
    assert train(cfg, progress=False)["steps"] == 1
    bf16 = load_target(tdir, dtype=torch.bfloat16)
    h = build_drafter("mtp", bf16, block_size=4, target_dir=tdir)
    assert h.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    feats = bf16.hidden_states(ids[None], h.feature_layers)[0]
    hid, toks = h.unroll([feats], [ids], [4, 9], temperature=0.0)
    assert hid.dtype == torch.float32 and toks.shape == (2, 3)


def test_a_head_that_does_not_fit_is_named(tmp_path):
    """A folder whose mtp.* tensors miss one, disagree with its config's layer count, or hold an integer weight:
    a user error naming the folder and the tensor or key."""
    from safetensors.torch import save_file

    path = tiny_mtp(tmp_path)
    target = load_target(path)
    st = os.path.join(path, "model.safetensors")
    sd = load_file(st)
    cases = {"missing ['mtp.norm.weight']": {k: v for k, v in sd.items() if k != "mtp.norm.weight"},
             "not a floating-point weight": {**sd, "mtp.norm.weight": sd["mtp.norm.weight"].long()}}
    for why, tensors in cases.items():
        save_file(tensors, st)
        with pytest.raises(BadInputError) as e:
            load_mtp(path, target)
        assert path in str(e.value) and why in str(e.value) and "mtp.norm.weight" in str(e.value)
    save_file(sd, st)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, KEYS["qwen3_next"]: 2}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(BadInputError, match="names 2 MTP layer"):
        load_mtp(path, target)


def test_the_head_runs_the_targets_kernel_choice(tmp_path):
    """The recipe's kernels: section reaches the head's modules as it reaches the target's (``hand_down``)."""
    path = tiny_mtp(tmp_path)
    target = load_target(path)
    marker = object()
    target.kernel_paths = marker
    d = build_drafter("mtp", target, target_dir=path)
    assert d.kernel_paths is marker and d.mtp.layers[0].self_attn.kernel_paths is marker
    assert load_drafter(path, target).mtp.norm.kernel_paths is marker


def test_offpolicy_ce_is_hard_ce_on_the_reference(tmp_path, monkeypatch):
    """trainer.method offpolicy_ce trains the head as MTP heads are trained: CE on the reference's tokens at every
    chained step (``fused_ce``), not EAGLE-3's soft CE against the target (``fused_ttt``)."""
    import specopd.train.phases as phases
    from specopd.train.loop import train
    from tests.tiny_runs import tiny_recipe

    calls = []
    real = phases.fused_ce
    monkeypatch.setattr(phases, "fused_ttt", lambda *a, **k: pytest.fail("soft TTT CE used for an MTP head"))
    monkeypatch.setattr(phases, "fused_ce", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    out = str(tmp_path / "run")
    train(tiny_recipe(out, MTP_RUN + ["trainer.method=offpolicy_ce", "trainer.max_steps=1"], target="tiny:qwen3_next"),
          progress=False)
    assert calls and all(s[1] == 3 for s in calls)  # [N, W] reference tokens, W = 3 chained steps
