/* Paged decode attention for the CPU: one query token per sequence, K/V read in place.
 *
 * Built and loaded by engine/cpu/kernels.py (gcc -O3 -march=native, loaded with ctypes):
 * paged_decode.c instantiates the kernels over a cache of the model's dtype,
 * paged_decode_kv8.c those over an 8-bit cache; the two compile in parallel into one
 * shared object. The torch path gathers each sequence's blocks into a padded copy and
 * runs SDPA on it; this reads every K and V row once, straight from its block, and handles
 * all query heads of a KV head (GQA) with that one read. Math in float32, like SDPA's CPU
 * kernel.
 *
 * Layouts (all contiguous, as engine/modeling/attention.py describes):
 *   q, out        [B, H, D]
 *   k_cache, v_cache  [num_blocks, KVH, block_size, D]   (one layer), of q's dtype,
 *                 or for an 8-bit cache (engine/modeling/kv_quant.py) rows of D + 2 bytes,
 *                 [num_blocks, KVH, block_size, D + 2] uint8: D codes, then a bf16 scale
 *   block_tables  [B, table_stride] int32;  context_lens [B] int32 (>= 1)
 * Work items are (sequence, kv head) pairs, spread over `num_threads` OpenMP threads when
 * built with -fopenmp (linked to the OpenMP runtime torch itself uses, so the two share
 * one thread pool). Returns 0, -1 if scratch memory could not be allocated, -2 for a
 * shape this file does not handle.
 *
 * 8-bit rows are dequantized on the fly, never copied: a row's scale multiplies its scores
 * (q . codes, times the scale) and its softmax weights (p times the scale, before
 * p * codes), so the loops over D only widen codes to float. int8 codes widen directly; an
 * e4m3 code's fields are moved into a float16's (sign, exponent, mantissa, the exponent
 * bias 8 steps apart), which the CPU widens to float32 in hardware, subnormals included,
 * and the 2^8 goes into the scale. (e4m3's NaN, 0x7f/0xff, would read as 480: quantize
 * never writes it.) An 8-bit kernel takes the query dtype as an argument (`QTYPE_*`): q
 * is read and the output written once per work item, outside the loops over the context,
 * so one kernel per code format serves every query dtype at the cost of one compile.
 */
#include <math.h>
#include <stdint.h>

#include "exp2_poly.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
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
    const float p = exp2_poly(f);
    union { uint32_t u; float f; } scale_bits;
    scale_bits.u = (uint32_t)((int32_t)n + 127) << 23;
    return x <= -87.0f ? 0.0f : p * scale_bits.f;
}

