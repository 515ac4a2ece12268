/* The one header of lmforge's CPU kernels: what every kernel file shares (limits, bf16 conversion, the
 * thread helpers, the A8 job and the dispatch table), and the prototypes of every function the library
 * exports (the ctypes bindings in `__init__.py` call exactly these).
 *
 * Files, one concern each (docs/engine.md, "Where the kernels live"):
 *   attention.c         paged decode attention: entry points, threads, context partitions, portable body
 *   attention_avx512.c  its bf16 body (AVX-512, AVX512-BF16 dot products when targeted), its float32-query body's
 *                       512-bit parts
 *   attention_avx2.c    its float32-query body over float32 / bf16 pools (AVX2 + FMA): the 256-bit parts
 *   attention_f32_tile.c  that body's width-generic rest (tile loop, values), included by both files above
 *   attention_prefill.c paged prefill attention: every prefill chunk of a step, causal, in place (vector C)
 *   kv_write.c          K/V rows into their pool slots (bf16, any bytes, float32 -> bf16, int8 + scales)
 *   elementwise.c       RMSNorm, RoPE, silu * up, bf16 and float32
 *   qmm_f32.c           the A16 row kernel: int8 / int4 / bf16 / float32 weights, float32 activations
 *   gemm_f32.c          the panel GEMM the row kernel hands big row counts to (AVX2 + FMA)
 *   gemm_bf16.c         bf16 weights on bf16 dot products for many rows: a panel GEMM (AVX512-BF16)
 *   qmm_a8.c            int8 activations: quantization, entry points, threads, the portable body
 *   qmm_a8_avx256.c     its 256-bit bodies: avx2, avx_vnni, avx512_vnni_256
 *   qmm_a8_avx512.c     its 512-bit body: avx512_vnni
 *   qmm_a8_panel.c      its panel GEMM for many rows (prefill chunks, big batches): AVX-512 VNNI
 *   decode_layer.c      a whole decoder layer (and the stack of them) of a decode step in one call
 *   dispatch.c          which body runs, decided once at load from the CPU's flags; `lmf_kernels_chosen`
 *
 * No Python or torch headers: every file is plain C, compiled together with the system C compiler at first
 * use (`lmforge.engine.kernels.build`).
 */
#ifndef LMF_COMMON_H
#define LMF_COMMON_H

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What this build compiles. The compiler's target (`-march=native` at first use) decides the bodies
 * compiled for the whole file; x86 bodies with their own `__attribute__((target))` are compiled on every
 * x86 build and chosen at run time (dispatch.c). -DLMF_PORTABLE (which the tests build) leaves plain C only. */
#if defined(__AVX512F__) && !defined(LMF_PORTABLE)
#define LMF_AVX512 1  /* bf16 attention and the bf16 elementwise ops in AVX-512 */
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(LMF_PORTABLE)
#define LMF_AVX2 1  /* the A16 row kernel in AVX2 + FMA, and the panel GEMM (which has no other body) */
#endif
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(LMF_PORTABLE)
#define LMF_X86 1  /* the float32 attention body and the A8 bodies: own target attributes, chosen at run time */
#if defined(__clang__) ? (__clang_major__ >= 12) : (__GNUC__ >= 11)
#define LMF_AVXVNNI 1  /* a compiler that knows AVX-VNNI */
#endif
#endif
#if defined(LMF_AVX512) || defined(LMF_AVX2) || defined(LMF_X86)
#include <immintrin.h>
#endif

/* Internal to the library: shared between its files, not exported (ctypes sees only the lmf_* API). */
#define LMF_HIDDEN __attribute__((visibility("hidden")))

#define TILE 16          /* attention: tokens a tile of the online softmax */
#define MAX_H 256        /* head size limit of the attention and RoPE kernels (`kernels.MAX_H`) */
#define MAX_G 16         /* query heads per kv head */
#define MAX_N 64         /* query heads, AVX-512 and AVX2 attention bodies */
#define MAX_THREADS 64

