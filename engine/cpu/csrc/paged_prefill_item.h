/* One work item of the prefill kernel (paged_prefill.c), instantiated once per head_dim:
 * paged_prefill.c defines ITEM_D (a multiple of 16) and includes this file, which defines
 * `prefill_item_<ITEM_D>`. A constant D makes every accumulator array a fixed size that
 * gcc keeps in registers.
 *
 * Scores are computed transposed, keys by rows ([BK][rows]): each K row is broadcast one
 * element at a time against 16-row vectors of the (once transposed) queries, so a K/V
 * tile is converted to float32 with contiguous vector loads only, and the softmax runs
 * down the columns 16 rows at a time with no horizontal reductions. */
#define PF_NV (ITEM_D / 16)                   /* vectors per row of D */
#define PF_RPV (PF_NV >= 16 ? 1 : 16 / PF_NV) /* rows per block of P.V: 16 accumulators */
#define PF_CAT_(a, b) a##b
#define PF_CAT(a, b) PF_CAT_(a, b)

/* Scores St[j][c0 * 16 ...] of keys j0..j0+3 against NR 16-row vectors of queries. */
static inline __attribute__((always_inline)) void PF_CAT(qk_block_, ITEM_D)(
    const float *restrict Qt, int Rp, const float *restrict Kf, float *restrict St, int j0,
    int c0, const int NR) {
    enum { D = ITEM_D };
    v16sf acc[4][4];
    for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < NR; ++c) acc[jj][c] = splat(0.0f);
    for (int d = 0; d < D; ++d) {
        v16sf qv[4];
        for (int c = 0; c < NR; ++c) qv[c] = vload_f32(Qt + d * Rp + (c0 + c) * 16);
        for (int jj = 0; jj < 4; ++jj) {
            const v16sf b = splat(Kf[(j0 + jj) * D + d]);
            for (int c = 0; c < NR; ++c) acc[jj][c] += b * qv[c];
        }
    }
    for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < NR; ++c)
            __builtin_memcpy(St + (j0 + jj) * Rp + (c0 + c) * 16, &acc[jj][c], sizeof(v16sf));
}

/* Tokens [row0, row0 + ntok) of the flat batch, the first at position pos0 of its
 * sequence, against KV head kvh: scores, online softmax and P.V over the keys
 * [0, pos0 + ntok) in tiles of BK. */
