"""Worker step, baselines, worker-group equivalence and a short learning run (tiny CPU configs)."""
import json
import os

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from specopd import speculative as spec
from specopd.losses import confidence_loss, e2e_tv_loss, logits_at, tv_alpha
from specopd.train import phases
from specopd.train.group import LocalGroup
from specopd.train.loop import train
from specopd.train.step import reduce_metrics
from specopd.train.worker import Worker, lr_lambda
from tiny_runs import tiny_recipe


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(2, 10, 0.1)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0) and f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    vals = [f(s) for s in range(2, 11)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_expected_al_from_alpha_sums():
    # two branches, W = 2: alphas (0.5, 0.5) and (1.0, 0.0) -> AL = 1 + mean(0.5 + 0.25, 1.0 + 0) = 1.875
    r = {"branches": 2, "alpha_sum": [1.5, 0.5], "surv_sum": [1.5, 0.25]}
    m = reduce_metrics([r], 0.0)
    assert m["expected_al"] == pytest.approx(1.875) and m["alpha"] == pytest.approx([0.75, 0.25])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return Worker(tiny_recipe(str(tmp_path_factory.mktemp("w"))))


def test_proposals_are_per_sample_and_scores_exact(worker):
    ids = worker.train_ids[:2]
    caches = phases.prefill(worker, ids)
    prop = phases.propose(worker, caches, ids, step=5)
    W, B = worker.W, worker.cfg.trainer.anchors_per_seq
    assert prop.tokens.shape == (2 * B, W)
    # a sample's anchors and branch tokens do not depend on the other samples of the batch
    alone = phases.propose(worker, phases.prefill(worker, ids[1:]), ids[1:], step=5)
    assert torch.equal(alone.anchors, prop.anchors[B:]) and torch.equal(alone.tokens, prop.tokens[B:])
    # ...but do depend on the step
    other = phases.propose(worker, caches, ids, step=6)
    assert not torch.equal(other.tokens, prop.tokens)
    s0 = worker.sample(ids[0])
    a = prop.anchors[:B]
    assert int(a.min()) >= s0["prompt_len"] - 1 and int(a.max()) + W <= s0["input_ids"].numel() - 1
    assert all(c.logits is None and c.hidden.shape == (c.token_ids.numel(), worker.target.hidden_size)
               for c in caches)  # the trunk keeps [T, D], never [T, V]
    hp = phases.score(worker, prop, caches)
    assert hp.shape == (2 * B, W, worker.target.hidden_size)  # hidden states: never [N, W, V]
    weight = worker.target.lm_head.weight
    for b in (0, B + 1):  # lm_head(hp[b, k]) == target(trunk[:a+1] + tokens[:k])[-1]
        i = int(prop.trunk_index[b])
        trunk = caches[i].token_ids
        ab = int(prop.anchors[b])
        p = logits_at(hp[b], weight)
        for k in range(W):
            seq = torch.cat([trunk[: ab + 1], prop.tokens[b, :k]])
            ref = worker.target(seq[None])[0, -1]
            assert torch.allclose(p[k], ref, atol=1e-4, rtol=1e-4), (b, k)


def test_reference_blocks_use_trunk_logits(worker):
    ids = worker.train_ids[:1]
    caches = phases.prefill(worker, ids)
    prop = phases.propose(worker, caches, ids, step=0, reference=True)
    trunk = caches[0].token_ids
    a = int(prop.anchors[0])
    assert torch.equal(prop.tokens[0], trunk[a + 1: a + 1 + worker.W])
    hp = phases.score(worker, prop, caches)
    p = logits_at(hp[0], worker.target.lm_head.weight)
    assert torch.allclose(p[1], worker.target(trunk[None, : a + 2])[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", ["tiny:llama", "tiny:qwen3_next", "tiny:qwen4_exp"])
def test_target_keeps_hidden_states_not_logits(tmp_path, target):
    """What the step asks of the target: prefill keeps hidden [T, D] (what lm_head reads: head_input) instead of
    logits [T, V]; score returns hidden states only; extending / committing grows them; lm_head of each equals
    the logits path (qwen4_exp has no final norm: its head is lm_head alone)."""
    from specopd.models import load_target
    from specopd.tree import ProposalTree
    from specopd.models.tiny import resolve_target_path

    cfg = tiny_recipe(str(tmp_path), target=target)
    m = load_target(resolve_target_path(cfg.model, str(tmp_path)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.vocab_size, (21,), generator=g)
    x = torch.randn(3, m.hidden_size, generator=g)
    torch.testing.assert_close(m.head(x), m.lm_head(m.head_input(x)))
    full = m.prefill(ids)
    lean = m.prefill(ids, keep_logits=False, keep_hidden=True)
    assert lean.logits is None and lean.hidden.shape == (21, m.hidden_size)
    torch.testing.assert_close(m.lm_head(lean.hidden), full.logits, rtol=1e-5, atol=1e-5)
    tree = ProposalTree.from_branches(torch.tensor([0, 7, 20]), torch.randint(0, m.vocab_size, (3, 4), generator=g))
    hid = m.score(tree, lean, return_logits=False, return_hidden=True)
    assert hid.shape == (3, 4, m.hidden_size)
    torch.testing.assert_close(m.lm_head(hid), m.score(tree, full), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="return_logits=False"):
        m.score(tree, lean, return_logits=False)
    # growth: prefill extension and commit keep hidden rows for every token
    more = torch.randint(0, m.vocab_size, (3,), generator=g)
    ext = m.prefill(more, cache=lean)
    ref = m.prefill(torch.cat([ids, more]), keep_logits=False, keep_hidden=True)
    torch.testing.assert_close(ext.hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    chain = ProposalTree.from_branches(torch.tensor([20]), more.view(1, 3))
    _, state = m.score(chain, lean, return_state=True)
    got = m.commit([lean], state, [torch.arange(3)])[0]
    assert got.logits is None
    torch.testing.assert_close(got.hidden, ref.hidden, rtol=1e-5, atol=1e-5)


def _reference_step(w, prop, denom):
    """The v0.1 step on full logits: a second drafter forward (teacher forcing the sampled tokens), q [N, W, V],
    p [N, W, V] from plain target forwards of trunk[:a+1] + tokens[:W-1], e2e_tv_loss / ce_loss, confidence."""
    from specopd.drafters import shift_tokens
    from specopd.losses import ce_loss

    t = w.cfg.trainer
    prev = shift_tokens(prop.anchor_tokens, prop.tokens)
    args = (prop.features, prop.anchors, prop.trunk_index, prop.anchor_tokens, prev)
    conf = None
    if w.drafter.has_confidence:
        q, conf = w.drafter(*args, return_confidence=True)
    else:
        q = w.drafter(*args)
    with torch.no_grad():
        p = []
        for b in range(q.shape[0]):
            trunk = w.sample(prop.sample_ids[int(prop.trunk_index[b])])["input_ids"]
            a = int(prop.anchors[b])
            seq = torch.cat([trunk[: a + 1], prop.tokens[b, : w.W - 1]]) if not prop.reference else trunk
            p.append(w.target(seq[None])[0, a: a + w.W])
        p = torch.stack(p)
    if t.method == "offpolicy_ce":
        loss = ce_loss(q, prop.tokens, denom=denom)
    else:
        loss = e2e_tv_loss(q, p, denom=denom, temperature=t.acceptance_temperature)
    if t.ce_weight > 0 and t.ce_labels == "target":  # the target's argmax on the scored history
        loss = loss + t.ce_weight * ce_loss(q, p.argmax(-1), denom=denom)
    elif t.ce_weight > 0:  # the reference tokens after each anchor, read from the trunk here
        ref = torch.stack([w.sample(prop.sample_ids[int(prop.trunk_index[b])])["input_ids"][
            int(prop.anchors[b]) + 1: int(prop.anchors[b]) + 1 + w.W] for b in range(q.shape[0])])
        loss = loss + t.ce_weight * ce_loss(q, ref, denom=denom)
    alpha = tv_alpha(q.detach(), p, temperature=t.acceptance_temperature)
    if conf is not None:
        loss = loss + w.cfg.drafter.confidence_weight * confidence_loss(conf, alpha, denom=denom)
    return loss, alpha


@pytest.mark.parametrize("kind,method,temp", [("dflash", "specopd", 0.8), ("dspark", "specopd", 0.8),
                                              ("dflash", "offpolicy_ce", 0.8), ("dspark", "offpolicy_e2e_tv", 0.8),
                                              ("dflash", "specopd", 0.0), ("dspark", "specopd", 0.0),
                                              ("dflash", "offpolicy_e2e_tv", 0.0), ("dflash", "specopd+ce", 0.8),
                                              ("dspark", "specopd+ce", 0.0), ("dflash", "offpolicy_e2e_tv+ce", 0.8),
                                              ("dflash", "specopd+tce", 0.8), ("dspark", "offpolicy_e2e_tv+tce", 1.0)])
def test_one_forward_step_equals_full_logit_reference(tmp_path, kind, method, temp):
    """The step's one drafter forward (branches sampled from its detached hidden state, the fused chunked loss on
    the same graph; DSpark teacher-forcing its own samples) gives the loss, alpha and gradients of the v0.1
    full-logit step with a second forward. temp 0: greedy branches, alpha = q(argmax p). "+ce": trainer.ce_weight
    adds the CE on the reference tokens after each anchor; "+tce" the CE on the target's argmax of the plain forwards
    (trainer.ce_labels=target)."""
    method, extra = method.split("+")[0], method.split("+")[1:]
    ce = 0.4 if extra else 0.0
    labels = ["trainer.ce_labels=target"] if extra == ["tce"] else []
    cfg = tiny_recipe(str(tmp_path), [f"drafter.kind={kind}", f"trainer.method={method}", "trainer.loss_chunk_rows=5",
                                      f"trainer.acceptance_temperature={temp}", "drafter.block_size=5",
                                      f"trainer.ce_weight={ce}"] + labels)
    w = Worker(cfg)
    ids = w.train_ids[:2]
    caches = phases.prefill(w, ids)
    prop = phases.propose(w, caches, ids, step=1, reference=method.startswith("offpolicy"))
    assert prop.hidden.requires_grad  # the forward that proposes carries the gradient
    if method == "specopd":  # the branches are those the decoding-style sampler draws from the same forward
        rows = [torch.nonzero(prop.trunk_index == i).flatten() for i in range(len(ids))]
        gens = [w.generator("branch", 1, int(s)) for s in ids]
        with torch.no_grad():
            toks, _ = w.drafter.sample(prop.features, prop.anchors, prop.trunk_index, prop.anchor_tokens,
                                       temp, gens, rows=rows)
        assert torch.equal(toks, prop.tokens)
    assert (prop.reference_tokens is not None) == (ce > 0)
    hp = phases.score(w, prop, caches)
    denom = 3 * prop.tokens.shape[0]
    ref_loss, ref_alpha = _reference_step(w, prop, denom)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in w.params]
    w.optimizer.zero_grad(set_to_none=True)
    m = phases.loss_backward(w, prop, hp, denom)
    assert prop.hidden is None  # the graph was consumed
    assert m["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(torch.tensor(m["alpha_sum"]), ref_alpha.sum(0), rtol=1e-5, atol=1e-6)
    for p, g in zip(w.params, ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6 * float(g.abs().max()) + 1e-9)


class _MaxVocabTensor(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized dim that any op produces (forward and backward),
    other than tensors shaped like a weight (the frozen lm_head / embedding, DSpark's Markov weights, their
    gradients and AdamW states, and transposes)."""

    def __init__(self, vocab: int, weight_shapes):
        super().__init__()
        self.vocab, self.max_numel, self.op = vocab, 0, None
        self.skip = {tuple(s) for s in weight_shapes} | {tuple(s)[::-1] for s in weight_shapes}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if (isinstance(t, torch.Tensor) and self.vocab in t.shape and tuple(t.shape) not in self.skip
                    and t.numel() > self.max_numel):
                self.max_numel, self.op = t.numel(), f"{func} {tuple(t.shape)}"
        return out


@pytest.mark.parametrize("kind,method", [("dflash", "specopd"), ("dspark", "specopd"), ("dflash", "draft_opd"),
                                         ("dflash", "offpolicy_ce"), ("dflash2", "specopd"),
                                         ("dflash2", "draft_opd"), ("dflash2", "offpolicy_ce"),
                                         ("eagle3", "specopd"), ("eagle3", "offpolicy_ce"), ("eagle3", "draft_opd")])
def test_step_never_holds_branch_logits(tmp_path, kind, method):
    """No op of a whole training step (prefill, propose, score, loss, backward, optimizer) or of the held-out
    evaluation outputs a vocabulary-sized tensor (other than weights, V2's codebooks [V, r] among them) larger than
    one [chunk, V] chunk: no [N, W, V], [N, V] (DSpark's slot logits), [M, V] (scored nodes) or [T, V] (trunk
    logits)."""
    v, chunk = 997, 4  # a prime vocabulary: no other size equals it
    cfg = tiny_recipe(str(tmp_path), [f"drafter.kind={kind}", f"trainer.method={method}",
                                      f"trainer.loss_chunk_rows={chunk}", f"model.tiny.vocab_size={v}",
                                      "drafter.block_size=8", "trainer.anchors_per_seq=8", "data.batch_size=4"])
    w = Worker(cfg)
    ids = w.train_ids[:4]
    shapes = [p.shape for p in list(w.target.parameters()) + list(w.drafter.parameters()) if v in p.shape]
    with _MaxVocabTensor(v, shapes) as rec:
        m = phases.colocated_step(w, ids, 0, None)
        phases.evaluate(w, w.heldout_ids[:2])
    limit = chunk * v
    if method == "draft_opd":  # its rollout's p and q logits of one round: [sequences, W + 1, V] (small)
        limit = len(ids) * (w.W + 1) * v
        assert m["branches"] * w.W * v > 2 * limit  # all blocks' p [N, W, V] would be caught
    else:
        assert min(m["branches"], cfg.data.seq_len) * v > limit  # each forbidden tensor would be caught
    assert rec.max_numel <= limit, (rec.max_numel, rec.op, m["branches"], w.W, v)


def verify_block(p_logits: torch.Tensor, q_logits: torch.Tensor, draft: torch.Tensor, temperature: float,
                 generator: torch.Generator) -> tuple:
    """One block through ``specopd.speculative.accept``.

    Args:
        p_logits: [W + 1, V] the target's logits.
        q_logits: [W, V] the drafter's logits.
        draft: [W] drafted tokens.
        temperature: T.
        generator: the torch.Generator.

    Returns:
        (number of accepted draft tokens k, the committed tokens draft[:k] + the resampled / bonus token).
    """
    (k,), (y,) = spec.accept(draft[None], q_logits[None], p_logits[None], temperature, generator)
    return k, torch.cat([draft[:k], torch.tensor([y], device=draft.device, dtype=draft.dtype)])


def test_verify_block_is_lossless():
    """Rejection sampling commits tokens distributed as p, whatever q drafted them."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, 4, generator=g) * 2
    q_logits = torch.randn(2, 4, generator=g) * 2
    q0 = torch.softmax(q_logits[0], -1)
    p0 = torch.softmax(p_logits[0], -1)
    assert float((p0 - q0).abs().max()) > 0.2  # a wrong verifier (committing q's draws) would be caught
    counts = torch.zeros(4)
    n = 1500
    for _ in range(n):
        draft = torch.stack([torch.multinomial(torch.softmax(q_logits[j], -1), 1, generator=g)[0] for j in range(2)])
        _, new = verify_block(p_logits, q_logits, draft, 1.0, g)
        counts[int(new[0])] += 1
    assert torch.allclose(counts / n, p0, atol=0.045), (counts / n, p0, q0)
    # q == p: everything is accepted, plus the bonus token
    k, new = verify_block(p_logits, p_logits[:2], torch.tensor([1, 2]), 1.0, g)
    assert k == 2 and new.numel() == 3


def test_two_workers_equal_one(tmp_path):
    """Splitting a batch over 2 in-process workers and summing their gradients (the all-reduce) gives the
    1-worker gradient; after the optimizer step both replicas are identical."""
    cfg = tiny_recipe(str(tmp_path))
    g1, g2 = LocalGroup(cfg, 1), LocalGroup(cfg, 2)
    try:
        ids = g1.workers[0].train_ids[:4]
        denom = 4 * cfg.trainer.anchors_per_seq
        losses = []
        for grp, parts in ((g1, [ids]), (g2, [ids[:2], ids[2:]])):
            grp.run(phases.stage, [(p, 0) for p in parts])
            res = grp.run(phases.loss_backward, [(w.staged.proposals, w.staged.hp, denom) for w in grp.workers])
            losses.append(sum(r["loss"] for r in res))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        one = [p.grad.clone() for p in g1.workers[0].drafter.parameters()]
        two = [a.grad + b.grad for a, b in zip(g2.workers[0].drafter.parameters(), g2.workers[1].drafter.parameters())]
        for a, b in zip(one, two):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
        g2.run(phases.optimizer_step, [(), ()])
        for b, c in zip(g2.workers[0].drafter.parameters(), g2.workers[1].drafter.parameters()):
            assert torch.equal(b, c)  # the all-reduce ran: replicas stay identical
    finally:
        g1.shutdown()
        g2.shutdown()


@pytest.mark.parametrize("method", ["draft_opd", "offpolicy_ce", "offpolicy_e2e_tv"])
def test_baselines_train(tmp_path, method):
    cfg = tiny_recipe(str(tmp_path), [f"trainer.method={method}", "trainer.max_steps=2", "trainer.eval_heldout=false"])
    summary = train(cfg, progress=False)
    lines = [json.loads(x) for x in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2] and summary["steps"] == 2
    for m in lines:
        assert m["supervised_tokens"] == m["branches"] * (cfg.drafter.block_size - 1) > 0
        assert m["branches"] <= cfg.data.batch_size * cfg.trainer.anchors_per_seq
        assert torch.isfinite(torch.tensor(m["loss"])) and m["supervised_tokens_per_s"] > 0
    assert os.path.isfile(os.path.join(summary["final_checkpoint"], "model.safetensors"))


@pytest.mark.parametrize("method", ["offpolicy_ce", "offpolicy_e2e_tv"])
def test_cache_trunks_same_numbers_one_prefill_per_sequence(tmp_path, method):
    """trainer.cache_trunks: bit-identical losses and weights, and the target runs once per sequence (counted on
    its first decoder layer); on-policy methods refuse it."""
    from specopd.config import RecipeError
    from specopd.runs.checkpoint import find_latest

    over = [f"trainer.method={method}", "trainer.max_steps=6", "trainer.eval_heldout=false", "data.num_samples=6",
            "data.heldout=0", "data.batch_size=4"]
    runs = {}
    for cache in (False, True):
        out = str(tmp_path / f"c{int(cache)}")
        calls = []
        import specopd.train.worker as W

        orig = W.Worker.__init__

        def init(self, *a, **k):
            orig(self, *a, **k)
            self.target.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))

        W.Worker.__init__ = init
        try:
            train(tiny_recipe(out, over + [f"trainer.cache_trunks={str(cache).lower()}"]), progress=False)
        finally:
            W.Worker.__init__ = orig
        from safetensors.torch import load_file

        runs[cache] = ([json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))],
                       load_file(os.path.join(find_latest(out), "model.safetensors")), len(calls))
    (l0, w0, n0), (l1, w1, n1) = runs[False], runs[True]
    assert l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert n0 == 6 * 4 and n1 == 6  # 6 steps x 4 sequences prefilled vs each of the 6 sequences once
    with pytest.raises(RecipeError, match="cache_trunks"):
        tiny_recipe(str(tmp_path / "x"), ["trainer.method=specopd", "trainer.cache_trunks=true"])
    # held-out evaluation scores sampled branches (full K/V): it prefills in full next to the reused trunks
    out = str(tmp_path / "ev")
    train(tiny_recipe(out, [f"trainer.method={method}", "trainer.max_steps=4", "trainer.cache_trunks=true",
                            "trainer.eval_every=2"]), progress=False)
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "heldout_expected_al" in r] == [2, 4]


def test_expected_al_rises_on_heldout(tmp_path):
    """A short SpecOPD run raises the held-out expected acceptance length (bonus included)."""
    cfg = tiny_recipe(str(tmp_path), ["trainer.max_steps=25", "trainer.lr=3e-2", "data.batch_size=4"])
    s = train(cfg, progress=False)
    before, after = s["eval_before"]["expected_al"], s["eval_after"]["expected_al"]
    assert after > before + 0.1, (before, after)  # measured here: 1.16 -> 1.38


def test_eval_every_logs_heldout_al_and_draws_it(tmp_path):
    """trainer.eval_every=2, log_every=3, 5 steps: metrics lines at 2, 3, 4, 5; held-out AL at 2, 4 and the last
    step (5), not at 3; the logged number is the held-out AL of the drafter saved after that step; the figure is
    a PNG; the progress bar is not needed for any of it."""
    from safetensors.torch import load_file

    from specopd.train.validator import read_heldout_al

    cfg = tiny_recipe(str(tmp_path), ["trainer.max_steps=5", "trainer.eval_every=2", "trainer.log_every=3",
                                      "trainer.eval_heldout=false"])
    s = train(cfg, progress=False)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in rows] == [2, 3, 4, 5]
    assert [m["step"] for m in rows if "heldout_expected_al" in m] == [2, 4, 5]
    for m in rows:
        if "heldout_expected_al" in m:
            assert 1.0 <= m["heldout_expected_al"] <= cfg.drafter.block_size and m["heldout_branches"] > 0
            assert len(m["heldout_alpha"]) == cfg.drafter.block_size - 1 and m["heldout_eval_s"] > 0
    assert read_heldout_al(tmp_path) == [(m["step"], m["heldout_expected_al"]) for m in rows if "heldout_expected_al" in m]
    # the curve starts at the drafter before training (computed for it although eval_heldout is off)
    assert s["eval_before"]["expected_al"] >= 1.0 and s["heldout_expected_al"]["step"] == 5
    png = tmp_path / "heldout_al.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s["heldout_expected_al"]["figure"] == str(png)
    # an independent evaluation of the final checkpoint's weights gives the logged step-5 number exactly (held-out
    # sequences go data.batch_size at a time: the trunk caches of one batch at most; all at once agrees to rounding)
    w = Worker(tiny_recipe(str(tmp_path / "fresh"), ["trainer.max_steps=5"]))
    w.drafter.load_state_dict(load_file(os.path.join(s["final_checkpoint"], "model.safetensors")))
    ids, bs = w.heldout_ids, cfg.data.batch_size
    assert len(ids) > bs  # more than one batch
    again = reduce_metrics([phases.evaluate(w, ids[i: i + bs]) for i in range(0, len(ids), bs)], 0.0)["expected_al"]
    assert again == rows[-1]["heldout_expected_al"] and again != s["eval_before"]["expected_al"]
    assert reduce_metrics([phases.evaluate(w, ids)], 0.0)["expected_al"] == pytest.approx(again, rel=1e-6)


def test_eval_every_bad_values_are_clear_errors():
    from specopd.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"trainer.eval_every=-1 is out of range"):
        load_recipe(None, ["trainer.eval_every=-1"])
    with pytest.raises(RecipeError, match=r"data.heldout=0 holds none out: set data.heldout"):
        load_recipe(None, ["trainer.eval_every=10", "data.heldout=0"])
    with pytest.raises(RecipeError, match="expected int"):
        load_recipe(None, ["trainer.eval_every=often"])
    assert load_recipe(None, ["trainer.eval_every=0", "data.heldout=0"]).trainer.eval_every == 0


