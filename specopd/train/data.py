"""Reference sequences (prompt + response token ids), their train / held-out split, anchors and the global batch
order. Sources and counts: specopd/train/DESIGN.md ("Datasets").
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Optional

import torch
from tqdm import tqdm

from specopd.config import RecipeError
from specopd.data.formats import build_cache, conversation_samples, stats_note
from specopd.data.packaged import conversations_file
from specopd.data.prepare import load_tokenizer
from specopd.data.references import token_ids_problem
from specopd.errors import TOO_DEEP, BadInputError, own_dir, read_text_lines, replacing
from specopd.models.loading import read_config
from specopd.models.tiny import TINY_VERSION
from specopd.sampling import multinomial_tokens


def _key(cfg) -> str:
    d, m = cfg.data, cfg.model
    spec = dict(target=m.target, tiny_seed=m.tiny_seed, tiny=dict(m.tiny), v=TINY_VERSION, num_samples=d.num_samples,
                prompt_len=d.prompt_len, seq_len=d.seq_len, t=d.synthetic_temperature, seed=d.seed)
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


@torch.no_grad()
def sample_references(target, num_samples: int, prompt_len: int, seq_len: int, temperature: float, seed: int,
                      batch: int = 256, progress: bool = True) -> list:
    """Random prompts (uniform ids) + responses sampled from ``target`` at ``temperature``.

    Args:
        target: a ``TargetModel``.
        num_samples: how many sequences.
        prompt_len: prompt tokens per sequence.
        seq_len: tokens per sequence, prompt included.
        temperature: T of the sampling.
        seed: the generator's seed.
        batch: sequences per target pass.
        progress: show a progress bar.

    Returns:
        list of {"input_ids": [seq_len], "prompt_len"}.
    """
    g = torch.Generator().manual_seed(int(seed))
    v = target.vocab_size
    out = []
    chunks = range(0, num_samples, batch)
    bar = tqdm(total=num_samples * (seq_len - prompt_len), desc="sampling synthetic references", unit="tok",
               disable=not progress, leave=False)
    for s in chunks:
        n = min(batch, num_samples - s)
        ids = torch.randint(0, v, (n, prompt_len), generator=g)
        for _ in range(seq_len - prompt_len):
            logits = target(ids.to(target.device))[:, -1].float().cpu()
            nxt = multinomial_tokens(logits, temperature, g)[:, None]
            ids = torch.cat([ids, nxt], 1)
            bar.update(n)
        out.extend({"input_ids": ids[i].clone(), "prompt_len": int(prompt_len)} for i in range(n))
    bar.close()
    return out


def read_prepared(path: str, seq_len: int, vocab_size: Optional[int] = None, context: Optional[int] = None,
                  stats: Optional[dict] = None) -> list:
    """Records of a prepared .jsonl, cut to ``min(seq_len, context)`` tokens. Every record is validated as it is
    read: input_ids are integers (no 3.7, no "3", no booleans) in [0, vocab_size), prompt_len an integer; a bad one,
    or a line that is not UTF-8 JSON, is a ``BadInputError`` naming file:line.

    Args:
        path: the .jsonl.
        seq_len: cut to this many tokens.
        vocab_size: the target's vocabulary size (None: not checked).
        context: the target's max_position_embeddings (None: no limit).
        stats: when given, counts records dropped because their prompt does not fit the context
            (``prompt_too_long``), with no response token left after the cut (``no_response``), and shortened to the
            context (``cut_to_context``).

    Returns:
        list of records.
    """
    fp = os.path.join(path, "data.jsonl") if os.path.isdir(path) else path
    if os.path.isdir(fp):
        raise BadInputError(f"data.path={path!r}: {fp} is a folder; give a .jsonl file or a folder holding data.jsonl")
    if not os.path.isfile(fp):
        raise FileNotFoundError(f"prepared data {fp!r} not found (run `specopd prepare data ...`, or point "
                                f"data.path at a .jsonl with input_ids / prompt_len per line)")
    st = stats if stats is not None else {}
    st.update(records=0, prompt_too_long=0, no_response=0, cut_to_context=0)
    limit = min(seq_len, context) if context else seq_len
    out = []
    for ln, line in read_text_lines(fp, "data.path"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids = rec["input_ids"]
            pl = rec["response_start"] if "response_start" in rec else rec["prompt_len"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            what = (f"no key {e}" if isinstance(e, KeyError) else TOO_DEEP if isinstance(e, RecursionError) else
                    f"{type(e).__name__}: {e}")
            raise BadInputError(f"{fp}:{ln}: expected a JSON object with input_ids (list of ints) and "
                                f"prompt_len (int): {what}") from None
        bad = token_ids_problem(ids, vocab_size)
        if bad is None and type(pl) is not int:  # noqa: E721
            bad = f"prompt_len = {json.dumps(pl)} is not an integer"
        if bad is not None:
            raise BadInputError(f"{fp}:{ln}: {bad}; fix the record or prepare the data again "
                                f"(`specopd prepare data`)")
        st["records"] += 1
        if context and pl >= context:
            st["prompt_too_long"] += 1  # the response would start beyond the target's context
            continue
        if context and len(ids) > context and seq_len > context:
            st["cut_to_context"] += 1
        ids = torch.tensor(ids[:limit], dtype=torch.long)
        if pl < 1 or ids.numel() <= pl:
            st["no_response"] += 1  # no response left after cutting
            continue
        rec_out = {"input_ids": ids, "prompt_len": pl}
        if rec.get("loss_mask") is not None:  # supervised tokens given per token (e.g. multi-turn chats)
            lm = rec["loss_mask"]
            if not isinstance(lm, list) or len(lm) != len(rec["input_ids"]) or any(x not in (0, 1) for x in lm):
                raise BadInputError(f"{fp}:{ln}: loss_mask must be a list of 0/1, one per input_ids token "
                                    f"({len(rec['input_ids'])})")
            rec_out["loss_mask"] = torch.tensor(lm[:limit], dtype=torch.bool)
        if rec.get("split") is not None and rec["split"] not in ("train", "heldout"):
            raise BadInputError(f"{fp}:{ln}: 'split' is {json.dumps(rec['split'])}; records may say 'train' or "
                                f"'heldout' (or leave 'split' out: the split is then by id, data.heldout)")
        if rec.get("split") in ("train", "heldout"):
            rec_out["split"] = rec["split"]
        out.append(rec_out)
    if not out:
        ctx = f" and the target context of {context}" if context else ""
        raise BadInputError(f"{fp}: no usable sequences of {st['records']} (each needs prompt_len >= 1 and a "
                            f"response within data.seq_len={seq_len} tokens{ctx}; {st['prompt_too_long']} had a longer "
                            f"prompt than the target's context)")
    return out


def drop_note(st: dict, seq_len: int, context: Optional[int]) -> Optional[str]:
    """One line saying what ``read_prepared`` dropped or cut (None when nothing)."""
    said = []
    if st.get("prompt_too_long"):
        said.append(f"{st['prompt_too_long']} dropped: prompt of >= {context} tokens, longer than the target's "
                    f"context (max_position_embeddings={context})")
    if st.get("no_response"):
        said.append(f"{st['no_response']} dropped: no response token within data.seq_len={seq_len}")
    if st.get("cut_to_context"):
        said.append(f"{st['cut_to_context']} cut to the target's context of {context} tokens")
    return f"[data] of {st['records']} records, " + "; ".join(said) if said else None


def target_context(target) -> Optional[int]:
    """The target's context length (config max_position_embeddings), or None when it does not say."""
    c = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    return int(c) if c else None


