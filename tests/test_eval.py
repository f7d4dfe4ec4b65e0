"""Speculative decoding: lossless at T > 0 (distribution of the first tokens), exact at T = 0, AL accounting."""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

from oracle import CONFIGS, make_tiny_checkpoint
from specopd.eval import SpeculativeDecoder, autoregressive
from specopd.eval.cli import evaluate_al, format_table
from specopd.models import MODEL_TYPES, load_target

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """1-layer llama, vocab 8 (so the distribution of two tokens is a 64-cell table)."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("eval"), vocab_size=8, num_hidden_layers=1,
                                initializer_range=0.5)
    return load_target(path)


class PositionContext:
    """The fake drafters' decoding cache: counts the context positions it was given (their anchor)."""

    def __init__(self):
        self.n = 0

    def __len__(self):
        return self.n

    def extend(self, features):
        self.n += features.shape[0]
        return self


class RandomDrafter:
    """Context-blind random drafter: logits [W, V] depend on the anchor token only; sampled like the real ones."""

    feature_layers = (0,)
    training = False

    def __init__(self, vocab: int, block_size: int = 3, scale: float = 2.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = scale * torch.randn(vocab, block_size, vocab, generator=g)
        self.block_size = self.draft_len = block_size

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def context_cache(self):
        return PositionContext()

    def extend_contexts(self, ctxs, features, next_tokens=None):
        for c, f in zip(ctxs, features):
            c.extend(f)

    def draft_batch(self, ctxs, anchor_tokens, temperature=1.0, generators=None):
        logits = self.table[torch.as_tensor(anchor_tokens).cpu()]  # [N, W, V]
        if temperature == 0:
            return logits.argmax(-1), logits
        probs = torch.softmax(logits / temperature, -1).view(-1, logits.shape[-1])
        return torch.multinomial(probs, 1, generator=generators).view(logits.shape[:2]), logits


class OracleDrafter(RandomDrafter):
    """Drafts the known greedy continuation ``seq`` but corrupts draft position ``(a // 2) % (W + 1)`` (W + 1:
    none), so rounds accept 0..W tokens. Reads only the anchor position a (= the context length)."""

    def __init__(self, seq: torch.Tensor, vocab: int, block_size: int = 3):
        self.seq, self.vocab, self.block_size, self.draft_len = seq.tolist(), vocab, block_size, block_size

    def draft_batch(self, ctxs, anchor_tokens, temperature=1.0, generators=None):
        a, w = len(ctxs[0]), self.block_size
        toks = [self.seq[i] if i < len(self.seq) else 0 for i in range(a + 1, a + 1 + w)]
        bad = (a // 2) % (w + 1)
        if bad < w:
            toks[bad] = (toks[bad] + 1) % self.vocab
        t = torch.tensor([toks])
        return t, 10.0 * torch.nn.functional.one_hot(t, self.vocab).float()


# ---------------------------------------------------------------------------------------------- statistics
def chi2_threshold(df: int, z: float = 3.72) -> float:
    """Upper quantile of chi-square(df) at the standard-normal z (3.72: p = 1e-4), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple:
    """Pearson chi-square of counts vs exact probs; cells with expected < min_expected pooled. -> (stat, df)."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < min_expected
    c = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    e = torch.cat([exp[~small], exp[small].sum().view(1)])
    keep = e > 0
    c, e = c[keep], e[keep]
    return float(((c - e) ** 2 / e).sum()), int(keep.sum()) - 1


@torch.no_grad()
def exact_two_tokens(target, prompt: torch.Tensor, temperature: float) -> torch.Tensor:
    """[V, V] exact joint distribution of the first two sampled tokens."""
    v = target.vocab_size
    p1 = torch.softmax(target(prompt[None])[0, -1] / temperature, -1)
    seqs = torch.cat([prompt.expand(v, -1), torch.arange(v)[:, None]], 1)
    p2 = torch.softmax(target(seqs)[:, -1] / temperature, -1)  # [V (first token), V]
    return p1[:, None] * p2


def empirical_two_tokens(decoder, prompt, n: int) -> torch.Tensor:
    v = decoder.target.vocab_size
    counts = torch.zeros(v * v)
    for s in range(n):
        toks = decoder.generate(prompt, max_new_tokens=2, generator=torch.Generator().manual_seed(s)).tokens
        counts[int(toks[0]) * v + int(toks[1])] += 1
    return counts


PROMPT = torch.tensor([1, 5, 7, 3, 2])


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.7, marks=pytest.mark.slow)])
def test_lossless_distribution_of_first_two_tokens(small, temperature):
    dec = SpeculativeDecoder(small, RandomDrafter(small.vocab_size, block_size=3), temperature=temperature)
    exact = exact_two_tokens(small, PROMPT, temperature).flatten()
    counts = empirical_two_tokens(dec, PROMPT, 800 if temperature == 1.0 else 1500)
    stat, df = chi2(counts, exact)
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} (df {df}): speculative samples are not the target's"
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    bound = 0.5 * float((exact * (1 - exact) / counts.sum()).sqrt().sum())  # >= E[TV] (Jensen)
    assert tv < 1.5 * bound, f"TV {tv:.4f} vs expected-TV bound {bound:.4f}"


