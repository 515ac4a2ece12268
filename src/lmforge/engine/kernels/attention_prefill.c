/* Paged prefill attention: every prefill chunk of a step in one call, causal, over the K/V the step has just
 * written into the pool (and whatever the sequence had cached before the chunk: a prefix-cache hit, the earlier
 * chunks of a long prompt), read in place through the block table. No gather, no padding, no mask tensor.
 *
 * Chunk c (chunks[c] = q_row, q_len, ctx): its query i sits at row q_row + i of q and out, at position
 * ctx + i of its sequence, and attends over the sequence's tokens [0, ctx + i]; token j lives in pool row
 * tables[c * tables_M + j / B] * B + j % B. Float32 queries and output, a bfloat16 (kv 0) or float32 (kv 1)
 * pool, all arithmetic in float32 (a bf16 row widened is exact): the same numbers as SDPA over the pool's K/V,
 * up to summation order. kv 2: a bfloat16 pool on the CPU's bf16 dot products (queries and probabilities rounded
 * to bf16, sums in float32; below, "bf16 dot products"), where this CPU and build have them, else as kv 0.
 *
 * The layout is the one that keeps the online softmax vertical: a vector's lanes are VL consecutive queries of
 * one head, so a tile of VL keys gives VL score vectors (one per key), and their max, exp and sum over the
 * tile are lane-wise, with no horizontal reduction anywhere. Per tile and query head: scores are VL
 * accumulators fed by one load of the transposed queries and VL broadcasts of the widened K rows per head
 * dimension; the output (transposed, H vectors) takes VL broadcast FMAs of the widened V rows per dimension.
 * One work item is (chunk, kv head, block of VL queries); its K/V tile rows are widened once for the G query
 * heads of the kv head. Items are handed out latest block first (the most keys) from a shared counter.
 *
 * Written in GNU C vector extensions, compiled for the build's target: 16 lanes in AVX-512 registers where the
 * compiler targets AVX-512F, 8 in AVX2's (and plain C elsewhere, the same code). Returns 0, or -1 for a shape
 * it does not take (the caller falls back to SDPA). */
#include "common.h"

#ifdef LMF_AVX512
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));  /* unaligned loads and stores */
typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));

#define SPLAT(x) ((vf){0} + (float)(x))
#define SELECT(m, a, b) ((vf)(((vi)(a) & (m)) | ((vi)(b) & ~(m))))  /* lane-wise m ? a : b, m all ones or zeros */

/* a > b ? a : b lane-wise (MAXPS's own rule, so the same lanes whichever form runs) */
static inline vf vmax(vf a, vf b) {
#if defined(LMF_AVX512) && VL == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(LMF_AVX2) && VL == 8
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return SELECT(a > b, a, b);
#endif
}

/* max(m, s[0], ..., s[VL - 1]) lane-wise as a tree, log2(VL) + 1 deep. One chain of VL compares and blends (~4
 * cycles each) had been the critical path between a tile's scores and its exponentials. Max is exact, so the order
 * changes no number (with no NaN among the scores; a +0 / -0 tie is the only choice it can flip, and s - m is then
 * the same). */
static inline vf tile_max(vf m, const vf *s) {
    vf t[VL / 2];
    LMF_UNROLL for (int i = 0; i < VL / 2; i++) t[i] = vmax(s[i], s[i + VL / 2]);
    LMF_UNROLL for (int w = VL / 4; w >= 1; w /= 2)
        LMF_UNROLL for (int i = 0; i < w; i++) t[i] = vmax(t[i], t[i + w]);
    return vmax(m, t[0]);
}

/* exp(x): lanes below -87.3 (-inf included) give 0 exactly, the rest within ~2 ulp: 2^n times a degree-7
 * polynomial of the remainder r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (the Cephes expf coefficients) */
