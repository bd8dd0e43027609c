/* The native CPU library's entry points (bound by ctypes in kernels/cpu_native.py), declared
 * once so that the files calling one another (cpu_decoder_stack.c) are checked against the
 * files defining them. */
#ifndef RAGSERVE_CPU_KERNELS_H
#define RAGSERVE_CPU_KERNELS_H

#include <stdint.h>

/* One step's batch layout for the paged attention (mirrored by kernels/cpu_native.py). */
typedef struct {
    int32_t num_seqs, num_heads, num_kv_heads, head_dim;
    int32_t block_size, is_bf16, num_threads, _pad;
    int64_t block_stride;  /* elements between consecutive blocks of one layer */
    int64_t kv_offset;     /* elements from a block's K plane to its V plane */
    int64_t table_stride;  /* entries between block-table rows */
    const int32_t *query_start; /* [num_seqs + 1] */
    const int32_t *seq_lens;    /* [num_seqs] */
    const int32_t *block_tables;
    float scale;
} AttnParams;

#define SMALL_LINEAR_MAX_ROWS 64
#define BF16_SMALL_LINEAR_MAX_ROWS 2
#define PAIRS_LINEAR_MAX_ROWS 32 /* rows of the native decoder stack's paired products; as kernels/cpu_linear.py */
#define PAIR_PANEL 48

int ragserve_paged_attention(const AttnParams *p, const void *q, int64_t q_token_stride, const void *key,
                             int64_t key_stride, const void *value, int64_t value_stride, const int64_t *slots,
                             void *kv, void *out);
int ragserve_add_rms_norm(int is_bf16, int64_t rows, int64_t cols, const void *x, void *residual,
                          const void *weight, float eps, void *out, int threads);
int ragserve_silu_mul(int is_bf16, int64_t rows, int64_t inter, const void *gate_up, int64_t stride, void *out,
                      int threads);
void ragserve_rotary(int is_bf16, int64_t tokens, int heads, int head_dim, const void *src, int64_t src_stride,
                     const void *cos, const void *sin, void *dst, int64_t dst_stride, int threads);
int ragserve_small_linear(int64_t rows, int64_t n_out, int64_t k_in, const float *x, const float *wt,
                          const float *bias, float *out, int threads);
int ragserve_small_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint16_t *w,
                               const uint16_t *bias, uint16_t *out, int threads);
int ragserve_argmax_rows(int is_bf16, int64_t rows, int64_t cols, const void *x, int64_t stride, int64_t *out,
                         int threads);
int ragserve_pairs_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint32_t *wp,
                               const uint16_t *bias, uint16_t *out, int threads);
int ragserve_pairs_silu_mul_bf16(int64_t rows, int64_t inter, int64_t k_in, const uint16_t *x, const uint32_t *wp,
                                 const uint16_t *bias, uint16_t *out, int threads);
int ragserve_amx_linear_bf16(int64_t rows, int64_t n_out, int64_t k_in, const uint16_t *x, const uint16_t *w,
                             const uint16_t *bias, uint16_t *out, int threads);

#endif
