"""DFlash V2 (vLLM 0.32 ``DFlash2DraftModel``): the DFlash block drafter plus a grouped dynamic convolution along
the block around each layer's attention and MLP, a scaled input embedding, soft-capped candidate logits and a
low-rank candidate selector that makes slot l's draft distribution depend on the token drafted at slot l - 1.
Shapes: N branches, S = block_size, W = S - 1, D hidden, V vocab, K = selector_top_k, r = selector_rank.
Design, maths and the order of scale and soft cap: specopd/drafters/DFLASH2.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from specopd.drafters.dflash import DFlashDrafter, DraftLayer, DrafterConfig
from specopd.losses import ChunkBuffers, chunk_logits, resolve_chunk_rows
from specopd.models.tensor_parallel import vocab_group
from specopd.sampling import pick_tokens

# dflash_config keys V2 adds (vLLM ``qwen3_dflash2.py``); the first four are required by vLLM, the others default
# to 1.0, 1.0 and 0 (no soft cap) there.
V2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
           "output_multiplier", "final_logit_softcapping")


@dataclass
class DFlash2Config(DrafterConfig):
    """``DrafterConfig`` plus the V2 keys of ``dflash_config`` (vLLM requires the first four; these defaults are
    ours, for drafters built here)."""

    conv_kernel_size: int = 4  # taps of the grouped convolution (tap t reads block row r - t)
    conv_group_size: int = 16  # channels sharing one dynamic coefficient; must divide hidden_size
    selector_rank: int = 64  # r of the predecessor / successor codebooks
    selector_top_k: int = 8  # K candidates per slot
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by it
    output_multiplier: float = 1.0  # candidate logits: multiplied by it, then soft-capped (vLLM's top-k order)
    final_logit_softcapping: float = 0.0  # cap * tanh(x / cap); 0 = none


def v2_problems(c: DFlash2Config, vocab) -> list:
    """(field, value, what it must be) for every V2 setting that vLLM would refuse or that cannot work with a
    target of ``vocab`` tokens (None: not checked against it)."""
    bad = []
    for name in ("conv_kernel_size", "selector_rank"):
        if not getattr(c, name) >= 1:
            bad.append((name, getattr(c, name), ">= 1"))
    if not c.conv_group_size >= 1 or c.hidden_size % c.conv_group_size:
        bad.append(("conv_group_size", c.conv_group_size, f"must divide hidden_size={c.hidden_size}"))
    if not 1 <= c.selector_top_k <= (vocab or c.selector_top_k):
        bad.append(("selector_top_k", c.selector_top_k, f"in [1, vocab_size={vocab or '?'}]"))
    if not c.output_multiplier > 0:
        bad.append(("output_multiplier", c.output_multiplier, "> 0: vLLM's top-k reduction needs a positive scale"))
    if not c.final_logit_softcapping >= 0:
        bad.append(("final_logit_softcapping", c.final_logit_softcapping, ">= 0; 0 = none"))
    return bad


# ------------------------------------------------------------------------------------------- layers


class GroupedConv(nn.Module):
    """Grouped dynamic convolution along the block's rows (vLLM ``DFlashGroupedConv``).

    ``kernel_projection`` (D -> 2 * taps * groups) gives per-row coefficients ``delta`` [.., 2, taps, groups];
    side s of row r: ``out[r] = sum_t (base_kernel[s, t] + delta[r, s, t, group]) * x[r - t]`` over taps t <= r
    (rows of the same block only; a channel's group is channel // conv_group_size). Side 0 runs before the
    attention / MLP, side 1 after it, both with the coefficients of the input of side 0."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = int(taps), int(group_size), hidden // int(group_size)
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.taps * self.groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, D] -> delta [N, S, 2, taps, groups]."""
        return self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [N, S, D], delta [N, S, taps, groups] (one side of ``coefficients``) -> [N, S, D]."""
        n, s, d = x.shape
        xs = x.view(n, s, self.groups, self.group_size)
        base = self.base_kernel[side].to(x.dtype).view(self.taps, self.groups, self.group_size)
        out = (base[0] + delta[:, :, 0, :, None]) * xs
        for t in range(1, min(self.taps, s)):  # row r < t reads nothing (another block's row in vLLM's flat rows)
            tail = (base[t] + delta[:, t:, t, :, None]) * xs[:, : s - t]
            out = out + torch.cat([tail.new_zeros(n, t, self.groups, self.group_size), tail], 1)
        return out.reshape(n, s, d)


