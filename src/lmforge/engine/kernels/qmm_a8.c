/* The int8-activation (A8) matmul: int8 activations x int8 / int4 weights, integer dot products. This file: the
 * activations' quantization, the entry points, their threads, and the portable body; the x86 bodies are
 * qmm_a8_avx256.c (avx2, avx_vnni, avx512_vnni_256) and qmm_a8_avx512.c (avx512_vnni), and which runs is
 * dispatch.c's table.
 *
 * x (M, K) float32 or bfloat16 is quantized dynamically a block of `ab` inputs at a time (`a8_block`: the
 * weight's group, 32 under groups of 16; per channel int8: the whole row, vLLM's dynamic per-token W8A8):
 * s[m, a] = absmax / 127 of the block, q = rint(x / s) (ties to even, as torch.round), |q| <= 127. One scale a
 * token let a single large channel (real models have some: SmolLM2's residual stream) flatten every other
 * input of the row to a few levels; a scale a block of 32 confines it to its block, as llama.cpp's q8_0 / q8_1.
 * For every weight group (int8: the whole row, per channel, or `gs` inputs; int4: `gs` inputs) the products q * code
 * accumulate exactly in int32 (K < 65536: |dot| <= 128 * 127 * K, and the 512-bit body's
 * offset sums (qmm_a8_avx512.c) stay exact), and
 *     out[m, n] = sum_g (scale[n, g] * s[m, a(g)]) * float(dot_g[m, n])    (float32)
 * Weights are the A16 kernel's (`lmf_qmm_f32`): int8 (N, K); int4 two a byte, low nibble = even k,
 * stored code + 8. For int4 the quantized activations keep each block of 32 as (its 16 even k, its 16
 * odd k), so that a block's 16 bytes unpack into low nibbles then high nibbles with no interleave.
 *
 * Bodies, chosen at load from the CPU's flags (dispatch.c), each compiled for its own ISA with
 * `__attribute__((target))` so one build runs on any x86-64 and a test can force each:
 *   4 avx512_vnni_256  _mm256_dpbusd_epi32 (EVEX), the 256-bit body on an AVX-512 VNNI CPU (the default there;
 *                      int8 weights from 8 rows go to the 512-bit body)
 *   3 avx512_vnni  _mm512_dpbusd_epi32, 64 codes an instruction (Ice Lake, Sapphire Rapids, Zen 4)
 *   2 avx_vnni     _mm256_dpbusd_avx_epi32, VEX (Alder Lake and later without AVX-512)
 *   1 avx2         _mm256_maddubs_epi16 + _mm256_madd_epi16 (Haswell, Zen 1-3)
 *   0 portable     plain C (every CPU; the reference the others must equal bit for bit)
 * dpbusd and maddubs multiply unsigned by signed bytes. int8 weights: the weight's magnitude |c| is the
 * unsigned operand and the activation takes the weight's sign (llama.cpp's trick; |q| <= 127 so negating
 * it cannot overflow, and maddubs's int16 pair sums stay within 2 * 128 * 127 = 32512: no saturation).
 * int4 weights on the 256-bit bodies: the stored nibble c + 8 (0..15) is the unsigned operand as it is
 * and q the signed one (pairs within 2 * 15 * 127), so dot(q, c) = dot(q, c + 8) - 8 * sum(q): 8 * sum(q)
 * of each group is computed once a call (`qs`) and taken back, scaled, at a row's end. No abs, sign
 * or subtract a block.
 * Rows: each weight row is read from memory once and used for all M activation rows, 4 at a time.
 *
 * GGUF's block types (`lmforge.quant.gguf_types`) add two forms. Zero offsets `zero` (N, G), w = scale * code + zero
 * (Q4_1, Q5_1, Q4_K, Q5_K): out gains s[m] * sum_g zero[n, g] * sum(q in g), llama.cpp's q8_1 precedent (its
 * blocks carry the activations' sum for the minimum's term); the sums are `qs`, one per group, and the 256-bit
 * int4 bodies fold their own - 8 * scale into the same term. Groups of 16 for int8 codes (Q6_K): a block of 32
 * codes takes two scales, one per half of the dot product's lanes (256-bit bodies; the 512-bit body hands them
 * to the 256-bit one).
 */
#include "common.h"

/* int4 codes of a row as int8, in the order the quantized activations use: for each block of 32,
 * byte i's low nibble (k = 2i) at i, its high nibble (k = 2i + 1) at 16 + i. */
