/* The 256-bit bodies of the int8-activation matmul (qmm_a8.c): one template, three instantiations, which differ
 * only in their dot-product step:
 *   avx2             _mm256_maddubs_epi16 + _mm256_madd_epi16 (Haswell, Zen 1-3)
 *   avx_vnni         _mm256_dpbusd_avx_epi32, VEX (Alder Lake and later without AVX-512; compilers that know it)
 *   avx512_vnni_256  _mm256_dpbusd_epi32, EVEX (AVX-512 VNNI + VL: the default on such a CPU)
 * Each is compiled with its own target attribute on every x86 build; dispatch.c decides which this CPU runs.
 */
#include "common.h"

#ifdef LMF_X86


/* 256-bit bodies: one block of 32 codes a step, two steps (two dot chains a row) at a time. A macro,
 * instantiated per ISA: the dot-product step DOT(acc, |c|, signed q) is the only difference. */
#define A8_YMM_BODY(NAME, TARGET, DOT)                                                                      \
__attribute__((target(TARGET), always_inline)) static inline __m256i NAME##_codes(const void *w, const int bits, \
                                                                                 int64_t k, int64_t K) {    \
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)((const int8_t *)w + k));                     \
    /* the block's 16 bytes in both halves (one load), the upper half shifted to its high nibbles; a 5/6-bit  \
     * block is 16 + 4 (bits - 4) bytes */                                                                  \
    const uint8_t *blk = (const uint8_t *)w + (bits == 4 ? k >> 1 : (k / 32) * (16 + 4 * (bits - 4)));    \
    const __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)blk));                  \
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(y, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F)); \
    if (bits == 4) return lo;                                                                               \
    /* 5 / 6 bits: the block's high bits (common.h's row layout), element e's at byte e % (4 hb), bit hb (e / 4 hb) */ \
    const uint8_t *hp = blk + 16;                                                                           \
    (void)K;                                                                                                \
    __m256i h;                                                                                              \
    if (bits == 6) {                                                                                        \
        int64_t h8;                                                                                         \
        memcpy(&h8, hp, 8);                                                                                 \
        h = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h8), _mm256_set_epi64x(6, 4, 2, 0)),     \
                             _mm256_set1_epi8(0x03));                                                       \
    } else {                                                                                                \
        int32_t h4;                                                                                         \
        memcpy(&h4, hp, 4);                                                                                 \
        h = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h4), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0)), \
                             _mm256_set1_epi8(0x01));                                                       \
    }                                                                                                       \
    return _mm256_or_si256(lo, _mm256_slli_epi16(h, 4));                                                    \
}                                                                                                           \
/* the dot step's unsigned operand: |c| (int8), or the stored unsigned code itself (4, 5, 6 bits) */                 \
__attribute__((target(TARGET), always_inline)) static inline __m256i NAME##_lhs(__m256i c, const int bits) { \
    return bits == 8 ? _mm256_abs_epi8(c) : c;                                                              \
}                                                                                                           \
/* its signed operand: the activations with the weight's sign (int8), or as they are (int4) */              \
__attribute__((target(TARGET), always_inline)) static inline __m256i NAME##_rhs(const int8_t *q, __m256i c,  \
                                                                               const int bits) {            \
    const __m256i x = _mm256_loadu_si256((const __m256i *)q);                                               \
    return bits == 8 ? _mm256_sign_epi8(x, c) : x;                                                          \
}                                                                                                           \
__attribute__((target(TARGET), always_inline)) static inline __m256i NAME##_dot(__m256i acc, __m256i a, __m256i x) { \
    DOT;                                                                                                    \
}                                                                                                           \
__attribute__((target(TARGET))) static inline float NAME##_hsum(__m256 v) {                                 \
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                          \
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                                 \
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));                                           \
}                                                                                                           \
/* the scales of block b (32 codes): one group of 32, or two of 16 (GGUF's Q6_K: dot lanes 0-3 are codes   \
 * 0-15, lanes 4-7 codes 16-31) */                                                                          \
__attribute__((target(TARGET), always_inline)) static inline __m256 NAME##_bscale(const float *ws, int64_t b, \
                                                                                 const int64_t gs) {        \
    if (gs == 32) return _mm256_set1_ps(ws[b]);                                                             \
    return _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]));                             \
}                                                                                                           \
/* int4 codes of two blocks A, B (32 bytes, one load): low nibbles are A's and B's even codes, high nibbles   \
 * their odd ones; the activations come as (A even, B even, A odd, B odd) (`pair_order`), so two dot steps    \
 * cover 64 codes, lanes 0-3 summing A, 4-7 B, and one convert and multiply-add with (sA x4, sB x4) apply     \
 * both scales (groups of 32); a group of 64 or more takes whole pairs into one integer sum. Two pairs a step \
 * on two float chains; a block left over (K / 32 odd) is the one-block path's. */                           \
