/* Paged decode attention for the CPU: one query token per sequence, K/V read in place.
 *
 * Built and loaded by engine/cpu_kernels.py (gcc -O3 -march=native, loaded with ctypes).
 * The torch path gathers each sequence's blocks into a padded copy and runs SDPA on it;
 * this reads every K and V row once, straight from its block, and handles all query
 * heads of a KV head (GQA) with that one read. Math in float32, like SDPA's CPU kernel.
 *
 * Layouts (all contiguous, as engine/attention.py describes):
 *   q, out        [B, H, D]
 *   k_cache, v_cache  [num_blocks, KVH, block_size, D]   (one layer)
 *   block_tables  [B, table_stride] int32;  context_lens [B] int32 (>= 1)
 * Work items are (sequence, kv head) pairs, spread over `num_threads` OpenMP threads when
 * built with -fopenmp (linked to the OpenMP runtime torch itself uses, so the two share
 * one thread pool). Returns 0, -1 if scratch memory could not be allocated, -2 for a
 * shape this file does not handle.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64

/* exp(x) for x <= 0 (softmax inputs after subtracting the max), vectorizable: 2^(x log2 e)
 * split into an integer power (exponent bits) and a degree-6 polynomial for 2^f, f in
 * [-0.5, 0.5]; relative error about 2e-7. Inputs below -87 return 0. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: |t| < 2^22 */
    float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180230e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale_bits;
    scale_bits.u = (uint32_t)((int32_t)n + 127) << 23;
    return x <= -87.0f ? 0.0f : p * scale_bits.f;
}

static inline float bf16_load(const uint16_t *p, int i) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)p[i] << 16;
    return v.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* ---- scalar path: any head_dim ---------------------------------------------------------- */
#define F32_LOAD(p, i) ((p)[i])
#define F16_LOAD(p, i) ((float)(p)[i])
#define BF16_LOAD(p, i) bf16_load((p), (i))
#define F32_STORE(p, i, x) ((p)[i] = (x))
#define F16_STORE(p, i, x) ((p)[i] = (_Float16)(x))
#define BF16_STORE(p, i, x) ((p)[i] = bf16_store(x))

/* Row t of a sequence's K (or V) for one KV head. */
#define ROW(cache, t)                                                                        \
    ((cache) + (((int64_t)table[(t) >> block_shift] * kv_heads + kvh) * block_size +         \
                ((t) & (block_size - 1))) * (int64_t)head_dim)

/* Ask for row t's bytes ahead of use: blocks sit anywhere in the cache, so the hardware
 * prefetcher cannot see the next block coming. */
#define PREFETCH_ROW(cache, t, nbytes)                                                       \
    do {                                                                                     \
        const char *p_ = (const char *)ROW(cache, t);                                        \
        for (int o_ = 0; o_ < (nbytes); o_ += 64) __builtin_prefetch(p_ + o_, 0, 3);         \
    } while (0)

/* Softmax over each query head's scores (row stride `stride`), in place; sums[g]. */
static void softmax_rows(float *scores, int G, int64_t len, int64_t stride, float *sums) {
    for (int g = 0; g < G; ++g) {
        float *sg = scores + g * stride, m = -INFINITY, total = 0.0f;
        _Pragma("omp simd reduction(max : m)") for (int64_t t = 0; t < len; ++t) m =
            sg[t] > m ? sg[t] : m;
        _Pragma("omp simd reduction(+ : total)") for (int64_t t = 0; t < len; ++t) {
            sg[t] = exp_neg(sg[t] - m);
            total += sg[t];
        }
        sums[g] = total;
    }
}

