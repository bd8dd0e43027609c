/* Vector helpers shared by the CPU kernels: GCC vector types sized for the build's ISA
 * (AVX-512: 16 floats, else 8), bf16 widening and rounding, max, exp. */
#ifndef RAGSERVE_CPU_VEC_H
#define RAGSERVE_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef int32_t viu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));

static inline vf loadu(const float *p) { return *(const vfu *)p; }
static inline void storeu(float *p, vf x) { *(vfu *)p = x; }
static inline vf splat(float x) {
#if VL == 16
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){0} + x;
#endif
}

static inline vf load_bf16(const uint16_t *p) {
    vu wide = __builtin_convertvector(*(const vh *)p, vu) << 16;
    return (vf)wide;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

static inline vf vmax(vf a, vf b) {
#if VL == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    vi take_a = a > b;
    return (vf)(((vi)a & take_a) | ((vi)b & ~take_a));
#endif
}

/* a * b + c rounded once. NOTE: explicit, so every kernel that promises the same sums in
 * the same order gets them (the compiler's contraction of a * b + c may differ from loop
 * to loop). */
static inline vf vfma(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 2^x for x <= 0, to ~1e-8 relative. Below -126 (and for -inf) it returns 2^-126 or less,
 * ~1e-38: as good as 0 next to the row's largest probability, which is 1. */
static inline vf vexp2(vf x) {
    x = vmax(x, splat(-126.0f));
    vf n = (x + 12582912.0f) - 12582912.0f; /* round to nearest (1.5 * 2^23 trick) */
    vf f = x - n;                           /* in [-0.5, 0.5] */
    vf p = splat(1.5252734e-5f);
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += x[i];
    return s;
}

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < VL; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* VL floats rounded to nearest even bf16, each in the high half of its 32 bits. */
static inline vu round_bf16_bits(vf x) {
    vu bits = (vu)x;
    return bits + (0x7FFFu + ((bits >> 16) & 1u));
}

/* Round to nearest even, VL floats to bf16. */
static inline void store_bf16(uint16_t *p, vf x) {
    *(vh *)p = __builtin_convertvector(round_bf16_bits(x) >> 16, vh);
}

/* What a bf16 tensor op would have stored: x rounded to bf16 (float32: x itself). */
static inline vf round_as(vf x, int is_bf16) {
    if (!is_bf16) return x;
    return (vf)(round_bf16_bits(x) & 0xFFFF0000u);
}

#if VL == 16
/* Transpose 16 x 16 32-bit elements in place: r[i] lane j becomes r[j] lane i. */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* Then u[4i + c]'s 128-bit lane L holds column 4L + c of rows 4i .. 4i + 3. */
    __m512i u[16];
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i lo_a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), lo_b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        __m512i hi_a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE), hi_b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(lo_a, lo_b, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(lo_a, lo_b, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(hi_a, hi_b, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(hi_a, hi_b, 0xDD);
    }
}
#endif

/* e^x to ~1 ulp (Cody-Waite reduction); inf above ~88.7, ~0 below ~-87.3. */
static inline vf vexp(vf x) {
    x = vmax(x, splat(-87.3f));
    vi big = x > 88.7f;
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf y = (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
    return vselect(big, splat(INFINITY), y);
}

/* silu(g) * u as a tensor op of the dtype takes it: the activation rounded first. One
 * definition for the separate pass and the pass fused into the gate/up product, so that
 * both give the same bits. */
static inline vf silu_times(vf g, vf u, int is_bf16) {
    return round_as(g / (1.0f + vexp(-g)), is_bf16) * u;
}

#endif