def test_always_accepting_decoder_fails_the_same_check(small, monkeypatch):
    from specopd import speculative as spec
    from specopd.drafters import pick_tokens

    def accept_all(drafts, q_logits, p_logits, temperature, generator):
        bonus = pick_tokens(p_logits[:, -1], temperature, generator)
        return [drafts.shape[1]] * drafts.shape[0], bonus.tolist()

    monkeypatch.setattr(spec, "accept", accept_all)
    dec = SpeculativeDecoder(small, RandomDrafter(small.vocab_size, block_size=3), temperature=1.0)
    exact = exact_two_tokens(small, PROMPT, 1.0).flatten()
    stat, df = chi2(empirical_two_tokens(dec, PROMPT, 400), exact)
    assert stat > 10 * chi2_threshold(df), f"the check did not catch a lossy decoder (chi2 {stat:.1f}, df {df})"


@pytest.mark.slow
def test_lossless_with_a_real_dflash_drafter(small):
    from specopd.drafters import build_drafter

    d = build_drafter("dflash", small, num_layers=1, block_size=3, seed=3)
    dec = SpeculativeDecoder(small, d, temperature=1.0)
    exact = exact_two_tokens(small, PROMPT, 1.0).flatten()
    stat, df = chi2(empirical_two_tokens(dec, PROMPT, 800), exact)
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} (df {df})"


