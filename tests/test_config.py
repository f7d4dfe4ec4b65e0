"""Recipe loading, validation errors and the CLI entry points (no training here)."""
import glob
import os

import pytest

from specopd.cli import main
from specopd.config import RecipeConfig, RecipeError, load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_and_overrides():
    cfg = load_recipe(None, ["trainer.max_steps=7", "seed=3", "drafter.feature_layers=[0,1]", "model.tiny={hidden_size: 32}"])
    assert isinstance(cfg, RecipeConfig)
    assert cfg.trainer.max_steps == 7 and cfg.seed == 3
    assert list(cfg.drafter.feature_layers) == [0, 1] and cfg.model.tiny == {"hidden_size": 32}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "tiny*.yaml"))))
def test_shipped_tiny_recipes_load(path):
    cfg = load_recipe(path)
    assert cfg.model.target.startswith("tiny:")


def test_unknown_key_names_key_and_valid_keys(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("trainer:\n  max_step: 3\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(p))
    msg = str(e.value)
    assert "trainer.max_step" in msg and "max_steps" in msg and "anchors_per_seq" in msg
    with pytest.raises(RecipeError, match="valid keys of the recipe"):
        load_recipe(None, ["trainr.max_steps=3"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["trainer.max_steps=many"])
    assert "trainer.max_steps" in str(e.value) and "int" in str(e.value)
    with pytest.raises(RecipeError, match="is a section"):
        load_recipe(None, ["trainer=3"])


def test_bad_values_list_choices():
    with pytest.raises(RecipeError, match="offpolicy_ce"):
        load_recipe(None, ["trainer.method=rollout"])
    with pytest.raises(RecipeError, match="keep_last"):
        load_recipe(None, ["trainer.keep_last=1"])
    with pytest.raises(RecipeError, match="tiny:llama"):
        load_recipe(None, ["model.target=tiny:gpt2"])
    with pytest.raises(RecipeError, match="resume"):
        load_recipe(None, ["trainer.resume=/no/such/ckpt"])
    with pytest.raises(RecipeError, match="section.key=value"):
        load_recipe(None, ["max_steps"])
    with pytest.raises(RecipeError, match="ce_weight"):
        load_recipe(None, ["trainer.ce_weight=-0.1"])
    for method in ("offpolicy_ce", "draft_opd"):  # a CE term only beside E2E-TV, named with the fix
        with pytest.raises(RecipeError, match="set trainer.ce_weight=0"):
            load_recipe(None, [f"trainer.method={method}", "trainer.ce_weight=0.5"])
    assert load_recipe(None, ["trainer.ce_weight=0.5"]).trainer.ce_weight == 0.5
    assert load_recipe(None, ["trainer.ce_weight=0.5", "trainer.ce_labels=target"]).trainer.ce_labels == "target"
    with pytest.raises(RecipeError, match="set trainer.ce_weight > 0"):
        load_recipe(None, ["trainer.ce_labels=target"])
    with pytest.raises(RecipeError, match="ce_labels='argmax' is not valid"):
        load_recipe(None, ["trainer.ce_weight=0.5", "trainer.ce_labels=argmax"])
    v2ce = ["drafter.kind=dflash2", "trainer.method=offpolicy_ce", "trainer.vocab_ce_weight=1"]
    assert load_recipe(None, v2ce).trainer.vocab_ce_weight == 1.0
    with pytest.raises(RecipeError, match="set trainer.method=offpolicy_ce or trainer.vocab_ce_weight=0"):
        load_recipe(None, ["drafter.kind=dflash2", "trainer.vocab_ce_weight=1"])
    with pytest.raises(RecipeError, match="whole vocabulary already: set trainer.vocab_ce_weight=0"):
        load_recipe(None, ["trainer.method=offpolicy_ce", "trainer.vocab_ce_weight=1"])
    with pytest.raises(RecipeError, match="float32"):
        load_recipe(None, ["eval.dtype=fp8"])


def test_eval_dtype_defaults_to_the_models():
    from specopd.config import eval_dtype

    assert eval_dtype(load_recipe(None, ["model.dtype=bfloat16"])) == "bfloat16"
    assert eval_dtype(load_recipe(None, ["model.dtype=bfloat16", "eval.dtype=float32"])) == "float32"


def test_auto_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    """model.dtype=auto resolves when the recipe is read: bfloat16 on CUDA and on a CPU with native bf16 matmuls,
    float32 on a CPU that would emulate them (far slower than fp32 on an AVX2 EPYC)."""
    import torch

    from specopd_kernels import cpu_features
    from specopd import config

    for native in (True, False):
        monkeypatch.setattr(cpu_features, "cpu_bf16_native", lambda native=native: native)
        cfg = load_recipe(None, ["model.dtype=auto", "model.device=cpu"])
        assert cfg.model.dtype == ("bfloat16" if native else "float32")
        assert config.eval_dtype(cfg) == cfg.model.dtype
        assert load_recipe(None, ["model.dtype=auto", "model.device=cuda"]).model.dtype == "bfloat16"
        want = "bfloat16" if native or torch.cuda.is_available() else "float32"
        assert load_recipe(None, ["model.dtype=auto", "model.device=auto"]).model.dtype == want
        assert load_recipe(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"  # asked for: kept
    monkeypatch.undo()
    flags = cpu_features.cpu_flags()
    assert cpu_features.cpu_bf16_native() == ("amx_bf16" in flags or "avx512_bf16" in flags)
    if os.path.exists("/proc/cpuinfo") and any(ln.startswith("flags") for ln in open("/proc/cpuinfo")):
        assert flags  # the flags line is read


def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_fix(monkeypatch):
    from specopd_kernels import cpu_features
    from specopd.models import loading

    cfg = load_recipe(None, ["model.dtype=bfloat16", "model.device=cpu"])
    monkeypatch.setattr(cpu_features, "cpu_bf16_native", lambda: False)
    with pytest.warns(UserWarning, match="model.dtype=auto"):
        loading.check_device(cfg)
    monkeypatch.setattr(cpu_features, "cpu_bf16_native", lambda: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loading.check_device(cfg)


def test_missing_recipe_file_lists_recipes():
    with pytest.raises(FileNotFoundError, match="tiny.yaml"):
        load_recipe("/no/such/recipe.yaml")


def test_cli_dry_run_prints_plan(tmp_path, capsys):
    rc = main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), "--dry-run",
               f"trainer.output_dir={tmp_path}", "runtime.num_workers=2", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "worker 1" in out and "memory" in out and "llama" in out
    assert not os.path.exists(tmp_path / "checkpoints")  # nothing ran
    assert (tmp_path / "plan.json").exists()


def test_cli_errors_exit_2(capsys):
    assert main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), "trainer.bogus=1"]) == 2
    assert "trainer.bogus" in capsys.readouterr().err
    assert main(["train", "/no/such.yaml"]) == 2


def test_cli_dispatch_passes_arguments_through(monkeypatch):
    import specopd.cli as cli

    seen = {}
    for name, module in (("main_prepare", "specopd.data.prepare"), ("main_eval", "specopd.eval.cli")):
        monkeypatch.setattr(cli, name, lambda *a, _m=module, **kw: seen.setdefault(_m, a))
    assert main(["prepare", "data", "--num", "48", "--max-new-tokens", "64"]) == 0
    assert seen["specopd.data.prepare"] == (["data", "--num", "48", "--max-new-tokens", "64"],)
    assert main(["eval", os.path.join(ROOT, "recipes", "tiny.yaml"), "--json", "x.json", "eval.prompts=3"]) == 0
    cfg, args = seen["specopd.eval.cli"]
    assert cfg.eval.prompts == 3 and args.json == "x.json"


def test_every_field_declares_what_a_resume_does_with_its_change():
    """Each recipe field says whether a resume refuses its change, lists it as taking effect from the resumed step,
    or lists it as the same run (``specopd.config.setting``); a field that declares nothing is an error."""
    import dataclasses

    from specopd.config import FROM_HERE, REFUSE, RESUME_POLICIES, SAME_RUN, resume_policies, setting, to_dict

    policies = resume_policies()
    flat = [f"{s}.{k}" for s, sec in to_dict(RecipeConfig()).items() if isinstance(sec, dict) for k in sec] + ["seed"]
    assert set(policies) == set(flat) and set(policies.values()) <= set(RESUME_POLICIES)
    assert policies["seed"] == policies["model.target"] == policies["data.seq_len"] == REFUSE
    assert policies["trainer.max_steps"] == policies["runtime.num_workers"] == SAME_RUN
    assert policies["trainer.lr"] == policies["data.batch_size"] == FROM_HERE

    @dataclasses.dataclass
    class Section:
        declared: int = setting(1, resume=SAME_RUN)
        bare: int = 2

    with pytest.raises(TypeError, match=r"Section\.bare declares no resume policy"):
        resume_policies(Section)
    with pytest.raises(ValueError, match="resume='maybe'"):
        setting(1, resume="maybe")


def test_compute_paths_are_recipe_keys_checked_on_resume(tmp_path, capsys):
    """The kernels section (specopd_kernels.paths): one key per path, validated up front, shown by --dry-run, taking effect
    from the resumed step on; a checkpoint that records no section ran on the defaults, and a run on the defaults
    records none (its checkpoints stay the bytes they were)."""
    import dataclasses

    from specopd_kernels import paths
    from specopd.config import FROM_HERE, recipe_record, recorded_recipe, resume_policies, to_dict
    from specopd.train.checkpointer import recipe_changes

    assert [f.name for f in dataclasses.fields(paths.KernelsConfig)] == list(paths.CHOICES)
    assert all(resume_policies()[f"kernels.{k}"] == FROM_HERE for k in paths.CHOICES)
    with pytest.raises(RecipeError, match=r"kernels.cpu_attention='c' is not valid; choose one of \['auto', 'cpu'"):
        load_recipe(None, ["kernels.cpu_attention=c"])
    assert main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), "--dry-run", f"trainer.output_dir={tmp_path}",
                 "kernels.cpu_tv_loss=torch"]) == 0
    assert "cpu_tv_loss=torch" in capsys.readouterr().out

    default, changed = load_recipe(None), load_recipe(None, ["kernels.cpu_linear=all"])
    assert "kernels" not in recipe_record(default) and recipe_record(changed)["kernels"]["cpu_linear"] == "all"
    refused, same, here = recipe_changes(recorded_recipe(recipe_record(default)), to_dict(changed))
    assert not refused and not same and here == ["kernels.cpu_linear 'auto' -> 'all'"]
    assert recipe_changes(recorded_recipe(recipe_record(changed)), to_dict(changed)) == ([], [], [])


