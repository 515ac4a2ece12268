/* The A16 row kernel: weight-only int8 / int4 / bf16 / float32 matmul on float32 activations, for the few rows
 * of a decode step (`lmforge.quant.linear.QmmLinear`; CPUs without bf16 units, and every int-weight model under
 * `--dtype auto`). From the caller's `gemm_rows` rows on it hands over to the panel GEMM (gemm_f32.c).
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] with w = code * scale:
 *   int8: codes (N, K) int8, one float32 scale per output row (w8a16 per channel) or per group of `gs`;
 *   int4: codes packed two per byte (N, K/2) uint8, low nibble = even k, stored unsigned (code + 8),
 *         one float32 scale per output row and group of `gs` inputs (gs a multiple of 32);
 *   bf16 (bits 16): the weights themselves (N, K) as bfloat16 bit patterns, widened exactly to float32
 *         (a 16-bit shift), one scale per row (1.0 for a bf16 checkpoint: exact). A bf16 checkpoint on a
 *         CPU without bf16 units reads 2 bytes a weight and computes in float32;
 *   float32 (bits 32): the weights as they are, scale 1 (the float32 model's decoder layers, so that a
 *         decode step's layer is one C call: `engine.decode_layer`).
 * For the few rows of a decode step (M small): every weight row is read from memory once and, for a
 * block of up to 4 activation rows, converted to float32 once; the accumulation is float32 FMA (AVX2)
 * or plain C (the portable body, also what LMF_PORTABLE builds). Output rows n are split over threads.
 * Decode is bound by the bytes it reads, so 1 (int8) or 0.5 (int4) bytes a weight instead of 4 is the
 * point; float32 rounding differs from dequantize + matmul only in summation order.
 *
 * GGUF's block types add two forms (`lmforge.quant.gguf_types`): int8 codes with a scale per 16 inputs
 * (Q6_K; `gs` 16, two groups a block of 32), and zero offsets: w = code * scale + zero (Q4_1, Q5_1, Q4_K, Q5_K),
 * computed as sum_g zero[g] * sum_{k in g} x[k] from the activations' group sums, once a call. Scales and
 * zeros come in the file's own form (common.h's `lmf_scales`: float16, or int8 under a float16 per super-block)
 * and are widened a weight row at a time.
 */
#include "common.h"

#ifdef LMF_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef LMF_AVX2
/* Codes k .. k+31 of a weight row as 4 x 8 float32: int8 widened as is; int4 (two a byte, low nibble
 * first, stored code + 8) split into nibbles, interleaved back into k order, re-centred. */
static inline __attribute__((always_inline)) void widen32(const void *wrow, int bits, int64_t k, int64_t K,
                                                          __m256 w[4]) {
    __m128i c0, c1;  /* codes k .. k+15 and k+16 .. k+31, signed bytes */
    if (bits == 32) {  /* float32 weights: read as they are */
        const float *p = (const float *)wrow + k;
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(p + 8 * i);
        return;
    }
    if (bits == 16) {  /* bfloat16 -> float32: the 16 bits become the high half of the float */
        const __m128i *p = (const __m128i *)((const uint16_t *)wrow + k);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + i)), 16));
        return;
    }
    if (bits == 8) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)((const int8_t *)wrow + k));
        c0 = _mm256_castsi256_si128(b);
        c1 = _mm256_extracti128_si256(b, 1);
    } else if (bits == 4) {
        const __m128i lo4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)wrow + k / 2));
        const __m128i lo = _mm_and_si128(b, lo4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
        c0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
        c1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
    } else {  /* 5 / 6 bits (common.h's layout): low nibbles are codes 0-15, high nibbles 16-31, then the high bits */
        const __m128i lo4 = _mm_set1_epi8(0x0F), off = _mm_set1_epi8((char)code_offset(bits));
        const uint8_t *blk = (const uint8_t *)wrow + (k / 32) * (16 + 4 * (bits - 4)), *hp = blk + 16;
        const __m128i b = _mm_loadu_si128((const __m128i *)blk);
        (void)K;
        __m256i h;
        if (bits == 6) {
            int64_t h8;
            memcpy(&h8, hp, 8);
            h = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h8), _mm256_set_epi64x(6, 4, 2, 0)),
                                 _mm256_set1_epi8(0x03));
        } else {
            int32_t h4;
            memcpy(&h4, hp, 4);
            h = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h4), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0)),
                                 _mm256_set1_epi8(0x01));
        }
        h = _mm256_slli_epi16(h, 4);
        c0 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(b, lo4), _mm256_castsi256_si128(h)), off);
        c1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), _mm256_extracti128_si256(h, 1)), off);
    }
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8)));
}
#endif

