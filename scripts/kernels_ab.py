"""This checkout's CPU kernels against another revision's (or one engine form against another), alternating
in one process, so that the machine's drift between sittings cancels out. Best of `--repeats` each.

    attention  decode attention (`lmf_paged_decode_any`, float32 queries over a float32 or bf16 pool) on the
               random 300M Llama's shapes (24 layers, 16 query / 8 kv heads of 64), pool blocks in random order
               as a long-running server's are; outputs equal to float32 rounding
    prefill    paged prefill attention (`lmf_paged_prefill`) of one `--length`-token prompt on the same shapes, 24
               layers, a bf16 pool: OLD_REV's float32 arithmetic against this checkout's and its bf16 dot products
               (kv 2; float32 arithmetic where the CPU lacks AVX512-BF16); float32 outputs equal to rounding, the
               bf16 ones within bf16 rounding
    matmuls    a decode step's 96 layer matmuls of the same model (int4 groups of 32 on int8 activations,
               `lmf_qmm_a8`; or `--weights bf16`, `lmf_gemm_bf16`), distinct weights streamed from memory, at
               `--rows` activation rows; outputs equal
    panels     the same 96 matmuls in this checkout, int4 weights stored as rows against as 16-row panels
               (`QmmLinear.store_panels`), and on panels the lanes body against the panel GEMM; outputs equal to
               float32 rounding
    stack      a real engine on MODEL: one C call a decode step for the whole decoder stack against a call a
               layer (`lmf_decode_stack_q` / `lmf_decode_layer_q`), the same engine toggled between steps
    bits       no timing: every exported entry point of both libraries on the same random inputs (shapes,
               thread counts, every A8 body, act / kv dtypes), outputs and return codes equal bit for bit: the
               check for a refactor of the kernels that must not change a number

    python scripts/kernels_ab.py attention --old-rev 1455d4a --contexts 200,700,1400 [--kv bfloat16] [--seqs 16]
    python scripts/kernels_ab.py prefill --old-rev 5841e6c --length 512
    python scripts/kernels_ab.py matmuls --old-rev efd2024 --rows 1,4,16 [--weights bf16]
    python scripts/kernels_ab.py panels --rows 1,2,4,8,16,32,64 [--scales float32] [--zeros] [--bits 8] [--shapes smollm2|big]
    python scripts/kernels_ab.py stack runs/vs-llamacpp/random-llama-300m/model-q4_0.gguf
    python scripts/kernels_ab.py bits --old-rev HEAD~1 [--flags=-DLMF_PORTABLE]

`--old-rev` takes any revision whose kernels `kernels._bind` can load: from 4301085 (`lmf_qmm_f32`)
on for `attention`, from bb9321e (`lmf_qmm_a8`) on for `matmuls` and `bits`; its `engine/kernels/*.c` files
are built together, so both the single-file layout (`cpu_ops.c`, up to the split) and the split one work.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import typer

from lmforge.engine import kernels

app = typer.Typer(add_completion=False)
LAYERS, BLOCK, KV_HEADS, HEAD, HEADS, BLOCKS = 24, 16, 8, 64, 16, 4096
# the 300M's layer linears (out, in): fused q/k/v, o, fused gate/up, down
LINEARS = [(HEADS * HEAD + 2 * KV_HEADS * HEAD, 1024), (1024, HEADS * HEAD), (2 * 2816, 1024), (1024, 2816)]


KERNELS_DIR = "src/lmforge/engine/kernels"


def _library_at(rev: str, flags: tuple[str, ...] = ()) -> kernels.CpuKernels:
    """`rev`'s kernels, built: its C sources and headers (one `cpu_ops.c` before the split, one file a concern
    after it) written to a temporary folder and compiled together."""
    out = Path(tempfile.mkdtemp(prefix="kernels-ab-"))
    src = out / "src"
    src.mkdir()
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    names = subprocess.run([*git, "ls-tree", "--name-only", f"{rev}:{KERNELS_DIR}"], check=True, capture_output=True,
                           text=True).stdout.split()
    for name in (n for n in names if n.endswith((".c", ".h"))):
        (src / name).write_bytes(subprocess.run([*git, "show", f"{rev}:{KERNELS_DIR}/{name}"], check=True,
                                                capture_output=True).stdout)
    try:
        return _with_lin(kernels._bind(kernels.build(flags, out_dir=out, src_dir=src)), src)
    except AttributeError as e:  # a symbol _bind needs is missing: a revision older than this script takes
        raise typer.BadParameter(f"--old-rev {rev}: its kernels lack {e} (see this script's docstring)") from e


def _with_lin(lib: kernels.CpuKernels, src: Path) -> kernels.CpuKernels:
    """`lib` with `layer_lin`: how many values a linear takes in its sources' decoder-layer parameters (LIN)."""
    found = re.search(r"#define LIN (\d+)", (src / "decode_layer.c").read_text()) if (src / "decode_layer.c").exists() \
        else None
    lib.layer_lin = int(found.group(1)) if found else 6
    return lib


