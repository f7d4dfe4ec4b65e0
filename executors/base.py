"""The executor interface (see ``specopd.models.base`` for who calls it).

An executor is stateless; its caches are plain objects with ``nbytes()``.

``prefill(mixer, x, positions, prev=None, options={}) -> (out, cache)``
    x: [1, T, D] the mixer's input for trunk tokens (already normed by the layer); positions: [1, T]
    absolute positions; prev: this layer's cache of the trunk so far (incremental extension) or None.
    out: [1, T, D] exactly what ``mixer(x, positions)`` gives for the same (full) sequence.
    cache: this layer's trunk cache (for prev + these T tokens).

``score(mixer, x, tree, caches, options={}) -> out``
    x: [1, M, D] mixer inputs of the M tree nodes; tree: ProposalTree (node i belongs to trunk
    ``tree.trunk_index[i]``); caches: this layer's cache of each trunk. out: [1, M, D] where
    out[0, u] equals the mixer output at the last position of ``trunk[:anchor_u + 1] + path(u)`` run
    with the mixer's plain forward.
"""
from __future__ import annotations

_REGISTRY: dict = {}


class Executor:
    kind: str = "?"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        raise NotImplementedError

    def score(self, mixer, x, tree, caches, options=None):
        raise NotImplementedError


def register_executor(kind: str):
    def deco(cls):
        _REGISTRY[kind] = cls()
        return cls
    return deco


def get_executor(kind: str) -> Executor:
    if kind not in _REGISTRY:
        import importlib

        try:
            importlib.import_module(f"executors.{kind}")
        except ModuleNotFoundError as e:
            raise ValueError(f"no executor for attention kind {kind!r} (known: gqa, qsa, gdn)") from e
    return _REGISTRY[kind]