/* One output row n for R activation rows (R a compile-time constant after inlining, so the
 * accumulators stay in registers): total[r] = sum_g scale[g] * sum_{k in group g} x[r, k] * code[k].
 * Per group the products go into vector accumulators; the scale is applied to the vector (one FMA per
 * group), and the horizontal sum happens once per row. */
static inline __attribute__((always_inline)) void qmm_row(const float *x, int64_t K, const int R, const void *wrow,
                                                          int bits, const float *scale, int64_t gs, float *total) {
    const int64_t G = K / gs;
#ifdef LMF_AVX2
    __m256 t[4][2];
    for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
    int64_t done = 0;  /* inputs covered by the vector loop, the same in every group */
    if (gs == 16 && K % 32 == 0) {  /* two groups a block of 32: codes 0-15 on chain 0, 16-31 on chain 1 */
        for (int64_t k = 0; k < K; k += 32) {
            __m256 w[4];
            widen32(wrow, bits, k, K, w);
            const __m256 s0 = _mm256_set1_ps(scale[k / 16]), s1 = _mm256_set1_ps(scale[k / 16 + 1]);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * K + k;
                const __m256 a0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xr)));
                const __m256 a1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24),
                                                  _mm256_mul_ps(w[2], _mm256_loadu_ps(xr + 16)));
                t[r][0] = _mm256_fmadd_ps(a0, s0, t[r][0]);
                t[r][1] = _mm256_fmadd_ps(a1, s1, t[r][1]);
            }
        }
        for (int r = 0; r < R; r++) total[r] = hsum8(_mm256_add_ps(t[r][0], t[r][1]));
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        __m256 a[4][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const int64_t k0 = g * gs, k1 = k0 + gs;
        int64_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            __m256 w[4];
            widen32(wrow, bits, k, K, w);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * K + k;
                a[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a[r][1]);
                a[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a[r][1]);
            }
        }
        done = k - k0;
        const __m256 sg = _mm256_set1_ps(scale[g]);
        for (int r = 0; r < R; r++) {
            t[r][0] = _mm256_fmadd_ps(a[r][0], sg, t[r][0]);
            t[r][1] = _mm256_fmadd_ps(a[r][1], sg, t[r][1]);
        }
    }
    for (int r = 0; r < R; r++) total[r] = hsum8(_mm256_add_ps(t[r][0], t[r][1]));
#else
    const int64_t done = 0;
    for (int r = 0; r < R; r++) total[r] = 0.0f;
#endif
    if (done == gs) return;
    for (int64_t g = 0; g < G; g++) {  /* the tail of each group (all of it in the portable body) */
        float acc[4] = {0, 0, 0, 0};
        for (int64_t k = g * gs + done; k < (g + 1) * gs; k++) {
            float c;
            if (bits == 32) c = ((const float *)wrow)[k];
            else if (bits == 16) c = bf16_to_f32(((const uint16_t *)wrow)[k]);
            else if (bits == 8) c = (float)((const int8_t *)wrow)[k];
            else if (bits != 4) c = (float)(lohi_code((const uint8_t *)wrow, bits, K, k) - code_offset(bits));
            else {
                const uint8_t byte = ((const uint8_t *)wrow)[k / 2];
                c = (float)((int)((k & 1) ? byte >> 4 : byte & 0x0F) - 8);
            }
            for (int r = 0; r < R; r++) acc[r] += x[r * K + k] * c;
        }
        for (int r = 0; r < R; r++) total[r] += acc[r] * scale[g];
    }
}

