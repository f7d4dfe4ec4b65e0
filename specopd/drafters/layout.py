"""Drafter folders: our checkpoints and the released layout (z-lab DFlash / SpecForge DSpark / vLLM's DFlash V2)
that vLLM and SGLang load. Both layouts: specopd/drafters/DESIGN.md ("Drafter folders").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import warnings
from types import SimpleNamespace
from typing import Optional

import safetensors.torch
import torch
from safetensors import SafetensorError

from specopd.drafters.build import DRAFTERS
from specopd.drafters.dflash import FORMAT, DrafterConfig, default_target_layer_ids, target_identity
from specopd.drafters.dflash2 import V2_KEYS
from specopd.drafters.eagle3 import ARCH_QWEN3, eagle3_arch, eagle3_config_from_released, eagle3_released_config
from specopd.drafters.mtp import build_mtp, export_mtp, is_mtp_folder
from specopd.errors import (BadInputError, DamagedFolderError, FolderNotEmptyError, make_dir, open_write, read_text,
                            replacing_path)
from specopd.models.common import hand_down

ARCH = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel",
        "eagle3": "LlamaForCausalLMEagle3"}
KINDS = tuple(ARCH)
KIND_OF_ARCH = {**{v: k for k, v in ARCH.items()}, "Eagle3LlamaForCausalLM": "eagle3",  # both names vLLM loads
                ARCH_QWEN3: "eagle3"}  # and the Qwen3 variant (q / k norms)
EAGLE3_INDEX = ("d2t", "t2d")  # EAGLE-3's vocabulary maps: int64 / bool, never cast
AUTO_MAP = {"dflash": "dflash.DFlashDraftModel", "dspark": "dspark.DSparkDraftModel"}  # V2 ships no HF code
V2_REQUIRED = V2_KEYS[:4]  # vLLM reads these with dflash_config[key]: a V2 folder without them does not load
MASK_FILE = "mask_embedding.pt"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3
DRAFTER_FOLDER = ("a drafter folder holds config.json + safetensors weights, either SpecOPD's (config.json with "
                  "\"kind\": \"dflash\" | \"dspark\" | \"dflash2\" and the drafter's sizes, model.safetensors; "
                  "written by drafter.save(dir) or a run's <output_dir>/checkpoints/step-N) or the released DFlash / "
                  "DSpark / DFlash V2 layout (config.json with architectures [\"DFlashDraftModel\"], "
                  "[\"DSparkDraftModel\"] or [\"DFlash2DraftModel\"] and dflash_config, model.safetensors or "
                  "shards + index, optional mask_embedding.pt)")


class DrafterFolderError(BadInputError):
    """A drafter folder whose config.json holds a value of the wrong type or out of range, whose tensors do not
    match it (names, shapes, dtypes), or (``check_against_target``) that does not fit the target it is loaded for.
    The message names the file, the key or tensor, and the fix; ``specopd export``, ``eval.checkpoint`` and
    ``drafter.init_from`` refuse such a folder alike (``check_drafter``)."""


class NotADrafterError(ValueError):
    """A folder given as a drafter (``load_drafter``, ``eval.checkpoint``, ``drafter.init_from``, ``specopd
    export``) whose config.json does not describe a drafter. The message names the folder and what a drafter
    folder holds."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path!r} is not a drafter folder: {why}. {DRAFTER_FOLDER[0].upper()}{DRAFTER_FOLDER[1:]}")


# ------------------------------------------------------------------------------------------- integrity
MARKER = "COMPLETE"
MANIFEST = "manifest.json"


def sha256_file(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def verify_folder(path: str, checksums: bool = True) -> Optional[str]:
    """None when a folder's files match its manifest; else what is wrong (one line).

    A checkpoint folder (``specopd.runs.checkpoint``) has ``manifest.json`` (size + sha256 of every other file)
    and a ``COMPLETE`` marker recording the manifest's sha256. A manifest that is missing where the marker records
    one is damage, as are a manifest that does not match the marker, a listed file that is missing, of another
    size or (``checksums``) of another sha256, and a listed name that is not a file of the folder (``../x``, an
    absolute path: nothing outside the folder is read). A folder with neither (a released drafter, a checkpoint from before
    manifests) has nothing to check against: None."""
    mk, mf = os.path.join(path, MARKER), os.path.join(path, MANIFEST)
    marker = None
    if os.path.isfile(mk):
        try:
            with open(mk) as f:
                marker = json.load(f)
        except (OSError, ValueError) as e:
            if os.path.isfile(mf):
                return f"unreadable {MARKER} marker ({e})"
        if not isinstance(marker, dict):
            marker = None
    if not os.path.isfile(mf):
        if marker is not None and marker.get("manifest_sha256"):
            return (f"{MANIFEST} is missing, but the {MARKER} marker records its sha256 (it was deleted after the "
                    f"checkpoint was written): the files cannot be verified")
        return None
    try:
        with open(mf) as f:
            files = json.load(f)["files"]
        items = [(str(n), int(m["bytes"]), str(m["sha256"])) for n, m in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__}: {e})"
    if checksums and marker is not None and marker.get("manifest_sha256") not in (None, sha256_file(mf)):
        return f"{MANIFEST} does not match the checksum in {MARKER}"
    for name, nbytes, digest in items:
        if name in ("", ".", "..") or os.path.basename(name) != name:  # "../x", "/etc/x", "a/b": never read
            return f"{MANIFEST} lists {name!r}, which is not a file of this folder (a manifest lists its own files)"
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return f"{name} is missing"
        size = os.path.getsize(p)
        if size != nbytes:
            return f"{name} has {size} bytes, the manifest says {nbytes} (truncated or overwritten)"
        if checksums and sha256_file(p) != digest:
            return f"{name} does not match its sha256 in the manifest (corrupted)"
    return None


