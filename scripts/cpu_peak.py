"""This CPU's arithmetic peak, measured: a loop of 24 independent `vdpbf16ps` (bf16 pairs into float32, 64 FLOP a
512-bit instruction) and of 24 independent 512-bit float32 FMAs (32 FLOP), on `--threads` threads at once, GFLOP/s a
thread and in all. The ceiling the bf16 panel GEMM and paged prefill attention are measured against (docs/engine.md,
issue 44): on the Zen 4 EPYC of 2026-12-06, 2 threads, ~230 GFLOP/s a core in bf16 (3.6 G instructions a second, not
the 4.1 GHz an earlier estimate assumed) and ~116 in float32. Until 2026-12-07 the loops ran 12 chains, which hide the
latency of a core issuing one a cycle (Zen 4) but not of one issuing two (Zen 5: 12 chains read 473-524 GFLOP/s a
thread, 946-1,046 for two; 24 read 566-571 a thread, ~1,140). Needs a C compiler and AVX512-BF16 (else says so).

    python scripts/cpu_peak.py --threads 2
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import typer

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static long N;
static void *bf16(void *out) {
    __m512 a[24];
    for (int i = 0; i < 24; i++) a[i] = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
    const double t0 = now();
    for (long k = 0; k < N; k++) {  /* written out: 24 chains in registers at any optimization level */
#define B(i) a[i] = _mm512_dpbf16_ps(a[i], x, x);
        B(0) B(1) B(2) B(3) B(4) B(5) B(6) B(7) B(8) B(9) B(10) B(11)
        B(12) B(13) B(14) B(15) B(16) B(17) B(18) B(19) B(20) B(21) B(22) B(23)
        __asm__ volatile("" : "+v"(x));
    }
    const double dt = now() - t0;
    float s = 0; for (int i = 0; i < 24; i++) s += a[i][0];
    ((double *)out)[0] = N * 24 * 64 / dt / 1e9 + 0 * s;
    __m512 f[24], u = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < 24; i++) f[i] = _mm512_setzero_ps();
    const double t1 = now();
    for (long k = 0; k < N; k++) {
#define F(i) f[i] = _mm512_fmadd_ps(f[i], u, u);
        F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
        F(12) F(13) F(14) F(15) F(16) F(17) F(18) F(19) F(20) F(21) F(22) F(23)
        __asm__ volatile("" : "+v"(u));
    }
    const double dt2 = now() - t1;
    s = 0; for (int i = 0; i < 24; i++) s += f[i][0];
    ((double *)out)[1] = N * 24 * 32 / dt2 / 1e9 + 0 * s;
    return NULL;
}
int main(int argc, char **argv) {
    const int T = atoi(argv[1]);
    N = 200000000L / 24;
    pthread_t tid[64]; double r[64][2];
    for (int t = 0; t < T; t++) pthread_create(&tid[t], NULL, bf16, r[t]);
    double b = 0, f = 0;
    for (int t = 0; t < T; t++) { pthread_join(tid[t], NULL); b += r[t][0]; f += r[t][1]; }
    for (int t = 0; t < T; t++) printf("thread %d: bf16 %.1f GFLOP/s, float32 FMA %.1f GFLOP/s\n", t, r[t][0], r[t][1]);
    printf("all %d threads: bf16 %.1f GFLOP/s, float32 FMA %.1f GFLOP/s\n", T, b, f);
    return 0;
}
"""


def main(threads: int = 2) -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" not in flags:
        raise SystemExit("this CPU has no AVX512-BF16: nothing to measure here")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler")
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.c", Path(d) / "peak"
        src.write_text(SOURCE)
        subprocess.run([cc, "-O2", "-mavx512f", "-mavx512bf16", "-pthread", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    typer.run(main)
