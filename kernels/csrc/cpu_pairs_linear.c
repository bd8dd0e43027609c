/* bf16 products of a few rows (decode steps of 3 to 32 sequences, short questions) on CPUs
 * with AVX-512 BF16 and no AMX, over a copy of the weight laid out for vdpbf16ps.
 *
 * Layout (kernels/cpu_linear.py, pair_weight): the outputs in panels of PAIR_PANEL; panel p
 * holds, for each pair of inputs i, its PAIR_PANEL outputs' weights (w[n][2i], w[n][2i + 1])
 * as one 32-bit pair: wp[p][i][j], contiguous, zero past n_out. A panel is one sequential
 * stream, which the hardware prefetchers follow.
 *
 * A tile of up to PAIR_TILE_ROWS rows x PAIR_PANEL outputs keeps its 24 float32 sums in
 * registers: per pair of inputs it loads the panel's 3 vectors of pairs and multiplies each
 * by every row's broadcast pair. Each output is one float32 sum over the pairs in order, the
 * bias added, rounded once to nearest even bf16 (as the other bf16 kernels): a row's result
 * does not depend on the other rows of the batch.
 *
 * From PAIR_AHEAD_MIN_ROWS rows on, the tiles of a panel also prefetch the next panel,
 * each a share of its lines in proportion to its rows. Only a panel's first tile reads it
 * from memory, and at 32 rows that tile would need its 192 bytes every 24 cycles, more than
 * memory gives two cores at once; spread over the panel's tiles, the stream asks a quarter
 * of that. All four projections of 30 SmolLM2 layers and the LM head, weights from memory,
 * on a 2-core AMD EPYC (this build and the one before loaded in one process, alternated run
 * by run, medians of 12 runs each): 0.93-0.94x the time at 32 rows, 0.92x at 24, 0.96x at
 * 20, and 1.00-1.12x at 16 to 19 rows, where the first tile's stream is within what memory
 * gives and the prefetches only add work.
 *
 * Why: oneDNN's packed bf16 product of 32 rows ran SmolLM2's projections at about 0.7x this
 * CPU's bf16 rate, and each of the ~120 calls of a decode step crosses from Python; with
 * this kernel the decoder layers of such a step run in one native call
 * (cpu_decoder_stack.c).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if VL == 16 && defined(__AVX512BF16__)
#define PAIR_PANEL_VECTORS 3
#define PAIR_TILE_ROWS 8 /* 24 sums + 3 weight vectors + a broadcast in 32 registers */
#define PAIR_AHEAD_MIN_ROWS 20
#define CACHE_LINE 64

/* ahead: ahead_lines cache lines to prefetch, spread over the pairs (NULL: none). */
static inline __attribute__((always_inline)) void pair_tile(const int R, int64_t pairs, const uint32_t *x,
                                                            const uint32_t *panel, const float *bias,
                                                            uint16_t *out, int64_t ldo, int nb,
                                                            const char *ahead, int64_t ahead_lines) {
    __m512 acc[PAIR_TILE_ROWS][PAIR_PANEL_VECTORS];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < PAIR_PANEL_VECTORS; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; k++) {
        if (ahead != NULL) _mm_prefetch(ahead + k * ahead_lines / pairs * CACHE_LINE, _MM_HINT_T0);
        __m512bh w[PAIR_PANEL_VECTORS];
        for (int v = 0; v < PAIR_PANEL_VECTORS; v++)
            w[v] = (__m512bh)_mm512_loadu_si512(panel + k * PAIR_PANEL + v * VL);
        for (int i = 0; i < R; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[i * pairs + k]);
            for (int v = 0; v < PAIR_PANEL_VECTORS; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, w[v]);
        }
    }
    for (int i = 0; i < R; i++) {
        /* NOTE: a whole panel is stored in place; a call to memcpy per row and panel was 4%
         * of a 32-sequence decode step. */
        uint16_t rounded[PAIR_PANEL];
        uint16_t *dst = nb == PAIR_PANEL ? out + i * ldo : rounded;
        for (int v = 0; v < PAIR_PANEL_VECTORS; v++) {
            vf sum = (vf)acc[i][v];
            if (bias != NULL) sum += loadu(bias + v * VL);
            store_bf16(dst + v * VL, sum);
        }
        if (dst == rounded) memcpy(out + i * ldo, rounded, sizeof(uint16_t) * (size_t)nb);
    }
}

