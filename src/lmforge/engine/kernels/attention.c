/* Paged decode attention: every decoding sequence of a step in one call, reading each sequence's blocks once,
 * in place. The entry points, their threads, the context partitions of a batch-1 step, and the portable body;
 * the SIMD bodies are attention_avx512.c (bf16) and attention_avx2.c (float32 queries).
 *
 * For every decoding sequence s (one query token) and kv head g, the G = N / K query heads of the
 * group attend over the first lens[s] tokens of the sequence; token j lives in pool row
 * block_tables[s * M + j / B] * B + j % B. Scores, the running max and sum of an online softmax
 * (Milakov & Gimelshein 2018, as in FlashAttention) and the output accumulate in float32, TILE
 * tokens at a time: no gather, no padding, no per-sequence call. A bf16 output is rounded to
 * bfloat16 (nearest even).
 *
 * Layouts (contiguous): q and out (T, N, H); pools (P * B, K, H); rows[s] is the query's row in q
 * and out. Returns 0, or -1 for a shape this file does not handle (the caller falls back).
 *
 * `lmf_paged_decode_bf16` (bf16 everything): the AVX-512 body (`decode_seq`) where the compiler targets
 * AVX-512F, else the portable body. `lmf_paged_decode_any` (float32 activations and an int8 KV cache): CPUs
 * without native bf16 (AVX2-only) run the engine in float32, and `kv_cache_dtype=int8` stores K/V as int8
 * codes with one bfloat16 scale per token per kv head (value = code * scale). One portable body serves every
 * combination (`decode_one_any`): each K or V row's head vector is first widened to float32 (a loop the
 * compiler vectorizes for the target), then the online softmax. act: 0 bf16, 1 f32; kv: 0 bf16, 1 f32,
 * 2 int8. Float32 queries over a float32 or bf16 pool run the AVX2 body where the dispatch table says so.
 */
#include "common.h"

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
#ifdef LMF_AVX512
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
#ifdef LMF_AVX512
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

#ifdef LMF_X86
/* The float32-query body for a float32 (kv 1) or bf16 (kv 0) pool: 512-bit where this build has it and H % 16 == 0 */
static decode_heads_fn f32_body(int64_t kv, int64_t H) {
#ifdef LMF_ATTN_F32_AVX512
    if (H % 16 == 0) return kv == 1 ? decode_heads_f32_avx512 : decode_heads_bf16kv_avx512;
#endif
    (void)H;
    return kv == 1 ? decode_heads_f32_avx2 : decode_heads_bf16kv_avx2;
}
#endif

static void *decode_any_range(void *arg) {
    const decode_any_job *j = (const decode_any_job *)arg;
    const int64_t N = j->N, H = j->H, G = N / j->K, es = j->act ? 4 : 2;
#ifdef LMF_X86
    const int avx2 = j->act == 1 && (j->kv == 1 || j->kv == 0) && H % 8 == 0 && (j->g1 - j->g0) * G <= MAX_N &&
                     lmf_dispatch.attn_avx2;
    const decode_heads_fn body = f32_body(j->kv, H);
#endif
    for (int64_t s = j->first; s < j->last; s++) {
        const int64_t base = j->rows[s] * N * H * es;
#ifdef LMF_X86
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

#ifdef LMF_X86
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
#ifdef LMF_X86
    const int64_t pt = threads < MAX_THREADS ? threads : MAX_THREADS;  /* partitions: not bounded by the kv heads */
    if (S < pt && pt > 1 && total >= 2 * PART_TOKENS && act == 1 && (kv == 0 || kv == 1) && H % 8 == 0 &&
        N <= MAX_N && lmf_dispatch.attn_avx2)
        return decode_partitioned((const float *)q, k_pool, v_pool, block_tables, M, lens, rows, S, N, K, H, B, scale,
                                  (float *)out, pt, f32_body(kv, H));
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

