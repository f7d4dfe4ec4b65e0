"""Where the whole recipe goes: the functions that receive it, and its walk from the main job.

    python benchmarks/config_walk.py [REV ...]     # default: the work tree; REV: a commit (read with git show)
    python benchmarks/config_walk.py --list REV    # also each function and the calls that pass the recipe on

Static (AST) counts over specopd/, executors/ and kernels/:

- receivers: functions with a parameter that is the whole recipe: typed ``RecipeConfig``, or (outside
  specopd/models, executors, kernels and engines, where ``cfg`` is a Hugging Face config.json dict and ``model`` a
  module) named ``cfg`` / ``recipe`` with a section read (``cfg.model``), or any parameter but ``self`` and ``args``
  (argparse's) with two or more sections read. Counted per function and per module.
- the walk: from ``specopd.mainjob.run(cfg)``, every call that passes the recipe on as an argument (the name, a
  name bound to it, ``copy.deepcopy`` of it, what a walked function returns of it, or an attribute of ``self`` it
  was stored in), resolved through the project's imports to the function (a class: its ``__init__``) it reaches.
  Counted: the functions the recipe reaches, their modules, and the calls that carry it. Calls the AST cannot
  resolve (methods of objects, a class handed to Ray) end the walk there: the counts are a lower bound.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = ("specopd", "executors", "kernels")
SECTIONS = {"model", "drafter", "data", "trainer", "runtime", "eval", "profile", "pipeline", "kernels"}
HF_CFG = ("specopd/models", "executors", "kernels", "specopd/engines")  # cfg there: a config.json dict
COPIES = {"deepcopy", "copy", "replace"}
START = ("specopd.mainjob", "run", "cfg")


def sources(rev=None) -> dict:
    """{module name: source} of the project's packages, at ``rev`` (a commit) or in the work tree."""
    if rev:
        names = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", rev, *TOPS], check=True,
                               capture_output=True, text=True).stdout.split()
        read = lambda p: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{p}"], check=True,  # noqa: E731
                                        capture_output=True, text=True).stdout
    else:
        names = [os.path.relpath(os.path.join(d, f), ROOT) for top in TOPS for d, _, fs in
                 os.walk(os.path.join(ROOT, top)) for f in fs]
        read = lambda p: open(os.path.join(ROOT, p)).read()  # noqa: E731
    out = {}
    for p in names:
        if p.endswith(".py"):
            mod = p[:-3].replace("/", ".").removesuffix(".__init__")
            out[mod] = (p, read(p))
    return out


def _reads(fn, arg: str) -> set:
    return {x.attr for x in ast.walk(fn) if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name)
            and x.value.id == arg and x.attr in SECTIONS}


def receivers(trees: dict) -> dict:
    """{module: [function(param)]} of the functions that receive the whole recipe (the module docstring's rule)."""
    out = {}
    for mod, (path, tree) in trees.items():
        hf = path.startswith(HF_CFG)
        hits = []
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs:
                    ann = ast.unparse(a.annotation) if a.annotation else ""
                    secs = _reads(n, a.arg)
                    if "RecipeConfig" in ann or (not hf and secs and (a.arg in ("cfg", "recipe") or (
                            len(secs) >= 2 and a.arg not in ("self", "args")))):
                        hits.append(f"{n.name}({a.arg})")
        if hits:
            out[mod] = hits
    return out


