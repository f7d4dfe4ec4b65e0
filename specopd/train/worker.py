"""One training worker's state: the target, a drafter replica, AdamW and its LR schedule, the data it reads, the
seeded generators and the profiler, plus what a step keeps between its hops. It runs no step itself: the phases
that use it are functions in ``specopd.train.phases``. Design: specopd/train/DESIGN.md ("Workers").
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import threading
import time
import zlib
from typing import Callable, Iterator, Optional

import torch

from specopd.drafters import build_drafter, load_drafter
from specopd.errors import BadInputError
from specopd.models import load_target
from specopd.models.loading import policy_weights, resolve_dtype
from specopd.models.tensor_parallel import vocab_group
from specopd.models.tiny import resolve_target_path
from specopd.profiling import Profiler
from specopd.train.data import frequent_tokens, load_dataset, split_dataset, valid_anchors
from specopd.train.determinism import apply_deterministic
from specopd.train.handoff import Staged


SWAP_LOCK = threading.Lock()  # in-process workers share one target: one of them swaps its weights


def seed_for(*parts) -> int:
    """A 63-bit seed from integers / strings (stable across processes and Python versions)."""
    return zlib.crc32(repr(tuple(parts)).encode()) * 2654435761 % (2**63 - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup (step s gets (s+1)/warmup) then cosine from 1 to min_lr_ratio at max_steps."""
    def f(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        prog = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * prog))
    return f


