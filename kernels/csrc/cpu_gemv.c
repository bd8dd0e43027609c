/* float32 matrix-vector products for decode steps of a few sequences: out = x . w^T (+ bias)
 * for x [rows, K] with rows <= GEMV_MAX_ROWS and w [N, K] row-major, as nn.Linear stores it.
 *
 * A decode step of a small batch is bound by reading the weights once. MKL's sgemv behind
 * F.linear reads SmolLM2's out-of-cache weights at 10-12 GB/s on 2 AVX2 cores; streaming
 * GEMV_NB weight rows at a time, each read once for every x row while it sits in L1, reads
 * at about 20 GB/s. Sums run over K in vector lanes, then across lanes, so results differ
 * from MKL's in the last bits (a different order of float32 additions, ~1e-7 relative).
 */
#include <stdint.h>
#include <omp.h>

#include "cpu_vec.h"

#define GEMV_MAX_ROWS 4
#define GEMV_NB 8 /* weight rows per step: 8 x 576 floats stay in L1 for every x row */

int ragserve_gemv(int64_t rows, int64_t n_out, int64_t k_in, const float *x, const float *w,
                  const float *bias, float *out, int threads) {
    if (k_in % VL || rows < 1 || rows > GEMV_MAX_ROWS) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < n_out; n0 += GEMV_NB) {
        const int nb = n_out - n0 < GEMV_NB ? (int)(n_out - n0) : GEMV_NB;
        for (int64_t m = 0; m < rows; m++) {
            vf acc[GEMV_NB];
            for (int j = 0; j < GEMV_NB; j++) acc[j] = splat(0.0f);
            const float *xm = x + m * k_in;
            for (int64_t k = 0; k < k_in; k += VL) {
                vf xv = loadu(xm + k);
                for (int j = 0; j < nb; j++) acc[j] += xv * loadu(w + (n0 + j) * k_in + k);
            }
            for (int j = 0; j < nb; j++)
                out[m * n_out + n0 + j] = hsum(acc[j]) + (bias != NULL ? bias[n0 + j] : 0.0f);
        }
    }
    return 0;
}
