/* Per-layer element-wise work of a Llama decoder on the CPU, one call each:
 * residual add + RMSNorm, SiLU(gate) * up, and the rotary embedding of q and k.
 *
 * Op order and roundings follow transformers' eager code (the reference in tests): in
 * bf16, every tensor-level op rounds to bf16 where torch would, and float32 sums run in
 * float32. Rows are spread over OpenMP threads when there are enough of them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define MIN_ROWS_PER_THREAD 16

static inline int threads_for(int64_t rows, int threads) {
    int64_t most = rows / MIN_ROWS_PER_THREAD;
    return most < 1 ? 1 : (most < threads ? (int)most : threads);
}

static inline vf load_any(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? load_bf16((const uint16_t *)p + i) : loadu((const float *)p + i);
}

static inline void store_any(void *p, int64_t i, vf x, int is_bf16) {
    if (is_bf16) store_bf16((uint16_t *)p + i, x);
    else storeu((float *)p + i, x);
}

/* out = weight * dtype(s * rsqrt(mean(s^2) + eps)) per row, where s = residual + x (stored
 * back into residual) or, with x NULL, s = residual. Rows are `cols` long and contiguous;
 * cols is a multiple of VL. */
int ragserve_add_rms_norm(int is_bf16, int64_t rows, int64_t cols, const void *x, void *residual,
                          const void *weight, float eps, void *out, int threads) {
    if (cols % VL) return -1;
#pragma omp parallel for num_threads(threads_for(rows, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        vf acc = splat(0.0f);
        for (int64_t c = 0; c < cols; c += VL) {
            vf s = load_any(residual, base + c, is_bf16);
            if (x != NULL) {
                s = round_as(s + load_any(x, base + c, is_bf16), is_bf16);
                store_any(residual, base + c, s, is_bf16);
            }
            acc += s * s;
        }
        const float inv = 1.0f / sqrtf(hsum(acc) / (float)cols + eps);
        for (int64_t c = 0; c < cols; c += VL) {
            vf normed = round_as(load_any(residual, base + c, is_bf16) * inv, is_bf16);
            store_any(out, base + c, load_any(weight, c, is_bf16) * normed, is_bf16);
        }
    }
    return 0;
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], rows `stride` elements apart. */
int ragserve_silu_mul(int is_bf16, int64_t rows, int64_t inter, const void *gate_up, int64_t stride,
                      void *out, int threads) {
    if (inter % VL) return -1;
#pragma omp parallel for num_threads(threads_for(rows, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < inter; c += VL) {
            vf g = load_any(gate_up, r * stride + c, is_bf16);
            vf u = load_any(gate_up, r * stride + inter + c, is_bf16);
            store_any(out, r * inter + c, silu_times(g, u, is_bf16), is_bf16);
        }
    }
    return 0;
}

/* Half-rotation ("neox") rotary embedding of `heads` heads of head_dim per token:
 * dst[h] = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] with cos/sin rows [tokens, head_dim/2].
 * src rows are src_stride elements apart (heads contiguous within a row); dst likewise.
 * Tokens are spread over up to `threads` threads.
 *
 * NOTE: no fused multiply-adds here: transformers rounds each product before the sum, and
 * the float32 path must match it bit for bit. */
__attribute__((optimize("fp-contract=off"))) void ragserve_rotary(
    int is_bf16, int64_t tokens, int heads, int head_dim, const void *src, int64_t src_stride,
    const void *cos, const void *sin, void *dst, int64_t dst_stride, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens, threads)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int h = 0; h < heads; h++) {
            const int64_t s = t * src_stride + (int64_t)h * head_dim, d = t * dst_stride + (int64_t)h * head_dim;
            int i = 0;
            for (; i + VL <= half; i += VL) {
                vf c = load_any(cos, t * half + i, is_bf16), n = load_any(sin, t * half + i, is_bf16);
                vf x1 = load_any(src, s + i, is_bf16), x2 = load_any(src, s + half + i, is_bf16);
                vf a = round_as(x1 * c, is_bf16), b = round_as(x2 * n, is_bf16);
                vf e = round_as(x2 * c, is_bf16), f = round_as(x1 * n, is_bf16);
                store_any(dst, d + i, a - b, is_bf16);
                store_any(dst, d + half + i, e + f, is_bf16);
            }
            for (; i < half; i++) {
                float c, n, x1, x2;
                if (is_bf16) {
                    c = bf16_to_f32(((const uint16_t *)cos)[t * half + i]);
                    n = bf16_to_f32(((const uint16_t *)sin)[t * half + i]);
                    x1 = bf16_to_f32(((const uint16_t *)src)[s + i]);
                    x2 = bf16_to_f32(((const uint16_t *)src)[s + half + i]);
                    float a = bf16_to_f32(f32_to_bf16(x1 * c)), b = bf16_to_f32(f32_to_bf16(x2 * n));
                    float e = bf16_to_f32(f32_to_bf16(x2 * c)), f = bf16_to_f32(f32_to_bf16(x1 * n));
                    ((uint16_t *)dst)[d + i] = f32_to_bf16(a - b);
                    ((uint16_t *)dst)[d + half + i] = f32_to_bf16(e + f);
                } else {
                    c = ((const float *)cos)[t * half + i];
                    n = ((const float *)sin)[t * half + i];
                    x1 = ((const float *)src)[s + i];
                    x2 = ((const float *)src)[s + half + i];
                    float a = x1 * c, b = x2 * n, e = x2 * c, f = x1 * n;
                    ((float *)dst)[d + i] = a - b;
                    ((float *)dst)[d + half + i] = e + f;
                }
            }
        }
    }
}
