/* One work item of the prefill kernel (paged_prefill.c), instantiated once per head_dim:
 * paged_prefill.c defines ITEM_D (a multiple of 16) and includes this file, which defines
 * `prefill_item_<ITEM_D>`. A constant D makes every accumulator array a fixed size that
 * gcc keeps in registers.
 *
 * Scores are computed transposed, keys by rows ([BK][rows]): each K row is broadcast one
 * element at a time against VL-row vectors of the (once transposed) queries, so a K/V
 * tile is converted to float32 with contiguous vector loads only, and the softmax runs
 * down the columns VL rows at a time with no horizontal reductions. */
#define PF_NV (ITEM_D / VL)                            /* vectors per row of D */
#define PF_RPV (PF_NV >= PF_ACC ? 1 : PF_ACC / PF_NV) /* rows per block of P.V */
#define PF_CAT_(a, b) a##b
#define PF_CAT(a, b) PF_CAT_(a, b)

/* Scores St[j][c0 * VL ...] of keys j0..j0+3 against NR VL-row vectors of queries. */
static inline __attribute__((always_inline)) void PF_CAT(qk_block_, ITEM_D)(
    const float *restrict Qt, int Rp, const float *restrict Kf, float *restrict St, int j0,
    int c0, const int NR) {
    enum { D = ITEM_D };
    pvf acc[4][PF_NR];
    for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < NR; ++c) acc[jj][c] = splat(0.0f);
    for (int d = 0; d < D; ++d) {
        pvf qv[PF_NR];
        for (int c = 0; c < NR; ++c) qv[c] = pload(Qt + d * Rp + (c0 + c) * VL);
        for (int jj = 0; jj < 4; ++jj) {
            const pvf b = splat(Kf[(j0 + jj) * D + d]);
            for (int c = 0; c < NR; ++c) acc[jj][c] += b * qv[c];
        }
    }
    for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < NR; ++c)
            __builtin_memcpy(St + (j0 + jj) * Rp + (c0 + c) * VL, &acc[jj][c], sizeof(pvf));
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
    const int R = ntok * G, Rp = (R + 15) / 16 * 16, NRV = Rp / VL;
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
            for (; c0 + PF_NR <= NRV; c0 += PF_NR)
                PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, PF_NR);
            switch (NRV - c0) {
#if PF_NR > 3
            case 3: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 3); break;
#endif
#if PF_NR > 2
            case 2: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 2); break;
#endif
            case 1: PF_CAT(qk_block_, ITEM_D)(Qt, Rp, Kf, St, j0, c0, 1); break;
            default: break;
            }
        }
        /* online softmax, VL rows at a time: mask what a row must not see, fold the tile
         * into each row's max and sum, turn scores into weights */
        const int diagonal = kb + nk - 1 > pos0;
        const pvf ninf = splat(-INFINITY);
        for (int c = 0; c < NRV; ++c) {
            pvi limv;
            __builtin_memcpy(&limv, lim + c * VL, sizeof limv);
            pvf mv, mx = ninf;
            __builtin_memcpy(&mv, M + c * VL, sizeof mv);
            for (int j = 0; j < nk; ++j) {
                pvf s = pload(St + j * Rp + c * VL);
                if (diagonal) {
                    const pvi hidden = splat_i((int32_t)(kb + j)) > limv;
                    s = (pvf)(((pvi)s & ~hidden) | ((pvi)ninf & hidden));
                    __builtin_memcpy(St + j * Rp + c * VL, &s, sizeof s);
                }
                mx = vmax(mx, s);
            }
            const pvf m_new = vmax(mv, mx);
            const pvf alpha = vexp2_neg(mv - m_new);
            pvf sum = splat(0.0f);
            for (int j = 0; j < nk; ++j) {
                const pvf p = vexp2_neg(pload(St + j * Rp + c * VL) - m_new);
                __builtin_memcpy(St + j * Rp + c * VL, &p, sizeof p);
                sum += p;
            }
            pvf l;
            __builtin_memcpy(&l, L + c * VL, sizeof l);
            l = l * alpha + sum;
            __builtin_memcpy(L + c * VL, &l, sizeof l);
            __builtin_memcpy(M + c * VL, &m_new, sizeof m_new);
            __builtin_memcpy(A + c * VL, &alpha, sizeof alpha);
        }
        /* O = O * alpha + P . V: RPV rows x D in PF_ACC registers */
        for (int r0 = 0; r0 < Rp; r0 += RPV) {
            pvf acc[RPV][NV];
            for (int i = 0; i < RPV; ++i)
                for (int j = 0; j < NV; ++j)
                    acc[i][j] = pload(O + (r0 + i) * D + VL * j) * splat(A[r0 + i]);
            for (int k = 0; k < nk; ++k) {
                pvf vv[NV];
                for (int j = 0; j < NV; ++j) vv[j] = pload(V + k * D + VL * j);
                for (int i = 0; i < RPV; ++i) {
                    const pvf p = splat(St[k * Rp + r0 + i]);
                    for (int j = 0; j < NV; ++j) acc[i][j] += p * vv[j];
                }
            }
            for (int i = 0; i < RPV; ++i)
                for (int j = 0; j < NV; ++j)
                    __builtin_memcpy(O + (r0 + i) * D + VL * j, &acc[i][j], sizeof(pvf));
        }
    }
    for (int r = 0; r < R; ++r) {
        const int t = r / G;
        const int64_t dst = ((row0 + t) * num_heads + (int64_t)kvh * G + r % G) * D;
        const pvf inv = splat(1.0f / L[r]);
        for (int j = 0; j < NV; ++j)
            store_vec(out, dst + VL * j, pload(O + r * D + VL * j) * inv, qtype);
    }
}

#undef PF_NV
#undef PF_RPV
#undef PF_CAT
#undef PF_CAT_
