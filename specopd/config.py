"""Recipe configuration: omegaconf structured dataclasses + ``load_recipe`` (``section.key=value`` overrides); every
field declares what a resume does when its value changes (``setting(default, resume=...)``).
Checks and resume policies: specopd/DESIGN.md ("Recipes").
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kernels import cpu_features
from specopd.errors import UserError, dir_problem, is_finite_number, nonfinite_keys, read_text

TINY_PREFIX = "tiny:"
TINY_MODEL_TYPES = ("llama", "qwen3_next", "qwen4_exp")
METHODS = ("specopd", "draft_opd", "offpolicy_ce", "offpolicy_e2e_tv")
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
TP_LM_HEAD = ("auto", "vocab_parallel", "replicated")

# what a resume does when a field's value differs from the checkpoint's recipe
REFUSE = "refuse"  # another run (target, drafter shape, data, seed, method): the resume is refused
FROM_HERE = "from_here"  # takes effect from the resumed step on: listed, the run differs from an uninterrupted one
SAME_RUN = "same_run"  # bookkeeping or placement, the numbers do not change: listed
RESUME_POLICIES = (REFUSE, FROM_HERE, SAME_RUN)


class RecipeError(UserError, ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


def setting(default=dataclasses.MISSING, *, resume: str, factory=dataclasses.MISSING):
    """A recipe field with its default (or ``factory`` for a list / dict) and its resume policy
    (``RESUME_POLICIES``)."""
    if resume not in RESUME_POLICIES:
        raise ValueError(f"resume={resume!r}: choose one of {list(RESUME_POLICIES)}")
    return field(default=default, default_factory=factory, metadata={"resume": resume})


def _check_choice(section: str, key: str, value, choices) -> None:
    if value not in choices:
        raise RecipeError(f"{section}.{key}={value!r} is not valid; choose one of {list(choices)}")


def _check_range(section: str, key: str, value, lo=None, hi=None, lo_open=False) -> None:
    if not is_finite_number(value):
        raise RecipeError(f"{section}.{key}={value!r} is not a finite number; give a number (NaN and inf are "
                          f"refused)")
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        raise RecipeError(f"{section}.{key}={value!r} is out of range; it must be {' and '.join(s for s in (lo_s, hi_s) if s)}")


def auto_dtype(device: str) -> str:
    """``model.dtype: auto`` on ``device`` (cpu | cuda | auto): "bfloat16" where bf16 matmuls are native (CUDA, or
    a CPU with ``kernels.cpu_features.cpu_bf16_native``), else "float32"."""
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda or cpu_features.cpu_bf16_native() else "float32"


@dataclass
class ModelConfig:
    target: str = setting("tiny:llama", resume=REFUSE)
    """The target model: a Hugging Face folder (config.json + safetensors), or ``tiny:<model_type>``
    (llama | qwen3_next | qwen4_exp) for a tiny random target built deterministically from ``tiny_seed``
    and written as a real safetensors folder under ``<output_dir>/tiny-target``."""
    dtype: str = setting("float32", resume=FROM_HERE)
    """Target dtype: float32 | bfloat16 | float16 | auto (``auto_dtype``: bfloat16 on CUDA and on CPUs with native
    bf16 matmuls, AMX-BF16 or AVX512-BF16, else float32; resolved when the recipe is read). The drafter keeps
    fp32 master weights."""
    device: str = setting("cpu", resume=SAME_RUN)
    """cpu | cuda | auto (cuda when available)."""
    tiny_seed: int = setting(0, resume=REFUSE)
    """Seed of the tiny random target's weights (only for ``tiny:`` targets)."""
    tiny: Dict[str, Any] = setting(factory=dict, resume=REFUSE)
    """Overrides of the tiny target's config.json entries (e.g. ``{hidden_size: 64}``)."""
    gdn_checkpoint_every: int = setting(64, resume=SAME_RUN)
    """GDN layers: keep a recurrent-state checkpoint every C trunk tokens (branches replay < C steps)."""
    kernels: str = setting("auto", resume=FROM_HERE)
    """How the target's executors run prefill / score / verify / commit (``load_target(..., kernels=)``):
    auto (Triton kernels and fla on CUDA, torch on the CPU) | torch (plain torch, any device) | triton (the
    Triton kernels: CUDA; on the CPU only interpreted, with TRITON_INTERPRET=1)."""
    shape: Dict[str, Any] = setting(factory=dict, resume=FROM_HERE)
    """config.json entries of the target (model_type, hidden_size, vocab_size, ...) for the memory plan of
    ``specopd train --dry-run`` when the target folder is not on this machine; its config.json wins when it is."""
    gpu_memory_gb: Optional[float] = setting(None, resume=SAME_RUN)
    """The GPU the memory plan checks against, in GB (10^9 bytes), when no CUDA device is visible (the plan of a
    recipe for another machine); null: 80. A visible GPU's own memory wins."""

    def __post_init__(self):
        if self.gpu_memory_gb is not None:
            _check_range("model", "gpu_memory_gb", self.gpu_memory_gb, lo=1)
        if self.target.startswith(TINY_PREFIX):
            _check_choice("model", "target", self.target, [TINY_PREFIX + t for t in TINY_MODEL_TYPES] + ["<HF folder>"])
        _check_choice("model", "dtype", self.dtype, ["float32", "bfloat16", "float16", "auto"])
        _check_choice("model", "device", self.device, ["cpu", "cuda", "auto"])
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device)
        _check_range("model", "gdn_checkpoint_every", self.gdn_checkpoint_every, lo=1)
        _check_choice("model", "kernels", self.kernels, ["auto", "torch", "triton"])

    @property
    def is_tiny(self) -> bool:
        return self.target.startswith(TINY_PREFIX)


