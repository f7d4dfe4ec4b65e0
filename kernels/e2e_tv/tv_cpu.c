/* alpha = sum_v min(q, p) over rows of logits, and its gradient, in one pass per row (CPU).
 *
 * q = softmax(zq / T), p = softmax(zp / T) for R rows of V logits (fp32 or bf16, row stride ld*). Per row the
 * logits are read once from memory; the exponentials stay in a row scratch that fits the L2 cache. The torch
 * path (specopd/losses.py, kernels/e2e_tv/naive.py) makes ~30 passes over [R, V] fp32 for the same numbers.
 *
 * Built by kernels/e2e_tv/cpu.py with the system C compiler (-O3 -march=native -fopenmp; no fast-math), loaded
 * with ctypes. Threads: OpenMP, the runtime torch already loaded (libgomp.so.1), torch's thread count.
 * Rows are independent: a row's results do not depend on the other rows, the chunking or the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#ifndef __AVX512F__
#error "tv_cpu.c needs AVX-512 (-march=native on an AVX-512 CPU); without it specopd.losses keeps the torch path"
#endif
#include <immintrin.h>
#include "simd.h"

#define BLOCK 1024 /* sums: fp32 vector lanes over BLOCK elements, the block sums in fp64 (~1e-7 for any V) */

static inline __m512 exp_scaled(const float *x, __mmask16 k, __m512 m, __m512 inv_t) {
    return exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x), m), inv_t));
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* max, and a NaN / inf probe (x * 0 is NaN for NaN and +-inf, else 0). */
static float row_max(const float *x, int64_t V, float *probe) {
    __m512 m = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps(), zero = _mm512_setzero_ps();
    for (int64_t v = 0; v < V; v += VW) {
        __mmask16 k = tail_mask(V - v);
        __m512 a = _mm512_mask_loadu_ps(m, k, x + v);
        m = _mm512_max_ps(m, a);
        s = _mm512_add_ps(s, _mm512_maskz_mul_ps(k, a, zero));
    }
    *probe = _mm512_reduce_add_ps(s);
    return _mm512_reduce_max_ps(m);
}

/* e[v] = exp((x[v] - m) / T); returns sum e. */
static float row_exp(const float *x, int64_t V, float m, float inv_t, float *e) {
    __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
    double total = 0.0;
    for (int64_t b = 0; b < V; b += BLOCK) {
        int64_t end = b + BLOCK < V ? b + BLOCK : V;
        __m512 s = _mm512_setzero_ps();
        for (int64_t v = b; v < end; v += VW) {
            __mmask16 k = tail_mask(end - v);
            __m512 y = _mm512_maskz_mov_ps(k, exp_scaled(x + v, k, vm, vt));
            _mm512_mask_storeu_ps(e + v, k, y);
            s = _mm512_add_ps(s, y);
        }
        total += _mm512_reduce_add_ps(s);
    }
    return (float)total;
}

/* ind = 1[q < p] + 1/2 1[q == p] (torch.minimum's gradient rule) */
static inline __m512 tie_rule(__m512 q, __m512 p) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 ind = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(q, p, _CMP_LT_OQ), one);
    return _mm512_mask_mov_ps(ind, _mm512_cmp_ps_mask(q, p, _CMP_EQ_OQ), _mm512_set1_ps(0.5f));
}

/* alpha = sum min(q, p) and s = <q, ind> of a row from its exponentials and 1 / sums. */
static void row_alpha(const float *eq, const float *ep, int64_t V, float ra, float rb, double *alpha, double *s) {
    __m512 va = _mm512_set1_ps(ra), vb = _mm512_set1_ps(rb);
    double acc = 0.0, sacc = 0.0;
    for (int64_t b = 0; b < V; b += BLOCK) {
        int64_t end = b + BLOCK < V ? b + BLOCK : V;
        __m512 a = _mm512_setzero_ps(), t = _mm512_setzero_ps();
        for (int64_t v = b; v < end; v += VW) {
            __mmask16 k = tail_mask(end - v);
            __m512 q = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, eq + v), va);
            __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, ep + v), vb);
            a = _mm512_add_ps(a, _mm512_min_ps(q, p));
            t = _mm512_fmadd_ps(q, tie_rule(q, p), t);
        }
        acc += _mm512_reduce_add_ps(a);
        sacc += _mm512_reduce_add_ps(t);
    }
    *alpha = acc;
    *s = sacc;
}

/* out[v] = q_v (c (ind_v - s) + cn) from a row's logits and statistics (out may be a: each vector is read first).
 * cn = 0 without the CE term (then E2E-TV's own product order, its bits unchanged); with it (T = 1) the caller
 * subtracts cn at the row's target. */
