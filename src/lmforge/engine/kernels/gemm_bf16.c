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
 * and one `vdpbf16ps` multiplies it by one activation pair broadcast to the 16 lanes (once a step into a register,
 * shared by both panels): 16 outputs, no horizontal sum, each panel vector used by 12 activation rows while it sits
 * in a register (2 panels x 12 rows = 24 float32 accumulators). The activations are rounded to bfloat16 once a call
 * (nearest even, as torch's `.to(torch.bfloat16)`), as a bf16 GEMM's are, and interleaved in blocks of 12 rows (a
 * step's 12 pairs side by side: one pointer walks them), by both threads; products and sums in float32. The work
 * is a pair of panels times a slice of the rows, so that the last units of a call are short.
 * out[m, n] = scale[n] * sum_k w[n, k] x[m, k] (scale: one a row, 1 for a dense checkpoint).
 *
 * `lmf_qmm_f32` (bits 16, per-row scales) runs it from `lmf_bf16_panel_rows()` rows on a CPU with AVX512-BF16
 * (dispatch.c); elsewhere `lmf_gemm_bf16` returns -1 and the caller keeps its other paths.
 *
 * Stored panels (layout LMF_PANELS16, `QmmLinear.store_panels`): the weight kept in memory as those panels, panel p
 * (rows 16p .. 16p + 15) at w + 16 p K, so no call builds them. A 16-row decode batch of the 300M spent as long
 * building panels (30% of its samples) as multiplying them (37%): each weight was transposed once per call for
 * only 16 rows. Fewer rows than the panel GEMM's threshold run `bf16_lanes_f32` over the same panels: float32
 * activations as they are, each 64-byte word split into its 16 even-k and 16 odd-k weights (a shift and a mask:
 * exact), two FMAs a word, 16 outputs at once and no horizontal sum.
 */
#include "common.h"

#ifdef LMF_BF16_DOTS
#define LMF_BF16_PANEL 1
#define TB LMF_TARGET_BF16
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

/* R activation rows against panels P0, P1, the rows' pairs interleaved (`xp`: step d's pair of row r at xp[d R + r],
 * one pointer for all rows): out[r, 0..32) masked by live0 / live1, times the scales. `ahead` (stored panels; else
 * NULL): lines of the next pair of panels fetched into L2, one a step (`two`: two, the line K / 2 steps on as well),
 * so that memory streams them while these are multiplied rather than when they are reached. */
__attribute__((target(TB), always_inline)) static inline void bf16_rows(const int32_t *P0, const int32_t *P1,
                                                                        const int32_t *xp, int64_t K2,
                                                                        const float *sc, float *out, int64_t N,
                                                                        __mmask16 live0, __mmask16 live1,
                                                                        const int32_t *ahead, int two, const int R) {
    __m512 acc[2][BR];
    LMF_UNROLL for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < K2; d++) {
        if (ahead != NULL) {
            _mm_prefetch((const char *)(ahead + d * BP), _MM_HINT_T1);
            if (two) _mm_prefetch((const char *)(ahead + (K2 + d) * BP), _MM_HINT_T1);
        }
        const __m512i w0 = _mm512_loadu_si512(P0 + d * BP), w1 = _mm512_loadu_si512(P1 + d * BP);
        /* each row's pair broadcast once into a register for both panels: as the instructions' memory operand it was
         * loaded twice, 26 loads a step for 24 products (Zen 5, which issues two of these a cycle: 512 rows of the
         * 300M's 96 matmuls 332 / 358 / 367 -> 322 / 331 / 333 ms in turns; a bf16 prefill +3%) */
        LMF_UNROLL for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)bcast32(xp + d * R + r);
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], (__m512bh)w0, xv);
            acc[1][r] = _mm512_dpbf16_ps(acc[1][r], (__m512bh)w1, xv);
        }
    }
    const __m512 s0 = _mm512_maskz_loadu_ps(live0, sc), s1 = _mm512_maskz_loadu_ps(live1, sc + BP);
    LMF_UNROLL for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * N, live0, _mm512_mul_ps(acc[0][r], s0));
        _mm512_mask_storeu_ps(out + r * N + BP, live1, _mm512_mul_ps(acc[1][r], s1));
    }
}

