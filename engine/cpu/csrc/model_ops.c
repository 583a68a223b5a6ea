/* The model's small per-layer ops for the CPU, one call each where torch runs 5-12 ops:
 * the residual add with the RMS norm, the rotary embedding of q and k, and the MLP's
 * SiLU-and-multiply (engine/modeling/ops.py, `CpuOps`).
 *
 * Each torch op of a decode step is a dispatch of 5-15 us on a few thousand elements, and
 * with two threads ATen splits even those across the pool (a wake-up and a barrier
 * each): on the mid model at batch 32 the ~30 such ops a layer took more time at 2 threads
 * than at 1. These loops do the same arithmetic with the same roundings as the torch ops
 * they replace (`rms_norm`, `apply_rotary`, `F.silu(gate) * up`), so results are those of
 * the reference, except the norm's mean of squares, summed here in double precision
 * (torch sums float32 in its own order), and the SiLU's exp, a polynomial here (2e-7
 * relative error, torch's 1 ulp): bfloat16 results equal torch's (the final rounding
 * absorbs the difference; tests/engine/test_cpu_model_ops.py), float32 ones agree to a few ulp.
 *
 * Layouts: rows of `hidden` (or heads x head_dim) elements; an input's rows may be
 * `stride` elements apart (q and k are column slices of the fused qkv output), outputs
 * are contiguous. dtype: 0 float32, 1 bfloat16 (the values the engine's CPU backend
 * takes). Rows are spread over `threads` OpenMP threads only when there are enough of
 * them to pay for the wake-up. Contraction into FMAs is off: each product and sum is
 * rounded as torch rounds it.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exp2_poly.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

/* At least this many elements in a call before its rows go to more than one thread. */
#define PARALLEL_MIN_ELEMENTS 16384
/* The widest norm row (a float32 copy of it sits on the stack). */
#define MAX_HIDDEN 16384

/* exp(x), vectorizable: 2^(x log2 e) split into an integer power n and a degree-6
 * polynomial for 2^f, f in [-0.5, 0.5] (relative error about 2e-7; torch's vectorized
 * expf: 1 ulp). 2^n is applied as two halves, so that the result overflows to infinity and
 * underflows through the subnormals where expf does (silu(-100) is then -0, as torch's). */
static inline float exp_any(float x) {
    x = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    float t = x * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: |t| < 2^22 */
    float f = t - n;
    const float p = exp2_poly(f);
    const int32_t whole = (int32_t)n, half = whole / 2;
    union { uint32_t u; float f; } a, b;
    a.u = (uint32_t)(half + 127) << 23;
    b.u = (uint32_t)(whole - half + 127) << 23;
    return (p * a.f) * b.f;
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load(const void *p, const int dt, int64_t i) {
    return dt == DT_BF16 ? pd_from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

ALWAYS_INLINE void store(void *p, const int dt, int64_t i, float x) {
    if (dt == DT_BF16)
        ((uint16_t *)p)[i] = pd_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* x as the dtype holds it: an op's result in the tensor's dtype. */
ALWAYS_INLINE float round_to(float x, const int dt) {
    return dt == DT_BF16 ? pd_from_bf16(pd_to_bf16(x)) : x;
}

/* One row: s = x + residual (rounded), kept in residual_out when asked; then
 * out = weight * (s * rsqrt(mean(s^2) + eps) rounded), as transformers' LlamaRMSNorm. */
ALWAYS_INLINE void norm_row(const void *x, const void *residual, void *residual_out,
                            void *out, const void *weight, int64_t hidden, float eps,
                            const int dt, float *s) {
    double total = 0.0;
    _Pragma("omp simd reduction(+ : total)") for (int64_t i = 0; i < hidden; ++i) {
        float v = load(x, dt, i);
        if (residual) v = round_to(v + load(residual, dt, i), dt);
        s[i] = v;
        float sq = v * v; /* pow(2) in float32 */
        total += (double)sq;
    }
    if (residual_out)
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; ++i) store(residual_out, dt, i, s[i]);
    float mean = (float)total * (1.0f / (float)hidden);
    float r = 1.0f / sqrtf(mean + eps);
    _Pragma("omp simd") for (int64_t i = 0; i < hidden; ++i) {
        float y = round_to(s[i] * r, dt);
        store(out, dt, i, load(weight, dt, i) * y);
    }
}

/* out[t] = norm(x[t] (+ residual[t])), residual_out[t] = the sum; residual and
 * residual_out NULL for a plain norm. Returns 0, -2 for a dtype or size it does not take. */
int pd_add_rms_norm(const void *x, int64_t x_stride, const void *residual, void *residual_out,
                    void *out, const void *weight, int64_t rows, int64_t hidden, float eps,
                    int dtype, int threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || hidden <= 0 || hidden > MAX_HIDDEN) return -2;
    const int size = dtype == DT_BF16 ? 2 : 4;
    const int many = threads > 1 && rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS;
    _Pragma("omp parallel for num_threads(threads) if (many) schedule(static)")
    for (int64_t t = 0; t < rows; ++t) {
        float s[MAX_HIDDEN];
        const char *xr = (const char *)x + t * x_stride * size;
        const char *rr = residual ? (const char *)residual + t * hidden * size : 0;
        char *ro = residual_out ? (char *)residual_out + t * hidden * size : 0;
        char *o = (char *)out + t * hidden * size;
        if (dtype == DT_BF16)
            norm_row(xr, rr, ro, o, weight, hidden, eps, DT_BF16, s);
        else
            norm_row(xr, rr, ro, o, weight, hidden, eps, DT_F32, s);
    }
    return 0;
}

/* One token's heads rotated (neox: halves, not pairs) by its cos/sin rows:
 * out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype. */
ALWAYS_INLINE void rotate_token(const void *x, void *out, int heads, int head_dim,
                                const void *cos_row, const void *sin_row, const int dt) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; ++h) {
        const int64_t base = (int64_t)h * head_dim;
        _Pragma("omp simd") for (int i = 0; i < half; ++i) {
            float x1 = load(x, dt, base + i), x2 = load(x, dt, base + half + i);
            float a = round_to(x1 * load(cos_row, dt, i), dt);
            float b = round_to(-x2 * load(sin_row, dt, i), dt);
            store(out, dt, base + i, a + b);
            float c = round_to(x2 * load(cos_row, dt, half + i), dt);
            float d = round_to(x1 * load(sin_row, dt, half + i), dt);
            store(out, dt, base + half + i, c + d);
        }
    }
}