def check_folder(path: str, what: str = "drafter folder") -> None:
    """``verify_folder`` with checksums; a ``DamagedFolderError`` naming the folder and what is wrong."""
    why = verify_folder(path)
    if why is not None:
        raise DamagedFolderError(f"{what} {path} is damaged: {why}. It cannot be used: give another checkpoint "
                                 f"(an earlier <output_dir>/checkpoints/step-N) or train again")


# ------------------------------------------------------------------------------------------- safetensors
def stabilize_safetensors(path: str) -> None:
    """Rewrite a safetensors file's header in place with its ``__metadata__`` keys sorted, so the same tensors and
    metadata always give the same bytes (safetensors writes its metadata map in a random order). The header keeps
    its length; tensor entries and offsets are unchanged."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        head = json.loads(raw)
        meta = head.pop("__metadata__", None)
        out = ({"__metadata__": dict(sorted(meta.items()))} if meta is not None else {})
        out.update(sorted(head.items()))
        text = json.dumps(out, separators=(",", ":")).encode()
        if len(text) > n:  # cannot happen (same entries, same separators); never write a longer header
            raise RuntimeError(f"{path}: the reordered safetensors header is longer than the original")
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


def save_safetensors(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file`` with a fixed header order (``stabilize_safetensors``): byte-reproducible;
    written to a fresh tmp file and renamed (``replacing_path``: never through a link at ``path``)."""
    with replacing_path(path) as tmp:
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        stabilize_safetensors(tmp)


def load_safetensors(fp: str) -> dict:
    """``safetensors.torch.load_file``; a ``DamagedFolderError`` naming the file when it cannot be read."""
    try:
        return safetensors.torch.load_file(fp)
    except (SafetensorError, OSError) as e:
        raise DamagedFolderError(f"{fp} is not a readable safetensors file (truncated or damaged?): "
                                 f"{type(e).__name__}: {e}. Give another drafter folder or export / train again") from None


# ------------------------------------------------------------------------------------------- reading


