/* Tandem's CPU kernels, built against ggml by tandem.engine.ggml_kernels.
 *
 * tg_linear: Tandem's glue to ggml's CPU kernels: a linear layer y = x W^T over W stored in one of ggml's
 * block-quantized types (Q4_1, Q8_0, ...). The kernels are ggml's (llama.cpp's): each activation
 * row is quantized with the type's `from_float` to its `vec_dot_type`, and every output is one
 * call of the type's `vec_dot`. What is ours is only the loop: output rows split over OpenMP
 * threads (the same libgomp as torch's, so one thread pool), in tiles of weight rows that stay
 * in cache across the batch's activation rows.
 *
 * tg_paged_decode_attention: ours (ggml's only for its vectorized softmax): attention of decode
 * rows read straight from the paged KV pool, where the torch path gathers and pads every row's
 * blocks per layer.
 *
 * tg_decode_layers: ours, over ggml's dot products: whole decoder layers of a decode step in one
 * call, so a step is one C call instead of some 15 torch ops and 4 ctypes calls per layer.
 *
 * tg_repack_x8 / tg_linear_x8: Q4_0 and Q4_1 weights in ggml's 8-row interleaved layout for its AVX2
 * gemm and gemv (llama.cpp's CPU "repack" of Q4_0), which unpack each weight block once for 4
 * activation rows instead of once per row and vec_dot call. Q4_1 is not one of llama.cpp's repacked
 * types; ours is the decomposition: a Q4_1 value d * q + m is the Q4_0 value d * (q - 8) (the same d
 * and nibbles, so ggml's Q4_0 kernel runs them unchanged) plus the block's offset m + 8 d, whose
 * part of a dot product is that offset times the sum of the block's activations, added after the
 * gemm from a [rows, k / 32] table of offsets. No weight is quantized again: the result is the
 * Q4_1 weights' own, to float rounding and the activations' 8-bit rounding (as in vec_dot).
 *
 * x8_avx2_tile: ours, where the CPU has AVX2 and no AVX512-VNNI: the same repacked weights and the
 * same 8-bit activations, unsigned nibbles times signed bytes (one vpmaddubsw, no sign fix-ups) and
 * the block's products summed in 16 bits, up to X8_AVX2_TILE activation rows per weight unpack,
 * every row count, each row's outputs those of the row alone (and, as it happens, ggml's gemv's).
 *
 * x8_vnni_tile: ours, where the CPU has AVX512-VNNI: the same repacked weights and the same
 * 8-bit activations through vpdpbusd, up to 8 activation rows per weight unpack, each row's
 * outputs bit for bit those of ggml's gemv (so of the row alone).
 *
 * tg_repack_q8_x16 / tg_linear_q8_x16: ours, where the CPU has AVX512-VNNI: Q8_0 weights (an
 * lm_head) 16 rows interleaved for vpdpbusd, each row's outputs those of the row alone.
 *
 * tg_repack_q8_x8 / tg_linear_q8_x8: ours, where the CPU has AVX2 and no AVX512-VNNI: the same Q8_0
 * weights 8 rows interleaved for vpmaddubsw (signs moved to the activations, as ggml's vec_dot does),
 * each row's outputs those of the row alone. */
#include <ggml.h>
#include <ggml-cpu.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TG_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TG_VNNI 1 /* x8_rows's calls of VNNI_MIN_ROWS rows or more run x8_vnni_tile */
#elif defined(TG_AVX2) && defined(__F16C__)
#define TG_X8_AVX2 1 /* x8_rows runs x8_avx2_tile */
/* Activation rows a weight unpack serves: six rows' 16-bit sums and fp32 accumulators beside four
 * weight registers fill the 16 ymm registers. SmolLM2's projections (1536 x 576, 576 x 1536) on 2
 * AVX2 cores, 2026-12-07: tiles of 6 rows 1.3-2.6x ggml's gemm at 1-16 rows, tiles of 4 and 8 rows
 * 1.1-2.3x and 1.2-2.6x (the 16-row call 1.28x / 1.34x against 1.48x). */
#define X8_AVX2_TILE 6 /* x8_avx2_rows runs the 1-5 rows left over after whole tiles */
_Static_assert(X8_AVX2_TILE == 6, "x8_avx2_rows's cases for the rows left over");
#endif

#define TILE_ROWS 16
/* Work the threads take at a time in the projections of calls of GRAB_MIN_ROWS rows or more, as
 * they get to it (OpenMP's dynamic schedule) instead of a fixed share each: the services share two
 * cores with the router, Redis and the clients, and with a fixed share a thread the OS preempts
 * holds up the other at the next barrier for as long as it is away (decode steps of 8 rows took
 * 55 ms in decode_svc against 40 in process). 64 output rows a grab. Calls of fewer rows keep one
 * equal share per thread: a grab of one row's 64 outputs is a microsecond of work, and single-row
 * steps ran 10 % slower in small grabs. */
#define TILES_PER_GRAB 4
#define X8_GROUPS_PER_GRAB 8
#define GRAB_MIN_ROWS 4

/* Inside a parallel region: how many of `units` work units a thread takes at a time for a call
 * of m rows (GRAB_MIN_ROWS above). */
static int64_t grab_size(int64_t units, int64_t m, int64_t per_grab) {
    const int64_t nt = omp_get_num_threads();
    const int64_t share = (units + nt - 1) / nt;
    return m >= GRAB_MIN_ROWS ? per_grab : (share > 0 ? share : 1);
}

/* ggml-cpu's vectorized softmax numerator (exported by libggml-cpu, declared in its internal
 * vec.h, not in a public header): y[i] = exp(x[i] - max) for i < n, returns their sum. */
double ggml_vec_soft_max_f32(const int n, float *y, const float *x, float max);
/* ... and its SwiGLU (vec.h too): y[i] = silu(x[i]) * g[i], exp by its vectorized approximation. */
void ggml_vec_swiglu_f32(const int n, float *y, const float *x, const float *g);

/* ggml-cpu's repacked Q4_0 kernels and their activation quantizer (exported by libggml-cpu,
 * declared in its internal repack.h): 4 activation rows of k floats to Q8_0 blocks interleaved 8
 * bytes at a time; y [nr, nc] (rows bs floats apart) = those rows (nr a multiple of 4) against nc
 * weight rows (a multiple of 8) in the 8-row layout; the gemv takes one row of plain Q8_0 blocks. */
void ggml_quantize_mat_q8_0_4x8(const float *x, void *vy, int64_t k);
void ggml_gemm_q4_0_8x8_q8_0(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);
void ggml_gemv_q4_0_8x8_q8_0(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);

/* Tandem's type id (beyond ggml's) of weights repacked by tg_repack_x8, as tg_layer names it. */
#define TG_Q4_X8 1000
#define QK 32                    /* values per Q4_0 / Q4_1 / Q8_0 block */
#define X8_GROUP_BYTES 144       /* 8 rows of one Q4_0 block: 8 fp16 scales, 8 x 16 bytes of nibbles */
#define Q8_ROW_BLOCK_BYTES 34    /* one Q8_0 block: fp16 scale, 32 int8 */

/* The KV pool's element types: ggml's ids of fp32, fp16 and bf16. */
static int kv_type_ok(int kv_type) {
    return kv_type == GGML_TYPE_F32 || kv_type == GGML_TYPE_F16 || kv_type == GGML_TYPE_BF16;
}

static size_t kv_elem_size(int kv_type) { return kv_type == GGML_TYPE_F32 ? 4 : 2; }

/* n pool elements from element `at` of `base`, as fp32: in place for an fp32 pool, else
 * converted into tmp (ggml's row converters). */
static const float *kv_load(const char *base, int64_t at, int kv_type, int64_t n, float *tmp) {
    if (kv_type == GGML_TYPE_F16) {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)base + at, tmp, n);
        return tmp;
    }
    if (kv_type == GGML_TYPE_BF16) {
        ggml_cpu_bf16_to_fp32((const ggml_bf16_t *)base + at, tmp, n);
        return tmp;
    }
    return (const float *)base + at;
}

/* n fp32 values to the pool from element `at` of `base`, rounded to its type. */
static void kv_store(char *base, int64_t at, int kv_type, const float *src, int64_t n) {
    if (kv_type == GGML_TYPE_F16)
        ggml_cpu_fp32_to_fp16(src, (ggml_fp16_t *)base + at, n);
    else if (kv_type == GGML_TYPE_BF16)
        ggml_cpu_fp32_to_bf16(src, (ggml_bf16_t *)base + at, n);
    else
        memcpy((float *)base + at, src, sizeof(float) * (size_t)n);
}

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

/* Inside a parallel region: m rows of x (k floats each, `ldx` apart) quantized to the dot
 * product's type of weights of `type`, each row `qrow` bytes apart in q. */
static void quantize_rows(const struct ggml_type_traits_cpu *t, const float *x, int64_t ldx, int64_t m, int64_t k,
                          char *q, size_t qrow) {
    const struct ggml_type_traits_cpu *tv = ggml_get_type_traits_cpu(t->vec_dot_type);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++) tv->from_float(x + i * ldx, q + i * qrow, k);
}

/* Inside a parallel region: y[i, r] (+)= row r of W (n_out rows of `type`) . activation row i (q,
 * quantized by quantize_rows), for m rows; `accumulate` adds to y (a fused residual). Output rows
 * are taken by the threads in tiles that stay in cache across the activation rows, a few tiles at
 * a time as each thread gets to them (dynamic: a thread the OS preempts for another process on
 * these cores delays the others by a grab, not by its whole share; see TILES_PER_GRAB). */
static void matvec_rows(const struct ggml_type_traits_cpu *t, const char *w, size_t wrow, int64_t n_out, int64_t k,
                        const char *q, size_t qrow, int64_t m, float *y, int64_t ldy, int accumulate) {
    const int64_t grab = grab_size((n_out + TILE_ROWS - 1) / TILE_ROWS, m, TILES_PER_GRAB);
#pragma omp for schedule(dynamic, grab)
    for (int64_t r0 = 0; r0 < n_out; r0 += TILE_ROWS) {
        const int64_t r1 = r0 + TILE_ROWS < n_out ? r0 + TILE_ROWS : n_out;
        for (int64_t i = 0; i < m; i++) {
            for (int64_t r = r0; r < r1; r++) {
                float s;
                t->vec_dot((int)k, &s, 0, w + r * wrow, 0, q + i * qrow, 0, 1);
                y[i * ldy + r] = accumulate ? y[i * ldy + r] + s : s;
            }
        }
    }
}

