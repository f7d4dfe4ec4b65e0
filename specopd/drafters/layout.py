"""Drafter folders: our checkpoints and the released layout (z-lab DFlash / SpecForge DSpark / vLLM's DFlash V2)
that vLLM and SGLang load. Both layouts: specopd/drafters/DESIGN.md ("Drafter folders").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import warnings
from typing import Optional

import safetensors.torch
import torch
from safetensors import SafetensorError

from specopd.drafters.build import DRAFTERS
from specopd.drafters.dflash import FORMAT, DrafterConfig, default_target_layer_ids, target_identity
from specopd.drafters.dflash2 import V2_KEYS
from specopd.errors import DamagedFolderError, FolderNotEmptyError, make_dir, read_text

ARCH = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}
KINDS = tuple(ARCH)
KIND_OF_ARCH = {v: k for k, v in ARCH.items()}
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

    A checkpoint folder (``specopd.train.checkpoint``) has ``manifest.json`` (size + sha256 of every other file)
    and a ``COMPLETE`` marker recording the manifest's sha256. A manifest that is missing where the marker records
    one is damage, as are a manifest that does not match the marker, a listed file that is missing, of another
    size or (``checksums``) of another sha256. A folder with neither (a released drafter, a checkpoint from before
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
    """``safetensors.torch.save_file`` with a fixed header order (``stabilize_safetensors``): byte-reproducible."""
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    stabilize_safetensors(path)


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


def _get(raw: dict, name: str, default=None):
    """A field from dflash_config first, then the top level (as z-lab's ``_draft_value``)."""
    dc = raw.get("dflash_config") or {}
    return dc[name] if name in dc else raw.get(name, default)


def config_from_released(raw: dict, path: str, target_layers: Optional[int] = None) -> DrafterConfig:
    """A released config.json -> DrafterConfig (refuses the features we do not implement, naming them)."""
    archs = raw.get("architectures") or []
    kinds = [KIND_OF_ARCH[a] for a in archs if a in KIND_OF_ARCH]
    if not kinds:
        raise ValueError(f"{path}/config.json: architectures {archs} is not DFlashDraftModel / DSparkDraftModel / "
                         f"DFlash2DraftModel")
    kind = kinds[0]
    if raw.get("model_type") not in ("qwen3", "dspark"):
        raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r}: released DFlash / DSpark drafters "
                         f"are Qwen3 decoder layers (model_type 'qwen3'); other drafter architectures are not supported")
    unsupported = []
    if raw.get("attention_bias"):
        unsupported.append("attention_bias=true")
    if any(t != "full_attention" for t in raw.get("layer_types") or []) or _get(raw, "use_swa"):
        unsupported.append("sliding_attention layers")
    if raw.get("is_causal") or _get(raw, "causal"):
        unsupported.append("causal draft attention")
    if kind != "dflash2":  # V2's own keys (vLLM reads them for DFlash2DraftModel only)
        for name in ("input_embedding_scale", "output_multiplier"):
            if float(_get(raw, name, 1.0) or 1.0) != 1.0:
                unsupported.append(f"{name}={_get(raw, name)}")
        if _get(raw, "final_logit_softcapping"):
            unsupported.append("final_logit_softcapping")
    else:
        missing = [k for k in V2_REQUIRED if _get(raw, k) is None]
        if missing:
            raise ValueError(f"{path}/config.json: a DFlash2DraftModel needs dflash_config {missing} (vLLM reads "
                             f"them without defaults)")
    if kind == "dspark" and str(_get(raw, "markov_head_type", "vanilla")).lower() != "vanilla":
        unsupported.append(f"markov_head_type={_get(raw, 'markov_head_type')!r}")
    if _get(raw, "use_aux_hidden_state", True) is False:
        unsupported.append("use_aux_hidden_state=false")
    ths = raw.get("target_hidden_size")
    if ths is not None and int(ths) != int(raw["hidden_size"]):
        unsupported.append(f"target_hidden_size={ths} != hidden_size={raw['hidden_size']}")
    if unsupported:
        raise ValueError(f"{path}/config.json uses {', '.join(unsupported)}, which SpecOPD's DFlash does not implement")
    n = int(raw["num_hidden_layers"])
    ntl = raw.get("num_target_layers", target_layers)
    ids = _get(raw, "target_layer_ids")
    if ids is None:
        if ntl is None:
            raise ValueError(f"{path}/config.json has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(int(ntl), n)
    heads = int(raw["num_attention_heads"])
    rank = int(_get(raw, "markov_rank", 256) or 0)
    if kind == "dspark" and rank < 1:
        raise ValueError(f"{path}/config.json: a DSpark drafter without a Markov head (markov_rank {rank}) is a "
                         f"DFlash drafter; set architectures to DFlashDraftModel")
    conf_alpha = float(_get(raw, "confidence_head_alpha", 0.0) or 0.0)
    rope_scaling = raw.get("rope_scaling")
    spec = raw.get("specopd") or {}
    mask_id = _get(raw, "mask_token_id")
    v2 = {}
    if kind == "dflash2":
        v2 = dict(conv_kernel_size=int(_get(raw, "conv_kernel_size")),
                  conv_group_size=int(_get(raw, "conv_group_size")),
                  selector_rank=int(_get(raw, "selector_rank")), selector_top_k=int(_get(raw, "selector_top_k")),
                  input_embedding_scale=float(_get(raw, "input_embedding_scale", 1.0) or 1.0),
                  output_multiplier=float(_get(raw, "output_multiplier", 1.0) or 1.0),
                  final_logit_softcapping=float(_get(raw, "final_logit_softcapping", 0.0) or 0.0))
    return DRAFTERS[kind].config_class(**v2,
        kind=kind, num_layers=n, block_size=int(_get(raw, "block_size", 16)),
        feature_layers=tuple(int(i) for i in ids), hidden_size=int(raw["hidden_size"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=dict(rope_scaling) if rope_scaling else None, hidden_act=str(raw.get("hidden_act", "silu")),
        mask_token_id=None if mask_id is None else int(mask_id), learned_mask=False,
        markov_rank=rank if kind == "dspark" else 256,
        confidence_head=bool(_get(raw, "enable_confidence_head", conf_alpha > 0)),
        confidence_with_markov=bool(_get(raw, "confidence_head_with_markov", False)),
        target=dict(spec.get("target") or {"vocab_size": int(raw["vocab_size"]), "hidden_size": int(raw["hidden_size"]),
                                           **({"num_hidden_layers": int(ntl)} if ntl is not None else {})}))


def config_from_ours(raw: dict, path: str) -> DrafterConfig:
    """Our config.json -> DrafterConfig (refuses v0.1 folders, whose block_size and head differ)."""
    if int(raw.get("format", 1)) != FORMAT:
        raise ValueError(f"{path}/config.json was written by SpecOPD v0.1 (block_size counted drafted tokens only, "
                         f"learned mask vector, the target's final norm before lm_head): that drafter computes "
                         f"something else and cannot be loaded; train it again")
    cls = DRAFTERS[raw["kind"]].config_class
    fields = dataclasses.fields(cls)
    missing = [fl.name for fl in fields if fl.name not in raw and fl.default is dataclasses.MISSING
               and fl.default_factory is dataclasses.MISSING]
    if missing:
        raise NotADrafterError(path, f"its config.json has \"kind\": {raw.get('kind')!r} but lacks {missing}")
    cfg = cls(**{k: v for k, v in raw.items() if k in {fl.name for fl in fields}})
    cfg.feature_layers = tuple(int(i) for i in cfg.feature_layers)
    return cfg


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
        ValueError naming the mismatch.
    """
    have = target_identity(target)
    saved = cfg.target or {}
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocab size"),
                      ("num_hidden_layers", "number of target layers")):
        if key in saved and int(saved[key]) != have[key]:
            raise ValueError(f"{path}: {what} mismatch: the drafter was built for a target with {key}={saved[key]}, "
                             f"this target has {key}={have[key]}; load it with the target it was trained for")
    if cfg.hidden_size != have["hidden_size"]:
        raise ValueError(f"{path}: hidden size mismatch: drafter hidden_size={cfg.hidden_size}, target "
                         f"hidden_size={have['hidden_size']}")
    bad = [i for i in cfg.feature_layers if not 0 <= int(i) < have["num_hidden_layers"]]
    if bad:
        raise ValueError(f"{path}: target_layer_ids {list(cfg.feature_layers)} are out of range for this target "
                         f"({have['num_hidden_layers']} layers: ids must be in [0, {have['num_hidden_layers']}))")
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < have["vocab_size"]:
        raise ValueError(f"{path}: mask_token_id {cfg.mask_token_id} is outside the target's vocab "
                         f"(vocab_size={have['vocab_size']})")
    if "model_type" in saved and saved["model_type"] != have["model_type"]:
        warnings.warn(f"{path}: the drafter was trained on a {saved['model_type']!r} target, this one is "
                      f"{have['model_type']!r}; continuing (sizes match)")
    if sd is None:
        return
    fc = sd.get("fc.weight")
    want = len(cfg.feature_layers) * have["hidden_size"]
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, want):
        raise ValueError(f"{path}: fc width mismatch: fc.weight is {list(fc.shape)}, but {len(cfg.feature_layers)} "
                         f"target_layer_ids x target hidden {have['hidden_size']} needs [{cfg.hidden_size}, {want}]")
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        t = sd.get(name)
        if t is not None and have["vocab_size"] not in t.shape:
            raise ValueError(f"{path}: vocab mismatch: {name} is {list(t.shape)}, the target's vocab_size is "
                             f"{have['vocab_size']}")
    own = [k for k in sd if k.split(".")[0] in ("embed_tokens", "lm_head", "model") or "embed_tokens" in k]
    if own:
        raise ValueError(f"{path}: the folder ships its own {own[0]!r}; DFlash drafters share the target's "
                         f"embedding and lm_head (drafters with their own are not supported)")


def load_drafter(path: str, target, dtype: Optional[torch.dtype] = None):
    """A drafter from ``path`` (ours or the released layout) on ``target``'s device, parameters in ``dtype``
    (default float32: the training precision; bf16 weights convert exactly). A checkpoint folder is verified first
    against its manifest (``check_folder``): a damaged one raises ``DamagedFolderError``."""
    if os.path.isdir(path):
        check_folder(path, "checkpoint" if os.path.isfile(os.path.join(path, MARKER)) else "drafter folder")
    cfg, released = read_config(path, target_layers=int(target.num_layers))
    sd = read_weights(path)
    mask = read_mask_file(path)
    if released:
        spec = read_json(path).get("specopd") or {}
        if mask is not None:  # a learned mask vector (ours, or e.g. MiMo's) replaces embed(mask_token_id)
            mid, vec = mask
            if mid is not None and cfg.mask_token_id is not None and int(mid) != cfg.mask_token_id:
                raise ValueError(f"{path}: {MASK_FILE} is for mask_token_id {mid}, config.json says {cfg.mask_token_id}")
            cfg.learned_mask = True
            sd["mask_embedding"] = vec
        if "target" in spec:
            cfg.target = dict(spec["target"])
        for k in list(sd):  # early SpecForge checkpoints nest the DSpark heads under logit_head.
            if k.startswith("logit_head."):
                sd[k[len("logit_head."):]] = sd.pop(k)
    check_against_target(cfg, target, path, sd)
    if cfg.mask_token_id is None and not cfg.learned_mask:
        raise ValueError(f"{path}: no dflash_config.mask_token_id and no {MASK_FILE}: the masked slots are undefined")
    drafter = DRAFTERS[cfg.kind](target, cfg)
    ours = drafter.state_dict()
    missing, extra = sorted(set(ours) - set(sd)), sorted(set(sd) - set(ours))
    if missing or extra:
        raise ValueError(f"{path}: weights do not match a {cfg.kind} drafter with this config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(ours[k].shape):
            raise ValueError(f"{path}: tensor {k} is {list(t.shape)}, the config needs {list(ours[k].shape)}")
    drafter.load_state_dict({k: v.to(device=target.device, dtype=ours[k].dtype) for k, v in sd.items()}, strict=True)
    if dtype is not None:
        drafter.to(dtype)
    return drafter


# ------------------------------------------------------------------------------------------- export


def released_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """DrafterConfig -> the released config.json (+ a ``specopd`` entry with what engines need not read)."""
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
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
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
        dtype = next(iter(sd.values())).dtype
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    have = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if have and not force:
        stale = [n for n in have if _drafter_file(n) and n != "config.json"]
        what = f"drafter weights ({stale[0]})" if stale else f"{len(have)} other file(s) ({', '.join(have[:3])})"
        raise FolderNotEmptyError(f"{out_dir!r} already holds {what}; export into an empty folder, or pass --force "
                                  f"(force=True) to replace its drafter files")
    make_dir(out_dir, "the export folder")
    for n in have:
        if _drafter_file(n) and os.path.isfile(os.path.join(out_dir, n)):
            os.remove(os.path.join(out_dir, n))
    files = _write_weights(out_dir, sd, int(max_shard_bytes))
    if mask is not None:
        torch.save({"mask_token_id": cfg.mask_token_id, "embedding": mask.to(dtype)}, os.path.join(out_dir, MASK_FILE))
        files.append(MASK_FILE)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(released_config(cfg, dtype), f, indent=2)
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
    write_released(out_dir, drafter.config, drafter.state_dict(), dtype, max_shard_bytes, force=force)
    return out_dir


def export_folder(src: str, out_dir: str, dtype: Optional[torch.dtype] = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> DrafterConfig:
    """Export a drafter folder (our checkpoint, or a released folder) without loading its target. The source is
    verified first (``check_folder``: a damaged checkpoint raises ``DamagedFolderError``).

    Args:
        src: the drafter folder.
        out_dir, dtype, max_shard_bytes, force: as ``write_released``.

    Returns:
        the exported DrafterConfig.
    """
    check_folder(src, "checkpoint" if os.path.isfile(os.path.join(src, MARKER)) else "drafter folder")
    cfg, released = read_config(src)
    sd = read_weights(src)
    if released:
        mask = read_mask_file(src)
        if mask is not None:
            cfg.learned_mask = True
            sd["mask_embedding"] = mask[1]
    write_released(out_dir, cfg, sd, dtype, max_shard_bytes, force=force)
    return cfg


def serving_commands(out_dir: str, cfg: DrafterConfig, target_path: Optional[str] = None) -> list:
    """The vLLM and SGLang command lines that serve ``target_path`` with the exported drafter."""
    tgt = target_path or "<TARGET_MODEL_DIR>"
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
