"""Drafter losses and acceptance metrics (N branches, W positions, V vocab, D hidden): the plain forms on logits
[N, W, V] and the fused forms from hidden states, chunk_rows rows of logits at a time (never [N, W, V]).
Masks, normalisation and memory: specopd/DESIGN.md ("Losses").
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from specopd_kernels import paths
from specopd_kernels.e2e_tv import cpu as tv_cpu
from specopd_kernels.layer_ops import cpu as layer_ops

# fp32 [rows, V] buffers one loss chunk holds at its peak (logits of q and p and their bf16 matmul
# outputs; softmaxes are taken in place). The memory plan and ``auto_chunk_rows`` use it.
CHUNK_WORKSET_FACTOR = 4
# Budget of one chunk's working set when ``chunk_rows="auto"`` (bytes), by device type.
# CPU: 1 GiB = 1,365 rows at V = 49,152, so a step's rows run as one chunk at the main job's shapes (512) and at
# 512-token trunks (1,024): oneDNN's bf16 lm_head matmul is faster at larger row counts, and one chunk lets the
# loss's backward read its logits back (measured: the bf16 report in benchmarks/results/).
CHUNK_BUDGET = {"cuda": 2 << 30, "cpu": 1 << 30}
# Rows per [rows, V] @ [V, D] matmul of the backward for bf16 on the CPU: torch 2.13's oneDNN runs it markedly
# slower from 384 rows on (measured: the bf16 report in benchmarks/results/).
DX_ROWS_CPU_BF16 = 341
DFLASH_POSITION_DECAY = 7.0  # released DFlash CE weights exp(-k / 7) for drafted slot k (0-based)
TTT_DECAY = 0.8  # SpecForge / EAGLE-3's training-time test: step k's loss (0-based) weighted 0.8^k
# temperature 0 of alpha: p one-hot at its argmax, q at T = 1 (alpha = q(argmax p)); see ``tv_alpha``.
GREEDY = 0.0


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for probabilities (T = 0 acceptance is exact match: "
                         f"tv_alpha's greedy form); got {temperature}")
    return torch.softmax(logits.float() / float(temperature), dim=-1)


def _mask(mask: Optional[torch.Tensor], shape, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    mask = torch.as_tensor(mask, device=device)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must be [N, W] = {list(shape)}; got {list(mask.shape)}")
    return mask.bool()


def _reduce(per_branch: torch.Tensor, has_any: torch.Tensor, denom) -> torch.Tensor:
    """per_branch [N] (0 where a branch has no valid position) -> scalar."""
    if denom is None:
        denom = has_any.sum().clamp(min=1)
    elif float(denom) <= 0:
        raise ValueError(f"denom must be > 0 (the global number of branches); got {denom}")
    return per_branch.sum() / denom


def tv_alpha(q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """alpha [N, W] = sum_v min(q, p) = 1 - TV(p, q) (rejection-sampling acceptance); grad through q only.

    ``temperature`` 0 (greedy): p is one-hot at its argmax and q stays at T = 1, so alpha = q(argmax p), the
    smooth surrogate of greedy acceptance 1[argmax q == argmax p] (``GREEDY``)."""
    if q_logits.shape != p_logits.shape:
        raise ValueError(f"q_logits {tuple(q_logits.shape)} and p_logits {tuple(p_logits.shape)} must have one "
                         f"shape [N, W, V] (same vocabulary)")
    if temperature == GREEDY:
        g = p_logits.detach().argmax(-1, keepdim=True)
        return torch.softmax(q_logits.float(), -1).gather(-1, g).squeeze(-1)
    return torch.minimum(_probs(q_logits, temperature), _probs(p_logits.detach(), temperature)).sum(-1)


def align_p_logits(anchor_logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Target logits aligned with drafter slots: slot j predicts the token after ``trunk[:a+1] + y[:j]``,
    so p[:, 0] = the trunk logits at the anchor (``cache.logits[a]``, [N, V]) and p[:, j] = scored[:, j-1]
    (``target.score`` output [N, W, V]; its last row is the bonus position and is not used here).
    The same alignment holds for hidden states ([N, D] and [N, W, D]) feeding ``fused_e2e_tv``."""
    if anchor_logits.dim() != 2 or scored.dim() != 3 or anchor_logits.shape[0] != scored.shape[0]:
        raise ValueError(f"need anchor_logits [N, V] and scored [N, W, V]; got {tuple(anchor_logits.shape)} and "
                         f"{tuple(scored.shape)}")
    return torch.cat([anchor_logits[:, None].to(scored.dtype), scored[:, :-1]], 1)


def prefix_survival(alpha: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, W]: prod_{i<=j} alpha_i on the valid prefix, 0 from the first masked position on."""
    valid = torch.cumprod(_mask(mask, alpha.shape, alpha.device).long(), dim=1).bool()
    return torch.cumprod(torch.where(valid, alpha, torch.zeros_like(alpha)), dim=1)


def acceptance_length(alpha: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expected tokens per verification round, bonus included: [N] = 1 + sum_j prod_{i<=j} alpha_i."""
    return 1.0 + prefix_survival(alpha, mask).sum(1)


expected_acceptance_length = acceptance_length


def e2e_tv_from_alpha(alpha: torch.Tensor, mask: Optional[torch.Tensor] = None, denom=None) -> torch.Tensor:
    """E2E-TV from per-position acceptances alpha [N, W] (masks, normalisation: specopd/DESIGN.md, "Losses").
    Positions of a branch meet only through these scalars, which is what lets the fused loss work one chunk of
    rows at a time."""
    valid = torch.cumprod(_mask(mask, alpha.shape, alpha.device).long(), dim=1)
    wb = valid.sum(1)
    surv = prefix_survival(alpha, valid.bool()).sum(1)
    per_branch = torch.where(wb > 0, 1.0 - surv / wb.clamp(min=1), torch.zeros_like(surv))
    return _reduce(per_branch, wb > 0, denom)


def e2e_tv_loss(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: Optional[torch.Tensor] = None,
                denom=None, temperature: float = 1.0) -> torch.Tensor:
    """E2E-TV (the expected acceptance length as a loss): mean over branches of ``1 - (1/W_b) sum_j prod_{i<=j}
    alpha_i``.

    Args:
        q_logits: [N, W, V] drafter logits (gradients flow here).
        p_logits: [N, W, V] target logits, slot-aligned (``align_p_logits``); detached.
        mask: [N, W] bool; a False position ends its branch (only the valid prefix counts).
        denom: divide the summed branch losses by this (the global branch count); None: the branches with a valid
            position.
        temperature: T > 0 of both softmaxes; 0: greedy (alpha = q(argmax p), q at T = 1; ``tv_alpha``).

    Returns:
        scalar loss.
    """
    return e2e_tv_from_alpha(tv_alpha(q_logits, p_logits, temperature), mask, denom)


def position_weights(kind, width: int, device=None) -> Optional[torch.Tensor]:
    """Per-slot CE weights [W]: None | "dflash" (released DFlash: exp(-k / 7) for drafted slot k, 0-based)
    | "ttt" (SpecForge's EAGLE-3 training-time test: 0.8^k) | a sequence / tensor of W weights."""
    if kind is None:
        return None
    if isinstance(kind, str):
        k = torch.arange(width, dtype=torch.float32, device=device)
        if kind == "ttt":
            return TTT_DECAY ** k
        if kind != "dflash":
            raise ValueError(f"position_weights must be None, 'dflash', 'ttt' or [W] weights; got {kind!r}")
        return torch.exp(-k / DFLASH_POSITION_DECAY)
    w = torch.as_tensor(kind, dtype=torch.float32, device=device)
    if tuple(w.shape) != (width,) or bool((w < 0).any()):
        raise ValueError(f"position_weights must be W = {width} non-negative weights; got {tuple(w.shape)}")
    return w


def _masked_branch_mean(values: torch.Tensor, mask, denom, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    m = _mask(mask, values.shape, values.device)
    wt = m.to(values.dtype) if weights is None else m.to(values.dtype) * weights.to(values)[None]
    cnt = wt.sum(1)
    per_branch = torch.where(m, values * wt, torch.zeros_like(values)).sum(1) / torch.where(cnt > 0, cnt, 1)
    return _reduce(per_branch, cnt > 0, denom)


def ce_loss(q_logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None,
            denom=None, weights=None) -> torch.Tensor:
    """Cross-entropy of the drafter on reference tokens: per-branch (weighted) mean of -log q(target).

    Args:
        q_logits: [N, W, V] drafter logits.
        targets: [N, W] reference tokens.
        mask: [N, W] bool; False positions are skipped.
        denom: as in ``e2e_tv_loss``.
        weights: None | "dflash" | [W] per-position weights (``position_weights``).

    Returns:
        scalar loss.
    """
    if tuple(targets.shape) != tuple(q_logits.shape[:2]):
        raise ValueError(f"targets must be [N, W] = {list(q_logits.shape[:2])}; got {list(targets.shape)}")
    nll = -torch.log_softmax(q_logits.float(), -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return _masked_branch_mean(nll, mask, denom, position_weights(weights, nll.shape[1], nll.device))


def _ttt_reduce(per_pos: torch.Tensor, mask, denom, weights) -> torch.Tensor:
    """SpecForge's TTT reduction of per-position losses [N, W]: sum over steps weighted ``weights``, over
    branches / denom (None: N, the mean over every position of a step, masked ones counting 0)."""
    m = _mask(mask, per_pos.shape, per_pos.device)
    wt = position_weights(weights, per_pos.shape[1], per_pos.device)
    per_pos = torch.where(m, per_pos, torch.zeros_like(per_pos))
    per_branch = (per_pos if wt is None else per_pos * wt[None]).sum(1)
    return _reduce(per_branch, m.any(1), per_pos.shape[0] if denom is None else denom)


def ttt_loss(q_logits: torch.Tensor, p_logits: torch.Tensor, q_ids: Optional[torch.Tensor] = None,
             mask: Optional[torch.Tensor] = None, denom=None, weights="ttt") -> torch.Tensor:
    """EAGLE-3's training-time-test loss as SpecForge trains it: at each step the soft cross-entropy
    -sum_i pt_i log q_i of the drafter against the target's distribution restricted to q's vocabulary and
    renormalised there (pt = softmax(p_logits[..., q_ids])), its gradient that of the forward KL(pt || q); positions
    whose target argmax lies outside q's vocabulary count 0 (SpecForge's position mask, t2d[argmax]).

    Args:
        q_logits: [N, W, Vq] drafter logits over its head's columns.
        p_logits: [N, W, V] the target's logits at the same positions.
        q_ids: [Vq] the target ids of q's columns (the draft vocabulary); None: Vq = V, the same ids.
        mask: [N, W] bool; False positions count 0 (no prefix rule: each step stands alone, as in SpecForge).
        denom: the global branch count; None: N.
        weights: per-step weights as in ``position_weights``; default SpecForge's 0.8^k.

    Returns:
        scalar: sum over branches and steps of weight_k * loss / denom (SpecForge's per-step mean over positions,
        the steps summed with their weights).
    """
    pf = p_logits.float()
    inside = torch.ones(pf.shape[:2], dtype=torch.bool, device=pf.device)
    if q_ids is not None:
        t2d = torch.zeros(pf.shape[-1], dtype=torch.bool, device=pf.device)
        t2d[q_ids] = True
        inside, pf = t2d[pf.argmax(-1)], pf[..., q_ids]
    soft = -(torch.softmax(pf, -1) * torch.log_softmax(q_logits.float(), -1)).sum(-1)
    return _ttt_reduce(soft, _mask(mask, soft.shape, soft.device) & inside, denom, weights)


def confidence_loss(conf_logits: torch.Tensor, alpha: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    denom=None) -> torch.Tensor:
    """DSpark's confidence head: BCE(sigmoid(conf_logits), alpha), per-branch mean over valid positions.

    Args:
        conf_logits: [N, W] confidence logits.
        alpha: [N, W] per-position acceptance probabilities (the target; detached here).
        mask: [N, W] bool; False positions are skipped.
        denom: as in ``e2e_tv_loss``.

    Returns:
        scalar loss.
    """
    if conf_logits.shape != alpha.shape:
        raise ValueError(f"conf_logits {tuple(conf_logits.shape)} and alpha {tuple(alpha.shape)} must both be [N, W]")
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), alpha.detach().float(), reduction="none")
    return _masked_branch_mean(bce, mask, denom)


