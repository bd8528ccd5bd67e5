/* dinfer-rt CPU backend: native kernels for the dispatch-bound regime.
 *
 * On a small model at batch 1 every torch op costs a few microseconds however small its
 * tensor, so RMSNorm (about seven ops) or the rotary + K/V cache write of one layer (about
 * fifteen) cost more than the matmuls between them. Each function here does one such group in
 * one pass over float32 memory. Same formulas as the IR's reference semantics (ir/ops.py);
 * only the rounding of the sums differs. Compiled and loaded by backends/cpu/native.py.
 *
 * The layer blocks at the end (dinfer_attention_block_f32, dinfer_mlp_block_f32) go further:
 * a decoder layer's projections, norms, SwiGLU and attention in two calls, the matmuls in the
 * panel GEMM below for weights packed once (native.py decides which), else in the
 * transposed-input GEMM (8-128 rows) or through the BLAS torch itself links (MKL's sgemm on x86
 * wheels, handed over by native.py as a pointer). With DINFER_CPU_MATMUL=bf16 (native.py) the
 * projections run in the bfloat16 panel GEMM instead, on CPUs with AVX512-BF16.
 *
 * Layout conventions: strides are in elements; the last (head / feature) dimension is always
 * contiguous.
 */
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int dinfer_native_abi(void) { return 11; }

/* Below this much work a kernel stays on the calling thread (an OpenMP fork costs about a
 * microsecond on torch's already-spinning pool): multiply-adds for attention, elements for the
 * row kernels. */
#define PARALLEL_MIN_WORK (1 << 16)
#define PARALLEL_MIN_ELEMENTS (1 << 14)

/* Set by the loader when this library's OpenMP runtime is not torch's (two pools would
 * oversubscribe the cores): every kernel then stays on the calling thread. */
static int single_thread = 0;
void dinfer_native_single_thread(void) { single_thread = 1; }

int dinfer_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Threads an outer split of a layer block over its independent rows may use (1: none). Inside
 * such a split every kernel's own parallel region runs on its calling thread (OpenMP leaves
 * nested regions inactive), so each thread keeps its rows' intermediates in its own cache. */
static int outer_threads(void) {
#ifdef _OPENMP
    return single_thread || omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

/* Sum of squares with eight independent partial sums (vectorisable without reassociation). */
static float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static float inv_rms(const float *x, int64_t dim, float eps) {
    return 1.0f / sqrtf(sum_squares(x, dim) / (float)dim + eps);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), rows of `dim` contiguous values. */
void dinfer_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (!single_thread && rows > 1 && rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float inv = inv_rms(xr, dim, eps);
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (xr[d] * inv);
    }
}

/* sum = x + residual; out = rms_norm(sum) * weight (the residual stream and the next norm). */
void dinfer_add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *sum,
                             int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (!single_thread && rows > 1 && rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *rr = residual + r * dim;
        float *s = sum + r * dim, *o = out + r * dim;
        for (int64_t d = 0; d < dim; d++) s[d] = xr[d] + rr[d];
        float inv = inv_rms(s, dim, eps);
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (s[d] * inv);
    }
}

/* One head row: optional per-head RMSNorm (norm != NULL), then the half-split rotation of the
 * first `rot` dims with table rows c (cos) and s (signed sin, [-sin | sin]); dims past `rot`
 * are copied. `tmp` holds D floats. */
static void rope_row(const float *x, const float *norm, float eps, const float *c, const float *s, int64_t rot,
                     int64_t D, float *tmp, float *o) {
    if (norm != NULL) {
        float inv = inv_rms(x, D, eps);
        for (int64_t d = 0; d < D; d++) tmp[d] = norm[d] * (x[d] * inv);
        x = tmp;
    }
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int64_t i = half; i < rot; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
    for (int64_t i = rot; i < D; i++) o[i] = x[i];
}

/* The start of attention for one layer: QK-norm (optional), RoPE on q and k, and the K/V
 * laid out for the attention core.
 *
 * q [B, T, H, D], k and v [B, T, KV, D] with strides (qb, qt, qh) etc.; positions [B, T] with
 * strides (pb, pt) index rows of the [P, rot] tables cos_t / sin_t (the caller guarantees
 * P > every position). q_out: [B, H, T, D] contiguous. Without slots, k_out / v_out are
 * [B, KV, T, D] contiguous; with slots they are caches [B, S, KV, D] contiguous and row (b, t)
 * goes to slot slots[b * sb + t] (sb = 0: one index for every row; the caller checks the
 * slots lie in [0, S)). */
void dinfer_rope_qkv_f32(const float *q, int64_t qb, int64_t qt, int64_t qh, const float *k, int64_t kb, int64_t kt,
                         int64_t kh, const float *v, int64_t vb, int64_t vt, int64_t vh, const int64_t *pos,
                         int64_t pb, int64_t pt, const float *cos_t, const float *sin_t, int64_t rot,
                         const float *q_norm, const float *k_norm, float eps, int64_t B, int64_t T, int64_t H,
                         int64_t KV, int64_t D, float *q_out, float *k_out, float *v_out, const int64_t *slots,
                         int64_t sb, int64_t S) {
    /* one lane per (row, q head) and (row, kv head), each over its tokens in order (a repeated
     * slot keeps the last token's K/V, as one thread would): lanes split over the threads */
#pragma omp parallel for schedule(static) if (!single_thread && B * (H + KV) > 1 && B * T * (H + KV) * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t lane = 0; lane < B * (H + KV); lane++) {
        float tmp[D];
        int64_t b = lane / (H + KV), h = lane % (H + KV);
        for (int64_t t = 0; t < T; t++) {
            int64_t p = pos[b * pb + t * pt];
            const float *c = cos_t + p * rot, *s = sin_t + p * rot;
            if (h < H) {
                rope_row(q + b * qb + t * qt + h * qh, q_norm, eps, c, s, rot, D, tmp, q_out + ((b * H + h) * T + t) * D);
                continue;
            }
            int64_t g = h - H;
            float *ko, *vo;
            if (slots == NULL) {
                ko = k_out + ((b * KV + g) * T + t) * D;
                vo = v_out + ((b * KV + g) * T + t) * D;
            } else {
                int64_t slot = slots[b * sb + t];
                ko = k_out + ((b * S + slot) * KV + g) * D;
                vo = v_out + ((b * S + slot) * KV + g) * D;
            }
            rope_row(k + b * kb + t * kt + g * kh, k_norm, eps, c, s, rot, D, tmp, ko);
            const float *vr = v + b * vb + t * vt + g * vh;
            for (int64_t d = 0; d < D; d++) vo[d] = vr[d];
        }
    }
}

