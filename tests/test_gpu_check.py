"""benchmarks/gpu_check.sh, the one-call GPU check: the random target it trains on is the tiny targets'
construction."""
import torch


def test_random_target_draws_the_tiny_targets_weights_in_place(tmp_path):
    from specopd.models import load_target
    from specopd.train.tiny import build_tiny_target, random_target, tiny_config

    for mt in ("llama", "qwen3_next"):
        ref = load_target(build_tiny_target(mt, str(tmp_path / mt), seed=5), dtype=torch.bfloat16)
        got = random_target(tiny_config(mt, {})[0], dtype="bfloat16", device="cpu", seed=5)
        a, b = ref.state_dict(), got.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        assert got.kernels == "auto" and not any(p.requires_grad for p in got.parameters()) and not got.training