static void PF_CAT(prefill_item_, ITEM_D)(const void *q, const void *k_cache,
                                          const void *v_cache, const int32_t *table,
                                          int64_t row0, int ntok, int64_t pos0, int kvh,
                                          int num_heads, int kv_heads, int block_size,
                                          float scale, void *out, int qtype, const Scratch *sc) {
    enum { D = ITEM_D, NV = PF_NV, RPV = PF_RPV };
    const int G = num_heads / kv_heads;
    const int R = ntok * G, Rp = (R + 15) / 16 * 16, NRV = Rp / 16;
    const float qscale = scale * 1.44269504088896341f; /* scores in base 2 */
    float *restrict Qt = sc->q, *restrict O = sc->o, *restrict Kf = sc->kt, *restrict V = sc->v;
    float *restrict St = sc->s, *restrict M = sc->m, *restrict L = sc->l, *restrict A = sc->alpha;
    int32_t *restrict lim = sc->lim;
    for (int r = 0; r < Rp; ++r) { /* row r: token r / G, query head kvh * G + r % G */
        const int t = r < R ? r / G : ntok - 1;
        float row[D];
        if (r < R)
            load_vec(row, q, ((row0 + t) * num_heads + (int64_t)kvh * G + r % G) * D, D, qtype);
        for (int d = 0; d < D; ++d) {
            Qt[d * Rp + r] = r < R ? row[d] * qscale : 0.0f;
            O[r * D + d] = 0.0f;
        }
        M[r] = -INFINITY;
        L[r] = 0.0f;
        lim[r] = (int32_t)(pos0 + t);
    }
    const int64_t kend = pos0 + ntok; /* keys [0, kend) */
    for (int64_t kb = 0; kb < kend; kb += BK) {
        const int nk = kend - kb < BK ? (int)(kend - kb) : BK, nk4 = (nk + 3) / 4 * 4;
        for (int j = 0; j < nk4; ++j) {
            if (j < nk) {
                load_row(Kf + j * D, k_cache, table, kb + j, kvh, kv_heads, block_size, D, qtype);
                load_row(V + j * D, v_cache, table, kb + j, kvh, kv_heads, block_size, D, qtype);
            } else {
                for (int d = 0; d < D; ++d) Kf[j * D + d] = V[j * D + d] = 0.0f;
            }
        }
        for (int j0 = 0; j0 < nk4; j0 += 4) {
            int c0 = 0;
            for (; c0 + 4 <= NRV; c0 += 4) PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 4);
            switch (NRV - c0) {
            case 3: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 3); break;
            case 2: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 2); break;
            case 1: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 1); break;
            default: break;
            }
        }
        /* online softmax, 16 rows at a time: mask what a row must not see, fold the tile
         * into each row's max and sum, turn scores into weights */
        const int diagonal = kb + nk - 1 > pos0;
        const v16sf ninf = splat(-INFINITY);
        for (int c = 0; c < NRV; ++c) {
            v16si limv;
            __builtin_memcpy(&limv, lim + c * 16, sizeof limv);
            v16sf mv, mx = ninf;
            __builtin_memcpy(&mv, M + c * 16, sizeof mv);
            for (int j = 0; j < nk; ++j) {
                v16sf s = vload_f32(St + j * Rp + c * 16);
                if (diagonal) {
                    const v16si hidden = splat_i((int32_t)(kb + j)) > limv;
                    s = (v16sf)(((v16si)s & ~hidden) | ((v16si)ninf & hidden));
                    __builtin_memcpy(St + j * Rp + c * 16, &s, sizeof s);
                }
                mx = vmax(mx, s);
            }
            const v16sf m_new = vmax(mv, mx);
            const v16sf alpha = vexp2_neg(mv - m_new);
            v16sf sum = splat(0.0f);
            for (int j = 0; j < nk; ++j) {
                const v16sf p = vexp2_neg(vload_f32(St + j * Rp + c * 16) - m_new);
                __builtin_memcpy(St + j * Rp + c * 16, &p, sizeof p);
                sum += p;
            }
            v16sf l;
            __builtin_memcpy(&l, L + c * 16, sizeof l);
            l = l * alpha + sum;
            __builtin_memcpy(L + c * 16, &l, sizeof l);
            __builtin_memcpy(M + c * 16, &m_new, sizeof m_new);
            __builtin_memcpy(A + c * 16, &alpha, sizeof alpha);
        }
        /* O = O * alpha + P . V: RPV rows x D in 16 registers */
        for (int r0 = 0; r0 < Rp; r0 += RPV) {
            v16sf acc[RPV][NV];
            for (int i = 0; i < RPV; ++i)
                for (int j = 0; j < NV; ++j)
                    acc[i][j] = vload_f32(O + (r0 + i) * D + 16 * j) * splat(A[r0 + i]);
            for (int k = 0; k < nk; ++k) {
                v16sf vv[NV];
                for (int j = 0; j < NV; ++j) vv[j] = vload_f32(V + k * D + 16 * j);
                for (int i = 0; i < RPV; ++i) {
                    const v16sf p = splat(St[k * Rp + r0 + i]);
                    for (int j = 0; j < NV; ++j) acc[i][j] += p * vv[j];
                }
            }
            for (int i = 0; i < RPV; ++i)
                for (int j = 0; j < NV; ++j)
                    __builtin_memcpy(O + (r0 + i) * D + 16 * j, &acc[i][j], sizeof(v16sf));
        }
    }
    for (int r = 0; r < R; ++r) {
        const int t = r / G;
        const int64_t dst = ((row0 + t) * num_heads + (int64_t)kvh * G + r % G) * D;
        const v16sf inv = splat(1.0f / L[r]);
        for (int j = 0; j < NV; ++j)
            store_vec(out, dst + 16 * j, vload_f32(O + r * D + 16 * j) * inv, qtype);
    }
}

#undef PF_NV
#undef PF_RPV
#undef PF_CAT
#undef PF_CAT_
