/* A run of Llama decoder layers for a step of a few rows (decode steps, short questions),
 * float32 or bf16, in one call: the same kernels the per-op path calls from Python, in the
 * same order on the same buffers, so its results are bit-identical to that path's (and in
 * float32, to transformers').
 *
 * A decode step of SmolLM2-135M is ~300 small kernel calls; from Python each costs
 * 10-30 us of module dispatch, views and allocations, a quarter of a batch-1 step. Here the
 * layers loop in C over buffers allocated once per call.
 *
 * Per layer, with the residual stream carried one step late (as in llama.py):
 *   normed = norm(residual += hidden)  (layer 0: norm(residual), the embeddings)
 *   qkv = normed . Wqkv^T;  q, k rotated;  K/V stored and attended;  hidden = attn . Wo^T
 *   normed = norm(residual += hidden);  hidden = silu_mul(normed . Wgu^T) . Wdown^T
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

typedef struct { /* one layer's weights in the step's dtype; biases may be NULL */
    const void *input_norm, *qkv, *qkv_bias, *o, *o_bias;
    const void *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    /* bf16 projections paired for cpu_pairs_linear.c: NULL on AMX, in float32, or unpaired */
    const void *qkv_pairs, *o_pairs, *gate_up_pairs, *down_pairs;
} LayerWeights;

typedef struct { /* mirrored by kernels/cpu_decoder_stack.py */
    int32_t num_layers, rows, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, threads;
    float eps;
    int32_t is_bf16;          /* else float32 */
    int64_t layer_stride;     /* cache elements between consecutive layers' planes */
    const LayerWeights *layers;
    const AttnParams *attn;   /* the step's batch layout, shared by all layers */
    const int64_t *slots;     /* [rows] cache slots of the new K/V */
    char *kv;                 /* layer 0's K plane of block 0 */
    const void *cos, *sin;    /* [rows][head_dim / 2] */
    void *hidden;             /* out: the last layer's MLP output [rows][hidden_size] */
    void *residual;           /* in: the embeddings; out: the residual stream before it */
} DecoderStack;

/* The product the per-op path picks for these rows (kernels/cpu_linear.py): `pairs` is the
 * weight paired, where the CPU multiplies bf16 rows that way. */
static int linear(const DecoderStack *s, int64_t n_out, int64_t k_in, const void *x, const void *w,
                  const void *pairs, const void *bias, void *out) {
    if (!s->is_bf16) return ragserve_small_linear(s->rows, n_out, k_in, x, w, bias, out, s->threads);
    if (pairs != NULL) return ragserve_pairs_linear_bf16(s->rows, n_out, k_in, x, pairs, bias, out, s->threads);
    if (s->rows <= BF16_SMALL_LINEAR_MAX_ROWS)
        return ragserve_small_linear_bf16(s->rows, n_out, k_in, x, w, bias, out, s->threads);
    return ragserve_amx_linear_bf16(s->rows, n_out, k_in, x, w, bias, out, s->threads);
}

/* 0 on success; -1 where a kernel refuses the shapes; -2 out of memory. */
int ragserve_decoder_stack(const DecoderStack *s) {
    const int64_t rows = s->rows, H = s->hidden_size, D = s->head_dim, inter = s->intermediate_size;
    const int64_t q_size = s->num_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t qkv_width = q_size + 2 * kv_size, rotated_width = q_size + kv_size;
    const int64_t per_row = H + qkv_width + rotated_width + q_size + 2 * inter + inter;
    const int bf16 = s->is_bf16;
    const size_t es = bf16 ? 2 : 4;
    char *buffer = malloc(es * (size_t)(rows * per_row));
    if (buffer == NULL) return -2;
    char *normed = buffer, *qkv = normed + es * rows * H, *rotated = qkv + es * rows * qkv_width;
    char *attn = rotated + es * rows * rotated_width, *gate_up = attn + es * rows * q_size;
    char *act = gate_up + es * rows * 2 * inter;
    int status = 0;
    for (int l = 0; l < s->num_layers && status == 0; l++) {
        const LayerWeights *w = &s->layers[l];
        status = ragserve_add_rms_norm(bf16, rows, H, l == 0 ? NULL : s->hidden, s->residual, w->input_norm, s->eps,
                                       normed, s->threads);
        if (status == 0) status = linear(s, qkv_width, H, normed, w->qkv, w->qkv_pairs, w->qkv_bias, qkv);
        if (status != 0) break;
        /* q and k are adjacent columns of qkv: rotated as one [rows, heads + kv_heads, D]. */
        ragserve_rotary(bf16, rows, s->num_heads + s->num_kv_heads, (int)D, qkv, qkv_width, s->cos, s->sin, rotated,
                        rotated_width, s->threads);
        status = ragserve_paged_attention(s->attn, rotated, rotated_width, rotated + es * q_size, rotated_width,
                                          qkv + es * rotated_width, qkv_width, s->slots,
                                          s->kv + es * l * s->layer_stride, attn);
        if (status == 0) status = linear(s, H, q_size, attn, w->o, w->o_pairs, w->o_bias, s->hidden);
        if (status == 0)
            status = ragserve_add_rms_norm(bf16, rows, H, s->hidden, s->residual, w->post_norm, s->eps, normed,
                                           s->threads);
        if (status == 0)
            status = linear(s, 2 * inter, H, normed, w->gate_up, w->gate_up_pairs, w->gate_up_bias, gate_up);
        if (status == 0) status = ragserve_silu_mul(bf16, rows, inter, gate_up, 2 * inter, act, s->threads);
        if (status == 0) status = linear(s, H, inter, act, w->down, w->down_pairs, w->down_bias, s->hidden);
    }
    free(buffer);
    return status;
}