@dataclass
class DrafterRecipeConfig:
    """The recipe's drafter: section (the drafter's architecture itself is ``specopd.drafters.DrafterConfig``)."""
    kind: str = setting("dflash", resume=REFUSE)
    """dflash (parallel block drafter) | dspark (DFlash + Markov head + confidence head) | dflash2 (DFlash V2 as vLLM
    serves it: convolutions along the block, a top-K candidate selector drafted slot by slot)."""
    num_layers: int = setting(1, resume=REFUSE)
    """Number of drafter decoder layers."""
    block_size: int = setting(5, resume=REFUSE)
    """Block length counting the anchor, as released ("b16" = 16): each branch drafts W = block_size - 1
    tokens (drafter.draft_len). >= 2."""
    feature_layers: Optional[List[int]] = setting(None, resume=REFUSE)
    """Target layer ids whose hidden states the drafter reads (released dflash_config.target_layer_ids);
    null -> the released default for num_layers: round(1 + i * (L - 4) / (n - 1)), one layer: [L // 2]."""
    mask_token_id: Optional[int] = setting(None, resume=FROM_HERE)
    """The MASK token whose frozen target embedding fills the drafted slots. null: the first id the target's
    tokenizer leaves unused (Qwen3: 151669, as released), else (no spare id) a learned mask vector; -1: always
    a learned vector (exported as mask_embedding.pt)."""
    init_from: Optional[str] = setting(None, resume=SAME_RUN)
    """A drafter folder to start from: ours (a checkpoint step folder) or a released DFlash / DSpark / DFlash V2 folder
    (config.json with dflash_config + safetensors, e.g. z-lab/Qwen3-8B-DFlash-b16)."""
    confidence_weight: float = setting(0.1, resume=FROM_HERE)
    """DSpark: weight of the confidence-head loss (ignored for dflash)."""
    architecture: Dict[str, Any] = setting(factory=dict, resume=REFUSE)
    """More architecture settings of a fresh drafter, as ``build_drafter`` takes them (ignored with init_from, whose
    folder has its own): DSpark's markov_rank, confidence_head, confidence_with_markov; DFlash V2's conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k, input_embedding_scale, output_multiplier,
    final_logit_softcapping (e.g. drafter.architecture.selector_top_k=32); also num_heads, num_kv_heads, head_dim,
    intermediate_size (default: the target's). An unknown key is an error naming the allowed ones."""

    def __post_init__(self):
        _check_choice("drafter", "kind", self.kind, ["dflash", "dspark", "dflash2"])
        _check_range("drafter", "num_layers", self.num_layers, lo=1)
        if self.block_size < 2:
            raise RecipeError(f"drafter.block_size={self.block_size!r} is out of range: it counts the anchor, as "
                              f"released (16 drafts 15 tokens), so it must be >= 2")
        if self.mask_token_id is not None and self.mask_token_id < -1:
            raise RecipeError(f"drafter.mask_token_id={self.mask_token_id}: give a token id, -1 (learned vector) "
                              f"or null (automatic)")
        _check_range("drafter", "confidence_weight", self.confidence_weight, lo=0)
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise RecipeError(f"drafter.init_from={self.init_from!r}: no such folder (give a drafter folder with "
                              f"config.json + safetensors: <output_dir>/checkpoints/step-N, or a released "
                              f"DFlash / DSpark folder)")


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
    sample_temperature: float = setting(1.0, resume=REFUSE)
    """synthetic: temperature used to sample the responses from the target."""
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
        _check_choice("data", "source", self.source, ["synthetic", "prepared", "conversations"])
        if self.source == "prepared":
            if not self.path:
                raise RecipeError("data.source=prepared needs data.path (run `specopd prepare data ...` first)")
        if self.source == "conversations" and not self.path:
            raise RecipeError("data.source=conversations needs data.path: a .jsonl / .json / .parquet file of "
                              "conversations (SpecForge, ShareGPT or OpenAI messages)")
        _check_choice("data", "overlong", self.overlong, ["truncate", "drop"])
        _check_choice("data", "bad_lines", self.bad_lines, ["error", "skip"])
        _check_choice("data", "duplicate_ids", self.duplicate_ids, ["keep", "drop_repeats", "error"])
        _check_range("data", "num_samples", self.num_samples, lo=2)
        _check_range("data", "prompt_len", self.prompt_len, lo=2)
        _check_range("data", "seq_len", self.seq_len, lo=4)
        if self.source == "synthetic" and self.seq_len <= self.prompt_len:
            raise RecipeError(f"data.seq_len={self.seq_len} must exceed data.prompt_len={self.prompt_len}")
        _check_range("data", "sample_temperature", self.sample_temperature, lo=0, lo_open=True)
        _check_range("data", "batch_size", self.batch_size, lo=1)
        _check_range("data", "heldout", self.heldout, lo=0, hi=0.9)


