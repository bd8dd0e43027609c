/* Paged attention for CPUs, reading K/V where they lie in the block-major cache.
 *
 * One call per layer runs a whole mixed batch: it stores the new tokens' K/V in their
 * slots, then attends every query over its sequence's blocks (causal among the new
 * tokens, full over the cached context) with a flash-style online softmax. Nothing is
 * gathered into a per-sequence copy and no mask is built.
 *
 * Work is split into items (sequence, kv head, query tile, key part) run on the OpenMP
 * threads of the process (libgomp, the same runtime torch uses). A query tile holds the
 * `group` query heads of one kv head for up to QT tokens as one matrix of rows, so K/V
 * are read once per tile and never repeated per query head (GQA without copies). When
 * there are few tiles (decode, short chunks over long contexts) their keys are split into
 * parts whose partial results are merged by their log-sum-exp.
 *
 * Two inner loops:
 *  - tile rows >= VL (prefill): scores S^T[key][row] = K . Q^T with rows as the vector
 *    dimension (Q^T packed once per tile; K rows read in place in float32), then
 *    O[row][dim] += P^T . V with dims as the vector dimension (V rows read in place).
 *    Register-blocked micro-kernels, FMA-bound.
 *  - fewer rows (decode): dot products vectorised over head_dim, a few rows of one kv head
 *    at a time (its query heads) sharing every K/V row they load.
 *
 * Arithmetic is float32 throughout; bfloat16 K/V/Q are widened on load and the output is
 * rounded to nearest even. Scores are kept in base 2 (scale * log2(e) folded into Q).
 * Where the CPU has AVX-512 BF16, bf16 tiles instead multiply bf16 pairs with float32 sums
 * (cpu_bf16_dot.h): K/V are read in place, probabilities (taken by a cheaper degree-3
 * exp2, exp2_softmax) are rounded to bf16 for P . V.
 * Where it also has AMX and the OS grants it, bf16 runs both products on AMX tiles
 * (cpu_amx_attention.h): tiles 32 query rows at a time (run_tile_amx), decodes up to 16 rows
 * per kv head (run_small_amx).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if VL == 16
#define RBK 12 /* keys per QK micro-tile */
#define RBR 12 /* query rows per PV micro-tile */
#else
#define RBK 6
#define RBR 6
#endif
#define NV 2             /* vectors per micro-tile row */
#define KC 96            /* keys per online-softmax chunk */
#define TILE_ROWS 256   /* most query rows per tile (fewer when tiles would be too few) */
#define MIN_TILE_ROWS 32
#define MIN_PART_KEYS 256
#define LOG2E 1.4426950408889634f /* scores are kept in base 2 */

#include "cpu_bf16_dot.h"
#include "cpu_amx_attention.h"

typedef struct {
    const void *q;
    int64_t q_token_stride; /* elements; heads are head_dim apart */
    const char *kv;         /* this layer's K plane of block 0 */
    void *out;              /* [tokens, heads, head_dim], contiguous */
} Operands;

typedef struct { /* the step's new tokens' K/V, stored into the cache before attention */
    const void *key, *value;
    int64_t key_stride, value_stride; /* elements between tokens */
    const int64_t *slots;             /* [tokens] */
} NewKV;

typedef struct {
    int32_t seq, t0, t1;          /* query tokens [t0, t1) of the sequence */
    int32_t kv_head, kv_heads;    /* kv heads [kv_head, kv_head + kv_heads) */
    int32_t k0, k1;               /* keys [k0, k1) */
    int64_t scratch;              /* floats into the partials buffer; -1: write output */
    float cost;
} Item;

typedef struct {
    int32_t first, parts; /* items of one (sequence, kv heads, tile) */
} Group;

typedef struct { /* per-thread buffers */
    float *qt;        /* tile: Q^T [D][rpad]; small: Q [rows][D] */
    float *st;        /* tile: S^T [KC + RBK][rpad]; small: S [rows][KC] */
    float *o;         /* [rows][D] */
    float *kf, *vf_;  /* [KC][D] widened bf16 K/V rows */
    uint32_t *qp, *pp, *vp; /* bf16 dot: Q, P, V packed in pairs (see cpu_bf16_dot.h) */
    const uint16_t **khrow, **vhrow; /* bf16 dot: K/V rows in place */
    uint32_t *qh;     /* small AMX: per kv head Q^T pairs [D / 2][16] */
    float *oh;        /* small AMX: per kv head O [16][D] */
    float *ct;        /* small AMX: one C tile, S^T [16 keys][16 rows] */
    uint16_t *pb, *kb; /* small AMX: P [16][KC] bf16; 16 K rows [16][D] gathered from small blocks */
    float *m, *l, *alpha;
    int32_t *lim;
    const float **krow, **vrow;
} Work;

static const float ZERO_ROW[512] __attribute__((aligned(64)));

static inline size_t elem_size(const AttnParams *p) { return p->is_bf16 ? 2 : 4; }

/* Address of key `a` of a sequence (its K row for one kv head); V is kv_offset further. */
static inline const char *key_addr(const AttnParams *p, const Operands *ops, const int32_t *table,
                                   int64_t a, int kv_head) {
    const int64_t off = a & (p->block_size - 1); /* block sizes are powers of two */
    const int64_t row = table[a / p->block_size] * p->block_stride +
                        off * p->num_kv_heads * p->head_dim + (int64_t)kv_head * p->head_dim;
    return ops->kv + row * (int64_t)elem_size(p);
}

/* Ask for `bytes` of K rows from k, and as many of V rows kv_offset further, into L2.
 *
 * NOTE: into L2, not L1: a chunk's K/V (72 KB for a decode of SmolLM2's three kv heads)
 * prefetched into L1 evicted the chunk being multiplied. With the L2 hint, prefetching a
 * decode's next chunk while this one is multiplied (run_small) took decodes of 32 sequences
 * over 300 tokens, every layer of a 30-layer cache, to 0.89x the time bf16 and 0.95x
 * float32 (two builds alternated in one process); into L1 it had gained nothing. */
static inline void prefetch_rows(const char *k, int64_t bytes, int64_t v_off) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b, 0, 1);
        __builtin_prefetch(k + v_off + b, 0, 1);
    }
}

/* Point krow/vrow at the chunk's keys [kc, kc + n), widening bf16 rows into kf/vf_ (with
 * `dot`, khrow/vhrow at the bf16 rows in place instead), and prefetch the keys
 * [kc + n, next_end) of the next chunk.
 *
 * NOTE: rows of one kv head are scattered (a block's rows are num_kv_heads * head_dim apart,
 * blocks anywhere), so without prefetching the tile loops stall on every block's first
 * rows: a 20-token question over 4k fp32 keys ran at 0.9 GB/s of K/V, 2.3x slower. */
static void chunk_rows(const AttnParams *p, const Operands *ops, const int32_t *table, int kv_head,
                       int64_t kc, int n, int64_t next_end, int dot, Work *w) {
    const int D = p->head_dim, bs = p->block_size;
    const int64_t es = (int64_t)elem_size(p), token_stride = (int64_t)p->num_kv_heads * D * es;
    const int64_t v_off = p->kv_offset * es, row_bytes = D * es;
    int j = 0;
    while (j < n) {
        const char *k = key_addr(p, ops, table, kc + j, kv_head);
        int64_t left_in_block = bs - ((kc + j) & (bs - 1));
        int run = (int)(left_in_block < n - j ? left_in_block : n - j);
        for (int i = 0; i < run; i++, j++, k += token_stride) {
            if (dot) {
                w->khrow[j] = (const uint16_t *)k;
                w->vhrow[j] = (const uint16_t *)(k + v_off);
            } else if (p->is_bf16) {
                const uint16_t *kh = (const uint16_t *)k, *vh_ = (const uint16_t *)(k + v_off);
                for (int d = 0; d < D; d += VL) {
                    storeu(w->kf + (int64_t)j * D + d, load_bf16(kh + d));
                    storeu(w->vf_ + (int64_t)j * D + d, load_bf16(vh_ + d));
                }
                w->krow[j] = w->kf + (int64_t)j * D;
                w->vrow[j] = w->vf_ + (int64_t)j * D;
            } else {
                w->krow[j] = (const float *)k;
                w->vrow[j] = (const float *)(k + v_off);
            }
        }
    }
    for (int64_t a = kc + n; a < next_end;) {
        const char *k = key_addr(p, ops, table, a, kv_head);
        int64_t left_in_block = bs - (a & (bs - 1));
        int64_t run = left_in_block < next_end - a ? left_in_block : next_end - a;
        for (int64_t i = 0; i < run; i++, a++, k += token_stride) prefetch_rows(k, row_bytes, v_off);
    }
}

#if HAVE_BF16_DOT
/* The chunk's V rows (vhrow, n of them) as pairs vp [key / 2][dim] (rows 2i and 2i + 1
 * interleaved, a zero row after an odd last one), for the tile and AMX products. */
static void pack_value_pairs(Work *w, int n, int D) {
    for (int i = 0; 2 * i < n; i++) {
        const uint16_t *v0 = w->vhrow[2 * i];
        const uint16_t *v1 = 2 * i + 1 < n ? w->vhrow[2 * i + 1] : (const uint16_t *)ZERO_ROW;
        for (int d = 0; d < D; d += VL) *(vpair *)(w->vp + (int64_t)i * D + d) = interleave_bf16(v0 + d, v1 + d);
    }
}
#endif

/* Read keys [a, end) of every kv head (K and V) once, in address order: each block's rows of
 * those keys are two contiguous spans, which the hardware prefetchers stream.
 *
 * NOTE: a decode item's products then read its chunk from cache. Read head by head (a third
 * of each token's row at a time) the bytes came from memory at 11-12 GB/s on 2 EPYC cores,
 * where whole spans stream at 30; prefetching the next chunk into L1, sequentially or per
 * head, changed nothing (into L2 it pays: see prefetch_rows). Decodes of 32 sequences over
 * 300 tokens, 30 layers' blocks scattered through a 2.9 GB cache: 19.0 -> 17.2 ms bf16,
 * 28.0 -> 24.2 ms float32. With a layer's K/V already in cache the extra pass costs about
 * 10%. Prefetching the next block's spans while reading this one's (a stream that jumps
 * between blocks) took the same decodes from 14.1-15.9 to 13.1-13.7 ms bf16
 * (`kernels.bench_cpu_attention --every-layer`, two interleaved runs on a busy minute). */
