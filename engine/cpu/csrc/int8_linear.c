/* Weight-only int8 linear for the CPU: y[b, n] = scale[n] * sum_k x[b, k] * w[n, k].
 *
 * Built by engine/cpu/kernels.py's _build (gcc -O3 -march=native), loaded with ctypes by
 * engine/cpu/int8.py for engine/modeling/linear.py's Int8Linear. A decode step is bound by the
 * bytes of weight it reads, so each call reads each int8 weight once, in one sequential
 * stream, and widens it in registers -- never a dequantized copy of the whole weight.
 * With more than BB activation rows, a group's rows are widened once into a small
 * per-thread tile (in cache) that every block of BT activation rows then reads; more
 * than MB rows (a prefill) go MB at a time, so that their x stays in cache.
 *
 * The weight is packed once, at load (Int8Linear; `i8_pack_index` says where each value
 * goes): groups of R rows, each cut into chunks of C values of K; group g, chunk j, row r
 * is the C bytes at ((g * chunks + j) * R + r) * C. Rows N..(a multiple of R) and columns
 * K..(a multiple of C) are zero. Row-major rows read R at a time made R short strided
 * streams that ran at half the memory bandwidth of one sequential stream here (Zen 4).
 * Within a chunk the bytes are in the order the bf16 path widens them (`chunk_index`).
 *
 * x [B, K] rows `ldx` elements apart, float32, bfloat16 or float16 (`dtype`); scales [N]
 * and y [B, N] (contiguous) in x's dtype. Sums in float32; y = round(sum * scale).
 * Output row groups are spread over `num_threads` OpenMP threads (the runtime torch uses,
 * so they share its pool); each output is computed whole by one thread, so results do not
 * depend on the thread count, nor a row's on the other rows of x. Returns 0, -1 if
 * scratch memory could not be allocated, -2 for arguments this file does not take.
 *
 * Paths (`i8_linear_path`): 2, AVX-512 (F, BW, VL, VBMI) with AVX512_BF16: bf16 x by
 * vdpbf16ps, the int8 widened to bf16 by two byte lookups (|q| <= 127: exact in bf16);
 * 1, AVX-512: float32 FMAs, the int8 widened by vpmovsxbd/vcvtdq2ps; 0: a plain C loop,
 * correct but slower than torch's own op (Int8Linear then keeps torch's). x other than
 * what the path multiplies is first copied, widened, into a float32 scratch row.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define I8_AVX512 1
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define I8_BF16DP 1
#endif
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define R 4  /* output rows a group */
#define C 64 /* values of K a chunk: one cache line of int8 */
#define BB 4 /* activation rows a register block, the weight widened in registers */
#define BT 6 /* activation rows a register block, the weight read from a tile */

#define INLINE static inline __attribute__((always_inline))

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#else
#define THREAD_ID 0
#endif

/* The column (within its chunk) of the byte at position p of a packed chunk: the bf16
 * path unpacks the low and high 8 bytes of each 16-byte lane apart, so byte p holds
 * column (p / 16) * 8 + p % 8 of the first 32 when p % 16 < 8, else of the last 32. */
INLINE int chunk_index(int p) {
    const int lane = p >> 4, j = p & 15;
    return j < 8 ? lane * 8 + j : 32 + lane * 8 + (j - 8);
}

/* For the packer: the offset of w[n, k] in the packed weight of K columns. */
int64_t i8_pack_index(int64_t n, int64_t k, int64_t K) {
    const int64_t chunks = (K + C - 1) / C, j = k / C;
    int p = 0;
    while (chunk_index(p) != (int)(k % C)) ++p;
    return ((n / R * chunks + j) * R + n % R) * C + p;
}

