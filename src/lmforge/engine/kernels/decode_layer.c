/* One decoder layer of a decode step in one C call (and every layer of the step in one: the stack), float32
 * activations, int8 / int4 / bf16 / float32 weights: the other files' kernels in the engine's order
 * (`lmforge.engine.decode_layer` builds the parameter arrays).
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
 * p: the layer, as int64 (pointers as integers):
 *   0 in_norm_w  1 post_norm_w  2 D  3 N heads  4 K kv heads  5 H head dim  6 F intermediate  7 block size
 *   8 k_pool  9 v_pool  10 threads (matmuls)  11 threads (attention)
 *   12 the K/V pool's dtype: 1 float32, 0 bfloat16 (written rounded to nearest even)
 *   13 q, k, v apart (1: three matmuls, as a GGUF Q4_K_M file's layers whose v is Q6_K; 0: one fused qkv)
 *   14 gate, up apart (1: two matmuls; 0: one fused gate_up)
 *   15.. the linears, LIN values each: codes, float32 scales (or 0), the scales' descriptor (`lmf_scales`, with the
 *        zero offsets; 0: the float32 scales, no zeros), bits, gs (<= 0 per channel),
 *        gemm_rows (lmf_qmm_f32's: from this many rows the panel GEMM), bf16_rows (bf16 weights: from this many rows
 *        `lmf_gemm_bf16`, activations rounded to bf16; 0 never); in order qkv (or q, k, v), o, gate_up (or
 *        gate, up), down. Each linear keeps its own format: a GGUF file mixes them within a layer.
 * cos, sin: (M, H); slots (M); tables (S, tables_M) int32, lens (S) int32, rows (S) int64: as
 * lmf_paged_decode_any. Returns 0, or the first failing kernel's code. */
#include "common.h"

#define LIN 7

/* out (M, n_out) = x (M, n_in) times linear `l` of the layer's parameters. */
static int linear(int64_t isa, const int64_t *p, int l, const float *x, float *out, int64_t M, int64_t n_out,
                  int64_t n_in) {
    const int64_t *w = p + 15 + l * LIN, th = p[10];
    const void *codes = (const void *)w[0];
    const float *scales = (const float *)w[1];
    const lmf_scales *sc = (const lmf_scales *)w[2];
    if (isa >= 0) return lmf_qmm_a8(isa, x, 1, codes, scales, out, M, n_out, n_in, w[3], w[4], th, sc);
    if (w[6] > 0 && w[3] == 16 && M >= w[6] &&  /* stored as panels or not, as the descriptor says */
        lmf_gemm_bf16(x, (const uint16_t *)codes, scales, out, M, n_out, n_in, th, sc ? sc->layout : LMF_ROWS) == 0)
        return 0;
    return lmf_qmm_f32(x, codes, scales, out, M, n_out, n_in, w[3], w[4], th, w[5], sc);
}

/* q, k, v rows (M, NQ), (M, NK), (M, NK) from h: one fused matmul split apart, or three. */
static int project_qkv(int64_t isa, const int64_t *p, const float *h, float *qkv, float *q, float *k, float *v,
                       int64_t M, int64_t D, int64_t NQ, int64_t NK) {
    int rc;
    if (p[13]) {
        if ((rc = linear(isa, p, 0, h, q, M, NQ, D)) || (rc = linear(isa, p, 1, h, k, M, NK, D))) return rc;
        return linear(isa, p, 2, h, v, M, NK, D);
    }
    const int64_t NQKV = NQ + 2 * NK;
    if ((rc = linear(isa, p, 0, h, qkv, M, NQKV, D))) return rc;
    for (int64_t m = 0; m < M; m++) {
        memcpy(q + m * NQ, qkv + m * NQKV, (size_t)NQ * sizeof(float));
        memcpy(k + m * NK, qkv + m * NQKV + NQ, (size_t)NK * sizeof(float));
        memcpy(v + m * NK, qkv + m * NQKV + NQ + NK, (size_t)NK * sizeof(float));
    }
    return 0;
}

/* act (M, F) = silu(h W_gate) * (h W_up): gate and up side by side from one fused matmul, or two matmuls. */
static int gate_up(int64_t isa, const int64_t *p, int l, const float *h, float *gu, float *act, int64_t M,
                   int64_t D, int64_t F) {
    int rc;
    if (p[14]) {
        if ((rc = linear(isa, p, l, h, gu, M, F, D)) || (rc = linear(isa, p, l + 1, h, gu + M * F, M, F, D))) return rc;
        lmf_silu_mul_f32(gu, gu + M * F, act, M * F);
        return 0;
    }
    if ((rc = linear(isa, p, l, h, gu, M, 2 * F, D))) return rc;
    for (int64_t m = 0; m < M; m++)  /* gate and up side by side in each row: silu_mul takes them apart */
        lmf_silu_mul_f32(gu + m * 2 * F, gu + m * 2 * F + F, act + m * F, F);
    return 0;
}

int lmf_decode_layer_q(int64_t isa, const int64_t *p, float *x, int64_t M, const float *cos, const float *sin,
                       const int64_t *slots, const int32_t *tables, int64_t tables_M, const int32_t *lens,
                       const int64_t *rows, int64_t S, float eps, float scale) {
    const int64_t D = p[2], N = p[3], K = p[4], H = p[5], F = p[6], B = p[7];
    const int64_t th_attn = p[11], kv = p[12], NQ = N * H, NK = K * H, NQKV = NQ + 2 * NK;
    if (kv != 0 && kv != 1) return -1;
    const int o_l = p[13] ? 3 : 1, gu_l = o_l + 1, down_l = gu_l + (p[14] ? 2 : 1);
    const float *in_w = (const float *)p[0], *post_w = (const float *)p[1];
    const int64_t floats = M * (D + NQKV + NQ + 2 * NK + NQ + 2 * F + F + D);
    float *buf = (float *)malloc((size_t)floats * sizeof(float));
    if (buf == NULL) return -1;
    float *h = buf, *qkv = h + M * D, *q = qkv + M * NQKV, *k = q + M * NQ, *v = k + M * NK, *att = v + M * NK;
    float *gu = att + M * NQ, *act = gu + M * 2 * F, *o = act + M * F;
    int rc = 0;
    lmf_rmsnorm_f32(x, in_w, h, M, D, eps, 1);
    if ((rc = project_qkv(isa, p, h, qkv, q, k, v, M, D, NQ, NK))) goto done;
    lmf_rope_f32(q, cos, sin, M, N, H, 1);
    lmf_rope_f32(k, cos, sin, M, K, H, 1);
    if (kv == 0)
        lmf_write_kv_f32_bf16(k, v, slots, M, NK, (uint16_t *)p[8], (uint16_t *)p[9]);
    else
        lmf_write_kv_bytes(k, v, slots, M, NK * (int64_t)sizeof(float), (void *)p[8], (void *)p[9]);
    if ((rc = lmf_paged_decode_any(q, (const void *)p[8], (const void *)p[9], NULL, NULL, tables, tables_M, lens,
                                   rows, S, N, K, H, B, scale, att, th_attn, 1, kv)))
        goto done;
    if ((rc = linear(isa, p, o_l, att, o, M, D, NQ))) goto done;
    for (int64_t i = 0; i < M * D; i++) x[i] = x[i] + o[i];
    lmf_rmsnorm_f32(x, post_w, h, M, D, eps, 1);
    if ((rc = gate_up(isa, p, gu_l, h, gu, act, M, D, F))) goto done;
    if ((rc = linear(isa, p, down_l, act, o, M, D, F))) goto done;
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
