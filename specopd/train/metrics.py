"""Metrics sinks (``trainer.loggers: [jsonl, tensorboard, wandb, mlflow]``): ``<output_dir>/metrics.jsonl`` is always
written and is the source of truth; the optional sinks get the same line flattened to scalars.
Metric names and failing sinks: specopd/train/DESIGN.md ("Metrics").
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from specopd.config import RecipeError, to_dict
from specopd.errors import BadInputError, open_write, own_dir
from specopd.profiling import read_jsonl

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
# record key -> sink name (lists become <name>/pos_<j>, dicts <name>/<key>)
NAMES = {"loss": "train/loss", "expected_al": "train/expected_al", "alpha": "train/alpha",
         "supervised_tokens_per_s": "train/supervised_tokens_per_s", "supervised_tokens": "train/supervised_tokens",
         "branches": "train/branches", "lr": "train/lr", "grad_norm": "train/grad_norm", "step_s": "train/step_s",
         "phase_s": "train/phase_s", "skipped": "train/skipped", "heldout_expected_al": "heldout/expected_al",
         "heldout_alpha": "heldout/alpha", "heldout_branches": "heldout/branches",
         "heldout_eval_s": "heldout/eval_s"}


def scalars(record: dict) -> dict:
    """A metrics.jsonl line -> {name: float} under the naming scheme of the module docstring (``step`` and
    ``time`` are the step and wall time of the point, not metrics; unknown keys keep their name under train/)."""
    out = {}
    for k, v in record.items():
        if k in ("step", "time"):
            continue
        name = NAMES.get(k, f"train/{k}")
        if isinstance(v, bool):
            out[name] = float(v)
        elif isinstance(v, (int, float)):
            out[name] = float(v)
        elif isinstance(v, (list, tuple)):
            out.update({f"{name}/pos_{j}": float(x) for j, x in enumerate(v, 1)})
        elif isinstance(v, dict):
            out.update({f"{name}/{kk}": float(x) for kk, x in v.items() if isinstance(x, (int, float))})
    return out


def read_metrics(run_dir) -> list:
    """The records of ``<run_dir>/metrics.jsonl`` (none when it is missing); a line cut short by a kill is
    skipped."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


class MissingExtraError(RecipeError, ImportError):
    """A logger named in trainer.loggers needs a package that is not installed; names the extra (a recipe error:
    the CLI prints it without a traceback)."""


def check_loggers(names) -> None:
    """Raise ``MissingExtraError`` naming ``pip install -e .[<extra>]`` for a logger whose package is missing."""
    for n in names:
        if n in EXTRAS and importlib.util.find_spec(EXTRAS[n][0]) is None:
            raise MissingExtraError(f"trainer.loggers lists {n}, but the {EXTRAS[n][0]} package is not installed: "
                                    f"`pip install -e .[{EXTRAS[n][1]}]` (or `pip install {EXTRAS[n][0]}`), or "
                                    f"remove {n} from trainer.loggers")


def sink_folders(cfg, resuming: bool) -> dict:
    """{logger: the folder it writes under trainer.output_dir}: mlflow's file store always (a fresh run keeps it),
    TensorBoard's and wandb's on a resume only (a fresh run moves them aside first)."""
    t, out = cfg.trainer, cfg.trainer.output_dir
    names = dict.fromkeys(t.loggers)
    dirs = {}
    if "mlflow" in names and t.mlflow_tracking_uri is None:
        dirs["mlflow"] = os.path.join(out, "mlruns")
    if resuming:
        dirs.update({n: os.path.join(out, n) for n in ("tensorboard", "wandb") if n in names})
    return dirs


def check_sink_folders(cfg, resuming: bool) -> None:
    """A logger's folder that is a file or not writable is a ``BadInputError`` naming it and the fix, before the
    run starts (not a traceback from the logger's own writer)."""
    for n, d in sink_folders(cfg, resuming).items():
        why = None
        if os.path.islink(d):
            why = "is a symbolic link (its files would be written wherever it points)"
        elif os.path.exists(d) and not os.path.isdir(d):
            why = "is a file, not a folder"
        elif os.path.isdir(d) and not os.access(d, os.W_OK | os.X_OK):
            why = "is not writable"
        elif not os.path.exists(d) and os.path.isdir(os.path.dirname(d)) and not os.access(os.path.dirname(d),
                                                                                          os.W_OK | os.X_OK):
            why = "cannot be made (its folder is not writable)"
        if why:
            raise BadInputError(f"trainer.loggers lists {n}, which writes {d}, but that {why}: make it a writable "
                                f"folder (move a file or link there aside), or remove {n} from trainer.loggers")