@dataclass
class TrainerConfig:
    method: str = setting("specopd", resume=REFUSE)
    """specopd (anchored parallel branches, on-policy) | draft_opd (sequential draft-and-verify rollouts) |
    offpolicy_ce | offpolicy_e2e_tv (blocks on the reference tokens, no sampling)."""
    max_steps: int = setting(20, resume=SAME_RUN)
    """Optimizer steps of the run (a resumed run continues up to this)."""
    lr: float = setting(3e-3, resume=FROM_HERE)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = setting(2, resume=FROM_HERE)
    """Linear warmup from 0 to lr over this many steps."""
    min_lr_ratio: float = setting(0.1, resume=FROM_HERE)
    """Cosine decay ends at lr * min_lr_ratio at max_steps."""
    weight_decay: float = setting(0.0, resume=FROM_HERE)
    """AdamW weight decay on matrices (not on norms and biases)."""
    betas: List[float] = setting(factory=lambda: [0.9, 0.95], resume=FROM_HERE)
    """AdamW betas."""
    grad_clip: float = setting(1.0, resume=FROM_HERE)
    """Clip the global gradient norm to this (0 disables clipping)."""
    anchors_per_seq: int = setting(8, resume=FROM_HERE)
    """B: anchors (branches) per sequence per step; draft_opd: at most this many rollout rounds per sequence."""
    temperature: float = setting(1.0, resume=FROM_HERE)
    """Sampling temperature of branches / rollouts; p and q are compared at this temperature. 0: greedy branches
    (the drafter's argmax) and alpha = q(argmax p) with q at T = 1, the smooth form of greedy acceptance."""
    ce_weight: float = setting(0.0, resume=FROM_HERE)
    """specopd / offpolicy_e2e_tv: add ce_weight x the CE of the drafter's block on the reference tokens after each
    anchor (the same drafter pass, uniform over positions) to E2E-TV. E2E-TV at T = 1 lowers greedy acceptance
    from a CE-trained plateau (benchmarks/results/2026-12-01-smollm2-135m-plateau-experiment-dev-cpu.md); on greedy references the CE's labels
    are the target's argmax. 0: E2E-TV alone (the paper's loss)."""
    ce_labels: str = setting("reference", resume=FROM_HERE)
    """The labels of the ce_weight term. reference: the trunk's tokens after each anchor. target: the target's own
    argmax at each scored position (specopd: on the branch's history; offpolicy_e2e_tv: on the reference), what
    greedy verification accepts there: distillation for T = 0 serving from references the target did not write,
    with no decoding (losses.target_argmax). Measured from the shipped ShareGPT drafter: no faster T = 0 lift than
    E2E-TV alone (benchmarks/results/2026-12-07-smollm2-135m-greedy-labels-for-t0-avx2-epyc.md)."""
    vocab_ce_weight: float = setting(0.0, resume=FROM_HERE)
    """DFlash V2 (``drafter.kind: dflash2``), trainer.method offpolicy_ce only: add vocab_ce_weight x the CE of the
    drafter's raw lm_head logits over the whole vocabulary (DFlash's own pretraining loss) to the CE over the
    candidates. That CE sees only the current top K as negatives, so the raw logits that choose the candidates can
    drift away from the target's tokens; this term ranks them over every token (specopd/drafters/DFLASH2.md,
    "Training"). 0: the candidate CE alone."""
    output_dir: str = setting("runs/tiny", resume=SAME_RUN)
    """Run folder: metrics.jsonl, checkpoints/, tiny-target/, data cache, profile."""
    resume: str = setting("auto", resume=SAME_RUN)
    """auto (newest complete checkpoint in output_dir, else start fresh) | none (start fresh) | a step folder."""
    save_every: int = setting(0, resume=SAME_RUN)
    """Checkpoint every N steps (0: only at the end; a checkpoint is always written when a run ends)."""
    keep_last: int = setting(2, resume=SAME_RUN)
    """Keep the newest K >= 2 checkpoints."""
    log_every: int = setting(1, resume=SAME_RUN)
    """Write a metrics.jsonl line every N steps."""
    eval_heldout: bool = setting(True, resume=SAME_RUN)
    """Evaluate expected acceptance length on the held-out data before and after training."""
    eval_anchors_per_seq: int = setting(8, resume=SAME_RUN)
    """Anchors per held-out sequence for that evaluation (and for ``eval_every``)."""
    eval_every: int = setting(0, resume=SAME_RUN)
    """Every N steps (and at the last step) evaluate the held-out expected acceptance length (bonus included;
    fixed anchors and branches, one forward pass, no update) and log it: ``heldout_expected_al`` in
    metrics.jsonl, the progress bar, and <output_dir>/heldout_al.png (redrawn at each evaluation). 0: off.
    Needs held-out sequences (data.heldout > 0). It does not change the training numbers. One evaluation costs
    the forward passes (no backward) of ceil(held-out sequences / data.batch_size) steps, data.batch_size
    sequences at a time."""
    cache_trunks: bool = setting(False, resume=SAME_RUN)
    """Off-policy methods (offpolicy_ce, offpolicy_e2e_tv) only: keep each training sequence's drafter features
    and final hidden states in its worker's memory after its first prefill, so later epochs skip the target
    (SpecForge's "offline" mode, for small runs: T x (F + D) floats per sequence, F = len(feature_layers) x D).
    The numbers are the same as without it. Colocated roles only (split roles prefill every step). On-policy
    methods score branches against the trunk's full K/V and cannot use it (held-out evaluation, which does,
    prefills in full)."""
    max_nonfinite_steps: int = setting(5, resume=SAME_RUN)
    """A step whose loss or gradient is NaN / inf is skipped (no update) and logged; this many in a row stop
    the run (with a checkpoint and a message naming the steps)."""
    deterministic: bool = setting(False, resume=FROM_HERE)
    """torch's deterministic algorithms (CUDA: deterministic cuBLAS / cuDNN, an error instead of a
    non-deterministic kernel): the same recipe on the same workers is bitwise reproducible, resumes too."""
    batch_invariant: bool = setting(False, resume=FROM_HERE)
    """Each sample's step runs alone and the gradients add up in a fixed tree over the global batch, so the
    numbers are bitwise the same for any runtime.num_workers (a resume may change it). Costs one backward per
    sample and an all-reduce of about num_workers x the drafter's size: for checks and small runs."""
    loss_chunk_rows: Any = setting("auto", resume=FROM_HERE)
    """Rows of [rows, V] fp32 logits the fused loss and the branch sampling hold at once: an integer >= 1, or
    auto (a budget of 2 GiB on CUDA / 1 GiB on the CPU, lowered to a quarter of the free GPU memory; see
    specopd.losses.auto_chunk_rows). Lower it if the loss phase runs out of memory."""
    # ---- metrics sinks (specopd.train.metrics)
    loggers: List[str] = setting(factory=lambda: ["jsonl"], resume=SAME_RUN)
    """Where the metrics go: any of jsonl, tensorboard, wandb, mlflow. <output_dir>/metrics.jsonl is always
    written (the source of truth: resume and the figures read it); the others get the same numbers under one
    naming scheme (train/loss, train/alpha/pos_<j>, heldout/expected_al, train/supervised_tokens_per_s,
    train/phase_s/<phase>, ...). tensorboard: <output_dir>/tensorboard; wandb: offline under <output_dir>/wandb
    unless trainer.wandb_mode=online; mlflow: a file store <output_dir>/mlruns unless trainer.mlflow_tracking_uri."""
    logger_project: str = setting("specopd", resume=SAME_RUN)
    """wandb project / mlflow experiment name."""
    run_name: Optional[str] = setting(None, resume=SAME_RUN)
    """Run name in wandb / mlflow (null: the output_dir's folder name)."""
    wandb_mode: str = setting("offline", resume=SAME_RUN)
    """offline (files under <output_dir>/wandb, `wandb sync` uploads them later) | online."""
    mlflow_tracking_uri: Optional[str] = setting(None, resume=SAME_RUN)
    """null: a file store under <output_dir>/mlruns (`mlflow ui --backend-store-uri <output_dir>/mlruns`); else
    any MLflow tracking URI (http://..., sqlite:///...)."""

    def __post_init__(self):
        _check_choice("trainer", "method", self.method, METHODS)
        _check_range("trainer", "max_steps", self.max_steps, lo=0)
        _check_range("trainer", "lr", self.lr, lo=0, lo_open=True)
        _check_range("trainer", "warmup_steps", self.warmup_steps, lo=0)
        _check_range("trainer", "min_lr_ratio", self.min_lr_ratio, lo=0, hi=1)
        _check_range("trainer", "weight_decay", self.weight_decay, lo=0)
        if len(self.betas) != 2 or not all(is_finite_number(b) and 0 <= b < 1 for b in self.betas):
            raise RecipeError(f"trainer.betas={list(self.betas)} must be two numbers in [0, 1)")
        _check_range("trainer", "grad_clip", self.grad_clip, lo=0)
        _check_range("trainer", "anchors_per_seq", self.anchors_per_seq, lo=1)
        _check_range("trainer", "temperature", self.temperature, lo=0)
        _check_range("trainer", "ce_weight", self.ce_weight, lo=0)
        if self.ce_weight > 0 and self.method not in CE_TERM_METHODS:
            raise RecipeError(f"trainer.ce_weight={self.ce_weight} adds a CE term to E2E-TV (methods "
                              f"{' and '.join(CE_TERM_METHODS)}); trainer.method={self.method} "
                              + ("is CE already" if self.method == "offpolicy_ce" else
                                 "has no reference block per rollout round") + ": set trainer.ce_weight=0")
        _check_choice("trainer", "ce_labels", self.ce_labels, CE_LABELS)
        if self.ce_labels != "reference" and self.ce_weight == 0:
            raise RecipeError(f"trainer.ce_labels={self.ce_labels} chooses the labels of the CE term, which "
                              f"trainer.ce_weight=0 turns off: set trainer.ce_weight > 0, or drop ce_labels")
        _check_range("trainer", "vocab_ce_weight", self.vocab_ce_weight, lo=0)
        if self.vocab_ce_weight > 0 and self.method != "offpolicy_ce":
            raise RecipeError(f"trainer.vocab_ce_weight={self.vocab_ce_weight} adds a full-vocabulary CE to DFlash "
                              f"V2's off-policy CE pretraining; trainer.method={self.method}: set "
                              f"trainer.method=offpolicy_ce or trainer.vocab_ce_weight=0")
        why = dir_problem(self.output_dir, writable=False)
        if why is not None:
            raise RecipeError(f"trainer.output_dir={self.output_dir!r} cannot be the run folder: {why}; give a "
                              f"folder (it is created when missing)")
        if not (self.resume in ("auto", "none") or os.path.isdir(self.resume)):
            raise RecipeError(f"trainer.resume={self.resume!r}: use auto, none, or an existing checkpoint folder "
                              f"(<output_dir>/checkpoints/step-N)")
        _check_range("trainer", "save_every", self.save_every, lo=0)
        _check_range("trainer", "keep_last", self.keep_last, lo=2)
        _check_range("trainer", "log_every", self.log_every, lo=1)
        _check_range("trainer", "eval_anchors_per_seq", self.eval_anchors_per_seq, lo=1)
        _check_range("trainer", "eval_every", self.eval_every, lo=0)
        _check_range("trainer", "max_nonfinite_steps", self.max_nonfinite_steps, lo=1)
        rows = self.loss_chunk_rows
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise RecipeError(f"trainer.loss_chunk_rows={rows!r} is not valid; give an integer >= 1 (rows of "
                              f"[rows, V] logits per chunk of the fused loss) or auto")
        for name in self.loggers:
            _check_choice("trainer", "loggers", name, LOGGERS)
        _check_choice("trainer", "wandb_mode", self.wandb_mode, ["offline", "online"])


