/* The 512-bit body of the int8-activation matmul (qmm_a8.c): avx512_vnni, `_mm512_dpbusd_epi32`, 64 codes an
 * instruction (Ice Lake, Sapphire Rapids, Zen 4). Compiled with its own target attribute on every x86 build;
 * dispatch.c decides whether this CPU runs it.
 */
#include "common.h"

#ifdef LMF_X86

/* 512-bit body: 64 codes (two blocks) a step. Its activations come unsigned, u = q + 128 (`lmf_qmm_s8`
 * converts them once a call), so that each row costs one dpbusd a step: dpbusd(acc, u, c) accumulates
 * dot(q, c) + 128 * sum(c), and the 128 * sum(c) term is one more dpbusd a step shared by all rows
 * (`corr`), subtracted at the group's end (int32 wraps, so the difference is exact while |dot| fits,
 * K < 65536). Two accumulators a row (even and odd steps) keep two dpbusd chains in flight at batch 1.
 * A K that is 32 more than a multiple of 64 ends on a masked half step. Groups of 64 or more (and
 * int8's one group) convert to float once a group; int4 groups of 32 (or 96, ...) every step, with
 * the two blocks' scales (`wsb`: the row's scale per block of 32, filled once a weight row). */
#define T512 "avx512f,avx512bw,avx512vl,avx512vnni,fma"
#define A8_ALL (~(__mmask64)0)
#define A8_LOW32 ((((__mmask64)1) << 32) - 1)
__attribute__((target(T512), always_inline)) static inline __m512i a8_codes512(const void *w, const int bits, int64_t k,
                                                                                __mmask64 live) {
    if (bits == 8) return _mm512_maskz_loadu_epi8(live, (const int8_t *)w + k);
    const uint8_t *b = (const uint8_t *)w + k / 2;  /* 32 bytes: blocks b0 and b1, 16 each (a half step: b0) */
    const __m512i y = _mm512_broadcast_i64x4(live == A8_ALL ? _mm256_loadu_si256((const __m256i *)b)
                                                           : _mm256_maskz_loadu_epi8(0xFFFFu, b));
    /* the upper copy shifted: (low nibbles, high nibbles) = (b0 even, b1 even, b0 odd, b1 odd) in 128-bit lanes */
    const __m512i z = _mm512_and_si512(_mm512_mask_srli_epi16(y, 0xFFFF0000u, y, 4), _mm512_set1_epi8(0x0F));
    const __m512i p = _mm512_permutexvar_epi64(_mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0), z);  /* b0 even, b0 odd, ... */
    return _mm512_maskz_sub_epi8(live, p, _mm512_set1_epi8(8));  /* dead lanes: code 0 */
}

__attribute__((target(T512), always_inline)) static inline void a8_groups512(
        const a8_job *j, const void *w, const float *ws, const uint8_t *u, const float *xs, __m512 *tf, const int R,
        const int bits) {
    const int64_t K = j->K, gs = j->gs, G = j->G, A = j->A;
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int64_t g = 0; g < G; g++) {
        __m512i a0[A8_MAX_R], a1[A8_MAX_R], c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();
        int64_t k = g * gs;
        const int64_t end = k + gs;
        for (; k + 128 <= end; k += 128) {
            const __m512i wa = a8_codes512(w, bits, k, A8_ALL), wb = a8_codes512(w, bits, k + 64, A8_ALL);
            c0 = _mm512_dpbusd_epi32(c0, k128, wa);
            c1 = _mm512_dpbusd_epi32(c1, k128, wb);
            for (int r = 0; r < R; r++) {
                a0[r] = _mm512_dpbusd_epi32(a0[r], _mm512_loadu_si512(u + r * K + k), wa);
                a1[r] = _mm512_dpbusd_epi32(a1[r], _mm512_loadu_si512(u + r * K + k + 64), wb);
            }
        }
        for (; k < end; k += 64) {  /* 96, 64 or 32 codes left */
            const __mmask64 live = end - k >= 64 ? A8_ALL : A8_LOW32;
            const __m512i wa = a8_codes512(w, bits, k, live);
            c0 = _mm512_dpbusd_epi32(c0, k128, wa);
            for (int r = 0; r < R; r++)
                a0[r] = _mm512_dpbusd_epi32(a0[r], _mm512_maskz_loadu_epi8(live, u + r * K + k), wa);
        }
        const __m512i corr = _mm512_add_epi32(c0, c1);
        for (int r = 0; r < R; r++)  /* activation blocks are the groups here (per channel: the row) */
            tf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a0[r], a1[r]), corr)),
                                    _mm512_set1_ps(ws[g] * xs[r * A + g]), tf[r]);
    }
}