static void row_grad(const float *a, const float *b, int64_t V, float ma, float mb, float ra, float rb, float s,
                     float c, float cn, float inv_t, float *out) {
    __m512 vma = _mm512_set1_ps(ma), vmb = _mm512_set1_ps(mb), vt = _mm512_set1_ps(inv_t);
    __m512 vra = _mm512_set1_ps(ra), vrb = _mm512_set1_ps(rb), vs = _mm512_set1_ps(s), vc = _mm512_set1_ps(c);
    __m512 vcn = _mm512_set1_ps(cn);
    for (int64_t v = 0; v < V; v += VW) {
        __mmask16 k = tail_mask(V - v);
        __m512 q = _mm512_mul_ps(exp_scaled(a + v, k, vma, vt), vra);
        __m512 p = _mm512_mul_ps(exp_scaled(b + v, k, vmb, vt), vrb);
        __m512 g = cn == 0.0f ? _mm512_mul_ps(vc, _mm512_mul_ps(q, _mm512_sub_ps(tie_rule(q, p), vs)))
                              : _mm512_mul_ps(q, _mm512_fmadd_ps(vc, _mm512_sub_ps(tie_rule(q, p), vs), vcn));
        _mm512_mask_storeu_ps(out + v, k, g);
    }
}

/* Forward. stats[row] = {max zq, max zp, 1 / sum_q, 1 / sum_p, <q, ind>} for the backward,
 * ind = 1[q < p] + 1/2 1[q == p] (torch.minimum's gradient rule). A row with a NaN or inf logit gets alpha NaN. */
void tv_alpha_forward(const void *zq, int q_bf16, int64_t ldq, const void *zp, int p_bf16, int64_t ldp,
                      int64_t R, int64_t V, float inv_t, float *alpha, float *stats, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * 4 * (size_t)V);
        float *xq = buf, *xp = buf + V, *eq = buf + 2 * V, *ep = buf + 3 * V;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const float *a = load_row(zq, q_bf16, ldq, r, V, xq);
            const float *b = load_row(zp, p_bf16, ldp, r, V, xp);
            float pa, pb;
            float ma = row_max(a, V, &pa), mb = row_max(b, V, &pb);
            float ra = 1.0f / row_exp(a, V, ma, inv_t, eq);
            float rb = 1.0f / row_exp(b, V, mb, inv_t, ep);
            double acc, s;
            row_alpha(eq, ep, V, ra, rb, &acc, &s);
            alpha[r] = (pa == 0.0f && pb == 0.0f) ? (float)acc : NAN;
            float *st = stats + 5 * r;
            st[0] = ma; st[1] = mb; st[2] = ra; st[3] = rb; st[4] = (float)s;
        }
        free(buf);
    }
}

/* Backward: g[row, v] = coef[row] * q_v (ind_v - <q, ind>), coef = dL/dalpha / T, from the forward's stats and the
 * same logits; written as fp32 or bf16 (out_bf16), row stride ldg. With coef_nll and targets (T = 1 only: q is the
 * CE's softmax), plus the CE term's coef_nll[row] * (q_v - 1[v == targets[row]]), added before any rounding. */
void tv_alpha_backward(const void *zq, int q_bf16, int64_t ldq, const void *zp, int p_bf16, int64_t ldp,
                       int64_t R, int64_t V, float inv_t, const float *stats, const float *coef,
                       const float *coef_nll, const int64_t *targets,
                       void *g, int out_bf16, int64_t ldg, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * 3 * (size_t)V);
        float *xq = buf, *xp = buf + V, *gr = buf + 2 * V;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const float *a = load_row(zq, q_bf16, ldq, r, V, xq);
            const float *b = load_row(zp, p_bf16, ldp, r, V, xp);
            const float *st = stats + 5 * r;
            float ma = st[0], mb = st[1], ra = st[2], rb = st[3], s = st[4], c = coef[r];
            float cn = coef_nll ? coef_nll[r] : 0.0f;
            float *o = out_bf16 ? gr : (float *)g + r * ldg;
            row_grad(a, b, V, ma, mb, ra, rb, s, c, cn, inv_t, o);
            if (coef_nll) o[targets[r]] -= cn;
            if (out_bf16) {
                uint16_t *h = (uint16_t *)g + r * ldg;
                for (int64_t v = 0; v < V; v++) h[v] = f32_to_bf16(gr[v]);
            }
        }
        free(buf);
    }
}
