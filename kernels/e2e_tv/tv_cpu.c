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

#include "simd.h" /* AVX-512 F or AVX2 + FMA (the same bits on either); without them the torch path is kept */

#define BLOCK 1024 /* sums: fp32 vector lanes over BLOCK elements, the block sums in fp64 (~1e-7 for any V) */

static inline vf exp_scaled(const float *x, vmask k, vf m, vf inv_t) {
    return exp16(v_mul(v_sub(v_loadz(k, x), m), inv_t));
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
    vf m = v_set1(-INFINITY), s = v_zero(), zero = v_zero();
    for (int64_t v = 0; v < V; v += VW) {
        vmask k = tail_mask(V - v);
        vf a = v_load_or(m, k, x + v);
        m = v_max(m, a);
        s = v_add(s, v_movz(k, v_mul(a, zero)));
    }
    *probe = v_reduce_add(s);
    return v_reduce_max(m);
}

/* e[v] = exp((x[v] - m) / T); returns sum e. */
static float row_exp(const float *x, int64_t V, float m, float inv_t, float *e) {
    vf vm = v_set1(m), vt = v_set1(inv_t);
    double total = 0.0;
    for (int64_t b = 0; b < V; b += BLOCK) {
        int64_t end = b + BLOCK < V ? b + BLOCK : V;
        vf s = v_zero();
        for (int64_t v = b; v < end; v += VW) {
            vmask k = tail_mask(end - v);
            vf y = v_movz(k, exp_scaled(x + v, k, vm, vt));
            v_store(e + v, k, y);
            s = v_add(s, y);
        }
        total += v_reduce_add(s);
    }
    return (float)total;
}

/* ind = 1[q < p] + 1/2 1[q == p] (torch.minimum's gradient rule) */
static inline vf tie_rule(vf q, vf p) {
    vf ind = v_movz(v_lt(q, p), v_set1(1.0f));
    return v_mov(ind, v_eq(q, p), v_set1(0.5f));
}

/* alpha = sum min(q, p) and s = <q, ind> of a row from its exponentials and 1 / sums. */
static void row_alpha(const float *eq, const float *ep, int64_t V, float ra, float rb, double *alpha, double *s) {
    vf va = v_set1(ra), vb = v_set1(rb);
    double acc = 0.0, sacc = 0.0;
    for (int64_t b = 0; b < V; b += BLOCK) {
        int64_t end = b + BLOCK < V ? b + BLOCK : V;
        vf a = v_zero(), t = v_zero();
        for (int64_t v = b; v < end; v += VW) {
            vmask k = tail_mask(end - v);
            vf q = v_mul(v_loadz(k, eq + v), va);
            vf p = v_mul(v_loadz(k, ep + v), vb);
            a = v_add(a, v_min(q, p));
            t = v_fmadd(q, tie_rule(q, p), t);
        }
        acc += v_reduce_add(a);
        sacc += v_reduce_add(t);
    }
    *alpha = acc;
    *s = sacc;
}

/* out[v] = q_v (c (ind_v - s) + cn) from a row's logits and statistics (out may be a: each vector is read first).
 * cn = 0 without the CE term (then E2E-TV's own product order, its bits unchanged); with it (T = 1) the caller
 * subtracts cn at the row's target. */
static void row_grad(const float *a, const float *b, int64_t V, float ma, float mb, float ra, float rb, float s,
                     float c, float cn, float inv_t, float *out) {
    vf vma = v_set1(ma), vmb = v_set1(mb), vt = v_set1(inv_t);
    vf vra = v_set1(ra), vrb = v_set1(rb), vs = v_set1(s), vc = v_set1(c), vcn = v_set1(cn);
    for (int64_t v = 0; v < V; v += VW) {
        vmask k = tail_mask(V - v);
        vf q = v_mul(exp_scaled(a + v, k, vma, vt), vra);
        vf p = v_mul(exp_scaled(b + v, k, vmb, vt), vrb);
        vf g = cn == 0.0f ? v_mul(vc, v_mul(q, v_sub(tie_rule(q, p), vs)))
                          : v_mul(q, v_fmadd(vc, v_sub(tie_rule(q, p), vs), vcn));
        v_store(out + v, k, g);
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