#define DEFINE_SCALAR(NAME, T, LOAD, STORE)                                                  \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,   \
                     int64_t b, int kvh, int64_t len, int num_heads, int kv_heads,           \
                     int head_dim, int block_size, float scale, float *scores, float *qs,    \
                     float *acc, T *out) {                                                   \
        const int G = num_heads / kv_heads, D = head_dim;                                    \
        const int block_shift = __builtin_ctz((unsigned)block_size);                         \
        float sums[MAX_GROUP];                                                               \
        for (int g = 0; g < G; ++g) {                                                        \
            const T *qrow = q + (b * num_heads + kvh * G + g) * D;                           \
            for (int d = 0; d < D; ++d) qs[g * D + d] = LOAD(qrow, d) * scale;               \
        }                                                                                    \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            const T *krow = ROW(k_cache, t);                                                 \
            for (int g = 0; g < G; ++g) {                                                    \
                float s = 0.0f;                                                              \
                for (int d = 0; d < D; ++d) s += qs[g * D + d] * LOAD(krow, d);              \
                scores[g * len + t] = s;                                                     \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, G, len, len, sums);                                             \
        memset(acc, 0, sizeof(float) * (size_t)(G * D));                                    \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            const T *vrow = ROW(v_cache, t);                                                 \
            for (int g = 0; g < G; ++g) {                                                    \
                const float p = scores[g * len + t];                                         \
                for (int d = 0; d < D; ++d) acc[g * D + d] += p * LOAD(vrow, d);             \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; ++g) {                                                        \
            T *orow = out + (b * num_heads + kvh * G + g) * D;                               \
            for (int d = 0; d < D; ++d) STORE(orow, d, acc[g * D + d] / sums[g]);            \
        }                                                                                    \
    }

DEFINE_SCALAR(scalar_f32, float, F32_LOAD, F32_STORE)
DEFINE_SCALAR(scalar_bf16, uint16_t, BF16_LOAD, BF16_STORE)
DEFINE_SCALAR(scalar_f16, _Float16, F16_LOAD, F16_STORE)

/* ---- vector path: head_dim a multiple of 16 ---------------------------------------------
 * 16 float lanes per vector (gcc vector extensions: AVX-512 where the CPU has it, pairs of
 * 256-bit or 128-bit registers elsewhere). Scores, 16 rows at a time: each row's K is
 * loaded once; for every query head its products are summed lane-wise into one vector per
 * row, and 15 shuffle-and-add steps turn the 16 rows' vectors into one vector of scores.
 * V: every row's values are added, scaled, into one accumulator per query head. */
typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef uint32_t v16su __attribute__((vector_size(64)));
typedef uint16_t v16hu __attribute__((vector_size(32)));
typedef _Float16 v16hf __attribute__((vector_size(32)));

static inline v16sf vload_f32(const float *p) {
    v16sf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline v16sf vload_bf16(const uint16_t *p) {
    v16hu h;
    __builtin_memcpy(&h, p, sizeof h);
    v16su w = __builtin_convertvector(h, v16su) << 16;
    v16sf f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
static inline v16sf vload_f16(const _Float16 *p) {
    v16hf h;
    __builtin_memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v16sf);
}

/* Two vectors of k rows x s lanes -> one of 2k rows x s/2 lanes, rows kept in order. */
#define FOLD(x, y, LO, HI) (__builtin_shuffle((x), (y), LO) + __builtin_shuffle((x), (y), HI))

static inline v16sf reduce16(const v16sf *p) {
    const v16si lo16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16si hi16 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16si lo8 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16si hi8 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16si lo4 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16si hi4 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16si lo2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16si hi2 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16sf a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) a[i] = FOLD(p[2 * i], p[2 * i + 1], lo16, hi16);
    for (int i = 0; i < 4; ++i) b[i] = FOLD(a[2 * i], a[2 * i + 1], lo8, hi8);
    for (int i = 0; i < 2; ++i) c[i] = FOLD(b[2 * i], b[2 * i + 1], lo4, hi4);
    return FOLD(c[0], c[1], lo2, hi2);
}

#define MAX_CHUNKS (MAX_HEAD_DIM / 16)

#define SHAPE_CASE(NAME, G_, C_)                                                             \
    case G_ * 64 + C_:                                                                       \
        NAME##_impl(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,            \
                    block_size, scale, scores, qv, part, acc, out, G_, C_);                  \
        break;
