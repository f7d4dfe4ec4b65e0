"""The project's one token sampler: inverse CDF over chunks of rows, one fp64 uniform per token from that
sample's generator, T = 0 = argmax. ``sample_from_hidden`` builds the logits from hidden states chunk by chunk
(never [N, W, V]); ``pick_tokens`` takes logits that exist anyway. Drafters, the trainer's branches and
decoding all draw through it, so the tokens do not depend on the chunking or on the batch. ``multinomial_tokens``
is the second rule, ``torch.multinomial`` (with a nucleus), kept for the references that were recorded with it
(``specopd eval``'s prepared data, the synthetic references): their files and caches keep those numbers.
"""
from __future__ import annotations

import torch

from specopd_kernels import paths
from specopd_kernels.sampling import cpu as sample_cpu
from specopd.losses import ChunkBuffers, chunk_logits, even_chunk, raw_logits, resolve_chunk_rows, softmax_



def use_sample_kernel(device, temperature: float, kernel_paths=None) -> bool:
    """Whether draws at ``temperature`` on ``device`` go through kernels/sampling: the same rule as ``draw_``, from
    bf16 or fp32 logits in one pass per row (no fp32 copy, no [R, V] softmax). ``kernel_paths`` (the recipe's
    ``kernels:`` section; None: all "auto") ``cpu_sampling`` is "auto" (the C kernel when it builds, else torch) |
    "cpu" (the kernel, an error if it does not build) | "torch" (``draw_``)."""
    which = paths.mode(kernel_paths, "cpu_sampling")
    if temperature <= 0 or which == "torch" or torch.device(device).type != "cpu":
        return False
    if which == "cpu" and not sample_cpu.available():
        raise RuntimeError(f"kernels.cpu_sampling=cpu but the CPU sampling kernel does not build: "
                           f"{sample_cpu.unavailable_reason()}; set kernels.cpu_sampling=auto to use the torch path")
    return sample_cpu.available()


def _uniforms(n: int, per: int, rows, generators, device, draw: bool = True) -> tuple:
    """One fp64 uniform per token: generator i draws for all tokens of rows[i] at once (rows[i] in order, the
    trailing dims row-major). Returns (u [n * per] fp64, the flat token indices to draw, in that order).
    ``draw=False`` (greedy): no random numbers are consumed, u stays 0."""
    if rows is None:
        rows = [torch.arange(n, device=device)]
    rows = list(rows)
    if generators is None or isinstance(generators, torch.Generator):
        generators = [generators] * len(rows)
    generators = list(generators)
    if len(generators) != len(rows):
        raise ValueError(f"{len(rows)} row groups but {len(generators)} generators (give one, or one per group)")
    u = torch.zeros(n * per, dtype=torch.float64, device=device)
    todo = []
    for r, g in zip(rows, generators):
        r = torch.as_tensor(r, dtype=torch.long, device=device).reshape(-1)
        if r.numel() == 0:
            continue
        fr = (r[:, None] * per + torch.arange(per, device=device)).reshape(-1)  # flat tokens, row-major
        if draw:
            gdev = g.device if g is not None else device  # CPU generators with GPU logits
            u[fr] = torch.rand(fr.numel(), generator=g, dtype=torch.float64, device=gdev).to(device)
        todo.append(fr)
    return u, (torch.cat(todo) if todo else torch.zeros(0, dtype=torch.long, device=device))


CDF_BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF (``draw_``)