def _libraries(old_rev: str, threads: int) -> dict[str, kernels.CpuKernels]:
    torch.set_num_threads(threads)
    here = kernels.load()
    if here is None:
        raise typer.BadParameter("lmforge's CPU kernels did not build here (`lmforge doctor`)")
    return {"this checkout": here, old_rev: _library_at(old_rev)}


def _alternate(names: list[str], run, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(names, float("inf"))
    for _ in range(repeats):
        for name in names:
            t = time.perf_counter()
            run(name)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


@app.command()
def attention(old_rev: str = typer.Option(..., help="The revision to compare against (its kernels' C sources)."),
              contexts: str = "200,700,1400", repeats: int = 40, threads: int = 2,
              kv: str = typer.Option("float32", help="The pool's dtype: float32 or bfloat16."),
              seqs: int = 1) -> None:
    """Decode attention, ms a step (24 layers) and the K/V GB/s read."""
    if kv not in ("float32", "bfloat16"):
        raise typer.BadParameter("--kv: float32 or bfloat16")
    libs = _libraries(old_rev, threads)
    dtype, kind = getattr(torch, kv), int(kv == "float32")
    shape = (BLOCKS, BLOCK, KV_HEADS, HEAD)
    ks = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    vs = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(seqs, HEADS * HEAD)
    for L in (int(c) for c in contexts.split(",")):
        perm = np.random.default_rng(L).permutation(BLOCKS)[: seqs * ((L + BLOCK - 1) // BLOCK)]
        table = torch.tensor(perm, dtype=torch.int32).reshape(seqs, -1)
        lens, rows = torch.tensor([L] * seqs, dtype=torch.int32), torch.arange(seqs, dtype=torch.int64)
        outs = {name: torch.empty(seqs, HEADS * HEAD) for name in libs}

        def run(name: str) -> None:
            for k, v in zip(ks, vs):
                rc = libs[name].decode_any(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(),
                                           table.shape[1], lens.data_ptr(), rows.data_ptr(), seqs, HEADS, KV_HEADS,
                                           HEAD, BLOCK, HEAD ** -0.5, outs[name].data_ptr(), threads, 1, kind)
                assert rc == 0, rc
        best = _alternate(list(libs), run, repeats)
        a, b = outs.values()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the two libraries compute the same attention
        kv_bytes = LAYERS * L * seqs * KV_HEADS * HEAD * dtype.itemsize * 2
        print(f"context {L}: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({kv_bytes / best[name] / 1e9:.1f} GB/s)"
                                           for name in libs), flush=True)


@app.command()
def prefill(old_rev: str = typer.Option(..., help="The revision to compare against (its kernels' C sources)."),
            length: int = 512, repeats: int = 10, threads: int = 2) -> None:
    """Paged prefill attention of one prompt, ms for 24 layers: float32 arithmetic here and at OLD_REV, bf16 dots."""
    libs = _libraries(old_rev, threads)
    gen = torch.Generator().manual_seed(0)
    blocks = -(-length // BLOCK)
    shape = (BLOCKS, BLOCK, KV_HEADS, HEAD)
    ks = [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)]
    vs = [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)]
    q = torch.randn(length, HEADS, HEAD, generator=gen)
    table = torch.tensor(np.random.default_rng(length).permutation(BLOCKS)[:blocks], dtype=torch.int32)[None]
    chunks = torch.tensor([[0, length, 0]], dtype=torch.int64)
    sides = {f"{name}, float32": (lib, 0) for name, lib in libs.items()}
    sides["this checkout, bf16 dots"] = (libs["this checkout"], 2)
    probe = torch.empty(length, HEADS, HEAD)
    if libs[old_rev].prefill(q.data_ptr(), q.stride(0), q.stride(1), ks[0].data_ptr(), vs[0].data_ptr(), 2,
                             table.data_ptr(), blocks, chunks.data_ptr(), 1, HEADS, KV_HEADS, HEAD, BLOCK, HEAD ** -0.5,
                             probe.data_ptr(), threads) == 0:  # OLD_REV has bf16 dots too (kv 2): time them as well
        sides[f"{old_rev}, bf16 dots"] = (libs[old_rev], 2)
    outs = {name: torch.empty(length, HEADS, HEAD) for name in sides}

    def run(name: str) -> None:
        lib, kv = sides[name]
        for k, v in zip(ks, vs):
            rc = lib.prefill(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), kv, table.data_ptr(),
                             blocks, chunks.data_ptr(), 1, HEADS, KV_HEADS, HEAD, BLOCK, HEAD ** -0.5,
                             outs[name].data_ptr(), threads)
            assert rc == 0, rc
    best = _alternate(list(sides), run, repeats)
    a, b, c, *d = outs.values()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=0, atol=3e-2)
    for other in d:  # the two revisions' bf16 dots: within bf16 rounding (a change of exp flips some roundings)
        torch.testing.assert_close(c, other, rtol=0, atol=3e-2)
    pairs = length * (length + 1) // 2
    gflop = LAYERS * HEADS * pairs * HEAD * 4 / 1e9
    same = [kind for kind in ("float32", "bf16 dots") if f"{old_rev}, {kind}" in outs
            and torch.equal(outs[f"this checkout, {kind}"], outs[f"{old_rev}, {kind}"])]
    print(f"{length} tokens, 24 layers ({gflop:.1f} GFLOP causal): " + ", ".join(
        f"{name} {best[name] * 1e3:.1f} ms ({gflop / best[name]:.0f} GFLOP/s)" for name in sides)
        + f"; bit for bit equal to {old_rev}: {', '.join(same) or 'none'}", flush=True)