/* head_dim 32, 64, 128 with 1, 2, 4 or 8 query heads per KV head. */
#define SHAPE_CASES(NAME)                                                                    \
    SHAPE_CASE(NAME, 1, 2) SHAPE_CASE(NAME, 2, 2) SHAPE_CASE(NAME, 4, 2)                     \
    SHAPE_CASE(NAME, 8, 2) SHAPE_CASE(NAME, 1, 4) SHAPE_CASE(NAME, 2, 4)                     \
    SHAPE_CASE(NAME, 4, 4) SHAPE_CASE(NAME, 8, 4) SHAPE_CASE(NAME, 1, 8)                     \
    SHAPE_CASE(NAME, 2, 8) SHAPE_CASE(NAME, 4, 8) SHAPE_CASE(NAME, 8, 8)

/* scores: G rows of `stride` = len rounded up to 16 floats. */
#define DEFINE_VECTOR(NAME, T, VLOAD, STORE)                                                 \
    static inline __attribute__((always_inline)) void NAME##_impl(                           \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t b,     \
        int kvh, int64_t len, int num_heads, int kv_heads, int block_size, float scale,      \
        float *scores, v16sf *qv, v16sf *part, v16sf *acc, T *out, const int G,              \
        const int C) {                                                                       \
        const int head_dim = 16 * C;                                                         \
        const int block_shift = __builtin_ctz((unsigned)block_size);                         \
        const int64_t stride = (len + 15) / 16 * 16;                                         \
        const int row_bytes = head_dim * (int)sizeof(T);                                     \
        float sums[MAX_GROUP];                                                               \
        v16sf x[MAX_CHUNKS];                                                                 \
        for (int g = 0; g < G; ++g) {                                                        \
            const T *qrow = q + (b * num_heads + kvh * G + g) * head_dim;                    \
            for (int c = 0; c < C; ++c) qv[g * C + c] = VLOAD(qrow + 16 * c) * scale;        \
        }                                                                                    \
        for (int64_t t0 = 0; t0 < len; t0 += 16) {                                           \
            const int rows = len - t0 < 16 ? (int)(len - t0) : 16;                           \
            for (int r = 0; r < rows; ++r) {                                                 \
                if (t0 + 16 + r < len) PREFETCH_ROW(k_cache, t0 + 16 + r, row_bytes);        \
                const T *krow = ROW(k_cache, t0 + r);                                        \
                for (int c = 0; c < C; ++c) x[c] = VLOAD(krow + 16 * c);                     \
                for (int g = 0; g < G; ++g) {                                                \
                    v16sf s = qv[g * C] * x[0];                                              \
                    for (int c = 1; c < C; ++c) s += qv[g * C + c] * x[c];                   \
                    part[g * 16 + r] = s;                                                    \
                }                                                                            \
            }                                                                                \
            for (int g = 0; g < G; ++g) {                                                    \
                for (int r = rows; r < 16; ++r) part[g * 16 + r] = (v16sf){0};               \
                v16sf s = reduce16(part + g * 16);                                           \
                __builtin_memcpy(scores + g * stride + t0, &s, sizeof s);                    \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, G, len, stride, sums);                                          \
        for (int i = 0; i < G * C; ++i) acc[i] = (v16sf){0};                                 \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            if (t + 16 < len) PREFETCH_ROW(v_cache, t + 16, row_bytes);                      \
            const T *vrow = ROW(v_cache, t);                                                 \
            for (int c = 0; c < C; ++c) x[c] = VLOAD(vrow + 16 * c);                         \
            for (int g = 0; g < G; ++g) {                                                    \
                const float p = scores[g * stride + t];                                      \
                for (int c = 0; c < C; ++c) acc[g * C + c] += p * x[c];                      \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; ++g) {                                                        \
            T *orow = out + (b * num_heads + kvh * G + g) * head_dim;                        \
            const float inv = 1.0f / sums[g];                                                \
            for (int c = 0; c < C; ++c) {                                                    \
                float o[16];                                                                 \
                v16sf v = acc[g * C + c] * inv;                                              \
                __builtin_memcpy(o, &v, sizeof o);                                           \
                for (int i = 0; i < 16; ++i) STORE(orow, 16 * c + i, o[i]);                  \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    /* The common shapes get copies with G and C known, so accumulators stay in registers. */\
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,   \
                     int64_t b, int kvh, int64_t len, int num_heads, int kv_heads,           \
                     int head_dim, int block_size, float scale, float *scores, v16sf *qv,    \
                     v16sf *part, v16sf *acc, T *out) {                                      \
        const int G = num_heads / kv_heads, C = head_dim / 16;                               \
        switch (G * 64 + C) {                                                                \
        SHAPE_CASES(NAME)                                                                    \
        default:                                                                             \
            NAME##_impl(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,        \
                        block_size, scale, scores, qv, part, acc, out, G, C);                \
        }                                                                                    \
    }

DEFINE_VECTOR(vector_f32, float, vload_f32, F32_STORE)
DEFINE_VECTOR(vector_bf16, uint16_t, vload_bf16, BF16_STORE)
DEFINE_VECTOR(vector_f16, _Float16, vload_f16, F16_STORE)

/* ---- entry points ------------------------------------------------------------------------ */
#define DEFINE_DECODE(NAME, T, SCALAR, VECTOR)                                               \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,    \
             int64_t table_stride, const int32_t *context_lens, T *out, int64_t num_items,   \
             int num_heads, int kv_heads, int head_dim, int block_size, float scale,         \
             int num_threads) {                                                              \
        const int G = num_heads / kv_heads;                                                  \
        if (head_dim > MAX_HEAD_DIM || G > MAX_GROUP || num_heads % kv_heads ||              \
            block_size <= 0 || (block_size & (block_size - 1)))                              \
            return -2;                                                                       \
        const int vec = head_dim % 16 == 0;                                                  \
        int64_t max_len = 1;                                                                 \
        for (int64_t it = 0; it < num_items; it += kv_heads) {                               \
            const int64_t len = context_lens[it / kv_heads];                                 \
            max_len = len > max_len ? len : max_len;                                         \
        }                                                                                    \
        const size_t n_scores = (size_t)G * (size_t)((max_len + 15) / 16 * 16);              \
        const size_t n_vec = (size_t)G * (size_t)head_dim / 16 * 2 + (size_t)G * 16;         \
        int failed = 0;                                                                      \
        (void)num_threads;                                                                   \
        _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)") {              \
            float *scores = aligned_alloc(64, sizeof(float) * n_scores);                     \
            v16sf *vbuf = aligned_alloc(64, sizeof(v16sf) * (n_vec + 1));                    \
            if (!scores || !vbuf) {                                                          \
                _Pragma("omp atomic write") failed = 1;                                      \
            }                                                                                \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < num_items;     \
                                                         ++it) {                             \
                if (!scores || !vbuf) continue;                                              \
                const int64_t b = it / kv_heads;                                             \
                const int kvh = (int)(it % kv_heads);                                        \
                const int32_t *table = block_tables + b * table_stride;                      \
                const int64_t len = context_lens[b];                                         \
                if (vec) {                                                                   \
                    v16sf *qv = vbuf, *acc = vbuf + G * head_dim / 16;                       \
                    v16sf *part = acc + G * head_dim / 16;                                   \
                    VECTOR(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,     \
                           head_dim, block_size, scale, scores, qv, part, acc, out);         \
                } else {                                                                     \
                    float *qs = (float *)vbuf, *acc = qs + G * head_dim;                     \
                    SCALAR(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,     \
                           head_dim, block_size, scale, scores, qs, acc, out);               \
                }                                                                            \
            }                                                                                \
            free(scores);                                                                    \
            free(vbuf);                                                                      \
        }                                                                                    \
        return failed ? -1 : 0;                                                              \
    }

DEFINE_DECODE(pd_decode_f32, float, scalar_f32, vector_f32)
DEFINE_DECODE(pd_decode_bf16, uint16_t, scalar_bf16, vector_bf16)
DEFINE_DECODE(pd_decode_f16, _Float16, scalar_f16, vector_f16)