static void a8_unpack4(const uint8_t *w, int64_t K, int8_t *out) {
    for (int64_t b = 0; b < K / 32; b++)
        for (int i = 0; i < 16; i++) {
            out[b * 32 + i] = (int8_t)((w[b * 16 + i] & 0x0F) - 8);
            out[b * 32 + 16 + i] = (int8_t)((w[b * 16 + i] >> 4) - 8);
        }
}

/* Plain C: int4 rows are unpacked once a weight row, then every group is one loop the compiler
 * vectorizes for the target, as for int8. Its float arithmetic is never contracted into fused multiply-adds,
 * so the reference gives the same bits whatever else the file holds (GCC contracts across statements, and
 * whether it does changed with the zero offsets' branch). */
#if defined(__GNUC__) && !defined(__clang__)
#define LMF_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define LMF_NO_CONTRACT
#endif
LMF_NO_CONTRACT LMF_HIDDEN void a8_range_portable(const a8_job *j) {
    const int64_t K = j->K, gs = j->gs, G = K / gs, row_bytes = row_bytes_of(j->bits, K), off = code_offset(j->bits);
    int8_t unpacked[j->bits < 8 ? K : 1];
    float ws_buf[LMF_MAX_G], wz_buf[LMF_MAX_G];
    for (int64_t n = j->n0; n < j->n1; n++) {
        const int8_t *c = (const int8_t *)j->w + n * row_bytes;
        const float *ws, *wz;
        row_scales(j->sc, j->ws, n, G, j->bits, ws_buf, wz_buf, &ws, &wz);
        if (j->bits == 4) {
            a8_unpack4((const uint8_t *)c, K, unpacked);
            c = unpacked;
        } else if (j->bits < 8) {  /* 5 / 6 bits: each code in k order, u - off */
            for (int64_t k = 0; k < K; k++) unpacked[k] = (int8_t)(lohi_code((const uint8_t *)c, j->bits, K, k) - off);
            c = unpacked;
        }
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *q = j->q + m * K;
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t dot = 0, sum = 0;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                    dot += (int32_t)q[k] * c[k];
                    sum += q[k];
                }
                /* a product, then a sum, each rounded (no fused multiply-add: see LMF_NO_CONTRACT) */
                const float xg = j->xs[m * j->A + g * gs / j->ab], sx = ws[g] * xg;
                const float scaled = (float)dot * sx;
                total += scaled;
                if (wz) {  /* zero offsets: + zero * sum(q) */
                    const float shifted = wz[g] * ((float)sum * xg);
                    total += shifted;
                }
            }
            j->out[m * j->N + n] = total;
        }
    }
}

/* int4 activations from the per-block order (each block of 32: its 16 even k, then its 16 odd k) to the pair
 * order of the 256-bit bodies' int4 paths: for each two blocks A, B: A's evens, B's evens, A's odds, B's odds
 * (a pair's 32 weight bytes then split into its low and high nibbles with no shuffle). A block left over at the
 * row's end keeps its order. */
static void pair_order(const int8_t *q, int64_t M, int64_t K, int8_t *out) {
    for (int64_t m = 0; m < M; m++) {
        const int8_t *a = q + m * K;
        int8_t *o = out + m * K;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            memcpy(o + k, a + k, 16);            /* A even */
            memcpy(o + k + 16, a + k + 32, 16);  /* B even */
            memcpy(o + k + 32, a + k + 16, 16);  /* A odd */
            memcpy(o + k + 48, a + k + 48, 16);  /* B odd */
        }
        memcpy(o + k, a + k, (size_t)(K - k));
    }
}

static void *a8_range(void *arg) {  /* a thread's share: chunks of weight rows (`take_rows`), on body j->isa */
    a8_job j = *(const a8_job *)arg;
    const a8_body_fn body = lmf_dispatch.a8_body[j.isa];  /* lmf_qmm_s8 checked that this CPU runs it */
    while (take_rows(j.next, j.chunk, j.N, j.threads, &j.n0, &j.n1)) body(&j);
    return NULL;
}

static void *a8_range_panel(void *arg) {  /* a thread's share of panels: whole pairs of them (take_pairs) */
    a8_job j = *(const a8_job *)arg;
    while (take_pairs(j.next, j.N, j.threads, &j.n0, &j.n1)) lmf_dispatch.a8_panel(&j);
    return NULL;
}