# ================================================================================ fused, chunked (hidden states)
def check_chunk_rows(chunk_rows) -> None:
    """``chunk_rows`` must be "auto" or an int >= 1 (``trainer.loss_chunk_rows``)."""
    if isinstance(chunk_rows, str):
        if chunk_rows != "auto":
            raise ValueError(f"chunk_rows must be 'auto' or an integer >= 1; got {chunk_rows!r}")
        return
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an integer >= 1 (rows of [rows, V] logits per chunk) or 'auto'; "
                         f"got {chunk_rows!r} (trainer.loss_chunk_rows)")


def chunk_budget_bytes(device) -> int:
    """Budget of one chunk's working set for ``chunk_rows="auto"``: ``CHUNK_BUDGET`` for the device type,
    lowered to a quarter of the free memory when less is free (CUDA)."""
    device = torch.device(device)
    budget = CHUNK_BUDGET.get(device.type, CHUNK_BUDGET["cpu"])
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free // 4)
    return int(budget)


def auto_chunk_rows(vocab: int, device="cpu", budget_bytes: Optional[int] = None) -> int:
    """Rows per chunk so that one chunk's fp32 working set (``CHUNK_WORKSET_FACTOR`` x [rows, V]) fits
    ``budget_bytes`` (default ``chunk_budget_bytes(device)``); at least 1."""
    budget = chunk_budget_bytes(device) if budget_bytes is None else int(budget_bytes)
    return max(1, budget // (CHUNK_WORKSET_FACTOR * 4 * int(vocab)))


def even_chunk(n: int, chunk: int) -> int:
    """Rows per chunk when ``n`` rows are cut into ceil(n / chunk) chunks of near-equal size (at most ``chunk``):
    no small last chunk (a [R, V] matmul's rate falls with R). E.g. 512 rows, chunk 341 -> 256 (two chunks)."""
    if n <= 0:
        return max(1, int(chunk))
    k = -(-n // int(chunk))
    return -(-n // k)


def resolve_chunk_rows(chunk_rows, vocab: int, device) -> int:
    check_chunk_rows(chunk_rows)
    return auto_chunk_rows(vocab, device) if chunk_rows == "auto" else int(chunk_rows)


def chunk_logits(xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], rows: torch.Tensor,
                 bufs: Optional["ChunkBuffers"] = None, slot: int = 0) -> torch.Tensor:
    """fp32 logits of some rows: each product in w_k's dtype (bf16: fp32 accumulation inside the matmul), cast to
    fp32 before the sum and the softmax.

    Args:
        xs: per term, [N, K_k] hidden rows (the drafter's hidden states; DSpark adds a low-rank term).
        ws: per term, [V, K_k] weights (the lm_head).
        rows: [R] indices into N.
        bufs: write into these reused buffers instead of fresh [R, V] tensors (the same bits; on the CPU a fresh
            50 MB tensor costs page faults on every chunk); None: fresh tensors.
        slot: which of ``bufs``' fp32 buffers holds the result (the caller's other live [R, V] tensors use others).

    Returns:
        [R, V] fp32 logits = sum_k x_k[rows] @ w_k^T.
    """
    z = None
    for x, w in zip(xs, ws):
        a = x[rows].to(w.dtype)
        if bufs is None:
            t = (a @ w.t()).float()
            z = t if z is None else z.add_(t)
            continue
        n = rows.numel()
        if z is None and w.dtype == torch.float32:
            z = torch.mm(a, w.t(), out=bufs.fp32(slot, n))
            continue
        t = torch.mm(a, w.t(), out=bufs.scratch(w.dtype, n))
        z = bufs.fp32(slot, n).copy_(t) if z is None else z.add_(t)  # the fp32 cast of t is exact: same bits
    return z


class ChunkBuffers:
    """[rows, V] buffers that the chunks of one loss / sampling call reuse: ``fp32(slot, n)`` one per live fp32
    tensor of a chunk, ``scratch(dtype, n, slot)`` per dtype for products and casts (slot 0: consumed at once).
    Each is made on first use; views [n, V] of [rows, V] storage, contiguous. ``ChunkBuffers.pooled`` keeps them
    between calls on the CPU."""

    _pool = threading.local()  # per thread: {(vocab, device): ChunkBuffers} kept between calls (CPU)

    def __init__(self, rows: int, vocab: int, device):
        self.rows, self.vocab, self.device = int(rows), int(vocab), device
        self.slots, self.low = {}, {}
        self.busy = False
        self.uses = 0  # calls that have had this pooled set: a call can tell whether its buffers were reused since

    @classmethod
    @contextlib.contextmanager
    def pooled(cls, rows: int, vocab: int, device) -> Iterator["ChunkBuffers"]:
        """The buffers of one call. On the CPU, this thread's pooled set for (vocab, device), grown to ``rows``
        and kept after the call: a fresh [rows, V] tensor above glibc's mmap threshold (32 MiB) is new pages every
        call, one page fault per 4 KiB (measured: about as long as the lm_head matmul that fills it).
        Elsewhere, or while the pooled set is in use (a nested call), fresh buffers. ``release_pool`` frees them.
        Nothing a call returns may be a view of them."""
        device = torch.device(device)
        if device.type != "cpu":
            yield cls(rows, vocab, device)
            return
        pool = cls._pool.__dict__.setdefault("sets", {})
        key = (int(vocab), str(device))
        b = pool.get(key)
        if b is not None and b.busy:
            yield cls(rows, vocab, device)
            return
        if b is None or b.rows < int(rows):
            b = pool[key] = cls(rows, vocab, device)
        b.busy = True
        b.uses += 1
        try:
            yield b
        finally:
            b.busy = False

    @classmethod
    def release_pool(cls) -> None:
        """Free this thread's pooled CPU buffers."""
        cls._pool.__dict__.pop("sets", None)

    def fp32(self, slot: int, n: int) -> torch.Tensor:
        if slot not in self.slots:
            self.slots[slot] = torch.empty(self.rows, self.vocab, dtype=torch.float32, device=self.device)
        return self.slots[slot][:n]

    def scratch(self, dtype: torch.dtype, n: int, slot: int = 0) -> torch.Tensor:
        if (dtype, slot) not in self.low:
            self.low[dtype, slot] = torch.empty(self.rows, self.vocab, dtype=dtype, device=self.device)
        return self.low[dtype, slot][:n]


def raw_logits(xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], rows: torch.Tensor, bufs: "ChunkBuffers",
               slot: int, compute: bool = True) -> torch.Tensor:
    """``chunk_logits`` without the fp32 copy of a single bf16 product (the kernel reads bf16 itself).

    Args:
        xs, ws: per term, [N, K_k] hidden rows and [V, K_k] weights, as in ``chunk_logits``.
        rows: [R] indices into N.
        bufs: the call's ``ChunkBuffers``.
        slot: fp32 slot ``slot`` (or bf16 scratch slot ``slot + 1``) that holds the result.
        compute: False: return that buffer as it is (it holds these logits from an earlier call with the same
            arguments).

    Returns:
        [R, V] logits in w's dtype for one term (the values the fp32 copy would hold, exactly), fp32 for several.
    """
    n = rows.numel()
    if len(xs) != 1:
        return chunk_logits(xs, ws, rows, bufs, slot) if compute else bufs.fp32(slot, n)
    x, w = xs[0], ws[0]
    out = bufs.fp32(slot, n) if w.dtype == torch.float32 else bufs.scratch(w.dtype, n, slot + 1)
    return torch.mm(x[rows].to(w.dtype), w.t(), out=out) if compute else out


def use_tv_kernel(device, kernel_paths=None) -> bool:
    """Whether the fused E2E-TV runs alpha and its gradient through kernels/e2e_tv on ``device``: ``kernel_paths``
    (the recipe's ``kernels:`` section; None: all "auto") ``cpu_tv_loss`` is "auto" (the C kernel when it builds, else
    torch) | "cpu" (the kernel, an error if it does not build) | "torch"."""
    which = paths.mode(kernel_paths, "cpu_tv_loss")
    if which == "torch" or torch.device(device).type != "cpu":
        return False
    if which == "cpu" and not tv_cpu.available():
        raise RuntimeError(f"kernels.cpu_tv_loss=cpu but the CPU TV kernel does not build: "
                           f"{tv_cpu.unavailable_reason()}; set kernels.cpu_tv_loss=auto to use the torch path")
    return tv_cpu.available()


def softmax_(z: torch.Tensor) -> torch.Tensor:
    """In-place softmax over the last dim of fp32 z [R, V]; returns (z, logsumexp [R])."""
    m = z.amax(-1, keepdim=True)
    z.sub_(m).exp_()
    s = z.sum(-1, keepdim=True)
    z.div_(s)
    return z, (m + s.log()).squeeze(-1)


class _ChunkedHead(torch.autograd.Function):
    """Per-row statistics of q = softmax(sum_k x_k @ w_k^T / T), computed ``chunk`` rows at a time.

    Outputs for the flat rows ``rows`` [R]: alpha [R] = sum_v min(q, p) with p = softmax(hp @ wp^T / T)
    (when hp is given; T = 0: alpha = softmax(z)[g], g = argmax hp @ wp^T, kept for the backward),
    nll [R] = -log softmax(z)[target] at temperature 1 (when targets are given).
    Backward gets dL/dalpha, dL/dnll [R] and recomputes each chunk's logits (the C kernel's path reads them back
    instead when all rows were one chunk of a pooled CPU set that no call has used since):
        dalpha/dz_v = q_v (ind_v - sum_u q_u ind_u) / T,   ind = 1[q < p] + 1/2 1[q == p]  (torch.minimum's rule)
        dalpha/dz_v = alpha (1[v == g] - q_v)                                              (T = 0)
        dnll/dz_v   = softmax(z)_v - 1[v == target]
    then G [R, V] -> dx_k = G @ w_k, dw_k = G^T x_k (for the inputs that need them).
    """

    @staticmethod
    def forward(ctx, rows, chunk, temperature, hp, wp, targets, qids, kernel_paths, *xw):
        with torch.autocast(rows.device.type, enabled=False):  # precision is set here, not by autocast
            return _ChunkedHead._forward(ctx, rows, chunk, temperature, hp, wp, targets, qids, kernel_paths, *xw)

    @staticmethod
    def _forward(ctx, rows, chunk, temperature, hp, wp, targets, qids, kernel_paths, *xw):
        xs, ws = xw[0::2], xw[1::2]
        ctx.qids = qids
        dev = rows.device
        alpha = torch.zeros(rows.numel(), dtype=torch.float32, device=dev) if hp is not None else None
        nll = torch.zeros(rows.numel(), dtype=torch.float32, device=dev) if targets is not None else None
        greedy = alpha is not None and temperature == GREEDY
        gidx = torch.zeros(rows.numel(), dtype=torch.long, device=dev) if greedy else None  # argmax p
        chunk = even_chunk(rows.numel(), chunk)
        with ChunkBuffers.pooled(min(chunk, rows.numel()), ws[0].shape[0], dev) as bufs:  # slots: 0 zq, 1 p
            ctx.stats = ctx.kept = None
            # kernels/e2e_tv: alpha (and a CE term's nll when q's temperature is 1: the kernel's own softmax)
            if (alpha is not None and not greedy and (nll is None or temperature == 1.0)
                    and use_tv_kernel(dev, kernel_paths) and qids is None):
                ctx.stats = torch.empty(rows.numel(), 5, dtype=torch.float32, device=dev)  # for the backward
                for s in range(0, rows.numel(), chunk):
                    r = rows[s: s + chunk]
                    zq = raw_logits(xs, ws, r, bufs, 0)
                    alpha[s: s + chunk], ctx.stats[s: s + chunk] = tv_cpu.tv_alpha_forward(
                        zq, raw_logits((hp,), (wp,), r, bufs, 2), temperature)
                    if nll is not None:
                        nll[s: s + chunk] = tv_cpu.ce_nll(zq, ctx.stats[s: s + chunk], targets[r])
                    del zq
                # one chunk in a pooled set: the backward reads these logits back if nothing used the set since
                ctx.kept = (bufs, bufs.uses) if chunk >= rows.numel() and bufs.uses else None
            else:
                _ChunkedHead._forward_torch(rows, chunk, temperature, hp, wp, targets, xs, ws, bufs, alpha, nll, gidx,
                                            qids)
        ctx.gidx = gidx
        ctx.chunk, ctx.temperature, ctx.device_type = chunk, temperature, dev.type
        ctx.has_alpha, ctx.has_nll, ctx.n_terms = alpha is not None, nll is not None, len(xs)
        ctx.save_for_backward(rows, hp, wp, targets, *xw)
        empty = torch.zeros(0, device=dev)
        return (alpha if alpha is not None else empty), (nll if nll is not None else empty)

    @staticmethod
    def _p_chunk(hp, wp, r, bufs, slot, temperature, qids):
        """p = softmax(hp @ wp^T / T) of rows r [R, V]; with ``qids`` [Vq] its columns at those target ids [R, Vq]
        (normalised over the whole vocabulary; a fresh [R, V] then, q's buffers being Vq wide)."""
        if qids is None:
            return softmax_(chunk_logits((hp,), (wp,), r, bufs, slot=slot).div_(temperature))[0]
        return softmax_(chunk_logits((hp,), (wp,), r).div_(temperature))[0][:, qids]

    @staticmethod
    def _p_argmax(hp, wp, r, bufs, qids):
        """argmax p of rows r [R]: a target id, or with ``qids`` its column in q (-1 when q has no such column)."""
        if qids is None:
            return chunk_logits((hp,), (wp,), r, bufs, slot=1).argmax(-1)
        g = chunk_logits((hp,), (wp,), r).argmax(-1)
        col = torch.full((wp.shape[0],), -1, dtype=torch.long, device=g.device)
        col[qids] = torch.arange(qids.numel(), device=g.device)
        return col[g]

    @staticmethod
    def _forward_torch(rows, chunk, temperature, hp, wp, targets, xs, ws, bufs, alpha, nll, gidx, qids=None):
        """The forward's chunks in torch ops (alpha, nll, greedy alpha; written into alpha / nll / gidx)."""
        greedy = gidx is not None
        tq = 1.0 if greedy else temperature  # q's temperature in alpha
        for s in range(0, rows.numel(), chunk):
            r = rows[s: s + chunk]
            zq = chunk_logits(xs, ws, r, bufs, slot=0)  # [R, V] fp32
            if nll is not None:
                t = targets[r].long()
                zt = zq.gather(1, t[:, None]).squeeze(1)
                if alpha is None or tq == 1.0:
                    q, lse = softmax_(zq)
                else:
                    lse = torch.logsumexp(zq, -1)
                nll[s: s + chunk] = lse - zt
            if alpha is not None:
                if nll is None or tq != 1.0:
                    q, _ = softmax_(zq.div_(tq))
                if greedy:
                    g = _ChunkedHead._p_argmax(hp, wp, r, bufs, qids)  # [R]
                    gidx[s: s + chunk] = g
                    alpha[s: s + chunk] = torch.where(g >= 0, q.gather(1, g.clamp_min(0)[:, None]).squeeze(1), 0.0)
                else:
                    p = _ChunkedHead._p_chunk(hp, wp, r, bufs, 1, temperature, qids)
                    alpha[s: s + chunk] = torch.minimum(q, p, out=p).sum(-1)
                    del p
            del zq

    @staticmethod
    def backward(ctx, g_alpha, g_nll):
        with torch.autocast(ctx.device_type, enabled=False):
            return _ChunkedHead._backward(ctx, g_alpha, g_nll)

    @staticmethod
    def _backward(ctx, g_alpha, g_nll):
        rows, hp, wp, targets, *xw = ctx.saved_tensors
        xs, ws = xw[0::2], xw[1::2]
        need = ctx.needs_input_grad[8:]  # after rows .. kernel_paths
        dx = [torch.zeros_like(x) if need[2 * k] else None for k, x in enumerate(xs)]
        dw = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need[2 * k + 1] else None
              for k, w in enumerate(ws)]
        T = ctx.temperature
        use_a = ctx.has_alpha and g_alpha is not None and bool(g_alpha.ne(0).any())
        use_n = ctx.has_nll and g_nll is not None and bool(g_nll.ne(0).any())
        if (use_a or use_n) and any(n for n in need):
            with ChunkBuffers.pooled(min(ctx.chunk, rows.numel()), ws[0].shape[0], rows.device) as bufs:
                # slots: 0 z, 1 g, 2 p
                for s in range(0, rows.numel(), ctx.chunk):
                    r = rows[s: s + ctx.chunk]
                    if ctx.stats is not None:  # kernels/e2e_tv, from the forward's stats (+ the CE term at T = 1)
                        kept = ctx.kept is not None and ctx.kept[0] is bufs and bufs.uses == ctx.kept[1] + 1
                        g = _ChunkedHead._grad_kernel(ctx, r, s, hp, wp, xs, ws, dw, bufs,
                                                      g_alpha if use_a else None,
                                                      (g_nll, targets) if use_n else None, recompute=not kept)
                        _ChunkedHead._grad_inputs(g, r, xs, ws, dx, dw, bufs)
                        del g
                        continue
                    z = chunk_logits(xs, ws, r, bufs, slot=0)  # [R, V] fp32 raw logits
                    g = None
                    if use_n:  # (softmax(z) - onehot) * dL/dnll
                        g = bufs.fp32(1, r.numel()).copy_(z) if use_a else z
                        softmax_(g)
                        g[torch.arange(r.numel(), device=g.device), targets[r].long()] -= 1.0
                        g.mul_(g_nll[s: s + ctx.chunk, None])
                    if use_a and ctx.gidx is not None:  # T = 0: alpha (onehot(g) - q) * dL/dalpha
                        q, _ = softmax_(z)
                        gi = ctx.gidx[s: s + ctx.chunk]
                        ar = torch.arange(r.numel(), device=q.device)
                        coef = torch.where(gi >= 0, q[ar, gi.clamp_min(0)], 0.0) * g_alpha[s: s + ctx.chunk]
                        gi = gi.clamp_min(0)  # a column q lacks (-1): coef 0 there
                        ga = q.mul_(-coef[:, None])
                        ga[ar, gi] += coef
                        g = ga if g is None else g.add_(ga)
                        del q
                    elif use_a:  # q (ind - <q, ind>) * dL/dalpha / T
                        q, _ = softmax_(z.div_(T))
                        p = _ChunkedHead._p_chunk(hp, wp, r, bufs, 2, T, ctx.qids)
                        # ind = 1[q < p] + 1/2 1[q == p] = (sign(p - q) + 1) / 2, in p's storage (p - q == 0 iff p == q)
                        ind = p.sub_(q).sign_().add_(1.0).mul_(0.5)  # [R, V]
                        qi = torch.mul(q, ind, out=bufs.scratch(torch.float32, r.numel())).sum(-1)  # <q, ind> [R]
                        ga = ind.sub_(qi[:, None]).mul_(q).mul_(g_alpha[s: s + ctx.chunk, None] / T)
                        g = ga if g is None else g.add_(ga)
                        del q, ind, p
                    _ChunkedHead._grad_inputs(g, r, xs, ws, dx, dw, bufs)
                    del g, z
        ctx.kept = None
        grads = []
        for k in range(len(xs)):
            grads += [dx[k], None if dw[k] is None else dw[k].to(ws[k].dtype)]
        return (None, None, None, None, None, None, None, None, *grads)

    @staticmethod
    def _grad_kernel(ctx, r, s, hp, wp, xs, ws, dw, bufs, g_alpha, ce=None, recompute=True):
        """dL/dz [R, V] of one chunk by kernels/e2e_tv: fp32 over z itself when z is fp32; else (one bf16 term)
        in w's dtype, what ``_grad_inputs`` multiplies by, unless the weight needs its fp32 gradient.
        ce: (dL/dnll [rows], targets [all rows]) of a CE term, or None. recompute: False when ``bufs`` still holds
        the forward's logits of these rows (the same bits: the same matmuls)."""
        n = r.numel()
        z = raw_logits(xs, ws, r, bufs, 0, compute=recompute)
        zp = raw_logits((hp,), (wp,), r, bufs, 2, compute=recompute)
        if z.dtype == torch.float32:
            out = z
        else:
            out = bufs.scratch(z.dtype, n, 5) if dw[0] is None else bufs.fp32(1, n)
        gn, tg = (None, None) if ce is None else (ce[0][s: s + n], ce[1][r])
        ga = g_alpha[s: s + n] if g_alpha is not None else torch.zeros(n, dtype=torch.float32, device=z.device)
        return tv_cpu.tv_alpha_backward(z, zp, ctx.temperature, ctx.stats[s: s + n], ga, out, grad_nll=gn,
                                        targets=tg)

    @staticmethod
    def _grad_inputs(g, r, xs, ws, dx, dw, bufs):
        """dx_k[r] = G @ w_k, dw_k += G^T x_k[r] for one chunk's G = dL/dz [R, V]."""
        for k, (x, w) in enumerate(zip(xs, ws)):
            if dx[k] is not None:
                gl = g if w.dtype == g.dtype else bufs.scratch(w.dtype, r.numel()).copy_(g)  # g.to(w.dtype)
                n, step = r.numel(), r.numel()
                if gl.device.type == "cpu" and gl.dtype == torch.bfloat16:
                    step = even_chunk(n, DX_ROWS_CPU_BF16)
                for s in range(0, n, step):
                    dx[k][r[s: s + step]] = (gl[s: s + step] @ w).to(dx[k].dtype)
            if dw[k] is not None:
                dw[k].add_(g.t() @ x[r].float())  # fp32 accumulation over chunks


