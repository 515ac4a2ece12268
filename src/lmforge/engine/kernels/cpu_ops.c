/* CPU kernels of the inference engine, bfloat16. Paged decode attention: every decoding sequence of a
 * step in one call, reading each sequence's blocks once, in place. Then the K/V write and the
 * elementwise ops of a Llama layer (RMSNorm, RoPE, SwiGLU's silu * up) at the end of the file.
 *
 * For every decoding sequence s (one query token) and kv head g, the G = N / K query heads of the
 * group attend over the first lens[s] tokens of the sequence; token j lives in pool row
 * block_tables[s * M + j / B] * B + j % B. Scores, the running max and sum of an online softmax
 * (Milakov & Gimelshein 2018, as in FlashAttention) and the output accumulate in float32, TILE
 * tokens at a time: no gather, no padding, no per-sequence call. The output is rounded to
 * bfloat16 (nearest even).
 *
 * Layouts (contiguous): q and out (T, N, H); pools (P * B, K, H); rows[s] is the query's row in q
 * and out. Returns 0, or -1 for a shape this file does not handle (the caller falls back).
 *
 * Two bodies of one algorithm: AVX-512 intrinsics where the compiler targets AVX-512F (bf16 dot
 * products with AVX512-BF16 when present), and portable C elsewhere (or with -DLMF_PORTABLE, which
 * the tests build to check it). No Python or torch headers: lmforge compiles this file with the
 * system C compiler at first use (`lmforge.engine.kernels`) and calls it through ctypes.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define MAX_H 256
#define MAX_G 16
#define MAX_N 64  /* query heads, AVX-512 body */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* K/V of this step's T tokens into their pool rows (vLLM's reshape_and_cache): row_len = K * H. */
void lmf_write_kv_bf16(const uint16_t *k, const uint16_t *v, const int64_t *slots, int64_t T, int64_t row_len,
                       uint16_t *k_pool, uint16_t *v_pool) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_pool + slots[t] * row_len, k + t * row_len, (size_t)row_len * 2);
        memcpy(v_pool + slots[t] * row_len, v + t * row_len, (size_t)row_len * 2);
    }
}

/* One tile of the online softmax for one query head, in float32 (the scalar bodies): p[0..nt) holds the
 * tile's scaled scores on entry and exp(score - new max) on exit; the running max and sum, and the
 * accumulator acc[0..H), are rescaled to the new max. */
static inline void softmax_tile(float *p, int64_t nt, float *mx, float *sum, float *acc, int64_t H) {
    float m = *mx;
    for (int64_t i = 0; i < nt; i++) m = p[i] > m ? p[i] : m;
    const float alpha = expf(*mx - m);
    float tile_sum = 0.0f;
    for (int64_t i = 0; i < nt; i++) {
        p[i] = expf(p[i] - m);
        tile_sum += p[i];
    }
    *sum = *sum * alpha + tile_sum;
    *mx = m;
    for (int64_t h = 0; h < H; h++) acc[h] *= alpha;
}

/* The pool row (an index into P * B * K head rows) of kv head g for a tile's tokens [t0, t0 + nt). */
static inline void tile_rows(const int32_t *table, int64_t t0, int64_t nt, int64_t B, int64_t K, int64_t g,
                             int64_t *row) {
    for (int64_t i = 0; i < nt; i++) {
        const int64_t j = t0 + i;
        row[i] = ((int64_t)table[j / B] * B + j % B) * K + g;
    }
}

#if defined(__AVX512F__) && !defined(LMF_PORTABLE)
#include <immintrin.h>

static inline __m512 load_bf16(const uint16_t *p) {  /* 16 bfloat16 -> 16 float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* exp(x): 2^n * p(f), f in [-ln2/2, ln2/2], rel. error ~2e-7; x below -87 gives exp(-87) ~1.6e-38
 * (so -inf gives that too: callers mask), above 88.7 inf. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2 = _mm512_set1_ps(0.693147180559945309f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, ln2, x);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result = the sum of a[i]'s 16 lanes. A transpose-and-add tree: 45 shuffles and adds
 * for the 16 sums (about 3 each), instead of 16 separate horizontal reductions (about 8 each). */
static inline __m512 hsum16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (a2i, a2i+1, a2i, a2i+1) partial sums */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: (a4i, a4i+1, a4i+2, a4i+3) partial sums */
        c[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    /* c[i]'s four 128-bit lanes each hold a partial of sums 4i..4i+3: add lanes pairwise across c's */
    for (int i = 0; i < 2; i++)  /* 128-bit lanes: (c2i.0+c2i.1, c2i.2+c2i.3, c2i+1.0+c2i+1.1, c2i+1.2+c2i+1.3) */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    /* d[0] lanes: (0-3 half A, 0-3 half B, 4-7 A, 4-7 B); d[1] likewise for 8-15 */
    const __m512 lo = _mm512_shuffle_f32x4(d[0], d[1], 0x88), hi = _mm512_shuffle_f32x4(d[0], d[1], 0xdd);
    return _mm512_add_ps(lo, hi);  /* lanes: sums 0-3, 4-7, 8-11, 12-15 */
}

/* One sequence, all heads: each tile's K and V rows are read once (head by head: scores, softmax
 * update, V accumulation), while the next tile's rows are prefetched. */
static void decode_seq(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *table,
                       int64_t len, int64_t N, int64_t K, int64_t H, int64_t B, float scale, uint16_t *out) {
    const int64_t C = H / 16, G = N / K;  /* 16-float chunks per head vector; query heads per kv head */
    __m512 acc[MAX_N * MAX_H / 16];
    float mx[MAX_N], sum[MAX_N], p[MAX_N][TILE];  /* p: this tile's softmax numerators per head */
#ifdef __AVX512BF16__
    __m512bh qb[MAX_N * MAX_H / 32];
    for (int64_t c = 0; c < N * H / 32; c++) qb[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
#else
    __m512 qf[MAX_N * MAX_H / 16];
    for (int64_t c = 0; c < N * C; c++) qf[c] = load_bf16(q + c * 16);
#endif
    for (int64_t c = 0; c < N * C; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; n++) {
        mx[n] = -INFINITY;
        sum[n] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row_len = K * H;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        const __mmask16 live = (__mmask16)((1u << nt) - 1u);
        const uint16_t *kr[TILE], *vr[TILE];
        for (int64_t i = 0; i < nt; i++) {
            const int64_t j = t0 + i, row = (int64_t)table[j / B] * B + j % B;
            kr[i] = k_pool + row * row_len;
            vr[i] = v_pool + row * row_len;
        }
        /* the next tile's rows, requested while this one computes (+8-10% measured: the hardware
         * prefetcher loses the stream at every jump between blocks) */
        for (int64_t j = t0 + TILE; j < t0 + 2 * TILE && j < len; j++) {
            const int64_t row = (int64_t)table[j / B] * B + j % B;
            const char *kp = (const char *)(k_pool + row * row_len), *vp = (const char *)(v_pool + row * row_len);
            for (int64_t b = 0; b < row_len * 2; b += 64) {
                _mm_prefetch(kp + b, _MM_HINT_T0);
                _mm_prefetch(vp + b, _MM_HINT_T0);
            }
        }
        for (int64_t n = 0; n < N; n++) {
            const int64_t koff = (n / G) * H;
            __m512 d[TILE];
            for (int64_t i = 0; i < nt; i++) {
#ifdef __AVX512BF16__
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < H / 32; c++)
                    a = _mm512_dpbf16_ps(a, qb[n * H / 32 + c], (__m512bh)_mm512_loadu_si512(kr[i] + koff + c * 32));
#else
                __m512 a = _mm512_mul_ps(qf[n * C], load_bf16(kr[i] + koff));
                for (int64_t c = 1; c < C; c++) a = _mm512_fmadd_ps(qf[n * C + c], load_bf16(kr[i] + koff + c * 16), a);
#endif
                d[i] = a;
            }
            for (int64_t i = nt; i < TILE; i++) d[i] = _mm512_setzero_ps();
            __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, hsum16(d), vscale);
            const float m = fmaxf(mx[n], _mm512_reduce_max_ps(s));
            const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m))));
            const float alpha = expf(mx[n] - m);  /* 0 on the first tile (exp(-inf)) */
            sum[n] = sum[n] * alpha + _mm512_reduce_add_ps(e);
            mx[n] = m;
            _mm512_storeu_ps(p[n], e);
            /* this head's output: accumulators in registers across the tile's tokens */
            const int64_t voff = (n / G) * H;
            __m512 o[MAX_H / 16];
            const __m512 va = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < C; c++) o[c] = _mm512_mul_ps(acc[n * C + c], va);
            for (int64_t i = 0; i < nt; i++) {
                const __m512 w = _mm512_set1_ps(p[n][i]);
                for (int64_t c = 0; c < C; c++) o[c] = _mm512_fmadd_ps(w, load_bf16(vr[i] + voff + c * 16), o[c]);
            }
            for (int64_t c = 0; c < C; c++) acc[n * C + c] = o[c];
        }
    }
    for (int64_t n = 0; n < N; n++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[n]);
        float o[MAX_H];
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[n * C + c], inv));
        for (int64_t h = 0; h < H; h++) out[n * H + h] = f32_to_bf16(o[h]);
    }
}

#else /* portable C: the float32 body below (`decode_one_any`), reading bf16 q and K/V */

static void decode_one_any(const void *q, const void *k_pool, const void *v_pool, const uint16_t *k_scales,
                           const uint16_t *v_scales, const int32_t *table, int64_t len, int64_t g, int64_t G,
                           int64_t K, int64_t H, int64_t B, float scale, void *out, int act, int kv);

#endif

typedef struct {
    const uint16_t *q, *k_pool, *v_pool;
    const int32_t *block_tables, *lens;
    const int64_t *rows;
    int64_t M, first, last, N, K, H, B;
    float scale;
    uint16_t *out;
} decode_job;

static void *decode_range(void *arg) {  /* sequences [first, last) */
    const decode_job *j = (const decode_job *)arg;
    const int64_t N = j->N, H = j->H;
    for (int64_t s = j->first; s < j->last; s++) {
#if defined(__AVX512F__) && !defined(LMF_PORTABLE)
        decode_seq(j->q + j->rows[s] * N * H, j->k_pool, j->v_pool, j->block_tables + s * j->M, j->lens[s], N, j->K, H,
                   j->B, j->scale, j->out + j->rows[s] * N * H);
#else
        const int64_t G = N / j->K;
        for (int64_t g = 0; g < j->K; g++)
            decode_one_any(j->q + (j->rows[s] * N + g * G) * H, j->k_pool, j->v_pool, NULL, NULL,
                           j->block_tables + s * j->M, j->lens[s], g, G, j->K, H, j->B, j->scale,
                           j->out + (j->rows[s] * N + g * G) * H, 0, 0);
#endif
    }
    return NULL;
}