def draw_(z: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """Tokens [R] from fp32 logits z [R, V] (overwritten): argmax at T = 0, else inverse CDF of softmax(z / T)
    at u [R] (fp64 in [0, 1)): the first token whose cumulative probability exceeds u * total.

    Two levels, in fp64, so that nothing beyond z itself is [R, V]: block sums of ``CDF_BLOCK`` entries
    [R, V / B] locate the block holding u * total, then one [R, B] cumulative sum inside it. A token with
    probability 0 is never drawn (its CDF step is empty)."""
    if temperature == 0:
        return z.argmax(-1)
    p, _ = softmax_(z.div_(temperature))  # [R, V] fp32, in place
    r, v = p.shape
    bsz = min(CDF_BLOCK, v)
    full = v // bsz
    # block sums in fp32 (pairwise summation, ~1e-7 relative: the level of fp32 p itself; a dtype=float64 sum
    # would copy p), then fp64 from there on
    sums = [p[:, : full * bsz].view(r, full, bsz).sum(-1)]  # [R, full]
    if full * bsz < v:
        sums.append(p[:, full * bsz:].sum(-1, keepdim=True))
    bsum = torch.cat(sums, 1).double()  # [R, nb]
    bcdf = torch.cumsum(bsum, -1)
    total = bcdf[:, -1:]
    t = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [R, 1], < total
    blk = torch.searchsorted(bcdf, t, right=True).clamp_(max=bcdf.shape[1] - 1)  # [R, 1]
    before = torch.where(blk > 0, bcdf.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(t))  # <= t
    cols = blk * bsz + torch.arange(bsz, device=p.device)  # [R, B]
    inside = cols < v
    vals = torch.where(inside, p.gather(1, cols.clamp(max=v - 1)).double(), 0.0)  # [R, B]
    j = torch.searchsorted(before + torch.cumsum(vals, -1), t, right=True)  # [R, 1]
    # t < the block's end, so j < B but for rounding between the two levels: then its last token with p > 0
    last = torch.where(vals > 0, torch.arange(bsz, device=p.device), -1).amax(-1, keepdim=True)
    return (blk * bsz + torch.minimum(j, last)).squeeze(1)


def multinomial_tokens(logits: torch.Tensor, temperature: float, generator, top_p: float = 1.0) -> torch.Tensor:
    """Tokens by ``torch.multinomial`` over softmax(logits / T) within the nucleus; argmax at T = 0. The reference
    data's rule (see the module docstring), not ``pick_tokens``' inverse CDF.

    Args:
        logits: [..., V] (one position [V], or rows [R, V]).
        temperature: T >= 0 (0 = greedy).
        generator: the torch.Generator to draw from (None at T = 0).
        top_p: the nucleus mass: the smallest prefix of the sorted probabilities whose mass reaches it (the top
            token always kept); 1 = the whole vocabulary.

    Returns:
        [...] long tokens.
    """
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p
        probs = torch.zeros_like(probs).scatter(-1, si, torch.where(keep, sp, 0.0))
    dev = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(dev), 1, generator=generator).squeeze(-1)


