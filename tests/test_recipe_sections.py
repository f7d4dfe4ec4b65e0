"""The recipe's sections beside their components and the recipe root's imports (specopd/DESIGN.md, "Recipes")."""
import ast
import dataclasses
import os

from specopd.config import RecipeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# where each section is defined: beside the code that reads it
HOMES = {"model": "specopd.models.config", "drafter": "specopd.drafters.config", "data": "specopd.data.config",
         "trainer": "specopd.train.config", "runtime": "specopd.train.config", "eval": "specopd.eval.config",
         "profile": "specopd.profiling", "pipeline": "specopd.mainjob_config", "kernels": "kernels.paths"}


def test_each_section_is_defined_beside_its_component():
    got = {f.name: f.default_factory.__module__ for f in dataclasses.fields(RecipeConfig)
           if f.default_factory is not dataclasses.MISSING}
    assert got == HOMES


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
