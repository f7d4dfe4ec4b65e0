/* Causal GQA attention in bf16 on the CPU: vdpbf16ps (AVX512-BF16) dot products, fp32 softmax, one call for many
 * sequences (the packed prefill's trunks, a decoding step's last rows); and tree attention (score / verify) on the
 * same chunks, at the end of this file.
 *
 * Why: torch's CPU flash-attention kernel runs bf16 at a small fraction of the matmul rate on a CPU with
 * AVX512-BF16 but no AMX (measured: benchmarks/results/, the causal-attention-in-C report); one call per
 * trunk and layer.
 *
 * The numerics follow torch's flash kernel for reduced precision (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp):
 *  s = (q . k) * scale in fp32 (products of bf16 are exact in fp32; the sum in pairs, vdpbf16ps's order),
 *  keys in chunks of KC with the online softmax: m = running max, e = exp(s - m) in fp32, l += sum(e) in fp32,
 *  P = bf16(e) (round to nearest even), acc = acc * exp(m_old - m) + P . V in fp32, out = bf16(acc * (1 / l)).
 * So the result is within bf16 noise of the fp32 softmax of the same inputs (tests/test_kernels_causal_attention.py
 * bounds it by torch's own bf16 error), not bitwise torch's: the exp (Cephes, ~1 ulp), the sums' order and the key
 * chunks differ. A row's result depends only on its own query, its sequence's keys and KC: not on the other rows,
 * the query blocks or the thread count.
 *
 * Layout: q [Nq, H, D], k / v [Nk, Hkv, D], o [Nq, H, D] with any token and head strides and D contiguous; sequence
 * s has queries cu_q[s] .. cu_q[s + 1] - 1 and keys cu_k[s] .. cu_k[s + 1] - 1, its query i at key position
 * (Lk - Lq) + i (prefill: Lq = Lk; one decoding step: Lq = 1). D % 32 == 0, D <= 256.
 * Built by kernels/cbuild.py (-O3 -march=native -fopenmp); needs AVX512-F / BW and AVX512-BF16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512BF16__)
#error "attention_cpu.c needs AVX-512 F/BW and AVX512-BF16 (-march=native on such a CPU); without it torch's sdpa runs"
#endif
#include <immintrin.h>
#include "simd.h"

#ifndef KC
#define KC 256     /* keys per online-softmax chunk */
#endif
#ifndef ROWS
#define ROWS 96    /* (query, head) rows per work item, about (48-144 and KC 256-512: within 5% at 192-1000 keys) */
#endif
#define MAXD 256

static inline __m512bh pair_bcast(const uint16_t *p) { /* two adjacent bf16 in every 32-bit lane */
    uint32_t u;
    memcpy(&u, p, 4);
    return (__m512bh)_mm512_set1_epi32((int)u);
}

static inline __m512bh load_bh(const uint32_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* K of one (sequence, kv head) as blocks of 16 keys: kp[blk][d / 2][16] 32-bit pairs (k[j][d], k[j][d + 1]);
 * keys past L are 0. */
static void pack_k(const uint16_t *k, int64_t ks_t, int64_t L, int64_t D, uint32_t *kp) {
    int64_t nb = (L + 15) / 16;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t p = 0; p < D / 2; p++) {
            uint32_t *dst = kp + (b * (D / 2) + p) * 16;
            for (int64_t jj = 0; jj < 16; jj++) {
                int64_t j = b * 16 + jj;
                uint32_t u = 0;
                if (j < L) memcpy(&u, k + j * ks_t + 2 * p, 4);
                dst[jj] = u;
            }
        }
}

/* V of one (sequence, kv head) as pairs of keys: vp[j / 2][d] 32-bit pairs (v[j][d], v[j + 1][d]); past L: 0. */
static void pack_v(const uint16_t *v, int64_t vs_t, int64_t L, int64_t D, uint32_t *vp) {
    for (int64_t jp = 0; jp < (L + 1) / 2; jp++)
        for (int64_t d = 0; d < D; d++) {
            uint32_t lo = v[2 * jp * vs_t + d];
            uint32_t hi = 2 * jp + 1 < L ? v[(2 * jp + 1) * vs_t + d] : 0;
            vp[jp * D + d] = lo | (hi << 16);
        }
}

