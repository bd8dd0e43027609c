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

/* 2^x for the softmax's x <= 2^LAZY_RESCALE (larger x come only in a pass whose results are
 * dropped), to ~1e-4 relative: a degree-3 polynomial on the fraction, far below the bf16
 * rounding (4e-3) the probabilities get for P . V, and the same approximation in the sum
 * they are divided by. The integer part is rounded by adding 1.5 * 2^23, whose low
 * mantissa bits then hold it, and is shifted into p's exponent: 8 instructions in all,
 * where a degree-5 polynomial with vrndscaleps and vscalefps took 10 (3 of them port-0
 * only). */
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