/* Whether ggml has a dot product for weights of `type` (and a way to quantize activations to it). */
static int has_dot(int type) {
    if (type == TG_Q4_X8) return 1;
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    const struct ggml_type_traits_cpu *tv = ggml_get_type_traits_cpu(t->vec_dot_type);
    return t->vec_dot != NULL && (t->vec_dot_type == (enum ggml_type)type || tv->from_float != NULL);
}

static size_t act_row_size(int type, int64_t k) {
    if (type == TG_Q4_X8) return ggml_row_size(GGML_TYPE_Q8_0, k);
    return ggml_row_size(ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot_type, k);
}

/* y [m, n_out] = x [m, k] @ W^T, W [n_out, k] as rows of `type`. Returns 0, -1 when ggml has no
 * dot product for the type, -2 when the activation rows' scratch cannot be allocated. */
int tg_linear(int type, const char *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
              int nthreads) {
    if (!has_dot(type)) return -1;
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    const size_t wrow = ggml_row_size((enum ggml_type)type, k), xrow = act_row_size(type, k);
    char *scratch = malloc((size_t)m * xrow + 1); /* the rows quantized to the dot product's type */
    if (scratch == NULL) return -2;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        quantize_rows(t, x, k, m, k, scratch, xrow);
        matvec_rows(t, w, wrow, n_out, k, scratch, xrow, m, y, n_out, 0);
    }
    free(scratch);
    return 0;
}

/* The 8-row layout of n rows of Q4_0 or Q4_1 blocks (k values each; n a multiple of 8, k of 32) into
 * dst (n / 8 * k / 32 groups of X8_GROUP_BYTES): group (g, b) holds block b of rows 8 g .. 8 g + 7,
 * their scales, then their nibble bytes 8 at a time, row by row (bytes 0-7 of each row's 16, then
 * bytes 8-15), each nibble XOR 8 so that ggml's kernel reads it as the signed q - 8. For Q4_1,
 * corr [k / 32, n] gets each block's offset m + 8 d, block-major (tg_linear_x8 adds its term, a
 * block's offsets for a run of outputs at a time); NULL for Q4_0.
 * Returns 0, -1 for another type or shape, or where ggml's kernels for this layout are not the
 * AVX2 ones (this build's CPU lacks AVX2: the plain rows are faster there). */
int tg_repack_x8(int type, const char *src, int64_t n, int64_t k, char *dst, float *corr) {
#if !defined(__AVX2__)
    return -1;
#endif
    if ((type != GGML_TYPE_Q4_0 && type != GGML_TYPE_Q4_1) || n % 8 || k % QK) return -1;
    if ((type == GGML_TYPE_Q4_1) != (corr != NULL)) return -1;
    const int64_t nb = k / QK;
    const size_t block = ggml_type_size((enum ggml_type)type), scale_at = 0, qs_at = type == GGML_TYPE_Q4_1 ? 4 : 2;
    for (int64_t g = 0; g < n / 8; g++) {
        for (int64_t b = 0; b < nb; b++) {
            char *out = dst + (g * nb + b) * X8_GROUP_BYTES;
            for (int j = 0; j < 8; j++) {
                const char *in = src + ((g * 8 + j) * nb + b) * block;
                memcpy(out + 2 * j, in + scale_at, 2);
                for (int half = 0; half < 2; half++)
                    for (int e = 0; e < 8; e++)
                        out[16 + half * 64 + j * 8 + e] = (char)(in[qs_at + half * 8 + e] ^ 0x88);
                if (corr != NULL) {
                    ggml_fp16_t d16, m16;
                    memcpy(&d16, in, 2);
                    memcpy(&m16, in + 2, 2);
                    corr[b * n + g * 8 + j] = ggml_fp16_to_fp32(m16) + 8.0f * ggml_fp16_to_fp32(d16);
                }
            }
        }
    }
    return 0;
}

/* The sum of activation block b of row j as quantized for the gemm, the rows' blocks from `at`: 4
 * rows' Q8_0 blocks interleaved 8 bytes at a time (`four`: chunk c of a block's 16 is row c % 4's),
 * else rows of nb plain Q8_0 blocks. */
static float q8_block_sum(const char *at, int64_t j, int four, int64_t b, int64_t nb) {
    ggml_fp16_t d16;
    int sum = 0;
    if (four) {
        const char *blk = at + b * (4 * Q8_ROW_BLOCK_BYTES);
        memcpy(&d16, blk + 2 * j, 2);
        for (int64_t c = j; c < 16; c += 4)
            for (int e = 0; e < 8; e++) sum += (int8_t)blk[8 + c * 8 + e];
    } else {
        const char *blk = at + (j * nb + b) * Q8_ROW_BLOCK_BYTES;
        memcpy(&d16, blk, 2);
        for (int e = 0; e < QK; e++) sum += (int8_t)blk[2 + e];
    }
    return ggml_fp16_to_fp32(d16) * (float)sum;
}

/* Outputs [c0, c1) of one row of the gemm, o, plus the Q4_1 offsets' term (the sum over its nb
 * blocks of corr [nb, n_out] times the row's activation block sums xr; nb = 0 for none), then
 * added to yo (a fused residual) when yo is not NULL, else left in o. The sums run 64 outputs at a
 * time in registers (eight independent chains over the blocks), where a loop over the blocks that
 * loaded and stored the outputs at every block spent most of its time on those stores. */
static void x8_finish_row(float *restrict o, float *restrict yo, const float *restrict corr, int64_t n_out,
                          const float *restrict xr, int64_t nb, int64_t c0, int64_t c1) {
    int64_t c = c0;
#ifdef TG_AVX2
    for (; c + 64 <= c1; c += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(o + c + 8 * j);
        for (int64_t b = 0; b < nb; b++) {
            const __m256 sv = _mm256_set1_ps(xr[b]);
            const float *cb = corr + b * n_out + c;
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(sv, _mm256_loadu_ps(cb + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) {
            if (yo != NULL) _mm256_storeu_ps(yo + c + 8 * j, _mm256_add_ps(a[j], _mm256_loadu_ps(yo + c + 8 * j)));
            else _mm256_storeu_ps(o + c + 8 * j, a[j]);
        }
    }
#endif
    for (; c < c1; c++) {
        float v = o[c];
        for (int64_t b = 0; b < nb; b++) v = fmaf(corr[b * n_out + c], xr[b], v); /* as the vector path rounds */
        if (yo != NULL) yo[c] += v;
        else o[c] = v;
    }
}

/* Fewest rows left over after whole groups of 16 that go through ggml's gemm as one more group of
 * 16, zero rows after them: its AVX2 gemm takes activation rows 16 at a time (the weights unpacked
 * once for all 16) only over a call's leading multiple of 16, the rest 4 at a time. SmolLM2's
 * forwards on 2 AVX2 cores, paired in one process (bench/x8_pad.py --pad16, 10 pairs, 2026-12-07):
 * decode steps of 14 / 15 rows 1.08x / 1.15x faster padded, 30 / 31 rows 1.11x / 1.05x, a 13-token
 * prompt chunk beside a decode row 1.14x; 12 / 13 rows padded (a threshold of 12) 0.94x / 0.96x,
 * slower. So from 14 (TANDEM_X8_PAD16: another threshold, 0 for none; read at every call, for A/B
 * measurements). */
#define X8_PAD16_MIN 14

static int64_t x8_pad16_min(void) {
    const char *v = getenv("TANDEM_X8_PAD16");
    if (v == NULL || *v == '\0') return X8_PAD16_MIN;
    const long n = strtol(v, NULL, 10);
    return n > 0 && n < 16 ? n : 16; /* 0 (or nonsense): never */
}

/* x8_rows's padded group for m rows: its size, 16 when X8_PAD16_MIN or more rows are left over
 * after whole groups of 16, else 4 when 2 or 3 are left over after whole groups of 4, else 0
 * (none); its first row, after those whole groups, at *start. */
static int64_t x8_tail(int64_t m, int64_t *start) {
    if (m % 16 >= x8_pad16_min()) {
        *start = m / 16 * 16;
        return 16;
    }
    *start = m / 4 * 4;
    return m - *start >= 2 ? 4 : 0;
}

/* Activation rows (of m) that x8_rows quantizes in groups of 4 for ggml's gemm: m rounded down to
 * 4, or up when 2 or 3 rows are left over (or to 16 when X8_PAD16_MIN or more are left over after
 * whole groups of 16, above). A row through the gemv costs about what 4 through the
 * gemm do (each unpacks the weights once). SmolLM2's decode steps on 2 AVX2 cores, paired in one
 * process (bench/x8_pad.py, 2026-11-28): 3 / 7 / 11 / 15 rows 1.18 / 1.12 / 1.09 / 1.08x faster
 * padded, 2 left over even, multiples of 4 unchanged. One row left over runs the gemv, which costs
 * less than 3 zero rows. Scratch for the quantized rows is sized for x8_padded(m). */
static int64_t x8_padded(int64_t m) {
    int64_t start;
    const int64_t group = x8_tail(m, &start);
    return group ? start + group : m;
}

/* Whether the A/B switch `name` is "0" (off); read at every call, so a benchmark flips it between
 * steps: TANDEM_X8_PAD (bench/x8_pad.py), TANDEM_X8_VNNI and TANDEM_X8_AVX2 (bench/x8_kernel.py). */
static int switched_off(const char *name) {
    const char *v = getenv(name);
    return v != NULL && strcmp(v, "0") == 0;
}

/* Whether m rows go through the gemm with a padded group (x8_padded), unless TANDEM_X8_PAD=0, or
 * x8_avx2_rows takes the call (unless TANDEM_X8_AVX2=0: then ggml's gemm and gemv run). */
static int x8_padding(int64_t m) {
#ifdef TG_X8_AVX2
    if (!switched_off("TANDEM_X8_AVX2")) return 0; /* x8_avx2_rows takes every call: no scratch for padded rows */
#endif
    return !switched_off("TANDEM_X8_PAD") && x8_padded(m) > m;
}

/* Inside a grab of x8_rows or x8_vnni_rows (fewer than VNNI_FINISH_MIN_ROWS rows): outputs [c0, c1) of its m rows (in out, ldo floats
 * apart) finished by x8_finish_row when there are Q4_1 offsets to add or a residual y to add to. */
static void x8_finish_rows(float *out, int64_t ldo, float *y, int64_t ldy, const float *corr, int64_t n_out,
                           const float *xs, int64_t nb, int64_t m, int accumulate, int64_t c0, int64_t c1) {
    if (corr == NULL && !accumulate) return;
    for (int64_t r = 0; r < m; r++)
        x8_finish_row(out + r * ldo, accumulate ? y + r * ldy : NULL, corr, n_out, xs + r * nb, corr != NULL ? nb : 0,
                      c0, c1);
}

/* x8_rows's `pad` when `padding` (x8_padding's answer for the call's m), for a largest k or n_out of
 * `widest`: NULL when no group is padded. The caller keeps `padding` to tell that NULL from a failed
 * allocation, so TANDEM_X8_PAD is read once per call. */
static float *x8_pad_scratch(int padding, int64_t widest) {
    return padding ? malloc(sizeof(float) * (size_t)(16 * widest)) : NULL;
}

#ifdef TG_AVX2
/* One activation block as the kernel reads it: Q8_0's 32 values (as ggml quantizes them), its
 * scale in fp32, and the two lane halves' correction (see x8_act_quantize). */
typedef struct {
    int8_t qs[QK];
    float d;
    int32_t corr[2];
} act_block;
#define ACT_BLOCK_BYTES 44
_Static_assert(sizeof(act_block) == ACT_BLOCK_BYTES, "act_block is 44 bytes");

/* One block of 32 activations quantized as ggml's Q8_0 (`q8`'s from_float) into out's values and
 * scale (its corr is the caller's). */
static inline void act_block_values(const struct ggml_type_traits_cpu *q8, const float *xb, act_block *out) {
    char blk[Q8_ROW_BLOCK_BYTES];
    q8->from_float(xb, blk, QK);
    ggml_fp16_t d16;
    memcpy(&d16, blk, 2);
    memcpy(out->qs, blk + 2, QK);
    out->d = ggml_fp16_to_fp32(d16);
}

/* Row i of x [., k] to nb act_blocks at q (and its block sums, each d * the sum of its values, to
 * xs when not NULL: the Q4_1 offsets' term). The kernel multiplies the unsigned nibble q (0..15)
 * where the Q4_0 value is q - 8, so each lane starts from -8 x the sum of the activations it
 * pairs with: the even lanes see elements 0-3, 8-11, 16-19, 24-27 of the block, the odd ones the
 * others (x8_vnni_tile). */
static void x8_act_quantize(const float *xi, int64_t nb, act_block *q, float *xs) {
    const struct ggml_type_traits_cpu *q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    for (int64_t b = 0; b < nb; b++) {
        act_block_values(q8, xi + b * QK, q + b);
        /* each 32-bit lane j of s4 sums elements 4j..4j+3 (exact: u8 ones x s8 into 16 bits, then
         * pairs into 32); half 0 is lanes 0, 2, 4, 6, half 1 the others */
        const __m256i s4 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)q[b].qs)),
            _mm256_set1_epi16(1));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, s4);
        const int32_t half[2] = {lanes[0] + lanes[2] + lanes[4] + lanes[6], lanes[1] + lanes[3] + lanes[5] + lanes[7]};
        q[b].corr[0] = -8 * half[0];
        q[b].corr[1] = -8 * half[1];
        if (xs != NULL) xs[b] = q[b].d * (float)(half[0] + half[1]);
    }
}