# ---------------------------------------------------------------------------------------------- greedy
def test_greedy_equals_plain_greedy_and_al_accounting(small):
    n, w = 24, 3
    ar = autoregressive(small, PROMPT, n, temperature=0.0)
    with torch.no_grad():  # plain forward greedy, the reference of the reference
        ids = PROMPT.clone()
        for _ in range(n):
            ids = torch.cat([ids, small(ids[None])[0, -1].argmax().view(1)])
    assert ar.tokens.tolist() == ids[len(PROMPT):].tolist()
    seq = torch.cat([PROMPT, autoregressive(small, PROMPT, n + w, temperature=0.0).tokens])  # drafts past n too
    res = SpeculativeDecoder(small, OracleDrafter(seq, small.vocab_size, w), temperature=0.0).generate(PROMPT, n)
    assert res.tokens[:n].tolist() == ar.tokens.tolist()
    assert res.tokens.numel() >= n and sum(res.accept_lengths) == res.tokens.numel()
    # the oracle corrupts draft position (a // 2) % (W + 1): the round accepts exactly that many drafts
    pos, expect = len(PROMPT) - 1, []
    while pos - (len(PROMPT) - 1) < n:
        k = (pos // 2) % (w + 1)
        expect.append(k + 1)
        pos += k + 1
    assert res.accept_lengths == expect
    assert res.accepted_at == [sum(a > i + 1 for a in expect) for i in range(w)]
    random_res = SpeculativeDecoder(small, RandomDrafter(small.vocab_size, w), temperature=0.0).generate(PROMPT, n)
    assert random_res.tokens[:n].tolist() == ar.tokens.tolist()


class Recording:
    """Wraps a real drafter: logs every round's (context length, anchor token, generator state, drafted tokens,
    q logits) and the rows its fc projects (each context position must be projected once, never again)."""

    def __init__(self, drafter):
        self.drafter, self.log, self.rows = drafter, [], []

    @contextlib.contextmanager
    def counting_rows(self):
        handle = self.drafter.fc.register_forward_hook(lambda m, i, o: self.rows.append(i[0].shape[0]))
        try:
            yield
        finally:
            handle.remove()

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft_batch(self, ctxs, anchor_tokens, temperature, generators):
        state = generators.get_state() if generators is not None else None
        toks, logits = self.drafter.draft_batch(ctxs, anchor_tokens, temperature, generators)
        self.log.append((len(ctxs[0]), int(anchor_tokens[0]), state, toks[0], logits[0]))
        return toks, logits


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_decoder_drafts_equal_recomputation_every_round(small, kind):
    """The decoder's drafter context cache: every round's drafted tokens and q logits equal the drafter run on
    all features of the committed sequence (plain target forward), with the same generator draws at T > 0;
    one projection pass per round over the newly committed rows only (the bonus token alone in many rounds)."""
    from specopd.drafters import build_drafter

    d = build_drafter(kind, small, num_layers=1, block_size=4, seed=5, **({"selector_top_k": 3} if kind == "dflash2"
                                                                         else {}))
    if kind == "dspark":
        with torch.no_grad():
            d.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    if kind == "dflash2":  # q on 3 of 8 tokens, depending on the previous draft
        with torch.no_grad():
            d.candidate_selector.successor_codebook.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    steps = set()
    for prompt, temp, seed in ((PROMPT, 0.0, 0), (PROMPT, 1.0, 1), (torch.tensor([4]), 1.0, 2)):
        rec = Recording(d)
        with rec.counting_rows():
            res = SpeculativeDecoder(small, rec, temperature=temp).generate(prompt, 24,
                                                                           torch.Generator().manual_seed(seed))
        full = torch.cat([prompt, res.tokens])
        with torch.no_grad():
            feats = small.hidden_states(full[None], d.feature_layers)[0]
        assert len(rec.log) == res.rounds and rec.log[0][0] == len(prompt) - 1
        for a, atok, state, toks, logits in rec.log:
            assert atok == int(full[a])
            g = None
            if state is not None:
                g = torch.Generator()
                g.set_state(state)
            with torch.no_grad():
                rt, rl = d.sample([feats[:a]], torch.tensor([a]), None, torch.tensor([atok]), temperature=temp,
                                  generator=g)
            assert torch.equal(toks, rt[0]), f"anchor {a}: cached draft differs from recomputation"
            torch.testing.assert_close(logits, rl[0], rtol=1e-5, atol=1e-5)
        anchors = [entry[0] for entry in rec.log]
        new = [b - a for a, b in zip(anchors, anchors[1:])]  # rows committed between rounds
        assert rec.rows == [n for n in [anchors[0]] + new if n], "each round projects only the committed rows"
        steps.update(new)
    assert 1 in steps and max(steps) > 1, f"rounds committed {sorted(steps)} tokens: need bonus-only and longer"


def test_one_token_prompt_and_stop_token(small):
    one = torch.tensor([4])
    ar = autoregressive(small, one, 10, temperature=0.0)
    res = SpeculativeDecoder(small, RandomDrafter(small.vocab_size, 3), temperature=0.0).generate(one, 10)
    assert res.tokens[:10].tolist() == ar.tokens.tolist()
    stop = int(ar.tokens[3])
    first = ar.tokens.tolist().index(stop)
    res = SpeculativeDecoder(small, RandomDrafter(small.vocab_size, 3), temperature=0.0,
                             stop_token_ids=[stop]).generate(one, 10)
    assert res.tokens.tolist() == ar.tokens[: first + 1].tolist() and res.stopped_by == "stop_token"
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        SpeculativeDecoder(small, RandomDrafter(small.vocab_size, 3)).generate(torch.tensor([]), 4)
    with pytest.raises(ValueError, match="block_size must be in"):
        SpeculativeDecoder(small, RandomDrafter(small.vocab_size, 3), block_size=4)
    with pytest.raises(ValueError, match="context limit"):
        SpeculativeDecoder(small, RandomDrafter(small.vocab_size, 3)).generate(PROMPT, 5000)


def test_evaluate_al_table(small):
    ar = autoregressive(small, PROMPT, 15, temperature=0.0)
    oracle = OracleDrafter(torch.cat([PROMPT, ar.tokens]), small.vocab_size, 3)
    r = evaluate_al(small, oracle, [PROMPT], 12, temperature=0.0, baseline=True)
    res = SpeculativeDecoder(small, oracle, temperature=0.0).generate(PROMPT, 12)
    assert r["mean_al"] == pytest.approx(res.mean_accept_length) and r["rounds"] == res.rounds
    assert r["survival"] == pytest.approx(res.survival)
    assert r["per_position_acceptance"][0] == pytest.approx(res.accepted_at[0] / res.rounds)
    assert r["speedup"] > 0 and r["ar_new_tokens"] == 12 and r["mean_al"] > 1.5
    assert "incl. bonus" in format_table(r)


# ---------------------------------------------------------------------------------------------- every attention kind
@contextlib.contextmanager
def count_target_passes(target):
    """Counts target passes (plain, prefill or score) with a forward hook on the first decoder layer's MLP,
    which every pass runs exactly once. Yields a one-element list holding the count."""
    n = [0]
    handle = target.model.layers[0].mlp.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    try:
        yield n
    finally:
        handle.remove()


KINDS = {"gqa": ("llama", {}), "gdn": ("qwen3_next", {}), "qsa": ("qwen4_exp_text", {})}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_attention_kind_decodes_identically_at_t0(kind, tmp_path):
    mt, over = KINDS[kind]
    if mt not in CONFIGS or mt not in MODEL_TYPES:
        pytest.skip(f"{mt} ({kind}) not available yet: needs tests/oracle.py CONFIGS[{mt!r}] and "
                    f"specopd/models registering it")
    target = load_target(make_tiny_checkpoint(mt, tmp_path, **over))
    assert kind in target.layer_kinds
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (23,), generator=g)
    n, c = 30, 8  # 53 tokens: past the QSA budget (16) and several GDN checkpoints (every 8)
    ar = autoregressive(target, prompt, n, temperature=0.0, gdn_checkpoint_every=c)
    with torch.no_grad():
        ref = target(torch.cat([prompt, ar.tokens])[None])[0, len(prompt) - 1:-1].argmax(-1)
    assert ar.tokens.tolist() == ref.tolist()
    longer = autoregressive(target, prompt, n + 4, temperature=0.0, gdn_checkpoint_every=c).tokens
    oracle = OracleDrafter(torch.cat([prompt, longer]), target.vocab_size, 4)
    with count_target_passes(target) as passes:
        res = SpeculativeDecoder(target, oracle, temperature=0.0, gdn_checkpoint_every=c).generate(prompt, n)
    assert res.tokens[:n].tolist() == ar.tokens.tolist()
    assert sum(res.accept_lengths) == res.tokens.numel() and len(set(res.accept_lengths)) > 1
    assert passes[0] == res.rounds + 1, f"{passes[0]} target passes for {res.rounds} rounds (+1 prompt prefill)"
    with count_target_passes(target) as passes:
        sampled = SpeculativeDecoder(target, RandomDrafter(target.vocab_size, 4), temperature=1.0,
                                     gdn_checkpoint_every=c).generate(prompt[:1], 12, torch.Generator().manual_seed(0))
    assert passes[0] == sampled.rounds + 1 and sum(sampled.accept_lengths) == sampled.tokens.numel()
    from specopd.drafters import build_drafter

    for drafter_kind in ("dflash", "dspark", "dflash2"):  # real drafters through their context caches
        d = build_drafter(drafter_kind, target, num_layers=1, block_size=4, seed=0)
        with count_target_passes(target) as passes:
            res = SpeculativeDecoder(target, d, temperature=0.0, gdn_checkpoint_every=c).generate(prompt, n)
        assert res.tokens[:n].tolist() == ar.tokens.tolist()
        assert passes[0] == res.rounds + 1