typedef struct {
    const int32_t *xp;
    const uint16_t *w;
    const float *scale;
    float *out;
    int64_t M, N, K, threads, *next;
    int64_t br;             /* rows a pass (<= BR), the rows' blocks in xp */
    int64_t slice;          /* the rows in runs of `slice` rows (a multiple of br; the last the rest) */
    int32_t *scratch;       /* this thread's two panels (NULL: the weight is stored as panels) */
} bf16_job;

/* Panel n0 / 16 of a weight stored as panels (LMF_PANELS16): K / 2 words of 16 rows */
static inline const int32_t *stored_panel(const uint16_t *w, int64_t K, int64_t n0) {
    return (const int32_t *)(w + n0 * K);
}

/* Rows [m0, m1) (m0 a multiple of br) against panels Q0, Q1 (output columns n0 ..), in passes of br rows. `next`: the
 * pair after, fetched a line a step over the first two passes (one pass: two lines a step). Until 2026-12-07 the first
 * pass fetched both panels and a 16-row call ran passes of 12 and 4 rows; in even passes (8 and 8) with the fetches
 * spread, the 300M's 96 matmuls (566 MB of bf16 weights, memory-bound below ~16 rows) in turns, best of 6: 16 rows
 * 17.4 -> 15.4 ms, 13 rows 16.6 -> 14.6, 20 rows 18.9 -> 17.9, 32 rows 26.4 -> 25.4; 4, 8 and 512 rows alike (Zen 5,
 * 2 threads, ~44 GB/s read by torch.sum that hour). */
__attribute__((target(TB))) static void bf16_slice(const bf16_job *j, const int32_t *Q0, const int32_t *Q1,
                                                   const int32_t *next, int64_t n0, int64_t m0, int64_t m1,
                                                   __mmask16 m0k, __mmask16 m1k) {
    const int64_t K2 = j->K / 2, N = j->N;
    const int64_t br = j->br, passes = (m1 - m0 + br - 1) / br;
    for (int64_t r0 = m0; r0 < m1; r0 += br) {
        const int R = m1 - r0 < br ? (int)(m1 - r0) : (int)br;
        const int64_t i = (r0 - m0) / br;
        const int32_t *pf = next != NULL && i < 2 ? next + i * K2 * BP : NULL;  /* pass i: panel i of the next pair */
        const int two = passes == 1;
        const int32_t *xp = j->xp + r0 * K2;
        const float *sc = j->scale + n0;
        float *out = j->out + r0 * N + n0;
        switch (R) {
            case 1: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 1); break;
            case 2: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 2); break;
            case 3: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 3); break;
            case 4: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 4); break;
            case 5: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 5); break;
            case 6: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 6); break;
            case 7: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 7); break;
            case 8: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 8); break;
            case 9: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 9); break;
            case 10: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 10); break;
            case 11: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, 11); break;
            default: bf16_rows(Q0, Q1, xp, K2, sc, out, N, m0k, m1k, pf, two, BR); break;
        }
    }
}

/* The unit of work at many rows: a pair of panels times a slice of the activation rows, so that the last units of a
 * call are short (a whole pair of the 300M's down projection at 512 rows is ~0.2 ms, which the other thread spent in
 * libgomp's barrier at the end of every call). Slices of >= 96 rows (a pair's panels reused that often from L2), at
 * most 4, each a multiple of `unit` (rows a pass); units pair-major, so that a thread's consecutive units reuse a
 * pair. 96 and 4, 48 and 8, 192 and 2: alike at 512 rows (Zen 5). The A8 panel GEMM split the same way was no faster
 * at 128 or 512 rows (`kernels_ab.py matmuls`; its pairs take half the time), so it keeps whole pairs. */
static int64_t row_slice(int64_t M, int64_t unit) {
    const int64_t S = M / 96 < 1 ? 1 : M / 96 > 4 ? 4 : M / 96;
    return ((M + S - 1) / S + unit - 1) / unit * unit;
}