#define MAX_THREADS 64

/* Run fn on jobs[0 .. threads) (each `size` bytes), this thread taking job 0: OpenMP when built with it
 * (torch's own runtime: libgomp.so.1 is loaded once per process, and its worker threads, already
 * spinning after the last matmul, take the jobs; no second pool fights them for cores), else pthreads,
 * doing here any job that gets no thread. */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t t = 0; t < threads; t++) fn((char *)jobs + t * size);
#else
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, fn, (char *)jobs + t * size) == 0;
    fn(jobs);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            fn((char *)jobs + t * size);  /* no thread to be had: do it here */
    }
#endif
}

/* Work handed out in chunks from a shared counter (`next`), ~16 chunks a thread and at least 8 rows
 * each, so that a thread that starts late or runs slower (a busy sibling core) takes fewer and none
 * waits long for it (matmul rows: after a contiguous 7/8 of each share, `take_rows`). */
static int64_t chunk_rows(int64_t N, int64_t threads) {
    const int64_t chunk = (N / (16 * threads) + 7) / 8 * 8;
    return chunk < 8 ? 8 : chunk;
}

/* The next chunk [*n0, *n1) of rows [0, N), or 0 when none is left. */
__attribute__((unused)) /* its one user, the panel GEMM, is absent from builds without AVX2 + FMA */
static int take_chunk(int64_t *next, int64_t chunk, int64_t N, int64_t *n0, int64_t *n1) {
    *n0 = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * chunk;
    if (*n0 >= N) return 0;
    *n1 = *n0 + chunk < N ? *n0 + chunk : N;
    return 1;
}

/* As take_chunk, for a matmul's weight rows, guided: the first `threads` chunks are each 7/8 of a thread's
 * share of the rows, one contiguous run, and the last eighth goes in chunks of `chunk` rows to whichever
 * thread is free (a late or slowed thread still takes less). Chunks of 1/16 of a share throughout cost a
 * batch-1 step ~20%: each chunk is a new stream the hardware prefetcher must pick up again, 16 a thread in
 * each of a step's 96 matmuls (the 300M's int4 g32 layer shapes, 2 threads, Zen 4: 7.65 -> 6.09 ms at 1 row,
 * 11.2 -> 9.9 at 4; `python scripts/kernels_ab.py matmuls --old-rev efd2024`; a fully static split, a
 * throwaway variant, 0.96x of this, with nothing left to balance a slowed thread). */
#define GUIDED_NUM 7
#define GUIDED_DEN 8
static int take_rows(int64_t *next, int64_t chunk, int64_t N, int64_t threads, int64_t *n0, int64_t *n1) {
    const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    const int64_t big = N * GUIDED_NUM / GUIDED_DEN / threads / 8 * 8;
    if (i < threads && big > 0) {
        *n0 = i * big;
        *n1 = *n0 + big;
        return 1;
    }
    *n0 = big > 0 ? threads * big + (i - threads) * chunk : i * chunk;  /* too few rows for a share: chunks only */
    if (*n0 >= N) return 0;
    *n1 = *n0 + chunk < N ? *n0 + chunk : N;
    return 1;
}

/* Cut sequences [0, S) into consecutive ranges [bounds[t], bounds[t + 1]) of about equal total context
 * (the work is K/V bytes read), one per thread. Returns how many ranges, or -1 if a sequence is empty. */
static int64_t split_by_context(const int32_t *lens, int64_t S, int64_t threads, int64_t *bounds) {
    int64_t total = 0;
    for (int64_t s = 0; s < S; s++) {
        if (lens[s] < 1) return -1;
        total += lens[s];
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > S) threads = S;
    if (threads < 1 || total < 256) threads = 1;  /* the threads are warm OpenMP workers: worth it from ~256 tokens */
    int64_t s = 0, acc = 0;
    bounds[0] = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t goal = total * (t + 1) / threads;
        while (s < S && (t == threads - 1 || acc + lens[s] / 2 < goal)) acc += lens[s++];
        bounds[t + 1] = s;
    }
    return threads;
}

/* `threads` > 1: the sequences are cut into that many consecutive ranges of about equal total
 * context (the work is K/V bytes read), each run by its own thread (OpenMP when built with it,
 * else pthreads), this one included. */
int lmf_paged_decode_bf16(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool,
                          const int32_t *block_tables, int64_t M, const int32_t *lens, const int64_t *rows,
                          int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale, uint16_t *out,
                          int64_t threads) {
    if (K < 1 || N % K != 0 || N / K > MAX_G || H > MAX_H || H % 16 != 0 || B < 1) return -1;
#if defined(__AVX512F__) && !defined(LMF_PORTABLE)
    if (N > MAX_N || (N * H) % 32 != 0) return -1;
#ifdef __AVX512BF16__
    if (H % 32 != 0) return -1;
#endif
#endif
    int64_t bounds[MAX_THREADS + 1];
    threads = split_by_context(lens, S, threads, bounds);
    if (threads < 0) return -1;
    decode_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (decode_job){q, k_pool, v_pool, block_tables, lens, rows, M, bounds[t], bounds[t + 1], N, K, H, B,
                               scale, out};
    run_jobs(decode_range, jobs, sizeof jobs[0], threads);
    return 0;
}

/* ---- elementwise ops of a Llama layer, bfloat16 in and out ---------------------------------------
 * Each follows the rounding of the torch ops it replaces (every torch bf16 op computes in float32
 * and rounds its result to bfloat16), so outputs match torch's bit for bit except where a float32
 * reduction (RMSNorm's mean) or exp (SiLU) is summed or approximated differently. */

#if defined(__AVX512F__) && !defined(LMF_PORTABLE)
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
#define VEC 1
#else
#define VEC 0
#endif

/* RMSNorm as transformers computes it: y = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(w * y). */
void lmf_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t D, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * D;
        uint16_t *o = out + r * D;
        int64_t h = 0;
        float ss = 0.0f;
#if VEC
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
#if VEC
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; h + 16 <= D; h += 16)
            store_bf16(o + h, round_bf16_ps(_mm512_mul_ps(load_bf16(w + h),
                                                          round_bf16_ps(_mm512_mul_ps(load_bf16(xr + h), vinv)))));
#endif
        for (; h < D; h++)
            o[h] = f32_to_bf16(bf16_to_f32(w[h]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[h]) * inv)));
    }
}

/* Rotary embedding in place on x (T, heads, H) with cos/sin (T, H): x*cos + rotate_half(x)*sin,
 * rotate_half(x) = (-x2, x1); both products and the sum rounded as torch rounds them. */
void lmf_rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t T, int64_t heads, int64_t H) {
    const int64_t half = H / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * H, *s = sin + t * H;
        for (int64_t n = 0; n < heads; n++) {
            uint16_t *lo = x + (t * heads + n) * H, *hi = lo + half;
            int64_t h = 0;
#if VEC
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

/* SwiGLU's middle: out = bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)). */
void lmf_silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if VEC
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = load_bf16(g + i);
        /* exp(-g) overflows to inf for g < -88.7 (silu -> -0; torch gives a denormal) */
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 sv = round_bf16_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
        store_bf16(out + i, round_bf16_ps(_mm512_mul_ps(sv, load_bf16(u + i))));
    }
#endif
    for (; i < n; i++) {
        const float gv = bf16_to_f32(g[i]);
        out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gv / (1.0f + expf(-gv)))) * bf16_to_f32(u[i]));
    }
}

/* ---- float32 activations and an int8 KV cache ------------------------------------------------------
 * CPUs without native bf16 (AVX2-only) run the engine in float32, and `kv_cache_dtype=int8` stores
 * K/V as int8 codes with one bfloat16 scale per token per kv head (value = code * scale). One portable
 * body serves every combination: each K or V row's head vector is first widened to float32 (a loop
 * the compiler vectorizes for the target), then the same online softmax as above. act: 0 bf16, 1 f32;
 * kv: 0 bf16, 1 f32, 2 int8. */

