"""Phase spans per worker, an optional NVML utilisation sampler, and the profile outputs.

Every worker owns one ``Profiler``; ``with prof.span("prefill"): ...`` records (worker, name, start, end)
in wall-clock seconds. On a GPU the span synchronises the device at both ends, so a span covers the
kernels it launched (not just their launch). ``GpuSampler`` polls NVML (``pynvml`` from the optional
``nvidia-ml-py``) in a thread; without a GPU or without NVML it records *nothing* and says why.

``write_profile(run_dir, spans, gpu_samples, gpu_note)`` saves the raw data (profile/spans.jsonl,
profile/gpu.jsonl, profile/meta.json) and renders from it; ``render(run_dir)`` re-renders from the saved
files (``specopd profile RUN_DIR``). Outputs under ``<run_dir>/profile/``:

- ``trace.json``    Chrome / Perfetto trace events, one lane (pid) per worker; GPU activity as counters
- ``timeline.png``  per-worker phase lanes as coloured bars + the GPU activity curve (or a note why none)
- ``summary.json``  share of wall time per phase per worker; mean GPU activity % (or null + reason)

NVML's "utilization.gpu" is the share of time in which at least one kernel ran on the GPU; we report it
as *GPU activity %* (it is not SM occupancy).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

# The phases a training step is made of, in step order (other names are drawn too, in grey shades).
PHASES = ("prefill", "propose", "score", "loss_backward", "allreduce", "optimizer", "checkpoint")
_COLORS = {
    "prefill": "#1f77b4", "propose": "#ff7f0e", "score": "#2ca02c", "loss_backward": "#d62728",
    "backward": "#d62728", "allreduce": "#9467bd", "all-reduce": "#9467bd", "optimizer": "#8c564b",
    "checkpoint": "#e377c2", "eval": "#17becf", "warmup": "#bcbd22",
}


class Profiler:
    """Records (worker, name, start_s, end_s) spans; ``events`` is the list (drained by ``take()``)."""

    def __init__(self, worker: str = "worker0", sync_cuda: bool = True, enabled: bool = True):
        self.worker = worker
        self.sync_cuda = sync_cuda
        self.enabled = enabled
        self.events: list = []  # (worker, name, start_s, end_s)

    def _sync(self):
        if self.sync_cuda:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    @contextlib.contextmanager
    def span(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.time()
        try:
            yield
        finally:
            self._sync()
            self.events.append((self.worker, name, t0, time.time()))

    def take(self) -> list:
        """Return the recorded spans and forget them (workers ship them to the controller this way)."""
        ev, self.events = self.events, []
        return ev


# -- GPU utilisation ------------------------------------------------------------------------------------

def gpu_unavailable_reason() -> Optional[str]:
    """None when NVML can sample a GPU here, else a short reason (shown in the figure and the summary)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no GPU (torch.cuda.is_available() is False)"
    except ImportError:  # pragma: no cover
        return "torch not importable"
    try:
        import pynvml  # noqa: F401
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
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


class GpuSampler:
    """Samples NVML GPU activity % and memory of this process's GPU every ``interval_s`` in a thread.

    ``samples``: list of (worker, t_s, activity_pct, mem_used_bytes). ``note``: why there are none (or None).
    """

    def __init__(self, worker: str = "worker0", interval_s: float = 0.1, device_index: Optional[int] = None):
        self.worker = worker
        self.interval_s = interval_s
        self.samples: list = []
        self.note = gpu_unavailable_reason()
        self._index = device_index
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def available(self) -> bool:
        return self.note is None

    def start(self) -> "GpuSampler":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"nvml-{self.worker}", daemon=True)
            self._thread.start()
        return self

    def _run(self):
        import pynvml

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

    def stop(self) -> "GpuSampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return self

    def take(self) -> list:
        s, self.samples = self.samples, []
        return s


def start_gpu_sampler(cfg, worker: str):
    """(sampler or None, note): a running GpuSampler when ``profile.nvml`` is on and NVML sees a GPU;
    otherwise None and the reason (recorded in summary.json and drawn in timeline.png)."""
    prof = getattr(cfg, "profile", None)
    if prof is None or not getattr(prof, "enabled", True):
        return None, "profiling off (profile.enabled=false)"
    why = gpu_unavailable_reason()
    if why is not None:
        return None, why
    if not getattr(prof, "nvml", False):
        return None, "NVML sampling off (set profile.nvml=true)"
    s = GpuSampler(worker, interval_s=getattr(prof, "nvml_interval_ms", 100) / 1000.0).start()
    return s, None


# -- saving and rendering -------------------------------------------------------------------------------

def _profile_dir(run_dir) -> Path:
    d = Path(run_dir) / "profile"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _as_span(e) -> dict:
    if isinstance(e, dict):
        return {"worker": str(e["worker"]), "name": str(e["name"]), "start": float(e["start"]), "end": float(e["end"])}
    w, n, s, t = e
    return {"worker": str(w), "name": str(n), "start": float(s), "end": float(t)}


def _as_sample(e) -> dict:
    if isinstance(e, dict):
        return e
    w, t, u, m = e
    return {"worker": str(w), "t": float(t), "gpu_pct": float(u), "mem_bytes": int(m)}


def append_spans(run_dir, spans: Iterable, gpu_samples: Iterable = ()) -> None:
    """Append raw spans / GPU samples to profile/spans.jsonl and profile/gpu.jsonl (cheap; call per step)."""
    d = _profile_dir(run_dir)
    with open(d / "spans.jsonl", "a") as f:
        for e in spans:
            f.write(json.dumps(_as_span(e)) + "\n")
    samples = list(gpu_samples)
    if samples:
        with open(d / "gpu.jsonl", "a") as f:
            for e in samples:
                f.write(json.dumps(_as_sample(e)) + "\n")