static void *a8_range_lanes(void *arg) {  /* as a8_range_panel, on weights stored as panels (few rows; x86 only) */
#ifdef LMF_X86
    a8_job j = *(const a8_job *)arg;
    while (take_pairs(j.next, j.N, j.threads, &j.n0, &j.n1)) a8_lanes_avx512vnni(&j);
#else
    (void)arg;
#endif
    return NULL;
}

/* absmax / 127 of one row. The absolute values are compared as bit patterns (for finite floats the
 * order is the same), so the loop is an integer max the compiler vectorizes without fast-math. */
static float a8_row_scale(const void *x, int act, int64_t K) {
    uint32_t amax = 0;
    if (act) {
        const uint32_t *u = (const uint32_t *)x;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t a = u[k] & 0x7fffffffu;
            amax = a > amax ? a : amax;
        }
    } else {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t a = ((uint32_t)h[k] << 16) & 0x7fffffffu;
            amax = a > amax ? a : amax;
        }
    }
    union { uint32_t u; float f; } c = {amax};
    return c.f / 127.0f;
}

/* codes = clamp(rint(x / s), -127, 127), ties to even (torch.round); one plain loop per dtype. */
static void a8_row_codes(const void *x, int act, int64_t K, float sc, int8_t *q) {
    if (!(sc > 0.0f)) {  /* an all-zero row */
        for (int64_t k = 0; k < K; k++) q[k] = 0;
        return;
    }
    if (act) {
        const float *f = (const float *)x;
        for (int64_t k = 0; k < K; k++) {
            const float v = nearbyintf(f[k] / sc);
            q[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
    } else {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t k = 0; k < K; k++) {
            const float v = nearbyintf(bf16_to_f32(h[k]) / sc);
            q[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
    }
}

#ifdef LMF_AVX512
/* a8_row_scale and a8_row_codes of one block of n float32 (n % 32 == 0), 16 lanes at a time, and with nibble_order
 * each 32 codes stored as their even k, then their odd k: the same bits (the absolute maximum compared as bit
 * patterns, one IEEE division a value, rounding to nearest even as nearbyintf's default mode, the same clamp).
 * Why: the scalar loops took ~5% of a Q4_0 prefill's samples (512 rows x the 300M's 96 matmuls' inputs). */
static float a8_block_f32_avx512(const float *x, int64_t n, int nibble_order, int8_t *q) {
    __m512i amax = _mm512_setzero_si512();
    for (int64_t k = 0; k < n; k += 16)
        amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_loadu_si512(x + k), _mm512_set1_epi32(0x7fffffff)));
    union { uint32_t u; float f; } c = {(uint32_t)_mm512_reduce_max_epu32(amax)};
    const float sc = c.f / 127.0f;
    if (!(sc > 0.0f)) {  /* an all-zero block */
        memset(q, 0, (size_t)n);
        return sc;
    }
    const __m512 vs = _mm512_set1_ps(sc), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t k = 0; k < n; k += 32) {
        __m512i v[2];
        for (int h = 0; h < 2; h++) {
            const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k + 16 * h), vs),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
        }
        if (nibble_order) {
            const __m512i e = _mm512_permutex2var_epi32(v[0], evens, v[1]), o = _mm512_permutex2var_epi32(v[0], odds, v[1]);
            v[0] = e;
            v[1] = o;
        }
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(v[0]));
        _mm_storeu_si128((__m128i *)(q + k + 16), _mm512_cvtepi32_epi8(v[1]));
    }
    return sc;
}
#endif

/* Dynamic int8 quantization of x (M, K) (act: 0 bf16, 1 f32) a block of ab inputs at a time (ab <= 0: the whole
 * row) into q (M, K) and scales s (M, K / ab); nibble_order 1 (int4 weights): each block of 32 stored as its even
 * k, then its odd k. */