static inline int64_t ceil_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* S[r][0 .. nk) = scale * q_r . k_j for keys c0 + j of one block of rows; rows r of `qr` (pointers). */
static void scores(const uint16_t *const *qr, int64_t R, const uint32_t *kp, int64_t c0, int64_t nk, int64_t D,
                   float scale, float *S) {
    const int64_t P = D / 2;
    const vf sc = v_set1(scale);
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        int64_t nr = R - r0 < 4 ? R - r0 : 4;
        const uint16_t *q0 = qr[r0], *q1 = qr[r0 + (nr > 1)], *q2 = qr[r0 + (nr > 2 ? 2 : 0)],
                       *q3 = qr[r0 + (nr > 3 ? 3 : 0)];
        for (int64_t j = 0; j < nk; j += 32) {
            const uint32_t *b0 = kp + ((c0 + j) / 16) * P * 16;
            const uint32_t *b1 = b0 + P * 16;
            int two = j + 16 < nk;
            vf a00 = v_zero(), a01 = v_zero(), a10 = v_zero(), a11 = v_zero();
            vf a20 = v_zero(), a21 = v_zero(), a30 = v_zero(), a31 = v_zero();
            if (two) {
                for (int64_t p = 0; p < P; p++) {
                    __m512bh k0 = load_bh(b0 + p * 16), k1 = load_bh(b1 + p * 16);
                    __m512bh x;
                    x = pair_bcast(q0 + 2 * p); a00 = _mm512_dpbf16_ps(a00, x, k0); a01 = _mm512_dpbf16_ps(a01, x, k1);
                    x = pair_bcast(q1 + 2 * p); a10 = _mm512_dpbf16_ps(a10, x, k0); a11 = _mm512_dpbf16_ps(a11, x, k1);
                    x = pair_bcast(q2 + 2 * p); a20 = _mm512_dpbf16_ps(a20, x, k0); a21 = _mm512_dpbf16_ps(a21, x, k1);
                    x = pair_bcast(q3 + 2 * p); a30 = _mm512_dpbf16_ps(a30, x, k0); a31 = _mm512_dpbf16_ps(a31, x, k1);
                }
            } else {
                for (int64_t p = 0; p < P; p++) {
                    __m512bh k0 = load_bh(b0 + p * 16);
                    a00 = _mm512_dpbf16_ps(a00, pair_bcast(q0 + 2 * p), k0);
                    a10 = _mm512_dpbf16_ps(a10, pair_bcast(q1 + 2 * p), k0);
                    a20 = _mm512_dpbf16_ps(a20, pair_bcast(q2 + 2 * p), k0);
                    a30 = _mm512_dpbf16_ps(a30, pair_bcast(q3 + 2 * p), k0);
                }
            }
            vf acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
            for (int64_t i = 0; i < nr; i++) {
                float *s = S + (r0 + i) * KC + j;
                v_store(s, tail_mask(nk - j), v_mul(acc[i][0], sc));
                if (two) v_store(s + 16, tail_mask(nk - j - 16), v_mul(acc[i][1], sc));
            }
        }
    }
}