@dataclass
class RuntimeConfig:
    backend: str = setting("local", resume=SAME_RUN)
    """local (in-process workers) | ray (one Ray actor per worker)."""
    num_workers: int = setting(1, resume=SAME_RUN)
    """Data-parallel workers; each global batch is split by sample across them. With roles=split this
    counts target workers, and each one is paired with its own drafter worker (2 x num_workers in all)."""
    tensor_parallel: int = setting(1, resume=SAME_RUN)
    """Ranks that shard each data-parallel replica's target (Ray actors on one node; attention and GDN heads, MLPs,
    MoE experts; see specopd/models/tensor_parallel.py). 1: every worker holds the whole target."""
    tp_lm_head: str = setting("auto", resume=SAME_RUN)
    """With tensor_parallel > 1, how the ranks hold the target's lm_head for training: vocab_parallel (V / N rows
    each; the fused loss reduces its softmaxes and alpha over the group, the branch sampler gathers each chunk's
    logits, DFlash V2 merges the ranks' top-K candidates and reduces p at them; the group must divide the
    vocabulary) | replicated (the whole head on every rank) | auto (vocab_parallel, for every drafter kind).
    Measured: benchmarks/results/2026-12-04-tensor-parallel-vocab-loss-*.md."""
    address: Optional[str] = setting(None, resume=SAME_RUN)
    """Ray cluster address (null: start a local Ray instance)."""
    cpus_per_worker: float = setting(1.0, resume=SAME_RUN)
    """Ray: CPUs reserved per worker actor (more than the machine has hangs Ray silently)."""
    gpus_per_worker: float = setting(0.0, resume=SAME_RUN)
    """Ray: GPUs reserved per worker actor."""
    roles: str = setting("colocated", resume=SAME_RUN)
    """colocated (each worker runs every phase) | split (target workers prefill and score, keeping the trunk
    caches; drafter workers sample proposals, compute the loss and take the all-reduced optimizer step; the
    controller moves trunk ids + features, proposals and p logits between them). Not for draft_opd."""

    def __post_init__(self):
        _check_choice("runtime", "backend", self.backend, ["local", "ray"])
        _check_range("runtime", "num_workers", self.num_workers, lo=1)
        _check_range("runtime", "cpus_per_worker", self.cpus_per_worker, lo=0)
        _check_range("runtime", "gpus_per_worker", self.gpus_per_worker, lo=0)
        _check_choice("runtime", "roles", self.roles, ["colocated", "split"])
        _check_range("runtime", "tensor_parallel", self.tensor_parallel, lo=1)
        _check_choice("runtime", "tp_lm_head", self.tp_lm_head, TP_LM_HEAD)
        if self.tensor_parallel > 1 and self.backend != "ray":
            raise RecipeError(f"runtime.tensor_parallel={self.tensor_parallel} needs runtime.backend=ray (one "
                              f"actor per rank); set it, or runtime.tensor_parallel=1")
        if self.tensor_parallel > 1 and self.roles != "colocated":
            raise RecipeError("runtime.tensor_parallel > 1 runs with runtime.roles=colocated only; set it, or "
                              "runtime.tensor_parallel=1")


