import json
import time

import pytest

from specopd import profiling
from specopd.profiling import GpuSampler, Profiler, render, write_profile


def _fake_run(tmp_path):
    spans = []
    for rank in range(2):
        p = Profiler(f"worker{rank}")
        for _ in range(2):
            with p.span("train_step"):
                for name in ("prefill", "propose", "score", "loss_backward", "allreduce", "optimizer"):
                    with p.span(name):
                        time.sleep(0.002)
        spans += p.take()
        assert p.events == []
    c = Profiler("controller")
    with c.span("checkpoint"):
        time.sleep(0.002)
    return spans + c.take()


def test_span_records_order_and_nesting():
    p = Profiler("w")
    with p.span("outer"):
        with p.span("inner"):
            pass
    (w1, n1, s1, e1), (w2, n2, s2, e2) = p.events
    assert (n1, n2) == ("inner", "outer") and s2 <= s1 <= e1 <= e2 and w1 == "w"
    off = Profiler("w", enabled=False)
    with off.span("x"):
        pass
    assert off.events == []


def test_outputs_and_rerender(tmp_path):
    spans = _fake_run(tmp_path)
    s = write_profile(tmp_path, spans)
    d = tmp_path / "profile"
    for f in ("spans.jsonl", "trace.json", "timeline.png", "summary.json", "meta.json"):
        assert (d / f).exists(), f
    trace = json.loads((d / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert lanes == {"controller", "worker0", "worker1"}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(spans) and all(e["dur"] >= 0 for e in xs)
    # one lane (pid) per worker
    assert len({e["pid"] for e in xs}) == 3
    w0 = s["workers"]["worker0"]
    assert set(profiling.PHASES) - {"checkpoint"} <= set(w0["phases"])
    assert 0 < w0["phases"]["prefill"]["share"] < 1 and 0 < w0["covered_share"] <= 1
    assert s["workers"]["controller"]["phases"]["checkpoint"]["count"] == 1
    if GpuSampler().available:
        pytest.skip("GPU present: the no-GPU note is not expected")
    # honest on CPU: no number, a reason
    assert s["gpu_activity_pct"] is None and "no GPU" in s["gpu_note"]
    # re-render from saved spans only
    for f in ("trace.json", "timeline.png", "summary.json"):
        (d / f).unlink()
    s2 = render(tmp_path)
    assert (d / "timeline.png").stat().st_size > 10_000
    assert s2["workers"]["worker1"]["phases"]["score"]["count"] == 2


def test_render_missing_dir_names_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="spans.jsonl"):
        render(tmp_path)


def test_gpu_sampler_cpu_reports_reason():
    g = GpuSampler("w").start()
    time.sleep(0.05)
    g.stop()
    if g.available:
        assert g.take(), "NVML sampler recorded nothing on a GPU machine"
    else:
        assert g.take() == [] and g.note


def test_gpu_samples_rendered(tmp_path):
    spans = [("worker0", "score", 10.0, 11.0)]
    samples = [("worker0", 10.0 + 0.1 * i, 50.0 + i, 1 << 30) for i in range(10)]
    s = write_profile(tmp_path, spans, samples, gpu_note="test")
    assert s["gpu_activity_pct"] == pytest.approx(54.5)
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    assert sum(e["ph"] == "C" for e in trace["traceEvents"]) == 10


def test_cli_profile_rerenders(tmp_path, capsys):
    from specopd.cli import main

    write_profile(tmp_path, _fake_run(tmp_path), plot=False)
    assert not (tmp_path / "profile" / "timeline.png").exists()
    assert main(["profile", str(tmp_path)]) == 0
    assert (tmp_path / "profile" / "timeline.png").exists()
    assert '"workers"' in capsys.readouterr().out