/* Sum and maximum with eight independent lanes (vectorisable without reassociation). */
static float sum_of(const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

static float max_of(const float *x, int64_t n) {
    float acc[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
    float m = -INFINITY;
    for (int j = 0; j < 8; j++) m = acc[j] > m ? acc[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* Eight floats as one vector (GCC / Clang vector extensions: AVX with -march=native, split into
 * narrower operations elsewhere); unaligned loads and stores through memcpy. */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* The register tiles below (attention core, panel GEMM, transposed-input GEMM) are written on
 * `vf`, the widest vector this build's target holds in one register: 16 floats with AVX-512, 8
 * with AVX, 4 otherwise (SSE, NEON), VF floats each, NV32 of them per 32 floats. A vector wider
 * than the hardware's registers is no vector at all to GCC: it lives on the stack and a scalar
 * times it is sixteen scalar stores and a reload (the first version, written on 64-byte vectors,
 * ran its GEMMs at 2 GFLOP/s on an AVX2-only Zen 3, 25x under torch's sgemm). Tile rows are
 * sized to the register file: ROWS x NV32 accumulators plus NV32 loaded vectors fit 32 AVX-512
 * registers, or (about) 16 AVX ones. */
#if defined(__AVX512F__)
#define VF 16
#elif defined(__AVX__)
#define VF 8
#else
#define VF 4
#endif
#define NV32 (32 / VF)
typedef float vf __attribute__((vector_size(VF * sizeof(float))));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
int dinfer_native_vector_floats(void) { return VF; }

/* The attention core's register tile: ATT_ROWS query rows against 32 keys (or 32 value dims),
 * ATT_ROWS x NV32 independent vector sums, each key (value) vector loaded once for all the rows:
 * a small GEMM of its own (scores = Q K^T, then out = P V), where one row at a time would reload
 * every key vector per row and wait on a single FMA chain. */
#if VF == 16
#define ATT_ROWS 4
#else
#define ATT_ROWS 2
#endif

/* scores[r * SP + j] = q[r * D:] . keys_t[:, j] for the tile's rows and keys_t [D, SP] (SP a
 * multiple of 16, zero past the keys): 32 keys at a time, then 16. */
static void scores_tile(const float *q, const float *keys_t, int64_t D, int64_t SP, float *scores) {
    for (int64_t j0 = 0; j0 < SP; j0 += 32) {
        int nv = SP - j0 >= 32 ? NV32 : NV32 / 2; /* the last 16 keys: half the vectors */
        vf a[ATT_ROWS][NV32];
        for (int r = 0; r < ATT_ROWS; r++)
            for (int v = 0; v < NV32; v++) a[r][v] = (vf){0};
        if (nv == NV32) {
            for (int64_t d = 0; d < D; d++) {
                vf kv[NV32];
#pragma GCC unroll 8
                for (int v = 0; v < NV32; v++) kv[v] = loadv(keys_t + d * SP + j0 + v * VF);
#pragma GCC unroll 4
                for (int r = 0; r < ATT_ROWS; r++) {
                    float qv = q[r * D + d];
#pragma GCC unroll 8
                    for (int v = 0; v < NV32; v++) a[r][v] += qv * kv[v];
                }
            }
        } else {
            for (int64_t d = 0; d < D; d++) {
                vf kv[NV32 / 2];
#pragma GCC unroll 4
                for (int v = 0; v < NV32 / 2; v++) kv[v] = loadv(keys_t + d * SP + j0 + v * VF);
#pragma GCC unroll 4
                for (int r = 0; r < ATT_ROWS; r++) {
                    float qv = q[r * D + d];
#pragma GCC unroll 4
                    for (int v = 0; v < NV32 / 2; v++) a[r][v] += qv * kv[v];
                }
            }
        }
        for (int r = 0; r < ATT_ROWS; r++)
            for (int v = 0; v < nv; v++) storev(scores + r * SP + j0 + v * VF, a[r][v]);
    }
}

/* out[r][d] = scale[r] * sum_{j < S} w[r * SP + j] values[j * stride + d] for the first `rows`
 * rows of the tile: 32 dims at a time, then 16, then one by one. */
static void weighted_tile(const float *w, int64_t SP, const float *values, int64_t stride, int64_t S, int64_t D,
                          const float *scale, float *const *out, int rows) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        vf a[ATT_ROWS][NV32];
        for (int r = 0; r < ATT_ROWS; r++)
            for (int v = 0; v < NV32; v++) a[r][v] = (vf){0};
        for (int64_t j = 0; j < S; j++) {
            vf vv[NV32];
#pragma GCC unroll 8
            for (int v = 0; v < NV32; v++) vv[v] = loadv(values + j * stride + d0 + v * VF);
#pragma GCC unroll 4
            for (int r = 0; r < ATT_ROWS; r++) {
                float wv = w[r * SP + j];
#pragma GCC unroll 8
                for (int v = 0; v < NV32; v++) a[r][v] += wv * vv[v];
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < NV32; v++) storev(out[r] + d0 + v * VF, a[r][v] * scale[r]);
    }
    for (; d0 + 16 <= D; d0 += 16) {
        vf a[ATT_ROWS][NV32 / 2];
        for (int r = 0; r < ATT_ROWS; r++)
            for (int v = 0; v < NV32 / 2; v++) a[r][v] = (vf){0};
        for (int64_t j = 0; j < S; j++) {
            vf vv[NV32 / 2];
#pragma GCC unroll 4
            for (int v = 0; v < NV32 / 2; v++) vv[v] = loadv(values + j * stride + d0 + v * VF);
#pragma GCC unroll 4
            for (int r = 0; r < ATT_ROWS; r++) {
                float wv = w[r * SP + j];
#pragma GCC unroll 4
                for (int v = 0; v < NV32 / 2; v++) a[r][v] += wv * vv[v];
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < NV32 / 2; v++) storev(out[r] + d0 + v * VF, a[r][v] * scale[r]);
    }
    for (; d0 < D; d0++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < S; j++) acc += w[r * SP + j] * values[j * stride + d0];
            out[r][d0] = acc * scale[r];
        }
}

/* exp(x) for x <= 0: 2^n p(r) with n = round(x / ln 2), r = x - n ln 2 (in two parts) and the
 * degree-7 polynomial of Cephes' expf (relative error ~1e-7, float32 rounding). x is clamped at
 * -87 (exp ~ 1.6e-38); -inf and NaN land there too. Written on eight lanes with the vector
 * extensions (GCC does not vectorise the scalar form without -ffinite-math-only), and as the
 * scalar form for loop tails. */
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)((mask & (v8i)yes) | (~mask & (v8i)no)); }

static inline v8f exp8_nonpositive(v8f x) {
    const v8f lowest = (v8f){0} - 87.0f;
    x = select8(x > lowest, x, lowest);
    v8i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i); /* x <= 0: truncation rounds */
    v8f nf = __builtin_convertvector(ni, v8f);
    v8f r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8f)((ni + 127) << 23);
}