@dataclass
class EvalConfig:
    prompts: int = setting(8, resume=SAME_RUN)
    """Number of held-out prompts decoded by ``specopd eval`` (with ``--prompts FILE``: its first N, the only lines
    read)."""
    max_new_tokens: int = setting(32, resume=SAME_RUN)
    """Tokens generated per prompt."""
    temperature: float = setting(0.0, resume=SAME_RUN)
    """Decoding temperature (0 = greedy, acceptance = exact match with the target's argmax)."""
    checkpoint: str = setting("latest", resume=SAME_RUN)
    """Drafter to evaluate: latest (newest checkpoint of trainer.output_dir) | none (untrained) | a folder."""
    seed: int = setting(0, resume=SAME_RUN)
    """Seed of the decoding generator."""
    dtype: str = setting("auto", resume=SAME_RUN)
    """The target's dtype when decoding and judging: auto (= model.dtype) | float32 | bfloat16 | float16. float32
    keeps the judge's exact checks (T = 0 token equality with vLLM) for a drafter trained on a bf16 target."""
    bench: str = setting("chat", resume=SAME_RUN)
    """The main job's before / after prompts: chat (held-out chitchat first turns, eval.prompts of them) | mt-bench
    (MT-Bench's 80 first turns in vLLM; ours on eval.prompts of them, the same number from each category)."""

    def __post_init__(self):
        _check_choice("eval", "dtype", self.dtype, ["auto", "float32", "bfloat16", "float16"])
        _check_choice("eval", "bench", self.bench, ["chat", "mt-bench"])
        _check_range("eval", "prompts", self.prompts, lo=1)
        _check_range("eval", "max_new_tokens", self.max_new_tokens, lo=1)
        _check_range("eval", "temperature", self.temperature, lo=0)


