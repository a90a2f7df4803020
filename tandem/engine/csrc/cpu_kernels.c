/* Tandem's CPU kernels, built against ggml by tandem.engine.ggml_kernels.
 *
 * tg_linear: Tandem's glue to ggml's CPU kernels: a linear layer y = x W^T over W stored in one of ggml's
 * block-quantized types (Q4_1, Q8_0, ...). The kernels are ggml's (llama.cpp's): each activation
 * row is quantized with the type's `from_float` to its `vec_dot_type`, and every output is one
 * call of the type's `vec_dot`. What is ours is only the loop: output rows split over OpenMP
 * threads (the same libgomp as torch's, so one thread pool), in tiles of weight rows that stay
 * in cache across the batch's activation rows.
 *
 * tg_paged_decode_attention: ours alone (no ggml): attention of decode rows read straight from
 * the paged KV pool, where the torch path gathers and pads every row's blocks per layer. */
#include <ggml.h>
#include <ggml-cpu.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE_ROWS 16

int tg_init(void) {
    ggml_cpu_init();
    return 0;
}

size_t tg_row_size(int type, int64_t k) { return ggml_row_size((enum ggml_type)type, k); }

size_t tg_quantize(int type, const float *src, void *dst, int64_t nrows, int64_t k) {
    return ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, nrows, k, NULL);
}

/* n values of `type` in src (whole blocks) to fp32 */
int tg_dequantize(int type, const void *src, float *dst, int64_t n) {
    const struct ggml_type_traits *t = ggml_get_type_traits((enum ggml_type)type);
    if (t->to_float == NULL) return -1;
    t->to_float(src, dst, n);
    return 0;
}

/* y [m, n_out] = x [m, k] @ W^T, W [n_out, k] as rows of `type`. Returns 0, -1 when ggml has no
 * dot product for the type, -2 when the activation rows' scratch cannot be allocated. */
int tg_linear(int type, const char *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
              int nthreads) {
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    const struct ggml_type_traits_cpu *tv = ggml_get_type_traits_cpu(t->vec_dot_type);
    if (t->vec_dot == NULL || (t->vec_dot_type != (enum ggml_type)type && tv->from_float == NULL)) return -1;
    const size_t wrow = ggml_row_size((enum ggml_type)type, k);
    const size_t xrow = ggml_row_size(t->vec_dot_type, k);
    char *scratch = malloc((size_t)m * xrow + 1); /* the rows quantized to the dot product's type */
    if (scratch == NULL) return -2;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) tv->from_float(x + i * k, scratch + i * xrow, k);
#pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < n_out; r0 += TILE_ROWS) {
            const int64_t r1 = r0 + TILE_ROWS < n_out ? r0 + TILE_ROWS : n_out;
            for (int64_t i = 0; i < m; i++) {
                for (int64_t r = r0; r < r1; r++) {
                    t->vec_dot((int)k, &y[i * n_out + r], 0, w + r * wrow, 0, scratch + i * xrow, 0, 1);
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* Paged attention of decode rows (one new token each) over Tandem's KV pool, fp32. Row i's query
 * heads q[qrow[i]] ([H, d], contiguous) attend over its cached tokens, which lie in blocks
 * table[indptr[i] .. indptr[i + 1]) of `bs` tokens, the last block holding last_len[i] of them
 * (the pool's CSR block table, kv_pool.PagedLayout); a block's K (and V) is one contiguous
 * [bs, kv_heads, d] run, blocks `block_stride` floats apart (either pool layout).
 * Query head h reads kv head h / (H / kv_heads). Output rows go to out[qrow[i]]. Work items are
 * (row, kv head) pairs: the group's scores over the whole context, an exact softmax, then the
 * weighted sum of V, so each K and V row is read once per group and nothing is gathered or
 * padded. Returns 0, -1 for heads that do not group evenly, -2 when scratch cannot be had. */
int tg_paged_decode_attention(const float *q, const float *k, const float *v, int64_t block_stride,
                              const int64_t *qrow, const int32_t *indptr, const int32_t *table,
                              const int32_t *last_len, int64_t n, int64_t heads, int64_t kv_heads,
                              int64_t d, int64_t bs, float scale, float *out, int nthreads) {
    if (kv_heads < 1 || heads % kv_heads != 0) return -1;
    const int64_t group = heads / kv_heads;
#define TG_SEQ_LEN(i) ((int64_t)(indptr[(i) + 1] - indptr[(i)] - 1) * bs + last_len[(i)])
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = TG_SEQ_LEN(i) > max_len ? TG_SEQ_LEN(i) : max_len;
    if (nthreads < 1) nthreads = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_len)); /* [group, len] */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n * kv_heads; item++) {
            if (scores == NULL) continue;
            const int64_t i = item / kv_heads, g = item % kv_heads, len = TG_SEQ_LEN(i);
            const float *qi = q + (qrow[i] * heads + g * group) * d;
            float *oi = out + (qrow[i] * heads + g * group) * d;
            const int32_t *blocks = table + indptr[i];
            for (int64_t t = 0; t < len; t++) {
                const float *kt = k + (int64_t)blocks[t / bs] * block_stride + ((t % bs) * kv_heads + g) * d;
                for (int64_t h = 0; h < group; h++) {
                    const float *qh = qi + h * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t e = 0; e < d; e++) dot += qh[e] * kt[e];
                    scores[h * len + t] = dot * scale;
                }
            }
            for (int64_t h = 0; h < group; h++) {
                float *sh = scores + h * len, mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;
                for (int64_t t = 0; t < len; t++) {
                    sh[t] = expf(sh[t] - mx);
                    sum += sh[t];
                }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; t++) sh[t] *= inv;
                for (int64_t e = 0; e < d; e++) oi[h * d + e] = 0.0f;
            }
            for (int64_t t = 0; t < len; t++) {
                const float *vt = v + (int64_t)blocks[t / bs] * block_stride + ((t % bs) * kv_heads + g) * d;
                for (int64_t h = 0; h < group; h++) {
                    const float p = scores[h * len + t];
                    float *oh = oi + h * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; e++) oh[e] += p * vt[e];
                }
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
#undef TG_SEQ_LEN
}

/* RMSNorm of m rows of k floats (Hugging Face's: x / sqrt(mean(x^2) + eps) * w, in fp32): one call
 * where torch's CPU rms_norm runs several operators (about 18 us for one row of 576 here). */
void tg_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t k, float eps, int nthreads) {
    if (nthreads < 1 || m * k < 65536) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * k;
        float *yi = y + i * k;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t e = 0; e < k; e++) ss += xi[e] * xi[e];
        const float r = 1.0f / sqrtf(ss / (float)k + eps);
#pragma omp simd
        for (int64_t e = 0; e < k; e++) yi[e] = xi[e] * r * w[e];
    }
}