def load_conversations(cfg, target, stats: dict) -> list:
    """``data.source: conversations``: the samples of ``data.path`` through the target's chat template."""
    if cfg.model.is_tiny:
        raise RecipeError(f"data.source=conversations puts each conversation through the target's chat template, "
                          f"but model.target={cfg.model.target} has no tokenizer: give a Hugging Face folder with "
                          f"its tokenizer files (e.g. `specopd prepare model smollm2-135m`)")
    tok = load_tokenizer(cfg.model.target, target.vocab_size)
    d = cfg.data
    return conversation_samples(conversations_file(d.path), tok, cfg.model.target, cfg.trainer.output_dir, d.seq_len,
                                target_context(target), overlong=d.overlong, bad_lines=d.bad_lines, seed=d.seed,
                                heldout=d.heldout, stats=stats, duplicate_ids=d.duplicate_ids)


def warm_conversation_cache(cfg) -> Optional[dict]:
    """``data.source: conversations``: tokenise data.path into its cache here (the controller, before the
    workers start: Ray workers then load it instead of each tokenising the file). Reads only the target's
    config.json and tokenizer. Returns the cache's {"path", "hit"} (None for other sources)."""
    if cfg.data.source != "conversations" or cfg.model.is_tiny:
        return None
    with open(os.path.join(cfg.model.target, "config.json")) as f:
        conf = json.load(f)
    vocab = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
    tok = load_tokenizer(cfg.model.target, int(vocab))
    return build_cache(conversations_file(cfg.data.path), tok, cfg.model.target, cfg.trainer.output_dir)


