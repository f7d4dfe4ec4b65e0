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


def _stepped_run(n_steps=60, workers=2):
    """Spans as the training loop records them: a controller ``step`` span per step (with its number), the
    workers' phases inside it, a checkpoint every 20 steps; 1 ms per phase (synthetic clock)."""
    spans, t = [], 1000.0
    for k in range(1, n_steps + 1):
        t0 = t
        for w in range(workers):
            tw = t0
            for i, name in enumerate(("prefill", "propose", "score", "loss_backward", "allreduce", "optimizer")):
                d = 0.001 * (1 + i) * (1 + w)
                spans.append((f"worker{w}", name, tw, tw + d))
                tw += d
        t = t0 + 0.05
        if k % 20 == 0:
            spans.append(("controller", "checkpoint", t, t + 0.01))
            t += 0.01
        spans.append(("controller", "step", t0, t, {"step": k}))
        t += 0.001
    return spans


def test_step_table_aggregates_phases_per_step():
    spans = [profiling._as_span(e) for e in _stepped_run()]
    table = profiling.step_table(spans)
    assert [r["step"] for r in table] == list(range(1, 61))
    r = table[0]
    assert r["phases"]["score"] == pytest.approx(0.003 * 2)  # the slowest worker's time in the phase
    assert r["phases"]["other"] == pytest.approx(0.05 - sum(0.001 * (1 + i) * 2 for i in range(6)))
    assert table[19]["phases"]["checkpoint"] == pytest.approx(0.01) and "checkpoint" not in table[18]["phases"]
    # a resumed run repeats steps: the last run of a step counts
    again = spans + [{"worker": "controller", "name": "step", "start": 5000.0, "end": 5001.0, "step": 60}]
    assert profiling.step_table(again)[-1]["wall_s"] == pytest.approx(1.0)


def test_timeline_of_a_60_step_run_with_cpu_use(tmp_path):
    """The figure a 60-step CPU run gets: per-step bars, shares per worker, and CPU use (not an empty GPU
    panel); the summary carries the per-step table and the CPU means; trace.json the CPU counters."""
    cpu = [{"worker": "worker0", "t": 1000.0 + 0.25 * i, "cpu_cores": 0.9, "machine_cores": 1.8, "ncpu": 2,
            "rss_bytes": 1 << 28} for i in range(14)]
    s = write_profile(tmp_path, _stepped_run(), cpu, gpu_note="no GPU (test)")
    d = tmp_path / "profile"
    assert (d / "cpu.jsonl").exists() and not (d / "gpu.jsonl").exists()
    assert s["steps"]["count"] == 60 and s["gpu_activity_pct"] is None
    assert s["cpu"]["mean_cores_per_worker"]["worker0"] == pytest.approx(0.9)
    assert s["cpu"]["machine_mean_cores"] == pytest.approx(1.8)
    trace = json.loads((d / "trace.json").read_text())
    assert sum(e["name"] == "cpu_cores_busy" for e in trace["traceEvents"]) == 14
    assert any(e["name"] == "step 60" for e in trace["traceEvents"])
    assert (d / "timeline.png").stat().st_size > 20_000
    # a killed run leaves half a line: the profile still renders
    with open(d / "spans.jsonl", "a") as f:
        f.write('{"worker": "worker0", "name": "pre')
    assert render(tmp_path)["steps"]["count"] == 60


def test_cpu_sampler_records_this_process():
    pytest.importorskip("psutil")
    from specopd.profiling import CpuSampler

    c = CpuSampler("w", interval_s=0.05).start()
    t = time.time()
    while time.time() - t < 0.3 or (len(c.samples) < 3 and time.time() - t < 30):  # a loaded machine: wait on
        sum(i * i for i in range(20000))  # keep a core busy
    c.stop()
    got = c.take()
    assert len(got) >= 3 and c.note is None
    assert all(x["worker"] == "w" and x["ncpu"] >= 1 and x["rss_bytes"] > 0 for x in got)
    assert max(x["cpu_cores"] for x in got) > 0.2  # the busy loop shows up


def test_start_gpu_sampler_falls_back_to_cpu_use(tmp_path):
    from types import SimpleNamespace

    from specopd.profiling import CpuSampler, start_gpu_sampler

    if GpuSampler().available:
        pytest.skip("a GPU is present")
    s, note = start_gpu_sampler(SimpleNamespace(profile=SimpleNamespace(enabled=True, nvml=True)), "local")
    try:
        assert "no GPU" in note
        assert isinstance(s, CpuSampler) or s is None  # None only without psutil
    finally:
        if s is not None:
            s.stop()