static inline float load_act(const void *p, int act, int64_t i) {
    return act ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_act(void *p, int act, int64_t i, float x) {
    if (act) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = f32_to_bf16(x);
}

/* the head vector at pool row `row` (an index into (P * B * K) head rows), widened to float32 */
static inline void load_head(const void *pool, const uint16_t *scales, int kv, int64_t row, int64_t H, float *dst) {
    if (kv == 1) {
        memcpy(dst, (const float *)pool + row * H, (size_t)H * 4);
    } else if (kv == 2) {
        const int8_t *c = (const int8_t *)pool + row * H;
        const float s = bf16_to_f32(scales[row]);
        for (int64_t h = 0; h < H; h++) dst[h] = (float)c[h] * s;
    } else {
        const uint16_t *b = (const uint16_t *)pool + row * H;
        for (int64_t h = 0; h < H; h++) dst[h] = bf16_to_f32(b[h]);
    }
}

static void decode_one_any(const void *q, const void *k_pool, const void *v_pool, const uint16_t *k_scales,
                           const uint16_t *v_scales, const int32_t *table, int64_t len, int64_t g, int64_t G,
                           int64_t K, int64_t H, int64_t B, float scale, void *out, int act, int kv) {
    float qf[MAX_G][MAX_H], acc[MAX_G][MAX_H], p[MAX_G][TILE], mx[MAX_G], sum[MAX_G], row_f[MAX_H];
    for (int64_t n = 0; n < G; n++) {
        for (int64_t h = 0; h < H; h++) {
            qf[n][h] = load_act(q, act, n * H + h);
            acc[n][h] = 0.0f;
        }
        mx[n] = -INFINITY;
        sum[n] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        int64_t row[TILE];
        tile_rows(table, t0, nt, B, K, g, row);
        for (int64_t i = 0; i < nt; i++) {  /* scores: each K row widened once, dotted with every query head */
            const float *kr = kv == 1 ? (const float *)k_pool + row[i] * H : row_f;  /* float32 pool: read in place */
            if (kv != 1) load_head(k_pool, k_scales, kv, row[i], H, row_f);
            for (int64_t n = 0; n < G; n++) {
                float d = 0.0f;
                /* a vector reduction (lanes summed at the end): without it -O3 keeps the float sum scalar */
#pragma omp simd reduction(+ : d)
                for (int64_t h = 0; h < H; h++) d += qf[n][h] * kr[h];
                p[n][i] = d * scale;
            }
        }
        for (int64_t n = 0; n < G; n++) softmax_tile(p[n], nt, &mx[n], &sum[n], acc[n], H);
        for (int64_t i = 0; i < nt; i++) {
            const float *vr = kv == 1 ? (const float *)v_pool + row[i] * H : row_f;
            if (kv != 1) load_head(v_pool, v_scales, kv, row[i], H, row_f);
            for (int64_t n = 0; n < G; n++)
                for (int64_t h = 0; h < H; h++) acc[n][h] += p[n][i] * vr[h];
        }
    }
    for (int64_t n = 0; n < G; n++)
        for (int64_t h = 0; h < H; h++) store_act(out, act, n * H + h, acc[n][h] / sum[n]);
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(LMF_PORTABLE)
#include <immintrin.h>
#define LMF_ATTN_AVX2 1
/* exp(x) for x <= 0 (softmax arguments), as exp_ps above in 256 bits: 2^n * p(f); x below -87 gives
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
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void heads_scores(
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

/* acc0 (and acc1) = acc * alpha + sum_i p_i * V_i over a tile's nt tokens for SB query heads sharing each
 * widened V value: 32 floats of each accumulator in registers across the tokens (8 past a multiple of 32). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void heads_values(
        const char *v_pool, const int64_t *row, int64_t g, int64_t nt, int64_t H, int64_t rb, const float *p0,
        const float *p1, float alpha0, float alpha1, float *acc0, float *acc1, const int SB, const int bf16) {
    const int es = bf16 ? 2 : 4;
    const __m256 al0 = _mm256_set1_ps(alpha0), al1 = _mm256_set1_ps(alpha1);
    int64_t h = 0;
    for (; h + 32 <= H; h += 32) {
        __m256 a[2][4];
        for (int c = 0; c < 4; c++) {
            a[0][c] = _mm256_mul_ps(_mm256_load_ps(acc0 + h + 8 * c), al0);
            if (SB == 2) a[1][c] = _mm256_mul_ps(_mm256_load_ps(acc1 + h + 8 * c), al1);
        }
        for (int64_t i = 0; i < nt; i++) {
            const char *vr = v_pool + (row[i] + g) * rb + h * es;
            const __m256 w0 = _mm256_set1_ps(p0[i]), w1 = SB == 2 ? _mm256_set1_ps(p1[i]) : w0;
            for (int c = 0; c < 4; c++) {
                const __m256 v = kv_load8(vr + 8 * c * es, bf16);
                a[0][c] = _mm256_fmadd_ps(w0, v, a[0][c]);
                if (SB == 2) a[1][c] = _mm256_fmadd_ps(w1, v, a[1][c]);
            }
        }
        for (int c = 0; c < 4; c++) {
            _mm256_store_ps(acc0 + h + 8 * c, a[0][c]);
            if (SB == 2) _mm256_store_ps(acc1 + h + 8 * c, a[1][c]);
        }
    }
    for (; h < H; h += 8) {
        __m256 a0 = _mm256_mul_ps(_mm256_load_ps(acc0 + h), al0);
        __m256 a1 = SB == 2 ? _mm256_mul_ps(_mm256_load_ps(acc1 + h), al1) : a0;
        for (int64_t i = 0; i < nt; i++) {
            const __m256 v = kv_load8(v_pool + (row[i] + g) * rb + h * es, bf16);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[i]), v, a0);
            if (SB == 2) a1 = _mm256_fmadd_ps(_mm256_set1_ps(p1[i]), v, a1);
        }
        _mm256_store_ps(acc0 + h, a0);
        if (SB == 2) _mm256_store_ps(acc1 + h, a1);
    }
}

/* decode_one_any for float32 q over a float32 or bfloat16 K/V pool, for kv heads [g0, g1) of one sequence
 * at once (AVX2 CPUs without bf16 run the engine in float32; a bf16 checkpoint or int8-activation model keeps
 * its K/V in bf16 there, half the bytes), H a multiple of 8, (g1 - g0) * G <= MAX_N. The same online softmax
 * as the others, arranged for the memory and the core:
 *   - tile-outer, head-inner: a tile's 16 tokens are read for all the heads [g0, g1) together, so each
 *     token's rows of those heads are one contiguous run of the pool ((g1 - g0) * H values; the whole token
 *     row when one thread takes every head), and the next tile's runs are prefetched while this one computes.
 *     Head-outer order (one head over every token, then the next) read 128-256 B pieces 1-2 KB apart and
 *     ran at ~5 GB/s from memory against ~25 for a streaming read (Zen 4, 2 threads).
 *   - scores 8 tokens at a time: 8 independent FMA chains, then one transposing reduction (`hsum8x8`)
 *     instead of 8 horizontal sums; the tile's softmax in vectors;
 *   - V: each 64-float slice of a query head's accumulator (16 past a multiple of 64) stays in registers
 *     over the tile's tokens,
 *     rescaled by the tile's alpha on load (one load and store a tile, not a store-forwarded
 *     read-modify-write a token).
 * `bf16` is a constant in each of the two callers below, so each gets its own body. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void decode_heads_avx2(
        const float *q, const char *k_pool, const char *v_pool, const int32_t *table, int64_t t_begin, int64_t len,
        int64_t pf_len, int64_t g0, int64_t g1, int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out,
        float *part, const int bf16) {
    float acc[MAX_N * MAX_H] __attribute__((aligned(32)));
    float p[MAX_N][TILE] __attribute__((aligned(32))), mx[MAX_N], sum[MAX_N], alpha[MAX_N];
    const int64_t es = bf16 ? 2 : 4, rb = H * es, NS = (g1 - g0) * G, run = (g1 - g0) * rb;
    for (int64_t i = 0; i < NS * H; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
    for (int64_t s = 0; s < NS; s++) {
        mx[s] = -INFINITY;
        sum[s] = 0.0f;
    }
    int64_t row[TILE], next[TILE];  /* pool rows of kv head g0 for the tile's tokens; heads g0.. follow */
    tile_rows(table, t_begin, len < TILE ? len : TILE, B, K, g0, row);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t nt = len - t0 < TILE ? len - t0 : TILE;
        /* the next tile's runs, into L2 (into L1 they evicted this tile's: 1.1-1.3x slower, a throwaway
         * variant); a partition's last tile prefetches the next partition's first (pf_len: the tokens left in
         * the sequence from t_begin) */
        const int64_t left = pf_len - t0 - nt, nn = left < TILE ? left : TILE;
        if (nn > 0) {
            tile_rows(table, t_begin + t0 + TILE, nn, B, K, g0, next);
            for (int64_t i = 0; i < nn; i++)
                for (int64_t b = 0; b < run; b += 64) {
                    _mm_prefetch(k_pool + next[i] * rb + b, _MM_HINT_T1);
                    _mm_prefetch(v_pool + next[i] * rb + b, _MM_HINT_T1);
                }
        }
        for (int64_t g = 0; g < g1 - g0; g++)  /* scores: query heads in pairs where G is even (a K row widened once) */
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                const float *qn = q + ((g0 + g) * G + n) * H;
                if (G % 2)
                    heads_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], NULL, 1, bf16);
                else
                    heads_scores(qn, k_pool, row, g, nt, H, rb, scale, p[st], p[st + 1], 2, bf16);
            }
        for (int64_t st = 0; st < NS; st++) {  /* the tile's online softmax; padding lanes end as 0 */
            for (int64_t i = nt; i < TILE; i++) p[st][i] = -INFINITY;
            const __m256 a = _mm256_load_ps(p[st]), b2 = _mm256_load_ps(p[st] + 8);
            __m256 m8 = _mm256_max_ps(a, b2);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float m = _mm_cvtss_f32(m4) > mx[st] ? _mm_cvtss_f32(m4) : mx[st];
            alpha[st] = expf(mx[st] - m);
            const __m256 mv = _mm256_set1_ps(m);
            const __m256 e0 = exp256(_mm256_sub_ps(a, mv)), e1 = exp256(_mm256_sub_ps(b2, mv));
            _mm256_store_ps(p[st], e0);
            _mm256_store_ps(p[st] + 8, e1);
            for (int64_t i = nt; i < TILE; i++) p[st][i] = 0.0f;
            float tile_sum = 0.0f;
            for (int64_t i = 0; i < nt; i++) tile_sum += p[st][i];
            sum[st] = sum[st] * alpha[st] + tile_sum;
            mx[st] = m;
        }
        for (int64_t g = 0; g < g1 - g0; g++)  /* acc = acc * alpha + sum_i p_i * V_i, a V row widened once a pair */
            for (int64_t n = 0; n < G; n += G % 2 ? 1 : 2) {
                const int64_t st = g * G + n;
                if (G % 2)
                    heads_values(v_pool, row, g, nt, H, rb, p[st], NULL, alpha[st], 0.0f, acc + st * H, NULL, 1, bf16);
                else
                    heads_values(v_pool, row, g, nt, H, rb, p[st], p[st + 1], alpha[st], alpha[st + 1], acc + st * H,
                                 acc + (st + 1) * H, 2, bf16);
            }
        memcpy(row, next, sizeof row);
    }
    if (part != NULL) {  /* a partition of the context: its unnormalized state, merged by `merge_parts` */
        memcpy(part, acc, (size_t)(NS * H) * sizeof(float));
        memcpy(part + NS * H, mx, (size_t)NS * sizeof(float));
        memcpy(part + NS * H + NS, sum, (size_t)NS * sizeof(float));
        return;
    }
    for (int64_t g = 0; g < g1 - g0; g++)
        for (int64_t n = 0; n < G; n++) {
            const int64_t st = g * G + n;
            const __m256 inv = _mm256_set1_ps(1.0f / sum[st]);
            float *o = out + ((g0 + g) * G + n) * H;
            for (int64_t h = 0; h < H; h += 8) _mm256_storeu_ps(o + h, _mm256_mul_ps(_mm256_load_ps(acc + st * H + h), inv));
        }
}

__attribute__((target("avx2,fma"))) static void decode_heads_f32_avx2(const float *q, const void *k_pool,
        const void *v_pool, const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1,
        int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out, float *part) {
    decode_heads_avx2(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                      scale, out, part, 0);
}