/* acc[r][0 .. D) += sum_j P[r][j] v_j over pairs of keys jp = 0 .. npair (P: bf16 pairs, row stride KC / 2). */
static void pv(const uint32_t *Pb, int64_t R, const uint32_t *vp, int64_t npair, int64_t D, float *acc) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        int64_t nr = R - r0 < 4 ? R - r0 : 4;
        const uint32_t *p0 = Pb + r0 * (KC / 2), *p1 = Pb + (r0 + (nr > 1)) * (KC / 2),
                       *p2 = Pb + (r0 + (nr > 2 ? 2 : 0)) * (KC / 2), *p3 = Pb + (r0 + (nr > 3 ? 3 : 0)) * (KC / 2);
        for (int64_t d = 0; d < D; d += 32) {
            float *c0 = acc + r0 * D + d;
            vf a00 = _mm512_loadu_ps(c0), a01 = _mm512_loadu_ps(c0 + 16);
            vf a10 = v_zero(), a11 = v_zero(), a20 = v_zero(), a21 = v_zero(), a30 = v_zero(), a31 = v_zero();
            if (nr > 1) a10 = _mm512_loadu_ps(c0 + D), a11 = _mm512_loadu_ps(c0 + D + 16);
            if (nr > 2) a20 = _mm512_loadu_ps(c0 + 2 * D), a21 = _mm512_loadu_ps(c0 + 2 * D + 16);
            if (nr > 3) a30 = _mm512_loadu_ps(c0 + 3 * D), a31 = _mm512_loadu_ps(c0 + 3 * D + 16);
            for (int64_t jp = 0; jp < npair; jp++) {
                __m512bh v0 = load_bh(vp + jp * D + d), v1 = load_bh(vp + jp * D + d + 16);
                __m512bh x;
                x = (__m512bh)_mm512_set1_epi32((int)p0[jp]); a00 = _mm512_dpbf16_ps(a00, x, v0); a01 = _mm512_dpbf16_ps(a01, x, v1);
                x = (__m512bh)_mm512_set1_epi32((int)p1[jp]); a10 = _mm512_dpbf16_ps(a10, x, v0); a11 = _mm512_dpbf16_ps(a11, x, v1);
                x = (__m512bh)_mm512_set1_epi32((int)p2[jp]); a20 = _mm512_dpbf16_ps(a20, x, v0); a21 = _mm512_dpbf16_ps(a21, x, v1);
                x = (__m512bh)_mm512_set1_epi32((int)p3[jp]); a30 = _mm512_dpbf16_ps(a30, x, v0); a31 = _mm512_dpbf16_ps(a31, x, v1);
            }
            _mm512_storeu_ps(c0, a00), _mm512_storeu_ps(c0 + 16, a01);
            if (nr > 1) _mm512_storeu_ps(c0 + D, a10), _mm512_storeu_ps(c0 + D + 16, a11);
            if (nr > 2) _mm512_storeu_ps(c0 + 2 * D, a20), _mm512_storeu_ps(c0 + 2 * D + 16, a21);
            if (nr > 3) _mm512_storeu_ps(c0 + 3 * D, a30), _mm512_storeu_ps(c0 + 3 * D + 16, a31);
        }
    }
}

/* The online softmax over one chunk of a row's scores s[0 .. nk), of which s[0 .. nv) are its keys (nv <= 0: none):
 * m = running max, l += sum exp(s - m) in fp32, acc *= exp(m_old - m); P[0 .. nk) (bf16 pairs, past nv 0) =
 * bf16(exp(s - m)) for pv(). */
static void softmax_chunk(const float *s, int64_t nk, int64_t nv, uint32_t *pr, float *m, float *l, float *acc,
                          int64_t D) {
    if (nv <= 0) { /* the row's keys ended before this chunk */
        memset(pr, 0, (size_t)((nk + 1) / 2) * 4);
        return;
    }
    vf mx = v_set1(-INFINITY);
    for (int64_t j = 0; j < nv; j += VW) mx = v_max(mx, v_load_or(v_set1(-INFINITY), tail_mask(nv - j), s + j));
    float mnew = v_reduce_max(mx);
    mnew = mnew > *m ? mnew : *m;
    const float alpha = *m == -INFINITY ? 0.0f : expf(*m - mnew);
    const vf mv = v_set1(mnew);
    vf sum = v_zero();
    uint16_t *ph = (uint16_t *)pr;
    for (int64_t j = 0; j < nk; j += VW) {
        vmask valid = j < nv ? tail_mask(nv - j) : 0;
        vf e = v_movz(valid, exp16(v_sub(v_loadz(valid, s + j), mv)));
        sum = v_add(sum, e);
        __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_mask_storeu_epi16(ph + j, (__mmask16)tail_mask(nk - j), eb);
    }
    if (nk % 2) ph[nk] = 0; /* the last pair's second key */
    *l = *l * alpha + v_reduce_add(sum);
    *m = mnew;
    if (alpha != 1.0f) {
        const vf av = v_set1(alpha);
        for (int64_t d = 0; d < D; d += VW) _mm512_storeu_ps(acc + d, v_mul(_mm512_loadu_ps(acc + d), av));
    }
}

