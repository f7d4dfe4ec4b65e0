"""Data: the CPU demo target (``prepare_smollm2``) and reference data (``prepare_data`` / ``load_references``)."""
from specopd.data.references import heldout_prompts, load_references  # noqa: F401
from specopd.data.smollm2 import default_model_dir, prepare_smollm2  # noqa: F401