def test_no_library_code_reads_a_compute_path_from_the_environment():
    """The compute paths are recipe keys (specopd_kernels.paths): no module reads their old environment variables."""
    import re

    old = re.compile(r"SPECOPD_(ATTENTION|LINEAR|LAYER_OPS|TV_KERNEL|SAMPLE_KERNEL|DRAFTER_ATTENTION)\b")
    found = [f"{os.path.relpath(p, ROOT)}:{i}" for top in ("specopd", "executors", "kernels")
             for p in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)
             for i, line in enumerate(open(p), 1) if old.search(line)]
    assert found == []


def test_a_worker_applies_its_recipes_compute_paths(tmp_path):
    """A worker (in-process or in a Ray actor) hands the recipe's paths to its target and drafter; no recipe is
    "auto" everywhere."""
    from specopd_kernels import paths
    from specopd.train.worker import Worker

    w = Worker(load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"), [f"trainer.output_dir={tmp_path}",
                                                                        "kernels.cpu_sampling=torch"]))
    for model in (w.target, w.drafter):
        assert paths.mode(model.kernel_paths, "cpu_sampling") == "torch"
        assert paths.mode(model.kernel_paths, "cpu_tv_loss") == "auto"
    assert paths.mode(None, "cpu_sampling") == "auto" and paths.mode(None, "drafter_attention") == "auto"
    with pytest.raises(ValueError, match="kernels.cpu_fast: no such compute path"):
        paths.mode(None, "cpu_fast")
