"""Human chat text (chitchat-dataset) as training trunks, and the held-out chat prompts (split by conversation).
Details: specopd/data/DESIGN.md ("Chat text").
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from specopd.data.prepare import encode_prompt, load_tokenizer
from specopd.data.references import chitchat_data, split_of
from specopd.errors import replacing

HELDOUT_MAX_PROMPT_TOKENS = 96  # short chat prompts keep CPU evaluation (and reference generation) quick


def chitchat_conversations() -> list:
    """Every chitchat-dataset conversation -> list of (id, messages), roles alternating user / assistant
    (turn k of the conversation is one speaker's utterances joined by newlines)."""
    out = []
    for cid, conv in chitchat_data().items():
        msgs = []
        for turn in conv.get("messages") or []:
            text = "\n".join(u["text"] for u in turn if u.get("text")).strip()
            if text:
                msgs.append({"role": "user" if len(msgs) % 2 == 0 else "assistant", "content": text})
        if msgs:
            out.append((cid, msgs))
    return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def heldout_chat_prompts(num: int, seed: int = 0, heldout_fraction: float = 0.1, tokenizer=None,
                         max_prompt_tokens: Optional[int] = None) -> list:
    """The first ``num`` held-out prompts, in dataset order.

    From held-out conversations only; a prompt whose normalised text is the first turn of any train
    conversation, or of an earlier held-out prompt, is skipped.

    Args:
        num: how many prompts.
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).
        tokenizer: with ``max_prompt_tokens``, prompts longer than that (after the chat template) are skipped too.
        max_prompt_tokens: see ``tokenizer``; None: no limit.

    Returns:
        list of (id, [first user message]).
    """
    convs = chitchat_conversations()
    seen = {_norm(m[0]["content"]) for cid, m in convs if split_of(cid, seed, heldout_fraction) == "train"}
    out = []
    for cid, msgs in convs:
        if len(out) >= num:
            break
        if split_of(cid, seed, heldout_fraction) != "heldout":
            continue
        key = _norm(msgs[0]["content"])
        if key in seen:
            continue
        first = [msgs[0]]
        if tokenizer is not None and max_prompt_tokens is not None and \
                len(encode_prompt(tokenizer, first)) > max_prompt_tokens:
            continue
        seen.add(key)
        out.append((cid, first))
    if len(out) < num:
        raise ValueError(f"only {len(out)} distinct held-out chitchat prompts (asked for {num}); lower the number "
                         f"or raise heldout_fraction")
    return out


def train_chat_prompts(num: int, seed: int = 0, heldout_fraction: float = 0.1, tokenizer=None,
                       max_prompt_tokens: Optional[int] = HELDOUT_MAX_PROMPT_TOKENS) -> list:
    """The first ``num`` distinct first user turns of *train* conversations, in dataset order (the prompts the main
    job's references answer; duplicates such as "hello?" would give the same greedy answer many times).

    Args:
        num: how many prompts.
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).
        tokenizer: with it, prompts longer than ``max_prompt_tokens`` (after the chat template) are skipped.
        max_prompt_tokens: see ``tokenizer``.

    Returns:
        list of (id, [message]).
    """
    seen, out = set(), []
    for cid, msgs in chitchat_conversations():
        if len(out) >= num:
            break
        key = _norm(msgs[0]["content"])
        if split_of(cid, seed, heldout_fraction) != "train" or key in seen:
            continue
        if tokenizer is not None and max_prompt_tokens is not None and \
                len(encode_prompt(tokenizer, msgs[:1])) > max_prompt_tokens:
            continue
        seen.add(key)
        out.append((cid, msgs[:1]))
    if len(out) < num:
        raise ValueError(f"only {len(out)} distinct train chat prompts (asked for {num}); lower pipeline.data_num")
    return out


def train_conversations(num: int, offset: int = 0, seed: int = 0, heldout_fraction: float = 0.1,
                        convs: Optional[list] = None) -> list:
    """Whole *train* conversations (``split_of``) that have an assistant turn, in dataset order: the ``num`` from
    the ``offset``-th on (what fine-tuning a policy toward chat reads; held-out conversations never).

    Args:
        num, offset: which train conversations (successive calls take successive slices).
        seed, heldout_fraction: the train / held-out split.
        convs: [(id, messages)] to choose from (default: ``chitchat_conversations()``).

    Returns:
        list of (id, messages); fewer than ``num`` only where the train split runs out."""
    convs = chitchat_conversations() if convs is None else convs
    train = [(cid, m) for cid, m in convs
             if split_of(cid, seed, heldout_fraction) == "train" and any(x["role"] == "assistant" for x in m)]
    return train[offset: offset + num]


DRIFT_DOMAINS = {  # a domain of replies a policy can be fine-tuned toward -> does the first reply belong to it
    "code": lambda reply: "```" in reply,
    "long": lambda reply: len(reply) >= 2000,
}


def domain_train_exchanges(convs: list, domain: str, num: int, offset: int = 0, seed: int = 0,
                           heldout_fraction: float = 0.1) -> list:
    """The first exchange (user turn, assistant reply) of *train* conversations whose reply is of ``domain``
    (``DRIFT_DOMAINS``: "code" has a fenced block, "long" >= 2000 characters), in file order: the ``num`` from the
    ``offset``-th on (what fine-tuning a policy toward one domain reads; held-out conversations never).

    Args:
        convs: [(id, messages, split)] as ``formats.read_conversations`` gives them (its ``where`` dropped); a
            record's own ``split`` wins over the split by id.
        domain, num, offset: which exchanges; seed, heldout_fraction: the split by id (``split_of``).

    Returns:
        list of (id, [user, assistant]); fewer than ``num`` only where the domain's train conversations run out."""
    keep = DRIFT_DOMAINS[domain]
    out = []
    for cid, msgs, split in convs:
        if (split or split_of(cid, seed, heldout_fraction)) != "train" or len(msgs) < 2:
            continue
        if msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant" and keep(msgs[1]["content"]):
            out.append((cid, msgs[:2]))
    return out[offset: offset + num]


def pretrain_chat_prompts(num: int, seed: int = 0, heldout_fraction: float = 0.1, tokenizer=None,
                          max_prompt_tokens: Optional[int] = HELDOUT_MAX_PROMPT_TOKENS) -> list:
    """Up to ``num`` distinct single-turn prompts from *train* conversations: every first user turn
    (``train_chat_prompts``' order), then the later user turns, conversation by conversation (many thousands: what
    pretraining a drafter wants). A prompt whose normalised text is the first user turn of any held-out conversation
    (a possible evaluation prompt) is never used.

    Args:
        num: at most this many prompts.
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).
        tokenizer, max_prompt_tokens: as in ``train_chat_prompts``.

    Returns:
        list of (id, [message]); ids: ``<conversation id>`` for first turns, ``<conversation id>#<turn>`` for later
        ones.
    """
    convs = chitchat_conversations()
    banned = {_norm(m[0]["content"]) for cid, m in convs if split_of(cid, seed, heldout_fraction) == "heldout"}
    train = [(cid, m) for cid, m in convs if split_of(cid, seed, heldout_fraction) == "train"]
    firsts = [(cid, 0, m[0]) for cid, m in train]
    laters = [(cid, k, m[k]) for cid, m in train for k in range(2, len(m), 2)]
    seen, out = set(banned), []
    for cid, k, msg in firsts + laters:
        if len(out) >= num:
            break
        key = _norm(msg["content"])
        if key in seen:
            continue
        if tokenizer is not None and max_prompt_tokens is not None and \
                len(encode_prompt(tokenizer, [msg])) > max_prompt_tokens:
            continue
        seen.add(key)
        out.append((cid if k == 0 else f"{cid}#{k}", [{"role": "user", "content": msg["content"]}]))
    if len(out) < num:
        raise ValueError(f"only {len(out)} distinct train chat prompts (asked for {num}); lower pipeline.data_num")
    return out


def encode_conversation(tok, messages: list, seq_len: int) -> tuple:
    """messages -> (token ids of the whole chat-formatted conversation cut to ``seq_len``, prompt_len): the
    prompt is the system prompt + first user turn + assistant header (what a served request starts with)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    prompt = encode_prompt(tok, messages[:1])
    n = 0  # the common prefix (equal to the prompt unless the template formats a first turn differently)
    while n < min(len(ids), len(prompt)) and ids[n] == prompt[n]:
        n += 1
    return ids[:seq_len], n


def _write_jsonl(path: str, recs: list) -> None:
    """Records -> ``path``, one JSON object per line, written atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def write_conversation_data(tok, path: str, num: int, seq_len: int, seed: int = 0,
                            heldout_fraction: float = 0.1, min_response_tokens: int = 16) -> dict:
    """Write the first ``num`` train conversations, chat-formatted, to ``path`` (JSONL, written atomically).

    Args:
        tok: the target's tokenizer (its chat template formats each conversation).
        path: the .jsonl to write.
        num: how many conversations.
        seq_len: each is cut to this many tokens.
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).
        min_response_tokens: conversations with fewer tokens after the prompt are skipped.

    Returns:
        counts: ``written``, ``skipped_short``, ``tokens``, ``supervised_tokens``.
    """
    recs, skipped = [], 0
    for cid, msgs in chitchat_conversations():
        if len(recs) >= num:
            break
        if split_of(cid, seed, heldout_fraction) != "train" or len(msgs) < 2:
            continue
        ids, pl = encode_conversation(tok, msgs, seq_len)
        if len(ids) - pl < min_response_tokens:
            skipped += 1
            continue
        recs.append({"id": cid, "split": "train", "input_ids": ids, "prompt_len": pl})
    _write_jsonl(path, recs)
    return {"written": len(recs), "skipped_short": skipped,
            "tokens": sum(len(r["input_ids"]) for r in recs),
            "supervised_tokens": sum(len(r["input_ids"]) - r["prompt_len"] for r in recs)}


def write_dataset_replies(tok, path: str, prompts: list, seq_len: int, min_response_tokens: int = 4) -> dict:
    """Write each prompt of ``pretrain_chat_prompts`` with the reply the dataset itself gives it (the next turn of
    its conversation, as the assistant's), chat-formatted, to ``path`` (JSONL, written atomically): references
    the target did not write, as a user's own chat data gives them before any regeneration.

    Args:
        tok: the target's tokenizer (its chat template formats each pair).
        path: the .jsonl to write.
        prompts: ``pretrain_chat_prompts(...)`` output, ids ``<conversation id>`` or ``<conversation id>#<turn>``
            (train conversations only; held-out openings already excluded there).
        seq_len: each pair is cut to this many tokens.
        min_response_tokens: pairs with fewer tokens after the prompt (or no next turn) are skipped.

    Returns:
        counts: ``written``, ``skipped``, ``supervised_tokens``.
    """
    convs = dict(chitchat_conversations())
    recs, skipped = [], 0
    for pid, msgs in prompts:
        cid, _, k = pid.partition("#")
        conv, k = convs[cid], int(k or 0)
        if k + 1 >= len(conv):
            skipped += 1
            continue
        pair = [msgs[0], {"role": "assistant", "content": conv[k + 1]["content"]}]
        ids, pl = encode_conversation(tok, pair, seq_len)
        if len(ids) - pl < min_response_tokens:
            skipped += 1
            continue
        recs.append({"id": pid, "split": "train", "input_ids": ids, "prompt_len": pl})
    _write_jsonl(path, recs)
    return {"written": len(recs), "skipped": skipped,
            "supervised_tokens": sum(len(r["input_ids"]) - r["prompt_len"] for r in recs)}


def heldout_prompt_ids(target_dir: str, vocab_size: int, num: int, seed: int = 0,
                       heldout_fraction: float = 0.1) -> list:
    """``heldout_chat_prompts`` through the target's chat template (what the main job's before/after table and
    ``specopd eval`` on the main recipe decode).

    Args:
        target_dir: the target's Hugging Face folder (its tokenizer).
        vocab_size: the target's vocabulary size.
        num: how many prompts.
        seed, heldout_fraction: the train / held-out split (``specopd.data.references.split_of``).

    Returns:
        list of prompt ids [T_i].
    """
    tok = load_tokenizer(target_dir, vocab_size)
    prompts = heldout_chat_prompts(num, seed, heldout_fraction, tok, HELDOUT_MAX_PROMPT_TOKENS)
    return [torch.tensor(encode_prompt(tok, msgs)) for _, msgs in prompts]
