/* AMX tile products for cpu_attention.c's bf16 tiles (the primitives are in cpu_amx.h).
 *
 * Both products of a tile are laid out so that nothing is transposed on the way out:
 *  - S^T = K . Q^T: A holds 16 keys' rows (bf16, contiguous in kb [keys][D]), B holds Q^T
 *    as pairs along head_dim (qp [D / 2][32] per row block of 32 rows), C is S^T
 *    [keys][32]: rows stay the vector dimension for the softmax pass.
 *  - O^T += V^T . P^T: A holds V^T (vt [D][vs]), B the probabilities as bf16 pairs along
 *    keys (pp [keys / 2][32]), C is O^T [D][32], so the online-softmax rescale of a row
 *    is a vector multiply along rows.
 * 2 x 2 blocks of C share each loaded A and B tile. Sums stay float32, as in the vdpbf16ps
 * path; only the order of additions differs.
 */
#ifndef RAGSERVE_CPU_AMX_ATTENTION_H
#define RAGSERVE_CPU_AMX_ATTENTION_H

#include "cpu_amx.h"
#include "cpu_bf16_dot.h"

#if HAVE_AMX
/* Query rows of a prefill tile's row block: the rows of every C tile pair (2 x 16). */
#define AMX_BLOCK_ROWS 32

/* V^T of 32 keys, n of them real (rows in vrow), into columns [0, 32) of vt [D][stride]
 * bf16, zero past n: each 32 keys x 16 dims is built as 16 key pairs (vectors) and
 * transposed as 32-bit pairs. */
static void amx_pack_vt(const uint16_t *const *vrow, int n, int64_t stride, int D, const uint16_t *zero,
                        uint16_t *vt) {
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            const int j = 2 * i;
            const uint16_t *v0 = j < n ? vrow[j] + d0 : zero, *v1 = j + 1 < n ? vrow[j + 1] + d0 : zero;
            r[i] = (__m512i)interleave_bf16(v0, v1);
        }
        transpose_16x16(r);
        for (int d = 0; d < 16; d++) _mm512_storeu_si512(vt + (int64_t)(d0 + d) * stride, r[d]);
    }
}

/* S^T[j][r] = K[j] . Q[r] (unscaled) for a row block's 32 rows and keys j < keys (a multiple
 * of 32); kb holds the chunk's keys [kpad][D], zero past the chunk; qp is the block's Q^T
 * pairs [D / 2][32], st its S^T [keys][32]. */
static void amx_qk(const uint16_t *kb, const uint32_t *qp, float *st, int keys, int D) {
    for (int j0 = 0; j0 < keys; j0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int d0 = 0; d0 < D; d0 += 32) {
            const uint32_t *q = qp + (int64_t)(d0 / 2) * AMX_BLOCK_ROWS;
            amx_accumulate_2x2(kb + (int64_t)j0 * D + d0, kb + (int64_t)(j0 + 16) * D + d0, (int64_t)D * 2, q, q + 16,
                               AMX_BLOCK_ROWS * 4);
        }
        amx_store_2x2(st + (int64_t)j0 * AMX_BLOCK_ROWS, AMX_BLOCK_ROWS);
    }
}

/* O^T[d][r] += sum over keys j < keys of V[j][d] P[r][j] for a row block's 32 rows, from vt
 * [D][vs] (zero past the chunk) and the block's P pairs pp [keys / 2][32]; ot is the block's
 * O^T [D][32]. */
static void amx_pv(const uint16_t *vt, int64_t vs, const uint32_t *pp, float *ot, int keys, int D) {
    for (int d0 = 0; d0 < D; d0 += 32) {
        float *o = ot + (int64_t)d0 * AMX_BLOCK_ROWS;
        amx_load_2x2(o, AMX_BLOCK_ROWS);
        for (int j0 = 0; j0 < keys; j0 += 32) {
            const uint32_t *p = pp + (int64_t)(j0 / 2) * AMX_BLOCK_ROWS;
            amx_accumulate_2x2(vt + (int64_t)d0 * vs + j0, vt + (int64_t)(d0 + 16) * vs + j0, vs * 2, p, p + 16,
                               AMX_BLOCK_ROWS * 4);
        }
        amx_store_2x2(o, AMX_BLOCK_ROWS);
    }
}

#endif

#endif
