"""Tensor parallelism of a target over the ranks of one group, on torch's DTensor (``torch.distributed.tensor``).

``load_target(path, tensor_parallel=TensorParallel(mesh))`` builds every rank's shard of the target. What is split:
attention heads (each rank holds whole key/value groups with their query heads: GQA, gated attention, QSA's
attention), MLPs (column-parallel gate / up, row-parallel down), MoE experts (expert-parallel: a block of experts
per rank, the router replicated), Gated DeltaNet key-head groups (their value heads, conv channels, gates, and so
their recurrent states and fp32 checkpoints), and ``lm_head`` over the vocabulary (``shard_vocab``: the head gathers
its logits; the fused losses and the branch sampler take the local block, see ``vocab_group``). Everything else
is replicated: embeddings, norms, hyper-connections, PLE, the QSA indexer (so every rank computes the full index
score in the unsharded order and selects bitwise the same blocks as an unsharded target).

Each sharded weight is cut by ``distribute_tensor(w, mesh, [Shard(dim)], src_data_rank=None)`` (no communication:
every rank slices its own block) after the rows of interleaved layouts are permuted so that a rank's block is
contiguous. ``ShardPlan.shard`` (the plan ``shard_target`` keeps as ``model.shard_plan``) is the one place a full
weight becomes a rank's block: ``load_target`` cuts the checkpoint with it, and a policy swap
(``TargetModel.copy_weights_``) cuts each new full weight with it and copies the block into the existing local tensor.
Row-parallel outputs are summed as ``Partial -> Replicate`` DTensors, the vocabulary as
``Shard(-1) -> Replicate``. Executors see plain local tensors: their caches hold the local heads only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specopd.models.common import MLP, Experts, Linear


class TensorParallel:
    """One tensor-parallel group: a 1-D ``DeviceMesh`` over the ranks that shard one target. ``size`` 1 is the
    unsharded target (no mesh needed). ``shard_vocab=False`` keeps ``lm_head`` whole on every rank
    (``runtime.tp_lm_head: replicated``)."""

    def __init__(self, mesh=None, shard_vocab: bool = True):
        self.mesh, self.shard_vocab = mesh, bool(shard_vocab)
        self.size = 1 if mesh is None else int(mesh.size())
        self.rank = 0 if mesh is None else int(mesh.get_local_rank())

    @classmethod
    def planned(cls, size: int, shard_vocab: bool = False) -> "TensorParallel":
        """Rank 0 of a group of ``size`` without a process group: for shapes only (the memory plan on meta)."""
        tp = cls(None, shard_vocab)
        tp.size = int(size)
        return tp

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``t`` (a row-parallel partial result), on every rank."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        return DTensor.from_local(t, self.mesh, [Partial()]).redistribute(self.mesh, [Replicate()]).to_local()

    def gather(self, t: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        """Every rank's block of ``t`` along ``dim`` (torch.chunk's split of ``full``), concatenated, on every rank."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        dim = dim % t.dim()
        shape = list(t.shape)
        shape[dim] = int(full)
        stride = torch.empty(shape, device="meta").stride()
        d = DTensor.from_local(t, self.mesh, [Shard(dim)], shape=torch.Size(shape), stride=stride)
        return d.redistribute(self.mesh, [Replicate()]).to_local()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` reduced over the group in place ("sum" | "max" | "min"): the same bits on every rank."""
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op], group=self.mesh.get_group())
        return t

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[size x rows, ...]: every rank's equal block ``t`` [rows, ...], in rank order, on every rank."""
        import torch.distributed as dist

        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, torch 2.13
        gather(out, t, group=self.mesh.get_group())
        return out

    def gather_cols(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, size x cols]: every rank's equal block ``t`` [rows, cols] side by side (the vocabulary's logits)."""
        g = self.gather_rows(t)  # [size * rows, cols]
        r = t.shape[0]
        return g.view(self.size, r, t.shape[1]).transpose(0, 1).reshape(r, self.size * t.shape[1])

    def vocab_block(self, vocab: int) -> tuple:
        """(first, end) of this rank's equal block of a vocabulary of ``vocab`` tokens; ValueError naming the fix
        when the group does not divide it (the vocabulary-parallel loss and sampler need equal blocks)."""
        if vocab % self.size:
            raise ValueError(f"vocab_size = {vocab} does not divide over runtime.tensor_parallel = {self.size}: the "
                             f"vocabulary-parallel lm_head needs equal blocks; choose a tensor_parallel that divides "
                             f"it, or set runtime.tp_lm_head=replicated (the whole lm_head on every rank)")
        c = vocab // self.size
        return self.rank * c, (self.rank + 1) * c

    def shard(self, w: torch.Tensor, dim: int, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's block of ``w`` along ``dim`` (after ``perm`` reorders that dim), as a plain tensor."""
        from torch.distributed.tensor import Shard, distribute_tensor

        if perm is not None:
            w = w.index_select(dim, perm)
        return distribute_tensor(w, self.mesh, [Shard(dim)], src_data_rank=None).to_local().contiguous()


class RowParallelLinear(Linear):
    """``Linear`` whose input features are split over the group: local matmul, sum over ranks, then the bias."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelHead(Linear):
    """``lm_head`` split over the vocabulary: local logits, gathered over ranks ([..., V] on every rank)."""

    tp: TensorParallel
    full_vocab: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather(super().forward(x), -1, self.full_vocab)


def vocab_group(head: nn.Module) -> Optional[TensorParallel]:
    """The group ``head`` (a target's ``lm_head``) is split over by vocabulary, or None when it is whole: the fused
    losses and the branch sampler then take its local block [V / N, D] and this group. ValueError when the group
    does not divide the vocabulary (``TensorParallel.vocab_block``): they need equal blocks."""
    tp = getattr(head, "tp", None) if isinstance(head, VocabParallelHead) else None
    if tp is None or tp.size == 1:
        return None
    tp.vocab_block(head.full_vocab)
    return tp


class ExpertParallel(Experts):
    """A block of experts per rank (``first`` .. ``first + num_local - 1``); tokens routed elsewhere add nothing
    here, the outputs are summed over ranks."""

    tp: TensorParallel

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce(super().forward(x, idx, weights))


class ShardPlan:
    """How this rank's shard of a target is cut from the full weights: ``rules`` {parameter name: (dim, perm or
    None)} (names not there are replicated) and every parameter's unsharded shape. Kept as ``model.shard_plan``;
    ``shard`` is the one owner of "a full weight -> this rank's block": ``load_target`` and the policy swap
    (``TargetModel.copy_weights_``) both cut with it."""

    def __init__(self, tp: TensorParallel, rules: dict, full_shapes: dict):
        self.tp, self.rules, self.full_shapes = tp, rules, full_shapes

    def shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``w``, the full (unsharded) weight of parameter ``name`` (``w`` itself when the
        parameter is replicated)."""
        rule = self.rules.get(name)
        return w if rule is None else self.tp.shard(w, *rule)


def shard_target(model: nn.Module, tp: TensorParallel) -> ShardPlan:
    """Turn ``model`` (built on the meta device, unsharded) into this rank's shard: local shapes, local head counts,
    the parallel module classes. Returns its ``ShardPlan`` (also kept as ``model.shard_plan``), which cuts the
    checkpoint's tensors. Raises ValueError naming what does not divide."""
    from specopd.models.llama import Attention
    from specopd.models.qwen3_next import GatedAttention, GatedDeltaNet

    n = tp.size
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    plan: dict = {}
    for name, mod in list(model.named_modules()):
        pre = name + "." if name else ""
        if isinstance(mod, (Attention, GatedAttention)):
            plan.update({pre + k: v for k, v in _shard_attention(mod, n, name).items()})
        elif isinstance(mod, GatedDeltaNet):
            plan.update({pre + k: v for k, v in _shard_gdn(mod, n, name).items()})
        elif isinstance(mod, MLP):
            plan.update({pre + k: v for k, v in _shard_mlp(mod, n, name).items()})
        elif isinstance(mod, Experts):
            e = mod.num_experts
            _divides(e, n, f"{name}: num_experts")
            mod.__class__ = ExpertParallel
            mod.tp, mod.first = tp, tp.rank * (e // n)
            _resize(mod, "gate_up_proj", 0, e // n)
            _resize(mod, "down_proj", 0, e // n)
            plan.update({pre + "gate_up_proj": (0, None), pre + "down_proj": (0, None)})
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear):
            mod.tp = tp
    model.tensor_parallel = tp
    if tp.shard_vocab:
        head = model.lm_head
        v = head.out_features
        head.__class__ = VocabParallelHead
        head.tp, head.full_vocab = tp, v
        c = -(-v // n)  # torch.chunk's block: ranks past the last block hold none
        local_v = max(0, min(c, v - tp.rank * c))
        _resize(head, "weight", 0, local_v)
        head.out_features = local_v
        plan["lm_head.weight"] = (0, None)
    model.shard_plan = ShardPlan(tp, plan, shapes)
    return model.shard_plan


def _divides(count: int, n: int, what: str) -> None:
    if count % n:
        raise ValueError(f"{what} = {count} does not divide over runtime.tensor_parallel = {n}; choose a "
                         f"tensor_parallel that divides it (or 1)")


def _resize(mod: nn.Module, pname: str, dim: int, size: int) -> None:
    """Replace ``mod.<pname>`` (meta) by one of ``size`` along ``dim``."""
    p = getattr(mod, pname)
    shape = list(p.shape)
    shape[dim] = size
    setattr(mod, pname, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=False))


def _column(lin: Linear, rows: int) -> None:
    _resize(lin, "weight", 0, rows)
    if lin.bias is not None:
        _resize(lin, "bias", 0, rows)
    lin.out_features = rows


def _row(lin: Linear, cols: int) -> None:
    _resize(lin, "weight", 1, cols)
    lin.in_features = cols
    lin.__class__ = RowParallelLinear


def _blocks(perm_of_rank, n: int) -> torch.Tensor:
    """Concatenate each rank's index list: the permutation that makes rank r's rows the r-th contiguous block."""
    return torch.cat([torch.as_tensor(perm_of_rank(r), dtype=torch.long) for r in range(n)])


def _shard_attention(mod, n: int, name: str) -> dict:
    """Whole key/value groups per rank, with their query heads (contiguous in q/k/v rows and o_proj columns)."""
    _divides(mod.num_kv_heads, n, f"{name}: num_key_value_heads")
    hq, hkv, hd = mod.num_heads // n, mod.num_kv_heads // n, mod.head_dim
    q_rows = mod.q_proj.out_features // mod.num_heads  # hd, or 2 hd for gated attention ([q | gate] per head)
    _column(mod.q_proj, hq * q_rows)
    _column(mod.k_proj, hkv * hd)
    _column(mod.v_proj, hkv * hd)
    _row(mod.o_proj, hq * hd)
    mod.num_heads, mod.num_kv_heads = hq, hkv
    plan = {f"{p}.weight": (0, None) for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"{p}.bias": (0, None) for p in ("q_proj", "k_proj", "v_proj") if getattr(mod, p).bias is not None})
    plan["o_proj.weight"] = (1, None)
    return plan


def _shard_gdn(mod, n: int, name: str) -> dict:
    """Whole key heads per rank with their value heads. The conv channels (q | k | v, each head-major) and the
    unfused in_proj_qkv rows are permuted so that a rank's q, k and v channels are one contiguous block."""
    _divides(mod.num_k_heads, n, f"{name}: linear_num_key_heads")
    hk, h, dk, dv = mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
    lk, lv = hk // n, h // n
    kd, vd = mod.key_dim, mod.value_dim

    def channels(r):  # rank r's conv channels, in the local (q | k | v) order
        q = range(r * lk * dk, (r + 1) * lk * dk)
        k = range(kd + r * lk * dk, kd + (r + 1) * lk * dk)
        v = range(2 * kd + r * lv * dv, 2 * kd + (r + 1) * lv * dv)
        return list(q) + list(k) + list(v)

    conv_perm = _blocks(channels, n)
    plan = {"conv1d.weight": (0, conv_perm), "dt_bias": (0, None), "A_log": (0, None), "out_proj.weight": (1, None)}
    local_cd = 2 * lk * dk + lv * dv
    if mod.fused_qkvz:  # rows grouped per key head already: contiguous blocks
        _column(mod.in_proj_qkvz, mod.in_proj_qkvz.out_features // n)
        _column(mod.in_proj_ba, mod.in_proj_ba.out_features // n)
        plan.update({"in_proj_qkvz.weight": (0, None), "in_proj_ba.weight": (0, None)})
    else:
        _column(mod.in_proj_qkv, local_cd)
        for p in ("in_proj_z", "in_proj_b", "in_proj_a"):
            _column(getattr(mod, p), getattr(mod, p).out_features // n)
        plan.update({"in_proj_qkv.weight": (0, conv_perm), "in_proj_z.weight": (0, None),
                     "in_proj_b.weight": (0, None), "in_proj_a.weight": (0, None)})
    w = mod.conv_kernel_size
    mod.conv1d = nn.Conv1d(local_cd, local_cd, w, bias=False, groups=local_cd, padding=w - 1, device="meta")
    mod.conv1d.weight.requires_grad_(False)
    _resize(mod, "dt_bias", 0, lv)
    _resize(mod, "A_log", 0, lv)
    _row(mod.out_proj, lv * dv)
    mod.num_k_heads, mod.num_v_heads = lk, lv
    mod.key_dim, mod.value_dim, mod.conv_dim = lk * dk, lv * dv, local_cd
    return plan


def _shard_mlp(mod: MLP, n: int, name: str) -> dict:
    i = mod.gate_proj.out_features
    _divides(i, n, f"{name}: intermediate_size")
    for p in (mod.gate_proj, mod.up_proj):
        _column(p, i // n)
    _row(mod.down_proj, i // n)
    plan = {"gate_proj.weight": (0, None), "up_proj.weight": (0, None), "down_proj.weight": (1, None)}
    plan.update({f"{p}.bias": (0, None) for p in ("gate_proj", "up_proj") if getattr(mod, p).bias is not None})
    return plan