typedef struct {
    int64_t s, g, i0, i1; /* sequence (trunk), kv head, rows i0 .. i1 - 1 (of the sequence / of the tree's order) */
    int64_t cost;
} Item;

static int by_cost(const void *a, const void *b) {
    int64_t x = ((const Item *)a)->cost, y = ((const Item *)b)->cost;
    return (x < y) - (x > y); /* descending: long items first */
}

/* K and V of every (sequence, kv head) packed once per call: sequence s's keys are rows start[s] .. start[s] +
 * len[s] - 1 of k / v, packed as a block of ceil16(len[s]) keys (pack_k / pack_v) at base(). */
typedef struct {
    int64_t *koff; /* [nseq + 1] padded keys before sequence s */
    uint32_t *k, *v;
    const int64_t *len;
    int64_t Hkv, D;
} Packed;

static void packed_free(Packed *p) { free(p->koff), free(p->k), free(p->v); }

static inline size_t packed_base(const Packed *p, int64_t s, int64_t g) {
    return (size_t)(p->koff[s] * p->Hkv + g * ceil_to(p->len[s], 16)) * (p->D / 2);
}

/* Returns 0, or -1 when out of memory (nothing left allocated). */
static int pack_all(Packed *p, const uint16_t *k, int64_t ks_t, int64_t ks_h, const uint16_t *v, int64_t vs_t,
                    int64_t vs_h, const int64_t *start, const int64_t *len, int64_t nseq, int64_t Hkv, int64_t D,
                    int nt) {
    p->len = len, p->Hkv = Hkv, p->D = D, p->k = p->v = NULL;
    p->koff = malloc((size_t)(nseq + 1) * sizeof(int64_t));
    if (!p->koff) return -1;
    p->koff[0] = 0;
    for (int64_t s = 0; s < nseq; s++) p->koff[s + 1] = p->koff[s] + ceil_to(len[s], 16);
    p->k = aligned_alloc(64, (size_t)(p->koff[nseq] * Hkv * (D / 2) + 16) * 4);
    p->v = aligned_alloc(64, (size_t)(p->koff[nseq] * Hkv * (D / 2) + 16) * 4);
    if (!p->k || !p->v) {
        packed_free(p);
        return -1;
    }
#pragma omp parallel for num_threads(p->koff[nseq] * Hkv * D >= 16384 ? nt : 1) schedule(dynamic, 1)
    for (int64_t t = 0; t < nseq * Hkv; t++) {
        int64_t s = t / Hkv, g = t % Hkv;
        pack_k(k + start[s] * ks_t + g * ks_h, ks_t, len[s], D, p->k + packed_base(p, s, g));
        pack_v(v + start[s] * vs_t + g * vs_h, vs_t, len[s], D, p->v + packed_base(p, s, g));
    }
    return 0;
}

/* One thread's scratch for work items of up to rmax rows (and up to A tree keys a row). */
typedef struct {
    float *S, *acc, *m, *l, *sa;
    uint32_t *Pb;
    int64_t *lim;
    const uint16_t **qr;
} Scratch;

static void scratch_free(Scratch *w) {
    free(w->S), free(w->acc), free(w->m), free(w->l), free(w->sa), free(w->Pb), free(w->lim), free((void *)w->qr);
}

