/* The float32-query body of `lmf_paged_decode_any` (attention.c) over a float32 or bfloat16 pool, AVX2 + FMA.
 * Compiled on every x86 build with its own target attribute and run where the dispatch table finds AVX2 and
 * FMA on the CPU (`lmf_dispatch.attn_avx2`): AVX2 CPUs without bf16 run the engine in float32.
 */
#include "common.h"

#ifdef LMF_X86

/* exp(x) for x <= 0 (softmax arguments), as common.h's exp_ps in 256 bits: 2^n * p(f); x below -87 gives
 * ~1.6e-38, NaN stays NaN. */
__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  /* NaN: max returns its second operand, x */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    /* 2^n as float bits: n in [-126, 0] here, so (n + 127) << 23 is a normal number */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 K/V values at p as float32: a float32 pool as it is, a bfloat16 pool widened (a bf16 value is the
 * top half of its float32) */
__attribute__((target("avx2,fma"))) static inline __m256 kv_load8(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The 8 sums of d[0..8), each over its 8 lanes, as one vector (lane j: the sum of d[j]). */
__attribute__((target("avx2,fma"))) static inline __m256 hsum8x8(const __m256 d[8]) {
    const __m256 t0 = _mm256_hadd_ps(d[0], d[1]), t1 = _mm256_hadd_ps(d[2], d[3]);
    const __m256 t2 = _mm256_hadd_ps(d[4], d[5]), t3 = _mm256_hadd_ps(d[6], d[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The scaled scores of a tile's nt tokens (kv head g's rows at row[i] + g) for SB query heads (1, or 2 sharing
 * each widened K value: q0 and q0 + H) into p0 (and p1): 8 / SB tokens at a time, 8 FMA chains, one
 * transposing reduction (`hsum8x8`, lane j * SB + u: token j, head u). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void heads_scores(
        const float *q0, const char *k_pool, const int64_t *row, int64_t g, int64_t nt, int64_t H, int64_t rb,
        float scale, float *p0, float *p1, const int SB, const int bf16) {
    const int TB = 8 / SB, es = bf16 ? 2 : 4;
    for (int64_t i = 0; i < nt; i += TB) {
        const char *kr[8];
        __m256 d[8];
        for (int j = 0; j < TB; j++)  /* past the tile's end: its last row again, never used */
            kr[j] = k_pool + (row[i + j < nt ? i + j : nt - 1] + g) * rb;
        for (int j = 0; j < 8; j++) d[j] = _mm256_setzero_ps();
        for (int64_t h = 0; h < H; h += 8) {
            const __m256 qa = _mm256_loadu_ps(q0 + h), qb = SB == 2 ? _mm256_loadu_ps(q0 + H + h) : qa;
            for (int j = 0; j < TB; j++) {
                const __m256 kv = kv_load8(kr[j] + h * es, bf16);
                d[j * SB] = _mm256_fmadd_ps(qa, kv, d[j * SB]);
                if (SB == 2) d[j * SB + 1] = _mm256_fmadd_ps(qb, kv, d[j * SB + 1]);
            }
        }
        const __m256 sc = _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(scale));
        if (SB == 1) {
            _mm256_store_ps(p0 + i, sc);
        } else {  /* lanes (t0 h0, t0 h1, t1 h0, ...): each head's 4 tokens together */
            const __m256 de = _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
            _mm_store_ps(p0 + i, _mm256_castps256_ps128(de));
            _mm_store_ps(p1 + i, _mm256_extractf128_ps(de, 1));
        }
    }
}

/* acc0 (and acc1) = acc * alpha + sum_i p_i * V_i over a tile's nt tokens for SB query heads sharing each
 * widened V value: 32 floats of each accumulator in registers across the tokens (8 past a multiple of 32). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void heads_values(
        const char *v_pool, const int64_t *row, int64_t g, int64_t nt, int64_t H, int64_t rb, const float *p0,
        const float *p1, float alpha0, float alpha1, float *acc0, float *acc1, const int SB, const int bf16) {
    const int es = bf16 ? 2 : 4;
    const __m256 al0 = _mm256_set1_ps(alpha0), al1 = _mm256_set1_ps(alpha1);
    int64_t h = 0;
    for (; h + 32 <= H; h += 32) {
        __m256 a[2][4];
        for (int c = 0; c < 4; c++) {
            a[0][c] = _mm256_mul_ps(_mm256_load_ps(acc0 + h + 8 * c), al0);
            if (SB == 2) a[1][c] = _mm256_mul_ps(_mm256_load_ps(acc1 + h + 8 * c), al1);
        }
        for (int64_t i = 0; i < nt; i++) {
            const char *vr = v_pool + (row[i] + g) * rb + h * es;
            const __m256 w0 = _mm256_set1_ps(p0[i]), w1 = SB == 2 ? _mm256_set1_ps(p1[i]) : w0;
            for (int c = 0; c < 4; c++) {
                const __m256 v = kv_load8(vr + 8 * c * es, bf16);
                a[0][c] = _mm256_fmadd_ps(w0, v, a[0][c]);
                if (SB == 2) a[1][c] = _mm256_fmadd_ps(w1, v, a[1][c]);
            }
        }
        for (int c = 0; c < 4; c++) {
            _mm256_store_ps(acc0 + h + 8 * c, a[0][c]);
            if (SB == 2) _mm256_store_ps(acc1 + h + 8 * c, a[1][c]);
        }
    }
    for (; h < H; h += 8) {
        __m256 a0 = _mm256_mul_ps(_mm256_load_ps(acc0 + h), al0);
        __m256 a1 = SB == 2 ? _mm256_mul_ps(_mm256_load_ps(acc1 + h), al1) : a0;
        for (int64_t i = 0; i < nt; i++) {
            const __m256 v = kv_load8(v_pool + (row[i] + g) * rb + h * es, bf16);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[i]), v, a0);
            if (SB == 2) a1 = _mm256_fmadd_ps(_mm256_set1_ps(p1[i]), v, a1);
        }
        _mm256_store_ps(acc0 + h, a0);
        if (SB == 2) _mm256_store_ps(acc1 + h, a1);
    }
}

/* decode_one_any for float32 q over a float32 or bfloat16 K/V pool, for kv heads [g0, g1) of one sequence
 * at once (AVX2 CPUs without bf16 run the engine in float32; a bf16 checkpoint or int8-activation model keeps
 * its K/V in bf16 there, half the bytes), H a multiple of 8, (g1 - g0) * G <= MAX_N. The same online softmax
 * as the others, arranged for the memory and the core:
 *   - tile-outer, head-inner: a tile's 16 tokens are read for all the heads [g0, g1) together, so each
 *     token's rows of those heads are one contiguous run of the pool ((g1 - g0) * H values; the whole token
 *     row when one thread takes every head), and the next tile's rows are prefetched while this one computes,
 *     each kv head's K rows before its scores and V rows before its values: spread so, not issued at the tile's
 *     start in one burst of 512 prefetches that stalled on the full miss queue (perf: 12.6% of the samples on
 *     one `prefetcht1`), 16 sequences at 1,100 tokens read 13.7 -> 23.7 GB/s, one 14.2 -> 24.3 (bf16 pool,
 *     `python scripts/kernels_ab.py attention --old-rev fbb96be --kv bfloat16 --seqs 16 --contexts 200,1100`).
 *     Head-outer order (one head over every token, then the next) read 128-256 B pieces 1-2 KB apart and
 *     ran at ~5 GB/s from memory against ~25 for a streaming read (Zen 4, 2 threads).
 *   - scores 8 tokens at a time: 8 independent FMA chains, then one transposing reduction (`hsum8x8`)
 *     instead of 8 horizontal sums; the tile's softmax in vectors;
 *   - V: each 64-float slice of a query head's accumulator (16 past a multiple of 64) stays in registers
 *     over the tile's tokens,
 *     rescaled by the tile's alpha on load (one load and store a tile, not a store-forwarded
 *     read-modify-write a token).
 * `bf16` is a constant in each of the two callers below, so each gets its own body. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void decode_heads_avx2(
        const float *q, const char *k_pool, const char *v_pool, const int32_t *table, int64_t t_begin, int64_t len,
        int64_t pf_len, int64_t g0, int64_t g1, int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out,
        float *part, const int bf16) {
    float acc[MAX_N * MAX_H] __attribute__((aligned(32)));
    float p[MAX_N][TILE] __attribute__((aligned(32))), mx[MAX_N], sum[MAX_N], alpha[MAX_N];
    const int64_t es = bf16 ? 2 : 4, rb = H * es, NS = (g1 - g0) * G, run = (g1 - g0) * rb;
    for (int64_t i = 0; i < NS * H; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
    for (int64_t s = 0; s < NS; s++) {
        mx[s] = -INFINITY;
        sum[s] = 0.0f;
    }
    int64_t row[TILE], next[TILE];  /* pool rows of kv head g0 for the tile's tokens; heads g0.. follow */
    tile_rows(table, t_begin, len < TILE ? len : TILE, B, K, g0, row);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        /* the next tile's rows, into L2 (into L1 they evicted this tile's: 1.1-1.3x slower, a throwaway
         * variant), a head at a time in the loops below; a partition's last tile prefetches the next partition's
         * first (pf_len: the tokens left in the sequence from t_begin) */
        const int64_t left = pf_len - t0 - nt, pf_n = left <= 0 ? 0 : left < TILE ? left : TILE;
        if (pf_n > 0) tile_rows(table, t_begin + t0 + TILE, pf_n, B, K, g0, next);
        for (int64_t g = 0; g < g1 - g0; g++) {  /* scores: query heads in pairs where G is even (a K row widened once) */
            for (int64_t i = 0; i < pf_n; i++)  /* the next tile's K rows of this head, a head at a time */
                for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(k_pool + (next[i] + g) * rb + b, _MM_HINT_T1);
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                const float *qn = q + ((g0 + g) * G + n) * H;
                if (G % 2)
                    heads_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], NULL, 1, bf16);
                else
                    heads_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], p[st + 1], 2, bf16);
            }
        }
        for (int64_t st = 0; st < NS; st++) {  /* the tile's online softmax; padding lanes end as 0 */
            for (int64_t i = nt; i < TILE; i++) p[st][i] = -INFINITY;
            const __m256 a = _mm256_load_ps(p[st]), b2 = _mm256_load_ps(p[st] + 8);
            __m256 m8 = _mm256_max_ps(a, b2);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float m = _mm_cvtss_f32(m4) > mx[st] ? _mm_cvtss_f32(m4) : mx[st];
            alpha[st] = expf(mx[st] - m);
            const __m256 mv = _mm256_set1_ps(m);
            const __m256 e0 = exp256(_mm256_sub_ps(a, mv)), e1 = exp256(_mm256_sub_ps(b2, mv));
            _mm256_store_ps(p[st], e0);
            _mm256_store_ps(p[st] + 8, e1);
            for (int64_t i = nt; i < TILE; i++) p[st][i] = 0.0f;
            float tile_sum = 0.0f;
            for (int64_t i = 0; i < nt; i++) tile_sum += p[st][i];
            sum[st] = sum[st] * alpha[st] + tile_sum;
            mx[st] = m;
        }
        for (int64_t g = 0; g < g1 - g0; g++) {  /* acc = acc * alpha + sum_i p_i * V_i, a V row widened once a pair */
            for (int64_t i = 0; i < pf_n; i++)  /* and its V rows */
                for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(v_pool + (next[i] + g) * rb + b, _MM_HINT_T1);
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                if (G % 2)
                    heads_values(v_pool, row, g, nt, H, rb, p[st], NULL, alpha[st], 0.0f, acc + st * H, NULL, 1, bf16);
                else
                    heads_values(v_pool, row, g, nt, H, rb, p[st], p[st + 1], alpha[st], alpha[st + 1], acc + st * H,
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
            const __m256 inv = _mm256_set1_ps(1.0f / sum[st]);
            float *o = out + ((g0 + g) * G + n) * H;
            for (int64_t h = 0; h < H; h += 8) _mm256_storeu_ps(o + h, _mm256_mul_ps(_mm256_load_ps(acc + st * H + h), inv));
        }
}

__attribute__((target("avx2,fma"))) LMF_HIDDEN void decode_heads_f32_avx2(const float *q, const void *k_pool,
        const void *v_pool, const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1,
        int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out, float *part) {
    decode_heads_avx2(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                      scale, out, part, 0);
}

__attribute__((target("avx2,fma"))) LMF_HIDDEN void decode_heads_bf16kv_avx2(const float *q, const void *k_pool,
        const void *v_pool, const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1,
        int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out, float *part) {
    decode_heads_avx2(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                      scale, out, part, 1);
}

#endif
