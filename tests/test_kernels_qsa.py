"""QSA kernels: indexer scores, top-k (identical selections, ties to the lowest group index), gathered sparse
attention, and the blockwise prefill against the per-query sequential reference on a real QSA layer
(fp32; on the CPU under TRITON_INTERPRET=1)."""
import pytest
import torch

import kernel_check
from specopd_kernels.qsa.naive import gathered_attention, group_scores, sequential_attention, sequential_selection

FILE = __file__


def check_indexer() -> None:
    """Scores equal the reference on the complete groups; selections equal ``select_groups`` for k below,
    at and above the number of complete groups, with exact ties (zeros, a block of equal scores, ties that
    straddle the k-th place), no complete group at all, and G above the top-k kernel's tile."""
    from specopd_kernels.qsa.indexer import index_scores, topk_groups
    from specopd.models.qwen4_exp import select_groups

    dev = kernel_check.device()
    g_ = torch.Generator().manual_seed(0)
    nq, hi, di, g = 24, 3, 32, 90
    q, keys = torch.randn(nq, hi, di, generator=g_), torch.randn(g, di, generator=g_)
    n = torch.randint(0, g + 1, (nq,), generator=g_)
    n[:3] = torch.tensor([0, 1, g])
    got = index_scores(q.to(dev), keys.to(dev), n.to(dev)).cpu()
    ref = group_scores(q, keys)
    seen = torch.arange(g)[None, :] < n[:, None]
    assert kernel_check.rel(got[seen], ref[seen]) <= 1e-5
    q8, keys8 = q[:, :, :8].contiguous(), keys[:, :8].contiguous()  # head dim 8: padded to tl.dot's 16
    got8 = index_scores(q8.to(dev), keys8.to(dev), n.to(dev)).cpu()
    assert kernel_check.rel(got8[seen], group_scores(q8, keys8)[seen]) <= 1e-5
    ties = ref.clone()
    ties[:, ::3] = 0.0  # exact zeros (all heads' ReLU = 0)
    ties[5:9, :40] = 1.5  # 40 equal scores: the k-th place falls inside a run of ties
    ties[10, :] = 0.0  # all equal
    for k in (1, 16, 40, 90, 128):
        for s in (got, ties):
            sel = topk_groups(s.to(dev), n.to(dev), k).cpu()
            assert torch.equal(sel, select_groups(s, n, k)), k
    # rows longer than one 1024-score tile, ties across the tile edge
    big = torch.rand(3, 1100, generator=g_).round(decimals=2)
    nb = torch.tensor([1100, 1030, 700])
    for k in (600, 1024):
        assert torch.equal(topk_groups(big.to(dev), nb.to(dev), k).cpu(), select_groups(big, nb, k)), k


def test_indexer_scores_and_topk():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "indexer")


def check_sparse_attention() -> None:
    """Gathered attention with GQA groups (12 heads / 2 KV heads, padded to 16 rows), key lists of 1 key, of
    several tiles, and with repeated rows; and head dim 8 (padded to tl.dot's 16 columns)."""
    from specopd_kernels.qsa.sparse_attention import sparse_attention

    dev = kernel_check.device()
    g_ = torch.Generator().manual_seed(1)
    for h, hkv, d in ((12, 2, 64), (4, 2, 8)):
        nq, n_rows, s = 9, 300, 150
        q = torch.randn(nq, h, d, generator=g_)
        k, v = torch.randn(n_rows, hkv, d, generator=g_), torch.randn(n_rows, hkv, d, generator=g_)
        idx = torch.randint(0, n_rows, (nq, s), generator=g_)
        n_keys = torch.tensor([1, 2, 63, 64, 65, 150, 149, 100, 7])
        ref = gathered_attention(q, k, v, idx, n_keys, d ** -0.5)
        got = sparse_attention(q.to(dev), k.to(dev), v.to(dev), idx.to(dev), n_keys.to(dev), d ** -0.5)
        assert kernel_check.rel(got, ref) <= 1e-5, (d, kernel_check.rel(got, ref))


