"""The speculative round, written once and batched over sequences: draft -> verify -> accept -> commit, one target
pass per round. Used by ``specopd.eval.decoder.SpeculativeDecoder`` and by Draft-OPD's rollout
(``specopd.train.baselines``). Sequence state and the four steps: specopd/DESIGN.md ("The speculative round").
Plain decoding is not this loop with no drafter: it needs no draft, accept or drafter cache (its loops and why two:
``specopd.eval.decoder``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence as Seq, Tuple, runtime_checkable

import torch

from specopd.tree import ProposalTree


@runtime_checkable
class BlockDrafter(Protocol):
    """What a speculative round needs of a drafter (``specopd.drafters``: DFlash and DSpark): a decoding
    context cache per sequence, grown by the committed features, and one block drafted per sequence in one
    call. A = sequences of the round, W = ``draft_len``, F = feature width, V = vocab."""

    @property
    def draft_len(self) -> int:
        """W: tokens drafted per block."""

    @property
    def feature_layers(self) -> tuple:
        """The target layers whose outputs are the drafter's features (``start`` prefills with them)."""

    def context_cache(self) -> object:
        """An empty decoding cache of one sequence's context (its ``len`` = positions held)."""

    def extend_contexts(self, ctxs: Seq[object], features: Seq[torch.Tensor],
                        next_tokens: Seq[torch.Tensor] = None) -> None:
        """Append features[b] [n_b, F] to ctxs[b], all in one pass; ``next_tokens[b]`` [n_b] the token after each new
        row (the last one the anchor token): autoregressive drafters (EAGLE-3, MTP) read it, block drafters not."""

    def draft_batch(self, ctxs: Seq[object], anchor_tokens: torch.Tensor, temperature: float,
                    generators=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """One block per sequence anchored at len(ctxs[b]).

        Args:
            ctxs: A drafter context caches (``drafter.context_cache()``), one per sequence.
            anchor_tokens: [A] the anchor token of each sequence.
            temperature: T (0: argmax).
            generators: one torch.Generator, or one per sequence, or None.

        Returns:
            (tokens [A, W], raw logits q [A, W, V]).
        """


@dataclass
class Sequence:
    """One sequence between rounds. cache: every token the target has run (a TargetCache with the drafter's
    features, built with keep_checkpoints=False); last: the pending token at position len(cache), or None when
    the cache's last token is the anchor (a one-token prompt before its first round); logits [V]: the target's
    logits after the cache, only when last is None; ctx: the drafter's decoding cache of the context features
    (positions < anchor; ``draft`` extends it lazily, so it may lag the cache between rounds)."""

    cache: object
    last: Optional[int]
    logits: Optional[torch.Tensor] = None
    ctx: Optional[object] = None  # the drafter's context cache (``drafter.context_cache()``), made by ``draft``

    def __len__(self) -> int:
        """Committed tokens (the cache plus the pending token)."""
        return len(self.cache) + (self.last is not None)

    @property
    def anchor(self) -> int:
        """Position of the anchor token (the drafter's block starts there)."""
        return len(self.cache) if self.last is not None else len(self.cache) - 1

    @property
    def anchor_token(self) -> int:
        return int(self.last) if self.last is not None else int(self.cache.token_ids[-1])


def start(target, prompt_ids, feature_layers: Seq[int] = (), gdn_checkpoint_every: int = 64) -> Sequence:
    """Prefill a prompt once (all but its last token, which is pending). A decoding cache keeps no GDN
    checkpoints (every anchor is at the end) and no logits.

    Args:
        target: a ``TargetModel``.
        prompt_ids: [T0] the prompt.
        feature_layers: the drafter's feature layers (the cache keeps their outputs).
        gdn_checkpoint_every: C of the GDN executor.

    Returns:
        the ``Sequence``.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(target.device)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token (e.g. BOS)")
    opts = dict(feature_layers=tuple(feature_layers), gdn_checkpoint_every=gdn_checkpoint_every,
                keep_checkpoints=False)
    if ids.numel() == 1:
        cache = target.prefill(ids, keep_logits=True, **opts)
        logits, cache.logits = cache.logits[-1], None
        return Sequence(cache, None, logits)
    return Sequence(target.prefill(ids[:-1], keep_logits=False, **opts), int(ids[-1]))


def draft(drafter: BlockDrafter, seqs: Seq[Sequence], temperature: float, generators=None) -> tuple:
    """Draft one block after every sequence's anchor in ONE drafter call over their context caches.

    Each sequence's ``ctx`` (created here on first use) is first extended by the features the target committed
    since it was last used (``cache.features[len(ctx):anchor]``: the prompt in round 1, then only the accepted
    tokens), so nothing is recomputed over the whole context; then ``drafter.draft_batch``.

    Args:
        drafter: a ``BlockDrafter``.
        seqs: A sequences.
        temperature: T (0: argmax).
        generators: one torch.Generator, or one per sequence.

    Returns:
        (drafts [A, W], q logits [A, W, V]).
    """
    new, nxt = [], []
    for s in seqs:
        if s.ctx is None:
            s.ctx = drafter.context_cache()
        have, need = len(s.ctx), s.anchor
        if have > need:
            raise ValueError(f"the drafter context holds {have} positions but the anchor is at {need}: a context "
                             f"cache belongs to one sequence and only grows")
        if have < need and s.cache.features is None:
            raise ValueError("the sequence's cache has no drafter features: start(target, prompt, "
                             "feature_layers=drafter.feature_layers)")
        new.append(s.cache.features[have:need] if have < need else None)
        ids = s.cache.token_ids[have + 1: need + 1].to("cpu")  # row p reads x_(p+1); the last is the anchor token
        nxt.append(torch.cat([ids, torch.tensor([s.anchor_token])[: need - have - ids.numel()]]))
    grow = [(s.ctx, f, x) for s, f, x in zip(seqs, new, nxt) if f is not None]
    if grow:  # [n_b, F] per sequence: only what was committed since its last draft
        drafter.extend_contexts(*zip(*grow))
    atok = torch.tensor([s.anchor_token for s in seqs])
    return drafter.draft_batch([s.ctx for s in seqs], atok, temperature, generators)


def verify(target, seqs: Seq[Sequence], drafts: torch.Tensor) -> tuple:
    """One target pass over all sequences' chains. drafts [A, k] -> (p_logits [A, k + 1, V]: p for d_1..d_k
    and the bonus position, VerifyState for ``commit``)."""
    a, k = drafts.shape
    if a != len(seqs) or k < 1:
        raise ValueError(f"verify: drafts must be [A={len(seqs)}, k >= 1]; got {tuple(drafts.shape)}")
    drafts = drafts.detach().to("cpu", torch.long)
    trees = []
    for s, d in zip(seqs, drafts):
        chain = d if s.last is None else torch.cat([torch.tensor([s.last]), d])
        trees.append(ProposalTree.from_branches(torch.tensor([len(s.cache) - 1]), chain.view(1, -1)))
    tree = ProposalTree.pack(trees)
    logits, state = target.score(tree, [s.cache for s in seqs], return_state=True)
    if all(s.last is not None for s in seqs):
        return logits, state  # [A, k + 1, V]
    rows = tree.split(state.logits)  # per sequence [k + 1, V] or [k, V]
    p = torch.stack([r if s.last is not None else torch.cat([s.logits[None].to(r.dtype), r])
                     for s, r in zip(seqs, rows)])
    return p, state


def _generator_list(generators, a: int) -> list:
    if generators is None or isinstance(generators, torch.Generator):
        return [generators] * a
    gens = list(generators)
    if len(gens) != a:
        raise ValueError(f"accept: {len(gens)} generators for {a} sequences (give one, or one per sequence)")
    return gens


def accept(drafts: torch.Tensor, q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float,
           generators=None) -> tuple:
    """Verify drafted blocks of A sequences at once. T = 0: exact match with argmax p. T > 0: lossless
    rejection sampling on softmax(logits / T).

    Args:
        drafts: [A, k] drafted tokens.
        q_logits: [A, k, V] the drafter's logits, raw.
        p_logits: [A, k + 1, V] the target's logits, raw.
        temperature: T.
        generators: one torch.Generator, or one per sequence (its draws: k uniforms, then one token).

    Returns:
        (accepted [A] list of int n_a in [0, k], next_tokens [A] list of int: the resampled token at the
        first rejection, or the bonus token from p at node k when all k were accepted).
    """
    a, k = drafts.shape
    if q_logits.shape[:2] != (a, k) or p_logits.shape[:2] != (a, k + 1):
        raise ValueError(f"accept: drafts {tuple(drafts.shape)}, q {tuple(q_logits.shape)}, p "
                         f"{tuple(p_logits.shape)}; need [A, k], [A, k, V], [A, k + 1, V]")
    dev = p_logits.device
    d = drafts.to(dev, torch.long)
    ar = torch.arange(a, device=dev)
    if temperature == 0:
        best = p_logits.argmax(-1)  # [A, k + 1]
        n = (d == best[:, :k]).long().cumprod(-1).sum(-1)  # [A]
        return n.tolist(), best[ar, n].tolist()
    p = torch.softmax(p_logits.float() / temperature, dim=-1)  # [A, k + 1, V]
    q = torch.softmax(q_logits.float().to(dev) / temperature, dim=-1)  # [A, k, V]
    gens = _generator_list(generators, a)
    u = torch.stack([torch.rand(k, generator=g, device=g.device if g is not None else dev).to(dev)
                     for g in gens])  # [A, k]
    pd, qd = p[:, :k].gather(-1, d[..., None])[..., 0], q.gather(-1, d[..., None])[..., 0]
    n = (u * qd < pd).long().cumprod(-1).sum(-1)  # accept d_i with prob min(1, p/q), in order
    p_n = p[ar, n]  # [A, V]: p at the first rejected position, or at the bonus node
    resid = (p_n - q[ar, n.clamp(max=k - 1)]).clamp_min(0)
    # p == q up to rounding leaves no residual mass; rejection then had ~zero probability: sample p
    rows = torch.where(((n < k) & (resid.sum(-1) > 0))[:, None], resid, p_n)
    nxt = [torch.multinomial(r.to(g.device if g is not None else dev), 1, generator=g) for r, g in zip(rows, gens)]
    return n.tolist(), torch.cat([x.to(dev) for x in nxt]).tolist()


def commit(target, seqs: Seq[Sequence], state, accepted: Seq[int], next_tokens: Seq[int],
           keep: Optional[Seq[bool]] = None) -> list:
    """Extend each sequence by its verified ``[last, d_1..d_n]`` from the verify pass (``target.commit``, no
    new pass); ``next_tokens`` become the pending tokens.

    Args:
        target: the ``TargetModel`` that ran ``verify``.
        seqs: A sequences.
        state: the verify pass's state.
        accepted: [A] accepted draft tokens n_a per sequence.
        next_tokens: [A] the resampled / bonus token per sequence.
        keep: [A] bool; False: sequence a is finished and returned as it was (no commit work for it).

    Returns:
        the new Sequences; they keep the drafter context caches, which the next ``draft`` extends by the committed
        features (the verify pass's, through ``target.commit``).
    """
    keep = [True] * len(seqs) if keep is None else list(keep)
    sizes = torch.bincount(state.tree.trunk_index, minlength=len(seqs)).tolist()  # nodes per chain
    paths, off = [], 0
    for s, n, kp, m in zip(seqs, accepted, keep, sizes):
        paths.append(torch.arange(off, off + n + int(s.last is not None)) if kp else torch.zeros(0, dtype=torch.long))
        off += m
    caches = target.commit([s.cache for s in seqs], state, paths)
    return [Sequence(c, int(t), ctx=s.ctx) if kp else s for c, t, kp, s in zip(caches, next_tokens, keep, seqs)]
