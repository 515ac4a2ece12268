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
 * p: the layer, 24 values as int64 (pointers as integers):
 *   0 in_norm_w  1 post_norm_w  2 D  3 N heads  4 K kv heads  5 H head dim  6 F intermediate  7 block size
 *   8 qkv codes  9 qkv scales  10 o codes  11 o scales  12 gate_up codes  13 gate_up scales
 *   14 down codes  15 down scales  16 bits  17 gs (group size; <= 0 per channel)  18 k_pool  19 v_pool
 *   20 threads (matmuls)  21 threads (attention)  22 gemm_rows (lmf_qmm_f32's: from this many rows the panel GEMM)
 *   23 the K/V pool's dtype: 1 float32, 0 bfloat16 (written rounded to nearest even)
 * cos, sin: (M, H); slots (M); tables (S, tables_M) int32, lens (S) int32, rows (S) int64: as
 * lmf_paged_decode_any. Returns 0, or the first failing kernel's code. */
#include "common.h"

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