static void touch_keys(const AttnParams *p, const Operands *ops, const int32_t *table, int64_t a, int64_t end) {
    const int64_t es = (int64_t)elem_size(p), token_bytes = (int64_t)p->num_kv_heads * p->head_dim * es;
    const int64_t v_off = p->kv_offset * es;
    vi seen = {0};
    while (a < end) {
        const char *k = key_addr(p, ops, table, a, 0);
        const int64_t left_in_block = p->block_size - (a & (p->block_size - 1));
        const int64_t run = left_in_block < end - a ? left_in_block : end - a;
        const char *next = a + run < end ? key_addr(p, ops, table, a + run, 0) : NULL;
        for (int64_t b = 0; b < run * token_bytes; b += 64) {
            if (next != NULL) prefetch_rows(next + b, 64, v_off); /* the chunk's last run has none after it */
            seen |= *(const viu *)(k + b) | *(const viu *)(k + v_off + b);
        }
        a += run;
    }
    /* The loads must happen; in a register where there is one wide enough (in memory, a store
     * per line). */
#if defined(__AVX__)
    __asm__ volatile("" : : "v"(seen));
#else
    __asm__ volatile("" : : "m"(seen));
#endif
}

/* Prefetch share `part` of `parts` of keys [a, end) of every kv head (K and V) into L2. */
static void prefetch_keys_share(const AttnParams *p, const Operands *ops, const int32_t *table, int64_t a,
                                int64_t end, int part, int parts) {
    const int64_t token_bytes = (int64_t)p->num_kv_heads * p->head_dim * (int64_t)elem_size(p);
    const int64_t v_off = p->kv_offset * (int64_t)elem_size(p);
    const int64_t stop = a + (end - a) * (part + 1) / parts;
    for (a += (end - a) * part / parts; a < stop;) {
        const int64_t left_in_block = p->block_size - (a & (p->block_size - 1));
        const int64_t run = left_in_block < stop - a ? left_in_block : stop - a;
        prefetch_rows(key_addr(p, ops, table, a, 0), run * token_bytes, v_off);
        a += run;
    }
}

/* Query row r of the tile: token t0 + r / group, head kv_head * group + r % group. */
static inline float query_value(const AttnParams *p, const Operands *ops, int64_t token, int head,
                                int d) {
    int64_t index = token * ops->q_token_stride + (int64_t)head * p->head_dim + d;
    return p->is_bf16 ? bf16_to_f32(((const uint16_t *)ops->q)[index]) : ((const float *)ops->q)[index];
}

/* Online-softmax update of one row block: scores -> probabilities in place, m/l/alpha updated. */
static inline void softmax_update(vf *mx, vf *m, vf *l, vf *alpha_out) {
    vf m_new = vmax(*m, *mx);
    vi finite = m_new > -INFINITY;
    vf ref = vselect(finite, m_new, splat(0.0f));
    *alpha_out = vexp2(*m - ref);
    *l = *l * *alpha_out;
    *m = m_new;
    *mx = ref;
}

/* ---- tile mode -------------------------------------------------------------------------- */

/* S^T[j][r] = K[j] . Q^T[:, r] for keys j < keys[r / (NV * VL)] of each row block (the rest of
 * the chunk is masked for every row of the block; the softmax pass overwrites it). */
static void qk_tile(const float *const *krow, const float *qt, float *st, const int *keys, int rpad, int D) {
    /* Rows outer: a tile's Q^T slice [D][NV * VL] stays in L1 while the chunk's keys pass. */
    for (int r0 = 0; r0 < rpad; r0 += NV * VL) {
        const int npad = keys[r0 / (NV * VL)];
        for (int j0 = 0; j0 < npad; j0 += RBK) {
            vf acc[RBK][NV];
            const float *k[RBK];
            for (int jj = 0; jj < RBK; jj++) {
                k[jj] = krow[j0 + jj];
                for (int v = 0; v < NV; v++) acc[jj][v] = splat(0.0f);
            }
            for (int d = 0; d < D; d++) {
                vf b[NV];
                for (int v = 0; v < NV; v++) b[v] = loadu(qt + (int64_t)d * rpad + r0 + v * VL);
                for (int jj = 0; jj < RBK; jj++) {
                    vf a = splat(k[jj][d]);
                    for (int v = 0; v < NV; v++) acc[jj][v] += a * b[v];
                }
            }
            for (int jj = 0; jj < RBK; jj++)
                for (int v = 0; v < NV; v++) storeu(st + (int64_t)(j0 + jj) * rpad + r0 + v * VL, acc[jj][v]);
        }
    }
}

#define PV_BLOCK(ROWS)                                                                          \
    static void pv_rows_##ROWS(const float *const *vrow, const float *pt, float *o, int n,       \
                               int rpad, int r0, int D) {                                         \
        for (int d0 = 0; d0 < D; d0 += NV * VL) {                                               \
            vf acc[ROWS][NV];                                                                   \
            for (int rr = 0; rr < ROWS; rr++)                                                   \
                for (int v = 0; v < NV; v++) acc[rr][v] = loadu(o + (int64_t)(r0 + rr) * D + d0 + v * VL); \
            for (int j = 0; j < n; j++) {                                                       \
                vf b[NV];                                                                       \
                for (int v = 0; v < NV; v++) b[v] = loadu(vrow[j] + d0 + v * VL);                \
                const float *pj = pt + (int64_t)j * rpad + r0;                                  \
                for (int rr = 0; rr < ROWS; rr++) {                                             \
                    vf a = splat(pj[rr]);                                                       \
                    for (int v = 0; v < NV; v++) acc[rr][v] += a * b[v];                        \
                }                                                                               \
            }                                                                                   \
            for (int rr = 0; rr < ROWS; rr++)                                                   \
                for (int v = 0; v < NV; v++) storeu(o + (int64_t)(r0 + rr) * D + d0 + v * VL, acc[rr][v]); \
        }                                                                                       \
    }
PV_BLOCK(RBR)
PV_BLOCK(1)

/* Where row r of an item lives: rows come kv head by kv head, each head's `tokens * group`
 * rows token-major (row t * group + g is query head kv_head * group + g of token t0 + t). */
static inline void row_place(const AttnParams *p, const Item *it, int r, int64_t *token, int *head) {
    const int group = p->num_heads / p->num_kv_heads, per_head = (it->t1 - it->t0) * group;
    const int within = r % per_head;
    *token = p->query_start[it->seq] + it->t0 + within / group;
    *head = (it->kv_head + r / per_head) * group + within % group;
}

/* Keys of the chunk [kc, kc + n) that row r may see (its probabilities past them are 0). */
static inline int visible(const Work *w, int64_t kc, int n, int r) {
    int64_t keys = w->lim[r] - kc + 1;
    return keys < 0 ? 0 : (keys > n ? n : (int)keys);
}

/* Element offset in q of a tile's row r (r < the tile's rows). */
static inline int64_t query_offset(const AttnParams *p, const Operands *ops, const Item *it, int r) {
    const int group = p->num_heads / p->num_kv_heads;
    return (p->query_start[it->seq] + it->t0 + r / group) * ops->q_token_stride +
           (int64_t)(it->kv_head * group + r % group) * p->head_dim;
}

/* Each of a tile's rows' last visible key in lim (INT32_MAX for padding up to rpad), and the
 * online softmax's m/l reset. */
static void start_tile_rows(const AttnParams *p, const Item *it, Work *w, int rows, int rpad) {
    const int group = p->num_heads / p->num_kv_heads;
    const int64_t context = p->seq_lens[it->seq] - (p->query_start[it->seq + 1] - p->query_start[it->seq]);
    for (int r = 0; r < rpad; r++) w->lim[r] = r < rows ? (int32_t)(context + it->t0 + r / group) : INT32_MAX;
    for (int r = 0; r < rpad; r += VL) {
        storeu(w->m + r, splat(-INFINITY));
        storeu(w->l + r, splat(0.0f));
    }
}

#if HAVE_BF16_DOT
/* A tile's Q^T as bf16 pairs, zero in the padding rows, in blocks of `block` rows: qp holds
 * each block's [D / 2][block] in turn (block = rpad: the whole tile as [D / 2][rpad]; the AMX
 * tiles take blocks of AMX_BLOCK_ROWS). 16 rows at a time, loaded as rows and transposed in
 * registers (D is a multiple of NV * VL = 32 here, as ragserve_paged_attention requires).
 * NOTE: written a row at a time, each row's 32 pairs went to 32 cache lines a column apart:
 * 11% of a prefill's attention over 16 prompts of 256 tokens. */
static void query_pairs(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows, int rpad,
                        int block) {
    const int pairs = p->head_dim / 2;
    for (int r0 = 0; r0 < rpad; r0 += 16) {
        const uint32_t *src[16];
        for (int i = 0; i < 16; i++)
            src[i] = r0 + i < rows ? (const uint32_t *)((const uint16_t *)ops->q + query_offset(p, ops, it, r0 + i))
                                   : (const uint32_t *)ZERO_ROW;
        uint32_t *dst = w->qp + (int64_t)(r0 / block) * pairs * block + r0 % block;
        for (int c0 = 0; c0 < pairs; c0 += 16) {
            __m512i t[16];
            for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_si512(src[i] + c0);
            transpose_16x16(t);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (int64_t)(c0 + j) * block, t[j]);
        }
    }
}
#endif

/* A tile's queries: Q^T scaled into qt [D][rpad] (float32 products) or as bf16 pairs into
 * qp [D / 2][rpad] (pair products), zero in the padding rows up to rpad; each row's last
 * visible key in lim (INT32_MAX for padding), and m/l reset. */
