/* Products of a few rows (decode steps, questions).
 *
 * float32: out = x . w^T (+ bias) for x [rows, K], rows <= SMALL_LINEAR_MAX_ROWS, with the
 * weight stored transposed, wt = w^T [K, N] row-major (kernels/cpu_linear.py lays float32 CPU
 * weights out so; MKL's products over that layout are as fast for prefill chunks). Outer
 * products: a tile of up to TILE_ROWS x rows and PANEL outputs keeps its sums in registers;
 * at each k it reads PANEL contiguous weights and broadcasts one x value per row. A thread
 * takes a run of PANEL-wide column panels; where more than one row tile passes over a panel,
 * the first pass copies it into a contiguous buffer that the others read (the panel's rows
 * lie N floats apart, which for N a multiple of 1,024 is the same few L1 sets: read in place
 * by every pass, 32 rows ran at 0.6x the packed rate). The first pass fetches the weight rows
 * PREFETCH_ROWS ahead: it streams them from memory.
 *
 * Up to STREAM_MAX_ROWS rows the product is bound by reading the weights once: a thread
 * walks its columns SPAN at a time, STREAM_K weight rows of SPAN contiguous floats per step,
 * with the sums in an L1 buffer. One row of SmolLM2's 30 layers took 0.9-1.1x MKL's time
 * (F.linear over the same layout), where panels of 48 took 1.3x and one weight row per step
 * 1.2-1.6x.
 *
 * Every output is one sum in one order, whatever the row count: a fused multiply-add per k
 * from k = 0, then the bias (scalar fmaf at the edge of a span rounds as a vector lane). So
 * a row's result does not depend on the other rows of the batch; it differs from MKL's only
 * in the last bits (another order of float32 additions).
 * Against the dot-product tiles this replaced (the weight as stored, lanes over K, summed
 * across at the end), SmolLM2's 30 layers with their weights streamed from memory ran in
 * 0.6-0.9x the time at 32 rows and 0.65-0.75x at 64 on 2 AVX-512 cores (a Xeon without AMX),
 * and a float32 decode step of 32 sequences in 0.75x (median 111-116 against 147-158 ms).
 *
 * bf16 rows (AVX-512 BF16 builds): one or two rows stream the weights once with vdpbf16ps
 * (pairs along K, float32 sums, one rounding to bf16 at the end, as oneDNN's bf16 inner
 * product does); oneDNN's packed product takes 1.4-1.7x as long for one or two rows of
 * SmolLM2's projections and LM head on 2 AMX cores. Weights with a paired copy (CPUs without
 * AMX) take cpu_pairs_linear.c instead, which reads them faster.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define PANEL_VECTORS 3
#define PANEL (PANEL_VECTORS * VL) /* outputs per tile */
#if VL == 16
#define TILE_ROWS 8 /* 24 sums + 3 weight vectors + a broadcast in 32 registers */
#else
#define TILE_ROWS 4 /* 12 sums + 3 + 1 in 16 */
#endif
#define PREFETCH_ROWS 16
#define STREAM_MAX_ROWS 4
#define SPAN 512 /* columns per streamed pass: STREAM_MAX_ROWS x 2 KiB of sums in L1 */
#if VL == 16
#define STREAM_K 16 /* weight rows per streamed step (their x values stay in registers) */
#else
#define STREAM_K 8
#endif

/* One tile: rows [0, R) of x (ldx apart) times the panel b (rows ldb apart, PANEL wide) over
 * k in [0, K); the sums (+ bias) go to out (ldo apart). With `pack`, b's rows are copied
 * there (PANEL apart); with `fetch`, the rows PREFETCH_ROWS ahead are prefetched. */
