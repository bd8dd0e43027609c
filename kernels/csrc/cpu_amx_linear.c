/* bf16 out = x . w^T (+ bias) on AMX tiles, for x [rows, K] and w [N, K] row-major as
 * nn.Linear stores it: decode steps of many sequences and short prefill chunks.
 *
 * The product is computed transposed, out^T = w . x^T, so the weight is read where it lies:
 * A tiles are 16 weight rows x 32 K (the plain layout), B tiles hold x^T as bf16 pairs along
 * K (packed once per call, [K / 2][mpad]), and C tiles are 16 outputs x 16 rows. A decode
 * step streams every weight once: all 30 SmolLM2 layers at 32 rows take 0.65-0.70x the time
 * of oneDNN's packed product on 2 AMX cores (interleaved runs), and a 32-sequence decode step
 * 0.6-0.7x.
 *
 * Threads split the weight into 32-row blocks, so each weight row is read from memory once;
 * rows of x beyond 32 reread the block from L2. Sums are float32 (TDPBF16PS), rounded once
 * to bf16; each output's additions are in the same order whatever the other rows of x are,
 * so a row's result does not depend on its batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_amx.h"

#if HAVE_AMX
#define BLOCK 32 /* weight rows and x rows per 2 x 2 block of C tiles */

/* x^T as bf16 pairs along K: xp[k / 2][m] holds (x[m][k], x[m][k + 1]), zero for m >= rows;
 * 16 rows x 16 pairs at a time, as one 32-bit transpose. */
static void pack_rows(const uint16_t *x, int64_t rows, int64_t k_in, int64_t mpad, uint32_t *xp) {
    const int64_t pairs = k_in / 2;
    for (int64_t m0 = 0; m0 < mpad; m0 += 16)
        for (int64_t k0 = 0; k0 < pairs; k0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = m0 + i < rows ? _mm512_loadu_si512((const uint32_t *)(x + (m0 + i) * k_in) + k0)
                                     : _mm512_setzero_si512();
            transpose_16x16(r);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512(xp + (k0 + k) * mpad + m0, r[k]);
        }
}

/* out[m][n0 + n] for the rows m0 + [0, 32) below rows, from the C block cb[32 n][32 m]:
 * transposed 16 x 16 at a time, bias added, rounded once to bf16. */
static void store_block(const float *cb, int64_t m0, int64_t rows, int64_t n0, int64_t n_out, int nb,
                        const uint16_t *bias, uint16_t *out) {
    for (int q = 0; q < 4; q++) {
        const int n_half = q / 2, m_half = q % 2;
        if (n_half * 16 >= nb || m0 + m_half * 16 >= rows) continue;
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(cb + (n_half * 16 + i) * BLOCK + m_half * 16);
        transpose_16x16(r); /* r[j] lane i: output n_half * 16 + i of row m_half * 16 + j */
        __m512 b = _mm512_setzero_ps();
        if (bias != NULL)
            for (int i = 0; i < 16; i++) ((float *)&b)[i] = n_half * 16 + i < nb ? bf16_to_f32(bias[n0 + n_half * 16 + i]) : 0.0f;
        const int width = nb - n_half * 16 < 16 ? nb - n_half * 16 : 16;
        const __mmask16 keep = (__mmask16)((1u << width) - 1u);
        for (int j = 0; j < 16; j++) {
            const int64_t m = m0 + m_half * 16 + j;
            if (m >= rows) break;
            __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(r[j]), b));
            _mm256_mask_storeu_epi16(out + m * n_out + n0 + n_half * 16, keep, (__m256i)v);
        }
    }
}

/* The C block of 32 weight rows (at w, stride k_in) by the 32 packed rows at xp + m0;
 * the 32 rows at next (or NULL) are fetched meanwhile. */
static void multiply_block(const uint16_t *w, int64_t k_in, const uint32_t *xp, int64_t mpad, int64_t m0,
                           const uint16_t *next, float *cb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < k_in; k0 += 32) {
        /* NOTE: 32 rows read 64 bytes at a time are more streams than the hardware
         * prefetchers follow: the next block's lines are brought into L2 as this one's are
         * used (19% faster than none on 2 cores; into L1, 5% slower than into L2). */
        if (next != NULL)
            for (int i = 0; i < BLOCK; i++) __builtin_prefetch(next + i * k_in + k0, 0, 1);
        const uint32_t *b = xp + (k0 / 2) * mpad + m0;
        amx_accumulate_2x2(w + k0, w + 16 * k_in + k0, k_in * 2, b, b + 16, mpad * 4);
    }
    amx_store_2x2(cb, BLOCK);
}

/* tail: BLOCK x k_in scratch for the last block's rows, zero-padded to 32, where n_out is
 * not a multiple of BLOCK (else NULL); only the thread that owns the last block uses it. */
static void multiply(int64_t rows, int64_t n_out, int64_t k_in, const uint32_t *xp, int64_t mpad,
                     const uint16_t *w, const uint16_t *bias, uint16_t *out, uint16_t *tail, int threads) {
    const int64_t blocks = (n_out + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        float cb[BLOCK * BLOCK] __attribute__((aligned(64)));
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t n0 = blk * BLOCK;
            const int nb = n_out - n0 < BLOCK ? (int)(n_out - n0) : BLOCK;
            const uint16_t *wb = w + n0 * k_in;
            if (nb < BLOCK) {
                memset(tail, 0, sizeof(uint16_t) * (size_t)(BLOCK * k_in));
                memcpy(tail, wb, sizeof(uint16_t) * (size_t)(nb * k_in));
                wb = tail;
            }
            const uint16_t *next = blk + 1 < blocks && nb == BLOCK ? w + (n0 + BLOCK) * k_in : NULL;
            for (int64_t m0 = 0; m0 < rows; m0 += BLOCK) {
                multiply_block(wb, k_in, xp, mpad, m0, m0 == 0 ? next : NULL, cb);
                store_block(cb, m0, rows, n0, n_out, nb, bias, out);
            }
        }
        _tile_release();
    }
}
#endif

/* 0 on success; -1 where AMX is not usable or k_in is not a multiple of 32; -2 out of memory. */
int ragserve_amx_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint16_t *w,
                             const uint16_t *bias, uint16_t *out, int threads) {
#if HAVE_AMX
    if (!amx_usable() || k_in % 32 || rows < 1 || n_out < 1) return -1;
    const int64_t mpad = (rows + BLOCK - 1) / BLOCK * BLOCK;
    uint32_t *xp = aligned_alloc(64, (sizeof(uint32_t) * (size_t)(k_in / 2) * (size_t)mpad + 63) / 64 * 64);
    uint16_t *tail = n_out % BLOCK ? malloc(sizeof(uint16_t) * (size_t)(BLOCK * k_in)) : NULL;
    if (xp == NULL || (n_out % BLOCK && tail == NULL)) {
        free(xp);
        free(tail);
        return -2;
    }
    pack_rows(x, rows, k_in, mpad, xp);
    multiply(rows, n_out, k_in, xp, mpad, w, bias, out, tail, threads);
    free(xp);
    free(tail);
    return 0;
#else
    (void)rows, (void)n_out, (void)k_in, (void)x, (void)w, (void)bias, (void)out, (void)threads;
    return -1;
#endif
}
