"""Target models (our own torch implementations) and ``load_target``.

Supported ``model_type`` values are registered in ``MODEL_TYPES`` (``specopd.models.registry``) by the model
modules, which are imported here.
"""
from specopd.models.context import RunContext, TargetCache, VerifyState  # noqa: F401
from specopd.models.base import TargetModel  # noqa: F401
from specopd.models.loading import load_mtp, load_target  # noqa: F401
from specopd.models.registry import MODEL_TYPES, register_model  # noqa: F401
from specopd.models import llama, qwen3_next, qwen4_exp  # noqa: F401,E402  (register their model types)
