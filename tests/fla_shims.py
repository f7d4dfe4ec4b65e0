"""Run fla-core's Triton kernels on the CPU under TRITON_INTERPRET=1 (tests only; the library never imports this).

Two gaps of the interpreter that fla 0.6.0 meets, bridged here:
- autotune: the interpreter has no benchmarker ("0 active drivers"), so every ``Autotuner`` keeps its first config
  only (``Autotuner.run`` then launches it without benchmarking). Results do not depend on the config.
- ``for i_t in range(NT): i_t.to(tl.int64)``: compiled Triton gives loop counters a ``.to()``; interpreted they are
  Python ints. ``patch_range`` gives every loaded ``fla.*`` module a ``range`` whose ints have a no-op ``.to()``.

Call ``install()`` before importing fla (it imports fla's GDN kernels and the causal conv and patches them), in a
process started with TRITON_INTERPRET=1 (``tests/kernel_check.py`` starts one).

``record_launches()`` also records every launch of a fla kernel (module, name, argument dtypes, integer and
constexpr values), so ``tests/test_fla.py`` can compile exactly those launches for sm_90 with triton.compile.
"""
from __future__ import annotations

import builtins
import os
import sys

LAUNCHES: list = []


class _Int(int):
    def to(self, *args, **kwargs):  # noqa: ARG002 - a loop counter cast: a no-op on Python ints
        return self


def _range(*args):
    return (_Int(i) for i in builtins.range(*args))


def patch_range() -> None:
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and mod is not None:
            mod.range = _range


def first_config_only() -> None:
    """Every Triton ``Autotuner`` made from here on keeps its first config only, launched without benchmarking (call
    it before fla is imported). The interpreter needs it; on a GPU it bounds fla's correctness checks
    (benchmarks/gpu_check.py pytest --one-autotune-config): results do not depend on the config."""
    from triton.runtime import autotuner

    if not getattr(autotuner.Autotuner, "_first_config_only", False):
        init = autotuner.Autotuner.__init__

        def first_config(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.configs = self.configs[:1]

        autotuner.Autotuner.__init__ = first_config
        autotuner.Autotuner._first_config_only = True


def install() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("tests/fla_shims.py runs fla's kernels under the interpreter: set TRITON_INTERPRET=1 "
                           "before starting the process")
    first_config_only()
    import fla.modules.causal_conv1d  # noqa: F401
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.gated_delta_rule.chunk  # noqa: F401

    patch_range()


def record_launches() -> None:
    """Record each interpreted launch of a fla kernel into ``LAUNCHES``: dicts with ``module``, ``kernel``,
    ``args`` {name: ("ptr", dtype) | ("int", value) | ("float", value) | ("const", value)}."""
    import torch
    from triton.runtime import interpreter

    if getattr(interpreter.InterpretedFunction, "_recording", False):
        return
    run = interpreter.InterpretedFunction.run

    import inspect

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if fn.__module__.startswith("fla."):
            consts = {p.name for p in inspect.signature(fn).parameters.values() if "constexpr" in str(p.annotation)}
            named = dict(zip(self.arg_names, args))
            named.update(kwargs)
            spec = {}
            for n in self.arg_names:
                a = named.get(n)
                if isinstance(a, torch.Tensor):
                    spec[n] = ("ptr", str(a.dtype).replace("torch.", ""))
                elif n in consts:
                    spec[n] = ("const", getattr(a, "value", a))
                elif isinstance(a, bool) or a is None:
                    spec[n] = ("const", a)
                elif isinstance(a, int):
                    spec[n] = ("int", a)
                elif isinstance(a, float):
                    spec[n] = ("float", a)
                else:
                    spec[n] = ("const", getattr(a, "value", a))
            opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            LAUNCHES.append(dict(module=fn.__module__, kernel=fn.__name__, args=spec, options=opts))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording
    interpreter.InterpretedFunction._recording = True
