"""The recipe's sections beside their components, the renamed keys (still read, with a note; checkpoints that
recorded the old names resume) and the recipe root's imports (specopd/DESIGN.md, "Recipes")."""
import ast
import dataclasses
import hashlib
import json
import os

import pytest

from specopd.cli import main
from specopd.config import RENAMED, RecipeConfig, RecipeError, load_recipe, recorded_recipe, resume_policies, to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")

# where each section is defined: beside the code that reads it
HOMES = {"model": "specopd.models.config", "drafter": "specopd.drafters.config", "data": "specopd.data.config",
         "trainer": "specopd.train.config", "runtime": "specopd.train.config", "eval": "specopd.eval.config",
         "profile": "specopd.profiling", "pipeline": "specopd.mainjob_config", "kernels": "specopd_kernels.paths",
         "follow": "specopd.follow_config"}


def test_each_section_is_defined_beside_its_component():
    got = {f.name: f.default_factory.__module__ for f in dataclasses.fields(RecipeConfig)
           if f.default_factory is not dataclasses.MISSING}
    assert got == HOMES


def test_renamed_keys_name_fields_and_say_which_is_which():
    """Every new name is a field of the old name's section and no old name is; each new key's own name is unique in
    the recipe (the fingerprints write it back as the old one by that name, tests/fingerprint_runs.py)."""
    policies = resume_policies()
    assert all(new in policies and old not in policies and old.split(".")[0] == new.split(".")[0]
               for old, new in RENAMED.items())
    names = [k.rpartition(".")[2] for k in policies]
    assert all(names.count(new.rpartition(".")[2]) == 1 for new in RENAMED.values())
    temperatures = sorted(k for k in policies if "temperature" in k)
    assert temperatures == ["data.synthetic_temperature", "eval.decode_temperature", "pipeline.data_temperature",
                            "pipeline.eval_temperatures", "trainer.acceptance_temperature"]
    assert sorted(k for k in policies if k.endswith("warmup_steps")) == ["pipeline.warmup_steps",
                                                                         "trainer.lr_warmup_steps"]


def test_an_old_key_is_read_under_its_new_name_with_a_one_line_note(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  sample_temperature: 0.5\ntrainer:\n  temperature: 0.0\n  warmup_steps: 4\n"
                   "eval:\n  temperature: 1.0\n")
    cfg = load_recipe(str(old))
    assert (cfg.data.synthetic_temperature, cfg.trainer.acceptance_temperature, cfg.trainer.lr_warmup_steps,
            cfg.eval.decode_temperature) == (0.5, 0.0, 4, 1.0)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 4 and all(f"{o} is now called {n}" in line and str(old) in line
                                   for (o, n), line in zip(RENAMED.items(), notes))
    assert load_recipe(str(old), ["trainer.temperature=0.7"]).trainer.acceptance_temperature == 0.7
    assert "override: trainer.temperature is now called trainer.acceptance_temperature" in capsys.readouterr().err
    assert load_recipe(str(old), ["trainer.acceptance_temperature=0.3"]).trainer.acceptance_temperature == 0.3
    capsys.readouterr()
    assert load_recipe(TINY, ["trainer.acceptance_temperature=0.3"]).trainer.acceptance_temperature == 0.3
    assert capsys.readouterr().err == ""  # the new names: no note
    with pytest.raises(RecipeError, match="trainer.temperature and trainer.acceptance_temperature are one key"):
        load_recipe(None, ["trainer.temperature=1", "trainer.acceptance_temperature=0"])
    with pytest.raises(RecipeError, match=r"trainer.acceptance_temperature=-1.0 is out of range"):
        load_recipe(None, ["trainer.temperature=-1"])  # checked under the name it now has