class Project:
    """The modules' functions, classes and imports, to resolve a call's name to the function it reaches."""

    def __init__(self, trees: dict):
        self.trees, self.defs, self.imports = trees, {}, {}
        for mod, (path, tree) in trees.items():
            defs, imps = {}, {}
            pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
            for n in tree.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defs[n.name] = n
                elif isinstance(n, ast.ImportFrom):
                    base = n.module or ""
                    if n.level:
                        base = ".".join(pkg.split(".")[: len(pkg.split(".")) - n.level + 1] + ([base] if base else []))
                    for a in n.names:
                        sub = f"{base}.{a.name}"
                        imps[a.asname or a.name] = ("module", sub) if sub in trees else ("name", base, a.name)
                elif isinstance(n, ast.Import):
                    for a in n.names:
                        imps[a.asname or a.name.split(".")[0]] = ("module", a.name if a.asname else
                                                                  a.name.split(".")[0])
            self.defs[mod], self.imports[mod] = defs, imps

    def lookup(self, mod: str, name: str, depth: int = 0):
        """-> (module, def node) that ``name`` means in ``mod`` (following re-exports), or None."""
        if mod not in self.defs or depth > 8:
            return None
        if name in self.defs[mod]:
            return mod, self.defs[mod][name]
        imp = self.imports[mod].get(name)
        if imp and imp[0] == "name":
            return self.lookup(imp[1], imp[2], depth + 1)
        return None

    def resolve(self, mod: str, func, cls=None) -> tuple:
        """A call's func (in a method of ``cls``: ``self.name`` too) -> (module, def node, the class it builds or
        None, the class it is a method of or None), or None."""
        hit = None
        if cls is not None and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                func.value.id == "self":
            meth = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == func.attr), None)
            return (mod, meth, None, cls) if meth else None
        if isinstance(func, ast.Name):
            hit = self.lookup(mod, func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            imp = self.imports.get(mod, {}).get(func.value.id)
            if imp and imp[0] == "module":
                hit = self.lookup(imp[1], func.attr)
        if hit is None:
            return None
        m, node = hit
        if isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            return (m, init, node, node) if init else None
        return m, node, None, None


def pairs(s: ast.Assign) -> list:
    """(target, value) pairs of an assignment, element by element for ``a, b = x, y``."""
    out = []
    for t in s.targets:
        if isinstance(t, ast.Tuple) and isinstance(s.value, ast.Tuple) and len(t.elts) == len(s.value.elts):
            out += list(zip(t.elts, s.value.elts))
        else:
            out.append((t, s.value))
    return out


def walk(project: Project) -> tuple:
    """The recipe's walk from ``START`` -> ({(module, function)}, [(caller, callee)])."""
    seen, edges, returns = set(), [], {}

    def methods_of(cls):
        return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def visit(mod, fn, cls, params: frozenset, self_attrs: frozenset = frozenset()) -> bool:
        """Walks ``fn`` with ``params`` holding the recipe; -> whether it returns the recipe."""
        key = (mod, (f"{cls.name}." if cls else "") + fn.name, params, self_attrs)
        if key in returns:
            return returns[key]
        returns[key] = False  # recursion: not known yet
        seen.add((mod, key[1]))
        held, attrs = set(params), set(self_attrs)

        def carries(e) -> bool:
            if isinstance(e, ast.Name):
                return e.id in held
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                return e.attr in attrs
            if isinstance(e, ast.Call):
                name = e.func.attr if isinstance(e.func, ast.Attribute) else getattr(e.func, "id", "")
                if name in COPIES and e.args and carries(e.args[0]):
                    return True
                return call(e)
            return False

        def call(c: ast.Call) -> bool:
            pos = [i for i, a in enumerate(c.args) if carries(a)]
            kws = {k.arg for k in c.keywords if k.arg and carries(k.value)}
            if not pos and not kws:
                return False
            hit = project.resolve(mod, c.func, cls)
            if hit is None:
                return False
            m, node, klass, owner = hit
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if klass is not None or (names and names[0] == "self"):
                names = names[1:]
            got = frozenset([names[i] for i in pos if i < len(names)] + list(kws))
            if not got:
                return False
            edges.append((f"{mod}.{key[1]}", f"{m}.{(owner.name + '.') if owner else ''}{node.name}"))
            back = visit(m, node, owner, got, self_attrs if owner is cls else frozenset())
            if klass is not None:  # the recipe kept on the object: every method that reads it
                kept = frozenset(t.attr for s in ast.walk(node) if isinstance(s, ast.Assign)
                                 for t, v in pairs(s) if isinstance(t, ast.Attribute) and isinstance(v, ast.Name)
                                 and v.id in got and isinstance(t.value, ast.Name) and t.value.id == "self")
                for meth in methods_of(klass) if kept else []:
                    if meth is not node and any(isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name)
                                                and x.value.id == "self" and x.attr in kept for x in ast.walk(meth)):
                        visit(m, meth, klass, frozenset(), kept)
            return back

        out = False
        for s in ast.walk(fn):
            if isinstance(s, ast.Assign):
                held.update(t.id for t, v in pairs(s) if isinstance(t, ast.Name) and carries(v))
            elif isinstance(s, ast.Call):
                call(s)
            elif isinstance(s, ast.Return) and s.value is not None and carries(s.value):
                out = True
        returns[key] = out
        return out

    mod, name, param = START
    visit(mod, project.defs[mod][name], None, frozenset({param}))
    return seen, edges


def count(rev=None, listing: bool = False) -> dict:
    trees = {m: (p, ast.parse(src)) for m, (p, src) in sources(rev).items()}
    rec = receivers(trees)
    seen, edges = walk(Project(trees))
    if listing:
        print(f"== {rev or 'work tree'}")
        for m in sorted(rec):
            print(f"  receives: {m}: {', '.join(rec[m])}")
        for a, b in sorted(set(edges)):
            print(f"  passes:   {a} -> {b}")
    return {"receiver_modules": len(rec), "receiver_functions": sum(len(v) for v in rec.values()),
            "walk_functions": len(seen), "walk_modules": len({m for m, _ in seen}), "walk_calls": len(set(edges))}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    listing = "--list" in argv
    revs = [a for a in argv if a != "--list"] or [None]
    print("python benchmarks/config_walk.py " + " ".join(argv))
    rows = [(r or "work tree", count(r, listing)) for r in revs]
    cols = ["receiver_modules", "receiver_functions", "walk_modules", "walk_functions", "walk_calls"]
    print(f"{'tree':<12}" + "".join(f"{c:>20}" for c in cols))
    for name, c in rows:
        print(f"{name:<12}" + "".join(f"{c[k]:>20}" for k in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
