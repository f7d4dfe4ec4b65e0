"""Load a target from a Hugging Face folder: ``config.json`` + ``model.safetensors`` (or a sharded
``model.safetensors.index.json``). No silent random init: every parameter must come from the checkpoint."""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specopd_executors.base import check_kernels
from specopd_kernels import cpu_features
from specopd.errors import BadInputError
from specopd.settings import RecipeError
from specopd.models.common import hand_down
from specopd.models.registry import MODEL_TYPES
from specopd.models.tensor_parallel import shard_target

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")


def check_device_dtype(device, dtype: torch.dtype) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} requested but CUDA is not available here; use device='cpu'")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError("this GPU cannot do bfloat16; use dtype=torch.float16 or torch.float32")
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {device}; use 'cpu' or 'cuda'")
    return device


def check_device(cfg) -> None:
    """Whether this machine runs the target as the recipe ``cfg`` asks, before any work. model.device=cuda on a
    machine whose torch sees no CUDA device: a RecipeError (Ray clusters given by runtime.address are not checked
    here: their workers may have GPUs the driver lacks). A bf16 target on a CPU without native bf16 matmuls: a
    warning that names the fix."""
    if cfg.runtime.address is not None:
        return
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError(f"model.device=cuda, but torch sees no CUDA device on this machine (torch "
                          f"{torch.__version__}, torch.cuda.is_available() is False): use model.device=cpu, or "
                          f"model.device=auto (cuda when available)")
    on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
    if on_cpu and cfg.model.dtype == "bfloat16" and not cpu_features.cpu_bf16_native():
        warnings.warn(f"model.dtype=bfloat16 on a CPU without AMX-BF16 or AVX512-BF16 (torch sees "
                      f"{torch.backends.cpu.get_cpu_capability()}): its bf16 matmuls are emulated, far slower than "
                      f"fp32; use model.dtype=auto (bfloat16 only where it is native) or float32", stacklevel=2)


def read_config(path: str) -> dict:
    """config.json as a flat dict of the *text* model (composite configs' ``text_config`` merged in)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"target folder {path!r} does not exist (give a Hugging Face model folder, "
                                f"or run `specopd prepare model smollm2-135m` for the CPU demo target)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: it is not a Hugging Face model folder")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        outer = {k: v for k, v in cfg.items() if k != "text_config"}
        cfg = {**outer, **cfg["text_config"], "_outer_model_type": outer.get("model_type")}
    return cfg


def read_state_dict(path: str) -> dict:
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        sd = {}
        for shard in sorted(set(weight_map.values())):
            fp = os.path.join(path, shard)
            if not os.path.isfile(fp):
                raise FileNotFoundError(f"shard {shard!r} named in {index} is missing")
            sd.update(load_file(fp))
        missing = set(weight_map) - set(sd)
        if missing:
            raise ValueError(f"tensors listed in the index but absent from the shards: {sorted(missing)[:5]}")
        return sd
    raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")


def safetensors_files(path: str) -> list:
    """The safetensors files of a folder: ``model.safetensors``, or the shards its index names."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return [os.path.join(path, "model.safetensors")]
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
    with open(index) as f:
        return [os.path.join(path, s) for s in sorted(set(json.load(f)["weight_map"].values()))]


def checkpoint_names(path: str) -> list:
    """The tensor names of the folder's safetensors (headers only)."""
    names = []
    for fp in safetensors_files(path):
        with safe_open(fp, framework="pt") as f:
            names += list(f.keys())
    return names