/* A thread's share of the units (a pair of panels times a slice of the rows: `row_slice`), handed out by take_rows:
 * a contiguous 7/8 of a share, then single units */
__attribute__((target(TB))) static void *bf16_range(void *arg) {
    const bf16_job *j = (const bf16_job *)arg;
    const int64_t K = j->K, N = j->N, S = (j->M + j->slice - 1) / j->slice, units = (N + 2 * BP - 1) / (2 * BP) * S;
    int32_t *P0 = j->scratch, *P1 = j->scratch + K / 2 * BP;
    int64_t built = -1, u0, u1;  /* the pair whose panels P0, P1 hold */
    while (take_rows(j->next, 1, units, j->threads, &u0, &u1))
        for (int64_t u = u0; u < u1; u++) {
            const int64_t n0 = u / S * 2 * BP, m0 = u % S * j->slice, m1 = m0 + j->slice < j->M ? m0 + j->slice : j->M;
            const int live0 = N - n0 < BP ? (int)(N - n0) : BP;
            const int live1 = N - n0 - BP < BP ? (int)(N - n0 - BP) : BP;
            const int32_t *Q0 = P0, *Q1 = P1, *next = NULL;
            if (j->scratch == NULL) {  /* stored: N % 16 == 0, so whole panels */
                Q0 = stored_panel(j->w, K, n0);
                Q1 = live1 > 0 ? stored_panel(j->w, K, n0 + BP) : Q0;
                next = n0 + 2 * BP < N && u % S == 0 ? stored_panel(j->w, K, n0 + 2 * BP) : NULL;
            } else {
                if (built != n0) {
                    bf16_panel_build(j->w, K, N, n0, live0, P0);
                    if (live1 > 0) bf16_panel_build(j->w, K, N, n0 + BP, live1, P1);
                    built = n0;
                }
                if (live1 <= 0) Q1 = P0;  /* no second panel: the first again, nothing stored */
            }
            const __mmask16 k0 = (__mmask16)((1u << live0) - 1), k1 = live1 > 0 ? (__mmask16)((1u << live1) - 1) : 0;
            bf16_slice(j, Q0, Q1, next, n0, m0, m1, k0, k1);
        }
    return NULL;
}

typedef struct {
    const float *x;
    int64_t M, K, br, swiglu;  /* swiglu: x is (M, 2 K) [gate | up] rows, the activations silu(gate) * up */
    int32_t *xp;
} pack_args;

/* Blocks [b0, b1) of br rows of x (M, K) float32, rounded to bf16 (nearest even) and interleaved into xp: block b
 * (rows r0 = b br .., R of them, the last block the rest) at xp + r0 K / 2, step d's pair of row r at d R + r */
__attribute__((target(TB))) static void bf16_pack_rows(const void *args, int64_t b0, int64_t b1) {
    const pack_args *a = (const pack_args *)args;
    const int64_t M = a->M, K = a->K, br = a->br;
    for (int64_t r0 = b0 * br; r0 < b1 * br && r0 < M; r0 += br) {
        const int R = M - r0 < br ? (int)(M - r0) : (int)br;
        const __mmask16 keep = (__mmask16)((1u << R) - 1);
        int32_t *blk = a->xp + r0 * (K / 2);
        for (int64_t c = 0; c < K; c += 32) {  /* 16 pairs of each row: one 16 x 16 transpose, R lanes stored */
            __m512i v[16];
            for (int r = 0; r < 16; r++) {
                const int64_t m = r0 + (r < R ? r : 0);
#ifdef LMF_AVX512
                if (a->swiglu) {
                    const float *g = a->x + m * 2 * K + c, *u = g + K;
                    v[r] = (__m512i)_mm512_cvtne2ps_pbh(
                        _mm512_mul_ps(silu_ps(_mm512_loadu_ps(g + 16)), _mm512_loadu_ps(u + 16)),
                        _mm512_mul_ps(silu_ps(_mm512_loadu_ps(g)), _mm512_loadu_ps(u)));
                    continue;
                }
#endif
                const float *row = a->x + m * K + c;
                v[r] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
            }
            lmf_transpose16(v);
            for (int t = 0; t < 16; t++) _mm512_mask_storeu_epi32(blk + (c / 2 + t) * R, keep, v[t]);
        }
    }
}

