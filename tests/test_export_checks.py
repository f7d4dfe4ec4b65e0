"""One check of a drafter folder for ``specopd export``, ``eval.checkpoint`` and ``drafter.init_from``
(``specopd.drafters.layout.check_drafter``): tensors against config.json (names, shapes, dtypes), config values in
range and of their type, for every drafter kind and both layouts; refused with exit 2 naming the key or tensor,
nothing written. And a run started from another kind's folder records the drafter that trains."""
import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specopd.drafters import build_drafter, export_drafter, load_drafter
from specopd.drafters.layout import DrafterFolderError
from specopd.errors import UserError
from specopd.models import load_target
from specopd.runs import checkpoint as ck
from specopd.models.tiny import resolve_target_path
from tiny_runs import TINY_TEST_OVERRIDES, run_cli, tiny_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
KINDS = ("dflash", "dspark", "dflash2")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """run: a run folder holding the tiny target that eval builds for it (2 layers, hidden 64, vocab 256);
    (kind, "ours" | "released") -> a good drafter folder for that target (1 layer, block_size 4)."""
    base = tmp_path_factory.mktemp("checks")
    run = str(base / "run")
    target = load_target(resolve_target_path(tiny_recipe(run).model, run))
    folders = {}
    for kind in KINDS:
        d = build_drafter(kind, target, num_layers=1, block_size=4, mask_token_id=5, seed=1)
        folders[kind, "ours"] = str(base / kind)
        d.save(folders[kind, "ours"])
        folders[kind, "released"] = export_drafter(d, str(base / f"{kind}-released"))
    return {"run": run, "target": target, **folders}


def _bad(good, tmp_path, kind, layout, config=None, tensors=None):
    """A copy of the good ``kind`` folder in ``layout`` with config.json entries set (``a.b``: nested) and
    tensors replaced (None: removed)."""
    folder = str(tmp_path / f"bad-{kind}-{layout}")
    shutil.copytree(good[kind, layout], folder)
    p = os.path.join(folder, "config.json")
    raw = json.load(open(p))
    for key, value in (config or {}).items():
        *up, last = key.split(".")
        d = raw
        for k in up:
            d = d[k]
        if value is None:
            d.pop(last)
        else:
            d[last] = value
    json.dump(raw, open(p, "w"), indent=2)
    f = os.path.join(folder, "model.safetensors")
    sd = load_file(f)
    for name, t in (tensors or {}).items():
        sd.pop(name) if t is None else sd.__setitem__(name, t(sd.get(name)))
    save_file(sd, f)
    return folder


def _refused(rc, err, needles):
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and "specopd: error:" in err, err[-2000:]
    for n in needles:
        assert n in err, (n, err[-2000:])


def _eval(capsys, good, folder):
    return run_cli(capsys, "eval", RECIPE, *TINY_TEST_OVERRIDES, "model.target=tiny:llama",
                f"trainer.output_dir={good['run']}", f"eval.checkpoint={folder}", "eval.prompts=1",
                "eval.max_new_tokens=2", "--no-baseline")


def _init_from(capsys, tmp_path, folder):
    out = tmp_path / "init-run"
    rc, so, err = run_cli(capsys, "train", RECIPE, *TINY_TEST_OVERRIDES, "model.target=tiny:llama",
                       f"trainer.output_dir={out}", f"drafter.init_from={folder}", "trainer.max_steps=1")
    assert not out.exists()  # refused before the run folder is made
    return rc, so, err