class DraftLayer2(DraftLayer):
    """A DFlash draft layer with ``attention_conv`` around its attention and ``mlp_conv`` around its MLP; the
    context K/V (from the target's features) do not pass through them."""

    def __init__(self, c: DFlash2Config):
        super().__init__(c)
        self.attention_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.mlp_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, h, cos, sin, k_ctx, v_ctx, layout, backend="auto"):
        """As ``DraftLayer.forward``, each sub-block as conv side 0 -> attention / MLP -> conv side 1.

        Args:
            h: [N, S, D] the block's hidden state.
            cos, sin, k_ctx, v_ctx, layout, backend: as ``DraftAttention.forward``.

        Returns:
            [N, S, D].
        """
        x = self.input_layernorm(h)
        c = self.attention_conv.coefficients(x)
        a = self.self_attn(self.attention_conv.convolve(x, c[:, :, 0], 0), cos, sin, k_ctx, v_ctx, layout, backend)
        h = h + self.attention_conv.convolve(a, c[:, :, 1], 1)
        x = self.post_attention_layernorm(h)
        c = self.mlp_conv.coefficients(x)
        m = self.mlp(self.mlp_conv.convolve(x, c[:, :, 0], 0))
        return h + self.mlp_conv.convolve(m, c[:, :, 1], 1)


