"""The recipe root: ``RecipeConfig`` (one section per component, each defined beside its code), ``load_recipe``
(YAML + ``section.key=value`` overrides, renamed keys, cross-section rules) and what a checkpoint records of it.
Every field declares what a resume does when its value changes (``specopd.settings.setting``). Checks, renamed keys
and resume policies: specopd/DESIGN.md ("Recipes").
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from specopd_kernels import cpu_features
from specopd_kernels.paths import KernelsConfig, PathChoiceError
from specopd.data.config import DataConfig
from specopd.drafters.config import DrafterRecipeConfig
from specopd.errors import nonfinite_keys, read_text
from specopd.eval.config import EvalConfig
from specopd.follow_config import FollowConfig
from specopd.mainjob_config import PipelineConfig
from specopd.models.config import TINY_MODEL_TYPES, TINY_PREFIX, ModelConfig  # noqa: F401 - re-exported
from specopd.profiling import ProfileConfig
from specopd.settings import (FROM_HERE, REFUSE, RESUME_POLICIES, SAME_RUN, RecipeError,  # noqa: F401 - re-exported
                              setting)
from specopd.train.config import (CE_LABELS, CE_TERM_METHODS, LOGGERS, METHODS, TP_LM_HEAD,  # noqa: F401 - re-exported
                                  RuntimeConfig, TrainerConfig)


def auto_dtype(device: str) -> str:
    """``model.dtype: auto`` on ``device`` (cpu | cuda | auto): "bfloat16" where bf16 matmuls are native (CUDA, or
    a CPU with ``specopd_kernels.cpu_features.cpu_bf16_native``), else "float32"."""
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda or cpu_features.cpu_bf16_native() else "float32"


# Keys renamed so that a name says which temperature or warm-up it is: old "section.key" -> its new name in the same
# section. A recipe or an override that uses an old name is read as the new one with a one-line note; a checkpoint's
# recorded recipe is read the same way (``recorded_recipe``), so runs recorded before a rename resume and compare key
# by key.
RENAMED = {
    "data.sample_temperature": "data.synthetic_temperature",
    "trainer.temperature": "trainer.acceptance_temperature",
    "trainer.warmup_steps": "trainer.lr_warmup_steps",
    "eval.temperature": "eval.decode_temperature",
}


def upgrade_keys(d: dict, origin: Optional[str] = None) -> dict:
    """A recipe as a nested dict with each old name of ``RENAMED`` under its new one (in its place: a key is renamed
    within its section). ``origin`` (where the dict came from: "recipe <path>", "override"): print a one-line note
    per old name; None: silently (a checkpoint's record). Both names of one key: RecipeError."""
    out = dict(d)
    for old, new in RENAMED.items():
        section, key = old.split(".")
        new_key = new.split(".")[1]
        fields = out.get(section)
        if not isinstance(fields, dict) or key not in fields:
            continue
        if new_key in fields:
            raise RecipeError(f"{origin or 'the recorded recipe'}: {old} and {new} are one key (renamed to {new}); "
                              f"give only {new}")
        out[section] = {(new_key if k == key else k): v for k, v in fields.items()}
        if origin:
            print(f"note: {origin}: {old} is now called {new} (the old name still works; rename it to silence this "
                  f"note)", file=sys.stderr)
    return out


@dataclass
class RecipeConfig:
    seed: int = setting(0, resume=REFUSE)
    """Seed of the drafter init and of all per-sample anchor / branch generators."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The frozen target model."""
    drafter: DrafterRecipeConfig = field(default_factory=DrafterRecipeConfig)
    """The drafter being trained."""
    data: DataConfig = field(default_factory=DataConfig)
    """Reference sequences and batching."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Method, optimisation, checkpoints, logging."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Workers and where they run."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """``specopd eval``: speculative decoding with the trained drafter."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Per-phase spans and GPU sampling."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The main job (prepare, warm up, train, evaluate); off by default."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Which compute path runs where there is a choice (the CPU kernels, the drafter's attention)."""
    follow: FollowConfig = field(default_factory=FollowConfig)
    """``specopd follow``: a drafter that follows a moving policy (an RL run)."""

    def __post_init__(self):
        if self.model.dtype == "auto":  # resolved when the recipe is read: the machine it runs on decides
            self.model.dtype = auto_dtype(self.model.device)
        if self.runtime.roles == "split" and self.trainer.method == "draft_opd":
            raise RecipeError("runtime.roles=split does not support trainer.method=draft_opd (its rollout "
                              "interleaves drafting and verification); use runtime.roles=colocated")
        if self.trainer.batch_invariant and (self.runtime.roles == "split" or self.trainer.method == "draft_opd"):
            raise RecipeError("trainer.batch_invariant=true needs runtime.roles=colocated and a method other than "
                              "draft_opd (its rollouts form the batch); set trainer.batch_invariant=false")
        if self.trainer.cache_trunks and not self.trainer.method.startswith("offpolicy"):
            raise RecipeError(f"trainer.cache_trunks=true keeps only features and hidden states, but "
                              f"trainer.method={self.trainer.method} scores branches against the trunk's K/V: set "
                              f"trainer.cache_trunks=false (or use offpolicy_ce / offpolicy_e2e_tv)")
        if self.trainer.vocab_ce_weight > 0 and self.drafter.kind != "dflash2":
            raise RecipeError(f"trainer.vocab_ce_weight={self.trainer.vocab_ce_weight} is for DFlash V2, whose CE is "
                              f"over its top K candidates; drafter.kind={self.drafter.kind}'s CE is over the whole "
                              f"vocabulary already: set trainer.vocab_ce_weight=0")
        if self.trainer.eval_every > 0 and self.data.heldout == 0:
            raise RecipeError(f"trainer.eval_every={self.trainer.eval_every} evaluates on held-out sequences, but "
                              f"data.heldout=0 holds none out: set data.heldout to a fraction such as 0.1 (those "
                              f"sequences are then never trained on), or trainer.eval_every=0")


def vocab_parallel_head(cfg) -> bool:
    """Whether the ranks of a tensor-parallel group split the target's lm_head by vocabulary for training
    (``runtime.tp_lm_head``; auto: vocab_parallel, for every drafter kind)."""
    r = cfg.runtime
    return int(r.tensor_parallel) > 1 and r.tp_lm_head != "replicated"


# sections a checkpoint records only when they differ from their defaults (``recipe_record``)
OPTIONAL_SECTIONS = {"kernels": KernelsConfig, "follow": FollowConfig}
# keys ("section.key" -> default) a checkpoint records only when set, for the same reason
OPTIONAL_KEYS = {"drafter.ttt_steps": None, "drafter.draft_vocab_size": None}


def recipe_record(cfg) -> dict:
    """The recipe as a checkpoint records it: ``to_dict``, without the kernels and follow sections and the
    ``OPTIONAL_KEYS`` while they are at their defaults (so checkpoints of runs on the defaults are the bytes they were
    before those settings existed)."""
    d = to_dict(cfg)
    for name, cls in OPTIONAL_SECTIONS.items():
        if getattr(cfg, name) == cls():
            del d[name]
    for key, default in OPTIONAL_KEYS.items():
        sec, _, k = key.partition(".")
        if d[sec][k] == default:
            del d[sec][k]
    return d


def recorded_recipe(d: Optional[dict]) -> Optional[dict]:
    """A checkpoint's recipe under today's key names (``upgrade_keys``) with the kernels and follow sections and the
    ``OPTIONAL_KEYS`` filled in: a record without one ran on their defaults."""
    if d is None:
        return None
    d = upgrade_keys(d)
    d = {**d, **{name: {**to_dict(cls()), **(d[name] if name in d else {})} for name, cls in OPTIONAL_SECTIONS.items()}}
    for key, default in OPTIONAL_KEYS.items():
        sec, _, k = key.partition(".")
        if isinstance(d.get(sec), dict):
            d[sec] = {k: default, **d[sec]}
    return d


def eval_dtype(cfg) -> str:
    """The target dtype of decoding and judging: ``eval.dtype``, or ``model.dtype`` when it is auto."""
    return cfg.eval.target_dtype(cfg.model.dtype)


# ---------------------------------------------------------------------------------------------- loading
def _valid_keys(cls) -> list:
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_keys(data: dict, cls, prefix: str, origin: str) -> None:
    """Unknown keys -> error naming the key and the valid keys of its section."""
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: {prefix or 'the recipe'} must be a mapping of keys, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        full = f"{prefix}{k}"
        if k not in fields:
            raise RecipeError(f"{origin}: unknown key {full!r}; valid keys of "
                              f"{prefix.rstrip('.') or 'the recipe'}: {sorted(fields)}")
        sub = fields[k].default_factory if fields[k].default_factory is not dataclasses.MISSING else None
        sub_cls = type(sub()) if sub is not None and dataclasses.is_dataclass(sub()) else None
        if sub_cls is not None:
            if not isinstance(v, dict):
                raise RecipeError(f"{origin}: {full!r} is a section; give a mapping with keys "
                                  f"{_valid_keys(sub_cls)}, not {v!r}")
            _check_keys(v, sub_cls, full + ".", origin)


def _parse_overrides(overrides) -> dict:
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes

    out: dict = {}
    for ov in overrides or []:
        if "=" not in ov or ov.startswith("="):
            raise RecipeError(f"override {ov!r} is not of the form section.key=value (e.g. trainer.max_steps=10)")
        key, _ = ov.split("=", 1)
        try:
            d = OmegaConf.to_container(OmegaConf.from_dotlist([ov]))
        except Exception as e:  # noqa: BLE001
            raise RecipeError(f"override {ov!r} could not be parsed: {e}") from None
        node = out
        parts = key.strip().split(".")
        src = d
        for p in parts[:-1]:
            src = src[p]
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {ov!r} conflicts with an earlier override of {p!r}")
        node[parts[-1]] = src[parts[-1]]
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_recipe(path: Optional[str], overrides=None) -> RecipeConfig:
    """Read a YAML recipe (or defaults when ``path`` is None), apply ``a.b=c`` overrides, validate.

    Returns a ``RecipeConfig`` (plain dataclasses; ``__post_init__`` checks have run).
    """
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes
    from omegaconf.errors import OmegaConfBaseException  # omegaconf: see above

    data: dict = {}
    if path is not None:
        if os.path.isdir(path):
            raise RecipeError(f"recipe {path!r} is a folder; give a YAML file (e.g. recipes/tiny.yaml)")
        if not os.path.isfile(path):
            hint = ""
            rdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
            if os.path.isdir(rdir):
                hint = f"; recipes shipped in {rdir}: {sorted(f for f in os.listdir(rdir) if f.endswith('.yaml'))}"
            raise FileNotFoundError(f"recipe {path!r} does not exist{hint}")
        read_text(path, "recipe")  # a file that is not UTF-8 is named with its line
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except Exception as e:  # noqa: BLE001
            raise RecipeError(f"recipe {path!r} is not valid YAML: {e}") from None
        if not loaded:  # an empty file (or only comments) would train the defaults without a word
            raise RecipeError(f"recipe {path!r} is empty (no keys); give the settings of a run (start from a "
                              f"recipe in recipes/, e.g. recipes/tiny.yaml)")
        data = upgrade_keys(loaded, f"recipe {path}") if isinstance(loaded, dict) else loaded
        _check_keys(data, RecipeConfig, "", f"recipe {path}")
    ovs = upgrade_keys(_parse_overrides(overrides), "override")
    _check_keys(ovs, RecipeConfig, "", "override")
    merged = _deep_merge(data, ovs)
    try:
        conf = OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.create(merged))
        cfg = OmegaConf.to_object(conf)
    except RecipeError:
        raise
    except PathChoiceError as e:  # the kernels section's own check (kernels/ imports nothing from specopd)
        raise RecipeError(str(e)) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        exp = _expected_type(key)
        raise RecipeError(f"{key}: {getattr(e, 'msg', str(e)).splitlines()[0]}"
                          + (f" (expected {exp})" if exp else "")) from None
    bad = nonfinite_keys(to_dict(cfg))
    if bad:
        raise RecipeError(f"{', '.join(bad)}: not a finite number (NaN / inf); give a finite value")
    return cfg


