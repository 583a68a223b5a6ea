/* A bfloat16-weight linear for CPUs without bf16 matmul (AVX2 + FMA, no AVX512-BF16/AMX):
 * y[b, n] = sum_k x[b, k] * w[n, k], x and y float32 (`bf_linear`) or both bfloat16
 * (`bf_linear_bf16`, the conversions inside the call), w bfloat16.
 *
 * Built by engine/cpu/kernels.py's _build (gcc -O3 -march=native), loaded with ctypes by
 * engine/cpu/bf16.py for engine/modeling/linear.py's Linear. oneDNN has no bf16 matmul on such a
 * CPU, and torch's bf16 F.linear there widens and multiplies element by element; holding
 * the weight widened to float32 makes prefill fast but doubles the bytes every decode step
 * reads (and the memory). Here the weight stays bf16 and is widened in registers, which is
 * exact (a bf16 value is a float32 with its low 16 bits zero): a decode step reads 2 bytes
 * per weight, a prefill runs register-blocked FMAs.
 *
 * Layout (packed once, at load; `bf_linear_perm` for the order inside a k): panels of P = 16
 * outputs; panel p, column k holds w[16p + j, k] for the 16 j at (p * K + k) * 16, in the
 * order one 32-byte load widens with vpunpcklwd / vpunpckhwd against zero (low 4 words of
 * each 128-bit lane -> outputs 0..7, high 4 -> 8..15). Rows N..(a multiple of 16) are zero.
 *
 * Every output is one float32 FMA chain over k = 0, 1, .., K-1, whatever B, the row block
 * and the thread count: a row's result never depends on the other rows of x (a decode row
 * gets the sums a prefill row gets) nor on the threads. Panels are spread over `threads`
 * OpenMP threads (the runtime torch uses, so they share its pool); within a panel, blocks
 * of MR activation rows each run the whole k loop, the panel (16 x K x 2 bytes) staying in
 * cache from one block to the next. Returns 0, or -2 for arguments this file does not take.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BF_AVX2 1
#endif

#define P 16 /* outputs a panel */
#define MR 6 /* activation rows a register block: 12 accumulators of the 16 registers */

#define INLINE static inline __attribute__((always_inline))

/* 1: AVX2 + FMA (what Linear uses); 0: a plain C loop, correct, not used for speed. */
int bf_linear_path(void) {
#ifdef BF_AVX2
    return 1;
#else
    return 0;
#endif
}

/* The output (0..15, within its panel) whose weight sits at position q of a k's 16. */
int bf_linear_perm(int q) {
    const int lane = q >> 3, j = q & 7;
    return (j < 4 ? 0 : 8) + lane * 4 + (j & 3);
}

#ifdef BF_AVX2
/* Stores accumulator pair (lo, hi) as row r's 16 outputs n0.. (fewer at the last panel). */
INLINE void store16(float *y, int64_t N, int64_t n0, int r, __m256 lo, __m256 hi) {
    float *out = y + r * N + n0;
    if (n0 + P <= N) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
    } else {
        float tmp[P];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        memcpy(out, tmp, (size_t)(N - n0) * sizeof(float));
    }
}

/* y[r, n0 .. n0 + 16) for rows r < mr of x, from one panel; `mr` a constant when inlined.
 * The accumulators are named variables, not an array: gcc kept an array's copy on the
 * stack and stored it every k (12 stores a k, the kernel at a third of its FMA rate). */
#define ACC(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps()
#define FMA_ROW(r)                                                                 \
    if (mr > r) {                                                                  \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                     \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                 \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                 \
    }
