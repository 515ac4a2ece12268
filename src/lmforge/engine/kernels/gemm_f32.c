/* The panel GEMM: prefill on bfloat16 (or float32, int8, int4) weights, float32 activations; `lmf_qmm_f32`
 * (qmm_f32.c) hands it the calls of `gemm_rows` rows or more.
 *
 * out (M, N) = x (M, K) . w (N, K)^T for a prefill chunk (M above the decode kernel's rows) of a bf16
 * checkpoint on a CPU without bf16 units. The old way widened the whole weight into a float32 buffer
 * (2 bytes read, 4 written, 4 read again by sgemm a weight, ~47 MB a layer of the 300M) before MKL's
 * sgemm; here each block of 16 output columns is widened into a (K, 16) float32 panel that stays in L2
 * (64 KB at K = 1024), and a 6 x 16 register tile (12 accumulators, two weight vectors and a broadcast
 * activation per k: 12 FMAs to 8 loads, so the FMA units are the limit) runs down all of K for every 6
 * rows of x. Panels are handed out to threads in chunks (`take_chunk`): each output column is one
 * thread's, no reduction. Summation is float32 FMA in k order, so it differs from sgemm only in rounding
 * order. AVX2 + FMA only: returns -1 elsewhere (the caller keeps widen + sgemm).
 */
#include "common.h"

#ifdef LMF_AVX2
#define GEMM_MR 6
#define GEMM_NR 16

/* 8 x 8 transpose of float32 rows r[0..7] (each 8 columns) in place: r[i][j] -> r[j][i] */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* 8 weights of row n from k (k a multiple of 8, groups of 16 or more: one group) as float32, dequantized as
 * `QmmLinear.dequantized` does (code * scale, one rounding; + zero, a second, with zero offsets): bf16 widened,
 * float32 as is, int8 codes, int4 two a byte (low nibble = even k, stored code + 8). */
static inline __attribute__((always_inline)) __m256 gemm_load8(const void *w, int bits, const float *scale,
                                                               const float *zero, int64_t gs, int64_t K,
                                                               int64_t n, int64_t k) {
    const int64_t i = n * K + k;
    if (bits == 32) return _mm256_loadu_ps((const float *)w + i);
    if (bits == 16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    __m256 v;
    if (bits == 8) {
        v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
    } else if (bits != 4) {  /* 5 / 6 bits: eight codes one by one (packing is amortized over the panel's rows) */
        const uint8_t *row = (const uint8_t *)w + n * row_bytes_of(bits, K);
        int32_t c[8];
        for (int t = 0; t < 8; t++) c[t] = lohi_code(row, bits, K, k + t) - code_offset(bits);
        v = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)c));
    } else {
        uint32_t b4;
        memcpy(&b4, (const uint8_t *)w + i / 2, 4);
        const __m128i b = _mm_cvtsi32_si128((int)b4), lo4 = _mm_set1_epi8(0x0F);
        const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, lo4), _mm_and_si128(_mm_srli_epi16(b, 4), lo4));
        v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(c), _mm256_set1_epi32(8)));
    }
    v = _mm256_mul_ps(v, _mm256_set1_ps(scale[k / gs]));  /* the row's own scales and zeros */
    return zero ? _mm256_add_ps(v, _mm256_set1_ps(zero[k / gs])) : v;
}

static inline float gemm_load1(const void *w, int bits, const float *scale, const float *zero, int64_t gs,
                               int64_t K, int64_t n, int64_t k) {
    const int64_t i = n * K + k;
    if (bits == 32) return ((const float *)w)[i];
    if (bits == 16) return bf16_to_f32(((const uint16_t *)w)[i]);
    float c;
    if (bits == 8) c = (float)((const int8_t *)w)[i];
    else if (bits != 4) c = (float)(lohi_code((const uint8_t *)w + n * row_bytes_of(bits, K), bits, K, k) - code_offset(bits));
    else {
        const uint8_t byte = ((const uint8_t *)w)[i / 2];
        c = (float)((int)((i & 1) ? byte >> 4 : byte & 0x0F) - 8);
    }
    const float v = c * scale[k / gs];
    return zero ? v + zero[k / gs] : v;
}

/* Weight rows n0 .. n0+nc-1 (nc <= 16) as a (K, 16) float32 panel: panel[k * 16 + j] = w[n0 + j, k],
 * zero where n0 + j >= N. 8 rows x 8 k at a time: dequantized, transposed in registers, stored as 8 rows. */
static void gemm_pack(const void *w, int bits, const float *scale, const lmf_scales *sc, int64_t gs, int64_t K,
                      int64_t n0, int64_t nc, float *panel, float *ws16, float *wz16) {
    const int64_t G = K / gs;
    const float *ws[GEMM_NR], *wz[GEMM_NR];  /* each row's scales and zeros, widened (common.h's row_scales) */
    for (int64_t j = 0; j < nc; j++) row_scales(sc, scale, n0 + j, G, bits, ws16 + j * G, wz16 + j * G, &ws[j], &wz[j]);
    for (int64_t j0 = 0; j0 < GEMM_NR; j0 += 8) {
        int64_t k = 0;
        if (j0 + 8 <= nc) {
            for (; k + 8 <= K; k += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++)
                    r[i] = gemm_load8(w, bits, ws[j0 + i], wz[j0 + i], gs, K, n0 + j0 + i, k);
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (k + i) * GEMM_NR + j0, r[i]);
            }
        }
        for (; k < K; k++)  /* the K tail, and the columns past N of the last panel */
            for (int64_t j = j0; j < j0 + 8; j++)
                panel[k * GEMM_NR + j] = j < nc ? gemm_load1(w, bits, ws[j], wz[j], gs, K, n0 + j, k) : 0.0f;
    }
}

