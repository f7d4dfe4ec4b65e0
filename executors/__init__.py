"""Branch-parallel executors: how one token-mixer layer runs over a trunk (prefill) and a tree (score).

One module per attention kind; each exposes ``prefill`` and ``score`` with the signatures documented in
``specopd_executors.base`` and a plain sequential reference they are tested against.
"""
from specopd_executors.base import Executor, get_executor, register_executor  # noqa: F401
from specopd_executors import conv, gdn, gqa, qsa  # noqa: F401  (each registers its executor)