@app.command()
def matmuls(old_rev: str = typer.Option(..., help="The revision to compare against (its kernels' C sources)."),
            rows: str = "1,4,16", repeats: int = 12, threads: int = 2,
            weights_kind: str = typer.Option("int4", "--weights", help="int4 (g32 codes on int8 activations, "
                                             "`lmf_qmm_a8`) or bf16 (the bf16 panel GEMM, `lmf_gemm_bf16`)."),
            tolerance: float = typer.Option(1e-5, help="Largest relative output difference allowed: float32 "
                                            "rounding by default; a change of the numerics (the activations' "
                                            "scale a block of 32 since 2026-12-06: ~1e-2) needs more.")) -> None:
    """A decode step's 96 matmuls (int4 g32 on int8 activations, or bf16 weights), ms and weight GB/s."""
    if weights_kind not in ("int4", "bf16"):
        raise typer.BadParameter("--weights: int4 or bf16")
    libs = _libraries(old_rev, threads)
    gen = torch.Generator().manual_seed(0)
    if weights_kind == "int4":
        weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                    torch.rand(n, k // 32, generator=gen)) for _ in range(LAYERS) for n, k in LINEARS]
    else:
        weights = [(torch.randn(n, k, generator=gen).bfloat16(), torch.ones(n)) for _ in range(LAYERS) for n, k in LINEARS]
    call = {name: _matmul(lib, weights_kind, threads) for name, lib in libs.items()}
    nbytes = sum(c.numel() * c.element_size() + s.numel() * 4 for c, s in weights)
    for M in (int(r) for r in rows.split(",")):
        x = torch.randn(M, max(k for _, k in LINEARS), generator=gen)
        outs = {name: [torch.empty(M, c.shape[0]) for c, _ in weights] for name in libs}

        def run(name: str) -> None:
            for (c, s), out, (n, k) in zip(weights, outs[name], LINEARS * LAYERS):
                rc = call[name](x.data_ptr(), c.data_ptr(), s.data_ptr(), out.data_ptr(), M, n, k)
                assert rc == 0, rc
        best = _alternate(list(libs), run, repeats)
        # the same integer dot products; a change of the float accumulation's order (pairs of blocks since 0419165)
        # moves float32 rounding only
        diff = max((a - b).abs().max().item() / max(a.abs().max().item(), 1e-30) for a, b in zip(*outs.values()))
        assert diff < tolerance, f"the two libraries' outputs differ by {diff:.2e} (--tolerance {tolerance:g})"
        print(f"{M} rows: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({nbytes / best[name] / 1e9:.1f} GB/s)"
                                        for name in libs) + f"; largest relative difference {diff:.1e}", flush=True)


def _matmul(lib: kernels.CpuKernels, kind: str, threads: int):
    """(x, w, scales, out, M, N, K) -> rc: int4 g32 codes on `lmf_qmm_a8` (float32 x), or bf16 weights on
    `lmf_gemm_bf16` (from 1 row: the panel, which is what its prefetch changed; the weight as rows, layout 0, an
    argument that revisions before the stored bf16 panels do not read)."""
    if kind == "bf16":
        if lib.gemm_bf16 is None:
            raise typer.BadParameter("--weights bf16: this library has no lmf_gemm_bf16 (an older revision?)")
        return lambda x, w, ws, out, M, N, K: lib.gemm_bf16(x, w, ws, out, M, N, K, threads, 0)
    a8 = lib.a8()
    return lambda x, w, ws, out, M, N, K: a8(x, 1, w, ws, out, M, N, K, 4, 32, threads, None)


