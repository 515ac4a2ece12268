/* The dispatch table: which body of each kernel runs, decided once, when the library is loaded, from the CPU's
 * flags (`__builtin_cpu_supports`) and what this build compiled (common.h's LMF_* macros). Every other file
 * reads `lmf_dispatch` and decides nothing about the CPU itself.
 *
 * Two kinds of choice:
 *   - at build time, by the compiler's target (-march=native at first use, so this CPU's): the bf16 attention
 *     and elementwise bodies (AVX-512 or portable C), the A16 row kernel and the panel GEMM (AVX2 + FMA or
 *     portable / none);
 *   - at load, by the CPU's flags, among bodies compiled with their own target attributes (so one x86 build
 *     runs anywhere and a test can force each): the float32-query attention body (AVX2 + FMA) and the
 *     int8-activation bodies (avx512_vnni_256, avx512_vnni, avx_vnni, avx2, portable).
 * `lmf_kernels_chosen` names them all in one line, for `kernels.status()` and the startup line.
 */
#include "common.h"

#include <stdio.h>

LMF_HIDDEN lmf_dispatch_table lmf_dispatch;

/* 1 if this CPU has body `isa`'s instructions (whether the build has it is the table's NULL). */
static int a8_cpu_runs(int64_t isa) {
    if (isa == A8_PORTABLE) return 1;
#ifdef LMF_X86
    if (isa == A8_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if defined(LMF_AVXVNNI)
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

/* The bodies the compiler's target chose for whole files (common.h's LMF_AVX512, LMF_AVX2), by name. */
#if defined(LMF_AVX512) && defined(__AVX512BF16__)
#define ATTN_BF16 "avx512_bf16"
#elif defined(LMF_AVX512)
#define ATTN_BF16 "avx512"
#else
#define ATTN_BF16 "portable"
#endif
#ifdef LMF_AVX512
#define ELEMENTWISE_BF16 "avx512"
#else
#define ELEMENTWISE_BF16 "portable"
#endif
/* attention_prefill.c's vector C, as the compiler lowered it: 16 lanes in AVX-512 registers, 8 in AVX2's */
#if defined(LMF_AVX512)
#define ATTN_PREFILL "avx512"
#elif defined(__AVX2__) && !defined(LMF_PORTABLE)
#define ATTN_PREFILL "avx2"
#else
#define ATTN_PREFILL "portable"
#endif
#ifdef LMF_AVX2
#define QMM_F32 "avx2"
#define GEMM_F32 "avx2"
#else
#define QMM_F32 "portable"
#define GEMM_F32 "none"
#endif

static const char *const a8_names[A8_ISAS] = {"portable", "avx2", "avx_vnni", "avx512_vnni", "avx512_vnni_256"};
static char chosen[320];  /* lmf_kernels_chosen's line, written with the table */

/* many rows go to the panel GEMM from this many: where it passes the best row body with the weights read from memory,
 * as a decode step reads them. It was 16 (best row body / panel time at 8 rows 0.58-1.30, int8 per channel / int4
 * g128); since the panel prefetches the next panels' rows (qmm_a8_panel.c), int4 g32 at 6 / 8 / 12 rows reads 1.03-1.30
 * / 1.11-1.44 / 1.37-1.70 and int8 per channel 0.91-1.27 / 0.84-0.98 / 1.27-1.42 (Zen 4, 2 threads, the 300M's
 * shapes, `lmforge bench linear --group-size 32 --batches 6,8,12,16`), and in the engine (`LLM.generate`, 32
 * requests at 6 in flight, threshold 6 against 16 in one sitting) Q4_0 +1-13%, Q8_0 +11-25%; at 4 in flight it
 * loses (Q4_0 -6%). docs/engine.md, "The A8 panel GEMM" */
#define A8_PANEL_ROWS 6
/* bf16 weights go to the bf16 panel GEMM (gemm_bf16.c) from this many rows, the exact float32 row kernel below:
 * Zen 4, 2 threads, the 300M's shapes read from memory, row kernel / panel time at 1, 2, 4, 16 rows: 0.64-0.75,
 * 1.05-1.24, 1.13-1.87, 1.69-2.93 (`lmforge bench linear --batches 1,2,4,6,8,16,64`); 2-3 rows stay exact, where
 * the gain is a few percent on two shapes of three */
#define BF16_PANEL_ROWS 4

#ifdef LMF_ATTN_F32_AVX512
#define ATTN_F32_WIDE "avx512"  /* the build targets AVX-512F, so the CPU has it (head sizes % 16; else avx2) */
#else
#define ATTN_F32_WIDE (lmf_dispatch.attn_avx2 ? "avx2" : "portable")
#endif

static void write_chosen(void) {
    char panel[48] = "none", bf16[48] = "none";  /* "avx512_vnni/16rows": the body, and from how many rows it runs */
    if (lmf_dispatch.bf16_panel && lmf_dispatch.bf16_panel_rows > 0)
        snprintf(bf16, sizeof bf16, "avx512_bf16/%lldrows", (long long)lmf_dispatch.bf16_panel_rows);
    if (lmf_dispatch.a8_panel != NULL && lmf_dispatch.a8_panel_rows > 0)
        snprintf(panel, sizeof panel, "avx512_vnni/%lldrows", (long long)lmf_dispatch.a8_panel_rows);
    snprintf(chosen, sizeof chosen,
             "attention_bf16=" ATTN_BF16 " attention_f32=%s attention_prefill=" ATTN_PREFILL " elementwise_bf16=" ELEMENTWISE_BF16 " qmm_f32=" QMM_F32
             " gemm_f32=" GEMM_F32 " gemm_bf16=%s qmm_a8=%s qmm_a8_panel=%s",
             ATTN_F32_WIDE, bf16, a8_names[lmf_dispatch.a8_best], panel);
}

__attribute__((constructor)) static void lmf_dispatch_init(void) {
#ifdef LMF_X86
    __builtin_cpu_init();  /* required before __builtin_cpu_supports in a constructor */
    lmf_dispatch.attn_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    const a8_body_fn built[A8_ISAS] = {
        [A8_PORTABLE] = a8_range_portable,
#ifdef LMF_X86
        [A8_AVX2] = a8_range_avx2,
#ifdef LMF_AVXVNNI
        [A8_AVX_VNNI] = a8_range_avxvnni,
#endif
        [A8_AVX512_VNNI] = a8_range_avx512vnni,
        [A8_AVX512_VNNI_256] = a8_range_avx512vnni256,
#endif
    };
    lmf_dispatch.a8_best = A8_PORTABLE;
    for (int64_t isa = 0; isa < A8_ISAS; isa++) {
        lmf_dispatch.a8_body[isa] = built[isa] != NULL && a8_cpu_runs(isa) ? built[isa] : NULL;
        if (lmf_dispatch.a8_body[isa] != NULL) lmf_dispatch.a8_best = isa;  /* numbered in order of preference */
    }
#ifdef LMF_X86
    if (lmf_dispatch.a8_body[A8_AVX512_VNNI] != NULL) {
        lmf_dispatch.a8_panel = a8_panel_avx512vnni;
        lmf_dispatch.a8_panel_rows = A8_PANEL_ROWS;
        lmf_dispatch.a8_lanes_rows = A8_LANES_MAX_ROWS;
    }
    lmf_dispatch.bf16_panel = bf16_panel_cpu();
    if (lmf_dispatch.bf16_panel) lmf_dispatch.bf16_panel_rows = BF16_PANEL_ROWS;
#endif
    write_chosen();
}

/* The panel GEMM's threshold: from `rows` rows (0: never) the AVX-512 VNNI bodies hand a call to it; rows < 0
 * leaves it. Returns the threshold before (0 where this CPU or build has no panel body, which nothing changes). */
int64_t lmf_a8_panel_rows(int64_t rows) {
    const int64_t before = lmf_dispatch.a8_panel_rows;
    if (rows >= 0 && lmf_dispatch.a8_panel != NULL) {
        lmf_dispatch.a8_panel_rows = rows;
        write_chosen();
    }
    return before;
}

/* On int4 weights stored as panels (LMF_PANELS16): below `rows` rows the lanes body, from it the panel GEMM (0: the
 * panel's own threshold alone); rows < 0 leaves it. Returns the value before (0 where there is no panel body). */
int64_t lmf_a8_lanes_rows(int64_t rows) {
    const int64_t before = lmf_dispatch.a8_lanes_rows;
    if (rows >= 0 && lmf_dispatch.a8_panel != NULL) lmf_dispatch.a8_lanes_rows = rows;
    return before;
}

/* The bf16 panel GEMM's threshold, as `lmf_a8_panel_rows`: from `rows` rows (0: never) `lmf_qmm_f32` hands bf16
 * weights to it; rows < 0 only reads it. Returns the threshold before (0 where the CPU or build lacks it). */
int64_t lmf_bf16_panel_rows(int64_t rows) {
    const int64_t before = lmf_dispatch.bf16_panel_rows;
    if (rows >= 0 && lmf_dispatch.bf16_panel) {
        lmf_dispatch.bf16_panel_rows = rows;
        write_chosen();
    }
    return before;
}

/* 1 if this CPU (and this build) runs A8 body `isa`, else 0. */
int lmf_a8_isa_supported(int64_t isa) {
    return isa >= 0 && isa < A8_ISAS && lmf_dispatch.a8_body[isa] != NULL;
}

/* The A8 body `lmf_qmm_a8` runs when not told: the most preferred this CPU runs. */
int64_t lmf_a8_best_isa(void) {
    return lmf_dispatch.a8_best;
}

/* "concern=body ..." for every kernel with more than one body, as this CPU and build run them: attention_bf16
 * (avx512_bf16 | avx512 | portable), attention_f32 (float32 queries over float32 / bf16 pools: avx512 | avx2 | portable;
 * int8 pools always portable), attention_prefill (avx512 | avx2 | portable: the vector width its vector C was
 * compiled to), elementwise_bf16 (avx512 | portable), qmm_f32 (avx2 | portable), gemm_f32
 * (avx2 | none: the caller widens and runs sgemm), gemm_bf16 (bf16 weights on bf16 dot products for many rows,
 * and its threshold, or none), qmm_a8 (the default A8 body, `kernels.A8_ISAS` names),
 * qmm_a8_panel (the many-row A8 GEMM and its threshold, or none).
 * K/V writes and the float32 elementwise ops are plain C everywhere. */
const char *lmf_kernels_chosen(void) {
    return chosen;
}