V2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CASES = {  # id: (kind, layout, config.json entries, tensors, what the message names)
    "missing tensor": ("dflash", "ours", None, {"norm.weight": None}, ["missing ['norm.weight']"]),
    "extra tensor": ("dspark", "released", None, {"extra.weight": lambda t: torch.zeros(3)},
                     ["unexpected ['extra.weight']"]),
    "wrong shape": ("dflash2", "ours", None, {"layers.0.mlp.up_proj.weight": lambda t: t[:5]},
                    ["tensor 'layers.0.mlp.up_proj.weight' is [5, 64]", "needs [128, 64]"]),
    "V2 tensors under a V1 config": ("dflash2", "ours", {"kind": "dflash", **{k: None for k in V2_KEYS}}, None,
                                     ["a dflash2 drafter's", "candidate_selector", "\"kind\": \"dflash2\""]),
    "V2 tensors under a released V1 config": ("dflash2", "released", {"architectures": ["DFlashDraftModel"]}, None,
                                              ["a dflash2 drafter's", "architectures [\"DFlash2DraftModel\"]"]),
    "V1 tensors under a V2 config": ("dflash", "released", {"architectures": ["DFlash2DraftModel"], **{
        f"dflash_config.{k}": v for k, v in zip(V2_KEYS, (4, 16, 8, 8))}}, None,
        ["a dflash drafter's", "describes a dflash2 drafter", "architectures [\"DFlashDraftModel\"]"]),
    "DSpark heads under a DFlash config": ("dspark", "ours", {"kind": "dflash"}, None,
                                          ["a dspark drafter's", "\"kind\": \"dspark\""]),
    "selector_top_k above the vocabulary": ("dflash2", "released", {"dflash_config.selector_top_k": 1000}, None,
                                            ["\"dflash_config.selector_top_k\" = 1000", "vocab_size=256"]),
    "conv_kernel_size 0": ("dflash2", "ours", {"conv_kernel_size": 0}, None, ["\"conv_kernel_size\" = 0", ">= 1"]),
    "selector_rank 0": ("dflash2", "released", {"dflash_config.selector_rank": 0}, None,
                        ["\"dflash_config.selector_rank\" = 0"]),
    "negative rank": ("dspark", "ours", {"markov_rank": -3}, None, ["\"markov_rank\" = -3", ">= 1"]),
    "negative head count": ("dflash", "released", {"num_attention_heads": -4}, None,
                            ["\"num_attention_heads\" = -4", ">= 1"]),
    "zero kv heads": ("dspark", "ours", {"num_kv_heads": 0}, None, ["\"num_kv_heads\" = 0"]),
    "zero layer count": ("dspark", "released", {"num_hidden_layers": 0}, None, ["\"num_hidden_layers\" = 0"]),
    "block_size below 2": ("dflash", "ours", {"block_size": 1}, None, ["\"block_size\" = 1", "counts the anchor"]),
    "target_layer_ids outside the target": ("dflash2", "released", {"dflash_config.target_layer_ids": [2]}, None,
                                            ["target_layer_ids", "[2]", "out of range", "[0, 2)"]),
    "negative target layer id": ("dflash", "ours", {"feature_layers": [-1]}, None, ["[-1]", "out of range", "[0, 2)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_eval_and_init_from_refuse_the_same_folder(good, tmp_path, capsys, case):
    """Each bad folder: export exits 2 naming the key / tensor and writes nothing (a new OUT is not made; an OUT
    with files, even with --force, keeps them as they were); eval.checkpoint and drafter.init_from refuse it with
    the same message, and so does load_drafter (the workers' loader)."""
    kind, layout, config, tensors, needles = CASES[case]
    folder = _bad(good, tmp_path, kind, layout, config, tensors)
    out = tmp_path / "out"
    _refused(*run_cli(capsys, "export", folder, out)[::2], needles)
    assert not out.exists()
    used = tmp_path / "used"
    export_drafter(load_drafter(good["dflash", "ours"], good["target"]), str(used))
    before = {n: (used / n).read_bytes() for n in os.listdir(used)}
    _refused(*run_cli(capsys, "export", folder, used, "--force")[::2], needles)
    assert {n: (used / n).read_bytes() for n in os.listdir(used)} == before
    _refused(*_eval(capsys, good, folder)[::2], needles)
    _refused(*_init_from(capsys, tmp_path, folder)[::2], needles)
    with pytest.raises(DrafterFolderError) as e:
        load_drafter(folder, good["target"])
    assert all(n in str(e.value) for n in needles) and isinstance(e.value, UserError)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["ours", "released"])
def test_a_weight_stored_as_int64_is_refused_naming_it(good, tmp_path, capsys, kind, layout):
    """An int64 weight used to end export in KeyError: torch.int64 with an empty config.json left behind, and
    was cast to float by eval and init_from without a word: now each refuses it naming the tensor."""
    folder = _bad(good, tmp_path, kind, layout, tensors={"fc.weight": lambda t: t.long()})
    needles = ["tensor 'fc.weight' is stored as int64", "floating point"]
    out = tmp_path / "out"
    _refused(*run_cli(capsys, "export", folder, out, "--dtype", "bfloat16")[::2], needles)
    assert not out.exists()
    _refused(*_eval(capsys, good, folder)[::2], needles)
    _refused(*_init_from(capsys, tmp_path, folder)[::2], needles)
    with pytest.raises(DrafterFolderError, match="'fc.weight' is stored as int64"):
        load_drafter(folder, good["target"])


@pytest.mark.parametrize("kind,layout,key,value,want", [
    ("dflash", "ours", "num_layers", "two", "an integer"),
    ("dflash2", "released", "num_hidden_layers", "two", "an integer"),
    ("dflash2", "released", "dflash_config.selector_top_k", "8", "an integer"),
    ("dspark", "ours", "rms_norm_eps", "1e-6", "a finite number"),
    ("dspark", "released", "dflash_config.markov_rank", 2.5, "an integer"),
    ("dflash", "ours", "target.vocab_size", "256", "an integer"),
    ("dflash", "released", "dflash_config.target_layer_ids", [1, None], "an integer"),
    ("dspark", "ours", "confidence_head", "false", "true or false"),
])
def test_a_value_of_the_wrong_type_names_the_file_and_key(good, tmp_path, capsys, kind, layout, key, value, want):
    """A string where a number belongs (and the like) in config.json: the file, the key and the type expected,
    exit 2, never int()'s "invalid literal"; export, eval and init_from alike."""
    folder = _bad(good, tmp_path, kind, layout, config={key: value})
    shown = key + ("[1]" if isinstance(value, list) else "")
    needles = [f"{folder}/config.json", f"\"{shown}\" is ", f"it must be {want}"]
    _refused(*run_cli(capsys, "export", folder, tmp_path / "out")[::2], needles)
    assert not (tmp_path / "out").exists()
    _refused(*_eval(capsys, good, folder)[::2], needles)
    _refused(*_init_from(capsys, tmp_path, folder)[::2], needles)


@pytest.mark.parametrize("kind", KINDS)
def test_a_good_folder_exports_and_loads_back_bitwise(good, tmp_path, capsys, kind):
    """The checks refuse nothing good: ours -> export -> load gives the same tensors bit for bit, and exporting the
    export again gives the same bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(capsys, "export", good[kind, "ours"], a)[0] == 0
    assert run_cli(capsys, "export", a, b)[0] == 0
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in os.listdir(a))
    want = load_file(os.path.join(good[kind, "ours"], "model.safetensors"))
    got = load_file(str(a / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    d = load_drafter(str(a), good["target"])
    assert d.kind == kind and all(torch.equal(v, want[k]) for k, v in d.state_dict().items())


def _recipe(run):
    return yaml.safe_load(open(os.path.join(run, "recipe.yaml")))


def test_dflash2_from_a_v1_folder_records_the_drafter_that_trains(good, tmp_path, capsys, monkeypatch):
    """drafter.kind=dflash2 with a V1 drafter.init_from trains V1: the warning, the dry run's plan, recipe.yaml and
    every checkpoint's recipe say dflash; the same command resumes that run. A run recorded before (its recipe says dflash2) resumes
    too."""
    from specopd.train import loop

    def train(out, *extra):
        return run_cli(capsys, "train", RECIPE, *TINY_TEST_OVERRIDES, "model.target=tiny:llama",
                    f"trainer.output_dir={out}", "drafter.kind=dflash2", f"drafter.init_from={good['dflash', 'ours']}", "trainer.max_steps=2",
                    "trainer.save_every=1", "trainer.keep_last=3", "trainer.eval_heldout=false", *extra)

    run = str(tmp_path / "run")
    rc, so, err = train(run, "--dry-run")
    assert rc == 0 and "drafter  dflash, 1 layer(s)" in so and not os.path.exists(run), err[-2000:]
    rc, so, err = train(run)
    assert rc == 0, err[-2000:]
    assert "is a dflash drafter" in so and "drafter.kind=dflash (the recipe said dflash2)" in so
    assert _recipe(run)["drafter"]["kind"] == "dflash"
    for step in (1, 2):
        step_dir = os.path.join(run, "checkpoints", f"step-{step}")
        assert ck.read_state(step_dir)["recipe"]["drafter"]["kind"] == "dflash"
        assert json.load(open(os.path.join(step_dir, "config.json")))["kind"] == "dflash"
    shutil.rmtree(os.path.join(run, "checkpoints", "step-2"))
    rc, so, err = train(run)
    assert rc == 0, err[-2000:]
    assert "resumed from" in so and "step-1" in so and "cannot resume" not in err
    assert os.path.isdir(os.path.join(run, "checkpoints", "step-2"))

    old = str(tmp_path / "old")  # as recorded before: the recipe's dflash2 next to a V1 drafter
    monkeypatch.setattr(loop, "drafter_as_loaded", lambda cfg: cfg)
    assert train(old, "trainer.max_steps=1")[0] == 0
    assert ck.read_state(os.path.join(old, "checkpoints", "step-1"))["recipe"]["drafter"]["kind"] == "dflash2"
    monkeypatch.undo()
    rc, so, err = train(old)
    assert rc == 0 and "resumed from" in so, err[-2000:]
    assert _recipe(old)["drafter"]["kind"] == "dflash"