class JsonlSink:
    """<output_dir>/metrics.jsonl: the record as it is, one line per step (appended, closed each time)."""

    name = "jsonl"

    def __init__(self, path: str):
        self.path = path

    def log(self, step: int, record: dict) -> None:
        with open_write(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files under ``log_dir`` (``tensorboard --logdir <output_dir>/tensorboard``). A resumed run purges
    the events the interrupted run wrote after the checkpoint's step (``purge_step``)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, resume_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter  # optional extra (.[tensorboard])

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir, purge_step=None if not resume_step else resume_step + 1)

    def log(self, step: int, record: dict) -> None:
        for k, v in scalars(record).items():  # NaN / inf are stored as they are
            self.writer.add_scalar(k, v, step, walltime=record.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in ``<run_dir>/wandb`` (mode offline by default: `wandb sync <run_dir>/wandb/offline-run-*`
    uploads it later). A resumed run continues the same run id (kept in ``<run_dir>/wandb/specopd_run_id``)."""

    name = "wandb"

    def __init__(self, run_dir: str, project: str, name: str, config: dict, mode: str = "offline"):
        import wandb  # optional extra (.[wandb])

        self._wandb = wandb
        base = own_dir(os.path.join(run_dir, "wandb"))
        id_file = os.path.join(base, "specopd_run_id")
        run_id = open(id_file).read().strip() if os.path.isfile(id_file) else secrets.token_hex(4)
        self.run = wandb.init(project=project, name=name, dir=run_dir, mode=mode, id=run_id, resume="allow",
                              config=config, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        with open_write(id_file) as f:
            f.write(run_id)

    def log(self, step: int, record: dict) -> None:
        self.run.log(scalars(record), step=int(step))

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run (experiment ``project``); default tracking store: files under ``<run_dir>/mlruns``
    (`mlflow ui --backend-store-uri <run_dir>/mlruns`). The recipe's keys are its params; a resumed run continues
    the same run id (kept in ``<run_dir>/mlflow_run_id``). MLflow's metric history is append-only: steps an
    interrupted run logged after its last checkpoint stay, and the resumed run logs them again (the newest value
    of a step is the resumed run's; TensorBoard and metrics.jsonl drop the old ones)."""

    name = "mlflow"

    def __init__(self, run_dir: str, project: str, name: str, params: dict, tracking_uri: Optional[str] = None):
        if tracking_uri is None:
            tracking_uri = "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
            # MLflow 3 keeps its file store "in maintenance mode" and refuses it unless this is set; a local
            # store means no network, so no usage telemetry either (unless the environment says otherwise)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param  # optional extra (.[mlflow])
        from mlflow.tracking import MlflowClient  # optional extra (.[mlflow])

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        id_file = os.path.join(run_dir, "mlflow_run_id")
        self.run_id = None
        if os.path.isfile(id_file):
            rid = open(id_file).read().strip()
            try:
                self.client.get_run(rid)
                self.run_id = rid
            except Exception:  # noqa: BLE001  (another store: start a new run)
                self.run_id = None
        if self.run_id is None:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            ps = [Param(k, str(v)[:500]) for k, v in sorted(params.items())]
            for i in range(0, len(ps), 100):
                self.client.log_batch(self.run_id, params=ps[i: i + 100])
            with open_write(id_file) as f:
                f.write(self.run_id)

    def log(self, step: int, record: dict) -> None:
        from mlflow.entities import Metric  # optional extra (.[mlflow])

        ts = int(1000 * (record.get("time") or time.time()))
        ms = [Metric(k, v, ts, int(step)) for k, v in scalars(record).items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i: i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat_params(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and prefix.count(".") < 1:
            out.update(_flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MetricsLogger:
    """All the run's sinks; jsonl first. ``log`` sends one record to each."""

    def __init__(self, sinks: list, warn=print):
        self.sinks = list(sinks)
        self._warn = warn

    def log(self, record: dict) -> None:
        step = int(record["step"])
        for s in list(self.sinks):
            if s.name == "jsonl":
                s.log(step, record)  # the source of truth: its errors are the run's
                continue
            try:
                s.log(step, record)
            except Exception as e:  # noqa: BLE001
                self.sinks.remove(s)
                self._warn(f"warning: the {s.name} logger failed ({type(e).__name__}: {e}); it is off for the rest "
                           f"of the run (every number is in metrics.jsonl)")

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                self._warn(f"warning: closing the {s.name} logger failed ({e})")


def make_logger(cfg, resume_step: Optional[int] = None, warn=print) -> MetricsLogger:
    """The sinks of ``cfg.trainer.loggers`` (jsonl always) for the run in ``cfg.trainer.output_dir``."""
    t = cfg.trainer
    out = t.output_dir
    check_loggers(t.loggers)
    name = t.run_name or os.path.basename(os.path.normpath(os.path.abspath(out)))
    sinks: list = [JsonlSink(os.path.join(out, "metrics.jsonl"))]
    for n in dict.fromkeys(t.loggers):
        try:
            if n == "tensorboard":
                sinks.append(TensorBoardSink(os.path.join(out, "tensorboard"), resume_step))
            elif n == "wandb":
                sinks.append(WandbSink(out, t.logger_project, name, to_dict(cfg), mode=t.wandb_mode))
            elif n == "mlflow":
                sinks.append(MlflowSink(out, t.logger_project, name, _flat_params(to_dict(cfg)),
                                        t.mlflow_tracking_uri))
        except OSError as e:  # its folder refused a write (a file there, read-only, the disk full)
            raise BadInputError(f"trainer.loggers lists {n}, whose files cannot be written ({e.strerror or e}: "
                                f"{e.filename or out}): make that a writable folder, or remove {n} from "
                                f"trainer.loggers") from None
    return MetricsLogger(sinks, warn)


class TrainMetrics:
    """The training loop's metrics: ``log`` a step's line to every sink (``make_logger``), ``show`` it on the
    progress bar, ``warn`` beside the bar. A resumed run starts at ``step`` (``resumed``: the sinks continue the
    run there)."""

    def __init__(self, cfg, step: int, resumed: bool, progress: bool = True):
        t = cfg.trainer
        self.log_every, self.max_steps = t.log_every, t.max_steps
        self.sinks = make_logger(cfg, resume_step=step if resumed else None)  # metrics.jsonl + trainer.loggers
        self.bar = tqdm(total=t.max_steps, initial=min(step, t.max_steps), desc=f"train {t.method}", unit="step",
                        disable=not progress)

    def log(self, record: dict, force: bool = False) -> None:
        """Every ``trainer.log_every`` steps, the last step, a skipped step, and when ``force`` (an evaluation)."""
        step = record["step"]
        if step % self.log_every == 0 or step == self.max_steps or record.get("skipped") or force:
            self.sinks.log(record)  # metrics.jsonl (the source of truth) and every trainer.loggers sink

    def show(self, record: dict, heldout: Optional[tuple] = None) -> None:
        """The progress bar: one step more, its loss and AL, and ``heldout`` = (step, result) of the newest
        held-out evaluation."""
        post = dict(loss=f"{record['loss']:.4f}", AL=f"{record['expected_al']:.3f}")
        if heldout is not None and heldout[1].get("branches", 1):
            post["heldout_AL"] = f"{heldout[1]['expected_al']:.3f}@{heldout[0]}"
        self.bar.set_postfix(**post, sup_tok_s=f"{record['supervised_tokens_per_s']:.0f}")
        self.bar.update(1)

    def warn(self, msg: str) -> None:
        (tqdm.write if not self.bar.disable else print)(msg)

    def end(self) -> None:
        """The last step is done: close the progress bar."""
        self.bar.close()

    def close(self) -> None:
        """Close the sinks (the run ends, or is interrupted)."""
        self.sinks.close()
