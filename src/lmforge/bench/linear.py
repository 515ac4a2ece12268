"""The engine's linear layers on CPU, two sections of one report (bench_linear.json + .md):

  * quantized (issue 25): int8 (per channel) and int4 (per group) weights at batch 1/4/16/64, per
    kernel: the int8-activation bodies this CPU has (`lmf_qmm_a8`: AVX-512 VNNI, AVX-VNNI, AVX2,
    portable, each on its rows) and its panel GEMM where the CPU has AVX-512 VNNI (`qmm_a8_panel.c`, which
    the engine runs from `lmf_a8_panel_rows()` rows), the exact A16 kernels on float32 activations (`lmf_qmm_f32`'s row kernel, and the panel
    GEMM `lmf_gemm_f32` that takes over from `QmmLinear.GEMM_MIN_ROWS` rows) and torch's weight-only
    kernels (bf16 activations); and bf16 weights (a bf16 checkpoint under `--dtype auto`): the exact row kernel
    (`lmf_qmm_f32`, bits 16), lmforge's bf16 panel GEMM where the CPU has AVX512-BF16 (`gemm_bf16.c`, from
    `lmf_bf16_panel_rows()` rows in the engine) and oneDNN's bf16 GEMM (`F.linear`, the weight as it is). Each figure is GB/s of weight bytes read (codes + scales) and
    GFLOP/s (2·M·N·K), against the STREAM triad of `lmforge doctor` (its saved profile, else measured
    now) as the roofline. Each call reads the next of enough weight copies to overflow the caches
    (`--working-set-mb`), as a decode step reads every layer's weights once from memory.
  * packed: `F.linear` against `PackedLinear` (oneDNN's layout, reordered once), outputs compared, for
    each dtype the engine packs on this CPU: float32 (MKL's `F.linear` is slow at a few rows) and bf16
    where the CPU has bf16 units (a plain bf16 `F.linear` reorders the weight on every call); on the
    kernel threads (`--threads`, default torch's).

    lmforge bench linear [--out DIR] [--threads N] [--group-size 128] [--batches 1,4,16,64]
    python -m lmforge.bench.linear [--out DIR]

Quantized shapes are the 300M bench Llama's projections (hidden 1024, MLP 2816); packed shapes the
~30M model's (hidden 512, MLP 1376, vocabulary 8192). The report records the load average: figures
taken on a busy machine are lower bounds and are labelled so.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import torch
import torch.nn.functional as F
import typer

from lmforge.bench.doctor import measure_bandwidth
from lmforge.bench.report import emit, provenance
from lmforge.engine import kernels
from lmforge.engine.model_runner import PackedLinear, can_pack_linear
from lmforge.perf.hardware import default_profile_path, load_profile
from lmforge.quant import QuantScheme, quantize_rtn
from lmforge.quant.linear import Int4Linear, Int8Linear, QmmLinear, QuantizedLinear
from lmforge.track.short import short_mode, shrink

SHAPES = ((512, 512), (512, 1376), (1376, 512), (512, 8192))  # (in, out), packed section
ROWS = (1, 8, 32, 128)
QUANT_SHAPES = ((1024, 1024), (1024, 2816), (2816, 1024))  # (in, out): the 300M model's o, gate/up, down
BATCHES = (1, 4, 16, 64)


def best_seconds(fn, calls: int = 50, repeats: int = 5) -> float:
    """Seconds per call of `fn`: one warm-up call, then the best of `repeats` timings of `calls` calls
    (under LMFORGE_SHORT, CI: 2 calls once; the code runs, the figure is not one to quote)."""
    calls, repeats = shrink(calls, 2), shrink(repeats, 1)
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def call_seconds(fn: Callable[[], Any], budget_s: float = 0.15, min_calls: int = 7) -> tuple[float, float]:
    """(best, median) seconds of single calls of `fn` over ~`budget_s` (at least `min_calls`), after a
    warm-up call. The best call is the one the other processes of a busy machine disturbed least."""
    fn()
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < min_calls or time.perf_counter() < stop:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0], times[len(times) // 2]


def roofline() -> dict:
    """STREAM triad bytes/s: `lmforge doctor`'s saved profile, else measured now (256 MB arrays)."""
    try:
        bw = (((load_profile() or {}).get("devices") or {}).get("cpu") or {}).get("mem_bandwidth") or {}
    except ValueError:
        bw = {}
    if bw.get("triad"):
        return {"triad_gbs": round(bw["triad"] / 1e9, 2), "source": f"lmforge doctor ({default_profile_path()})"}
    return {"triad_gbs": round(measure_bandwidth("cpu")["triad"] / 1e9, 2), "source": "measured now (STREAM triad)"}