static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    int32_t ni = (int32_t)(x * 1.44269504088896341f - 0.5f);
    float nf = (float)ni;
    float r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (ni + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* scores[j] = exp(scores[j] - m) for scores <= m (a softmax's numerators); masked keys (-inf)
 * come out ~0 and are zeroed by the caller. */
static void exp_shifted(float *scores, int64_t n, float m) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store8(scores + j, exp8_nonpositive(load8(scores + j) - m));
    for (; j < n; j++) scores[j] = exp_nonpositive(scores[j] - m);
}

/* scores <- the softmax numerators over the valid keys (masked keys 0); returns their sum.
 * ``masked``: some keys of the row are padding (a row without any valid key attends to all).
 * The row is read and written up to S rounded up to 8 (no scalar tail of exponentials; the
 * caller's buffer is that long and ignores the values past S). */
static float softmax_numerators(float *scores, int64_t S, const uint8_t *valid, int masked) {
    if (masked)
        for (int64_t j = 0; j < S; j++) scores[j] = valid[j] ? scores[j] : -INFINITY;
    exp_shifted(scores, (S + 7) / 8 * 8, max_of(scores, S));
    if (masked)
        for (int64_t j = 0; j < S; j++) scores[j] = valid[j] ? scores[j] : 0.0f;
    return sum_of(scores, S);
}

/* silu(x) * up: x sigmoid(x), the sigmoid from e = exp(-|x|) <= 1 (1 / (1 + e), or e / (1 + e)
 * below zero), so the exponential never overflows. */
static inline v8f silu_mul8(v8f x, v8f up) {
    v8i negative = x < 0.0f;
    v8f e = exp8_nonpositive(select8(negative, x, -x));
    return x * (select8(negative, e, (v8f){0} + 1.0f) / (1.0f + e)) * up;
}

static inline float silu_mul(float x, float up) {
    float e = exp_nonpositive(x < 0.0f ? x : -x);
    return x * ((x < 0.0f ? e : 1.0f) / (1.0f + e)) * up;
}

/* out[r, i] = silu(h[r, i]) * h[r, half + i] for h [rows, 2 half] = [gate | up] (ir.ops.swiglu).
 * Rows split over the OpenMP threads when large. */
void dinfer_swiglu_f32(const float *h, float *out, int64_t rows, int64_t half) {
#pragma omp parallel for schedule(static) if (!single_thread && rows > 1 && rows * half >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = h + r * 2 * half, *up = gate + half;
        float *o = out + r * half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) store8(o + i, silu_mul8(load8(gate + i), load8(up + i)));
        for (; i < half; i++) o[i] = silu_mul(gate[i], up[i]);
    }
}

/* The whole attention op: QK-norm (optional) and RoPE on q and k, the K/V rows written at
 * their slots, then softmax(q k^T * scale) v over the valid keys.
 *
 * q, k, v, pos, cos_t, sin_t, rot, q_norm, k_norm, eps: as dinfer_rope_qkv_f32. keys / values
 * [B, S, KV, D] contiguous: the caches (row (b, t) written at slots[b * sb + t]) or, with
 * slots == NULL, this forward's own keys (S == T, row t at slot t). key_valid [B, S] (bytes,
 * 0 = padding); a row with no valid key attends to every key (ir.ops.attention_mask). out:
 * [B, T, H, D] contiguous. No block-causal rule (the caller uses SDPA for that). Per (row, kv
 * head) the keys are transposed once to [D, S], so every score loop runs over keys, in
 * vectors, without horizontal sums. Returns 0, or -1 when its scratch cannot be allocated. */
int dinfer_rope_attention_f32(const float *q, int64_t qb, int64_t qt, int64_t qh, const float *k, int64_t kb,
                              int64_t kt, int64_t kh, const float *v, int64_t vb, int64_t vt, int64_t vh,
                              const int64_t *pos, int64_t pb, int64_t pt, const float *cos_t, const float *sin_t,
                              int64_t rot, const float *q_norm, const float *k_norm, float eps, int64_t B, int64_t T,
                              int64_t H, int64_t KV, int64_t D, float *keys, float *values, const int64_t *slots,
                              int64_t sb, int64_t S, const uint8_t *key_valid, float scale, float *out) {
    int64_t SP = (S + 15) / 16 * 16; /* keys padded to whole vectors: zero keys, never read past S */
    /* the keys' rotary and the K/V writes: one lane per (row, kv head), its tokens in order */
#pragma omp parallel for schedule(static) if (!single_thread && B * KV > 1 && B * T * KV * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t lane = 0; lane < B * KV; lane++) {
        float tmp[D];
        int64_t b = lane / KV, h = lane % KV;
        for (int64_t t = 0; t < T; t++) {
            int64_t p = pos[b * pb + t * pt];
            int64_t slot = slots == NULL ? t : slots[b * sb + t];
            float *ko = keys + ((b * S + slot) * KV + h) * D, *vo = values + ((b * S + slot) * KV + h) * D;
            rope_row(k + b * kb + t * kt + h * kh, k_norm, eps, cos_t + p * rot, sin_t + p * rot, rot, D, tmp, ko);
            const float *vr = v + b * vb + t * vt + h * vh;
            for (int64_t d = 0; d < D; d++) vo[d] = vr[d];
        }
    }
    int64_t group = H / KV;
    int failed = 0;
    /* (row, kv head) pairs are independent: split over the threads of the OpenMP runtime torch
     * itself uses (one pool, already spinning after torch's last op), when there is enough work. */