def test_main_eval_on_the_tiny_recipe(tmp_path, capsys):
    import json

    from specopd.config import load_recipe
    from specopd.eval.cli import main_eval

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_recipe(os.path.join(root, "recipes", "tiny.yaml"), [
        f"trainer.output_dir={tmp_path}", "eval.checkpoint=none", "eval.prompts=2", "eval.max_new_tokens=6",
        "data.num_samples=8", "data.seq_len=12", "data.heldout=0.25"])
    out = tmp_path / "eval.json"
    r = main_eval(cfg, ["--json", str(out)])
    assert json.loads(out.read_text())["mean_al"] == pytest.approx(r["mean_al"]) and r["num_prompts"] == 2
    assert r["mean_al"] >= 1.0 and len(r["survival"]) == cfg.drafter.block_size - 1 and "speedup" in r
    assert "incl. bonus" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="eval.checkpoint=none"):
        main_eval(load_recipe(os.path.join(root, "recipes", "tiny.yaml"), [f"trainer.output_dir={tmp_path}"]), [])


def test_eval_cli_on_a_folder_that_is_not_a_drafter(tmp_path, capsys):
    """``specopd eval RECIPE eval.checkpoint=<a model folder>``: exit code 2 and a message naming the folder and
    what a drafter folder holds, no traceback."""
    import json

    from specopd.cli import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = tmp_path / "some-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rc = main(["eval", os.path.join(root, "recipes", "tiny.yaml"), f"trainer.output_dir={tmp_path / 'run'}",
               f"eval.checkpoint={model}", "eval.prompts=1", "eval.max_new_tokens=2", "data.num_samples=8",
               "data.seq_len=12", "data.heldout=0.25"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"'{model}' is not a drafter folder" in err and "a drafter folder holds config.json" in err.lower()
    assert "Traceback" not in err


