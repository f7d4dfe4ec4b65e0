"""Gated DeltaNet (linear attention) over a trunk and a proposal tree: fp32 state checkpoints at prefill, a branch
replays from the nearest one. Kernels and caches: executors/DESIGN.md ("GDN executor").
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from specopd_executors.base import Executor, GrowingCache, register_executor, resolve_kernels, tree_cached
from specopd_executors.options import DEFAULT_CHECKPOINT_EVERY, as_options
from specopd_kernels.gated_delta.naive import gated_delta_step, recurrent_gated_delta_rule

DEFAULT_EVERY = DEFAULT_CHECKPOINT_EVERY


@dataclass
class GDNCache(GrowingCache):
    """One GDN layer's trunk cache (T tokens; H value heads; state K x V per head).

    conv_in [T, Cd] conv inputs (model dtype); g, beta [T, H] fp32; checkpoints [ceil(T/C), H, K, V] fp32
    (checkpoint k = state after the first k*C tokens; [0, H, K, V] when ``keep_checkpoints`` is False);
    final [H, K, V] fp32 (state after all T tokens).
    """

    conv_in: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    checkpoints: torch.Tensor
    final: torch.Tensor
    every: int
    keep_checkpoints: bool = True

    def __len__(self) -> int:
        return int(self.conv_in.shape[0])


@dataclass
class GDNNodes:
    """What ``verify`` keeps of the M tree nodes for ``commit``: conv_in [M, Cd], g, beta [M, H] fp32 and
    state [M, H, K, V] fp32, the recurrent state after each node (M x H x K x V x 4 bytes per layer)."""

    conv_in: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor


def auto_prefill(device, every, dtype) -> str:
    """The Triton prefill that ``gdn_prefill="auto"`` picks: "fla" on CUDA for a 16-bit model (``dtype``) when fla
    passes ``fla_verified`` and C (``every``; None: no checkpoints) is a multiple of its chunk, else "chunk" when C
    is a multiple of 16, else "recurrent". fp32 models never get fla: its fp32 dots run in TF32 on sm_80+
    (``specopd_kernels.gated_delta.fla_chunk.fla_fp32_exact``), our chunk kernel's in IEEE, as the fp32 contract needs."""
    from specopd_kernels.gated_delta.fla_chunk import CHUNK, fla_verified  # imports Triton, only on this path

    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) \
            and (every is None or every % CHUNK == 0) and fla_verified(device):
        return "fla"
    return "chunk" if every is None or every % 16 == 0 else "recurrent"


def _recurrence(options, device, every=None, dtype=torch.float32):
    """The sequence recurrence for prefill / replays (all share ``naive.recurrent_gated_delta_rule``'s
    contract) and its name: "torch" (naive loop) or, with Triton kernels, ``options.gdn_prefill`` ("auto":
    ``auto_prefill`` for the model's ``dtype``)."""
    if resolve_kernels(options, device) == "torch":
        return recurrent_gated_delta_rule, "torch"
    name = as_options(options).gdn_prefill
    if name not in ("auto", "chunk", "fla", "recurrent"):
        raise ValueError(f"unknown gdn_prefill {name!r}; use 'auto', 'chunk', 'fla' or 'recurrent'")
    if name == "auto":
        name = auto_prefill(device, every, dtype)
    from specopd_kernels.gated_delta.fla_chunk import prefill_backend  # imports Triton, only on this path

    run = prefill_backend(name)
    if name == "chunk" and os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter runs the in-chunk forward substitution row by row in Python: 16-token chunks keep
        # the CPU tests short (GPUs use 64; tests/test_kernels_gdn_chunk.py checks every chunk size)
        run = functools.partial(run, chunk_size=16)
    return run, name


def _every(options) -> int:
    c = int(as_options(options).gdn_checkpoint_every)
    if c < 1:
        raise ValueError(f"gdn_checkpoint_every must be >= 1; got {c}")
    return c


def _keep(options) -> bool:
    return bool(as_options(options).gdn_keep_checkpoints)


def _gather_trunk(caches, trunk: torch.Tensor, pos: torch.Tensor, field: str) -> torch.Tensor:
    """Rows ``getattr(caches[trunk[j]], field)[pos[j]]`` -> [n, ...]; zeros where pos < 0."""
    ref = getattr(caches[0], field)
    out = ref.new_zeros(trunk.shape[0], *ref.shape[1:])
    for i, c in enumerate(caches):
        sel = torch.nonzero((trunk == i) & (pos >= 0)).flatten()
        if sel.numel():
            out[sel] = getattr(c, field)[pos[sel]]
    return out


