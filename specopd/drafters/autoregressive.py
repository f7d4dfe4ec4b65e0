"""Autoregressive drafters (EAGLE-3; MTP plugs in the same way): W tokens drafted one step at a time, each step fed
its own sampled token and its own hidden state, over a per-trunk context computed once. Positions as vLLM's EAGLE
proposer: context row p = (token x_{p+1}, the target's features at p) at position p; a branch anchored at a starts
from row a - 1. Design: specopd/drafters/DESIGN.md ("Autoregressive drafters").
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specopd.drafters.attention import BranchLayout, branch_attention, cached_branch_attention
from specopd.drafters.dflash import DraftContext
from specopd.sampling import sample_from_hidden


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0,
                     at: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of n new rows over their cache (GQA: query head h reads kv head h // (H / Hkv)).

    Args:
        q: [n, H, hd] at positions past .. past + n - 1 (or ``at``).
        k, v: [past + n, Hkv, hd] (with ``at``: [T, Hkv, hd], the keys at positions 0 .. T - 1).
        past: rows before the queries.
        at: [n] the queries' positions (each sees the keys up to its own), instead of past .. past + n - 1.

    Returns:
        [n, H, hd].
    """
    n, h, hd = q.shape
    hkv = k.shape[1]
    if at is None:
        mask = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).tril(past)
    else:
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= at.to(q.device)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=hkv != h)
    return o[0].transpose(0, 1)