def test_acceptance_table_shows_counts_and_unreached_positions(small):
    ar = autoregressive(small, PROMPT, 15, temperature=0.0)
    oracle = OracleDrafter(torch.cat([PROMPT, ar.tokens]), small.vocab_size, 3)
    r = evaluate_al(small, oracle, [PROMPT], 12, temperature=0.0)
    assert r["reached_at"][0] == r["rounds"] and r["reached_at"][1:] == r["accepted_at"][:-1]
    cells = format_table(r).splitlines()[4]
    assert f"({r['accepted_at'][0]}/{r['rounds']})" in cells
    # a drafter that is never right: position 1 is 0/rounds, later positions are never reached
    class Never(OracleDrafter):
        def draft_batch(self, ctxs, anchor_tokens, *a, **k):
            toks, _ = super().draft_batch(ctxs, anchor_tokens, *a, **k)
            toks[0, 0] = (self.seq[len(ctxs[0]) + 1] + 1) % self.vocab  # the first draft is always wrong
            return toks, 10.0 * torch.nn.functional.one_hot(toks, self.vocab).float()

    r = evaluate_al(small, Never(torch.cat([PROMPT, ar.tokens]), small.vocab_size, 3), [PROMPT], 6, temperature=0.0)
    assert r["mean_al"] == 1.0 and r["per_position_acceptance"] == [0.0, None, None]
    assert format_table(r).splitlines()[4].split()[-3:] == [f"(0/{r['rounds']})", "-", "-"]