/* Inside a parallel region, for x8_vnni_rows and x8_avx2_rows: the m rows of x [m, k] to act_blocks
 * at q (their block sums to xs where `sums`: Q4_1), then where the call's tiles write: straight into
 * y, finishing their outputs themselves (the Q4_1 offsets' term, the residual when `accumulate`),
 * for calls of `fused_min` rows or more; else their raw outputs into y, or into tmp [m, n_out] when
 * accumulating, for x8_finish_rows to finish. */
typedef struct {
    float *out;
    int64_t ldo;
    const float *corr; /* corr for the tiles to add, or NULL */
    int accumulate;    /* whether the tiles add to out */
    int fused;
} x8_tile_target;

static x8_tile_target x8_tiles_prepare(const float *x, int64_t m, int64_t k, act_block *q, float *xs, int sums,
                                       int64_t fused_min, const float *corr, float *y, int64_t ldy, float *tmp,
                                       int64_t n_out, int accumulate) {
    const int64_t nb = k / QK;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++) x8_act_quantize(x + i * k, nb, q + i * nb, sums ? xs + i * nb : NULL);
    /* the loop's implicit barrier: every row is quantized */
    const int fused = m >= fused_min;
    const x8_tile_target t = {fused || !accumulate ? y : tmp, fused || !accumulate ? ldy : n_out,
                              fused ? corr : NULL, fused && accumulate, fused};
    return t;
}
#endif

#ifdef TG_VNNI
/* With AVX512-VNNI, x8_rows runs calls of VNNI_MIN_ROWS rows or more through a kernel of ours
 * (x8_vnni_tile) instead of ggml's gemm, over the same repacked weights: ggml's x86 gemm takes 4
 * activation rows at a time (16 only from 16) with byte multiplies that widen to 16 bits, where
 * vpdpbusd multiplies and sums four u8 x s8 pairs into each 32-bit lane in one instruction, and
 * the weights are unpacked once for up to 8 rows. */
#define VNNI_MIN_ROWS 2
/* Outputs of the 8-row groups g and (with `two`) g + 1 of W (tg_repack_x8's layout: per block 8
 * fp16 scales, then rows 0-7's bytes 0-7 with 0x88 xored in, then their bytes 8-15) for activation
 * rows [i0, i0 + NR) of q (nb act_blocks a row), into out (ldo floats a row) from column c0. Each
 * 32-bit lane holds one weight row's four nibbles of a quarter of the block: lane 2j and 2j + 1 are
 * row j's bytes 0-3 and 4-7 (low nibbles: elements 0-3 and 4-7; high: 16-19 and 20-23), and of the
 * second 64 bytes its elements 8-15 and 24-31; the activations' matching 8 bytes are broadcast to
 * every pair of lanes. Each block's integer sum of a row (the pair's, exact) is scaled and
 * accumulated as ggml's gemv does it (fmadd of the sum by weight scale x activation scale), so a
 * row's outputs are bit for bit those of a call of that row alone (which ggml's gemv runs), in
 * any batch. NR is a constant at each call. */
static inline __attribute__((always_inline)) void x8_vnni_tile(const char *w0, const char *w1, int two, int64_t nb,
                                                               const act_block *q, int64_t i0, const int NR,
                                                               const float *corr, const float *xs, int64_t n_out,
                                                               float *y, int64_t ldy, int accumulate, int64_t c0) {
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x88);
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m512 acc[8][2];
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[2][4];
        __m512 dw[2];
        for (int h = 0; h < 2; h++) {
            if (h == 1 && !two) break;
            const char *blk = (h ? w1 : w0) + b * X8_GROUP_BYTES;
            const __m512i p0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + 16)), flip);
            const __m512i p1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + 80)), flip);
            w[h][0] = _mm512_and_si512(p0, low);
            w[h][1] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
            w[h][2] = _mm512_and_si512(p1, low);
            w[h][3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            dw[h] = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(d8));
        }
        for (int r = 0; r < NR; r++) {
            const act_block *a = q + (i0 + r) * nb + b;
            int64_t a0, a1, a2, a3, c;
            memcpy(&a0, a->qs, 8);
            memcpy(&a1, a->qs + 16, 8);
            memcpy(&a2, a->qs + 8, 8);
            memcpy(&a3, a->qs + 24, 8);
            memcpy(&c, a->corr, 8);
            const __m512i v0 = _mm512_set1_epi64(a0), v1 = _mm512_set1_epi64(a1), v2 = _mm512_set1_epi64(a2),
                          v3 = _mm512_set1_epi64(a3), start = _mm512_set1_epi64(c);
            const __m512 da = _mm512_set1_ps(a->d);
            for (int h = 0; h < 2; h++) {
                if (h == 1 && !two) break;
                __m512i dot = _mm512_dpbusd_epi32(start, w[h][0], v0);
                dot = _mm512_dpbusd_epi32(dot, w[h][1], v1);
                dot = _mm512_dpbusd_epi32(dot, w[h][2], v2);
                dot = _mm512_dpbusd_epi32(dot, w[h][3], v3);
                dot = _mm512_add_epi32(dot, _mm512_shuffle_epi32(dot, _MM_PERM_CDAB)); /* the pair's sum, in both */
                acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[h], da), acc[r][h]);
            }
        }
    }
    /* Each row's 8 or 16 outputs in one register (the even lanes of both groups), then finished
     * as x8_finish_row does it, with the same operations in the same order (so a row's outputs stay
     * those of the row alone, which ggml's gemv and x8_finish_row compute): the Q4_1 offsets' term
     * fmadd'ed block by block (corr not NULL), then added to y when accumulating. Here the offsets
     * of a block are read once for all NR rows, where x8_finish_row reads them again for each row
     * (x8_vnni_rows leaves tiles of fewer than VNNI_FINISH_MIN_ROWS rows to it). */
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __mmask16 keep = two ? 0xFFFF : 0x00FF;
    __m512 o[8];
    for (int r = 0; r < NR; r++) o[r] = _mm512_permutex2var_ps(acc[r][0], evens, two ? acc[r][1] : acc[r][0]);
    if (corr != NULL)
        for (int64_t b = 0; b < nb; b++) {
            const __m512 cb = _mm512_maskz_loadu_ps(keep, corr + b * n_out + c0);
            for (int r = 0; r < NR; r++) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(i0 + r) * nb + b]), cb, o[r]);
        }
    for (int r = 0; r < NR; r++) {
        float *yr = y + (i0 + r) * ldy + c0;
        if (accumulate) o[r] = _mm512_add_ps(o[r], _mm512_maskz_loadu_ps(keep, yr));
        _mm512_mask_storeu_ps(yr, keep, o[r]);
    }
}

/* TILE(NR) over the m activation rows in tiles of 8, then 4, 2 and 1 rows, `i` the first row of
 * each: NR is a constant at each call, so the tile's loops over its rows unroll. */
#define TG_ROW_TILES(TILE)                \
    do {                                  \
        int64_t i = 0;                    \
        for (; i + 8 <= m; i += 8) TILE(8); \
        if (m - i >= 4) {                 \
            TILE(4);                      \
            i += 4;                       \
        }                                 \
        if (m - i >= 2) {                 \
            TILE(2);                      \
            i += 2;                       \
        }                                 \
        if (m - i >= 1) TILE(1);          \
    } while (0)

/* Fewest rows whose tiles finish their own outputs (x8_vnni_tile's corr and accumulate): its
 * sums over the blocks are one dependent chain per row, so tiles of fewer rows wait on them; their
 * outputs are finished by x8_finish_rows, 64 outputs of a row at a time, instead. */