def read_json(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter folder {path!r} does not exist")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a drafter folder ({DRAFTER_FOLDER})")
    try:
        raw = json.loads(read_text(cfg_path, "drafter config"))
    except json.JSONDecodeError as e:
        raise NotADrafterError(path, f"its config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise NotADrafterError(path, f"its config.json holds a {type(raw).__name__}, not a JSON object")
    return raw


def is_released(raw: dict) -> bool:
    return "dflash_config" in raw or any(a in KIND_OF_ARCH for a in raw.get("architectures") or [])


def read_weights(path: str) -> dict:
    """All tensors of a folder: ``model.safetensors``, or the shards listed by ``model.safetensors.index.json``,
    or (neither) every ``*.safetensors`` file in it."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                wmap = json.load(f).get("weight_map") or {}
        except (ValueError, AttributeError) as e:
            raise DamagedFolderError(f"{index} is not a valid safetensors index ({e})") from None
        files = [os.path.join(path, s) for s in sorted(set(wmap.values()))]
        missing = [s for s in files if not os.path.isfile(s)]
        if missing:
            raise FileNotFoundError(f"{index} lists {os.path.basename(missing[0])}, which is not in {path!r}")
    else:
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path!r} has no safetensors weights (model.safetensors or an index)")
    sd = {}
    for fp in files:
        for k, v in load_safetensors(fp).items():
            if k in sd:
                raise ValueError(f"tensor {k!r} appears in two files of {path!r}")
            sd[k] = v
    return sd


def read_mask_file(path: str) -> Optional[tuple]:
    """-> (mask_token_id or None, vector [D]) from ``mask_embedding.pt``, or None when absent."""
    fp = os.path.join(path, MASK_FILE)
    if not os.path.isfile(fp):
        return None
    try:
        state = torch.load(fp, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (unpickling errors of a damaged file have no common class)
        raise DamagedFolderError(f"{fp} cannot be read ({type(e).__name__}: {e})") from None
    if isinstance(state, dict):
        return state.get("mask_token_id"), state["embedding"].reshape(-1)
    return None, state.reshape(-1)


JSON_TYPES = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", type(None): "null"}
TARGET_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")  # target_identity's


class ConfigFields:
    """Typed values of a drafter's config.json: each value that is not of its type is a ``DrafterFolderError``
    naming the file, the key and the type expected (never ``int()``'s "invalid literal")."""

    def __init__(self, raw: dict, path: str):
        self.raw, self.file = raw, os.path.join(path, "config.json")
        dc = raw.get("dflash_config")
        if dc is not None and not isinstance(dc, dict):
            raise DrafterFolderError(f"{self.file}: \"dflash_config\" is {JSON_TYPES.get(type(dc), type(dc).__name__)},"
                                     f" not an object; it holds the drafter's keys (mask_token_id, target_layer_ids, "
                                     f"...)")
        self.dc = dc or {}

    def key(self, name: str, nested: bool = True) -> str:
        """Where ``name`` is read: ``dflash_config.name`` (released drafters' keys, read there first as z-lab's
        ``_draft_value`` does) or the top level."""
        return f"dflash_config.{name}" if nested and name in self.dc else name

    def value(self, name: str, default=None, nested: bool = True):
        return self.dc[name] if nested and name in self.dc else self.raw.get(name, default)

    def wrong(self, key: str, value, want: str) -> DrafterFolderError:
        got = JSON_TYPES.get(type(value), type(value).__name__)
        shown = json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)
        return DrafterFolderError(f"{self.file}: \"{key}\" is {shown} ({got}); it must be {want}. Correct it in "
                                  f"config.json (the value the drafter was built with) or give another drafter folder")

    def typed(self, key: str, value, typ):
        """``value`` (of ``key``) as ``typ``: int (a JSON integer; 2.0 is 2), float (a finite number) or bool."""
        if typ is bool:
            if not isinstance(value, bool):
                raise self.wrong(key, value, "true or false")
            return value
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if typ is int and not (ok and float(value).is_integer()):
            raise self.wrong(key, value, "an integer (a JSON number without quotes)")
        if not ok:
            raise self.wrong(key, value, "a finite number (a JSON number without quotes)")
        return typ(value)

    def get(self, name: str, typ, default=None, nested: bool = True):
        """The field ``name`` as ``typ``.

        Args:
            name: the key (in dflash_config first when ``nested``, then at the top level).
            typ: int, float or bool (``typed``).
            default: when the key is absent or null.
            nested: whether dflash_config may hold it.
        """
        v = self.value(name, None, nested)
        return default if v is None else self.typed(self.key(name, nested), v, typ)

    def need(self, name: str, typ, nested: bool = False):
        """A required field (a ``KeyError`` naming it when absent: ``read_config`` words it)."""
        if (name not in self.dc or not nested) and name not in self.raw:
            raise KeyError(name)
        return self.typed(self.key(name, nested), self.value(name, None, nested), typ)

    def ints(self, key: str, value) -> tuple:
        """A list of integers (target layer ids)."""
        if not isinstance(value, (list, tuple)):
            raise self.wrong(key, value, "a list of integers (target layer ids)")
        return tuple(self.typed(f"{key}[{i}]", v, int) for i, v in enumerate(value))

    def target(self, key: str, value) -> dict:
        """The target identity recorded with a drafter (``target_identity``), its sizes typed."""
        if not isinstance(value, dict):
            raise self.wrong(key, value, "an object (the target's model_type, vocab_size, hidden_size, ...)")
        return {k: self.typed(f"{key}.{k}", v, int) if k in TARGET_SIZES else v for k, v in value.items()}


def config_from_released(raw: dict, path: str, target_layers: Optional[int] = None) -> DrafterConfig:
    """A released config.json -> DrafterConfig (refuses the features we do not implement, naming them)."""
    f = ConfigFields(raw, path)
    archs = raw.get("architectures") or []
    kinds = [KIND_OF_ARCH[a] for a in archs if a in KIND_OF_ARCH]
    if not kinds:
        raise ValueError(f"{path}/config.json: architectures {archs} is not DFlashDraftModel / DSparkDraftModel / "
                         f"DFlash2DraftModel")
    kind = kinds[0]
    if kind == "eagle3":
        return eagle3_config_from_released(raw, path, f, target_layers)
    if raw.get("model_type") not in ("qwen3", "dspark"):
        raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r}: released DFlash / DSpark drafters "
                         f"are Qwen3 decoder layers (model_type 'qwen3'); other drafter architectures are not supported")
    unsupported = []
    if raw.get("attention_bias"):
        unsupported.append("attention_bias=true")
    if any(t != "full_attention" for t in raw.get("layer_types") or []) or f.value("use_swa"):
        unsupported.append("sliding_attention layers")
    if raw.get("is_causal") or f.value("causal"):
        unsupported.append("causal draft attention")
    if kind != "dflash2":  # V2's own keys (vLLM reads them for DFlash2DraftModel only)
        for name in ("input_embedding_scale", "output_multiplier"):
            if (f.get(name, float, 1.0) or 1.0) != 1.0:
                unsupported.append(f"{name}={f.value(name)}")
        if f.get("final_logit_softcapping", float):
            unsupported.append("final_logit_softcapping")
    else:
        missing = [k for k in V2_REQUIRED if f.value(k) is None]
        if missing:
            raise ValueError(f"{path}/config.json: a DFlash2DraftModel needs dflash_config {missing} (vLLM reads "
                             f"them without defaults)")
    if kind == "dspark" and str(f.value("markov_head_type", "vanilla")).lower() != "vanilla":
        unsupported.append(f"markov_head_type={f.value('markov_head_type')!r}")
    if f.value("use_aux_hidden_state", True) is False:
        unsupported.append("use_aux_hidden_state=false")
    ths = f.get("target_hidden_size", int, nested=False)
    if ths is not None and ths != f.need("hidden_size", int):
        unsupported.append(f"target_hidden_size={ths} != hidden_size={raw['hidden_size']}")
    if unsupported:
        raise ValueError(f"{path}/config.json uses {', '.join(unsupported)}, which SpecOPD's DFlash does not implement")
    n, hidden = f.need("num_hidden_layers", int), f.need("hidden_size", int)
    ntl = f.get("num_target_layers", int, target_layers, nested=False)
    ids = f.value("target_layer_ids")
    if ids is None:
        if ntl is None:
            raise ValueError(f"{path}/config.json has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(ntl, n)
    ids = f.ints(f.key("target_layer_ids"), ids)
    heads = f.need("num_attention_heads", int)
    rank = f.get("markov_rank", int, 256) or 0
    if kind == "dspark" and rank < 1:
        raise ValueError(f"{path}/config.json: a DSpark drafter without a Markov head (markov_rank {rank}) is a "
                         f"DFlash drafter; set architectures to DFlashDraftModel")
    conf_alpha = f.get("confidence_head_alpha", float, 0.0) or 0.0
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise f.wrong("rope_scaling", rope_scaling, "an object or null")
    spec = raw.get("specopd") or {}
    rope = raw.get("rope_parameters") if "rope_theta" not in raw else None
    rope = rope if isinstance(rope, dict) else {}
    v2 = {}
    if kind == "dflash2":
        v2 = dict({k: f.get(k, int) for k in V2_REQUIRED},
                  input_embedding_scale=f.get("input_embedding_scale", float, 1.0) or 1.0,
                  output_multiplier=f.get("output_multiplier", float, 1.0) or 1.0,
                  final_logit_softcapping=f.get("final_logit_softcapping", float, 0.0) or 0.0)
    target = (f.target("specopd.target", spec["target"]) if isinstance(spec, dict) and spec.get("target") else
              {"vocab_size": f.need("vocab_size", int), "hidden_size": hidden,
               **({"num_hidden_layers": ntl} if ntl is not None else {})})
    return DRAFTERS[kind].config_class(**v2,
        kind=kind, num_layers=n, block_size=f.get("block_size", int, 16),
        feature_layers=ids, hidden_size=hidden, num_heads=heads,
        num_kv_heads=f.get("num_key_value_heads", int, heads, nested=False),
        head_dim=f.get("head_dim", int, hidden // max(heads, 1), nested=False),
        intermediate_size=f.need("intermediate_size", int), rms_norm_eps=f.get("rms_norm_eps", float, 1e-6, False),
        rope_theta=(f.get("rope_theta", float, 10000.0, False) if not rope else
                    f.typed("rope_parameters.rope_theta", rope.get("rope_theta", 10000.0), float)),
        rope_scaling=dict(rope_scaling) if rope_scaling else None, hidden_act=str(raw.get("hidden_act", "silu")),
        mask_token_id=f.get("mask_token_id", int), learned_mask=False,
        markov_rank=rank if kind == "dspark" else 256,
        confidence_head=f.get("enable_confidence_head", bool, conf_alpha > 0),
        confidence_with_markov=f.get("confidence_head_with_markov", bool, False), target=target)


FIELD_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "tuple": tuple}


def config_from_ours(raw: dict, path: str) -> DrafterConfig:
    """Our config.json -> DrafterConfig, each field of its type (refuses v0.1 folders, whose block_size and head
    differ)."""
    f = ConfigFields(raw, path)
    if f.get("format", int, 1, nested=False) != FORMAT:
        raise ValueError(f"{path}/config.json was written by SpecOPD v0.1 (block_size counted drafted tokens only, "
                         f"learned mask vector, the target's final norm before lm_head): that drafter computes "
                         f"something else and cannot be loaded; train it again")
    cls = DRAFTERS[raw["kind"]].config_class
    fields = dataclasses.fields(cls)
    missing = [fl.name for fl in fields if fl.name not in raw and fl.default is dataclasses.MISSING
               and fl.default_factory is dataclasses.MISSING]
    if missing:
        raise NotADrafterError(path, f"its config.json has \"kind\": {raw.get('kind')!r} but lacks {missing}")
    values = {fl.name: raw[fl.name] for fl in fields if fl.name in raw}
    for fl in fields:  # each field of its declared type (DrafterConfig's annotations)
        optional = fl.type.startswith("Optional[")
        typ, v = FIELD_TYPES.get(fl.type[9:-1] if optional else fl.type), values.get(fl.name)
        if typ is None or fl.name not in values or (v is None and optional):
            continue
        if typ is tuple:
            values[fl.name] = f.ints(fl.name, v)
        elif typ in (str, dict) and not isinstance(v, typ):
            raise f.wrong(fl.name, v, ("a string" if typ is str else "an object") + (" or null" if optional else ""))
        elif typ not in (str, dict):
            values[fl.name] = f.typed(fl.name, v, typ)
    if isinstance(values.get("target"), dict):
        values["target"] = f.target("target", values["target"])
    return cls(**values)


def read_config(path: str, target_layers: Optional[int] = None) -> tuple:
    """-> (DrafterConfig, released: bool) of a drafter folder (ours or released). A config.json that is not a
    drafter's (a target model's, a truncated one, anything else) raises ``NotADrafterError``."""
    raw = read_json(path)
    released = is_released(raw)
    if not released:
        kind = raw.get("kind")
        if kind is None:
            archs = raw.get("architectures")
            what = (f"its config.json is a model's (architectures {archs}, model_type {raw.get('model_type')!r}), "
                    f"not a drafter's: a target goes in model.target" if archs or "model_type" in raw else
                    "its config.json has no \"kind\" (SpecOPD drafter) and no dflash_config / DFlashDraftModel "
                    "architecture (released drafter)")
            raise NotADrafterError(path, what)
        if kind not in KINDS:
            raise NotADrafterError(path, f"its config.json has kind {kind!r}, not one of {sorted(KINDS)}")
    try:
        return (config_from_released(raw, path, target_layers), True) if released else (config_from_ours(raw, path),
                                                                                           False)
    except (KeyError, TypeError, AttributeError) as e:  # required fields missing or of the wrong type
        why = (f"its config.json lacks the field {e}" if isinstance(e, KeyError) else
               f"its config.json does not describe a drafter ({e})")
        raise NotADrafterError(path, why) from None


# ------------------------------------------------------------------------------------------- loading


def check_against_target(cfg: DrafterConfig, target, path: str, sd: Optional[dict] = None) -> None:
    """Errors that name each mismatch between a drafter folder and ``target`` with both values.

    Args:
        cfg: the folder's DrafterConfig.
        target: the TargetModel it is loaded for.
        path: the folder (named in the errors).
        sd: its state dict, to check the tensors' shapes too.

    Raises:
        DrafterFolderError (a ValueError) naming the mismatch.
    """
    have = target_identity(target)
    saved = cfg.target or {}
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocab size"),
                      ("num_hidden_layers", "number of target layers")):
        if key in saved and int(saved[key]) != have[key]:
            raise DrafterFolderError(f"{path}: {what} mismatch: the drafter was built for a target with "
                                     f"{key}={saved[key]}, this target has {key}={have[key]}; load it with the target "
                                     f"it was trained for")
    if cfg.hidden_size != have["hidden_size"]:
        raise DrafterFolderError(f"{path}: hidden size mismatch: drafter hidden_size={cfg.hidden_size}, target "
                                 f"hidden_size={have['hidden_size']}")
    bad = [i for i in cfg.feature_layers if not 0 <= int(i) < have["num_hidden_layers"]]
    if bad:
        raise DrafterFolderError(f"{path}: target_layer_ids {list(cfg.feature_layers)} are out of range for this "
                                 f"target ({have['num_hidden_layers']} layers: ids must be in "
                                 f"[0, {have['num_hidden_layers']}))")
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < have["vocab_size"]:
        raise DrafterFolderError(f"{path}: mask_token_id {cfg.mask_token_id} is outside the target's vocab "
                                 f"(vocab_size={have['vocab_size']})")
    if "model_type" in saved and saved["model_type"] != have["model_type"]:
        warnings.warn(f"{path}: the drafter was trained on a {saved['model_type']!r} target, this one is "
                      f"{have['model_type']!r}; continuing (sizes match)")
    if sd is None:
        return
    fc = sd.get("fc.weight")
    want = len(cfg.feature_layers) * have["hidden_size"]
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, want):
        raise DrafterFolderError(f"{path}: fc width mismatch: fc.weight is {list(fc.shape)}, but "
                                 f"{len(cfg.feature_layers)} target_layer_ids x target hidden {have['hidden_size']} "
                                 f"needs [{cfg.hidden_size}, {want}]")
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        t = sd.get(name)
        if t is not None and have["vocab_size"] not in t.shape:
            raise DrafterFolderError(f"{path}: vocab mismatch: {name} is {list(t.shape)}, the target's vocab_size "
                                     f"is {have['vocab_size']}")


