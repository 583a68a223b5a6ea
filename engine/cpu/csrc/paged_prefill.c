/* Paged prefill attention for the CPU: each prompt chunk attends causally to its cached
 * prefix and to itself, K/V read from the paged cache (the chunk's own rows are written
 * there before attention runs), float32 math, like SDPA's CPU kernel.
 *
 * Built with the decode kernels into one shared object (engine/cpu/kernels.py). Why it
 * exists: SDPA's fused CPU kernel runs a bfloat16 prompt's two matmuls as float32 MKL
 * sgemm calls on small tiles and its softmax in between; on the `mid` model (16 heads, 4
 * KV heads, head_dim 64) at 512 tokens that reached ~48 GFLOP/s, a fifth of what the
 * projections around it reach, so attention took ~22% of a prefill for ~5% of its FLOPs.
 * A chunk with a cached prefix was worse: the blocks were gathered into a copy and SDPA
 * took an explicit mask, off its causal fast path. This kernel:
 *   - takes all query heads of one KV head (GQA) and BQ tokens as one tile of G * BQ
 *     rows, so each K/V tile it converts to float32 serves 64 rows on `mid`;
 *   - streams the keys in tiles of BK (flash attention's online softmax: a running max
 *     and sum per row, the output rescaled when the max grows), reading only the keys
 *     the tile's last token can see, and masking only the tiles on the diagonal;
 *   - keeps the 4 x 64 score block and the output rows in registers (gcc vector
 *     extensions, so any target gcc has gets the same code at its own width);
 *   - spreads (sequence, query tile, KV head) work items over the OpenMP threads torch
 *     uses, largest first.
 *
 * Layouts (contiguous):
 *   q, out            [T, H, D] with T = query_start_loc[P], the prefill rows of a step
 *   k_cache, v_cache  [num_blocks, KVH, block_size, D] of q's dtype (one layer)
 *   block_tables      [P, table_stride] int32; query_start_loc [P + 1] int32;
 *   context_lens      [P] int32: sequence i's rows query_start_loc[i]..[i+1] sit at the
 *                     last positions of its context_lens[i] tokens.
 * Returns 0, -1 if scratch memory could not be allocated, -2 for a shape it does not take
 * (head_dim not 32, 64, 128 or 256; heads not a multiple of KV heads; a block size not a
 * power of two; a chunk longer than its context).
 */
#include "paged_decode.h"

#define BQ 16 /* query tokens per work item */
#define BK 64 /* keys per tile */

/* The vector it computes with: VL float lanes, the machine's own width. With AVX2 (no
 * AVX-512) gcc 12 keeps a 16-lane vector in memory and moves it through general registers
 * 8 bytes at a time, so the 16-lane code ran attention at a tenth of the FMA rate on a
 * 2-core EPYC (a third of a bfloat16 prefill of the mid model); 8 lanes fit its registers.
 * Every lane is one row (scores, softmax) or one element of D (P.V) and sums over the same
 * terms in the same order at either width, so the results are the same. PF_NR: row vectors
 * a score block takes (by four keys), PF_ACC: accumulators of the P.V block, both sized to
 * the registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define VL 8
#define PF_NR 2
#define PF_ACC 8
#define SPLAT_INIT(x) {x, x, x, x, x, x, x, x}
#else
#define VL 16
#define PF_NR 4
#define PF_ACC 16
#define SPLAT_INIT(x) {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}
#endif
typedef float pvf __attribute__((vector_size(VL * 4)));
typedef int32_t pvi __attribute__((vector_size(VL * 4)));
typedef uint32_t pvu __attribute__((vector_size(VL * 4)));
typedef uint16_t pvhu __attribute__((vector_size(VL * 2)));
typedef _Float16 pvhf __attribute__((vector_size(VL * 2)));

static inline pvf splat(float x) { return (pvf)SPLAT_INIT(x); }

static inline pvi splat_i(int32_t x) { return (pvi)SPLAT_INIT(x); }

static inline pvf pload(const float *p) {
    pvf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline pvf vmax(pvf a, pvf b) {
    const pvi gt = a > b;
    return (pvf)(((pvi)a & gt) | ((pvi)b & ~gt));
}

/* 2^t lane by lane for t <= 0 (exp_neg's polynomial, on the base-2 exponent); 0 below -126,
 * so a masked score (-inf) gives exactly 0. */