__attribute__((target("avx2,fma"))) static void decode_heads_bf16kv_avx2(const float *q, const void *k_pool,
        const void *v_pool, const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1,
        int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out, float *part) {
    decode_heads_avx2(q, (const char *)k_pool, (const char *)v_pool, table, t_begin, len, pf_len, g0, g1, G, K, H, B,
                      scale, out, part, 1);
}

typedef void (*decode_heads_fn)(const float *, const void *, const void *, const int32_t *, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *);
#endif

typedef struct {
    const void *q, *k_pool, *v_pool;
    const uint16_t *k_scales, *v_scales;
    const int32_t *block_tables, *lens;
    const int64_t *rows;
    int64_t M, first, last, N, K, H, B, g0, g1;  /* sequences [first, last), kv heads [g0, g1) */
    float scale;
    void *out;
    int act, kv;
} decode_any_job;

static void *decode_any_range(void *arg) {
    const decode_any_job *j = (const decode_any_job *)arg;
    const int64_t N = j->N, H = j->H, G = N / j->K, es = j->act ? 4 : 2;
#ifdef LMF_ATTN_AVX2
    __builtin_cpu_init();
    const int avx2 = j->act == 1 && (j->kv == 1 || j->kv == 0) && H % 8 == 0 && (j->g1 - j->g0) * G <= MAX_N &&
                     __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const decode_heads_fn body = j->kv == 1 ? decode_heads_f32_avx2 : decode_heads_bf16kv_avx2;
#endif
    for (int64_t s = j->first; s < j->last; s++) {
        const int64_t base = j->rows[s] * N * H * es;
#ifdef LMF_ATTN_AVX2
        if (avx2) {  /* all of this job's kv heads in one pass over the sequence's blocks */
            body((const float *)((const char *)j->q + base), j->k_pool, j->v_pool, j->block_tables + s * j->M, 0,
                 j->lens[s], j->lens[s], j->g0, j->g1, G, j->K, H, j->B, j->scale, (float *)((char *)j->out + base), NULL);
            continue;
        }
#endif
        for (int64_t g = j->g0; g < j->g1; g++) {
            const int64_t off = base + g * G * H * es;
            decode_one_any((const char *)j->q + off, j->k_pool, j->v_pool, j->k_scales, j->v_scales,
                           j->block_tables + s * j->M, j->lens[s], g, G, j->K, H, j->B, j->scale,
                           (char *)j->out + off, j->act, j->kv);
        }
    }
    return NULL;
}

#ifdef LMF_ATTN_AVX2
/* Fewer sequences than threads (batch 1), on the AVX2 body: each sequence's context is cut into fixed
 * partitions of PART_TOKENS tokens (flash-decoding, as vLLM's paged attention v2), each computed on its own
 * (all kv heads over one contiguous token range: whole pool blocks streamed, where a split by kv heads read
 * half of each token's row at a 1-2 KB stride) and merged in a fixed order, so the bits do not depend on the
 * thread count; a thread takes a contiguous run of partitions and prefetches across their edges. The 300M's
 * 24 layers at batch 1, bf16 K/V in random blocks, Zen 4, 2 threads, against the split by kv heads
 * (`python scripts/kernels_ab.py attention --old-rev 9111c25 --kv bfloat16`): 700 tokens of context 0.84x,
 * 1,400 0.79-0.82x the time. Throwaway variants: 64-token partitions cost 1.23x at 200 tokens (the merge
 * and the partitions' starts); 256 give two threads 1 and 2 of 700 tokens' partitions. */
#define PART_TOKENS 128

typedef struct {
    const float *q;
    const void *k_pool, *v_pool;
    const int32_t *block_tables, *lens;
    const int64_t *rows, *item_seq, *item_part;  /* work item i: sequence item_seq[i], partition item_part[i] */
    int64_t M, first, last, N, K, H, B;  /* items [first, last) */
    float scale, *parts;  /* item i's state at parts + i * (N * H + 2 * N) */
    decode_heads_fn body;
} decode_part_job;

static void *decode_part_range(void *arg) {
    const decode_part_job *j = (const decode_part_job *)arg;
    const int64_t N = j->N, H = j->H, G = N / j->K, size = N * H + 2 * N;
    for (int64_t i = j->first; i < j->last; i++) {
        const int64_t s = j->item_seq[i], t0 = j->item_part[i] * PART_TOKENS;
        const int64_t len = j->lens[s] - t0 < PART_TOKENS ? j->lens[s] - t0 : PART_TOKENS;
        j->body(j->q + j->rows[s] * N * H, j->k_pool, j->v_pool, j->block_tables + s * j->M, t0, len,
                j->lens[s] - t0, 0, j->K, G,
                j->K, H, j->B, j->scale, NULL, j->parts + i * size);
    }
    return NULL;
}

/* out = the softmax-weighted merge of a sequence's partitions [p0, p1), in order. */
static void merge_parts(const float *parts, int64_t p0, int64_t p1, int64_t N, int64_t H, float *out) {
    const int64_t size = N * H + 2 * N;
    for (int64_t n = 0; n < N; n++) {
        float m = -INFINITY, total = 0.0f;
        for (int64_t p = p0; p < p1; p++) {
            const float mp = parts[p * size + N * H + n];
            m = mp > m ? mp : m;
        }
        float *o = out + n * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t p = p0; p < p1; p++) {
            const float *st = parts + p * size;
            const float w = expf(st[N * H + n] - m);
            total += st[N * H + N + n] * w;
            for (int64_t h = 0; h < H; h++) o[h] += st[n * H + h] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t h = 0; h < H; h++) o[h] *= inv;
    }
}

static int decode_partitioned(const float *q, const void *k_pool, const void *v_pool, const int32_t *block_tables,
                              int64_t M, const int32_t *lens, const int64_t *rows, int64_t S, int64_t N, int64_t K,
                              int64_t H, int64_t B, float scale, float *out, int64_t threads, decode_heads_fn body) {
    int64_t items = 0;
    for (int64_t s = 0; s < S; s++) items += (lens[s] + PART_TOKENS - 1) / PART_TOKENS;
    int64_t *item_seq = (int64_t *)malloc((size_t)items * 2 * sizeof(int64_t));
    float *parts = (float *)malloc((size_t)(items * (N * H + 2 * N)) * sizeof(float));
    if (item_seq == NULL || parts == NULL) {
        free(item_seq);
        free(parts);
        return -1;
    }
    int64_t *item_part = item_seq + items, i = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t p = 0; p * PART_TOKENS < lens[s]; p++, i++) {
            item_seq[i] = s;
            item_part[i] = p;
        }
    if (threads > items) threads = items;
    decode_part_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)  /* contiguous runs of items: each thread streams one stretch of context */
        jobs[t] = (decode_part_job){q, k_pool, v_pool, block_tables, lens, rows, item_seq, item_part, M,
                                    items * t / threads, items * (t + 1) / threads, N, K, H, B, scale, parts, body};
    run_jobs(decode_part_range, jobs, sizeof jobs[0], threads);
    for (int64_t s = 0, p0 = 0; s < S; s++) {
        const int64_t np = (lens[s] + PART_TOKENS - 1) / PART_TOKENS;
        merge_parts(parts, p0, p0 + np, N, H, out + rows[s] * N * H);
        p0 += np;
    }
    free(item_seq);
    free(parts);
    return 0;
}
#endif

/* As lmf_paged_decode_bf16, for any act/kv pair; scales are (P * B * K) bfloat16 (NULL unless kv = 2).
 * Fewer sequences than threads (batch 1): on the AVX2 body with >= 2 * PART_TOKENS tokens, the context in
 * partitions (`decode_partitioned`); otherwise with >= 512 cached (token, kv head) pairs the kv heads are
 * split across the threads (each head's numbers are the same either way). float32 q on a float32
 * or bfloat16 pool with H % 8 == 0 on an AVX2 CPU run `decode_heads_avx2`; everything else `decode_one_any`. */
int lmf_paged_decode_any(const void *q, const void *k_pool, const void *v_pool, const uint16_t *k_scales,
                         const uint16_t *v_scales, const int32_t *block_tables, int64_t M, const int32_t *lens,
                         const int64_t *rows, int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale,
                         void *out, int64_t threads, int64_t act, int64_t kv) {
    if (K < 1 || N % K != 0 || N / K > MAX_G || H > MAX_H || B < 1 || act < 0 || act > 1 || kv < 0 || kv > 2)
        return -1;
    if (kv == 2 && (k_scales == NULL || v_scales == NULL)) return -1;
    int64_t bounds[MAX_THREADS + 1], total = 0;
    for (int64_t s = 0; s < S; s++) {
        if (lens[s] < 1) return -1;
        total += lens[s];
    }
    const int64_t want = threads < K ? threads : K;
    decode_any_job jobs[MAX_THREADS];
#ifdef LMF_ATTN_AVX2
    __builtin_cpu_init();
    const int64_t pt = threads < MAX_THREADS ? threads : MAX_THREADS;  /* partitions: not bounded by the kv heads */
    if (S < pt && pt > 1 && total >= 2 * PART_TOKENS && act == 1 && (kv == 0 || kv == 1) && H % 8 == 0 &&
        N <= MAX_N && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return decode_partitioned((const float *)q, k_pool, v_pool, block_tables, M, lens, rows, S, N, K, H, B, scale,
                                  (float *)out, pt, kv == 1 ? decode_heads_f32_avx2 : decode_heads_bf16kv_avx2);
#endif
    if (S < want && want > 1 && total * K >= 512) {
        /* fewer sequences than threads (batch 1) and enough K/V to read (at long context this is
         * bandwidth, one core's worth): the kv heads are cut into ranges instead, all sequences each */
        for (int64_t t = 0; t < want; t++)
            jobs[t] = (decode_any_job){q, k_pool, v_pool, k_scales, v_scales, block_tables, lens, rows, M, 0, S, N, K, H,
                                       B, K * t / want, K * (t + 1) / want, scale, out, (int)act, (int)kv};
        run_jobs(decode_any_range, jobs, sizeof jobs[0], want);
        return 0;
    }
    threads = split_by_context(lens, S, threads, bounds);
    if (threads < 0) return -1;
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (decode_any_job){q, k_pool, v_pool, k_scales, v_scales, block_tables, lens, rows, M, bounds[t],
                                   bounds[t + 1], N, K, H, B, 0, K, scale, out, (int)act, (int)kv};
    run_jobs(decode_any_range, jobs, sizeof jobs[0], threads);
    return 0;
}

/* K/V rows of any element size into their pool rows: row_bytes = K * H * sizeof(element). */
void lmf_write_kv_bytes(const void *k, const void *v, const int64_t *slots, int64_t T, int64_t row_bytes,
                        void *k_pool, void *v_pool) {
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)k_pool + slots[t] * row_bytes, (const char *)k + t * row_bytes, (size_t)row_bytes);
        memcpy((char *)v_pool + slots[t] * row_bytes, (const char *)v + t * row_bytes, (size_t)row_bytes);
    }
}

