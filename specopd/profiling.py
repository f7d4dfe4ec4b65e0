"""Phase spans per worker, the GPU (NVML) / CPU (psutil) samplers, and the profile outputs under
``<run_dir>/profile/`` (trace.json, timeline.png, summary.json), with the recipe's ``profile:`` section
(``ProfileConfig``). Outputs: specopd/DESIGN.md ("Profiling").
"""
from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from specopd.errors import open_write, own_dir, replacing, write_replace
from specopd.settings import SAME_RUN, check_range, setting

# The phases a training step is made of, in step order: the span names, the metric keys (train/phase_s/<phase>)
# and the memory plan's phases (specopd/memory.py). Other span names are drawn too, in grey shades.
PHASES = ("prefill", "propose", "score", "loss_backward", "allreduce", "optimizer", "checkpoint")
_COLORS = {
    "prefill": "#1f77b4", "propose": "#ff7f0e", "score": "#2ca02c", "loss_backward": "#d62728",
    "backward": "#d62728", "allreduce": "#9467bd", "all-reduce": "#9467bd", "optimizer": "#8c564b",
    "checkpoint": "#e377c2", "eval": "#17becf", "warmup": "#bcbd22",
}


@dataclass
class ProfileConfig:
    """The recipe's ``profile:`` section."""
    enabled: bool = setting(True, resume=SAME_RUN)
    """Record per-phase spans (prefill / propose / score / loss_backward / optimizer_step) per worker."""
    nvml: bool = setting(False, resume=SAME_RUN)
    """Sample GPU utilisation / memory with NVML while training (GPU only)."""
    nvml_interval_ms: int = setting(50, resume=SAME_RUN)
    """NVML sampling interval."""

    def __post_init__(self):
        check_range("profile", "nvml_interval_ms", self.nvml_interval_ms, lo=1)


class Profiler:
    """Records (worker, name, start_s, end_s) spans; ``events`` is the list (drained by ``take()``)."""

    def __init__(self, worker: str = "worker0", sync_cuda: bool = True, enabled: bool = True):
        self.worker = worker
        self.sync_cuda = sync_cuda
        self.enabled = enabled
        self.events: list = []  # (worker, name, start_s, end_s)

    def _sync(self):
        if self.sync_cuda:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """Record (worker, name, start, end) around the block; ``args`` (e.g. step=12) are kept as a 5th
        element and shown in the trace (the controller's ``step`` spans carry the step number)."""
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.time()
        try:
            yield
        finally:
            self._sync()
            self.events.append((self.worker, name, t0, time.time(), args) if args else
                               (self.worker, name, t0, time.time()))

    def take(self) -> list:
        """Return the recorded spans and forget them (workers ship them to the controller this way)."""
        ev, self.events = self.events, []
        return ev


# -- GPU utilisation ------------------------------------------------------------------------------------

def gpu_unavailable_reason() -> Optional[str]:
    """None when NVML can sample a GPU here, else a short reason (shown in the figure and the summary)."""
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    try:
        import pynvml  # noqa: F401  (optional: nvidia-ml-py)
    except ImportError:
        return "nvidia-ml-py not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as e:  # NVMLError subclasses
        return f"NVML init failed: {e}"
    return None