static inline vf vexp(vf x) {
    const vi dead = x < SPLAT(-87.3f);
    x = SELECT(x < SPLAT(88.0f), x, SPLAT(88.0f));
    x = SELECT(dead, SPLAT(0.0f), x);
    const vf t = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);
    vi n = __builtin_convertvector(t, vi);            /* toward zero, then down where that rounded up: floor */
    n += (vi)(__builtin_convertvector(n, vf) > t);    /* -1 where true */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = (x - nf * SPLAT(0.693359375f)) - nf * SPLAT(-2.12194440e-4f);
    vf p = SPLAT(1.9875691500e-4f);
    p = p * r + SPLAT(1.3981999507e-3f);
    p = p * r + SPLAT(8.3334519073e-3f);
    p = p * r + SPLAT(4.1665795894e-2f);
    p = p * r + SPLAT(1.6666665459e-1f);
    p = p * r + SPLAT(5.0000001201e-1f);
    p = p * r * r + r + SPLAT(1.0f);
    return SELECT(dead, SPLAT(0.0f), p * (vf)((n + 127) << 23));
}

/* VL head vectors of H floats from pool rows (kv 0 bf16, 1 f32); rows past nt are zero */
static void widen_tile(const void *pool, int kv, const int64_t *row, int64_t nt, int64_t H, float *dst) {
    for (int64_t j = 0; j < VL; j++) {
        float *d = dst + j * H;
        if (j >= nt) {
            memset(d, 0, (size_t)H * sizeof(float));
        } else if (kv == 1) {
            memcpy(d, (const float *)pool + row[j] * H, (size_t)H * sizeof(float));
        } else {
            const uint16_t *s = (const uint16_t *)pool + row[j] * H;
            int64_t h = 0;
            for (; h + VL <= H; h += VL) {
                const vu w = __builtin_convertvector(*(const vh_u *)(s + h), vu) << 16;
                *(vf_u *)(d + h) = (vf)w;
            }
            for (; h < H; h++) d[h] = bf16_to_f32(s[h]);
        }
    }
}

typedef struct {
    const float *q;
    const void *k_pool, *v_pool;
    const int32_t *tables;
    const int64_t *chunks, *first_item;  /* first_item[c]: chunk c's first item index; [S] = all items */
    int64_t tables_M, S, N, K, H, B, q_row_stride, q_head_stride, kv;
    float scale;
    float *out;
    int64_t *next;
    float *scratch;  /* this thread's: queries and outputs transposed, the tile's widened K and V */
} prefill_job;

/* an item's outputs, H vectors of VL queries (ot), times inv, into nq rows of dst `stride` floats apart: 16 x 16
 * transposes where the lanes are 16 (each row's dimensions stored together), else lane by lane. Stored lane by lane,
 * 16 rows 4 KB apart (the 300M's N x H) hit one cache set: ~20% of a bf16 item's samples. */
static void store_rows(const vf *ot, const vf inv, float *dst, int64_t nq, int64_t stride, int64_t H) {
    int64_t h = 0;
#if defined(LMF_X86) && VL == 16
    for (; h + 16 <= H; h += 16) {
        __m512i r[16];
        for (int k = 0; k < 16; k++) r[k] = (__m512i)(ot[h + k] * inv);
        lmf_transpose16(r);
        for (int64_t i = 0; i < nq; i++) _mm512_storeu_si512(dst + i * stride + h, r[i]);
    }
#endif
    for (; h < H; h++) {
        const vf v = ot[h] * inv;
        for (int64_t i = 0; i < nq; i++) dst[i * stride + h] = v[i];
    }
}

