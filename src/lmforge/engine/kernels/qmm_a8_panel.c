/* The int8-activation matmul for many rows (prefill chunks, big decode batches): a panel GEMM on AVX-512 VNNI.
 *
 * The row bodies (qmm_a8_avx256.c, qmm_a8_avx512.c) read each weight row once and take its dot product with every
 * activation row, a horizontal sum a row and weight row; fine for a decode step's few rows, but each weight code is
 * then unpacked once per 4 activation rows, and 16-512 rows pay that again and again. Here the weight is taken 16
 * rows at a time (a panel), unpacked once into bytes c + 128 interleaved four k a lane (llama.cpp's 8- and
 * 16-row repacks of Q4_0 are the precedent, done here per call and per panel, in L1, so nothing is stored twice):
 *
 *     P[k / 4][i][k % 4] = 128 + code of weight row n0 + i at input k      (a 64-byte vector: 4 k of 16 rows)
 *
 * and one `vpdpbusd` multiplies it by 4 inputs of one activation row broadcast to the 16 lanes (in the panel GEMM
 * once a step into a register for both panels; in the lanes body the EVEX `{1to16}` memory operand): 16 outputs at
 * once, no horizontal sum, each panel vector used by R activation rows while it sits in a register. dpbusd
 * multiplies unsigned by signed bytes: the panel holds c + 128 (unsigned) and the activations stay signed q, so it
 * accumulates dot(q, c) + 128 * sum(q); each group's accumulator starts at
 * -128 * sum(q) of its activation row (`qsum`, made once a call by `lmf_qmm_s8`), which leaves the exact integer
 * dot product at the group's end (|dot| < 2^31 for K < 65536). Then, per group g and row m,
 *     out[m, n0..n0+15] += float(dot) * (scale[n, g] * xs[m, a(g)])  (+ zero[n, g] * qs[m, g] with zero offsets)
 * in float32, the same terms as the other bodies, summed in group order per output (the row bodies sum lanes in
 * another order: results agree to float32 rounding, integer dot products exactly).
 *
 * Every weight form the A8 kernel takes runs here: int8 (per channel, groups of 16 or more), int4, 5- and 6-bit
 * codes, with float32, float16 or two-level scales and zero offsets, since a panel is built from each row's
 * signed codes and float32 scales (`row_scales`). Activation order: int4 rows in the quantizer's nibble order
 * (each block of 32: 16 even k, then 16 odd k; `a8_unpack4`), every other width in k order.
 *
 * `lmf_qmm_s8` runs it from `lmf_a8_panel_rows()` rows on a CPU with AVX-512 VNNI (dispatch.c).
 */
#include "common.h"

#ifdef LMF_X86

#define TP "avx512f,avx512bw,avx512vl,avx512vnni,fma"
#define PANEL A8_PANEL  /* weight rows a panel: one 512-bit vector of int32 lanes (16) */
#define PANEL_R 8     /* activation rows a pass over one panel */
#define PANEL_R2 6    /* activation rows a pass over two panels side by side (2 x 6 accumulators, 2 x 6 sums) */

/* Weight row n's codes as signed int8, in the activations' order, into out (K bytes). */
static void panel_row_codes(const a8_job *j, int64_t n, int8_t *out) {
    const int64_t K = j->K, bits = j->bits, row_bytes = row_bytes_of(bits, K);
    const uint8_t *w = (const uint8_t *)j->w + n * row_bytes;
    if (bits == 8) {
        memcpy(out, w, (size_t)K);
    } else if (bits == 4) {  /* stored code + 8, two a byte; each block: even k, then odd k */
        for (int64_t b = 0; b < K / 32; b++)
            for (int i = 0; i < 16; i++) {
                out[b * 32 + i] = (int8_t)((w[b * 16 + i] & 0x0F) - 8);
                out[b * 32 + 16 + i] = (int8_t)((w[b * 16 + i] >> 4) - 8);
            }
    } else {  /* 5 / 6 bits: u - off, k order */
        const int off = code_offset(bits);
        for (int64_t k = 0; k < K; k++) out[k] = (int8_t)(lohi_code(w, bits, K, k) - off);
    }
}

