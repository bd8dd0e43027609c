/* AMX tile primitives (Intel Sapphire Rapids and later) for the bf16 kernels: attention
 * (cpu_amx_attention.h) and linear layers (cpu_amx_linear.c).
 *
 * One TDPBF16PS multiplies a [16 x 32] bf16 tile by a [32 x 16] one (bf16 pairs along the
 * reduced dimension) into 16 x 16 float32 sums: 8,192 multiply-adds per instruction, 256x
 * what one vdpbf16ps does. Tiles are 16 rows of 64 bytes; 2 x 2 blocks of C share each
 * loaded A and B tile.
 *
 * A kernel may use AMX only once the process holds permission for the tile state
 * (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+): amx_usable() asks once and says whether.
 * RAGSERVE_CPU_AMX=0 keeps the bf16 kernels off AMX (for comparisons).
 */
#ifndef RAGSERVE_CPU_AMX_H
#define RAGSERVE_CPU_AMX_H

#include "cpu_vec.h"

#if VL == 16 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
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
static inline int amx_usable(void) {
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

/* Tile t (0-3, a C tile) from / into memory. Tile numbers are encoded in the instruction,
 * hence the switches. */
static inline void amx_tile_load(int t, const void *src, int64_t stride) {
    switch (t) {
    case 0: _tile_loadd(0, src, stride); break;
    case 1: _tile_loadd(1, src, stride); break;
    case 2: _tile_loadd(2, src, stride); break;
    default: _tile_loadd(3, src, stride); break;
    }
}

static inline void amx_tile_store(int t, void *dst, int64_t stride) {
    switch (t) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
    }
}

/* C tile t (0-3) += A tile 4 . the B tile at b, loaded into tile 5, 6 or 7 in turn. */
static inline void amx_accumulate_a4(int t, const void *b, int64_t stride) {
    switch (t) {
    case 0: _tile_loadd(5, b, stride); _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_loadd(6, b, stride); _tile_dpbf16ps(1, 4, 6); break;
    case 2: _tile_loadd(7, b, stride); _tile_dpbf16ps(2, 4, 7); break;
    default: _tile_loadd(5, b, stride); _tile_dpbf16ps(3, 4, 5); break;
    }
}

#else
#define HAVE_AMX 0
static inline int amx_usable(void) { return 0; }
#endif

#endif