class Worker:
    """The state one worker's share of each step reads and updates. See the module docstring."""

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, target=None, role: str = "both",
                 tensor_parallel=None):
        """role: "both" (colocated) | "target" | "drafter" (split roles; both still build the target and a
        drafter: the drafter worker needs the frozen embeddings / lm_head, the target worker the drafter's
        feature layers). tensor_parallel: this rank's ``TensorParallel`` group (runtime.tensor_parallel > 1):
        the target is its shard; ``rank`` / ``world_size`` stay the data-parallel ones."""
        if role not in ("both", "target", "drafter"):
            raise ValueError(f"Worker role must be both | target | drafter, got {role!r}")
        self.cfg, self.rank, self.world_size, self.role = cfg, int(rank), int(world_size), role
        # the recipe's process settings, in whichever process hosts this worker (this one, or a Ray actor's)
        apply_deterministic(cfg.trainer.deterministic)
        self.device = resolve_device(cfg.model.device)
        if target is None:
            path = resolve_target_path(cfg.model, cfg.trainer.output_dir)
            target = load_target(path, dtype=resolve_dtype(cfg.model.dtype), device=self.device, kernels=cfg.model.kernels,
                                 tensor_parallel=tensor_parallel, kernel_paths=cfg.kernels)
        self.target = target
        self.vocab_tp = vocab_group(target.lm_head)  # runtime.tp_lm_head: the loss's group, or None (whole head)
        d = cfg.drafter
        dataset = None
        if d.kind == "mtp":  # the target's own head: from drafter.init_from, else from the target's folder
            self.drafter = build_drafter("mtp", target, block_size=d.block_size, target_dir=d.init_from or
                                         resolve_target_path(cfg.model, cfg.trainer.output_dir))
        elif d.init_from:  # ours or a released DFlash / DSpark folder
            self.drafter = load_drafter(d.init_from, target)
            got = (self.drafter.kind, int(self.drafter.block_size), len(self.drafter.layers))
            if got != (d.kind, d.block_size, d.num_layers) and rank == 0:
                print(f"warning: drafter.init_from={d.init_from} is a {got[0]} drafter with block_size={got[1]}, "
                      f"num_layers={got[2]}; the recipe's drafter.kind/block_size/num_layers "
                      f"({d.kind}, {d.block_size}, {d.num_layers}) are ignored")
        else:
            arch = dict(d.architecture)
            if d.draft_vocab_size is not None:  # EAGLE-3: the training data's most frequent ids (SpecForge's rule)
                dataset = self.load_data(cfg)
                train_ids = split_dataset(dataset, cfg.data.heldout, cfg.data.seed)[0]
                v = int(target.vocab_size)
                arch["draft_vocab"] = frequent_tokens(dataset, train_ids, min(d.draft_vocab_size, v), v)
            self.drafter = build_drafter(d.kind, target, num_layers=d.num_layers, block_size=d.block_size,
                                         seed=cfg.seed, feature_layers=d.feature_layers,
                                         mask_token_id=d.mask_token_id,  # the target's tokenizer picks MASK
                                         target_dir=None if cfg.model.is_tiny else cfg.model.target, **arch)
        if d.init_from and d.draft_vocab_size is not None and rank == 0:
            print(f"warning: drafter.draft_vocab_size={d.draft_vocab_size} is ignored: drafter.init_from={d.init_from} "
                  f"has its own vocabulary")
        self.drafter.train()
        self.W = d.train_steps(self.drafter, cfg.trainer.method)
        if self.W < self.drafter.draft_len and rank == 0:
            print(f"note: drafter.ttt_steps={self.W} < block_size - 1 = {self.drafter.draft_len}: served drafts run "
                  f"past the steps trained (SpecForge trains 7 and serves fewer)")
        self.read_data(cfg, dataset)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        t = cfg.trainer
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=tuple(t.betas), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_warmup_steps, t.max_steps, t.min_lr_ratio))
        self.prof = Profiler(f"target{rank}" if role == "target" else f"worker{rank}", enabled=cfg.profile.enabled)
        self.phase_s: dict = {}  # seconds per phase of the current step (``span``), reset when a step starts
        self.allreduce: Optional[Callable] = None  # sums gradients across the workers in place (``set_allreduce``)
        self.cached_trunks: dict = {}  # trainer.cache_trunks: sample id -> TargetCache without layer caches
        self.staged: Optional[Staged] = None  # a step's share between phases.stage and finish (split: the drafter's
        #                                       hops, drafter_propose -> drafter_update)
        self.trunk_caches: Optional[list] = None  # split roles, target side: between target_prefill and target_score
        self.steps_done = 0  # optimizer steps applied to this replica (checkpoints are labelled with it)

    # ------------------------------------------------------------------ data
    def load_data(self, cfg) -> list:
        """``cfg``'s samples (``load_dataset``); ``data_stats`` says what the reading read, dropped, cut, skipped."""
        self.data_stats: dict = {}  # -> train_summary.json
        return load_dataset(cfg, self.target, progress=self.rank == 0, stats=self.data_stats)

    def read_data(self, cfg, dataset: Optional[list] = None) -> None:
        """Read ``cfg``'s data (``load_data``, unless ``dataset`` is what it read) and split it: the samples, their
        anchors, the train / held-out ids."""
        rank = self.rank
        self.dataset = self.load_data(cfg) if dataset is None else dataset
        train_ids, heldout_ids = split_dataset(self.dataset, cfg.data.heldout, cfg.data.seed)
        self.anchor_positions = [valid_anchors(s, self.W) for s in self.dataset]  # per sample, sorted
        ok = lambda i: self.anchor_positions[i].numel() > 0  # noqa: E731
        self.train_ids, self.heldout_ids = [i for i in train_ids if ok(i)], [i for i in heldout_ids if ok(i)]
        dropped = len(train_ids) + len(heldout_ids) - len(self.train_ids) - len(self.heldout_ids)
        self.data_stats.update(sequences=len(self.dataset), train=len(self.train_ids), heldout=len(self.heldout_ids),
                               skipped_short_response=dropped)
        if dropped and rank == 0:
            print(f"[data] {dropped} sequence(s) skipped: no {self.W} supervised tokens in a row after an anchor "
                  f"(response or assistant turns shorter than block_size = {self.W + 1} tokens)")
        if not train_ids:
            raise BadInputError(
                f"every one of the {len(self.dataset)} records of data.path={cfg.data.path!r} is held out (\"split\": "
                f"\"heldout\"), so there is nothing to train on: mark the training records \"split\": \"train\" (or "
                f"remove the split fields to let data.heldout={cfg.data.heldout} choose the held-out ones)")
        if not self.train_ids:
            raise ValueError(f"no training sequence has a response of at least drafter.block_size={self.W + 1} "
                             f"tokens; lower drafter.block_size or raise data.seq_len")
        self.cached_trunks = {}  # trainer.cache_trunks: the trunks of the samples read before are gone

    def set_data(self, path: str) -> None:
        """Train and evaluate on the prepared records of ``path`` from now on (``specopd.follow``: each policy
        version's rollouts), read and split as ``data.source: prepared`` reads ``data.path``."""
        self.read_data(dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, source="prepared",
                                                                              path=path)))

    def swap_policy(self, source, version) -> None:
        """Replace the target's weights in place by the policy ``source`` (a Hugging Face folder or a state dict,
        ``policy_weights``), once per ``version``: in-process workers share one target. A tensor-parallel rank reads
        the full weights and copies its own block of each (``TargetModel.copy_weights_``)."""
        with SWAP_LOCK:
            if getattr(self.target, "policy_version", None) != version:
                self.target.copy_weights_(policy_weights(self.target, source))
                self.target.policy_version = version

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time a phase: a profiler span, and its seconds added to this step's ``phase_s``."""
        t0 = time.perf_counter()
        with self.prof.span(name):
            yield
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def autocast(self):
        """bf16 autocast for the drafter on CUDA (nothing on the CPU)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def generator(self, *parts) -> torch.Generator:
        """A generator on the worker's device seeded from (seed, *parts): e.g. ("branch", step, sample id)."""
        return torch.Generator(device=self.device).manual_seed(seed_for(self.cfg.seed, *parts))

    def sample(self, sid: int) -> dict:
        return self.dataset[int(sid)]

    def data_info(self) -> dict:
        """Sample lengths / prompt lengths and the train / held-out ids (the controller batches with it)."""
        return {"lengths": [int(s["input_ids"].numel()) for s in self.dataset],
                "prompt_lens": [int(s["prompt_len"]) for s in self.dataset],
                "train_ids": list(self.train_ids), "heldout_ids": list(self.heldout_ids),
                "draft_len": self.W, "vocab_size": self.target.vocab_size,
                "anchor_counts": [int(a.numel()) for a in self.anchor_positions], "data_stats": dict(self.data_stats)}

    def set_allreduce(self, fn: Optional[Callable]) -> None:
        """fn(list_of_grads) sums gradients across workers in place (None = single worker, no-op)."""
        self.allreduce = fn

    def take_spans(self) -> list:
        """The profiler's spans since the last call."""
        return self.prof.take()

    # ------------------------------------------------------------------ state
    def drafter_config(self) -> dict:
        """The drafter's config.json content, as ``drafter.save`` writes it."""
        return self.drafter.config_dict()

    def state_dict(self) -> dict:
        return {"drafter": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
                "drafter_config": self.drafter_config(), "drafter_kind": self.drafter.kind,
                "steps_done": self.steps_done,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}

    def load_state_dict(self, sd: dict) -> None:
        self.drafter.load_state_dict({k: v.to(self.device) for k, v in sd["drafter"].items()}, strict=True)
        if sd.get("optimizer") is not None:  # a copy: in-process replicas get the same dict (their AdamW
            # moments must not share tensors)
            self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        if sd.get("scheduler") is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        self.steps_done = int(sd.get("steps_done", self.scheduler.last_epoch))
        self._apply_recipe_hparams()
        rng = sd.get("rng") or {}
        if rng.get("torch") is not None:
            torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _apply_recipe_hparams(self) -> None:
        """After a resume: the recipe's lr / schedule / betas / weight decay win over the checkpoint's (loading
        an optimizer restores its old ones). Unchanged values give exactly the saved learning rate."""
        t = self.cfg.trainer
        f = lr_lambda(t.lr_warmup_steps, t.max_steps, t.min_lr_ratio)
        self.scheduler.lr_lambdas = [f] * len(self.optimizer.param_groups)
        self.scheduler.base_lrs = [float(t.lr)] * len(self.optimizer.param_groups)
        for i, g in enumerate(self.optimizer.param_groups):
            g["initial_lr"] = float(t.lr)
            g["betas"] = tuple(t.betas)
            g["weight_decay"] = t.weight_decay if i == 0 else 0.0
            g["lr"] = float(t.lr) * f(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