@dataclasses.dataclass
class DrafterFolder:
    """A drafter folder as read (``read_drafter``): its config.json as written (``raw``) and as a DrafterConfig, its
    tensors under our names (a learned mask vector as ``mask_embedding``), and which layout it is in."""
    path: str
    raw: dict
    cfg: DrafterConfig
    sd: dict
    released: bool

    def key(self, field: str) -> str:
        """The config.json key that holds the DrafterConfig field ``field`` in this folder's layout."""
        if not self.released:
            return field
        name = RELEASED_KEYS.get(field, field)
        return ConfigFields(self.raw, self.path).key(name) if name in NESTED_KEYS else name

    def states_kind(self, kind: str) -> str:
        """How this folder's config.json states the drafter kind ``kind``."""
        return f"architectures [\"{ARCH[kind]}\"]" if self.released else f"\"kind\": \"{kind}\""


RELEASED_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads", "feature_layers": "target_layer_ids"}
NESTED_KEYS = {"block_size", "target_layer_ids", "mask_token_id", "markov_rank", *V2_KEYS}  # read from dflash_config
KIND_PARTS = {"dflash2": ("attention_conv", "mlp_conv", "candidate_selector"),
              "dspark": ("markov_head", "confidence_head")}  # the tensors only that kind has


def read_drafter(path: str, target_layers: Optional[int] = None, what: Optional[str] = None) -> DrafterFolder:
    """Read a drafter folder (ours or released), verified against its manifest first (``check_folder``, its
    errors naming the folder as ``what``, e.g. ``drafter.init_from``); a released folder's ``mask_embedding.pt``
    becomes the ``mask_embedding`` tensor. Nothing is checked against the config yet: ``check_drafter`` does."""
    if os.path.isdir(path):
        check_folder(path, what or ("checkpoint" if os.path.isfile(os.path.join(path, MARKER)) else "drafter folder"))
    cfg, released = read_config(path, target_layers)
    raw, sd = read_json(path), read_weights(path)
    if released:
        mask = read_mask_file(path)
        if mask is not None:  # a learned mask vector (ours, or e.g. MiMo's) replaces embed(mask_token_id)
            mid, vec = mask
            if mid is not None and cfg.mask_token_id is not None and int(mid) != cfg.mask_token_id:
                raise DrafterFolderError(f"{path}: {MASK_FILE} is for mask_token_id {mid}, config.json says "
                                         f"{cfg.mask_token_id}; give the {MASK_FILE} saved with this config.json")
            cfg.learned_mask = True
            sd["mask_embedding"] = vec
        for k in list(sd):  # early SpecForge checkpoints nest the DSpark heads under logit_head.
            if k.startswith("logit_head."):
                sd[k[len("logit_head."):]] = sd.pop(k)
            if cfg.kind == "eagle3" and k.startswith("midlayer."):  # SpecForge's one layer (vLLM maps it alike)
                sd["layers.0." + k[len("midlayer."):]] = sd.pop(k)
        if cfg.kind == "eagle3":  # without embed_tokens vLLM shares the target's
            cfg.own_embedding = "embed_tokens.weight" in sd
    return DrafterFolder(path, raw, cfg, sd, released)