static inline float bf16_load(const uint16_t *p, int64_t i) {
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

/* 8-bit codes (engine/modeling/kv_quant.py): the value of code i of a row, before its scale. */
static inline float i8_load(const uint8_t *p, int i) { return (float)(int8_t)p[i]; }

/* An e4m3 code as the float16 with its fields: the code's value / 2^8 (see the header). */
static inline float e4m3_load(const uint8_t *p, int i) {
    const uint16_t h = (uint16_t)(((p[i] & 0x80u) << 8) | ((p[i] & 0x7fu) << 7));
    _Float16 f;
    __builtin_memcpy(&f, &h, sizeof f);
    return (float)f;
}

/* A row's scale: the bf16 after its D codes (2-byte aligned for an even D; read with a
 * memcpy, which compiles to one load, so an odd D works too). */
static inline float row_scale(const uint8_t *row, int head_dim) {
    uint16_t s;
    __builtin_memcpy(&s, row + head_dim, sizeof s);
    return bf16_load(&s, 0);
}
#define I8_SCALE(row, D) row_scale((row), (D))
#define E4M3_SCALE(row, D) (row_scale((row), (D)) * 256.0f)
#define NO_SCALE(row, D) 1.0f

/* Query dtypes of the 8-bit kernels (engine/cpu/kernels.py passes them). */
enum { QTYPE_F32 = 0, QTYPE_BF16 = 1, QTYPE_F16 = 2 };

static inline float qtype_load(const void *p, int qtype, int64_t i) {
    switch (qtype) {
    case QTYPE_BF16: return bf16_load((const uint16_t *)p, i);
    case QTYPE_F16: return (float)((const _Float16 *)p)[i];
    default: return ((const float *)p)[i];
    }
}

static inline void qtype_store(void *p, int qtype, int64_t i, float x) {
    switch (qtype) {
    case QTYPE_BF16: ((uint16_t *)p)[i] = bf16_store(x); break;
    case QTYPE_F16: ((_Float16 *)p)[i] = (_Float16)x; break;
    default: ((float *)p)[i] = x;
    }
}

/* ---- scalar path: any head_dim ----------------------------------------------------------
 * Element loads LOAD(p, i) and stores STORE(p, i, x) by index. */
#define F32_LOAD(p, i) ((p)[i])
#define F16_LOAD(p, i) ((float)(p)[i])
#define BF16_LOAD(p, i) bf16_load((p), (i))
#define I8_LOAD(p, i) i8_load((p), (i))
#define E4M3_LOAD(p, i) e4m3_load((p), (i))
#define ANY_LOAD(p, i) qtype_load((p), qtype, (i))
#define F32_STORE(p, i, x) ((p)[i] = (x))
#define F16_STORE(p, i, x) ((p)[i] = (_Float16)(x))
#define BF16_STORE(p, i, x) ((p)[i] = bf16_store(x))
#define ANY_STORE(p, i, x) qtype_store((p), qtype, (i), (x))

/* Row t of a sequence's K (or V) for one KV head; rows are `row_len` cache elements. */
#define ROW(cache, t)                                                                        \
    ((cache) + (((int64_t)table[(t) >> block_shift] * kv_heads + kvh) * block_size +         \
                ((t) & (block_size - 1))) * (int64_t)row_len)

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

/* q and out hold T (void for an 8-bit kernel: `qtype` says what), read by QLOAD and
 * written by OSTORE. The cache holds CT, read by KLOAD; QUANT: 8-bit rows of D codes and
 * a scale (RSCALE), else rows of D values (RSCALE unused). */
#define DEFINE_SCALAR(NAME, T, QLOAD, OSTORE, CT, KLOAD, QUANT, RSCALE)                      \
    static void NAME(const T *q, const CT *k_cache, const CT *v_cache, const int32_t *table, \
                     int64_t b, int kvh, int64_t len, int num_heads, int kv_heads,           \
                     int head_dim, int block_size, float scale, float *scores, float *qs,    \
                     float *acc, T *out, int qtype) {                                        \
        const int G = num_heads / kv_heads, D = head_dim;                                    \
        const int row_len = QUANT ? D + 2 : D;                                               \
        const int block_shift = __builtin_ctz((unsigned)block_size);                         \
        float sums[MAX_GROUP];                                                               \
        (void)qtype;                                                                         \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t qrow = (b * num_heads + kvh * G + g) * D;                          \
            for (int d = 0; d < D; ++d) qs[g * D + d] = QLOAD(q, qrow + d) * scale;          \
        }                                                                                    \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            const CT *krow = ROW(k_cache, t);                                                \
            for (int g = 0; g < G; ++g) {                                                    \
                float s = 0.0f;                                                              \
                for (int d = 0; d < D; ++d) s += qs[g * D + d] * KLOAD(krow, d);             \
                if (QUANT) s *= RSCALE(krow, D);                                             \
                scores[g * len + t] = s;                                                     \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, G, len, len, sums);                                             \
        memset(acc, 0, sizeof(float) * (size_t)(G * D));                                    \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            const CT *vrow = ROW(v_cache, t);                                                \
            const float vs = QUANT ? RSCALE(vrow, D) : 1.0f;                                 \
            for (int g = 0; g < G; ++g) {                                                    \
                const float p = QUANT ? scores[g * len + t] * vs : scores[g * len + t];      \
                for (int d = 0; d < D; ++d) acc[g * D + d] += p * KLOAD(vrow, d);            \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t orow = (b * num_heads + kvh * G + g) * D;                          \
            for (int d = 0; d < D; ++d) OSTORE(out, orow + d, acc[g * D + d] / sums[g]);     \
        }                                                                                    \
    }