static int scratch_alloc(Scratch *w, int64_t rmax, int64_t D, int64_t A) { /* 1 when all of it was allocated */
    w->S = aligned_alloc(64, (size_t)rmax * KC * 4);
    w->Pb = aligned_alloc(64, (size_t)rmax * (KC / 2) * 4);
    w->acc = aligned_alloc(64, (size_t)rmax * D * 4);
    w->m = malloc((size_t)rmax * 4), w->l = malloc((size_t)rmax * 4), w->sa = malloc((size_t)(A + 1) * 4);
    w->lim = malloc((size_t)rmax * sizeof(int64_t));
    w->qr = malloc((size_t)rmax * sizeof(void *));
    return w->S && w->Pb && w->acc && w->m && w->l && w->sa && w->lim && w->qr;
}

/* Rows w->qr[0 .. R) over one packed (sequence, kv head) block (kp / vp), row r seeing keys [0, w->lim[r]): the
 * online softmax from scratch over chunks of KC keys, leaving m, l and the unnormalised acc in w. */
static void attend_packed(Scratch *w, int64_t R, const uint32_t *kp, const uint32_t *vp, int64_t D, float scale) {
    int64_t kend = 0; /* keys 0 .. kend - 1 reach some row */
    for (int64_t r = 0; r < R; r++) {
        w->m[r] = -INFINITY, w->l[r] = 0.0f;
        kend = w->lim[r] > kend ? w->lim[r] : kend;
    }
    memset(w->acc, 0, (size_t)R * D * 4);
    for (int64_t c0 = 0; c0 < kend; c0 += KC) {
        const int64_t nk = kend - c0 < KC ? kend - c0 : KC;
        scores(w->qr, R, kp, c0, nk, D, scale, w->S);
        for (int64_t r = 0; r < R; r++) {
            const int64_t lim = w->lim[r] - c0; /* this row's keys in the chunk: [0, lim) */
            softmax_chunk(w->S + r * KC, nk, lim < nk ? lim : nk, w->Pb + r * (KC / 2), w->m + r, w->l + r,
                          w->acc + r * D, D);
        }
        pv(w->Pb, R, vp + (size_t)(c0 / 2) * D, (nk + 1) / 2, D, w->acc);
    }
}

static void store_row(uint16_t *dst, const float *acc, float l, int64_t D) { /* bf16(acc / l) */
    const vf inv = v_set1(1.0f / l);
    for (int64_t d = 0; d < D; d += VW)
        _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(v_mul(_mm512_loadu_ps(acc + d), inv)));
}

/* Returns 0, or -1 when out of memory (the caller raises). */
int causal_attention_bf16(const uint16_t *q, int64_t qs_t, int64_t qs_h, const uint16_t *k, int64_t ks_t,
                          int64_t ks_h, const uint16_t *v, int64_t vs_t, int64_t vs_h, uint16_t *o, int64_t os_t,
                          int64_t os_h, const int64_t *cu_q, const int64_t *cu_k, int64_t nseq, int64_t H,
                          int64_t Hkv, int64_t D, float scale, int nthreads) {
    const int64_t G = H / Hkv;
    const int64_t bq = ROWS / G > 0 ? ROWS / G : 1; /* query positions per item */
    const int nt = nthreads > 0 ? nthreads : 1;
    int64_t *len = malloc((size_t)(nseq + 1) * sizeof(int64_t)), nitems = 0;
    if (!len) return -1;
    for (int64_t s = 0; s < nseq; s++) {
        len[s] = cu_k[s + 1] - cu_k[s];
        nitems += Hkv * ((cu_q[s + 1] - cu_q[s] + bq - 1) / bq);
    }
    Item *items = malloc((size_t)(nitems + 1) * sizeof(Item));
    Packed pk;
    if (!items || pack_all(&pk, k, ks_t, ks_h, v, vs_t, vs_h, cu_k, len, nseq, Hkv, D, nt)) {
        free(len), free(items);
        return -1;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++) {
        int64_t lq = cu_q[s + 1] - cu_q[s], off = len[s] - lq;
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t i0 = 0; i0 < lq; i0 += bq) {
                int64_t i1 = i0 + bq < lq ? i0 + bq : lq;
                items[n++] = (Item){s, g, i0, i1, (i1 - i0) * (off + i1)};
            }
    }
    qsort(items, (size_t)n, sizeof(Item), by_cost);
    int failed = 0;