def test_the_cli_takes_old_keys_in_recipes_and_overrides(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text(open(TINY).read().replace("acceptance_temperature:", "temperature:"))
    assert main(["train", str(old), "--dry-run", f"trainer.output_dir={tmp_path / 'run'}",
                 "trainer.warmup_steps=1"]) == 0
    err = capsys.readouterr().err
    assert "trainer.temperature is now called trainer.acceptance_temperature" in err
    assert "override: trainer.warmup_steps is now called trainer.lr_warmup_steps" in err


def _reseal(step_dir):
    """The checkpoint's manifest and marker brought up to date with its files as they are now."""
    def sha(p):
        return hashlib.sha256(open(p, "rb").read()).hexdigest()

    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    man["files"] = {n: {"bytes": os.path.getsize(os.path.join(step_dir, n)), "sha256": sha(os.path.join(step_dir, n))}
                    for n in man["files"]}
    json.dump(man, open(os.path.join(step_dir, "manifest.json"), "w"), indent=1)
    marker = json.load(open(os.path.join(step_dir, "COMPLETE")))
    json.dump(dict(marker, manifest_sha256=sha(os.path.join(step_dir, "manifest.json"))),
              open(os.path.join(step_dir, "COMPLETE"), "w"))


def test_a_checkpoint_that_recorded_the_old_names_resumes(tmp_path, capsys):
    """A run whose state.json records the old key names (as runs before the renames did: fingerprint_runs'
    ``old_key_names`` writes exactly those bytes) resumes as the same run, and a changed value under a renamed key
    is still seen and listed."""
    from fingerprint_runs import old_key_names
    from specopd.runs import checkpoint as ck
    from specopd.train.checkpointer import recipe_changes

    out = tmp_path / "run"
    assert main(["train", TINY, f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_heldout=false",
                 "profile.enabled=false"]) == 0
    step = os.path.join(str(out), "checkpoints", "step-2")
    state = os.path.join(step, "state.json")
    text = open(state).read()
    open(state, "w").write(old_key_names(text))
    assert '"temperature": 1.0' in open(state).read() and "acceptance_temperature" not in open(state).read()
    _reseal(step)
    assert ck.verify(step) is None
    capsys.readouterr()
    assert main(["train", TINY, f"trainer.output_dir={out}", "trainer.max_steps=3", "trainer.eval_heldout=false",
                 "profile.enabled=false"]) == 0
    said = capsys.readouterr().out
    assert "cannot resume" not in said and "take effect from step" not in said
    assert "trainer.max_steps 2 -> 3" in said and os.path.isdir(os.path.join(str(out), "checkpoints", "step-3"))

    recorded = recorded_recipe(json.loads(old_key_names(text))["recipe"])
    now = load_recipe(TINY, [f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_heldout=false",
                             "profile.enabled=false", "trainer.acceptance_temperature=0.5"])
    assert recipe_changes(recorded, to_dict(now)) == ([], [], ["trainer.acceptance_temperature 1.0 -> 0.5"])


def _module_level_imports(path: str, name: str, mods: set) -> set:
    """The modules ``name`` imports when it is imported: its module-level imports (not those inside functions or
    ``if TYPE_CHECKING``), each with the packages above it (their ``__init__`` runs first)."""
    is_pkg = path.endswith("__init__.py")
    found = set()

    def add(target: str) -> None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        while target:
            found.add(target)
            target = target.rpartition(".")[0]

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if is_pkg else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if node.module else pkg
                for a in node.names:
                    add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(ast.parse(open(path).read(), path).body)
    found.discard(name)
    return found


def test_nothing_the_recipe_root_loads_imports_it_back():
    """Importing specopd.config imports every section's package (models, drafters, data, eval, ...): no module it
    loads that way may import specopd.config at module level, or one import order fails with a partially
    initialised module (tests/test_imports.py reads imports, not the package __init__ files they run)."""
    paths = {}
    for top in ("specopd", "executors", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    paths[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    mods = set(paths)
    imports = {m: _module_level_imports(p, m, mods) for m, p in paths.items()}
    loaded, todo = set(), ["specopd.config"]
    while todo:
        m = todo.pop()
        for t in imports.get(m, ()):
            if t not in loaded:
                loaded.add(t)
                todo.append(t)
    assert {"specopd.models", "specopd.drafters", "specopd.eval", "specopd.data"} <= loaded
    back = sorted(m for m in loaded - {"specopd.config"} if "specopd.config" in imports[m])
    assert back == [], f"imported (module level) while specopd.config loads, and importing it back: {back}"