/* ---- vector path: head_dim a multiple of 16 ---------------------------------------------
 * 16 float lanes per vector (gcc vector extensions: AVX-512 where the CPU has it; with AVX2
 * the hot loops use explicit 8-lane halves instead, see DEFINE_VECTOR there). Scores, 16 rows at a time: each row's K is
 * loaded once; for every query head its products are summed lane-wise into one vector per
 * row, and 15 shuffle-and-add steps turn the 16 rows' vectors into one vector of scores.
 * V: every row's values are added, scaled, into one accumulator per query head. */
typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef uint32_t v16su __attribute__((vector_size(64)));
typedef uint16_t v16hu __attribute__((vector_size(32)));
typedef _Float16 v16hf __attribute__((vector_size(32)));
typedef int8_t v16qi __attribute__((vector_size(16)));
typedef uint8_t v16qu __attribute__((vector_size(16)));

/* x in all 16 lanes. NOTE: for `scalar * vector` gcc 12 on AVX2 builds the 64-byte
 * splat in memory, one scalar store per lane, each time; one broadcast does it. */
static inline v16sf splat16(float x) {
    v16sf v;
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256 h[2] = {_mm256_set1_ps(x), _mm256_set1_ps(x)};
    __builtin_memcpy(&v, h, sizeof v);
#else
    v = (v16sf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
    return v;
}
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
/* 16 float16s (as bits) widened to float32. NOTE: gcc 12 widens a vector of _Float16
 * one element at a time (an insert and a scalar convert each) where the CPU has no
 * AVX512-FP16; the F16C instruction does all 16 (or 8) at once. */
static inline v16sf widen_f16(v16hu bits) {
    v16sf f;
#if defined(__AVX512F__)
    __m256i h;
    __builtin_memcpy(&h, &bits, sizeof h);
    const __m512 w = _mm512_cvtph_ps(h);
    __builtin_memcpy(&f, &w, sizeof f);
#elif defined(__F16C__)
    __m128i h[2];
    __builtin_memcpy(h, &bits, sizeof h);
    const __m256 w[2] = {_mm256_cvtph_ps(h[0]), _mm256_cvtph_ps(h[1])};
    __builtin_memcpy(&f, w, sizeof f);
#else
    v16hf h;
    __builtin_memcpy(&h, &bits, sizeof h);
    f = __builtin_convertvector(h, v16sf);
#endif
    return f;
}
static inline v16sf vload_f16(const _Float16 *p) {
    v16hu h;
    __builtin_memcpy(&h, p, sizeof h);
    return widen_f16(h);
}
/* 16 8-bit codes, before their row's scale (as i8_load, e4m3_load). NOTE: gcc 12 widens
 * a vector of int8 lanes one lane at a time, through scalar registers (5x slower than
 * the bf16 kernel); the sign-extending moves do 16 (or 8) at once. */
static inline v16sf vload_i8(const uint8_t *p) {
    v16sf f;
#if defined(__AVX512F__)
    __m128i c;
    __builtin_memcpy(&c, p, sizeof c);
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
    __builtin_memcpy(&f, &w, sizeof f);
#elif defined(__AVX2__)
    const __m128i lo = _mm_loadl_epi64((const __m128i *)p); /* 8 bytes, unaligned */
    const __m128i hi = _mm_loadl_epi64((const __m128i *)(p + 8));
    const __m256 w[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))};
    __builtin_memcpy(&f, w, sizeof f);
#else
    v16qi c;
    __builtin_memcpy(&c, p, sizeof c);
    f = __builtin_convertvector(__builtin_convertvector(c, v16si), v16sf);