/* float32 K/V rows into a bfloat16 pool (round to nearest even, as torch's .to(torch.bfloat16)): float32
 * activations over a bf16 K/V cache. row_len = K * H. */
void lmf_write_kv_f32_bf16(const float *k, const float *v, const int64_t *slots, int64_t T, int64_t row_len,
                           uint16_t *k_pool, uint16_t *v_pool) {
    for (int64_t t = 0; t < T; t++) {
        uint16_t *kd = k_pool + slots[t] * row_len, *vd = v_pool + slots[t] * row_len;
        const float *ks = k + t * row_len, *vs = v + t * row_len;
        for (int64_t i = 0; i < row_len; i++) {
            kd[i] = f32_to_bf16(ks[i]);
            vd[i] = f32_to_bf16(vs[i]);
        }
    }
}

/* Quantize and write: per token and kv head, scale = bf16(max(absmax / 127, 1e-8)), code =
 * clamp(rint(x / scale), -127, 127) (ties to even, as torch.round): the same bits as the torch path
 * (`lmforge.engine.attention.quantize_kv`). x (T, K, H) in act dtype; pools (rows, K, H) int8; scales
 * (rows, K) bfloat16. */
static void quantize_rows(const void *x, int act, const int64_t *slots, int64_t T, int64_t K, int64_t H,
                          int8_t *pool, uint16_t *scales) {
    float row_f[MAX_H];
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < K; g++) {
            float amax = 0.0f;
            for (int64_t h = 0; h < H; h++) {
                row_f[h] = load_act(x, act, (t * K + g) * H + h);
                amax = fmaxf(amax, fabsf(row_f[h]));
            }
            const float sc = fmaxf(amax / 127.0f, 1e-8f);
            const uint16_t sb = f32_to_bf16(sc);
            const float s = bf16_to_f32(sb);
            int8_t *dst = pool + (slots[t] * K + g) * H;
            for (int64_t h = 0; h < H; h++) {
                float c = nearbyintf(row_f[h] / s);
                dst[h] = (int8_t)(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));
            }
            scales[slots[t] * K + g] = sb;
        }
}

int lmf_write_kv_int8(const void *k, const void *v, const int64_t *slots, int64_t T, int64_t K, int64_t H,
                      int64_t act, int8_t *k_pool, int8_t *v_pool, uint16_t *k_scales, uint16_t *v_scales) {
    if (H > MAX_H || act < 0 || act > 1) return -1;
    quantize_rows(k, (int)act, slots, T, K, H, k_pool, k_scales);
    quantize_rows(v, (int)act, slots, T, K, H, v_pool, v_scales);
    return 0;
}

/* Float32 bodies of the elementwise ops, in torch's float32 order (plain loops; -O3 vectorizes them). */
void lmf_rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t D, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float ss = 0.0f;
        for (int64_t h = 0; h < D; h++) ss += xr[h] * xr[h];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t h = 0; h < D; h++) out[r * D + h] = w[h] * (xr[h] * inv);
    }
}

void lmf_rope_f32(float *x, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t H) {
    const int64_t half = H / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * H, *s = sin + t * H;
        for (int64_t n = 0; n < heads; n++) {
            float *lo = x + (t * heads + n) * H, *hi = lo + half;
            for (int64_t h = 0; h < half; h++) {
                const float l = lo[h], u = hi[h];
                lo[h] = l * c[h] + (-u) * s[h];
                hi[h] = u * c[h + half] + l * s[h + half];
            }
        }
    }
}

void lmf_silu_mul_f32(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* ---- weight-only int8 / int4 / bf16 matmul on float32 activations (CPUs without bf16) -------------------
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
 */
#if defined(__AVX2__) && defined(__FMA__) && !defined(LMF_PORTABLE)
#include <immintrin.h>
#define LMF_QMM_AVX2 1
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef LMF_QMM_AVX2
/* Codes k .. k+31 of a weight row as 4 x 8 float32: int8 widened as is; int4 (two a byte, low nibble
 * first, stored code + 8) split into nibbles, interleaved back into k order, re-centred. */
static inline __attribute__((always_inline)) void widen32(const void *wrow, int bits, int64_t k, __m256 w[4]) {
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
    } else {
        const __m128i lo4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)wrow + k / 2));
        const __m128i lo = _mm_and_si128(b, lo4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
        c0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
        c1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
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
#ifdef LMF_QMM_AVX2
    __m256 t[4][2];
    for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
    int64_t done = 0;  /* inputs covered by the vector loop, the same in every group */
    for (int64_t g = 0; g < G; g++) {
        __m256 a[4][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const int64_t k0 = g * gs, k1 = k0 + gs;
        int64_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            __m256 w[4];
            widen32(wrow, bits, k, w);
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
#ifdef LMF_QMM_AVX2
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
    int64_t M, N, K, gs, bits, n0, n1;
    int64_t *next, chunk, threads;  /* shared by the threads: the next chunk of weight rows (qmm_range, take_rows) */
} qmm_job;

static void qmm_rows_of(const qmm_job *j) {  /* weight rows [j->n0, j->n1) */
    const int64_t K = j->K, gs = j->gs, G = K / gs;
    const int64_t row_bytes = j->bits == 32 ? 4 * K : j->bits == 16 ? 2 * K : j->bits == 8 ? K : K / 2;
    const int64_t block = j->bits == 32 ? 8 : 4;  /* float32 weights: 8 rows a pass (f32_row8) */
    for (int64_t m0 = 0; m0 < j->M; m0 += block) {
        const int R = j->M - m0 < block ? (int)(j->M - m0) : (int)block;
        const float *x = j->x + m0 * K;
        for (int64_t n = j->n0; n < j->n1; n++) {
            float total[8];
            const void *w = (const uint8_t *)j->w + n * row_bytes;
            const float *sc = j->scale + n * G;
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
            else if (j->bits == 8) QMM_ROWS(8) else QMM_ROWS(4)
#undef QMM_ROWS
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r];
        }
    }
}

static void *qmm_range(void *arg) {  /* a thread's share: chunks of weight rows (`take_chunk`) */
    qmm_job j = *(const qmm_job *)arg;
    while (take_rows(j.next, j.chunk, j.N, j.threads, &j.n0, &j.n1)) qmm_rows_of(&j);
    return NULL;
}

/* bits 32, 16, 8 or 4; float32, bf16 and int8 with gs <= 0 or gs = K are per channel (any K), else gs is a group as for
 * int4 (GGUF's Q8_0: groups of 32). From `gemm_rows` rows on (> 0; 0: never) the call goes to the panel GEMM below
 * when this build has it: the caller's choice, per weight, since where the GEMM starts to win depends on the bits
 * (`QmmLinear.GEMM_MIN_ROWS`, measured). Returns -1 for shapes it does not take (a group not a multiple of 32
 * dividing K). */
int lmf_gemm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t bits, int64_t gs, int64_t threads);

int lmf_qmm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                int64_t bits, int64_t gs, int64_t threads, int64_t gemm_rows) {
    if (bits != 32 && bits != 16 && bits != 8 && bits != 4) return -1;
    if (bits >= 8 && (gs <= 0 || gs == K)) gs = K;
    else if (gs <= 0 || gs % 32 || K % gs) return -1;
    if (gemm_rows > 0 && M >= gemm_rows && lmf_gemm_f32(x, w, scale, out, M, N, K, bits, gs, threads) == 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > N) threads = N;
    int64_t next = 0;
    const int64_t chunk = chunk_rows(N, threads);
    qmm_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (qmm_job){x, w, scale, out, M, N, K, gs, bits, 0, 0, &next, chunk, threads};
    run_jobs(qmm_range, jobs, sizeof jobs[0], threads);
    return 0;
}

/* ---- prefill GEMM on bfloat16 (or float32) weights, float32 activations -----------------------------
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
#ifdef LMF_QMM_AVX2
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

/* 8 weights of row n from k (k a multiple of 8, gs of 32: one group) as float32, dequantized as
 * `QmmLinear.dequantized` does (code * scale, one rounding): bf16 widened, float32 as is, int8 codes, int4
 * two a byte (low nibble = even k, stored code + 8). */
static inline __attribute__((always_inline)) __m256 gemm_load8(const void *w, int bits, const float *scale,
                                                               int64_t G, int64_t gs, int64_t K, int64_t n, int64_t k) {
    const int64_t i = n * K + k;
    if (bits == 32) return _mm256_loadu_ps((const float *)w + i);
    if (bits == 16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    __m256 v;
    if (bits == 8) {
        v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
    } else {
        uint32_t b4;
        memcpy(&b4, (const uint8_t *)w + i / 2, 4);
        const __m128i b = _mm_cvtsi32_si128((int)b4), lo4 = _mm_set1_epi8(0x0F);
        const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, lo4), _mm_and_si128(_mm_srli_epi16(b, 4), lo4));
        v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(c), _mm256_set1_epi32(8)));
    }
    return _mm256_mul_ps(v, _mm256_set1_ps(scale[n * G + k / gs]));
}

static inline float gemm_load1(const void *w, int bits, const float *scale, int64_t G, int64_t gs, int64_t K,
                               int64_t n, int64_t k) {
    const int64_t i = n * K + k;
    if (bits == 32) return ((const float *)w)[i];
    if (bits == 16) return bf16_to_f32(((const uint16_t *)w)[i]);
    float c;
    if (bits == 8) c = (float)((const int8_t *)w)[i];
    else {
        const uint8_t byte = ((const uint8_t *)w)[i / 2];
        c = (float)((int)((i & 1) ? byte >> 4 : byte & 0x0F) - 8);
    }
    return c * scale[n * G + k / gs];
}

/* Weight rows n0 .. n0+nc-1 (nc <= 16) as a (K, 16) float32 panel: panel[k * 16 + j] = w[n0 + j, k],
 * zero where n0 + j >= N. 8 rows x 8 k at a time: dequantized, transposed in registers, stored as 8 rows. */