@dataclass
class ProfileConfig:
    enabled: bool = setting(True, resume=SAME_RUN)
    """Record per-phase spans (prefill / propose / score / loss_backward / optimizer_step) per worker."""
    nvml: bool = setting(False, resume=SAME_RUN)
    """Sample GPU utilisation / memory with NVML while training (GPU only)."""
    nvml_interval_ms: int = setting(50, resume=SAME_RUN)
    """NVML sampling interval."""

    def __post_init__(self):
        _check_range("profile", "nvml_interval_ms", self.nvml_interval_ms, lo=1)


@dataclass
class PipelineConfig:
    """The main job (``specopd.mainjob``). Off by default: ``specopd train`` is plain training."""
    enabled: bool = setting(False, resume=SAME_RUN)
    """On: prepare the target (model.target names a `specopd prepare model` target) and chat references on
    first use (cached), warm a fresh drafter up (pipeline.warmup_method) if no warm drafter exists, train with
    trainer.method from it, then print a held-out speculative-decoding AL table (before / after) and the profile."""
    data_num: int = setting(48, resume=SAME_RUN)
    """Distinct chat prompts (first turns of chitchat-dataset train conversations) the target answers (cached,
    resumable)."""
    data_max_new_tokens: int = setting(64, resume=SAME_RUN)
    """Response tokens generated per prompt."""
    data_temperature: float = setting(1.0, resume=SAME_RUN)
    """Sampling temperature of the target's responses (0: greedy)."""
    data_batch_size: int = setting(64, resume=SAME_RUN)
    """Prompts answered together by the built-in engine (one packed target pass per generated token)."""
    data_engine: str = setting("auto", resume=SAME_RUN)
    """Who answers the prompts: auto (vLLM when its venv is there, `make vllm`, else builtin) | builtin | vllm."""
    data_prompts: str = setting("first_turns", resume=SAME_RUN)
    """first_turns: distinct first user turns of train conversations; all_turns: then their later user turns too
    (58k prompts: pretraining). Held-out conversations' openings are never used."""
    warmup_steps: int = setting(20, resume=SAME_RUN)
    """Steps of the warm drafter from a fresh one (0: start trainer.method from a random drafter)."""
    warmup_method: str = setting("offpolicy_ce", resume=SAME_RUN)
    """Method of the warm-up: offpolicy_ce | offpolicy_e2e_tv (on the same references)."""
    warmup_lr: float = setting(3e-3, resume=SAME_RUN)
    """Peak learning rate of the warm-up (trainer.lr is the rate of the main training stage)."""
    warmup_min_lr_ratio: float = setting(0.1, resume=SAME_RUN)
    """The warm-up's cosine schedule ends at warmup_lr * this (1.0: constant after the linear warmup)."""
    eval_temperatures: List[float] = setting(factory=lambda: [0.0, 1.0], resume=SAME_RUN)
    """Decoding temperatures of the before / after table (0: greedy, acceptance = exact match)."""

    def __post_init__(self):
        _check_range("pipeline", "data_num", self.data_num, lo=2)
        _check_range("pipeline", "data_max_new_tokens", self.data_max_new_tokens, lo=1)
        _check_range("pipeline", "data_temperature", self.data_temperature, lo=0)
        _check_range("pipeline", "data_batch_size", self.data_batch_size, lo=1)
        _check_choice("pipeline", "data_engine", self.data_engine, ["auto", "builtin", "vllm"])
        _check_choice("pipeline", "data_prompts", self.data_prompts, ["first_turns", "all_turns"])
        _check_range("pipeline", "warmup_steps", self.warmup_steps, lo=0)
        _check_choice("pipeline", "warmup_method", self.warmup_method, ["offpolicy_ce", "offpolicy_e2e_tv"])
        _check_range("pipeline", "warmup_lr", self.warmup_lr, lo=0, lo_open=True)
        _check_range("pipeline", "warmup_min_lr_ratio", self.warmup_min_lr_ratio, lo=0, hi=1)
        if not self.eval_temperatures or any(not is_finite_number(t) or t < 0 for t in self.eval_temperatures):
            raise RecipeError(f"pipeline.eval_temperatures={list(self.eval_temperatures)} must list one or more "
                              f"temperatures >= 0 (0 = greedy)")