def load_dataset(cfg, target, progress: bool = True, stats: Optional[dict] = None) -> list:
    """The run's samples, built once and cached for synthetic data.

    Args:
        cfg: the recipe.
        target: the ``TargetModel``.
        progress: show progress bars.
        stats: filled with what was read, dropped, cut or skipped (prepared and conversations data).

    Returns:
        list indexed by sample id.
    """
    ctx = target_context(target)
    st: dict = stats if stats is not None else {}
    if cfg.data.source == "conversations":
        out = load_conversations(cfg, target, st)
        note = stats_note(st, min(cfg.data.seq_len, ctx) if ctx else cfg.data.seq_len)
        if note and progress:
            print(note, flush=True)
        return out
    if cfg.data.source == "prepared":
        out = read_prepared(cfg.data.path, cfg.data.seq_len, target.vocab_size, context=ctx, stats=st)
        st["source"] = "prepared"
        note = drop_note(st, cfg.data.seq_len, ctx)
        if note and progress:
            print(note, flush=True)
        return out
    if ctx and cfg.data.seq_len > ctx:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} is longer than the target's context ({ctx} tokens, "
                         f"max_position_embeddings): lower data.seq_len")
    d = cfg.data
    cache_dir = os.path.join(cfg.trainer.output_dir, "data")
    fp = os.path.join(cache_dir, f"synthetic-{_key(cfg)}.pt")
    if os.path.isfile(fp):
        try:
            samples = torch.load(fp, map_location="cpu", weights_only=True)
            why = None if synthetic_ok(samples, d.num_samples, d.seq_len) else "of another structure"
        except Exception as e:  # noqa: BLE001  (unpickling errors of a damaged file have no common class)
            why = f"unreadable ({type(e).__name__})"
        if why is None:
            return samples
        if progress:
            print(f"note: the synthetic-data cache {fp} is {why}: sampling it again", flush=True)
    samples = sample_references(target, d.num_samples, d.prompt_len, d.seq_len, d.synthetic_temperature, d.seed,
                                progress=progress)
    own_dir(cache_dir)
    with replacing(fp, "wb") as f:
        torch.save(samples, f)
    return samples


def synthetic_ok(samples, n: int, seq_len: int) -> bool:
    """Whether a loaded synthetic-data cache is what ``sample_references`` gives: ``n`` dicts of ``input_ids``
    (a [seq_len] long tensor) and ``prompt_len`` (an int)."""
    return isinstance(samples, list) and len(samples) == n and all(
        isinstance(s, dict) and isinstance(s.get("prompt_len"), int) and isinstance(s.get("input_ids"), torch.Tensor)
        and s["input_ids"].dtype == torch.long and tuple(s["input_ids"].shape) == (seq_len,) for s in samples)


def split_dataset(samples: list, heldout: float, seed: int) -> tuple:
    """(train_ids, heldout_ids): the records' own ``split`` fields when the data has held-out records
    (``specopd prepare data`` writes them), else a seeded split with ``heldout`` fraction."""
    marked = [s.get("split") for s in samples]
    if "heldout" in marked:
        return ([i for i, m in enumerate(marked) if m != "heldout"], [i for i, m in enumerate(marked) if m == "heldout"])
    return split_ids(len(samples), heldout, seed)