/* ---- bfloat16 <-> float32 ----------------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of an activation tensor, act: 0 bfloat16, 1 float32. */
static inline float load_act(const void *p, int act, int64_t i) {
    return act ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_act(void *p, int act, int64_t i, float x) {
    if (act) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = f32_to_bf16(x);
}

#ifdef LMF_AVX512
/* ---- AVX-512 helpers of the bf16 attention and elementwise bodies --------------------------------------- */

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

/* silu(g) = g / (1 + exp(-g)), 16 at a time. exp_ps clamps its argument at -87 (g > 87: exp(-g) ~1.6e-38, silu g
 * as torch's) and gives inf above 88.7 (g < -88.7: silu -0 where torch gives a denormal). SwiGLU's middle
 * (elementwise.c) and the bf16 panel GEMM's fused form of it (gemm_bf16.c) share it, so both give the same bits. */
static inline __m512 silu_ps(const __m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

/* ---- the weight formats' bytes ----------------------------------------------------------------------------- */

/* A weight row's bytes by `bits`: 32 float32, 16 bfloat16, 8 int8 codes, 4 two codes a byte (lmforge's int4 order:
 * byte i of a block holds codes 2i and 2i + 1), and 5 or 6 (GGUF's Q5_*, Q6_K, kept at their bits): each block of
 * 32 as 16 + 4 hb bytes (hb = bits - 4), one after another: its codes' low four bits in the file's own order (byte
 * i: element i's in the low nibble, element i + 16's in the high one), then their high bits, element e's at byte
 * 16 + e % (4 hb), bit hb * (e / (4 hb)). One stream a row (with the high bits in a plane of their own after the
 * low ones, the hardware prefetcher lost the second stream: a Q6_K row of 2,048 read at 5.6 GB/s). 4-, 5- and
 * 6-bit codes are stored unsigned, u = code + 2^(bits - 1) (`code_offset`) when symmetric; a zero-point code is u. */
static inline int64_t row_bytes_of(int64_t bits, int64_t K) {
    return bits == 32 ? 4 * K : bits == 16 ? 2 * K : bits == 8 ? K : K * bits / 8;
}

static inline int code_offset(int64_t bits) { return bits < 8 ? 1 << (bits - 1) : 0; }

/* The stored unsigned code u of element k of a 5- or 6-bit row (scalar: tails and references). */
static inline int lohi_code(const uint8_t *row, int64_t bits, int64_t K, int64_t k) {
    const int64_t b = k / 32, e = k % 32, hb = bits - 4, per = 4 * hb;
    const uint8_t *blk = row + b * (16 + per);
    (void)K;
    const int low = (blk[e % 16] >> (e < 16 ? 0 : 4)) & 0x0F;
    const int high = (blk[16 + e % per] >> (hb * (e / per))) & ((1 << hb) - 1);
    return low | (high << 4);
}

/* ---- a weight's per-group scales and zero offsets, in the form its file stores them ------------------------ */

/* `lmforge.quant.linear.QmmLinear` hands the matmuls a descriptor (seven int64: this struct) instead of float32
 * arrays, so that a GGUF weight keeps its file's bytes at run time:
 *   LMF_SCALES_F32    float32 (N, G)
 *   LMF_SCALES_F16    float16 (N, G): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 scales (and minimums) as stored
 *   LMF_SCALES_SUPER  int8 (N, G) times a float16 per `per` groups (N, G / per): the K-quants' 6-bit scales under
 *                     their super-block's d (Q4_K, Q5_K: 8 groups of 32; Q6_K: 16 of 16; the minimums under
 *                     -dmin), fl(d * q) exact in float32
 * Zero offsets `z` (absent: NULL) in the same form: w = scale * stored code + zero, the stored code an int4
 * nibble (0..15) or an int8 byte. `row_scales` expands one weight row into float32: the scales, and the zero
 * offsets in the kernels' terms (an int4 code is read as nibble - 8, so + 8 * scale). */
enum { LMF_SCALES_F32 = 0, LMF_SCALES_F16 = 1, LMF_SCALES_SUPER = 2 };
/* `layout`: how the codes and scales lie. LMF_ROWS: a weight row after another (codes (N, row bytes), scales (N, G)).
 * LMF_PANELS16 (int4 with or without zeros, int8 without; float32, float16 or two-level scales, the two-level ones
 * int4 only; N % 16 == 0; AVX-512 VNNI only; qmm_a8_panel.c; and bf16 weights, gemm_bf16.c's own interleave): 16
 * rows at a time side by side, the A8 panel's own interleave kept in memory instead of rebuilt every call:
 *     codes[p][w][i] = bytes 4w .. 4w + 3 of weight row 16p + i   (a 64-byte vector: one 4-byte word of 16 rows)
 *     scales[p][g][i] = scale of row 16p + i, group g              (16 contiguous: one vector a group; zeros alike,
 *                                                                    and a two-level form's super-blocks [p][g / per][i])
 * Only the A8 panel bodies read it (`lmf_qmm_s8` refuses it elsewhere), and for bf16 weights (bits 16, one word
 * a pair of inputs, scale one float32 a row) gemm_bf16.c's bodies (`lmf_qmm_f32` hands its few rows there). */
enum { LMF_ROWS = 0, LMF_PANELS16 = 16 };
typedef struct { int64_t fmt, per; const void *s, *sd, *z, *zd; int64_t layout; } lmf_scales;
/* Unroll the loop that follows completely (its count a constant after inlining): the register-blocked bodies index
 * arrays of accumulators by its variable, and a loop left rolled keeps them in memory. GCC decides by the body's
 * size: the lanes body's 4-row pass went 2.1x slower when its scales' epilogue grew a third form (the 300M's 96
 * matmuls at 16 rows, 19.4 -> 40.8 ms, `kernels_ab.py panels`), so the bodies say it rather than leave it to it. */
#if defined(__clang__)
#define LMF_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define LMF_UNROLL _Pragma("GCC unroll 16")
#else
#define LMF_UNROLL
#endif
#define LMF_MAX_G 4096  /* groups a row: K < 65536 in groups of 16 or more */

#ifdef LMF_X86
/* The 4 bytes at p in every 32-bit lane, in a register: one load that several instructions share (the panel GEMMs use
 * each activation row's 4 bytes for both panels; as each instruction's `{1to16}` memory operand they were loaded twice) */
__attribute__((target("avx512f"), always_inline)) static inline __m512i bcast32(const void *p) {
    int32_t a;
    memcpy(&a, p, 4);
    return _mm512_set1_epi32(a);
}
#endif

/* AVX512-BF16 bodies (`vdpbf16ps`): compiled with their own target on every x86 build whose compiler knows the
 * instruction, run where the CPU has it (lmf_dispatch.bf16_panel): the bf16 panel GEMM (gemm_bf16.c) and the bf16
 * dot products of paged prefill attention (attention_prefill.c). */
#if defined(LMF_X86) && (defined(__clang__) ? (__clang_major__ >= 9) : (__GNUC__ >= 10))
#define LMF_BF16_DOTS 1
#define LMF_TARGET_BF16 "avx512f,avx512bw,avx512vl,avx512bf16"

/* acc + vdpbf16ps(w, the bf16 pair at p broadcast to every lane), the broadcast as the instruction's memory operand;
 * by value: through a pointer, GCC left paged prefill attention's 16 score accumulators on the stack (a load and a
 * store around every instruction) */
__attribute__((target(LMF_TARGET_BF16), always_inline)) static inline __m512 dpbf16_bcast(__m512 acc, const __m512i w,
                                                                                         const void *p) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
#else
    int32_t a;
    memcpy(&a, p, 4);
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(a));
#endif
}
#endif

