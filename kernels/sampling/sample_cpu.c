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

#include "simd.h" /* AVX-512 F or AVX2 + FMA (the same bits on either); without them the torch path is kept */


/* max, and whether the row holds a NaN or +inf */
static float row_max(const float *x, int64_t V, int *bad) {
    vf m = v_set1(-INFINITY);
    vmask nan = m_none();
    for (int64_t v = 0; v < V; v += VW) {
        vmask k = tail_mask(V - v);
        vf a = v_load_or(m, k, x + v);
        nan = m_or(nan, v_nan(a));
        m = v_max(m, a);
    }
    float r = v_reduce_max(m);
    *bad = m_any(nan) || r == INFINITY || r == -INFINITY;
    return r;
}

/* e[v] = exp((x[v] - m) / T) (0 below exp16's clamp EXP16_LOW); bs[b] = the sum over block b (fp32 lanes, then fp64) */
static double row_exp(const float *x, int64_t V, int64_t block, float m, float inv_t, float *e, double *bs) {
    vf vm = v_set1(m), vt = v_set1(inv_t), low = v_set1(EXP16_LOW);
    double total = 0.0;
    for (int64_t b = 0, j = 0; b < V; b += block, j++) {
        int64_t end = b + block < V ? b + block : V;
        vf s = v_zero();
        for (int64_t v = b; v < end; v += VW) {
            vmask k = tail_mask(end - v);
            vf y = v_mul(v_sub(v_loadz(k, x + v), vm), vt);
            vmask keep = m_and(k, v_ge(y, low));
            y = v_movz(keep, exp16(y));
            v_store(e + v, k, y);
            s = v_add(s, y);
        }
        bs[j] = (double)v_reduce_add(s);
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