def _split_argmax(z: torch.Tensor, lo: int, tp, gmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.argmax's rule over a vocabulary split across ``tp``: the first index of each row's maximum, i.e. the
    smallest global index among the ranks holding the global maximum. z [R, V / N] this rank's logits (columns
    lo ..); gmax [R] the rows' global maxima when already reduced. Returns [R] global ids, the same on every rank."""
    li = z.argmax(-1)
    if gmax is None:
        gmax = tp.all_reduce_(z.amax(-1), "max")
    gi = torch.where(z.gather(1, li[:, None]).squeeze(1) == gmax, li + lo, torch.iinfo(torch.long).max)
    return tp.all_reduce_(gi, "min")


class _VocabParallelHead(torch.autograd.Function):
    """``_ChunkedHead``'s alpha and nll over a vocabulary split across the ranks of ``tp`` (equal blocks): each rank
    holds rows [first, end) of the lm_head and computes [R, V / N] logits per chunk, never [R, V]. Per chunk the
    forward all-reduces the row maxima of q and p (max), then the sums of exp and the target's logit (sum; its owner
    alone adds it), then the partial sums of min(q, p) (T = 0: the min index of the global argmax first, torch's
    first-maximum rule), so every rank gets the same alpha and nll. The backward reuses the forward's row statistics,
    all-reduces <q, ind> per chunk and sums the partial dx = G_loc @ w_loc once over the group (fp32). A weight that
    covers the whole vocabulary (DSpark's W2, a replicated drafter weight: ``full``) is cut here and the rows of its
    gradient gathered, so every rank holds the same gradient. Torch ops only: kernels/e2e_tv reads whole rows."""

    @staticmethod
    def forward(ctx, rows, chunk, temperature, hp, wp, targets, tp, full, *xw):
        with torch.autocast(rows.device.type, enabled=False):  # precision is set here, not by autocast
            return _VocabParallelHead._forward(ctx, rows, chunk, temperature, hp, wp, targets, tp, full, *xw)

    @staticmethod
    def _local(ws, full, tp):
        """The local block of every weight (ws[0] is the lm_head's block), and its (first, end)."""
        lo, hi = tp.vocab_block(ws[0].shape[0] * tp.size)
        return [w[lo:hi] if f else w for w, f in zip(ws, full)], lo, hi

    @staticmethod
    def _forward(ctx, rows, chunk, temperature, hp, wp, targets, tp, full, *xw):
        xs = xw[0::2]
        ws, lo, hi = _VocabParallelHead._local(xw[1::2], full, tp)
        dev, n, vl = rows.device, rows.numel(), hi - lo
        has_a, has_n = hp is not None, targets is not None
        greedy = has_a and temperature == GREEDY
        tq = 1.0 if greedy else float(temperature)  # q's temperature in alpha
        sep = has_n and has_a and tq != 1.0  # the nll's softmax (T = 1) differs from q's
        alpha = torch.zeros(n, dtype=torch.float32, device=dev) if has_a else None
        nll = torch.zeros(n, dtype=torch.float32, device=dev) if has_n else None
        gidx = torch.zeros(n, dtype=torch.long, device=dev) if greedy else None
        stats = torch.zeros(n, 6, dtype=torch.float32, device=dev)  # m1, s1 (T = 1), mq, sq (q at T), mp, sp
        chunk = even_chunk(n, chunk)
        with ChunkBuffers.pooled(min(chunk, n), vl, dev) as bufs:  # slots: 0 zq, 1 zp, 2 exp at T = 1
            for s in range(0, n, chunk):
                r = rows[s: s + chunk]
                k = r.numel()
                zq = chunk_logits(xs, ws, r, bufs, slot=0)  # [R, V / N] fp32
                zp = chunk_logits((hp,), (wp,), r, bufs, slot=1) if has_a else None
                if has_a and not greedy:
                    zp.div_(tq)
                mx = torch.stack([zq.amax(-1), zp.amax(-1) if has_a else zq.new_zeros(k)], 1)
                tp.all_reduce_(mx, "max")
                m1, mp = mx[:, 0], mx[:, 1]  # max(z / T) = max(z) / T: x -> x / T is monotone
                if greedy:  # the first index of p's maximum over the whole vocabulary
                    gidx[s: s + k] = _split_argmax(zp, lo, tp, mp)
                sm = zq.new_zeros(k, 5)  # s1, sq, sp, the target's logit, exp(zq - m1) at argmax p
                if has_n:
                    t = targets[r].long() - lo
                    own = (t >= 0) & (t < vl)
                    sm[:, 3] = torch.where(own, zq.gather(1, t.clamp(0, vl - 1)[:, None]).squeeze(1), 0.0)
                if sep:
                    sm[:, 0] = torch.sub(zq, m1[:, None], out=bufs.fp32(2, k)).exp_().sum(-1)
                mq = m1 / tq if tq != 1.0 else m1
                if tq != 1.0:
                    zq.div_(tq)
                eq = zq.sub_(mq[:, None]).exp_()  # q's numerators (T = 1: also the nll's)
                sm[:, 1] = eq.sum(-1)
                if not sep:
                    sm[:, 0] = sm[:, 1]
                if has_a and not greedy:
                    sm[:, 2] = zp.sub_(mp[:, None]).exp_().sum(-1)
                if greedy:
                    gl = gidx[s: s + k] - lo
                    own = (gl >= 0) & (gl < vl)
                    sm[:, 4] = torch.where(own, eq.gather(1, gl.clamp(0, vl - 1)[:, None]).squeeze(1), 0.0)
                tp.all_reduce_(sm, "sum")
                stats[s: s + k] = torch.stack([m1, sm[:, 0], mq, sm[:, 1], mp, sm[:, 2]], 1)
                if has_n:
                    nll[s: s + k] = m1 + sm[:, 0].log() - sm[:, 3]
                if greedy:
                    alpha[s: s + k] = sm[:, 4] / sm[:, 1]
                elif has_a:
                    q, p = eq.div_(sm[:, 1:2]), zp.div_(sm[:, 2:3])
                    alpha[s: s + k] = tp.all_reduce_(torch.minimum(q, p, out=p).sum(-1), "sum")
                del zq, zp
        ctx.stats, ctx.gidx, ctx.tp, ctx.full, ctx.lo = stats, gidx, tp, full, lo
        ctx.chunk, ctx.temperature, ctx.device_type = chunk, temperature, dev.type
        ctx.has_alpha, ctx.has_nll = has_a, has_n
        ctx.save_for_backward(rows, hp, wp, targets, alpha, *xw)
        empty = torch.zeros(0, device=dev)
        return (alpha if alpha is not None else empty), (nll if nll is not None else empty)

    @staticmethod
    def backward(ctx, g_alpha, g_nll):
        with torch.autocast(ctx.device_type, enabled=False):
            return _VocabParallelHead._backward(ctx, g_alpha, g_nll)

    @staticmethod
    def _backward(ctx, g_alpha, g_nll):
        rows, hp, wp, targets, alpha, *xw = ctx.saved_tensors
        xs, tp, full, lo = xw[0::2], ctx.tp, ctx.full, ctx.lo
        ws, _, hi = _VocabParallelHead._local(xw[1::2], full, tp)
        need = ctx.needs_input_grad[8:]
        dx = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need[2 * k] else None
              for k, x in enumerate(xs)]  # partial sums, reduced in fp32
        dw = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need[2 * k + 1] else None
              for k, w in enumerate(ws)]
        T, vl, dev = ctx.temperature, hi - lo, rows.device
        use_a = ctx.has_alpha and g_alpha is not None and bool(g_alpha.ne(0).any())
        use_n = ctx.has_nll and g_nll is not None and bool(g_nll.ne(0).any())
        if (use_a or use_n) and any(need):
            with ChunkBuffers.pooled(min(ctx.chunk, rows.numel()), vl, dev) as bufs:  # slots: 0 z, 1 g, 2 p
                for s in range(0, rows.numel(), ctx.chunk):
                    r = rows[s: s + ctx.chunk]
                    k, ar = r.numel(), torch.arange(r.numel(), device=dev)
                    m1, s1, mq, sq, mp, sp = ctx.stats[s: s + k, :, None].unbind(1)  # [R, 1] each
                    z = chunk_logits(xs, ws, r, bufs, slot=0)  # [R, V / N] fp32 raw logits
                    g = None
                    if use_n:  # (softmax(z) - onehot) * dL/dnll, the onehot on the target's owner
                        g = bufs.fp32(1, k).copy_(z) if use_a else z
                        g.sub_(m1).exp_().div_(s1)
                        t = targets[r].long() - lo
                        own = (t >= 0) & (t < vl)
                        g[ar[own], t[own]] -= 1.0
                        g.mul_(g_nll[s: s + k, None])
                    if use_a and ctx.gidx is not None:  # T = 0: alpha (onehot(g) - q) * dL/dalpha
                        q = z.sub_(m1).exp_().div_(s1)
                        coef = alpha[s: s + k] * g_alpha[s: s + k]
                        ga = q.mul_(-coef[:, None])
                        gl = ctx.gidx[s: s + k] - lo
                        own = (gl >= 0) & (gl < vl)
                        ga[ar[own], gl[own]] += coef[own]
                        g = ga if g is None else g.add_(ga)
                    elif use_a:  # q (ind - <q, ind>) * dL/dalpha / T, <q, ind> summed over the group
                        if T != 1.0:
                            z.div_(T)
                        q = z.sub_(mq).exp_().div_(sq)
                        zp = chunk_logits((hp,), (wp,), r, bufs, slot=2)
                        if T != 1.0:
                            zp.div_(T)
                        p = zp.sub_(mp).exp_().div_(sp)
                        ind = p.sub_(q).sign_().add_(1.0).mul_(0.5)  # 1[q < p] + 1/2 1[q == p], in p's storage
                        qi = tp.all_reduce_(torch.mul(q, ind, out=bufs.scratch(torch.float32, k)).sum(-1), "sum")
                        ga = ind.sub_(qi[:, None]).mul_(q).mul_(g_alpha[s: s + k, None] / T)
                        g = ga if g is None else g.add_(ga)
                        del q, ind, p
                    _ChunkedHead._grad_inputs(g, r, xs, ws, dx, dw, bufs)
                    del g, z
        # every rank runs the same collectives: the branches above depend on values equal on every rank
        parts = [d for d in dx if d is not None]
        if parts:
            flat = tp.all_reduce_(torch.cat([d.reshape(-1) for d in parts]), "sum")
            off = 0
            for d in parts:
                d.view(-1).copy_(flat[off: off + d.numel()])
                off += d.numel()
        grads = []
        for k in range(len(xs)):
            gw = dw[k]
            if gw is not None and full[k]:
                gw = tp.gather_rows(gw)  # [V, K]: every rank's rows
            grads += [None if dx[k] is None else dx[k].to(xs[k].dtype),
                      None if gw is None else gw.to(xw[2 * k + 1].dtype)]
        return (None,) * 8 + tuple(grads)