static inline float f16_to_f32(uint16_t h) {  /* exact, subnormals and infinities included */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0x1f) c.u = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) c.u = sign | ((exp + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man * 2^-24 */
        c.f = (float)man * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}

static inline float f16_scalar(uint16_t h) {  /* one float16: F16C where the build has it */
#if defined(__F16C__) && !defined(LMF_PORTABLE)
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

/* The G groups of row `row` in the descriptor's form `fmt` (a float16 q's form, or int8 under a float16 per
 * `per` groups) as float32 into out; with `add` (zeros of 4-, 5-, 6-bit codes), plus off * add[g] (the kernels
 * read such a code as u - off, `code_offset`). One pass: a zero row costs what a scale row costs. */
static inline void expand_groups(int64_t fmt, int64_t per, const void *q, const void *d, int64_t G, int64_t row,
                                 float *restrict out, const float *restrict add, int off) {
    int64_t g = 0;
    if (fmt == LMF_SCALES_F16) {
        const uint16_t *h = (const uint16_t *)q + row * G;
#if defined(LMF_AVX2) && defined(__F16C__)
        for (; g + 8 <= G; g += 8) {
            __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g)));
            if (add) v = _mm256_fmadd_ps(_mm256_set1_ps((float)off), _mm256_loadu_ps(add + g), v);
            _mm256_storeu_ps(out + g, v);
        }
#endif
        for (; g < G; g++) out[g] = f16_scalar(h[g]) + (add ? (float)off * add[g] : 0.0f);
        return;
    }
    const int8_t *qi = (const int8_t *)q + row * G;
    const uint16_t *dd = (const uint16_t *)d + row * (G / per);