/* one item: chunk c, kv head g, queries [p0, p0 + nq) of the chunk */
static void prefill_item(const prefill_job *j, int64_t c, int64_t g, int64_t p0, int64_t nq, float *scr) {
    const int64_t H = j->H, G = j->N / j->K, q_row = j->chunks[3 * c], ctx = j->chunks[3 * c + 2];
    const int32_t *table = j->tables + c * j->tables_M;
    vf *qt = (vf *)scr, *ot = qt + G * H;              /* (G, H) vectors: queries and outputs, transposed */
    float *kf = (float *)(ot + G * H), *vfl = kf + VL * H;  /* the tile's K and V rows, widened */
    vf mx[MAX_G], sum[MAX_G];
    vi pos;                                             /* each lane's position; lanes past nq repeat the last */
    for (int64_t i = 0; i < VL; i++) pos[i] = (int32_t)(ctx + p0 + (i < nq ? i : nq - 1));
    for (int64_t hh = 0; hh < G; hh++) {
        const float *qh = j->q + (q_row + p0) * j->q_row_stride + (g * G + hh) * j->q_head_stride;
        for (int64_t h = 0; h < H; h++) {
            vf v;
            for (int64_t i = 0; i < VL; i++) v[i] = qh[(i < nq ? i : nq - 1) * j->q_row_stride + h] * j->scale;
            qt[hh * H + h] = v;
            ot[hh * H + h] = SPLAT(0.0f);
        }
        mx[hh] = SPLAT(-INFINITY);
        sum[hh] = SPLAT(0.0f);
    }
    const int64_t last = ctx + p0 + nq - 1, first = ctx + p0;  /* keys [0, last]; lane 0 sees [0, first] */
    for (int64_t t0 = 0; t0 <= last; t0 += VL) {
        const int64_t nt = last + 1 - t0 < VL ? last + 1 - t0 : VL;
        int64_t row[VL];
        tile_rows(table, t0, nt, j->B, j->K, g, row);
        widen_tile(j->k_pool, (int)j->kv, row, nt, H, kf);
        widen_tile(j->v_pool, (int)j->kv, row, nt, H, vfl);
        const int masked = t0 + VL - 1 > first;  /* some key of the tile is past some lane's position */
        for (int64_t hh = 0; hh < G; hh++) {
            vf s[VL];
            for (int64_t t = 0; t < VL; t++) s[t] = SPLAT(0.0f);
            const vf *qv = qt + hh * H;
            for (int64_t h = 0; h < H; h++) {
                const vf a = qv[h];
                for (int64_t t = 0; t < VL; t++) s[t] += a * kf[t * H + h];
            }
            if (masked)
                for (int64_t t = 0; t < VL; t++) s[t] = SELECT(pos >= (vi){0} + (int32_t)(t0 + t), s[t], SPLAT(-INFINITY));
            const vf m = tile_max(mx[hh], s);
            const vf alpha = vexp(mx[hh] - m);  /* 0 on the first tile: exp(-inf) */
            vf tile_sum = SPLAT(0.0f);
            for (int64_t t = 0; t < VL; t++) {
                s[t] = vexp(s[t] - m);
                tile_sum += s[t];
            }
            sum[hh] = sum[hh] * alpha + tile_sum;
            mx[hh] = m;
            vf *o = ot + hh * H;
            for (int64_t h = 0; h < H; h += 4) {  /* four dimensions at a time: four independent FMA chains */
                vf a0 = o[h] * alpha, a1 = o[h + 1] * alpha, a2 = o[h + 2] * alpha, a3 = o[h + 3] * alpha;
                for (int64_t t = 0; t < VL; t++) {
                    const float *vr = vfl + t * H + h;
                    a0 += s[t] * vr[0];
                    a1 += s[t] * vr[1];
                    a2 += s[t] * vr[2];
                    a3 += s[t] * vr[3];
                }
                o[h] = a0;
                o[h + 1] = a1;
                o[h + 2] = a2;
                o[h + 3] = a3;
            }
        }
    }
    for (int64_t hh = 0; hh < G; hh++)
        store_rows(ot + hh * H, SPLAT(1.0f) / sum[hh], j->out + ((q_row + p0) * j->N + g * G + hh) * H, nq, j->N * H, H);
}

