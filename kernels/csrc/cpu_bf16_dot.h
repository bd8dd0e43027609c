/* bf16 pair dot products (AVX-512 BF16's vdpbf16ps) for cpu_attention.c: the tile
 * micro-kernels and their pair packing.
 *
 * vdpbf16ps multiplies 32 bf16 pairs and adds each pair's two products into one of 16
 * float32 lanes: twice the multiply-adds of a float32 FMA per instruction, and no widening
 * of K/V on load. Operands are packed as 32-bit pairs of bf16 along the reduced dimension:
 *  - Q . K^T reduces over head_dim: K rows are already pairs in place (d, d + 1 adjacent);
 *    Q^T is packed once per tile as qp[d / 2][row].
 *  - P . V reduces over keys: V is packed per chunk as vp[key / 2][dim] (rows 2i and 2i + 1
 *    interleaved) and the probabilities, rounded to bf16 as flash attention does on GPUs,
 *    as pp[key / 2][row].
 * Accumulation stays in float32; scores are scaled after the product (Q stays exact).
 */
#ifndef RAGSERVE_CPU_BF16_DOT_H
#define RAGSERVE_CPU_BF16_DOT_H

#include "cpu_vec.h"

#if VL == 16 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1

typedef uint32_t vpair __attribute__((vector_size(64), aligned(4)));

static inline __m512bh as_pairs(vpair x) { return (__m512bh)(__m512i)x; }

static inline vpair load_pairs(const uint32_t *p) { return *(const vpair *)p; }

/* Two bf16 rows (16 elements each) interleaved into 16 pairs: lo from a, hi from b (one
 * vpermt2w over the two 32-byte loads). */
static inline vpair interleave_bf16(const uint16_t *a, const uint16_t *b) {
    const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a));
    __m512i hi = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b));
    return (vpair)_mm512_permutex2var_epi16(lo, index, hi);
}

/* Two float32 vectors rounded to nearest even bf16 and paired: lo from a, hi from b
 * (vcvtne2ps2bf16 puts b's 16 values below a's, vpermw interleaves them). */
static inline vpair round_pairs(vf a, vf b) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (vpair)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
}

/* 2^x for a softmax whose probabilities are rounded to bf16 for P . V (x <= 0 against the
 * row's max; x <= 2^LAZY_RESCALE against the AMX tiles' lagging reference, cpu_attention.c,
 * larger x coming only in a pass whose results are dropped), to ~1e-4 relative: a degree-3
 * polynomial on the fraction, far below the bf16 rounding (4e-3) the probabilities get, and
 * the same approximation in the sum they are divided by. The integer part is rounded by
 * adding 1.5 * 2^23, whose low mantissa bits then hold it, and is shifted into p's
 * exponent: 8 instructions in all, where a degree-5 polynomial with vrndscaleps and
 * vscalefps took 10 (3 of them port-0 only). */
static inline __m512 exp2_softmax(__m512 x) {
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 t = _mm512_add_ps(x, shift);
    const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, shift)); /* in [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(5.5007654e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4220794e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9328273e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i scale = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), scale));
}

/* S^T[j][r] = scale * K[j] . Q[r] for keys j < keys[r / (NV * VL)] of each row block, from
 * K rows in place (bf16) and qp [D / 2][rpad]. Same blocking as qk_tile. */
static void qk_tile_dot(const uint16_t *const *krow, const uint32_t *qp, float *st, const int *keys,
                        int rpad, int D, float scale) {
    for (int r0 = 0; r0 < rpad; r0 += NV * VL) {
        const int npad = keys[r0 / (NV * VL)];
        for (int j0 = 0; j0 < npad; j0 += RBK) {
            __m512 acc[RBK][NV];
            const uint32_t *k[RBK];
            for (int jj = 0; jj < RBK; jj++) {
                k[jj] = (const uint32_t *)krow[j0 + jj];
                for (int v = 0; v < NV; v++) acc[jj][v] = _mm512_setzero_ps();
            }
            for (int i = 0; i < D / 2; i++) {
                __m512bh b[NV];
                for (int v = 0; v < NV; v++) b[v] = as_pairs(load_pairs(qp + (int64_t)i * rpad + r0 + v * VL));
                for (int jj = 0; jj < RBK; jj++) {
                    __m512bh a = (__m512bh)_mm512_set1_epi32((int)k[jj][i]);
                    for (int v = 0; v < NV; v++) acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], a, b[v]);
                }
            }
            for (int jj = 0; jj < RBK; jj++)
                for (int v = 0; v < NV; v++)
                    storeu(st + (int64_t)(j0 + jj) * rpad + r0 + v * VL, (vf)acc[jj][v] * scale);
        }
    }
}

/* O[r0 + rr][:] += sum over key pairs jp < pairs of pp[jp][r0 + rr] . vp[jp][:]. */
#define PV_DOT_BLOCK(ROWS)                                                                        \
    static void pv_dot_rows_##ROWS(const uint32_t *vp, const uint32_t *pp, float *o, int pairs,   \
                                   int rpad, int r0, int D) {                                     \
        for (int d0 = 0; d0 < D; d0 += NV * VL) {                                                 \
            __m512 acc[ROWS][NV];                                                                 \
            for (int rr = 0; rr < ROWS; rr++)                                                     \
                for (int v = 0; v < NV; v++)                                                      \
                    acc[rr][v] = (__m512)loadu(o + (int64_t)(r0 + rr) * D + d0 + v * VL);         \
            for (int jp = 0; jp < pairs; jp++) {                                                  \
                __m512bh b[NV];                                                                   \
                for (int v = 0; v < NV; v++) b[v] = as_pairs(load_pairs(vp + (int64_t)jp * D + d0 + v * VL)); \
                const uint32_t *pj = pp + (int64_t)jp * rpad + r0;                                \
                for (int rr = 0; rr < ROWS; rr++) {                                               \
                    __m512bh a = (__m512bh)_mm512_set1_epi32((int)pj[rr]);                        \
                    for (int v = 0; v < NV; v++) acc[rr][v] = _mm512_dpbf16_ps(acc[rr][v], a, b[v]); \
                }                                                                                 \
            }                                                                                     \
            for (int rr = 0; rr < ROWS; rr++)                                                     \
                for (int v = 0; v < NV; v++)                                                      \
                    storeu(o + (int64_t)(r0 + rr) * D + d0 + v * VL, (vf)acc[rr][v]);             \
        }                                                                                         \
    }
PV_DOT_BLOCK(RBR)
PV_DOT_BLOCK(1)

#else
#define HAVE_BF16_DOT 0
#endif

#endif