static void tile_queries(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows, int rpad,
                         int dot) {
#if HAVE_BF16_DOT
    if (dot) {
        query_pairs(p, ops, it, w, rows, rpad, rpad);
        start_tile_rows(p, it, w, rows, rpad);
        return;
    }
#else
    (void)dot;
#endif
    const int D = p->head_dim;
    const float qscale = p->scale * LOG2E;
    for (int r = 0; r < rpad; r++) {
        float *column = w->qt + r;
        if (r >= rows) {
            for (int d = 0; d < D; d++) column[(int64_t)d * rpad] = 0.0f;
            continue;
        }
        const int64_t at = query_offset(p, ops, it, r);
        if (p->is_bf16) {
            const uint16_t *src = (const uint16_t *)ops->q + at;
            for (int d = 0; d < D; d++) column[(int64_t)d * rpad] = qscale * bf16_to_f32(src[d]);
        } else {
            const float *src = (const float *)ops->q + at;
            for (int d = 0; d < D; d++) column[(int64_t)d * rpad] = qscale * src[d];
        }
    }
    start_tile_rows(p, it, w, rows, rpad);
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 1 when bf16 pair products (vdpbf16ps) beat widening K to float32 for FMAs on this CPU:
 * one chunk's Q . K^T both ways on synthetic rows, best of 7 rounds each. Which wins
 * depends on the core: one SmolLM2 layer's 2,048-token prefill took 17 ms with pairs
 * against 30 with FMAs on one AVX-512 BF16 CPU, and 43 against 27 on another (a Xeon
 * without AMX, where vdpbf16ps does no more multiply-adds a cycle than two FMA ports). */
static int pairs_beat_fmas(void) {
#if HAVE_BF16_DOT
    enum { D = 64, ROWS = 2 * NV * VL, KEYS = KC, REPS = 16 };
    static uint16_t kh[KEYS * D] __attribute__((aligned(64)));
    static float kf[KEYS * D] __attribute__((aligned(64)));
    static float qt[D * ROWS] __attribute__((aligned(64)));
    static uint32_t qp[(D / 2) * ROWS] __attribute__((aligned(64)));
    static float st[(KEYS + RBK) * ROWS] __attribute__((aligned(64)));
    const float *krow[KEYS];
    const uint16_t *khrow[KEYS];
    int keys[ROWS / (NV * VL)];
    for (int i = 0; i < KEYS * D; i++) kh[i] = (uint16_t)(0x3c00 + (i & 0xff)); /* ~[0.0078, 0.0156) */
    for (int i = 0; i < D * ROWS; i++) qt[i] = 0.01f * (float)(i & 7);
    for (int i = 0; i < (D / 2) * ROWS; i++) qp[i] = 0x3c003c00u + (uint32_t)(i & 7);
    for (int j = 0; j < KEYS; j++) {
        krow[j] = kf + (int64_t)j * D;
        khrow[j] = kh + (int64_t)j * D;
    }
    for (int b = 0; b < ROWS / (NV * VL); b++) keys[b] = KEYS;
    double fmas = 1e30, pairs = 1e30;
    for (int round = 0; round < 7; round++) {
        double t0 = seconds_now();
        for (int rep = 0; rep < REPS; rep++) {
            for (int i = 0; i < KEYS * D; i += VL) storeu(kf + i, load_bf16(kh + i));
            qk_tile(krow, qt, st, keys, ROWS, D);
        }
        double t1 = seconds_now();
        for (int rep = 0; rep < REPS; rep++) qk_tile_dot(khrow, qp, st, keys, ROWS, D, 1.0f);
        double t2 = seconds_now();
        fmas = t1 - t0 < fmas ? t1 - t0 : fmas;
        pairs = t2 - t1 < pairs ? t2 - t1 : pairs;
    }
    return pairs < fmas;
#else
    return 0;
#endif
}

/* 1 when bf16 prefill tiles multiply bf16 pairs, 0 when they widen K/V to float32 for
 * FMAs: RAGSERVE_CPU_BF16_DOT_TILES=1 or 0, else whichever pairs_beat_fmas() finds faster.
 * Decodes, bound by reading K/V, keep the pairs. Decided once, before threads start. */
static int bf16_dot_tiles(void) {
    static int state = 0; /* 0: not decided yet, 1: pairs, -1: float32 FMAs */
    if (state == 0) {
        const char *env = getenv("RAGSERVE_CPU_BF16_DOT_TILES");
        int on = env != NULL && env[0] != '\0' ? strcmp(env, "0") != 0 : pairs_beat_fmas();
        state = on ? 1 : -1;
    }
    return state > 0;
}

int ragserve_bf16_dot_tiles(void) { return HAVE_BF16_DOT && bf16_dot_tiles(); }

/* A tile's probabilities exp2(s - mx) for its rows [r, r + VL) over the chunk's n keys, in
 * place in st; returns their sums. */
static inline vf probabilities(Work *w, int n, int rpad, int r, vf mx) {
    vf sum = splat(0.0f);
    for (int j = 0; j < n; j++) {
        vf e = vexp2(loadu(w->st + (int64_t)j * rpad + r) - mx);
        storeu(w->st + (int64_t)j * rpad + r, e);
        sum += e;
    }
    return sum;
}

#if HAVE_BF16_DOT
/* The same for pair products: rounded to bf16 straight into pp [key / 2][rpad] as key pairs
 * (a zero after an odd n's last key), by the bf16 paths' cheaper exp2_softmax. */
static inline vf probability_pairs(Work *w, int n, int rpad, int r, vf mx) {
    vf sum0 = splat(0.0f), sum1 = splat(0.0f);
    for (int i = 0; 2 * i < n; i++) {
        const int64_t j = 2 * i;
        const vf e0 = (vf)exp2_softmax((__m512)(loadu(w->st + j * rpad + r) - mx));
        const vf e1 = j + 1 < n ? (vf)exp2_softmax((__m512)(loadu(w->st + (j + 1) * rpad + r) - mx)) : splat(0.0f);
        sum0 += e0;
        sum1 += e1;
        *(vpair *)(w->pp + (int64_t)i * rpad + r) = round_pairs(e0, e1);
    }
    return sum0 + sum1;
}
#endif

static void run_tile(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows,
                     int rpad) {
    const int D = p->head_dim;
    const int64_t context = p->seq_lens[it->seq] - (p->query_start[it->seq + 1] - p->query_start[it->seq]);
    const int32_t *table = p->block_tables + (int64_t)it->seq * p->table_stride;
    const int dot = HAVE_BF16_DOT && p->is_bf16 && bf16_dot_tiles();

    tile_queries(p, ops, it, w, rows, rpad, dot);
    memset(w->o, 0, sizeof(float) * (size_t)rows * D);

    for (int64_t kc = it->k0; kc < it->k1; kc += KC) {
        int n = (int)(it->k1 - kc < KC ? it->k1 - kc : KC);
        int npad = (n + RBK - 1) / RBK * RBK;
        int64_t next_end = kc + n + KC < it->k1 ? kc + n + KC : it->k1;
        chunk_rows(p, ops, table, it->kv_head, kc, n, next_end, dot, w);
#if HAVE_BF16_DOT
        if (dot) pack_value_pairs(w, n, D);
#endif
        for (int j = n; j < npad; j++) {
            w->krow[j] = ZERO_ROW;
            if (dot) w->khrow[j] = (const uint16_t *)ZERO_ROW;
        }
        /* Causal skip: keys past a row block's last position need no product. */
        int block_keys[TILE_ROWS / (NV * VL) + 2];
        for (int r0 = 0; r0 < rpad; r0 += NV * VL) {
            int last = r0 + NV * VL - 1 < rows ? r0 + NV * VL - 1 : rows - 1;
            int64_t needed = w->lim[last] - kc + 1;
            needed = needed < 0 ? 0 : (needed > n ? n : needed);
            block_keys[r0 / (NV * VL)] = (int)((needed + RBK - 1) / RBK * RBK);
        }
#if HAVE_BF16_DOT
        if (dot) qk_tile_dot(w->khrow, w->qp, w->st, block_keys, rpad, D, p->scale * LOG2E);
        else
#endif
            qk_tile(w->krow, w->qt, w->st, block_keys, rpad, D);
        int masked = kc + n - 1 > context + it->t0;
        for (int r = 0; r < rpad; r += VL) {
            vf mx = splat(-INFINITY);
            vi lim = *(const viu *)(w->lim + r);
            for (int j = 0; j < n; j++) {
                vf s = loadu(w->st + (int64_t)j * rpad + r);
                if (masked) {
                    s = vselect((vi){0} + (int32_t)(kc + j) <= lim, s, splat(-INFINITY));
                    storeu(w->st + (int64_t)j * rpad + r, s);
                }
                mx = vmax(mx, s);
            }
            vf m = loadu(w->m + r), l = loadu(w->l + r), alpha;
            softmax_update(&mx, &m, &l, &alpha);
#if HAVE_BF16_DOT
            const vf sum = dot ? probability_pairs(w, n, rpad, r, mx) : probabilities(w, n, rpad, r, mx);
#else
            const vf sum = probabilities(w, n, rpad, r, mx);
#endif
            storeu(w->m + r, m);
            storeu(w->l + r, l + sum);
            storeu(w->alpha + r, alpha);
        }
        for (int r = 0; r < rows; r++) {
            float a = w->alpha[r];
            if (a != 1.0f)
                for (int d = 0; d < D; d += VL) storeu(w->o + (int64_t)r * D + d, loadu(w->o + (int64_t)r * D + d) * a);
        }
        int r0 = 0;
#if HAVE_BF16_DOT
        if (dot) {
            for (; r0 + RBR <= rows; r0 += RBR)
                pv_dot_rows_RBR(w->vp, w->pp, w->o, (visible(w, kc, n, r0 + RBR - 1) + 1) / 2, rpad, r0, D);
            for (; r0 < rows; r0++) pv_dot_rows_1(w->vp, w->pp, w->o, (visible(w, kc, n, r0) + 1) / 2, rpad, r0, D);
            continue;
        }
#endif
        for (; r0 + RBR <= rows; r0 += RBR) pv_rows_RBR(w->vrow, w->st, w->o, visible(w, kc, n, r0 + RBR - 1), rpad, r0, D);
        for (; r0 < rows; r0++) pv_rows_1(w->vrow, w->st, w->o, visible(w, kc, n, r0), rpad, r0, D);
    }
}

#if HAVE_AMX
/* Score j of the block's 16 rows from column c of S^T, -inf past each row's last visible key
 * when `masked`. */
static inline vf masked_score(const Work *w, int64_t kc, int j, int c, vi lim, int masked) {
    vf s = loadu(w->st + (int64_t)j * AMX_BLOCK_ROWS + c);
    return masked ? vselect((vi){0} + (int32_t)(kc + j) <= lim, s, splat(-INFINITY)) : s;
}

/* exp2(scale * s - ref) of the block's 16 rows from column c over the chunk's first nk keys
 * (masked past each row's position when `masked`), written as bf16 pairs into pp (zero up to
 * kpad keys) and summed into *sum; returns the rows' largest unscaled score. */
static inline vf exp_pass(Work *w, int64_t kc, int nk, int kpad, int c, vi lim, int masked, float scale, vf ref,
                          vf *sum) {
    vf acc[2] = {splat(0.0f), splat(0.0f)}, top = splat(-INFINITY), zero = splat(0.0f);
    for (int j = 0; j < kpad; j += 2) {
        vf e[2];
        for (int h = 0; h < 2; h++) {
            e[h] = zero;
            if (j + h >= nk) continue;
            const vf score = masked_score(w, kc, j + h, c, lim, masked);
            top = vmax(top, score);
            e[h] = (vf)exp2_softmax((__m512)(score * scale - ref));
            if (masked) e[h] = vselect((vi){0} + (int32_t)(kc + j + h) <= lim, e[h], zero);
            acc[h] += e[h];
        }
        *(vpair *)(w->pp + (int64_t)(j / 2) * AMX_BLOCK_ROWS + c) = round_pairs(e[0], e[1]);
    }
    *sum = acc[0] + acc[1];
    return top;
}

/* The online softmax of the row block [r0, r0 + 32) over the chunk's first nk keys (the block's
 * S^T unscaled in st, masked past each row's position when `masked`): m/l/alpha updated, the
 * probabilities written straight into the block's bf16 pairs pp (zero up to kpad keys).
 * Returns whether any row's reference moved, i.e. whether O^T needs rescaling by alpha.
 *
 * NOTE: a row's reference m moves only when the chunk's max passes it by more than
 * LAZY_RESCALE (base 2), so probabilities stay below 2^LAZY_RESCALE, far inside float32's
 * and bf16's range, and O^T is rescaled only in the rare chunks where a reference moves
 * instead of after every chunk (FlashAttention-4's conditional rescaling). Rows that have a
 * reference already take their exponentials against it in one pass over the scores, which
 * finds the max on the way; only if that max moves a reference is the pass run again. */
#define LAZY_RESCALE 8.0f
static int block_softmax_pairs(Work *w, int64_t kc, int nk, int kpad, int r0, int masked, float scale) {
    int moved = 0;
    for (int c = 0; c < AMX_BLOCK_ROWS; c += VL) {
        const int r = r0 + c;
        const vi lim = *(const viu *)(w->lim + r);
        vf m = loadu(w->m + r), l = loadu(w->l + r), sum;
        vf alpha = splat(1.0f), mx = splat(-INFINITY);
        const int seen = _mm512_cmp_ps_mask((__m512)m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ) == 0;
        if (seen) mx = exp_pass(w, kc, nk, kpad, c, lim, masked, scale, m, &sum) * scale;
        const vi moves = mx > m + LAZY_RESCALE; /* false where both are -inf: nothing seen yet */
        if (!seen || _mm512_test_epi32_mask((__m512i)moves, (__m512i)moves) != 0) {
            if (!seen) {
                /* NOTE: four running maxima, so that the loop is not one chain of dependent maxes. */
                vf m0 = splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
                int j = 0;
                for (; j + 4 <= nk; j += 4) {
                    m0 = vmax(m0, masked_score(w, kc, j, c, lim, masked));
                    m1 = vmax(m1, masked_score(w, kc, j + 1, c, lim, masked));
                    m2 = vmax(m2, masked_score(w, kc, j + 2, c, lim, masked));
                    m3 = vmax(m3, masked_score(w, kc, j + 3, c, lim, masked));
                }
                for (; j < nk; j++) m0 = vmax(m0, masked_score(w, kc, j, c, lim, masked));
                mx = vmax(vmax(m0, m1), vmax(m2, m3)) * scale;
            }
            const vi move = mx > m + LAZY_RESCALE;
            const vf m_new = vselect(move, mx, m);
            const vf ref = vselect(m_new > -INFINITY, m_new, splat(0.0f));
            alpha = vselect(move, vexp2(m - ref), splat(1.0f));
            moved |= _mm512_test_epi32_mask((__m512i)move, (__m512i)move) != 0;
            m = m_new;
            exp_pass(w, kc, nk, kpad, c, lim, masked, scale, ref, &sum);
        }
        storeu(w->m + r, m);
        storeu(w->l + r, l * alpha + sum);
        storeu(w->alpha + r, alpha);
    }
    return moved;
}

/* Every key of the sequences whose tiles run on AMX, packed once per call (not once per tile
 * and chunk): per (sequence, kv head) K rows [kpad][D] and V^T [D][vt_stride(kpad)], kpad the
 * keys rounded up to 32, zero past them. Sequences without AMX tiles have offset -1. */
typedef struct {
    uint16_t *k, *vt;
    int64_t *offset; /* [num_seqs]: elements to the sequence's kv head 0 in k */
    int64_t *v_offset; /* [num_seqs]: the same in vt */
    int32_t *kpad;   /* [num_seqs] */
    int64_t jobs;    /* (sequence, kv head, 32 keys) packing jobs */
    int64_t *job_start; /* [num_seqs + 1]: first job of each sequence */
} AmxPack;

/* NOTE: V^T rows are padded by one cache line, so that the 16 rows of an A tile do not all
 * fall into one L1 set (rows 4 KiB apart would: 2,048 keys of V^T thrashed L1 in every tile
 * product). */
static inline int64_t vt_stride(int64_t kpad) { return kpad + 32; }

static inline int amx_tiles(const AttnParams *p, int s) {
    return (p->query_start[s + 1] - p->query_start[s]) * (p->num_heads / p->num_kv_heads) >= VL;
}

/* Lay out and allocate the pack. 0, or -2 when out of memory.
 * NOTE: a buffer per call: glibc raises its mmap threshold to a freed chunk's size, so from
 * the second call on the pack comes from the heap without fresh page faults. */
static int amx_plan_pack(const AttnParams *p, AmxPack *pack) {
    const int64_t D = p->head_dim, heads = p->num_kv_heads;
    pack->offset = malloc(sizeof(int64_t) * (size_t)p->num_seqs);
    pack->v_offset = malloc(sizeof(int64_t) * (size_t)p->num_seqs);
    pack->kpad = malloc(sizeof(int32_t) * (size_t)p->num_seqs);
    pack->job_start = malloc(sizeof(int64_t) * (size_t)(p->num_seqs + 1));
    if (!pack->offset || !pack->v_offset || !pack->kpad || !pack->job_start) return -2;
    int64_t elements = 0, v_elements = 0, jobs = 0;
    for (int s = 0; s < p->num_seqs; s++) {
        pack->job_start[s] = jobs;
        pack->kpad[s] = (p->seq_lens[s] + 31) / 32 * 32;
        pack->offset[s] = amx_tiles(p, s) ? elements : -1;
        pack->v_offset[s] = v_elements;
        if (pack->offset[s] < 0) continue;
        elements += heads * pack->kpad[s] * D;
        v_elements += heads * vt_stride(pack->kpad[s]) * D;
        jobs += heads * (pack->kpad[s] / 32);
    }
    pack->job_start[p->num_seqs] = jobs;
    pack->jobs = jobs;
    pack->k = aligned_alloc(64, ((size_t)(elements + v_elements) * sizeof(uint16_t) + 63) / 64 * 64 + 64);
    if (!pack->k) return -2;
    pack->vt = pack->k + elements;
    return 0;
}

static void amx_free_pack(AmxPack *pack) {
    free(pack->k);
    free(pack->offset);
    free(pack->v_offset);
    free(pack->kpad);
    free(pack->job_start);
}

/* Packing job `job`: 32 keys of one (sequence, kv head). */
static void amx_pack_job(const AttnParams *p, const Operands *ops, const AmxPack *pack, int64_t job) {
    int s = 0, hi = p->num_seqs; /* the sequence whose jobs hold `job`: job_start[s] <= job < job_start[s + 1] */
    while (hi - s > 1) {
        const int mid = (s + hi) / 2;
        if (pack->job_start[mid] <= job) s = mid;
        else hi = mid;
    }
    const int D = p->head_dim;
    const int64_t per_head = pack->kpad[s] / 32, within = job - pack->job_start[s];
    const int h = (int)(within / per_head);
    const int64_t j0 = (within % per_head) * 32, kpad = pack->kpad[s];
    const int n = (int)(p->seq_lens[s] - j0 < 32 ? p->seq_lens[s] - j0 : 32);
    const int32_t *table = p->block_tables + (int64_t)s * p->table_stride;
    const int64_t v_off = p->kv_offset * 2;
    uint16_t *k = pack->k + pack->offset[s] + (h * kpad + j0) * D;
    const uint16_t *vrow[32];
    for (int j = 0; j < 32; j++) {
        if (j < n) {
            const char *key = key_addr(p, ops, table, j0 + j, h);
            memcpy(k + (int64_t)j * D, key, sizeof(uint16_t) * (size_t)D);
            vrow[j] = (const uint16_t *)(key + v_off);
        } else {
            memset(k + (int64_t)j * D, 0, sizeof(uint16_t) * (size_t)D);
        }
    }
    const int64_t vs = vt_stride(kpad);
    amx_pack_vt(vrow, n, vs, D, (const uint16_t *)ZERO_ROW, pack->vt + pack->v_offset[s] + h * D * vs + j0);
}

/* A tile's queries for run_tile_amx: Q^T as bf16 pairs in row blocks of AMX_BLOCK_ROWS
 * (query_pairs); each row's last visible key in lim (INT32_MAX for padding), m/l reset. */
static void amx_tile_queries(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows,
                             int rpad) {
    query_pairs(p, ops, it, w, rows, rpad, AMX_BLOCK_ROWS);
    start_tile_rows(p, it, w, rows, rpad);
}

/* run_tile's work with both products on AMX tiles (cpu_amx.h) over the packed keys: each
 * 32-row block runs its products and softmax while its scores (32 rows x KC keys) stay in
 * L1. A block's Q^T pairs and O^T lie contiguous (rows of 32 elements), and every block
 * shares one S^T and one P buffer, so that a chunk's pass over the blocks keeps to a few
 * KiB of each instead of walking strided columns of tile-wide arrays. O^T is turned into
 * w->o [rows][D] at the end. */
static void run_tile_amx(const AttnParams *p, const Operands *ops, const AmxPack *pack, const Item *it, Work *w,
                         int rows, int rpad) {
    const int D = p->head_dim, block = D * AMX_BLOCK_ROWS; /* floats of a block's O^T; its Q^T, half as many pairs */
    const float qscale = p->scale * LOG2E;
    const int64_t kpad = pack->kpad[it->seq], vs = vt_stride(kpad);
    const uint16_t *kb = pack->k + pack->offset[it->seq] + (int64_t)it->kv_head * kpad * D;
    const uint16_t *vt = pack->vt + pack->v_offset[it->seq] + (int64_t)it->kv_head * D * vs;
    float *ot = w->qt;

    amx_tile_queries(p, ops, it, w, rows, rpad);
    memset(ot, 0, sizeof(float) * (size_t)D * rpad);
    amx_configure();
    for (int64_t kc = it->k0; kc < it->k1; kc += KC) {
        const int n = (int)(it->k1 - kc < KC ? it->k1 - kc : KC);
        for (int r0 = 0; r0 < rpad; r0 += AMX_BLOCK_ROWS) {
            /* Causal skip: keys past the block's last position need no product. */
            const int last = r0 + AMX_BLOCK_ROWS - 1 < rows ? r0 + AMX_BLOCK_ROWS - 1 : rows - 1;
            int64_t needed = w->lim[last] - kc + 1;
            const int nk = (int)(needed < 0 ? 0 : (needed > n ? n : needed));
            if (nk == 0) continue;
            const int keys = (nk + 31) / 32 * 32;
            float *ob = ot + (int64_t)(r0 / AMX_BLOCK_ROWS) * block;
            amx_qk(kb + kc * D, w->qp + (int64_t)(r0 / AMX_BLOCK_ROWS) * block / 2, w->st, keys, D);
            if (block_softmax_pairs(w, kc, nk, keys, r0, kc + nk - 1 > w->lim[r0], qscale))
                for (int d = 0; d < D; d++)
                    for (int c = 0; c < AMX_BLOCK_ROWS; c += VL) {
                        float *o = ob + d * AMX_BLOCK_ROWS + c;
                        storeu(o, loadu(o) * loadu(w->alpha + r0 + c));
                    }
            amx_pv(vt + kc, vs, w->pp, ob, keys, D);
        }
    }
    _tile_release();
    for (int r0 = 0; r0 < rpad; r0 += 16)
        for (int d0 = 0; d0 < D; d0 += 16) {
            const float *ob = ot + (int64_t)(r0 / AMX_BLOCK_ROWS) * block + r0 % AMX_BLOCK_ROWS;
            __m512i t[16];
            for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_si512(ob + (d0 + i) * AMX_BLOCK_ROWS);
            transpose_16x16(t);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(w->o + (int64_t)(r0 + i) * D + d0, t[i]);
        }
}
#endif

/* ---- small mode (fewer rows than a vector: decodes) ---------------------------------------- */

/* Row r's online-softmax step over one chunk's scores s [npad] (keys from `allowed` on are
 * masked): s becomes the probabilities, m/l are updated; returns alpha, the factor for the
 * row's output so far. */
static inline float row_softmax(Work *w, int r, float *s, int allowed, int npad) {
    for (int j = allowed; j < npad; j++) s[j] = -INFINITY;
    vf mx = splat(-INFINITY);
    for (int j = 0; j < npad; j += VL) mx = vmax(mx, loadu(s + j));
    vf m = splat(w->m[r]), l = splat(w->l[r]), alpha;
    mx = splat(hmax(mx));
    softmax_update(&mx, &m, &l, &alpha);
    vf sum = splat(0.0f);
    for (int j = 0; j < npad; j += VL) {
        vf e = vexp2(loadu(s + j) - mx);
        storeu(s + j, e);
        sum += e;
    }
    w->m[r] = m[0];
    w->l[r] = l[0] + hsum(sum);
    return alpha[0];
}

/* out[i] = scale * the sum of the lanes of acc[i], for 8 accumulators. */
static inline void reduce8(const vf *acc, float scale, float *out) {
#if defined(__AVX2__)
    __m256 h[8];
    for (int i = 0; i < 8; i++) {
#if VL == 16
        __m512 x = (__m512)acc[i];
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(x),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
        h[i] = (__m256)acc[i];
#endif
    }
    __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
    __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
#else
    for (int i = 0; i < 8; i++) out[i] = scale * hsum(acc[i]);
#endif
}

/* Decode rows share their kv head's K/V: a few rows at a time, each K or V row is loaded
 * once for all of them (AVX2 has 16 vector registers, AVX-512 32).
 *
 * NOTE: row by row, with V copied into pairs per chunk first, the products cost as much
 * as the reads. 32 decodes over 300 tokens, every layer of a 30-layer cache (2 EPYC
 * cores, `kernels.bench_cpu_attention --every-layer`): 17.2-17.6 -> 12.5-12.6 ms bf16,
 * 26.3-26.7 -> 19.9-21.1 ms float32. */
#if VL == 16
#define SCORE_ROWS 3
#define VALUE_ROWS 4
#else
#define SCORE_ROWS 1
#define VALUE_ROWS 2
#endif
#define FORCE_INLINE inline __attribute__((always_inline))

/* Scores of R rows q [R][D] over keys [0, n) (krow padded with zero rows to a multiple of 8):
 * s[r * KC + j] = q_r . k_j, 8 keys per pass. Q is scaled already. */
static FORCE_INLINE void rows_scores(int R, const float *q, const float *const *krow, int n, int D, float *s) {
    for (int j0 = 0; j0 < n; j0 += 8) {
        vf acc[3][8]; /* R <= SCORE_ROWS <= 3 */
        for (int r = 0; r < R; r++)
            for (int jj = 0; jj < 8; jj++) acc[r][jj] = splat(0.0f);
        for (int d = 0; d < D; d += VL) {
            vf qd[3];
            for (int r = 0; r < R; r++) qd[r] = loadu(q + (int64_t)r * D + d);
            for (int jj = 0; jj < 8; jj++) {
                const vf k = loadu(krow[j0 + jj] + d);
                for (int r = 0; r < R; r++) acc[r][jj] += qd[r] * k;
            }
        }
        for (int r = 0; r < R; r++) reduce8(acc[r], 1.0f, s + (int64_t)r * KC + j0);
    }
}

/* o_r[0:D] += sum_j p_r[j] * v_j for R rows (p [R][KC], o [R][D]), each V row loaded once,
 * NVEC vectors of dims per pass. */
static FORCE_INLINE void rows_values_pass(int R, int NVEC, const float *p, const float *const *vrow, int n, int d0,
                                          int D, float *o) {
    vf acc[4][4]; /* R <= VALUE_ROWS <= 4 */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NVEC; v++) acc[r][v] = loadu(o + (int64_t)r * D + d0 + v * VL);
    for (int j = 0; j < n; j++) {
        vf x[4];
        for (int v = 0; v < NVEC; v++) x[v] = loadu(vrow[j] + d0 + v * VL);
        for (int r = 0; r < R; r++) {
            const vf pj = splat(p[(int64_t)r * KC + j]);
            for (int v = 0; v < NVEC; v++) acc[r][v] += pj * x[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NVEC; v++) storeu(o + (int64_t)r * D + d0 + v * VL, acc[r][v]);
}

static FORCE_INLINE void rows_values(int R, const float *p, const float *const *vrow, int n, int D, float *o) {
    int d0 = 0;
    for (; d0 + 4 * VL <= D; d0 += 4 * VL) rows_values_pass(R, 4, p, vrow, n, d0, D, o);
    for (; d0 < D; d0 += 2 * VL) rows_values_pass(R, 2, p, vrow, n, d0, D, o); /* D is a multiple of 2 * VL */
}

#if HAVE_BF16_DOT
/* rows_scores from bf16 rows in place by pair products: s[r * KC + j] = scale * q_r . k_j. */
static FORCE_INLINE void rows_scores_dot(int R, const uint16_t *q, const uint16_t *const *krow, int n, int D,
                                         float scale, float *s) {
    for (int j0 = 0; j0 < n; j0 += 8) {
        __m512 acc[3][8]; /* R <= SCORE_ROWS */
        for (int r = 0; r < R; r++)
            for (int jj = 0; jj < 8; jj++) acc[r][jj] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 2 * VL) {
            __m512bh qd[3];
            for (int r = 0; r < R; r++) qd[r] = (__m512bh)_mm512_loadu_si512(q + (int64_t)r * D + d);
            for (int jj = 0; jj < 8; jj++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(krow[j0 + jj] + d);
                for (int r = 0; r < R; r++) acc[r][jj] = _mm512_dpbf16_ps(acc[r][jj], qd[r], k);
            }
        }
        for (int r = 0; r < R; r++) reduce8((const vf *)acc[r], scale, s + (int64_t)r * KC + j0);
    }
}

/* O += P . V for R rows from bf16 probability pairs pb [R][KC / 2] and V rows in place:
 * each pair of V rows is interleaved in registers once for all R rows (vpunpck{l,h}wd),
 * G 32-dim groups per pass. The interleave works within 128-bit lanes, so o holds each
 * group's dims in unpack order (see unpack_order). */
static FORCE_INLINE void rows_values_dot_pass(int R, int G, const uint32_t *pb, const uint16_t *const *vrow,
                                              int pairs, int d0, int D, float *o) {
    __m512 acc[4][4]; /* R <= VALUE_ROWS */
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 2 * G; t++) acc[r][t] = _mm512_loadu_ps(o + (int64_t)r * D + d0 + t * VL);
    for (int i = 0; i < pairs; i++) {
        __m512bh v[4];
        for (int g = 0; g < G; g++) {
            const __m512i a = _mm512_loadu_si512(vrow[2 * i] + d0 + 32 * g);
            const __m512i b = _mm512_loadu_si512(vrow[2 * i + 1] + d0 + 32 * g);
            v[2 * g] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            v[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int r = 0; r < R; r++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pb[(int64_t)r * (KC / 2) + i]);
            for (int t = 0; t < 2 * G; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], pr, v[t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 2 * G; t++) _mm512_storeu_ps(o + (int64_t)r * D + d0 + t * VL, acc[r][t]);
}

static FORCE_INLINE void rows_values_dot(int R, const uint32_t *pb, const uint16_t *const *vrow, int pairs, int D,
                                         float *o) {
    int d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) rows_values_dot_pass(R, 2, pb, vrow, pairs, d0, D, o);
    for (; d0 < D; d0 += 32) rows_values_dot_pass(R, 1, pb, vrow, pairs, d0, D, o); /* D is a multiple of 32 */
}

/* Put a row's dims back in order after rows_values_dot: in each group of 32, value k of
 * the low half is dim (k / 4) * 8 + k % 4, of the high half 4 further. */
static void unpack_order(float *o, int D) {
    float group[32];
    for (int g = 0; g < D; g += 32) {
        for (int k = 0; k < 16; k++) {
            group[(k / 4) * 8 + k % 4] = o[g + k];
            group[(k / 4) * 8 + 4 + k % 4] = o[g + 16 + k];
        }
        memcpy(o + g, group, sizeof(group));
    }
}
#endif

/* What both small modes derive from an item: rows per kv head, the cached context before
 * the item's sequence's new tokens, its block table, and the scores' base-2 scale. */
typedef struct {
    int D, group, per_head;
    int64_t context;
    const int32_t *table;
    float qscale;
} SmallItem;

static inline SmallItem small_item(const AttnParams *p, const Item *it) {
    const int group = p->num_heads / p->num_kv_heads;
    const int32_t query_len = p->query_start[it->seq + 1] - p->query_start[it->seq];
    return (SmallItem){p->head_dim, group, (it->t1 - it->t0) * group, p->seq_lens[it->seq] - query_len,
                       p->block_tables + (int64_t)it->seq * p->table_stride, p->scale * LOG2E};
}

/* One kv head's rows [r0, r0 + count) over a chunk of n keys (krow/vrow or khrow/vhrow set):
 * scores, online softmax, then O += P . V, a few rows at a time. */
static void small_head_chunk(const SmallItem *si, Work *w, int64_t kc, int n, int r0, int count, int dot) {
    const int D = si->D, npad = (n + VL - 1) / VL * VL;
#if !HAVE_BF16_DOT
    (void)dot;
#endif
    /* Zero rows up to the 8-key passes' end (an odd n's last V pair among them). */
    for (int j = n; j < (n + 7) / 8 * 8; j++) {
        w->krow[j] = w->vrow[j] = ZERO_ROW;
        w->khrow[j] = w->vhrow[j] = (const uint16_t *)ZERO_ROW;
    }
    /* Each call below passes R as a constant, so that the inlined row loops unroll. */
    for (int r = r0; r < r0 + count;) {
        const int R = r0 + count - r < SCORE_ROWS ? r0 + count - r : SCORE_ROWS;
        float *s = w->st + (int64_t)r * KC;
#if HAVE_BF16_DOT
        if (dot) {
            const uint16_t *q = (const uint16_t *)w->qp + (int64_t)r * D;
            if (R == 3) rows_scores_dot(3, q, w->khrow, n, D, si->qscale, s);
            else if (R == 2) rows_scores_dot(2, q, w->khrow, n, D, si->qscale, s);
            else rows_scores_dot(1, q, w->khrow, n, D, si->qscale, s);
        } else
#endif
        {
            const float *q = w->qt + (int64_t)r * D;
            if (R == 3) rows_scores(3, q, w->krow, n, D, s);
            else if (R == 2) rows_scores(2, q, w->krow, n, D, s);
            else rows_scores(1, q, w->krow, n, D, s);
        }
        r += R;
    }
    for (int r = r0; r < r0 + count; r++) {
        float *s = w->st + (int64_t)r * KC, *o = w->o + (int64_t)r * D;
        const float a = row_softmax(w, r, s, visible(w, kc, n, r), npad);
        if (a != 1.0f)
            for (int d = 0; d < D; d += VL) storeu(o + d, loadu(o + d) * a);
#if HAVE_BF16_DOT
        /* NOTE: adjacent probabilities rounded to bf16 are the pairs P . V needs. */
        if (dot)
            for (int j = 0; j < npad; j += VL) store_bf16((uint16_t *)w->pp + (int64_t)r * KC + j, loadu(s + j));
#endif
    }
    for (int r = r0; r < r0 + count;) {
        const int R = r0 + count - r < VALUE_ROWS ? r0 + count - r : VALUE_ROWS;
        float *o = w->o + (int64_t)r * D;
#if HAVE_BF16_DOT
        if (dot) {
            const uint32_t *pb = w->pp + (int64_t)r * (KC / 2);
            const int pairs = (n + 1) / 2;
            if (R == 4) rows_values_dot(4, pb, w->vhrow, pairs, D, o);
            else if (R == 3) rows_values_dot(3, pb, w->vhrow, pairs, D, o);
            else if (R == 2) rows_values_dot(2, pb, w->vhrow, pairs, D, o);
            else rows_values_dot(1, pb, w->vhrow, pairs, D, o);
        } else
#endif
        {
            const float *p = w->st + (int64_t)r * KC;
            if (R == 4) rows_values(4, p, w->vrow, n, D, o);
            else if (R == 3) rows_values(3, p, w->vrow, n, D, o);
            else if (R == 2) rows_values(2, p, w->vrow, n, D, o);
            else rows_values(1, p, w->vrow, n, D, o);
        }
        r += R;
    }
}

static void run_small(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows) {
    const SmallItem si = small_item(p, it);
    const int D = si.D, group = si.group, per_head = si.per_head;
    const int dot = HAVE_BF16_DOT && p->is_bf16;
    uint16_t *qh = (uint16_t *)w->qp; /* bf16 dot: Q rows as they are */

    for (int r = 0; r < rows; r++) {
        int64_t token;
        int head;
        row_place(p, it, r, &token, &head);
        if (dot)
            memcpy(qh + (int64_t)r * D, (const uint16_t *)ops->q + token * ops->q_token_stride + (int64_t)head * D,
                   sizeof(uint16_t) * (size_t)D);
        else
            for (int d = 0; d < D; d++) w->qt[(int64_t)r * D + d] = si.qscale * query_value(p, ops, token, head, d);
        w->lim[r] = (int32_t)(si.context + it->t0 + (r % per_head) / group);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * D);

    for (int64_t kc = it->k0; kc < it->k1; kc += KC) {
        const int n = (int)(it->k1 - kc < KC ? it->k1 - kc : KC);
        /* NOTE: all kv heads of a decode in one item: a chunk's blocks are read whole (each
         * token's K row of every head is one contiguous span) instead of a third at a time
         * by three items far apart in time. */
        const int whole = it->kv_heads == p->num_kv_heads;
        const int64_t next_end = kc + n + KC < it->k1 ? kc + n + KC : it->k1;
        if (whole) touch_keys(p, ops, si.table, kc, kc + n);
        for (int h = 0; h < it->kv_heads; h++) {
            /* The next chunk comes into L2 while this one is multiplied, a share per kv head
             * (touch_keys then finds it there); chunk_rows prefetches nothing more. */
            if (whole && next_end > kc + n) prefetch_keys_share(p, ops, si.table, kc + n, next_end, h, it->kv_heads);
            chunk_rows(p, ops, si.table, it->kv_head + h, kc, n, kc + n, dot, w);
            small_head_chunk(&si, w, kc, n, h * per_head, per_head, dot);
        }
    }
#if HAVE_BF16_DOT
    if (dot)
        for (int r = 0; r < rows; r++) unpack_order(w->o + (int64_t)r * D, D);
#endif
}

#if HAVE_AMX
/* run_small's work with both products on AMX tiles, 16 query rows per kv head at most:
 *  - S^T = K . Q^T, 16 keys at a time: A tiles read the keys where they lie (a block's rows
 *    are a fixed stride apart; blocks of fewer than 16 keys are copied to kb first), B holds
 *    Q^T as pairs; each row's 16 scores are gathered from the C tile.
 *  - the rows' online softmax as run_small's (keys are the vector dimension).
 *  - O += P . V: A holds the probabilities as bf16 rows, B the V pairs pack_value_pairs builds; O
 *    is kept per kv head in tile layout (oh) across chunks.
 * NOTE: tiles do a 16-key block in a few instructions whatever the row count, where
 * run_small's dot products end in horizontal sums per row and key (measured when run_small
 * took its rows one at a time; not measured against its shared-load form, for want of an
 * AMX CPU). */
static void run_small_amx(const AttnParams *p, const Operands *ops, const Item *it, Work *w, int rows) {
    const SmallItem si = small_item(p, it);
    const int D = si.D, per_head = si.per_head;
    const int64_t token_bytes = (int64_t)p->num_kv_heads * D * 2;
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));

    memset(w->qh, 0, sizeof(uint32_t) * (size_t)it->kv_heads * (D / 2) * 16);
    for (int r = 0; r < rows; r++) {
        int64_t token;
        int head;
        row_place(p, it, r, &token, &head);
        const uint16_t *src = (const uint16_t *)ops->q + token * ops->q_token_stride + (int64_t)head * D;
        uint32_t *pairs = w->qh + (int64_t)(r / per_head) * (D / 2) * 16 + r % per_head;
        for (int i = 0; i < D / 2; i++) pairs[i * 16] = (uint32_t)src[2 * i] | (uint32_t)src[2 * i + 1] << 16;
        w->lim[r] = (int32_t)(si.context + it->t0 + (r % per_head) / si.group);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->oh, 0, sizeof(float) * (size_t)it->kv_heads * 16 * D);
    memset(w->pb, 0, sizeof(uint16_t) * 16 * KC); /* rows past per_head stay 0 */
    amx_configure();
    for (int64_t kc = it->k0; kc < it->k1; kc += KC) {
        const int n = (int)(it->k1 - kc < KC ? it->k1 - kc : KC);
        const int npad = (n + VL - 1) / VL * VL, kpad = (n + 31) / 32 * 32;
        for (int h = 0; h < it->kv_heads; h++) {
            /* NOTE: no software prefetch of the next chunk here: the hardware prefetchers
             * keep up with these short passes over whole blocks, and the prefetches only
             * queued behind them (decodes 32 x 300 took 0.38 ms a layer with, 0.32 without). */
            chunk_rows(p, ops, si.table, it->kv_head + h, kc, n, kc + n, 1, w);
            pack_value_pairs(w, n, D);
            /* NOTE: pairs past the chunk meet probabilities 0, but 0 * NaN is NaN: zero them. */
            for (int i = (n + 1) / 2; i < kpad / 2; i++) memset(w->vp + (int64_t)i * D, 0, sizeof(uint32_t) * (size_t)D);
            const uint32_t *qh = w->qh + (int64_t)h * (D / 2) * 16;
            for (int j0 = 0; j0 < n; j0 += 16) {
                /* Keys kc + j0 .. + 15 share a block when blocks hold 16 or more (kc + j0 is a
                 * multiple of 16); past the sequence's end they are its last block's unused
                 * slots, whose scores the softmax masks. */
                const uint16_t *a = w->khrow[j0];
                int64_t stride = token_bytes;
                if (p->block_size < 16) {
                    for (int j = 0; j < 16; j++) {
                        if (j0 + j < n) memcpy(w->kb + (int64_t)j * D, w->khrow[j0 + j], sizeof(uint16_t) * (size_t)D);
                        else memset(w->kb + (int64_t)j * D, 0, sizeof(uint16_t) * (size_t)D);
                    }
                    a = w->kb;
                    stride = (int64_t)D * 2;
                }
                _tile_zero(0);
                for (int d0 = 0; d0 < D; d0 += 32) {
                    _tile_loadd(1, a + d0, stride);
                    _tile_loadd(2, qh + (d0 / 2) * 16, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, w->ct, 64);
                for (int r = 0; r < per_head; r++) {
                    __m512 sc = _mm512_i32gather_ps(column, w->ct + r, 4);
                    _mm512_storeu_ps(w->st + (int64_t)(h * per_head + r) * KC + j0, _mm512_mul_ps(sc, _mm512_set1_ps(si.qscale)));
                }
            }
            float *oh = w->oh + (int64_t)h * 16 * D;
            for (int r = 0; r < per_head; r++) {
                const int row = h * per_head + r;
                float *s = w->st + (int64_t)row * KC;
                const float a = row_softmax(w, row, s, visible(w, kc, n, row), npad);
                if (a != 1.0f)
                    for (int d = 0; d < D; d += VL) storeu(oh + (int64_t)r * D + d, loadu(oh + (int64_t)r * D + d) * a);
                for (int j = 0; j < npad; j += VL) store_bf16(w->pb + (int64_t)r * KC + j, loadu(s + j));
                for (int j = npad; j < kpad; j++) w->pb[(int64_t)r * KC + j] = 0;
            }
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int tiles = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
                for (int t = 0; t < tiles; t++) amx_tile_load(t, oh + d0 + t * 16, (int64_t)D * 4);
                for (int j0 = 0; j0 < kpad; j0 += 32) {
                    _tile_loadd(4, w->pb + j0, KC * 2);
                    const uint32_t *v = w->vp + (int64_t)(j0 / 2) * D + d0;
                    for (int t = 0; t < tiles; t++) amx_accumulate_a4(t, v + t * 16, (int64_t)D * 4);
                }
                for (int t = 0; t < tiles; t++) amx_tile_store(t, oh + d0 + t * 16, (int64_t)D * 4);
            }
        }
    }
    _tile_release();
    for (int r = 0; r < rows; r++)
        memcpy(w->o + (int64_t)r * D, w->oh + ((int64_t)(r / per_head) * 16 + r % per_head) * D, sizeof(float) * (size_t)D);
}
#endif