#define VNNI_FINISH_MIN_ROWS 8

/* x8_rows with AVX512-VNNI: the same contract, q holding m rows of act_blocks; from
 * VNNI_FINISH_MIN_ROWS rows the tiles finish their outputs themselves and tmp is not used. */
static void x8_vnni_rows(const char *w8, const float *corr, int64_t n_out, int64_t k, const float *x, int64_t m,
                         char *qbytes, float *xs, float *y, int64_t ldy, float *tmp, int accumulate) {
    const int64_t nb = k / QK;
    act_block *q = (act_block *)qbytes;
    const x8_tile_target t =
        x8_tiles_prepare(x, m, k, q, xs, corr != NULL, VNNI_FINISH_MIN_ROWS, corr, y, ldy, tmp, n_out, accumulate);
    const int64_t groups = n_out / 8, grab = grab_size(groups, m, X8_GROUPS_PER_GRAB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t g0 = 0; g0 < groups; g0 += grab) {
        const int64_t g1 = g0 + grab < groups ? g0 + grab : groups;
        for (int64_t g = g0; g < g1; g += 2) {
            const char *w0 = w8 + g * nb * X8_GROUP_BYTES, *w1 = w0 + nb * X8_GROUP_BYTES;
            const int two = g + 1 < g1;
#define TG_VNNI_TILE(NR) x8_vnni_tile(w0, w1, two, nb, q, i, NR, t.corr, xs, n_out, t.out, t.ldo, t.accumulate, g * 8)
            TG_ROW_TILES(TG_VNNI_TILE);
#undef TG_VNNI_TILE
        }
        if (!t.fused) x8_finish_rows(t.out, t.ldo, y, ldy, corr, n_out, xs, nb, m, accumulate, g0 * 8, g1 * 8);
    } /* the loop's implicit barrier: every output is written */
}
#endif

#ifdef TG_X8_AVX2
/* The weight columns a tile's registers hold, lane by lane (x8_avx2_tile's shuffles); the order is
 * its own inverse, so the same permutation puts a register back in column order. */
#define X8_AVX2_ORDER _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)

/* Outputs of the 8-row group at w (tg_repack_x8's layout, nb blocks; corr its Q4_1 offsets [nb,
 * n_out] or NULL) for activation rows [i0, i0 + NR) of q (nb act_blocks a row; xs their block
 * sums), into y (ldy floats a row, added to it when `accumulate`) from column c0. Per block, the
 * group's nibbles are shuffled so that each 32-bit lane holds four consecutive values of one weight
 * row (rows 0, 1, 4, 5, 2, 3, 6, 7 across the lanes), eight registers for the block's 32 values;
 * each is multiplied with the activations' matching 4 bytes, broadcast (vpmaddubsw: the unsigned
 * nibble q, 0..15, times the signed 8-bit activation, pairs summed into 16 bits), and the eight
 * products summed in 16 bits (at most 8 x 2 x 15 x 127 = 30480: exact), then in pairs into 32
 * (vpmaddwd), which leaves each lane one weight row's whole block: its integer dot product once the
 * activations' -8 x sum (the Q4_0 value is q - 8) is added, scaled by weight scale x activation
 * scale and accumulated in fp32 block by block. ggml's AVX2 gemm does signed x signed bytes (two
 * sign instructions per multiply) and adds every product into 32 bits; this does one multiply and
 * one 16-bit add per 32 byte products. A row's outputs are computed the same way whatever the tile,
 * so they are those of the row alone. NR is a constant at each call. */
static inline __attribute__((always_inline)) void x8_avx2_tile(const char *w, int64_t nb, const act_block *q,
                                                               int64_t i0, const int NR, const float *corr,
                                                               const float *xs, int64_t n_out, float *y, int64_t ldy,
                                                               int accumulate, int64_t c0) {
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x88), ones = _mm256_set1_epi16(1);
    __m256 acc[X8_AVX2_TILE];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char *blk = w + b * X8_GROUP_BYTES;
        __m256i sum[X8_AVX2_TILE];
        for (int h = 0; h < 2; h++) {
            /* bytes 8h .. 8h + 7 of each row: rows 0-3, then 4-7, two lanes a row */
            const __m256i r03 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 16 + h * 64)), flip);
            const __m256i r47 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 48 + h * 64)), flip);
            const __m256i a = _mm256_shuffle_epi32(r03, _MM_SHUFFLE(3, 1, 2, 0));
            const __m256i c = _mm256_shuffle_epi32(r47, _MM_SHUFFLE(3, 1, 2, 0));
            const __m256i first = _mm256_unpacklo_epi64(a, c), second = _mm256_unpackhi_epi64(a, c);
            /* elements 8h + 0..3, 8h + 4..7, 16 + 8h + 0..3, 16 + 8h + 4..7 of each row */
            const __m256i wv[4] = {_mm256_and_si256(first, low), _mm256_and_si256(second, low),
                                   _mm256_and_si256(_mm256_srli_epi16(first, 4), low),
                                   _mm256_and_si256(_mm256_srli_epi16(second, 4), low)};
            const int at[4] = {8 * h, 8 * h + 4, 16 + 8 * h, 20 + 8 * h};
            for (int r = 0; r < NR; r++) {
                const int8_t *qa = q[(i0 + r) * nb + b].qs;
                __m256i p = h ? sum[r] : _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {
                    int32_t v;
                    memcpy(&v, qa + at[j], 4);
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(v)));
                }
                sum[r] = p;
            }
        }
        const __m256 dw =
            _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)), X8_AVX2_ORDER);
        for (int r = 0; r < NR; r++) {
            const act_block *a = q + (i0 + r) * nb + b;
            const __m256i dot =
                _mm256_add_epi32(_mm256_madd_epi16(sum[r], ones), _mm256_set1_epi32(a->corr[0] + a->corr[1]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a->d)), acc[r]);
        }
    }
    /* back in column order, then finished as x8_finish_row does it, with the same operations in the
     * same order (so the outputs stay those of the row alone): the Q4_1 offsets' term fmadd'ed block
     * by block (corr not NULL; a block's offsets read once for the tile's rows), then added to y when
     * accumulating */
    __m256 o[X8_AVX2_TILE];
    for (int r = 0; r < NR; r++) o[r] = _mm256_permutevar8x32_ps(acc[r], X8_AVX2_ORDER);
    if (corr != NULL)
        for (int64_t b = 0; b < nb; b++) {
            const __m256 cb = _mm256_loadu_ps(corr + b * n_out + c0);
            for (int r = 0; r < NR; r++) o[r] = _mm256_fmadd_ps(_mm256_set1_ps(xs[(i0 + r) * nb + b]), cb, o[r]);
        }
    for (int r = 0; r < NR; r++) {
        float *yr = y + (i0 + r) * ldy + c0;
        _mm256_storeu_ps(yr, accumulate ? _mm256_add_ps(o[r], _mm256_loadu_ps(yr)) : o[r]);
    }
}

/* Fewest rows whose tiles finish their own outputs (x8_avx2_tile's corr and accumulate), as
 * VNNI_FINISH_MIN_ROWS for the VNNI kernel; calls of fewer leave them to x8_finish_rows. */
#define AVX2_FINISH_MIN_ROWS 8

/* x8_rows on an AVX2 CPU without AVX512-VNNI: the same contract, q holding m rows of act_blocks
 * (from AVX2_FINISH_MIN_ROWS rows tmp is not used); every row count, one included, runs
 * x8_avx2_tile, X8_AVX2_TILE rows at a time, then the rest. */
static void x8_avx2_rows(const char *w8, const float *corr, int64_t n_out, int64_t k, const float *x, int64_t m,
                         char *qbytes, float *xs, float *y, int64_t ldy, float *tmp, int accumulate) {
    const int64_t nb = k / QK;
    act_block *q = (act_block *)qbytes;
    const x8_tile_target t =
        x8_tiles_prepare(x, m, k, q, xs, corr != NULL, AVX2_FINISH_MIN_ROWS, corr, y, ldy, tmp, n_out, accumulate);
    const int64_t groups = n_out / 8, grab = grab_size(groups, m, X8_GROUPS_PER_GRAB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t g0 = 0; g0 < groups; g0 += grab) {
        const int64_t g1 = g0 + grab < groups ? g0 + grab : groups;
        for (int64_t g = g0; g < g1; g++) {
            const char *w = w8 + g * nb * X8_GROUP_BYTES;
            int64_t i = 0;
#define TG_AVX2_TILE(NR) x8_avx2_tile(w, nb, q, i, NR, t.corr, xs, n_out, t.out, t.ldo, t.accumulate, g * 8)
            for (; i + X8_AVX2_TILE <= m; i += X8_AVX2_TILE) TG_AVX2_TILE(X8_AVX2_TILE);
#define TG_AVX2_REST(NR) \
    case NR:             \
        TG_AVX2_TILE(NR); \
        break
            switch (m - i) { /* fewer than X8_AVX2_TILE rows left */
                TG_AVX2_REST(5);
                TG_AVX2_REST(4);
                TG_AVX2_REST(3);
                TG_AVX2_REST(2);
                TG_AVX2_REST(1);
            default: break;
            }
#undef TG_AVX2_REST
#undef TG_AVX2_TILE
        }
        if (!t.fused) x8_finish_rows(t.out, t.ldo, y, ldy, corr, n_out, xs, nb, m, accumulate, g0 * 8, g1 * 8);
    } /* the loop's implicit barrier: every output is written */
}
#endif