def test_sparse_attention():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "sparse")


def _mixer(seed=0, budget=16):
    from oracle import CONFIGS

    from specopd.models.qwen4_exp import QSAttention

    torch.manual_seed(seed)
    mixer = QSAttention(CONFIGS["qwen4_exp_text"](indexer_budget=budget), layer_idx=1)
    with torch.no_grad():  # RMSNorm weights start at zero (1 + w): give them values so they are exercised
        for p in mixer.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.2)
    return mixer.eval()


def check_prefill(t: str, t0: str, chunk: str) -> None:
    """The blockwise prefill (kernels end to end) on a real QSA layer equals the per-query sequential
    reference: selections identical, outputs within 1e-5; also for a chunk of queries that extends earlier
    tokens (queries t0..T-1 over keys 0..T-1)."""
    from specopd_kernels.qsa.sparse_attention import qsa_prefill

    t, t0, chunk = int(t), int(t0), int(chunk)
    dev = kernel_check.device()
    mixer = _mixer()
    x = torch.randn(1, t, mixer.q_proj.in_features, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(t)[None]
    with torch.no_grad():
        ref_out = sequential_attention(mixer, x, pos)
        ref_sel = sequential_selection(mixer, x, pos)
        q, k, v, gate = mixer.project(x, pos)
        qi, raw = mixer.index_project(x, pos)
        g = t // mixer.ratio
        r = mixer.ratio
        pooled = mixer.pool_keys(raw[0, : g * r].reshape(g, r, -1), pos[0, : g * r: r])
        last = torch.arange(t0, t)
        o, sel = qsa_prefill(q[0, t0:].to(dev), k[0].to(dev), v[0].to(dev), qi[0, t0:].to(dev), pooled.to(dev),
                             last.to(dev), mixer.topk, mixer.ratio, mixer.scaling, chunk=chunk)
        out = mixer.finish(o.cpu()[None], gate[:, t0:])
    assert kernel_check.rel(out, ref_out[:, t0:]) <= 1e-5, kernel_check.rel(out, ref_out[:, t0:])
    for i in range(t0, t):
        groups = ref_sel[i][0]
        exp = torch.full((mixer.topk,), -1, dtype=torch.long)
        exp[: groups.numel()] = groups
        assert torch.equal(sel[i - t0].cpu(), exp), (i, sel[i - t0], exp)


@pytest.mark.parametrize("t,t0,chunk", [(45, 0, 16), (45, 29, 7)], ids=["prefill", "extension"])
def test_prefill_matches_sequential_reference(t, t0, chunk):
    """T = 45 > budget + 3 = 19: selection is sparse for most queries; chunks cross group edges."""
    pytest.importorskip("triton")
    kernel_check.run(FILE, "prefill", str(t), str(t0), str(chunk))


def test_group_rows_lists_selected_tokens_then_tail():
    """Key rows per query: the selected groups' tokens ascending, then the tail; as ``token_mask`` says."""
    from specopd_kernels.qsa.sparse_attention import group_rows

    mixer = _mixer()
    sel = torch.tensor([[0, 3, -1, -1], [1, 2, 4, 5], [-1, -1, -1, -1]])
    last = torch.tensor([17, 23, 2])
    idx, n_keys = group_rows(sel, last, 4)
    mask = mixer.token_mask(sel, last, 24)
    for q in range(3):
        assert idx[q, : n_keys[q]].tolist() == torch.nonzero(mask[q]).flatten().tolist()


def test_pack_rows_moves_valid_keys_first():
    from specopd_kernels.qsa.sparse_attention import pack_rows

    rows = torch.tensor([[5, 9, 2, 7], [1, 3, 4, 8]])
    ok = torch.tensor([[False, True, False, True], [True, True, True, False]])
    idx, n = pack_rows(rows, ok)
    assert n.tolist() == [2, 3] and idx[0, :2].tolist() == [9, 7] and idx[1, :3].tolist() == [1, 3, 4]


def check_gpu() -> None:
    """bf16 on CUDA at the qwen4_exp shape (24 / 2 heads, hd 256, indexer 4 x 128, budget 2048) and T = 4096:
    selections agree with the fp32 reference except near-ties, outputs within bf16 noise."""
    from specopd_kernels.qsa.indexer import index_scores, topk_groups
    from specopd_kernels.qsa.sparse_attention import group_rows, sparse_attention
    from specopd.models.qwen4_exp import select_groups

    g_ = torch.Generator().manual_seed(3)
    t, h, hkv, d, hi, di, topk = 4096, 24, 2, 256, 4, 128, 512
    qi, keys = torch.randn(t, hi, di, generator=g_), torch.randn(t // 4, di, generator=g_)
    n = (torch.arange(t) + 1) // 4
    s_ref = group_scores(qi, keys)
    sel_ref = select_groups(s_ref, n, topk)
    s = index_scores(qi.cuda(), keys.cuda(), n.cuda())
    sel = topk_groups(s, n.cuda(), topk).cpu()
    assert (sel == sel_ref).float().mean() > 0.999
    q = torch.randn(t, h, d, generator=g_)
    k, v = torch.randn(t, hkv, d, generator=g_), torch.randn(t, hkv, d, generator=g_)
    idx, nk = group_rows(sel_ref, torch.arange(t), 4)
    ref = gathered_attention(q[-64:], k, v, idx[-64:], nk[-64:], d ** -0.5)
    b = lambda x: x.to("cuda", torch.bfloat16)  # noqa: E731
    got = sparse_attention(b(q[-64:]), b(k), b(v), idx[-64:].cuda(), nk[-64:].cuda(), d ** -0.5)
    assert kernel_check.rel(got, ref) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qsa_kernels_bf16_on_cuda():
    check_gpu()


def check_fp16() -> None:
    """fp16 sparse attention (bf16's stand-in under the interpreter) over an exact selection, head dims 64 and
    256: within 2.5x the fp32 reference's own input rounding noise. (The indexer runs in fp32 for every target.)"""
    from specopd_kernels.qsa.sparse_attention import group_rows, sparse_attention
    from specopd.models.qwen4_exp import select_groups

    dev = kernel_check.device()
    g_ = torch.Generator().manual_seed(4)
    t, hi, di, topk = 160, 2, 32, 8
    qi, keys = torch.randn(t, hi, di, generator=g_), torch.randn(t // 4, di, generator=g_)
    n = (torch.arange(t) + 1) // 4
    sel = select_groups(group_scores(qi, keys), n, topk)
    idx, nk = group_rows(sel, torch.arange(t), 4)
    for h, hkv, d in ((4, 2, 64), (8, 1, 256)):
        q = torch.randn(t, h, d, generator=g_)
        k, v = torch.randn(t, hkv, d, generator=g_), torch.randn(t, hkv, d, generator=g_)
        rows = slice(t - 24, t)
        ref = gathered_attention(q[rows], k, v, idx[rows], nk[rows], d ** -0.5)
        r16 = lambda x: x.half().float()  # noqa: E731
        rounded = gathered_attention(r16(q[rows]), r16(k), r16(v), idx[rows], nk[rows], d ** -0.5)
        b = lambda x: x.to(dev, torch.float16)  # noqa: E731
        got = sparse_attention(b(q[rows]), b(k), b(v), idx[rows].to(dev), nk[rows].to(dev), d ** -0.5)
        assert got.dtype == torch.float16
        kernel_check.lowp_check(got, ref, rounded, what=f"qsa sparse attention fp16 h{h}/{hkv} d{d}")


def test_sparse_attention_fp16_within_noise():
    pytest.importorskip("triton")
    kernel_check.run(FILE, "fp16")


CHECKS = {"indexer": check_indexer, "sparse": check_sparse_attention, "prefill": check_prefill, "gpu": check_gpu,
          "fp16": check_fp16}

if __name__ == "__main__":
    kernel_check.main(CHECKS)