#if defined(LMF_AVX2) && defined(__F16C__)
    if (per == 8) {  /* the K-quants of 32: a super-block's d for each 8 groups, eight d at a time */
        float dv[8];
        for (; g + 64 <= G; g += 64) {
            _mm256_storeu_ps(dv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + g / 8))));
            for (int c = 0; c < 8; c++) {
                __m256 v = _mm256_mul_ps(_mm256_broadcast_ss(dv + c), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(qi + g + 8 * c)))));
                if (add) v = _mm256_fmadd_ps(_mm256_set1_ps((float)off), _mm256_loadu_ps(add + g + 8 * c), v);
                _mm256_storeu_ps(out + g + 8 * c, v);
            }
        }
    }
    if (per % 8 == 0)
        for (; g + 8 <= G; g += 8) {
            __m256 v = _mm256_mul_ps(_mm256_set1_ps(f16_scalar(dd[g / per])),
                                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qi + g)))));
            if (add) v = _mm256_fmadd_ps(_mm256_set1_ps((float)off), _mm256_loadu_ps(add + g), v);
            _mm256_storeu_ps(out + g, v);
        }
#endif
    for (; g < G; g++) out[g] = f16_scalar(dd[g / per]) * (float)qi[g] + (add ? (float)off * add[g] : 0.0f);
}

/* One weight row's scales (and zero offsets in the kernels' terms) as float32: pointers into the descriptor's own
 * float32 arrays where it holds them, else into ws_buf / wz_buf (LMF_MAX_G floats each). `sc` NULL: the plain
 * float32 scales `ws` (N, G) and no zeros. */
static inline void row_scales(const lmf_scales *sc, const float *ws, int64_t n, int64_t G, int64_t bits,
                              float *ws_buf, float *wz_buf, const float **ws_row, const float **wz_row) {
    *wz_row = NULL;
    if (sc == NULL || (sc->fmt == LMF_SCALES_F32 && sc->z == NULL)) {
        *ws_row = (sc == NULL ? ws : (const float *)sc->s) + n * G;
        return;
    }
    if (sc->fmt == LMF_SCALES_F32) {
        const float *s = (const float *)sc->s + n * G, *z = (const float *)sc->z + n * G;
        *ws_row = s;
        for (int64_t g = 0; g < G; g++) wz_buf[g] = z[g] + (float)code_offset(bits) * s[g];
    } else {
        expand_groups(sc->fmt, sc->per, sc->s, sc->sd, G, n, ws_buf, NULL, 0);
        *ws_row = ws_buf;
        if (sc->z == NULL) return;
        expand_groups(sc->fmt, sc->per, sc->z, sc->zd, G, n, wz_buf, bits < 8 ? ws_buf : NULL, code_offset(bits));
    }
    *wz_row = wz_buf;
}

/* ---- threads ------------------------------------------------------------------------------------------ */

/* Run fn on jobs[0 .. threads) (each `size` bytes), this thread taking job 0: OpenMP when built with it
 * (torch's own runtime: libgomp.so.1 is loaded once per process, and its worker threads, already
 * spinning after the last matmul, take the jobs; no second pool fights them for cores), else pthreads,
 * doing here any job that gets no thread. */
static inline void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int64_t threads) {
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

/* fn(args, r0, r1) over rows [0, rows) in contiguous shares, one a thread, each at least `per` rows (too few rows:
 * all on the calling thread). The row-parallel preparations and elementwise ops: a row's result never depends on
 * its share, so the thread count changes no number. */
typedef void (*rows_fn)(const void *args, int64_t r0, int64_t r1);
typedef struct {
    rows_fn fn;
    const void *args;
    int64_t r0, r1;
} rows_job;

static inline void *rows_range(void *arg) {
    const rows_job *j = (const rows_job *)arg;
    if (j->r0 < j->r1) j->fn(j->args, j->r0, j->r1);
    return NULL;
}

static inline void split_rows(rows_fn fn, const void *args, int64_t rows, int64_t per, int64_t threads) {
    if (per < 1) per = 1;
    if (threads > rows / per) threads = rows / per;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2) {
        if (rows > 0) fn(args, 0, rows);
        return;
    }
    rows_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (rows_job){fn, args, rows * t / threads, rows * (t + 1) / threads};
    run_jobs(rows_range, jobs, sizeof jobs[0], threads);
}

/* Work handed out in chunks from a shared counter (`next`), ~16 chunks a thread and at least 8 rows
 * each, so that a thread that starts late or runs slower (a busy sibling core) takes fewer and none
 * waits long for it (matmul rows: after a contiguous 7/8 of each share, `take_rows`). */
static inline int64_t chunk_rows(int64_t N, int64_t threads) {
    const int64_t chunk = (N / (16 * threads) + 7) / 8 * 8;
    return chunk < 8 ? 8 : chunk;
}

