/* bf16 products on CPUs with AVX-512 BF16 and no AMX, over a copy of the weight laid out for
 * vdpbf16ps: decode steps of 3 or more sequences, questions and prefill chunks.
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
 *
 * More rows take the same tiles, so a row's outputs are the same sums as in a decode step.
 * Up to PAIRS_PANEL_SPLIT_MAX_ROWS rows (questions, steps of many decodes) split by panels
 * as above; more (prefill chunks) by rows, each thread its own rows in blocks whose pairs
 * fill about a third of L2, each block over every panel, so that a panel comes from L3 once
 * per block and the block's rows from L2 once per panel. The weights of 30 layers, row split
 * against panel split (alternated in one process): 1.07-1.10x the time at 48 rows, 1.05x at 128,
 * 1.00x at 256 and 0.96x at 2,048.
 *
 * The gate/up product can take SiLU in the same pass (ragserve_pairs_silu_mul_bf16): each
 * tile's gate and up halves are rounded to bf16 as the product would store them, then
 * multiplied as ragserve_silu_mul does, so the 2 x intermediate-wide product is never
 * written. All four projections of 30 SmolLM2 layers with SiLU on a 2-core AMD EPYC
 * (alternated in one process, `python -m kernels.bench_cpu_linear`): 0.90x the time of
 * oneDNN's products over its packed weights and a separate SiLU pass at 2,048 and 4,096
 * rows (416 against 376 GFLOP/s), 0.94x at 256, 0.86x at 64.
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
#define PAIRS_PANEL_SPLIT_MAX_ROWS 128 /* more rows split by rows (split_by_rows) */
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

/* pair_tile() with the row count a constant, so that its loops unroll, and a copy without
 * prefetches for the tiles that take none. NOTE: the test for `ahead` left in the loop made
 * long products 3-5% slower. */
static void pair_tile_of(int rows, int64_t pairs, const uint32_t *x, const uint32_t *panel, const float *bias,
                         uint16_t *out, int64_t ldo, int nb, const char *ahead, int64_t ahead_lines) {
#define PAIR_TILE_CASES(AHEAD, LINES)                                                      \
    switch (rows) {                                                                        \
        PAIR_TILE_CASE(1, AHEAD, LINES) PAIR_TILE_CASE(2, AHEAD, LINES)                    \
        PAIR_TILE_CASE(3, AHEAD, LINES) PAIR_TILE_CASE(4, AHEAD, LINES)                    \
        PAIR_TILE_CASE(5, AHEAD, LINES) PAIR_TILE_CASE(6, AHEAD, LINES)                    \
        PAIR_TILE_CASE(7, AHEAD, LINES) PAIR_TILE_CASE(8, AHEAD, LINES)                    \
    }
#define PAIR_TILE_CASE(R, AHEAD, LINES) \
    case R: pair_tile(R, pairs, x, panel, bias, out, ldo, nb, AHEAD, LINES); break;
    if (ahead == NULL)
        PAIR_TILE_CASES(NULL, 0)
    else
        PAIR_TILE_CASES(ahead, ahead_lines)
#undef PAIR_TILE_CASE
#undef PAIR_TILE_CASES
}

/* The bias of outputs [n0, n0 + nb) as floats, zero past nb; NULL without a bias. */
static const float *panel_bias(const uint16_t *bias, int64_t n0, int nb, float *padded) {
    if (bias == NULL) return NULL;
    for (int j = 0; j < PAIR_PANEL; j++) padded[j] = j < nb ? bf16_to_f32(bias[n0 + j]) : 0.0f;
    return padded;
}

typedef struct { /* one product: out = x . w^T (+ bias), or silu(gate) * up of it */
    int64_t pairs, n_out;   /* n_out: the outputs stored (with silu: intermediates) */
    int silu;               /* w is [gate | up], each n_out outputs of whole panels */
    const uint16_t *x, *bias;
    const uint32_t *wp;
    uint16_t *out;
} Product;

static int64_t product_panels(const Product *job) { return (job->n_out + PAIR_PANEL - 1) / PAIR_PANEL; }

/* Output panel p for rows [m0, m1). With `ahead`, its tiles prefetch that panel's lines
 * (and with silu, the up panel's as far past the up panel) in proportion to their rows. */
static void product_panel(const Product *job, int64_t p, int64_t m0, int64_t m1, const char *ahead) {
    const int64_t pairs = job->pairs, n0 = p * PAIR_PANEL, panel_size = pairs * PAIR_PANEL;
    const int64_t panel_lines = panel_size * (int64_t)sizeof(uint32_t) / CACHE_LINE;
    const int nb = job->n_out - n0 < PAIR_PANEL ? (int)(job->n_out - n0) : PAIR_PANEL;
    float bias_floats[2][PAIR_PANEL];
    const float *bias = panel_bias(job->bias, n0, nb, bias_floats[0]);
    const uint32_t *panel = job->wp + p * panel_size;
    const int64_t up_offset = product_panels(job) * panel_size; /* silu: up panel p */
    const float *up_bias = job->silu ? panel_bias(job->bias, job->n_out + n0, nb, bias_floats[1]) : NULL;
    uint16_t gate[PAIR_TILE_ROWS * PAIR_PANEL], up[PAIR_TILE_ROWS * PAIR_PANEL];
    for (int64_t m = m0; m < m1; m += PAIR_TILE_ROWS) {
        const int tm = m1 - m < PAIR_TILE_ROWS ? (int)(m1 - m) : PAIR_TILE_ROWS;
        const int64_t line0 = (m - m0) * panel_lines / (m1 - m0), lines = (m - m0 + tm) * panel_lines / (m1 - m0) - line0;
        const char *tile_ahead = ahead == NULL ? NULL : ahead + line0 * CACHE_LINE;
        const uint32_t *x = (const uint32_t *)job->x + m * pairs;
        uint16_t *out = job->out + m * job->n_out + n0;
        if (!job->silu) {
            pair_tile_of(tm, pairs, x, panel, bias, out, job->n_out, nb, tile_ahead, lines);
            continue;
        }
        /* NOTE: gate and up rounded to bf16 as the product stores them, then ragserve_silu_mul's
         * arithmetic: the same bits as the two passes. */
        pair_tile_of(tm, pairs, x, panel, bias, gate, PAIR_PANEL, PAIR_PANEL, tile_ahead, lines);
        pair_tile_of(tm, pairs, x, panel + up_offset, up_bias, up, PAIR_PANEL, PAIR_PANEL,
                     tile_ahead == NULL ? NULL : tile_ahead + up_offset * sizeof(uint32_t), lines);
        for (int i = 0; i < tm; i++)
            for (int c = 0; c < PAIR_PANEL; c += VL)
                store_bf16(out + i * job->n_out + c,
                           silu_times(load_bf16(gate + i * PAIR_PANEL + c), load_bf16(up + i * PAIR_PANEL + c), 1));
    }
}