/* Word pw of 16 rows (`r`: lane i holds row i's 4 bytes) into the panel P as the dot product's unsigned operand,
 * code + 128: int8, 4 codes; int4, its low nibbles (4 codes of block pw / 4's first half) and its high nibbles (the
 * same 4 of its second half), each nibble - 8 + 128. */
__attribute__((target(TP), always_inline)) static inline void panel_word(int32_t *P, int64_t pw, __m512i r,
                                                                         const int bits) {
    if (bits == 8) {
        _mm512_storeu_si512(P + pw * PANEL, _mm512_xor_si512(r, _mm512_set1_epi8((char)0x80)));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F), k78 = _mm512_set1_epi8(0x78);
    const int64_t at = (pw / 4) * 8 + pw % 4;
    _mm512_storeu_si512(P + at * PANEL, _mm512_add_epi8(_mm512_and_si512(r, low), k78));
    _mm512_storeu_si512(P + (at + 4) * PANEL, _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi32(r, 4), low), k78));
}

/* A panel's 16 values of group g (scales `v`, or zeros; a two-level form's super-blocks `vd`) from weights stored as
 * panels (LMF_PANELS16), as float32. */
__attribute__((target(TP), always_inline)) static inline __m512 stored16(const lmf_scales *sc, const void *v,
                                                                         const void *vd, int64_t p, int64_t G, int64_t g) {
    if (sc->fmt == LMF_SCALES_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + (p * G + g) * PANEL)));
    if (sc->fmt == LMF_SCALES_SUPER) {  /* int8 a group times its super-block's float16 (stored as panels too): fl(d * q),
                                         * as `expand_groups` makes it for the rows layout */
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)v + (p * G + g) * PANEL))));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(
            (const __m256i *)((const uint16_t *)vd + (p * (G / sc->per) + g / sc->per) * PANEL)));
        return _mm512_mul_ps(d, q);
    }
    return _mm512_loadu_ps((const float *)v + (p * G + g) * PANEL);
}

__attribute__((target(TP), always_inline)) static inline __m512 stored_scales16(const lmf_scales *sc, int64_t p,
                                                                                int64_t G, int64_t g) {
    return stored16(sc, sc->s, sc->sd, p, G, g);
}

/* Their zero offsets in the kernels' terms (a code read as nibble - 8: zero + 8 * scale, as `row_scales` makes them),
 * from the stored panels' zeros and the group's scales sv. */
__attribute__((target(TP), always_inline)) static inline __m512 stored_zeros16(const lmf_scales *sc, int64_t p,
                                                                               int64_t G, int64_t g, __m512 sv) {
    return _mm512_fmadd_ps(_mm512_set1_ps(8.0f), sv, stored16(sc, sc->z, sc->zd, p, G, g));
}

/* The panel of rows [n0, n0 + 16) from weights stored as panels (LMF_PANELS16): the interleave is the stored
 * one, so a word of 16 rows is one load (no transpose), then its nibbles as panel_build's. */
__attribute__((target(TP))) static void panel_build16(const a8_job *j, int64_t n0, int32_t *P, float *S, float *Z) {
    const int64_t K = j->K, G = j->G, p = n0 / PANEL;
    const int64_t words = j->bits == 8 ? K / 4 : K / 8;
    const uint8_t *W = (const uint8_t *)j->w + p * words * 4 * PANEL;
    if (j->bits == 8)
        for (int64_t pw = 0; pw < words; pw++) panel_word(P, pw, _mm512_loadu_si512(W + pw * 64), 8);
    else
        for (int64_t pw = 0; pw < words; pw++) panel_word(P, pw, _mm512_loadu_si512(W + pw * 64), 4);
    for (int64_t g = 0; g < G; g++) {
        const __m512 sv = stored_scales16(j->sc, p, G, g);
        _mm512_storeu_ps(S + g * PANEL, sv);
        if (Z != NULL) _mm512_storeu_ps(Z + g * PANEL, stored_zeros16(j->sc, p, G, g, sv));
    }
}

