"""The executor interface (prefill / score / verify / commit of one layer over a trunk and a proposal tree), the
kernels switch and the growable cache storage. Contract: executors/DESIGN.md ("Executors").
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from specopd_executors.options import ExecOptions, as_options

_REGISTRY: dict = {}


class Executor:
    kind: str = "?"

    def prefill(self, mixer, x, positions, prev=None, options: Optional[ExecOptions] = None):
        """Run one layer's mixer over trunk tokens and keep the layer's trunk cache.

        Args:
            mixer: the layer's token mixer (the pieces each executor uses: executors/DESIGN.md, "Executors").
            x: [1, T, D] the mixer's input for the trunk tokens (already normed by the layer).
            positions: [1, T] absolute positions.
            prev: this layer's cache of the trunk so far (incremental extension; it keeps its contents), or None.
            options: an ``specopd_executors.options.ExecOptions`` (None: the defaults).

        Returns:
            (out [1, T, D], cache): out is exactly ``mixer(x, positions)`` on the full sequence; cache covers prev + T.
        """
        raise NotImplementedError

    def score(self, mixer, x, tree, caches, options: Optional[ExecOptions] = None):
        """Mixer outputs of every tree node as if its path had been run from scratch after its anchor.

        Args:
            mixer: the layer's token mixer.
            x: [1, M, D] mixer inputs of the M tree nodes.
            tree: ProposalTree; node u belongs to trunk ``tree.trunk_index[u]``.
            caches: this layer's cache of each trunk.
            options: run options.

        Returns:
            out [1, M, D]; out[0, u] = the mixer output at the last position of ``trunk[:anchor_u + 1] + path(u)``.
        """
        raise NotImplementedError

    def verify(self, mixer, x, tree, caches, options: Optional[ExecOptions] = None):
        """``score`` that also keeps what ``commit`` needs of every node (training's scoring never pays for it).

        Args:
            mixer, x, tree, caches, options: as ``score``.

        Returns:
            (out [1, M, D], nodes): nodes is the executor's own dataclass (e.g. the nodes' K/V; GDN: the fp32 state
            after each node).
        """
        raise NotImplementedError(f"the {self.kind!r} executor cannot keep node states for commit")

    def commit(self, mixer, cache, nodes, path, options: Optional[ExecOptions] = None):
        """Extend one trunk's cache by an accepted path with the states ``verify`` computed: no new pass. Equals
        ``prefill`` of the same tokens on ``cache``; ``cache`` keeps its contents.

        Args:
            mixer: the layer's token mixer.
            cache: the trunk's cache (T tokens).
            nodes: what ``verify`` returned.
            path: [L] node indices of the verified tree, root first, the root anchored at T - 1.
            options: run options.

        Returns:
            the cache of T + L tokens.
        """
        raise NotImplementedError(f"the {self.kind!r} executor cannot commit verified nodes")


def register_executor(kind: str):
    def deco(cls):
        _REGISTRY[kind] = cls()
        return cls
    return deco


def get_executor(kind: str) -> Executor:
    """The executor registered for a mixer kind (``executors/__init__.py`` imports every executor module)."""
    if kind not in _REGISTRY:
        raise ValueError(f"no executor for attention kind {kind!r} (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[kind]


# ------------------------------------------------------------------------------------------------ kernels
KERNELS = ("auto", "torch", "triton")


def check_kernels(kernels: str, device) -> None:
    """ValueError naming the fix when ``kernels`` is unknown or cannot run on ``device``."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}; got {kernels!r}")
    if kernels != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise ValueError("kernels='triton' needs the triton package (pip install triton); use kernels='torch'")
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernels='triton' runs Triton kernels, which need a CUDA device (got {device}); on the CPU "
                         f"they run only interpreted, with TRITON_INTERPRET=1 set before Python starts (tests; fp32, "
                         f"slow). Use kernels='torch' (or 'auto') on the CPU")


def resolve_kernels(options: Optional[ExecOptions], device) -> str:
    """``options.kernels`` for tensors on ``device`` -> "torch" | "triton" ("auto", or None: triton on CUDA)."""
    kernels = as_options(options).kernels or "auto"
    check_kernels(kernels, device)
    if kernels == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return kernels


def tree_cached(tree, key, build):
    """``build()`` once per tree and ``key`` (plans are the same for every layer): kept in the tree's cache."""
    return tree.cached(("executor",) + tuple(key), build)


# ------------------------------------------------------------------------------------------------ growth
class Rows:
    """Capacity-doubling storage of one tensor that grows along dim 0 (a vector's amortised append).

    Successive versions of a cache share it: the version of length n views ``buf[:n]``. An append at n
    writes in place when no other version has appended past n (``used == n``) and the capacity allows;
    otherwise it copies into a new buffer of twice the needed rows. Rows a version can see never change.
    """

    __slots__ = ("buf", "used")

    def __init__(self, buf: torch.Tensor, used: int):
        self.buf, self.used = buf, int(used)


def append_rows(old: Optional[torch.Tensor], new: torch.Tensor, rows: Optional[Rows]) -> tuple:
    """old [n, ...] (a view of ``rows.buf`` or any tensor), new [m, ...] -> (view [n + m, ...], Rows).

    In place when ``old`` is the newest version of ``rows`` and fits; else one copy into 2 (n + m) rows."""
    m = int(new.shape[0])
    if old is None:
        return new, None
    n = int(old.shape[0])
    if m == 0:
        return old, rows
    new = new.to(dtype=old.dtype, device=old.device)
    b = rows.buf if rows is not None else None
    if (b is not None and n > 0 and rows.used == n and old.data_ptr() == b.data_ptr() and n + m <= b.shape[0]
            and b.shape[1:] == old.shape[1:] and b.dtype == old.dtype and old.is_contiguous()):
        b[n:n + m] = new
        rows.used = n + m
        return b[:n + m], rows
    b = old.new_empty(2 * (n + m), *old.shape[1:])
    b[:n] = old
    b[n:n + m] = new
    return b[:n + m], Rows(b, n + m)


@dataclass
class GrowingCache:
    """Base of the per-layer cache dataclasses: ``grown(name=new_rows, ...)`` appends rows along dim 0 of
    the named fields (amortised, see ``Rows``) and returns a new cache; the old one keeps its contents."""

    _rows: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    def grown(self, replace: Optional[dict] = None, **new):
        rows, vals = dict(self._rows), {}
        for name, t in new.items():
            vals[name], rows[name] = append_rows(getattr(self, name), t, self._rows.get(name))
        return dataclasses.replace(self, **vals, **(replace or {}), _rows=rows)

    def nbytes(self) -> int:
        """Bytes of the cached tensors (their views; spare capacity of the growth buffers not counted)."""
        return int(sum(t.numel() * t.element_size() for t in self.tensors()))

    def tensors(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)
                if torch.is_tensor(getattr(self, f.name))]