int lmf_quantize_s8(const void *x, int64_t act, int64_t M, int64_t K, int64_t nibble_order, int64_t ab, int8_t *q,
                    float *s) {
    if (ab <= 0) ab = K;
    if (act < 0 || act > 1 || M < 0 || K < 1 || (nibble_order && K % 32) || K % ab || (ab != K && ab % 32)) return -1;
    const size_t es = act ? 4 : 2;
    const int64_t A = K / ab;
#ifdef LMF_AVX512
    if (act == 1 && ab % 32 == 0) {  /* float32 in blocks of 32s (a nibble-order block never straddles two) */
        for (int64_t m = 0; m < M; m++)
            for (int64_t a = 0; a < A; a++)
                s[m * A + a] = a8_block_f32_avx512((const float *)x + m * K + a * ab, ab, (int)nibble_order,
                                                   q + m * K + a * ab);
        return 0;
    }
#endif
    for (int64_t m = 0; m < M; m++) {
        int8_t *qr = q + m * K;
        for (int64_t a = 0; a < A; a++) {
            const void *xb = (const char *)x + (size_t)(m * K + a * ab) * es;
            s[m * A + a] = a8_row_scale(xb, (int)act, ab);
            a8_row_codes(xb, (int)act, ab, s[m * A + a], qr + a * ab);
        }
        if (nibble_order)
            for (int64_t b = 0; b < K; b += 32) {
                int8_t t[32];
                memcpy(t, qr + b, 32);
                for (int i = 0; i < 16; i++) {
                    qr[b + i] = t[2 * i];
                    qr[b + 16 + i] = t[2 * i + 1];
                }
            }
    }
    return 0;
}

/* Row-parallel preparation of the activations (`split_rows`: contiguous shares of the M rows, 8 or more each; a prefill
 * chunk's 512 x 2,816 inputs took 0.8 ms to quantize on one thread, every layer's every matmul). */
typedef struct {
    const int8_t *q; const void *x; int64_t act, K, nibble_order, ab; int8_t *qo; float *s; int32_t *qsum;
    int *failed;  /* act 2: set where a share's row buffer could not be had */
} row_job;