def test_train_refuses_a_main_job_recipe(tmp_path):
    """The training loop does not run the main job (the CLI does: cli -> mainjob -> train): a clear error."""
    from specopd.config import RecipeError

    with pytest.raises(RecipeError, match=r"pipeline.enabled=true is the main job .* `specopd train RECIPE`"):
        train(tiny_recipe(str(tmp_path), ["pipeline.enabled=true"]), progress=False)
    assert not os.listdir(tmp_path)  # refused before anything is written


@pytest.mark.parametrize("target", ["tiny:qwen3_next", pytest.param("tiny:qwen4_exp", marks=pytest.mark.slow)])
def test_gdn_and_qsa_targets_train(tmp_path, target):
    """The same step on GDN (qwen3_next) and QSA (qwen4_exp) targets: branch scores exact, a step runs."""
    w = Worker(tiny_recipe(str(tmp_path), target=target))
    ids = w.train_ids[:2]
    caches = phases.prefill(w, ids)
    prop = phases.propose(w, caches, ids, step=0)
    b = 1
    p = logits_at(phases.score(w, prop, caches)[b], w.target.lm_head.weight)
    trunk, a = caches[0].token_ids, int(prop.anchors[b])
    for k in range(w.W):
        ref = w.target(torch.cat([trunk[: a + 1], prop.tokens[b, :k]])[None])[0, -1]
        assert torch.allclose(p[k], ref, atol=1e-4, rtol=1e-4), k
    m = phases.colocated_step(w, ids, 0, None)
    assert m["branches"] == 2 * w.cfg.trainer.anchors_per_seq and m["loss"] > 0