def expected_tensors(cfg: DrafterConfig, ident: dict) -> dict:
    """name -> tensor (on the meta device: no memory, no init) of every tensor a drafter of ``cfg`` holds, for a
    target of ``ident`` (``target_identity``; needs hidden_size, vocab_size for DSpark / DFlash V2)."""
    shape = SimpleNamespace(model_type=ident.get("model_type", "?"), config={}, device=torch.device("meta"),
                            lm_head=None, hidden_size=cfg.hidden_size, vocab_size=ident.get("vocab_size") or 1 << 30,
                            num_layers=ident.get("num_hidden_layers") or max(cfg.feature_layers) + 1)
    with torch.device("meta"):
        return DRAFTERS[cfg.kind](shape, cfg, seed=None).state_dict()


def check_drafter(f: DrafterFolder, ident: Optional[dict] = None) -> None:
    """The one check of a drafter folder that ``specopd export`` (before writing a byte), ``eval.checkpoint`` and
    ``drafter.init_from`` (``load_drafter``) share: config.json's values in range (``config_problems`` of its
    kind), its tensors exactly those of a drafter of that config (names; V2 or DSpark tensors under another kind's
    config; shapes) and floating point (float32, bfloat16 or float16). A ``DrafterFolderError`` names the key or
    tensor and the fix.

    Args:
        f: the folder (``read_drafter``).
        ident: the target's ``target_identity`` (None: the one recorded in config.json).
    """
    cfg, where = f.cfg, os.path.join(f.path, "config.json")
    ident = dict(cfg.target or {}) if ident is None else ident
    bad = DRAFTERS[cfg.kind].config_problems(cfg, ident)
    if bad:
        raise DrafterFolderError(
            f"{where}: " + "; ".join(f"\"{f.key(k)}\" = {json.dumps(v)} is out of range ({rule})" for k, v, rule in bad)
            + ". Correct config.json (the values the drafter was trained with) or give another drafter folder")
    if cfg.kind != "dflash" and not ident.get("vocab_size"):
        raise DrafterFolderError(f"{where} does not record the target's vocab_size, which a {cfg.kind} drafter's "
                                 f"tensors depend on: add \"vocab_size\" (the target's) to config.json")
    try:
        want = expected_tensors(cfg, ident)
    except (ValueError, KeyError, TypeError) as e:  # e.g. an unsupported hidden_act or rope_scaling
        raise DrafterFolderError(f"{where}: a {cfg.kind} drafter cannot be built from it ({type(e).__name__}: "
                                 f"{e}); correct config.json or give another drafter folder") from None
    sd = f.sd
    own = [k for k in sd if k.split(".")[0] in ("embed_tokens", "lm_head", "model") or "embed_tokens" in k]
    if own and cfg.kind != "eagle3":
        raise DrafterFolderError(f"{f.path}: the folder ships its own {own[0]!r}; DFlash drafters share the "
                                 f"target's embedding and lm_head (drafters with their own are not supported)")
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        has = next((k for k, parts in KIND_PARTS.items() if any(p in n.split(".") for n in sd for p in parts)),
                   "dflash")
        if has != cfg.kind:
            theirs = [n for n in sd if any(p in n.split(".") for p in KIND_PARTS.get(has, ()))][:2]
            raise DrafterFolderError(
                f"{f.path}: the weights are a {has} drafter's (" + (f"{', '.join(theirs)}, ..." if theirs else
                                                                      f"without {', '.join(missing[:2])}, ...")
                + f"), but config.json describes "
                f"a {cfg.kind} drafter ({f.states_kind(cfg.kind)}): give the config.json saved with these weights "
                f"(it states {f.states_kind(has)}" + (f" and has the V2 keys {', '.join(V2_REQUIRED)}"
                                                      if has == "dflash2" and f.released else "") + ")")
        diff = [f"{what} {names[:5]}{'...' if len(names) > 5 else ''}" for what, names in
                (("missing", missing), ("unexpected", extra)) if names]
        raise DrafterFolderError(f"{f.path}: the weights do not match a {cfg.kind} drafter of its config.json: "
                                 f"{', '.join(diff)}; give the config.json saved with these weights, or another "
                                 f"drafter folder")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise DrafterFolderError(f"{f.path}: tensor {k!r} is {list(t.shape)}, but its config.json needs "
                                     f"{list(want[k].shape)}; the config.json and the weights are of different "
                                     f"drafters: give the config.json saved with these weights")
        if cfg.kind == "eagle3" and k in EAGLE3_INDEX:
            if t.dtype != want[k].dtype:
                raise DrafterFolderError(f"{f.path}: tensor {k!r} is stored as {str(t.dtype).replace('torch.', '')}, "
                                         f"EAGLE-3's {k} is {str(want[k].dtype).replace('torch.', '')} (SpecForge's "
                                         f"layout): give the folder as SpecForge wrote it")
        elif t.dtype not in DTYPES.values():
            raise DrafterFolderError(f"{f.path}: tensor {k!r} is stored as {str(t.dtype).replace('torch.', '')}, but "
                                     f"drafter weights are floating point ({', '.join(DTYPES)}); it is damaged or not "
                                     f"a drafter's weight: give another drafter folder (or export / train it again)")


