"""Every public function or method with 4 or more parameters (``self`` / ``cls`` not counted) documents them.

The packages are parsed with ``ast`` (nothing is imported). Public: the function's name and every enclosing class's
name have no leading ``_``; nested functions are not checked. Its docstring has an ``Args:`` section, or says
``Args / Returns: as ``module.Class.method```` where it implements an interface documented there (the executors).
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("specopd", "executors", "kernels")
MIN_PARAMS = 4
SEE_ALSO = re.compile(r"Args / Returns: as ``[\w.]+``")


def _undocumented(path: str) -> list:
    out = []

    def visit(body, cls=None):
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                a = node.args
                params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                if cls is not None and params[:1] in (["self"], ["cls"]):
                    params = params[1:]
                doc = ast.get_docstring(node) or ""
                if len(params) >= MIN_PARAMS and "Args:" not in doc and not SEE_ALSO.search(doc):
                    name = f"{cls}.{node.name}" if cls else node.name
                    out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {name}({', '.join(params)})")

    visit(ast.parse(open(path).read(), path).body)
    return out


def test_public_functions_with_many_parameters_have_args():
    bad = []
    for top in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    bad += _undocumented(os.path.join(dirpath, f))
    assert not bad, f"public functions with >= {MIN_PARAMS} parameters and no Args: section:\n" + "\n".join(bad)