static void gemm_pack(const void *w, int bits, const float *scale, int64_t gs, int64_t K, int64_t n0, int64_t nc,
                      float *panel) {
    const int64_t G = K / gs;
    for (int64_t j0 = 0; j0 < GEMM_NR; j0 += 8) {
        int64_t k = 0;
        if (j0 + 8 <= nc) {
            for (; k + 8 <= K; k += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = gemm_load8(w, bits, scale, G, gs, K, n0 + j0 + i, k);
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (k + i) * GEMM_NR + j0, r[i]);
            }
        }
        for (; k < K; k++)  /* the K tail, and the columns past N of the last panel */
            for (int64_t j = j0; j < j0 + 8; j++)
                panel[k * GEMM_NR + j] = j < nc ? gemm_load1(w, bits, scale, G, gs, K, n0 + j, k) : 0.0f;
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
    const float *x; const void *w; const float *scale; float *out;
    int64_t M, N, K, bits, gs;
    int64_t *next, chunk;  /* panels handed out `chunk` at a time */
    float *panel;          /* this thread's (K, 16) buffer */
} gemm_job;

static void *gemm_range(void *arg) {
    const gemm_job *j = (const gemm_job *)arg;
    const int64_t P = (j->N + GEMM_NR - 1) / GEMM_NR, K = j->K;
    int64_t p0, p1;
    while (take_chunk(j->next, j->chunk, P, &p0, &p1))
        for (int64_t p = p0; p < p1; p++) {
            const int64_t n0 = p * GEMM_NR, nc = j->N - n0 < GEMM_NR ? j->N - n0 : GEMM_NR;
            gemm_pack(j->w, (int)j->bits, j->scale, j->gs, K, n0, nc, j->panel);
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
 * or groups) or 4 (groups); groups a multiple of 32 dividing K. Returns 0, or -1 when this build has no
 * AVX2 + FMA body, the shape is not one it takes, or memory for the panels is not to be had. */
int lmf_gemm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t bits, int64_t gs, int64_t threads) {
#ifdef LMF_QMM_AVX2
    static const float one = 1.0f;
    if (M < 1 || N < 1 || K < 1) return -1;
    if (bits != 32 && bits != 16 && bits != 8 && bits != 4) return -1;
    if (scale == NULL && bits < 16) return -1;
    if (scale == NULL) scale = &one;  /* float weights with no scales: a row of ones, below */
    if (bits != 4 && (gs <= 0 || gs == K)) gs = K;
    else if (gs <= 0 || gs % 32 || K % gs) return -1;
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
    float *panels = (float *)aligned_alloc(64, (size_t)threads * K * GEMM_NR * sizeof(float));
    if (panels == NULL) {
        free(ones);
        return -1;
    }
    int64_t next = 0;
    int64_t chunk = P / (8 * threads);  /* ~8 chunks a thread: a slower sibling core takes fewer */
    if (chunk < 1) chunk = 1;
    gemm_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (gemm_job){x, w, scale, out, M, N, K, bits, gs, &next, chunk, panels + t * K * GEMM_NR};
    run_jobs(gemm_range, jobs, sizeof jobs[0], threads);
    free(panels);
    free(ones);
    return 0;
#else
    (void)x; (void)w; (void)scale; (void)out; (void)M; (void)N; (void)K; (void)bits; (void)gs; (void)threads;
    return -1;
#endif
}

/* ---- int8 activations x int8 / int4 weights: integer dot products (A8) --------------------------------
 *
 * x (M, K) float32 or bfloat16 is quantized per row (token), dynamically: s[m] = absmax / 127,
 * q = rint(x / s) (ties to even, as torch.round), |q| <= 127 (vLLM's dynamic per-token W8A8 int8).
 * For every weight group (int8: the whole row, per channel, or `gs` inputs; int4: `gs` inputs) the products q * code
 * accumulate exactly in int32 (K < 65536: |dot| <= 128 * 127 * K, and the 512-bit body's
 * offset sums below stay exact), and
 *     out[m, n] = s[m] * sum_g scale[n, g] * float(dot_g[m, n])          (float32)
 * Weights are the A16 kernel's (`lmf_qmm_f32`): int8 (N, K); int4 two a byte, low nibble = even k,
 * stored code + 8. For int4 the quantized activations keep each block of 32 as (its 16 even k, its 16
 * odd k), so that a block's 16 bytes unpack into low nibbles then high nibbles with no interleave.
 *
 * Bodies, chosen at run time from the CPU's flags (`__builtin_cpu_supports`), each compiled for its
 * own ISA with `__attribute__((target))` so one build runs on any x86-64 and a test can force each:
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
 */
#define A8_MAX_R 4

typedef struct {
    const int8_t *q; const float *xs; const void *w; const float *ws; float *out;
    const float *qs;  /* int4 on the 256-bit bodies: 8 * sum(q) of each group, (M, G); else NULL */
    int64_t M, N, K, gs, bits, n0, n1, isa, G;  /* G = K / gs groups a row */
    int64_t *next, chunk, threads;  /* shared by the threads: the next chunk of weight rows (a8_range, take_rows) */
} a8_job;

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
 * vectorizes for the target, as for int8. */
static void a8_range_portable(const a8_job *j) {
    const int64_t K = j->K, gs = j->gs, G = K / gs, row_bytes = j->bits == 8 ? K : K / 2;
    int8_t unpacked[j->bits == 4 ? K : 1];
    for (int64_t n = j->n0; n < j->n1; n++) {
        const int8_t *c = (const int8_t *)j->w + n * row_bytes;
        if (j->bits == 4) {
            a8_unpack4((const uint8_t *)c, K, unpacked);
            c = unpacked;
        }
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *q = j->q + m * K;
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t dot = 0;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) dot += (int32_t)q[k] * c[k];
                total += (float)dot * j->ws[n * G + g];
            }
            j->out[m * j->N + n] = total * j->xs[m];
        }
    }
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(LMF_PORTABLE)
#include <immintrin.h>
#define LMF_A8_X86 1
#if defined(__clang__) ? (__clang_major__ >= 12) : (__GNUC__ >= 11)
#define LMF_A8_AVXVNNI 1
#endif

/* R (rows, 1..4) and BITS (8 or 4) as compile-time constants of an always-inline row function FN, so
 * its accumulators stay in registers and no branch on the weight format runs inside its loops. */
#define A8_ROWS_SWITCH(FN, R, ...) do {                                              \
        if (j->bits == 8) switch (R) {                                                \
            case 1: FN(__VA_ARGS__, 1, 8); break;                                     \
            case 2: FN(__VA_ARGS__, 2, 8); break;                                     \
            case 3: FN(__VA_ARGS__, 3, 8); break;                                     \
            default: FN(__VA_ARGS__, 4, 8); break;                                    \
        } else switch (R) {                                                           \
            case 1: FN(__VA_ARGS__, 1, 4); break;                                     \
            case 2: FN(__VA_ARGS__, 2, 4); break;                                     \
            case 3: FN(__VA_ARGS__, 3, 4); break;                                     \
            default: FN(__VA_ARGS__, 4, 4); break;                                    \
        }                                                                             \
    } while (0)

/* 256-bit bodies: one block of 32 codes a step, two steps (two dot chains a row) at a time. A macro,
 * instantiated per ISA: the dot-product step DOT(acc, |c|, signed q) is the only difference. */
#define A8_YMM_BODY(NAME, TARGET, DOT)                                                                      \
__attribute__((target(TARGET), always_inline)) static inline __m256i NAME##_codes(const void *w, const int bits, \
                                                                                 int64_t k) {               \
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)((const int8_t *)w + k));                     \
    /* the block's 16 bytes in both halves (one load), the upper half shifted to its high nibbles */      \
    const __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + (k >> 1)))); \
    return _mm256_and_si256(_mm256_srlv_epi64(y, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));    \
}                                                                                                           \
/* the dot step's unsigned operand: |c| (int8), or the stored nibble c + 8 itself (int4) */                 \
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
__attribute__((target(TARGET), always_inline)) static inline void NAME##_rows(                              \
        const a8_job *j, const void *w, const float *ws, const int8_t *q, const float *qs, float *total,       \
        const int R, const int bits) {                                                                      \
    const int64_t K = j->K, gs = j->gs, G = j->G;                                                           \
    __m256 tf[A8_MAX_R];                                                                                    \
    for (int r = 0; r < R; r++) tf[r] = _mm256_setzero_ps();                                                \
    if (gs == 32) {  /* GGUF's Q8_0 / Q4_0: a scale a block; two blocks a step on two float chains a row */ \
        __m256 tf2[A8_MAX_R];                                                                               \
        for (int r = 0; r < R; r++) tf2[r] = _mm256_setzero_ps();                                           \
        int64_t g = 0;                                                                                      \
        for (; g + 2 <= G; g += 2) {                                                                        \
            const int64_t k = g * 32;                                                                       \
            const __m256i c = NAME##_codes(w, bits, k), a = NAME##_lhs(c, bits);                            \
            const __m256i c2 = NAME##_codes(w, bits, k + 32), a2 = NAME##_lhs(c2, bits);                    \
            const __m256 s = _mm256_set1_ps(ws[g]), s2 = _mm256_set1_ps(ws[g + 1]);                         \
            for (int r = 0; r < R; r++) {                                                                   \
                const __m256i d = NAME##_dot(_mm256_setzero_si256(), a, NAME##_rhs(q + r * K + k, c, bits));  \
                const __m256i d2 = NAME##_dot(_mm256_setzero_si256(), a2,                                   \
                                              NAME##_rhs(q + r * K + k + 32, c2, bits));                    \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, tf[r]);                                   \
                tf2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), s2, tf2[r]);                               \
            }                                                                                               \
        }                                                                                                   \
        if (g < G) {                                                                                        \
            const int64_t k = g * 32;                                                                       \
            const __m256i c = NAME##_codes(w, bits, k), a = NAME##_lhs(c, bits);                            \
            const __m256 s = _mm256_set1_ps(ws[g]);                                                         \
            for (int r = 0; r < R; r++)                                                                     \
                tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(NAME##_dot(_mm256_setzero_si256(), a,            \
                                                                      NAME##_rhs(q + r * K + k, c, bits))), \
                                        s, tf[r]);                                                          \
        }                                                                                                   \
        for (int r = 0; r < R; r++) tf[r] = _mm256_add_ps(tf[r], tf2[r]);                                   \
    } else                                                                                                  \
    for (int64_t g = 0; g < G; g++) {                                                                       \
        __m256i acc[A8_MAX_R], acc2[A8_MAX_R];  /* two dot chains a row: even and odd blocks */            \
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_si256();                              \
        int64_t k = g * gs;                                                                                 \
        const int64_t end = k + gs;                                                                         \
        for (; k + 64 <= end; k += 64) {                                                                    \
            const __m256i c = NAME##_codes(w, bits, k), a = NAME##_lhs(c, bits);                            \
            const __m256i c2 = NAME##_codes(w, bits, k + 32), a2 = NAME##_lhs(c2, bits);                    \
            for (int r = 0; r < R; r++) {                                                                   \
                acc[r] = NAME##_dot(acc[r], a, NAME##_rhs(q + r * K + k, c, bits));                         \
                acc2[r] = NAME##_dot(acc2[r], a2, NAME##_rhs(q + r * K + k + 32, c2, bits));                \
            }                                                                                               \
        }                                                                                                   \
        if (k < end) {  /* an odd block left */                                                             \
            const __m256i c = NAME##_codes(w, bits, k), a = NAME##_lhs(c, bits);                            \
            for (int r = 0; r < R; r++) acc[r] = NAME##_dot(acc[r], a, NAME##_rhs(q + r * K + k, c, bits));  \
        }                                                                                                   \
        const __m256 sg = _mm256_set1_ps(ws[g]);                                                            \
        for (int r = 0; r < R; r++)                                                                         \
            tf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[r], acc2[r])), sg, tf[r]);      \
    }                                                                                                       \
    float tail[A8_MAX_R] = {0};                                                                             \
    if (bits == 4) {  /* the nibbles were c + 8: take 8 * sum(q) of each group back, scaled (qs = 8 sum q) */ \
        int64_t g = 0;                                                                                      \
        for (; g + 8 <= G; g += 8) {                                                                        \
            const __m256 sv = _mm256_loadu_ps(ws + g);                                                      \
            for (int r = 0; r < R; r++) tf[r] = _mm256_fnmadd_ps(sv, _mm256_loadu_ps(qs + r * G + g), tf[r]); \
        }                                                                                                   \
        for (; g < G; g++)                                                                                  \
            for (int r = 0; r < R; r++) tail[r] += ws[g] * qs[r * G + g];                                   \
    }                                                                                                       \
    for (int r = 0; r < R; r++) total[r] = NAME##_hsum(tf[r]) - tail[r];                                    \
}                                                                                                           \
__attribute__((target(TARGET))) static void a8_range_##NAME(const a8_job *j) {                              \
    const int64_t K = j->K, G = j->G, row_bytes = j->bits == 8 ? K : K / 2;                                 \
    for (int64_t n = j->n0; n < j->n1; n++) {                                                               \
        const void *w = (const uint8_t *)j->w + n * row_bytes;                                              \
        for (int64_t m0 = 0; m0 < j->M; m0 += A8_MAX_R) {                                                   \
            const int R = j->M - m0 < A8_MAX_R ? (int)(j->M - m0) : A8_MAX_R;                               \
            float total[A8_MAX_R];                                                                          \
            A8_ROWS_SWITCH(NAME##_rows, R, j, w, j->ws + n * G, j->q + m0 * K, j->qs ? j->qs + m0 * G : NULL, total); \
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r] * j->xs[m0 + r];             \
        }                                                                                                   \
    }                                                                                                       \
}

