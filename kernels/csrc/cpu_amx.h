/* AMX tile products for cpu_attention.c's bf16 tiles (Intel Sapphire Rapids and later).
 *
 * One TDPBF16PS multiplies a [16 x 32] bf16 tile by a [32 x 16] one into 16 x 16 float32
 * sums: 8,192 multiply-adds per instruction, 256x what one vdpbf16ps does. Both products of
 * a tile are laid out so that nothing is transposed on the way out:
 *  - S^T = K . Q^T: A holds 16 keys' rows (bf16, contiguous in kb [keys][D]), B holds Q^T
 *    as pairs along head_dim (qp [D / 2][rpad], the layout the vdpbf16ps tiles use), C is
 *    S^T [keys][rows]: rows stay the vector dimension for the softmax pass.
 *  - O^T += V^T . P^T: A holds V^T (vt [D][kpad]), B the probabilities as bf16 pairs along
 *    keys (pp [keys / 2][rpad]), C is O^T [D][rpad], so the online-softmax rescale of a row
 *    is a vector multiply along rows.
 * Tiles are 16 rows of 64 bytes; 2 x 2 blocks of C share each loaded A and B tile. Sums
 * stay float32, as in the vdpbf16ps path; only the order of additions differs.
 *
 * The kernel may use AMX only once the process holds permission for the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+): amx_usable() asks once and says whether.
 * RAGSERVE_CPU_AMX=0 keeps bf16 tiles on the vdpbf16ps path (for comparisons).
 */
#ifndef RAGSERVE_CPU_AMX_H
#define RAGSERVE_CPU_AMX_H

#include "cpu_bf16_dot.h"

#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* 1 when this process may use AMX: not turned off by RAGSERVE_CPU_AMX=0, and granted by the
 * kernel, asked the first time (not thread-safe: call it before starting threads). */
static int amx_usable(void) {
    static int state = 0; /* 0: not asked yet, 1: yes, -1: no */
    if (state == 0) {
        const char *env = getenv("RAGSERVE_CPU_AMX");
        int off = env != NULL && strcmp(env, "0") == 0;
        state = !off && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return state > 0;
}

/* Every tile register as 16 rows of 64 bytes (palette 1). The configuration is per thread. */
static inline void amx_configure(void) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* 2^x for the softmax's x <= 0, to ~3e-6 relative (a degree-5 polynomial; the probabilities
 * are rounded to bf16, 4e-3, for P . V), in 9 instructions where vexp2 takes 14. */
static inline __m512 exp2_softmax(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n); /* in [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

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

/* C tiles 0-3 += the 2 x 2 products of the A tiles at a0, a1 (16 rows each) and the B tiles
 * at b0, b1: tile 0 += a0 . b0, 1 += a0 . b1, 2 += a1 . b0, 3 += a1 . b1. */
static inline void amx_accumulate_2x2(const void *a0, const void *a1, int64_t a_stride, const void *b0, const void *b1,
                                      int64_t b_stride) {
    _tile_loadd(4, a0, a_stride);
    _tile_loadd(5, a1, a_stride);
    _tile_loadd(6, b0, b_stride);
    _tile_loadd(7, b1, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* C tiles 0-3 from / into the 32 x 32 float32 block at c of a matrix with rows of `row`
 * floats: tile 0 its top left, 1 top right, 2 bottom left, 3 bottom right. */
static inline void amx_load_2x2(const float *c, int64_t row) {
    _tile_loadd(0, c, row * 4);
    _tile_loadd(1, c + 16, row * 4);
    _tile_loadd(2, c + 16 * row, row * 4);
    _tile_loadd(3, c + 16 * row + 16, row * 4);
}

static inline void amx_store_2x2(float *c, int64_t row) {
    _tile_stored(0, c, row * 4);
    _tile_stored(1, c + 16, row * 4);
    _tile_stored(2, c + 16 * row, row * 4);
    _tile_stored(3, c + 16 * row + 16, row * 4);
}

/* S^T[j][r] = K[j] . Q[r] (unscaled) for the 32 rows [r0, r0 + 32) and keys j < keys (a
 * multiple of 32); kb holds the chunk's keys [kpad][D], zero past the chunk. */
static void amx_qk(const uint16_t *kb, const uint32_t *qp, float *st, int r0, int keys, int rpad, int D) {
    for (int j0 = 0; j0 < keys; j0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int d0 = 0; d0 < D; d0 += 32) {
            const uint32_t *q = qp + (int64_t)(d0 / 2) * rpad + r0;
            amx_accumulate_2x2(kb + (int64_t)j0 * D + d0, kb + (int64_t)(j0 + 16) * D + d0, (int64_t)D * 2, q, q + 16,
                               (int64_t)rpad * 4);
        }
        amx_store_2x2(st + (int64_t)j0 * rpad + r0, rpad);
    }
}

/* O^T[d][r] += sum over keys j < keys of V[j][d] P[r][j] for the 32 rows [r0, r0 + 32), from
 * vt [D][kpad] (zero past the chunk) and pp [kpad / 2][rpad]; ot is [D][rpad]. */
static void amx_pv(const uint16_t *vt, int kpad, const uint32_t *pp, float *ot, int r0, int keys, int rpad,
                   int D) {
    for (int d0 = 0; d0 < D; d0 += 32) {
        float *o = ot + (int64_t)d0 * rpad + r0;
        amx_load_2x2(o, rpad);
        for (int j0 = 0; j0 < keys; j0 += 32) {
            const uint32_t *p = pp + (int64_t)(j0 / 2) * rpad + r0;
            amx_accumulate_2x2(vt + (int64_t)d0 * kpad + j0, vt + (int64_t)(d0 + 16) * kpad + j0, (int64_t)kpad * 2, p,
                               p + 16, (int64_t)rpad * 4);
        }
        amx_store_2x2(o, rpad);
    }
}

#else
#define HAVE_AMX 0
static inline int amx_usable(void) { return 0; }
#endif

#endif
