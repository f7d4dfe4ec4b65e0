"""Memory plan: one GPU's estimated peak for one SpecOPD step, term by term per phase, before anything is loaded
(``memory_plan``), and ``check_memory``, which names the recipe keys to lower when the step does not fit.
Phases, sizes and growth: specopd/DESIGN.md ("Memory plan").
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn

from specopd_executors.gqa import BLOCKED
from specopd_executors.qsa import SCORE_BYTES as QSA_SCORE_BYTES
from specopd.config import vocab_parallel_head
from specopd.data.formats import count_records
from specopd.data.packaged import conversations_file
from specopd.data.smollm2 import MODEL_NAME, default_model_dir, is_prepared
from specopd.drafters import build_drafter
from specopd.losses import CHUNK_BUDGET, CHUNK_WORKSET_FACTOR, auto_chunk_rows
from specopd.models import MODEL_TYPES
from specopd.models.loading import read_config
from specopd.models.tensor_parallel import TensorParallel, shard_target
from specopd.models.tiny import tiny_config
from specopd.profiling import PHASES

DEFAULT_DEVICE_BYTES = 80 * 10**9
"""Device memory assumed when no CUDA device is visible: 80 GB (decimal). An "80 GB" H100 / A100 reports
79.2 GiB (85.0e9 bytes), so this leaves ~5 GB for fragmentation beyond ``RUNTIME_OVERHEAD``."""
RUNTIME_OVERHEAD = 1 << 30
"""CUDA context, cuBLAS / NCCL workspaces and allocator slack, counted in every phase on CUDA."""
MEMORY_PHASES = tuple(p for p in PHASES if p not in ("allreduce", "checkpoint"))  # the step's phases that hold memory
ROLE_PHASES = {"target": ("prefill", "score"), "drafter": ("propose", "loss_backward", "optimizer")}
GDN_SCORE_STATES = 6
"""fp32 [H, K, V] GDN states per branch a scoring layer holds at once: the anchor state, the level's input and
output, and the step's temporaries (decayed state, k d^T, their sum; ``specopd_kernels.gated_delta.gated_delta_step``)."""


class MemoryPlanError(ValueError):
    """The planned peak does not fit the device; the message names the recipe keys to lower."""


@dataclass
class Term:
    name: str
    bytes: int
    phases: Tuple[str, ...]  # the phases during which it is alive
    key: Optional[str]  # the recipe key that lowers it (None: fixed by the model)
    how: str  # the formula, in words
    verb: str = "lower"  # what to do with ``key`` to shrink the term ("raise" for a checkpoint interval)


