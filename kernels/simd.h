/* AVX-512 helpers shared by the CPU kernels (kernels/e2e_tv/tv_cpu.c, kernels/sampling/sample_cpu.c,
 * kernels/layer_ops/layer_ops_cpu.c);
 * kernels/cbuild.py puts this folder on the include path and counts this file in each build's cache key. */
#ifndef SPECOPD_SIMD_H
#define SPECOPD_SIMD_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define VW 16 /* floats per vector */
#define EXP16_LOW (-87.3365f) /* exp16 clamps its argument here (fp32's exp is denormal or 0 below it) */

static inline __mmask16 tail_mask(int64_t n) { return n >= VW ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp(x), Cephes expf (~1 ulp) on 16 lanes; x is clamped to [-87.34, 88]: below, 2^-126 e^r (~1e-38) instead of a
 * denormal or 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP16_LOW)), _mm512_set1_ps(88.0f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127));
    return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
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