def frequent_tokens(samples: list, ids: list, size: int, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary as SpecForge chooses it (data/preprocessing.py, generate_vocab_mapping_file): the
    ``size`` target ids most frequent among the supervised tokens (``loss_mask``, else after ``prompt_len``) of
    samples ``ids``. Ties fall as SpecForge's Counter.most_common breaks them, fed sample by sample in ``ids``' order
    (each sample's distinct ids ascending): the id seen first wins; too few distinct ids: the lowest unseen ones.

    Args:
        samples: the loaded samples (``input_ids``, and ``loss_mask`` or ``prompt_len``).
        ids: the training split's sample indices, in the order they are counted.
        size: the draft vocabulary's size.
        vocab_size: the target's vocabulary size.

    Returns:
        [size] the chosen target ids, sorted (d2t[i] = ids[i] - i, as released).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    first = torch.full((vocab_size,), len(ids), dtype=torch.long)  # the rank in ``ids`` of the first sample with it
    for rank, i in enumerate(ids):
        s = samples[i]
        x, m = s["input_ids"], s.get("loss_mask")
        u, c = (x[m.bool()] if m is not None else x[int(s["prompt_len"]):]).unique(return_counts=True)
        counts[u] += c
        first[u] = torch.clamp_max(first[u], rank)
    order = torch.arange(vocab_size)  # ascending ids, then first seen, then count descending (stable sorts)
    order = order[torch.sort(first[order], stable=True).indices]
    order = order[torch.sort(-counts[order], stable=True).indices]
    return order[:size].sort().values


def conversation_split(cfg) -> tuple:
    """``data.source: conversations`` -> (samples, train_ids, heldout_ids) exactly as a run of ``cfg`` reads and
    splits them (the same tokenisation cache), without loading the target's weights: what a benchmark needs to
    name the conversations a run trains on and the held-out ones it never sees."""
    conf = read_config(cfg.model.target)  # the text model's, composite configs merged
    tok = load_tokenizer(cfg.model.target, int(conf["vocab_size"]))
    d, ctx = cfg.data, conf.get("max_position_embeddings")
    samples = conversation_samples(conversations_file(d.path), tok, cfg.model.target, cfg.trainer.output_dir,
                                   d.seq_len, int(ctx) if ctx else None, overlong=d.overlong,
                                   bad_lines=d.bad_lines, seed=d.seed, heldout=d.heldout,
                                   duplicate_ids=d.duplicate_ids)
    return (samples, *split_dataset(samples, d.heldout, d.seed))


def trained_ids(train_ids: list, batch_size: int, seed: int, steps: int) -> list:
    """The sample ids the first ``steps`` steps of a run train on, in order (``BatchOrder``, as the trainer
    draws them; an id repeats once an epoch is done).

    Args:
        train_ids: the run's train sample ids (``split_ids``); batch_size: samples a step (``data.batch_size``);
        seed: the data order's seed (``data.seed``); steps: how many steps.
    """
    order = BatchOrder(train_ids, batch_size, seed)
    return [i for _ in range(steps) for i in order.next()]


def split_ids(n: int, heldout: float, seed: int) -> tuple:
    """(train_ids, heldout_ids) from a seeded permutation; at least one of each when n >= 2."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) + 7919)).tolist()
    k = min(n - 1, max(1, math.ceil(heldout * n))) if heldout > 0 else 0
    return sorted(perm[k:]), sorted(perm[:k])


class BatchOrder:
    """Global batches of sample ids: epoch e visits the train ids in a permutation seeded from (seed, e).

    ``position`` = (epoch, offset) is saved in checkpoints so a resumed run sees the same batches.
    """

    def __init__(self, train_ids: list, batch_size: int, seed: int):
        if not train_ids:
            raise ValueError("no training samples (data.heldout too large or the dataset is empty)")
        self.ids = list(train_ids)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch, self.offset = 0, 0

    def _order(self, epoch: int) -> list:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return [self.ids[i] for i in torch.randperm(len(self.ids), generator=g).tolist()]

    def next(self) -> list:
        out = []
        while len(out) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.offset: self.offset + self.batch_size - len(out)]
            out.extend(take)
            self.offset += len(take)
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def set_position(self, pos: dict) -> None:
        self.epoch, self.offset = int(pos["epoch"]), int(pos["offset"])


def valid_anchors(sample: dict, draft_len: int) -> torch.Tensor:
    """Sorted valid anchors [A] of a sample: a >= 1 (one context feature), a + W <= T - 1, and the W tokens
    a + 1 .. a + W all supervised: after ``prompt_len`` (``anchor_range``: a contiguous range), or, with a
    ``loss_mask`` [T] bool, all masked (every token of each block lies on one assistant turn)."""
    T, W = int(sample["input_ids"].numel()), int(draft_len)
    mask = sample.get("loss_mask")
    if mask is None:
        lo, hi = anchor_range(T, int(sample["prompt_len"]), W)
        return torch.arange(lo, hi + 1) if hi >= lo else torch.empty(0, dtype=torch.long)
    if T - 1 - W < 1:
        return torch.empty(0, dtype=torch.long)
    c = torch.cat([torch.zeros(1, dtype=torch.long), mask.long().cumsum(0)])  # c[k] = masked tokens in [0, k)
    a = torch.arange(1, T - W)
    ok = (c[a + 1 + W] - c[a + 1]) == W
    return a[ok]


def num_branches(length: int, prompt_len: int, draft_len: int, anchors_per_seq: int) -> int:
    """Branches of one sample per step: min(B, number of valid anchors) (see ``anchor_range``).

    Args:
        length: the sample's tokens.
        prompt_len: its prompt tokens.
        draft_len: W.
        anchors_per_seq: B.

    Returns:
        int.
    """
    lo, hi = anchor_range(length, prompt_len, draft_len)
    return max(0, min(anchors_per_seq, hi - lo + 1))


def anchor_range(length: int, prompt_len: int, draft_len: int) -> tuple:
    """Valid anchors a in [lo, hi]: on the response part (a >= prompt_len - 1, the last prompt token
    anchors the first response token), at least one context feature (a >= 1), and the W = draft_len
    (= drafter.block_size - 1) reference tokens after the anchor inside the sequence (a + W <= T - 1), so
    every method sees the same anchors."""
    return max(prompt_len - 1, 1), length - 1 - draft_len