@dataclass
class MemoryPlan:
    terms: List[Term]
    device_bytes: int
    device_source: str
    shape_source: str
    sizes: dict  # S, T, N, W, V, D, chunk_rows, ...
    roles: str = "colocated"
    notes: List[str] = field(default_factory=list)

    def phase_bytes(self, phases=MEMORY_PHASES) -> dict:
        return {p: sum(t.bytes for t in self.terms if p in t.phases) for p in phases}

    def role_peaks(self) -> dict:
        """{role: (peak bytes, phase)}: one entry (colocated) or the target and drafter GPUs (split)."""
        pb = self.phase_bytes()
        roles = {"colocated": MEMORY_PHASES} if self.roles != "split" else ROLE_PHASES
        return {r: max(((pb[p], p) for p in ph), key=lambda x: x[0]) for r, ph in roles.items()}

    @property
    def peak(self) -> int:
        return max(b for b, _ in self.role_peaks().values())

    @property
    def peak_phase(self) -> str:
        return max(self.role_peaks().values(), key=lambda x: x[0])[1]

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_bytes

    def advice(self) -> List[str]:
        """The recipe keys whose terms, largest first, cover the excess of the peak phase."""
        excess = self.peak - self.device_bytes
        if excess <= 0:
            return []
        phase = self.peak_phase
        out, covered = [], 0
        fixed = sum(t.bytes for t in self.terms if phase in t.phases and t.key is None)
        if fixed > self.device_bytes:
            out.append(f"the terms fixed by the model ({_gib(fixed)}) alone exceed the device "
                       f"({_gib(self.device_bytes)}): use a GPU with more memory or a smaller model.dtype")
        for t in sorted((t for t in self.terms if phase in t.phases and t.key), key=lambda t: -t.bytes):
            out.append(f"{t.verb} {t.key} ({t.name}: {_gib(t.bytes)})")
            covered += t.bytes
            if covered >= excess:
                break
        return out

    def to_dict(self) -> dict:
        rp = self.role_peaks()
        return {"terms": [asdict(t) for t in self.terms], "phases": self.phase_bytes(),
                "roles": {r: {"peak": b, "phase": p} for r, (b, p) in rp.items()},
                "peak": self.peak, "peak_phase": self.peak_phase, "device_bytes": self.device_bytes,
                "device_source": self.device_source, "fits": self.fits, "advice": self.advice(),
                "shape_source": self.shape_source, "sizes": dict(self.sizes), "notes": list(self.notes)}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def human(n: float) -> str:
    """Bytes in B / KiB / MiB / GiB / TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------------------------------------- inputs
def target_shape(cfg) -> Tuple[Optional[dict], str]:
    """(config.json entries of the target, where they came from); (None, why) when no shape is known."""
    m = cfg.model
    if m.is_tiny:
        return tiny_config(m.target[len("tiny:"):], dict(m.tiny))[0], f"built-in tiny config ({m.target})"
    folder = m.target
    if not os.path.isdir(folder):
        # a `specopd prepare model` name (e.g. smollm2-135m), once prepared
        if folder == MODEL_NAME and is_prepared(default_model_dir()):
            folder = default_model_dir()
    if os.path.isdir(folder):
        return read_config(folder), f"{folder}/config.json"
    if m.shape:
        shape = dict(m.shape)
        if "text_config" in shape:  # the composite layout of a real config.json
            shape = {**{k: v for k, v in shape.items() if k != "text_config"}, **shape["text_config"]}
        return shape, "recipe model.shape (the target folder is not on this machine)"
    return None, (f"target folder {m.target!r} is not on this machine and the recipe has no model.shape "
                  f"(add the config.json entries of the target under model.shape)")


def device_memory(cfg) -> Tuple[int, str]:
    """(bytes, source): the GPU's memory when CUDA is visible, host RAM for CPU recipes, else 80 GB."""
    if cfg.model.device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
            return kb * 1024, "host RAM (model.device=cpu)"
        except (OSError, StopIteration):
            return DEFAULT_DEVICE_BYTES, "default 80 GB (host RAM unknown)"
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        return int(prop.total_memory), f"cuda:0 ({prop.name})"
    if cfg.model.gpu_memory_gb is not None:
        return int(cfg.model.gpu_memory_gb * 10**9), "recipe model.gpu_memory_gb (no CUDA device visible here)"
    return DEFAULT_DEVICE_BYTES, "default 80 GB (no CUDA device visible here)"


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class TargetInfo:
    """What the plan reads off the meta-built target."""
    params: int
    weight_bytes: int
    vocab: int
    hidden: int
    layers: int
    mixers: list  # token mixer modules (kind gqa / qsa / gdn / conv), in layer order
    mlp_width: int  # intermediate width a token passes through (dense, or top-k experts + shared)
    streams: int  # residual streams (hyper-connections), 1 for a plain pre-norm stack
    model_type: str
    model: nn.Module
    lm_head_bytes: int = 0  # one rank's lm_head (part of weight_bytes; 0 when tied to the embedding, counted there)
    lm_head_rows: int = 0  # its vocabulary rows: V, or V / N split by vocabulary