def _physical_gpu_index() -> int:
    """NVML counts physical GPUs; CUDA_VISIBLE_DEVICES (set by Ray per actor) maps our device 0 to one."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if vis.isdigit():
        return int(vis)
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


class ResourceSampler:
    """A daemon thread that appends a sample to ``samples`` every ``interval_s`` until ``stop()``; ``take()``
    drains them. ``note``: why there are none (None when sampling works). Subclasses set ``thread_prefix`` and
    implement ``_run`` (loop until ``self._stop`` is set; on failure set ``note``, never fake)."""

    thread_prefix = "sampler"

    def __init__(self, worker: str, interval_s: float, note: Optional[str]):
        self.worker = worker
        self.interval_s = interval_s
        self.samples: list = []
        self.note = note
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def available(self) -> bool:
        return self.note is None

    def start(self) -> "ResourceSampler":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.thread_prefix}-{self.worker}", daemon=True)
            self._thread.start()
        return self

    def _run(self):
        raise NotImplementedError

    def stop(self) -> "ResourceSampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return self

    def take(self) -> list:
        s, self.samples = self.samples, []
        return s


class GpuSampler(ResourceSampler):
    """NVML GPU activity % and memory of this process's GPU. ``samples``: (worker, t_s, activity_pct,
    mem_used_bytes)."""

    thread_prefix = "nvml"

    def __init__(self, worker: str = "worker0", interval_s: float = 0.1, device_index: Optional[int] = None):
        super().__init__(worker, interval_s, gpu_unavailable_reason())
        self._index = device_index

    def _run(self):
        import pynvml  # optional (nvidia-ml-py)

        pynvml.nvmlInit()
        try:
            idx = self._index if self._index is not None else _physical_gpu_index()
            h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            while not self._stop.is_set():
                u = pynvml.nvmlDeviceGetUtilizationRates(h)
                m = pynvml.nvmlDeviceGetMemoryInfo(h)
                self.samples.append((self.worker, time.time(), float(u.gpu), int(m.used)))
                self._stop.wait(self.interval_s)
        except Exception as e:  # report, never fake
            self.note = f"NVML sampling failed: {e}"
        finally:
            pynvml.nvmlShutdown()


def _psutil_missing() -> Optional[str]:
    try:
        import psutil  # noqa: F401  (optional)
    except ImportError:
        return "psutil not installed (pip install psutil)"
    return None


class CpuSampler(ResourceSampler):
    """This process's CPU use and the machine's (psutil). ``samples``: dicts {worker, t, cpu_cores (this
    process: 1.0 = one core busy), machine_cores (all processes), ncpu, rss_bytes}."""

    thread_prefix = "cpu"

    def __init__(self, worker: str = "worker0", interval_s: float = 0.25):
        super().__init__(worker, max(0.05, float(interval_s)), _psutil_missing())

    def _run(self):
        import psutil  # optional

        try:
            proc, ncpu = psutil.Process(), psutil.cpu_count() or 1
            proc.cpu_percent(None)
            psutil.cpu_percent(None)  # both count from here
            while not self._stop.wait(self.interval_s):
                self.samples.append({"worker": self.worker, "t": time.time(), "cpu_cores": proc.cpu_percent(None) / 100,
                                     "machine_cores": psutil.cpu_percent(None) / 100 * ncpu, "ncpu": ncpu,
                                     "rss_bytes": proc.memory_info().rss})
        except Exception as e:  # noqa: BLE001  (report, never fake)
            self.note = f"CPU sampling failed: {e}"


def start_gpu_sampler(cfg, worker: str):
    """(sampler or None, note): a running GpuSampler when ``profile.nvml`` is on and NVML sees a GPU;
    otherwise a running CpuSampler (psutil, when installed) and the reason there is no GPU curve
    (recorded in summary.json; the figure then shows CPU use)."""
    prof = getattr(cfg, "profile", None)
    if prof is None or not getattr(prof, "enabled", True):
        return None, "profiling off (profile.enabled=false)"
    why = gpu_unavailable_reason()
    if why is None and not getattr(prof, "nvml", False):
        why = "NVML sampling off (set profile.nvml=true)"
    if why is not None:
        cpu = CpuSampler(worker)
        return (cpu.start() if cpu.available else None), why
    s = GpuSampler(worker, interval_s=getattr(prof, "nvml_interval_ms", 100) / 1000.0).start()
    return s, None


# -- saving and rendering -------------------------------------------------------------------------------

def _profile_dir(run_dir) -> Path:
    return Path(own_dir(str(Path(run_dir) / "profile")))


def _as_span(e) -> dict:
    if isinstance(e, dict):
        out = {"worker": str(e["worker"]), "name": str(e["name"]), "start": float(e["start"]), "end": float(e["end"])}
        if "step" in e:
            out["step"] = int(e["step"])
        return out
    w, n, s, t, *args = e
    out = {"worker": str(w), "name": str(n), "start": float(s), "end": float(t)}
    if args and "step" in args[0]:
        out["step"] = int(args[0]["step"])
    return out


def _as_sample(e) -> dict:
    if isinstance(e, dict):
        return e
    w, t, u, m = e
    return {"worker": str(w), "t": float(t), "gpu_pct": float(u), "mem_bytes": int(m)}


def append_spans(run_dir, spans: Iterable, gpu_samples: Iterable = ()) -> None:
    """Append raw spans / samples to profile/spans.jsonl and profile/gpu.jsonl (GPU) or profile/cpu.jsonl
    (``CpuSampler``'s); cheap, call per step."""
    d = _profile_dir(run_dir)
    with open_write(str(d / "spans.jsonl"), "a") as f:
        for e in spans:
            f.write(json.dumps(_as_span(e)) + "\n")
    samples = [_as_sample(e) for e in gpu_samples]
    for name, rows in (("gpu.jsonl", [e for e in samples if "cpu_cores" not in e]),
                       ("cpu.jsonl", [e for e in samples if "cpu_cores" in e])):
        if rows:
            with open_write(str(d / name), "a") as f:
                for e in rows:
                    f.write(json.dumps(e) + "\n")


def write_profile(run_dir, spans: Iterable = (), gpu_samples: Iterable = (), gpu_note: Optional[str] = None,
                  plot: bool = True) -> dict:
    """Append the given spans/samples, record the GPU note, then render everything.

    Args:
        run_dir: the run folder (writes ``<run_dir>/profile/``).
        spans: span dicts (worker, name, start, end).
        gpu_samples: NVML or CPU samples.
        gpu_note: why there are no GPU samples (None: there are).
        plot: draw the figures too.

    Returns:
        the summary (``summary.json``).
    """
    append_spans(run_dir, spans, gpu_samples)
    d = _profile_dir(run_dir)
    meta_path = d / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if gpu_note is not None or "gpu_note" not in meta:
        meta["gpu_note"] = gpu_note if gpu_note is not None else gpu_unavailable_reason()
    write_replace(str(meta_path), json.dumps(meta, indent=1))
    return render(run_dir, plot=plot)


def read_jsonl(path: Path) -> list:
    """The records of a .jsonl; a line cut short (a killed run) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def load_profile(run_dir):
    """(spans, gpu_samples, meta) saved under <run_dir>/profile/; meta["cpu_samples"]: CpuSampler's."""
    d = Path(run_dir) / "profile"
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    meta["cpu_samples"] = read_jsonl(d / "cpu.jsonl")
    return read_jsonl(d / "spans.jsonl"), read_jsonl(d / "gpu.jsonl"), meta


def _lanes(spans: list) -> list:
    """Worker names in a stable order: controller first, then by rank number if the name has one."""
    def key(w):
        m = re.search(r"(\d+)$", w)
        return (0 if not m else 1, int(m.group(1)) if m else 0, w)

    return sorted({s["worker"] for s in spans}, key=key)


def _nested_depth(spans: list):
    """(depth, has_child): depth of each span inside the other spans of its worker (0 = top level)."""
    depth = [0] * len(spans)
    has_child = [False] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["worker"], spans[i]["start"], -spans[i]["end"]))
    stack: list = []
    for i in order:
        s = spans[i]
        while stack and (spans[stack[-1]]["worker"] != s["worker"] or spans[stack[-1]]["end"] <= s["start"]):
            stack.pop()
        depth[i] = len(stack)
        if stack:
            has_child[stack[-1]] = True
        stack.append(i)
    return depth, has_child


