/* The bf16 body of `lmf_paged_decode_bf16` (attention.c): AVX-512 intrinsics, with AVX512-BF16 dot products
 * (`vdpbf16ps`) where the compiler targets them. The same online softmax as the portable body, a tile of 16
 * tokens in one vector: its 16 scores come out of one transposing reduction (`hsum16`). Compiled only where
 * the compiler targets AVX-512F (common.h's LMF_AVX512); elsewhere this file is empty.
 */
#include "common.h"

#ifdef LMF_AVX512

/* Lane i of the result = the sum of a[i]'s 16 lanes. A transpose-and-add tree: 45 shuffles and adds
 * for the 16 sums (about 3 each), instead of 16 separate horizontal reductions (about 8 each). */
static inline __m512 hsum16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (a2i, a2i+1, a2i, a2i+1) partial sums */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: (a4i, a4i+1, a4i+2, a4i+3) partial sums */
        c[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    /* c[i]'s four 128-bit lanes each hold a partial of sums 4i..4i+3: add lanes pairwise across c's */
    for (int i = 0; i < 2; i++)  /* 128-bit lanes: (c2i.0+c2i.1, c2i.2+c2i.3, c2i+1.0+c2i+1.1, c2i+1.2+c2i+1.3) */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    /* d[0] lanes: (0-3 half A, 0-3 half B, 4-7 A, 4-7 B); d[1] likewise for 8-15 */
    const __m512 lo = _mm512_shuffle_f32x4(d[0], d[1], 0x88), hi = _mm512_shuffle_f32x4(d[0], d[1], 0xdd);
    return _mm512_add_ps(lo, hi);  /* lanes: sums 0-3, 4-7, 8-11, 12-15 */
}

/* One sequence, all heads: each tile's K and V rows are read once (head by head: scores, softmax
 * update, V accumulation), while the next tile's rows are prefetched. */
LMF_HIDDEN void decode_seq(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *table,
                           int64_t len, int64_t N, int64_t K, int64_t H, int64_t B, float scale, uint16_t *out) {
    const int64_t C = H / 16, G = N / K;  /* 16-float chunks per head vector; query heads per kv head */
    __m512 acc[MAX_N * MAX_H / 16];
    float mx[MAX_N], sum[MAX_N], p[MAX_N][TILE];  /* p: this tile's softmax numerators per head */
#ifdef __AVX512BF16__
    __m512bh qb[MAX_N * MAX_H / 32];
    for (int64_t c = 0; c < N * H / 32; c++) qb[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
#else
    __m512 qf[MAX_N * MAX_H / 16];
    for (int64_t c = 0; c < N * C; c++) qf[c] = load_bf16(q + c * 16);
#endif
    for (int64_t c = 0; c < N * C; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n++) {
        mx[n] = -INFINITY;
        sum[n] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row_len = K * H;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        const __mmask16 live = (__mmask16)((1u << nt) - 1u);
        const uint16_t *kr[TILE], *vr[TILE];
        for (int64_t i = 0; i < nt; i++) {
            const int64_t j = t0 + i, row = (int64_t)table[j / B] * B + j % B;
            kr[i] = k_pool + row * row_len;
            vr[i] = v_pool + row * row_len;
        }
        /* the next tile's rows, requested while this one computes (+8-10% measured: the hardware
         * prefetcher loses the stream at every jump between blocks) */
        for (int64_t j = t0 + TILE; j < t0 + 2 * TILE && j < len; j++) {
            const int64_t row = (int64_t)table[j / B] * B + j % B;
            const char *kp = (const char *)(k_pool + row * row_len), *vp = (const char *)(v_pool + row * row_len);
            for (int64_t b = 0; b < row_len * 2; b += 64) {
                _mm_prefetch(kp + b, _MM_HINT_T0);
                _mm_prefetch(vp + b, _MM_HINT_T0);
            }
        }
        for (int64_t n = 0; n < N; n++) {
            const int64_t koff = (n / G) * H;
            __m512 d[TILE];
            for (int64_t i = 0; i < nt; i++) {
#ifdef __AVX512BF16__
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < H / 32; c++)
                    a = _mm512_dpbf16_ps(a, qb[n * H / 32 + c], (__m512bh)_mm512_loadu_si512(kr[i] + koff + c * 32));
#else
                __m512 a = _mm512_mul_ps(qf[n * C], load_bf16(kr[i] + koff));
                for (int64_t c = 1; c < C; c++) a = _mm512_fmadd_ps(qf[n * C + c], load_bf16(kr[i] + koff + c * 16), a);
#endif
                d[i] = a;
            }
            for (int64_t i = nt; i < TILE; i++) d[i] = _mm512_setzero_ps();
            __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, hsum16(d), vscale);
            const float m = fmaxf(mx[n], _mm512_reduce_max_ps(s));
            const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m))));
            const float alpha = expf(mx[n] - m);  /* 0 on the first tile (exp(-inf)) */
            sum[n] = sum[n] * alpha + _mm512_reduce_add_ps(e);
            mx[n] = m;
            _mm512_storeu_ps(p[n], e);
            /* this head's output: accumulators in registers across the tile's tokens */
            const int64_t voff = (n / G) * H;
            __m512 o[MAX_H / 16];
            const __m512 va = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < C; c++) o[c] = _mm512_mul_ps(acc[n * C + c], va);
            for (int64_t i = 0; i < nt; i++) {
                const __m512 w = _mm512_set1_ps(p[n][i]);
                for (int64_t c = 0; c < C; c++) o[c] = _mm512_fmadd_ps(w, load_bf16(vr[i] + voff + c * 16), o[c]);
            }
            for (int64_t c = 0; c < C; c++) acc[n * C + c] = o[c];
        }
    }
    for (int64_t n = 0; n < N; n++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[n]);
        float o[MAX_H];
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[n * C + c], inv));
        for (int64_t h = 0; h < H; h++) out[n * H + h] = f32_to_bf16(o[h]);
    }
}
#endif