#endif
    return f;
}
static inline v16sf vload_e4m3(const uint8_t *p) {
    v16qu c;
    __builtin_memcpy(&c, p, sizeof c);
    const v16hu w = __builtin_convertvector(c, v16hu);
    return widen_f16(((w & 0x80) << 8) | ((w & 0x7f) << 7));
}
static inline v16sf vload_qtype(const void *p, int qtype, int64_t i) {
    switch (qtype) {
    case QTYPE_BF16: return vload_bf16((const uint16_t *)p + i);
    case QTYPE_F16: return vload_f16((const _Float16 *)p + i);
    default: return vload_f32((const float *)p + i);
    }
}
/* 16 elements from index i of a query row: VLOAD(p + i), or by the runtime dtype. */
#define F32_VLOAD(p, i) vload_f32((p) + (i))
#define BF16_VLOAD(p, i) vload_bf16((p) + (i))
#define F16_VLOAD(p, i) vload_f16((p) + (i))
#define ANY_VLOAD(p, i) vload_qtype((p), qtype, (i))

/* Two vectors of k rows x s lanes -> one of 2k rows x s/2 lanes, rows kept in order. */
#define FOLD(x, y, LO, HI) (__builtin_shuffle((x), (y), LO) + __builtin_shuffle((x), (y), HI))

#if defined(__AVX512F__) || !defined(__AVX2__)
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
#else
/* The same sums, in the same tree, for AVX2 (no AVX-512): gcc 12 lowers the 16-lane
 * shuffles above to one scalar move per lane there (most of a decode step's attention
 * time on a 2-core EPYC). Each row's vector v is halved as above: s8[m] = v[m] + v[m + 8],
 * s4[m] = s8[m] + s8[m + 4], s2[m] = s4[m] + s4[m + 2], then s2[0] + s2[1]; here with
 * 256-bit halves, 128-bit lane swaps, 64-bit unpacks and a horizontal add, which leave
 * rows in the order 0 2 4 6 1 3 5 7 (of each 8), undone by one permute. */
/* The 16 scores from the rows' s8 vectors (above), into w[0] (rows 0-7) and w[1]. */
static inline void reduce16_s8(const __m256 *s8, __m256 w[2]) {
    __m256 t[8], u[4];
    for (int i = 0; i < 8; ++i) { /* s4 of rows 2i | 2i + 1 */
        const __m256 r0 = s8[2 * i], r1 = s8[2 * i + 1];
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20),
                             _mm256_permute2f128_ps(r0, r1, 0x31));
    }
    for (int j = 0; j < 4; ++j) {
        const __m256d a = _mm256_castps_pd(t[2 * j]), b = _mm256_castps_pd(t[2 * j + 1]);
        u[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    } /* s2 of rows 4j, 4j + 2 | 4j + 1, 4j + 3 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < 2; ++k)
        w[k] = _mm256_permutevar8x32_ps(_mm256_hadd_ps(u[2 * k], u[2 * k + 1]), order);
}

static inline v16sf reduce16(const v16sf *p) {
    __m256 s8[16], w[2];
    for (int r = 0; r < 16; ++r) {
        __m256 h[2];
        __builtin_memcpy(h, p + r, sizeof h); /* row r: low, high halves */
        s8[r] = _mm256_add_ps(h[0], h[1]);
    }
    reduce16_s8(s8, w);
    v16sf s;
    __builtin_memcpy(&s, w, sizeof s);
    return s;
}
#endif

#define MAX_CHUNKS (MAX_HEAD_DIM / 16)

#define SHAPE_CASE(NAME, G_, C_)                                                             \
    case G_ * 64 + C_:                                                                       \
        NAME##_impl(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,            \
                    block_size, scale, scores, qv, part, acc, out, qtype, G_, C_);           \
        break;