/* The next chunk [*n0, *n1) of rows [0, N), or 0 when none is left. */
static inline int take_chunk(int64_t *next, int64_t chunk, int64_t N, int64_t *n0, int64_t *n1) {
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
static inline int take_rows(int64_t *next, int64_t chunk, int64_t N, int64_t threads, int64_t *n0, int64_t *n1) {
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

/* As take_rows, for the panel bodies' unit of work, a pair of 16-row panels (32 weight rows): [*n0, *n1) of [0, N),
 * whole pairs but the last. take_rows counts in eighths of a pair here, so that its contiguous 7/8 of a share and
 * its single-unit tail are whole pairs. Chunks of about a quarter of a share (the panel GEMMs' split before
 * 2026-12-06) left one thread waiting up to one chunk at the end of every call: at a prefill chunk's 512 rows, the
 * main thread sat in libgomp's barrier for ~8% of a bf16 prefill's samples. */
static inline int take_pairs(int64_t *next, int64_t N, int64_t threads, int64_t *n0, int64_t *n1) {
    const int64_t pairs = (N + 31) / 32;
    int64_t u0, u1;
    if (!take_rows(next, 8, 8 * pairs, threads, &u0, &u1)) return 0;
    *n0 = u0 / 8 * 32;
    *n1 = u1 / 8 * 32 < N ? u1 / 8 * 32 : N;
    return 1;
}

/* ---- attention: shared by its files --------------------------------------------------------------------- */

/* The pool row (an index into P * B * K head rows) of kv head g for a tile's tokens [t0, t0 + nt). */
static inline void tile_rows(const int32_t *table, int64_t t0, int64_t nt, int64_t B, int64_t K, int64_t g,
                             int64_t *row) {
    for (int64_t i = 0; i < nt; i++) {
        const int64_t j = t0 + i;
        row[i] = ((int64_t)table[j / B] * B + j % B) * K + g;
    }
}

#ifdef LMF_AVX512
/* One sequence, all heads, bf16 q / pools / out (attention_avx512.c). */
LMF_HIDDEN void decode_seq(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *table,
                           int64_t len, int64_t N, int64_t K, int64_t H, int64_t B, float scale, uint16_t *out);
#endif

#ifdef LMF_X86
/* Float32 q over a float32 / bf16 pool, kv heads [g0, g1) of one sequence, tokens [t_begin, t_begin + len);
 * `part` NULL: the normalized output into out, else the unnormalized state (attention_avx2.c). */
typedef void (*decode_heads_fn)(const float *, const void *, const void *, const int32_t *, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *);
LMF_HIDDEN void decode_heads_f32_avx2(const float *q, const void *k_pool, const void *v_pool, const int32_t *table,
                                      int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1, int64_t G,
                                      int64_t K, int64_t H, int64_t B, float scale, float *out, float *part);
LMF_HIDDEN void decode_heads_bf16kv_avx2(const float *q, const void *k_pool, const void *v_pool, const int32_t *table,
                                         int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1,
                                         int64_t G, int64_t K, int64_t H, int64_t B, float scale, float *out,
                                         float *part);
#if defined(LMF_AVX512) && !defined(LMF_ATTN_AVX2)
#define LMF_ATTN_F32_AVX512 1  /* the same in 512-bit vectors, H % 16 == 0 (attention_avx512.c) */
LMF_HIDDEN void decode_heads_f32_avx512(const float *q, const void *k_pool, const void *v_pool, const int32_t *table,
                                        int64_t t_begin, int64_t len, int64_t pf_len, int64_t g0, int64_t g1, int64_t G,
                                        int64_t K, int64_t H, int64_t B, float scale, float *out, float *part);
LMF_HIDDEN void decode_heads_bf16kv_avx512(const float *q, const void *k_pool, const void *v_pool,
                                           const int32_t *table, int64_t t_begin, int64_t len, int64_t pf_len,
                                           int64_t g0, int64_t g1, int64_t G, int64_t K, int64_t H, int64_t B,
                                           float scale, float *out, float *part);
#endif
#endif

/* ---- int8-activation (A8) matmul: shared by qmm_a8*.c and dispatch.c ------------------------------------ */

/* The bodies, numbered in order of preference (`kernels.A8_ISAS`): with none asked for, the highest this
 * CPU runs (dispatch.c). */
enum { A8_PORTABLE = 0, A8_AVX2 = 1, A8_AVX_VNNI = 2, A8_AVX512_VNNI = 3, A8_AVX512_VNNI_256 = 4, A8_ISAS = 5 };

#define A8_MAX_R 4  /* activation rows a pass over a weight row */

/* The activations' quantization block for weights in groups of gs (gs = K: int8 per channel): one int8 scale a
 * block of the weight's group (32 under GGUF's groups of 16), so every group's integer dot product has one
 * weight scale and one activation scale (llama.cpp's q8_0 / q8_1 blocks of 32; per channel: per token, vLLM's
 * dynamic W8A8). */
static inline int64_t a8_block(int64_t gs) { return gs == 16 ? 32 : gs; }

typedef struct {
    const int8_t *q; const float *xs; const void *w; const float *ws; float *out;  /* xs: (M, A) */
    const float *qs;  /* xs * sum(q) of each group, (M, G): int4 on the 256-bit bodies, and with zeros; else NULL */
    const int32_t *qsum;  /* sum(q) of each group, (M, G): with the panel body and where qs is made; else NULL */
    const lmf_scales *sc;  /* the scales' (and zeros') form; NULL: the float32 `ws` and no zeros */
    int pairs;  /* int4 on the 256-bit bodies: q in `pair_order` (blocks taken two at a time) */
    const float *xp;  /* with pairs in groups of 32: each pair's two activation scales as 8 floats (x_A x4, x_B x4),
                       * (M, K / 64, 8), one load a pair and row; else NULL */
    int64_t M, N, K, gs, bits, n0, n1, isa, G;  /* G = K / gs groups a row */
    int64_t ab, A;  /* the activations' block (`a8_block`) and A = K / ab blocks a row, a scale each */
    int64_t *next, chunk, threads;  /* shared by the threads: the next chunk of weight rows (a8_range, take_rows) */
    char *scratch;  /* the panel body's buffers, this thread's (`a8_panel_scratch` bytes, 64-aligned); else NULL */
} a8_job;

/* One body: weight rows [j->n0, j->n1) for all j->M activation rows. */
typedef void (*a8_body_fn)(const a8_job *);
LMF_HIDDEN void a8_range_portable(const a8_job *j);
#ifdef LMF_X86
LMF_HIDDEN void a8_range_avx2(const a8_job *j);
#ifdef LMF_AVXVNNI
LMF_HIDDEN void a8_range_avxvnni(const a8_job *j);
#endif
LMF_HIDDEN void a8_range_avx512vnni256(const a8_job *j);
LMF_HIDDEN void a8_range_avx512vnni(const a8_job *j);
LMF_HIDDEN void a8_panel_avx512vnni(const a8_job *j);  /* qmm_a8_panel.c: many rows, 16 weight rows a panel */
LMF_HIDDEN void a8_lanes_avx512vnni(const a8_job *j);  /* qmm_a8_panel.c: a few rows on weights stored as panels */

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
/* As A8_ROWS_SWITCH, with the 5- and 6-bit codes too (the 256-bit bodies). */
#define A8_ROWS_SWITCH_ALL(FN, R, ...) do {                                          \
        if (j->bits == 6) switch (R) {                                                \
            case 1: FN(__VA_ARGS__, 1, 6); break;                                     \
            case 2: FN(__VA_ARGS__, 2, 6); break;                                     \
            case 3: FN(__VA_ARGS__, 3, 6); break;                                     \
            default: FN(__VA_ARGS__, 4, 6); break;                                    \
        } else if (j->bits == 5) switch (R) {                                         \
            case 1: FN(__VA_ARGS__, 1, 5); break;                                     \
            case 2: FN(__VA_ARGS__, 2, 5); break;                                     \
            case 3: FN(__VA_ARGS__, 3, 5); break;                                     \
            default: FN(__VA_ARGS__, 4, 5); break;                                    \
        } else A8_ROWS_SWITCH(FN, R, __VA_ARGS__);                                    \
    } while (0)
#endif

#ifdef LMF_X86
/* In place: r[i] lane j <- r[j] lane i, for 16 vectors of 16 int32 (a 16 x 16 transpose of 4-byte words): the
 * panel GEMMs' repack of 16 weight rows (qmm_a8_panel.c, gemm_bf16.c). */
__attribute__((target("avx512f"), always_inline)) static inline void lmf_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)  /* each 128-bit lane: word e of rows i..i+3 into r[i + e] */
        for (int h = 0; h < 2; h++) {
            r[i + 2 * h] = _mm512_unpacklo_epi64(t[i + h], t[i + 2 + h]);
            r[i + 2 * h + 1] = _mm512_unpackhi_epi64(t[i + h], t[i + 2 + h]);
        }
    /* within each 128-bit lane: the words of rows 4a..4a+3; now the lanes across the 4 groups of 4 rows */
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            t[i + 8 * h] = _mm512_shuffle_i32x4(r[i + 8 * h], r[i + 4 + 8 * h], 0x88);
            t[i + 4 + 8 * h] = _mm512_shuffle_i32x4(r[i + 8 * h], r[i + 4 + 8 * h], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
}