def load_drafter(path: str, target, dtype: Optional[torch.dtype] = None):
    """A drafter from ``path`` (ours or the released layout) on ``target``'s device, parameters in ``dtype``
    (default float32: the training precision; bf16 weights convert exactly). A checkpoint folder is verified first
    against its manifest (``check_folder``): a damaged one raises ``DamagedFolderError``; then against the target
    (``check_against_target``) and as ``specopd export`` checks it (``check_drafter``)."""
    if is_mtp_folder(path):  # an MTP head: a qwen3_next / qwen3_5 target folder, or our MTP checkpoint / export
        drafter = build_mtp(target, path)
        return drafter if dtype is None else drafter.to(dtype)
    f = read_drafter(path, target_layers=int(target.num_layers))
    check_against_target(f.cfg, target, path, f.sd)
    check_drafter(f, target_identity(target))
    drafter = DRAFTERS[f.cfg.kind](target, f.cfg)
    hand_down(drafter, getattr(target, "kernel_paths", None))  # the target's kernels: section
    ours = drafter.state_dict()
    drafter.load_state_dict({k: v.to(device=target.device, dtype=ours[k].dtype) for k, v in f.sd.items()}, strict=True)
    if dtype is not None:
        drafter.to(dtype)
    return drafter


# ------------------------------------------------------------------------------------------- export