/* float32 weights (bits 32, scale 1), R = 5..8 activation rows: one accumulator vector a row (no groups to
 * scale), so 8 rows and 2 weight vectors fit AVX2's 16 registers and a weight row is read once for up to
 * 8 rows, not once per 4 (`qmm_row` keeps the 1-4 row case, with 2 accumulators a row). */
static inline __attribute__((always_inline)) void f32_row8(const float *x, int64_t K, const int R, const float *wrow,
                                                           float *total) {
    int64_t k = 0;
#ifdef LMF_AVX2
    __m256 a[8];
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(wrow + k), w1 = _mm256_loadu_ps(wrow + k + 8);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + k;
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[r]);
            a[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[r]);
        }
    }
    for (int r = 0; r < R; r++) total[r] = hsum8(a[r]);
#else
    for (int r = 0; r < R; r++) total[r] = 0.0f;
#endif
    for (; k < K; k++)
        for (int r = 0; r < R; r++) total[r] += x[r * K + k] * wrow[k];
}

typedef struct {
    const float *x; const void *w; const float *scale; float *out;
    const lmf_scales *sc;  /* the scales' (and zeros') form; NULL: the float32 `scale` and no zeros */
    const float *xsum;  /* with zeros: the activations' group sums (M, G) */
    int64_t M, N, K, gs, bits, n0, n1;
    int64_t *next, chunk, threads;  /* shared by the threads: the next chunk of weight rows (qmm_range, take_rows) */
} qmm_job;

/* sum_g a[g] * b[g] (the zero offsets' term of one output). */
static inline float dot_groups(const float *a, const float *b, int64_t G) {
    int64_t g = 0;
    float s = 0.0f;
#ifdef LMF_AVX2
    __m256 v = _mm256_setzero_ps();
    for (; g + 8 <= G; g += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), v);
    s = hsum8(v);
#endif
    for (; g < G; g++) s += a[g] * b[g];
    return s;
}

static void qmm_rows_of(const qmm_job *j) {  /* weight rows [j->n0, j->n1) */
    const int64_t K = j->K, gs = j->gs, G = K / gs;
    float ws_buf[LMF_MAX_G], wz_buf[LMF_MAX_G];
    const int64_t row_bytes = row_bytes_of(j->bits, K);
    const int64_t block = j->bits == 32 ? 8 : 4;  /* float32 weights: 8 rows a pass (f32_row8) */
    for (int64_t m0 = 0; m0 < j->M; m0 += block) {
        const int R = j->M - m0 < block ? (int)(j->M - m0) : (int)block;
        const float *x = j->x + m0 * K;
        for (int64_t n = j->n0; n < j->n1; n++) {
            float total[8];
            const void *w = (const uint8_t *)j->w + n * row_bytes;
            const float *sc, *wz;
            row_scales(j->sc, j->scale, n, G, j->bits, ws_buf, wz_buf, &sc, &wz);
            /* R and bits constant per call: the accumulators stay in registers, no branch in the loop */
#define QMM_ROWS(BITS) switch (R) {                                     \
                case 1: qmm_row(x, K, 1, w, BITS, sc, gs, total); break;  \
                case 2: qmm_row(x, K, 2, w, BITS, sc, gs, total); break;  \
                case 3: qmm_row(x, K, 3, w, BITS, sc, gs, total); break;  \
                default: qmm_row(x, K, 4, w, BITS, sc, gs, total); break; \
            }
#define F32_ROWS switch (R) {                                                  \
                case 5: f32_row8(x, K, 5, (const float *)w, total); break;      \
                case 6: f32_row8(x, K, 6, (const float *)w, total); break;      \
                case 7: f32_row8(x, K, 7, (const float *)w, total); break;      \
                default: f32_row8(x, K, 8, (const float *)w, total); break;     \
            }
            if (j->bits == 32 && R > 4) F32_ROWS
#undef F32_ROWS
            else if (j->bits == 32) QMM_ROWS(32) else if (j->bits == 16) QMM_ROWS(16)
            else if (j->bits == 8) QMM_ROWS(8) else if (j->bits == 6) QMM_ROWS(6) else if (j->bits == 5) QMM_ROWS(5)
            else QMM_ROWS(4)
#undef QMM_ROWS
            if (wz != NULL)
                for (int r = 0; r < R; r++) total[r] += dot_groups(wz, j->xsum + (m0 + r) * G, G);
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r];
        }
    }
}

