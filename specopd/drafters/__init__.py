"""Drafters: DFlash, DSpark and DFlash V2 exactly as released / served, trained here, exported for serving.
Call sequence and shapes: specopd/drafters/DESIGN.md ("Drafters"); dflash.py (model), dspark.py (Markov / confidence
heads), dflash2.py (V2: convolutions, candidate selector, walk; DFLASH2.md), attention.py (shared-context branch
attention), layout.py (folders).
"""
from specopd.drafters.build import DRAFTERS, Drafter, build_drafter, shift_tokens  # noqa: F401
from specopd.drafters.dflash import (DFlashDrafter, DraftContext, DrafterConfig, choose_mask,  # noqa: F401
                                     default_target_layer_ids, target_identity, target_rope_theta)
from specopd.drafters.dflash2 import Candidates, DFlash2Config, DFlash2Drafter, Realized  # noqa: F401
from specopd.drafters.dspark import DSparkDrafter  # noqa: F401
from specopd.drafters.mtp import MTPConfig, MTPDrafter, build_mtp, export_mtp  # noqa: F401
from specopd.sampling import pick_tokens  # noqa: F401
from specopd.drafters.layout import (describe_export, export_drafter, export_folder, load_drafter,  # noqa: F401
                                     serving_commands)

__all__ = ["Drafter", "build_drafter", "load_drafter", "export_drafter", "export_folder", "serving_commands",
           "shift_tokens", "pick_tokens", "DFlashDrafter", "DSparkDrafter", "DFlash2Drafter", "DFlash2Config",
           "Candidates", "Realized", "DraftContext", "DrafterConfig", "MTPDrafter", "MTPConfig",
           "DRAFTERS", "default_target_layer_ids", "choose_mask"]