/* ---- a few rows of float32 activations on stored panels ------------------------------------------------------ */

#define LR 4  /* activation rows a pass */

/* R activation rows (x, rows K apart) against NP stored panels from P: out[r, 0 .. 16 NP) = scale * the dot
 * products. A word is one weight pair of 16 rows: shifted left 16 bits it is their even-k weights, masked to its
 * high half their odd-k weights, both exact in float32; even and odd k sum apart and are added at the end. */
__attribute__((target(TB), always_inline)) static inline void f32_lanes(const int32_t *P, const float *x, int64_t K,
                                                                        const float *sc, float *out, int64_t N,
                                                                        const int NP, const int R) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 e[2][LR], o[2][LR];
    LMF_UNROLL for (int p = 0; p < NP; p++)
        LMF_UNROLL for (int r = 0; r < R; r++) e[p][r] = o[p][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < K / 2; d++)
        LMF_UNROLL for (int p = 0; p < NP; p++) {
            const int32_t *at = P + (p * K / 2 + d) * BP;
            _mm_prefetch((const char *)(at + 8 * BP), _MM_HINT_T0);  /* 512 bytes ahead, as a8_lanes_avx512vnni */
            const __m512i v = _mm512_loadu_si512(at);
            const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            LMF_UNROLL for (int r = 0; r < R; r++) {
                e[p][r] = _mm512_fmadd_ps(we, _mm512_set1_ps(x[r * K + 2 * d]), e[p][r]);
                o[p][r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[r * K + 2 * d + 1]), o[p][r]);
            }
        }
    LMF_UNROLL for (int p = 0; p < NP; p++) {
        const __m512 s = _mm512_loadu_ps(sc + p * BP);
        LMF_UNROLL for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N + p * BP, _mm512_mul_ps(_mm512_add_ps(e[p][r], o[p][r]), s));
    }
}

typedef struct {
    const float *x;
    const uint16_t *w;
    const float *scale;
    float *out;
    int64_t M, N, K, threads, *next;
} lanes_job;