def read_selected(path: str, keep) -> dict:
    """The tensors of the folder whose names ``keep(name)`` accepts, reading only those (a large target's MTP head
    without its billions of other weights)."""
    out = {}
    for fp in safetensors_files(path):
        if not os.path.isfile(fp):
            raise FileNotFoundError(f"shard {fp!r} named in {path}/model.safetensors.index.json is missing")
        with safe_open(fp, framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    out[name] = f.get_tensor(name)
    return out


class NoMTPError(BadInputError):
    """A target folder without the ``mtp.*`` tensors a ``drafter.kind: mtp`` run needs."""


def load_mtp(path: str, target, dtype: Optional[torch.dtype] = None, device=None):
    """The checkpoint's own MTP module from the target folder ``path`` (its ``mtp.*`` tensors, which ``load_target``
    leaves out): ``target.build_mtp(n)`` with every weight from the folder, n = the number of ``mtp.layers.<i>`` in
    the folder, which the layer count its config.json names (if any: the released Qwen3-Next config names none) must
    equal.

    Args:
        path: the target folder (or an MTP export / checkpoint: the same names).
        target: the loaded target (its ``build_mtp``, ``mtp_key``, ``mtp_num_layers``).
        dtype: the weights' dtype (default the target's).
        device: where they go (default the target's).

    Returns:
        the MultiTokenPredictor, trainable. A folder without MTP tensors: ``NoMTPError``; tensors that do not fit
        the config: ``BadInputError`` naming the folder.
    """
    if not hasattr(target, "build_mtp"):
        raise BadInputError(f"drafter.kind=mtp needs a target that ships an MTP head (qwen3_next, qwen3_5); "
                            f"{path} is a {getattr(target, 'model_type', '?')} target")
    raw = read_selected(path, lambda name: target.mtp_key(name) is not None)
    convert = getattr(type(target), "convert_checkpoint", None)
    if convert is not None:
        raw = convert(raw, None)
    sd = {target.mtp_key(k): v for k, v in raw.items()}
    if not sd:
        raise NoMTPError(f"{path}: no mtp.* tensors in its safetensors: this checkpoint ships no MTP head (give the "
                         f"original release's folder, or a folder exported by `specopd export` from an mtp run)")
    n = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("layers.")), default=0)
    named = target.mtp_num_layers(read_config(path))
    if named is not None and named != n:
        raise BadInputError(f"{path}/config.json names {named} MTP layer(s), its safetensors hold {n} "
                            f"(mtp.layers.0 .. mtp.layers.{n - 1}): fix the config's layer count")
    with torch.device("meta"):
        mtp = target.build_mtp(n)
    ours = dict(mtp.named_parameters())
    extra = sorted(set(sd) - set(ours))
    missing = sorted(set(ours) - set(sd))
    if extra or missing:
        raise BadInputError(f"{path}: its mtp.* tensors do not fit an MTP head of {n} layer(s) as config.json describes "
                            f"it: unexpected {['mtp.' + k for k in extra[:5]]}, missing {['mtp.' + k for k in missing[:5]]}")
    for k, t in sd.items():
        if not t.is_floating_point():
            raise BadInputError(f"{path}: tensor mtp.{k} is {t.dtype}, not a floating-point weight")
        if tuple(t.shape) != tuple(ours[k].shape):
            raise BadInputError(f"{path}: tensor mtp.{k} has shape {tuple(t.shape)}, expected {tuple(ours[k].shape)} "
                                f"from config.json")
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    device = target.device if device is None else torch.device(device)
    mtp.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=True, assign=True)
    return mtp


def load_target(path: str, dtype=torch.float32, device="cpu", config_overrides: Optional[dict] = None,
                kernels: str = "auto", tensor_parallel=None, kernel_paths=None):
    """Build our implementation of the checkpoint's ``model_type`` and load every weight.

    Args:
        path: a Hugging Face folder (config.json + safetensors, sharded index too).
        dtype: parameter dtype (fp32 parameters the model keeps, e.g. ``A_log``, stay fp32).
        device: where the weights go.
        config_overrides: keys replacing config.json's.
        kernels: "torch" (plain torch, exact, any device) | "triton" (``kernels/``: CUDA, or the CPU under
            ``TRITON_INTERPRET=1``) | "auto" (Triton and fla on CUDA, torch on the CPU); kept as ``target.kernels``.
        kernel_paths: the recipe's ``kernels:`` section (``KernelsConfig``; None: all "auto"), handed to the layers
            and executors (``specopd.models.common.hand_down``); kept as ``target.kernel_paths``.

    Returns:
        TargetModel in eval mode with ``requires_grad=False`` on all parameters.
    """
    dtype = resolve_dtype(dtype)
    device = check_device_dtype(device, dtype)
    check_kernels(kernels, device)
    cfg = read_config(path)
    cfg.update(config_overrides or {})
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {mt!r} in {path}/config.json; supported: {sorted(MODEL_TYPES)}")
    cls = MODEL_TYPES[mt]
    with torch.device("meta"):
        model = cls(cfg)
    sd = checkpoint_params(model, read_state_dict(path), cfg, path)
    if tensor_parallel is not None and tensor_parallel.size > 1:
        plan = shard_target(model, tensor_parallel)
        sd = {k: plan.shard(k, v) for k, v in sd.items()}
    return hand_down(place_weights(model, sd, dtype, device, kernels), kernel_paths)