/* out rows m0 .. m0+R-1, columns n0 .. n0+nc-1 (R a compile-time constant after inlining). */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t K, const int R,
                                                            const float *panel, float *out, int64_t N, int64_t nc) {
    __m256 c[GEMM_MR][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + k * GEMM_NR), b1 = _mm256_loadu_ps(panel + k * GEMM_NR + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * K + k);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (nc == GEMM_NR) {
            _mm256_storeu_ps(out + r * N, c[r][0]);
            _mm256_storeu_ps(out + r * N + 8, c[r][1]);
        } else {
            float tmp[GEMM_NR];
            _mm256_storeu_ps(tmp, c[r][0]);
            _mm256_storeu_ps(tmp + 8, c[r][1]);
            memcpy(out + r * N, tmp, (size_t)nc * sizeof(float));
        }
    }
}

typedef struct {
    const float *x; const void *w; const float *scale; const lmf_scales *sc; float *out;
    int64_t M, N, K, bits, gs;
    int64_t *next, chunk;  /* panels handed out `chunk` at a time */
    float *panel;          /* this thread's (K, 16) buffer */
    float *ws16, *wz16;    /* this thread's 16 rows of widened scales and zeros, (16, G) each */
} gemm_job;

static void *gemm_range(void *arg) {
    const gemm_job *j = (const gemm_job *)arg;
    const int64_t P = (j->N + GEMM_NR - 1) / GEMM_NR, K = j->K;
    int64_t p0, p1;
    while (take_chunk(j->next, j->chunk, P, &p0, &p1))
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * GEMM_NR, nc = j->N - n0 < GEMM_NR ? j->N - n0 : GEMM_NR;
            gemm_pack(j->w, (int)j->bits, j->scale, j->sc, j->gs, K, n0, nc, j->panel, j->ws16, j->wz16);
            int64_t m = 0;
            for (; m + GEMM_MR <= j->M; m += GEMM_MR)
                gemm_tile(j->x + m * K, K, GEMM_MR, j->panel, j->out + m * j->N + n0, j->N, nc);
            const float *x = j->x + m * K;
            float *o = j->out + m * j->N + n0;
            switch (j->M - m) {
                case 1: gemm_tile(x, K, 1, j->panel, o, j->N, nc); break;
                case 2: gemm_tile(x, K, 2, j->panel, o, j->N, nc); break;
                case 3: gemm_tile(x, K, 3, j->panel, o, j->N, nc); break;
                case 4: gemm_tile(x, K, 4, j->panel, o, j->N, nc); break;
                case 5: gemm_tile(x, K, 5, j->panel, o, j->N, nc); break;
                default: break;
            }
        }
    return NULL;
}
#endif

/* Weights as `lmf_qmm_f32` takes them: bits 32 or 16 (scale may be NULL: 1), 8 (per channel: gs <= 0 or K;
 * or groups, 16 too) or 4 (groups); groups a multiple of 32 dividing K; zero offsets `zero` (N, G) or NULL.
 * Returns 0, or -1 when this build has no AVX2 + FMA body, the shape is not one it takes, or memory for the
 * panels is not to be had. */
int lmf_gemm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t bits, int64_t gs, int64_t threads, const lmf_scales *sc) {
#ifdef LMF_AVX2
    static const float one = 1.0f;
    if (M < 1 || N < 1 || K < 1 || (sc != NULL && sc->layout != LMF_ROWS)) return -1;
    if (bits != 32 && bits != 16 && bits != 8 && bits != 6 && bits != 5 && bits != 4) return -1;
    const void *zero = sc != NULL ? sc->z : NULL;
    if (scale == NULL && sc == NULL && bits < 16) return -1;
    if (scale == NULL && sc == NULL) scale = &one;  /* float weights with no scales: a row of ones, below */
    if (bits != 4 && (gs <= 0 || gs == K) && zero == NULL) gs = K;
    else if (gs <= 0 || (gs % 32 && !(gs == 16 && (bits == 8 || bits == 6))) || K % gs) return -1;
    const int64_t P = (N + GEMM_NR - 1) / GEMM_NR;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > P) threads = P;
    float *ones = NULL;
    if (scale == &one) {  /* one scale a row, all 1 */
        ones = (float *)malloc((size_t)N * sizeof(float));
        if (ones == NULL) return -1;
        for (int64_t n = 0; n < N; n++) ones[n] = 1.0f;
        scale = ones;
    }
    const int64_t G = K / gs, floats = K * GEMM_NR + 2 * GEMM_NR * G;  /* a thread's panel, scales and zeros */
    if (G > LMF_MAX_G) {
        free(ones);
        return -1;
    }
    float *panels = (float *)aligned_alloc(64, (size_t)((threads * floats * sizeof(float) + 63) / 64 * 64));
    if (panels == NULL) {
        free(ones);
        return -1;
    }
    int64_t next = 0;
    int64_t chunk = P / (8 * threads);  /* ~8 chunks a thread: a slower sibling core takes fewer */
    if (chunk < 1) chunk = 1;
    gemm_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (gemm_job){x, w, scale, sc, out, M, N, K, bits, gs, &next, chunk, panels + t * floats,
                             panels + t * floats + K * GEMM_NR, panels + t * floats + K * GEMM_NR + GEMM_NR * G};
    run_jobs(gemm_range, jobs, sizeof jobs[0], threads);
    free(panels);
    free(ones);
    return 0;
#else
    (void)x; (void)w; (void)scale; (void)out; (void)M; (void)N; (void)K; (void)bits; (void)gs; (void)threads;
    (void)sc;
    return -1;
#endif
}