/* ---- driver ---------------------------------------------------------------------------- */

static void write_row(const AttnParams *p, const Operands *ops, int64_t token, int head, const float *src,
                      float inv_l) {
    const int D = p->head_dim;
    int64_t base = (token * p->num_heads + head) * (int64_t)D;
    if (p->is_bf16) {
        uint16_t *dst = (uint16_t *)ops->out + base;
        for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d] * inv_l);
    } else {
        float *dst = (float *)ops->out + base;
        for (int d = 0; d < D; d++) dst[d] = src[d] * inv_l;
    }
}

static inline int item_rows(const AttnParams *p, const Item *it) {
    return (it->t1 - it->t0) * (p->num_heads / p->num_kv_heads) * it->kv_heads;
}

static inline int pad_rows(int rows) { return (rows + NV * VL - 1) / (NV * VL) * (NV * VL); }

static int by_cost_desc(const void *a, const void *b) {
    float ca = ((const Item *)a)->cost, cb = ((const Item *)b)->cost;
    return (ca < cb) - (ca > cb);
}

static int alloc_work(Work *w, int D, int kv_heads) {
    const size_t rmax = TILE_ROWS + 2 * NV * VL; /* padded tile rows */
    size_t floats = (size_t)D * rmax + (size_t)(KC + RBK) * rmax + rmax * (size_t)D +
                    2 * (size_t)KC * D + 3 * rmax;
    float *base = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    w->lim = malloc(rmax * sizeof(int32_t) + VL * sizeof(int32_t));
    size_t pairs = (size_t)(D / 2) * rmax + (size_t)((KC + RBK) / 2 + 1) * rmax + (size_t)(KC / 2 + 1) * D;
    w->qp = HAVE_BF16_DOT ? aligned_alloc(64, (pairs * sizeof(uint32_t) + 63) / 64 * 64) : NULL;
    w->pp = w->qp ? w->qp + (size_t)(D / 2) * rmax : NULL;
    w->vp = w->pp ? w->pp + (size_t)((KC + RBK) / 2 + 1) * rmax : NULL;
    w->khrow = malloc((KC + RBK) * sizeof(uint16_t *));
    w->vhrow = malloc((KC + RBK) * sizeof(uint16_t *));
    w->krow = malloc((KC + RBK) * sizeof(float *));
    w->vrow = malloc((KC + RBK) * sizeof(float *));
    if (!base || !w->lim || !w->krow || !w->vrow || !w->khrow || !w->vhrow || (HAVE_BF16_DOT && !w->qp)) return -1;
#if HAVE_AMX
    w->qh = aligned_alloc(64, sizeof(uint32_t) * (size_t)kv_heads * (D / 2) * 16);
    w->oh = aligned_alloc(64, sizeof(float) * (size_t)kv_heads * 16 * D + 16 * 16 * sizeof(float));
    w->pb = aligned_alloc(64, sizeof(uint16_t) * (16 * KC + 16 * (size_t)D));
    if (!w->qh || !w->oh || !w->pb) return -1;
    w->ct = w->oh + (size_t)kv_heads * 16 * D;
    w->kb = w->pb + 16 * KC;
#else
    (void)kv_heads;
#endif
    w->qt = base;
    w->st = w->qt + (size_t)D * rmax;
    w->o = w->st + (size_t)(KC + RBK) * rmax;
    w->kf = w->o + rmax * (size_t)D;
    w->vf_ = w->kf + (size_t)KC * D;
    w->m = w->vf_ + (size_t)KC * D;
    w->l = w->m + rmax;
    w->alpha = w->l + rmax;
    return 0;
}

