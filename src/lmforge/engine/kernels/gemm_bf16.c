/* bf16 weights on the CPU's bf16 dot products: a panel GEMM on AVX512-BF16 (`vdpbf16ps`) for many rows (prefill
 * chunks, decode batches) of a bf16 checkpoint's linears, which otherwise widen every weight to float32 (the row
 * kernel, qmm_f32.c) or go to oneDNN's bf16 GEMM with the weight reordered on every call.
 *
 * The A8 panel GEMM's shape (qmm_a8_panel.c) with pairs in place of quads: 16 weight rows at a time, unpacked
 * once per call into pairs of inputs a lane by one 16 x 16 transpose of 4-byte words (a bf16 row's word t is its
 * inputs 2t and 2t + 1, so no other shuffle is needed):
 *
 *     P[k / 2][i] = (w[n0 + i][k], w[n0 + i][k + 1])      (a 64-byte vector: 2 k of 16 rows)
 *
 * and one `vdpbf16ps` multiplies it by one activation pair broadcast to the 16 lanes (the `{1to16}` memory
 * operand): 16 outputs, no horizontal sum, each panel vector used by 12 activation rows while it sits in a
 * register (2 panels x 12 rows = 24 float32 accumulators). The activations are rounded to bfloat16 once a call
 * (nearest even, as torch's `.to(torch.bfloat16)`), as a bf16 GEMM's are; products and sums in float32.
 * out[m, n] = scale[n] * sum_k w[n, k] x[m, k] (scale: one a row, 1 for a dense checkpoint).
 *
 * `lmf_qmm_f32` (bits 16, per-row scales) runs it from `lmf_bf16_panel_rows()` rows on a CPU with AVX512-BF16
 * (dispatch.c); elsewhere `lmf_gemm_bf16` returns -1 and the caller keeps its other paths.
 */
#include "common.h"

#if defined(LMF_X86) && (defined(__clang__) ? (__clang_major__ >= 9) : (__GNUC__ >= 10))
#define LMF_BF16_PANEL 1
#define TB "avx512f,avx512bw,avx512vl,avx512bf16"
#define BP 16     /* weight rows a panel: one vector of float32 lanes */
#define BR 12     /* activation rows a pass over two panels side by side */

/* The panel of weight rows [n0, n0 + live): K / 2 vectors of 16 pairs; lanes past `live` repeat the last row. */
__attribute__((target(TB))) static void bf16_panel_build(const uint16_t *w, int64_t K, int64_t N, int64_t n0,
                                                         int live, int32_t *P) {
    const uint16_t *rows[BP];
    for (int i = 0; i < BP; i++) rows[i] = w + (n0 + (i < live ? i : live - 1)) * K;
    for (int64_t c = 0; c < K; c += 32) {  /* K: a multiple of 32, 16 words a row a step */
        __m512i r[16];
        if (n0 + 2 * BP < N)  /* the next pair of panels' same bytes into L2 (qmm_a8_panel.c's panel_build: why) */
            for (int i = 0; i < BP; i++) _mm_prefetch((const char *)(rows[i] + 2 * BP * K + c), _MM_HINT_T1);
        for (int i = 0; i < BP; i++) r[i] = _mm512_loadu_si512(rows[i] + c);
        lmf_transpose16(r);
        for (int t = 0; t < 16; t++) _mm512_storeu_si512(P + (c / 2 + t) * BP, r[t]);
    }
}

/* acc += vdpbf16ps(w, the pair at p broadcast to every lane), the broadcast as the instruction's memory operand */
__attribute__((target(TB), always_inline)) static inline void dpbf16_bcast(__m512 *acc, const __m512i w,
                                                                           const uint16_t *p) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(w), "m"(*(const int32_t *)p));
#else
    int32_t a;
    memcpy(&a, p, 4);
    *acc = _mm512_dpbf16_ps(*acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(a));
#endif
}

/* R activation rows (xb + m0 * K) against panels P0, P1: out[r, 0..32) masked by live0 / live1, times the scales */
__attribute__((target(TB), always_inline)) static inline void bf16_rows(const int32_t *P0, const int32_t *P1,
                                                                        const uint16_t *xb, int64_t K, const float *sc,
                                                                        float *out, int64_t N, __mmask16 live0,
                                                                        __mmask16 live1, const int R) {
    __m512 acc[2][BR];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < K / 2; d++) {
        const __m512i w0 = _mm512_loadu_si512(P0 + d * BP), w1 = _mm512_loadu_si512(P1 + d * BP);
        for (int r = 0; r < R; r++) {
            dpbf16_bcast(&acc[0][r], w0, xb + r * K + 2 * d);
            dpbf16_bcast(&acc[1][r], w1, xb + r * K + 2 * d);
        }
    }
    const __m512 s0 = _mm512_maskz_loadu_ps(live0, sc), s1 = _mm512_maskz_loadu_ps(live1, sc + BP);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * N, live0, _mm512_mul_ps(acc[0][r], s0));
        _mm512_mask_storeu_ps(out + r * N + BP, live1, _mm512_mul_ps(acc[1][r], s1));
    }
}