def test_dspark_drafter_trains(tmp_path):
    """DSpark: Markov head sampled left to right with per-sample generators; confidence loss included."""
    cfg = tiny_recipe(str(tmp_path), ["drafter.kind=dspark", "trainer.max_steps=2", "trainer.eval_heldout=false"])
    w = Worker(cfg)
    ids = w.train_ids[:2]
    caches = phases.prefill(w, ids)
    prop = phases.propose(w, caches, ids, step=0)
    alone = phases.propose(w, phases.prefill(w, ids[1:]), ids[1:], step=0)
    B = cfg.trainer.anchors_per_seq
    assert torch.equal(alone.tokens, prop.tokens[B:])
    s = train(cfg, progress=False)
    from specopd.drafters import load_drafter

    assert load_drafter(s["final_checkpoint"], w.target).kind == "dspark"


def test_loop_with_two_local_workers(tmp_path):
    """train() with runtime.num_workers=2 (threads + summing all-reduce): every sample of the global batch
    is trained on once per step, and the run matches the 1-worker loss closely."""
    cfg2 = tiny_recipe(str(tmp_path / "two"), ["runtime.num_workers=2", "trainer.max_steps=2", "trainer.eval_heldout=false"])
    cfg1 = tiny_recipe(str(tmp_path / "one"), ["trainer.max_steps=2", "trainer.eval_heldout=false"])
    train(cfg2, progress=False)
    train(cfg1, progress=False)
    m2 = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    m1 = [json.loads(x) for x in open(tmp_path / "one" / "metrics.jsonl")]
    for a, b in zip(m1, m2):
        assert b["branches"] == a["branches"] == cfg1.data.batch_size * cfg1.trainer.anchors_per_seq
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def test_groups_and_drafters_satisfy_their_protocols(tmp_path):
    """LocalGroup and RayGroup are WorkerGroups; the drafters are BlockDrafters. A group runs the function it is
    given on each worker, checks the roles it is asked for, and its typed state calls read the workers."""
    from specopd.distributed.ray_backend import RayGroup
    from specopd.speculative import BlockDrafter
    from specopd.train.group import WorkerGroup, data_info, worker_state

    g = LocalGroup(tiny_recipe(str(tmp_path)), 1)
    try:
        assert isinstance(g, WorkerGroup) and isinstance(g.workers[0].drafter, BlockDrafter)
        assert g.run(lambda w, x: (w.rank, x), [(7,)]) == [(0, 7)]
        assert data_info(g)["train_ids"] == g.workers[0].train_ids
        assert worker_state(g)["steps_done"] == 0
        with pytest.raises(ValueError, match="role='target'"):
            g.run(Worker.data_info, [()], role="target")  # colocated: there are no target workers
        with pytest.raises(ValueError, match="2 argument tuples for 1 workers"):
            g.run(Worker.data_info, [(), ()])
    finally:
        g.shutdown()
    methods = [m for m in vars(WorkerGroup) if not m.startswith("_")]
    assert {"run", "take_spans", "shutdown"} <= set(methods)
    assert all(callable(getattr(RayGroup, m)) for m in methods if m not in ("num_workers", "split", "closed"))