/* The panel of weight rows [n0, n0 + live): codes P (K / 4 vectors of 16 words: c + 128 as bytes, the dot
 * product's unsigned operand), and per group the scales S and the zero offsets Z (when the weight has them), G
 * vectors each. Lanes past `live` repeat the last row (their outputs are never stored). int8 and int4 rows: 16
 * rows' words a step through a 16 x 16 transpose (an int4 word's low nibbles are 4 codes of its block's first
 * half, its high nibbles the same 4 of the second half: the activations' nibble order); 5- and 6-bit rows
 * code by code. */
__attribute__((target(TP))) static void panel_build(const a8_job *j, int64_t n0, int live, int8_t *row, int32_t *P,
                                                    float *S, float *Z, float *ws_buf, float *wz_buf) {
    const int64_t K = j->K, G = j->G, bits = j->bits, row_bytes = row_bytes_of(bits, K);
    if (j->sc != NULL && j->sc->layout == LMF_PANELS16) {  /* live is 16: N % 16 == 0 there */
        panel_build16(j, n0, P, S, Z);
        return;
    }
    if (bits == 8 || bits == 4) {
        const uint8_t *rows[PANEL];
        for (int i = 0; i < PANEL; i++)
            rows[i] = (const uint8_t *)j->w + (n0 + (i < live ? i : live - 1)) * row_bytes;
        for (int64_t c = 0; c < row_bytes; c += 64) {  /* row_bytes: a multiple of 16 */
            const int words = row_bytes - c >= 64 ? 16 : (int)((row_bytes - c) / 4);
            const __mmask16 m = (__mmask16)((1u << words) - 1);
            __m512i r[16];
            /* the next pair of panels' same bytes into L2 while this pair computes: the hardware prefetchers do not
             * follow 16 short interleaved row streams, and these loads waited on memory for ~20% of the body's time
             * (perf, Zen 4, a Q4_0 batch of 16) */
            if (n0 + 2 * PANEL < j->N)
                for (int i = 0; i < PANEL; i++)
                    _mm_prefetch((const char *)(rows[i] + 2 * PANEL * row_bytes + c), _MM_HINT_T1);
            for (int i = 0; i < PANEL; i++) r[i] = _mm512_maskz_loadu_epi32(m, rows[i] + c);
            lmf_transpose16(r);
            for (int t = 0; t < words; t++) {  /* the rows' word c / 4 + t */
                if (bits == 8) panel_word(P, c / 4 + t, r[t], 8);
                else panel_word(P, c / 4 + t, r[t], 4);
            }
        }
    } else {
        for (int i = 0; i < PANEL; i++) {
            panel_row_codes(j, n0 + (i < live ? i : live - 1), row);
            const uint32_t *rw = (const uint32_t *)row;
            for (int64_t w = 0; w < K / 4; w++) P[w * PANEL + i] = (int32_t)(rw[w] ^ 0x80808080u);
        }
    }
    for (int i = 0; i < PANEL; i++) {
        const float *ws, *wz;
        row_scales(j->sc, j->ws, n0 + (i < live ? i : live - 1), G, bits, ws_buf, wz_buf, &ws, &wz);
        for (int64_t g = 0; g < G; g++) {
            S[g * PANEL + i] = ws[g];
            if (Z != NULL) Z[g * PANEL + i] = wz != NULL ? wz[g] : 0.0f;
        }
    }
}

/* acc += dpbusd(w, the 4 signed bytes at p broadcast to every lane): the broadcast as the instruction's `{1to16}`
 * memory operand, one instruction (GCC 12 loads it into a register first: one more instruction a dot product) */
__attribute__((target(TP), always_inline)) static inline void dpbusd_bcast(__m512i *acc, const __m512i w,
                                                                           const int8_t *p) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(w), "m"(*(const int32_t *)p));