typedef struct {
    const uint16_t *xb, *w;
    const float *scale;
    float *out;
    int64_t M, N, K, chunk, *next;
    int32_t *scratch;  /* this thread's two panels */
} bf16_job;

__attribute__((target(TB))) static void *bf16_range(void *arg) {
    const bf16_job *j = (const bf16_job *)arg;
    const int64_t K = j->K, N = j->N;
    int32_t *P0 = j->scratch, *P1 = j->scratch + K / 2 * BP;
    int64_t c0, c1;
    while (take_chunk(j->next, j->chunk, N, &c0, &c1)) {
        for (int64_t n0 = c0; n0 < c1; n0 += 2 * BP) {
            const int live0 = c1 - n0 < BP ? (int)(c1 - n0) : BP;
            const int live1 = c1 - n0 - BP < BP ? (int)(c1 - n0 - BP) : BP;
            bf16_panel_build(j->w, K, N, n0, live0, P0);
            if (live1 > 0) bf16_panel_build(j->w, K, N, n0 + BP, live1, P1);
            const __mmask16 m0 = (__mmask16)((1u << live0) - 1), m1 = live1 > 0 ? (__mmask16)((1u << live1) - 1) : 0;
            const int32_t *Q1 = live1 > 0 ? P1 : P0;  /* no second panel: the first again, nothing stored */
            for (int64_t r0 = 0; r0 < j->M; r0 += BR) {
                const int R = j->M - r0 < BR ? (int)(j->M - r0) : BR;
                const uint16_t *xb = j->xb + r0 * K;
                const float *sc = j->scale + n0;
                float *out = j->out + r0 * N + n0;
                switch (R) {
                    case 1: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 1); break;
                    case 2: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 2); break;
                    case 3: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 3); break;
                    case 4: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 4); break;
                    case 5: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 5); break;
                    case 6: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 6); break;
                    case 7: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 7); break;
                    case 8: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 8); break;
                    case 9: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 9); break;
                    case 10: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 10); break;
                    case 11: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, 11); break;
                    default: bf16_rows(P0, Q1, xb, K, sc, out, N, m0, m1, BR); break;
                }
            }
        }
    }
    return NULL;
}

/* x (M, K) float32 rounded to bf16 (nearest even) into xb */
__attribute__((target(TB))) static void bf16_round_rows(const float *x, int64_t n, uint16_t *xb) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(xb + i, (__m512i)b);
    }
    for (; i < n; i++) xb[i] = f32_to_bf16(x[i]);
}

LMF_HIDDEN int bf16_panel_cpu(void) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
#else
LMF_HIDDEN int bf16_panel_cpu(void) {
    return 0;
}
#endif

int lmf_gemm_bf16(const float *x, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                  int64_t threads) {
#ifdef LMF_BF16_PANEL
    if (!lmf_dispatch.bf16_panel || M < 1 || N < 1 || K < 32 || K % 32 || scale == NULL) return -1;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t pairs = (N + 2 * BP - 1) / (2 * BP), per = pairs / (4 * threads);
    const int64_t chunk = 2 * BP * (per > 1 ? per : 1);  /* whole pairs of panels, about four chunks a thread */
    if (threads > (N + chunk - 1) / chunk) threads = (N + chunk - 1) / chunk;
    const size_t panels = (size_t)K * BP * 4;  /* two panels: K / 2 pairs x 16 lanes x 4 bytes each */
    uint16_t *xb = (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
    int32_t *scratch = (int32_t *)aligned_alloc(64, panels * (size_t)threads);
    if (xb == NULL || scratch == NULL) {
        free(xb);
        free(scratch);
        return -1;
    }
    bf16_round_rows(x, M * K, xb);
    int64_t next = 0;
    bf16_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (bf16_job){xb, w, scale, out, M, N, K, chunk, &next, (int32_t *)((char *)scratch + panels * t)};
    run_jobs(bf16_range, jobs, sizeof jobs[0], threads);
    free(scratch);
    free(xb);
    return 0;
#else
    (void)x, (void)w, (void)scale, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -1;
#endif
}