A8_YMM_BODY(avx2, "avx2,fma",
            return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), _mm256_set1_epi16(1))))
#if defined(LMF_A8_AVXVNNI)
A8_YMM_BODY(avxvnni, "avx2,fma,avxvnni", return _mm256_dpbusd_avx_epi32(acc, a, x))
#endif
/* The same 256-bit body on the EVEX form of vpdpbusd (AVX-512 VNNI + VL): on Zen 4, whose 512-bit
 * operations are two 256-bit halves, it beats the 512-bit body below at every batch for int4 and at
 * batch 1-4 for int8 (the 300M's layer shapes, 2 threads: int4 g32 batch 1 0.21 against 0.39 ms,
 * batch 64 6.4 against 7.8; int8 g32 batch 1 0.22 against 0.36, batch 16 1.87 against 1.78), so it is
 * the default there; the 512-bit body stays for `LMFORGE_A8_ISA=avx512_vnni`. */
A8_YMM_BODY(avx512vnni256, "avx2,fma,avx512vl,avx512vnni", return _mm256_dpbusd_epi32(acc, a, x))

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
        const a8_job *j, const void *w, const float *ws, const uint8_t *u, __m512 *tf, const int R, const int bits) {
    const int64_t K = j->K, gs = j->gs, G = j->G;
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
        const __m512 sg = _mm512_set1_ps(ws[g]);
        for (int r = 0; r < R; r++)
            tf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a0[r], a1[r]), corr)), sg, tf[r]);
    }
}

__attribute__((target(T512), always_inline)) static inline void a8_steps512(
        const a8_job *j, const void *w, const float *wsb, const uint8_t *u, __m512 *tf, const int R, const int bits) {
    const int64_t K = j->K;
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 64) {
        const int full = K - k >= 64;
        const __mmask64 live = full ? A8_ALL : A8_LOW32;
        const __m512i c = a8_codes512(w, bits, k, live);
        const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, c));
        /* lanes 0-7: block k / 32, lanes 8-15: the next (0 in a half step: its dot is 0 too) */
        const __m512 sv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(wsb[k / 32]), 0xFF00,
                                                     _mm_set_ss(full ? wsb[k / 32 + 1] : 0.0f));
        for (int r = 0; r < R; r++)
            tf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg, _mm512_maskz_loadu_epi8(live, u + r * K + k), c)),
                                    sv, tf[r]);
    }
}

__attribute__((target(T512), always_inline)) static inline void a8_rows512(
        const a8_job *j, const void *w, const float *ws, const float *wsb, const uint8_t *u, float *total,
        const int R, const int bits) {
    __m512 tf[A8_MAX_R];
    for (int r = 0; r < R; r++) tf[r] = _mm512_setzero_ps();
    if (wsb == NULL) a8_groups512(j, w, ws, u, tf, R, bits);
    else a8_steps512(j, w, wsb, u, tf, R, bits);
    for (int r = 0; r < R; r++) total[r] = _mm512_reduce_add_ps(tf[r]);
}

__attribute__((target(T512))) static void a8_range_avx512vnni(const a8_job *j) {
    const int64_t K = j->K, G = j->G, row_bytes = j->bits == 8 ? K : K / 2;
    const int steps = j->gs % 64 != 0 && G > 1;  /* groups of 32 (96, ...): scales change inside a step */
    float wsb[65536 / 32];
    const uint8_t *u = (const uint8_t *)j->q;  /* q + 128 here (lmf_qmm_s8) */
    for (int64_t n = j->n0; n < j->n1; n++) {
        const void *w = (const uint8_t *)j->w + n * row_bytes;
        const float *ws = j->ws + n * G;
        if (steps)  /* the row's scale per block of 32, without a division */
            for (int64_t b = 0, g = 0, left = j->gs / 32; b < K / 32; b++) {
                wsb[b] = ws[g];
                if (--left == 0) g++, left = j->gs / 32;
            }
        for (int64_t m0 = 0; m0 < j->M; m0 += A8_MAX_R) {
            const int R = j->M - m0 < A8_MAX_R ? (int)(j->M - m0) : A8_MAX_R;
            float total[A8_MAX_R];
            A8_ROWS_SWITCH(a8_rows512, R, j, w, ws, steps ? wsb : NULL, u + m0 * K, total);
            for (int r = 0; r < R; r++) j->out[(m0 + r) * j->N + n] = total[r] * j->xs[m0 + r];
        }
    }
}
#endif /* x86 */

/* Numbered in order of preference: with no body asked for, the highest this CPU runs. */
enum { A8_PORTABLE = 0, A8_AVX2 = 1, A8_AVX_VNNI = 2, A8_AVX512_VNNI = 3, A8_AVX512_VNNI_256 = 4, A8_ISAS = 5 };

