"""Triton pieces shared by the attention kernels (tree attention, QSA sparse attention)."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v_tile, DOT_PREC: tl.constexpr):
    """Fold one block of scores into the running softmax (Triton helper); a row with nothing visible yet stays at zero
    instead of turning into NaN.

    Args:
        m_i: [BM] running max (log2 scale).
        l_i: [BM] running sum.
        acc: [BM, D] fp32 running output.
        s: [BM, BN] masked (-inf), log2-scaled scores of the block.
        v_tile: [BN, D] the block's values.
        DOT_PREC: the dot's input precision.

    Returns:
        (m_i, l_i, acc) updated.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PREC)
    return m_new, l_i, acc
