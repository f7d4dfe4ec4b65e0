"""Target models (our own torch implementations) and ``load_target``.

Supported ``model_type`` values are registered in ``MODEL_TYPES`` by the model modules below.
"""
from specopd.models.base import RunContext, TargetCache, TargetModel  # noqa: F401
from specopd.models.loading import load_target  # noqa: F401

MODEL_TYPES: dict = {}


def register_model(*model_types):
    def deco(cls):
        for mt in model_types:
            MODEL_TYPES[mt] = cls
        return cls
    return deco


def _import_models():
    import importlib

    for mod in ("llama", "qwen3_next", "qwen4_exp"):
        try:
            importlib.import_module(f"specopd.models.{mod}")
        except ModuleNotFoundError as e:  # a model module not written yet
            if e.name != f"specopd.models.{mod}":
                raise


_import_models()