/* 1 when this build runs x8_rows's calls through x8_avx2_tile (AVX2 without AVX512-VNNI). */
int tg_x8_avx2(void) {
#ifdef TG_X8_AVX2
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build runs x8_rows's calls of VNNI_MIN_ROWS rows or more through x8_vnni_tile. */
int tg_x8_vnni(void) {
#ifdef TG_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Bytes of scratch x8_rows needs for m activation rows of `qrow` bytes as ggml's Q8_0 (or wider)
 * quantizes them: room for x8_padded(m) such rows, and for m rows of the VNNI kernel's blocks. */
static size_t x8_q_bytes(int64_t m, size_t qrow) {
    size_t bytes = (size_t)x8_padded(m) * qrow;
#if defined(TG_VNNI) || defined(TG_X8_AVX2)
    const size_t vnni = (size_t)m * ((qrow + Q8_ROW_BLOCK_BYTES - 1) / Q8_ROW_BLOCK_BYTES) * ACT_BLOCK_BYTES;
    bytes = vnni > bytes ? vnni : bytes;
#endif
    return bytes;
}

/* Inside a parallel region: y [m, n_out] (+)= x [m, k] @ W^T for W repacked by tg_repack_x8 (corr
 * its Q4_1 offsets or NULL): through x8_vnni_rows or x8_avx2_rows where they run (every repacked
 * call on an AVX2 CPU but one-row calls on AVX512-VNNI), else through ggml's gemm and gemv as
 * follows (by default only those one-row calls; TANDEM_X8_VNNI=0 / TANDEM_X8_AVX2=0 for the rest,
 * the A/B baseline, padding included). The rows are quantized to Q8_0 into q (4 at a time for ggml's gemm;
 * with `pad` the rows from x8_tail's start and zero rows after them as one more group of 4 or 16,
 * else the m % 4 others one by one for its gemv; x8_padded(m) * k / 32 * 34 bytes), the block sums
 * of x go to xs [m, k / 32] (Q4_1 only), then each thread computes its share of 8-row groups of
 * outputs for every row: into tmp [m, n_out] when `accumulate` (then added to y), else straight
 * into y. `pad` (x8_pad_scratch's for this m: NULL when no group is padded) holds 16 * max(k, n_out)
 * floats: the padded group's last rows, then its outputs. */
static void x8_rows(const char *w8, const float *corr, int64_t n_out, int64_t k, const float *x, int64_t m,
                    char *q, float *xs, float *y, int64_t ldy, float *tmp, int accumulate, float *pad) {
#ifdef TG_VNNI
    if (m >= VNNI_MIN_ROWS && !switched_off("TANDEM_X8_VNNI")) {
        x8_vnni_rows(w8, corr, n_out, k, x, m, q, xs, y, ldy, tmp, accumulate);
        return;
    }
#endif
#ifdef TG_X8_AVX2
    if (!switched_off("TANDEM_X8_AVX2")) {
        x8_avx2_rows(w8, corr, n_out, k, x, m, q, xs, y, ldy, tmp, accumulate);
        return;
    }
#endif
    const int64_t nb = k / QK;
    /* rows through the gemm in place, then rows quantized 4 at a time (pad: x8_pad_scratch's) */
    int64_t m4 = m / 4 * 4, mg = m4;
    if (pad != NULL) {
        const int64_t group = x8_tail(m, &m4);
        mg = m4 + group;
    }
    const size_t row_q8 = (size_t)nb * Q8_ROW_BLOCK_BYTES;
    const struct ggml_type_traits_cpu *q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (mg > m ? mg : m); i += 4) {
        if (i + 4 <= m && i < mg) {
            ggml_quantize_mat_q8_0_4x8(x + i * k, q + i * row_q8, k);
        } else if (i < mg) { /* the last rows, and zero rows after them */
            float *p = pad + (i - m4) * k;
            const int64_t real = m > i ? m - i : 0;
            memcpy(p, x + i * k, sizeof(float) * (size_t)(real * k));
            memset(p + real * k, 0, sizeof(float) * (size_t)((4 - real) * k));
            ggml_quantize_mat_q8_0_4x8(p, q + i * row_q8, k);
        } else {
            for (int64_t r = i; r < m; r++) q8->from_float(x + r * k, q + r * row_q8, k);
        }
        if (corr != NULL) /* the offsets' term sees the activations as the gemm does: quantized */
            for (int64_t r = i; r < i + 4 && r < m; r++)
                for (int64_t b = 0; b < nb; b++) xs[r * nb + b] = q8_block_sum(q + i * row_q8, r - i, i < mg, b, nb);
    } /* the loop's implicit barrier: pad is free for the padded group's outputs */
    const int64_t groups = n_out / 8, grab = grab_size(groups, m, X8_GROUPS_PER_GRAB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t g0 = 0; g0 < groups; g0 += grab) {
        const int64_t g1 = g0 + grab < groups ? g0 + grab : groups;
        const int64_t c0 = g0 * 8, c1 = g1 * 8;
        const char *w = w8 + g0 * nb * X8_GROUP_BYTES;
        float *out = accumulate ? tmp : y;
        const int64_t ldo = accumulate ? n_out : ldy;
        if (m4) ggml_gemm_q4_0_8x8_q8_0((int)k, out + c0, (size_t)ldo, w, q, (int)m4, (int)(c1 - c0));
        if (mg > m4) { /* the padded group: its rows into pad (this thread's columns), the real ones copied */
            ggml_gemm_q4_0_8x8_q8_0((int)k, pad + c0, (size_t)n_out, w, q + m4 * row_q8, (int)(mg - m4),
                                    (int)(c1 - c0));
            for (int64_t r = m4; r < m; r++)
                memcpy(out + r * ldo + c0, pad + (r - m4) * n_out + c0, sizeof(float) * (size_t)(c1 - c0));
        } else {
            for (int64_t r = m4; r < m; r++)
                ggml_gemv_q4_0_8x8_q8_0((int)k, out + r * ldo + c0, (size_t)ldo, w, q + r * row_q8, 1,
                                        (int)(c1 - c0));
        }
        x8_finish_rows(out, ldo, y, ldy, corr, n_out, xs, nb, m, accumulate, c0, c1);
    } /* the loop's implicit barrier: every output is written */
}

/* y [m, n_out] = x [m, k] @ W^T for W repacked by tg_repack_x8 (corr: its Q4_1 offsets, or NULL).
 * Returns 0, -2 when scratch cannot be had. */
int tg_linear_x8(const char *w8, const float *corr, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
                 int nthreads) {
    char *q = malloc(x8_q_bytes(m, (size_t)(k / QK) * Q8_ROW_BLOCK_BYTES) + 1);
    float *xs = malloc(sizeof(float) * (size_t)(m * (k / QK)) + 1);
    const int padding = x8_padding(m);
    float *pad = x8_pad_scratch(padding, k > n_out ? k : n_out);
    if (q == NULL || xs == NULL || (pad == NULL && padding)) {
        free(q);
        free(xs);
        free(pad);
        return -2;
    }
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    x8_rows(w8, corr, n_out, k, x, m, q, xs, y, n_out, NULL, 0, pad);
    free(q);
    free(xs);
    free(pad);
    return 0;
}

/* tg_repack_q8_x16 / tg_linear_q8_x16: Q8_0 weights (an lm_head as llama.cpp's GGUFs store it) for
 * calls of several activation rows, where the CPU has AVX512-VNNI. ggml's own kernels take such a
 * layer one activation row and one weight row at a time (vec_dot), slower than fbgemm's fp16 from
 * 4 rows, which reads twice the bytes; ggml's repacked Q8_0 gemm has no x86 code. Here 16 weight
 * rows are interleaved 4 bytes at a time, so one vpdpbusd multiplies and sums 4 values of each of
 * the 16 rows with 4 of an activation row, and a block of the 16 rows, loaded once, serves up to 8
 * activation rows. vpdpbusd takes unsigned x signed bytes: the weights are stored as q + 128 and
 * each activation block's sum starts at -128 x the sum of its values, so every block's integer dot
 * product is exact, then scaled as ggml scales it (weight scale x activation scale, both Q8_0's). */
#if defined(TG_VNNI) || defined(TG_X8_AVX2)
/* n rows of Q8_0 blocks (k values each; n a multiple of `rows`, k of 32) into dst, `rows` rows at a
 * time: group (g, b) (2 + 32 bytes a row) holds block b of rows rows g .. rows g + rows - 1, their
 * fp16 scales in row order, then 8 chunks of 4 x rows bytes, chunk j holding bytes 4 j .. 4 j + 3 of
 * each row's block in row order, each byte XOR `flip`. The layout of tg_repack_q8_x16 (16 rows, flip
 * 0x80) and tg_repack_q8_x8 (8 rows, no flip). */
static void q8_interleave(const char *src, int64_t n, int64_t k, int rows, char flip, char *dst) {
    const int64_t nb = k / QK;
    for (int64_t g = 0; g < n / rows; g++)
        for (int64_t b = 0; b < nb; b++) {
            char *out = dst + (g * nb + b) * rows * (2 + QK);
            for (int r = 0; r < rows; r++) {
                const char *in = src + ((g * rows + r) * nb + b) * Q8_ROW_BLOCK_BYTES;
                memcpy(out + 2 * r, in, 2);
                for (int j = 0; j < QK / 4; j++)
                    for (int e = 0; e < 4; e++)
                        out[2 * rows + j * 4 * rows + 4 * r + e] = (char)(in[2 + 4 * j + e] ^ flip);
            }
        }
}
#endif

#define Q8X16_ROWS 16
#define Q8X16_GROUP_BYTES (2 * Q8X16_ROWS + QK * Q8X16_ROWS) /* 16 fp16 scales, 16 rows x 32 bytes */

/* n rows of Q8_0 blocks (k values each; n a multiple of 16, k of 32) into dst (n / 16 * k / 32
 * groups of Q8X16_GROUP_BYTES): group (g, b) holds block b of rows 16 g .. 16 g + 15, their
 * scales, then 8 chunks of 64 bytes, chunk j holding bytes 4 j .. 4 j + 3 of each row's block in
 * row order, each byte XOR 0x80 (q + 128 as an unsigned byte). -1 when this build has no
 * AVX512-VNNI (nothing runs the layout) or the shape does not fit it. */
int tg_repack_q8_x16(const char *src, int64_t n, int64_t k, char *dst) {
#ifndef TG_VNNI
    (void)src, (void)n, (void)k, (void)dst;
    return -1;
#else
    if (n % Q8X16_ROWS || k % QK) return -1;
    q8_interleave(src, n, k, Q8X16_ROWS, (char)0x80, dst);
    return 0;
#endif
}

#ifdef TG_VNNI
/* Row i of x [., k] to nb act_blocks at q, each block's corr[0] -128 x the sum of its values
 * (the weights' +128). */
static void q8_vnni_quantize(const float *xi, int64_t nb, act_block *q) {
    const struct ggml_type_traits_cpu *q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    for (int64_t b = 0; b < nb; b++) {
        act_block_values(q8, xi + b * QK, q + b);
        int32_t sum = 0;
        for (int e = 0; e < QK; e++) sum += q[b].qs[e];
        q[b].corr[0] = -128 * sum;
        q[b].corr[1] = 0;
    }
}

/* The 16 outputs of weight group wg (tg_repack_q8_x16's layout, nb blocks) for activation rows
 * [i0, i0 + NR) of q, into y (ldy floats a row) from column c0. NR is a constant at each call. */
static inline __attribute__((always_inline)) void q8_vnni_tile(const char *wg, int64_t nb, const act_block *q,
                                                               int64_t i0, const int NR, float *y, int64_t ldy,
                                                               int64_t c0) {
    __m512 acc[8];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char *blk = wg + b * Q8X16_GROUP_BYTES;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512i w[QK / 4];
        for (int j = 0; j < QK / 4; j++) w[j] = _mm512_loadu_si512((const void *)(blk + 2 * Q8X16_ROWS + 64 * j));
        for (int r = 0; r < NR; r++) {
            const act_block *a = q + (i0 + r) * nb + b;
            __m512i dot = _mm512_set1_epi32(a->corr[0]);
            for (int j = 0; j < QK / 4; j++) {
                int32_t v;
                memcpy(&v, a->qs + 4 * j, 4);
                dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(v));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a->d)), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + (i0 + r) * ldy + c0, acc[r]);
}