#else
    int32_t a;
    memcpy(&a, p, 4);
    *acc = _mm512_dpbusd_epi32(*acc, w, _mm512_set1_epi32(a));
#endif
}

/* R activation rows (q + m0 * K ...) against NP panels side by side (16 NP weight rows): out[m0 + r, n0 ..). Each
 * step loads NP panel vectors and R broadcasts for NP * R dot products. QD: the group's 4-byte steps (gs / 4) as a
 * compile-time constant, or 0 to read them from the job. With it the group's loop unrolls whole and its addresses
 * are constant offsets; a group of 32 is only 8 steps, and the loop's own counting and addressing had cost ~20% of a
 * prefill's matmul time: `kernels_ab.py panels --rows 512` (Zen 5, 96 matmuls of the 300M, 2 threads), int8 292 / 300
 * -> 243 / 242 ms, int4 305 / 297 -> 246 / 235, and at 64 rows int4 44 / 47 -> 40 / 36; the same bits. */
__attribute__((target(TP), always_inline)) static inline void panel_rows(
        const a8_job *j, int32_t *const *P, float *const *S, float *const *Z, const int8_t *q, const float *xs,
        const float *qs, const int32_t *qsum, float *out, const __mmask16 *live, const int NP, const int R, const int QD) {
    const int64_t K = j->K, G = j->G, gs = QD ? 4 * QD : j->gs, A = j->A, ab = j->ab, quads = QD ? QD : gs / 4;
    __m512 f[2][PANEL_R];
    LMF_UNROLL for (int p = 0; p < NP; p++)
        LMF_UNROLL for (int r = 0; r < R; r++) f[p][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i acc[2][PANEL_R];
        LMF_UNROLL for (int r = 0; r < R; r++) {
            const __m512i c = _mm512_set1_epi32(-128 * qsum[r * G + g]);
            LMF_UNROLL for (int p = 0; p < NP; p++) acc[p][r] = c;
        }
        const int8_t *qg = q + g * gs;
        for (int64_t d = 0; d < quads; d++) {
            __m512i wv[2];
            LMF_UNROLL for (int p = 0; p < NP; p++) wv[p] = _mm512_loadu_si512(P[p] + (g * quads + d) * PANEL);
            LMF_UNROLL for (int r = 0; r < R; r++) {
                const __m512i xv = bcast32(qg + r * K + 4 * d);  /* once for both panels */
                LMF_UNROLL for (int p = 0; p < NP; p++) acc[p][r] = _mm512_dpbusd_epi32(acc[p][r], wv[p], xv);
            }
        }
        const int64_t a = g * gs / ab;
        LMF_UNROLL for (int p = 0; p < NP; p++) {
            const __m512 sv = _mm512_loadu_ps(S[p] + g * PANEL);
            LMF_UNROLL for (int r = 0; r < R; r++)
                f[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][r]), _mm512_mul_ps(sv, _mm512_set1_ps(xs[r * A + a])),
                                          f[p][r]);
            if (Z[p] != NULL) {
                const __m512 zv = _mm512_loadu_ps(Z[p] + g * PANEL);
                LMF_UNROLL for (int r = 0; r < R; r++) f[p][r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(qs[r * G + g]), f[p][r]);
            }
        }
    }
    LMF_UNROLL for (int p = 0; p < NP; p++)
        LMF_UNROLL for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * j->N + p * PANEL, live[p], f[p][r]);
}

#define PANEL_ROWS_CASES(NP, RMAX) do {                                                                        \
        switch (R) {                                                                                           \
            case 1: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, 1, 0); break;                             \
            case 2: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, 2, 0); break;                             \
            case 3: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, 3, 0); break;                             \
            case 4: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, 4, 0); break;                             \
            case 5: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, 5, 0); break;                             \
            default: panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, NP, RMAX, 0); break;                         \
        }                                                                                                      \
    } while (0)

