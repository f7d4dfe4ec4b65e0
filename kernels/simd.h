/* 16-float vectors for the CPU kernels (kernels/e2e_tv/tv_cpu.c, kernels/sampling/sample_cpu.c; layer_ops_cpu.c
 * uses the AVX-512 helpers only): one __m512 on AVX-512 F, two __m256 on AVX2 + FMA, with the same operations in
 * the same order, so a kernel's results are the same bits on either (tests/test_kernels_simd.py builds both where
 * the CPU allows). The reductions are written out (v_reduce_add / v_reduce_max: GCC's _mm512_reduce_*_ps order)
 * so that they do not depend on the compiler's intrinsics either.
 * kernels/cbuild.py puts this folder on the include path and counts this file in each build's cache key. */
#ifndef SPECOPD_SIMD_H
#define SPECOPD_SIMD_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define VW 16 /* floats per vector */
#define EXP16_LOW (-87.3365f) /* exp16 clamps its argument here (fp32's exp is denormal or 0 below it) */

#if defined(__AVX512F__) && !defined(SPECOPD_SIMD_AVX2)
#define SIMD_ISA "avx512"
typedef __m512 vf;
typedef __mmask16 vmask; /* bit i: lane i */

static inline vmask tail_mask(int64_t n) { return n >= VW ? (vmask)0xffff : (vmask)((1u << n) - 1u); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c, one rounding */
static inline vf v_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b, one rounding */
static inline vf v_floor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) { /* 2^n for integral n in [-126, 127] */
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
static inline vf v_loadz(vmask k, const float *p) { return _mm512_maskz_loadu_ps(k, p); }            /* 0 outside k */
static inline vf v_load_or(vf src, vmask k, const float *p) { return _mm512_mask_loadu_ps(src, k, p); } /* src outside */
static inline void v_store(float *p, vmask k, vf x) { _mm512_mask_storeu_ps(p, k, x); }
static inline vf v_movz(vmask k, vf x) { return _mm512_maskz_mov_ps(k, x); }
static inline vf v_mov(vf src, vmask k, vf x) { return _mm512_mask_mov_ps(src, k, x); } /* x in k, else src */
static inline vmask v_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vmask v_eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vmask v_ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
static inline vmask v_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline vmask m_none(void) { return 0; }
static inline vmask m_and(vmask a, vmask b) { return a & b; }
static inline vmask m_or(vmask a, vmask b) { return a | b; }
static inline int m_any(vmask a) { return a != 0; }
static inline __m256 v_lo(vf a) { return _mm512_castps512_ps256(a); }
static inline __m256 v_hi(vf a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_ISA "avx2"
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256 lo, hi; } vmask; /* all-ones lanes */

static inline vmask tail_mask(int64_t n) {
    __m256i c = _mm256_set1_epi32((int)(n >= VW ? VW : n));
    return (vmask){_mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
                   _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
#define V2(f, a, b) ((vf){f((a).lo, (b).lo), f((a).hi, (b).hi)})
static inline vf v_set1(float a) { return (vf){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline vf v_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf v_add(vf a, vf b) { return V2(_mm256_add_ps, a, b); }
static inline vf v_sub(vf a, vf b) { return V2(_mm256_sub_ps, a, b); }
static inline vf v_mul(vf a, vf b) { return V2(_mm256_mul_ps, a, b); }
static inline vf v_min(vf a, vf b) { return V2(_mm256_min_ps, a, b); }
static inline vf v_max(vf a, vf b) { return V2(_mm256_max_ps, a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf v_fnmadd(vf a, vf b, vf c) {
    return (vf){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf v_floor(vf a) {
    return (vf){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}
static inline __m256 pow2i8(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline vf v_pow2i(vf n) { return (vf){pow2i8(n.lo), pow2i8(n.hi)}; }
static inline vf v_loadz(vmask k, const float *p) { /* masked-off lanes are not read (no fault past the end) */
    return (vf){_mm256_maskload_ps(p, _mm256_castps_si256(k.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(k.hi))};
}
static inline vf v_movz(vmask k, vf x) { return (vf){_mm256_and_ps(k.lo, x.lo), _mm256_and_ps(k.hi, x.hi)}; }
static inline vf v_mov(vf src, vmask k, vf x) {
    return (vf){_mm256_blendv_ps(src.lo, x.lo, k.lo), _mm256_blendv_ps(src.hi, x.hi, k.hi)};
}
static inline vf v_load_or(vf src, vmask k, const float *p) { return v_mov(src, k, v_loadz(k, p)); }
static inline void v_store(float *p, vmask k, vf x) {
    _mm256_maskstore_ps(p, _mm256_castps_si256(k.lo), x.lo);
    _mm256_maskstore_ps(p + 8, _mm256_castps_si256(k.hi), x.hi);
}
static inline vmask v_lt(vf a, vf b) { return (vmask){_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)}; }
static inline vmask v_eq(vf a, vf b) { return (vmask){_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)}; }
static inline vmask v_ge(vf a, vf b) { return (vmask){_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)}; }
static inline vmask v_nan(vf a) { return (vmask){_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)}; }
static inline vmask m_none(void) { return (vmask){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vmask m_and(vmask a, vmask b) { return (vmask){_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
static inline vmask m_or(vmask a, vmask b) { return (vmask){_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
static inline int m_any(vmask a) { return _mm256_movemask_ps(_mm256_or_ps(a.lo, a.hi)) != 0; }
static inline __m256 v_lo(vf a) { return a.lo; }
static inline __m256 v_hi(vf a) { return a.hi; }
#undef V2

#else
#error "the CPU kernels need AVX-512 F or AVX2 + FMA (-march=native on such a CPU); without them torch's path is kept"
#endif

/* sum of the 16 lanes: (hi 8 + lo 8), (hi 4 + lo 4), + its pairs swapped, lane 0 + lane 1 (GCC's order) */
static inline float v_reduce_add(vf a) {
    __m256 t3 = _mm256_add_ps(v_hi(a), v_lo(a));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}

/* max of the 16 lanes, in GCC's _mm512_reduce_max_ps order (operand order too: it decides NaN and -0 / +0) */
static inline float v_reduce_max(vf a) {
    __m256 t3 = _mm256_max_ps(v_hi(a), v_lo(a));
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(t10);
}

/* exp(x), Cephes expf (~1 ulp) on 16 lanes; x is clamped to [-87.34, 88]: below, 2^-126 e^r (~1e-38) instead of a
 * denormal or 0. */
static inline vf exp16(vf x) {
    x = v_min(v_max(x, v_set1(EXP16_LOW)), v_set1(88.0f));
    vf fx = v_floor(v_fmadd(x, v_set1(1.44269504088896341f), v_set1(0.5f)));
    vf r = v_fnmadd(fx, v_set1(0.693359375f), x);
    r = v_fmadd(fx, v_set1(2.12194440e-4f), r);
    vf y = v_set1(1.9875691500E-4f);
    y = v_fmadd(y, r, v_set1(1.3981999507E-3f));
    y = v_fmadd(y, r, v_set1(8.3334519073E-3f));
    y = v_fmadd(y, r, v_set1(4.1665795894E-2f));
    y = v_fmadd(y, r, v_set1(1.6666665459E-1f));
    y = v_fmadd(y, r, v_set1(5.0000001201E-1f));
    y = v_fmadd(y, v_mul(r, r), v_add(r, v_set1(1.0f)));
    return v_mul(y, v_pow2i(fx));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One row of logits -> fp32 x[V]: a copy into buf for bf16, the row itself for fp32 (row stride ld). */
static inline const float *load_row(const void *z, int bf16, int64_t ld, int64_t row, int64_t V, float *buf) {
    if (!bf16) return (const float *)z + row * ld;
    const uint16_t *h = (const uint16_t *)z + row * ld;
    for (int64_t v = 0; v < V; v++) buf[v] = bf16_to_f32(h[v]);
    return buf;
}

#endif