/* The 16 outputs of weight group wg for all m activation rows of q. */
static void q8_vnni_group(const char *wg, int64_t nb, const act_block *q, int64_t m, float *y, int64_t ldy,
                          int64_t c0) {
#define TG_Q8_TILE(NR) q8_vnni_tile(wg, nb, q, i, NR, y, ldy, c0)
    TG_ROW_TILES(TG_Q8_TILE);
#undef TG_Q8_TILE
}
#endif

#if defined(TG_VNNI) || defined(TG_X8_AVX2)
/* The Q8_0 head kernels' common frame: y [m, n_out] = x [m, k] @ W^T for W in groups of `rows`
 * output rows (`group_bytes` a block of a group): each activation row quantized by `quantize`
 * (in parallel), then the groups in grabs, `group` computing one group's outputs for every row.
 * Returns 0, or -2 when scratch cannot be had. */
typedef void (*q8_quantize_fn)(const float *xi, int64_t nb, act_block *q);
typedef void (*q8_group_fn)(const char *wg, int64_t nb, const act_block *q, int64_t m, float *y, int64_t ldy,
                            int64_t c0);
static int q8_linear_groups(const char *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
                            int nthreads, int64_t rows, int64_t group_bytes, q8_quantize_fn quantize,
                            q8_group_fn group) {
    const int64_t nb = k / QK, groups = n_out / rows;
    act_block *q = malloc(sizeof(act_block) * (size_t)(m * nb) + 1);
    if (q == NULL) return -2;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize(x + i * k, nb, q + i * nb);
        /* the loop's implicit barrier: every row is quantized */
        const int64_t grab = grab_size(groups, m, X8_GROUPS_PER_GRAB);
#pragma omp for schedule(dynamic, 1)
        for (int64_t g0 = 0; g0 < groups; g0 += grab) {
            const int64_t g1 = g0 + grab < groups ? g0 + grab : groups;
            for (int64_t g = g0; g < g1; g++) group(w + g * nb * group_bytes, nb, q, m, y, n_out, g * rows);
        }
    }
    free(q);
    return 0;
}
#endif

/* y [m, n_out] = x [m, k] @ W^T for W repacked by tg_repack_q8_x16. Returns 0, -1 without
 * AVX512-VNNI, -2 when scratch cannot be had. Each output row is computed alone (the same for any
 * m and any rows beside it). */
int tg_linear_q8_x16(const char *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
#ifndef TG_VNNI
    (void)w, (void)n_out, (void)k, (void)x, (void)m, (void)y, (void)nthreads;
    return -1;
#else
    return q8_linear_groups(w, n_out, k, x, m, y, nthreads, Q8X16_ROWS, Q8X16_GROUP_BYTES, q8_vnni_quantize,
                            q8_vnni_group);
#endif
}

/* tg_repack_q8_x8 / tg_linear_q8_x8: Q8_0 weights (an lm_head as llama.cpp's GGUFs store it) for
 * calls of several activation rows where the CPU has AVX2 but no AVX512-VNNI. ggml's kernels take
 * such a layer one activation row and one weight row at a time (vec_dot), and fbgemm's fp16 copy, which
 * runs calls of more rows, multiplies in fp32: one FMA and one broadcast per 8 multiply-adds, about
 * half its FMA peak on this CPU. Here 8 weight rows are interleaved 4 bytes at a time, so one
 * vpmaddubsw multiplies 4 values of each of the 8 rows with 4 of an activation row (32 byte
 * products, summed in pairs), and a block of the 8 rows, loaded once, serves up to Q8X8_TILE
 * activation rows. vpmaddubsw takes unsigned x signed bytes: the weights' magnitudes times the
 * activations with the weights' signs (vpsignb), as ggml's AVX2 vec_dot does. The activations are
 * Q8_0 as ggml quantizes them for vec_dot; every block's integer dot product is exact, then scaled
 * by weight scale x activation scale and added block by block, the same operations in the same
 * order for a row whatever the tile: each row's outputs are those of the row alone. */
#ifdef TG_X8_AVX2 /* AVX2 and F16C without AVX512-VNNI: Kernels.x8_avx2 */
#define TG_Q8X8 1
#endif
#define Q8X8_ROWS 8
#define Q8X8_GROUP_BYTES (2 * Q8X8_ROWS + QK * Q8X8_ROWS) /* 8 fp16 scales, 8 rows x 32 bytes */
/* Activation rows a weight block serves: four rows' int32 dot products and fp32 accumulators beside
 * the block's chunk, its magnitudes and the constant fill the 16 ymm registers. */
#define Q8X8_TILE 4

/* n rows of Q8_0 blocks (k values each; n a multiple of 8, k of 32) into dst (n / 8 * k / 32 groups
 * of Q8X8_GROUP_BYTES): group (g, b) holds block b of rows 8 g .. 8 g + 7, their scales, then 8
 * chunks of 32 bytes, chunk j holding bytes 4 j .. 4 j + 3 of each row's block in row order. -1
 * when this build does not run the layout (no AVX2 and F16C, or AVX512-VNNI: tg_repack_q8_x16's)
 * or the shape does not fit it. */
int tg_repack_q8_x8(const char *src, int64_t n, int64_t k, char *dst) {
#ifndef TG_Q8X8
    (void)src, (void)n, (void)k, (void)dst;
    return -1;
#else
    if (n % Q8X8_ROWS || k % QK) return -1;
    q8_interleave(src, n, k, Q8X8_ROWS, 0, dst);
    return 0;
#endif
}

#ifdef TG_Q8X8
/* The 8 outputs of weight group wg (tg_repack_q8_x8's layout, nb blocks) for activation rows
 * [i0, i0 + NR) of q into y (ldy floats a row) from column c0. NR is a constant at each call. */
static inline __attribute__((always_inline)) void q8_x8_tile(const char *wg, int64_t nb, const act_block *q,
                                                             int64_t i0, const int NR, float *y, int64_t ldy,
                                                             int64_t c0) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[Q8X8_TILE];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char *blk = wg + b * Q8X8_GROUP_BYTES;
        __m256i dot[Q8X8_TILE];
        for (int r = 0; r < NR; r++) dot[r] = _mm256_setzero_si256();
        for (int j = 0; j < QK / 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2 * Q8X8_ROWS + 32 * j));
            const __m256i magnitude = _mm256_abs_epi8(w);
            for (int r = 0; r < NR; r++) {
                int32_t v;
                memcpy(&v, q[(i0 + r) * nb + b].qs + 4 * j, 4);
                const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(v), w);
                /* pairs of products: at most 2 x 127 x 127, so summed in 32 bits */
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(q[(i0 + r) * nb + b].d)), acc[r]);
    }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + (i0 + r) * ldy + c0, acc[r]);
}

/* Row xi [k] to nb act_blocks at q, Q8_0 as ggml quantizes for vec_dot. */
static void q8_x8_quantize(const float *xi, int64_t nb, act_block *q) {
    const struct ggml_type_traits_cpu *q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    for (int64_t b = 0; b < nb; b++) act_block_values(q8, xi + b * QK, q + b);
}

/* The 8 outputs of weight group wg for all m activation rows of q. */
static void q8_x8_group(const char *wg, int64_t nb, const act_block *q, int64_t m, float *y, int64_t ldy,
                        int64_t c0) {
    int64_t i = 0;
    for (; i + Q8X8_TILE <= m; i += Q8X8_TILE) q8_x8_tile(wg, nb, q, i, Q8X8_TILE, y, ldy, c0);
    switch (m - i) { /* fewer than Q8X8_TILE rows left */
    case 3: q8_x8_tile(wg, nb, q, i, 3, y, ldy, c0); break;
    case 2: q8_x8_tile(wg, nb, q, i, 2, y, ldy, c0); break;
    case 1: q8_x8_tile(wg, nb, q, i, 1, y, ldy, c0); break;
    default: break;
    }
}
#endif

/* y [m, n_out] = x [m, k] @ W^T for W repacked by tg_repack_q8_x8. Returns 0, -1 where this build
 * does not run the layout, -2 when scratch cannot be had. Each output row is computed alone (the
 * same for any m and any rows beside it). */
int tg_linear_q8_x8(const char *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y, int nthreads) {
#ifndef TG_Q8X8
    (void)w, (void)n_out, (void)k, (void)x, (void)m, (void)y, (void)nthreads;
    return -1;
#else
    if (n_out % Q8X8_ROWS || k % QK) return -1;
    return q8_linear_groups(w, n_out, k, x, m, y, nthreads, Q8X8_ROWS, Q8X8_GROUP_BYTES, q8_x8_quantize,
                            q8_x8_group);
#endif
}

#ifdef TG_AVX2
/* out[0..4) = q . k_j for the four rows k_j (d floats, d % 8 == 0). */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                        int64_t d, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t e = 0; e < d; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + e), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + e), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + e), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + e), a3);
    }
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* o[0..d) += sum_j p[j] * v_j over n rows v_j = v + j * stride (d % 32 == 0): 32 floats of o at a
 * time held in registers (two sets, alternate rows) across all n rows. */
static inline void axpy_rows(float *o, const float *p, const float *v, int64_t stride, int64_t n, int64_t d) {
    for (int64_t e = 0; e < d; e += 32) {
        __m256 a0 = _mm256_loadu_ps(o + e), a1 = _mm256_loadu_ps(o + e + 8), a2 = _mm256_loadu_ps(o + e + 16),
               a3 = _mm256_loadu_ps(o + e + 24);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        int64_t j = 0;
        for (; j + 1 < n; j += 2) {
            const float *v0 = v + j * stride + e, *v1 = v0 + stride;
            const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
            a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0), a0);
            a1 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8), a1);
            a2 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 16), a2);
            a3 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 24), a3);
            b0 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1), b0);
            b1 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8), b1);
            b2 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 16), b2);
            b3 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 24), b3);
        }
        if (j < n) {
            const float *v0 = v + j * stride + e;
            const __m256 p0 = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0), a0);
            a1 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8), a1);
            a2 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 16), a2);
            a3 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 24), a3);
        }
        _mm256_storeu_ps(o + e, _mm256_add_ps(a0, b0));
        _mm256_storeu_ps(o + e + 8, _mm256_add_ps(a1, b1));
        _mm256_storeu_ps(o + e + 16, _mm256_add_ps(a2, b2));
        _mm256_storeu_ps(o + e + 24, _mm256_add_ps(a3, b3));
    }
}
#endif

