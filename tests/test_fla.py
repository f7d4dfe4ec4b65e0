"""fla-core's kernels as our GDN prefill uses them (``kernels/gated_delta/fla_chunk.py``, ``executors/gdn.py``), run on
the CPU under TRITON_INTERPRET=1 with the shims of ``tests/fla_shims.py`` (autotune: first config; loop counters with
``.to()``), against our references:

- ``fla_chunk_gated_delta_rule``: outputs, final state and fp32 checkpoints against the plain recurrence (fp32,
  including extensions that start off a chunk boundary), fla's varlen mode against per-sequence references;
- fp16 (the interpreter's stand-in for bf16, whose ``tl.dot`` it gets wrong): within fp16 noise, bounded by our own
  chunk kernel's measured fp16 error on the same problem, with fp32 checkpoints;
- fla's ``causal_conv1d`` (``specopd_executors.gdn._conv_seq``) against the mixer's own conv, with history and packed;
- the GDN executor with ``gdn_prefill="fla"`` against ``kernels="torch"`` (prefill, packed prefill, score);
- the launches fla makes for a bf16-shaped problem compile for sm_90 (triton.compile, no GPU), i.e. every kernel's
  dot operands share one dtype.
On CUDA the same checks run with fla's compiled kernels (no shims), in a process with TRITON_F32_DEFAULT=ieee.
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import kernel_check

FILE = __file__
ROOT = kernel_check.ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None,
    reason="fla-core is not installed (pip install -e '.[dev]')")


def _setup():
    if os.environ.get("TRITON_INTERPRET") == "1":
        import fla_shims

        fla_shims.install()


def _inputs(b, t, h, kd, vd, seed=0, device="cpu"):
    from specopd_kernels.gated_delta.naive import prepare_qk

    g_ = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(b, t, h, kd, generator=g_), torch.randn(b, t, h, kd, generator=g_))
    v = torch.randn(b, t, h, vd, generator=g_)
    g = -torch.rand(b, t, h, generator=g_) * 1.5
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, kd, vd, generator=g_) * 0.3
    return [x.to(device) for x in (q, k, v, g, beta, s0)]


def _reference(q, k, v, g, beta, init, every, start):
    from specopd_kernels.gated_delta.naive import recurrent_gated_delta_rule

    return recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g=g, beta=beta, initial_state=init,
                                      checkpoint_every=every, start=start)


PREFILL = {  # name: (B, T, H, K, V, start, checkpoint_every, initial state)
    "t150_c64": (1, 150, 2, 16, 32, 0, 64, True),  # 3 chunks, last one partial
    "t37_no_h0": (2, 37, 2, 32, 16, 0, 64, False),  # one partial chunk, batch 2
    "extend_start70_c128": (1, 100, 1, 16, 16, 70, 128, True),  # off a chunk boundary: front-padded to 64
    "t1": (1, 1, 1, 16, 16, 0, None, True),  # one token, no checkpoints
}
# IEEE fp32 dots (interpreted, or on CUDA with TRITON_F32_DEFAULT=ieee: test_fla_on_cuda): measured <= 2.6e-6
# interpreted; fp32 round-off of the chunked form
TOL32 = 2e-5


def check_prefill(name: str) -> None:
    _setup()
    from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule

    b, t, h, kd, vd, start, every, h0 = PREFILL[name]
    q, k, v, g, beta, s0 = _inputs(b, t, h, kd, vd, device=kernel_check.device())
    init = s0 if h0 else None
    ref = _reference(q, k, v, g, beta, init, every, start)
    got = fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=init, checkpoint_every=every,
                                     start=start)
    errs = [kernel_check.rel(got[0], ref[0]), kernel_check.rel(got[1], ref[1])]
    if every is None:
        assert got[2] is None
    else:
        assert got[2].dtype == torch.float32 and got[2].shape == ref[2].shape, (got[2].shape, ref[2].shape)
        errs.append(kernel_check.rel(got[2], ref[2]))
    print(name, "rel errors (o, final, checkpoints):", errs)
    assert max(errs) <= TOL32, (name, errs)


def check_varlen() -> None:
    """fla's varlen mode: one packed pass over fresh sequences of lengths 150, 1, 64, 37 equals each alone."""
    _setup()
    from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule

    dev = kernel_check.device()
    lens = [150, 1, 64, 37]
    seqs = [_inputs(1, n, 2, 16, 16, seed=i, device=dev) for i, n in enumerate(lens)]
    packed = [torch.cat([s[j] for s in seqs], dim=1) for j in range(5)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev)
    o, finals, cks = fla_chunk_gated_delta_rule(*packed[:3], g=packed[3], beta=packed[4], checkpoint_every=64,
                                                cu_seqlens=cu)
    assert finals.shape[0] == len(lens) and len(cks) == len(lens)
    errs = []
    for i, (s, a, b_) in enumerate(zip(seqs, cu[:-1].tolist(), cu[1:].tolist())):
        ref = _reference(s[0], s[1], s[2], s[3], s[4], None, 64, 0)
        assert cks[i].shape == ref[2][0].shape and cks[i].dtype == torch.float32
        errs.append(max(kernel_check.rel(o[:, a:b_], ref[0]), kernel_check.rel(finals[i], ref[1][0]),
                        kernel_check.rel(cks[i], ref[2][0])))
    print("varlen rel errors:", errs)
    assert max(errs) <= TOL32, errs


