"""Triton kernels and the pure-torch reference each one is tested against (``naive.py`` beside it); see
kernels/README.md for the interfaces the executors use.

Imported as ``specopd_kernels``. Reached as ``kernels`` instead (a checkout's root on ``sys.path``: ``python -m`` or a
REPL there), this folder is not that name's owner: the ``kernels`` that ``sys.path`` finds without this checkout
(Hugging Face's, which transformers imports) loads in its place, whatever was imported before; with none it stays
itself (kernels/DESIGN.md).
"""
import importlib.util as _util
import os as _os
import sys as _sys
from importlib.machinery import PathFinder as _PathFinder

if __name__ == "kernels":
    _checkout = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _spec = _PathFinder.find_spec(__name__, [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _checkout])
    if _spec is not None:  # none: the folder stays itself, as before the rename (a probe such as transformers'
        #                   is_kernels_available, which imports the name, then finds no distribution's metadata)
        _sys.modules[__name__] = _util.module_from_spec(_spec)  # what the import statement returns
        _spec.loader.exec_module(_sys.modules[__name__])
