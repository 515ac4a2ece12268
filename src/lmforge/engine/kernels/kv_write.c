/* K/V writes: this step's K/V rows into their pool slots (vLLM's `reshape_and_cache`), one call for all T
 * tokens; slots[t] is token t's pool row. A bf16, float32 or any-element pool takes the rows as they are;
 * float32 rows into a bf16 pool are rounded (nearest even); an int8 pool takes codes and a bf16 scale per
 * token and kv head. Plain C on every CPU (memcpy and loops the compiler vectorizes).
 */
#include "common.h"

/* K/V of this step's T tokens into their pool rows (vLLM's reshape_and_cache): row_len = K * H. */
void lmf_write_kv_bf16(const uint16_t *k, const uint16_t *v, const int64_t *slots, int64_t T, int64_t row_len,
                       uint16_t *k_pool, uint16_t *v_pool) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_pool + slots[t] * row_len, k + t * row_len, (size_t)row_len * 2);
        memcpy(v_pool + slots[t] * row_len, v + t * row_len, (size_t)row_len * 2);
    }
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
    lmf_write_kv_f32_bf16_strided(k, v, slots, T, row_len, row_len, row_len, k_pool, v_pool);
}

/* The same from rows k_stride and v_stride floats apart (k and v where they lie in the fused q/k/v projection's
 * output: no copy of each first). Returns 0. */
int lmf_write_kv_f32_bf16_strided(const float *k, const float *v, const int64_t *slots, int64_t T, int64_t row_len,
                                  int64_t k_stride, int64_t v_stride, uint16_t *k_pool, uint16_t *v_pool) {
    for (int64_t t = 0; t < T; t++) {
        uint16_t *kd = k_pool + slots[t] * row_len, *vd = v_pool + slots[t] * row_len;
        const float *ks = k + t * k_stride, *vs = v + t * v_stride;
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