/* Few rows (decode steps, short questions): the weights come from memory once, each thread
 * a run of adjacent panels (one sequential stream), every row over each. */
static void split_by_panels(const Product *job, int64_t rows, int threads) {
    const int64_t panels = product_panels(job), panel_size = job->pairs * PAIR_PANEL;
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = panels * me / team, last = panels * (me + 1) / team;
        for (int64_t p = first; p < last; p++) {
            const int ahead = rows >= PAIR_AHEAD_MIN_ROWS && p + 1 < last;
            product_panel(job, p, 0, rows, ahead ? (const char *)(job->wp + (p + 1) * panel_size) : NULL);
        }
    }
}

/* Rows per block for k_in inputs: the block's pairs about 384 KB, a third of a 1 MB L2. */
static int64_t block_rows(int64_t k_in) {
    const int64_t fit = (int64_t)384 * 1024 / (k_in * (int64_t)sizeof(uint16_t)) / PAIR_TILE_ROWS * PAIR_TILE_ROWS;
    return fit < PAIR_TILE_ROWS ? PAIR_TILE_ROWS : fit > 512 ? 512 : fit;
}

/* Many rows (prefill chunks): each thread its own rows (whole tiles), block by block, each
 * block over every panel: a panel comes from L3 once per block, the block's rows from L2
 * once per panel. Each panel's tiles prefetch the next panel, as in split_by_panels: 256
 * rows (one block a thread, the weights of 30 layers from memory) took 0.88-0.90x the time,
 * 2,048-4,096 rows 0.98-1.03x. */
static void split_by_rows(const Product *job, int64_t rows, int threads) {
    const int64_t panels = product_panels(job), block = block_rows(2 * job->pairs);
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t tiles = (rows + PAIR_TILE_ROWS - 1) / PAIR_TILE_ROWS;
        const int64_t first = tiles * me / team * PAIR_TILE_ROWS;
        const int64_t last = tiles * (me + 1) / team * PAIR_TILE_ROWS < rows ? tiles * (me + 1) / team * PAIR_TILE_ROWS
                                                                             : rows;
        for (int64_t b0 = first; b0 < last; b0 += block)
            for (int64_t p = 0; p < panels; p++)
                product_panel(job, p, b0, b0 + block < last ? b0 + block : last,
                              p + 1 < panels ? (const char *)(job->wp + (p + 1) * job->pairs * PAIR_PANEL) : NULL);
    }
}

static void run_product(const Product *job, int64_t rows, int threads) {
    if (rows <= PAIRS_PANEL_SPLIT_MAX_ROWS)
        split_by_panels(job, rows, threads);
    else
        split_by_rows(job, rows, threads);
}
#endif

/* bf16 out = x . w^T (+ bias) for rows >= 1, the weight as pair_weight lays it out (wp).
 * 0 on success; -1 where the build has no AVX-512 BF16, k_in is odd or there are no rows. */
int ragserve_pairs_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint32_t *wp,
                               const uint16_t *bias, uint16_t *out, int threads) {
#if VL == 16 && defined(__AVX512BF16__)
    if (k_in % 2 || rows < 1) return -1;
    const Product job = {.pairs = k_in / 2, .n_out = n_out, .silu = 0, .x = x, .bias = bias, .wp = wp, .out = out};
    run_product(&job, rows, threads);
    return 0;
#else
    (void)rows, (void)n_out, (void)k_in, (void)x, (void)wp, (void)bias, (void)out, (void)threads;
    return -1;
#endif
}

/* bf16 out[r] = silu(g) * u where [g | u] = x[r] . w^T (+ bias), w the [2 * inter, k_in]
 * gate/up weight as pair_weight lays it out: the gate/up product and ragserve_silu_mul in
 * one pass, with the same bits. 0 on success; -1 where the build has no AVX-512 BF16, k_in
 * is odd, inter is not whole panels or there are no rows. */
int ragserve_pairs_silu_mul_bf16(int64_t rows, int64_t inter, int64_t k_in, const uint16_t *x, const uint32_t *wp,
                                 const uint16_t *bias, uint16_t *out, int threads) {
#if VL == 16 && defined(__AVX512BF16__)
    if (k_in % 2 || inter % PAIR_PANEL || rows < 1) return -1;
    const Product job = {.pairs = k_in / 2, .n_out = inter, .silu = 1, .x = x, .bias = bias, .wp = wp, .out = out};
    run_product(&job, rows, threads);
    return 0;
#else
    (void)rows, (void)inter, (void)k_in, (void)x, (void)wp, (void)bias, (void)out, (void)threads;
    return -1;
#endif
}