__attribute__((target(T512), always_inline)) static inline void a8_steps512(
        const a8_job *j, const void *w, const float *wsb, const uint8_t *u, const float *xs, __m512 *tf, const int R,
        const int bits) {
    const int64_t K = j->K, A = j->A, ab = j->ab;
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 64) {
        const int full = K - k >= 64;
        const __mmask64 live = full ? A8_ALL : A8_LOW32;
        const __m512i c = a8_codes512(w, bits, k, live);
        const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, c));
        /* lanes 0-7: block k / 32, lanes 8-15: the next (0 in a half step: its dot is 0 too) */
        const __m512 sv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(wsb[k / 32]), 0xFF00,
                                                     _mm_set_ss(full ? wsb[k / 32 + 1] : 0.0f));
        for (int r = 0; r < R; r++) {  /* the activation blocks of the step's two blocks of 32 (groups of 32, 96...) */
            const float *xr = xs + r * A;
            const __m512 xv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(xr[k / ab]), 0xFF00,
                                                         _mm_set_ss(full ? xr[(k + 32) / ab] : 0.0f));
            tf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg, _mm512_maskz_loadu_epi8(live, u + r * K + k), c)),
                                    _mm512_mul_ps(sv, xv), tf[r]);
        }
    }
}

__attribute__((target(T512), always_inline)) static inline void a8_rows512(
        const a8_job *j, const void *w, const float *ws, const float *wsb, const float *wz, const uint8_t *u,
        const float *xs, const float *qs, float *total, const int R, const int bits) {
    __m512 tf[A8_MAX_R];
    for (int r = 0; r < R; r++) tf[r] = _mm512_setzero_ps();
    if (wsb == NULL) a8_groups512(j, w, ws, u, xs, tf, R, bits);
    else a8_steps512(j, w, wsb, u, xs, tf, R, bits);
    for (int r = 0; r < R; r++) total[r] = _mm512_reduce_add_ps(tf[r]);
    if (wz != NULL)  /* zero offsets: + zero * xs * sum(q) a group (qs) */
        for (int r = 0; r < R; r++)
            for (int64_t g = 0; g < j->G; g++) total[r] += wz[g] * qs[r * j->G + g];
}

__attribute__((target(T512))) LMF_HIDDEN void a8_range_avx512vnni(const a8_job *j) {
    const int64_t K = j->K, G = j->G, row_bytes = j->bits == 8 ? K : K / 2;
    const int steps = j->gs % 64 != 0 && G > 1;  /* groups of 32 (96, ...): scales change inside a step */
    float wsb[65536 / 32], ws_buf[LMF_MAX_G], wz_buf[LMF_MAX_G];
    const uint8_t *u = (const uint8_t *)j->q;  /* q + 128 here (lmf_qmm_s8) */
    for (int64_t n = j->n0; n < j->n1; n++) {
        const void *w = (const uint8_t *)j->w + n * row_bytes;
        const float *ws, *wz;
        row_scales(j->sc, j->ws, n, G, j->bits, ws_buf, wz_buf, &ws, &wz);
        if (steps)  /* the row's scale per block of 32, without a division */
            for (int64_t b = 0, g = 0, left = j->gs / 32; b < K / 32; b++) {
                wsb[b] = ws[g];
                if (--left == 0) g++, left = j->gs / 32;
            }
        for (int64_t m0 = 0; m0 < j->M; m0 += A8_MAX_R) {
            const int R = j->M - m0 < A8_MAX_R ? (int)(j->M - m0) : A8_MAX_R;
            float total[A8_MAX_R];
            A8_ROWS_SWITCH(a8_rows512, R, j, w, ws, steps ? wsb : NULL, wz, u + m0 * K, j->xs + m0 * j->A,
                           j->qs ? j->qs + m0 * G : NULL, total);
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r];
        }
    }
}
#endif