#if defined(LMF_BF16_DOTS) && VL == 16
#define PREFILL_BF16 1
/* ---- bf16 dot products (kv 2: a bf16 pool, on a CPU with AVX512-BF16) ---------------------------------------------
 *
 * The same item, layout and online softmax with both products on `vdpbf16ps` (two bf16 products summed into a
 * float32 lane, twice the float32 FMA's work an instruction): the queries (scaled) and each tile's probabilities are
 * rounded to bf16, the K/V are the pool's own bf16, every sum stays float32 (FlashAttention's precision, and
 * OpenVINO's on this CPU). The engine asks for it only where the linears already round their activations (the bf16
 * panel GEMM, int8 activations), so the queries come out of a GEMM on bf16-rounded inputs anyway.
 *   scores: a query vector holds dimensions (h, h + 1) of the 16 queries, one dword a lane, and each key row's dword
 *     at h is broadcast from a copy of the tile's 16 rows side by side (bf16 as the pool holds them, no widening):
 *     H / 2 instructions a key;
 *   output: the tile's probabilities as pairs of keys (t, t + 1) a lane, and V as the same pairs a dimension (the
 *     tile's rows interleaved two by two once per kv head, for its G query heads). */

/* exp(x) for the bf16 body: common.h's exp_ps (rel. error ~2e-7; AVX-512's rounding and scaling instructions, ~12
 * instructions against `vexp`'s ~25, whose clamps and floor are written for any vector width), lanes below -87.3 (-inf
 * included: masked keys, the first tile's old max) at 0 exactly. The probabilities are rounded to bf16 next, so its
 * last bits against vexp's change nothing a bf16 product keeps; the sums move by float32 rounding. 512 tokens, 24
 * layers, in turns (Zen 5, 2 threads): 28.1 -> 24.2 ms, outputs within 1.5e-4 of vexp's. */
__attribute__((target(LMF_TARGET_BF16))) static inline vf exp_b(vf x) {
    return (vf)_mm512_maskz_mov_ps(_mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), exp_ps((__m512)x));
}

/* lane i: (bf16(a_i), bf16(b_i)), a in the low half */
__attribute__((target(LMF_TARGET_BF16))) static inline __m512i pair_bf16(const __m512 a, const __m512 b) {
    const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  /* words 0..15: a, 16..31: b */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, ab);
}

/* the tile's K rows (pointers, bf16) side by side in kt (16 x H), and its V rows as pairs of tokens:
 * vw[e * H + h] = (v[2e][h], v[2e + 1][h]) */