def step_table(spans: list) -> list:
    """Per training step: [{step, start, wall_s, phases: {name: s}}], from the controller's ``step`` spans.

    A worker span belongs to the step whose span holds its midpoint; only innermost spans count (no double
    counting of containers). Phases run on all workers at once, so a step's time in a phase is the longest
    worker's; ``other`` is the rest of the step (waiting, the controller). A step run twice (a resumed run
    repeats the steps after its checkpoint) keeps its last run."""
    marks = sorted((s for s in spans if s["worker"] == "controller" and s["name"] == "step"), key=lambda s: s["start"])
    if not marks:
        return []
    _, has_child = _nested_depth(spans)
    starts = [m["start"] for m in marks]
    rows = [{"step": m.get("step", i + 1), "start": m["start"], "wall_s": m["end"] - m["start"], "per": {}}
            for i, m in enumerate(marks)]
    for i, s in enumerate(spans):
        if has_child[i] or s["name"] == "step":
            continue
        mid = 0.5 * (s["start"] + s["end"])
        k = bisect.bisect_right(starts, mid) - 1
        if k < 0 or mid > marks[k]["end"]:
            continue
        key = (s["name"], s["worker"])
        rows[k]["per"][key] = rows[k]["per"].get(key, 0.0) + s["end"] - s["start"]
    by_step = {}
    for r in rows:
        phases: dict = {}
        for (name, _), v in r.pop("per").items():
            phases[name] = max(phases.get(name, 0.0), v)
        phases["other"] = max(0.0, r["wall_s"] - sum(phases.values()))
        r["phases"] = phases
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def summarize(spans: list, samples: list, meta: dict) -> dict:
    """Share of the run's wall time per phase per worker (only top-level spans of each worker count
    toward ``covered``; nested spans are listed too, so shares can sum to more than 1 when nested), the
    per-step table (``step_table``), GPU activity or, without a GPU, CPU use per worker."""
    cpu = meta.get("cpu_samples") or []
    cpu_out = None
    if cpu:
        ws = sorted({c["worker"] for c in cpu})
        cpu_out = {"ncpu": max(c["ncpu"] for c in cpu),
                   "machine_mean_cores": sum(c["machine_cores"] for c in cpu) / len(cpu),
                   "mean_cores_per_worker": {w: sum(c["cpu_cores"] for c in cpu if c["worker"] == w)
                                             / sum(c["worker"] == w for c in cpu) for w in ws},
                   "note": "psutil: cores busy (1.0 = one core), per worker process and for the whole machine"}
    if not spans:
        return {"wall_s": 0.0, "workers": {}, "gpu_activity_pct": None,
                "gpu_note": meta.get("gpu_note") or "no spans recorded", "cpu": cpu_out, "steps": None}
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    wall = max(t1 - t0, 1e-9)
    depth, _ = _nested_depth(spans)
    workers = {}
    for w in _lanes(spans):
        idx = [i for i, s in enumerate(spans) if s["worker"] == w]
        per: dict = {}
        for i in idx:
            s = spans[i]
            e = per.setdefault(s["name"], {"total_s": 0.0, "count": 0})
            e["total_s"] += s["end"] - s["start"]
            e["count"] += 1
        for e in per.values():
            e["share"] = e["total_s"] / wall
            e["mean_ms"] = 1e3 * e["total_s"] / e["count"]
        covered = sum(spans[i]["end"] - spans[i]["start"] for i in idx if depth[i] == 0)
        workers[w] = {"phases": per, "covered_share": covered / wall, "untracked_share": max(0.0, 1 - covered / wall)}
    out = {"wall_s": wall, "workers": workers}
    table = step_table(spans)
    out["steps"] = None if not table else {
        "count": len(table), "mean_s": sum(r["wall_s"] for r in table) / len(table),
        "per_step": [{"step": r["step"], "wall_s": r["wall_s"], "phases": r["phases"]} for r in table]}
    if samples:
        out["gpu_activity_pct"] = sum(s["gpu_pct"] for s in samples) / len(samples)
        out["gpu_activity_pct_per_worker"] = {
            w: sum(s["gpu_pct"] for s in samples if s["worker"] == w) / max(1, sum(s["worker"] == w for s in samples))
            for w in sorted({s["worker"] for s in samples})}
        out["gpu_note"] = "NVML utilization.gpu: share of time a kernel was running, sampled every ~0.1 s"
    else:
        out["gpu_activity_pct"] = None
        out["gpu_note"] = meta.get("gpu_note") or "no GPU samples recorded"
    out["cpu"] = cpu_out
    return out