#pragma omp parallel if (!single_thread && B * KV > 1 && B * T * H * S * D >= PARALLEL_MIN_WORK) reduction(| : failed)
    {
        float tmp_q[D], qr[ATT_ROWS * D];
        /* this thread's scratch: the kv head's keys transposed [D, SP], and a tile's score rows */
        float *keys_t = calloc((size_t)((D + ATT_ROWS) * SP), sizeof(float));
        if (keys_t == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * KV; bg++) {
            if (keys_t == NULL) continue;
            float *scores = keys_t + D * SP;
            int64_t b = bg / KV, g = bg % KV;
            const uint8_t *valid = key_valid + b * S;
            int64_t n_valid = 0;
            for (int64_t j = 0; j < S; j++) n_valid += valid[j] != 0;
            int masked = n_valid > 0 && n_valid < S;
            const float *kbase = keys + (b * S * KV + g) * D, *vbase = values + (b * S * KV + g) * D;
            for (int64_t d = 0; d < D; d++)
                for (int64_t j = 0; j < S; j++) keys_t[d * SP + j] = kbase[j * KV * D + d];
            /* the group's query rows (t, head), ATT_ROWS at a time (the last tile's spare rows zero) */
            int64_t rows = T * group;
            for (int64_t r0 = 0; r0 < rows; r0 += ATT_ROWS) {
                int nr = rows - r0 < ATT_ROWS ? (int)(rows - r0) : ATT_ROWS;
                float *o[ATT_ROWS], inv[ATT_ROWS];
                for (int i = 0; i < ATT_ROWS; i++) {
                    float *qi = qr + i * D;
                    if (i >= nr) {
                        memset(qi, 0, (size_t)D * sizeof(float));
                        continue;
                    }
                    int64_t t = (r0 + i) / group, h = g * group + (r0 + i) % group, p = pos[b * pb + t * pt];
                    rope_row(q + b * qb + t * qt + h * qh, q_norm, eps, cos_t + p * rot, sin_t + p * rot, rot, D, tmp_q, qi);
                    for (int64_t d = 0; d < D; d++) qi[d] *= scale;
                    o[i] = out + ((b * T + t) * H + h) * D;
                }
                scores_tile(qr, keys_t, D, SP, scores);
                for (int i = 0; i < nr; i++) inv[i] = 1.0f / softmax_numerators(scores + i * SP, S, valid, masked);
                weighted_tile(scores, SP, vbase, KV * D, S, D, inv, o, nr);
            }
        }
        free(keys_t);
    }
    return failed ? -1 : 0;
}


/* ---------------------------------------------------------------- layer blocks
 *
 * A decoder layer of a dense model is about a dozen small ops between two attention calls;
 * each costs a few microseconds of dispatch on top of its arithmetic. These two functions do
 * the whole run in one call each, with the matmuls in the GEMMs below or torch's own BLAS. */

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);
static sgemm_fn blas_sgemm = NULL; /* Fortran sgemm_ (column-major) */

void dinfer_set_blas(void *sgemm) { blas_sgemm = (sgemm_fn)sgemm; }

/* ---- panel GEMM: y [M, N] = x [M, K] W^T for a weight packed once into panels of PANEL output
 * columns (P[p][k][c] = W[p * PANEL + c][k], zero past N), so each k step of a 6 x 32 tile loads
 * two whole vectors of W and broadcasts six x values: twelve independent FMA chains. Measured
 * on the 2-core EPYC (Zen 4) here, one thread: 1024 x 192 weights at 21 rows 83 vs 115 us for
 * torch's MKL sgemm, 4096 x 768 at 21 rows 1.6 vs 3.4 ms, at 1050 rows 64 vs 87 ms. */
#define PANEL 32
#if VF == 16
#define TILE_ROWS 6
#else
#define TILE_ROWS 3
#endif

