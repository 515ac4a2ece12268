/* The elementwise ops of a Llama layer, one call each instead of 5-14 torch ops (`lmforge.engine.fused` puts
 * them in the model): RMSNorm, RoPE and SwiGLU's silu * up, on bfloat16 (AVX-512 where the compiler targets
 * it, else portable C) and on float32 (plain loops the compiler vectorizes).
 *
 * The row ops take `threads` and split their rows into that many contiguous shares when a call has at least
 * SPLIT_MIN elements (a prefill chunk; a decode step's few rows stay on the calling thread). Every row is computed
 * the same way whatever the split, so the thread count changes no number. On one thread a 512-token bf16 prefill of
 * the 300M spent ~60 ms of its ~890 in them while the other core waited (2026-12-06).
 */
#include "common.h"

#define SPLIT_MIN 65536  /* elements a call before its rows are split across threads: a share at least half that */
#define PER(width) ((SPLIT_MIN / 2 + (width) - 1) / (width))

/* ---- bfloat16 in and out ------------------------------------------------------------------------------
 * Each follows the rounding of the torch ops it replaces (every torch bf16 op computes in float32
 * and rounds its result to bfloat16), so outputs match torch's bit for bit except where a float32
 * reduction (RMSNorm's mean) or exp (SiLU) is summed or approximated differently. */

#ifdef LMF_AVX512
/* x rounded to the nearest bfloat16 (ties to even), kept as float32; NaN stays NaN */
static inline __m512 round_bf16_ps(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

static inline void store_bf16(uint16_t *p, __m512 x) {  /* x must already be a bfloat16 value */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
#endif

typedef struct {
    const void *x, *w;
    void *out;
    int64_t D;
    float eps;
} norm_args;

/* RMSNorm as transformers computes it: y = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(w * y). */
static void rmsnorm_bf16_rows(const void *args, int64_t r0, int64_t r1) {
    const norm_args *a = (const norm_args *)args;
    const uint16_t *x = (const uint16_t *)a->x, *w = (const uint16_t *)a->w;
    uint16_t *out = (uint16_t *)a->out;
    const int64_t D = a->D;
    const float eps = a->eps;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = x + r * D;
        uint16_t *o = out + r * D;
        int64_t h = 0;
        float ss = 0.0f;
#ifdef LMF_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; h + 16 <= D; h += 16) {
            const __m512 v = load_bf16(xr + h);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; h < D; h++) ss += bf16_to_f32(xr[h]) * bf16_to_f32(xr[h]);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        h = 0;
#ifdef LMF_AVX512
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; h + 16 <= D; h += 16)
            store_bf16(o + h, round_bf16_ps(_mm512_mul_ps(load_bf16(w + h),
                                                          round_bf16_ps(_mm512_mul_ps(load_bf16(xr + h), vinv)))));
#endif
        for (; h < D; h++)
            o[h] = f32_to_bf16(bf16_to_f32(w[h]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[h]) * inv)));
    }
}

void lmf_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t D, float eps,
                      int64_t threads) {
    const norm_args a = {x, w, out, D, eps};
    split_rows(rmsnorm_bf16_rows, &a, rows, PER(D), threads);
}

typedef struct {
    void *x;
    const void *cos, *sin;
    int64_t heads, H, stride;  /* stride: elements from one token's row of x to the next (heads * H: packed rows) */
} rope_args;

/* Rotary embedding in place on x (T, heads, H) with cos/sin (T, H): x*cos + rotate_half(x)*sin,
 * rotate_half(x) = (-x2, x1); both products and the sum rounded as torch rounds them. */