class FusedOut(NamedTuple):
    """loss: scalar (with grad); alpha: [N, W] fp32, detached (0 past a branch's valid prefix, or None when
    no target side was given); nll: [N, W] detached per-position CE (None for E2E-TV)."""
    loss: torch.Tensor
    alpha: Optional[torch.Tensor]
    nll: Optional[torch.Tensor] = None


def _flat_terms(hq, weight, markov, vocab=None):
    """[(x [N*W, K], w [V, K])] for hq (and DSpark's low-rank term), with shape checks. ``vocab``: the whole
    vocabulary when ``weight`` is one rank's block of it (W2 still covers it all)."""
    if hq.dim() != 3:
        raise ValueError(f"hq must be the drafter's final hidden state [N, W, D]; got {tuple(hq.shape)}")
    n, w, d = hq.shape
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be the lm_head weight [V, D = {d}]; got {tuple(weight.shape)}")
    terms = [hq.reshape(n * w, d), weight]
    if markov is not None:
        e, w2 = markov
        v = weight.shape[0] if vocab is None else vocab
        if e.dim() != 3 or tuple(e.shape[:2]) != (n, w) or w2.dim() != 2 or w2.shape != (v, e.shape[2]):
            raise ValueError(f"markov=(e [N, W, r], w2 [V, r]) with N, W = {n}, {w}, V = {v}; got "
                             f"{tuple(e.shape)} and {tuple(w2.shape)}")
        terms += [e.reshape(n * w, e.shape[2]), w2]
    return terms