/* Weight rows [j->n0, j->n1) two panels (32 rows) at a time, a last odd panel alone, for all j->M activation rows
 * (signed q, and qsum). */
__attribute__((target(TP))) LMF_HIDDEN void a8_panel_avx512vnni(const a8_job *j) {
    const int64_t K = j->K, G = j->G, M = j->M;
    const int zeros = j->qs != NULL && j->sc != NULL && j->sc->z != NULL;
    /* j->scratch (`a8_panel_scratch`): per panel P (K bytes a row of it), S and Z (G floats each a row); then one
     * code row, two scale rows */
    const size_t per = (size_t)K * PANEL + (size_t)G * PANEL * 8;
    char *buf = j->scratch;
    int32_t *P[2];
    float *S[2], *Z[2];
    for (int p = 0; p < 2; p++) {
        P[p] = (int32_t *)(buf + p * per);
        S[p] = (float *)(buf + p * per + K * PANEL);
        Z[p] = zeros ? S[p] + G * PANEL : NULL;
    }
    int8_t *row = (int8_t *)(buf + 2 * per);
    float *ws_buf = (float *)(row + K), *wz_buf = ws_buf + LMF_MAX_G;
    for (int64_t n0 = j->n0; n0 < j->n1; n0 += 2 * PANEL) {
        __mmask16 mask[2] = {0, 0};
        int NP = 0;
        for (int p = 0; p < 2 && n0 + p * PANEL < j->n1; p++, NP++) {
            const int64_t left = j->n1 - (n0 + p * PANEL);
            const int live = left < PANEL ? (int)left : PANEL;
            mask[p] = (__mmask16)((1u << live) - 1);
            panel_build(j, n0 + p * PANEL, live, row, P[p], S[p], Z[p], ws_buf, wz_buf);
        }
        const int rmax = NP == 2 ? PANEL_R2 : PANEL_R;
        for (int64_t m0 = 0; m0 < M; m0 += rmax) {
            const int R = M - m0 < rmax ? (int)(M - m0) : rmax;
            const int8_t *am = j->q + m0 * K;
            const float *xm = j->xs + m0 * j->A, *qm = zeros ? j->qs + m0 * G : NULL;
            const int32_t *cm = j->qsum + m0 * G;
            float *om = j->out + m0 * j->N + n0;
            /* the full pass over two panels (nearly all of a prefill's work) with the group's length a compile-time
             * constant for the common groups, so that its dot-product loop unrolls whole (`panel_rows`) */
            if (NP == 2 && R == PANEL_R2 && j->gs == 32) panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, 2, PANEL_R2, 8);
            else if (NP == 2 && R == PANEL_R2 && j->gs == 128)
                panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, 2, PANEL_R2, 32);
            else if (NP == 2) PANEL_ROWS_CASES(2, PANEL_R2);
            else if (R <= 5) PANEL_ROWS_CASES(1, 5);
            else if (R == 6) panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, 1, 6, 0);
            else if (R == 7) panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, 1, 7, 0);
            else panel_rows(j, P, S, Z, am, xm, qm, cm, om, mask, 1, PANEL_R, 0);
        }
    }
}

/* ---- a few rows on int4 weights stored as panels (LMF_PANELS16) --------------------------------------------
 *
 * A decode step's 1-5 rows. The row bodies (qmm_a8_avx256.c) spend ~0.4 instructions a weight byte on a row's
 * nibbles, pairs and scales and its horizontal sums; one thread reads ~11 GB/s that way, two do not fill this
 * VM's ~28 GB/s. On panels stored in memory (llama.cpp's repacked Q4_0 GEMV is the precedent) one load is a word
 * of 16 rows: its low nibbles (codes c + 8 of 4 even k) and its high nibbles shifted down (c + 8, 4 odd k) each
 * take one `vpdpbusd` against 4 activation bytes broadcast, 16 outputs at once, no horizontal sum: ~0.11 512-bit
 * instructions a byte. Per group and row both go into one accumulator that starts at -8 * sum(q), so it ends at
 * dot(q, c) exactly. (Until 2026-12-06 the high nibbles stayed in place, 16 (c + 8), in a second accumulator
 * divided by 16 at the group's end: one shift a word of 16 rows now instead of a shift and an add a group, row and
 * panel, and half the accumulators; the same integers, so the same bits.) Then
 *     out[m, n] += float(dot) * (scale[n, g] * xs[m, a(g)])    (+ (zero + 8 scale)[n, g] * qs[m, g] with zeros)
 * the panel GEMM's terms in its order (group order per output): the same bits as `a8_panel_avx512vnni`. */