#endif

/* The bytes of one thread's panel buffers (qmm_a8_panel.c) for rows of K inputs in G groups: two panels of codes
 * (K bytes a weight row), scales and zero offsets (G floats each a row), a code row and two scale rows. */
#define A8_PANEL 16
static inline size_t a8_panel_scratch(int64_t K, int64_t G) {
    const size_t per = (size_t)K * A8_PANEL + (size_t)G * A8_PANEL * 8;
    return (2 * per + (size_t)K + 2 * LMF_MAX_G * sizeof(float) + 63) / 64 * 64;
}

/* On int4 and int8 weights stored as panels the lanes body takes calls below this many rows (`lmf_a8_lanes_rows` sets
 * it), the panel GEMM from it: the panel's per-call build (2 panels of bytes, 32 KB at K = 1,024: past Zen 4's L1)
 * costs more than re-reading the codes a pass of 4 rows. The 300M's 96 layer matmuls, 2 threads, Zen 4, panel / lanes
 * time (`python scripts/kernels_ab.py panels [--bits 8]`): Q4_0-like, 1 row 1.47, 4 1.64, 8 1.51, 16 1.23, 64 1.00;
 * int8 in groups of 32, 1 row 1.30, 8 1.32, 16 1.21, 32 1.16, 64 1.02. */