def _expected_type(full_key: str) -> Optional[str]:
    cls = RecipeConfig
    parts = full_key.split(".")
    for i, p in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if p not in fields:
            return None
        f = fields[p]
        if i == len(parts) - 1:
            return _type_name(f.type)
        cls = type(f.default_factory())
    return None


def resume_policies(cls=None, prefix: str = "") -> dict:
    """"section.key" -> resume policy of every field of ``cls`` (default ``RecipeConfig``; a section's fields under
    its name). A field that declares none is a ``TypeError`` naming it: each new field must say what a resume
    does when it changes."""
    out = {}
    for f in dataclasses.fields(cls or RecipeConfig):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            out.update(resume_policies(type(sub), f"{prefix}{f.name}."))
        elif f.metadata.get("resume") in RESUME_POLICIES:
            out[prefix + f.name] = f.metadata["resume"]
        else:
            raise TypeError(f"{(cls or RecipeConfig).__name__}.{f.name} declares no resume policy: define it with "
                            f"setting(default, resume=REFUSE | FROM_HERE | SAME_RUN)")
    return out


def to_dict(cfg: RecipeConfig) -> dict:
    """Plain nested dict (for logging and for saving next to a checkpoint)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RecipeConfig) -> str:
    from omegaconf import OmegaConf  # omegaconf: not on the GPU test machine; only to read / write recipes

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))