def released_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """DrafterConfig -> the released config.json (+ a ``specopd`` entry with what engines need not read)."""
    if cfg.kind == "eagle3":
        return eagle3_released_config(cfg, {v: k for k, v in DTYPES.items()}[dtype], FORMAT)
    t = cfg.target or {}
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [int(i) for i in cfg.feature_layers]}
    if cfg.kind == "dspark":
        dflash.update(attention_mode="gqa" if cfg.num_kv_heads < cfg.num_heads else "mha",
                      projector_type="dspark", markov_rank=int(cfg.markov_rank), markov_head_type="vanilla",
                      enable_confidence_head=bool(cfg.confidence_head),
                      confidence_head_with_markov=bool(cfg.confidence_with_markov))
    if cfg.kind == "dflash2":
        dflash.update({k: getattr(cfg, k) for k in V2_KEYS})
    out = {
        "architectures": [ARCH[cfg.kind]], **({"auto_map": {"AutoModel": AUTO_MAP[cfg.kind]}} if cfg.kind in AUTO_MAP
                                              else {}), "model_type": "qwen3",
        "block_size": int(cfg.block_size), "dflash_config": dflash,
        "num_target_layers": t.get("num_hidden_layers"),
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": int(t.get("max_position_embeddings") or 40960),
        "vocab_size": t.get("vocab_size"), "tie_word_embeddings": False, "attention_bias": False,
        "attention_dropout": 0.0, "layer_types": ["full_attention"] * cfg.num_layers,
        "max_window_layers": cfg.num_layers, "sliding_window": None, "use_sliding_window": False,
        "initializer_range": 0.02, "use_cache": True,
        "dtype": {v: k for k, v in DTYPES.items()}[dtype],
        "specopd": {"kind": cfg.kind, "format": FORMAT, "target": dict(t), "learned_mask": bool(cfg.learned_mask)},
    }
    return out


def _write_weights(out_dir: str, sd: dict, max_shard_bytes: int) -> list:
    """safetensors: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + the index when the
    weights exceed ``max_shard_bytes``. Returns the file names written."""
    total = sum(t.numel() * t.element_size() for t in sd.values())
    meta = {"format": "pt"}
    if total <= max_shard_bytes:
        save_safetensors(sd, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        nb = sd[k].numel() * sd[k].element_size()
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += nb
    shards.append(cur)
    names, wmap = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, os.path.join(out_dir, name), metadata=meta)
        names.append(name)
        wmap.update({k: name for k in shard})
    with open_write(os.path.join(out_dir, INDEX_FILE)) as f:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": wmap}, f, indent=2)
    return names + [INDEX_FILE]


def _drafter_file(name: str) -> bool:
    return name in ("config.json", INDEX_FILE, MASK_FILE) or name.endswith(".safetensors")