def chrome_trace(spans: list, samples: list, cpu: list = ()) -> dict:
    """Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
    cpu = list(cpu)
    t0 = min([s["start"] for s in spans] + [s["t"] for s in samples] + [c["t"] for c in cpu] or [0.0])
    lanes = _lanes(spans + [{"worker": s["worker"]} for s in list(samples) + cpu]) if (spans or samples or cpu) else []
    pid = {w: i for i, w in enumerate(lanes)}
    ev = []
    for w, p in pid.items():
        ev.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": w}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "args": {"sort_index": p}})
    for s in spans:
        e = {"name": s["name"] if "step" not in s else f"step {s['step']}", "cat": "phase", "ph": "X",
             "pid": pid[s["worker"]], "tid": 0, "ts": (s["start"] - t0) * 1e6, "dur": (s["end"] - s["start"]) * 1e6}
        if "step" in s:
            e["args"] = {"step": s["step"]}
        ev.append(e)
    for s in samples:
        ev.append({"name": "gpu_activity_pct", "ph": "C", "pid": pid[s["worker"]], "tid": 0,
                   "ts": (s["t"] - t0) * 1e6, "args": {"gpu %": s["gpu_pct"]}})
    for c in cpu:
        ev.append({"name": "cpu_cores_busy", "ph": "C", "pid": pid[c["worker"]], "tid": 0,
                   "ts": (c["t"] - t0) * 1e6, "args": {"process": c["cpu_cores"], "machine": c["machine_cores"]}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def _color(name: str, extra: dict) -> str:
    if name in _COLORS:
        return _COLORS[name]
    if name not in extra:
        greys = ["#7f7f7f", "#aaaaaa", "#555555", "#c7c7c7"]
        extra[name] = greys[len(extra) % len(greys)]
    return extra[name]


MAX_BARS = 120  # more steps than this are drawn as bins of consecutive steps (mean per step)


def _phase_order(names) -> list:
    names = list(dict.fromkeys(names))
    return [p for p in PHASES if p in names] + sorted(n for n in names if n not in PHASES and n != "other") + (
        ["other"] if "other" in names else [])


def _plot_steps(ax, table: list, extra: dict) -> None:
    """Stacked bars: time per step by phase (bins of consecutive steps when there are many)."""
    k = max(1, math.ceil(len(table) / MAX_BARS))
    bins = [table[i: i + k] for i in range(0, len(table), k)]
    names = _phase_order(n for r in table for n in r["phases"])
    x = [0.5 * (b[0]["step"] + b[-1]["step"]) for b in bins]
    bottom = [0.0] * len(bins)
    for name in names:
        h = [sum(r["phases"].get(name, 0.0) for r in b) / len(b) for b in bins]
        ax.bar(x, h, width=0.8 * k, bottom=bottom, color="#dddddd" if name == "other" else _color(name, extra),
               label=name if name != "other" else "other (waiting, controller)", linewidth=0)
        bottom = [a + c for a, c in zip(bottom, h)]
    mean = sum(r["wall_s"] for r in table) / len(table)
    ax.set_ylabel("seconds per step")
    ax.set_xlabel("training step" + (f" (bars: mean of {k} consecutive steps)" if k > 1 else ""))
    ax.set_title(f"Time per training step by phase ({len(table)} steps, mean {mean:.3g} s; a phase's time is its "
                 f"slowest worker's)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)


def _plot_lanes(ax, spans: list, t0: float, extra: dict) -> None:
    """Per-worker lanes of phase spans (a profile without the controller's step spans)."""
    from matplotlib.patches import Patch  # matplotlib: slow to import, only when drawing

    lanes = _lanes(spans)
    _, has_child = _nested_depth(spans)
    used = []
    for i, s in enumerate(spans):
        y = lanes.index(s["worker"])
        c = _color(s["name"], extra)
        if has_child[i]:
            ax.broken_barh([(s["start"] - t0, s["end"] - s["start"])], (y + 0.3, 0.12), facecolors=c)
        else:
            ax.broken_barh([(s["start"] - t0, s["end"] - s["start"])], (y - 0.4, 0.68), facecolors=c,
                           edgecolors="white", linewidth=0.3)
        if s["name"] not in used:
            used.append(s["name"])
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=_color(n, extra), label=n) for n in _phase_order(used)], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title("Phases per worker over time (time since start, s)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _plot_shares(ax, spans: list, summary: dict, extra: dict) -> None:
    """One horizontal bar per worker: share of the run's wall time in each (innermost) phase."""
    _, has_child = _nested_depth(spans)
    wall = summary.get("wall_s") or 1e-9
    lanes = _lanes(spans)
    share = {w: {} for w in lanes}
    for i, s in enumerate(spans):
        if not has_child[i] and s["name"] != "step":
            d = share[s["worker"]]
            d[s["name"]] = d.get(s["name"], 0.0) + (s["end"] - s["start"]) / wall
    names = _phase_order(n for d in share.values() for n in d)
    left = [0.0] * len(lanes)
    for name in names:
        w = [share[ln].get(name, 0.0) for ln in lanes]
        ax.barh(range(len(lanes)), w, left=left, color=_color(name, extra), label=name, height=0.6)
        left = [a + b for a, b in zip(left, w)]
    for y, v in enumerate(left):
        ax.text(min(v, 1.0) + 0.005, y, f"{100 * v:.0f}% busy", va="center", fontsize=8, color="#444444")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.set_xlabel("share of the run's wall time")
    ax.set_title(f"Where each worker's time went (wall {wall:.3g} s)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _plot_use(ax, samples: list, cpu: list, summary: dict, t0: float, table: list) -> None:
    """GPU activity (NVML) over time, else CPU cores busy (psutil), else why neither."""
    for r in table if len(table) <= MAX_BARS else []:
        ax.axvline(r["start"] - t0, color="#eeeeee", linewidth=0.6, zorder=0)
    if samples:
        for w in sorted({s["worker"] for s in samples}):
            pts = [(s["t"] - t0, s["gpu_pct"]) for s in samples if s["worker"] == w]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=w, linewidth=1)
        ax.set_ylim(0, 105)
        ax.set_ylabel("GPU activity %")
        ax.set_title(f"GPU activity (NVML), mean {summary['gpu_activity_pct']:.1f}%", fontsize=10)
    elif cpu:
        ncpu = max(c["ncpu"] for c in cpu)
        for w in sorted({c["worker"] for c in cpu}):
            pts = [(c["t"] - t0, c["cpu_cores"]) for c in cpu if c["worker"] == w]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{w} process", linewidth=1)
        first = sorted({c["worker"] for c in cpu})[0]
        mach = [(c["t"] - t0, c["machine_cores"]) for c in cpu if c["worker"] == first]
        ax.plot([p[0] for p in mach], [p[1] for p in mach], color="#888888", linestyle="--", linewidth=1,
                label="whole machine")
        ax.axhline(ncpu, color="#cc0000", linewidth=0.8, linestyle=":", label=f"{ncpu} cores")
        ax.set_ylim(0, ncpu * 1.1 + 0.1)
        ax.set_ylabel("CPU cores busy")
        c = summary.get("cpu") or {}
        ax.set_title(f"CPU use (psutil), whole machine mean {c.get('machine_mean_cores', 0):.2f} of {ncpu} cores busy "
                     f"(no GPU curve: {summary.get('gpu_note')})", fontsize=10)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, f"no utilisation samples ({summary.get('gpu_note')}; CPU use needs psutil)",
                ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#444444")
    if samples or cpu:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_xlabel("time since start (s)" + ("; grey lines: step starts" if table and len(table) <= MAX_BARS else ""))
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(spans: list, samples: list, summary: dict, path: Path, cpu: list = ()) -> None:
    """timeline.png: time per step by phase (or per-worker lanes without step spans), the share of wall
    time per phase per worker, and GPU activity or CPU use over time.

    Args:
        spans: span dicts (worker, name, start, end).
        samples: GPU samples.
        summary: the profile summary (shares per phase per worker).
        path: the .png to write.
        cpu: CPU samples (psutil), drawn when there are no GPU samples.
    """
    import matplotlib  # matplotlib: slow to import, only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: slow to import, only when drawing

    cpu = list(cpu)
    t0 = min([s["start"] for s in spans] + [s["t"] for s in samples] + [c["t"] for c in cpu] or [0.0])
    table = step_table(spans)
    lanes = _lanes(spans)
    top_h = 3.2 if table else max(1.5, 0.55 * len(lanes) + 0.6)
    share_h = 0.45 * len(lanes) + 0.9
    fig, (ax, ax_share, ax_use) = plt.subplots(3, 1, figsize=(12, top_h + share_h + 2.6 + 1.2),
                                               gridspec_kw={"height_ratios": [top_h, share_h, 2.6]})
    extra: dict = {}
    if table:
        _plot_steps(ax, table, extra)
    else:
        _plot_lanes(ax, spans, t0, extra)
    _plot_shares(ax_share, spans, summary, extra)
    _plot_use(ax_use, samples, cpu, summary, t0, table)
    fig.tight_layout()
    try:
        with replacing(str(path), "wb") as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)


def render(run_dir, plot: bool = True) -> dict:
    """Re-render trace.json, summary.json (and timeline.png) from <run_dir>/profile/spans.jsonl."""
    d = Path(run_dir) / "profile"
    if not (d / "spans.jsonl").exists():
        raise FileNotFoundError(f"no saved spans at {d / 'spans.jsonl'}: is {run_dir} a training run directory "
                                f"(trainer.output_dir) of a run with profiling on?")
    spans, samples, meta = load_profile(run_dir)
    cpu = meta.pop("cpu_samples", [])
    summary = summarize(spans, samples, {**meta, "cpu_samples": cpu})
    write_replace(str(d / "summary.json"), json.dumps(summary, indent=1))
    write_replace(str(d / "trace.json"), json.dumps(chrome_trace(spans, samples, cpu)))
    if plot:
        plot_timeline(spans, samples, summary, d / "timeline.png", cpu)
    return summary