def _trunk_rows(mixer, caches, trunk: torch.Tensor, pos: torch.Tensor):
    """Recurrence inputs of trunk rows (trunk[j], pos[j]) [n]: q, k [n, H, K], v [n, H, V], g, beta [n, H]
    (fp32, prepared as in prefill: conv over the cached conv inputs, split_qkv); rows with pos < 0 are zero
    (a no-op step: g = beta = 0)."""
    wk = mixer.conv_kernel_size
    # conv windows: inputs at pos-W+1 .. pos (zeros before the trunk start and for padding rows)
    win = torch.stack([_gather_trunk(caches, trunk, torch.where(pos >= 0, pos - (wk - 1) + j,
                                                                torch.full_like(pos, -1)).clamp(min=-1), "conv_in")
                       for j in range(wk)], dim=1)  # [n, W, Cd]
    q, k, v = mixer.split_qkv(mixer.conv(win))
    return q, k, v, _gather_trunk(caches, trunk, pos, "g"), _gather_trunk(caches, trunk, pos, "beta")


def _check_bare(caches, trunk: torch.Tensor, anchor: torch.Tensor) -> None:
    """ValueError when an anchor inside a trunk needs a checkpoint its cache does not keep (decoding caches)."""
    lens = torch.tensor([len(c) for c in caches], device=anchor.device)[trunk]
    bare = torch.tensor([not c.keep_checkpoints for c in caches], device=anchor.device)[trunk] & (anchor + 1 != lens)
    if bool(bare.any()):
        p = int(torch.nonzero(bare)[0])
        raise ValueError(f"anchor {int(anchor[p])} is not the last position of its trunk (length "
                         f"{int(lens[p])}), whose cache keeps no GDN checkpoints (prefill(..., "
                         f"keep_checkpoints=False), for decoding); prefill with keep_checkpoints=True to score "
                         f"branches inside the trunk")


def _conv_seq(mixer, u, history, fla: bool = False, cu_seqlens=None):
    """The causal conv over a sequence (``mixer.conv_seq``: u [1, T, Cd], history [1, W-1, Cd] or None); with
    ``fla`` (CUDA, SiLU), fla's ``causal_conv1d`` over [history ; u], or over packed sequences with
    ``cu_seqlens`` (tests/test_fla.py: interpreted on the CPU)."""
    if not fla or mixer.act is not torch.nn.functional.silu:
        if cu_seqlens is not None:
            b = cu_seqlens.tolist()
            return torch.cat([mixer.conv_seq(u[:, lo:hi]) for lo, hi in zip(b[:-1], b[1:])], dim=1)
        return mixer.conv_seq(u, history)
    from fla.modules.causal_conv1d import causal_conv1d  # optional (gpu extra)

    wk = mixer.conv_kernel_size
    x = u if history is None else torch.cat([history.to(u.dtype), u], dim=1)  # [1, (W-1) + T, Cd]
    y, _ = causal_conv1d(x=x.contiguous(), weight=mixer.conv1d.weight[:, 0, :].contiguous(), bias=None,
                         activation="silu", cu_seqlens=cu_seqlens)
    return y if history is None else y[:, wk - 1:]