__attribute__((target(TARGET), always_inline)) static inline void NAME##_pairs(                             \
        const a8_job *j, const void *w, const float *ws, const int8_t *q, const float *xs, const int64_t x0,  \
        __m256 *tf, const int R) {                                                                          \
    const int64_t K = j->K, gs = j->gs, np = K / 64, A = j->A;  /* x0: the first row's index into j->xp */  \
    const __m256i lo4 = _mm256_set1_epi8(0x0F);                                                             \
    __m256 tf2[A8_MAX_R];                                                                                   \
    for (int r = 0; r < R; r++) tf2[r] = _mm256_setzero_ps();                                               \
    if (gs == 32) {                                                                                         \
        int64_t p = 0;                                                                                      \
        for (; p + 2 <= np; p += 2) {                                                                       \
            const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + p * 32));           \
            const __m256i v2 = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + p * 32 + 32));     \
            const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); \
            const __m256i lo2 = _mm256_and_si256(v2, lo4), hi2 = _mm256_and_si256(_mm256_srli_epi16(v2, 4), lo4); \
            const __m256 s = NAME##_bscale(ws, p, 16), s2 = NAME##_bscale(ws, p + 1, 16);                  \
            for (int r = 0; r < R; r++) {                                                                   \
                const int8_t *x = q + r * K + p * 64;                                                       \
                const float *xv = j->xp + (x0 + r * np + p) * 8;  /* the pair's (x_A x4, x_B x4) */          \
                const __m256 sx = _mm256_mul_ps(s, _mm256_loadu_ps(xv));                                    \
                const __m256 sx2 = _mm256_mul_ps(s2, _mm256_loadu_ps(xv + 8));                              \
                const __m256i d = NAME##_dot(NAME##_dot(_mm256_setzero_si256(), lo,                       \
                    _mm256_loadu_si256((const __m256i *)x)), hi, _mm256_loadu_si256((const __m256i *)(x + 32))); \
                const __m256i d2 = NAME##_dot(NAME##_dot(_mm256_setzero_si256(), lo2,                     \
                    _mm256_loadu_si256((const __m256i *)(x + 64))), hi2, _mm256_loadu_si256((const __m256i *)(x + 96))); \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sx, tf[r]);                                  \
                tf2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), sx2, tf2[r]);                              \
            }                                                                                               \
        }                                                                                                   \
        for (; p < np; p++) {                                                                               \
            const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + p * 32));           \
            const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); \
            const __m256 s = NAME##_bscale(ws, p, 16);                                                      \
            for (int r = 0; r < R; r++) {                                                                   \
                const int8_t *x = q + r * K + p * 64;                                                       \
                const __m256i d = NAME##_dot(NAME##_dot(_mm256_setzero_si256(), lo,                       \
                    _mm256_loadu_si256((const __m256i *)x)), hi, _mm256_loadu_si256((const __m256i *)(x + 32))); \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),                                              \
                                        _mm256_mul_ps(s, _mm256_loadu_ps(j->xp + (x0 + r * np + p) * 8)), tf[r]); \
            }                                                                                               \
        }                                                                                                   \
        if (np * 64 < K) {  /* the last, unpaired block: activations (even, odd) as the one-block path */   \
            const int64_t k = np * 64;                                                                      \
            const __m256i c = NAME##_codes(w, 4, k, K);                                                        \
            for (int r = 0; r < R; r++)                                                                     \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(NAME##_dot(_mm256_setzero_si256(), c,             \
                    _mm256_loadu_si256((const __m256i *)(q + r * K + k)))),                                  \
                    _mm256_set1_ps(ws[k / 32] * xs[r * A + k / 32]), tf[r]);                                \
        }                                                                                                   \
    } else {  /* groups of 64, 128, ...: whole pairs, one integer sum a group */                           \
        for (int64_t g = 0; g < K / gs; g++) {                                                              \
            __m256i acc[A8_MAX_R];                                                                          \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();                                    \
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) {                                           \
                const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + k / 2));        \
                const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); \
                for (int r = 0; r < R; r++) {                                                               \
                    const int8_t *x = q + r * K + k;                                                        \
                    acc[r] = NAME##_dot(NAME##_dot(acc[r], lo, _mm256_loadu_si256((const __m256i *)x)),     \
                                        hi, _mm256_loadu_si256((const __m256i *)(x + 32)));                 \
                }                                                                                           \
            }                                                                                               \
            for (int r = 0; r < R; r++)  /* activation blocks are the groups here */                       \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(ws[g] * xs[r * A + g]), tf[r]); \
        }                                                                                                   \
    }                                                                                                       \
    for (int r = 0; r < R; r++) tf[r] = _mm256_add_ps(tf[r], tf2[r]);                                       \
}                                                                                                           \
__attribute__((target(TARGET), always_inline)) static inline void NAME##_rows(                              \
        const a8_job *j, const void *w, const float *ws, const float *wz, const int8_t *q, const float *xs,   \
        const float *qs, float *total, const int R, const int bits) {                                       \
    const int64_t K = j->K, gs = j->gs, G = j->G, A = j->A;                                                 \
    __m256 tf[A8_MAX_R];                                                                                    \
    for (int r = 0; r < R; r++) tf[r] = _mm256_setzero_ps();                                                \
    if (bits == 4 && j->pairs) {  /* int4, pairs of blocks in one load (activations in `pair_order`) */     \
        NAME##_pairs(j, w, ws, q, xs, (xs - j->xs) / A * (K / 64), tf, R);                                  \
    } else                                                                                                  \
    if (gs == 32 || gs == 16) {  /* GGUF's blocks: scales a block; two blocks a step on two float chains */ \
        __m256 tf2[A8_MAX_R];                                                                               \
        for (int r = 0; r < R; r++) tf2[r] = _mm256_setzero_ps();                                           \
        const int64_t nb = K / 32;                                                                          \
        int64_t g = 0;                                                                                      \
        for (; g + 2 <= nb; g += 2) {                                                                       \
            const int64_t k = g * 32;                                                                       \
            const __m256i c = NAME##_codes(w, bits, k, K), a = NAME##_lhs(c, bits);                            \
            const __m256i c2 = NAME##_codes(w, bits, k + 32, K), a2 = NAME##_lhs(c2, bits);                    \
            const __m256 s = NAME##_bscale(ws, g, gs), s2 = NAME##_bscale(ws, g + 1, gs);                   \
            for (int r = 0; r < R; r++) {  /* activation blocks of 32 here */                              \
                const __m256i d = NAME##_dot(_mm256_setzero_si256(), a, NAME##_rhs(q + r * K + k, c, bits));  \
                const __m256i d2 = NAME##_dot(_mm256_setzero_si256(), a2,                                   \
                                              NAME##_rhs(q + r * K + k + 32, c2, bits));                    \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_set1_ps(xs[r * A + g])), \
                                        tf[r]);                                                             \
                tf2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2),                                            \
                                         _mm256_mul_ps(s2, _mm256_set1_ps(xs[r * A + g + 1])), tf2[r]);     \
            }                                                                                               \
        }                                                                                                   \
        if (g < nb) {                                                                                       \
            const int64_t k = g * 32;                                                                       \
            const __m256i c = NAME##_codes(w, bits, k, K), a = NAME##_lhs(c, bits);                            \
            const __m256 s = NAME##_bscale(ws, g, gs);                                                      \
            for (int r = 0; r < R; r++)                                                                     \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(NAME##_dot(_mm256_setzero_si256(), a,            \
                                                                      NAME##_rhs(q + r * K + k, c, bits))), \
                                        _mm256_mul_ps(s, _mm256_set1_ps(xs[r * A + g])), tf[r]);            \
        }                                                                                                   \
        for (int r = 0; r < R; r++) tf[r] = _mm256_add_ps(tf[r], tf2[r]);                                   \
    } else                                                                                                  \
    for (int64_t g = 0; g < G; g++) {                                                                       \
        __m256i acc[A8_MAX_R], acc2[A8_MAX_R];  /* two dot chains a row: even and odd blocks */            \
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_si256();                              \
        int64_t k = g * gs;                                                                                 \
        const int64_t end = k + gs;                                                                         \
        for (; k + 64 <= end; k += 64) {                                                                    \
            const __m256i c = NAME##_codes(w, bits, k, K), a = NAME##_lhs(c, bits);                            \
            const __m256i c2 = NAME##_codes(w, bits, k + 32, K), a2 = NAME##_lhs(c2, bits);                    \
            for (int r = 0; r < R; r++) {                                                                   \
                acc[r] = NAME##_dot(acc[r], a, NAME##_rhs(q + r * K + k, c, bits));                         \
                acc2[r] = NAME##_dot(acc2[r], a2, NAME##_rhs(q + r * K + k + 32, c2, bits));                \
            }                                                                                               \
        }                                                                                                   \
        if (k < end) {  /* an odd block left */                                                             \
            const __m256i c = NAME##_codes(w, bits, k, K), a = NAME##_lhs(c, bits);                            \
            for (int r = 0; r < R; r++) acc[r] = NAME##_dot(acc[r], a, NAME##_rhs(q + r * K + k, c, bits));  \
        }                                                                                                   \
        for (int r = 0; r < R; r++)  /* activation blocks are the groups here (per channel: the row) */    \
            tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[r], acc2[r])),                  \
                                    _mm256_set1_ps(ws[g] * xs[r * A + g]), tf[r]);                          \
    }                                                                                                       \
    /* per group, (zero - off * scale, a 4/5/6-bit code read as u - off) * xs * sum(q) (qs, a group) */      \
    float tail[A8_MAX_R] = {0};                                                                             \
    if (bits < 8 || wz != NULL) {                                                                           \
        int64_t g = 0;                                                                                      \
        const __m256 eight = _mm256_set1_ps((float)code_offset(bits));                                      \
        for (; g + 8 <= G; g += 8) {                                                                        \
            const __m256 cv = _mm256_fnmadd_ps(eight, _mm256_loadu_ps(ws + g),                             \
                                               wz ? _mm256_loadu_ps(wz + g) : _mm256_setzero_ps());         \
            for (int r = 0; r < R; r++) tf[r] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(qs + r * G + g), tf[r]); \
        }                                                                                                   \
        for (; g < G; g++) {                                                                                \
            const float cg = (wz ? wz[g] : 0.0f) - (float)code_offset(bits) * ws[g];                       \
            for (int r = 0; r < R; r++) tail[r] += cg * qs[r * G + g];                                      \
        }                                                                                                   \
    }                                                                                                       \
    for (int r = 0; r < R; r++) total[r] = NAME##_hsum(tf[r]) + tail[r];                                    \
}                                                                                                           \
__attribute__((target(TARGET))) LMF_HIDDEN void a8_range_##NAME(const a8_job *j) {                          \
    const int64_t K = j->K, G = j->G, row_bytes = row_bytes_of(j->bits, K);                                 \
    float ws_buf[LMF_MAX_G], wz_buf[LMF_MAX_G];                                                             \
    for (int64_t n = j->n0; n < j->n1; n++) {                                                               \
        const void *w = (const uint8_t *)j->w + n * row_bytes;                                              \
        const float *ws, *wz;                                                                               \
        row_scales(j->sc, j->ws, n, G, j->bits, ws_buf, wz_buf, &ws, &wz);                                  \
        for (int64_t m0 = 0; m0 < j->M; m0 += A8_MAX_R) {                                                   \
            const int R = j->M - m0 < A8_MAX_R ? (int)(j->M - m0) : A8_MAX_R;                               \
            float total[A8_MAX_R];                                                                          \
            A8_ROWS_SWITCH_ALL(NAME##_rows, R, j, w, ws, wz, j->q + m0 * K, j->xs + m0 * j->A,             \
                               j->qs ? j->qs + m0 * G : NULL, total);                                      \
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r];                             \
        }                                                                                                   \
    }                                                                                                       \
}

A8_YMM_BODY(avx2, "avx2,fma",
            return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), _mm256_set1_epi16(1))))
#if defined(LMF_AVXVNNI)
A8_YMM_BODY(avxvnni, "avx2,fma,avxvnni", return _mm256_dpbusd_avx_epi32(acc, a, x))
#endif
/* The same 256-bit body on the EVEX form of vpdpbusd (AVX-512 VNNI + VL): on Zen 4, whose 512-bit
 * operations are two 256-bit halves, it beats the 512-bit body (qmm_a8_avx512.c) at every batch for int4 and at
 * batch 1-4 for int8 (the 300M's layer shapes, 2 threads: int4 g32 batch 1 0.21 against 0.39 ms,
 * batch 64 6.4 against 7.8; int8 g32 batch 1 0.22 against 0.36, batch 16 1.87 against 1.78), so it is
 * the default there; the 512-bit body stays for `LMFORGE_A8_ISA=avx512_vnni`. */
A8_YMM_BODY(avx512vnni256, "avx2,fma,avx512vl,avx512vnni", return _mm256_dpbusd_epi32(acc, a, x))
#endif