__attribute__((target(TP), always_inline)) static inline void lanes_rows(
        const a8_job *j, int64_t p0, const int8_t *q, const float *xs, const int32_t *qsum, const float *qs, float *out,
        const int NP, const int R, const int B8, const int WD) {
    const int64_t K = j->K, G = j->G, A = j->A, ab = j->ab;
    const int64_t words = WD ? WD : B8 ? j->gs / 4 : j->gs / 8, gs = B8 ? 4 * words : 8 * words;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), k80 = _mm512_set1_epi8((char)0x80);
    const int zeros = j->sc->z != NULL;  /* then j->qs: xs * sum(q) a group (int4 only) */
    const uint8_t *W[2];
    __m512 f[2][A8_MAX_R];
    LMF_UNROLL for (int p = 0; p < NP; p++) {
        W[p] = (const uint8_t *)j->w + (p0 + p) * (B8 ? K : K / 2) * PANEL;
        LMF_UNROLL for (int r = 0; r < R; r++) f[p][r] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        __m512i lo[2][A8_MAX_R], hi[2][A8_MAX_R];  /* hi: int8's second chain (int4 sums into lo alone) */
        LMF_UNROLL for (int r = 0; r < R; r++) {
            const __m512i c = _mm512_set1_epi32((B8 ? -128 : -8) * qsum[r * G + g]);
            LMF_UNROLL for (int p = 0; p < NP; p++) lo[p][r] = c, hi[p][r] = _mm512_setzero_si512();
        }
        const int8_t *qg = q + g * gs;
        for (int64_t w = 0; w < words; w++) {
            /* int4: the word's 4 even k, its 4 odd k 16 further; int8: its 4 k, words alternating between two chains */
            const int64_t at = B8 ? 4 * w : (w / 4) * 32 + 4 * (w % 4);
            LMF_UNROLL for (int p = 0; p < NP; p++) {
                /* 4 KB ahead at one row, 2 KB at more. On a Zen 4 (a throwaway A/B, the distance a variable; the 300M's
                 * 96 matmuls, 2 threads) against none: 0.97x the time at 1 row, 0.89x at 4, 0.96x at 16, and 256-4,096
                 * bytes alike; on a Zen 5, whose cores stream faster than the next line arrives at 512 bytes ahead,
                 * `kernels_ab.py panels`, this against 512 in turns: 1 row 6.58 / 6.20 -> 5.49 / 5.90 ms, 2 rows 6.75 /
                 * 6.40 -> 5.79 / 5.95, 4 rows 7.05 / 6.96 -> 6.20 / 6.25, 16 rows 14.84 / 14.51 -> 14.34 / 14.12 (4 KB at
                 * every row count: no better) */
                _mm_prefetch((const char *)(W[p] + (g * words + w) * 64 + (R == 1 ? 4096 : 2048)), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(W[p] + (g * words + w) * 64);
                if (B8) {  /* code + 128, unsigned; the group's -128 * sum(q) takes it back */
                    const __m512i u = _mm512_xor_si512(v, k80);
                    if (w % 2)  /* a branch, not a pointer picked at run time: that kept lo / hi in memory */
                        LMF_UNROLL for (int r = 0; r < R; r++) dpbusd_bcast(&hi[p][r], u, qg + r * K + at);
                    else
                        LMF_UNROLL for (int r = 0; r < R; r++) dpbusd_bcast(&lo[p][r], u, qg + r * K + at);
                    continue;
                }
                const __m512i vl = _mm512_and_si512(v, lo4), vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                LMF_UNROLL for (int r = 0; r < R; r++) {
                    dpbusd_bcast(&lo[p][r], vl, qg + r * K + at);
                    dpbusd_bcast(&lo[p][r], vh, qg + r * K + at + 16);
                }
            }
        }
        const int64_t a = g * gs / ab;
        LMF_UNROLL for (int p = 0; p < NP; p++) {
            const __m512 sv = stored_scales16(j->sc, p0 + p, G, g);
            LMF_UNROLL for (int r = 0; r < R; r++)
                f[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(B8 ? _mm512_add_epi32(lo[p][r], hi[p][r]) : lo[p][r]),
                                          _mm512_mul_ps(sv, _mm512_set1_ps(xs[r * A + a])), f[p][r]);
            if (zeros) {  /* + (zero + 8 * scale) * xs * sum(q), the panel GEMM's term */
                const __m512 zv = stored_zeros16(j->sc, p0 + p, G, g, sv);
                LMF_UNROLL for (int r = 0; r < R; r++) f[p][r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(qs[r * G + g]), f[p][r]);
            }
        }
    }
    LMF_UNROLL for (int p = 0; p < NP; p++)
        LMF_UNROLL for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * j->N + p * PANEL, f[p][r]);
}

