/* The float32-query decode body of `lmf_paged_decode_any` (attention.c) over a float32 or bfloat16 pool, written
 * once for any vector width: attention_avx2.c includes this file for 8 lanes (AVX2 + FMA), attention_avx512.c for
 * 16 (AVX-512F). Compiled on its own (the build compiles every .c, and keys itself by every .c and common.h, the one
 * header) it is empty: everything below needs the includer's AT_W. The includer defines, before the #include:
 *   AT_W                      lanes a vector (8 or 16); at_vec its type
 *   AT_TARGET                 the functions' target attribute (empty where the whole file is compiled for it)
 *   AT_ZERO() AT_LOAD(p) AT_STORE(p, v) AT_STOREU(p, v) AT_SET1(x) AT_MUL(a, b) AT_FMA(a, b, c) (a * b + c)
 *   AT_KV_LOAD(p, bf16)       AT_W K/V values at p as float32 (a bf16 pool widened)
 *   AT_NAME(x)                x with the width's suffix (the two entry points below)
 * and two functions, the parts whose instructions differ by width:
 *   at_scores(q0, k_pool, row, g, nt, H, rb, scale, p0, p1, SB, bf16): a tile's scaled scores for SB query heads;
 *   at_softmax(p, nt, &mx, &sum, &alpha): one query head's online-softmax step over the tile's scores p (in place:
 *     the probabilities, padding lanes 0).
 * Each width sums in its own order (its reductions), so each has its own bits; within a width the bits are those of
 * the body as it stood in each file before (2026-12-07).
 *
 * The order of work, arranged for the memory and the core:
 *   - tile-outer, head-inner: a tile's 16 tokens are read for all the heads [g0, g1) together, so each
 *     token's rows of those heads are one contiguous run of the pool ((g1 - g0) * H values; the whole token
 *     row when one thread takes every head), and the next tile's rows are prefetched while this one computes,
 *     each kv head's K rows before its scores and V rows before its values: spread so, not issued at the tile's
 *     start in one burst of 512 prefetches that stalled on the full miss queue (perf: 12.6% of the samples on
 *     one `prefetcht1`), 16 sequences at 1,100 tokens read 13.7 -> 23.7 GB/s, one 14.2 -> 24.3 (bf16 pool,
 *     `python scripts/kernels_ab.py attention --old-rev fbb96be --kv bfloat16 --seqs 16 --contexts 200,1100`).
 *     Head-outer order (one head over every token, then the next) read 128-256 B pieces 1-2 KB apart and
 *     ran at ~5 GB/s from memory against ~25 for a streaming read (Zen 4, 2 threads). Into L2, not L1 (into L1
 *     they evicted this tile's rows: 1.1-1.3x slower, a throwaway variant).
 *   - query heads in pairs where G is even: each K and V value widened once for both;
 *   - V: each 4 * AT_W-float slice of a query head's accumulator (AT_W past a multiple of it) stays in registers
 *     over the tile's tokens, rescaled by the tile's alpha on load (one load and store a tile, not a
 *     store-forwarded read-modify-write a token).
 * `bf16` is a constant in each of the two entry points, so each gets its own body. */
#ifdef AT_W

/* acc0 (and acc1) = acc * alpha + sum_i p_i * V_i over a tile's nt tokens for SB query heads sharing each widened
 * V value. */
AT_TARGET static inline __attribute__((always_inline)) void at_values(
        const char *v_pool, const int64_t *row, int64_t g, int64_t nt, int64_t H, int64_t rb, const float *p0,
        const float *p1, float alpha0, float alpha1, float *acc0, float *acc1, const int SB, const int bf16) {
    const int es = bf16 ? 2 : 4;
    const at_vec al0 = AT_SET1(alpha0), al1 = AT_SET1(alpha1);
    int64_t h = 0;
    for (; h + 4 * AT_W <= H; h += 4 * AT_W) {
        at_vec a[2][4];
        for (int c = 0; c < 4; c++) {
            a[0][c] = AT_MUL(AT_LOAD(acc0 + h + AT_W * c), al0);
            if (SB == 2) a[1][c] = AT_MUL(AT_LOAD(acc1 + h + AT_W * c), al1);
        }
        for (int64_t i = 0; i < nt; i++) {
            const char *vr = v_pool + (row[i] + g) * rb + h * es;
            const at_vec w0 = AT_SET1(p0[i]), w1 = SB == 2 ? AT_SET1(p1[i]) : w0;
            for (int c = 0; c < 4; c++) {
                const at_vec v = AT_KV_LOAD(vr + AT_W * c * es, bf16);
                a[0][c] = AT_FMA(w0, v, a[0][c]);
                if (SB == 2) a[1][c] = AT_FMA(w1, v, a[1][c]);
            }
        }
        for (int c = 0; c < 4; c++) {
            AT_STORE(acc0 + h + AT_W * c, a[0][c]);
            if (SB == 2) AT_STORE(acc1 + h + AT_W * c, a[1][c]);
        }
    }
    for (; h < H; h += AT_W) {
        at_vec a0 = AT_MUL(AT_LOAD(acc0 + h), al0);
        at_vec a1 = SB == 2 ? AT_MUL(AT_LOAD(acc1 + h), al1) : a0;
        for (int64_t i = 0; i < nt; i++) {
            const at_vec v = AT_KV_LOAD(v_pool + (row[i] + g) * rb + h * es, bf16);
            a0 = AT_FMA(AT_SET1(p0[i]), v, a0);
            if (SB == 2) a1 = AT_FMA(AT_SET1(p1[i]), v, a1);
        }
        AT_STORE(acc0 + h, a0);
        if (SB == 2) AT_STORE(acc1 + h, a1);
    }
}