int64_t dinfer_panel_floats(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

void dinfer_pack_panels(const float *w, int64_t n, int64_t k, float *panels) {
    for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < PANEL; c++) {
                int64_t col = p * PANEL + c;
                panels[(p * k + i) * PANEL + c] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* One tile: `rows` (<= TILE_ROWS) rows of x against one panel; `cols` (<= PANEL) columns kept. */
static void panel_tile(const float *x, int64_t k, int rows, const float *panel, float *y, int64_t ldy, int64_t cols) {
    vf acc[TILE_ROWS][NV32];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int v = 0; v < NV32; v++) acc[r][v] = (vf){0};
    if (rows == TILE_ROWS) { /* the common case, fully unrolled */
        for (int64_t i = 0; i < k; i++) {
            vf wv[NV32];
#pragma GCC unroll 8
            for (int v = 0; v < NV32; v++) wv[v] = loadv(panel + i * PANEL + v * VF);
#pragma GCC unroll 6
            for (int r = 0; r < TILE_ROWS; r++) {
                float xv = x[r * k + i];
#pragma GCC unroll 8
                for (int v = 0; v < NV32; v++) acc[r][v] += xv * wv[v];
            }
        }
    } else {
        for (int64_t i = 0; i < k; i++) {
            vf wv[NV32];
#pragma GCC unroll 8
            for (int v = 0; v < NV32; v++) wv[v] = loadv(panel + i * PANEL + v * VF);
            for (int r = 0; r < rows; r++) {
                float xv = x[r * k + i];
#pragma GCC unroll 8
                for (int v = 0; v < NV32; v++) acc[r][v] += xv * wv[v];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float tmp[PANEL], *dst = cols == PANEL ? y + r * ldy : tmp;
        for (int v = 0; v < NV32; v++) storev(dst + v * VF, acc[r][v]);
        if (cols < PANEL) memcpy(y + r * ldy, tmp, (size_t)cols * sizeof(float));
    }
}

/* ---- transposed-input GEMM: y [M, N] = x [M, K] W^T reading W [N, K] where it lies (no packed
 * copy). The roles of the panel GEMM swap: x, the small operand, is transposed per call into
 * xt [K][Mp] (zero past M, Mp a multiple of 16), and a tile of XT_ROWS weight rows x 32 (or 16)
 * input rows broadcasts one weight value per row and loads whole vectors of xt at each k step,
 * every weight value read once per tile from its contiguous row. Rows are taken in chunks whose
 * xt stays in L2. linear_rows uses it for XT_MIN_ROWS..XT_MAX_ROWS rows (below). Measured on the
 * 2-core EPYC (Zen 4) here, two threads: 2304 x 768 at 32 rows 0.58 vs 1.06 ms for torch's MKL
 * sgemm, 4096 x 768 at 32 rows 1.12 vs 2.40 ms, 32000 x 768 (an LM head) 9.5 vs 26.9 ms. */
#if VF == 16
#define XT_ROWS 12
#else
#define XT_ROWS 3
#endif
#define SPLIT_MIN_WORK (1 << 16) /* multiply-adds below which a projection stays on one thread */
#define XT_CHUNK_FLOATS (1 << 16) /* xt floats per row chunk (256 KB) */

static void xt_tile(const float *w, int64_t k, const float *xt, int64_t ld, int vecs, int nr, float *yt) {
    vf acc[XT_ROWS][NV32];
    for (int r = 0; r < XT_ROWS; r++)
        for (int v = 0; v < NV32; v++) acc[r][v] = (vf){0};
    int nv = vecs == 2 ? NV32 : NV32 / 2; /* 32 input rows, or the last 16 */
    if (nv == NV32 && nr == XT_ROWS) { /* the common case, fully unrolled */
        for (int64_t i = 0; i < k; i++) {
            vf xv[NV32];
#pragma GCC unroll 8
            for (int v = 0; v < NV32; v++) xv[v] = loadv(xt + i * ld + v * VF);
#pragma GCC unroll 12
            for (int r = 0; r < XT_ROWS; r++) {
                float wv = w[r * k + i];
#pragma GCC unroll 8
                for (int v = 0; v < NV32; v++) acc[r][v] += wv * xv[v];
            }
        }
    } else {
        for (int64_t i = 0; i < k; i++) {
            vf xv[NV32];
            for (int v = 0; v < nv; v++) xv[v] = loadv(xt + i * ld + v * VF);
            for (int r = 0; r < nr; r++) {
                float wv = w[r * k + i];
                for (int v = 0; v < nv; v++) acc[r][v] += wv * xv[v];
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) storev(yt + r * 32 + v * VF, acc[r][v]);
}

int dinfer_xt_linear_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y) {
    int64_t chunk = XT_CHUNK_FLOATS / (k > 0 ? k : 1) / 32 * 32;
    chunk = chunk < 32 ? 32 : chunk;
    int64_t chunk_p = rows < chunk ? (rows + 15) / 16 * 16 : chunk;
    float *xt = malloc((size_t)(k * chunk_p + 1) * sizeof(float));
    if (xt == NULL) return -1;
    int64_t blocks = (n + XT_ROWS - 1) / XT_ROWS;
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        int64_t m = rows - m0 < chunk ? rows - m0 : chunk, mp = (m + 15) / 16 * 16;
        const float *xc = x + m0 * k;
#pragma omp parallel for schedule(static) if (!single_thread && m * k >= PARALLEL_MIN_ELEMENTS)
        for (int64_t i0 = 0; i0 < k; i0 += 16) { /* 16 k values per row at a time: short strided writes */
            int64_t i1 = i0 + 16 < k ? i0 + 16 : k;
            for (int64_t r = 0; r < mp; r++)
                for (int64_t i = i0; i < i1; i++) xt[i * mp + r] = r < m ? xc[r * k + i] : 0.0f;
        }
#pragma omp parallel for schedule(static) if (!single_thread && blocks > 1 && m * n * k >= SPLIT_MIN_WORK)
        for (int64_t b = 0; b < blocks; b++) {
            float yt[XT_ROWS * 32];
            int nr = n - b * XT_ROWS < XT_ROWS ? (int)(n - b * XT_ROWS) : XT_ROWS;
            for (int64_t t = 0; t < mp; t += 32) {
                int vecs = mp - t >= 32 ? 2 : 1;
                xt_tile(w + b * XT_ROWS * k, k, xt + t, mp, vecs, nr, yt);
                int64_t tr = m - t < 16 * vecs ? m - t : 16 * vecs;
                float *yo = y + (m0 + t) * n + b * XT_ROWS;
                for (int64_t r = 0; r < tr; r++)
                    for (int c = 0; c < nr; c++) yo[r * n + c] = yt[c * 32 + r];
            }
        }
    }
    free(xt);
    return 0;
}

/* ---- bfloat16 panel GEMM (DINFER_CPU_MATMUL=bf16): y [M, N] = bf16(x) bf16(W)^T, summed in
 * float32, like torch's float32 matmuls under
 * torch.backends.mkldnn.matmul.fp32_precision = "bf16". The weight is packed once
 * into panels of PANEL columns whose k values come in pairs (P[p][i][c][j] = bf16(W[p * PANEL
 * + c][2 i + j]), zero past N and K), x is rounded to bfloat16 per call, and each k pair of a
 * 6 x 32 tile is two AVX512-BF16 dot products per row (vdpbf16ps: 16 columns x 2 k values).
 * The products of two bfloat16 values are exact in float32, so the result is the float32 sum
 * of the exact products of the rounded inputs (rounding: to nearest even; the instruction
 * reads denormal inputs as zero). Measured on the 2-core EPYC (Zen 4) here, two threads: 1024 x
 * 192 weights at 51 rows 63 us (320 GFLOP/s) against about 140 us for the float32 panels. */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int dinfer_bf16_panels(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

int64_t dinfer_panel_bf16_halves(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * ((k + 1) / 2 * 2); }

void dinfer_pack_panels_bf16(const float *w, int64_t n, int64_t k, uint16_t *panels) {
    int64_t k2 = (k + 1) / 2;
    for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; p++)
        for (int64_t i = 0; i < k2; i++)
            for (int64_t c = 0; c < PANEL; c++)
                for (int64_t j = 0; j < 2; j++) {
                    int64_t col = p * PANEL + c, kk = 2 * i + j;
                    panels[((p * k2 + i) * PANEL + c) * 2 + j] = col < n && kk < k ? bf16_of(w[col * k + kk]) : 0;
                }
}

#ifdef __AVX512BF16__
/* x rounded to bfloat16, rows padded to whole tiles and k to pairs (zeros): [rows_p][k2] pairs. */
static uint32_t *bf16_rows(const float *x, int64_t rows, int64_t k, int64_t rows_p) {
    int64_t k2 = (k + 1) / 2;
    uint32_t *xb = malloc((size_t)(rows_p * k2 + 1) * sizeof(uint32_t));
    if (xb == NULL) return NULL;
#pragma omp parallel for schedule(static) if (!single_thread && rows * k >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows_p; r++) {
        uint16_t *o = (uint16_t *)(xb + r * k2);
        const float *xr = x + r * k;
        int64_t i = 0;
        if (r < rows)
            for (; i + 32 <= k; i += 32) { /* hardware rounding, 32 values at a time */
                __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i));
                _mm512_storeu_si512(o + i, (__m512i)v);
            }
        for (; i < 2 * k2; i++) o[i] = r < rows && i < k ? bf16_of(xr[i]) : 0;
    }
    return xb;
}