static void free_work(Work *w) {
    free(w->qt);
    free(w->qh);
    free(w->oh);
    free(w->pb);
    free(w->lim);
    free((void *)w->krow);
    free((void *)w->vrow);
    free(w->qp);
    free((void *)w->khrow);
    free((void *)w->vhrow);
}

/* New token t's K and V rows (kv_heads * head_dim elements each) into its slot of the cache. */
static void store_token_kv(const AttnParams *p, const Operands *ops, const NewKV *kv_in, int64_t t) {
    const size_t es = elem_size(p);
    const int64_t width = (int64_t)p->num_kv_heads * p->head_dim, slot = kv_in->slots[t];
    char *dst = (char *)ops->kv + ((slot / p->block_size) * p->block_stride + (slot % p->block_size) * width) * (int64_t)es;
    memcpy(dst, (const char *)kv_in->key + t * kv_in->key_stride * (int64_t)es, (size_t)width * es);
    memcpy(dst + p->kv_offset * (int64_t)es, (const char *)kv_in->value + t * kv_in->value_stride * (int64_t)es,
           (size_t)width * es);
}

/* Tokens per tile of a sequence's query_len: tile_tokens, unless the last tile would have
 * fewer rows than a vector (and run as decodes do, its keys read for a few rows): then the
 * same number of tiles, evened out (the last may still be the shorter). NOTE: 8 prompts of
 * 256 tokens with 3 query heads per kv head took tiles of 85, 85, 85 and 1 token; in four
 * tiles of 64 tokens their attention took 0.93x the time. */
