/* Tandem's glue to ggml's CPU kernels: a linear layer y = x W^T over W stored in one of ggml's
 * block-quantized types (Q4_1, Q8_0, ...). The kernels are ggml's (llama.cpp's): each activation
 * row is quantized with the type's `from_float` to its `vec_dot_type`, and every output is one
 * call of the type's `vec_dot`. What is ours is only the loop: output rows split over OpenMP
 * threads (the same libgomp as torch's, so one thread pool), in tiles of weight rows that stay
 * in cache across the batch's activation rows. Built by tandem.engine.ggml_kernels. */
#include <ggml.h>
#include <ggml-cpu.h>
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