static void quantize_rows(const void *arg, int64_t m0, int64_t m1) {
    const row_job *r = (const row_job *)arg;
    const int64_t K = r->K, A = K / r->ab;
    if (r->act == 2) {  /* gate_up rows (M, 2 K): silu(gate) * up a row at a time (`lmf_silu_mul_f32`), then as float32 */
        float *h = (float *)malloc((size_t)K * sizeof(float));
        if (h == NULL) {
            __atomic_store_n(r->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        for (int64_t m = m0; m < m1; m++) {
            const float *g = (const float *)r->x + m * 2 * K;
            lmf_silu_mul_f32(g, g + K, h, K);
            lmf_quantize_s8(h, 1, 1, K, r->nibble_order, r->ab, r->qo + m * K, r->s + m * A);
        }
        free(h);
        return;
    }
    const size_t es = r->act ? 4 : 2;
    lmf_quantize_s8((const char *)r->x + (size_t)(m0 * K) * es, r->act, m1 - m0, K, r->nibble_order, r->ab,
                    r->qo + m0 * K, r->s + m0 * A);
}

static void group_sums(const void *arg, int64_t m0, int64_t m1) {  /* sum(q) of each group of ab (the weight's gs) */
    const row_job *r = (const row_job *)arg;
    const int64_t G = r->K / r->ab;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < G; g++) {
            int32_t sum = 0;
            for (int64_t k = g * r->ab; k < (g + 1) * r->ab; k++) sum += r->q[m * r->K + k];
            r->qsum[m * G + g] = sum;
        }
}

/* out (M, N) float32 = the A8 product of quantized rows (q, xs (M, K / a8_block(gs)): `lmf_quantize_s8` with that
 * block) and int8 / int4 weights (w, ws (N, K / gs)).
 * isa: a body (0..4, `A8_ISAS`) or -1 for the best. Returns 0; -1 for a shape it does not take (K % 32, int4 gs
 * not a multiple of 32 dividing K, K >= 65536); -2 for a body this CPU or build does not have. */
int lmf_qmm_s8(const int8_t *q, const float *xs, const void *w, const float *ws, float *out, int64_t M, int64_t N,
               int64_t K, int64_t bits, int64_t gs, int64_t threads, int64_t isa, const lmf_scales *sc) {
    if ((bits != 8 && bits != 6 && bits != 5 && bits != 4) || K % 32 || K >= 65536 || M < 1 || N < 1) return -1;
    if (bits == 8 && gs <= 0) gs = K;  /* per channel; int8 groups of 32 or more (GGUF's Q8_0) as for int4 */
    const float *zero = sc != NULL ? (const float *)sc->z : NULL;  /* only its presence matters here */
    if (sc != NULL && (sc->fmt < LMF_SCALES_F32 || sc->fmt > LMF_SCALES_SUPER || (sc->fmt == LMF_SCALES_SUPER &&
                                                                                    (sc->per < 1 || (K / gs) % sc->per))))
        return -1;
    const int g16 = (bits == 8 || bits == 6) && gs == 16 && zero == NULL;  /* GGUF's Q6_K: a scale per 16 */
    if (gs <= 0 || (gs % 32 && !g16) || K % gs) return -1;
    const int64_t ab = a8_block(gs), A = K / ab;
    if (isa < 0) isa = lmf_a8_best_isa();
    if (isa >= A8_ISAS || !lmf_a8_isa_supported(isa)) return -2;
    /* weights stored as panels (LMF_PANELS16): only the panel bodies read them, on an AVX-512 VNNI CPU */
    const int panels16 = sc != NULL && sc->layout == LMF_PANELS16;
    if (sc != NULL && sc->layout != LMF_ROWS && !panels16) return -1;
    if (panels16 && ((bits != 4 && bits != 8) || (bits == 8 && (zero != NULL || sc->fmt == LMF_SCALES_SUPER)) ||
                     N % A8_PANEL || gs % 32))
        return -1;
    if (panels16 && (lmf_dispatch.a8_panel == NULL || (isa != A8_AVX512_VNNI && isa != A8_AVX512_VNNI_256))) return -2;
    /* many rows on an AVX-512 VNNI CPU: the panel GEMM (qmm_a8_panel.c), whatever the weight's form; fewer on
     * stored panels (int4 or int8 codes): the lanes body beside it, below `a8_lanes_rows` (on int8, the panel ÷ lanes
     * time: 1.30 at 1 row, 1.32 at 8, 1.16 at 32; `python scripts/kernels_ab.py panels --bits 8`) */
    const int panel = (isa == A8_AVX512_VNNI || isa == A8_AVX512_VNNI_256) && lmf_dispatch.a8_panel != NULL &&
                      lmf_dispatch.a8_panel_rows > 0 && M >= lmf_dispatch.a8_panel_rows &&
                      (!panels16 || M >= lmf_dispatch.a8_lanes_rows);
    const int lanes = panels16 && !panel;
    if (panel || lanes) isa = A8_AVX512_VNNI;
    if (!panel && isa == A8_AVX512_VNNI && (g16 || bits == 5 || bits == 6))  /* groups of 16, 5/6-bit codes: the 256-bit body */
        isa = lmf_a8_isa_supported(A8_AVX512_VNNI_256) ? A8_AVX512_VNNI_256 : A8_PORTABLE;
    /* the 256-bit VNNI body hands int8 weights at 8 rows or more to the 512-bit one, which wins there (Zen 4,
     * 2 threads: int8 g32 on the 300M's shapes, 4 rows 0.47 against 0.50 ms, 16 rows 1.78 against 1.87; a
     * Q8_0 prompt of 100 tokens 308-329 against 360-617 ms); int4 stays on it at every batch */
    if (!panel && isa == A8_AVX512_VNNI_256 && bits == 8 && M >= 8 && !g16 && lmf_a8_isa_supported(A8_AVX512_VNNI))
        isa = A8_AVX512_VNNI;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > N) threads = N;
    int8_t *u = NULL;  /* the 512-bit body reads q + 128 (unsigned): converted once here */
    if (isa == A8_AVX512_VNNI && !panel && !lanes) {
        if ((u = (int8_t *)malloc((size_t)(M * K))) == NULL) return -1;
        for (int64_t i = 0; i < M * K; i++) u[i] = (int8_t)((uint8_t)q[i] ^ 0x80u);
    }
    /* xs * sum(q) a group: the 256-bit int4 bodies multiply the stored nibbles (c + 8) and take 8 * sum(q) back;
     * zero offsets add zero * sum(q) (the portable body sums as it goes) */
    const int want_qs = (bits < 8 && (isa == A8_AVX2 || isa == A8_AVX_VNNI || isa == A8_AVX512_VNNI_256))
                        || (zero != NULL && isa != A8_PORTABLE);
    /* sum(q) of each group, once, on the call's threads: qs from it, and the panel body reads it as it is */
    int32_t *qsum = NULL;
    float *qs = NULL;
    if (want_qs || panel || lanes) {
        if ((qsum = (int32_t *)malloc((size_t)(M * (K / gs)) * sizeof(int32_t))) == NULL
            || (want_qs && (qs = (float *)malloc((size_t)(M * (K / gs)) * sizeof(float))) == NULL)) {
            free(qsum);
            free(u);
            return -1;
        }
        split_rows(group_sums, &(row_job){q, NULL, 0, K, 0, gs, NULL, NULL, qsum}, M, 8, threads);
        if (want_qs)
            for (int64_t m = 0; m < M; m++)
                for (int64_t g = 0; g < K / gs; g++)
                    qs[m * (K / gs) + g] = (float)qsum[m * (K / gs) + g] * xs[m * A + g * gs / ab];
    }
    /* int4 on the 256-bit bodies, groups of 32 or whole pairs: blocks taken two at a time (pair_order) */
    const int pairs = bits == 4 && (isa == A8_AVX2 || isa == A8_AVX_VNNI || isa == A8_AVX512_VNNI_256) &&
                      (gs == 32 || gs % 64 == 0);
    float *xp = NULL;
    if (pairs) {
        if ((u = (int8_t *)malloc((size_t)(M * K))) == NULL
            || (gs == 32 && (xp = (float *)malloc((size_t)(M * (K / 64) * 8) * sizeof(float) + 1)) == NULL)) {
            free(u);
            free(qs);
            free(qsum);
            return -1;
        }
        pair_order(q, M, K, u);
        if (xp != NULL)  /* each pair's two activation scales in the dot's lanes: 0-3 block A, 4-7 block B */
            for (int64_t m = 0; m < M; m++)
                for (int64_t p = 0; p < K / 64; p++)
                    for (int i = 0; i < 8; i++) xp[(m * (K / 64) + p) * 8 + i] = xs[m * A + 2 * p + (i >= 4)];
    }
    int64_t next = 0;
    /* the panel bodies take whole pairs of panels (take_pairs); each thread's panel buffers are taken here so that a
     * failed allocation is this call's -1, not a row left unwritten */
    const int64_t chunk = chunk_rows(N, threads);
    const size_t scratch = panel ? a8_panel_scratch(K, K / gs) : 0;
    char *panels = NULL;
    if (panel && (panels = (char *)aligned_alloc(64, scratch * (size_t)threads)) == NULL) {
        free(qsum);
        free(qs);
        return -1;
    }
    a8_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (a8_job){u ? u : q, xs, w, ws, out, qs, qsum, sc, pairs, xp, M, N, K, gs, bits, 0, 0, isa, K / gs, ab,
                           A, &next, chunk, threads, panels ? panels + scratch * (size_t)t : NULL};
    run_jobs(panel ? a8_range_panel : lanes ? a8_range_lanes : a8_range, jobs, sizeof jobs[0], threads);
    free(panels);
    free(qsum);
    free(xp);
    free(qs);
    free(u);
    return 0;
}