def _quantized(K: int, N: int, scheme: QuantScheme) -> QuantizedLinear:
    q = QuantizedLinear(K, N, scheme, scale_dtype=torch.bfloat16)
    qw, s = quantize_rtn(torch.randn(N, K, generator=torch.Generator().manual_seed(K * N)), scheme, torch.bfloat16)
    q.qweight.copy_(qw)
    q.weight_scale.copy_(s)
    return q


def _kernels(q: QuantizedLinear, lib: kernels.CpuKernels | None) -> dict[str, Callable[[torch.Tensor], Any]]:
    """Name -> callable on float32 rows, for one weight (each kernel on its own layout of it): the A8
    bodies and the A16 kernel on one `QmmLinear`'s codes, torch's kernel on its packed copy."""
    out: dict[str, Callable[[torch.Tensor], Any]] = {}
    if lib is not None:
        layer = QmmLinear(q, torch.float32, qmm=lib.qmm_f32)  # no c_gemm: the row kernel at every batch
        layer.MAX_ROWS = max(BATCHES)  # the A16 kernel itself at every batch, not its sgemm fallback
        for isa in lib.a8_isas():  # each body on its rows, the panel GEMM off
            out[f"A8 {isa}"] = _panel_from(lib, 0, functools.partial(layer.forward_a8, a8=lib.a8(isa)))
        if lib.a8_panel_rows is not None and lib.a8_panel_rows(-1) > 0:  # and the panel GEMM at every batch
            out["A8 panel GEMM (avx512_vnni)"] = _panel_from(lib, 1, functools.partial(layer.forward_a8,
                                                                                       a8=lib.a8("avx512_vnni")))
        out["A16 exact (lmf_qmm_f32 rows)"] = layer
        if lib.gemm_ok:  # the same codes on the panel GEMM, which the engine runs from QmmLinear.GEMM_MIN_ROWS rows
            out["A16 exact (lmf_gemm_f32 panel)"] = functools.partial(_gemm, layer, lib.gemm_f32)
    torch_cls = Int8Linear if q.scheme.num_bits == 8 else Int4Linear
    if torch_cls.supports(q, torch.device("cpu")):
        out["torch (bf16 activations)"] = torch_cls(q, torch.bfloat16)
    return out