#define A8_LANES_MAX_ROWS 64

/* ---- the dispatch table (dispatch.c) ------------------------------------------------------------------- */

/* Filled once when the library is loaded, from the CPU's flags and what this build compiled; read by every
 * file that has more than one body for a CPU to choose from. */
typedef struct {
    int attn_avx2;                 /* float32-query attention: the AVX2 + FMA body runs on this CPU */
    a8_body_fn a8_body[A8_ISAS];   /* each A8 body, NULL where this build or this CPU lacks it */
    int64_t a8_best;               /* the A8 body `lmf_qmm_a8` runs when not told */
    a8_body_fn a8_panel;           /* the A8 panel GEMM (AVX-512 VNNI), NULL where this build or CPU lacks it */
    int64_t a8_panel_rows;         /* from how many rows the AVX-512 VNNI bodies hand a call to it (0: never) */
    int64_t a8_lanes_rows;         /* on weights stored as panels, below how many rows the lanes body runs instead */
    int bf16_panel;                /* the bf16 panel GEMM (gemm_bf16.c) runs on this CPU and build */
    int64_t bf16_panel_rows;       /* from how many rows `lmf_qmm_f32` hands bf16 weights to it (0: never) */
} lmf_dispatch_table;

LMF_HIDDEN extern lmf_dispatch_table lmf_dispatch;
LMF_HIDDEN int bf16_panel_cpu(void);  /* gemm_bf16.c: 1 where this build has its body and this CPU runs it */
/* gemm_bf16.c: float32 rows on bf16 weights stored as panels (`lmf_qmm_f32` below the panel GEMM's threshold) */
LMF_HIDDEN int bf16_lanes_f32(const float *x, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N,
                              int64_t K, int64_t threads);

/* ---- the exported API (ctypes: `kernels._bind`) --------------------------------------------------------- */

/* attention.c */
int lmf_paged_decode_bf16(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool,
                          const int32_t *block_tables, int64_t M, const int32_t *lens, const int64_t *rows,
                          int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale, uint16_t *out,
                          int64_t threads);
int lmf_paged_decode_any(const void *q, const void *k_pool, const void *v_pool, const uint16_t *k_scales,
                         const uint16_t *v_scales, const int32_t *block_tables, int64_t M, const int32_t *lens,
                         const int64_t *rows, int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale,
                         void *out, int64_t threads, int64_t act, int64_t kv);
/* attention_prefill.c */
int lmf_paged_prefill(const float *q, int64_t q_row_stride, int64_t q_head_stride, const void *k_pool,
                      const void *v_pool, int64_t kv, const int32_t *tables, int64_t tables_M, const int64_t *chunks,
                      int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale, float *out,
                      int64_t threads);