@dataclass
class KernelsConfig:
    """Which compute path runs where there is a choice (``kernels.paths``, applied in the driver and every worker).
    Each is "auto" by default: the fastest path that is exact to its promise on this machine."""
    cpu_attention: str = setting("auto", resume=FROM_HERE)
    """bf16 causal and tree attention in C (kernels/causal_attention): auto (on CPUs with AVX512-BF16 and no AMX) |
    cpu (wherever it builds; an error where it does not) | torch (torch's attention everywhere)."""
    cpu_layer_ops: str = setting("auto", resume=FROM_HERE)
    """bf16 RMSNorm, SiLU * up and RoPE in C, and packed linear layers (kernels/layer_ops): auto | torch."""
    cpu_linear: str = setting("auto", resume=FROM_HERE)
    """Linear layers with the weight packed once for oneDNN: auto (bf16; F.linear's bits) | torch (F.linear) | all
    (fp32 too: oneDNN's fp32 kernel, not F.linear's bits)."""
    cpu_tv_loss: str = setting("auto", resume=FROM_HERE)
    """The fused E2E-TV's alpha and gradient in C (kernels/e2e_tv): auto | cpu (an error if it does not build) |
    torch."""
    cpu_sampling: str = setting("auto", resume=FROM_HERE)
    """Draws at T > 0 in C (kernels/sampling): auto | cpu (an error if it does not build) | torch."""
    drafter_attention: str = setting("auto", resume=FROM_HERE)
    """The drafter's branch attention: auto (flex_attention on CUDA when it compiles, else chunked) | chunked |
    flex."""

    def __post_init__(self):
        section = "kernels"  # (a variable: tests/test_imports.py reads a call on a module's name as an import)
        for key, choices in KERNEL_CHOICES.items():
            _check_choice(section, key, getattr(self, key), choices)


# the values of each kernels key, "auto" first (the same as kernels.paths.CHOICES: tests/test_config.py)
KERNEL_CHOICES = {"cpu_attention": ("auto", "cpu", "torch"), "cpu_layer_ops": ("auto", "torch"),
                  "cpu_linear": ("auto", "torch", "all"), "cpu_tv_loss": ("auto", "cpu", "torch"),
                  "cpu_sampling": ("auto", "cpu", "torch"), "drafter_attention": ("auto", "chunked", "flex")}


def recipe_record(cfg) -> dict:
    """The recipe as a checkpoint records it: ``to_dict``, without the kernels section while every path is at its
    default (so checkpoints of runs on the default paths are the bytes they were before the section existed)."""
    d = to_dict(cfg)
    if cfg.kernels == KernelsConfig():
        del d["kernels"]
    return d


def recorded_recipe(d: Optional[dict]) -> Optional[dict]:
    """A checkpoint's recipe with the kernels section filled in: a record without one ran on the default paths."""
    if d is None:
        return None
    return {**d, "kernels": {**to_dict(KernelsConfig()), **(d["kernels"] if "kernels" in d else {})}}


CE_TERM_METHODS = ("specopd", "offpolicy_e2e_tv")  # the methods trainer.ce_weight adds a CE term to
CE_LABELS = ("reference", "target")  # trainer.ce_labels


def eval_dtype(cfg) -> str:
    """The target dtype of decoding and judging: ``eval.dtype``, or ``model.dtype`` when it is auto."""
    return cfg.model.dtype if cfg.eval.dtype == "auto" else cfg.eval.dtype


@dataclass
class RecipeConfig:
    seed: int = setting(0, resume=REFUSE)
    """Seed of the drafter init and of all per-sample anchor / branch generators."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The frozen target model."""
    drafter: DrafterRecipeConfig = field(default_factory=DrafterRecipeConfig)
    """The drafter being trained."""
    data: DataConfig = field(default_factory=DataConfig)
    """Reference sequences and batching."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Method, optimisation, checkpoints, logging."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Workers and where they run."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """``specopd eval``: speculative decoding with the trained drafter."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Per-phase spans and GPU sampling."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The main job (prepare, warm up, train, evaluate); off by default."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Which compute path runs where there is a choice (the CPU kernels, the drafter's attention)."""

    def __post_init__(self):
        if self.runtime.roles == "split" and self.trainer.method == "draft_opd":
            raise RecipeError("runtime.roles=split does not support trainer.method=draft_opd (its rollout "
                              "interleaves drafting and verification); use runtime.roles=colocated")
        if self.trainer.batch_invariant and (self.runtime.roles == "split" or self.trainer.method == "draft_opd"):
            raise RecipeError("trainer.batch_invariant=true needs runtime.roles=colocated and a method other than "
                              "draft_opd (its rollouts form the batch); set trainer.batch_invariant=false")
        if self.trainer.cache_trunks and not self.trainer.method.startswith("offpolicy"):
            raise RecipeError(f"trainer.cache_trunks=true keeps only features and hidden states, but "
                              f"trainer.method={self.trainer.method} scores branches against the trunk's K/V: set "
                              f"trainer.cache_trunks=false (or use offpolicy_ce / offpolicy_e2e_tv)")
        if self.trainer.vocab_ce_weight > 0 and self.drafter.kind != "dflash2":
            raise RecipeError(f"trainer.vocab_ce_weight={self.trainer.vocab_ce_weight} is for DFlash V2, whose CE is "
                              f"over its top K candidates; drafter.kind={self.drafter.kind}'s CE is over the whole "
                              f"vocabulary already: set trainer.vocab_ce_weight=0")
        if self.trainer.eval_every > 0 and self.data.heldout == 0:
            raise RecipeError(f"trainer.eval_every={self.trainer.eval_every} evaluates on held-out sequences, but "
                              f"data.heldout=0 holds none out: set data.heldout to a fraction such as 0.1 (those "
                              f"sequences are then never trained on), or trainer.eval_every=0")