def check_fp16(dtype: str = "float16") -> None:
    """fp16 q / k / v (bf16's stand-in; bf16 itself on CUDA): o and states within that dtype's noise of the fp32
    recurrence, with fp32 checkpoints. Noise = how far the fp32 recurrence itself moves when its inputs are rounded
    to the dtype (measured on the same problem); fla, which also stores w, u, v_new and the states it reads back
    in that dtype, may be 4x that."""
    _setup()
    from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule

    dev = kernel_check.device()
    q, k, v, g, beta, s0 = _inputs(1, 200, 2, 32, 32, seed=5, device=dev)
    half = [x.to(getattr(torch, dtype)) for x in (q, k, v)]
    exact = _reference(q, k, v, g, beta, s0, 64, 70)
    ref = _reference(*[x.float() for x in half], g, beta, s0, 64, 70)  # fp32 maths on the fp16-rounded inputs
    got = fla_chunk_gated_delta_rule(*half, g=g, beta=beta, initial_state=s0, checkpoint_every=64, start=70)
    assert got[2].dtype == torch.float32 and got[2].shape == ref[2].shape
    for what, a, r, e in zip(("o", "final", "checkpoints"), got, ref, exact):
        noise, err = kernel_check.rel(r, e), kernel_check.rel(a, r)
        print(f"{dtype} {what}: fla {err:.2e}, input rounding noise {noise:.2e}")
        assert err <= 4 * noise, (what, err, noise)


def _mixer_target(dtype=torch.float32):
    from random_targets import gdn_target

    args = SimpleNamespace(hidden=64, layers=4, vocab=128, device=torch.device(kernel_check.device()), dtype=dtype)
    return gdn_target(args)


def check_conv() -> None:
    """fla's causal_conv1d (SiLU) as ``_conv_seq`` calls it: plain, after a history, and packed (cu_seqlens)."""
    _setup()
    from specopd_executors.gdn import _conv_seq

    target = _mixer_target()
    mixer = next(m for m in target.modules() if hasattr(m, "conv_seq"))
    dev = kernel_check.device()
    g_ = torch.Generator().manual_seed(1)
    cd = mixer.conv1d.weight.shape[0]
    wk = mixer.conv_kernel_size
    u = torch.randn(1, 90, cd, generator=g_).to(dev)
    hist = torch.randn(1, wk - 1, cd, generator=g_).to(dev)
    errs = [kernel_check.rel(_conv_seq(mixer, u, None, fla=True), mixer.conv_seq(u, None)),
            kernel_check.rel(_conv_seq(mixer, u, hist, fla=True), mixer.conv_seq(u, hist))]
    cu = torch.tensor([0, 40, 41, 90], device=dev)
    ref = torch.cat([mixer.conv_seq(u[:, a:b]) for a, b in ((0, 40), (40, 41), (41, 90))], dim=1)
    errs.append(kernel_check.rel(_conv_seq(mixer, u, None, fla=True, cu_seqlens=cu), ref))
    print("conv rel errors (plain, history, packed):", errs)
    assert max(errs) <= 1e-6, errs