/* The n tokens of a block's K or V rows of kv heads [g0, g0 + ng) as fp32; *ts gets the floats from
 * one token's rows to the next: in place for an fp32 pool (a token's kv heads lie together), else
 * converted into tmp [bs, ng, d]. */
static const float *kv_block(const char *base, int64_t block_at, int kv_type, int64_t g0, int64_t ng, int64_t n,
                             int64_t kv_heads, int64_t d, float *tmp, int64_t *ts) {
    if (kv_type == GGML_TYPE_F32) {
        *ts = kv_heads * d;
        return (const float *)base + block_at + g0 * d;
    }
    *ts = ng * d;
    if (ng == kv_heads) {
        kv_load(base, block_at, kv_type, n * kv_heads * d, tmp);
    } else {
        for (int64_t j = 0; j < n; j++) kv_load(base, block_at + (j * kv_heads + g0) * d, kv_type, ng * d, tmp + j * ng * d);
    }
    return tmp;
}

/* One work item of the paged decode attention: the query heads of kv heads [g0, g0 + ng) of a row,
 * qi [ng * group, d], whose `len` cached tokens lie in `blocks`, attend over them; the result goes
 * to oi [ng * group, d]. A block at a time (its K and V rows read in address order, in place in an
 * fp32 pool, else converted to fp32 once into tmp), each query head's scores against the block's
 * keys, four keys a dot-product batch (independent sums, so the FMA chains overlap), then the
 * softmax over the whole context, then each head's weighted sum of the block's V rows with the
 * sums held in registers across the block (the one-token-at-a-time loops that stood here waited
 * on each dot product's chain: 1.3-1.9x slower at contexts 5-1000). K and V are pool elements of
 * kv_type (block_stride counts elements). scores: [ng * group, len]; tmp: [bs, ng, d]. */
static void attend_group(const float *qi, const char *k, const char *v, int kv_type, int64_t block_stride,
                         const int32_t *blocks, int64_t len, int64_t g0, int64_t ng, int64_t group,
                         int64_t kv_heads, int64_t d, int64_t bs, float scale, float *scores, float *tmp,
                         float *oi) {
    const int64_t nh = ng * group;
    int64_t ts;
#ifdef TG_AVX2
    const int vec = d % 32 == 0;
#else
    const int vec = 0;
#endif
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const float *kb = kv_block(k, (int64_t)blocks[t0 / bs] * block_stride, kv_type, g0, ng, n, kv_heads, d, tmp, &ts);
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = qi + h * d, *kh = kb + (h / group) * d;
            float *sh = scores + h * len + t0;
            int64_t j = 0;
#ifdef TG_AVX2
            if (vec)
                for (; j + 4 <= n; j += 4) dot4(qh, kh + j * ts, kh + (j + 1) * ts, kh + (j + 2) * ts, kh + (j + 3) * ts, d, sh + j);
#endif
            for (; j < n; j++) {
                const float *kt = kh + j * ts;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t e = 0; e < d; e++) dot += qh[e] * kt[e];
                sh[j] = dot;
            }
            for (j = 0; j < n; j++) sh[j] *= scale;
        }
    }
    for (int64_t h = 0; h < nh; h++) {
        float *sh = scores + h * len, mx = -INFINITY;
        for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;
        const float inv = (float)(1.0 / ggml_vec_soft_max_f32((int)len, sh, sh, mx));
        for (int64_t t = 0; t < len; t++) sh[t] *= inv;
        for (int64_t e = 0; e < d; e++) oi[h * d + e] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const float *vb = kv_block(v, (int64_t)blocks[t0 / bs] * block_stride, kv_type, g0, ng, n, kv_heads, d, tmp, &ts);
        for (int64_t h = 0; h < nh; h++) {
            const float *vh = vb + (h / group) * d, *ph = scores + h * len + t0;
            float *oh = oi + h * d;
#ifdef TG_AVX2
            if (vec) {
                axpy_rows(oh, ph, vh, ts, n, d);
                continue;
            }
#endif
            for (int64_t j = 0; j < n; j++) {
                const float p = ph[j], *vt = vh + j * ts;
#pragma omp simd
                for (int64_t e = 0; e < d; e++) oh[e] += p * vt[e];
            }
        }
    }
}

/* Work items of the decode attention of n rows: a whole row (all its kv heads, read in address
 * order) when there are rows enough to keep every thread busy, else (row, kv head) pairs. */
static int64_t heads_per_item(int64_t n, int64_t kv_heads, int nthreads) {
    return n >= 2 * (int64_t)nthreads ? kv_heads : 1;
}

#define TG_SEQ_LEN(i) ((int64_t)(indptr[(i) + 1] - indptr[(i)] - 1) * bs + last_len[(i)])

static int64_t longest(const int32_t *indptr, const int32_t *last_len, int64_t n, int64_t bs) {
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = TG_SEQ_LEN(i) > max_len ? TG_SEQ_LEN(i) : max_len;
    return max_len;
}

/* Paged attention of decode rows (one new token each) over Tandem's KV pool (fp32 math). Row i's query
 * heads q[qrow[i]] ([H, d], contiguous) attend over its cached tokens, which lie in blocks
 * table[indptr[i] .. indptr[i + 1]) of `bs` tokens, the last block holding last_len[i] of them
 * (the pool's CSR block table, kv_pool.PagedLayout); a block's K (and V) is one contiguous
 * [bs, kv_heads, d] run, blocks `block_stride` elements apart (either pool layout), the elements
 * of kv_type: fp32, fp16 or bf16 (read as fp32).
 * Query head h reads kv head h / (H / kv_heads). Output rows go to out[qrow[i]]. Work items are
 * whole rows, or (row, kv head) pairs when rows are few (heads_per_item): their heads' scores over
 * the whole context, an exact softmax, then the weighted sum of V, so each K and V row is read
 * once per item, in address order, and nothing is gathered or padded. Returns 0, -1 for heads
 * that do not group evenly, -2 when scratch cannot be had, -3 for another kv_type. */
int tg_paged_decode_attention(const float *q, const void *k, const void *v, int64_t block_stride,
                              const int64_t *qrow, const int32_t *indptr, const int32_t *table,
                              const int32_t *last_len, int64_t n, int64_t heads, int64_t kv_heads,
                              int64_t d, int64_t bs, float scale, float *out, int kv_type, int nthreads) {
    if (kv_heads < 1 || heads % kv_heads != 0) return -1;
    if (!kv_type_ok(kv_type)) return -3;
    const int64_t group = heads / kv_heads, max_len = longest(indptr, last_len, n, bs);
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = heads_per_item(n, kv_heads, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * max_len + bs * kv_heads * d)); /* [heads, len] | tmp */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n * (kv_heads / ng); item++) {
            if (scores == NULL) continue;
            const int64_t i = item / (kv_heads / ng), g = item % (kv_heads / ng) * ng;
            attend_group(q + (qrow[i] * heads + g * group) * d, k, v, kv_type, block_stride, table + indptr[i],
                         TG_SEQ_LEN(i), g, ng, group, kv_heads, d, bs, scale, scores, scores + heads * max_len,
                         out + (qrow[i] * heads + g * group) * d);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

static void rms_row(const float *xi, const float *w, float *yi, int64_t k, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t e = 0; e < k; e++) ss += xi[e] * xi[e];
    const float r = 1.0f / sqrtf(ss / (float)k + eps);
#pragma omp simd
    for (int64_t e = 0; e < k; e++) yi[e] = xi[e] * r * w[e];
}

/* RMSNorm of m rows of k floats (Hugging Face's: x / sqrt(mean(x^2) + eps) * w, in fp32): one call
 * where torch's CPU rms_norm runs several operators (about 18 us for one row of 576 here). */
void tg_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t k, float eps, int nthreads) {
    if (nthreads < 1 || m * k < 65536) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < m; i++) rms_row(x + i * k, w, y + i * k, k, eps);
}

/* Greedy decoding's last step: for each of m rows of logits (n floats each), the index of its first
 * largest value into ids (torch.argmax's), and when lp is not NULL that token's log-probability
 * under the row's softmax, -log(sum_j exp(x_j - max)), into lp, in two passes over the row (its
 * largest value, then ggml's vectorized exp sum into a scratch row) where torch's sampler ran a
 * copy, an argmax and a whole log_softmax of the batch (bench/greedy_rows.py: 0.63 against 0.32 ms
 * for 16 rows of 49,152 with a logprob on a 2-core host). Rows
 * go to the threads whole. Returns 0; -1 when a row holds a NaN (torch decides those: its argmax
 * takes the NaN), -2 when the scratch cannot be had. */
int tg_greedy_rows(const float *x, int64_t m, int64_t n, int64_t *ids, float *lp, int nthreads) {
    int failed = 0;
    if (nthreads > m) nthreads = (int)m;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *scratch = lp != NULL ? malloc(sizeof(float) * (size_t)n) : NULL;
        if (lp != NULL && scratch == NULL) failed |= 2;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            if (failed) continue;
            const float *row = x + i * n;
            float mx = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
            for (int64_t j = 0; j < n; j++) {
                mx = row[j] > mx ? row[j] : mx;
                nan |= row[j] != row[j];
            }
            if (nan) {
                failed |= 1;
                continue;
            }
            int64_t at = 0;
            while (at < n - 1 && row[at] != mx) at++;
            ids[i] = at;
            if (lp != NULL) lp[i] = (float)-log(ggml_vec_soft_max_f32((int)n, scratch, row, mx));
        }
        free(scratch);
    }
    return failed & 2 ? -2 : failed ? -1 : 0;
}

/* One decoder layer's weights for tg_decode_layers: norms fp32, projections as rows of ggml types
 * or repacked by tg_repack_x8 (type TG_Q4_X8, with their Q4_1 offsets or NULL in *_corr; q, k, v
 * stacked in qkv; gate over up in gate_up), qkv_bias fp32 or NULL. */
