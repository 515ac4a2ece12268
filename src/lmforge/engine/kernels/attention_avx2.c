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
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void at_scores(
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

/* One query head's online-softmax step over a tile's nt scores p (in place: the probabilities, padding lanes 0). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void at_softmax(
        float *p, int64_t nt, float *mx, float *sum, float *alpha) {
    for (int64_t i = nt; i < TILE; i++) p[i] = -INFINITY;
    const __m256 a = _mm256_load_ps(p), b2 = _mm256_load_ps(p + 8);
    __m256 m8 = _mm256_max_ps(a, b2);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float m = _mm_cvtss_f32(m4) > *mx ? _mm_cvtss_f32(m4) : *mx;
    *alpha = expf(*mx - m);  /* 0 on the first tile: exp(-inf) */
    const __m256 mv = _mm256_set1_ps(m);
    const __m256 e0 = exp256(_mm256_sub_ps(a, mv)), e1 = exp256(_mm256_sub_ps(b2, mv));
    _mm256_store_ps(p, e0);
    _mm256_store_ps(p + 8, e1);
    for (int64_t i = nt; i < TILE; i++) p[i] = 0.0f;
    float tile_sum = 0.0f;
    for (int64_t i = 0; i < nt; i++) tile_sum += p[i];
    *sum = *sum * *alpha + tile_sum;
    *mx = m;
}

/* the width-generic rest (values, the tile loop, the two entry points decode_heads_{f32,bf16kv}_avx2), 8 lanes */
#define AT_W 8
#define at_vec __m256
#define AT_TARGET __attribute__((target("avx2,fma")))
#define AT_ZERO() _mm256_setzero_ps()
#define AT_LOAD(p) _mm256_load_ps(p)
#define AT_STORE(p, v) _mm256_store_ps(p, v)
#define AT_STOREU(p, v) _mm256_storeu_ps(p, v)
#define AT_SET1(x) _mm256_set1_ps(x)
#define AT_MUL(a, b) _mm256_mul_ps(a, b)
#define AT_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define AT_KV_LOAD(p, bf16) kv_load8(p, bf16)
#define AT_NAME(x) x##_avx2
#include "attention_f32_tile.c"

#endif