def _target_side(hp, p_weight, weight, n, w):
    if hp is None:
        return None, None
    if tuple(hp.shape[:2]) != (n, w) or hp.shape[-1] != (p_weight if p_weight is not None else weight).shape[1]:
        raise ValueError(f"hp must be the target's hidden state at the scored positions [N, W, D] = [{n}, {w}, "
                         f"{weight.shape[1]}]; got {tuple(hp.shape)}")
    return hp.detach().reshape(n * w, hp.shape[-1]), (weight if p_weight is None else p_weight).detach()


def _run_head(hq, weight, markov, rows_mask, chunk_rows, temperature, hp=None, p_weight=None, targets=None,
              tp=None, q_ids=None, kernel_paths=None):
    n, w = hq.shape[:2]
    vp = tp is not None and tp.size > 1
    if q_ids is not None and (vp or markov is not None or p_weight is None):
        raise ValueError("q on a draft vocabulary (q_ids) needs the target's p_weight, and takes no Markov term or "
                         "vocabulary-parallel head")
    if vp:  # weight and p_weight are this rank's block of the vocabulary
        tp.vocab_block(weight.shape[0] * tp.size)
    terms = _flat_terms(hq, weight, markov, weight.shape[0] * tp.size if vp else None)
    hpf, wp = _target_side(hp, p_weight, weight, n, w)
    if vp and wp is not None and wp.shape[0] != weight.shape[0]:
        raise ValueError(f"p_weight must be this rank's block of the vocabulary like weight ({weight.shape[0]} rows); "
                         f"got {tuple(wp.shape)}")
    chunk = resolve_chunk_rows(chunk_rows, weight.shape[0], hq.device)
    if hp is not None and temperature < 0:
        raise ValueError(f"temperature must be > 0 for alpha, or 0 for its greedy form (alpha = q(argmax p)); "
                         f"got {temperature}")
    rows = torch.nonzero(rows_mask.reshape(-1)).flatten()
    tflat = None if targets is None else targets.reshape(-1).to(hq.device)
    if vp:
        full = (False,) + (True,) * (len(terms) // 2 - 1)  # the lm_head's block; DSpark's W2 whole
        a, nl = _VocabParallelHead.apply(rows, chunk, float(temperature), hpf, wp, tflat, tp, full, *terms)
    else:
        a, nl = _ChunkedHead.apply(rows, chunk, float(temperature), hpf, wp, tflat,
                                   None if q_ids is None else q_ids.to(hq.device), kernel_paths, *terms)
    alpha = nll = None
    if hp is not None:
        alpha = torch.zeros(n * w, dtype=torch.float32, device=hq.device).index_put((rows,), a).view(n, w)
    if targets is not None:
        nll = torch.zeros(n * w, dtype=torch.float32, device=hq.device).index_put((rows,), nl).view(n, w)
    return alpha, nll


def fused_e2e_tv(hq: torch.Tensor, weight: torch.Tensor, hp: torch.Tensor, *, p_weight: Optional[torch.Tensor] = None,
                 markov=None, mask: Optional[torch.Tensor] = None, denom=None, temperature: float = 1.0,
                 chunk_rows="auto", ce_targets: Optional[torch.Tensor] = None, ce_weight: float = 0.0,
                 tp=None, q_ids: Optional[torch.Tensor] = None, kernel_paths=None,
                 ce_mask: Optional[torch.Tensor] = None) -> FusedOut:
    """E2E-TV from hidden states, equal to ``e2e_tv_loss(q_logits, p_logits, mask, denom, temperature)`` with
    ``q_logits = hq @ weight^T (+ e @ w2^T)`` and ``p_logits = hp @ p_weight^T``, never materialising [N, W, V];
    with ``ce_weight`` > 0, plus ``ce_weight * ce_loss(q_logits, ce_targets, mask, denom)`` from the same pass.

    Args:
        hq: [N, W, D] the drafter's final (normed) hidden state, with grad.
        weight: [V, D] the frozen lm_head shared by drafter and target (a gradient only if it requires one).
        hp: [N, W, D] the target's hidden state before lm_head at the scored positions, slot-aligned; detached.
        p_weight: [V, D] the target's lm_head when it differs from ``weight`` (default: ``weight``).
        markov: DSpark's low-rank term ``(e [N, W, r], w2 [V, r])``, e = W1[x_prev]; both get gradients.
        mask: [N, W] bool; False ends the branch (positions after it are not computed).
        denom: as in ``e2e_tv_loss``.
        temperature: T > 0 of both softmaxes; 0: greedy (alpha = q(argmax p), q at T = 1; ``tv_alpha``).
        chunk_rows: rows of [rows, V] logits per chunk, or "auto" (``auto_chunk_rows``).
        ce_targets: [N, W] reference tokens, the labels of the CE term (needed when ``ce_weight`` > 0).
        ce_weight: the CE term's weight (q at T = 1, uniform over the valid prefix's positions); 0: none.
        tp: the tensor-parallel group the vocabulary is split over (``specopd.models.tensor_parallel.vocab_group``):
            then ``weight`` and ``p_weight`` are this rank's block [V / N, D] (W2 stays [V, r]), the softmaxes and
            alpha are reduced over the group, and every rank returns the same loss and gradients; None: whole.
        q_ids: [Vq] the target ids of ``weight``'s rows when q lives on a draft vocabulary (EAGLE-3's head): alpha =
            sum_i min(q_i, p[q_ids[i]]) with p over the whole vocabulary (``p_weight`` required); ``ce_targets``
            are then columns of q.
        kernel_paths: the recipe's ``kernels:`` section (its ``cpu_tv_loss``: ``use_tv_kernel``); None: all "auto".
        ce_mask: [N, W] bool, the positions the CE term counts within the valid prefix (a draft vocabulary: labels
            q has a column for); None: all of it.

    Returns:
        ``FusedOut(loss, alpha, nll)``: the scalar loss, alpha [N, W] fp32 detached (0 past a branch's valid
        prefix), which feeds the metrics and the confidence loss with no second TV pass, and the CE term's nll
        [N, W] (None without it).
    """
    n, w = hq.shape[:2]
    valid = torch.cumprod(_mask(mask, (n, w), hq.device).long(), dim=1).bool()
    if ce_weight < 0:
        raise ValueError(f"ce_weight must be >= 0; got {ce_weight}")
    if ce_weight > 0 and (ce_targets is None or tuple(ce_targets.shape) != (n, w)):
        raise ValueError(f"ce_weight > 0 needs ce_targets [N, W] = [{n}, {w}] (the reference tokens); got "
                         f"{None if ce_targets is None else list(ce_targets.shape)}")
    alpha, nll = _run_head(hq, weight, markov, valid, chunk_rows, temperature, hp=hp, p_weight=p_weight,
                           targets=ce_targets if ce_weight > 0 else None, tp=tp, q_ids=q_ids,
                           kernel_paths=kernel_paths)
    loss = e2e_tv_from_alpha(alpha, valid, denom)
    if nll is not None:
        ce_rows = valid if ce_mask is None else valid & _mask(ce_mask, (n, w), hq.device)
        loss = loss + ce_weight * _masked_branch_mean(nll, ce_rows, denom)
    return FusedOut(loss, alpha.detach(), None if nll is None else nll.detach())


def fused_ce(hq: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, markov=None,
             mask: Optional[torch.Tensor] = None, denom=None, weights=None, hp: Optional[torch.Tensor] = None,
             p_weight: Optional[torch.Tensor] = None, temperature: float = 1.0, chunk_rows="auto",
             tp=None, q_ids: Optional[torch.Tensor] = None, kernel_paths=None) -> FusedOut:
    """Off-policy CE from hidden states, equal to ``ce_loss(q_logits, targets, mask, denom, weights)`` (q at T = 1).

    Args:
        hq: [N, W, D] the drafter's final hidden state, with grad.
        weight: [V, D] the frozen lm_head.
        targets: [N, W] reference tokens.
        markov: DSpark's ``(e [N, W, r], w2 [V, r])``, as in ``fused_e2e_tv``.
        mask: [N, W] bool; rows with mask False are not computed.
        denom: as in ``e2e_tv_loss``.
        weights: None | "dflash" | [W] (``position_weights``).
        hp: [N, W, D] the target side, as in ``fused_e2e_tv``: then the same pass also returns alpha (no gradient).
        p_weight: [V, D] the target's lm_head when it differs from ``weight``.
        temperature: T of alpha (the CE itself is at T = 1).
        chunk_rows: rows per chunk, or "auto".
        tp: the group the vocabulary is split over, as in ``fused_e2e_tv`` (the target's logit on its owner).
        q_ids: as in ``fused_e2e_tv`` (``targets`` are then columns of q).
        kernel_paths: as in ``fused_e2e_tv`` (alpha's path when ``hp`` is given).

    Returns:
        ``FusedOut(loss, alpha)``; alpha [N, W] when ``hp`` is given, else None.
    """
    n, w = hq.shape[:2]
    if tuple(targets.shape) != (n, w):
        raise ValueError(f"targets must be [N, W] = [{n}, {w}]; got {list(targets.shape)}")
    m = _mask(mask, (n, w), hq.device)
    alpha, nll = _run_head(hq, weight, markov, m, chunk_rows, temperature, hp=hp, p_weight=p_weight, targets=targets,
                           tp=tp, q_ids=q_ids, kernel_paths=kernel_paths)
    loss = _masked_branch_mean(nll, m, denom, position_weights(weights, w, hq.device))
    return FusedOut(loss, None if alpha is None else alpha.detach(), nll.detach())


class _DnnHead:
    """One fp32 head term's products through oneDNN (``kernels.cpu_linear=all``, as the fp32 linear layers): z = x @
    w^T, dx = g @ w and dw = g^T @ x, each weight reordered once (w and w^T per loss call, x^T per chunk). On this
    AMD CPU oneDNN's fp32 runs well above torch.mm's (MKL); its sums run in another order (not torch.mm's bits)."""

    def __init__(self, xs, ws):
        self.x, self.w = xs[0], ws[0]
        self.packs = {}

    @staticmethod
    def maybe(xs, ws, kernel_paths) -> Optional["_DnnHead"]:
        """A ``_DnnHead`` when the recipe asks (``cpu_linear=all``) and oneDNN takes this one fp32 term here, else
        None (torch.mm)."""
        if len(xs) != 1 or paths.mode(kernel_paths, "cpu_linear") != "all" or \
                not layer_ops.linear_enabled(xs[0], ws[0], kernel_paths=kernel_paths) or ws[0].dtype != torch.float32:
            return None
        return _DnnHead(xs, ws)

    def _pack(self, key, w):
        if key not in self.packs:
            self.packs[key] = layer_ops.PackedWeight().get(w.detach().contiguous())
        return self.packs[key]

    def logits(self, r) -> torch.Tensor:
        """z [R, V] fp32 of rows r."""
        return layer_ops.linear(self.x[r], self._pack("w", self.w))

    def grad_inputs(self, g, r, dx, dw) -> None:
        """dx[r] = g @ w, dw += g^T @ x[r] for one chunk's g [R, V] (as ``_ChunkedHead._grad_inputs``)."""
        if dx[0] is not None:
            dx[0][r] = layer_ops.linear(g, self._pack("wt", self.w.t()))
        if dw[0] is not None:
            dw[0].add_(layer_ops.linear(g.t(), layer_ops.PackedWeight().get(self.x[r].detach().t().contiguous())))


class _SoftTargetHead(torch.autograd.Function):
    """``ttt_loss``'s rows chunk by chunk: q = softmax(sum_k x_k @ w_k^T) [R, Vq], the target's logits
    zp = hp @ wp^T [R, V] (one [chunk, V] per chunk, made once: the loss, alpha and the gradient share it),
    pt = softmax(zp[:, qids]).
    Outputs for the flat rows ``rows`` [R]: soft [R] = lse(z) - <pt, z> (0 where argmax zp is not among qids),
    alpha [R] = sum_i min(q_i, p[qids_i]) at ``temperature`` (0: q(argmax p)), no gradient.
    dsoft/dz = softmax(z) - pt; then the inputs' gradients as ``_ChunkedHead``. With ``coef`` [R] (the gradient the
    caller's reduction will send soft) the forward computes them in the same pass from the chunk it already holds,
    and the backward returns them when the gradient that arrives is ``coef`` bit for bit; otherwise (or without
    ``coef``) the backward recomputes each chunk (the logits twice more, the target's too).
    ``kernel_paths``' ``cpu_linear=all`` runs the three fp32 head products (z, dx, dw) through oneDNN
    (``_DnnHead``; within fp32 rounding of torch.mm, not its bits), as it does the fp32 linear layers."""

    @staticmethod
    def forward(ctx, rows, chunk, temperature, hp, wp, qids, coef, kernel_paths, *xw):
        need = ctx.needs_input_grad[8:]
        with torch.autocast(rows.device.type, enabled=False):
            xs, ws = xw[0::2], xw[1::2]
            ctx.dnn = _DnnHead.maybe(xs, ws, kernel_paths)
            n = rows.numel()
            soft = torch.zeros(n, dtype=torch.float32, device=rows.device)
            alpha = torch.zeros_like(soft)
            chunk = even_chunk(n, chunk)
            early = coef is not None and any(need)
            dx, dw = _SoftTargetHead._grad_buffers(xs, ws, need) if early else (None, None)
            with ChunkBuffers.pooled(min(chunk, n), ws[0].shape[0], rows.device) as bufs:  # 0 z, 1 zp, 2-3 alpha
                for s in range(0, n, chunk):
                    r = rows[s: s + chunk]
                    z = chunk_logits(xs, ws, r, bufs, slot=0) if ctx.dnn is None else ctx.dnn.logits(r)
                    zp = chunk_logits((hp,), (wp,), r, *((bufs, 1) if qids is None else ()))
                    pt, col = _SoftTargetHead._soft_target(zp, wp, qids)
                    pz = torch.mul(pt, z, out=bufs.fp32(2, r.numel())).sum(-1)  # = (pt * z).sum(-1), in a kept buffer
                    soft[s: s + chunk] = torch.where(col >= 0, torch.logsumexp(z, -1) - pz, 0.0)
                    q1 = None  # softmax(z) at T = 1: greedy alpha's q, T = 1 alpha's q, and the gradient's
                    if temperature not in (GREEDY, 1.0):
                        q, _ = softmax_(bufs.fp32(2, r.numel()).copy_(z).div_(temperature))
                        p = _ChunkedHead._p_chunk(hp, wp, r, bufs, 3, temperature, qids)
                        alpha[s: s + chunk] = torch.minimum(q, p, out=p).sum(-1)
                        del p, q
                    if temperature in (GREEDY, 1.0) or early:
                        q1, _ = softmax_(z)
                    if temperature == GREEDY:  # q at T = 1 at p's argmax (0 when q has no such column)
                        alpha[s: s + chunk] = torch.where(col >= 0, q1.gather(1, col.clamp_min(0)[:, None])[:, 0], 0.0)
                    elif temperature == 1.0:  # p = softmax(zp) (on q's columns): pt itself on the whole vocabulary
                        p = pt if qids is None else softmax_(zp)[0][:, qids]
                        alpha[s: s + chunk] = torch.minimum(q1, p, out=bufs.fp32(2, r.numel())).sum(-1)
                        del p
                    if early:
                        g = q1.sub_(pt).mul_(torch.where(col >= 0, coef[s: s + chunk], 0.0)[:, None])
                        _SoftTargetHead._grad_inputs(ctx.dnn, g, r, xs, ws, dx, dw, bufs)
                        del g
                    del pt, zp, z, q1
        ctx.chunk = chunk
        ctx.early = (coef, dx, dw) if early else None
        ctx.use_dnn, ctx.dnn = ctx.dnn is not None, None  # its packs freed: a recomputing backward packs again
        ctx.save_for_backward(rows, hp, wp, qids, *xw)
        ctx.mark_non_differentiable(alpha)
        return soft, alpha

    @staticmethod
    def _grad_inputs(dnn, g, r, xs, ws, dx, dw, bufs):
        """``_ChunkedHead._grad_inputs``, or with ``dnn`` its products through oneDNN."""
        if dnn is None:
            _ChunkedHead._grad_inputs(g, r, xs, ws, dx, dw, bufs)
        else:
            dnn.grad_inputs(g, r, dx, dw)

    @staticmethod
    def _grad_buffers(xs, ws, need):
        """(dx, dw): per term zeros for the inputs that need a gradient (dw in fp32, summed over chunks), else None."""
        dx = [torch.zeros_like(x) if need[2 * k] else None for k, x in enumerate(xs)]
        dw = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need[2 * k + 1] else None
              for k, w in enumerate(ws)]
        return dx, dw

    @staticmethod
    def _soft_target(zp, wp, qids):
        """(pt [R, Vq] = softmax of the target's logits zp [R, V] on q's columns (in zp's storage on the whole
        vocabulary; zp is left as it was with ``qids``), col [R]: argmax p's column in q, -1 when q has none)."""
        g = zp.argmax(-1)
        if qids is None:
            return softmax_(zp)[0], g
        col = torch.full((wp.shape[0],), -1, dtype=torch.long, device=g.device)
        col[qids] = torch.arange(qids.numel(), device=g.device)
        return softmax_(zp[:, qids])[0], col[g]

    @staticmethod
    def backward(ctx, g_soft, g_alpha):
        rows, hp, wp, qids, *xw = ctx.saved_tensors
        xs, ws = xw[0::2], xw[1::2]
        early, ctx.early = ctx.early, None
        if early is not None and g_soft is not None and torch.equal(g_soft, early[0]):
            dx, dw = early[1:]  # the forward's, for exactly this gradient
        else:
            dx, dw = _SoftTargetHead._recompute(ctx, rows, hp, wp, qids, xs, ws, g_soft)
        grads = []
        for k in range(len(xs)):
            grads += [dx[k], None if dw[k] is None else dw[k].to(ws[k].dtype)]
        return (None, None, None, None, None, None, None, None, *grads)

    @staticmethod
    def _recompute(ctx, rows, hp, wp, qids, xs, ws, g_soft):
        """(dx, dw) for a gradient ``g_soft`` the forward did not foresee: each chunk's z and pt made again."""
        with torch.autocast(rows.device.type, enabled=False):
            need = ctx.needs_input_grad[8:]
            dnn = _DnnHead(xs, ws) if ctx.use_dnn else None
            dx, dw = _SoftTargetHead._grad_buffers(xs, ws, need)
            if g_soft is not None and any(need):
                with ChunkBuffers.pooled(min(ctx.chunk, rows.numel()), ws[0].shape[0], rows.device) as bufs:
                    for s in range(0, rows.numel(), ctx.chunk):
                        r = rows[s: s + ctx.chunk]
                        zp = chunk_logits((hp,), (wp,), r, *((bufs, 1) if qids is None else ()))
                        pt, col = _SoftTargetHead._soft_target(zp, wp, qids)
                        g, _ = softmax_(chunk_logits(xs, ws, r, bufs, slot=0) if dnn is None else dnn.logits(r))
                        g.sub_(pt).mul_(torch.where(col >= 0, g_soft[s: s + ctx.chunk], 0.0)[:, None])
                        _SoftTargetHead._grad_inputs(dnn, g, r, xs, ws, dx, dw, bufs)
                        del g, pt, zp
        return dx, dw