#define LANES_CASES(B8, WD) do {                                                                                  \
        switch (NP * 8 + R) {                                                                                  \
            case 17: lanes_rows(j, p0, q, xs, qsum, qs, out, 2, 1, B8, WD); break;                                  \
            case 18: lanes_rows(j, p0, q, xs, qsum, qs, out, 2, 2, B8, WD); break;                                  \
            case 19: lanes_rows(j, p0, q, xs, qsum, qs, out, 2, 3, B8, WD); break;                                  \
            case 20: lanes_rows(j, p0, q, xs, qsum, qs, out, 2, 4, B8, WD); break;                                  \
            case 9: lanes_rows(j, p0, q, xs, qsum, qs, out, 1, 1, B8, WD); break;                                   \
            case 10: lanes_rows(j, p0, q, xs, qsum, qs, out, 1, 2, B8, WD); break;                                  \
            case 11: lanes_rows(j, p0, q, xs, qsum, qs, out, 1, 3, B8, WD); break;                                  \
            default: lanes_rows(j, p0, q, xs, qsum, qs, out, 1, 4, B8, WD); break;                                  \
        }                                                                                                      \
    } while (0)

/* Weight rows [j->n0, j->n1) (whole panels), two panels side by side, for all j->M activation rows (signed q and
 * qsum), 4 at a time. */
__attribute__((target(TP))) LMF_HIDDEN void a8_lanes_avx512vnni(const a8_job *j) {
    const int64_t K = j->K, G = j->G, M = j->M;
    for (int64_t n0 = j->n0; n0 < j->n1; n0 += 2 * PANEL) {
        const int NP = j->n1 - n0 >= 2 * PANEL ? 2 : 1;
        for (int64_t m0 = 0; m0 < M; m0 += A8_MAX_R) {
            const int R = M - m0 < A8_MAX_R ? (int)(M - m0) : A8_MAX_R;
            const int8_t *q = j->q + m0 * K;
            const float *xs = j->xs + m0 * j->A;
            const int32_t *qsum = j->qsum + m0 * G;
            const float *qs = j->qs != NULL ? j->qs + m0 * G : NULL;
            float *out = j->out + m0 * j->N + n0;
            const int64_t p0 = n0 / PANEL;
            /* groups of 32 (GGUF's blocks) with the group's words a compile-time constant, as panel_rows' QD */
            if (j->bits == 8 && j->gs == 32) LANES_CASES(1, 8);
            else if (j->gs == 32) LANES_CASES(0, 4);
            else if (j->bits == 8) LANES_CASES(1, 0);
            else LANES_CASES(0, 0);
        }
    }
}
#endif