def _check_temperature(temperature: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")


@torch.no_grad()
def sample_from_hidden(h: torch.Tensor, weight: torch.Tensor, temperature: float, rows=None, generators=None, *,
                       markov=None, chunk_rows="auto", tp=None, kernel_paths=None) -> torch.Tensor:
    """Tokens drawn from softmax((h @ weight^T [+ e @ w2^T]) / T), logits built chunk by chunk; argmax at T = 0.

    Inverse-CDF sampling with one fp64 uniform per token: generator i draws ``u`` for all of its tokens at once
    (rows[i] in order, then the trailing dims row-major), so the tokens do not depend on ``chunk_rows`` or on the
    other samples of the batch. The drawn token always has p > 0. Memory: one [chunk_rows, V] chunk, never [N, ..., V].

    Args:
        h: [N, ..., D] hidden states (e.g. [N, W, D], or [N, D] for one DSpark slot).
        weight: [V, D] lm_head weight.
        temperature: T >= 0 (0 = greedy).
        rows: list of index tensors into dim 0, group i drawn with generators[i]; None: every row.
        generators: one torch.Generator (or None) per group, or one for all rows.
        markov: DSpark's ``(e [N, ..., r], w2 [V, r])``.
        chunk_rows: rows of logits per chunk, or "auto".
        tp: the group the vocabulary is split over (``specopd.models.tensor_parallel.vocab_group``): ``weight`` is
            this rank's block [V / N, D] (W2 stays [V, r]); each chunk's local logits are gathered into [R, V] for
            the draw, so every rank draws the same tokens, the ones this sampler draws from those logits whole.
        kernel_paths: the recipe's ``kernels:`` section (``use_sample_kernel``); None: all "auto".

    Returns:
        [N, ...] long tokens; rows of no group are -1.
    """
    _check_temperature(temperature)
    lead = h.shape[:-1]
    terms = [h.reshape(-1, h.shape[-1]), weight]
    if markov is not None:
        e, w2 = markov
        if tuple(e.shape[:-1]) != tuple(lead):
            raise ValueError(f"markov e must be [{', '.join(map(str, lead))}, r]; got {tuple(e.shape)}")
        terms += [e.reshape(-1, e.shape[-1]), w2]
    xs, ws = terms[0::2], terms[1::2]
    if tp is not None and tp.size > 1:
        return _sample_gathered(lead, xs, ws, temperature, rows, generators, chunk_rows, tp, kernel_paths)
    chunk = resolve_chunk_rows(chunk_rows, weight.shape[0], h.device)
    kernel = use_sample_kernel(h.device, temperature, kernel_paths)
    with ChunkBuffers.pooled(min(chunk, max(1, terms[0].shape[0])), weight.shape[0], h.device) as bufs:
        logits_of = (lambda r: raw_logits(xs, ws, r, bufs, 0)) if kernel else (lambda r: chunk_logits(xs, ws, r, bufs))
        return _sample(lead, weight.shape[0], logits_of, temperature, rows, generators, chunk, h.device, kernel)


def _sample_gathered(lead, xs, ws, temperature, rows, generators, chunk_rows, tp, kernel_paths):
    """``sample_from_hidden`` over a vocabulary split across ``tp``: local [R, V / N] logits per chunk (the lm_head's
    block; W2 cut to the same rows), gathered into [R, V] fp32 on every rank for the draw. A gather, not a
    vocabulary-parallel draw: the inverse CDF normalises by the softmax's sum, whose rounding a sum of per-rank sums
    would change, and these tokens must be the unsharded sampler's (the same uniforms, the same rule)."""
    v = ws[0].shape[0] * tp.size
    lo, hi = tp.vocab_block(v)
    ws = [ws[0]] + [w[lo:hi] for w in ws[1:]]  # DSpark's W2 covers the whole vocabulary
    dev = xs[0].device
    chunk = resolve_chunk_rows(chunk_rows, v, dev)
    kernel = use_sample_kernel(dev, temperature, kernel_paths)
    return _sample(lead, v, lambda r: tp.gather_cols(chunk_logits(xs, ws, r)), temperature, rows, generators, chunk,
                   dev, kernel)


@torch.no_grad()
def pick_tokens(logits: torch.Tensor, temperature: float, generator=None, rows=None, chunk_rows="auto",
                kernel_paths=None) -> torch.Tensor:
    """The same sampler as ``sample_from_hidden`` on logits that exist anyway (decoding's q and p); argmax at T = 0.

    Args:
        logits: [N, ..., V].
        temperature: T >= 0 (0 = greedy).
        generator: one torch.Generator (or None) for all rows, or with ``rows`` one per group.
        rows: list of index tensors into N (per-sample randomness in training); None: every row.
        chunk_rows: rows per chunk, or "auto".
        kernel_paths: the recipe's ``kernels:`` section (``use_sample_kernel``); None: all "auto".

    Returns:
        [N, ...] long tokens.
    """
    _check_temperature(temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    kernel = (use_sample_kernel(logits.device, temperature, kernel_paths)
              and flat.dtype in (torch.float32, torch.bfloat16))
    return _sample(logits.shape[:-1], logits.shape[-1], (lambda r: flat[r]) if kernel else (lambda r: flat[r].float()),
                   temperature, rows, generator, chunk_rows, logits.device, kernel)


def _sample(lead, vocab: int, logits_of, temperature: float, rows, generators, chunk_rows, device, kernel=False):
    """Tokens [*lead] from ``logits_of(flat rows)`` chunk by chunk: fp32 [R, V] that ``draw_`` may overwrite, or
    (``kernel``) fp32 / bf16 [R, V] for kernels/sampling."""
    per = int(torch.tensor(lead[1:]).prod()) if len(lead) > 1 else 1
    n = int(lead[0]) if len(lead) else 1
    chunk = resolve_chunk_rows(chunk_rows, vocab, device)
    out = torch.full((n * per,), -1, dtype=torch.long, device=device)
    u, todo = _uniforms(n, per, rows, generators, device, draw=temperature > 0)
    chunk = even_chunk(todo.numel(), chunk)
    with torch.autocast(torch.device(device).type, enabled=False):  # precision is set here, not by autocast
        for s in range(0, todo.numel(), chunk):
            r = todo[s: s + chunk]
            z = logits_of(r)
            out[r] = sample_cpu.draw(z, u[r], temperature, CDF_BLOCK) if kernel else draw_(z, u[r], temperature)
    return out.view(lead)