def analyse_target(shape: dict, dtype: str, tensor_parallel: int = 1, shard_vocab: bool = False) -> TargetInfo:
    """Build our model class for ``shape`` on the meta device: exact weights (fp32 where the model keeps them,
    tied weights once), the token mixers and the MLP width.

    Args:
        shape: the target's config.json entries.
        dtype: the weights' dtype name.
        tensor_parallel: N > 1: one rank's shard (local heads, experts and MLP columns: its caches follow).
        shard_vocab: with N > 1, the lm_head's block of V / N rows, a weight of its own even when the embedding is
            tied to it (``runtime.tp_lm_head``); ValueError when N does not divide V.

    Returns:
        ``TargetInfo``.
    """
    mt = shape.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} of the target shape is not supported; supported: {sorted(MODEL_TYPES)}")
    try:
        with torch.device("meta"):
            model = MODEL_TYPES[mt](dict(shape))
    except (KeyError, TypeError) as e:
        raise ValueError(f"the target shape lacks an entry our {mt} model needs: {e} (give the config.json "
                         f"entries under model.shape)") from None
    shard_vocab = shard_vocab and tensor_parallel > 1
    if tensor_parallel > 1:
        tp = TensorParallel.planned(tensor_parallel, shard_vocab)
        if shard_vocab:
            tp.vocab_block(int(shape["vocab_size"]))
        shard_target(model, tp)
    bpe = _BYTES[dtype]
    tied = set(getattr(model, "tied_params", {})) - ({"lm_head.weight"} if shard_vocab else set())
    fp32 = tuple(getattr(model, "fp32_params", ()))
    params = wbytes = 0
    for name, p in model.named_parameters():
        if name in tied:
            continue
        params += p.numel()
        wbytes += p.numel() * (4 if any(name.endswith(s) for s in fp32) else bpe)
    mixers = [m for m in model.modules() if getattr(type(m), "kind", None) in ("gqa", "qsa", "gdn", "conv")]
    experts = int(shape.get("num_experts") or 0)
    moe = (int(shape.get("num_experts_per_tok") or 0) * int(shape.get("moe_intermediate_size") or 0)
           + int(shape.get("shared_expert_intermediate_size") or 0)) if experts else 0
    head = model.lm_head.weight
    head_bytes = 0 if "lm_head.weight" in tied else head.numel() * (4 if "lm_head.weight".endswith(fp32) else bpe)
    return TargetInfo(params, wbytes, int(shape["vocab_size"]), int(shape["hidden_size"]),
                      int(shape["num_hidden_layers"]), mixers, max(int(shape.get("intermediate_size") or 0), moe),
                      int(shape.get("hc_count") or 1), mt, model, head_bytes, int(head.shape[0]))


def _proj_width(mixer: nn.Module) -> int:
    """Output features of every projection of a mixer (q/k/v/gate, GDN in_proj, indexer) per token."""
    return sum(m.out_features for m in mixer.modules() if isinstance(m, nn.Linear))