INLINE void block(int mr, const float *x, int64_t ldx, const uint16_t *panel, int64_t K,
                  float *y, int64_t N, int64_t n0) {
    ACC(0); ACC(1); ACC(2); ACC(3); ACC(4); ACC(5);
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; ++k) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(panel + k * P));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
    }
    if (mr > 0) store16(y, N, n0, 0, c00, c01);
    if (mr > 1) store16(y, N, n0, 1, c10, c11);
    if (mr > 2) store16(y, N, n0, 2, c20, c21);
    if (mr > 3) store16(y, N, n0, 3, c30, c31);
    if (mr > 4) store16(y, N, n0, 4, c40, c41);
    if (mr > 5) store16(y, N, n0, 5, c50, c51);
}
#undef FMA_ROW

/* Two panels at once for one or two rows: four or eight independent FMA chains instead of
 * two or four, so that a decode step waits on memory, not on FMA latency. Each output's
 * chain is the same as `block`'s. */
#define FMA_ROW2(r)                                                                \
    if (mr > r) {                                                                  \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                     \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                 \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                 \
        c##r##2 = _mm256_fmadd_ps(a, w2, c##r##2);                                 \
        c##r##3 = _mm256_fmadd_ps(a, w3, c##r##3);                                 \
    }
INLINE void block2(int mr, const float *x, int64_t ldx, const uint16_t *pa, const uint16_t *pb,
                   int64_t K, float *y, int64_t N, int64_t n0) {
    ACC(0); ACC(1);
    __m256 c02 = _mm256_setzero_ps(), c03 = c02, c12 = c02, c13 = c02;
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; ++k) {
        const __m256i ha = _mm256_loadu_si256((const __m256i *)(pa + k * P));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(pb + k * P));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, ha));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, ha));
        const __m256 w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, hb));
        const __m256 w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, hb));
        FMA_ROW2(0) FMA_ROW2(1)
    }
    /* both panels are whole: the caller checks */
    store16(y, N, n0, 0, c00, c01);
    store16(y, N, n0 + P, 0, c02, c03);
    if (mr > 1) {
        store16(y, N, n0, 1, c10, c11);
        store16(y, N, n0 + P, 1, c12, c13);
    }
}
#undef FMA_ROW2
#undef ACC

static void rows(int64_t mr, const float *x, int64_t ldx, const uint16_t *panel, int64_t K,
                 float *y, int64_t N, int64_t n0) {
    switch (mr) { /* constant row counts: the loops over r unroll, accumulators in registers */
    case 1: block(1, x, ldx, panel, K, y, N, n0); break;
    case 2: block(2, x, ldx, panel, K, y, N, n0); break;
    case 3: block(3, x, ldx, panel, K, y, N, n0); break;
    case 4: block(4, x, ldx, panel, K, y, N, n0); break;
    case 5: block(5, x, ldx, panel, K, y, N, n0); break;
    default: block(6, x, ldx, panel, K, y, N, n0); break;
    }
}
#endif

/* The plain loop: the same sums in the same order (a fused multiply-add per k). */
__attribute__((unused)) static void rows_c(int64_t mr, const float *x, int64_t ldx, const uint16_t *panel, int64_t K,
                   float *y, int64_t N, int64_t n0) {
    for (int64_t r = 0; r < mr; ++r)
        for (int q = 0; q < P; ++q) {
            const int64_t n = n0 + bf_linear_perm(q);
            if (n >= N) continue;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k)
                acc = __builtin_fmaf(x[r * ldx + k], pd_from_bf16(panel[k * P + q]), acc);
            y[r * N + n] = acc;
        }
}

/* y = x @ w.T for x [B, K] float32 rows `ldx` apart, w packed (above) for N outputs, y
 * [B, N] float32; B, N, K > 0. Called by every thread of a parallel region (or outside
 * one): the panels are shared out by orphaned `omp for` loops, each ending at a barrier. */
