"""``MODEL_TYPES``: HF ``model_type`` -> our target class. Each model module registers its classes with
``@register_model(...)``; importing ``specopd.models`` imports them all."""
from __future__ import annotations

MODEL_TYPES: dict = {}


def register_model(*model_types):
    """Class decorator: ``MODEL_TYPES[mt] = cls`` for each ``mt`` (a config.json ``model_type``)."""
    def deco(cls):
        for mt in model_types:
            MODEL_TYPES[mt] = cls
        return cls
    return deco