def fused_ttt(hq: torch.Tensor, weight: torch.Tensor, hp: torch.Tensor, *, p_weight: Optional[torch.Tensor] = None,
              q_ids: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None, denom=None, weights="ttt",
              temperature: float = 1.0, chunk_rows="auto", early_grad: bool = True, kernel_paths=None) -> FusedOut:
    """``ttt_loss(hq @ weight^T, hp @ p_weight^T, q_ids, mask, denom, weights)`` from hidden states, one [chunk, V]
    of the target's logits at a time (never [N, W, V]).

    Args:
        hq: [N, W, D] the drafter's final (normed) hidden state at each TTT step, with grad.
        weight: [Vq, D] the drafter's head (its own, over the draft vocabulary, or the target's lm_head).
        hp: [N, W, D] the target's hidden state before lm_head at the same positions; detached.
        p_weight: [V, D] the target's lm_head (default: ``weight``).
        q_ids: [Vq] the target ids of ``weight``'s rows; None: the whole vocabulary.
        mask, denom, weights: as in ``ttt_loss``.
        temperature: T of alpha (the metrics' acceptance, from the same pass, no gradient); 0: greedy.
        chunk_rows: rows per chunk, or "auto".
        early_grad: with grad enabled, compute the gradients in the forward's pass for ``loss.backward()`` as it
            is (the reduction's own gradient, derived here); a backward from anything else recomputes them. The
            same numbers either way; False: always recompute (the reference the tests compare with).
        kernel_paths: the recipe's ``kernels:`` section; ``cpu_linear=all`` runs q's fp32 head products through
            oneDNN on the CPU (within fp32 rounding of torch.mm, not its bits); None: all "auto" (torch.mm).

    Returns:
        ``FusedOut(loss, alpha, nll)``: nll is the per-position soft cross-entropy [N, W] (0 where masked).
    """
    n, w = hq.shape[:2]
    if temperature < 0:
        raise ValueError(f"temperature must be > 0, or 0 for greedy alpha; got {temperature}")
    m = _mask(mask, (n, w), hq.device)
    terms = _flat_terms(hq, weight, None)
    hpf, wp = _target_side(hp, p_weight, weight, n, w)
    rows = torch.nonzero(m.reshape(-1)).flatten()
    chunk = resolve_chunk_rows(chunk_rows, wp.shape[0], hq.device)
    coef = None
    if early_grad and torch.is_grad_enabled() and any(t.requires_grad for t in terms):
        coef = _ttt_row_grad(rows, n, w, m, denom, weights)
    soft, a = _SoftTargetHead.apply(rows, chunk, float(temperature), hpf, wp,
                                    None if q_ids is None else q_ids.to(hq.device), coef, kernel_paths, *terms)
    flat = torch.zeros(n * w, dtype=torch.float32, device=hq.device)
    per_pos = flat.index_put((rows,), soft).view(n, w)
    alpha = flat.index_put((rows,), a).view(n, w)
    loss = _ttt_reduce(per_pos, m, denom, weights)
    return FusedOut(loss, alpha.detach(), per_pos.detach())


