"""Held-out evaluation during training: the drafter's expected acceptance length on held-out samples.

``evaluate_heldout`` uses fixed anchors and branches and per-sample generators, so it never touches the training
RNG streams and does not change the training numbers. ``Validator`` runs it before training
(``trainer.eval_heldout`` or ``trainer.eval_every``), every ``trainer.eval_every`` steps and at the last step (into
that step's metrics line: ``heldout_expected_al``, the progress bar, and ``<output_dir>/heldout_al.png``, drawn by
``plot_heldout_al`` from metrics.jsonl), and after training (``eval_after`` in train_summary.json).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from specopd.config import RecipeConfig, RecipeError
from specopd.errors import replacing
from specopd.train import phases
from specopd.train.metrics import read_metrics
from specopd.train.step import reduce_metrics, shard

EVAL_COLOR = "#17becf"  # the "eval" spans' colour in the profile figures


def evaluate_heldout(group, heldout_ids: list, batch_size: Optional[int] = None) -> dict:
    """Expected acceptance length (bonus included) of the drafter on held-out samples (on-policy estimate).

    The samples go ``batch_size`` at a time (split across the workers like a training batch), so a worker
    holds the trunk caches of at most its share of one batch, however many samples are held out; the cost is
    the forward passes of ceil(len / batch_size) steps. None: all at once."""
    ids = list(heldout_ids)
    chunk = batch_size or max(1, len(ids))
    res = []
    for lo in range(0, max(1, len(ids)), chunk):
        parts = shard(ids[lo: lo + chunk], group.num_workers)
        res += phases.split_evaluate(group, parts) if group.split else group.run(phases.evaluate, [(p,) for p in parts])
    m = reduce_metrics(res, 0.0)
    return {"expected_al": m["expected_al"], "alpha": m["alpha"], "branches": m["branches"]}


def format_al(m: Optional[dict]) -> str:
    """An expected AL for display: "-" when it was taken over no branch (no held-out sequence)."""
    return "-" if not m or not m.get("branches", 1) else f"{m['expected_al']:.4f}"


def read_heldout_al(run_dir) -> list:
    """[(step, held-out expected AL)] from ``<run_dir>/metrics.jsonl`` rows that carry ``heldout_expected_al``
    (``trainer.eval_every``), in step order; a line cut short by a kill is skipped."""
    pts = {}
    for r in read_metrics(run_dir):
        if isinstance(r, dict) and r.get("heldout_expected_al") is not None:
            pts[int(r["step"])] = float(r["heldout_expected_al"])
    return sorted(pts.items())


def plot_heldout_al(run_dir, start: Optional[float] = None) -> Path:
    """``<run_dir>/heldout_al.png``: held-out expected AL (bonus included) against the training step, read from
    metrics.jsonl (so a resumed or crashed run keeps its curve), with ``start`` (the drafter before training) at
    step 0 when given; the training batches' own expected AL (on-policy, before each update) in grey for
    comparison. Written tmp + rename (a reader never sees half a file)."""
    import matplotlib  # matplotlib: slow to import, only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: slow to import, only when drawing

    run_dir = Path(run_dir)
    pts = ([(0, float(start))] if start is not None else []) + read_heldout_al(run_dir)
    train = [(int(r["step"]), float(r["expected_al"])) for r in read_metrics(run_dir)
             if isinstance(r, dict) and "expected_al" in r and "step" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([p[0] for p in train], [p[1] for p in train], color="#bbbbbb", linewidth=1,
                label="training batches (on-policy, before the update)")
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=EVAL_COLOR, marker="o", markersize=3,
                linewidth=1.5, label=f"held-out (last {pts[-1][1]:.3f} at step {pts[-1][0]})")
    ax.set_xlabel("training step")
    ax.set_ylabel("expected acceptance length (incl. bonus)")
    ax.set_title("Expected acceptance length during training", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    fig.tight_layout()
    path = run_dir / "heldout_al.png"
    try:
        with replacing(str(path), "wb", tmp=str(run_dir / f".heldout_al.png.tmp-{os.getpid()}")) as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


class Validator:
    """The run's held-out evaluations: ``before`` (the drafter before training), ``latest`` (step, result) of
    the newest one, ``due`` / ``run`` every ``trainer.eval_every`` steps, ``after`` for the summary."""

    def __init__(self, cfg: RecipeConfig, group, heldout_ids: list):
        t = cfg.trainer
        if t.eval_every and not heldout_ids:
            raise RecipeError(f"trainer.eval_every={t.eval_every} needs held-out sequences, and this data has none "
                              f"(data.heldout={cfg.data.heldout}, or every held-out response is shorter than "
                              f"drafter.block_size): raise data.heldout, or set trainer.eval_every=0")
        self.t, self.out, self.batch_size = t, t.output_dir, cfg.data.batch_size
        self.group, self.ids = group, heldout_ids
        self.before: Optional[dict] = None  # evaluate() of the drafter before training (None: not evaluated)
        self.latest: Optional[tuple] = None  # (step, evaluate() result) of the newest evaluation

    def evaluate(self) -> dict:
        return evaluate_heldout(self.group, self.ids, self.batch_size)

    def start_fresh(self) -> Optional[dict]:
        """A fresh run: evaluate the untrained drafter when asked (eval_every: the curve starts at step 0)."""
        self.before = self.evaluate() if self.t.eval_heldout or self.t.eval_every else None
        if self.before:
            print(f"held-out expected AL (incl. bonus) before training: {format_al(self.before)}"
                  + ("" if self.ids else " (no held-out sequence: data.heldout=0 or none usable)"))
        return self.before

    def start(self, step: int, before: Optional[dict]) -> None:
        """Training starts at ``step`` with ``before`` (a resume: the checkpoint's): the newest evaluation is
        the one before training, or the newest that the kept metrics lines carry."""
        self.before = before
        if self.t.eval_every and step == 0 and before:
            self.latest = (0, before)
        elif self.t.eval_every and step > 0:
            pts = read_heldout_al(self.out)
            self.latest = (pts[-1][0], {"expected_al": pts[-1][1]}) if pts else None

    def due(self, step: int) -> bool:
        return bool(self.t.eval_every) and (step % self.t.eval_every == 0 or step == self.t.max_steps)

    def run(self, step: int) -> dict:
        """Evaluate after ``step``; returns the fields of that step's metrics line."""
        t1 = time.perf_counter()
        self.latest = (step, self.evaluate())
        r = self.latest[1]
        return dict(heldout_expected_al=r["expected_al"], heldout_alpha=r["alpha"], heldout_branches=r["branches"],
                    heldout_eval_s=time.perf_counter() - t1)

    def plot(self, warn) -> None:
        """Redraw <out>/heldout_al.png from metrics.jsonl (a convenience: a failure is reported, not raised)."""
        try:
            plot_heldout_al(self.out, start=self.before["expected_al"] if self.before else None)
        except Exception as e:  # noqa: BLE001
            warn(f"warning: could not draw {os.path.join(self.out, 'heldout_al.png')} ({e}); the numbers are in "
                 f"metrics.jsonl (heldout_expected_al)")

    def summary(self, step: int) -> dict:
        """train_summary.json's held-out entries after ``step`` steps (the drafter after the last step is
        evaluated here unless eval_every did it there)."""
        out = {}
        if self.t.eval_every and self.latest is not None:
            out["heldout_expected_al"] = {"step": self.latest[0], "expected_al": self.latest[1]["expected_al"],
                                          "figure": os.path.join(self.out, "heldout_al.png")}
        if self.t.eval_heldout:
            s, r = self.latest or (None, {})
            after = r if s == step and step > 0 and "alpha" in r else self.evaluate()
            out["eval_after"] = after
            print(f"held-out expected AL (incl. bonus): before {format_al(self.before)} -> after {format_al(after)}"
                  + ("" if after.get("branches", 1) else " (no held-out sequence to evaluate on: raise data.heldout)"))
        return out
