"""The Triton kernels' ahead-of-time compile variants at the recipes' shapes and the compile of one: shared by
``tests/test_kernels_aot.py`` and ``benchmarks/aot_check.py`` (which prints them and explains its arguments).
``launched_kernels()`` lists every Triton kernel in kernels/ (the tests check each has a variant)."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHARED_LIMIT = {90: 232448, 100: 232448}  # max dynamic shared memory per block (227 KiB) on sm_90 / sm_100

# Spills measured with this script and accepted: (label, triton "major.minor", arch) -> (max local + stack bytes,
# why). Anything else that spills fails. Measured 2026-12-01 on the CPU (no GPU run yet).
KNOWN_SPILLS = {
    ("tree_attention[27B hd256 G6 bf16 chain]", "3.6", 90): (
        16, "triton 3.6's ptxas (the H200 machine's) gives the head-dim-256 chain kernel (q [64, 256] bf16 and acc "
            "[64, 256] fp32 in registers, 255 registers) a 16 B stack frame (cuobjdump: LOCAL 0, STACK 16); triton "
            "3.9: none. Kept; the GPU run's bench_kernels times it"),
    ("gdn_fused_recurrent[27B]", "3.6", 90): (
        8, "triton 3.6 gives the 48-head fused recurrent kernel without h0 an 8 B stack frame (LOCAL 0, STACK 8; the "
           "qwen4_exp 32-head and the h0 variants: none; triton 3.9: none); this kernel runs the prefill only when "
           "gdn_checkpoint_every is not a multiple of 16, which no recipe uses"),
}
# fp32 variants (--dtypes fp32): reported, never failed. fp32 targets are for the exactness tests at small head
# dims (tests/test_executor_gpu.py: hidden 128); the recipes run bf16. At the recipes' head dims the block sizes,
# chosen for bf16, hold fp32 tiles twice as large, and IEEE fp32 dots run on FMA units: the tree attention and GDN
# chunk kernels keep 1.7-20 KB of stack under triton 3.6 and 3.9 alike (benchmarks/results/2026-12-01-gpu-paths-on-the-cpu-dev-cpu.md). Slower, not wrong.
FP32_SPILLS_ACCEPTED = True
FP32_ONLY = {"gdn_replay", "gdn_fused_recurrent", "qsa_index_scores", "qsa_topk"}  # fp32 for every target: no pass


# The recipes' shapes, as the executors launch the kernels for them (bf16 targets). GDN q / k reach the kernels
# expanded to the value heads (``GatedDeltaNet.split_qkv``), so HQ = H; the chunk kernels get q / k / v in bf16
# (``specopd_executors.gdn`` casts them for tensor-core dots), the fused recurrent and replay kernels get fp32 (their
# launchers / the executor pass split_qkv's fp32 outputs). QSA: index queries and pooled keys in fp32
# (selection is discrete: the indexer runs in fp32 for every target dtype), attention q / k / v in bf16.
SHAPES = {
    "8B": dict(gqa=(128, 32, 8)),  # Qwen3-8B: 32 / 8 heads of 128
    "27B": dict(gqa=(256, 24, 4), gdn=(48, 128, 128)),  # Qwen3.5-27B: gated attention; GDN 48 value heads
    "qwen4_exp": dict(gdn=(32, 128, 128), qsa=(256, 16, 2), indexer=(32, 128, 512)),  # recipe shape
}


def tiny_shapes() -> dict:
    """The shapes of the tiny recipes' targets (recipes/tiny*.yaml: ``model.target: tiny:<type>`` with its
    ``model.tiny`` overrides, built by ``specopd.models.tiny``), in ``SHAPES``' form, keyed "tiny:<type>": head dims
    below 16 (qwen4_exp's GDN K = V = 8) must still compile (the launchers pad them, kernels/dot.py)."""
    import glob

    from specopd.config import load_recipe
    from specopd.models.tiny import tiny_config

    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "tiny*.yaml"))):
        model = load_recipe(path).model
        if not model.target.startswith("tiny:"):
            continue
        cfg = tiny_config(model.target[len("tiny:"):], dict(model.tiny))[0]
        kinds = set(cfg.get("layer_types") or ["full_attention"])
        shape = {}
        if "full_attention" in kinds:
            shape["gqa"] = (cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if "linear_attention" in kinds:
            shape["gdn"] = (cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])
        if "indexed_attention" in kinds:
            shape["qsa"] = (cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"])
            shape["indexer"] = (cfg["indexer_n_heads"], cfg["indexer_head_dim"],
                                cfg["indexer_budget"] // cfg["indexer_compress_ratio"])
        out[model.target] = shape
    return out


def variants(dtypes=("bf16",), shapes=None) -> list:
    """(label, module, kernel name, pointer dtypes by arg, fp32 scalar args, constexprs, launch options): every
    Triton kernel the executors launch, at the block sizes their launchers pick (the same config functions), for
    targets of each of ``dtypes`` ("bf16": the recipes; "fp32": fp32 targets, whose launchers use IEEE dots) at
    ``shapes`` (default ``SHAPES``, the recipes'; ``tiny_shapes()`` for the tiny recipes). Kernels whose operands
    are fp32 for every target (GDN replay / fused recurrent, QSA indexer / top-k) appear once, with the first
    dtype. A variant identical to an earlier one (two shapes that launch a kernel alike) is left out."""
    out, seen = [], set()
    for i, dt in enumerate(dtypes):
        for v in _variants_of(dt, first=i == 0, shapes=SHAPES if shapes is None else shapes):
            key = repr(v[1:])
            if key not in seen:
                seen.add(key)
                out.append(v)
    return out


def _variants_of(dt: str, first: bool, shapes: dict) -> list:
    import torch
    import triton

    from specopd_kernels.dot import dot_precision
    from specopd_kernels.gated_delta import chunk, replay
    from specopd_kernels.qsa import indexer, sparse_attention
    from specopd_kernels.tree_attention import triton_fwd as tree

    out = []
    f32 = "*fp32"
    prec = dot_precision({"fp32": torch.float32, "bf16": torch.bfloat16}[dt])  # the launchers' DOT_PREC
    for name, shape in shapes.items():
        if "gqa" in shape:  # GQA score: tree attention over the block plan (chains; general trees)
            hd, h, hkv = shape["gqa"]
            cfg = tree.kernel_config(hd, h // hkv)
            for chain in (True, False):
                ptrs = {n: f"*{dt}" for n in ("Q", "K", "V", "TK", "TV", "Out")}
                ptrs.update({n: "*i32" for n in ("order", "anchor", "depth", "q_start", "q_end", "q_toff", "t_full",
                                                 "t_len", "nb_ptr", "nb_idx")})
                ptrs["bits"] = "*i64" if not chain else "*i32"
                out.append((f"tree_attention[{name} hd{hd} G{h // hkv} {dt} {'chain' if chain else 'tree'}]",
                            "specopd_kernels.tree_attention.triton_fwd", "_tree_attn_fwd", ptrs, ("qk_scale",),
                            dict(G=h // hkv, HD=hd, BLOCK_D=cfg["BLOCK_D"], BM=cfg["BM"], BMN=cfg["BMN"],
                                 BN=cfg["BN"], CHAIN=chain, DOT_PREC=prec),
                            dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])))
        if "gdn" in shape:  # GDN prefill (chunk 64 = C; fresh trunks and extensions) and score (fused replay)
            h, kd, vd = shape["gdn"]
            bt = chunk.chunk_size_for(64)
            cfg = chunk.kernel_config(kd, vd)
            common = dict(H=h, HQ=h, K=kd, V=vd, BT=bt, BK=cfg["BK"], DOT_PREC=prec)
            out.append((f"gdn_chunk_wy[{name} {dt}]", "specopd_kernels.gated_delta.chunk", "_chunk_wy_fwd",
                        dict(k=f"*{dt}", v=f"*{dt}", g=f32, beta=f32, gc_out=f32, w_out=f32, u_out=f32), (),
                        dict(common, BV=cfg["BV_WY"]), dict(num_warps=cfg["warps_wy"])))
            for h0 in (False, True):
                out.append((f"gdn_chunk_h[{name} {dt}{' h0' if h0 else ''}]", "specopd_kernels.gated_delta.chunk",
                            "_chunk_h_fwd", dict(k=f"*{dt}", w=f32, u=f32, gc=f32, h0=f32, h_out=f32, vn_out=f32,
                                                 ht=f32), (),
                            dict(common, BV=cfg["BV_H"], USE_H0=h0), dict(num_warps=cfg["warps_h"])))
            out.append((f"gdn_chunk_o[{name} {dt}]", "specopd_kernels.gated_delta.chunk", "_chunk_o_fwd",
                        dict(q=f"*{dt}", k=f"*{dt}", gc=f32, h=f32, vn=f32, o=f32), (),
                        dict(common, BV=cfg["BV_O"]), dict(num_warps=cfg["warps_o"])))
            rcfg = replay.kernel_config(kd, vd)
            for store in ((False, True) if first else ()):
                ptrs = {n: f32 for n in ("states0", "scratch", "states_out", "o", "rk", "rv", "rg", "rbeta", "nq",
                                         "nk", "nv", "ng", "nbeta")}
                ptrs.update({n: "*i32" for n in ("seg_state", "seg_tok", "seg_stop_ptr", "stop_len",
                                                 "stop_node_ptr", "node_id", "node_src", "node_save")})
                out.append((f"gdn_replay[{name} {'verify' if store else 'score'}]", "specopd_kernels.gated_delta.replay",
                            "_replay_fwd", ptrs, (), dict(H=h, HQ=h, K=kd, V=vd, BK=rcfg["BK"], BV=rcfg["BV"],
                                                          STORE_STATES=store), dict(num_warps=rcfg["num_warps"])))
            # fused recurrent: prefill when C is not a multiple of 16 (the tiny recipes' C = 8); its launcher's blocks
            for h0 in ((False, True) if first else ()):
                out.append((f"gdn_fused_recurrent[{name}{' h0' if h0 else ''}]", "specopd_kernels.gated_delta.fused_recurrent",
                            "_fwd_kernel", {n: f32 for n in ("q", "k", "v", "g", "beta", "o", "h0", "ht", "ck")}, (),
                            dict(H=h, K=kd, V=vd, BK=triton.next_power_of_2(kd), BV=min(triton.next_power_of_2(vd), 32),
                                 USE_H0=h0, SAVE_CK=True), dict(num_warps=4)))
        if "qsa" in shape:  # QSA prefill and score: indexer scores, exact top-k, sparse attention
            hi, di, topk = shape["indexer"]
            cfg = indexer.scores_config(di, fp32=True)
            if first:  # the indexer runs in fp32 whatever the target's dtype (QSAttention.index_project): IEEE fp32 dots
                out.append((f"qsa_index_scores[{name} {hi}x{di} fp32]", "specopd_kernels.qsa.indexer", "_index_scores_fwd",
                            dict(q=f32, keys=f32, n_complete="*i32", scores=f32), ("inv_div",),
                            dict(HI=hi, DI=di, BLOCK_D=cfg["BLOCK_D"], BQ=cfg["BQ"], BG=cfg["BG"], DOT_PREC="ieee"),
                            dict(num_warps=cfg["num_warps"])))
                cfg = indexer.topk_config(topk)
                out.append((f"qsa_topk[{name} k{topk}]", "specopd_kernels.qsa.indexer", "_topk_groups_fwd",
                            dict(scores=f32, n_complete="*i32", out="*i32"), (), dict(K_SEL=topk, BG=cfg["BG"]),
                            dict(num_warps=cfg["num_warps"])))
            hd, h, hkv = shape["qsa"]
            cfg = sparse_attention.kernel_config(hd, h // hkv)
            out.append((f"qsa_sparse_attention[{name} hd{hd} G{h // hkv} {dt}]", "specopd_kernels.qsa.sparse_attention",
                        "_sparse_attn_fwd", dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", idx="*i32", n_keys="*i32",
                                                 o=f"*{dt}"), ("qk_scale",),
                        dict(G=h // hkv, BH=cfg["BH"], HD=hd, BLOCK_D=cfg["BLOCK_D"], BN=cfg["BN"], DOT_PREC=prec),
                        dict(num_warps=cfg["num_warps"])))
    return out


def launched_kernels() -> set:
    """(module, name) of every Triton kernel in ``kernels/`` that a launcher calls (JIT functions defined there,
    minus device helpers called from other kernels): each must have a variant in ``variants``."""
    import importlib
    import pkgutil

    import triton

    import specopd_kernels

    helpers = {("specopd_kernels.softmax", "online_softmax_update")}
    found = set()
    for info in pkgutil.walk_packages(specopd_kernels.__path__, "specopd_kernels."):
        mod = importlib.import_module(info.name)
        for attr, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == info.name:
                found.add((info.name, attr))
    return found - helpers


def _resources(cubin: bytes, name: str) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        txt = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    pat = r":\s*\n\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)"
    m = re.search(r"Function " + re.escape(name) + pat, txt)
    if not m:
        raise RuntimeError(f"cuobjdump printed no resource line for {name}:\n{txt}")
    reg, stack, shared, local = (int(x) for x in m.groups())
    return dict(registers=reg, static_shared=shared, local_bytes=local, stack=stack)


@contextlib.contextmanager
def strict_dot_rule():
    """Within the block, triton's NVIDIA backend refuses a ``tl.dot`` with any block dim (M, N or K) below
    ``specopd_kernels.dot.MIN_DOT``. The compilers check less (triton 3.6 refuses only K < 16; 3.9 only K < 8), so without
    it the AOT check would pass a launch that a GPU refuses, or one that breaks the launchers' rule
    (kernels/dot.py). Raises AttributeError if this triton has no such hook any more (the check would be void)."""
    from triton.backends.nvidia import compiler as nv

    from specopd_kernels.dot import MIN_DOT

    base = nv.min_dot_size

    def strict(target):
        check = base(target)
        return lambda lhs, rhs: tuple(max(MIN_DOT, x) for x in check(lhs, rhs))

    nv.min_dot_size = strict
    try:
        yield
    finally:
        nv.min_dot_size = base


def compile_one(args) -> dict:
    """Compile one (variant, arch) under ``strict_dot_rule`` and read its resources; never raises (errors become
    ok = False)."""
    label, module, kernel, ptrs, floats, constexprs, options, arch = args
    row = {"kernel": label, "arch": f"sm_{arch}", "ok": False, "registers": None, "shared_bytes": None,
           "local_bytes": None}
    try:
        import importlib

        import triton

        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = getattr(importlib.import_module(module), kernel)
        sig = {}
        for n in fn.arg_names:
            if n in constexprs:
                sig[n] = "constexpr"
            elif n in ptrs:
                sig[n] = ptrs[n]
            elif n in floats:
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
        unknown = set(ptrs) - set(fn.arg_names)
        if unknown:
            raise ValueError(f"{kernel} has no arguments {sorted(unknown)}")
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}  # as the launcher specialises
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
        with strict_dot_rule():
            cc = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
        res = _resources(cc.asm["cubin"], cc.metadata.name)
        shared = int(cc.metadata.shared) + res["static_shared"]  # dynamic (triton's allocation) + static
        row.update(registers=res["registers"], shared_bytes=shared, local_bytes=res["local_bytes"] + res["stack"])
        problems = []
        if shared > SHARED_LIMIT[arch]:
            problems.append(f"shared memory {shared} B > {SHARED_LIMIT[arch]} B")
        if row["local_bytes"] > 0:
            known = KNOWN_SPILLS.get((label, ".".join(triton.__version__.split(".")[:2]), arch))
            spill = f"spills: {row['local_bytes']} B (local {res['local_bytes']}, stack {res['stack']})"
            if known and row["local_bytes"] <= known[0]:
                row["note"] = f"known, KNOWN_SPILLS: {spill}"
            elif FP32_SPILLS_ACCEPTED and " fp32" in label and label.split("[")[0] not in FP32_ONLY:
                row["note"] = f"fp32 variant {spill} (accepted, see FP32_SPILLS_ACCEPTED)"
            else:
                problems.append(spill)
        row["ok"] = not problems
        if problems:
            row["error"] = "; ".join(problems)
    except Exception as e:  # noqa: BLE001 - report every failure in the table
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    return row