@app.command()
def panels(rows: str = "1,2,4,8,16,32,64", repeats: int = 12, threads: int = 2,
           scales: str = typer.Option("float16", help="The stored scales: float16 (a GGUF Q4_0's) or float32."),
           zeros: bool = typer.Option(False, help="Zero offsets too (a GGUF Q4_1's form: nibbles, scale and minimum)."),
           bits: int = typer.Option(4, help="4 (int4 codes) or 8 (int8 codes in groups of 32, a GGUF Q8_0's form)."),
           shapes: str = typer.Option("300m", help="300m (24 layers of the random 300M), smollm2 (SmolLM2-135M's "
                                                   "30 layers: hidden 576, 9 / 3 heads of 64, intermediate 1,536) or "
                                                   "big (six 16,384 x 4,096 weights: the bodies without the calls' "
                                                   "fixed costs)."),
           weights: str = typer.Option("int", help="int (int4 / int8 codes, --bits) or bf16 (bf16 weights on float32 "
                                                   "activations: the row kernel and the bf16 panel GEMM building its "
                                                   "panels a call, against the lanes body and the panel GEMM on "
                                                   "stored panels)."))\
        -> None:
    """A decode step's int4 (or int8) g32 matmuls in this checkout (the 300M's 96 by default), the weights stored as
    rows against as 16-row panels (`QmmLinear.store_panels`; rows: the row bodies, from 6 rows the panel GEMM; panels:
    the lanes body, from 64 rows the panel GEMM, as the engine runs them), and on panels the lanes body against the
    panel GEMM at every row count."""
    from lmforge.quant import QuantScheme
    from lmforge.quant.linear import QmmLinear, QuantizedLinear
    lib = kernels.load()
    if weights == "bf16":
        return _panels_bf16(lib, rows, repeats, threads, shapes)
    if lib is None or lib.a8_panel_rows(-1) <= 0:
        raise typer.BadParameter("stored panels need the A8 panel bodies: an AVX-512 VNNI CPU")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    n_layers, linears = _shapes(shapes)
    if bits not in (4, 8) or (bits == 8 and zeros):
        raise typer.BadParameter("--bits: 4, or 8 without --zeros")
    layers: dict[str, list[QmmLinear]] = {"rows": [], "panels": []}
    for _ in range(n_layers):
        for n, k in linears:
            q = QuantizedLinear(k, n, QuantScheme(bits, 32, zero_point=zeros))
            lo, hi = (0, 16) if zeros else (-8, 8) if bits == 4 else (-128, 128)
            q.qweight.copy_(torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen))
            q.weight_scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(getattr(torch, scales))
            if zeros:
                q.weight_zero = -8 * q.weight_scale
            for name in layers:
                m = QmmLinear(q, torch.float32, a8=lib.a8())
                m.threads = threads
                assert name == "rows" or m.store_panels(int8=bits == 8)
                layers[name].append(m)
    nbytes = sum(m.codes.numel() + m.scale.numel() * m.scale.element_size() * (2 if zeros else 1)
                 for m in layers["rows"])
    panel_rows, lanes_rows = lib.a8_panel_rows(-1), lib.a8_lanes_rows(-1)
    for M in (int(r) for r in rows.split(",")):
        x = {k: torch.randn(M, k, generator=gen) for _, k in linears}
        outs = {name: [torch.empty(M, m.N) for m in layers["rows"]] for name in ("rows", "panels", "panel GEMM")}

        def run(name: str) -> None:
            ms = layers["rows" if name == "rows" else "panels"]
            if name == "panel GEMM":
                lib.a8_panel_rows(1)
                lib.a8_lanes_rows(0)
            try:
                for m, out in zip(ms, outs[name]):
                    rc = m.a8(x[m.K].data_ptr(), 1, m.codes.data_ptr(), m.scale.data_ptr(), out.data_ptr(), M, m.N,
                              m.K, bits, 32, threads, m.desc_ptr)
                    assert rc == 0, rc
            finally:
                lib.a8_panel_rows(panel_rows)
                lib.a8_lanes_rows(lanes_rows)
        best = _alternate(list(outs), run, repeats)
        _layouts_line(M, outs, best, nbytes, f", panel GEMM / lanes on panels {best['panel GEMM'] / best['panels']:.2f}")


def _layouts_line(M: int, outs: dict, best: dict, nbytes: int, more: str = "") -> None:
    """`panels`' line for M rows: the rows and panels layouts' outputs agree to float32 rounding, and each form's
    best time, its weight GB/s and rows / panels."""
    diff = max((a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
               for a, b in zip(outs["rows"], outs["panels"]))
    assert diff < 1e-5, f"the two layouts' outputs differ by {diff:.2e}"
    print(f"{M} rows: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({nbytes / best[name] / 1e9:.1f} GB/s)"
                                    for name in outs)
          + f"; rows / panels {best['rows'] / best['panels']:.2f}{more}", flush=True)


def _shapes(shapes: str) -> tuple[int, list[tuple[int, int]]]:
    """(layers, the (out, in) linears of a layer) for `panels --shapes`."""
    forms = {"300m": (LAYERS, LINEARS), "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
             "big": (6, [(16384, 4096)])}
    if shapes not in forms:
        raise typer.BadParameter("--shapes: 300m, smollm2 or big")
    return forms[shapes]