static void bf16_tile(const uint32_t *x, int64_t k2, int rows, const uint16_t *panel, float *y, int64_t ldy,
                      int64_t cols) {
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k2; i++) { /* every tile has TILE_ROWS rows of x: the padding is zero */
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * PANEL);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * PANEL + PANEL);
#pragma GCC unroll 6
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * k2 + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (cols == PANEL) {
            _mm512_storeu_ps(y + r * ldy, acc[r][0]), _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
        } else {
            float tmp[PANEL];
            _mm512_storeu_ps(tmp, acc[r][0]), _mm512_storeu_ps(tmp + 16, acc[r][1]);
            memcpy(y + r * ldy, tmp, (size_t)cols * sizeof(float));
        }
    }
}
#endif

static int bf16_linear(const uint16_t *panels, int64_t n, int64_t k, const float *x, int64_t rows, float *y) {
#ifdef __AVX512BF16__
    int64_t k2 = (k + 1) / 2, rows_p = (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int64_t np = (n + PANEL - 1) / PANEL;
    uint32_t *xb = bf16_rows(x, rows, k, rows_p);
    if (xb == NULL) return -1;
#pragma omp parallel for schedule(static) if (!single_thread && np > 1 && rows * n * k >= SPLIT_MIN_WORK)
    for (int64_t p = 0; p < np; p++) {
        int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS)
            bf16_tile(xb + r0 * k2, k2, (int)(rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS),
                      panels + p * k2 * 2 * PANEL, y + r0 * n + p * PANEL, n, cols);
    }
    free(xb);
    return 0;
#else
    (void)panels, (void)n, (void)k, (void)x, (void)rows, (void)y;
    return -3; /* never packed: native.py packs bfloat16 panels only where dinfer_bf16_panels() */
#endif
}

/* y = x W^T (+ bias) for W [n, k] (torch's linear layout): through its bfloat16 panels when
 * packed so, else its float32 panels when packed (panels split over the OpenMP threads), else
 * the transposed-input GEMM or the BLAS. */
typedef struct {
    const float *weight, *panels, *bias;
    int64_t n, k;
    const uint16_t *bf16_panels;
} dinfer_linear;

/* Rows the transposed-input GEMM takes: below 8 its 16-row tiles are mostly padding (torch's sgemm
 * ran 1-4 rows of a 2304 x 768 weight 1.2-2.4x faster), above 128 sgemm was as fast or faster
 * (down projections, k 2048). Only AVX-512 builds take it: with 16 AVX registers its tile is 3
 * weight rows, and on the AVX2 Zen 3 here (one thread) it ran level with MKL's sgemm at 32 rows
 * of a 2304 x 768 weight (1.68 vs 1.73 ms) and slower at 40 x 512 x 192 (315 vs 127 us) or 64
 * rows (3.7 vs 3.3 ms); the embedded model's batch-8 step went 21.4 -> 18.4 ms without it. */
#if VF == 16
#define XT_MIN_ROWS 8
#define XT_MAX_ROWS 128
#else
#define XT_MIN_ROWS 1
#define XT_MAX_ROWS 0
#endif
int64_t dinfer_xt_min_rows(void) { return XT_MIN_ROWS; }
int64_t dinfer_xt_max_rows(void) { return XT_MAX_ROWS; }

static int linear_rows(const dinfer_linear *L, const float *x, int64_t rows, float *y) {
    int64_t n = L->n, k = L->k;
    if (rows == 0) return 0;
    if (L->bf16_panels != NULL) {
        if (bf16_linear(L->bf16_panels, n, k, x, rows, y) != 0) return -1;
    } else if (L->panels != NULL) {
        int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (!single_thread && panels > 1 && rows * n * k >= SPLIT_MIN_WORK)
        for (int64_t p = 0; p < panels; p++) {
            int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
            for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS)
                panel_tile(x + r0 * k, k, (int)(rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS), L->panels + p * k * PANEL,
                           y + r0 * n + p * PANEL, n, cols);
        }
    } else if (rows >= XT_MIN_ROWS && rows <= XT_MAX_ROWS) {
        if (dinfer_xt_linear_f32(L->weight, n, k, x, rows, y) != 0) return -1;
    } else { /* row-major y [m, n] = x [m, k] W^T is column-major y^T [n, m] = W [k, n]^T x^T [k, m] */
        int m = (int)rows, ni = (int)n, ki = (int)k;
        const float one = 1.0f, zero = 0.0f;
        blas_sgemm("T", "N", &ni, &m, &ki, &one, L->weight, &ki, x, &ki, &zero, y, &ni);
    }
    if (L->bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += L->bias[j];
    return 0;
}

/* linear_rows on its own: the Q/K/V projection of an attention_block whose attention core
 * native.py leaves to torch's SDPA (many long rows), so the matmul still takes the plan's GEMM. */
int dinfer_plan_linear_f32(const dinfer_linear *L, const float *x, int64_t rows, float *y) {
    if (blas_sgemm == NULL) return -2;
    return linear_rows(L, x, rows, y);
}

/* Q/K/V projection and attention of one layer (ir.ops.attention_block): qkv = x W^T (+ b),
 * split into heads, then dinfer_rope_attention_f32 reading q, k and v in place from the
 * projection's rows. x [B, T, dim] contiguous; the rest as dinfer_rope_attention_f32, except that
 * without a cache keys / values may be NULL (then scratch of this call: S == T, no slots). */
