"""The recipe's ``data:`` section (``DataConfig``): the reference sequences a run trains on and how they are
batched. A leaf beside the data code (imports only ``specopd.settings``); ``specopd.train.data`` reads it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specopd.settings import FROM_HERE, REFUSE, RecipeError, check_choice, check_range, setting


@dataclass
class DataConfig:
    source: str = setting("synthetic", resume=REFUSE)
    """synthetic: references sampled from the target itself (random prompts + target continuations);
    prepared: token ids written by ``specopd prepare data`` (see ``path``); conversations: chat data as users have
    it (SpecForge ``conversations`` role/content, ShareGPT from/value, OpenAI ``messages``; JSONL, JSON or
    Parquet), put through the target's chat template, loss on every assistant turn (specopd.data.formats)."""
    path: Optional[str] = setting(None, resume=REFUSE)
    """prepared data: a .jsonl file (one {"input_ids": [...], "prompt_len": n} per line) or a folder holding
    data.jsonl; conversations: the .jsonl / .json / .parquet file."""
    num_samples: int = setting(256, resume=REFUSE)
    """synthetic: number of reference sequences generated (train + held-out)."""
    prompt_len: int = setting(8, resume=REFUSE)
    """synthetic: prompt tokens per sequence (random ids); anchors lie on the response after them."""
    seq_len: int = setting(48, resume=REFUSE)
    """synthetic: total tokens per sequence (prompt + response); prepared: sequences are cut to this length."""
    synthetic_temperature: float = setting(1.0, resume=REFUSE)
    """synthetic: the temperature the target samples the responses at (the main job's references:
    ``pipeline.data_temperature``)."""
    batch_size: int = setting(8, resume=FROM_HERE)
    """Sequences per global training step (split by sample across workers)."""
    heldout: float = setting(0.125, resume=REFUSE)
    """Fraction of the sequences held out for evaluation (never trained on)."""
    seed: int = setting(1234, resume=REFUSE)
    """Seed of the synthetic data and of the train/held-out split (independent of the top-level seed)."""
    # ---- conversations data (data.source: conversations; specopd.data.formats)
    overlong: str = setting("truncate", resume=REFUSE)
    """conversations: a conversation longer than data.seq_len tokens (after the chat template) is cut there
    (truncate) or left out (drop); both are counted in train_summary.json. One longer than the target's context
    is bad data (see bad_lines)."""
    bad_lines: str = setting("error", resume=REFUSE)
    """conversations: a bad record (not JSON / not UTF-8, unknown role, empty, no assistant turn, longer than the
    target's context, ...) stops the run with its file and line (error), or is skipped and counted by reason in
    train_summary.json (skip)."""
    duplicate_ids: str = setting("keep", resume=REFUSE)
    """conversations: a record whose id an earlier record has (with another conversation, or an exact copy) is
    trained too (keep), left out (drop_repeats: the first of each id is kept), or stops the run naming both lines
    (error); repeats are counted in train_summary.json and printed in every case."""

    def __post_init__(self):
        check_choice("data", "source", self.source, ["synthetic", "prepared", "conversations"])
        if self.source == "prepared":
            if not self.path:
                raise RecipeError("data.source=prepared needs data.path (run `specopd prepare data ...` first)")
        if self.source == "conversations" and not self.path:
            raise RecipeError("data.source=conversations needs data.path: a .jsonl / .json / .parquet file of "
                              "conversations (SpecForge, ShareGPT or OpenAI messages)")
        check_choice("data", "overlong", self.overlong, ["truncate", "drop"])
        check_choice("data", "bad_lines", self.bad_lines, ["error", "skip"])
        check_choice("data", "duplicate_ids", self.duplicate_ids, ["keep", "drop_repeats", "error"])
        check_range("data", "num_samples", self.num_samples, lo=2)
        check_range("data", "prompt_len", self.prompt_len, lo=2)
        check_range("data", "seq_len", self.seq_len, lo=4)
        if self.source == "synthetic" and self.seq_len <= self.prompt_len:
            raise RecipeError(f"data.seq_len={self.seq_len} must exceed data.prompt_len={self.prompt_len}")
        check_range("data", "synthetic_temperature", self.synthetic_temperature, lo=0, lo_open=True)
        check_range("data", "batch_size", self.batch_size, lo=1)
        check_range("data", "heldout", self.heldout, lo=0, hi=0.9)
