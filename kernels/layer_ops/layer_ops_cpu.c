/* A bf16 decoder layer's elementwise work in one pass each (CPU): RMSNorm, SiLU(gate) * up, RoPE.
 *
 * torch's eager forms (kernels/layer_ops/naive.py, the models' own code) make 3-8 passes over each activation,
 * with an fp32 copy for the norm; here each output is computed from one read of its inputs, with the same
 * roundings: every torch bf16 op computes in fp32 and rounds to nearest even, so do these.
 *  - rope and the "* up" of silu_mul: bitwise equal to torch (products of bf16 are exact in fp32; the sum is
 *    rounded to fp32 then bf16, as torch does);
 *  - rms_norm: the sum of squares in another order than torch's reduction (~1e-7 relative), so an element
 *    may differ by one bf16 unit where the fp32 value lies next to a rounding boundary;
 *  - silu: exp from Cephes (~1 ulp) instead of Sleef's: the same, up to one bf16 unit at rounding boundaries.
 *
 * Built by kernels/cbuild.py (-O3 -march=native -fopenmp; no fast-math), loaded with ctypes. Rows are
 * independent: a row's result does not depend on the other rows or the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "layer_ops_cpu.c needs AVX-512 F/BW/VL (-march=native on such a CPU); without it the models keep torch's ops"
#endif
#include <immintrin.h>
#include "simd.h"

#define PAR_MIN 32768 /* elements below which a call runs on one thread (OpenMP start-up costs more) */

static inline __m512 load_bf16(const uint16_t *p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* round to nearest even, as torch's fp32 -> bf16 (NaN stays a quiet NaN) */
static inline __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 neg(__m512 x) { /* -x with the sign of zero flipped too, as torch's neg */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

static inline void store_bf16(uint16_t *p, __mmask16 k, __m512 x) { _mm256_mask_storeu_epi16(p, k, to_bf16(x)); }

static inline __m512 round_bf16(__m512 x) { /* fp32 -> bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

/* out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps))      (unit_offset 0: llama / qwen3, HF's two roundings)
 *        = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * (1 + w)) (unit_offset 1: qwen3_next / qwen4_exp)
 * x, out: [R, D] bf16, row strides ldx / ldo; w: [D] bf16. */
void rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *out, int64_t ldo, int64_t R,
                   int64_t D, float eps, int unit_offset, int threads) {
    int nt = R * D < PAR_MIN ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *orow = out + r * ldo;
        __m512 s = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += VW) {
            __m512 a = load_bf16(xr + d, tail_mask(D - d));
            s = _mm512_add_ps(s, _mm512_mul_ps(a, a)); /* the square rounded to fp32, as h.pow(2) */
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(s) / (float)D + eps);
        __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.0f);
        for (int64_t d = 0; d < D; d += VW) {
            __mmask16 k = tail_mask(D - d);
            __m512 h = _mm512_mul_ps(load_bf16(xr + d, k), vinv);
            __m512 wv = load_bf16(w + d, k);
            __m512 y = unit_offset ? _mm512_mul_ps(h, _mm512_add_ps(one, wv)) : _mm512_mul_ps(wv, round_bf16(h));
            store_bf16(orow + d, k, y);
        }
    }
}

/* out[r] = bf16(silu(g[r])) * u[r], silu(x) = x / (1 + exp(-x)) in fp32. g, u, out: [R, N] bf16 (row strides). */
void silu_mul_bf16(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *out, int64_t ldo,
                   int64_t R, int64_t N, int threads) {
    int nt = R * N < PAR_MIN ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *gr = g + r * ldg, *ur = u + r * ldu;
        uint16_t *orow = out + r * ldo;
        for (int64_t n = 0; n < N; n += VW) {
            __mmask16 k = tail_mask(N - n);
            __m512 a = load_bf16(gr + n, k);
            __m512 na = neg(a);
            __m512 e = exp16(na); /* clamped at e^88; beyond fp32's exp overflows to inf, as torch's does */
            e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(na, _mm512_set1_ps(88.72283935546875f), _CMP_GE_OQ),
                                   _mm512_set1_ps(INFINITY));
            __m512 act = round_bf16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store_bf16(orow + n, k, _mm512_mul_ps(act, load_bf16(ur + n, k)));
        }
    }
}

/* out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) on the first rd features of every head, x elsewhere.
 * x, out: [N, H, hd] bf16 (token stride ldx / ldo, head stride hsx / hso, features contiguous); cos, sin: [N, rd]
 * bf16 (token stride ldc). rotate_half(x) = cat(-x[rd/2:rd], x[:rd/2]). */
void rope_bf16(const uint16_t *x, int64_t ldx, int64_t hsx, const uint16_t *cs, const uint16_t *sn, int64_t ldc,
               uint16_t *out, int64_t ldo, int64_t hso, int64_t N, int64_t H, int64_t hd, int64_t rd, int threads) {
    int nt = N * H * hd < PAR_MIN ? 1 : threads;
    int64_t half = rd / 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < N; t++) {
        const uint16_t *c = cs + t * ldc, *s = sn + t * ldc;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *xh = x + t * ldx + h * hsx;
            uint16_t *oh = out + t * ldo + h * hso;
            for (int64_t i = 0; i < half; i += VW) {
                __mmask16 k = tail_mask(half - i);
                __m512 x1 = load_bf16(xh + i, k), x2 = load_bf16(xh + half + i, k);
                __m512 c1 = load_bf16(c + i, k), c2 = load_bf16(c + half + i, k);
                __m512 s1 = load_bf16(s + i, k), s2 = load_bf16(s + half + i, k);
                __m512 neg_x2 = neg(x2);
                __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(neg_x2, s1)));
                __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2)));
                store_bf16(oh + i, k, lo);
                store_bf16(oh + half + i, k, hi);
            }
            if (rd < hd) memcpy(oh + rd, xh + rd, (size_t)(hd - rd) * sizeof(uint16_t));
        }
    }
}