def check_executor() -> None:
    """The GDN executor with gdn_prefill="fla" (fla's chunk rule + causal_conv1d) against kernels="torch" on a
    qwen3_5 hybrid: prefill, extension, packed (varlen) prefill, and score."""
    _setup()
    from specopd.tree import ProposalTree

    target = _mixer_target()
    dev = kernel_check.device()
    g_ = torch.Generator().manual_seed(2)
    trunks = [torch.randint(4, 128, (t,), generator=g_).to(dev) for t in (130, 70)]
    tree = ProposalTree.from_branches(torch.tensor([0, 63, 64, 129]), torch.randint(4, 128, (4, 3), generator=g_))
    out, run_options = {}, target.run_options
    for mode in ("torch", "fla"):
        target.kernels = "torch" if mode == "torch" else "triton"
        if mode == "fla":  # every call's executor options: the fla prefill backend
            target.run_options = lambda o: dataclasses.replace(run_options(o), gdn_prefill="fla")
        first = target.prefill(trunks[0][:50])
        ext = target.prefill(trunks[0][50:], cache=first)  # extension: start 50, not chunk-aligned
        packed = target.prefill_batch(trunks, packed=True)  # one varlen pass through fla (cu_seqlens)
        assert target.packed_ok, "packed prefill fell back to per-trunk prefill"
        p = target.score(tree, [ext])
        out[mode] = (ext, packed, p)
    (e_t, pk_t, p_t), (e_f, pk_f, p_f) = out["torch"], out["fla"]
    gdn = [i for i, k in enumerate(target.layer_kinds) if k == "gdn"]
    errs = {"prefill logits": kernel_check.rel(e_f.logits, e_t.logits), "score": kernel_check.rel(p_f, p_t),
            "checkpoints": max(kernel_check.rel(e_f.layers[i].checkpoints, e_t.layers[i].checkpoints) for i in gdn),
            "packed": max(kernel_check.rel(a.logits, b.logits) for a, b in zip(pk_f, pk_t))}
    print("executor rel errors:", errs)
    assert max(errs.values()) <= 2e-5, errs


def check_record(out_path: str) -> None:
    """Run the fla prefill once in fp16 at a recipe-like head size (K = V = 128, extension + checkpoints) and
    write every fla kernel launch to ``out_path`` (JSON) for ``compile_recorded``."""
    _setup()
    import fla_shims

    fla_shims.record_launches()
    from specopd_executors.gdn import _conv_seq  # noqa: F401 - imports fla's conv module: patch its range too
    from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule

    fla_shims.patch_range()
    q, k, v, g, beta, s0 = _inputs(1, 80, 1, 128, 128, seed=3)
    half = [x.half() for x in (q, k, v)]
    fla_chunk_gated_delta_rule(*half, g=g, beta=beta, initial_state=s0, checkpoint_every=64, start=10)
    from fla.modules.causal_conv1d import causal_conv1d

    causal_conv1d(x=torch.randn(1, 20, 64).half(), weight=torch.randn(64, 4).half(), bias=None, activation="silu")
    with open(out_path, "w") as f:
        json.dump(fla_shims.LAUNCHES, f)