/* head_dim 32, 64, 128 with 1, 2, 4 or 8 query heads per KV head. */
#define SHAPE_CASES(NAME)                                                                    \
    SHAPE_CASE(NAME, 1, 2) SHAPE_CASE(NAME, 2, 2) SHAPE_CASE(NAME, 4, 2)                     \
    SHAPE_CASE(NAME, 8, 2) SHAPE_CASE(NAME, 1, 4) SHAPE_CASE(NAME, 2, 4)                     \
    SHAPE_CASE(NAME, 4, 4) SHAPE_CASE(NAME, 8, 4) SHAPE_CASE(NAME, 1, 8)                     \
    SHAPE_CASE(NAME, 2, 8) SHAPE_CASE(NAME, 4, 8) SHAPE_CASE(NAME, 8, 8)

/* The common shapes get copies with G and C known, so accumulators stay in registers. */
#define DEFINE_VECTOR_ENTRY(NAME, T, CT)                                                     \
    static void NAME(const T *q, const CT *k_cache, const CT *v_cache, const int32_t *table, \
                     int64_t b, int kvh, int64_t len, int num_heads, int kv_heads,           \
                     int head_dim, int block_size, float scale, float *scores, v16sf *qv,    \
                     v16sf *part, v16sf *acc, T *out, int qtype) {                           \
        const int G = num_heads / kv_heads, C = head_dim / 16;                               \
        switch (G * 64 + C) {                                                                \
        SHAPE_CASES(NAME)                                                                    \
        default:                                                                             \
            NAME##_impl(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,        \
                        block_size, scale, scores, qv, part, acc, out, qtype, G, C);         \
        }                                                                                    \
    }

#if defined(__AVX2__) && !defined(__AVX512F__)
/* ---- the vector path with AVX2 (no AVX-512): the same sums in 8-lane registers ---------
 * gcc 12 keeps a 16-lane vector in memory on AVX2 and moves it through general registers,
 * so here each 16-element chunk of a K/V row is two 8-lane halves, loaded straight into
 * registers. Lane for lane the sums are the 16-lane path's: a row's score vector is its
 * low half plus its high half (reduce16's first fold), then reduce16_s8; P.V accumulates
 * the halves separately. */
typedef float v8sf __attribute__((vector_size(32)));
typedef uint16_t v8hu __attribute__((vector_size(16)));
typedef uint32_t v8su __attribute__((vector_size(32)));
typedef uint8_t v8qu __attribute__((vector_size(8)));

