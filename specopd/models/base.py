"""The target-model base: one layer loop run three ways (plain, prefill, score) through ``RunContext``; verify and
commit for speculative decoding. Design: specopd/models/DESIGN.md ("Target models").
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch
from torch import nn

from specopd_executors import get_executor
from specopd_executors.base import check_kernels
from specopd_executors.options import ExecOptions
from specopd.models.context import RunContext, TargetCache, VerifyState  # noqa: F401  (also re-exported here)
from specopd.models.packed import prefill_batch
from specopd.tree import ProposalTree


class DecoderLayer(nn.Module):
    """Base of decoder layers with one token mixer under its HF name: ``self_attn`` (attention kinds) or
    ``linear_attn`` (GDN). ``mixer`` is whichever the layer has."""

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn


class TargetModel(nn.Module):
    """Base of every target. Subclasses set ``config`` (with vocab_size, hidden_size, num_hidden_layers),
    ``layer_kinds`` (one of "gqa"/"qsa"/"gdn" per layer), and implement ``backbone``, ``embed``, ``head``.

    Rules for subclasses: no buffers (compute RoPE tables on the fly), parameter names as in the Hugging
    Face checkpoint after ``checkpoint_key(name)``, every parameter loaded from the checkpoint.
    """

    model_type: str = "?"
    layer_kinds: list
    kernels: str = "auto"  # executors' kernels: "auto" | "torch" | "triton" (load_target(..., kernels=))
    kernel_paths = None  # the recipe's kernels: section (load_target(..., kernel_paths=)); None: all "auto"
    packed_ok: bool = True  # packed prefill works here (prefill_batch sets False after PackedUnsupported)

    # -- defaults for the standard pre-norm decoder stack in HF naming (``model.embed_tokens``,
    #    ``model.layers[i].{input_layernorm, mixer, post_attention_layernorm, mlp}``, ``model.norm``,
    #    ``lm_head``); models with another residual structure (qwen4_exp) override them ------------------
    def backbone(self, ctx: RunContext) -> torch.Tensor:
        """[B, T] ids in ctx -> last hidden state [B, T, D], *before* the final norm."""
        h = self.embed(ctx.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = h + ctx.mix(i, layer.mixer, layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            ctx.record(i, h)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., D] (drafters share them)."""
        return self.model.embed_tokens(input_ids)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The backbone's output [..., D] -> what lm_head reads [..., D]: the final norm (``model.norm``); the
        identity for models without one (qwen4_exp: its hyper-connection mixer is the last step). The fused
        losses work from it: ``head(h) == lm_head(head_input(h))`` holds for every model (tested)."""
        norm = getattr(self.model, "norm", None)
        return h if norm is None else norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: [..., D] -> logits [..., V]."""
        return self.lm_head(self.head_input(h))

    @staticmethod
    def checkpoint_key(name: str) -> Optional[str]:
        """Map a checkpoint tensor name to our parameter name; None to ignore it (e.g. MTP heads)."""
        return name

    # -- provided -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward (the reference): [B, T] -> logits [B, T, V]."""
        input_ids = self.check_ids(input_ids)
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        ctx = RunContext("plain", input_ids, pos)
        return self.head(self.backbone(ctx))

    def hidden_states(self, input_ids: torch.Tensor, feature_layers: Sequence[int]) -> torch.Tensor:
        """Plain forward returning concatenated layer outputs [B, T, len(ids) * D] (drafter features)."""
        input_ids = self.check_ids(input_ids)
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        ctx = RunContext("plain", input_ids, pos, feature_layers=feature_layers)
        self.backbone(ctx)
        return torch.cat([ctx.features[i] for i in feature_layers], dim=-1)

    def full_shapes(self) -> dict:
        """{parameter name: its shape in the unsharded target}: the parameters' own shapes, or a tensor-parallel
        shard's full ones (its ``shard_plan``, ``specopd.models.tensor_parallel.ShardPlan``)."""
        plan = getattr(self, "shard_plan", None)
        return {k: tuple(p.shape) if plan is None else plan.full_shapes[k] for k, p in self.named_parameters()}

    @torch.no_grad()
    def copy_weights_(self, state_dict: dict) -> None:
        """Copy ``state_dict`` (our parameter name -> tensor) into the existing parameters, in place: the same
        tensors stay (a drafter sharing the embedding and lm_head sees the new ones), caches keyed on a weight's
        version are rebuilt. Every name, shape and dtype is checked before anything is copied; the first mismatch
        is a ValueError naming it (a missing or unknown name, a shape, a dtype). A tensor-parallel shard takes the
        full (unsharded) weights and cuts each with its ``shard_plan`` (the cut ``load_target`` makes), one
        weight at a time."""
        own, shapes = dict(self.named_parameters()), self.full_shapes()
        plan = getattr(self, "shard_plan", None)
        whole = "" if plan is None else " (unsharded)"
        for k in own:
            if k not in state_dict:
                raise ValueError(f"copy_weights_: the new weights lack {k!r} (every parameter is replaced; none is kept "
                                 f"from the old weights)")
        for k, v in state_dict.items():
            p = own.get(k)
            if p is None:
                raise ValueError(f"copy_weights_: {k!r} is not a parameter of this {self.model_type} target")
            if tuple(v.shape) != shapes[k]:
                raise ValueError(f"copy_weights_: {k!r} has shape {tuple(v.shape)}, the target's{whole} is {shapes[k]}")
            if v.dtype != p.dtype:
                raise ValueError(f"copy_weights_: {k!r} is {v.dtype}, the target's parameter is {p.dtype} (convert it "
                                 f"first: specopd.models.loading.policy_weights does)")
        for k, p in own.items():
            block = state_dict[k] if plan is None else plan.shard(k, state_dict[k])
            if block.shape != p.shape:  # copy_ would broadcast: a plan that disagrees with the shard is a bug
                raise RuntimeError(f"copy_weights_: the block of {k!r} has shape {tuple(block.shape)}, the shard's "
                                   f"parameter {tuple(p.shape)}")
            p.copy_(block)

    @torch.no_grad()
    def prefill(self, trunk_ids: torch.Tensor, cache: Optional[TargetCache] = None, *,
                feature_layers: Optional[Sequence[int]] = None, gdn_checkpoint_every: int = 64,
                keep_logits: bool = True, keep_hidden: Optional[bool] = None,
                keep_checkpoints: bool = True) -> TargetCache:
        """Run the trunk once and keep per-layer caches, logits and the drafter's features.

        With ``cache`` the trunk is *extended* by ``trunk_ids`` (incremental decoding): the result covers
        ``cache.token_ids + trunk_ids`` and keeps the cache's options (its logits cover all T only if ``cache`` had
        logits); ``cache`` keeps its contents.

        Args:
            trunk_ids: [T] token ids.
            cache: a TargetCache to extend, or None.
            feature_layers: target layer ids whose outputs form the drafter features.
            gdn_checkpoint_every: C, the GDN layers' fp32 state checkpoint interval.
            keep_logits: keep ``cache.logits`` [T, V].
            keep_hidden: keep ``cache.hidden`` [T, D], what lm_head reads (training: with keep_logits=False, so the
                trunk's logits never exist); None: as the extended cache does (else False).
            keep_checkpoints: False (decoding) keeps only the GDN final state: only anchors at the trunk's end can be
                scored.

        Returns:
            TargetCache with layer caches, logits [T, V] | None, hidden [T, D] | None, features [T, F] | None.
        """
        trunk_ids = torch.as_tensor(trunk_ids, device=self.device).reshape(-1).to(torch.long)
        self.check_ids(trunk_ids.view(1, -1))
        if feature_layers is None:
            feature_layers = cache.feature_layers if cache is not None else ()
        elif cache is not None and tuple(feature_layers) != tuple(cache.feature_layers):
            raise ValueError(f"feature_layers {tuple(feature_layers)} differ from the cache's "
                             f"{tuple(cache.feature_layers)}; extend a cache with its own feature layers")
        opts = dataclasses.replace(cache.options) if cache is not None else ExecOptions(
            gdn_checkpoint_every=int(gdn_checkpoint_every), gdn_keep_checkpoints=bool(keep_checkpoints))
        if opts.gdn_checkpoint_every < 1:
            raise ValueError("gdn_checkpoint_every must be >= 1")
        if keep_hidden is None:
            keep_hidden = cache is not None and cache.hidden is not None
        t0 = len(cache) if cache is not None else 0
        pos = torch.arange(t0, t0 + trunk_ids.numel(), device=self.device).view(1, -1)
        ctx = RunContext("prefill", trunk_ids.view(1, -1), pos, prev=cache, feature_layers=feature_layers,
                         options=self.run_options(opts))
        h = self.backbone(ctx)
        hn = self.head_input(h)[0] if (keep_logits or keep_hidden) else None  # [T, D]
        logits = self.lm_head(hn) if keep_logits else None
        hidden = hn if keep_hidden else None
        feats = torch.cat([ctx.features[i][0] for i in feature_layers], dim=-1) if feature_layers else None
        layers = [ctx.layer_caches[i] for i in range(self.num_layers)]
        extra = {k: v for k, v in ctx.layer_caches.items() if not isinstance(k, int)}
        if cache is not None:
            new = {"token_ids": trunk_ids}
            replace = {"layers": layers, "extra": extra}
            for name, val in (("logits", logits), ("hidden", hidden)):
                if val is not None and getattr(cache, name) is not None:
                    new[name] = val
                else:
                    replace[name] = val  # None, or only these tokens' rows when the cache kept none
            if feats is not None and cache.features is not None:
                new["features"] = feats
            return cache.grown(replace, **new)
        return TargetCache(token_ids=trunk_ids, layers=layers, logits=logits, hidden=hidden, features=feats,
                           feature_layers=tuple(feature_layers), options=opts, extra=extra)

    def prefill_batch(self, trunks: Sequence[torch.Tensor], **kw) -> list:
        """Prefill several fresh trunks ([T_i] ids each) in one packed varlen pass -> one TargetCache per trunk,
        equal to ``[self.prefill(t, **kw) for t in trunks]`` (which it falls back to on the CPU and for models
        that cannot run packed). Keywords as ``prefill`` (no ``cache``) plus ``packed`` = "auto" | True | False.
        See ``specopd.models.packed``."""
        return prefill_batch(self, trunks, **kw)

    def score(self, tree: ProposalTree, cache: Union[TargetCache, Sequence[TargetCache]], *,
              return_hidden: bool = False, return_state: bool = False, return_logits: bool = True):
        """Logits of every tree node as if each node's path had been run from scratch after its anchor:
        ``p[b, j] == target(trunk[:a_b + 1] + tokens[b, :j + 1])[-1]``.

        Args:
            tree: ProposalTree packed over len(cache) trunks (N chain branches of W, or M general nodes).
            cache: the trunks' TargetCache (one, or a sequence).
            return_hidden: also what lm_head reads at every node (``head_input``), [N, W, D] / [M, D].
            return_state: also a ``VerifyState`` for ``commit`` (verify; needs the logits). Its size: every node's
                K/V per attention layer and the fp32 state after every node per GDN layer.
            return_logits: False with return_hidden: only the hidden states (training: [N, W, V] never exists).

        Returns:
            logits [N, W, V] (chains) or [M, V]; with return_hidden / return_state a tuple (logits, hidden, state) of
            the requested parts, in that order.
        """
        if not (return_logits or return_hidden) or (return_state and not return_logits):
            raise ValueError("score: return_logits=False needs return_hidden=True and return_state=False")
        caches = [cache] if isinstance(cache, TargetCache) else list(cache)
        tree.validate([len(c) for c in caches], self.vocab_size)
        fl = ()
        if return_state:
            fl = caches[0].feature_layers if caches[0].features is not None else ()
            if any(tuple(c.feature_layers) != tuple(caches[0].feature_layers) or (c.features is None) != (not fl)
                   for c in caches):
                raise ValueError("verify (return_state=True) needs every cache built with the same feature_layers")
        ids = tree.tokens.to(self.device).view(1, -1)
        pos = tree.positions.to(self.device).view(1, -1)
        ctx = RunContext("score", ids, pos, tree=tree, caches=caches, options=self.run_options(caches[0].options),
                         feature_layers=fl, keep_state=return_state)
        hn = self.head_input(self.backbone(ctx)[0])  # [M, D]
        flat = self.lm_head(hn) if return_logits else None  # [M, V]
        out = [tree.reshape_nodes(flat)] if return_logits else []
        if return_hidden:
            out.append(tree.reshape_nodes(hn))
        if return_state:
            feats = torch.cat([ctx.features[i][0] for i in fl], dim=-1) if fl else None
            out.append(VerifyState(tree=tree, trunk_lens=[len(c) for c in caches], layers=ctx.node_states,
                                   logits=flat, features=feats, hidden=hn))
        return out[0] if len(out) == 1 else tuple(out)

    @torch.no_grad()
    def commit(self, caches: Sequence[TargetCache], state: VerifyState, paths: Sequence) -> list:
        """Extend each trunk by an accepted path of the verified tree, from the verify pass's states (no new
        target pass). caches: the caches given to ``score`` (one per trunk); paths: per trunk the accepted
        node indices of ``state.tree`` (packed numbering), root first; the root must hang off the trunk's last
        position; an empty path leaves the trunk as it is. Returns one TargetCache per trunk, equal to
        ``prefill(tokens of the path, cache=cache)`` (token ids, every layer's cache, features; logits too if
        the cache keeps them). The given caches keep their contents."""
        caches = [caches] if isinstance(caches, TargetCache) else list(caches)
        paths = self._check_paths(caches, state, paths)
        tree, out, dev = state.tree, [], self.device
        for cache, path in zip(caches, paths):
            if path.numel() == 0:
                out.append(cache)
                continue
            path_dev = path.to(dev)
            new = {key: get_executor(mixer.kind).commit(mixer, cache.layer_cache(key), nodes, path_dev,
                                                        options=self.run_options(cache.options))
                   for key, (mixer, nodes) in state.layers.items()}
            grow = {"token_ids": tree.tokens[path].to(dev)}
            if cache.features is not None and state.features is not None:
                grow["features"] = state.features[path_dev]
            if cache.logits is not None:
                grow["logits"] = state.logits[path_dev].to(cache.logits.dtype)
            if cache.hidden is not None:
                grow["hidden"] = state.hidden[path_dev].to(cache.hidden.dtype)
            layers = [new.get(i, c) for i, c in enumerate(cache.layers)]
            extra = {k: new.get(k, c) for k, c in cache.extra.items()}
            out.append(cache.grown({"layers": layers, "extra": extra}, **grow))
        return out

    def run_options(self, cache_options: ExecOptions) -> ExecOptions:
        """Executor options of one call: the cache's, with ``kernels`` and ``kernel_paths`` from the target unless the
        cache names its own; checked here (a clear error naming the fix, e.g. "triton" on a CPU without
        TRITON_INTERPRET=1)."""
        kernels = self.kernels if cache_options.kernels is None else cache_options.kernels
        chosen = self.kernel_paths if cache_options.kernel_paths is None else cache_options.kernel_paths
        opts = dataclasses.replace(cache_options, kernels=kernels, kernel_paths=chosen)
        check_kernels(opts.kernels, self.device)
        return opts

    @staticmethod
    def _check_paths(caches, state: VerifyState, paths) -> list:
        """paths -> list of [L_i] long CPU tensors; ValueError naming the problem for anything that is not an
        accepted path of the verified tree extending its trunk."""
        tree = state.tree
        if len(caches) != tree.num_trunks or len(paths) != tree.num_trunks:
            raise ValueError(f"commit: the verified tree spans {tree.num_trunks} trunk(s); got {len(caches)} "
                             f"cache(s) and {len(paths)} path(s) (one path per trunk, [] to commit nothing)")
        lens = [len(c) for c in caches]
        if lens != list(state.trunk_lens):
            raise ValueError(f"commit: the caches have lengths {lens} but were verified at {list(state.trunk_lens)};"
                             f" commit with the caches given to score(..., return_state=True)")
        depth_max = int(tree.depth.max()) + 1
        out = []
        for i, p in enumerate(paths):
            p = torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu()
            if p.numel() > depth_max:
                raise ValueError(f"commit: path of trunk {i} has {p.numel()} nodes, deeper than the verified tree "
                                 f"({depth_max} levels)")
            if p.numel():
                bad = (p < 0) | (p >= tree.num_nodes)
                if bool(bad.any()):
                    raise ValueError(f"commit: path of trunk {i} names node {int(p[bad][0])}, outside the verified "
                                     f"tree's {tree.num_nodes} nodes")
                wrong = tree.trunk_index[p] != i
                if bool(wrong.any()):
                    u = int(p[wrong][0])
                    raise ValueError(f"commit: path of trunk {i} names node {u}, which belongs to trunk "
                                     f"{int(tree.trunk_index[u])}")
                if int(tree.parent[p[0]]) >= 0 or int(tree.anchor[p[0]]) != lens[i] - 1:
                    raise ValueError(f"commit: path of trunk {i} starts at node {int(p[0])}, not a root anchored "
                                     f"at the trunk's last position {lens[i] - 1} (anchor {int(tree.anchor[p[0]])}, "
                                     f"parent {int(tree.parent[p[0]])}); a commit extends the trunk at its end")
                linked = tree.parent[p[1:]] == p[:-1]
                if not bool(linked.all()):
                    j = int(torch.nonzero(~linked)[0]) + 1
                    raise ValueError(f"commit: path of trunk {i} is not a root-first parent chain: node {int(p[j])} "
                                     f"has parent {int(tree.parent[p[j]])}, not {int(p[j - 1])}")
            out.append(p)
        return out

    def check_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.vocab_size}); got min {int(input_ids.min())}, "
                f"max {int(input_ids.max())} (is the tokenizer the target's own?)"
            )
        return input_ids