typedef struct {
    dinfer_linear qkv;
    const float *q_norm, *k_norm;
    int64_t heads, kv_heads, head_dim, rot;
    float eps, scale;
} dinfer_attention_plan;

/* The block for the batch rows [b0, b1) on the calling thread; qkv: scratch of (b1 - b0) * T * N
 * floats, plus 2 * (b1 - b0) * T * KV * D when there is no cache (keys NULL). */
static int attention_rows(const dinfer_attention_plan *p, const float *x, int64_t b0, int64_t b1, int64_t T,
                          const int64_t *pos, int64_t pb, int64_t pt, const float *cos_t, const float *sin_t,
                          float *keys, float *values, const int64_t *slots, int64_t sb, int64_t S,
                          const uint8_t *key_valid, float *out, float *qkv) {
    int64_t H = p->heads, KV = p->kv_heads, D = p->head_dim, N = p->qkv.n, B = b1 - b0;
    if (keys == NULL) {
        keys = qkv + B * T * N, values = keys + B * T * KV * D;
    } else {
        keys += b0 * S * KV * D, values += b0 * S * KV * D;
        slots = slots + b0 * sb;
    }
    if (linear_rows(&p->qkv, x + b0 * T * p->qkv.k, B * T, qkv) != 0) return -1;
    return dinfer_rope_attention_f32(qkv, T * N, N, D, qkv + H * D, T * N, N, D, qkv + (H + KV) * D, T * N, N, D,
                                     pos + b0 * pb, pb, pt, cos_t, sin_t, p->rot, p->q_norm, p->k_norm, p->eps, B, T, H,
                                     KV, D, keys, values, slots, sb, S, key_valid + b0 * S, p->scale,
                                     out + b0 * T * H * D);
}

/* Many short rows (a decoding batch): the batch rows split over the threads, each row's whole
 * block on one thread (its projection output and keys stay in that core's cache, one fork per
 * layer instead of one per kernel). Packed weights only: the BLAS keeps its own threads. */
#define OUTER_MIN_ROWS 4 /* batch rows per thread at least */

int dinfer_attention_block_f32(const dinfer_attention_plan *p, const float *x, int64_t B, int64_t T,
                               const int64_t *pos, int64_t pb, int64_t pt, const float *cos_t, const float *sin_t,
                               float *keys, float *values, const int64_t *slots, int64_t sb, int64_t S,
                               const uint8_t *key_valid, float *out) {
    if (blas_sgemm == NULL) return -2;
    int64_t KV = p->kv_heads, D = p->head_dim, N = p->qkv.n;
    int64_t own = keys == NULL ? T * KV * D : 0; /* no cache: the keys and values are scratch after qkv */
    int threads = outer_threads();
    int packed = p->qkv.panels != NULL || p->qkv.bf16_panels != NULL;
    if (threads > 1 && packed && B >= (int64_t)threads * OUTER_MIN_ROWS) {
        int failed = 0;
#pragma omp parallel reduction(| : failed)
        {
            float *qkv = malloc((size_t)(T * N + 2 * own + 1) * sizeof(float));
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < B; b++)
                failed |= qkv == NULL || attention_rows(p, x, b, b + 1, T, pos, pb, pt, cos_t, sin_t, keys, values, slots,
                                                        sb, S, key_valid, out, qkv) != 0;
            free(qkv);
        }
        return failed ? -1 : 0;
    }
    float *qkv = malloc((size_t)(B * (T * N + 2 * own) + 1) * sizeof(float));
    if (qkv == NULL) return -1;
    int rc = attention_rows(p, x, 0, B, T, pos, pb, pt, cos_t, sin_t, keys, values, slots, sb, S, key_valid, out, qkv);
    free(qkv);
    return rc;
}

/* Output projection, residual + RMSNorm, SwiGLU MLP, residual + RMSNorm (ir.ops.mlp_block):
 * sum = residual + attn W_o^T (+ b_o); h = swiglu(rms_norm(sum) W_gu^T); total = sum + h W_d^T;
 * normed = rms_norm(total) * out_norm. attn [rows, o.k], residual / normed / total [rows, dim]. */
typedef struct {
    dinfer_linear o, gate_up, down;
    const float *norm, *out_norm;
    int64_t dim, hidden;
    float eps;
} dinfer_mlp_plan;

#define MLP_SLICE_ROWS 256 /* rows per pass: the scratch stays rows x (2 dim + 3 hidden) of these */
#define MLP_OUTER_ROWS 64 /* rows per pass at most when the passes split over the threads */
#define MLP_SPLIT_MIN_ROWS 8 /* rows per thread at least for that split */

/* The block for rows [r0, r1) in passes of `slice` rows on the calling thread. */
static int mlp_rows(const dinfer_mlp_plan *p, const float *attn, const float *residual, int64_t r0, int64_t r1,
                    int64_t slice, float *normed, float *total, float *scratch) {
    int64_t D = p->dim, Hd = p->hidden, K = p->o.k;
    float *proj = scratch, *mid = proj + slice * D, *gate_up = mid + slice * D, *act = gate_up + slice * 2 * Hd;
    for (; r0 < r1; r0 += slice) { /* rows are independent: a refresh of 1000+ rows in slices */
        int64_t n = r1 - r0 < slice ? r1 - r0 : slice;
        float *tot = total + r0 * D;
        if (linear_rows(&p->o, attn + r0 * K, n, proj) != 0) return -1;
        dinfer_add_rms_norm_f32(residual + r0 * D, proj, p->norm, mid, tot, n, D, p->eps);
        if (linear_rows(&p->gate_up, mid, n, gate_up) != 0) return -1;
        dinfer_swiglu_f32(gate_up, act, n, Hd);
        if (linear_rows(&p->down, act, n, proj) != 0) return -1;
        dinfer_add_rms_norm_f32(tot, proj, p->out_norm, normed + r0 * D, tot, n, D, p->eps); /* in place: elementwise */
    }
    return 0;
}