/* A thread's share: pairs of panels (`take_rows` over pairs: one long run each, then the rest in single pairs) */
__attribute__((target(TB))) static void *lanes_range(void *arg) {
    const lanes_job *j = (const lanes_job *)arg;
    const int64_t K = j->K, N = j->N, pairs = (N + 2 * BP - 1) / (2 * BP);
    int64_t u0, u1;  /* in eighths of a pair, so that take_rows's multiples of 8 are whole pairs, not 8 of them */
    while (take_rows(j->next, 8, 8 * pairs, j->threads, &u0, &u1))
        for (int64_t n0 = u0 / 8 * 2 * BP; n0 < u1 / 8 * 2 * BP && n0 < N; n0 += 2 * BP) {
            const int NP = N - n0 >= 2 * BP ? 2 : 1;
            const int32_t *P = stored_panel(j->w, K, n0);
            for (int64_t m0 = 0; m0 < j->M; m0 += LR) {
                const int R = j->M - m0 < LR ? (int)(j->M - m0) : LR;
                const float *x = j->x + m0 * K;
                float *out = j->out + m0 * N + n0;
                switch (NP * 8 + R) {
                    case 17: f32_lanes(P, x, K, j->scale + n0, out, N, 2, 1); break;
                    case 18: f32_lanes(P, x, K, j->scale + n0, out, N, 2, 2); break;
                    case 19: f32_lanes(P, x, K, j->scale + n0, out, N, 2, 3); break;
                    case 20: f32_lanes(P, x, K, j->scale + n0, out, N, 2, 4); break;
                    case 9: f32_lanes(P, x, K, j->scale + n0, out, N, 1, 1); break;
                    case 10: f32_lanes(P, x, K, j->scale + n0, out, N, 1, 2); break;
                    case 11: f32_lanes(P, x, K, j->scale + n0, out, N, 1, 3); break;
                    default: f32_lanes(P, x, K, j->scale + n0, out, N, 1, 4); break;
                }
            }
        }
    return NULL;
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

/* Fewer rows on a weight stored as panels (`lmf_qmm_f32` hands them here): -1 where this CPU or build lacks the
 * body or the shape is not a stored one (N % 16, K % 32). */
LMF_HIDDEN int bf16_lanes_f32(const float *x, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N,
                              int64_t K, int64_t threads) {
#ifdef LMF_BF16_PANEL
    if (!lmf_dispatch.bf16_panel || M < 1 || N < 1 || N % BP || K < 32 || K % 32 || scale == NULL) return -1;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t pairs = (N + 2 * BP - 1) / (2 * BP);
    if (threads > pairs) threads = pairs;
    int64_t next = 0;
    lanes_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (lanes_job){x, w, scale, out, M, N, K, threads, &next};
    run_jobs(lanes_range, jobs, sizeof jobs[0], threads);
    return 0;
#else
    (void)x, (void)w, (void)scale, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -1;
#endif
}

/* lmf_gemm_bf16 (swiglu 0) and lmf_gemm_bf16_swiglu (1: x is (M, 2 K) gate_up rows) */
static int gemm_bf16(const float *x, int64_t swiglu, const uint16_t *w, const float *scale, float *out, int64_t M,
                     int64_t N, int64_t K, int64_t threads, int64_t layout) {
#ifdef LMF_BF16_PANEL
    if (!lmf_dispatch.bf16_panel || M < 1 || N < 1 || K < 32 || K % 32 || scale == NULL) return -1;
#ifndef LMF_AVX512
    if (swiglu) return -1;  /* silu_ps is AVX-512's */
#endif
    if (layout != LMF_ROWS && (layout != LMF_PANELS16 || N % BP)) return -1;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t pairs = (N + 2 * BP - 1) / (2 * BP);
    if (threads > pairs) threads = pairs;
    const size_t panels = layout == LMF_ROWS ? (size_t)K * BP * 4 : 0;  /* two panels: K / 2 pairs x 16 lanes x 4 bytes */
    int32_t *xp = (int32_t *)malloc((size_t)(M * K / 2) * sizeof(int32_t));
    int32_t *scratch = panels ? (int32_t *)aligned_alloc(64, panels * (size_t)threads) : NULL;
    if (xp == NULL || (panels && scratch == NULL)) {
        free(xp);
        free(scratch);
        return -1;
    }
    /* passes of even size: 16 rows as 8 and 8, not 12 and 4 */
    const int64_t br = (M + (M + BR - 1) / BR - 1) / ((M + BR - 1) / BR), slice = row_slice(M, br);
    const pack_args pa = {x, M, K, br, swiglu, xp};
    split_rows(bf16_pack_rows, &pa, (M + br - 1) / br, 4, threads);
    int64_t next = 0;
    bf16_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (bf16_job){xp, w, scale, out, M, N, K, threads, &next, br, slice,
                             scratch ? (int32_t *)((char *)scratch + panels * t) : NULL};
    run_jobs(bf16_range, jobs, sizeof jobs[0], threads);
    free(scratch);
    free(xp);
    return 0;
#else
    (void)x, (void)swiglu, (void)w, (void)scale, (void)out, (void)M, (void)N, (void)K, (void)threads, (void)layout;
    return -1;
#endif
}

/* `layout`: LMF_ROWS (the weight (N, K) as it is; panels built a call) or LMF_PANELS16 (stored as panels). */
int lmf_gemm_bf16(const float *x, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                  int64_t threads, int64_t layout) {
    return gemm_bf16(x, 0, w, scale, out, M, N, K, threads, layout);
}

int lmf_gemm_bf16_swiglu(const float *gu, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N,
                         int64_t K, int64_t threads, int64_t layout) {
    return gemm_bf16(gu, 1, w, scale, out, M, N, K, threads, layout);
}