static void *qmm_range(void *arg) {  /* a thread's share: chunks of weight rows (`take_chunk`) */
    qmm_job j = *(const qmm_job *)arg;
    while (take_rows(j.next, j.chunk, j.N, j.threads, &j.n0, &j.n1)) qmm_rows_of(&j);
    return NULL;
}

/* The activations' sum over each group, (M, G), for the zero offsets' term; NULL when out of memory. */
static float *group_sums(const float *x, int64_t M, int64_t K, int64_t gs) {
    const int64_t G = K / gs;
    float *xsum = (float *)malloc((size_t)(M * G) * sizeof(float));
    if (xsum == NULL) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += x[m * K + k];
            xsum[m * G + g] = s;
        }
    return xsum;
}

/* bits 32, 16, 8 or 4; float32, bf16 and int8 with gs <= 0 or gs = K are per channel (any K), else gs is a group as for
 * int4 (GGUF's Q8_0: groups of 32; int8 also 16, Q6_K). `zero` (N, G) or NULL: zero offsets (groups of 32 or more).
 * From `gemm_rows` rows on (> 0; 0: never) the call goes to the panel GEMM (gemm_f32.c) when this build has it: the
 * caller's choice, per weight, since where the GEMM starts to win depends on the bits (`QmmLinear.GEMM_MIN_ROWS`,
 * measured). Returns -1 for shapes it does not take (a group not a multiple of 32 dividing K). */
int lmf_qmm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                int64_t bits, int64_t gs, int64_t threads, int64_t gemm_rows, const lmf_scales *sc) {
    if (bits != 32 && bits != 16 && bits != 8 && bits != 6 && bits != 5 && bits != 4) return -1;
    if (sc != NULL && sc->layout != LMF_ROWS)  /* stored panels: bf16 weights only, on gemm_bf16.c's bodies */
        return bits == 16 && sc->layout == LMF_PANELS16 && sc->z == NULL
                   ? bf16_lanes_f32(x, (const uint16_t *)w, scale, out, M, N, K, threads) : -1;
    const void *zero = sc != NULL ? sc->z : NULL;
    if (sc == NULL && scale == NULL) return -1;
    if (bits >= 8 && (gs <= 0 || gs == K) && zero == NULL) gs = K;
    else if (gs <= 0 || (gs % 32 && !(gs == 16 && (bits == 8 || bits == 6) && zero == NULL)) || K % gs) return -1;
    if (sc != NULL && (sc->fmt < LMF_SCALES_F32 || sc->fmt > LMF_SCALES_SUPER || K / gs > LMF_MAX_G ||
                       (sc->fmt == LMF_SCALES_SUPER && (sc->per < 1 || (K / gs) % sc->per))))
        return -1;
    if (gemm_rows > 0 && M >= gemm_rows && lmf_gemm_f32(x, w, scale, out, M, N, K, bits, gs, threads, sc) == 0)
        return 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > N) threads = N;
    float *xsum = NULL;
    if (zero != NULL && (xsum = group_sums(x, M, K, gs)) == NULL) return -1;
    int64_t next = 0;
    const int64_t chunk = chunk_rows(N, threads);
    qmm_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (qmm_job){x, w, scale, out, sc, xsum, M, N, K, gs, bits, 0, 0, &next, chunk, threads};
    run_jobs(qmm_range, jobs, sizeof jobs[0], threads);
    free(xsum);
    return 0;
}