def _ttt_row_grad(rows, n, w, m, denom, weights) -> torch.Tensor:
    """The gradient [R] that ``loss.backward()`` sends the soft CE of the flat rows ``rows``: autograd through
    ``fused_ttt``'s own scatter and ``_ttt_reduce`` on a stand-in, so the same operations give the same bits."""
    probe = torch.zeros(rows.numel(), dtype=torch.float32, device=rows.device, requires_grad=True)
    with torch.enable_grad():
        flat = torch.zeros(n * w, dtype=torch.float32, device=rows.device)
        loss = _ttt_reduce(flat.index_put((rows,), probe).view(n, w), m, denom, weights)
        return torch.autograd.grad(loss, probe)[0]


# ================================================================================ q on candidates (DFlash V2)
@torch.no_grad()
def candidate_p(hp: torch.Tensor, ids: torch.Tensor, p_weight: torch.Tensor, temperature: float = 1.0,
                mask: Optional[torch.Tensor] = None, chunk_rows="auto", tp=None) -> torch.Tensor:
    """The target's p at each slot's candidates, from its hidden states one [chunk, V] chunk at a time.

    Args:
        hp: [N, W, D] the target's hidden state before lm_head at the scored positions (slot-aligned).
        ids: [N, W, K] candidate tokens per slot.
        p_weight: [V, D] the target's lm_head ([V / N, D], this rank's block, with ``tp``).
        temperature: T > 0: softmax(hp @ p_weight^T / T)[ids]; 0: 1[ids == argmax p] (greedy acceptance).
        mask: [N, W] bool: rows to compute (others stay 0); None: all.
        chunk_rows: rows of [rows, V] logits per chunk, or "auto".
        tp: the group the vocabulary is split over (``specopd.models.tensor_parallel.vocab_group``), or None:
            ``_candidate_p_split``; every rank returns the same values.

    Returns:
        [N, W, K] fp32, no grad.
    """
    n, w, k = ids.shape
    if tuple(hp.shape[:2]) != (n, w) or hp.shape[-1] != p_weight.shape[1]:
        raise ValueError(f"hp must be [N, W, D] = [{n}, {w}, {p_weight.shape[1]}]; got {tuple(hp.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be > 0, or 0 for greedy acceptance; got {temperature}")
    hpf, idf = hp.detach().reshape(n * w, -1), ids.reshape(n * w, k)
    rows = torch.nonzero(_mask(mask, (n, w), hp.device).reshape(-1)).flatten()
    out = torch.zeros(n * w, k, dtype=torch.float32, device=hp.device)
    vl = p_weight.shape[0]
    split = tp is not None and tp.size > 1
    lo = tp.vocab_block(vl * tp.size)[0] if split else 0
    chunk = resolve_chunk_rows(chunk_rows, vl, hp.device)
    with torch.autocast(hp.device.type, enabled=False), \
            ChunkBuffers.pooled(min(chunk, max(1, rows.numel())), vl, hp.device) as bufs:
        for s in range(0, rows.numel(), chunk):
            r = rows[s: s + chunk]
            z = chunk_logits((hpf,), (p_weight.detach(),), r, bufs)  # [R, V] fp32 ([R, V / N] with tp)
            if split:
                out[r] = _candidate_p_split(z, idf[r], float(temperature), tp, lo)
            elif temperature == GREEDY:
                out[r] = (idf[r] == z.argmax(-1, keepdim=True)).float()
            else:
                p, _ = softmax_(z.div_(float(temperature)))
                out[r] = p.gather(1, idf[r])
            del z
    return out.view(n, w, k)