static void linear_body(const float *x, int64_t ldx, const uint16_t *w, float *y, int64_t B,
                        int64_t N, int64_t K) {
    const int64_t panels = (N + P - 1) / P;
#ifdef BF_AVX2
    if (B <= 2) { /* decode: panel pairs, so each thread streams its panels in order */
        const int64_t pairs = (panels + 1) / 2;
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < pairs; ++i) {
            const int64_t p = 2 * i;
            const uint16_t *pa = w + p * K * P;
            if (p + 1 < panels && (p + 2) * P <= N) {
                if (B == 1)
                    block2(1, x, ldx, pa, pa + K * P, K, y, N, p * P);
                else
                    block2(2, x, ldx, pa, pa + K * P, K, y, N, p * P);
            } else {
                for (int64_t q = p; q < panels && q < p + 2; ++q)
                    rows(B, x, ldx, w + q * K * P, K, y, N, q * P);
            }
        }
        return;
    }
    _Pragma("omp for schedule(static)")
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < B; b += MR) {
            const int64_t mr = B - b < MR ? B - b : MR;
            rows(mr, x + b * ldx, ldx, w + p * K * P, K, y + b * N, N, p * P);
        }
#else
    _Pragma("omp for schedule(static)")
    for (int64_t p = 0; p < panels; ++p)
        rows_c(B, x, ldx, w + p * K * P, K, y, N, p * P);
#endif
}

/* x [B, K] float32 rows `ldx` apart; w packed (above) for N outputs; y [B, N] float32. */
int bf_linear(const float *x, int64_t ldx, const uint16_t *w, float *y, int64_t B, int64_t N,
              int64_t K, int threads) {
    if (B < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -2;
    if (B == 0 || N == 0) return 0;
    if (K == 0) {
        memset(y, 0, (size_t)(B * N) * sizeof(float));
        return 0;
    }
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    linear_body(x, ldx, w, y, B, N, K);
    return 0;
}

/* The same for a bfloat16 model: x [B, K] bfloat16 rows `ldx` apart, y [B, N] bfloat16,
 * each output its float32 sum plus bias[n] (float32; NULL: none) rounded once, as torch
 * rounds `(x.float() @ w.T + bias).to(bfloat16)`. The widening of x, the sums and the
 * rounding share one parallel region: no torch op (a dispatch, and a pass that ATen may
 * not split) on either side of the kernel. Returns 0, -2 (arguments), -3 (no memory). */
int bf_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                   uint16_t *y, int64_t B, int64_t N, int64_t K, int threads) {
    if (B < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -2;
    if (B == 0 || N == 0) return 0;
    float *xf = malloc((size_t)(B * (K > 0 ? K : 1)) * sizeof(float));
    float *yf = malloc((size_t)(B * N) * sizeof(float));
    if (xf == NULL || yf == NULL) {
        free(xf);
        free(yf);
        return -3;
    }
    if (K == 0) memset(yf, 0, (size_t)(B * N) * sizeof(float));
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < B; ++b) {
            const uint16_t *xb = x + b * ldx;
            float *xo = xf + b * K;
            _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) xo[k] = pd_from_bf16(xb[k]);
        }
        if (K > 0) linear_body(xf, K, w, yf, B, N, K);
        const int64_t total = B * N;
        if (bias == NULL) {
            _Pragma("omp for simd schedule(static)")
            for (int64_t i = 0; i < total; ++i) y[i] = pd_to_bf16(yf[i]);
        } else if (B >= 2 * threads) { /* rows to threads */
            _Pragma("omp for schedule(static)")
            for (int64_t b = 0; b < B; ++b) {
                const float *yb = yf + b * N;
                uint16_t *out = y + b * N;
                _Pragma("omp simd") for (int64_t n = 0; n < N; ++n)
                    out[n] = pd_to_bf16(yb[n] + bias[n]);
            }
        } else { /* a decode's row or two: each row's columns to threads */
            for (int64_t b = 0; b < B; ++b) {
                const float *yb = yf + b * N;
                uint16_t *out = y + b * N;
                _Pragma("omp for simd schedule(static)")
                for (int64_t n = 0; n < N; ++n) out[n] = pd_to_bf16(yb[n] + bias[n]);
            }
        }
    }
    free(xf);
    free(yf);
    return 0;
}