def write_released(out_dir: str, cfg: DrafterConfig, state_dict: dict, dtype: Optional[torch.dtype] = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> list:
    """Write a drafter in the released layout (config.json with dflash_config, safetensors shards, index,
    mask_embedding.pt); files are mode 0644.

    Args:
        out_dir: empty or new (``FolderNotEmptyError`` otherwise, unless ``force``).
        cfg: the drafter's DrafterConfig.
        state_dict: its weights under our names.
        dtype: weights dtype (default: as given).
        max_shard_bytes: split the weights into shards of this size.
        force: write into a folder holding other files, replacing its drafter files and keeping the rest.

    Returns:
        list of the files written.
    """
    sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    mask = sd.pop("mask_embedding", None)
    if (mask is not None) != bool(cfg.learned_mask):
        raise ValueError("state dict and config disagree on the learned mask vector")
    if dtype is None:
        dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    odd = [k for k, v in sd.items() if v.dtype not in DTYPES.values() and not (cfg.kind == "eagle3" and
                                                                                k in EAGLE3_INDEX)]
    if cfg.kind == "eagle3" and cfg.num_layers == 1:  # SpecForge's name of the one layer
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    if dtype not in DTYPES.values() or odd:  # checked before the first byte is written
        raise ValueError(f"the released layout holds {', '.join(DTYPES)} weights, not "
                         f"{sd[odd[0]].dtype if odd else dtype}{f' ({odd[0]})' if odd else ''}: give "
                         f"dtype=torch.float32 or another of them")
    config = released_config(cfg, dtype)
    have = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if have and not force:
        stale = [n for n in have if _drafter_file(n) and n != "config.json"]
        what = f"drafter weights ({stale[0]})" if stale else f"{len(have)} other file(s) ({', '.join(have[:3])})"
        raise FolderNotEmptyError(f"{out_dir!r} already holds {what}; export into an empty folder, or pass --force "
                                  f"(force=True) to replace its drafter files")
    make_dir(out_dir, "the export folder")
    for n in have:  # a link of such a name too: the link goes (never what it points at)
        p = os.path.join(out_dir, n)
        if _drafter_file(n) and (os.path.isfile(p) or os.path.islink(p)):
            os.remove(p)
    files = _write_weights(out_dir, sd, int(max_shard_bytes))
    if mask is not None:
        with open_write(os.path.join(out_dir, MASK_FILE), "wb") as f:
            torch.save({"mask_token_id": cfg.mask_token_id, "embedding": mask.to(dtype)}, f)
        files.append(MASK_FILE)
    with open_write(os.path.join(out_dir, "config.json")) as f:
        json.dump(config, f, indent=2)
    files = ["config.json"] + files
    for n in files:
        os.chmod(os.path.join(out_dir, n), 0o644)
    return files


def export_drafter(drafter, out_dir: str, dtype: Optional[torch.dtype] = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> str:
    """Write ``drafter`` in the released layout; ``load_drafter(out_dir, target)`` gives back the same weights
    (bit-exact when the dtype is kept).

    Args:
        drafter: a DFlashDrafter / DSparkDrafter.
        out_dir, dtype, max_shard_bytes, force: as ``write_released``.

    Returns:
        out_dir.
    """
    if drafter.kind == "mtp":
        return export_mtp(drafter, out_dir, dtype, force=force)
    write_released(out_dir, drafter.config, drafter.state_dict(), dtype, max_shard_bytes, force=force)
    return out_dir


def export_folder(src: str, out_dir: str, dtype: Optional[torch.dtype] = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> DrafterConfig:
    """Export a drafter folder (our checkpoint, or a released folder) without loading its target. The source is
    verified first (``check_folder``: a damaged checkpoint raises ``DamagedFolderError``), then checked as eval and
    ``drafter.init_from`` check what they load (``check_drafter``: ``DrafterFolderError``); nothing is written
    before both pass.

    Args:
        src: the drafter folder.
        out_dir, dtype, max_shard_bytes, force: as ``write_released``.

    Returns:
        the exported DrafterConfig.
    """
    f = read_drafter(src)
    check_drafter(f)
    write_released(out_dir, f.cfg, f.sd, dtype, max_shard_bytes, force=force)
    return f.cfg


def serving_commands(out_dir: str, cfg: DrafterConfig, target_path: Optional[str] = None) -> list:
    """The vLLM and SGLang command lines that serve ``target_path`` with the exported drafter."""
    tgt = target_path or "<TARGET_MODEL_DIR>"
    if cfg.kind == "eagle3":
        spec = json.dumps({"method": "eagle3", "model": os.path.abspath(out_dir),
                           "num_speculative_tokens": cfg.draft_len})
        return [f"vllm serve {tgt} --speculative-config '{spec}'",
                f"python -m sglang.launch_server --model-path {tgt} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {os.path.abspath(out_dir)} --speculative-num-steps {cfg.draft_len} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {cfg.block_size}"]
    spec = json.dumps({"method": "dflash", "model": os.path.abspath(out_dir), "num_speculative_tokens": cfg.draft_len})
    return [f"vllm serve {tgt} --speculative-config '{spec}'",
            f"python -m sglang.launch_server --model-path {tgt} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {os.path.abspath(out_dir)} --speculative-num-draft-tokens {cfg.block_size}"]


def describe_export(src: str, out_dir: str, cfg: DrafterConfig, target_path: Optional[str] = None) -> str:
    """What ``specopd export`` (and the main job) print after an export: what was written, the learned-mask and
    DSpark notes, and the vLLM / SGLang commands that serve it (``serving_commands``).

    Args:
        src: the exported folder's source.
        out_dir: the export.
        cfg: its DrafterConfig.
        target_path: the target for the printed commands (None: a placeholder).

    Returns:
        the text to print.
    """
    lines = [f"exported the {cfg.kind} drafter of {src} to {out_dir} (released layout: block_size {cfg.block_size} "
             f"= anchor + {cfg.draft_len} drafted tokens, target_layer_ids {list(cfg.feature_layers)}, "
             f"mask_token_id {cfg.mask_token_id})"]
    if cfg.kind == "eagle3":
        lines = [f"exported the eagle3 drafter of {src} to {out_dir} ({eagle3_arch(cfg)}: "
                 f"{cfg.draft_len} steps, eagle_aux_hidden_state_layer_ids {[i + 1 for i in cfg.feature_layers]}, "
                 f"draft vocabulary {cfg.draft_vocab_size or 'the whole target vocabulary'})"]
    if cfg.learned_mask:
        lines.append(f"note: this target has no spare token id, so the drafter learned its mask vector "
                     f"({out_dir}/{MASK_FILE}); vLLM substitutes it for embed_tokens[{cfg.mask_token_id}]")
    if cfg.kind == "dspark":
        lines.append("note: DSpark's Markov / confidence heads need an engine that implements DSparkDraftModel; "
                     "the commands below are the DFlash ones")
    if cfg.kind == "dflash2":
        lines.append(f"note: vLLM drafts with DFlash2DraftModel only in its GPU model runner (not the CPU build); its "
                     f"convolution's block is 1 + num_speculative_tokens, so serve it with num_speculative_tokens "
                     f"{cfg.draft_len} (the block it was trained on)")
    vllm, sglang = serving_commands(out_dir, cfg, target_path)
    lines += ["", "serve it with vLLM:", "  " + vllm, "or SGLang:", "  " + sglang]
    return "\n".join(lines)
