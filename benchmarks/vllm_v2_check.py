"""Serve a DFlash V2 export in vLLM on the first GPU and compare vLLM's acceptance counters with ours (the
``vllm_dflash2`` step of benchmarks/gpu_check.sh). NOT RUN YET: written on a CPU machine, whose vLLM cannot draft
with DFlash2DraftModel (only vLLM's GPU model runner V2 implements the candidate walk).

    python benchmarks/vllm_v2_check.py --work DIR [--json OUT] [--steps 20] [--dtype float32]

1. a tiny random Llama target with a character tokenizer and a chat template (as tests/test_vllm.py's);
2. a DFlash V2 drafter trained ``--steps`` SpecOPD steps on it (recipes/tiny.yaml, in-process, on the CPU), exported;
3. ``specopd.eval.engine.judge``, what ``specopd serve-check`` runs: vLLM (``$SPECOPD_VLLM_PYTHON``, a GPU build of
   vLLM >= 0.32; CUDA_VISIBLE_DEVICES=0, VLLM_USE_V2_MODEL_RUNNER=1) serves the export at T = 0 and 1 next to our
   SpeculativeDecoder on vLLM's schedule: at T = 0 (fp32) the texts, the rounds and the per-position acceptance
   must be equal; at T = 1 within noise (our walk draws with our sampler, vLLM's with Gumbel noise: the same
   distribution, not the same draws).

Exit: 0 = every check passed, 1 = a check failed (the report says which), 3 = skipped (no vLLM to run: the reason is
printed and written to the JSON).

What may need a change on the first GPU run: vLLM's attention backend for a non-causal fp32 draft (``--dtype
bfloat16`` if fp32 is refused: then T = 0 differences are reported with their near-tie margins), and the judge's
``--patch-cpu-expand`` (a no-op where vLLM runs Triton).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # tests/test_data.py (the char tokenizer) imports tests/oracle

EOS = 2
QUESTIONS = ["hello there", "what is up?", "tell me a story", "why?", "ok then", "good morning", "how are you",
             "bye now"]
# head_dim 32 (vLLM's attention kernels take head sizes from 32 up); as tests/test_vllm.py's tiny target
TINY = dict(vocab_size=128, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_hidden_layers=2, eos_token_id=EOS)


def main(argv=None) -> int:
    """Build, train, export, judge; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the target, the run, the export and vLLM's logs")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--steps", type=int, default=20, help="SpecOPD steps before the export")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperatures", default="0,1")
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # the first GPU
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # the only runner with the DFlash2 speculator

    from specopd.engines import vllm_missing_reason

    def report(rep: dict, rc: int) -> int:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rep, f, indent=1, default=str)
        return rc

    why = vllm_missing_reason()
    if why:
        print(f"SKIPPED: vLLM cannot run here: {why} (set SPECOPD_VLLM_PYTHON to a GPU build of vLLM >= 0.32)")
        return report({"skipped": why}, 3)

    import torch

    from specopd.config import load_recipe
    from specopd.data.prepare import encode_prompt, load_tokenizer
    from specopd.drafters.layout import export_folder
    from specopd.eval.engine import format_judge, judge
    from specopd.runs.checkpoint import find_latest
    from specopd.train.loop import train
    from specopd.models.tiny import build_tiny_target
    from tests.test_data import write_char_tokenizer

    torch.manual_seed(0)
    tdir = build_tiny_target("llama", os.path.join(a.work, "target"), seed=0, overrides=TINY)
    write_char_tokenizer(tdir)
    run = os.path.join(a.work, "run")
    cfg = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"), [
        f"trainer.output_dir={run}", f"model.target={tdir}", "model.device=cpu", "runtime.backend=local",
        "drafter.kind=dflash2", f"trainer.max_steps={a.steps}", "trainer.save_every=0", "trainer.resume=none",
        "profile.enabled=false"])
    train(cfg, progress=False)
    ck = find_latest(run)
    export = os.path.join(a.work, "export")
    export_folder(ck, export, force=True)
    tok = load_tokenizer(tdir, TINY["vocab_size"])
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    temps = [float(t) for t in a.temperatures.split(",")]
    try:
        rep = judge(tdir, export, prompts, a.max_new_tokens, temps, [EOS], a.dtype, seed=0, plain=True,
                    checkpoint=ck, work_dir=os.path.join(a.work, "judge"))
    except RuntimeError as e:  # vLLM did not start or died (its log is named in the message)
        print(f"vllm_v2_check FAILED: {e}")
        return report({"export": export, "problems": [str(e)]}, 1)
    print(format_judge(rep, f"vllm_v2_check: DFlash V2 export {export}"))
    t0 = rep.get("by_temperature", {}).get("0")
    if t0:
        print(f"T=0 accepted per position: vLLM {t0['vllm']['accepted_at']}, ours on vLLM's schedule "
              f"{t0['ours_vllm_schedule']['accepted_at']}")
    if rep["problems"]:
        print("vllm_v2_check FAILED:\n  " + "\n  ".join(rep["problems"]))
        return report(rep, 1)
    print("vllm_v2_check passed")
    return report(rep, 0)


if __name__ == "__main__":
    sys.exit(main())