static inline pvf vexp2_neg(pvf t) {
    const pvi under = t < splat(-126.0f);
    const pvf c = (pvf)(((pvi)t & ~under) | ((pvi)splat(-126.0f) & under));
    const pvf n = (c + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest */
    const pvf f = c - n;
    pvf p = splat(1.5353362e-4f);
    p = p * f + splat(1.3398874e-3f);
    p = p * f + splat(9.6180230e-3f);
    p = p * f + splat(5.5503406e-2f);
    p = p * f + splat(2.4022652e-1f);
    p = p * f + splat(6.9314718e-1f);
    p = p * f + splat(1.0f);
    const pvi bits = (__builtin_convertvector(n, pvi) + 127) << 23;
    return (pvf)((pvi)(p * (pvf)bits) & ~under);
}

/* Elements [at, at + n) of a tensor of the given dtype, as float32, into dst (n % 16 == 0). */
static inline void load_vec(float *restrict dst, const void *src, int64_t at, int n, int qtype) {
    for (int d = 0; d < n; d += 16) {
        v16sf v;
        if (qtype == QTYPE_BF16) v = vload_bf16((const uint16_t *)src + at + d);
        else if (qtype == QTYPE_F16) v = vload_f16((const _Float16 *)src + at + d);
        else v = vload_f32((const float *)src + at + d);
        __builtin_memcpy(dst + d, &v, sizeof v);
    }
}

/* VL floats into elements [at, at + VL) of a tensor of the given dtype (bfloat16: round to
 * nearest even, NaN kept a NaN, as bf16_store). */
static inline void store_vec(void *dst, int64_t at, pvf x, int qtype) {
    if (qtype == QTYPE_BF16) {
        pvu u;
        __builtin_memcpy(&u, &x, sizeof u);
        const pvi nan = (u & 0x7fffffffu) > 0x7f800000u;
        const pvu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const pvu bits = ((pvu)nan & ((u >> 16) | 0x40u)) | (~(pvu)nan & rounded);
        const pvhu h = __builtin_convertvector(bits, pvhu);
        __builtin_memcpy((uint16_t *)dst + at, &h, sizeof h);
    } else if (qtype == QTYPE_F16) {
        const pvhf h = __builtin_convertvector(x, pvhf);
        __builtin_memcpy((_Float16 *)dst + at, &h, sizeof h);
    } else {
        __builtin_memcpy((float *)dst + at, &x, sizeof x);
    }
}

/* One cache row (token `pos` of KV head `kvh`) of D elements, as float32, into dst. */
static inline void load_row(float *restrict dst, const void *cache, const int32_t *table,
                            int64_t pos, int kvh, int kv_heads, int block_size, int head_dim,
                            int qtype) {
    const int64_t block = table[pos / block_size];
    load_vec(dst, cache, ((block * kv_heads + kvh) * block_size + pos % block_size) * head_dim,
             head_dim, qtype);
}

/* A work item's scratch, float32: the q rows transposed ([D][rows]), the output rows, one
 * K and one V tile ([BK][D]), the scores ([BK][rows]), and per row its max, sum, rescale
 * and the last position it sees (int32). */
typedef struct {
    float *q, *o, *kt, *v, *s, *m, *l, *alpha;
    int32_t *lim;
} Scratch;

#define ITEM_D 32
#include "paged_prefill_item.h"
#undef ITEM_D
#define ITEM_D 64
#include "paged_prefill_item.h"
#undef ITEM_D
#define ITEM_D 128
#include "paged_prefill_item.h"
#undef ITEM_D
#define ITEM_D 256
#include "paged_prefill_item.h"
#undef ITEM_D

typedef struct {
    int64_t seq, t0, kend; /* sequence, first token of the tile in the chunk, keys seen */
} Item;

static int by_keys_desc(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->kend, y = ((const Item *)b)->kend;
    return (x < y) - (x > y);
}

static int prefill(const void *q, const void *k_cache, const void *v_cache,
                   const int32_t *block_tables, int64_t table_stride,
                   const int32_t *query_start_loc, const int32_t *context_lens, int64_t num_seqs,
                   void *out, int num_heads, int kv_heads, int head_dim, int block_size,
                   float scale, int num_threads, int qtype) {
    if (kv_heads <= 0 || num_heads % kv_heads || num_heads / kv_heads > MAX_GROUP ||
        block_size <= 0 || (block_size & (block_size - 1)))
        return -2;
    void (*item_fn)(const void *, const void *, const void *, const int32_t *, int64_t, int,
                    int64_t, int, int, int, int, float, void *, int, const Scratch *);
    switch (head_dim) {
    case 32: item_fn = prefill_item_32; break;
    case 64: item_fn = prefill_item_64; break;
    case 128: item_fn = prefill_item_128; break;
    case 256: item_fn = prefill_item_256; break;
    default: return -2;
    }
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t n = query_start_loc[i + 1] - query_start_loc[i];
        if (n < 0 || n > context_lens[i]) return -2;
        num_tiles += (n + BQ - 1) / BQ;
    }
    Item *items = malloc(sizeof(Item) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (!items) return -1;
    int64_t at = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t n = query_start_loc[i + 1] - query_start_loc[i];
        const int64_t pos0 = context_lens[i] - n;
        for (int64_t t0 = 0; t0 < n; t0 += BQ) {
            const int64_t ntok = n - t0 < BQ ? n - t0 : BQ;
            items[at++] = (Item){i, t0, pos0 + t0 + ntok};
        }
    }
    qsort(items, (size_t)num_tiles, sizeof(Item), by_keys_desc); /* longest first */
    const int G = num_heads / kv_heads;
    const size_t rows = (size_t)(BQ * G + 15) / 16 * 16;
    const size_t floats = rows * (size_t)head_dim * 2 + (size_t)head_dim * BK * 2 + rows * BK +
                          rows * 3;
    const int64_t num_items = num_tiles * kv_heads;
    int failed = 0;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *buf = aligned_alloc(64, sizeof(float) * (floats + 16 + rows));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        Scratch sc = {0};
        if (buf) {
            sc.q = buf;
            sc.o = sc.q + rows * head_dim;
            sc.kt = sc.o + rows * head_dim;
            sc.v = sc.kt + (size_t)head_dim * BK;
            sc.s = sc.v + (size_t)head_dim * BK;
            sc.m = sc.s + rows * BK;
            sc.l = sc.m + rows;
            sc.alpha = sc.l + rows;
            sc.lim = (int32_t *)(buf + floats + 16);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; ++it) {
            if (!buf) continue;
            const Item *w = &items[it / kv_heads];
            const int kvh = (int)(it % kv_heads);
            const int64_t n = query_start_loc[w->seq + 1] - query_start_loc[w->seq];
            const int ntok = (int)(n - w->t0 < BQ ? n - w->t0 : BQ);
            const int64_t pos0 = context_lens[w->seq] - n + w->t0;
            item_fn(q, k_cache, v_cache, block_tables + w->seq * table_stride,
                    query_start_loc[w->seq] + w->t0, ntok, pos0, kvh, num_heads, kv_heads,
                    block_size, scale, out, qtype, &sc);
        }
        free(buf);
    }
    free(items);
    return failed ? -1 : 0;
}

#define EXPORT_PREFILL(NAME, QTYPE)                                                            \
    int NAME(const void *q, const void *k_cache, const void *v_cache,                         \
             const int32_t *block_tables, int64_t table_stride,                               \
             const int32_t *query_start_loc, const int32_t *context_lens, int64_t num_seqs,   \
             void *out, int num_heads, int kv_heads, int head_dim, int block_size,            \
             float scale, int num_threads) {                                                  \
        return prefill(q, k_cache, v_cache, block_tables, table_stride, query_start_loc,      \
                       context_lens, num_seqs, out, num_heads, kv_heads, head_dim, block_size, \
                       scale, num_threads, QTYPE);                                            \
    }
EXPORT_PREFILL(pd_prefill_f32, QTYPE_F32)
EXPORT_PREFILL(pd_prefill_bf16, QTYPE_BF16)
EXPORT_PREFILL(pd_prefill_f16, QTYPE_F16)