class CandidateSelector(nn.Module):
    """Low-rank candidate selector (vLLM ``CandidateSelector``): the score of candidate c after predecessor p is
    ``<predecessor_codebook[p] * hidden_projection(h), successor_codebook[c]>``, added to c's unary logit."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair_scores(self, gate: torch.Tensor, prev: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """gate [..., r], prev [..., P] predecessor tokens, ids [..., C] candidates -> fp32 [..., P, C].

        The rows are looked up with ``embedding``, not ``codebook[ids]``: tokens recur, and the backward of
        advanced indexing (index_put with accumulate) adds a recurring token's rows in a thread-dependent order on
        the CPU; embedding's backward adds them in index order whatever the thread count (the same bits as
        indexing at one thread)."""
        e = nn.functional.embedding(prev, self.predecessor_codebook) * gate.unsqueeze(-2)  # [..., P, r]
        return torch.einsum("...pr,...cr->...pc", e, nn.functional.embedding(ids, self.successor_codebook)).float()


class Candidates(NamedTuple):
    """What the walk needs of a block: ids [N, W, K] (top-K of the raw lm_head logits, descending), unary [N, W, K]
    fp32 (their candidate logits: multiplied by output_multiplier, then soft-capped), gate [N, W, r]
    (hidden_projection of the drafter's hidden state)."""
    ids: torch.Tensor
    unary: torch.Tensor
    gate: torch.Tensor


class Realized(NamedTuple):
    """Scores of the candidates given the previous token: ids [N, W, K], scores [N, W, K] fp32 (the draft
    distribution is softmax(scores / T) over ids, 0 elsewhere); extra [N, W] fp32: the same score of a given
    token per slot (e.g. the reference token for the CE), or None."""
    ids: torch.Tensor
    scores: torch.Tensor
    extra: Optional[torch.Tensor] = None


def top_k_first(z: torch.Tensor, k: int) -> tuple:
    """(values, ids) [R, k] of the k largest of each row of z [R, V], ordered by value descending then id ascending:
    among equal values the smaller id comes first and is kept. torch.topk's tie rule is unspecified (on the CPU it
    depends on nth_element's partition), so a top-K merged from blocks of the vocabulary could not reproduce it;
    this rule is a total order, so the merged top-K is exactly this one of the whole row."""
    v, i = torch.topk(z, min(k + 1, z.shape[-1]), dim=-1)  # sorted; the k-th value is exact whatever the ties
    if v.shape[-1] > k:
        tie = torch.nonzero(v[:, k] == v[:, k - 1]).flatten()  # rows whose k-th value recurs past the k-th place
        v, i = v[:, :k], i[:, :k].clone()
        if tie.numel():
            thr = v[tie, k - 1: k]
            keep = v[tie] > thr  # those above the k-th value are all in; the ties take the smallest ids
            need = k - keep.sum(-1, keepdim=True)
            exact = torch.float32 if z.shape[-1] <= 2 ** 24 else torch.float64  # every id exact
            neg = -torch.arange(z.shape[-1], device=z.device, dtype=exact)
            key = torch.where(z[tie] == thr, neg, float("-inf"))  # the largest key is the smallest tied id
            tid = torch.topk(key, k, dim=-1).indices
            ids = torch.cat([i[tie], tid], -1)
            ok = torch.cat([keep, torch.arange(k, device=z.device) < need], -1)  # exactly k per row
            pick = torch.sort(ok.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
            i[tie] = ids.gather(1, pick)
    i = torch.sort(i, dim=-1, stable=True).values  # id ascending, then value descending, stably
    v = z.gather(1, i)
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices
    return v.gather(1, order), i.gather(1, order)


def _merge_top_k(v: torch.Tensor, ids: torch.Tensor, k: int, tp) -> tuple:
    """Every rank's local ``top_k_first`` (v [R, k'], global ids [R, k']) gathered ([R, N k']) and merged into the
    whole vocabulary's: the same total order (value descending, id ascending), so the same ids, on every rank."""
    gv, gi = tp.gather_cols(v.contiguous()), tp.gather_cols(ids.contiguous())
    o = torch.sort(gi, dim=-1, stable=True).indices  # positions in id order: a tie's position rank is its id rank
    gv, gi = gv.gather(1, o), gi.gather(1, o)
    mv, pos = top_k_first(gv, k)
    return mv, gi.gather(1, pos)


class _TopCandidates(torch.autograd.Function):
    """(ids [M, K], raw logits [M, K] = h @ W[ids]^T) of the top K of h @ W^T per row (``top_k_first``'s order),
    ``chunk`` rows at a time (memory: one [chunk, V]); with ``extra`` [M] the raw logit of that token too (column
    K). The values are the chunk matmul's; the backward is dh = g @ W[ids] row by row (the top-K choice is not
    differentiable). ``pool``: the chunk buffers are this thread's pooled set (``ChunkBuffers.pooled``: training),
    else fresh ones (decoding, whose row count would otherwise stay in the pool). ``tp``: W is this rank's block of
    the vocabulary (``vocab_group``): each rank's local top K is gathered and merged (``_merge_top_k``), the extra
    token's logit comes from its owner (a sum over the group), and the backward sums the partial dh of the owned
    candidates over the group once, so every rank gets the same ids, values and dh."""

    @staticmethod
    def forward(ctx, h, weight, k, extra, chunk, pool, tp):
        m = h.shape[0]
        kk = k + (extra is not None)
        vl = weight.shape[0]
        lo = 0 if tp is None else tp.vocab_block(vl * tp.size)[0]
        ids = torch.empty(m, kk, dtype=torch.long, device=h.device)
        vals = torch.empty(m, kk, dtype=torch.float32, device=h.device)
        if m:
            rows = min(chunk, m)
            with (ChunkBuffers.pooled(rows, vl, h.device) if pool else contextlib.nullcontext(
                    ChunkBuffers(rows, vl, h.device))) as bufs:
                for s in range(0, m, chunk):
                    r = torch.arange(s, min(s + chunk, m), device=h.device)
                    z = chunk_logits((h,), (weight,), r, bufs)  # [R, V] fp32 (V / N with tp)
                    v, i = top_k_first(z, min(k, vl))
                    if tp is not None:
                        v, i = _merge_top_k(v, i + lo, k, tp)
                    ids[s: s + chunk, :k], vals[s: s + chunk, :k] = i, v
                    if extra is not None:
                        e = extra[s: s + chunk, None]
                        ids[s: s + chunk, k:] = e
                        if tp is None:
                            vals[s: s + chunk, k:] = z.gather(1, e)
                        else:  # the owner's logit, 0 elsewhere: the sum is exact
                            el = e - lo
                            own = (el >= 0) & (el < vl)
                            x = torch.where(own, z.gather(1, el.clamp(0, vl - 1)), 0.0)
                            vals[s: s + chunk, k:] = tp.all_reduce_(x, "sum")
                    del z
        ctx.save_for_backward(h, weight, ids)
        ctx.chunk, ctx.tp, ctx.lo = chunk, tp, lo
        ctx.mark_non_differentiable(ids)
        return vals, ids

    @staticmethod
    def backward(ctx, g_vals, g_ids):
        h, weight, ids = ctx.saved_tensors
        tp, lo, vl = ctx.tp, ctx.lo, weight.shape[0]
        own = None if tp is None else (ids >= lo) & (ids < lo + vl)  # [M, K]: the candidates of this rank's block
        loc = ids if tp is None else (ids - lo).clamp(0, vl - 1)
        g = g_vals if tp is None else torch.where(own, g_vals, 0.0)
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = torch.zeros(h.shape, dtype=h.dtype if tp is None else torch.float32, device=h.device)
            for s in range(0, h.shape[0], ctx.chunk):
                wk = weight[loc[s: s + ctx.chunk]].float()  # [R, K, D]: the chunk's candidate rows only
                dh[s: s + ctx.chunk] = torch.einsum("rk,rkd->rd", g[s: s + ctx.chunk], wk).to(dh.dtype)
            if tp is not None:  # the partial sums of the owned candidates, summed once in fp32
                dh = tp.all_reduce_(dh, "sum").to(h.dtype)
        if ctx.needs_input_grad[1]:  # this rank's rows only
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            dw.index_add_(0, loc.reshape(-1), (g[..., None] * h.float()[:, None, :]).reshape(-1, h.shape[1]))
            dw = dw.to(weight.dtype)
        return dh, dw, None, None, None, None, None


def top_candidates(h: torch.Tensor, weight: torch.Tensor, k: int, extra: Optional[torch.Tensor] = None,
                   chunk_rows="auto", pool: bool = True, tp=None) -> tuple:
    """Top-k of the raw logits h @ weight^T without [N, W, V] (``_TopCandidates``; ties to the smaller id,
    ``top_k_first``).

    Args:
        h: [..., D] hidden states (with grad: the raw values carry it).
        weight: [V, D] the lm_head weight.
        k: candidates per row.
        extra: [...] a token per row whose raw logit is appended as column k, or None.
        chunk_rows: rows of [rows, V] logits per chunk, or "auto".
        pool: reuse this thread's pooled chunk buffers (training); False: fresh ones (decoding).
        tp: the group the vocabulary is split over (``specopd.models.tensor_parallel.vocab_group``): ``weight`` is
            this rank's block [V / N, D]; the ids (global), values and dh are the whole vocabulary's, on every rank.

    Returns:
        (raw [..., k (+1)] fp32, ids [..., k (+1)] long).
    """
    lead = h.shape[:-1]
    tp = tp if tp is not None and tp.size > 1 else None
    chunk = resolve_chunk_rows(chunk_rows, weight.shape[0], h.device)
    ex = None if extra is None else extra.reshape(-1).to(device=h.device, dtype=torch.long)
    vals, ids = _TopCandidates.apply(h.reshape(-1, h.shape[-1]), weight, int(k), ex, chunk, bool(pool), tp)
    kk = vals.shape[-1]
    return vals.view(*lead, kk), ids.view(*lead, kk)


# ------------------------------------------------------------------------------------------- the model


class DFlash2Drafter(DFlashDrafter):
    """DFlash V2. ``forward`` without ``prev_tokens`` gives the candidate logits over the vocabulary (DFlash's
    output, multiplied and soft-capped); with ``prev_tokens`` [N, W] the realized draft logits (selector scores on
    the top-K candidates given the previous token, -inf elsewhere). ``candidates`` / ``selector_scores`` /
    ``walk`` are what vLLM's drafting walk computes."""

    kind = "dflash2"
    config_class = DFlash2Config
    layer_class = DraftLayer2
    has_selector = True

    @classmethod
    def config_problems(cls, c, ident: dict) -> list:
        """DFlash's, and V2's own settings (``v2_problems``)."""
        return super().config_problems(c, ident) + v2_problems(c, ident.get("vocab_size"))

    def _build_extra(self) -> None:
        c = self.config
        vocab_group(self.target.lm_head)  # a split head must be in equal blocks (ValueError naming the fix)
        self.candidate_selector = CandidateSelector(c.hidden_size, int(self.target.vocab_size), int(c.selector_rank))

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """DFlash's init, then a start at DFlash: identity convolutions (base tap 0 = 1, other taps and
        kernel_projection 0) and a zero successor codebook (no selector term), as DSpark zeros its W2."""
        super()._init_weights(seed)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        self.candidate_selector.successor_codebook.zero_()

    @property
    def top_k(self) -> int:
        """K: candidates per slot (selector_top_k)."""
        return int(self.config.selector_top_k)

    def _block(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        x = super()._block(anchor_tokens)
        scale = float(self.config.input_embedding_scale)
        return x if scale == 1.0 else x * scale

    # -- logits -------------------------------------------------------------------------------------------
    def unary_from_raw(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw lm_head logits -> fp32 candidate logits, in vLLM's top-k order: x * output_multiplier, then
        cap * tanh(x / cap) (``LogitsProcessor.get_top_k_tokens``; both monotonic, so the top-K are those of raw)."""
        x = raw.float()
        mult, cap = float(self.config.output_multiplier), float(self.config.final_logit_softcapping)
        if mult != 1.0:
            x = x * mult
        if cap > 0:
            x = torch.tanh(x / cap) * cap
        return x

    def logits_from_hidden(self, h: torch.Tensor, prev_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [N, W, D] -> fp32 [N, W, V]: the candidate logits over the vocabulary; with prev_tokens [N, W] the
        realized draft logits (-inf outside each slot's top K)."""
        if prev_tokens is None:
            return self.unary_from_raw(super().logits_from_hidden(h))
        return self.draft_logits(self.realized(h, prev_tokens))

    def candidates(self, h: torch.Tensor, chunk_rows="auto", pool: bool = True) -> Candidates:
        """h [N, W, D] -> ``Candidates``; the raw logits are built ``chunk_rows`` rows at a time (never [N, W, V]);
        ``pool`` as ``top_candidates``."""
        head = self.target.lm_head
        raw, ids = top_candidates(h, head.weight, self.top_k, chunk_rows=chunk_rows, pool=pool, tp=vocab_group(head))
        return Candidates(ids, self.unary_from_raw(raw), self.candidate_selector.hidden_projection(h))

    def selector_scores(self, cands: Candidates, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[N, W, K (predecessor), K (candidate)] fp32: vLLM's ``_score_edges``. Predecessor row p of slot l is
        candidate p of slot l - 1 (slot 0: the anchor token in every row)."""
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=cands.ids.device).reshape(-1)
        k = cands.ids.shape[-1]
        prev = torch.cat([atok[:, None, None].expand(-1, 1, k), cands.ids[:, :-1]], 1)  # [N, W, K]
        return cands.unary[..., None, :] + self.candidate_selector.pair_scores(cands.gate, prev, cands.ids)

    def scores_given(self, cands: Candidates, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] the previous token of each slot (cands' leading dims) -> fp32 scores [..., K]."""
        return cands.unary + self.candidate_selector.pair_scores(cands.gate, prev[..., None], cands.ids)[..., 0, :]

    def realized(self, h: torch.Tensor, prev_tokens: torch.Tensor, extra: Optional[torch.Tensor] = None,
                 chunk_rows="auto") -> Realized:
        """The draft distribution's scores given each slot's previous token (teacher forcing), with grad.

        Args:
            h: [N, W, D] the drafter's hidden state.
            prev_tokens: [N, W] (column 0 = the anchor token, column l = the token at slot l - 1).
            extra: [N, W] a token per slot whose score is also returned (the CE's reference token), or None.
            chunk_rows: rows of [rows, V] logits per chunk, or "auto".

        Returns:
            ``Realized``.
        """
        prev = torch.as_tensor(prev_tokens, dtype=torch.long, device=h.device)
        if tuple(prev.shape) != tuple(h.shape[:2]):
            raise ValueError(f"prev_tokens must be [N, W] = {list(h.shape[:2])}; got {list(prev.shape)}")
        self._check_tokens(prev, "prev_tokens")
        if extra is not None:
            extra = torch.as_tensor(extra, dtype=torch.long, device=h.device)
            self._check_tokens(extra, "extra tokens")
        head = self.target.lm_head
        raw, ids = top_candidates(h, head.weight, self.top_k, extra, chunk_rows, tp=vocab_group(head))
        cands = Candidates(ids, self.unary_from_raw(raw), self.candidate_selector.hidden_projection(h))
        z = self.scores_given(cands, prev)  # [N, W, K (+1)]
        if extra is None:
            return Realized(ids, z)
        return Realized(ids[..., :-1], z[..., :-1], z[..., -1])

    def draft_logits(self, r: Realized) -> torch.Tensor:
        """``Realized`` -> [N, W, V] fp32: the scores at the candidates, -inf elsewhere (what vLLM's rejection
        sampler reads as the draft logits)."""
        n, w, _ = r.ids.shape
        full = torch.full((n, w, int(self.target.vocab_size)), float("-inf"), device=r.scores.device)
        return full.scatter(-1, r.ids, r.scores)

    def forward(self, features, anchors, trunk_index=None, anchor_tokens=None, prev_tokens=None,
                return_confidence: bool = False) -> torch.Tensor:
        """Candidate logits of every drafted slot, or the realized draft logits given ``prev_tokens``.

        Args:
            features, anchors, trunk_index, anchor_tokens: as ``DFlashDrafter.hidden``.
            prev_tokens: None, or [N, W] the token before each slot (column 0 = anchor_tokens).
            return_confidence: not supported (V2 has no confidence head).

        Returns:
            [N, W, V] fp32: without prev_tokens the candidate logits over the vocabulary; with them the selector's
            scores at the top-K candidates, -inf elsewhere.
        """
        if return_confidence:
            raise ValueError("DFlash V2 has no confidence head")
        h = self.hidden(features, anchors, trunk_index, anchor_tokens)
        if prev_tokens is None:
            return self.logits_from_hidden(h)
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        prev = torch.as_tensor(prev_tokens, dtype=torch.long, device=h.device)
        if prev.dim() != 2 or not torch.equal(prev[:, 0], atok):
            raise ValueError("prev_tokens must be [N, W] with prev_tokens[:, 0] == anchor_tokens (slot 0 follows the "
                             "anchor token); build it as cat([anchor_tokens[:, None], tokens[:, :-1]], 1)")
        return self.logits_from_hidden(h, prev)

    # -- the walk -----------------------------------------------------------------------------------------
    def walk(self, cands: Candidates, anchor_tokens: torch.Tensor, temperature: float, generator=None, rows=None,
             draw: Optional[Callable] = None) -> tuple:
        """vLLM's drafting walk: slot by slot, the candidate drawn given the one drawn before (slot 0: given the
        anchor token), from softmax(scores / T) (argmax at T = 0) with the project's sampler (``pick_tokens``:
        one uniform per row per slot from its group's generator). The realized scores carry the candidates' grad.

        Args:
            cands: ``Candidates`` of the block.
            anchor_tokens: [N].
            temperature: 0 = argmax.
            generator: one Generator, or one per ``rows`` group.
            rows: list of index tensors into N.
            draw: instead of the sampler, ``draw(slot, scores [N, K]) -> index [N]`` (e.g. a Gumbel-max draw).

        Returns:
            (tokens [N, W], index [N, W] into the candidates, realized scores [N, W, K] fp32).
        """
        prev = torch.as_tensor(anchor_tokens, dtype=torch.long, device=cands.ids.device).reshape(-1)
        toks, idx, real = [], [], []
        for slot in range(cands.ids.shape[1]):
            c = Candidates(cands.ids[:, slot], cands.unary[:, slot], cands.gate[:, slot])
            z = self.scores_given(c, prev)  # [N, K]
            i = draw(slot, z) if draw is not None else pick_tokens(z, temperature, generator, rows,
                                                                   kernel_paths=self.kernel_paths)
            prev = c.ids.gather(1, i.view(-1, 1)).view(-1)
            toks.append(prev)
            idx.append(i)
            real.append(z)
        return torch.stack(toks, 1), torch.stack(idx, 1), torch.stack(real, 1)

    def _sample_hidden(self, h, anchor_tokens, temperature, generator, rows=None, return_confidence=False,
                       return_logits=True, chunk_rows="auto"):
        """h [N, W, D] -> (tokens [N, W], realized draft logits [N, W, V] or None): the walk over the chunked
        top-K candidates (without ``return_logits`` nothing [N, W, V] is built)."""
        if return_confidence:
            raise ValueError("DFlash V2 has no confidence head")
        # with return_logits (decoding, sample): fresh chunk buffers, not the training steps' pooled set
        cands = self.candidates(h if return_logits else h.detach(), chunk_rows, pool=not return_logits)
        tokens, _, real = self.walk(cands, anchor_tokens, temperature, generator, rows)
        if not return_logits:
            return tokens, None
        return tokens, self.draft_logits(Realized(cands.ids, real))