def compile_recorded(path: str, arch: int = 90, fp16_as: str = "bf16") -> list:
    """Compile every recorded launch for sm_<arch> with its fp16 pointers as ``fp16_as`` (what a bf16 target
    passes): rows of (module.kernel, dtypes, "ok" | the error). Run without TRITON_INTERPRET."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path) as f:
        launches = json.load(f)
    rows, seen = [], set()
    tmap = {"float32": "fp32", "float16": fp16_as, "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
    for ln in launches:
        fn = getattr(importlib.import_module(ln["module"]), ln["kernel"])
        while not isinstance(fn, triton.runtime.jit.JITFunction):  # autotuner / heuristics wrappers
            fn = fn.fn
        sig, consts = {}, {}
        for i, n in enumerate(fn.arg_names):
            kind, val = ln["args"].get(n, ("const", None))
            if kind == "ptr":
                sig[n] = "*" + tmap[val]
            elif kind == "const":
                sig[n] = "constexpr"
                consts[(i,)] = val
            elif kind == "int":
                sig[n] = "i64" if abs(val) >= 2 ** 31 else "i32"
            else:
                sig[n] = "fp32"
        key = json.dumps([ln["kernel"], sig, sorted((k[0], str(v)) for k, v in consts.items())])
        if key in seen:
            continue
        seen.add(key)
        dts = ",".join(sorted({s for s in sig.values() if s.startswith("*")}))
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options=dict(ln.get("options") or {}))
            rows.append((f"{ln['module']}.{ln['kernel']}", dts, "ok"))
        except Exception as e:  # noqa: BLE001 - reported per kernel
            msg = str(e).strip().splitlines()
            rows.append((f"{ln['module']}.{ln['kernel']}", dts, f"{type(e).__name__}: {msg[-1] if msg else ''}"))
    return rows


@pytest.mark.parametrize("name", list(PREFILL))
def test_fla_prefill_matches_recurrence(name):
    kernel_check.run(FILE, "prefill", name)


def test_fla_varlen_matches_per_sequence():
    kernel_check.run(FILE, "varlen")


def test_fla_fp16_within_noise_fp32_checkpoints():
    kernel_check.run(FILE, "fp16")


def test_fla_causal_conv1d_matches_mixer_conv():
    kernel_check.run(FILE, "conv")


@pytest.mark.slow
def test_gdn_executor_fla_prefill_matches_torch():
    kernel_check.run(FILE, "executor", timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter records the launches; on CUDA they run")
def test_fla_launches_compile_for_sm90_bf16(tmp_path):
    """Record fla's launches for an fp16 prefill under the interpreter, then compile each for sm_90 with bf16
    pointers: a kernel whose dot mixes bf16 and fp32 operands fails here (it did before the one-dtype fix)."""
    pytest.importorskip("triton.backends.nvidia")
    rec = tmp_path / "launches.json"
    kernel_check.run(FILE, "record", str(rec))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    code = ("import json, sys, test_fla; rows = test_fla.compile_recorded(sys.argv[1]); "
            "print(json.dumps(rows))")
    r = subprocess.run([sys.executable, "-c", code, str(rec)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    names = {n.split(".")[-1] for n, _, _ in rows}
    assert {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o"} <= names, names
    bad = [row for row in rows if row[2] != "ok"]
    assert not bad, bad


def check_cuda() -> None:
    """Every check above on CUDA with fla's compiled kernels (autotuned), bf16 included; fp32 ones need IEEE dots."""
    from specopd_kernels.gated_delta.fla_chunk import fla_fp32_exact

    assert fla_fp32_exact("cuda"), "fla's fp32 dots would be TF32: run with TRITON_F32_DEFAULT=ieee"
    for name in PREFILL:
        check_prefill(name)
    check_varlen()
    check_fp16("float16")
    check_fp16("bfloat16")
    check_conv()
    check_executor()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_on_cuda():
    """fla on fp32 refuses to run in TF32 (triton's default fp32 dot on sm_80+; fla forces IEEE only before Ampere);
    then every check above runs on CUDA (``check_cuda``) in a process started with TRITON_F32_DEFAULT=ieee, so the
    fp32 checks hold to TOL32 for the reason they do interpreted: IEEE fp32 dots. (In its own process: the variable
    is read when a kernel compiles, and this one may already hold fla kernels compiled in TF32.)"""
    from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule, fla_fp32_exact

    if not fla_fp32_exact("cuda"):
        q, k, v, g, beta, _ = _inputs(1, 8, 1, 16, 16, device="cuda")
        with pytest.raises(ValueError, match="TF32"):
            fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, checkpoint_every=64)
    env = {**os.environ, "TRITON_F32_DEFAULT": "ieee",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, FILE, "cuda"], env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:])
    assert r.returncode == 0 and "cuda ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


CHECKS = {"prefill": check_prefill, "varlen": check_varlen, "fp16": check_fp16, "conv": check_conv,
          "executor": check_executor, "record": check_record, "cuda": check_cuda}

if __name__ == "__main__":
    kernel_check.main(CHECKS, strict_dots=False)  # fla's kernels: triton's own dot rule, not ours