static void rope_bf16_rows(const void *args, int64_t t0, int64_t t1) {
    const rope_args *a = (const rope_args *)args;
    uint16_t *x = (uint16_t *)a->x;
    const uint16_t *cos = (const uint16_t *)a->cos, *sin = (const uint16_t *)a->sin;
    const int64_t heads = a->heads, H = a->H, half = H / 2;
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *c = cos + t * H, *s = sin + t * H;
        for (int64_t n = 0; n < heads; n++) {
            uint16_t *lo = x + t * a->stride + n * H, *hi = lo + half;
            int64_t h = 0;
#ifdef LMF_AVX512
            for (; h + 16 <= half; h += 16) {
                const __m512 l = load_bf16(lo + h), u = load_bf16(hi + h);
                const __m512 a = round_bf16_ps(_mm512_mul_ps(l, load_bf16(c + h)));
                const __m512 b = round_bf16_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), u), load_bf16(s + h)));
                const __m512 a2 = round_bf16_ps(_mm512_mul_ps(u, load_bf16(c + half + h)));
                const __m512 b2 = round_bf16_ps(_mm512_mul_ps(l, load_bf16(s + half + h)));
                store_bf16(lo + h, round_bf16_ps(_mm512_add_ps(a, b)));
                store_bf16(hi + h, round_bf16_ps(_mm512_add_ps(a2, b2)));
            }
#endif
            for (; h < half; h++) {
                const float l = bf16_to_f32(lo[h]), u = bf16_to_f32(hi[h]);
                const float a = bf16_to_f32(f32_to_bf16(l * bf16_to_f32(c[h])));
                const float b = bf16_to_f32(f32_to_bf16(-u * bf16_to_f32(s[h])));
                const float a2 = bf16_to_f32(f32_to_bf16(u * bf16_to_f32(c[h + half])));
                const float b2 = bf16_to_f32(f32_to_bf16(l * bf16_to_f32(s[h + half])));
                lo[h] = f32_to_bf16(a + b);
                hi[h] = f32_to_bf16(a2 + b2);
            }
        }
    }
}

void lmf_rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t T, int64_t heads, int64_t H,
                   int64_t threads) {
    const rope_args a = {x, cos, sin, heads, H, heads * H};
    split_rows(rope_bf16_rows, &a, T, PER(heads * H), threads);
}

/* SwiGLU's middle: out = bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)). */
void lmf_silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef LMF_AVX512
    for (; i + 16 <= n; i += 16) {
        const __m512 sv = round_bf16_ps(silu_ps(load_bf16(g + i)));
        store_bf16(out + i, round_bf16_ps(_mm512_mul_ps(sv, load_bf16(u + i))));
    }
#endif
    for (; i < n; i++) {
        const float gv = bf16_to_f32(g[i]);
        out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gv / (1.0f + expf(-gv)))) * bf16_to_f32(u[i]));
    }
}

/* Float32 bodies of the elementwise ops, in torch's float32 arithmetic (plain loops; -O3 vectorizes them). */

/* sum of x[h]^2: 32 partial sums (x[h] into sum h % 32, each in order), then halved pairwise. The compiler keeps
 * the partial sums in vector registers: a sum in one chain cost a 1,024-wide row ~4,100 cycles of FMA latency
 * (~1 ms a prefill chunk's 512 rows), this ~150. */
static float sum_squares_f32(const float *x, int64_t D) {
    float a[32] = {0};
    int64_t h = 0;
    for (; h + 32 <= D; h += 32)
        for (int i = 0; i < 32; i++) a[i] += x[h + i] * x[h + i];
    for (int i = 0; h < D; h++, i++) a[i] += x[h] * x[h];
    for (int w = 16; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}

static void rmsnorm_f32_rows(const void *args, int64_t r0, int64_t r1) {
    const norm_args *a = (const norm_args *)args;
    const float *x = (const float *)a->x, *w = (const float *)a->w;
    float *out = (float *)a->out;
    const int64_t D = a->D;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        const float inv = 1.0f / sqrtf(sum_squares_f32(xr, D) / (float)D + a->eps);
        for (int64_t h = 0; h < D; h++) out[r * D + h] = w[h] * (xr[h] * inv);
    }
}