static inline v8sf splat8(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }
static inline v8sf vload_f32_8(const float *p) {
    v8sf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline v8sf vload_bf16_8(const uint16_t *p) {
    v8hu h;
    __builtin_memcpy(&h, p, sizeof h);
    const v8su w = __builtin_convertvector(h, v8su) << 16;
    v8sf f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
static inline v8sf widen_f16_8(v8hu bits) {
    v8sf f;
#if defined(__F16C__)
    __m128i h;
    __builtin_memcpy(&h, &bits, sizeof h);
    const __m256 w = _mm256_cvtph_ps(h);
    __builtin_memcpy(&f, &w, sizeof f);
#else
    typedef _Float16 v8hf __attribute__((vector_size(16)));
    v8hf h;
    __builtin_memcpy(&h, &bits, sizeof h);
    f = __builtin_convertvector(h, v8sf);
#endif
    return f;
}
static inline v8sf vload_f16_8(const _Float16 *p) {
    v8hu h;
    __builtin_memcpy(&h, p, sizeof h);
    return widen_f16_8(h);
}
static inline v8sf vload_i8_8(const uint8_t *p) {
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8sf f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
static inline v8sf vload_e4m3_8(const uint8_t *p) {
    v8qu c;
    __builtin_memcpy(&c, p, sizeof c);
    const v8hu w = __builtin_convertvector(c, v8hu);
    return widen_f16_8(((w & 0x80) << 8) | ((w & 0x7f) << 7));
}

/* As the 16-lane DEFINE_VECTOR below; KVLOAD##_8 reads 8 cache elements. The buffers are
 * the 16-lane path's, used as 8-lane halves: qv and acc hold G * C low halves, then as
 * many high halves; part holds 16 rows' s8 per query head. */
#define DEFINE_VECTOR(NAME, T, QVLOAD, OSTORE, CT, KVLOAD, QUANT, RSCALE)                    \
    static inline __attribute__((always_inline)) void NAME##_impl(                           \
        const T *q, const CT *k_cache, const CT *v_cache, const int32_t *table, int64_t b,   \
        int kvh, int64_t len, int num_heads, int kv_heads, int block_size, float scale,      \
        float *scores, v16sf *qv, v16sf *part, v16sf *acc, T *out, int qtype, const int G,   \
        const int C) {                                                                       \
        const int head_dim = 16 * C;                                                         \
        const int row_len = QUANT ? head_dim + 2 : head_dim;                                 \
        const int block_shift = __builtin_ctz((unsigned)block_size);                         \
        const int64_t stride = (len + 15) / 16 * 16;                                         \
        const int row_bytes = row_len * (int)sizeof(CT);                                     \
        float sums[MAX_GROUP];                                                               \
        float rs[16] = {0};                                                                  \
        v8sf xl[MAX_CHUNKS], xh[MAX_CHUNKS];                                                 \
        v8sf *ql = (v8sf *)qv, *qh = ql + G * C, *al = (v8sf *)acc, *ah = al + G * C;        \
        __m256 *s8 = (__m256 *)part;                                                         \
        (void)qtype;                                                                         \
        (void)rs;                                                                            \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t qrow = (b * num_heads + kvh * G + g) * head_dim;                   \
            for (int c = 0; c < C; ++c) {                                                    \
                const v16sf v = QVLOAD(q, qrow + 16 * c) * scale;                            \
                __builtin_memcpy(ql + g * C + c, &v, sizeof(v8sf));                          \
                __builtin_memcpy(qh + g * C + c, (const char *)&v + sizeof(v8sf),            \
                                 sizeof(v8sf));                                              \
            }                                                                                \
        }                                                                                    \
        for (int64_t t0 = 0; t0 < len; t0 += 16) {                                           \
            const int rows = len - t0 < 16 ? (int)(len - t0) : 16;                           \
            for (int r = 0; r < rows; ++r) {                                                 \
                if (t0 + 16 + r < len) PREFETCH_ROW(k_cache, t0 + 16 + r, row_bytes);        \
                const CT *krow = ROW(k_cache, t0 + r);                                       \
                if (QUANT) rs[r] = RSCALE(krow, head_dim);                                   \
                for (int c = 0; c < C; ++c) {                                                \
                    xl[c] = KVLOAD##_8(krow + 16 * c);                                       \
                    xh[c] = KVLOAD##_8(krow + 16 * c + 8);                                   \
                }                                                                            \
                for (int g = 0; g < G; ++g) {                                                \
                    v8sf sl = ql[g * C] * xl[0], sh = qh[g * C] * xh[0];                     \
                    for (int c = 1; c < C; ++c) {                                            \
                        sl += ql[g * C + c] * xl[c];                                         \
                        sh += qh[g * C + c] * xh[c];                                         \
                    }                                                                        \
                    s8[g * 16 + r] = (__m256)(sl + sh);                                      \
                }                                                                            \
            }                                                                                \
            for (int g = 0; g < G; ++g) {                                                    \
                __m256 w[2];                                                                 \
                for (int r = rows; r < 16; ++r) s8[g * 16 + r] = _mm256_setzero_ps();        \
                reduce16_s8(s8 + g * 16, w);                                                 \
                for (int k = 0; k < 2; ++k) {                                                \
                    if (QUANT) w[k] = _mm256_mul_ps(w[k], _mm256_loadu_ps(rs + 8 * k));      \
                    _mm256_storeu_ps(scores + g * stride + t0 + 8 * k, w[k]);                \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, G, len, stride, sums);                                          \
        for (int i = 0; i < G * C; ++i) al[i] = ah[i] = splat8(0.0f);                        \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            if (t + 16 < len) PREFETCH_ROW(v_cache, t + 16, row_bytes);                      \
            const CT *vrow = ROW(v_cache, t);                                                \
            const float vs = QUANT ? RSCALE(vrow, head_dim) : 1.0f;                          \
            for (int c = 0; c < C; ++c) {                                                    \
                xl[c] = KVLOAD##_8(vrow + 16 * c);                                           \
                xh[c] = KVLOAD##_8(vrow + 16 * c + 8);                                       \
            }                                                                                \
            for (int g = 0; g < G; ++g) {                                                    \
                const float p = QUANT ? scores[g * stride + t] * vs : scores[g * stride + t];\
                const v8sf pv = splat8(p);                                                   \
                for (int c = 0; c < C; ++c) {                                                \
                    al[g * C + c] += pv * xl[c];                                             \
                    ah[g * C + c] += pv * xh[c];                                             \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t orow = (b * num_heads + kvh * G + g) * head_dim;                   \
            const v8sf inv = splat8(1.0f / sums[g]);                                         \
            for (int c = 0; c < C; ++c) {                                                    \
                float o[16];                                                                 \
                const v8sf lo = al[g * C + c] * inv, hi = ah[g * C + c] * inv;               \
                __builtin_memcpy(o, &lo, sizeof lo);                                         \
                __builtin_memcpy(o + 8, &hi, sizeof hi);                                     \
                for (int i = 0; i < 16; ++i) OSTORE(out, orow + 16 * c + i, o[i]);           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    DEFINE_VECTOR_ENTRY(NAME, T, CT)
#else
/* scores: G rows of `stride` = len rounded up to 16 floats. T, QVLOAD, OSTORE, CT and
 * QUANT as in DEFINE_SCALAR; KVLOAD reads 16 cache elements. With QUANT, the 16 rows'
 * scales (rs) multiply their 16 scores in one vector product, a V row's scale its weights. */
#define DEFINE_VECTOR(NAME, T, QVLOAD, OSTORE, CT, KVLOAD, QUANT, RSCALE)                    \
    static inline __attribute__((always_inline)) void NAME##_impl(                           \
        const T *q, const CT *k_cache, const CT *v_cache, const int32_t *table, int64_t b,   \
        int kvh, int64_t len, int num_heads, int kv_heads, int block_size, float scale,      \
        float *scores, v16sf *qv, v16sf *part, v16sf *acc, T *out, int qtype, const int G,   \
        const int C) {                                                                       \
        const int head_dim = 16 * C;                                                         \
        const int row_len = QUANT ? head_dim + 2 : head_dim;                                 \
        const int block_shift = __builtin_ctz((unsigned)block_size);                         \
        const int64_t stride = (len + 15) / 16 * 16;                                         \
        const int row_bytes = row_len * (int)sizeof(CT);                                     \
        float sums[MAX_GROUP];                                                               \
        float rs[16] = {0};                                                                  \
        v16sf x[MAX_CHUNKS];                                                                 \
        (void)qtype;                                                                         \
        (void)rs;                                                                            \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t qrow = (b * num_heads + kvh * G + g) * head_dim;                   \
            for (int c = 0; c < C; ++c) qv[g * C + c] = QVLOAD(q, qrow + 16 * c) * scale;    \
        }                                                                                    \
        for (int64_t t0 = 0; t0 < len; t0 += 16) {                                           \
            const int rows = len - t0 < 16 ? (int)(len - t0) : 16;                           \
            for (int r = 0; r < rows; ++r) {                                                 \
                if (t0 + 16 + r < len) PREFETCH_ROW(k_cache, t0 + 16 + r, row_bytes);        \
                const CT *krow = ROW(k_cache, t0 + r);                                       \
                if (QUANT) rs[r] = RSCALE(krow, head_dim);                                   \
                for (int c = 0; c < C; ++c) x[c] = KVLOAD(krow + 16 * c);                    \
                for (int g = 0; g < G; ++g) {                                                \
                    v16sf s = qv[g * C] * x[0];                                              \
                    for (int c = 1; c < C; ++c) s += qv[g * C + c] * x[c];                   \
                    part[g * 16 + r] = s;                                                    \
                }                                                                            \
            }                                                                                \
            for (int g = 0; g < G; ++g) {                                                    \
                for (int r = rows; r < 16; ++r) part[g * 16 + r] = (v16sf){0};               \
                v16sf s = reduce16(part + g * 16);                                           \
                if (QUANT) s *= vload_f32(rs);                                               \
                __builtin_memcpy(scores + g * stride + t0, &s, sizeof s);                    \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, G, len, stride, sums);                                          \
        for (int i = 0; i < G * C; ++i) acc[i] = (v16sf){0};                                 \
        for (int64_t t = 0; t < len; ++t) {                                                  \
            if (t + 16 < len) PREFETCH_ROW(v_cache, t + 16, row_bytes);                      \
            const CT *vrow = ROW(v_cache, t);                                                \
            const float vs = QUANT ? RSCALE(vrow, head_dim) : 1.0f;                          \
            for (int c = 0; c < C; ++c) x[c] = KVLOAD(vrow + 16 * c);                        \
            for (int g = 0; g < G; ++g) {                                                    \
                const float p = QUANT ? scores[g * stride + t] * vs : scores[g * stride + t];\
                const v16sf pv = splat16(p);                                                 \
                for (int c = 0; c < C; ++c) acc[g * C + c] += pv * x[c];                     \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; ++g) {                                                        \
            const int64_t orow = (b * num_heads + kvh * G + g) * head_dim;                   \
            const float inv = 1.0f / sums[g];                                                \
            for (int c = 0; c < C; ++c) {                                                    \
                float o[16];                                                                 \
                v16sf v = acc[g * C + c] * inv;                                              \
                __builtin_memcpy(o, &v, sizeof o);                                           \
                for (int i = 0; i < 16; ++i) OSTORE(out, orow + 16 * c + i, o[i]);           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    DEFINE_VECTOR_ENTRY(NAME, T, CT)
#endif

/* ---- entry points ------------------------------------------------------------------------
 * DEFINE_DECODE defines `static int NAME(..., int qtype)`; the exported kernels wrap it. */
#define DEFINE_DECODE(NAME, T, CT, SCALAR, VECTOR)                                           \
    static int NAME(const T *q, const CT *k_cache, const CT *v_cache,                        \
                    const int32_t *block_tables, int64_t table_stride,                       \
                    const int32_t *context_lens, T *out, int64_t num_items, int num_heads,   \
                    int kv_heads, int head_dim, int block_size, float scale, int num_threads,\
                    int qtype) {                                                             \
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
                           head_dim, block_size, scale, scores, qv, part, acc, out, qtype);  \
                } else {                                                                     \
                    float *qs = (float *)vbuf, *acc = qs + G * head_dim;                     \
                    SCALAR(q, k_cache, v_cache, table, b, kvh, len, num_heads, kv_heads,     \
                           head_dim, block_size, scale, scores, qs, acc, out, qtype);        \
                }                                                                            \
            }                                                                                \
            free(scores);                                                                    \
            free(vbuf);                                                                      \
        }                                                                                    \
        return failed ? -1 : 0;                                                              \
    }

/* The exported signature (engine/cpu/kernels.py's argtypes), the same for every kernel. */
#define EXPORT_DECODE(NAME, T, CT, IMPL, QTYPE)                                              \
    int NAME(const T *q, const CT *k_cache, const CT *v_cache, const int32_t *block_tables,  \
             int64_t table_stride, const int32_t *context_lens, T *out, int64_t num_items,   \
             int num_heads, int kv_heads, int head_dim, int block_size, float scale,         \
             int num_threads) {                                                              \
        return IMPL(q, k_cache, v_cache, block_tables, table_stride, context_lens, out,      \
                    num_items, num_heads, kv_heads, head_dim, block_size, scale,             \
                    num_threads, QTYPE);                                                     \
    }