INLINE float load_f(int dtype, const void *p, int64_t i) {
    if (dtype == DT_F32) return ((const float *)p)[i];
    if (dtype == DT_BF16) return pd_from_bf16(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

INLINE void store_f(int dtype, void *p, int64_t i, float v) {
    if (dtype == DT_F32)
        ((float *)p)[i] = v;
    else if (dtype == DT_BF16)
        ((uint16_t *)p)[i] = pd_to_bf16(v);
    else
        ((_Float16 *)p)[i] = (_Float16)v;
}

/* y[b0 + b, n0 + r] = sums[b][r] * scale[n0 + r] for the group's real rows. */
INLINE void store_group(int dtype, const float sums[][R], int nb, const void *scales, void *y,
                        int64_t N, int64_t n0, int64_t b0) {
    for (int r = 0; r < R && n0 + r < N; ++r) {
        const float s = load_f(dtype, scales, n0 + r);
        for (int b = 0; b < nb; ++b) store_f(dtype, y, (b0 + b) * N + n0 + r, sums[b][r] * s);
    }
}

#ifdef I8_AVX512
/* 8 values of x from x + i, as float32 */
INLINE __m256 load8_f32(int dtype, const void *x, int64_t i) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dtype == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
#endif

/* x as float32 in the packed column order, zero past K: row b at out + b * kp. */
static void copy_x_f32(int dtype, const void *x, int64_t ldx, int64_t B, int64_t K, int64_t kp,
                       float *out) {
    for (int64_t b = 0; b < B; ++b) {
        int64_t j = 0;
#ifdef I8_AVX512
        /* positions 16h.. of a chunk hold its columns 8h..8h+7, then 32+8h..32+8h+7 */
        for (; j + C <= K; j += C)
            for (int h = 0; h < 4; ++h) {
                const __m256 lo = load8_f32(dtype, x, b * ldx + j + 8 * h);
                const __m256 hi = load8_f32(dtype, x, b * ldx + j + 32 + 8 * h);
                const __m512d v = _mm512_insertf64x4(
                    _mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1);
                _mm512_store_ps(out + b * kp + j + 16 * h, _mm512_castpd_ps(v));
            }
#endif
        for (; j < kp; j += C)
            for (int p = 0; p < C; ++p) {
                const int64_t k = j + chunk_index(p);
                out[b * kp + j + p] = k < K ? load_f(dtype, x, b * ldx + k) : 0.0f;
            }
    }
}

/* ---- portable path ------------------------------------------------------------------- */

__attribute__((unused)) static void group_scalar(int dtype, const float *xs, int64_t kp, const int8_t *wg,
                         const void *scales, void *y, int64_t B, int64_t N, int64_t n0) {
    for (int64_t b = 0; b < B; ++b) {
        float sums[1][R];
        for (int r = 0; r < R; ++r) {
            float acc = 0.0f;
            for (int64_t j = 0; j < kp; j += C) {
                const int8_t *w = wg + (j / C * R + r) * C;
                const float *xb = xs + b * kp + j;
                _Pragma("omp simd reduction(+ : acc)") for (int p = 0; p < C; ++p) acc +=
                    xb[p] * (float)w[p];
            }
            sums[0][r] = acc;
        }
        store_group(dtype, sums, 1, scales, y, N, n0, b);
    }
}

#ifdef I8_AVX512
/* ---- AVX-512 ---------------------------------------------------------------------------
 * A block: a group's R rows against NB (<= BB) activation rows, over all chunks; the R
 * rows come as int8 (widened in registers) or from a tile the group was widened into.
 * Accumulators are named variables (c<row><b>), not an array, so that they stay in
 * registers; NB is a constant in each instantiation and unused ones vanish. */

/* [sum(a), sum(b), sum(c), sum(d)] */
INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                       _mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 4 floats rounded to bf16 (to nearest even), in the low 8 bytes */
INLINE __m128i store_bf16x4(__m128 v) {
#ifdef __AVX512BF16__
    return (__m128i)_mm_cvtneps_pbh(v);
#else
    float f[4];
    uint16_t h[4] = {0};
    _mm_storeu_ps(f, v);
    for (int i = 0; i < 4; ++i) h[i] = pd_to_bf16(f[i]);
    return _mm_loadl_epi64((const __m128i *)h);
#endif
}

/* store_group, 4 outputs a row at once where the group's rows are all real */
INLINE void store_group_vec(int dtype, const float sums[][R], int nb, const void *scales,
                            void *y, int64_t N, int64_t n0, int64_t b0) {
    if (n0 + R > N) {
        store_group(dtype, sums, nb, scales, y, N, n0, b0);
        return;
    }
    __m128 s;
    if (dtype == DT_F32) {
        s = _mm_loadu_ps((const float *)scales + n0);
    } else {
        const __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)scales + n0));
        s = dtype == DT_BF16 ? _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16))
                             : _mm_cvtph_ps(h);
    }
    for (int b = 0; b < nb; ++b) {
        const __m128 v = _mm_mul_ps(_mm_loadu_ps(sums[b]), s);
        const int64_t at = (b0 + b) * N + n0;
        if (dtype == DT_F32) {
            _mm_storeu_ps((float *)y + at, v);
        } else {
            const __m128i h = dtype == DT_BF16 ? store_bf16x4(v)
                                               : _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
            _mm_storel_epi64((__m128i *)((uint16_t *)y + at), h);
        }
    }
}