def _panels_bf16(lib, rows: str, repeats: int, threads: int, shapes: str) -> None:
    """`panels --weights bf16`: the engine's bf16 layers (`QmmLinear.from_bf16` with the bf16 panel GEMM from its
    threshold) as rows against as stored panels, through the layers' own `forward` (rows: the row kernel, then the
    panel GEMM building its panels; panels: the lanes body, then the panel GEMM on the stored panels)."""
    from lmforge.quant.linear import QmmLinear
    panel = lib.bf16_panel_rows(-1) if lib is not None and lib.bf16_panel_rows is not None else 0
    if panel <= 0:
        raise typer.BadParameter("bf16 panels need the bf16 panel GEMM: a CPU with AVX512-BF16")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    n_layers, linears = _shapes(shapes)
    layers: dict[str, list[QmmLinear]] = {"rows": [], "panels": []}
    for _ in range(n_layers):
        for n, k in linears:
            lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
            for name in layers:
                m = QmmLinear.from_bf16(lin, lib.qmm_f32, c_gemm=True, bf16_units=True, bf16_panel=(lib.gemm_bf16, panel))
                m.threads = threads
                assert name == "rows" or m.store_panels()
                layers[name].append(m)
    nbytes = sum(m.codes.numel() * 2 for m in layers["rows"])
    for M in (int(r) for r in rows.split(",")):
        x = {k: torch.randn(M, k, generator=gen) for _, k in linears}
        outs = {name: [None] * len(layers["rows"]) for name in layers}

        def run(name: str) -> None:
            for i, m in enumerate(layers[name]):
                outs[name][i] = m(x[m.K])
        _layouts_line(M, outs, _alternate(list(outs), run, repeats), nbytes)