/* the next tile's rows of kv head g (pf_n tokens from `next`) into L2 */
AT_TARGET static inline __attribute__((always_inline)) void at_prefetch(const char *pool, const int64_t *next,
                                                                        int64_t pf_n, int64_t g, int64_t rb) {
    for (int64_t i = 0; i < pf_n; i++)
        for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(pool + (next[i] + g) * rb + b, _MM_HINT_T1);
}

/* kv heads [g0, g1) of one sequence, tokens [t_begin, t_begin + len) (`decode_heads_fn`, common.h); H % AT_W == 0,
 * (g1 - g0) * G <= MAX_N */
AT_TARGET static inline __attribute__((always_inline)) void at_decode_heads(
        const float *q, const char *k_pool, const char *v_pool, const int32_t *table, int64_t t_begin, int64_t len,
        int64_t pf_len, int64_t g0, int64_t g1, int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out,
        float *part, const int bf16) {
    float acc[MAX_N * MAX_H] __attribute__((aligned(AT_W * 4)));
    float p[MAX_N][TILE] __attribute__((aligned(AT_W * 4))), mx[MAX_N], sum[MAX_N], alpha[MAX_N];
    const int64_t es = bf16 ? 2 : 4, rb = H * es, NS = (g1 - g0) * G;
    for (int64_t i = 0; i < NS * H; i += AT_W) AT_STORE(acc + i, AT_ZERO());
    for (int64_t s = 0; s < NS; s++) {
        mx[s] = -INFINITY;
        sum[s] = 0.0f;
    }
    int64_t row[TILE], next[TILE];  /* pool rows of kv head g0 for the tile's tokens; heads g0.. follow */
    tile_rows(table, t_begin, len < TILE ? len : TILE, B, K, g0, row);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        /* the next tile's rows, a kv head at a time in the loops below; a partition's last tile prefetches the next
         * partition's first (pf_len: the tokens left in the sequence from t_begin) */
        const int64_t left = pf_len - t0 - nt, pf_n = left <= 0 ? 0 : left < TILE ? left : TILE;
        if (pf_n > 0) tile_rows(table, t_begin + t0 + TILE, pf_n, B, K, g0, next);
        for (int64_t g = 0; g < g1 - g0; g++) {
            at_prefetch(k_pool, next, pf_n, g, rb);
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                const float *qn = q + ((g0 + g) * G + n) * H;
                if (G % 2)
                    at_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], NULL, 1, bf16);
                else
                    at_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], p[st + 1], 2, bf16);
            }
        }
        for (int64_t st = 0; st < NS; st++) at_softmax(p[st], nt, &mx[st], &sum[st], &alpha[st]);
        for (int64_t g = 0; g < g1 - g0; g++) {
            at_prefetch(v_pool, next, pf_n, g, rb);
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                if (G % 2)
                    at_values(v_pool, row, g, nt, H, rb, p[st], NULL, alpha[st], 0.0f, acc + st * H, NULL, 1, bf16);
                else
                    at_values(v_pool, row, g, nt, H, rb, p[st], p[st + 1], alpha[st], alpha[st + 1], acc + st * H,
                              acc + (st + 1) * H, 2, bf16);
            }
        }
        memcpy(row, next, sizeof row);
    }
    if (part != NULL) {  /* a partition of the context: its unnormalized state, merged by `merge_parts` */
        memcpy(part, acc, (size_t)(NS * H) * sizeof(float));
        memcpy(part + NS * H, mx, (size_t)NS * sizeof(float));
        memcpy(part + NS * H + NS, sum, (size_t)NS * sizeof(float));
        return;
    }
    for (int64_t g = 0; g < g1 - g0; g++)
        for (int64_t n = 0; n < G; n++) {
            const int64_t st = g * G + n;
            const at_vec inv = AT_SET1(1.0f / sum[st]);
            float *o = out + ((g0 + g) * G + n) * H;
            for (int64_t h = 0; h < H; h += AT_W) AT_STOREU(o + h, AT_MUL(AT_LOAD(acc + st * H + h), inv));
        }
}

AT_TARGET LMF_HIDDEN void AT_NAME(decode_heads_f32)(const float *q, const void *k_pool, const void *v_pool,
                                                    const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len,
                                                    int64_t g0, int64_t g1, int64_t G, int64_t K, int64_t H, int64_t B,
                                                    float scale, float *out, float *part) {
    at_decode_heads(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                    scale, out, part, 0);
}

AT_TARGET LMF_HIDDEN void AT_NAME(decode_heads_bf16kv)(const float *q, const void *k_pool, const void *v_pool,
                                                       const int32_t *table, int64_t t_begin, int64_t len,
                                                       int64_t pf_len, int64_t g0, int64_t g1, int64_t G, int64_t K,
                                                       int64_t H, int64_t B, float scale, float *out, float *part) {
    at_decode_heads(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                    scale, out, part, 1);
}
#endif