def trunk_cache_bytes(mixer: nn.Module, t: int, every: int, bpe: int) -> Tuple[int, int]:
    """One mixer's trunk cache for t tokens, as the executors store it: GQACache k, v [T, Hkv, hd]; QSACache + raw
    index keys [T, di] + pooled keys [T // r, di]; GDNCache conv_in [T, Cd], g, beta [T, H] fp32, checkpoints
    [ceil(T / C), H, K, V] fp32, final [H, K, V] fp32; ConvCache x [T, C].

    Args:
        mixer: the layer's token mixer (built on the meta device).
        t: trunk tokens.
        every: C, the GDN checkpoint interval.
        bpe: bytes per element of the model dtype.

    Returns:
        (cache bytes, of which GDN state checkpoints).
    """
    kind = type(mixer).kind
    if kind in ("gqa", "qsa"):
        b = 2 * t * mixer.num_kv_heads * mixer.head_dim * bpe
        if kind == "qsa":
            di = mixer.indexer.head_dim
            b += t * di * bpe + (t // mixer.ratio) * di * bpe
        return b, 0
    if kind == "gdn":
        state = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim * 4
        ckpt = math.ceil(t / every) * state
        return t * mixer.conv_dim * bpe + 2 * t * mixer.num_v_heads * 4 + ckpt + state, ckpt
    if kind == "conv":
        return t * mixer.weight.shape[0] * bpe, 0
    raise ValueError(f"no cache layout known for mixer kind {kind!r}")


def forward_workset(info: TargetInfo, tokens: int, bpe: int) -> int:
    """One target layer's activations for ``tokens`` tokens, no grad: residual streams + norms, the widest mixer's
    projections (twice: inputs and outputs of its attention / recurrence), the MLP's gate, up and product."""
    proj = max((_proj_width(m) for m in info.mixers), default=0)
    return tokens * ((2 * info.streams + 4) * info.hidden + 2 * proj + 3 * info.mlp_width) * bpe


def dense_attention_scores(info: TargetInfo, tq: int, tk: int) -> int:
    """CPU (dense ``masked_attention``): fp32 scores + probabilities of one query chunk, as it chunks them
    (at most 2^26 score entries unless one query row alone is larger)."""
    heads = max((m.num_heads for m in info.mixers if type(m).kind in ("gqa", "qsa")), default=0)
    if not heads or not tq or not tk:
        return 0
    rows = min(tq, max(1, (1 << 26) // (heads * tk)))
    return 2 * rows * heads * tk * 4


QUERY_BLOCK = BLOCKED["block_m"]  # tree nodes per query block of the gqa score plan (torch path)


def score_extras(info: TargetInfo, trunk_nodes: List[int], branches: int, t: int, bpe: int) -> Tuple[int, str]:
    """The largest per-kind scoring transient (layers run one after another), as the executors compute it:
    gqa: the tree-attention block plan visits one block of QUERY_BLOCK nodes at a time (torch path: its fp32
    scores against the keys it can see, [H, QUERY_BLOCK, T + QUERY_BLOCK]; the Triton kernel keeps them on chip);
    gdn: GDN_SCORE_STATES fp32 states [H, K, V] per branch (chains: one state per branch and tree level);
    qsa: the gathered keys / values of the selected tokens [M, budget + r - 1, Hkv, hd] x 2 and their fp32
    scores [M, H, keys], processed in node chunks of at most QSA_SCORE_BYTES (the executor's qsa_score_bytes),
    plus the index scores [M, T / r].

    Args:
        info: the target's ``TargetInfo``.
        trunk_nodes: [S] tree nodes per trunk (M = their sum).
        branches: N.
        t: trunk tokens T.
        bpe: bytes per element of the model dtype.

    Returns:
        (bytes, what they are: e.g. "gdn branch states").
    """
    m = sum(trunk_nodes)
    best, what = 0, "none"
    kinds = {type(x).kind: x for x in info.mixers}
    if "gqa" in kinds:
        x = kinds["gqa"]
        b = x.num_heads * QUERY_BLOCK * (t + QUERY_BLOCK) * 4
        if b > best:
            best, what = b, "gqa score block"
    if "gdn" in kinds:
        x = kinds["gdn"]
        b = GDN_SCORE_STATES * branches * x.num_v_heads * x.head_k_dim * x.head_v_dim * 4
        if b > best:
            best, what = b, "gdn branch states"
    if "qsa" in kinds:
        x = kinds["qsa"]
        keys = x.topk * x.ratio + x.ratio - 1
        b = (min(QSA_SCORE_BYTES, 2 * m * keys * x.num_kv_heads * x.head_dim * bpe + m * x.num_heads * keys * 4)
             + m * (t // x.ratio + 1) * 4)
        if b > best:
            best, what = b, "qsa gathered keys"
    return best, what


def build_meta_drafter(cfg, info: TargetInfo):
    d = cfg.drafter
    with torch.device("meta"):
        arch = dict(d.architecture)
        if d.draft_vocab_size is not None:  # the head's size (which ids the data chooses does not matter here)
            arch["draft_vocab"] = torch.arange(min(d.draft_vocab_size, int(info.vocab)), device="cpu")
        return build_drafter(d.kind, info.model, num_layers=d.num_layers, block_size=d.block_size,
                             feature_layers=d.feature_layers, **arch)


def drafter_activation_bytes(drafter, n: int, w: int, ctx_rows: int, act: int) -> Tuple[int, int]:
    """The drafter's activations saved for backward, for n branches of w drafted tokens (w + 1 block rows with the
    anchor) and ctx_rows context rows (each trunk once: shared-context drafter).
    Per block row and layer: residual, norms and attention / MLP outputs (6 D), q in / normed / roped + attention
    output (3 H hd), k and v of the block (6 Hkv hd), MLP gate, up, act, product (4 I), fp32 log-sum-exp (H).
    Per context row and layer: k, v projections, normed, roped (4 Hkv hd). Once: fc output and its norm (2 D)
    per context row; the final norm's input and output [N, W, D].

    Args:
        drafter: the drafter (built on the meta device; its ``config`` gives the sizes).
        n: branches N.
        w: drafted tokens per branch W.
        ctx_rows: context rows (S * T).
        act: bytes per activation element.

    Returns:
        (all layers' activation bytes, one layer's).
    """
    c = drafter.config
    d, hq, hkv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    if getattr(drafter, "autoregressive", False):
        return autoregressive_activation_bytes(c, n, w, ctx_rows, act)
    rows = n * (w + 1)
    per_layer = rows * ((6 * d + 3 * hq + 6 * hkv + 4 * i) * act + 4 * c.num_heads) + ctx_rows * 4 * hkv * act
    once = ctx_rows * 2 * d * act + 2 * n * w * d * act
    markov = n * w * (getattr(c, "markov_rank", 0) + d) * act if getattr(drafter, "has_confidence", False) else 0
    return c.num_layers * per_layer + once + markov, per_layer


def autoregressive_activation_bytes(c, n: int, w: int, ctx_rows: int, act: int) -> Tuple[int, int]:
    """``drafter_activation_bytes`` of an autoregressive drafter (EAGLE-3): every context row runs every layer (the
    causal pass with grad, once per trunk), each branch runs W - 1 more steps; per row and layer the block drafter's
    row terms plus the 2D input of layer 0 (2 D); the per-branch step caches: step k's attention keeps the stacked
    q, k, v of its k steps (k (H + 2 Hkv) hd per branch and layer, sum over k < W); once: fc's output per context
    row and the normed / pre-norm outputs [N, W, D].

    Args:
        c: the drafter's config.
        n, w, ctx_rows, act: as ``drafter_activation_bytes``.

    Returns:
        (all layers' activation bytes, one layer's).
    """
    d, hq, hkv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    row = (8 * d + 3 * hq + 6 * hkv + 4 * i) * act + 4 * c.num_heads
    steps = n * (w * (w - 1) // 2) * (hq + 2 * hkv) * act
    per_layer = (ctx_rows + n * max(w - 1, 0)) * row + steps
    once = ctx_rows * d * act + 2 * n * w * d * act
    return c.num_layers * per_layer + once, per_layer


def selector_bytes(drafter, n: int, w: int, chunk: int, act: int) -> int:
    """DFlash V2's candidate selector in one step (0 for other drafters), n branches of w slots, K = selector_top_k,
    r = selector_rank: per slot the candidates' ids (8 B), raw / unary / score / softmax values and p at them (5 fp32)
    and their successor rows [K, r] (saved for backward), the hidden projection, the predecessor row and their
    product (3 r); the chunked top K's backward gathers [chunk, K, D] lm_head rows. vLLM's [N, W, K, K] pair scores
    are never built here: the walk takes one [N, K] row per slot (the row of the token drawn before) and the loss
    the row of each slot's given previous token.

    Args:
        drafter: the drafter (built on the meta device; its ``config`` gives K, r and D).
        n: branches N.
        w: drafted tokens per branch W.
        chunk: rows per loss chunk.
        act: bytes per activation element.

    Returns:
        bytes (0 for a drafter without a selector).
    """
    c = drafter.config
    if not getattr(drafter, "has_selector", False):
        return 0
    k, r = int(c.selector_top_k), int(c.selector_rank)
    return n * w * (k * (8 + 5 * 4 + r * act) + 3 * r * act) + min(chunk, n * w) * k * c.hidden_size * 4


# ---------------------------------------------------------------------------------------------- the plan
def _num_sequences(cfg) -> Optional[int]:
    """Training sequences of the recipe's data (an upper bound: held-out ones included); None when unknown
    (a prepared file that does not exist yet)."""
    d = cfg.data
    if d.source == "conversations":
        return count_records(conversations_file(d.path))
    if d.source != "prepared":
        return int(d.num_samples)
    path = d.path if os.path.isfile(d.path) else os.path.join(d.path, "data.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def memory_plan(cfg, device_bytes: Optional[int] = None) -> Optional[MemoryPlan]:
    """The plan of one GPU (one worker) for ``cfg``; None when the target's shape is unknown (see notes of
    ``target_shape``). ``device_bytes`` overrides the device memory (default: ``device_memory(cfg)``)."""
    shape, source = target_shape(cfg)
    if shape is None:
        return None
    m, t, d, r = cfg.model, cfg.trainer, cfg.data, cfg.runtime
    vp = vocab_parallel_head(cfg)  # runtime.tp_lm_head: each rank holds V / N rows of lm_head
    info = analyse_target(shape, m.dtype, r.tensor_parallel, shard_vocab=vp)
    drafter = build_meta_drafter(cfg, info)
    selector = getattr(drafter, "has_selector", False)  # DFlash V2: its walk reads top-K candidates, no gathered row
    bpe = _BYTES[m.dtype]
    on_gpu = m.device != "cpu"
    act = 2 if on_gpu else 4  # autocast bf16 on CUDA; the fp32 drafter's own dtype on the CPU
    dparams = sum(p.numel() for p in drafter.parameters())
    dbytes = 4  # master weights fp32 (the drafter is built in fp32)
    s = -(-d.batch_size // r.num_workers)
    tt, w, v, hid = d.seq_len, cfg.drafter.train_steps(drafter, t.method), info.vocab, info.hidden  # W per branch
    method = t.method
    b = t.anchors_per_seq
    n = s * b
    on_policy = method in ("specopd", "draft_opd")
    feats = len(drafter.feature_layers)
    device_type = "cuda" if on_gpu else "cpu"
    vl = info.lm_head_rows if vp else v  # the loss's vocabulary: one rank's block when split
    chunk, chunk_s = ((auto_chunk_rows(vl, device_type, CHUNK_BUDGET[device_type]),
                       auto_chunk_rows(v, device_type, CHUNK_BUDGET[device_type])) if t.loss_chunk_rows == "auto"
                      else (int(t.loss_chunk_rows),) * 2)
    chunk, chunk_s = min(chunk, n * w), min(chunk_s, n * w)
    every = m.gdn_checkpoint_every

    cache = ckpt = 0
    for x in info.mixers:
        c, k = trunk_cache_bytes(x, tt, every, bpe)
        cache, ckpt = cache + c, ckpt + k
    trunk_hidden = tt * hid * bpe  # final hidden states: p at the anchors comes from them
    nodes_per_trunk = [b * w] * s if on_policy else [0] * s
    score_extra, score_kind = score_extras(info, nodes_per_trunk, n, tt, bpe) if on_policy else (0, "none")
    dact, dlayer = drafter_activation_bytes(drafter, n, w, s * tt, act)

    def cpu_scores(tq, tk):  # CUDA runs fused attention kernels; the CPU path materialises score chunks
        return 0 if on_gpu else dense_attention_scores(info, tq, tk)

    all_, upto_score = MEMORY_PHASES, ("prefill", "propose", "score")
    head_note = (f"lm_head: [{info.lm_head_rows:,}, D] per rank = {human(info.lm_head_bytes)}, V / {r.tensor_parallel} "
                 f"rows (runtime.tp_lm_head=vocab_parallel), in the target weights" if vp else
                 f"lm_head: whole on every rank, [{v:,}, D] = "
                 + (f"{human(info.lm_head_bytes)} in the target weights " if info.lm_head_bytes else
                    "the tied embedding's weight ")
                 + f"(runtime.tp_lm_head=replicated; vocab_parallel holds V / {r.tensor_parallel} rows)")
    terms = [
        Term("target weights", info.weight_bytes, all_, None,
             f"{info.params / 1e9:.3f}B params in {m.dtype} (fp32 where the model keeps them)"
             + (f", one rank's shard of runtime.tensor_parallel={r.tensor_parallel}" if r.tensor_parallel > 1 else "")),
        Term("drafter weights (fp32)", dparams * dbytes, all_, "drafter.num_layers",
             f"{dparams / 1e6:.1f}M params x 4 B"),
        Term("drafter AdamW state", dparams * 2 * dbytes, all_, "drafter.num_layers", "exp_avg + exp_avg_sq, fp32"),
        Term("trunk caches", (cache - ckpt + trunk_hidden) * s, upto_score, "data.batch_size",
             f"{s} seq x T={tt}: per-layer executor caches (gqa K/V, qsa K/V + index keys, gdn conv inputs + "
             f"g/beta + final state, conv inputs) + final hidden [T, D]"),
    ]
    if ckpt:
        terms.append(Term("gdn state checkpoints", ckpt * s, upto_score, "model.gdn_checkpoint_every",
                          f"{s} seq x ceil(T / {every}) fp32 states per GDN layer", verb="raise"))
    terms += [
        Term("drafter features", s * tt * feats * hid * bpe, MEMORY_PHASES[:4], "data.batch_size",
             f"{s} seq x T x {feats} layers x D"),
        Term("prefill working set", forward_workset(info, tt, bpe) + cpu_scores(tt, tt), ("prefill",), "data.seq_len",
             "one trunk through one layer at a time (no grad)" + ("" if on_gpu else " + dense attention scores")),
    ]
    # SpecOPD and the off-policy baselines: one drafter forward with grad at propose, kept until the backward
    # (on the drafter's GPU with split roles); Draft-OPD drafts round by round without grad, then one forward
    # with grad in the loss phase
    keep = ("loss_backward",) if method == "draft_opd" else (
        ("propose", "loss_backward") if r.roles == "split" else ("propose", "score", "loss_backward"))
    if method == "draft_opd":
        terms.append(Term("drafter forward (no grad)", dlayer + s * tt * 2 * hid * act, ("propose",),
                          "trainer.anchors_per_seq", "one drafter layer's activations for the drafted blocks"))
    if on_policy:
        terms += [
            Term("scoring pass", forward_workset(info, n * w, bpe) + score_extra + cpu_scores(b * w, tt + b * w),
                 ("score",),
                 "trainer.anchors_per_seq",
                 f"N * W = {n * w} branch nodes through one layer (hidden states, no logits) + {score_kind}"
                 + ("" if on_gpu else " + dense attention scores of one trunk")),
        ]
    terms += [
        Term("target side hp", n * w * hid * bpe, ("score", "loss_backward"), "trainer.anchors_per_seq",
             "[N, W, D] target hidden states at the scored positions"),
        *([Term("loss / sampling chunk", CHUNK_WORKSET_FACTOR * chunk * vl * 4, ("propose", "loss_backward"),
                "trainer.loss_chunk_rows",
                f"{CHUNK_WORKSET_FACTOR} x [{chunk}, V / {r.tensor_parallel}] fp32 (vocabulary-parallel: each rank's "
                f"top K gathered as [{chunk}, {r.tensor_parallel} K], p at them reduced)")]
          if vp and selector else
          [Term("loss chunk", CHUNK_WORKSET_FACTOR * chunk * vl * 4, ("loss_backward",), "trainer.loss_chunk_rows",
                f"{CHUNK_WORKSET_FACTOR} x [{chunk}, V / {r.tensor_parallel}] fp32 (vocabulary-parallel)"),
           Term("sampling chunk", 3 * chunk_s * v * 4, ("propose",), "trainer.loss_chunk_rows",
                f"[{chunk_s}, V / {r.tensor_parallel}] local logits gathered into 2 x [{chunk_s}, V] fp32")]
          if vp else
          [Term("loss / sampling chunk", CHUNK_WORKSET_FACTOR * chunk * v * 4, ("propose", "loss_backward"),
                "trainer.loss_chunk_rows", f"{CHUNK_WORKSET_FACTOR} x [{chunk}, V] fp32")]),
        Term("drafter activations", dact, keep, "trainer.anchors_per_seq",
             f"{cfg.drafter.num_layers} layers saved for backward (" + (
                 "every context row through every layer once per trunk, N * (W - 1) step rows, the per-branch step "
                 "caches: stacked q / k / v of the steps so far" if getattr(drafter, "autoregressive", False) else
                 "block rows N * (W + 1), context once per trunk") +
             ") + the hidden state hq [N, W, D]: from the one forward at propose to the backward"),
        Term("drafter backward", dlayer + n * w * hid * act, ("loss_backward",), "trainer.anchors_per_seq",
             "one layer's activation gradients + the hq gradient [N, W, D]"),
        *([Term("candidate selector (dflash2)", selector_bytes(drafter, n, w, chunk, act), ("propose", "loss_backward"),
                "trainer.anchors_per_seq",
                f"[N, W, K] candidates (K = {drafter.config.selector_top_k}) + their [N, W, K, r] successor rows "
                f"(r = {drafter.config.selector_rank}) + [chunk, K, D] in the top K's backward; the [N, W, K, K] "
                f"pair scores are not built (one [N, K] row per slot)")]
          if getattr(drafter, "has_selector", False) else []),
        Term("drafter gradients (fp32)", dparams * dbytes, ("loss_backward", "optimizer"), "drafter.num_layers",
             "one per trainable weight"),
        Term("optimizer temporaries", 2 * dparams * dbytes, ("optimizer",), "drafter.num_layers",
             "AdamW (foreach) temporaries: sqrt(exp_avg_sq) and more (1.5x the weights measured on the CPU, "
             "torch 2.13); 2x planned"),
    ]
    if t.cache_trunks:  # every worker ends up keeping every training sequence it was ever given: all of them
        n_seq = _num_sequences(cfg)
        if n_seq is not None:
            terms.append(Term("kept trunks (cache_trunks)", n_seq * tt * (feats + 1) * hid * bpe, all_,
                              "trainer.cache_trunks", f"{n_seq} sequences x T x ({feats} feature layers + the final "
                              f"hidden) x D, on every worker", verb="turn off"))
    if on_gpu:
        terms += [
            Term("autocast weight copies", dparams * act, ("propose", "loss_backward"), "drafter.num_layers",
                 "bf16 copies of the drafter's weights during forward/backward"),
            Term("CUDA runtime", RUNTIME_OVERHEAD, all_, None, "context, cuBLAS/NCCL workspaces, allocator slack"),
        ]
    if device_bytes is None:
        dev_b, dev_src = device_memory(cfg)
    else:
        dev_b, dev_src = int(device_bytes), "given"
    notes = [head_note] if r.tensor_parallel > 1 else []
    if m.shape and not source.startswith("recipe"):
        notes.append(f"model.shape is ignored: the shape comes from {source}")
    if method == "draft_opd":
        notes.append("draft_opd: planned as B = trainer.anchors_per_seq rounds per sequence scored at once "
                     "(its rollout holds fewer branches at a time)")
    sizes = {"sequences_per_gpu": s, "seq_len": tt, "anchors_per_seq": b, "branches": n, "W": w, "vocab": v,
             "hidden": hid, "chunk_rows": chunk, "lm_head_rows": info.lm_head_rows, "lm_head_bytes": info.lm_head_bytes, "drafter_params": dparams, "target_params": info.params,
             "feature_layers": feats, "activation_bytes": act}
    if getattr(drafter, "has_selector", False):
        sizes.update(selector_top_k=int(drafter.config.selector_top_k), selector_rank=int(drafter.config.selector_rank))
    return MemoryPlan(terms, dev_b, dev_src, source, sizes, r.roles, notes)


def check_memory(cfg, device_bytes: Optional[int] = None) -> Optional[MemoryPlan]:
    """Raise ``MemoryPlanError`` when the plan's peak exceeds the device (call before any work starts).
    Returns the plan (None when the target's shape is unknown: nothing to check)."""
    p = memory_plan(cfg, device_bytes)
    if p is not None and not p.fits:
        raise MemoryPlanError(
            f"the step needs ~{_gib(p.peak)} per GPU (phase {p.peak_phase}) but the device has "
            f"{_gib(p.device_bytes)} ({p.device_source}); " + "; ".join(p.advice())
            + " (`specopd train RECIPE --dry-run` prints the plan term by term)")
    return p


def format_plan(p: MemoryPlan) -> List[str]:
    """The plan as printed by ``specopd train --dry-run`` (one line per term, then the peak)."""
    z = p.sizes
    lines = [f"memory   per GPU ({p.roles}): S={z['sequences_per_gpu']} seq x T={z['seq_len']}, "
             f"N={z['branches']} branches x W={z['W']}, V={z['vocab']:,}, loss chunk {z['chunk_rows']} rows; "
             f"shape from {p.shape_source}"]
    pb = p.phase_bytes()
    lines.append(f"  {'term':<28} {'bytes':>10}  {'phases':<36} lower with")
    for t in p.terms:
        ph = "all" if t.phases == MEMORY_PHASES else ",".join(t.phases)
        key = "-" if not t.key else (t.key if t.verb == "lower" else f"{t.key} ({t.verb})")
        lines.append(f"  {t.name:<28} {human(t.bytes):>10}  {ph:<36} {key}")
    lines.append("  by phase: " + ", ".join(f"{k} {human(v)}" for k, v in pb.items()))
    for role, (b, ph) in p.role_peaks().items():
        who = "" if role == "colocated" else f" ({role} GPU)"
        lines.append(f"  peak{who} {human(b)} in phase {ph}; device {_gib(p.device_bytes)} = "
                     f"{p.device_bytes / 1e9:.1f} GB ({p.device_source})")
    if p.fits:
        lines.append(f"  fits, {human(p.device_bytes - p.peak)} to spare")
    else:
        lines.append(f"  DOES NOT FIT by {_gib(p.peak - p.device_bytes)}: " + "; ".join(p.advice()))
    lines += [f"  note: {n}" for n in p.notes]
    return lines