static inline int tile_step(int query_len, int group, int tile_tokens) {
    if (query_len * group < VL) return query_len;
    const int tail = query_len % tile_tokens;
    if (tail == 0 || tail * group >= VL) return tile_tokens;
    const int tiles = (query_len + tile_tokens - 1) / tile_tokens;
    return (query_len + tiles - 1) / tiles;
}

/* Small-mode sequences (fewer rows per kv head than a vector) are one group for all their
 * kv heads; others one per tile and kv head. */
static inline int heads_per_group(const AttnParams *p, int query_len) {
    const int rows = query_len * (p->num_heads / p->num_kv_heads);
    return rows < VL && rows * p->num_kv_heads <= TILE_ROWS ? p->num_kv_heads : 1;
}

static int64_t count_groups(const AttnParams *p, int tile_tokens) {
    const int group = p->num_heads / p->num_kv_heads;
    int64_t count = 0;
    for (int s = 0; s < p->num_seqs; s++) {
        int32_t ql = p->query_start[s + 1] - p->query_start[s];
        if (ql == 0) continue;
        int step = tile_step(ql, group, tile_tokens);
        count += (ql + step - 1) / step * (p->num_kv_heads / heads_per_group(p, ql));
    }
    return count;
}

typedef struct {
    Item *items;
    Group *groups;
    int64_t num_items, num_groups, scratch; /* scratch: floats of split items' partial results */
} Plan;