/* q_out [T, heads, D], k_out [T, kv_heads, D] rotated from q and k (token rows
 * q_stride / k_stride elements apart) at positions[t] of the cos/sin tables
 * [max_positions, D]. Returns 0, -2 for a dtype or shape it does not take, -3 for a
 * position outside the tables. */
int pd_rotary_neox(const int64_t *positions, int64_t tokens, const void *q, int64_t q_stride,
                   const void *k, int64_t k_stride, void *q_out, void *k_out, int heads,
                   int kv_heads, int head_dim, const void *cos, const void *sin,
                   int64_t max_positions, int dtype, int threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || head_dim <= 0 || head_dim % 2) return -2;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -3;
    const int size = dtype == DT_BF16 ? 2 : 4;
    const int many =
        threads > 1 && tokens > 1 && tokens * (heads + kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS;
    _Pragma("omp parallel for num_threads(threads) if (many) schedule(static)")
    for (int64_t t = 0; t < tokens; ++t) {
        const char *c = (const char *)cos + positions[t] * head_dim * size;
        const char *s = (const char *)sin + positions[t] * head_dim * size;
        const char *qi = (const char *)q + t * q_stride * size;
        const char *ki = (const char *)k + t * k_stride * size;
        char *qo = (char *)q_out + t * (int64_t)heads * head_dim * size;
        char *ko = (char *)k_out + t * (int64_t)kv_heads * head_dim * size;
        if (dtype == DT_BF16) {
            rotate_token(qi, qo, heads, head_dim, c, s, DT_BF16);
            rotate_token(ki, ko, kv_heads, head_dim, c, s, DT_BF16);
        } else {
            rotate_token(qi, qo, heads, head_dim, c, s, DT_F32);
            rotate_token(ki, ko, kv_heads, head_dim, c, s, DT_F32);
        }
    }
    return 0;
}

ALWAYS_INLINE void silu_mul_row(const void *gate_up, void *out, int64_t width, const int dt) {
    _Pragma("omp simd") for (int64_t i = 0; i < width; ++i) {
        float g = load(gate_up, dt, i);
        float a = round_to(g / (1.0f + exp_any(-g)), dt); /* F.silu in the dtype */
        store(out, dt, i, a * load(gate_up, dt, width + i));
    }
}

/* out [T, width] = silu(gate) * up for gate_up [T, 2 * width] (gate, then up). */
int pd_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype,
                int threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || width <= 0) return -2;
    const int size = dtype == DT_BF16 ? 2 : 4;
    const int many = threads > 1 && rows > 1 && rows * width >= PARALLEL_MIN_ELEMENTS;
    _Pragma("omp parallel for num_threads(threads) if (many) schedule(static)")
    for (int64_t t = 0; t < rows; ++t) {
        const char *g = (const char *)gate_up + t * 2 * width * size;
        char *o = (char *)out + t * width * size;
        if (dtype == DT_BF16)
            silu_mul_row(g, o, width, DT_BF16);
        else
            silu_mul_row(g, o, width, DT_F32);
    }
    return 0;
}

/* The index of the largest value of row x[0, n), as torch.argmax picks it: the first
 * maximum, or the first NaN if the row holds one (NaN compares greater than anything).
 * Two vectorized passes: the maximum (and whether a NaN occurs), then the first element
 * equal to it, found a block at a time. torch's CPU argmax compares element by element
 * (about 1.2 ms for 32 rows of a 32k vocabulary on one AVX2 core, and no faster on two):
 * a greedy decode step's serial remainder. */
#define ARGMAX_BLOCK 64
static int64_t argmax_row(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    _Pragma("omp simd reduction(max : m) reduction(| : nan)")
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        nan |= v != v;
        m = v > m ? v : m;
    }
    for (int64_t start = 0; start < n; start += ARGMAX_BLOCK) {
        const int64_t end = start + ARGMAX_BLOCK < n ? start + ARGMAX_BLOCK : n;
        int hit = 0;
        _Pragma("omp simd reduction(| : hit)")
        for (int64_t i = start; i < end; ++i) hit |= nan ? x[i] != x[i] : x[i] == m;
        if (hit)
            for (int64_t i = start; i < end; ++i)
                if (nan ? x[i] != x[i] : x[i] == m) return i;
    }
    return 0; /* n == 0 does not reach here (the caller checks) */
}

/* out[r] = argmax of row r of x [rows, n] float32, rows `stride` elements apart. */
int pd_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                  int threads) {
    if (rows < 0 || n <= 0 || stride < n) return -2;
    const int many = threads > 1 && rows > 1 && rows * n >= PARALLEL_MIN_ELEMENTS;
    _Pragma("omp parallel for num_threads(threads) if (many) schedule(static)")
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, n);
    return 0;
}