def vocab_parallel_head(cfg) -> bool:
    """Whether the ranks of a tensor-parallel group split the target's lm_head by vocabulary for training
    (``runtime.tp_lm_head``; auto: vocab_parallel, for every drafter kind)."""
    r = cfg.runtime
    return int(r.tensor_parallel) > 1 and r.tp_lm_head != "replicated"


# ---------------------------------------------------------------------------------------------- loading
def _valid_keys(cls) -> list:
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_keys(data: dict, cls, prefix: str, origin: str) -> None:
    """Unknown keys -> error naming the key and the valid keys of its section."""
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: {prefix or 'the recipe'} must be a mapping of keys, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        full = f"{prefix}{k}"
        if k not in fields:
            raise RecipeError(f"{origin}: unknown key {full!r}; valid keys of "
                              f"{prefix.rstrip('.') or 'the recipe'}: {sorted(fields)}")
        sub = fields[k].default_factory if fields[k].default_factory is not dataclasses.MISSING else None
        sub_cls = type(sub()) if sub is not None and dataclasses.is_dataclass(sub()) else None
        if sub_cls is not None:
            if not isinstance(v, dict):
                raise RecipeError(f"{origin}: {full!r} is a section; give a mapping with keys "
                                  f"{_valid_keys(sub_cls)}, not {v!r}")
            _check_keys(v, sub_cls, full + ".", origin)


def _parse_overrides(overrides) -> dict:
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes

    out: dict = {}
    for ov in overrides or []:
        if "=" not in ov or ov.startswith("="):
            raise RecipeError(f"override {ov!r} is not of the form section.key=value (e.g. trainer.max_steps=10)")
        key, _ = ov.split("=", 1)
        try:
            d = OmegaConf.to_container(OmegaConf.from_dotlist([ov]))
        except Exception as e:  # noqa: BLE001
            raise RecipeError(f"override {ov!r} could not be parsed: {e}") from None
        node = out
        parts = key.strip().split(".")
        src = d
        for p in parts[:-1]:
            src = src[p]
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {ov!r} conflicts with an earlier override of {p!r}")
        node[parts[-1]] = src[parts[-1]]
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_recipe(path: Optional[str], overrides=None) -> RecipeConfig:
    """Read a YAML recipe (or defaults when ``path`` is None), apply ``a.b=c`` overrides, validate.

    Returns a ``RecipeConfig`` (plain dataclasses; ``__post_init__`` checks have run).
    """
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes
    from omegaconf.errors import OmegaConfBaseException  # omegaconf: see above

    data: dict = {}
    if path is not None:
        if os.path.isdir(path):
            raise RecipeError(f"recipe {path!r} is a folder; give a YAML file (e.g. recipes/tiny.yaml)")
        if not os.path.isfile(path):
            hint = ""
            rdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
            if os.path.isdir(rdir):
                hint = f"; recipes shipped in {rdir}: {sorted(f for f in os.listdir(rdir) if f.endswith('.yaml'))}"
            raise FileNotFoundError(f"recipe {path!r} does not exist{hint}")
        read_text(path, "recipe")  # a file that is not UTF-8 is named with its line
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except Exception as e:  # noqa: BLE001
            raise RecipeError(f"recipe {path!r} is not valid YAML: {e}") from None
        if not loaded:  # an empty file (or only comments) would train the defaults without a word
            raise RecipeError(f"recipe {path!r} is empty (no keys); give the settings of a run (start from a "
                              f"recipe in recipes/, e.g. recipes/tiny.yaml)")
        data = loaded
        _check_keys(data, RecipeConfig, "", f"recipe {path}")
    ovs = _parse_overrides(overrides)
    _check_keys(ovs, RecipeConfig, "", "override")
    merged = _deep_merge(data, ovs)
    try:
        conf = OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.create(merged))
        cfg = OmegaConf.to_object(conf)
    except RecipeError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        exp = _expected_type(key)
        raise RecipeError(f"{key}: {getattr(e, 'msg', str(e)).splitlines()[0]}"
                          + (f" (expected {exp})" if exp else "")) from None
    bad = nonfinite_keys(to_dict(cfg))
    if bad:
        raise RecipeError(f"{', '.join(bad)}: not a finite number (NaN / inf); give a finite value")
    return cfg


def _expected_type(full_key: str) -> Optional[str]:
    cls = RecipeConfig
    parts = full_key.split(".")
    for i, p in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if p not in fields:
            return None
        f = fields[p]
        if i == len(parts) - 1:
            return _type_name(f.type)
        cls = type(f.default_factory())
    return None


def resume_policies(cls=None, prefix: str = "") -> dict:
    """"section.key" -> resume policy of every field of ``cls`` (default ``RecipeConfig``; a section's fields under
    its name). A field that declares none is a ``TypeError`` naming it: each new field must say what a resume
    does when it changes."""
    out = {}
    for f in dataclasses.fields(cls or RecipeConfig):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            out.update(resume_policies(type(sub), f"{prefix}{f.name}."))
        elif f.metadata.get("resume") in RESUME_POLICIES:
            out[prefix + f.name] = f.metadata["resume"]
        else:
            raise TypeError(f"{(cls or RecipeConfig).__name__}.{f.name} declares no resume policy: define it with "
                            f"setting(default, resume=REFUSE | FROM_HERE | SAME_RUN)")
    return out


def to_dict(cfg: RecipeConfig) -> dict:
    """Plain nested dict (for logging and for saving next to a checkpoint)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RecipeConfig) -> str:
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