int dinfer_mlp_block_f32(const dinfer_mlp_plan *p, const float *attn, const float *residual, int64_t rows,
                         float *normed, float *total) {
    if (blas_sgemm == NULL) return -2;
    int64_t D = p->dim, Hd = p->hidden;
    const dinfer_linear *all[3] = {&p->o, &p->gate_up, &p->down};
    int packed = 1;
    for (int i = 0; i < 3; i++) packed &= all[i]->panels != NULL || all[i]->bf16_panels != NULL;
    int threads = outer_threads();
    if (threads > 1 && packed && rows >= (int64_t)threads * MLP_SPLIT_MIN_ROWS) { /* as dinfer_attention_block_f32 */
        int64_t passes = (rows + MLP_OUTER_ROWS - 1) / MLP_OUTER_ROWS;
        passes = passes < threads ? threads : passes; /* a batch-1 step: one pass per thread */
        int64_t slice = (rows + passes - 1) / passes;
        int failed = 0;
#pragma omp parallel reduction(| : failed)
        {
            float *scratch = malloc((size_t)(slice * (2 * D + 3 * Hd) + 1) * sizeof(float));
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < passes; i++) {
                int64_t r0 = i * slice, r1 = r0 + slice < rows ? r0 + slice : rows;
                failed |= scratch == NULL || mlp_rows(p, attn, residual, r0, r1, slice, normed, total, scratch) != 0;
            }
            free(scratch);
        }
        return failed ? -1 : 0;
    }
    int64_t slice = rows < MLP_SLICE_ROWS ? rows : MLP_SLICE_ROWS;
    float *scratch = malloc((size_t)(slice * (2 * D + 3 * Hd) + 1) * sizeof(float));
    if (scratch == NULL) return -1;
    int rc = mlp_rows(p, attn, residual, 0, rows, slice, normed, total, scratch);
    free(scratch);
    return rc; /* -1: a projection's scratch could not be allocated */
}


/* ---------------------------------------------------------------- small-vocabulary confidence head
 *
 * ir.ops.lm_head_confidence for a vocabulary whose weight fits in L2 (native.py decides): per row
 * the logits z = h W^T, the banned id at -inf, then the softmax statistics in one pass over z:
 * max (top-1 probability 1 / sum exp(z - m)), margin (top-1 minus top-2 probability) or
 * entropy (sum p log p = S / Z - log Z, S = sum exp(z - m) (z - m)), and the argmax (the first
 * on ties, like torch.argmax). A NaN logit gives a NaN score at the first NaN's id (torch's max
 * and argmax return the NaN too). At batch 1 the torch version is five kernels and ~0.15 ms for
 * 40 x 31 logits; this is one call. h [rows, k], W [V, k], conf / token [rows] contiguous. */
static float dot_f32(const float *a, const float *b, int64_t n) {
    v8f a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) a0 += load8(a + i) * load8(b + i), a1 += load8(a + i + 8) * load8(b + i + 8);
    for (; i + 8 <= n; i += 8) a0 += load8(a + i) * load8(b + i);
    v8f t = a0 + a1;
    float s = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

int dinfer_lm_head_confidence_f32(const float *h, int64_t rows, int64_t k, const float *w, int64_t V,
                                  int64_t banned, int kind, float *conf, int64_t *token) {
    int failed = 0;
#pragma omp parallel if (!single_thread && rows > 1 && rows * V * k >= PARALLEL_MIN_WORK) reduction(| : failed)
    {
        float *z = malloc((size_t)(V + 1) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (z == NULL) {
                failed = 1;
                continue;
            }
            const float *hr = h + r * k;
            int64_t best = 0, nan_at = -1;
            float top1 = -INFINITY, top2 = -INFINITY;
            for (int64_t v = 0; v < V; v++) {
                float zv = v == banned ? -INFINITY : dot_f32(hr, w + v * k, k);
                z[v] = zv;
                if (zv != zv) {
                    if (nan_at < 0) nan_at = v;
                } else if (zv > top1) {
                    top2 = top1, top1 = zv, best = v;
                } else if (zv > top2) {
                    top2 = zv;
                }
            }
            if (nan_at >= 0) {
                conf[r] = NAN, token[r] = nan_at;
                continue;
            }
            float zsum = 0.0f, ssum = 0.0f;
            for (int64_t v = 0; v < V; v++) {
                float e = expf(z[v] - top1); /* top1 is the max: e in [0, 1] */
                zsum += e;
                if (kind == 2 && e > 0.0f) ssum += e * (z[v] - top1);
            }
            float p1 = 1.0f / zsum;
            conf[r] = kind == 0 ? p1 : kind == 1 ? p1 - expf(top2 - top1) / zsum : ssum / zsum - logf(zsum);
            token[r] = best;
        }
        free(z);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- commit decision
 *
 * One block step's greedy commit (dinfer_rt/strategies.py, the scheduler's device-side path):
 * threshold: a row commits its masked slots with conf >= thr, and at least its best masked slot
 * (the first on ties, like torch.argmax); top_k: its min(max(quota, 1), masked) best masked
 * slots (ties to the lower slot, like a stable sort). Committed slots take x0 in x_block (row
 * stride xs) and are marked in commit. conf, masked, x0, commit [B, L] contiguous. */
void dinfer_commit_f32(const float *conf, const uint8_t *masked, const int64_t *quota, const int64_t *x0,
                       int64_t *x_block, int64_t xs, uint8_t *commit, int64_t B, int64_t L, float thr, int top_k) {
    for (int64_t r = 0; r < B; r++) {
        const float *c = conf + r * L;
        const uint8_t *m = masked + r * L;
        uint8_t *out = commit + r * L;
        int64_t n_masked = 0;
        for (int64_t j = 0; j < L; j++) {
            out[j] = 0;
            n_masked += m[j] != 0;
        }
        if (n_masked == 0) continue;
        int64_t want = 1;
        if (top_k) {
            want = quota[r] < 1 ? 1 : quota[r];
            if (want > n_masked) want = n_masked;
        } else {
            for (int64_t j = 0; j < L; j++) out[j] = m[j] && c[j] >= thr;
        }
        for (int64_t k = 0; k < want; k++) { /* the best masked slot not yet taken, first on ties */
            int64_t best = -1;
            for (int64_t j = 0; j < L; j++)
                if (m[j] && !(top_k && out[j]) && (best < 0 || c[j] > c[best])) best = j;
            if (best < 0) break;
            out[best] = 1;
        }
        for (int64_t j = 0; j < L; j++)
            if (out[j]) x_block[r * xs + j] = x0[r * L + j];
    }
}