__attribute__((target(LMF_TARGET_BF16), always_inline)) static inline void copy_tile(
        const uint16_t *const *kr, const uint16_t *const *vr, uint16_t *kt, uint32_t *vw, const int H) {
    LMF_UNROLL for (int t = 0; t < VL; t++)
        LMF_UNROLL for (int h = 0; h < H; h += 32)
            _mm512_storeu_si512(kt + t * H + h, _mm512_loadu_si512(kr[t] + h));
    LMF_UNROLL for (int e = 0; e < VL / 2; e++)
        LMF_UNROLL for (int h = 0; h < H; h += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[2 * e] + h)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[2 * e + 1] + h)));
            _mm512_storeu_si512(vw + e * H + h, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

/* one query head's tile: scores against the 16 key rows, the online softmax update, the output's update. H a
 * constant, so that every key's and V pair's broadcast is one pointer plus a fixed displacement. */
__attribute__((target(LMF_TARGET_BF16), always_inline)) static inline void tile_head_bf16(
        const __m512i *qp, const uint16_t *kt, const uint32_t *vw, int masked, vi pos, int64_t t0, vf *mx, vf *sum,
        vf *o, const int H) {
    __m512 s[VL];
    LMF_UNROLL for (int t = 0; t < VL; t++) s[t] = _mm512_setzero_ps();
    for (int d = 0; d < H / 2; d++) {
        const __m512i a = qp[d];
        LMF_UNROLL for (int t = 0; t < VL; t++) s[t] = dpbf16_bcast(s[t], a, kt + t * H + 2 * d);
    }
    if (masked)
        LMF_UNROLL for (int t = 0; t < VL; t++) s[t] = SELECT(pos >= (vi){0} + (int32_t)(t0 + t), s[t], SPLAT(-INFINITY));
    const vf m = tile_max(*mx, (const vf *)s);
    const vf alpha = exp_b(*mx - m);
    vf tile_sum = SPLAT(0.0f);
    __m512i pp[VL / 2];
    LMF_UNROLL for (int e = 0; e < VL / 2; e++) {
        const vf p0 = exp_b(s[2 * e] - m), p1 = exp_b(s[2 * e + 1] - m);
        tile_sum += p0 + p1;
        pp[e] = pair_bf16(p0, p1);
    }
    *sum = *sum * alpha + tile_sum;
    *mx = m;
    for (int h = 0; h < H; h += 8) {  /* eight dimensions at a time: eight independent chains */
        __m512 acc[8];
        LMF_UNROLL for (int i = 0; i < 8; i++) acc[i] = o[h + i] * alpha;
        LMF_UNROLL for (int e = 0; e < VL / 2; e++)
            LMF_UNROLL for (int i = 0; i < 8; i++) acc[i] = dpbf16_bcast(acc[i], pp[e], vw + e * H + h + i);
        LMF_UNROLL for (int i = 0; i < 8; i++) o[h + i] = acc[i];
    }
}

/* prefill_item on bf16 dot products, H a constant (64 or 128) */
__attribute__((target(LMF_TARGET_BF16), always_inline)) static inline void item_bf16(
        const prefill_job *j, int64_t c, int64_t g, int64_t p0, int64_t nq, float *scr, const int H) {
    const int64_t G = j->N / j->K, q_row = j->chunks[3 * c], ctx = j->chunks[3 * c + 2];
    const int32_t *table = j->tables + c * j->tables_M;
    __m512i *qp = (__m512i *)scr;              /* (G, H / 2): query pairs, a lane a query */
    vf *ot = (vf *)(qp + G * H / 2);           /* (G, H): outputs, transposed */
    uint32_t *vw = (uint32_t *)(ot + G * H);   /* (VL / 2, H): the tile's V as pairs of tokens */
    uint16_t *kt = (uint16_t *)(vw + VL / 2 * H);  /* (VL, H): the tile's K rows */
    vf mx[MAX_G], sum[MAX_G];
    vi pos;
    for (int64_t i = 0; i < VL; i++) pos[i] = (int32_t)(ctx + p0 + (i < nq ? i : nq - 1));
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int64_t hh = 0; hh < G; hh++) {  /* 16 dimensions of the 16 query rows at a time, transposed to a lane each */
        const float *qh = j->q + (q_row + p0) * j->q_row_stride + (g * G + hh) * j->q_head_stride;
        for (int h0 = 0; h0 < H; h0 += 16) {
            __m512i r[16];
            for (int64_t i = 0; i < VL; i++)
                r[i] = (__m512i)(_mm512_loadu_ps(qh + (i < nq ? i : nq - 1) * j->q_row_stride + h0) * scale);
            lmf_transpose16(r);
            for (int k = 0; k < 16; k += 2) qp[hh * H / 2 + (h0 + k) / 2] = pair_bf16((__m512)r[k], (__m512)r[k + 1]);
        }
        for (int h = 0; h < H; h++) ot[hh * H + h] = SPLAT(0.0f);
        mx[hh] = SPLAT(-INFINITY);
        sum[hh] = SPLAT(0.0f);
    }
    const int64_t last = ctx + p0 + nq - 1, first = ctx + p0;
    const uint16_t *kp = (const uint16_t *)j->k_pool, *vp = (const uint16_t *)j->v_pool;
    for (int64_t t0 = 0; t0 <= last; t0 += VL) {
        const int64_t nt = last + 1 - t0 < VL ? last + 1 - t0 : VL;
        int64_t row[VL];
        tile_rows(table, t0, nt, j->B, j->K, g, row);
        const uint16_t *kr[VL], *vr[VL];
        for (int64_t t = 0; t < VL; t++) {  /* rows past nt repeat the last: read, then masked to probability 0 */
            kr[t] = kp + row[t < nt ? t : nt - 1] * H;
            vr[t] = vp + row[t < nt ? t : nt - 1] * H;
        }
        copy_tile(kr, vr, kt, vw, H);
        const int masked = t0 + VL - 1 > first;
        for (int64_t hh = 0; hh < G; hh++)
            tile_head_bf16(qp + hh * H / 2, kt, vw, masked, pos, t0, &mx[hh], &sum[hh], ot + hh * H, H);
    }
    for (int64_t hh = 0; hh < G; hh++)
        store_rows(ot + hh * H, SPLAT(1.0f) / sum[hh], j->out + ((q_row + p0) * j->N + g * G + hh) * H, nq,
                   j->N * H, H);
}