static inline __attribute__((always_inline)) void tile(const int R, int64_t K, const float *x, int64_t ldx,
                                                       const float *b, int64_t ldb, const float *bias, float *out,
                                                       int64_t ldo, float *pack, int fetch) {
    vf acc[TILE_ROWS][PANEL_VECTORS];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < PANEL_VECTORS; v++) acc[i][v] = splat(0.0f);
    for (int64_t k = 0; k < K; k++) {
        const float *row = b + k * ldb;
        if (fetch && k + PREFETCH_ROWS < K)
            for (int v = 0; v < PANEL_VECTORS; v++) __builtin_prefetch(row + PREFETCH_ROWS * ldb + v * VL, 0, 3);
        vf w[PANEL_VECTORS];
        for (int v = 0; v < PANEL_VECTORS; v++) w[v] = loadu(row + v * VL);
        if (pack != NULL)
            for (int v = 0; v < PANEL_VECTORS; v++) storeu(pack + k * PANEL + v * VL, w[v]);
        for (int i = 0; i < R; i++) {
            vf a = splat(x[i * ldx + k]);
            for (int v = 0; v < PANEL_VECTORS; v++) acc[i][v] = vfma(a, w[v], acc[i][v]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int v = 0; v < PANEL_VECTORS; v++)
            storeu(out + i * ldo + v * VL, bias != NULL ? acc[i][v] + loadu(bias + v * VL) : acc[i][v]);
}

/* tile() with the row count a constant, so that its loops unroll. */
static void tile_of(int rows, int64_t K, const float *x, int64_t ldx, const float *b, int64_t ldb,
                    const float *bias, float *out, int64_t ldo, float *pack, int fetch) {
    switch (rows) {
#define TILE_CASE(R) \
    case R: tile(R, K, x, ldx, b, ldb, bias, out, ldo, pack, fetch); break;
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if TILE_ROWS == 8
        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
#endif
#undef TILE_CASE
    }
}

/* The panel of outputs [n0, n0 + nb) for every row. `pack` holds K * PANEL floats, `edge`
 * TILE_ROWS * PANEL plus PANEL. A full panel is read in place by the first row tile (and
 * copied when more follow); a partial one (nb < PANEL, the last) is copied with zeros past
 * nb first, and its sums go through `edge`. */
static void panel(int64_t rows, int64_t n_out, int64_t K, const float *x, const float *wt, const float *bias,
                  float *out, int64_t n0, int nb, float *pack, float *edge) {
    const int full = nb == PANEL;
    const float *bias_panel = bias != NULL ? bias + n0 : NULL;
    if (!full) {
        for (int64_t k = 0; k < K; k++) {
            memcpy(pack + k * PANEL, wt + k * n_out + n0, sizeof(float) * (size_t)nb);
            memset(pack + k * PANEL + nb, 0, sizeof(float) * (size_t)(PANEL - nb));
        }
        if (bias_panel != NULL) {
            float *padded = edge + TILE_ROWS * PANEL;
            memcpy(padded, bias_panel, sizeof(float) * (size_t)nb);
            memset(padded + nb, 0, sizeof(float) * (size_t)(PANEL - nb));
            bias_panel = padded;
        }
    }
    for (int64_t m0 = 0; m0 < rows; m0 += TILE_ROWS) {
        const int tm = rows - m0 < TILE_ROWS ? (int)(rows - m0) : TILE_ROWS;
        const float *xt = x + m0 * K;
        if (!full) {
            tile_of(tm, K, xt, K, pack, PANEL, bias_panel, edge, PANEL, NULL, 0);
            for (int i = 0; i < tm; i++)
                memcpy(out + (m0 + i) * n_out + n0, edge + i * PANEL, sizeof(float) * (size_t)nb);
        } else if (m0 == 0) {
            tile_of(tm, K, xt, K, wt + n0, n_out, bias_panel, out + n0, n_out, rows > TILE_ROWS ? pack : NULL, 1);
        } else {
            tile_of(tm, K, xt, K, pack, PANEL, bias_panel, out + m0 * n_out + n0, n_out, NULL, 0);
        }
    }
}

/* Columns [n0, n0 + nb) for rows <= STREAM_MAX_ROWS, reading each weight row's nb floats in
 * one pass over k; acc holds STREAM_MAX_ROWS x SPAN sums. */
static void stream_span(int64_t rows, int64_t n_out, int64_t K, const float *x, const float *wt, const float *bias,
                        float *out, int64_t n0, int nb, float *acc) {
    const int whole = nb / VL * VL;
    memset(acc, 0, sizeof(float) * (size_t)(rows * SPAN));
    int64_t k = 0;
    /* NOTE: STREAM_K weight rows per pass, each sum still taking them in order of k: more
     * rows in flight from memory, and a quarter of the sums' trips through L1. */
    for (; k + STREAM_K <= K; k += STREAM_K) {
        const float *row = wt + k * n_out + n0;
        for (int64_t m = 0; m < rows; m++) {
            vf a[STREAM_K];
            for (int i = 0; i < STREAM_K; i++) a[i] = splat(x[m * K + k + i]);
            float *sums = acc + m * SPAN;
            for (int c = 0; c < whole; c += VL) {
                vf sum = loadu(sums + c);
                for (int i = 0; i < STREAM_K; i++) sum = vfma(a[i], loadu(row + i * n_out + c), sum);
                storeu(sums + c, sum);
            }
            for (int c = whole; c < nb; c++)
                for (int i = 0; i < STREAM_K; i++) sums[c] = fmaf(x[m * K + k + i], row[i * n_out + c], sums[c]);
        }
    }
    for (; k < K; k++) {
        const float *row = wt + k * n_out + n0;
        for (int64_t m = 0; m < rows; m++) {
            const float xm = x[m * K + k];
            const vf a = splat(xm);
            float *sums = acc + m * SPAN;
            for (int c = 0; c < whole; c += VL) storeu(sums + c, vfma(a, loadu(row + c), loadu(sums + c)));
            for (int c = whole; c < nb; c++) sums[c] = fmaf(xm, row[c], sums[c]);
        }
    }
    for (int64_t m = 0; m < rows; m++)
        for (int c = 0; c < nb; c++) out[m * n_out + n0 + c] = acc[m * SPAN + c] + (bias != NULL ? bias[n0 + c] : 0.0f);
}

/* float32 out = x . wt (+ bias) for 1 to SMALL_LINEAR_MAX_ROWS rows, wt = w^T [k_in, n_out].
 * 0 on success; -1 for a row count out of range; -2 out of memory. */
int ragserve_small_linear(int64_t rows, int64_t n_out, int64_t k_in, const float *x, const float *wt,
                          const float *bias, float *out, int threads) {
    if (rows < 1 || rows > SMALL_LINEAR_MAX_ROWS) return -1;
    const int stream = rows <= STREAM_MAX_ROWS;
    const int64_t panels = (n_out + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const size_t floats = stream ? STREAM_MAX_ROWS * SPAN : k_in * PANEL + (TILE_ROWS + 1) * PANEL;
        float *pack = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (pack == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            /* NOTE: a run of adjacent panels per thread, so its reads of each weight row are
             * one contiguous span. */
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t first = panels * me / team, last = panels * (me + 1) / team;
            const int64_t end = last * PANEL < n_out ? last * PANEL : n_out;
            if (stream)
                for (int64_t n0 = first * PANEL; n0 < end; n0 += SPAN) {
                    const int nb = end - n0 < SPAN ? (int)(end - n0) : SPAN;
                    stream_span(rows, n_out, k_in, x, wt, bias, out, n0, nb, pack);
                }
            else
                for (int64_t p = first; p < last; p++) {
                    const int64_t n0 = p * PANEL;
                    const int nb = n_out - n0 < PANEL ? (int)(n_out - n0) : PANEL;
                    panel(rows, n_out, k_in, x, wt, bias, out, n0, nb, pack, pack + k_in * PANEL);
                }
        }
        free(pack);
    }
    return failed ? -2 : 0;
}

#if VL == 16 && defined(__AVX512BF16__)
#define BF16_STREAM_NB 8 /* weight rows per step: 8 accumulators per x row */

static void stream_rows_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint16_t *w,
                             const uint16_t *bias, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < n_out; n0 += BF16_STREAM_NB) {
        const int nb = n_out - n0 < BF16_STREAM_NB ? (int)(n_out - n0) : BF16_STREAM_NB;
        __m512 acc[BF16_SMALL_LINEAR_MAX_ROWS][BF16_STREAM_NB];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < BF16_STREAM_NB; j++) acc[m][j] = _mm512_setzero_ps();
        const int next = n_out - n0 - nb < BF16_STREAM_NB ? (int)(n_out - n0 - nb) : BF16_STREAM_NB;
        for (int64_t k = 0; k < k_in; k += 32) {
            /* NOTE: the next weight rows are fetched a step ahead: the streamer alone kept 15-16
             * GB/s of weights coming from memory on 2 cores, this 19-22. */
            for (int j = 0; j < next; j++) __builtin_prefetch(w + (n0 + nb + j) * k_in + k, 0, 3);
            __m512bh wv[BF16_STREAM_NB];
            for (int j = 0; j < nb; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n0 + j) * k_in + k);
            for (int m = 0; m < rows; m++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k_in + k);
                for (int j = 0; j < nb; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < nb; j++) {
                float sum = _mm512_reduce_add_ps(acc[m][j]) + (bias != NULL ? bf16_to_f32(bias[n0 + j]) : 0.0f);
                out[m * n_out + n0 + j] = f32_to_bf16(sum);
            }
    }
}
#endif

/* bf16 out = x . w^T (+ bias) for 1 to BF16_SMALL_LINEAR_MAX_ROWS rows; -1 where the build has
 * no AVX-512 BF16 or k_in is not a multiple of 32. */
int ragserve_small_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint16_t *w,
                               const uint16_t *bias, uint16_t *out, int threads) {
#if VL == 16 && defined(__AVX512BF16__)
    if (k_in % 32 || rows < 1 || rows > BF16_SMALL_LINEAR_MAX_ROWS) return -1;
    stream_rows_bf16(rows, n_out, k_in, x, w, bias, out, threads);
    return 0;
#else
    (void)rows, (void)n_out, (void)k_in, (void)x, (void)w, (void)bias, (void)out, (void)threads;
    return -1;
#endif
}
