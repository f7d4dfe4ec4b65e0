"""The recipe's ``kernels:`` section is handed down, not kept in a process-wide table: two targets with different
choices run their own paths side by side in one process, a drafter runs its target's, and a recipe's choice
reaches the driver's targets and each worker's, a Ray actor's included."""
import os

import pytest
import torch

from specopd_kernels.causal_attention import cpu as causal_cpu
from specopd_kernels.layer_ops import cpu as layer_ops
from specopd_kernels.paths import KernelsConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
CHOSEN = ["kernels.cpu_sampling=torch", "kernels.drafter_attention=chunked"]


def _choice_of(model) -> set:
    """The distinct ``kernel_paths`` that ``model``'s modules hold (a model handed one choice holds one)."""
    return {id(m.kernel_paths) for m in model.modules() if hasattr(m, "kernel_paths")}


@pytest.mark.skipif(not (layer_ops.LIB.available() and causal_cpu.LIB.available()),
                    reason="the C layer ops / attention kernels do not build on this CPU")
def test_two_targets_in_one_process_each_run_their_own_paths(tmp_path, monkeypatch):
    """One bf16 checkpoint loaded twice: one target on the C kernels (cpu_attention=cpu forces them on any CPU where
    they build), one on torch's ops. Interleaved calls each take their own path (a process-wide table could give
    only one of them its choice), and give the same greedy tokens; a drafter built on each runs its target's."""
    from specopd.drafters import build_drafter
    from specopd.models.loading import load_target
    from specopd.models.tiny import build_tiny_target

    path = build_tiny_target("llama", str(tmp_path / "t"), overrides={"vocab_size": 256, "num_hidden_layers": 2,
                                                                       "hidden_size": 128, "head_dim": 32})
    ours, theirs = KernelsConfig(cpu_attention="cpu"), KernelsConfig(cpu_attention="torch", cpu_layer_ops="torch")
    fast, plain = (load_target(path, dtype=torch.bfloat16, kernel_paths=c) for c in (ours, theirs))
    calls = []
    for mod, name in ((layer_ops, "rms_norm"), (causal_cpu, "causal_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for target in (fast, plain, fast, plain):
        calls.clear()
        logits[id(target)] = target.prefill(ids).logits
        assert set(calls) == ({"rms_norm", "causal_attention"} if target is fast else set())
    assert torch.equal(logits[id(fast)].argmax(-1), logits[id(plain)].argmax(-1))
    for target, choice in ((fast, ours), (plain, theirs)):
        assert target.kernel_paths is choice and _choice_of(target) == {id(choice)}
        for kind in ("dflash", "eagle3"):  # a block drafter and an autoregressive one
            drafter = build_drafter(kind, target, num_layers=1, block_size=4)
            assert drafter.kernel_paths is choice and _choice_of(drafter) == {id(choice)}
    assert load_target(path).kernel_paths is None  # outside a recipe: every path "auto"


def test_a_recipes_kernels_reach_the_local_driver_and_its_evaluation(tmp_path, monkeypatch):
    """runtime.backend=local: the workers in the driver's process run the recipe's paths (target, drafter, the
    losses and the sampler read them from there); the main job's evaluation loads its target with them."""
    import specopd.mainjob
    from specopd.config import load_recipe
    from specopd.train.loop import make_group

    cfg = load_recipe(RECIPE, [f"trainer.output_dir={tmp_path}", "runtime.backend=local", *CHOSEN])
    group = make_group(cfg)
    try:
        (got,) = group.run(lambda w: (w.target.kernel_paths, w.drafter.kernel_paths), [()])
    finally:
        group.shutdown()
    assert got == (cfg.kernels, cfg.kernels) and cfg.kernels.cpu_sampling == "torch"

    seen = []

    class Loaded(Exception):
        pass

    def fake_load_target(path, **kw):
        seen.append(kw.get("kernel_paths"))
        raise Loaded

    monkeypatch.setattr(specopd.mainjob, "load_target", fake_load_target)
    with pytest.raises(Loaded):
        specopd.mainjob.evaluate_rows(cfg.eval, [0.0], cfg.model, cfg.kernels, "unused", [], progress=False)
    assert seen == [cfg.kernels]


def test_a_recipes_kernels_reach_a_ray_worker(tmp_path, live_groups):
    """runtime.backend=ray: the actor, another process, builds its worker from the recipe and runs its paths."""
    ray = pytest.importorskip("ray")
    from specopd.config import load_recipe
    from specopd.distributed import RayGroup
    from specopd.train.worker import Worker

    def paths_of(w) -> tuple:  # nested: Ray pickles it by value (tests/ is not on the actors' path)
        return os.getpid(), w.target.kernel_paths, w.drafter.kernel_paths, w.drafter.layers[0].mlp.kernel_paths

    cfg = load_recipe(RECIPE, [f"trainer.output_dir={tmp_path}", "runtime.backend=ray", "runtime.num_workers=1",
                               "runtime.cpus_per_worker=1", "data.num_samples=8", *CHOSEN])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with RayGroup(cfg, Worker) as g:
            ((pid, *choices),) = g.run(paths_of, [()])
    finally:
        if started:
            ray.shutdown()
    assert pid != os.getpid()
    assert choices == [cfg.kernels] * 3 and choices[0].drafter_attention == "chunked"
    assert live_groups() == []