/* kv_write.c */
void lmf_write_kv_bf16(const uint16_t *k, const uint16_t *v, const int64_t *slots, int64_t T, int64_t row_len,
                       uint16_t *k_pool, uint16_t *v_pool);
void lmf_write_kv_bytes(const void *k, const void *v, const int64_t *slots, int64_t T, int64_t row_bytes,
                        void *k_pool, void *v_pool);
void lmf_write_kv_f32_bf16(const float *k, const float *v, const int64_t *slots, int64_t T, int64_t row_len,
                           uint16_t *k_pool, uint16_t *v_pool);
int lmf_write_kv_f32_bf16_strided(const float *k, const float *v, const int64_t *slots, int64_t T, int64_t row_len,
                                  int64_t k_stride, int64_t v_stride, uint16_t *k_pool, uint16_t *v_pool);
int lmf_write_kv_int8(const void *k, const void *v, const int64_t *slots, int64_t T, int64_t K, int64_t H,
                      int64_t act, int8_t *k_pool, int8_t *v_pool, uint16_t *k_scales, uint16_t *v_scales);
/* elementwise.c */
void lmf_rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t D, float eps,
                      int64_t threads);
void lmf_rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t T, int64_t heads, int64_t H,
                   int64_t threads);
void lmf_silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n);
void lmf_rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t D, float eps, int64_t threads);
void lmf_rope_f32(float *x, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t H, int64_t threads);
int lmf_rope_f32_strided(float *x, int64_t stride, const float *cos, const float *sin, int64_t T, int64_t heads,
                         int64_t H, int64_t threads);
void lmf_silu_mul_f32(const float *g, const float *u, float *out, int64_t n);
void lmf_silu_mul_rows_f32(const float *gu, float *out, int64_t rows, int64_t I, int64_t threads);
void lmf_silu_mul_rows_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I, int64_t threads);
/* qmm_f32.c, gemm_f32.c */
int lmf_qmm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                int64_t bits, int64_t gs, int64_t threads, int64_t gemm_rows, const lmf_scales *sc);
int lmf_gemm_f32(const float *x, const void *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                 int64_t bits, int64_t gs, int64_t threads, const lmf_scales *sc);
/* qmm_a8.c */
int lmf_quantize_s8(const void *x, int64_t act, int64_t M, int64_t K, int64_t nibble_order, int64_t ab, int8_t *q,
                    float *s);
int lmf_qmm_s8(const int8_t *q, const float *xs, const void *w, const float *ws, float *out, int64_t M, int64_t N,
               int64_t K, int64_t bits, int64_t gs, int64_t threads, int64_t isa, const lmf_scales *sc);
int lmf_qmm_a8(int64_t isa, const void *x, int64_t act, const void *w, const float *ws, float *out, int64_t M,
               int64_t N, int64_t K, int64_t bits, int64_t gs, int64_t threads, const lmf_scales *sc);
/* decode_layer.c */
int lmf_decode_layer_q(int64_t isa, const int64_t *p, float *x, int64_t M, const float *cos, const float *sin,
                       const int64_t *slots, const int32_t *tables, int64_t tables_M, const int32_t *lens,
                       const int64_t *rows, int64_t S, float eps, float scale);
int lmf_decode_stack_q(int64_t isa, int64_t n_layers, const int64_t *layers, float *x, int64_t M, const float *cos,
                       const float *sin, const int64_t *slots, const int32_t *tables, int64_t tables_M,
                       const int32_t *lens, const int64_t *rows, int64_t S, float eps, float scale);
/* dispatch.c */
int lmf_a8_isa_supported(int64_t isa);
int64_t lmf_a8_best_isa(void);
int64_t lmf_a8_panel_rows(int64_t rows);
int64_t lmf_a8_lanes_rows(int64_t rows);
int64_t lmf_bf16_panel_rows(int64_t rows);
/* gemm_bf16.c */
int lmf_gemm_bf16(const float *x, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N, int64_t K,
                  int64_t threads, int64_t layout);
/* As lmf_gemm_bf16 on silu(gate) * up of a fused gate_up output gu (M, 2 K), each row [gate | up]: SwiGLU's middle
 * computed in the GEMM's activation pass, the same float32 values as `lmf_silu_mul_rows_f32` (so the same bits) with
 * no (M, K) tensor written and read back. -1 where the build lacks AVX-512 (or what lmf_gemm_bf16 refuses). */
int lmf_gemm_bf16_swiglu(const float *gu, const uint16_t *w, const float *scale, float *out, int64_t M, int64_t N,
                         int64_t K, int64_t threads, int64_t layout);
const char *lmf_kernels_chosen(void);

#endif