class AutoregressiveDrafter(nn.Module):
    """Base of the drafters that draft one token per step (``kind`` "eagle3"; MTP the same way).

    A subclass defines ``layers`` (each with ``self_attn.hkv`` / ``.hd`` for the caches) and:
        ``context_hidden(features [M, F]) -> [M, D]``: a context row's hidden input from the target's features;
        ``rows(tokens [M], hidden [M, D], positions [M], attend, out=None) -> (normed [M', D], hidden_out [M', D])``:
            one step of M independent rows; layer i's attention is ``attend(i, q [M, H, hd], k [M, Hkv, hd], v)``
            (q, k after RoPE) -> o [M, H, hd]; ``normed`` feeds the head, ``hidden_out`` the next step; ``out``
            ([M'] row indices, or None: all): the rows whose outputs are wanted; the last layer makes the K/V of
            every row but its query and everything after only at those (q [M', H, hd] there);
        ``head_weight() -> [Vq, D]`` and ``vocab_ids`` (None, or [Vq] the target ids of the head's columns).
    Everything else (the trunk context, the unrolled branches, decoding caches, sampling) is here."""

    autoregressive = True  # code outside drafters/ branches on this once (``specopd.train.phases.propose``)
    soft_ttt = True  # trainer.method offpolicy_ce: SpecForge's soft CE against the target's p (EAGLE-3); False: CE on
    # the reference's tokens, each step alike (MTP heads, as they are trained)
    kernel_paths = None  # the recipe's kernels: section, its target's (``build_drafter`` / ``load_drafter``)

    # -- what the subclass gives -------------------------------------------------------------------------
    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, tokens, hidden, positions, attend, out=None):
        """One step of M independent rows.

        Args:
            tokens: [M] target ids read by the rows.
            hidden: [M, D] their hidden inputs (``context_hidden`` of features, or a previous step's hidden_out).
            positions: [M] RoPE positions.
            attend: ``attend(i, q, k, v) -> o`` layer i's attention.
            out: [M'] the rows whose outputs are wanted (None: all); the last layer's query and what follows it
                are made at those rows only (its K/V at every row).

        Returns:
            (normed [M', D], hidden_out [M', D]).
        """
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    vocab_ids: Optional[torch.Tensor] = None

    @property
    def draft_len(self) -> int:
        """W: tokens drafted per branch (one step each)."""
        return int(self.config.block_size) - 1

    # -- the head ---------------------------------------------------------------------------------------------
    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] normed -> fp32 logits over the head's vocabulary [..., Vq]."""
        w = self.head_weight()
        return F.linear(h.to(w.dtype), w).float()

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> fp32 logits over the target's vocabulary [..., V] (-inf off the draft vocabulary, as vLLM's
        ``compute_logits``)."""
        z = self.head_logits(h)
        if self.vocab_ids is None:
            return z
        out = z.new_full((*z.shape[:-1], int(self.target.vocab_size)), float("-inf"))
        out[..., self.vocab_ids] = z
        return out

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head column ids -> target token ids."""
        return ids if self.vocab_ids is None else self.vocab_ids[ids]

    def _pick(self, h, temperature, generators, rows, chunk_rows="auto"):
        """Target ids [N] drawn from the head on h [N, D] (one [chunk, Vq] at a time)."""
        ids = sample_from_hidden(h.detach()[:, None], self.head_weight().detach(), temperature, rows, generators,
                                 chunk_rows=chunk_rows, kernel_paths=self.kernel_paths)[:, 0]
        return self.to_target_ids(ids)

    # -- training: the trunk context and the unrolled branches -------------------------------------------
    def _context(self, feats: list, tokens: list, need: list, out: torch.Tensor):
        """The causal pass over every trunk's rows 0 .. need_i - 1 (row p = (x_{p+1}, features p)) -> per layer the
        packed K/V [C, Hkv, hd], and the (normed, hidden_out) [M', D] of the packed rows ``out`` [M'] (sorted,
        distinct: the branches' first steps; the last layer's query and MLP run at those rows only)."""
        dev = self.device
        fs = [f[:k] for f, k in zip(feats, need) if k]
        xs = [t[1:k + 1].to(dev) for t, k in zip(tokens, need) if k]
        pos = torch.cat([torch.arange(k, device=dev) for k in need if k])
        lens = [k for k in need if k]
        ks, vs = [], []
        last = len(self.layers) - 1
        # the out rows of each trunk and their positions in it (the last layer's queries)
        bounds = torch.cumsum(torch.tensor([0] + lens, device=dev), 0)
        cut = torch.searchsorted(out, bounds).tolist()
        at = [out[a:b] - bounds[j] for j, (a, b) in enumerate(zip(cut[:-1], cut[1:]))]

        def attend(i, q, k, v):
            ks.append(k)
            vs.append(v)
            if i != last:
                return torch.cat([causal_attention(qq, kk, vv) for qq, kk, vv in
                                  zip(q.split(lens), k.split(lens), v.split(lens))])
            return torch.cat([causal_attention(qq, kk, vv, at=p) for qq, kk, vv, p in
                              zip(q.split([p.numel() for p in at]), k.split(lens), v.split(lens), at)])

        return (ks, vs, *self.rows(torch.cat(xs), self.context_hidden(torch.cat(fs)), pos, attend, out=out))

    def unroll(self, features, token_ids, anchors, trunk_index=None, temperature: float = 1.0, generators=None,
               rows=None, tokens: Optional[torch.Tensor] = None, chunk_rows="auto", steps: Optional[int] = None):
        """Draft W tokens after every anchor, all branches of the batch at once, one step at a time.

        Step 1 of a branch at anchor a is context row a - 1 (its output, shared by every branch there); step k >= 2
        reads the token drafted at step k - 1 and that step's hidden output at position a + k - 2, and attends to
        its trunk's context rows < a (shared, packed: no per-branch copy) and its own steps 2 .. k.

        Args:
            features: list of [T_i, F] per trunk (the target's features at ``feature_layers``).
            token_ids: list of [T_i] the trunks' tokens (row p reads x_{p+1}).
            anchors: [N] in [1, T_i - 1] (anchor 0 has no context row).
            trunk_index: [N] (default: all 0).
            temperature: 0 = argmax.
            generators, rows: as ``pick_tokens`` (per-sample randomness).
            tokens: [N, W] target ids to feed instead of sampling (teacher forcing: the reference's tokens for
                training-time test, or tokens drafted before); they are returned as given.
            chunk_rows: rows per chunk of the sampler.
            steps: W, the steps to unroll (training's ``drafter.ttt_steps``); None: ``draft_len``.

        Returns:
            (h [N, W, D] the normed hidden states with their graph, tokens [N, W] target ids).
        """
        feats = [f if torch.is_tensor(f) else f.features for f in features]
        toks = [torch.as_tensor(t, dtype=torch.long) for t in token_ids]
        dev = self.device
        anchors = torch.as_tensor(anchors, dtype=torch.long, device=dev).reshape(-1)
        n, w = anchors.numel(), self.draft_len if steps is None else int(steps)
        tix = (torch.zeros(n, dtype=torch.long, device=dev) if trunk_index is None else
               torch.as_tensor(trunk_index, dtype=torch.long, device=dev).reshape(-1))
        lens = torch.tensor([min(f.shape[0], t.numel() - 1) for f, t in zip(feats, toks)], device=dev)
        bad = (anchors < 1) | (anchors > lens[tix])
        if n == 0 or bool(bad.any()):
            b = int(bad.nonzero()[0]) if n else 0
            raise ValueError("unroll needs >= 1 branch, each anchor in [1, T - 1] of its trunk (anchor 0 has no "
                             "context row: an autoregressive drafter starts from row a - 1 = (x_a, features a - 1))"
                             + (f"; branch {b} has anchor {int(anchors[b])} on a trunk of {int(lens[tix[b]]) + 1}"
                                if n else ""))
        if tokens is not None:
            tokens = torch.as_tensor(tokens, dtype=torch.long, device=dev)
            if tuple(tokens.shape) != (n, w):
                raise ValueError(f"unroll: tokens must be [N, W] = [{n}, {w}]; got {tuple(tokens.shape)}")
        key = tix * (int(anchors.max()) + 1) + anchors
        order = torch.argsort(key, stable=True)
        a_s, t_s = anchors[order], tix[order]
        need = torch.zeros(len(feats), dtype=torch.long, device=dev).scatter_reduce(0, t_s, a_s, "amax")
        starts = torch.cumsum(need, 0) - need
        first, which = torch.unique_consecutive(starts[t_s] + a_s - 1, return_inverse=True)  # step 1: row a - 1
        ks, vs, cn, ch = self._context(feats, toks, need.tolist(), first)
        h_k, g_k = cn[which], ch[which]  # step 1 (sorted order)
        inv = torch.argsort(order)
        out = [h_k]
        drafted = []
        sorted_rows = None if rows is None else [inv[r.to(dev)] for r in rows]
        step_q = [[] for _ in self.layers]
        step_k = [[] for _ in self.layers]
        step_v = [[] for _ in self.layers]
        c_len = int(need.sum())
        for k in range(1, w + 1):
            tok = tokens[order, k - 1] if tokens is not None else \
                self._pick(h_k, temperature, generators, sorted_rows, chunk_rows)
            drafted.append(tok)
            if k == w:
                break
            layout = BranchLayout(starts[t_s], a_s, c_len, k)

            def attend(i, q, kk, vv, layout=layout):
                step_q[i].append(q)
                step_k[i].append(kk)
                step_v[i].append(vv)
                o = branch_attention(torch.stack(step_q[i], 1), torch.stack(step_k[i], 1), torch.stack(step_v[i], 1),
                                     ks[i], vs[i], layout, self.scale, self.attention_backend, self.kernel_paths)
                return o[:, -1]

            h_k, g_k = self.rows(tok, g_k, a_s + k - 1, attend)
            out.append(h_k)
        h = torch.stack(out, 1)[inv]
        tok = torch.stack(drafted, 1)[inv]
        return h, (tokens if tokens is not None else tok)

    def hidden(self, features, anchors, trunk_index=None, anchor_tokens=None, token_ids=None, tokens=None):
        """h [N, W, D] of ``unroll`` teacher-forced on the branch tokens (those drafted, or the reference's).

        Args:
            features, anchors, trunk_index: as ``unroll``.
            anchor_tokens: unused (row a - 1 reads the trunk's token at a).
            token_ids: list of [T_i] the trunks' tokens.
            tokens: [N, W] the branch tokens to feed.

        Returns:
            h [N, W, D] with its graph.
        """
        if token_ids is None or tokens is None:
            raise ValueError(f"a {self.kind} drafter drafts step by step: hidden() needs the trunks' token_ids and the "
                             f"branch tokens to feed (unroll(...) drafts them)")
        return self.unroll(features, token_ids, anchors, trunk_index, tokens=tokens, steps=tokens.shape[1])[0]

    def forward(self, features, token_ids, anchors, trunk_index=None, tokens=None):
        """fp32 logits over the target's vocabulary of the branches teacher-forced on ``tokens`` (each step reads the
        token before it and the drafter's own output of the step before).

        Args:
            features, token_ids, anchors, trunk_index, tokens: as ``unroll``.

        Returns:
            [N, W, V] fp32.
        """
        return self.logits_from_hidden(self.hidden(features, anchors, trunk_index, None, token_ids, tokens))

    @torch.no_grad()
    def sample_tokens(self, h, anchor_tokens, temperature=1.0, generator=None, rows=None, chunk_rows="auto"):
        """Refused: each step's token feeds the next step, so ``unroll`` samples.

        Args:
            h, anchor_tokens, temperature, generator, rows, chunk_rows: as ``DFlashDrafter.sample_tokens``.
        """
        raise ValueError(f"a {self.kind} drafter samples while it unrolls (each step reads the token before): "
                         f"unroll(...) returns the tokens with the hidden states")

    # -- decoding ----------------------------------------------------------------------------------------------
    def context_cache(self, features=None, next_tokens=None, capacity: int = 0) -> "StepContext":
        """A decoding cache of one sequence (every layer's K/V of its context rows and the last row's output)."""
        ctx = StepContext(self, capacity)
        if features is not None:
            self.extend_contexts([ctx], [features], [next_tokens])
        return ctx

    @torch.no_grad()
    def extend_contexts(self, ctxs: Sequence["StepContext"], features: Sequence[torch.Tensor],
                        next_tokens: Sequence[torch.Tensor] = None) -> None:
        """Append context rows to every cache in one pass: ``features[b]`` [n_b, F] at positions len(ctxs[b]) ..,
        each row with the token after it (``next_tokens[b]`` [n_b]; the last is the anchor token)."""
        ctxs = list(ctxs)
        if next_tokens is None or len(next_tokens) != len(ctxs) or len(features) != len(ctxs):
            raise ValueError(f"extend_contexts: a {self.kind} drafter's context row p reads the token x_(p+1): give "
                             f"features and next_tokens, one [n_b] per context ({len(ctxs)})")
        dev = self.device
        fs = [torch.as_tensor(f).to(dev) for f in features]
        xs = [torch.as_tensor(t, dtype=torch.long).reshape(-1).to(dev) for t in next_tokens]
        ns = [int(f.shape[0]) for f in fs]
        if any(x.numel() != m for x, m in zip(xs, ns)):
            raise ValueError(f"extend_contexts: next_tokens {[x.numel() for x in xs]} for feature rows {ns}")
        live = [b for b, m in enumerate(ns) if m]
        if not live:
            return
        pos = torch.cat([torch.arange(len(ctxs[b]), len(ctxs[b]) + ns[b], device=dev) for b in live])
        for b in live:
            ctxs[b].reserve(len(ctxs[b]) + ns[b])

        def attend(i, q, k, v):
            outs, off = [], 0
            for b in live:
                c, m = ctxs[b], ns[b]
                c.k[i][c.length:c.length + m] = k[off:off + m]
                c.v[i][c.length:c.length + m] = v[off:off + m]
                e = c.length + m
                outs.append(causal_attention(q[off:off + m], c.k[i][:e], c.v[i][:e], past=c.length))
                off += m
            return torch.cat(outs)

        normed, hid = self.rows(torch.cat([xs[b] for b in live]), self.context_hidden(torch.cat([fs[b] for b in live])),
                                pos, attend)
        off = 0
        for b in live:
            c, m = ctxs[b], ns[b]
            c.length += m
            c.last = (normed[off + m - 1], hid[off + m - 1], int(xs[b][-1]))
            off += m

    @torch.no_grad()
    def draft_batch(self, ctxs: Sequence["StepContext"], anchor_tokens, temperature: float = 0.0, generators=None):
        """W tokens per sequence, step by step, all sequences at once: step 1 is each cache's last row (whose token
        is the anchor), step k >= 2 attends to its cache in place and its own steps.

        Args:
            ctxs: A StepContexts, each extended up to its anchor (``len(ctx)`` = anchor).
            anchor_tokens: [A] the pending tokens (each cache's last row read it).
            temperature: 0 = argmax.
            generators: None, one Generator, or a list of A.

        Returns:
            (tokens [A, W] target ids, raw logits [A, W, V] over the target's vocabulary, -inf off the draft
            vocabulary).
        """
        ctxs = list(ctxs)
        dev = self.device
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long).reshape(-1).to(dev)
        if not ctxs or atok.numel() != len(ctxs) or any(c.drafter is not self for c in ctxs):
            raise ValueError(f"draft_batch: {atok.numel()} anchor tokens for {len(ctxs)} contexts of this drafter")
        rows = None
        if isinstance(generators, (list, tuple)):
            if len(generators) != len(ctxs):
                raise ValueError(f"draft_batch: {len(generators)} generators for {len(ctxs)} sequences")
            rows = [torch.tensor([b], device=dev) for b in range(len(ctxs))]
        first = [self._first_step(c, int(t)) for c, t in zip(ctxs, atok.tolist())]
        h_k = torch.stack([f[0] for f in first])
        g_k = torch.stack([f[1] for f in first])
        pos0 = torch.tensor([max(len(c), 1) - 1 for c in ctxs], device=dev)
        step_q = [[] for _ in self.layers]
        step_k = [[] for _ in self.layers]
        step_v = [[] for _ in self.layers]
        logits, drafted = [], []
        for k in range(1, self.draft_len + 1):
            z = self.logits_from_hidden(h_k)
            tok = self._pick(h_k, temperature, generators, rows)  # unroll's sampler: the same draws
            logits.append(z)
            drafted.append(tok)
            if k == self.draft_len:
                break

            def attend(i, q, kk, vv):
                step_q[i].append(q)
                step_k[i].append(kk)
                step_v[i].append(vv)
                kc, vc = zip(*(c.kv(i) for c in ctxs))
                o = cached_branch_attention(torch.stack(step_q[i], 1), torch.stack(step_k[i], 1),
                                            torch.stack(step_v[i], 1), list(kc), list(vc), self.scale)
                return o[:, -1]

            h_k, g_k = self.rows(tok, g_k, pos0 + k, attend)
        return torch.stack(drafted, 1), torch.stack(logits, 1)

    def _first_step(self, ctx: "StepContext", anchor_token: int):
        """(normed, hidden_out) of step 1: the cache's last row. An empty cache (anchor 0: a one-token prompt) has no
        row; the step then reads (anchor token, a zero hidden state) at position 0 with no context (any draft is
        lossless: it only costs acceptance)."""
        if ctx.last is None:
            z = torch.zeros(1, self.config.hidden_size, device=self.device, dtype=self.dtype)
            n, h = self.rows(torch.tensor([anchor_token], device=self.device), z, torch.zeros(1, dtype=torch.long,
                             device=self.device), lambda i, q, k, v: causal_attention(q, k, v))
            return n[0], h[0]
        if ctx.last[2] != anchor_token:
            raise ValueError(f"draft_batch: the cache's last row read token {ctx.last[2]}, the anchor token is "
                             f"{anchor_token}: extend the context up to the anchor with next_tokens ending in it")
        return ctx.last[0], ctx.last[1]


class StepContext(DraftContext):
    """Decoding cache of one sequence for an autoregressive drafter: DFlash's ``DraftContext`` (every layer's K/V of
    its context rows [T, Hkv, hd], grown in place) plus the last row's (normed, hidden_out, token).
    ``len(ctx)`` = T = the anchor of the next draft. The steps' own K/V are never kept (they change every round)."""

    def __init__(self, drafter: AutoregressiveDrafter, capacity: int = 0):
        super().__init__(drafter, capacity)
        self.last = None
