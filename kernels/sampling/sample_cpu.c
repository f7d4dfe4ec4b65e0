/* Inverse-CDF draws from softmax(z / T) over rows of logits, one pass per row (CPU).
 *
 * For R rows of V logits (fp32 or bf16, row stride ld) and one fp64 uniform u per row: the token is the first v
 * whose cumulative sum of e = exp((z - max z) / T) exceeds t = u * sum(e) (t kept below the total), the same rule
 * as specopd.sampling.draw_ (two levels: block sums of BLOCK entries locate t's block, then one cumulative sum
 * inside it, both in fp64). The exponentials stay in a row scratch that fits the L2 cache; the torch path makes
 * ~8 passes over [R, V] fp32 (cast, max, subtract, exp, sum, divide, block sums) for the same draw.
 * A token with e = 0 (logit -inf, or (z - max) / T below fp32's normal range, p < ~1e-38) is never drawn.
 * A row with a NaN or +inf logit, or with every logit -inf, gets -1 (the caller raises).
 *
 * Built by kernels/sampling/cpu.py with the system C compiler (-O3 -march=native -fopenmp; no fast-math), loaded
 * with ctypes. Threads: OpenMP, the runtime torch already loaded, torch's thread count. Rows are independent: a
 * row's token does not depend on the other rows, the chunking or the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#ifndef __AVX512F__
#error "sample_cpu.c needs AVX-512 (-march=native on an AVX-512 CPU); without it specopd.sampling keeps the torch path"
#endif
#include <immintrin.h>
#include "simd.h"


/* max, and whether the row holds a NaN or +inf */
static float row_max(const float *x, int64_t V, int *bad) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t v = 0; v < V; v += VW) {
        __mmask16 k = tail_mask(V - v);
        __m512 a = _mm512_mask_loadu_ps(m, k, x + v);
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, a);
    }
    float r = _mm512_reduce_max_ps(m);
    *bad = nan != 0 || r == INFINITY || r == -INFINITY;
    return r;
}

/* e[v] = exp((x[v] - m) / T) (0 below exp16's clamp EXP16_LOW); bs[b] = the sum over block b (fp32 lanes, then fp64) */
static double row_exp(const float *x, int64_t V, int64_t block, float m, float inv_t, float *e, double *bs) {
    __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t), low = _mm512_set1_ps(EXP16_LOW);
    double total = 0.0;
    for (int64_t b = 0, j = 0; b < V; b += block, j++) {
        int64_t end = b + block < V ? b + block : V;
        __m512 s = _mm512_setzero_ps();
        for (int64_t v = b; v < end; v += VW) {
            __mmask16 k = tail_mask(end - v);
            __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + v), vm), vt);
            __mmask16 keep = k & _mm512_cmp_ps_mask(y, low, _CMP_GE_OQ);
            y = _mm512_maskz_mov_ps(keep, exp16(y));
            _mm512_mask_storeu_ps(e + v, k, y);
            s = _mm512_add_ps(s, y);
        }
        bs[j] = (double)_mm512_reduce_add_ps(s);
        total += bs[j];
    }
    return total;
}

/* The token at u from a row's exponentials and block sums. */
static int64_t row_draw(const float *e, const double *bs, int64_t V, int64_t block, double total, double u) {
    int64_t nb = (V + block - 1) / block;
    double t = u * total;
    if (!(t < total)) t = nextafter(total, 0.0);
    double before = 0.0;
    int64_t j = 0;
    for (; j < nb - 1; j++) { /* the first block whose end exceeds t (the last one otherwise) */
        if (before + bs[j] > t) break;
        before += bs[j];
    }
    int64_t lo = j * block, hi = lo + block < V ? lo + block : V, last = -1;
    double c = before;
    for (int64_t v = lo; v < hi; v++) {
        if (e[v] > 0.0f) {
            last = v;
            c += (double)e[v];
            if (c > t) return v;
        }
    }
    if (last >= 0) return last; /* t < the block's end but for rounding between the two levels */
    for (int64_t v = lo - 1; v >= 0; v--) /* an empty block by rounding: the last token before it with e > 0 */
        if (e[v] > 0.0f) return v;
    return -1;
}

/* tokens[row] for R rows; u [R] fp64 in [0, 1). */
void sample_rows(const void *z, int bf16, int64_t ld, int64_t R, int64_t V, int64_t block, float inv_t,
                 const double *u, int64_t *tokens, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * 2 * (size_t)V);
        double *bs = (double *)malloc(sizeof(double) * (size_t)((V + block - 1) / block));
        float *e = buf + V;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const float *x = load_row(z, bf16, ld, r, V, buf);
            int bad;
            float m = row_max(x, V, &bad);
            if (bad) {
                tokens[r] = -1;
                continue;
            }
            double total = row_exp(x, V, block, m, inv_t, e, bs);
            tokens[r] = row_draw(e, bs, V, block, total, u[r]);
        }
        free(bs);
        free(buf);
    }
}