def checkpoint_params(model, raw: dict, cfg: dict, where: str) -> dict:
    """A checkpoint's tensors (Hugging Face names) -> every parameter of ``model`` by our name: converted
    (``convert_checkpoint``), renamed (``checkpoint_key``), shapes checked, tied ones filled in.

    Args:
        model: the target (on any device, meta included): its parameters' names and unsharded shapes
            (``TargetModel.full_shapes``) are checked against.
        raw: tensor name -> tensor, as read from the checkpoint.
        cfg: the model's config dict (``read_config``).
        where: the checkpoint, named in errors.

    Returns:
        our parameter name -> tensor (dtypes as given). A tensor with no place, of another shape, or a parameter
    missing: ValueError naming it."""
    cls, mt = type(model), cfg.get("model_type")
    ours = model.full_shapes()
    convert = getattr(cls, "convert_checkpoint", None)  # optional: (raw dict, cfg) -> dict, e.g. fuse split tensors
    if convert is not None:
        raw = convert(raw, cfg)
    sd = {}
    for name, t in raw.items():
        key = cls.checkpoint_key(name)
        if key is None:
            continue
        if key not in ours:
            raise ValueError(f"checkpoint tensor {name!r} (as {key!r}) has no place in our {mt} model; "
                             f"the config may not match the weights")
        if tuple(t.shape) != ours[key]:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {ours[key]} from config.json")
        sd[key] = t
    missing = [k for k in ours if k not in sd]
    tied = getattr(model, "tied_params", {})  # ours -> source name, e.g. {"lm_head.weight": "model.embed_tokens.weight"}
    for k in list(missing):
        if k in tied and tied[k] in sd:
            sd[k] = sd[tied[k]]
            missing.remove(k)
    if missing:
        raise ValueError(f"checkpoint {where} lacks {len(missing)} tensor(s) our {mt} model needs, e.g. "
                         f"{missing[:5]}; refusing to initialise them at random")
    return sd


def policy_weights(target, source) -> dict:
    """New weights for ``target`` from ``source`` (a Hugging Face folder of the same architecture, or a state dict
    with Hugging Face names), by our parameter names, floating point ones in the target's parameter dtypes: what
    ``TargetModel.copy_weights_`` takes. Full (unsharded) weights, for a tensor-parallel target too (its
    ``copy_weights_`` cuts each). A folder whose config.json differs from the target's in a key that changes
    what runs, a missing tensor, a shape: ValueError naming it."""
    cfg = dict(vars(target.config))
    if isinstance(source, dict):
        raw, where = source, "the given state dict"
    else:
        new, where = read_config(source), str(source)
        ignore = {"_name_or_path", "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache"}
        for k in sorted((set(new) & set(cfg)) - ignore):
            if new[k] != cfg[k]:
                raise ValueError(f"{source}/config.json: {k} = {new[k]!r}, but the target running has "
                                 f"{k} = {cfg[k]!r}; a new policy version must keep the architecture (swap only "
                                 f"its weights), so start a new follow run for another model")
        raw = read_state_dict(source)
    sd = checkpoint_params(target, raw, cfg, where)
    del raw  # a folder's tensors live in sd only: each old one is freed as its cast is made (one weight at a time)
    own = dict(target.named_parameters())
    for k, v in sd.items():
        if v.is_floating_point() and own[k].is_floating_point():
            sd[k] = v.detach().to(own[k].dtype)  # detached: a trainer's live parameters may be given
    return sd


def param_dtype(model, key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``key`` is stored in: ``dtype``, or fp32 where the model keeps it (e.g. GDN's A_log)."""
    return torch.float32 if any(key.endswith(s) for s in getattr(model, "fp32_params", ())) else dtype


def place_weights(model, sd: dict, dtype: torch.dtype, device, kernels: str):
    """Load every tensor of ``sd`` into ``model`` (built on the meta device) on ``device``, floating point ones in
    ``param_dtype``.

    Args:
        model: the target, built on the meta device.
        sd: every parameter's tensor, by our parameter name.
        dtype: the parameters' dtype (fp32 where the model keeps it).
        device: where they go.
        kernels: ``load_target``'s ``kernels``, kept as ``model.kernels``.

    Returns:
        ``model``, in eval mode with ``requires_grad=False`` on all parameters.
    """
    sd = {k: v.to(device=device, dtype=param_dtype(model, k, dtype) if v.is_floating_point() else v.dtype)
          for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.kernels = kernels
    return model