typedef struct {
    const float *input_norm, *post_norm, *qkv_bias;
    const char *qkv, *o, *gate_up, *down;
    int32_t qkv_type, o_type, gate_up_type, down_type;
    const float *qkv_corr, *o_corr, *gate_up_corr, *down_corr;
} tg_layer;

/* Inside a parallel region: y [m, n_out] (+)= x [m, k] @ W^T for one projection of a tg_layer,
 * through ggml's gemm for repacked weights, else its vec_dot per row (q: the quantized rows,
 * qrow bytes apart; xs and tmp: x8_rows's scratch). */
static void project(int type, const char *w, const float *corr, int64_t n_out, int64_t k, const float *x, int64_t m,
                    char *q, size_t qrow, float *xs, float *y, int64_t ldy, float *tmp, int accumulate, float *pad) {
    if (type == TG_Q4_X8) {
        x8_rows(w, corr, n_out, k, x, m, q, xs, y, ldy, tmp, accumulate, pad);
        return;
    }
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    quantize_rows(t, x, k, m, k, q, qrow);
    matvec_rows(t, w, ggml_row_size((enum ggml_type)type, k), n_out, k, q, qrow, m, y, ldy, accumulate);
}

/* Llama-family decoder layers [0, n_layers) of `layers` over m decode rows on `nthreads` threads,
 * in one call and one OpenMP region (threads meet at a barrier between phases instead of a fork and
 * join per op): per layer, RMSNorm, the qkv projection (+ bias), rotate-half rope of q and k from
 * the rows' cos / sin_signed tables ([m, d], sin_signed holding rotate-half's sign), K and V
 * written to each row's slot, the paged attention above over its blocks (CSR table as for
 * tg_paged_decode_attention), the output projection added to x, RMSNorm, gate_up, silu(gate) * up,
 * and the down projection added to x. x [m, hidden] is updated in place. The pool holds kv_type
 * elements (fp32, fp16 or bf16; new K and V are rounded to it): layer l's K cache starts
 * layer_stride elements after layer l - 1's, at k0 for layer 0, its V cache v_offset elements after
 * its K. Every op runs row by row, as the one-op-at-a-time path does, with the same ggml kernels.
 * Returns 0, -1 when ggml has no dot product for a projection's type or the heads do not group, -2
 * when scratch cannot be had, -3 for a kv_type other than fp32, fp16 or bf16. */
static int decode_layers_rows(const tg_layer *layers, int64_t n_layers, int64_t hidden, int64_t heads,
                              int64_t kv_heads, int64_t d, int64_t inter, float eps, float scale, float *x, int64_t m,
                              const float *cos, const float *sin_signed, const int64_t *slots, void *k0,
                              int64_t layer_stride, int64_t v_offset, int64_t block_stride, int64_t bs,
                              const int32_t *indptr, const int32_t *table, const int32_t *last_len, int kv_type,
                              int nthreads) {
    if (kv_heads < 1 || heads % kv_heads != 0) return -1;
    if (!kv_type_ok(kv_type)) return -3;
    const size_t esize = kv_elem_size(kv_type);
    const int64_t group = heads / kv_heads, q_size = heads * d, kv_size = kv_heads * d;
    const int64_t n_qkv = q_size + 2 * kv_size, half = d / 2, max_len = longest(indptr, last_len, m, bs);
    size_t qrow = 0; /* bytes of one activation row quantized, the largest any projection needs */
    for (int64_t l = 0; l < n_layers; l++) {
        const tg_layer *w = &layers[l];
        if (!has_dot(w->qkv_type) || !has_dot(w->o_type) || !has_dot(w->gate_up_type) || !has_dot(w->down_type))
            return -1;
        const size_t sizes[4] = {act_row_size(w->qkv_type, hidden), act_row_size(w->o_type, q_size),
                                 act_row_size(w->gate_up_type, hidden), act_row_size(w->down_type, inter)};
        for (int j = 0; j < 4; j++) qrow = sizes[j] > qrow ? sizes[j] : qrow;
    }
    /* normed [m, hidden] | qkv [m, n_qkv] | attn [m, q_size] | gate_up [m, 2 inter] | act [m, inter]
     * | tmp [m, hidden] | xs [m, inter / 32 + q_size / 32 + hidden / 32] (x8_rows's, a bound on any k / 32) */
    const int64_t floats = m * (hidden + n_qkv + q_size + 3 * inter + hidden + (inter + q_size + hidden) / QK + 1);
    float *buf = malloc(sizeof(float) * (size_t)floats);
    char *q8 = malloc(x8_q_bytes(m, qrow) + 1);
    int64_t widest = n_qkv > 2 * inter ? n_qkv : 2 * inter; /* the largest k or n_out of a projection */
    widest = widest > hidden ? widest : hidden;
    widest = widest > q_size ? widest : q_size;
    const int padding = x8_padding(m);
    float *pad = x8_pad_scratch(padding, widest);
    if (buf == NULL || q8 == NULL || (pad == NULL && padding)) {
        free(buf);
        free(q8);
        free(pad);
        return -2;
    }
    float *normed = buf, *qkv = normed + m * hidden, *attn = qkv + m * n_qkv, *gu = attn + m * q_size;
    float *act = gu + m * 2 * inter, *tmp = act + m * inter, *xs = tmp + m * hidden;
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = heads_per_item(m, kv_heads, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * max_len + bs * kv_heads * d)); /* [heads, len] | tmp */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t l = 0; l < n_layers; l++) {
            const tg_layer *w = &layers[l];
            char *kc = (char *)k0 + (size_t)(l * layer_stride) * esize, *vc = kc + (size_t)v_offset * esize;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) rms_row(x + i * hidden, w->input_norm, normed + i * hidden, hidden, eps);
            project(w->qkv_type, w->qkv, w->qkv_corr, n_qkv, hidden, normed, m, q8, qrow, xs, qkv, n_qkv, tmp, 0, pad);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                float *row = qkv + i * n_qkv;
                if (w->qkv_bias != NULL)
                    for (int64_t e = 0; e < n_qkv; e++) row[e] += w->qkv_bias[e];
                const float *c = cos + i * d, *s = sin_signed + i * d;
                for (int64_t h = 0; h < heads + kv_heads; h++) { /* q heads, then k heads */
                    float *xh = row + h * d, rot[d];
                    memcpy(rot, xh + half, sizeof(float) * (size_t)(d - half)); /* rot[e] = xh[(e + half) % d] */
                    memcpy(rot + (d - half), xh, sizeof(float) * (size_t)half);
#pragma omp simd
                    for (int64_t e = 0; e < d; e++) xh[e] = xh[e] * c[e] + rot[e] * s[e];
                }
                const int64_t block = slots[i] / bs, off = slots[i] % bs;
                const int64_t at = block * block_stride + off * kv_size;
                kv_store(kc, at, kv_type, row + q_size, kv_size);
                kv_store(vc, at, kv_type, row + q_size + kv_size, kv_size);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < m * (kv_heads / ng); item++) {
                if (scores == NULL) continue;
                const int64_t i = item / (kv_heads / ng), g = item % (kv_heads / ng) * ng;
                attend_group(qkv + i * n_qkv + g * group * d, kc, vc, kv_type, block_stride, table + indptr[i],
                             TG_SEQ_LEN(i), g, ng, group, kv_heads, d, bs, scale, scores, scores + heads * max_len,
                             attn + i * q_size + g * group * d);
            }
            project(w->o_type, w->o, w->o_corr, hidden, q_size, attn, m, q8, qrow, xs, x, hidden, tmp, 1, pad);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) rms_row(x + i * hidden, w->post_norm, normed + i * hidden, hidden, eps);
            project(w->gate_up_type, w->gate_up, w->gate_up_corr, 2 * inter, hidden, normed, m, q8, qrow, xs, gu,
                    2 * inter, tmp, 0, pad);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) /* silu(gate) * up, ggml's vectorized exp */
                ggml_vec_swiglu_f32((int)inter, act + i * inter, gu + i * 2 * inter, gu + i * 2 * inter + inter);
            project(w->down_type, w->down, w->down_corr, hidden, inter, act, m, q8, qrow, xs, x, hidden, tmp, 1, pad);
        }
        free(scores);
    }
    free(buf);
    free(q8);
    free(pad);
    return failed ? -2 : 0;
}

/* The step's rows split between the threads when `split` is set (the rows are independent: each a
 * sequence of its own, no prompt chunk whose later rows read K/V its earlier rows write) and there
 * are at least as many rows as threads: thread t runs rows [t m / n, (t + 1) m / n) through every
 * layer alone, with no barrier between the threads until the step ends. Each thread reads every
 * layer's weights (the second read mostly from the shared cache, the threads moving through the
 * layers at about one pace); in exchange a thread preempted by another process (the router, the
 * client, decode's own event loop on a 2-core host) holds only its own rows back, where at each of
 * the ~12 barriers a layer it held the other thread too. Tandem's AVX2 and VNNI kernels and ggml's
 * per-row dot products compute each row as the row alone, so there splitting changes no output;
 * ggml's gemm (repacked layers with TANDEM_X8_AVX2=0) groups rows, and its outputs depend on the
 * split as on any batching. */
int tg_decode_layers(const tg_layer *layers, int64_t n_layers, int64_t hidden, int64_t heads, int64_t kv_heads,
                     int64_t d, int64_t inter, float eps, float scale, float *x, int64_t m, const float *cos,
                     const float *sin_signed, const int64_t *slots, void *k0, int64_t layer_stride,
                     int64_t v_offset, int64_t block_stride, int64_t bs, const int32_t *indptr,
                     const int32_t *table, const int32_t *last_len, int kv_type, int nthreads, int split) {
    if (!split || nthreads < 2 || m < nthreads)
        return decode_layers_rows(layers, n_layers, hidden, heads, kv_heads, d, inter, eps, scale, x, m, cos,
                                  sin_signed, slots, k0, layer_stride, v_offset, block_stride, bs, indptr, table,
                                  last_len, kv_type, nthreads);
    int rc = 0;
#pragma omp parallel num_threads(nthreads) reduction(min : rc)
    {
        const int n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t i0 = t * m / n, i1 = (t + 1) * m / n;
        if (i1 > i0)
            rc = decode_layers_rows(layers, n_layers, hidden, heads, kv_heads, d, inter, eps, scale, x + i0 * hidden,
                                    i1 - i0, cos + i0 * d, sin_signed + i0 * d, slots + i0, k0, layer_stride, v_offset,
                                    block_stride, bs, indptr + i0, table, last_len + i0, kv_type, 1);
    }
    return rc;
}

#undef TG_SEQ_LEN