def write_profile(run_dir, spans: Iterable = (), gpu_samples: Iterable = (), gpu_note: Optional[str] = None,
                  plot: bool = True) -> dict:
    """Append the given spans/samples, record the GPU note, then render everything. Returns the summary."""
    append_spans(run_dir, spans, gpu_samples)
    d = _profile_dir(run_dir)
    meta_path = d / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if gpu_note is not None or "gpu_note" not in meta:
        meta["gpu_note"] = gpu_note if gpu_note is not None else gpu_unavailable_reason()
    meta_path.write_text(json.dumps(meta, indent=1))
    return render(run_dir, plot=plot)


def _read_jsonl(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_profile(run_dir):
    """(spans, gpu_samples, meta) saved under <run_dir>/profile/."""
    d = Path(run_dir) / "profile"
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    return _read_jsonl(d / "spans.jsonl"), _read_jsonl(d / "gpu.jsonl"), meta


def _lanes(spans: list) -> list:
    """Worker names in a stable order: controller first, then by rank number if the name has one."""
    import re

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


def summarize(spans: list, samples: list, meta: dict) -> dict:
    """Share of the run's wall time per phase per worker (only top-level spans of each worker count
    toward ``covered``; nested spans are listed too, so shares can sum to more than 1 when nested)."""
    if not spans:
        return {"wall_s": 0.0, "workers": {}, "gpu_activity_pct": None,
                "gpu_note": meta.get("gpu_note") or "no spans recorded"}
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
    if samples:
        out["gpu_activity_pct"] = sum(s["gpu_pct"] for s in samples) / len(samples)
        out["gpu_activity_pct_per_worker"] = {
            w: sum(s["gpu_pct"] for s in samples if s["worker"] == w) / max(1, sum(s["worker"] == w for s in samples))
            for w in sorted({s["worker"] for s in samples})}
        out["gpu_note"] = "NVML utilization.gpu: share of time a kernel was running, sampled every ~0.1 s"
    else:
        out["gpu_activity_pct"] = None
        out["gpu_note"] = meta.get("gpu_note") or "no GPU samples recorded"
    return out


def chrome_trace(spans: list, samples: list) -> dict:
    """Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
    t0 = min([s["start"] for s in spans] + [s["t"] for s in samples] or [0.0])
    lanes = _lanes(spans + [{"worker": s["worker"]} for s in samples]) if (spans or samples) else []
    pid = {w: i for i, w in enumerate(lanes)}
    ev = []
    for w, p in pid.items():
        ev.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": w}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "args": {"sort_index": p}})
    for s in spans:
        ev.append({"name": s["name"], "cat": "phase", "ph": "X", "pid": pid[s["worker"]], "tid": 0,
                   "ts": (s["start"] - t0) * 1e6, "dur": (s["end"] - s["start"]) * 1e6})
    for s in samples:
        ev.append({"name": "gpu_activity_pct", "ph": "C", "pid": pid[s["worker"]], "tid": 0,
                   "ts": (s["t"] - t0) * 1e6, "args": {"gpu %": s["gpu_pct"]}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def _color(name: str, extra: dict) -> str:
    if name in _COLORS:
        return _COLORS[name]
    if name not in extra:
        greys = ["#7f7f7f", "#aaaaaa", "#555555", "#c7c7c7"]
        extra[name] = greys[len(extra) % len(greys)]
    return extra[name]


def plot_timeline(spans: list, samples: list, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = _lanes(spans)
    t0 = min([s["start"] for s in spans] + [s["t"] for s in samples] or [0.0])
    _, has_child = _nested_depth(spans)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.55 * max(1, len(lanes)) + 2.0), sharex=True,
                                  gridspec_kw={"height_ratios": [max(1, len(lanes)), 2]})
    extra: dict = {}
    used = []
    for i, s in enumerate(spans):
        y = lanes.index(s["worker"])
        c = _color(s["name"], extra)
        if has_child[i]:  # a container span (e.g. a whole step): a thin bar under the lane
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
    order = [p for p in PHASES if p in used] + [n for n in used if n not in PHASES]
    ax.legend(handles=[Patch(color=_color(n, extra), label=n) for n in order], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"SpecOPD phases per worker (wall {summary.get('wall_s', 0):.3g} s)")
    ax.grid(axis="x", alpha=0.3)
    if samples:
        for w in sorted({s["worker"] for s in samples}):
            pts = [(s["t"] - t0, s["gpu_pct"]) for s in samples if s["worker"] == w]
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=w, linewidth=1)
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("GPU activity %")
        ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax2.set_title(f"mean GPU activity {summary['gpu_activity_pct']:.1f}% (NVML)", fontsize=9)
    else:
        ax2.set_yticks([])
        ax2.text(0.5, 0.5, f"GPU utilisation unavailable ({summary.get('gpu_note')})", ha="center", va="center",
                 transform=ax2.transAxes, fontsize=11, color="#444444")
    ax2.set_xlabel("time since start (s)")
    ax2.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(run_dir, plot: bool = True) -> dict:
    """Re-render trace.json, summary.json (and timeline.png) from <run_dir>/profile/spans.jsonl."""
    d = Path(run_dir) / "profile"
    if not (d / "spans.jsonl").exists():
        raise FileNotFoundError(f"no saved spans at {d / 'spans.jsonl'}: is {run_dir} a training run directory "
                                f"(trainer.output_dir) of a run with profiling on?")
    spans, samples, meta = load_profile(run_dir)
    summary = summarize(spans, samples, meta)
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    (d / "trace.json").write_text(json.dumps(chrome_trace(spans, samples)))
    if plot:
        plot_timeline(spans, samples, summary, d / "timeline.png")
    return summary