def _candidate_p_split(z: torch.Tensor, ids: torch.Tensor, temperature: float, tp, lo: int) -> torch.Tensor:
    """``candidate_p`` of one chunk over a vocabulary split across ``tp``: z [R, V / N] this rank's logits (columns
    lo ..), ids [R, K] global. T > 0: the normaliser from all-reduces of the row maxima (max) and the sums of exp
    (sum), the numerators at the ids from their owners (a sum of a masked gather: exact); T = 0: the global argmax
    is the smallest id among the ranks holding the maximum (torch's first-maximum rule). Consumes z."""
    vl = z.shape[1]
    loc = ids - lo
    own = (loc >= 0) & (loc < vl)
    loc = loc.clamp(0, vl - 1)
    if temperature == GREEDY:
        return (ids == _split_argmax(z, lo, tp)[:, None]).float()
    if temperature != 1.0:
        z.div_(temperature)
    m = tp.all_reduce_(z.amax(-1, keepdim=True), "max")
    e = z.sub_(m).exp_()
    sm = torch.cat([e.sum(-1, keepdim=True), torch.where(own, e.gather(1, loc), 0.0)], 1)  # [R, 1 + K]
    tp.all_reduce_(sm, "sum")
    return sm[:, 1:] / sm[:, :1]


def candidate_alpha(scores: torch.Tensor, p_c: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """alpha [N, W] of q = softmax(scores / T) on the candidates (0 elsewhere) against p at them (``candidate_p``):
    sum_c min(q, p) (the mass off the candidates adds nothing: q is 0 there); T = 0: q(argmax p) at T = 1, 0
    when argmax p is not a candidate (``tv_alpha``'s greedy form). Grad through scores only."""
    if temperature == GREEDY:
        return (torch.softmax(scores.float(), -1) * p_c.detach()).sum(-1)
    return torch.minimum(torch.softmax(scores.float() / float(temperature), -1), p_c.detach()).sum(-1)


def candidate_nll(ids: torch.Tensor, scores: torch.Tensor, targets: torch.Tensor,
                  target_scores: torch.Tensor) -> torch.Tensor:
    """[N, W] -log of the target token's probability over its slot's candidates joined by the target itself:
    exactly -log q(target) when the target is a candidate; finite (the target's own score, ``target_scores``
    [N, W], in the softmax) when top-K missed it, where -log q would be infinite.

    Args:
        ids: [N, W, K] candidates.
        scores: [N, W, K] their scores (with grad).
        targets: [N, W] reference tokens.
        target_scores: [N, W] the same score of each target token (with grad).

    Returns:
        [N, W] fp32.
    """
    hit = ids == targets.to(ids.device)[..., None]  # [N, W, K], at most one per slot
    inside = hit.any(-1)
    z = scores.float()
    zt = torch.where(inside, z.masked_fill(~hit, float("-inf")).amax(-1), target_scores.float())
    joined = torch.cat([z, torch.where(inside, float("-inf"), target_scores.float())[..., None]], -1)
    return torch.logsumexp(joined, -1) - zt


def candidate_e2e_tv(ids: torch.Tensor, scores: torch.Tensor, hp: torch.Tensor, *, p_weight: torch.Tensor,
                     mask: Optional[torch.Tensor] = None, denom=None, temperature: float = 1.0, chunk_rows="auto",
                     ce_targets: Optional[torch.Tensor] = None, ce_scores: Optional[torch.Tensor] = None,
                     ce_weight: float = 0.0, tp=None) -> FusedOut:
    """E2E-TV of a draft distribution on candidates (DFlash V2's q = softmax(scores / T) on ids, 0 elsewhere), equal
    to ``e2e_tv_loss`` on its [N, W, V] logits (-inf off the candidates) without building them; with ``ce_weight``
    > 0, plus ``ce_weight`` x the mean ``candidate_nll`` of ``ce_targets``.

    Args:
        ids: [N, W, K] candidates; scores: [N, W, K] fp32 with grad.
        hp: [N, W, D] the target's hidden state at the scored positions; p_weight: [V, D] its lm_head.
        mask: [N, W] bool; False ends the branch.
        denom: as in ``e2e_tv_loss``.
        temperature: T > 0, or 0 (greedy: alpha = q(argmax p)).
        chunk_rows: rows of [rows, V] logits per chunk for p, or "auto".
        ce_targets: [N, W] reference tokens; ce_scores: [N, W] their scores (``Realized.extra``).
        ce_weight: the CE term's weight; 0: none.
        tp: the group the vocabulary is split over (``p_weight`` is this rank's block): ``candidate_p``'s; the rest
            reads the K candidates only, so every rank returns the same loss and gradients.

    Returns:
        ``FusedOut(loss, alpha [N, W] detached (0 past a branch's valid prefix), nll or None)``.
    """
    n, w, _ = ids.shape
    valid = torch.cumprod(_mask(mask, (n, w), ids.device).long(), dim=1).bool()
    if ce_weight < 0:
        raise ValueError(f"ce_weight must be >= 0; got {ce_weight}")
    if ce_weight > 0 and (ce_targets is None or ce_scores is None):
        raise ValueError("ce_weight > 0 needs ce_targets [N, W] and their scores ce_scores [N, W]")
    p_c = candidate_p(hp, ids, p_weight, temperature, valid, chunk_rows, tp)
    alpha = torch.where(valid, candidate_alpha(scores, p_c, temperature), 0.0)
    loss = e2e_tv_from_alpha(alpha, valid, denom)
    nll = None
    if ce_weight > 0:
        nll = candidate_nll(ids, scores, ce_targets, ce_scores)
        loss = loss + ce_weight * _masked_branch_mean(nll, valid, denom)
    return FusedOut(loss, alpha.detach(), None if nll is None else nll.detach())


def candidate_ce(ids: torch.Tensor, scores: torch.Tensor, targets: torch.Tensor, target_scores: torch.Tensor, *,
                 mask: Optional[torch.Tensor] = None, denom=None, weights=None, hp: Optional[torch.Tensor] = None,
                 p_weight: Optional[torch.Tensor] = None, temperature: float = 1.0, chunk_rows="auto",
                 tp=None) -> FusedOut:
    """Off-policy CE of a draft distribution on candidates: the per-branch mean of ``candidate_nll`` (q at T = 1).

    Args:
        ids, scores: [N, W, K] candidates and their scores (with grad).
        targets: [N, W] reference tokens; target_scores: [N, W] their scores.
        mask: [N, W] bool; False positions are skipped.
        denom: as in ``e2e_tv_loss``.
        weights: None | "dflash" | [W] (``position_weights``).
        hp, p_weight: the target side, as in ``candidate_e2e_tv``: then alpha too (no gradient).
        temperature: T of alpha.
        chunk_rows: rows per chunk, or "auto".
        tp: the group the vocabulary is split over, as in ``candidate_e2e_tv``.

    Returns:
        ``FusedOut(loss, alpha or None, nll [N, W])``.
    """
    n, w, _ = ids.shape
    m = _mask(mask, (n, w), ids.device)
    nll = candidate_nll(ids, scores, targets, target_scores)
    loss = _masked_branch_mean(nll, m, denom, position_weights(weights, w, ids.device))
    alpha = None
    if hp is not None:
        with torch.no_grad():
            p_c = candidate_p(hp, ids, p_weight, temperature, m, chunk_rows, tp)
            alpha = torch.where(m, candidate_alpha(scores, p_c, temperature), 0.0)
    return FusedOut(loss, alpha, nll.detach())


@torch.no_grad()
def target_argmax(hp: torch.Tensor, p_weight: torch.Tensor, *, chunk_rows="auto", tp=None) -> torch.Tensor:
    """The target's greedy token at every scored position: argmax of ``hp @ p_weight^T`` (the first index of the
    maximum, as ``torch.argmax``), ``chunk_rows`` rows at a time, never [N, W, V]. The labels of
    ``trainer.ce_labels: target``: what greedy verification accepts at each position of the scored history.

    Args:
        hp: [N, W, D] the target's hidden state before lm_head.
        p_weight: [V, D] the target's lm_head (this rank's block [V / N, D] with ``tp``).
        chunk_rows: rows of [rows, V] logits per chunk, or "auto".
        tp: the group the vocabulary is split over (as in ``fused_e2e_tv``): the first index of the maximum over
            the whole vocabulary, the same on every rank; None: whole.

    Returns:
        [N, W] int64 token ids.
    """
    n, w, d = hp.shape
    vp = tp is not None and tp.size > 1
    lo = tp.vocab_block(p_weight.shape[0] * tp.size)[0] if vp else 0
    flat = hp.reshape(n * w, d)
    out = torch.empty(n * w, dtype=torch.long, device=hp.device)
    chunk = even_chunk(n * w, resolve_chunk_rows(chunk_rows, p_weight.shape[0], hp.device))
    for s in range(0, n * w, chunk):
        r = torch.arange(s, min(s + chunk, n * w), device=hp.device)
        z = chunk_logits((flat,), (p_weight,), r)
        out[s: s + r.numel()] = _split_argmax(z, lo, tp) if vp else z.argmax(-1)
    return out.view(n, w)


@torch.no_grad()
def logits_at(h: torch.Tensor, weight: torch.Tensor, index: Optional[torch.Tensor] = None, *,
              temperature: float = 1.0) -> torch.Tensor:
    """fp32 logits of a few rows of hidden states (e.g. the target's p at some anchors); the result is materialised.

    Args:
        h: [M, D] hidden states.
        weight: [V, D] lm_head weight.
        index: [R] rows of h (default: all M).
        temperature: the logits are divided by it.

    Returns:
        [R, V] (or [M, V]) fp32 logits.
    """
    rows = torch.arange(h.shape[0], device=h.device) if index is None else torch.as_tensor(index, device=h.device)
    z = chunk_logits((h,), (weight,), rows)
    return z.div_(temperature) if temperature != 1.0 else z
