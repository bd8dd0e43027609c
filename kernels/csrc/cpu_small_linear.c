/* float32 products of a few rows: out = x . w^T (+ bias) for x [rows, K] with
 * rows <= SMALL_LINEAR_MAX_ROWS and w [N, K] row-major, as nn.Linear stores it.
 *
 * A decode step multiplies each running sequence's token by every weight. MKL's sgemm and
 * sgemv behind F.linear are tuned for large products: on 2 AVX2 cores they reach 13-30
 * GFLOP/s at 5 to 16 rows and 60-78 at 32, against 129 for large ones. Here:
 * - up to STREAM_MAX_ROWS rows the step is bound by reading the weights once: STREAM_NB
 *   weight rows at a time stay in L1 while every x row passes over them (~20 GB/s, against
 *   MKL's 10-12);
 * - more rows are computed in TILE_M x TILE_N tiles of dot products: TILE_M * TILE_N vector
 *   accumulators stay in registers, each weight tile is read from memory once and x comes
 *   from L2 (about 1.3x MKL's rate at 32 rows, 2.5x at 8).
 *
 * Every output is the same sum in the same order, whatever the row count: lanes accumulate
 * over K in vector steps (an explicit fused multiply-add each), then the lanes are added in order.
 * So a row's result does not depend on the other rows of the batch, and differs from MKL's
 * only in the last bits (a different order of float32 additions, ~1e-7 relative).
 *
 * bf16 rows (AVX-512 BF16 builds): one or two rows stream the weights once with vdpbf16ps
 * (pairs along K, float32 sums, one rounding to bf16 at the end, as oneDNN's bf16 inner
 * product does); oneDNN's packed product takes 1.4-1.7x as long for one or two rows of
 * SmolLM2's projections and LM head on 2 AMX cores.
 */
#include <stdint.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define STREAM_MAX_ROWS 4
#define STREAM_NB 8 /* weight rows per step: 8 x 576 floats stay in L1 for every x row */
#define TILE_M 2    /* x rows per tile */
#define TILE_N 6    /* weight rows per tile: 12 accumulators + x in 16 AVX2 registers */

static inline float finish(vf acc, const float *bias, int64_t n) {
    return hsum(acc) + (bias != NULL ? bias[n] : 0.0f);
}

static void stream_rows(int64_t rows, int64_t n_out, int64_t k_in, const float *x,
                        const float *w, const float *bias, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < n_out; n0 += STREAM_NB) {
        const int nb = n_out - n0 < STREAM_NB ? (int)(n_out - n0) : STREAM_NB;
        for (int64_t m = 0; m < rows; m++) {
            vf acc[STREAM_NB];
            for (int j = 0; j < STREAM_NB; j++) acc[j] = splat(0.0f);
            const float *xm = x + m * k_in;
            for (int64_t k = 0; k < k_in; k += VL) {
                vf xv = loadu(xm + k);
                for (int j = 0; j < nb; j++)
                    acc[j] = vfma(xv, loadu(w + (n0 + j) * k_in + k), acc[j]);
            }
            for (int j = 0; j < nb; j++) out[m * n_out + n0 + j] = finish(acc[j], bias, n0 + j);
        }
    }
}

/* One full TILE_M x TILE_N tile: x and w point at its first row; out at its first output. */
static inline void full_tile(int64_t n_out, int64_t k_in, const float *x, const float *w,
                             const float *bias, int64_t n0, float *out) {
    vf acc[TILE_M][TILE_N];
    for (int i = 0; i < TILE_M; i++)
        for (int j = 0; j < TILE_N; j++) acc[i][j] = splat(0.0f);
    for (int64_t k = 0; k < k_in; k += VL)
        for (int i = 0; i < TILE_M; i++) {
            vf xv = loadu(x + i * k_in + k);
            for (int j = 0; j < TILE_N; j++)
                acc[i][j] = vfma(xv, loadu(w + j * k_in + k), acc[i][j]);
        }
    for (int i = 0; i < TILE_M; i++)
        for (int j = 0; j < TILE_N; j++) out[i * n_out + j] = finish(acc[i][j], bias, n0 + j);
}

/* A tile at the edge (fewer rows or weight rows): one output at a time, same order. */
static void edge_tile(int64_t n_out, int64_t k_in, const float *x, const float *w,
                      const float *bias, int64_t n0, float *out, int tm, int tn) {
    for (int i = 0; i < tm; i++)
        for (int j = 0; j < tn; j++) {
            vf acc = splat(0.0f);
            for (int64_t k = 0; k < k_in; k += VL)
                acc = vfma(loadu(x + i * k_in + k), loadu(w + j * k_in + k), acc);
            out[i * n_out + j] = finish(acc, bias, n0 + j);
        }
}

static void tiled_rows(int64_t rows, int64_t n_out, int64_t k_in, const float *x, const float *w,
                       const float *bias, float *out, int threads) {
    const int64_t tiles = (n_out + TILE_N - 1) / TILE_N;
    /* NOTE: threads split the weight rows, so each weight is read from memory once. */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE_N;
        const int tn = n_out - n0 < TILE_N ? (int)(n_out - n0) : TILE_N;
        for (int64_t m0 = 0; m0 < rows; m0 += TILE_M) {
            const int tm = rows - m0 < TILE_M ? (int)(rows - m0) : TILE_M;
            const float *xt = x + m0 * k_in, *wt = w + n0 * k_in;
            float *ot = out + m0 * n_out + n0;
            if (tm == TILE_M && tn == TILE_N)
                full_tile(n_out, k_in, xt, wt, bias, n0, ot);
            else
                edge_tile(n_out, k_in, xt, wt, bias, n0, ot, tm, tn);
        }
    }
}

int ragserve_small_linear(int64_t rows, int64_t n_out, int64_t k_in, const float *x,
                          const float *w, const float *bias, float *out, int threads) {
    if (k_in % VL || rows < 1 || rows > SMALL_LINEAR_MAX_ROWS) return -1;
    if (rows <= STREAM_MAX_ROWS)
        stream_rows(rows, n_out, k_in, x, w, bias, out, threads);
    else
        tiled_rows(rows, n_out, k_in, x, w, bias, out, threads);
    return 0;
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