def test_split_roles_in_process_equal_colocated(tmp_path):
    """runtime.roles=split in-process: target workers keep the trunk caches and score, drafter workers
    propose and train; a step and a held-out evaluation equal the colocated worker's exactly."""
    col = LocalGroup(tiny_recipe(str(tmp_path)))
    split = LocalGroup(tiny_recipe(str(tmp_path), ["runtime.roles=split"]))
    try:
        assert split.targets[0].role == "target" and split.workers[0].role == "drafter"
        ids = col.workers[0].train_ids[:4]
        denom = 4 * col.workers[0].cfg.trainer.anchors_per_seq
        a = col.run(phases.colocated_step, [(ids, 0, denom)])[0]
        b = phases.split_step(split, [ids], 0, denom)[0]
        assert b["loss"] == a["loss"] and b["alpha_sum"] == a["alpha_sum"]
        assert {"prefill", "score", "propose", "loss_backward"} <= set(b["phase_s"])
        assert split.targets[0].trunk_caches is None  # the trunk caches are dropped after scoring
        for p, q in zip(col.workers[0].drafter.parameters(), split.workers[0].drafter.parameters()):
            assert torch.equal(p, q)
        held = col.workers[0].heldout_ids[:2]
        assert phases.split_evaluate(split, [held]) == col.run(phases.evaluate, [(held,)])
    finally:
        col.shutdown()
        split.shutdown()