/* The items of one call for tiles of `tile_tokens` tokens: a group per (sequence, tile, kv
 * heads), its keys split into parts of equal length (at least MIN_PART_KEYS each) when there
 * are fewer groups than 4 per thread. 0, or -2 when out of memory. */
static int plan_items(const AttnParams *p, int tile_tokens, int threads, Plan *plan) {
    const int group = p->num_heads / p->num_kv_heads, D = p->head_dim;
    int64_t num_groups = count_groups(p, tile_tokens);
    double total = 0.0;
    for (int s = 0; s < p->num_seqs; s++) {
        int32_t ql = p->query_start[s + 1] - p->query_start[s];
        int64_t context = p->seq_lens[s] - ql;
        int step = ql > 0 ? tile_step(ql, group, tile_tokens) : 1;
        for (int t0 = 0; t0 < ql; t0 += step) {
            int t1 = t0 + step < ql ? t0 + step : ql;
            total += (double)(t1 - t0) * group * (double)(context + (t0 + t1) / 2 + 1) * p->num_kv_heads;
        }
    }
    const double target = total / (4.0 * threads); /* cost per item to aim for */
    int64_t cap = num_groups * 4 + 16, num_items = 0, scratch = 0, gi = 0;
    Item *items = malloc(sizeof(Item) * (size_t)cap);
    Group *groups = malloc(sizeof(Group) * (size_t)(num_groups > 0 ? num_groups : 1));
    if (!items || !groups) goto oom;
    for (int s = 0; s < p->num_seqs; s++) {
        int32_t ql = p->query_start[s + 1] - p->query_start[s];
        if (ql == 0) continue;
        int64_t context = p->seq_lens[s] - ql;
        const int step = tile_step(ql, group, tile_tokens), heads = heads_per_group(p, ql);
        for (int t0 = 0; t0 < ql; t0 += step) {
            int t1 = t0 + step < ql ? t0 + step : ql;
            int64_t keys = context + t1;
            double cost = (double)(t1 - t0) * group * heads * (double)(context + (t0 + t1) / 2 + 1);
            int64_t parts = num_groups >= 4 * threads ? 1 : (int64_t)ceil(cost / target);
            if (parts > keys / MIN_PART_KEYS) parts = keys / MIN_PART_KEYS;
            if (parts < 1) parts = 1;
            int64_t part_len = ((keys + parts - 1) / parts + KC - 1) / KC * KC;
            parts = (keys + part_len - 1) / part_len;
            const int rows = (t1 - t0) * group * heads;
            for (int h = 0; h < p->num_kv_heads; h += heads) {
                if (num_items + parts > cap) {
                    cap = (num_items + parts) * 2;
                    Item *grown = realloc(items, sizeof(Item) * (size_t)cap);
                    if (!grown) goto oom;
                    items = grown;
                }
                groups[gi].first = (int32_t)num_items;
                groups[gi].parts = (int32_t)parts;
                gi++;
                for (int64_t part = 0; part < parts; part++) {
                    Item *it = &items[num_items++];
                    it->seq = s;
                    it->kv_head = h;
                    it->kv_heads = heads;
                    it->t0 = t0;
                    it->t1 = t1;
                    it->k0 = (int32_t)(part * part_len);
                    it->k1 = (int32_t)((part + 1) * part_len < keys ? (part + 1) * part_len : keys);
                    it->cost = (float)((double)rows * (it->k1 - it->k0));
                    it->scratch = -1;
                    if (parts > 1) {
                        it->scratch = scratch;
                        scratch += (int64_t)rows * (D + 2);
                    }
                }
            }
        }
    }
    *plan = (Plan){items, groups, num_items, num_groups, scratch};
    return 0;
oom:
    free(items);
    free(groups);
    return -2;
}