def _panel_from(lib: kernels.CpuKernels, rows: int, fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """fn with the A8 panel GEMM's threshold at `rows` (0: off) for each call, the library's own restored after."""
    if lib.a8_panel_rows is None:
        return fn

    def call(x: torch.Tensor) -> Any:
        before = lib.a8_panel_rows(rows)
        try:
            return fn(x)
        finally:
            lib.a8_panel_rows(before)
    return call


def _gemm(layer: QmmLinear, gemm, x_MK: torch.Tensor) -> torch.Tensor:
    out_MN = torch.empty(x_MK.shape[0], layer.N)
    rc = gemm(x_MK.data_ptr(), layer.codes.data_ptr(), layer.scale.data_ptr(), out_MN.data_ptr(), x_MK.shape[0],
              layer.N, layer.K, layer.bits, layer.gs, layer.threads, layer.desc_ptr)
    if rc != 0:
        raise RuntimeError(f"lmf_gemm_f32 refused {layer.N}x{layer.K} int{layer.bits} group {layer.gs}")
    return out_MN


def bench_quant_linear(batches: tuple[int, ...] = BATCHES, group_size: int = 128, threads: int | None = None,
                       working_set_mb: int = 256, shapes: tuple[tuple[int, int], ...] | None = None) -> dict:
    """Rows of (weights, shape, kernel, batch): us a call, weight GB/s, GFLOP/s, % of STREAM triad."""
    lib = kernels.load()
    saved = torch.get_num_threads()
    threads = threads or saved
    torch.set_num_threads(threads)
    os.environ["LMFORGE_QMM_THREADS"] = str(threads)  # QmmLinear reads it when built
    roof = roofline()
    rows = []
    try:
        with torch.inference_mode():
            for scheme in (QuantScheme(8, None), QuantScheme(4, group_size)):
                for K, N in shapes or QUANT_SHAPES:
                    rows += _bench_weight(scheme, K, N, lib, batches, working_set_mb, roof["triad_gbs"])
            if lib is not None:
                for K, N in shapes or QUANT_SHAPES:
                    rows += _bench_bf16(K, N, lib, batches, working_set_mb, roof["triad_gbs"])
    finally:
        torch.set_num_threads(saved)
        os.environ.pop("LMFORGE_QMM_THREADS", None)
    return {"threads": threads, "roofline": roof, "group_size": group_size, "working_set_mb": working_set_mb,
            "kernels_status": kernels.status(), "rows": rows}


def _bench_weight(scheme: QuantScheme, K: int, N: int, lib, batches, working_set_mb: int, triad_gbs: float) -> list:
    one = _quantized(K, N, scheme)
    copies = []  # enough distinct weights that each call reads its own from memory, not from the caches
    for _ in range(max(1, working_set_mb * 2**20 // (one.qweight.numel() * scheme.num_bits // 8))):
        copies.append(_kernels(copy.deepcopy(one), lib))  # its own buffers: int8 layers keep the codes as given
    weight_bytes = N * K * scheme.num_bits // 8 + N * scheme.groups(K) * 4  # codes + float32 scales
    label = scheme.name + (f" g{scheme.group_size}" if scheme.group_size else "")
    return _time_kernels(copies, label, K, N, weight_bytes, batches, triad_gbs)


def _bench_bf16(K: int, N: int, lib: kernels.CpuKernels, batches, working_set_mb: int, triad_gbs: float) -> list:
    """bf16 weights: the exact row kernel, the bf16 panel GEMM (where the CPU has it) and oneDNN's bf16 GEMM."""
    panel = lib.bf16_panel_rows(-1) if lib.bf16_panel_rows is not None else 0
    copies = []
    for i in range(max(1, working_set_mb * 2**20 // (N * K * 2))):
        lin = torch.nn.Linear(K, N, bias=False).to(torch.bfloat16)
        rows_kernel = QmmLinear.from_bf16(lin, lib.qmm_f32)
        rows_kernel.MAX_ROWS = max(BATCHES + tuple(batches))  # the row kernel itself at every batch
        kernels_of = {"A16 exact (lmf_qmm_f32 rows, bits 16)": rows_kernel}
        if panel:  # at every batch
            kernels_of["bf16 panel GEMM (avx512_bf16)"] = QmmLinear.from_bf16(lin, lib.qmm_f32, bf16_units=True,
                                                                              bf16_panel=(lib.gemm_bf16, 1))
        w = lin.weight.detach()
        kernels_of["oneDNN bf16 (F.linear)"] = lambda x, w=w: F.linear(x.to(torch.bfloat16), w).float()
        copies.append(kernels_of)
    return _time_kernels(copies, "bf16", K, N, N * K * 2, batches, triad_gbs)


def _time_kernels(copies: list[dict], label: str, K: int, N: int, weight_bytes: int, batches, triad_gbs: float) -> list:
    """Each kernel of `copies[0]` at each batch, every call on the next copy's weight (read from memory)."""
    rows = []
    for name in copies[0]:
        for M in batches:
            x = torch.randn(M, K)
            turn = [0]

            def call(name=name, x=x, turn=turn):
                turn[0] = (turn[0] + 1) % len(copies)
                return copies[turn[0]][name](x)
            sec, median = call_seconds(call)
            gbs = weight_bytes / sec / 1e9
            rows.append({"weights": label, "in": K, "out": N, "kernel": name, "batch": M, "us": round(sec * 1e6, 1),
                         "median_us": round(median * 1e6, 1),
                         "weight_gbs": round(gbs, 2), "gflops": round(2 * M * N * K / sec / 1e9, 1),
                         "of_triad": round(gbs / triad_gbs, 3) if triad_gbs else None})
    return rows


def bench_linear(threads: int | None = None) -> dict:
    """`F.linear` against `PackedLinear` for each dtype the engine packs here (`can_pack_linear`), on `threads`
    (default: torch's, as the engine runs)."""
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    rows, skipped = [], {}
    try:
        with torch.inference_mode():
            for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
                if not can_pack_linear(torch.device("cpu"), dtype):
                    skipped[name] = "oneDNN has no native path for it on this CPU: the engine does not pack"
                    continue
                for k, n in SHAPES:
                    linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
                    packed = PackedLinear(linear)
                    for m in ROWS:
                        x = torch.randn(m, k, dtype=dtype)
                        plain_us = best_seconds(lambda: F.linear(x, linear.weight)) * 1e6
                        packed_us = best_seconds(lambda: packed(x)) * 1e6
                        # float32: oneDNN and MKL sum in other orders, so the check is closeness, not bits
                        want, got = F.linear(x, linear.weight), packed(x)
                        same = torch.equal(want, got) if dtype == torch.bfloat16 else torch.allclose(
                            want, got, rtol=1e-4, atol=1e-5)
                        rows.append({"dtype": name, "in": k, "out": n, "rows": m, "plain_us": round(plain_us, 1),
                                     "packed_us": round(packed_us, 1), "speedup": round(plain_us / packed_us, 2),
                                     "same": same})
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "rows": rows, "skipped": skipped}


def quant_markdown(q: dict, prov: dict) -> list[str]:
    roof, load = q["roofline"], prov.get("load_average") or [0.0]
    busy = load[0] > 0.5 * (os.cpu_count() or 1)
    lines = [f"# bench linear: int8 / int4 weights, {q['threads']} threads"
             + (" — BUSY MACHINE (load average {}): figures are lower bounds".format(load[0]) if busy else ""), "",
             f"{prov['machine']}, {prov['date']}. Roofline: STREAM triad {roof['triad_gbs']} GB/s "
             f"({roof['source']}). Each call reads its own weight copy ({q['working_set_mb']} MB of copies); "
             "GB/s and GFLOP/s from the best call. "
             f"Kernels: {q['kernels_status'][:60]}", "",
             "| weights | in → out | kernel | batch | best µs (median) | weight GB/s | % of triad | GFLOP/s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['weights']} | {r['in']} → {r['out']} | {r['kernel']} | {r['batch']} | "
              f"{r['us']} ({r['median_us']}) | {r['weight_gbs']} | {100 * (r['of_triad'] or 0):.0f}% | {r['gflops']} |"
              for r in q["rows"]]
    return lines + [""]


def to_markdown(report: dict) -> str:
    lines = quant_markdown(report["quant"], report["provenance"]) if report.get("quant") else []
    packed = report.get("packed")
    if packed is None:
        return "\n".join(lines) + "\n"
    names = ", ".join(sorted({r["dtype"] for r in packed["rows"]})) or "none"
    lines += [f"# bench linear: {names} `F.linear` vs `PackedLinear`, {packed['threads']} thread(s)", "",
              "| dtype | in → out | rows | plain (µs) | packed (µs) | speed-up | same (bf16: bits; float32: 1e-4) |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['dtype']} | {r['in']} → {r['out']} | {r['rows']} | {r['plain_us']} | {r['packed_us']} | "
              f"{r['speedup']}× | {r['same']} |" for r in packed["rows"]]
    lines += [f"\n{name} skipped: {why}" for name, why in packed["skipped"].items()]
    return "\n".join(lines) + "\n"


def run(out: Path | None = None, quant: bool = True, packed: bool = True, batches: tuple[int, ...] = BATCHES,
        group_size: int = 128, threads: int | None = None, working_set_mb: int = 256) -> dict:
    """Both sections (or either), printed and written as bench_linear.json + .md under `out`."""
    report = {"provenance": provenance("int8/int4 weights; float32 and bfloat16 activations"),
              "quant": bench_quant_linear(batches, group_size, threads, working_set_mb) if quant else None,
              "packed": bench_linear(threads) if packed else None}
    emit(report, to_markdown, out, "bench_linear")
    return report


def main(
    out: Annotated[Optional[Path], typer.Option(help="Where bench_linear.json and .md go.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="Kernel threads (default: torch's).")] = None,
    group_size: Annotated[int, typer.Option(help="int4 weights: inputs per scale (a multiple of 32).")] = 128,
    batches: Annotated[str, typer.Option(help="Rows per call, comma-separated.")] = "1,4,16,64",
    working_set_mb: Annotated[int, typer.Option(help="Weight copies cycled through, MB (past the caches).")] = 256,
    quant: Annotated[bool, typer.Option(help="The int8 / int4 weight section.")] = True,
    packed: Annotated[bool, typer.Option(help="The F.linear vs PackedLinear section (float32, bf16).")] = True,
) -> None:
    """Linear kernels on CPU: int8 / int4 weights per kernel (int8-activation VNNI / AVX2 / portable
    bodies, the exact A16 kernel, torch's) in weight GB/s and GFLOP/s against the STREAM triad, and
    F.linear against PackedLinear (float32; bf16 where the CPU has bf16 units); writes bench_linear.json
    and bench_linear.md."""
    try:
        rows = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise typer.BadParameter(f"--batches {batches!r}: comma-separated integers, e.g. 1,4,16,64") from None
    if group_size <= 0 or group_size % 32:
        raise typer.BadParameter(f"--group-size {group_size}: a positive multiple of 32")
    if short_mode():  # CI: the two smallest batches, a working set of 8 MB
        rows, working_set_mb = tuple(sorted(rows)[:2]), min(working_set_mb, 8)
    run(out, quant, packed, rows, group_size, threads, working_set_mb)


if __name__ == "__main__":
    typer.run(main)