def test_main_eval_prompts_file_and_temperatures(tmp_path, capsys):
    import json

    from specopd.config import load_recipe
    from specopd.eval.cli import main_eval
    from test_data import write_char_tokenizer

    target_dir = make_tiny_checkpoint("llama", tmp_path / "t", vocab_size=128, num_hidden_layers=1, eos_token_id=2)
    write_char_tokenizer(target_dir)
    (tmp_path / "p.txt").write_text("hi there\nwhat now?\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"}]}) + "\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_recipe(os.path.join(root, "recipes", "tiny.yaml"), [
        f"trainer.output_dir={tmp_path}", f"model.target={target_dir}", "eval.checkpoint=none",
        "eval.max_new_tokens=5"])
    out = tmp_path / "eval.json"
    r = main_eval(cfg, ["--prompts", str(tmp_path / "p.txt"), "--temperatures", "0,1", "--no-baseline",
                        "--json", str(out)])
    assert r["num_prompts"] == 2 and sorted(r["by_temperature"]) == ["0", "1"] and r["temperature"] == 0.0
    assert json.loads(out.read_text())["by_temperature"]["1"]["mean_al"] == pytest.approx(
        r["by_temperature"]["1"]["mean_al"])
    text = capsys.readouterr().out
    assert "T=0 " in text and "T=1 " in text and "mean AL (incl. bonus): T=0" in text
    # the chat template is applied: the JSONL messages and the plain-text line give the same prompt ids
    from specopd.data.prepare import encode_prompt, load_tokenizer
    from specopd.eval.cli import file_prompt_ids

    want = encode_prompt(load_tokenizer(target_dir, 128), [{"role": "user", "content": "hi there"}])
    assert file_prompt_ids(str(tmp_path / "p.txt"), target_dir, 128)[0].tolist() == want
    assert file_prompt_ids(str(tmp_path / "p.jsonl"), target_dir, 128)[0].tolist() == want
    with pytest.raises(ValueError, match="--temperatures"):
        main_eval(cfg, ["--prompts", str(tmp_path / "p.txt"), "--temperatures", "-1"])
    with pytest.raises(FileNotFoundError, match="--prompts"):
        main_eval(cfg, ["--prompts", str(tmp_path / "missing.txt")])


def test_al_standard_errors():
    """al_stderr: with equal rounds per prompt it is the plain standard error of the per-prompt ALs;
    al_diff_stderr: paired, so a constant shift on every prompt has no error and a drafter against itself 0."""
    import statistics

    from specopd.eval.cli import al_diff_stderr, al_stderr

    a = [[1, 2, 1, 3], [3, 1, 1, 1], [1, 1, 1, 1], [2, 2, 4, 1], [1, 3, 2, 2]]
    per = [sum(x) / len(x) for x in a]
    assert abs(al_stderr(a) - statistics.stdev(per) / len(per) ** 0.5) < 1e-12
    assert al_diff_stderr(a, a) == 0.0
    b = [[x + 1 for x in r] for r in a]  # every round one token longer: AL(b) - AL(a) = 1 exactly, on every prompt
    assert al_diff_stderr(b, a) < 1e-12 < al_stderr(a)
    assert al_stderr([[1, 2]]) != al_stderr([[1, 2]])  # nan below 2 prompts
    with pytest.raises(ValueError, match="same >= 2 prompts"):
        al_diff_stderr(a, a[:3])