@app.command()
def stack(model: str, steps: int = 64, repeats: int = 12, threads: int = 2,
          quant_activations: str = "int8") -> None:
    """Batch-1 decode ms a step with the whole stack in one C call against a call a layer."""
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, enable_prefix_caching=False, quant_activations=quant_activations)
    layers = llm.llm_engine.model_runner.model.model.layers
    whole = getattr(layers[0], "stack", None)
    if whole is None:
        raise typer.BadParameter(f"{model}: its layers are not one C stack here "
                                 f"({llm.llm_engine.model_runner.decode_layers_why or 'LMFORGE_DECODE_STACK=0?'})")
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    tokens = {}

    def run(name: str) -> None:
        for m in layers:
            m.stack = whole if name == "one call a step" else None
        out = llm.generate([[5]], params, use_tqdm=False)[0].outputs[0]
        tokens[name] = out.token_ids
        times[name] = min(times.get(name, float("inf")), (out.token_times[-1] - out.token_times[0]) / steps)
    times: dict[str, float] = {}
    _alternate(["a call a layer", "one call a step"], run, repeats)
    assert tokens["a call a layer"] == tokens["one call a step"], "the two forms' tokens differ"
    print(", ".join(f"{name} {t * 1e3:.2f} ms a step" for name, t in times.items()))


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Random bfloat16 bit patterns (uint16), from float32 normals times `scale`."""
    return ((rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16).astype(np.uint16)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _Compare:
    """`compare(name, call, bufs)`: `call(lib, bufs)` on each of two libraries, each with its own copy of `bufs`
    (inputs and outputs, some written in place); the return codes and every buffer's bytes must be equal. The call
    runs at once, so closures over loop variables are safe."""

    def __init__(self, libs: list[kernels.CpuKernels]):
        self.libs, self.calls, self.differ = libs, 0, []

    def __call__(self, name: str, call, bufs: dict[str, np.ndarray]) -> None:
        runs = []
        for lib in self.libs:
            b = {k: v.copy() for k, v in bufs.items()}
            runs.append((call(lib, b), b))
        (rc0, b0), (rc1, b1) = runs
        self.calls += 1
        if rc0 != rc1 or any(b0[k].tobytes() != b1[k].tobytes() for k in b0):
            self.differ.append(name)


def _attention_cases(compare: _Compare, rng: np.random.Generator) -> None:
    """Both decode attentions: head layouts (one the bf16 AVX-512 body refuses), one sequence and several, fewer
    sequences than threads (context partitions, or kv heads split), every act / kv dtype pair."""
    B, P, W = 16, 64, 64  # block size, pool blocks, block-table width (up to 1,024 tokens a sequence)
    for N, K, H in ((16, 8, 64), (8, 2, 128), (4, 4, 32), (12, 4, 64), (4, 2, 48)):
        for S, threads in ((1, 1), (1, 2), (2, 4), (8, 3)):
            lens = rng.integers(1, 300 if S >= threads else 1000, S).astype(np.int32)
            common = {"t": rng.integers(0, P, (S, W)).astype(np.int32), "lens": lens,
                      "rows": rng.permutation(S).astype(np.int64)}
            bufs = {"q": _bf16(rng, S, N, H), "k": _bf16(rng, P * B, K, H), "v": _bf16(rng, P * B, K, H),
                    "out": np.zeros((S, N, H), np.uint16), **common}
            compare(f"paged_decode_bf16 N{N} K{K} H{H} S{S}", lambda lib, b: lib.decode(
                _ptr(b["q"]), _ptr(b["k"]), _ptr(b["v"]), _ptr(b["t"]), W, _ptr(b["lens"]), _ptr(b["rows"]), S, N, K,
                H, B, H ** -0.5, _ptr(b["out"]), threads), bufs)
            for act in (0, 1):
                q = _bf16(rng, S, N, H) if act == 0 else rng.standard_normal((S, N, H), np.float32)
                for kv in (0, 1, 2):
                    pools = [_bf16(rng, P * B, K, H), rng.standard_normal((P * B, K, H), np.float32),
                             rng.integers(-127, 128, (P * B, K, H)).astype(np.int8)]
                    positive = lambda a: np.abs(a.view(np.int16)).view(np.uint16)  # noqa: E731
                    bufs = {"q": q, "k": pools[kv], "v": pools[kv][::-1].copy(), "out": np.zeros_like(q), **common,
                            "ks": positive(_bf16(rng, P * B * K, scale=0.01)),
                            "vs": positive(_bf16(rng, P * B * K, scale=0.01))}
                    compare(f"paged_decode_any N{N} K{K} H{H} S{S} threads{threads} act{act} kv{kv}",
                            lambda lib, b: lib.decode_any(
                                _ptr(b["q"]), _ptr(b["k"]), _ptr(b["v"]), *(
                                    (_ptr(b["ks"]), _ptr(b["vs"])) if kv == 2 else (None, None)),
                                _ptr(b["t"]), W, _ptr(b["lens"]), _ptr(b["rows"]), S, N, K, H, B, H ** -0.5,
                                _ptr(b["out"]), threads, act, kv), bufs)


def _small_cases(compare: _Compare, rng: np.random.Generator) -> None:
    """The K/V writes and the elementwise ops, bf16 and float32."""
    T, K, H, rows = 5, 4, 32, 40
    s = rng.permutation(rows)[:T].astype(np.int64)

    def write(fn: str, k: np.ndarray, pool_dtype, row: int):
        bufs = {"k": k, "v": k[::-1].copy(), "s": s, "kp": np.zeros((rows, K * H), pool_dtype),
                "vp": np.zeros((rows, K * H), pool_dtype)}
        compare(fn, lambda lib, b: getattr(lib, fn)(_ptr(b["k"]), _ptr(b["v"]), _ptr(b["s"]), T, row,
                                                    _ptr(b["kp"]), _ptr(b["vp"])), bufs)
    write("write_kv", _bf16(rng, T, K * H), np.uint16, K * H)
    write("write_kv_bytes", rng.standard_normal((T, K * H), np.float32), np.float32, K * H * 4)
    write("write_kv_f32_bf16", rng.standard_normal((T, K * H), np.float32), np.uint16, K * H)
    for act in (0, 1):
        k = _bf16(rng, T, K, H) if act == 0 else rng.standard_normal((T, K, H), np.float32) * 3
        bufs = {"k": k, "v": k[::-1].copy(), "s": s, "kp": np.zeros((rows, K, H), np.int8),
                "vp": np.zeros((rows, K, H), np.int8), "ksc": np.zeros((rows, K), np.uint16),
                "vsc": np.zeros((rows, K), np.uint16)}
        compare(f"write_kv_int8 act{act}", lambda lib, b: lib.write_kv_int8(
            *map(_ptr, (b["k"], b["v"], b["s"])), T, K, H, act, *map(_ptr, (b["kp"], b["vp"], b["ksc"], b["vsc"]))),
            bufs)
    for sfx, make in (("", lambda *shape: _bf16(rng, *shape, scale=4)),
                      ("_f32", lambda *shape: rng.standard_normal(shape, np.float32) * 4)):
        for D in (64, 72, 1000):  # a tail past the vector width
            bufs = {"x": make(3, D), "w": make(D), "out": make(3, D) * 0}
            compare(f"rmsnorm{sfx} D{D}", lambda lib, b: getattr(lib, "rmsnorm" + sfx)(
                _ptr(b["x"]), _ptr(b["w"]), _ptr(b["out"]), 3, D, 1e-6, 1), bufs)
            bufs = {"g": make(3, D), "u": make(3, D), "out": make(3, D) * 0}
            compare(f"silu_mul{sfx} n{3 * D}", lambda lib, b: getattr(lib, "silu_mul" + sfx)(
                _ptr(b["g"]), _ptr(b["u"]), _ptr(b["out"]), 3 * D), bufs)
        for H in (32, 48, 128):
            bufs = {"x": make(3, 4, H), "cos": make(3, H), "sin": make(3, H)}
            compare(f"rope{sfx} H{H}", lambda lib, b: getattr(lib, "rope" + sfx)(
                _ptr(b["x"]), _ptr(b["cos"]), _ptr(b["sin"]), 3, 4, H, 1), bufs)


def _weights(rng: np.random.Generator, bits: int, N: int, K: int, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes as the kernels take them (float32, bf16, int8, or int4 two a byte) and float32 scales (N, K / gs)."""
    w = {32: lambda: rng.standard_normal((N, K), np.float32), 16: lambda: _bf16(rng, N, K),
         8: lambda: rng.integers(-127, 128, (N, K)).astype(np.int8),
         4: lambda: rng.integers(0, 256, (N, K // 2)).astype(np.uint8)}[bits]()
    groups = K // gs if gs > 0 else 1
    return w, (rng.random((N, groups), np.float32) + 0.01) * (1.0 if bits >= 16 else 0.02)


def _matmul_cases(compare: _Compare, rng: np.random.Generator, isas: list[int]) -> None:
    """The A16 row kernel (with and without the hand-over to the panel GEMM), the panel GEMM, the activations'
    quantization and the A8 matmul on every body, over every weight format and group size, 1-13 rows."""
    for K in (96, 192, 256):
        for bits in (32, 16, 8, 4):
            for gs in (0, 32, 64, 96):  # 0: per channel
                if (gs and K % gs) or (bits >= 16 and gs) or (bits == 4 and not gs):
                    continue
                N = int(rng.choice([20, 37, 64]))
                w, ws = _weights(rng, bits, N, K, gs)
                for M in (1, 2, 3, 4, 5, 7, 8, 9, 13):
                    x = rng.standard_normal((M, K), np.float32)
                    x[0, :7] *= 50  # outliers: the int8 scale
                    th = int(rng.integers(1, 4))
                    bufs = {"x": x, "w": w, "ws": ws, "out": np.zeros((M, N), np.float32)}
                    mm = (M, N, K, bits, gs, th)
                    for gr in (0, 6):
                        compare(f"qmm_f32 bits{bits} gs{gs} K{K} M{M} gemm_rows{gr}", lambda lib, b: lib.qmm_f32(
                            *map(_ptr, (b["x"], b["w"], b["ws"], b["out"])), *mm, gr, None), bufs)
                    no_scales = bits >= 16 and M % 2  # float weights may come without scales
                    compare(f"gemm_f32 bits{bits} gs{gs} K{K} M{M}", lambda lib, b: lib.gemm_f32(
                        _ptr(b["x"]), _ptr(b["w"]), None if no_scales else _ptr(b["ws"]), _ptr(b["out"]), *mm, None), bufs)
                    if bits > 8:
                        continue
                    for act in (0, 1):
                        xa = x if act else (x.view(np.uint32) >> 16).astype(np.uint16)
                        ab = gs or K  # a scale per block of the weight's group (the row for per channel)
                        q = {"x": xa, "q": np.zeros((M, K), np.int8), "s": np.zeros(M * (K // ab), np.float32)}
                        compare(f"quantize_s8 act{act} K{K} M{M} nibbles{int(bits == 4)} block{ab}",
                                lambda lib, b: lib.quantize_s8(_ptr(b["x"]), act, M, K, int(bits == 4), ab,
                                                               _ptr(b["q"]), _ptr(b["s"])), q)
                        for isa in (-1, *isas):
                            compare(f"qmm_a8 isa{isa} act{act} bits{bits} gs{gs} K{K} M{M}", lambda lib, b: lib.qmm_a8(
                                isa, _ptr(b["x"]), act, *map(_ptr, (b["w"], b["ws"], b["out"])), *mm, None), dict(bufs, x=xa))
                    q = {"q": rng.integers(-127, 128, (M, K)).astype(np.int8),
                         "s": rng.random(M * (K // (gs or K)), np.float32)}  # a scale per block of the group
                    for isa in (-1, *isas):
                        compare(f"qmm_s8 isa{isa} bits{bits} gs{gs} K{K} M{M}", lambda lib, b: lib.qmm_s8(
                            *map(_ptr, (b["q"], b["s"], b["w"], b["ws"], b["out"])), *mm, isa, None), dict(bufs, **q))


def _layer_cases(compare: _Compare, rng: np.random.Generator, isas: list[int]) -> None:
    """lmf_decode_layer_q and lmf_decode_stack_q (2 layers) on a small layer (D 64, 4 query / 2 kv heads of 16,
    F 96): A16 on every weight format, A8 on every body, float32 and bf16 pools, one sequence and three."""
    D, N, K, H, F, B, P, L = 64, 4, 2, 16, 96, 4, 32, 2
    shapes = {"qkv": ((N + 2 * K) * H, D), "o": (D, N * H), "gu": (2 * F, D), "down": (D, F)}
    for bits, gs, isa in ((32, 0, -1), (16, 0, -1), (8, 0, -1), (8, 32, -1), (4, 32, -1),
                          *((b, 32, i) for b in (8, 4) for i in isas)):
        for kv in (0, 1):
            for S, th in ((1, 1), (1, 2), (3, 2)):
                bufs = {"x": rng.standard_normal((S, D), np.float32), "cos": rng.standard_normal((S, H), np.float32),
                        "sin": rng.standard_normal((S, H), np.float32),
                        "slots": rng.permutation(P * B)[:S].astype(np.int64),
                        "t": rng.permutation(P)[: S * 8].reshape(S, 8).astype(np.int32),
                        "lens": rng.integers(1, 30, S).astype(np.int32), "rows": np.arange(S, dtype=np.int64)}
                for layer in range(L):
                    for name, (n, k) in shapes.items():
                        bufs[f"{layer}{name}"], bufs[f"{layer}{name}s"] = _weights(rng, bits, n, k, gs)
                    bufs[f"{layer}in"], bufs[f"{layer}post"] = rng.random((2, D), np.float32) + 0.5
                    for pool in ("kp", "vp"):
                        bufs[f"{layer}{pool}"] = (_bf16(rng, P * B, K, H) if kv == 0 else
                                                  rng.standard_normal((P * B, K, H), np.float32))

                def params(b: dict[str, np.ndarray], layer: int, lin: int) -> np.ndarray:  # lmf_decode_layer_q's
                    # p (since the GGUF block types: per-linear formats, LIN values a linear: 6, 7 with bf16_rows)
                    w = [v for n in shapes
                         for v in (_ptr(b[f"{layer}{n}"]), _ptr(b[f"{layer}{n}s"]), 0, bits, gs, 2, 0)[:lin]]
                    return np.array([_ptr(b[f"{layer}in"]), _ptr(b[f"{layer}post"]), D, N, K, H, F, B,
                                     _ptr(b[f"{layer}kp"]), _ptr(b[f"{layer}vp"]), th, th, kv, 0, 0, *w], dtype=np.int64)

                def run(lib: kernels.CpuKernels, b: dict[str, np.ndarray], stack: bool) -> int:
                    ps = [params(b, layer, lib.layer_lin) for layer in range(L if stack else 1)]
                    addrs = np.array([_ptr(a) for a in ps], dtype=np.int64)
                    step = (_ptr(b["x"]), S, *map(_ptr, (b["cos"], b["sin"], b["slots"], b["t"])), 8,
                            _ptr(b["lens"]), _ptr(b["rows"]), S, 1e-5, H ** -0.5)
                    if stack:
                        return lib.decode_stack_q(isa, L, _ptr(addrs), *step)
                    return lib.decode_layer_q(isa, _ptr(ps[0]), *step)
                for stack in (False, True):
                    compare(f"decode_{'stack' if stack else 'layer'}_q isa{isa} bits{bits} gs{gs} kv{kv} S{S} "
                            f"threads{th}", lambda lib, b: run(lib, b, stack), bufs)


@app.command()
def bits(old_rev: str = typer.Option(..., help="The revision to compare against (its kernels' C sources)."),
         flags: str = typer.Option("", help="Extra compiler flags for both builds, e.g. -DLMF_PORTABLE."),
         seed: int = 0) -> None:
    """Every entry point of this checkout's kernels and OLD_REV's on the same random inputs: equal bit for bit."""
    extra = tuple(flags.split())
    here = kernels._bind(kernels.build(extra)) if extra else kernels.load()
    if here is None:
        raise typer.BadParameter("lmforge's CPU kernels did not build here (`lmforge doctor`)")
    libs = [_with_lin(here, Path(kernels.__file__).parent), _library_at(old_rev, extra)]
    runs = [[lib.a8_isa_supported(i) for i in range(-1, 7)] for lib in libs]
    best = [ctypes.CDLL(str(lib.path)).lmf_a8_best_isa() for lib in libs]
    if runs[0] != runs[1] or best[0] != best[1]:
        raise SystemExit(f"the two libraries disagree on the A8 bodies this CPU runs: {runs}, default {best}")
    isas = [i for i in kernels.A8_ISAS.values() if here.a8_isa_supported(i)]
    compare, rng = _Compare(libs), np.random.default_rng(seed)
    _attention_cases(compare, rng)
    _small_cases(compare, rng)
    _matmul_cases(compare, rng, isas)
    _layer_cases(compare, rng, isas)
    names = ", ".join(k for k, v in kernels.A8_ISAS.items() if v in isas)
    print(f"{compare.calls} calls, A8 bodies {names}, flags {' '.join(kernels.FLAGS + list(extra))}: "
          f"{compare.calls - len(compare.differ)} equal" + "".join(f"\n  differs: {n}" for n in compare.differ))
    if compare.differ:
        raise SystemExit(1)


if __name__ == "__main__":
    app()
