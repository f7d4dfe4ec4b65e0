"""Draft-OPD rolls out like a serving engine (specopd.speculative): prompts prefilled once, one batched target
pass per round for all active sequences, commits from the verify pass. Its blocks and p equal a plain
sequence-at-a-time rollout that recomputes everything from scratch (same per-sample generators), so the loss
and the supervised tokens are those of the old two-pass rollout."""
import contextlib

import pytest
import torch

from specopd import speculative as spec
from specopd.losses import logits_at
from specopd.train.baselines import draft_opd_rollout
from specopd.train.worker import Worker
from tiny_runs import tiny_recipe


@contextlib.contextmanager
def count_target_passes(target):
    """Forward hook on the first decoder layer's MLP: every target pass (plain, prefill, score) runs it once."""
    n = [0]
    handle = target.model.layers[0].mlp.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    try:
        yield n
    finally:
        handle.remove()


@torch.no_grad()
def reference_rollout(worker, sample_ids, step):
    """One sequence at a time, no caches: drafter features and p from plain forwards of the whole prefix."""
    t, target, drafter = worker.cfg.trainer, worker.target, worker.drafter
    W = drafter.draft_len
    blocks = []
    for i, sid in enumerate(sample_ids):
        s = worker.sample(sid)
        gen = worker.generator("branch", step, int(sid))
        seq, limit = s["input_ids"][: s["prompt_len"]], int(s["input_ids"].numel())
        for _ in range(t.anchors_per_seq):
            if seq.numel() >= limit:
                break
            a = seq.numel() - 1
            feats = target.hidden_states(seq[None], drafter.feature_layers)[0]
            draft, q = drafter.sample([feats], torch.tensor([a]), torch.tensor([0]), seq[-1:],
                                      t.acceptance_temperature, [gen], rows=[torch.tensor([0])])
            p = target(torch.cat([seq, draft[0]])[None])[0, a:]  # [W + 1, V]
            (n,), (y,) = spec.accept(draft, q, p[None], t.acceptance_temperature, gen)
            blocks.append((i, a, int(seq[-1]), draft[0], p[:W]))
            seq = torch.cat([seq, draft[0, :n], torch.tensor([y])])
    return blocks


@pytest.mark.parametrize("target,rounds", [("tiny:llama", 5), ("tiny:llama", 30), ("tiny:qwen3_next", 5),
                                           pytest.param("tiny:qwen4_exp", 5, marks=pytest.mark.slow)])
def test_rollout_equals_sequential_reference_one_pass_per_round(tmp_path, target, rounds):
    """rounds = anchors_per_seq: 5 stops by the round count, 30 by the reference's length (20 tokens)."""
    w = Worker(tiny_recipe(str(tmp_path), [f"trainer.anchors_per_seq={rounds}", "drafter.block_size=3"],
                           target=target))
    ids = w.train_ids[:4]
    drafts, rows = [], []
    real = w.drafter.draft_batch
    w.drafter.draft_batch = lambda ctxs, *a, **k: drafts.append(len(ctxs)) or real(ctxs, *a, **k)
    hook = w.drafter.fc.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    with count_target_passes(w.target) as passes:
        prop, hp = draft_opd_rollout(w, ids, step=3)
    hook.remove()
    del w.drafter.draft_batch
    ref = reference_rollout(w, ids, step=3)
    got = sorted(zip(prop.trunk_index.tolist(), prop.anchors.tolist(), range(len(ref))))
    assert [(i, a) for i, a, _ in got] == [(b[0], b[1]) for b in sorted(ref, key=lambda b: (b[0], b[1]))]
    accepted = 0
    for (i, a, row), r in zip(got, sorted(ref, key=lambda b: (b[0], b[1]))):
        assert int(prop.anchor_tokens[row]) == r[2] and torch.equal(prop.tokens[row], r[3])
        p_row = logits_at(hp[row], w.target.lm_head.weight)  # the rollout keeps hidden states [W, D] per block
        err = float((p_row - r[4]).abs().max() / r[4].abs().max())
        assert err <= 1e-5, f"block (seq {i}, anchor {a}): p rel err {err:.2e}"
        accepted += 1
    # one prefill per prompt + one target pass per round (the longest sequence's rounds)
    rounds = max(sum(1 for b in ref if b[0] == i) for i in range(len(ids)))
    assert len({sum(1 for b in ref if b[0] == i) for i in range(len(ids))}) > 1 or rounds == 5
    assert passes[0] == len(ids) + rounds, f"{passes[0]} target passes: {len(ids)} prompts, {rounds} rounds"
    # one drafter call per round over all active sequences' context caches, one projection pass per round over
    # the rows committed since the last round: every context row is projected once (sum = each last anchor)
    assert len(drafts) == rounds and drafts[0] == len(ids) and len(rows) == rounds
    last = [max(b[1] for b in ref if b[0] == i) for i in range(len(ids))]
    assert sum(rows) == sum(last), f"{sum(rows)} feature rows projected for {sum(last)} context positions"
    assert prop.tokens.shape == (len(ref), w.W) and accepted == len(ref)


def test_rollout_features_equal_plain_forward(tmp_path):
    """The caches' drafter features after commits (from the verify passes) equal the plain forward's."""
    w = Worker(tiny_recipe(str(tmp_path), ["trainer.anchors_per_seq=6"]))
    ids = w.train_ids[:3]
    prop, _ = draft_opd_rollout(w, ids, step=0)
    for i in range(len(ids)):
        f = prop.features[i]
        rows = prop.trunk_index == i
        # rebuild the committed sequence: the blocks' anchors and accepted tokens define it
        a_last = int(prop.anchors[rows].max())
        assert f.shape[0] == a_last  # the last round's pending token was never run: context < anchor
        order = torch.argsort(prop.anchors[rows])
        anchors, atoks = prop.anchors[rows][order], prop.anchor_tokens[rows][order]
        seq = w.sample(ids[i])["input_ids"][: int(anchors[0])].tolist()
        for k in range(len(anchors)):  # block k's anchor token, then what was accepted until the next anchor
            nxt = int(anchors[k + 1]) if k + 1 < len(anchors) else a_last
            seq.append(int(atoks[k]))
            seq += prop.tokens[rows][order][k][: nxt - int(anchors[k]) - 1].tolist()
        seq = torch.tensor(seq[:a_last])
        ref = w.target.hidden_states(seq[None], w.drafter.feature_layers)[0]
        assert float((f - ref).abs().max() / ref.abs().max()) <= 1e-5