/* 0 on success; -1: head_dim unsupported (callers check first); -2: out of memory. */
int ragserve_paged_attention(const AttnParams *p, const void *q, int64_t q_token_stride,
                             const void *key, int64_t key_stride, const void *value,
                             int64_t value_stride, const int64_t *slots, void *kv, void *out) {
    const int D = p->head_dim, group = p->num_heads / p->num_kv_heads;
    if (D % (NV * VL) != 0 || D > 512 || group > TILE_ROWS) return -1;
    Operands ops = {q, q_token_stride, (const char *)kv, out};
    const int64_t tokens = key != NULL ? p->query_start[p->num_seqs] : 0;
    const NewKV new_kv = {key, value, key_stride, value_stride, slots};

    /* Tiles of up to TILE_ROWS rows; when they are too few to keep every thread busy their
     * keys are split into parts first (cheap: a merge), and tiles are halved only when even
     * that leaves threads idle (each halving reads the keys once more). */
    const int threads = p->num_threads > 0 ? p->num_threads : 1;
    int tile_tokens = TILE_ROWS / group > 0 ? TILE_ROWS / group : 1;
    Plan plan;
    for (;;) {
        if (plan_items(p, tile_tokens, threads, &plan) != 0) return -2;
        if (plan.num_items >= 2 * threads || tile_tokens == 1 || tile_tokens * group <= MIN_TILE_ROWS) break;
        free(plan.items);
        free(plan.groups);
        tile_tokens = (tile_tokens + 1) / 2;
    }
    if (plan.num_groups == 0) {
        for (int64_t t = 0; t < tokens; t++) store_token_kv(p, &ops, &new_kv, t);
        free(plan.items);
        free(plan.groups);
        return 0;
    }
    Item *items = plan.items;
    Group *groups = plan.groups;
    const int64_t num_items = plan.num_items, num_groups = plan.num_groups, scratch = plan.scratch;
    float *partials = scratch ? malloc(sizeof(float) * (size_t)scratch) : NULL;
    Item *order = malloc(sizeof(Item) * (size_t)num_items);
    if ((scratch && !partials) || !order) {
        free(partials);
        free(order);
        free(items);
        free(groups);
        return -2;
    }
    memcpy(order, items, sizeof(Item) * (size_t)num_items);
    qsort(order, (size_t)num_items, sizeof(Item), by_cost_desc);

    const int amx = p->is_bf16 && amx_usable();
    if (p->is_bf16) (void)bf16_dot_tiles(); /* decided before the threads start */
#if HAVE_AMX
    AmxPack pack = {0};
    if (amx && amx_plan_pack(p, &pack) != 0) {
        amx_free_pack(&pack);
        free(partials);
        free(order);
        free(items);
        free(groups);
        return -2;
    }
#else
    (void)amx; /* unused in builds without AMX */
#endif
    int failed = 0;
    int nt = (int64_t)threads < num_items ? threads : (int)num_items;
#pragma omp parallel num_threads(nt)
    {
        Work w = {0};
        int ok = alloc_work(&w, D, p->num_kv_heads) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* NOTE: stored by every thread, before any item reads them (the loop's barrier): one
         * thread alone took a tenth of a prefill's attention over 16 prompts of 256 tokens. */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) store_token_kv(p, &ops, &new_kv, t);
#if HAVE_AMX
#pragma omp for schedule(static)
        for (int64_t job = 0; job < pack.jobs; job++) amx_pack_job(p, &ops, &pack, job);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            if (!ok) continue;
            const Item *it = &order[i];
            int rows = item_rows(p, it);
#if HAVE_AMX
            if ((it->kv_heads > 1 || rows < VL) && amx) run_small_amx(p, &ops, it, &w, rows);
            else
#endif
            if (it->kv_heads > 1 || rows < VL) run_small(p, &ops, it, &w, rows);
#if HAVE_AMX
            else if (amx) run_tile_amx(p, &ops, &pack, it, &w, rows, pad_rows(rows));
#endif
            else run_tile(p, &ops, it, &w, rows, pad_rows(rows));
            if (it->scratch < 0) {
                for (int r = 0; r < rows; r++) {
                    int64_t token;
                    int head;
                    row_place(p, it, r, &token, &head);
                    write_row(p, &ops, token, head, w.o + (int64_t)r * D, 1.0f / w.l[r]);
                }
            } else {
                float *dst = partials + it->scratch;
                memcpy(dst, w.o, sizeof(float) * (size_t)rows * D);
                memcpy(dst + (int64_t)rows * D, w.m, sizeof(float) * (size_t)rows);
                memcpy(dst + (int64_t)rows * (D + 1), w.l, sizeof(float) * (size_t)rows);
            }
        }
        /* Merge split parts by their log-sum-exp (base 2). */
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < num_groups; g++) {
            if (groups[g].parts == 1 || failed) continue;
            const Item *first = &items[groups[g].first];
            int rows = item_rows(p, first);
            float acc[512];
            for (int r = 0; r < rows; r++) {
                float m_max = -INFINITY;
                for (int part = 0; part < groups[g].parts; part++) {
                    const float *src = partials + first[part].scratch;
                    float m = src[(int64_t)rows * D + r];
                    m_max = m > m_max ? m : m_max;
                }
                float l_sum = 0.0f;
                for (int d = 0; d < D; d++) acc[d] = 0.0f;
                for (int part = 0; part < groups[g].parts; part++) {
                    const float *src = partials + first[part].scratch;
                    float m = src[(int64_t)rows * D + r];
                    if (m == -INFINITY) continue;
                    float weight = exp2f(m - m_max);
                    l_sum += weight * src[(int64_t)rows * (D + 1) + r];
                    for (int d = 0; d < D; d++) acc[d] += weight * src[(int64_t)r * D + d];
                }
                int64_t token;
                int head;
                row_place(p, first, r, &token, &head);
                write_row(p, &ops, token, head, acc, 1.0f / l_sum);
            }
        }
        free_work(&w); /* frees what a failed alloc_work got, too */
    }
#if HAVE_AMX
    amx_free_pack(&pack);
#endif
    free(partials);
    free(order);
    free(items);
    free(groups);
    return failed ? -2 : 0;
}

/* The vector width this build was compiled for (floats), for logs and tests. */
int ragserve_vector_width(void) { return VL; }

/* 1 when bf16 tiles multiply on AMX tiles (the build has AMX and the OS granted it), for logs
 * and tests. */
int ragserve_amx(void) { return amx_usable(); }

/* 1 when bf16 tiles use the bf16 pair products, for logs and tests. */
int ragserve_bf16_dot(void) { return HAVE_BF16_DOT; }