/* 1 if this CPU (and this build) runs body `isa`, else 0. */
int lmf_a8_isa_supported(int64_t isa) {
    if (isa == A8_PORTABLE) return 1;
#ifdef LMF_A8_X86
    __builtin_cpu_init();
    if (isa == A8_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if defined(LMF_A8_AVXVNNI)
    if (isa == A8_AVX_VNNI) return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2");
#endif
    if (isa == A8_AVX512_VNNI_256)
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == A8_AVX512_VNNI)
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

/* The body `lmf_qmm_a8` runs when not told: the widest this CPU has. */
int64_t lmf_a8_best_isa(void) {
    for (int64_t isa = A8_ISAS - 1; isa > 0; isa--)
        if (lmf_a8_isa_supported(isa)) return isa;
    return A8_PORTABLE;
}

static void a8_rows_of(const a8_job *j) {  /* weight rows [j->n0, j->n1) on body j->isa */
#ifdef LMF_A8_X86
    if (j->isa == A8_AVX512_VNNI) a8_range_avx512vnni(j);
    else if (j->isa == A8_AVX512_VNNI_256) a8_range_avx512vnni256(j);
#ifdef LMF_A8_AVXVNNI
    else if (j->isa == A8_AVX_VNNI) a8_range_avxvnni(j);
#endif
    else if (j->isa == A8_AVX2) a8_range_avx2(j);
    else
#endif
        a8_range_portable(j);
}

static void *a8_range(void *arg) {  /* a thread's share: chunks of weight rows (`take_chunk`) */
    a8_job j = *(const a8_job *)arg;
    while (take_rows(j.next, j.chunk, j.N, j.threads, &j.n0, &j.n1)) a8_rows_of(&j);
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

/* Per-row dynamic int8 quantization of x (M, K) (act: 0 bf16, 1 f32) into q (M, K) and scales s (M);
 * nibble_order 1 (int4 weights): each block of 32 stored as its even k, then its odd k. */
int lmf_quantize_s8(const void *x, int64_t act, int64_t M, int64_t K, int64_t nibble_order, int8_t *q, float *s) {
    if (act < 0 || act > 1 || M < 0 || K < 0 || (nibble_order && K % 32)) return -1;
    const size_t es = act ? 4 : 2;
    for (int64_t m = 0; m < M; m++) {
        const void *xr = (const char *)x + (size_t)(m * K) * es;
        int8_t *qr = q + m * K;
        s[m] = a8_row_scale(xr, (int)act, K);
        a8_row_codes(xr, (int)act, K, s[m], qr);
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

/* out (M, N) float32 = the A8 product of quantized rows (q, xs) and int8 / int4 weights (w, ws (N, K / gs)).
 * isa: a body (0..3) or -1 for the best. Returns 0; -1 for a shape it does not take (K % 32, int4 gs
 * not a multiple of 32 dividing K, K >= 65536); -2 for a body this CPU or build does not have. */
int lmf_qmm_s8(const int8_t *q, const float *xs, const void *w, const float *ws, float *out, int64_t M, int64_t N,
               int64_t K, int64_t bits, int64_t gs, int64_t threads, int64_t isa) {
    if ((bits != 8 && bits != 4) || K % 32 || K >= 65536 || M < 1 || N < 1) return -1;
    if (bits == 8 && gs <= 0) gs = K;  /* per channel; int8 groups of 32 or more (GGUF's Q8_0) as for int4 */
    if (gs <= 0 || gs % 32 || K % gs) return -1;
    if (isa < 0) isa = lmf_a8_best_isa();
    if (isa >= A8_ISAS || !lmf_a8_isa_supported(isa)) return -2;
    /* the 256-bit VNNI body hands int8 weights at 8 rows or more to the 512-bit one, which wins there (Zen 4,
     * 2 threads: int8 g32 on the 300M's shapes, 4 rows 0.47 against 0.50 ms, 16 rows 1.78 against 1.87; a
     * Q8_0 prompt of 100 tokens 308-329 against 360-617 ms); int4 stays on it at every batch */
    if (isa == A8_AVX512_VNNI_256 && bits == 8 && M >= 8 && lmf_a8_isa_supported(A8_AVX512_VNNI)) isa = A8_AVX512_VNNI;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > N) threads = N;
    int8_t *u = NULL;  /* the 512-bit body reads q + 128 (unsigned): converted once here */
    if (isa == A8_AVX512_VNNI) {
        if ((u = (int8_t *)malloc((size_t)(M * K))) == NULL) return -1;
        for (int64_t i = 0; i < M * K; i++) u[i] = (int8_t)((uint8_t)q[i] ^ 0x80u);
    }
    float *qs = NULL;  /* the 256-bit int4 bodies multiply the stored nibbles (c + 8): 8 * sum(q) a group */
    if (bits == 4 && (isa == A8_AVX2 || isa == A8_AVX_VNNI || isa == A8_AVX512_VNNI_256)) {
        if ((qs = (float *)malloc((size_t)(M * (K / gs)) * sizeof(float))) == NULL) {
            free(u);
            return -1;
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < K / gs; g++) {
                int32_t sum = 0;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) sum += q[m * K + k];
                qs[m * (K / gs) + g] = 8.0f * (float)sum;
            }
    }
    int64_t next = 0;
    const int64_t chunk = chunk_rows(N, threads);
    a8_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (a8_job){u ? u : q, xs, w, ws, out, qs, M, N, K, gs, bits, 0, 0, isa, K / gs, &next, chunk, threads};
    run_jobs(a8_range, jobs, sizeof jobs[0], threads);
    free(qs);
    free(u);
    return 0;
}

/* Quantize x (act: 0 bf16, 1 f32) and multiply: `lmf_quantize_s8` then `lmf_qmm_s8`, one call (the body
 * first, so that Python binds it once with functools.partial). */
int lmf_qmm_a8(int64_t isa, const void *x, int64_t act, const void *w, const float *ws, float *out, int64_t M,
               int64_t N, int64_t K, int64_t bits, int64_t gs, int64_t threads) {
    if (K % 32 || M < 1) return -1;
    int8_t *q = (int8_t *)malloc((size_t)(M * K) + (size_t)M * sizeof(float));
    if (q == NULL) return -1;
    float *xs = (float *)(q + M * K);  /* M * K is a multiple of 32: aligned for float */
    int rc = lmf_quantize_s8(x, act, M, K, bits == 4, q, xs);
    if (rc == 0) rc = lmf_qmm_s8(q, xs, w, ws, out, M, N, K, bits, gs, threads, isa);
    free(q);
    return rc;
}

/* ---- one decoder layer of a decode step, float32 activations, int8 / int4 / bf16 weights ----------------
 *
 * What the engine's Python module tree does for a Llama layer when every sequence of the step is decoding
 * (M rows, one a sequence), as one call: the same kernels in the same order, so the same bits:
 *   h = rmsnorm(x); qkv = h W_qkv; q, k = rope(q), rope(k); write k, v at `slots`; a = attention(q);
 *   x += a W_o; h = rmsnorm(x); g, u = h W_gate_up; x += silu(g) * u W_down
 * The matmuls are `lmf_qmm_a8` (isa >= 0: int8 activations, int weights) or `lmf_qmm_f32` (isa < 0: exact
 * A16, or bf16 weights with bits 16). The
 * residual adds are float32 adds, as torch's. At a 24-layer model's batch-1 step this replaces ~40 Python
 * calls and small torch ops a layer (~0.35 ms) with one.
 *
 * p: the layer, 23 values as int64 (pointers as integers):
 *   0 in_norm_w  1 post_norm_w  2 D  3 N heads  4 K kv heads  5 H head dim  6 F intermediate  7 block size
 *   8 qkv codes  9 qkv scales  10 o codes  11 o scales  12 gate_up codes  13 gate_up scales
 *   14 down codes  15 down scales  16 bits  17 gs (group size; <= 0 per channel)  18 k_pool  19 v_pool
 *   20 threads (matmuls)  21 threads (attention)  22 gemm_rows (lmf_qmm_f32's: from this many rows the panel GEMM)
 *   23 the K/V pool's dtype: 1 float32, 0 bfloat16 (written rounded to nearest even)
 * cos, sin: (M, H); slots (M); tables (S, tables_M) int32, lens (S) int32, rows (S) int64: as
 * lmf_paged_decode_any. Returns 0, or the first failing kernel's code. */
static int qmm_any(int64_t isa, const float *x, const void *w, const float *ws, float *out, int64_t M, int64_t N,
                   int64_t K, int64_t bits, int64_t gs, int64_t threads, int64_t gemm_rows) {
    if (isa >= 0) return lmf_qmm_a8(isa, x, 1, w, ws, out, M, N, K, bits, gs, threads);
    return lmf_qmm_f32(x, w, ws, out, M, N, K, bits, gs, threads, gemm_rows);
}

int lmf_decode_layer_q(int64_t isa, const int64_t *p, float *x, int64_t M, const float *cos, const float *sin,
                       const int64_t *slots, const int32_t *tables, int64_t tables_M, const int32_t *lens,
                       const int64_t *rows, int64_t S, float eps, float scale) {
    const int64_t D = p[2], N = p[3], K = p[4], H = p[5], F = p[6], B = p[7], bits = p[16], gs = p[17];
    const int64_t th = p[20], th_attn = p[21], gr = p[22], kv = p[23], NQ = N * H, NK = K * H, NQKV = NQ + 2 * NK;
    if (kv != 0 && kv != 1) return -1;
    const float *in_w = (const float *)p[0], *post_w = (const float *)p[1];
    const int64_t floats = M * (D + NQKV + NQ + 2 * NK + NQ + 2 * F + F + D);
    float *buf = (float *)malloc((size_t)floats * sizeof(float));
    if (buf == NULL) return -1;
    float *h = buf, *qkv = h + M * D, *q = qkv + M * NQKV, *k = q + M * NQ, *v = k + M * NK, *att = v + M * NK;
    float *gu = att + M * NQ, *act = gu + M * 2 * F, *o = act + M * F;
    int rc = 0;
    lmf_rmsnorm_f32(x, in_w, h, M, D, eps);
    if ((rc = qmm_any(isa, h, (const void *)p[8], (const float *)p[9], qkv, M, NQKV, D, bits, gs, th, gr))) goto done;
    for (int64_t m = 0; m < M; m++) {
        memcpy(q + m * NQ, qkv + m * NQKV, (size_t)NQ * sizeof(float));
        memcpy(k + m * NK, qkv + m * NQKV + NQ, (size_t)NK * sizeof(float));
        memcpy(v + m * NK, qkv + m * NQKV + NQ + NK, (size_t)NK * sizeof(float));
    }
    lmf_rope_f32(q, cos, sin, M, N, H);
    lmf_rope_f32(k, cos, sin, M, K, H);
    if (kv == 0)
        lmf_write_kv_f32_bf16(k, v, slots, M, NK, (uint16_t *)p[18], (uint16_t *)p[19]);
    else
        lmf_write_kv_bytes(k, v, slots, M, NK * (int64_t)sizeof(float), (void *)p[18], (void *)p[19]);
    if ((rc = lmf_paged_decode_any(q, (const void *)p[18], (const void *)p[19], NULL, NULL, tables, tables_M, lens,
                                   rows, S, N, K, H, B, scale, att, th_attn, 1, kv)))
        goto done;
    if ((rc = qmm_any(isa, att, (const void *)p[10], (const float *)p[11], o, M, D, NQ, bits, gs, th, gr))) goto done;
    for (int64_t i = 0; i < M * D; i++) x[i] = x[i] + o[i];
    lmf_rmsnorm_f32(x, post_w, h, M, D, eps);
    if ((rc = qmm_any(isa, h, (const void *)p[12], (const float *)p[13], gu, M, 2 * F, D, bits, gs, th, gr))) goto done;
    for (int64_t m = 0; m < M; m++)  /* gate and up side by side in each row: silu_mul takes them apart */
        lmf_silu_mul_f32(gu + m * 2 * F, gu + m * 2 * F + F, act + m * F, F);
    if ((rc = qmm_any(isa, act, (const void *)p[14], (const float *)p[15], o, M, D, F, bits, gs, th, gr))) goto done;
    for (int64_t i = 0; i < M * D; i++) x[i] = x[i] + o[i];
done:
    free(buf);
    return rc;
}

/* Every decoder layer of a decode step, in order, in one call: layers[l] is layer l's parameter array (as
 * lmf_decode_layer_q's p). One call a step instead of one a layer saves the interpreter's work around each
 * (a module call, the residual's copy, 14 arguments converted): ~20 us a layer. */
int lmf_decode_stack_q(int64_t isa, int64_t n_layers, const int64_t *layers, float *x, int64_t M, const float *cos,
                       const float *sin, const int64_t *slots, const int32_t *tables, int64_t tables_M,
                       const int32_t *lens, const int64_t *rows, int64_t S, float eps, float scale) {
    for (int64_t l = 0; l < n_layers; l++) {
        const int rc = lmf_decode_layer_q(isa, (const int64_t *)layers[l], x, M, cos, sin, slots, tables, tables_M,
                                          lens, rows, S, eps, scale);
        if (rc != 0) return rc;
    }
    return 0;
}