__attribute__((target(LMF_TARGET_BF16))) static void prefill_item_bf16(const prefill_job *j, int64_t c, int64_t g,
                                                                       int64_t p0, int64_t nq, float *scr) {
    if (j->H == 64) item_bf16(j, c, g, p0, nq, scr, 64);
    else item_bf16(j, c, g, p0, nq, scr, 128);  /* lmf_paged_prefill takes kv 2 for these two only */
}
#endif

static void *prefill_range(void *arg) {
    const prefill_job *j = (const prefill_job *)arg;
    const int64_t total = j->first_item[j->S];
    for (;;) {
        const int64_t i = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED);
        if (i >= total) break;
        int64_t c = 0;
        while (j->first_item[c + 1] <= i) c++;
        const int64_t local = i - j->first_item[c], q_len = j->chunks[3 * c + 1];
        const int64_t blocks = (q_len + VL - 1) / VL, b = blocks - 1 - local / j->K, g = local % j->K;
        const int64_t p0 = b * VL, nq = q_len - p0 < VL ? q_len - p0 : VL;
#ifdef PREFILL_BF16
        if (j->kv == 2) {
            prefill_item_bf16(j, c, g, p0, nq, j->scratch);
            continue;
        }
#endif
        prefill_item(j, c, g, p0, nq, j->scratch);
    }
    return NULL;
}

int lmf_paged_prefill(const float *q, int64_t q_row_stride, int64_t q_head_stride, const void *k_pool,
                      const void *v_pool, int64_t kv, const int32_t *tables, int64_t tables_M, const int64_t *chunks,
                      int64_t S, int64_t N, int64_t K, int64_t H, int64_t B, float scale, float *out,
                      int64_t threads) {
    if (kv < 0 || kv > 2 || S < 1 || K < 1 || N % K || N / K > MAX_G || H < 4 || H % 4 || H > MAX_H || B < 1)
        return -1;
#ifdef PREFILL_BF16
    if (kv == 2 && (!lmf_dispatch.bf16_panel || (H != 64 && H != 128))) kv = 0;  /* float32 math, same pool */
#else
    if (kv == 2) kv = 0;
#endif
    int64_t *first_item = (int64_t *)malloc((size_t)(S + 1) * sizeof(int64_t));
    if (first_item == NULL) return -1;
    first_item[0] = 0;
    for (int64_t c = 0; c < S; c++) {
        const int64_t q_len = chunks[3 * c + 1], ctx = chunks[3 * c + 2];
        if (q_len < 1 || ctx < 0 || (ctx + q_len + B - 1) / B > tables_M) {
            free(first_item);
            return -1;
        }
        first_item[c + 1] = first_item[c] + (q_len + VL - 1) / VL * K;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > first_item[S]) threads = first_item[S];
    /* each thread's scratch, taken here: a failed allocation is this call's -1, not rows left unwritten */
    const size_t per = (size_t)(2 * (N / K) * H * VL + 2 * VL * H) * sizeof(float);
    float *scratch = (float *)aligned_alloc(64, per * (size_t)threads);
    if (scratch == NULL) {
        free(first_item);
        return -1;
    }
    int64_t next = 0;
    prefill_job jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (prefill_job){q, k_pool, v_pool, tables, chunks, first_item, tables_M, S, N, K, H, B, q_row_stride,
                                q_head_stride, kv, scale, out, &next, (float *)((char *)scratch + per * (size_t)t)};
    run_jobs(prefill_range, jobs, sizeof jobs[0], threads);
    free(scratch);
    free(first_item);
    return 0;
}
