"""The training loop's recipe sections: ``trainer:`` (``TrainerConfig``: method, optimisation, checkpoints,
logging) and ``runtime:`` (``RuntimeConfig``: the workers and where they run). A leaf beside the training code
(imports only ``specopd.settings`` and ``specopd.errors``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

from specopd.errors import dir_problem, is_finite_number
from specopd.settings import FROM_HERE, REFUSE, SAME_RUN, RecipeError, check_choice, check_range, setting

METHODS = ("specopd", "draft_opd", "offpolicy_ce", "offpolicy_e2e_tv")
CE_TERM_METHODS = ("specopd", "offpolicy_e2e_tv")  # the methods trainer.ce_weight adds a CE term to
CE_LABELS = ("reference", "target")  # trainer.ce_labels
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
TP_LM_HEAD = ("auto", "vocab_parallel", "replicated")


@dataclass
class TrainerConfig:
    method: str = setting("specopd", resume=REFUSE)
    """specopd (anchored parallel branches, on-policy) | draft_opd (sequential draft-and-verify rollouts) |
    offpolicy_ce | offpolicy_e2e_tv (blocks on the reference tokens, no sampling)."""
    max_steps: int = setting(20, resume=SAME_RUN)
    """Optimizer steps of the run (a resumed run continues up to this)."""
    lr: float = setting(3e-3, resume=FROM_HERE)
    """Peak learning rate (AdamW)."""
    lr_warmup_steps: int = setting(2, resume=FROM_HERE)
    """The learning rate's linear warmup from 0 to lr over this many steps (the main job's warm-up stage is
    ``pipeline.warmup_steps``)."""
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
    acceptance_temperature: float = setting(1.0, resume=FROM_HERE)
    """The temperature whose acceptance the drafter is trained for: branches / rollouts are sampled at it and p and
    q are compared at it (alpha, the loss). 0: greedy branches (the drafter's argmax) and alpha = q(argmax p) with q
    at T = 1, the smooth form of greedy acceptance. (Decoding: ``eval.decode_temperature``.)"""
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
        check_choice("trainer", "method", self.method, METHODS)
        check_range("trainer", "max_steps", self.max_steps, lo=0)
        check_range("trainer", "lr", self.lr, lo=0, lo_open=True)
        check_range("trainer", "lr_warmup_steps", self.lr_warmup_steps, lo=0)
        check_range("trainer", "min_lr_ratio", self.min_lr_ratio, lo=0, hi=1)
        check_range("trainer", "weight_decay", self.weight_decay, lo=0)
        if len(self.betas) != 2 or not all(is_finite_number(b) and 0 <= b < 1 for b in self.betas):
            raise RecipeError(f"trainer.betas={list(self.betas)} must be two numbers in [0, 1)")
        check_range("trainer", "grad_clip", self.grad_clip, lo=0)
        check_range("trainer", "anchors_per_seq", self.anchors_per_seq, lo=1)
        check_range("trainer", "acceptance_temperature", self.acceptance_temperature, lo=0)
        check_range("trainer", "ce_weight", self.ce_weight, lo=0)
        if self.ce_weight > 0 and self.method not in CE_TERM_METHODS:
            raise RecipeError(f"trainer.ce_weight={self.ce_weight} adds a CE term to E2E-TV (methods "
                              f"{' and '.join(CE_TERM_METHODS)}); trainer.method={self.method} "
                              + ("is CE already" if self.method == "offpolicy_ce" else
                                 "has no reference block per rollout round") + ": set trainer.ce_weight=0")
        check_choice("trainer", "ce_labels", self.ce_labels, CE_LABELS)
        if self.ce_labels != "reference" and self.ce_weight == 0:
            raise RecipeError(f"trainer.ce_labels={self.ce_labels} chooses the labels of the CE term, which "
                              f"trainer.ce_weight=0 turns off: set trainer.ce_weight > 0, or drop ce_labels")
        check_range("trainer", "vocab_ce_weight", self.vocab_ce_weight, lo=0)
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
        check_range("trainer", "save_every", self.save_every, lo=0)
        check_range("trainer", "keep_last", self.keep_last, lo=2)
        check_range("trainer", "log_every", self.log_every, lo=1)
        check_range("trainer", "eval_anchors_per_seq", self.eval_anchors_per_seq, lo=1)
        check_range("trainer", "eval_every", self.eval_every, lo=0)
        check_range("trainer", "max_nonfinite_steps", self.max_nonfinite_steps, lo=1)
        rows = self.loss_chunk_rows
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise RecipeError(f"trainer.loss_chunk_rows={rows!r} is not valid; give an integer >= 1 (rows of "
                              f"[rows, V] logits per chunk of the fused loss) or auto")
        for name in self.loggers:
            check_choice("trainer", "loggers", name, LOGGERS)
        check_choice("trainer", "wandb_mode", self.wandb_mode, ["offline", "online"])


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
        check_choice("runtime", "backend", self.backend, ["local", "ray"])
        check_range("runtime", "num_workers", self.num_workers, lo=1)
        check_range("runtime", "cpus_per_worker", self.cpus_per_worker, lo=0)
        check_range("runtime", "gpus_per_worker", self.gpus_per_worker, lo=0)
        check_choice("runtime", "roles", self.roles, ["colocated", "split"])
        check_range("runtime", "tensor_parallel", self.tensor_parallel, lo=1)
        check_choice("runtime", "tp_lm_head", self.tp_lm_head, TP_LM_HEAD)
        if self.tensor_parallel > 1 and self.backend != "ray":
            raise RecipeError(f"runtime.tensor_parallel={self.tensor_parallel} needs runtime.backend=ray (one "
                              f"actor per rank); set it, or runtime.tensor_parallel=1")
        if self.tensor_parallel > 1 and self.roles != "colocated":
            raise RecipeError("runtime.tensor_parallel > 1 runs with runtime.roles=colocated only; set it, or "
                              "runtime.tensor_parallel=1")