void lmf_rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t D, float eps, int64_t threads) {
    const norm_args a = {x, w, out, D, eps};
    split_rows(rmsnorm_f32_rows, &a, rows, PER(D), threads);
}

static void rope_f32_rows(const void *args, int64_t t0, int64_t t1) {
    const rope_args *a = (const rope_args *)args;
    float *x = (float *)a->x;
    const float *cos = (const float *)a->cos, *sin = (const float *)a->sin;
    const int64_t heads = a->heads, H = a->H, half = H / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = cos + t * H, *s = sin + t * H;
        for (int64_t n = 0; n < heads; n++) {
            float *lo = x + t * a->stride + n * H, *hi = lo + half;
            for (int64_t h = 0; h < half; h++) {
                const float l = lo[h], u = hi[h];
                lo[h] = l * c[h] + (-u) * s[h];
                hi[h] = u * c[h + half] + l * s[h + half];
            }
        }
    }
}

void lmf_rope_f32(float *x, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t H, int64_t threads) {
    const rope_args a = {x, cos, sin, heads, H, heads * H};
    split_rows(rope_f32_rows, &a, T, PER(heads * H), threads);
}

/* lmf_rope_f32 on rows `stride` floats apart: q or k where they lie in the fused q/k/v projection's output, rotated
 * there (no copy of each out first: ~2.5 ms of a 512-token prefill of the 300M). The same bits. Returns 0. */
int lmf_rope_f32_strided(float *x, int64_t stride, const float *cos, const float *sin, int64_t T, int64_t heads,
                         int64_t H, int64_t threads) {
    const rope_args a = {x, cos, sin, heads, H, stride};
    split_rows(rope_f32_rows, &a, T, PER(heads * H), threads);
    return 0;
}

/* silu(g) * u: 16 at a time (`silu_ps`) where the build has AVX-512 (relative error ~2e-7 against libm's expf,
 * float32 rounding's order; a prefill chunk's 512 x 2,816 took 3.8 ms a layer in the scalar loop), then the plain
 * loop. */
static inline void silu_mul_f32_span(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#ifdef LMF_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(silu_ps(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void lmf_silu_mul_f32(const float *g, const float *u, float *out, int64_t n) {
    silu_mul_f32_span(g, u, out, n);
}

typedef struct {
    const void *gu;
    void *out;
    int64_t I;
} silu_args;

static void silu_mul_f32_rows(const void *args, int64_t r0, int64_t r1) {
    const silu_args *a = (const silu_args *)args;
    const float *gu = (const float *)a->gu;
    const int64_t I = a->I;
    for (int64_t r = r0; r < r1; r++) silu_mul_f32_span(gu + r * 2 * I, gu + r * 2 * I + I, (float *)a->out + r * I, I);
}

static void silu_mul_bf16_rows(const void *args, int64_t r0, int64_t r1) {
    const silu_args *a = (const silu_args *)args;
    const uint16_t *gu = (const uint16_t *)a->gu;
    const int64_t I = a->I;
    for (int64_t r = r0; r < r1; r++) lmf_silu_mul_bf16(gu + r * 2 * I, gu + r * 2 * I + I, (uint16_t *)a->out + r * I, I);
}

/* The MLP's middle on a fused gate_up output gu (rows, 2 I), each row [gate | up], into out (rows, I): no copy of
 * the two halves first (two chunk().contiguous() copies of a prefill chunk's 512 x 5,632 cost more than the op). */
void lmf_silu_mul_rows_f32(const float *gu, float *out, int64_t rows, int64_t I, int64_t threads) {
    const silu_args a = {gu, out, I};
    split_rows(silu_mul_f32_rows, &a, rows, PER(I), threads);
}

void lmf_silu_mul_rows_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I, int64_t threads) {
    const silu_args a = {gu, out, I};
    split_rows(silu_mul_bf16_rows, &a, rows, PER(I), threads);
}
