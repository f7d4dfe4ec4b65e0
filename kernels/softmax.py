"""Triton pieces shared by the attention kernels (tree attention, QSA sparse attention)."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v_tile, DOT_PREC: tl.constexpr):
    """Fold one block of masked (-inf), log2-scaled scores s [BM, BN] and its values [BN, D] into the running
    max m_i [BM], sum l_i [BM] and output acc [BM, D] (fp32). A row with nothing visible yet stays at zero
    instead of turning into NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PREC)
    return m_new, l_i, acc