/* pair_tile() with the row count a constant, so that its loops unroll. */
static void pair_tile_of(int rows, int64_t pairs, const uint32_t *x, const uint32_t *panel, const float *bias,
                         uint16_t *out, int64_t ldo, int nb, const char *ahead, int64_t ahead_lines) {
    switch (rows) {
#define PAIR_TILE_CASE(R) \
    case R: pair_tile(R, pairs, x, panel, bias, out, ldo, nb, ahead, ahead_lines); break;
        PAIR_TILE_CASE(1) PAIR_TILE_CASE(2) PAIR_TILE_CASE(3) PAIR_TILE_CASE(4)
        PAIR_TILE_CASE(5) PAIR_TILE_CASE(6) PAIR_TILE_CASE(7) PAIR_TILE_CASE(8)
#undef PAIR_TILE_CASE
    }
}
#endif

/* bf16 out = x . w^T (+ bias) for 1 to PAIRS_LINEAR_MAX_ROWS rows, the weight as pair_weight
 * lays it out (wp). 0 on success; -1 where the build has no AVX-512 BF16, k_in is odd or the
 * rows are out of range. */
int ragserve_pairs_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint32_t *wp,
                               const uint16_t *bias, uint16_t *out, int threads) {
#if VL == 16 && defined(__AVX512BF16__)
    if (k_in % 2 || rows < 1 || rows > PAIRS_LINEAR_MAX_ROWS) return -1;
    const int64_t pairs = k_in / 2, panels = (n_out + PAIR_PANEL - 1) / PAIR_PANEL;
    const int64_t panel_lines = pairs * PAIR_PANEL * (int64_t)sizeof(uint32_t) / CACHE_LINE;
#pragma omp parallel num_threads(threads)
    {
        /* NOTE: a run of adjacent panels per thread: one sequential stream of weights. */
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = panels * me / team, last = panels * (me + 1) / team;
        float padded_bias[PAIR_PANEL];
        for (int64_t p = first; p < last; p++) {
            const int64_t n0 = p * PAIR_PANEL;
            const int nb = n_out - n0 < PAIR_PANEL ? (int)(n_out - n0) : PAIR_PANEL;
            const float *bias_panel = NULL;
            if (bias != NULL) {
                for (int j = 0; j < PAIR_PANEL; j++) padded_bias[j] = j < nb ? bf16_to_f32(bias[n0 + j]) : 0.0f;
                bias_panel = padded_bias;
            }
            const uint32_t *panel = wp + p * pairs * PAIR_PANEL;
            const char *next = rows >= PAIR_AHEAD_MIN_ROWS && p + 1 < last ? (const char *)(panel + pairs * PAIR_PANEL)
                                                                           : NULL;
            for (int64_t m0 = 0; m0 < rows; m0 += PAIR_TILE_ROWS) {
                const int tm = rows - m0 < PAIR_TILE_ROWS ? (int)(rows - m0) : PAIR_TILE_ROWS;
                const int64_t line0 = m0 * panel_lines / rows, line1 = (m0 + tm) * panel_lines / rows;
                pair_tile_of(tm, pairs, (const uint32_t *)x + m0 * pairs, panel, bias_panel, out + m0 * n_out + n0,
                             n_out, nb, next == NULL ? NULL : next + line0 * CACHE_LINE, line1 - line0);
            }
        }
    }
    return 0;
#else
    (void)rows, (void)n_out, (void)k_in, (void)x, (void)wp, (void)bias, (void)out, (void)threads;
    return -1;
#endif
}