#pragma omp parallel num_threads(n > 1 ? nt : 1)
    {
        Scratch sc;
        const int ok = scratch_alloc(&sc, bq * G, D, 0);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n; it++) {
            if (!ok) continue;
            const Item w = items[it];
            const int64_t off = len[w.s] - (cu_q[w.s + 1] - cu_q[w.s]), R = (w.i1 - w.i0) * G;
            for (int64_t i = w.i0; i < w.i1; i++)
                for (int64_t h = 0; h < G; h++) {
                    sc.qr[(i - w.i0) * G + h] = q + (cu_q[w.s] + i) * qs_t + (w.g * G + h) * qs_h;
                    sc.lim[(i - w.i0) * G + h] = off + i + 1; /* query i sits at key position off + i */
                }
            attend_packed(&sc, R, pk.k + packed_base(&pk, w.s, w.g), pk.v + packed_base(&pk, w.s, w.g), D, scale);
            for (int64_t r = 0; r < R; r++)
                store_row(o + (cu_q[w.s] + w.i0 + r / G) * os_t + (w.g * G + r % G) * os_h, sc.acc + r * D, sc.l[r], D);
        }
        scratch_free(&sc);
    }
    packed_free(&pk);
    free(len), free(items);
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------------ tree attention
 * Node u of a proposal tree (trunk s = tix[u], anchor a_u) attends to trunk s's keys 0 .. a_u (tk / tv rows
 * cu_k[s] .. cu_k[s + 1] - 1), then to its ancestors and itself: nodes anc[u][0 .. A) (node indices into k / v,
 * -1 after the last; kernels/tree_attention/naive.py's key order is root first). The trunk keys go through the
 * causal path's chunks with a row limit a_u + 1 (a node is a query at position a_u there); the few tree keys are one
 * more online-softmax step: s = scale * q . k (bf16 products, fp32 sum), P = bf16(exp(s - m)), acc += P v in fp32.
 * Work items hold consecutive nodes of `order` (a permutation grouped by trunk; anchors ascending within a trunk
 * keep an item's keys short) of one trunk and kv head. A row's result depends only on its query, its trunk's keys
 * 0 .. a_u, its tree keys and KC. */

static inline float round_bf16(float x) { /* round to nearest even, as _mm512_cvtneps_pbh (finite x) */
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t D) { /* D % 32 == 0 */
    vf acc = v_zero();
    for (int64_t d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    return v_reduce_add(acc);
}

static inline vf load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Returns 0, or -1 when out of memory (the caller raises). */
int tree_attention_bf16(const uint16_t *q, int64_t qs_t, int64_t qs_h, const uint16_t *k, int64_t ks_t,
                        int64_t ks_h, const uint16_t *v, int64_t vs_t, int64_t vs_h, const uint16_t *tk,
                        int64_t tks_t, int64_t tks_h, const uint16_t *tv, int64_t tvs_t, int64_t tvs_h, uint16_t *o,
                        int64_t os_t, int64_t os_h, const int64_t *cu_k, int64_t ntrunk, const int64_t *order,
                        const int64_t *anchor, const int64_t *tix, const int64_t *anc, int64_t A, int64_t M,
                        int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    const int64_t G = H / Hkv;
    const int64_t bq = ROWS / G > 0 ? ROWS / G : 1; /* nodes per item */
    const int nt = nthreads > 0 ? nthreads : 1;
    int64_t *len = calloc((size_t)ntrunk + 1, sizeof(int64_t));
    Item *items = malloc((size_t)(Hkv * (M + 1)) * sizeof(Item)); /* at most one item per node and kv head */
    if (!len || !items) {
        free(len), free(items);
        return -1;
    }
    for (int64_t u = 0; u < M; u++) /* keys to pack per trunk: 0 .. its largest anchor */
        if (anchor[u] + 1 > len[tix[u]]) len[tix[u]] = anchor[u] + 1;
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < M;) { /* runs of one trunk in `order`, cut into items of bq nodes */
        const int64_t s = tix[order[i0]];
        int64_t i1 = i0, kmax = 0;
        while (i1 < M && i1 - i0 < bq && tix[order[i1]] == s) {
            if (anchor[order[i1]] + 1 > kmax) kmax = anchor[order[i1]] + 1;
            i1++;
        }
        for (int64_t g = 0; g < Hkv; g++) items[n++] = (Item){s, g, i0, i1, (i1 - i0) * (kmax + A)};
        i0 = i1;
    }
    Packed pk;
    if (pack_all(&pk, tk, tks_t, tks_h, tv, tvs_t, tvs_h, cu_k, len, ntrunk, Hkv, D, nt)) {
        free(len), free(items);
        return -1;
    }
    qsort(items, (size_t)n, sizeof(Item), by_cost);
    int failed = 0;
#pragma omp parallel num_threads(n > 1 ? nt : 1)
    {
        Scratch sc;
        const int ok = scratch_alloc(&sc, bq * G, D, A);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n; it++) {
            if (!ok) continue;
            const Item w = items[it];
            const int64_t R = (w.i1 - w.i0) * G;
            for (int64_t i = w.i0; i < w.i1; i++)
                for (int64_t h = 0; h < G; h++) {
                    sc.qr[(i - w.i0) * G + h] = q + order[i] * qs_t + (w.g * G + h) * qs_h;
                    sc.lim[(i - w.i0) * G + h] = anchor[order[i]] + 1; /* the trunk keys */
                }
            attend_packed(&sc, R, pk.k + packed_base(&pk, w.s, w.g), pk.v + packed_base(&pk, w.s, w.g), D, scale);
            for (int64_t r = 0; r < R; r++) { /* the tree keys, then the output */
                const int64_t u = order[w.i0 + r / G], h = w.g * G + r % G;
                const int64_t *au = anc + u * A;
                float *ar = sc.acc + r * D, *sa = sc.sa;
                int64_t na = 0;
                float mnew = sc.m[r];
                for (; na < A && au[na] >= 0; na++) {
                    sa[na] = dot_bf16(sc.qr[r], k + au[na] * ks_t + w.g * ks_h, D) * scale;
                    mnew = sa[na] > mnew ? sa[na] : mnew;
                }
                if (na > 0) {
                    const float alpha = sc.m[r] == -INFINITY ? 0.0f : expf(sc.m[r] - mnew);
                    float sum = 0.0f;
                    for (int64_t d = 0; d < D; d += VW) _mm512_storeu_ps(ar + d, v_mul(_mm512_loadu_ps(ar + d), v_set1(alpha)));
                    for (int64_t j = 0; j < na; j++) {
                        const float e = expf(sa[j] - mnew);
                        sum += e;
                        const vf pe = v_set1(round_bf16(e));
                        const uint16_t *vr = v + au[j] * vs_t + w.g * vs_h;
                        for (int64_t d = 0; d < D; d += VW)
                            _mm512_storeu_ps(ar + d, v_fmadd(pe, load_bf16x16(vr + d), _mm512_loadu_ps(ar + d)));
                    }
                    sc.l[r] = sc.l[r] * alpha + sum;
                }
                store_row(o + u * os_t + h * os_h, ar, sc.l[r], D);
            }
        }
        scratch_free(&sc);
    }
    packed_free(&pk);
    free(len), free(items);
    return failed ? -1 : 0;
}