@register_executor("gdn")
class GDNExecutor(Executor):
    kind = "gdn"

    def prefill(self, mixer, x, positions, prev=None, options=None):
        """The recurrence over the trunk, extending ``prev`` exactly; the GDNCache keeps fp32 state checkpoints every C
        tokens, the final state, the conv inputs, g and beta.

        Args / Returns: as ``specopd_executors.base.Executor.prefill``.
        """
        if x.shape[0] != 1:
            raise ValueError(f"gdn prefill runs one trunk at a time (x [1, T, D]); got batch {x.shape[0]}")
        every, keep = _every(options), _keep(options)
        u, z, g, beta = mixer.project(x)
        wk = mixer.conv_kernel_size
        t0 = len(prev) if prev is not None else 0
        history, init = None, None
        if prev is not None:
            if prev.every != every:
                raise ValueError(f"extending a trunk cache built with gdn_checkpoint_every={prev.every} using "
                                 f"{every}; extend with the cache's own options")
            if prev.keep_checkpoints != keep:
                raise ValueError(f"extending a trunk cache built with keep_checkpoints={prev.keep_checkpoints} "
                                 f"using {keep}; extend with the cache's own options")
            hist = prev.conv_in[-(wk - 1):]
            pad = hist.new_zeros(wk - 1 - hist.shape[0], hist.shape[1])
            history = torch.cat([pad, hist])[None]
            init = prev.final[None]
        run, name = _recurrence(options, x.device, every if keep else None, x.dtype)
        q, k, v = mixer.split_qkv(_conv_seq(mixer, u, history, fla=name == "fla"))
        if name in ("chunk", "fla") and x.dtype in (torch.bfloat16, torch.float16):
            q, k, v = q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)  # tensor-core dots (fp32: IEEE, exact)
        o, final, ck = run(q, k, v, g=g, beta=beta, initial_state=init, checkpoint_every=every if keep else None,
                           start=t0)
        ck = ck[0] if keep else final.new_zeros(0, *final.shape[1:])
        if prev is not None:
            cache = prev.grown({"final": final[0]}, conv_in=u[0], g=g[0], beta=beta[0], checkpoints=ck)
        else:
            cache = GDNCache(u[0], g[0], beta[0], ck, final[0], every, keep)
        return mixer.finish(o, z), cache

    def prefill_packed(self, mixer, x, positions, cu_seqlens, options=None):
        """Fresh trunks packed along the token dim: projections and gates run once over all N tokens; the conv and the
        recurrence run per trunk, or in one varlen pass through fla (``cu_seqlens``) when the prefill backend is "fla"
        (CUDA; tests/test_fla.py runs it interpreted on the CPU).

        Args:
            mixer: the layer's GatedDeltaNet.
            x: [1, N, D] all trunks' tokens.
            positions: [1, N], each trunk from 0.
            cu_seqlens: [n + 1] python ints.
            options: run options.

        Returns:
            (out [1, N, D], list of one GDNCache per trunk).
        """
        every, keep = _every(options), _keep(options)
        u, z, g, beta = mixer.project(x)
        run, name = _recurrence(options, x.device, every if keep else None, x.dtype)
        ck_every = every if keep else None
        bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        if name == "fla":
            from specopd_kernels.gated_delta.fla_chunk import fla_chunk_gated_delta_rule  # imports Triton, only on this path

            cu = torch.tensor(cu_seqlens, dtype=torch.long, device=x.device)
            q, k, v = mixer.split_qkv(_conv_seq(mixer, u, None, fla=True, cu_seqlens=cu))
            if x.dtype in (torch.bfloat16, torch.float16):
                q, k, v = q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)
            o, finals, cks = fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, checkpoint_every=ck_every,
                                                        cu_seqlens=cu)
        else:
            outs, finals, cks = [], [], []
            for a, b in bounds:
                q, k, v = mixer.split_qkv(_conv_seq(mixer, u[:, a:b], None, fla=False))
                if name == "chunk" and x.dtype in (torch.bfloat16, torch.float16):
                    q, k, v = q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)
                o_i, fin, ck = run(q, k, v, g=g[:, a:b], beta=beta[:, a:b], checkpoint_every=ck_every)
                outs.append(o_i)
                finals.append(fin[0])
                cks.append(ck[0] if keep else None)
            o = torch.cat(outs, dim=1)  # [1, N, H, V]
        caches = []
        for j, (a, b) in enumerate(bounds):
            ck = cks[j] if keep else finals[j].new_zeros(0, *finals[j].shape)
            caches.append(GDNCache(u[0, a:b], g[0, a:b], beta[0, a:b], ck, finals[j], every, keep))
        return mixer.finish(o, z), caches

    def anchor_states(self, mixer, caches, trunk: torch.Tensor, anchor: torch.Tensor, options=None) -> torch.Tensor:
        """The fp32 states after trunk[0..anchor] for P (trunk, anchor) pairs (the torch path; the Triton kernel fuses
        this
        with the nodes' steps). Each starts from checkpoint (a+1)//C (or the final state when a = T-1) and replays < C
        trunk tokens: one replay per checkpoint segment in use, all segments batched, so the work is
        <= min(P, T/C) x (C-1) state steps.

        Args:
            mixer: the layer's GatedDeltaNet.
            caches: one GDNCache per trunk.
            trunk: [P] trunk of each pair.
            anchor: [P] anchor of each pair.
            options: run options.

        Returns:
            [P, H, K, V] fp32 states.
        """
        every = caches[0].every
        if any(c.every != every for c in caches):
            raise ValueError("packed trunk caches were built with different gdn_checkpoint_every")
        dev = anchor.device
        n = anchor + 1  # tokens consumed
        lens = torch.tensor([len(c) for c in caches], device=dev)[trunk]
        at_end = n == lens
        ck = torch.where(at_end, torch.zeros_like(n), n // every)
        r = torch.where(at_end, torch.zeros_like(n), n - ck * every)  # replay length < C
        _check_bare(caches, trunk, anchor)
        S = torch.stack([caches[int(i)].final if bool(e) else caches[int(i)].checkpoints[int(c)]
                         for i, e, c in zip(trunk.tolist(), at_end.tolist(), ck.tolist())])
        if not bool((r > 0).any()):
            return S
        # torch path: replay each (trunk, segment) once; pairs capture the state after their r-th step
        need = torch.nonzero(r > 0).flatten()
        seg_key = trunk[need] * (int(ck.max()) + 1) + ck[need]
        segs, row = torch.unique(seg_key, return_inverse=True)
        first = torch.full((segs.numel(),), -1, dtype=torch.long, device=dev).scatter_(0, row, need)
        seg_len = torch.zeros(segs.numel(), dtype=torch.long, device=dev).scatter_reduce_(0, row, r[need], "amax")
        q, k, v, g, beta = self._replay_inputs(mixer, caches, trunk[first], ck[first] * every, seg_len)
        S_seg = S[first]
        out = S.clone()
        r_need = r[need]
        for s in range(int(seg_len.max())):
            S_seg, _ = gated_delta_step(S_seg, q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s])
            done = torch.nonzero(r_need == s + 1).flatten()
            if done.numel():
                out[need[done]] = S_seg[row[done]]
        return out

    @staticmethod
    def _replay_inputs(mixer, caches, trunk: torch.Tensor, start: torch.Tensor, length: torch.Tensor):
        """q, k [P, R, H, K], v [P, R, H, V], g, beta [P, R, H] of trunk positions start[p] .. start[p] +
        length[p] - 1 (R = max length; later steps are zero: g = beta = 0, q = k = v = 0)."""
        steps = torch.arange(int(length.max()), device=start.device)
        pos = start[:, None] + steps[None, :]  # [P, R]
        pos = torch.where(steps[None, :] < length[:, None], pos, torch.full_like(pos, -1))
        p_, r_ = pos.shape
        tr = trunk[:, None].expand(p_, r_).reshape(-1)
        return tuple(t.view(p_, r_, *t.shape[1:]) for t in _trunk_rows(mixer, caches, tr, pos.reshape(-1)))

    def score(self, mixer, x, tree, caches, options=None):
        """Each branch replays from its anchor's nearest checkpoint, then the nodes advance level by level; caches: one
        GDNCache per trunk.

        Args / Returns: as ``specopd_executors.base.Executor.score``.
        """
        return self._score(mixer, x, tree, caches, options, keep=False)[0]

    def verify(self, mixer, x, tree, caches, options=None):
        """``score`` that also keeps every node's conv input, g, beta and the fp32 state after it (``GDNNodes``).

        Args / Returns: as ``specopd_executors.base.Executor.verify``.
        """
        return self._score(mixer, x, tree, caches, options, keep=True)

    def commit(self, mixer, cache, nodes, path, options=None):
        """Extend ``cache`` by ``path``: final = the state after the path's last node; a checkpoint (the state *before*
        the token) at every position T + j that is a multiple of C (unless the cache keeps none).

        Args / Returns: as ``specopd_executors.base.Executor.commit``.
        """
        t, every = len(cache), cache.every
        replace = {"final": nodes.state[path[-1]]}
        new = dict(conv_in=nodes.conv_in[path], g=nodes.g[path], beta=nodes.beta[path])
        edges = [j for j in range(path.numel()) if (t + j) % every == 0] if cache.keep_checkpoints else []
        if edges:  # the state before path token j: the trunk's final state (j = 0) or the state after node j-1
            new["checkpoints"] = torch.stack([cache.final if j == 0 else nodes.state[path[j - 1]] for j in edges])
        return cache.grown(replace, **new)

    def _score(self, mixer, x, tree, caches, options=None, keep=False):
        if len(caches) != tree.num_trunks:
            raise ValueError(f"tree spans {tree.num_trunks} trunk(s) but {len(caches)} cache(s) were given")
        dev = x.device
        wk = mixer.conv_kernel_size
        u, z, g, beta = mixer.project(x)
        m = x.shape[1]
        # conv windows: inputs 1..W-1 steps back along each node's path (ancestors, then the trunk)
        node_ref, trunk_pos = tree.path_refs(wk - 1)  # cached on the tree: computed once per score call
        node_ref, trunk_pos = node_ref.to(dev), trunk_pos.to(dev)
        tix = tree.trunk_index.to(dev)
        cols = []
        for s in range(wk - 2, -1, -1):  # oldest first
            from_trunk = _gather_trunk(caches, tix, trunk_pos[:, s], "conv_in").to(u.dtype)
            from_node = u[0, node_ref[:, s].clamp(min=0)]
            cols.append(torch.where((node_ref[:, s] >= 0)[:, None], from_node, from_trunk))
        cols.append(u[0])
        q, k, v = mixer.split_qkv(mixer.conv(torch.stack(cols, dim=1)))  # [M, H, K], [M, H, V]
        g, beta = g[0], beta[0]
        if resolve_kernels(options, dev) == "triton":
            o, S_nodes = self._replay_triton(mixer, caches, tree, q, k, v, g, beta, keep)
            return mixer.finish(o[None], z), (GDNNodes(u[0], g, beta, S_nodes) if keep else None)
        # anchor states of the roots, one per distinct (trunk, anchor)
        parent = tree.parent.to(dev)
        roots = torch.nonzero(parent < 0).flatten()
        pair = tix[roots] * (1 + int(tree.anchor.max())) + tree.anchor.to(dev)[roots]
        uniq, inv = torch.unique(pair, return_inverse=True)
        first = torch.full((uniq.numel(),), -1, dtype=torch.long, device=dev).scatter_(
            0, inv, roots)  # any root of each pair
        S_anchor = self.anchor_states(mixer, caches, tix[first], tree.anchor.to(dev)[first], options)
        # advance level by level; slot[u] = row of node u's state within its level
        o = torch.empty(m, *v.shape[1:], dtype=torch.float32, device=dev)
        slot = torch.empty(m, dtype=torch.long, device=dev)
        S_nodes = S_anchor.new_empty(m, *S_anchor.shape[1:]) if keep else None  # [M, H, K, V] fp32
        S_prev = None
        for d, nodes in enumerate(tree.levels()):
            nodes = nodes.to(dev)
            if d == 0:
                S_in = S_anchor[inv]  # level 0 = the roots, in node order
            else:
                S_in = S_prev[slot[parent[nodes]]]
            S_prev, o[nodes] = gated_delta_step(S_in, q[nodes], k[nodes], v[nodes], g[nodes], beta[nodes])
            slot[nodes] = torch.arange(nodes.numel(), device=dev)
            if keep:
                S_nodes[nodes] = S_prev
        out = mixer.finish(o[None], z)
        return out, (GDNNodes(u[0], g, beta, S_nodes) if keep else None)

    @staticmethod
    def _replay_triton(mixer, caches, tree, q, k, v, g, beta, keep):
        """Node outputs o [M, H, V] fp32 (and states [M, H, K, V] fp32 with ``keep``) through the fused replay
        kernel: per (trunk, checkpoint) segment, load the checkpoint, replay < C trunk tokens, run the branch
        nodes. Only the checkpoints segments start from are gathered (not every trunk's)."""
        from specopd_kernels.gated_delta.replay import build_replay_plan, gdn_tree_replay  # Triton, only on this path

        every = caches[0].every
        if any(c.every != every for c in caches):
            raise ValueError("packed trunk caches were built with different gdn_checkpoint_every")
        dev = q.device
        lens = tuple(len(c) for c in caches)
        _check_bare(caches, tree.trunk_index, tree.anchor)

        def build():
            plan = build_replay_plan(tree.anchor, tree.parent, tree.trunk_index, lens, every)
            # states0 rows (each trunk's checkpoints then its final state) -> the rows segments use, packed
            n_ck = [(t + every - 1) // every for t in lens]
            row_trunk = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(n_ck) + 1)
            row_ck = torch.cat([torch.arange(n + 1) for n in n_ck])
            used, seg_state = torch.unique(plan.seg_state, return_inverse=True)
            plan.seg_state = seg_state
            return plan.to(dev), (row_trunk[used].tolist(), row_ck[used].tolist(), n_ck), \
                (plan.replay_trunk.to(dev), plan.replay_pos.to(dev))

        plan, (s_trunk, s_ck, n_ck), (r_trunk, r_pos) = tree_cached(tree, ("gdn_replay", lens, every, str(dev)), build)
        states0 = torch.stack([caches[i].final if c == n_ck[i] else caches[i].checkpoints[c]
                               for i, c in zip(s_trunk, s_ck)])  # [S, H, K, V] fp32
        rq, rk, rv, rg, rbeta = _trunk_rows(mixer, caches, r_trunk, r_pos)
        o, states = gdn_tree_replay(states0, rk, rv, rg, rbeta, q, k, v, g, beta, plan, store_states=keep)
        return o, states