#if defined(LMF_AVX512) && !defined(LMF_ATTN_AVX2)
/* ---- float32 queries over a float32 or bfloat16 pool (`lmf_paged_decode_any`), 16 lanes ---------------------------
 *
 * attention_avx2.c's body in 512-bit vectors (the tile loop and the values shared: attention_f32_tile.c), with half
 * the instructions: 16 dimensions a vector, scores 8 tokens x 2 heads at a time into one `hsum16`, a tile's softmax in
 * one vector. Its sums run in another order than the AVX2 body's, so its bits are its own (float32 rounding apart).
 * Why: a bf16 checkpoint's decode attention (float32 queries, bf16 K/V) on the AVX2 body was compute-bound, not
 * memory-bound: 16 sequences at 192 tokens, 24 layers, read 22 GB/s from memory and 37 GB/s with every sequence on
 * the same (cached) blocks (Zen 5, 2 threads), a quarter of a 16-sequence decode step of the 300M. H % 16 == 0;
 * the build's test flag -DLMF_ATTN_AVX2 keeps the AVX2 body (so that both are tested on an AVX-512 CPU). */

static inline __m512 kv_load16(const char *p, const int bf16) {  /* 16 K/V values as float32 */
    return bf16 ? load_bf16((const uint16_t *)p) : _mm512_loadu_ps((const float *)p);
}

/* The scaled scores of a tile's nt tokens (kv head g's rows at row[i] + g) for SB query heads (1, or 2 sharing each
 * widened K value: q0 and q0 + H) into p0 (and p1): 16 / SB tokens at a time, 16 FMA chains, one `hsum16` (lane
 * j * SB + u: token j, head u). */
static inline __attribute__((always_inline)) void at_scores(const float *q0, const char *k_pool, const int64_t *row,
                                                           int64_t g, int64_t nt, int64_t H, int64_t rb, float scale,
                                                           float *p0, float *p1, const int SB, const int bf16) {
    const int TB = 16 / SB, es = bf16 ? 2 : 4;
    for (int64_t i = 0; i < nt; i += TB) {
        const char *kr[16];
        __m512 d[16];
        for (int j = 0; j < TB; j++)  /* past the tile's end: its last row again, never used */
            kr[j] = k_pool + (row[i + j < nt ? i + j : nt - 1] + g) * rb;
        for (int j = 0; j < 16; j++) d[j] = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += 16) {
            const __m512 qa = _mm512_loadu_ps(q0 + h), qb = SB == 2 ? _mm512_loadu_ps(q0 + H + h) : qa;
            for (int j = 0; j < TB; j++) {
                const __m512 kv = kv_load16(kr[j] + h * es, bf16);
                d[j * SB] = _mm512_fmadd_ps(qa, kv, d[j * SB]);
                if (SB == 2) d[j * SB + 1] = _mm512_fmadd_ps(qb, kv, d[j * SB + 1]);
            }
        }
        const __m512 sc = _mm512_mul_ps(hsum16(d), _mm512_set1_ps(scale));
        if (SB == 1) {
            _mm512_storeu_ps(p0 + i, sc);
        } else {  /* lanes (t0 h0, t0 h1, t1 h0, ...): each head's 8 tokens together */
            const __m512 de = _mm512_permutexvar_ps(
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), sc);
            _mm256_storeu_ps(p0 + i, _mm512_castps512_ps256(de));
            _mm256_storeu_ps(p1 + i, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(de), 1)));
        }
    }
}

/* One query head's online-softmax step over a tile's nt scores p in one vector (in place: the probabilities,
 * padding lanes 0). */
static inline __attribute__((always_inline)) void at_softmax(float *p, int64_t nt, float *mx, float *sum,
                                                             float *alpha) {
    const __mmask16 live = (__mmask16)((1u << nt) - 1);
    const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, p);
    const float tm = _mm512_reduce_max_ps(s), m = tm > *mx ? tm : *mx;
    *alpha = expf(*mx - m);  /* 0 on the first tile: exp(-inf) */
    const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m))));
    _mm512_store_ps(p, e);
    *sum = *sum * *alpha + _mm512_reduce_add_ps(e);
    *mx = m;
}

/* the width-generic rest (attention_f32_tile.c: values, the tile loop, decode_heads_{f32,bf16kv}_avx512), 16 lanes */
#define AT_W 16
#define at_vec __m512
#define AT_TARGET
#define AT_ZERO() _mm512_setzero_ps()
#define AT_LOAD(p) _mm512_load_ps(p)
#define AT_STORE(p, v) _mm512_store_ps(p, v)
#define AT_STOREU(p, v) _mm512_storeu_ps(p, v)
#define AT_SET1(x) _mm512_set1_ps(x)
#define AT_MUL(a, b) _mm512_mul_ps(a, b)
#define AT_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define AT_KV_LOAD(p, bf16) kv_load16(p, bf16)
#define AT_NAME(x) x##_avx512
#include "attention_f32_tile.c"
#endif