/* Quantize x (act: 0 bf16, 1 f32; 2: float32 gate_up rows (M, 2 K), each [gate | up], quantized as silu(gate) * up:
 * SwiGLU's middle in this call, the bits of `lmf_silu_mul_rows_f32` then act 1) and multiply: `lmf_quantize_s8` then
 * `lmf_qmm_s8`, one call (the body first, so that Python binds it once with functools.partial). */
int lmf_qmm_a8(int64_t isa, const void *x, int64_t act, const void *w, const float *ws, float *out, int64_t M,
               int64_t N, int64_t K, int64_t bits, int64_t gs, int64_t threads, const lmf_scales *sc) {
    if (K % 32 || M < 1 || gs > K) return -1;
    const int64_t ab = a8_block(bits == 8 && gs <= 0 ? K : gs);
    if (ab <= 0 || K % ab) return -1;
    int8_t *q = (int8_t *)malloc((size_t)(M * K) + (size_t)(M * (K / ab)) * sizeof(float));
    if (q == NULL) return -1;
    float *xs = (float *)(q + M * K);  /* M * K is a multiple of 32: aligned for float */
    int failed = 0;  /* act 2 (gate_up rows, silu(gate) * up): float32 rows of K once the middle is taken */
    int rc = act < 0 || act > 2 ? -1 : lmf_quantize_s8(x, act == 2 ? 1 : act, 0, K, bits == 4, ab, q, xs);  /* checks */
    if (rc == 0)
        split_rows(quantize_rows, &(row_job){NULL, x, act, K, bits == 4, ab, q, xs, NULL, &failed}, M, 8, threads);
    if (failed) rc = -1;
    if (rc == 0) rc = lmf_qmm_s8(q, xs, w, ws, out, M, N, K, bits, gs, threads, isa, sc);
    free(q);
    return rc;
}