#define ZERO4(b)                                                                             \
    __m512 c0##b = _mm512_setzero_ps(), c1##b = c0##b, c2##b = c0##b, c3##b = c0##b
#define SUMS4(b)                                                                             \
    if (NB > b) _mm_storeu_ps(sums[b], reduce4(c0##b, c1##b, c2##b, c3##b));
#define ZERO_ALL ZERO4(0); ZERO4(1); ZERO4(2); ZERO4(3)
#define SUMS_ALL SUMS4(0) SUMS4(1) SUMS4(2) SUMS4(3)

/* Asks for the R rows of a chunk (R cache lines) ahead of use: the tile kernels pass the
 * next group's weight, which then streams in while this group computes from its tile. */
#define PREFETCH_CHUNK(p)                                                                    \
    do {                                                                                     \
        for (int r_ = 0; r_ < R; ++r_) _mm_prefetch((const char *)(p) + r_ * C, _MM_HINT_T0); \
    } while (0)

INLINE __m512 widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* float32 FMAs over 16 columns: row vectors v0..v3, x at xs + b * kp + (k) */
#define F32_FMA(b, k)                                                                        \
    if (NB > b) {                                                                            \
        const __m512 xv = _mm512_load_ps(xs + b * kp + (k));                                 \
        c0##b = _mm512_fmadd_ps(v0, xv, c0##b);                                              \
        c1##b = _mm512_fmadd_ps(v1, xv, c1##b);                                              \
        c2##b = _mm512_fmadd_ps(v2, xv, c2##b);                                              \
        c3##b = _mm512_fmadd_ps(v3, xv, c3##b);                                              \
    }
#define DEF_F32(NAME, NBV, TILE)                                                             \
    static void NAME(const float *xs, int64_t kp, const int8_t *wg, const float *t,          \
                     float sums[][R]) {                                                      \
        enum { NB = NBV };                                                                   \
        (void)wg, (void)t;                                                                   \
        ZERO_ALL;                                                                            \
        ZERO4(4);                                                                            \
        ZERO4(5);                                                                            \
        for (int64_t j = 0; j < kp; j += C)                                                  \
            for (int h = 0; h < C; h += 16) {                                                \
                __m512 v0, v1, v2, v3;                                                       \
                if (TILE) {                                                                  \
                    const float *tj = t + j * R + h;                                         \
                    if (wg && h == 0) PREFETCH_CHUNK(wg + j * R);                            \
                    v0 = _mm512_load_ps(tj), v1 = _mm512_load_ps(tj + C);                    \
                    v2 = _mm512_load_ps(tj + 2 * C), v3 = _mm512_load_ps(tj + 3 * C);        \
                } else {                                                                     \
                    const int8_t *wj = wg + j * R + h;                                       \
                    v0 = widen16(wj), v1 = widen16(wj + C);                                  \
                    v2 = widen16(wj + 2 * C), v3 = widen16(wj + 3 * C);                      \
                }                                                                            \
                F32_FMA(0, j + h) F32_FMA(1, j + h) F32_FMA(2, j + h) F32_FMA(3, j + h)      \
                F32_FMA(4, j + h) F32_FMA(5, j + h)                                          \
            }                                                                                \
        SUMS_ALL SUMS4(4) SUMS4(5)                                                           \
    }
DEF_F32(f32_w1, 1, 0)
DEF_F32(f32_w2, 2, 0)
DEF_F32(f32_w3, 3, 0)
DEF_F32(f32_w4, 4, 0)
DEF_F32(f32_t1, 1, 1)
DEF_F32(f32_t2, 2, 1)
DEF_F32(f32_t3, 3, 1)
DEF_F32(f32_t4, 4, 1)
DEF_F32(f32_t5, 5, 1)
DEF_F32(f32_t6, 6, 1)
typedef void (*f32_block)(const float *, int64_t, const int8_t *, const float *, float[][R]);
static const f32_block F32_W[BB + 1] = {NULL, f32_w1, f32_w2, f32_w3, f32_w4};
static const f32_block F32_T[BT + 1] = {NULL,   f32_t1, f32_t2, f32_t3,
                                        f32_t4, f32_t5, f32_t6};

/* One group against all B rows of xs (float32, packed column order, rows kp apart). */
static void group_f32(int dtype, const float *xs, int64_t kp, const int8_t *wg,
                      const void *scales, void *y, int64_t B, int64_t N, int64_t n0,
                      float *tile, const int8_t *next) {
    float sums[BT][R];
    if (B <= BB) { /* widen in registers: the weight read once, straight from memory */
        F32_W[B](xs, kp, wg, NULL, sums);
        store_group_vec(dtype, sums, (int)B, scales, y, N, n0, 0);
        return;
    }
    for (int64_t i = 0; i < kp * R; i += 16) _mm512_store_ps(tile + i, widen16(wg + i));
    for (int64_t b0 = 0; b0 < B; b0 += BT) {
        const int nb = B - b0 < BT ? (int)(B - b0) : BT;
        F32_T[nb](xs + b0 * kp, kp, b0 == 0 ? next : NULL, tile, sums);
        store_group_vec(dtype, sums, nb, scales, y, N, n0, b0);
    }
}
#endif

#ifdef I8_BF16DP
/* ---- AVX512_BF16: bf16 x, vdpbf16ps (two products a lane) -------------------------------
 * A chunk's 64 int8 widen to two vectors of 32 bf16 by table lookups: the high and the
 * low byte of bf16(|q|) (vpermi2b, 128 entries), the sign put back into the high byte,
 * and the bytes interleaved (vpunpck{l,h}bw: hence the packed byte order). */

typedef struct {
    __m512i hi0, hi1, lo0, lo1, sign;
} bf16_tables;

static bf16_tables make_tables(void) {
    uint8_t hi[128], lo[128];
    for (int i = 0; i < 128; ++i) {
        union { float f; uint32_t u; } v = {.f = (float)i};
        hi[i] = (uint8_t)(v.u >> 24);
        lo[i] = (uint8_t)(v.u >> 16);
    }
    bf16_tables t;
    t.hi0 = _mm512_loadu_si512(hi), t.hi1 = _mm512_loadu_si512(hi + 64);
    t.lo0 = _mm512_loadu_si512(lo), t.lo1 = _mm512_loadu_si512(lo + 64);
    t.sign = _mm512_set1_epi8((char)0x80);
    return t;
}

/* The chunk at p as bf16: columns 0..31 in *a, 32..63 in *b. */
INLINE void widen64_bf16(const bf16_tables *t, const int8_t *p, __m512i *a, __m512i *b) {
    const __m512i q = _mm512_loadu_si512(p);
    const __m512i m = _mm512_abs_epi8(q);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, m, t->hi1);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, m, t->lo1);
    hi = _mm512_ternarylogic_epi32(hi, q, t->sign, 0xf8); /* hi | (q & 0x80) */
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

#define DP2(c, wa, wb, xa, xb)                                                               \
    c = _mm512_dpbf16_ps(_mm512_dpbf16_ps(c, (__m512bh)(wa), (__m512bh)(xa)), (__m512bh)(wb), \
                         (__m512bh)(xb))
#define BF16_DP(b, j)                                                                        \
    if (NB > b) {                                                                            \
        const __m512i xa = _mm512_loadu_si512(x + b * ldx + (j));                            \
        const __m512i xb = _mm512_loadu_si512(x + b * ldx + (j) + 32);                       \
        DP2(c0##b, a0, b0_, xa, xb);                                                         \
        DP2(c1##b, a1, b1_, xa, xb);                                                         \
        DP2(c2##b, a2, b2_, xa, xb);                                                         \
        DP2(c3##b, a3, b3_, xa, xb);                                                         \
    }
/* In registers: a chunk's R rows widened (8 vectors), then NB (<= BB) rows of x. */
#define DEF_BF16_W(NAME, NBV)                                                                \
    static void NAME(const bf16_tables *tb, const uint16_t *x, int64_t ldx, int64_t kp,      \
                     const int8_t *wg, float sums[][R]) {                                    \
        enum { NB = NBV };                                                                   \
        ZERO_ALL;                                                                            \
        for (int64_t j = 0; j < kp; j += C) {                                                \
            __m512i a0, a1, a2, a3, b0_, b1_, b2_, b3_;                                      \
            const int8_t *wj = wg + j * R;                                                   \
            widen64_bf16(tb, wj, &a0, &b0_);                                                 \
            widen64_bf16(tb, wj + C, &a1, &b1_);                                             \
            widen64_bf16(tb, wj + 2 * C, &a2, &b2_);                                         \
            widen64_bf16(tb, wj + 3 * C, &a3, &b3_);                                         \
            BF16_DP(0, j) BF16_DP(1, j) BF16_DP(2, j) BF16_DP(3, j)                          \
        }                                                                                    \
        SUMS_ALL                                                                             \
    }
DEF_BF16_W(bf16_w1, 1)
DEF_BF16_W(bf16_w2, 2)
DEF_BF16_W(bf16_w3, 3)
DEF_BF16_W(bf16_w4, 4)
typedef void (*bf16_w_block)(const bf16_tables *, const uint16_t *, int64_t, int64_t,
                             const int8_t *, float[][R]);
static const bf16_w_block BF16_W[BB + 1] = {NULL, bf16_w1, bf16_w2, bf16_w3, bf16_w4};

/* From the tile: NB (<= BT) rows of x, each half chunk's R rows loaded (4 vectors) and
 * used by all NB; x read straight from memory by the dot products. */
#define DP_T(b, h)                                                                           \
    if (NB > b) {                                                                            \
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * ldx + (h));                 \
        c0##b = _mm512_dpbf16_ps(c0##b, v0, xv);                                             \
        c1##b = _mm512_dpbf16_ps(c1##b, v1, xv);                                             \
        c2##b = _mm512_dpbf16_ps(c2##b, v2, xv);                                             \
        c3##b = _mm512_dpbf16_ps(c3##b, v3, xv);                                             \
    }
#define DEF_BF16_T(NAME, NBV)                                                                \
    static void NAME(const uint16_t *x, int64_t ldx, int64_t kp, const uint16_t *t,          \
                     const int8_t *next, float sums[][R]) {                                  \
        enum { NB = NBV };                                                                   \
        ZERO_ALL;                                                                            \
        ZERO4(4);                                                                            \
        ZERO4(5);                                                                            \
        for (int64_t j = 0; j < kp; j += C) {                                                \
            if (next) PREFETCH_CHUNK(next + j * R);                                          \
            for (int h = 0; h < C; h += 32) {                                                \
                const uint16_t *tj = t + j * R + h;                                          \
                const __m512bh v0 = (__m512bh)_mm512_load_si512(tj);                         \
                const __m512bh v1 = (__m512bh)_mm512_load_si512(tj + C);                     \
                const __m512bh v2 = (__m512bh)_mm512_load_si512(tj + 2 * C);                 \
                const __m512bh v3 = (__m512bh)_mm512_load_si512(tj + 3 * C);                 \
                DP_T(0, j + h) DP_T(1, j + h) DP_T(2, j + h)                                 \
                DP_T(3, j + h) DP_T(4, j + h) DP_T(5, j + h)                                 \
            }                                                                                \
        }                                                                                    \
        SUMS_ALL SUMS4(4) SUMS4(5)                                                           \
    }
DEF_BF16_T(bf16_t1, 1)
DEF_BF16_T(bf16_t2, 2)
DEF_BF16_T(bf16_t3, 3)
DEF_BF16_T(bf16_t4, 4)
DEF_BF16_T(bf16_t5, 5)
DEF_BF16_T(bf16_t6, 6)
typedef void (*bf16_t_block)(const uint16_t *, int64_t, int64_t, const uint16_t *,
                             const int8_t *, float[][R]);
static const bf16_t_block BF16_T[BT + 1] = {NULL,    bf16_t1, bf16_t2, bf16_t3,
                                            bf16_t4, bf16_t5, bf16_t6};

/* One group against all B rows of x (bf16, rows ldx apart, zero from K to kp). */
static void group_bf16(const bf16_tables *tb, const uint16_t *x, int64_t ldx, int64_t kp,
                       const int8_t *wg, const void *scales, void *y, int64_t B, int64_t N,
                       int64_t n0, uint16_t *tile, const int8_t *next) {
    float sums[BT][R];
    if (B <= BB) {
        BF16_W[B](tb, x, ldx, kp, wg, sums);
        store_group_vec(DT_BF16, sums, (int)B, scales, y, N, n0, 0);
        return;
    }
    for (int64_t i = 0; i < kp * R; i += C) {
        __m512i a, b;
        widen64_bf16(tb, wg + i, &a, &b);
        _mm512_store_si512(tile + i, a);
        _mm512_store_si512(tile + i + 32, b);
    }
    for (int64_t b0 = 0; b0 < B; b0 += BT) {
        const int nb = B - b0 < BT ? (int)(B - b0) : BT;
        BF16_T[nb](x + b0 * ldx, ldx, kp, tile, b0 == 0 ? next : NULL, sums);
        store_group_vec(DT_BF16, sums, nb, scales, y, N, n0, b0);
    }
}
#endif

int i8_linear_path(void) {
#if defined(I8_BF16DP)
    return 2;
#elif defined(I8_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* Activation rows a pass: each pass reads the whole weight once (from memory), each group
 * of it against the pass's rows of x (which stay in L2: 256 x 1024 bf16 = 512 KiB). */
#define MB 256

int i8_linear(int dtype, const void *x, int64_t ldx, const int8_t *w, const void *scales,
              void *y, int64_t B, int64_t N, int64_t K, int num_threads) {
    if (dtype < DT_F32 || dtype > DT_F16 || B < 0 || N < 0 || K < 0 || ldx < K) return -2;
    if (B == 0 || N == 0 || K == 0) {
        for (int64_t i = 0; i < B * N; ++i) store_f(dtype, y, i, 0.0f);
        return 0;
    }
    const int64_t kp = (K + C - 1) / C * C, groups = (N + R - 1) / R, wg_bytes = R * kp;
    const int threads = num_threads > 1 && groups > 1 ? num_threads : 1;
    /* Groups are handed out a few at a time: a thread the OS holds back (a shared
     * machine) leaves its share to the others instead of stalling the call. */
    const int64_t chunk = groups / (8 * threads) > 1 ? groups / (8 * threads) : 1;
    /* One tile a thread, allocated here so that no thread can fail alone. */
    const size_t tile_bytes = (B > BB ? (size_t)wg_bytes * sizeof(float) : 0);
    char *tiles = tile_bytes ? aligned_alloc(64, tile_bytes * (size_t)threads) : NULL;
    if (tile_bytes && !tiles) return -1;
#ifdef I8_BF16DP
    if (dtype == DT_BF16) {
        /* x as is, unless its rows need zeros from K to kp */
        const uint16_t *xb = x;
        uint16_t *copy = NULL;
        if (kp != K) {
            copy = calloc((size_t)(B * kp), sizeof(uint16_t));
            if (!copy) {
                free(tiles);
                return -1;
            }
            for (int64_t b = 0; b < B; ++b)
                memcpy(copy + b * kp, (const uint16_t *)x + b * ldx, sizeof(uint16_t) * K);
            xb = copy;
            ldx = kp;
        }
        const bf16_tables tb = make_tables();
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {
            uint16_t *tile = tiles ? (uint16_t *)(tiles + THREAD_ID * tile_bytes) : NULL;
            for (int64_t b0 = 0; b0 < B; b0 += MB) {
                const int64_t nb = B - b0 < MB ? B - b0 : MB;
                _Pragma("omp for schedule(dynamic, chunk) nowait") for (int64_t g = 0; g < groups;
                                                                        ++g) {
                    const int8_t *wg = w + g * wg_bytes;
                    group_bf16(&tb, xb + b0 * ldx, ldx, kp, wg, scales,
                               (uint16_t *)y + b0 * N, nb, N, g * R, tile,
                               g + 1 < groups ? wg + wg_bytes : NULL);
                }
            }
        }
        free(copy);
        free(tiles);
        return 0;
    }
#endif
    float *xs = aligned_alloc(64, sizeof(float) * (size_t)(B * kp));
    if (!xs) {
        free(tiles);
        return -1;
    }
    copy_x_f32(dtype, x, ldx, B, K, kp, xs);
#ifdef I8_AVX512
    const int64_t ysize = dtype == DT_F32 ? 4 : 2;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)") {
        float *tile = tiles ? (float *)(tiles + THREAD_ID * tile_bytes) : NULL;
        for (int64_t b0 = 0; b0 < B; b0 += MB) {
            const int64_t nb = B - b0 < MB ? B - b0 : MB;
            _Pragma("omp for schedule(dynamic, chunk) nowait") for (int64_t g = 0; g < groups;
                                                                    ++g) {
                const int8_t *wg = w + g * wg_bytes;
                group_f32(dtype, xs + b0 * kp, kp, wg, scales, (char *)y + b0 * N * ysize, nb,
                          N, g * R, tile, g + 1 < groups ? wg + wg_bytes : NULL);
            }
        }
    }
#else
    _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, chunk)")
    for (int64_t g = 0; g < groups; ++g)
        group_scalar(dtype, xs, kp, w + g * wg_bytes, scales, y, B, N, g * R);
#endif
    free(xs);
    free(tiles);
    return 0;
}
