"""Native CPU kernels for the engine's hot path, compiled on first use and called through ctypes.

The C sources sit beside this file, one concern a file behind one header (`common.h`), the way ggml splits
`ggml-cpu/` (docs/engine.md, "Where the kernels live"):

  * `attention.c` (+ `attention_avx512.c`, `attention_avx2.c` and their `attention_f32_tile.c`, its SIMD bodies):
    paged decode attention for every one-token query of a step in one call, reading each sequence's blocks in place
    (no gather, no padding, no per-sequence Python): `lmf_paged_decode_bf16` on bfloat16, `lmf_paged_decode_any` on
    float32 activations and a float32, bf16 or int8 KV cache (CPUs without native bf16, `kv_cache_dtype=int8`);
  * `kv_write.c`: this step's K/V rows into their pool slots (vLLM's `reshape_and_cache`): `lmf_write_kv_*`;
  * `elementwise.c`: a Llama layer's `lmf_rmsnorm_*`, `lmf_rope_*`, `lmf_silu_mul_*` (bf16 and f32), one call
    each instead of 5-14 torch ops (`lmforge.engine.fused` puts them in the model);
  * `qmm_f32.c`: `lmf_qmm_f32`, weight-only int8 (per channel) / int4 (packed, per group) matmul on float32
    activations for a decode step's few rows (`lmforge.quant.linear.QmmLinear`), and bf16 (bits 16) or float32
    (bits 32) weights; from the caller's `gemm_rows` rows it hands over to `gemm_f32.c`'s `lmf_gemm_f32`, a
    register-tiled GEMM that widens or dequantizes the weight a (K, 16) panel at a time in L2 (prefill chunks
    and big batches; AVX2 + FMA);
  * `qmm_a8.c` (+ `qmm_a8_avx256.c`, `qmm_a8_avx512.c`, its x86 bodies): `lmf_qmm_a8`, the same weights on
    int8 activations (dynamic, a scale per block of the weight's group: 32 for GGUF's types, the row for per-channel int8) with int32 integer dot products, one body per ISA (`A8_ISAS`:
    AVX-512 VNNI in 256-bit and 512-bit forms, AVX-VNNI, AVX2, portable C); `LMFORGE_A8_ISA=<name>` forces
    one, `a8_isa()` says which runs; from `lmf_a8_panel_rows()` rows (6; `LMFORGE_A8_PANEL_ROWS=N` sets it, 0
    never) an AVX-512 VNNI CPU runs `qmm_a8_panel.c`, a panel GEMM over 16 weight rows unpacked at a time (prefill
    chunks, big decode batches);
  * `decode_layer.c`: `lmf_decode_layer_q` / `lmf_decode_stack_q`, a whole decoder layer (or every layer) of a
    decode step in one call;
  * `dispatch.c`: the one place that decides which body of each kernel runs, once at load, from the CPU's
    flags and what the build compiled; `lmf_kernels_chosen` names them (`CpuKernels.bodies`, `status()`).

Why native code: on CPU the per-sequence `scaled_dot_product_attention` loop spent ~30 us of
dispatch per sequence per layer on top of reading the K/V, and a padded batched SDPA must first
copy every sequence's blocks. `python -m lmforge.bench.attention` measures the difference.

The files are plain C (no Python or torch headers), so building them takes one compiler call. Every
`*.c` here is built, with the system C compiler (`$CC`, else `cc`, `gcc`, `clang`) and
`-O3 -march=native`, into one shared object in `$LMFORGE_CACHE/kernels` (default
`~/.cache/lmforge/kernels`), keyed by every source and header, the flags, the compiler and this CPU's
feature flags; the build writes a temporary file and renames it, so concurrent first uses are safe. With
no compiler, a failed build or `LMFORGE_KERNELS=0`, `load()` returns None and the engine keeps its torch
path (same contract; the tests check both). `status()` says which and why. `-DLMF_PORTABLE` (the tests'
`load(("-DLMF_PORTABLE",))`) builds plain C bodies only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_DIR = Path(__file__).parent  # the C sources: every *.c here, and the headers they include
MAX_H = 256  # head size limit of the attention and RoPE kernels (common.h's MAX_H)
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-pthread"]
# numbered in order of preference (common.h's enum): with none forced, the highest this CPU runs; on an
# AVX-512 VNNI CPU that is the 256-bit body on the EVEX vpdpbusd (faster than the 512-bit body on Zen 4; it
# hands int8 weights at 8 rows or more to the 512-bit body, which wins there)
A8_ISAS = {"portable": 0, "avx2": 1, "avx_vnni": 2, "avx512_vnni": 3, "avx512_vnni_256": 4}
OPENMP = "-fopenmp"  # tried first: the decode kernel's threads then come from torch's own OpenMP pool

_lock = threading.Lock()
_cache: dict[tuple, CpuKernels | None] = {}
_status: dict[tuple, str] = {}


@dataclass
class CpuKernels:
    """The loaded library's entry points, typed; `path` is the shared object."""

    path: Path
    decode: ctypes._CFuncPtr  # lmf_paged_decode_bf16(..., threads) -> 0 | -1 (shape not handled)
    write_kv: ctypes._CFuncPtr  # lmf_write_kv_bf16(k, v, slots, T, row_len, k_pool, v_pool)
    rmsnorm: ctypes._CFuncPtr  # lmf_rmsnorm_bf16(x, w, out, rows, D, eps, threads)
    rope: ctypes._CFuncPtr  # lmf_rope_bf16(x, cos, sin, T, heads, H, threads), in place
    silu_mul: ctypes._CFuncPtr  # lmf_silu_mul_bf16(g, u, out, n)
    decode_any: ctypes._CFuncPtr  # lmf_paged_decode_any(q, k, v, k_scales, v_scales, ..., threads, act, kv)
    write_kv_bytes: ctypes._CFuncPtr  # lmf_write_kv_bytes(k, v, slots, T, row_bytes, k_pool, v_pool)
    write_kv_int8: ctypes._CFuncPtr  # lmf_write_kv_int8(k, v, slots, T, K, H, act, k_pool, v_pool, k_sc, v_sc)
    write_kv_f32_bf16: ctypes._CFuncPtr | None  # lmf_write_kv_f32_bf16(k, v, slots, T, row_len, k_pool, v_pool): float32
    #                                       rows rounded into a bfloat16 pool
    rmsnorm_f32: ctypes._CFuncPtr
    rope_f32: ctypes._CFuncPtr
    silu_mul_f32: ctypes._CFuncPtr
    silu_mul_rows: ctypes._CFuncPtr | None = None  # lmf_silu_mul_rows_bf16(gu, out, rows, I, threads): rows [gate | up]
    silu_mul_rows_f32: ctypes._CFuncPtr | None = None  # lmf_silu_mul_rows_f32(gu, out, rows, I, threads)
    qmm_f32: ctypes._CFuncPtr | None = None  # lmf_qmm_f32(x, codes, scales, out, M, N, K, bits, gs, threads,
    #                                          gemm_rows): from gemm_rows rows (> 0) on the panel GEMM
    qmm_a8: ctypes._CFuncPtr | None = None  # lmf_qmm_a8(isa, x, act, codes, scales, out, M, N, K, bits, gs, threads)
    qmm_s8: ctypes._CFuncPtr | None = None  # lmf_qmm_s8(q, q_scales, codes, scales, out, M, N, K, bits, gs, threads,
    #                                         isa): on rows quantized already (the tests' entry point)
    quantize_s8: ctypes._CFuncPtr | None = None  # lmf_quantize_s8(x, act, M, K, nibble_order, block, q, q_scales)
    a8_isa_supported: ctypes._CFuncPtr | None = None  # lmf_a8_isa_supported(isa) -> 0 | 1
    a8_panel_rows: ctypes._CFuncPtr | None = None  # lmf_a8_panel_rows(rows) -> the threshold before: from how many
    #                                                rows the A8 panel GEMM runs (0 never; rows < 0 only reads it)
    a8_lanes_rows: ctypes._CFuncPtr | None = None  # lmf_a8_lanes_rows(rows) -> the value before: on int4 weights
    #                                                stored as panels, below how many rows the lanes body runs
    bf16_panel_rows: ctypes._CFuncPtr | None = None  # lmf_bf16_panel_rows(rows) -> the threshold before: from how
    #                                                  many rows lmf_qmm_f32 runs bf16 weights on the bf16 panel GEMM
    #                                                  (0: never, or no AVX512-BF16; rows < 0 only reads it)
    gemm_bf16: ctypes._CFuncPtr | None = None  # lmf_gemm_bf16(x, w, scales, out, M, N, K, threads, layout) -> 0 | -1
    gemm_bf16_swiglu: ctypes._CFuncPtr | None = None  # the same on silu(gate) * up of gate_up rows (M, 2K)
    gemm_f32: ctypes._CFuncPtr | None = None  # lmf_gemm_f32(x, w, scales, out, M, N, K, bits, gs, threads) -> 0 | -1
    gemm_ok: bool = False  # whether this build has the panel GEMM's body (AVX2 + FMA): prefill chunks of bf16 weights
    decode_layer_q: ctypes._CFuncPtr | None = None  # lmf_decode_layer_q(isa, params, x, M, cos, sin, slots, tables,
    #                                                  tables_M, lens, rows, S, eps, scale): a whole decoder layer
    decode_stack_q: ctypes._CFuncPtr | None = None  # lmf_decode_stack_q(isa, n_layers, layer_params, x, M, ...):
    #                                                  every decoder layer of a decode step in one call
    prefill: ctypes._CFuncPtr | None = None  # lmf_paged_prefill(q, q_row_stride, q_head_stride, k_pool, v_pool, kv,
    #                                          tables, tables_M, chunks, S, N, K, H, B, scale, out, threads): every
    #                                          prefill chunk of a step, causal, over the pool in place (kv 0 bf16,
    #                                          1 float32, 2 bf16 on the CPU's bf16 dot products where it has them)
    rope_f32_strided: ctypes._CFuncPtr | None = None  # lmf_rope_f32_strided(x, stride, cos, sin, T, heads, H,
    #                                                   threads): lmf_rope_f32 on rows `stride` floats apart
    write_kv_f32_bf16_strided: ctypes._CFuncPtr | None = None  # lmf_write_kv_f32_bf16_strided(k, v, slots, T,
    #                                                            row_len, k_stride, v_stride, k_pool, v_pool)
    bodies: dict[str, str] = field(default_factory=dict)  # lmf_kernels_chosen: kernel -> the body dispatch.c
    #                                                      chose at load ({} for an older revision's build)

    def a8_isas(self) -> list[str]:
        """The A8 bodies this CPU runs, the default first (`A8_ISAS` names, in order of preference)."""
        return [name for name, i in sorted(A8_ISAS.items(), key=lambda kv: -kv[1]) if self.a8_isa_supported(i)]

    def a8(self, isa: str | None = None) -> A8Matmul:
        """`lmf_qmm_a8` with one body bound: `isa`, else `a8_isa(self)` (LMFORGE_A8_ISA or the preferred one)."""
        isa = isa or a8_isa(self)
        if isa not in A8_ISAS or not self.a8_isa_supported(A8_ISAS[isa]):
            raise ValueError(f"int8-activation body {isa!r}: this CPU runs {', '.join(self.a8_isas())}")
        panel = self.a8_panel_rows(-1) if self.a8_panel_rows is not None and isa.startswith("avx512") else 0
        return A8Matmul.bind(self.qmm_a8, isa, panel)


class A8Matmul(functools.partial):
    """`lmf_qmm_a8(x, act, codes, scales, out, M, N, K, bits, gs, threads)` with body `isa` bound
    (a partial: no Python frame in the call); what `lmforge.quant.linear.QmmLinear` calls for
    `quant_activations="int8"`."""

    isa: str
    panel_rows: int  # from how many rows the call runs the A8 panel GEMM (qmm_a8_panel.c); 0: never (no AVX-512 VNNI)

    @classmethod
    def bind(cls, fn: ctypes._CFuncPtr, isa: str, panel_rows: int = 0) -> A8Matmul:
        p = cls(fn, A8_ISAS[isa])
        p.isa, p.panel_rows = isa, panel_rows
        return p


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes `lmf_paged_decode_bf16` handles on every build (it returns -1 for the others)."""
    return (num_kv_heads >= 1 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16
            and num_heads <= 64 and head_dim % 32 == 0 and head_dim <= MAX_H)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("LMFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lmforge")
    return Path(root) / "kernels"


def sources(src_dir: Path = SOURCE_DIR) -> tuple[list[Path], list[Path]]:
    """(the C files, the headers) of `src_dir`, sorted: every `*.c` is compiled, every `*.h` keys the cache."""
    return sorted(src_dir.glob("*.c")), sorted(src_dir.glob("*.h"))


def build(extra_flags: tuple[str, ...] = (), out_dir: Path | None = None, src_dir: Path = SOURCE_DIR) -> Path:
    """Compile the `*.c` files of `src_dir` (this package's, or an older revision's for an A/B run) into one
    shared object, or reuse the cached build, and return its path. Raises RuntimeError with the compiler's
    message when it cannot."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    c_files, headers = sources(src_dir)
    if not c_files:
        raise RuntimeError(f"no C sources in {src_dir}")
    flags = FLAGS + list(extra_flags)
    out_dir = out_dir or cache_dir()
    target = out_dir / f"lmf_kernels-{_key(cc, flags, c_files + headers)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        for attempt in ([OPENMP], []):  # without OpenMP (e.g. clang without libomp): pthreads
            proc = _compile(cc, flags + attempt, c_files, tmp)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{Path(cc).name} failed on {src_dir}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _key(cc: str, flags: list[str], files: list[Path]) -> str:
    """The build's cache key: every file's name and bytes, the flags, the compiler, this CPU's flags."""
    parts = [b"%s\0%s" % (f.name.encode(), f.read_bytes()) for f in files]
    return hashlib.sha256(b"\0".join([*parts, " ".join(flags + [OPENMP]).encode(), cc.encode(), _cpu_flags().encode(),
                                       platform.machine().encode()])).hexdigest()[:16]


def _compile(cc: str, flags: list[str], c_files: list[Path], out: str) -> subprocess.CompletedProcess:
    """Each C file to an object, all at once (one compiler process a file, as `make -j`), then one link: the
    files compile as they would in one call, and with free cores in about the time of the slowest of them."""
    with tempfile.TemporaryDirectory(dir=Path(out).parent, prefix="objs-") as objs:
        cmds = [[cc, *flags, "-c", str(f), "-o", os.path.join(objs, f"{f.stem}.o")] for f in c_files]
        with ThreadPoolExecutor(min(len(cmds), os.cpu_count() or 1)) as pool:
            procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), cmds))
        failed = [p for p in procs if p.returncode != 0]
        if failed:
            return failed[0]
        objects = [cmd[-1] for cmd in cmds]
        return subprocess.run([cc, *flags, *objects, "-o", out, "-lm"], capture_output=True, text=True)


_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# entry points a library may lack (an older revision's build, the A/B scripts): field -> (symbol, argtypes)
_OPTIONAL = {
    "qmm_a8": ("lmf_qmm_a8", [_I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
    "qmm_s8": ("lmf_qmm_s8", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
    "quantize_s8": ("lmf_quantize_s8", [_P, _I64, _I64, _I64, _I64, _I64, _P, _P]),
    "a8_isa_supported": ("lmf_a8_isa_supported", [_I64]),
    "a8_panel_rows": ("lmf_a8_panel_rows", [_I64]), "a8_lanes_rows": ("lmf_a8_lanes_rows", [_I64]),
    "bf16_panel_rows": ("lmf_bf16_panel_rows", [_I64]),
    "gemm_bf16": ("lmf_gemm_bf16", [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]),
    "gemm_bf16_swiglu": ("lmf_gemm_bf16_swiglu", [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]),
    "gemm_f32": ("lmf_gemm_f32", [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P]),
    "decode_layer_q": ("lmf_decode_layer_q", [_I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64, _F, _F]),
    "prefill": ("lmf_paged_prefill", [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P,
                                      _I64]),
    "decode_stack_q": ("lmf_decode_stack_q", [_I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64, _F, _F]),
    "rope_f32_strided": ("lmf_rope_f32_strided", [_P, _I64, _P, _P, _I64, _I64, _I64, _I64]),
    "write_kv_f32_bf16_strided": ("lmf_write_kv_f32_bf16_strided", [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P]),
}


def _bind(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released for the call
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    decode = lib.lmf_paged_decode_bf16
    decode.restype = ctypes.c_int
    decode.argtypes = [P, P, P, P, I64, P, P, I64, I64, I64, I64, I64, ctypes.c_float, P, I64]
    fns = {}
    for name, argtypes in (("write_kv", [P, P, P, I64, I64, P, P]), ("rmsnorm", [P, P, P, I64, I64, ctypes.c_float, I64]),
                           ("rope", [P, P, P, I64, I64, I64, I64]), ("silu_mul", [P, P, P, I64]),
                           ("silu_mul_rows", [P, P, I64, I64, I64])):
        for suffix in ("bf16", "f32"):
            fn = getattr(lib, f"lmf_{name}_{suffix}", None)
            if fn is None:
                continue
            fn.restype, fn.argtypes = None, argtypes
            fns[name if suffix == "bf16" else f"{name}_f32"] = fn
    fns.pop("write_kv_f32", None)
    decode_any = lib.lmf_paged_decode_any
    decode_any.restype = ctypes.c_int
    decode_any.argtypes = [P, P, P, P, P, P, I64, P, P, I64, I64, I64, I64, I64, ctypes.c_float, P, I64, I64, I64]
    write_bytes = lib.lmf_write_kv_bytes
    write_bytes.restype, write_bytes.argtypes = None, [P, P, P, I64, I64, P, P]
    to_bf16 = getattr(lib, "lmf_write_kv_f32_bf16", None)  # None: an older revision's build (A/B scripts)
    if to_bf16 is not None:
        to_bf16.restype, to_bf16.argtypes = None, [P, P, P, I64, I64, P, P]
    write_int8 = lib.lmf_write_kv_int8
    write_int8.restype, write_int8.argtypes = ctypes.c_int, [P, P, P, I64, I64, I64, I64, P, P, P, P]
    qmm = lib.lmf_qmm_f32
    # the trailing pointer of the matmuls: zero offsets (N, G) or None (NULL); a library older than them ignores it
    qmm.restype, qmm.argtypes = ctypes.c_int, [P, P, P, P, I64, I64, I64, I64, I64, I64, I64, P]
    for field, (name, argtypes) in _OPTIONAL.items():
        fn = getattr(lib, name, None)
        if fn is None:  # an older revision's build (the A/B scripts)
            continue
        fn.restype, fn.argtypes = (ctypes.c_int64 if field.endswith("_rows") else ctypes.c_int), argtypes  # thresholds
        fns[field] = fn
    _panel_thresholds_from_env(fns)
    one = (ctypes.c_float * 1)(1.0)
    # -1: no AVX2 + FMA body in this build (and no lmf_gemm_f32 at all in an older revision's)
    gemm_ok = "gemm_f32" in fns and fns["gemm_f32"](one, one, None, one, 1, 1, 1, 32, 0, 1, None) == 0
    chosen = getattr(lib, "lmf_kernels_chosen", None)  # None: an older revision's build (the A/B scripts)
    bodies = {}
    if chosen is not None:
        chosen.restype, chosen.argtypes = ctypes.c_char_p, []
        bodies = dict(item.split("=", 1) for item in chosen().decode().split())
    return CpuKernels(path, decode, decode_any=decode_any, write_kv_bytes=write_bytes, write_kv_int8=write_int8,
                      write_kv_f32_bf16=to_bf16, qmm_f32=qmm, gemm_ok=gemm_ok, bodies=bodies, **fns)


def _panel_thresholds_from_env(fns: dict) -> None:
    """`LMFORGE_A8_PANEL_ROWS` / `LMFORGE_BF16_PANEL_ROWS`: from how many rows each panel GEMM runs (0: never);
    `LMFORGE_A8_LANES_ROWS`: on int4 weights stored as panels, below how many rows the lanes body runs."""
    for field, env in (("a8_panel_rows", "LMFORGE_A8_PANEL_ROWS"), ("bf16_panel_rows", "LMFORGE_BF16_PANEL_ROWS"),
                       ("a8_lanes_rows", "LMFORGE_A8_LANES_ROWS")):
        if field in fns and (rows := os.environ.get(env, "").strip()):
            if not rows.isdigit():
                raise ValueError(f"{env}={rows!r}: a row count (0: never the panel GEMM)")
            fns[field](int(rows))


def load(extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The compiled kernels, or None (no compiler, build failed, or `LMFORGE_KERNELS=0`); once per process."""
    key = tuple(extra_flags)
    with _lock:
        if key in _cache:
            return _cache[key]
        lib = None
        if os.environ.get("LMFORGE_KERNELS", "1") == "0":
            _status[key] = "off (LMFORGE_KERNELS=0)"
        else:
            try:
                lib = _bind(build(extra_flags))
                _status[key] = f"on ({lib.path})"
            except (RuntimeError, OSError, AttributeError) as e:
                _status[key] = f"off ({e})"
        _cache[key] = lib
        return lib


def a8_isa(lib: CpuKernels) -> str:
    """The A8 body `lib` runs: `LMFORGE_A8_ISA` when set (a ValueError if unknown or not on this CPU),
    else the one the library's dispatch table chose at load (the first this CPU has in order of preference)."""
    forced = os.environ.get("LMFORGE_A8_ISA", "").strip().lower()
    if not forced:
        return lib.bodies.get("qmm_a8") or lib.a8_isas()[0]
    if forced not in A8_ISAS:
        raise ValueError(f"LMFORGE_A8_ISA={forced!r}: not one of {', '.join(A8_ISAS)}")
    if not lib.a8_isa_supported(A8_ISAS[forced]):
        raise ValueError(f"LMFORGE_A8_ISA={forced!r}: this CPU runs only {', '.join(lib.a8_isas())}")
    return forced


def status() -> str:
    """'on (int8-activation matmul: <body>; <kernel> <body>, ...; path)' or 'off (why)' for the default build
    (the bodies as the dispatch table chose them, the A8 one after LMFORGE_A8_ISA); builds it if nobody asked
    yet."""
    lib = load()
    if lib is None:
        return _status[()]
    try:
        isa = a8_isa(lib)
    except ValueError as e:
        isa = f"error: {e}"
    others = ", ".join(f"{name} {body}" for name, body in lib.bodies.items() if name != "qmm_a8")
    return f"on (int8-activation matmul: {isa}; {others}; {lib.path})"


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX-512 BF16 or AMX-BF16, from its flags);
    `LMFORGE_CPU_BF16=0|1` overrides the answer (to measure the other `--dtype auto` choice here)."""
    forced = os.environ.get("LMFORGE_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_quant_activations(quantized: bool, dtype: str, device_type: str, fast_attention: bool,
                           tensor_parallel: bool) -> tuple[str, str]:
    """`--quant-activations auto`: ("int8" | "none", why). int8 where it runs on integer dot products: int8/int4
    weights, a CPU model in float32 or bfloat16, lmforge's kernels built with a VNNI or AVX2 body (llama.cpp
    quantizes activations to 8 bits for every weight type too; greedy agreement with the exact path on the frozen
    quant-check suite: w8 0.959, w4 0.986, perplexity +0.00%, docs/quantization.md). Elsewhere the exact path."""
    if not quantized:
        return "none", "float weights"
    if device_type != "cpu" or dtype not in ("float32", "bfloat16") or not fast_attention or tensor_parallel:
        return "none", "int weights outside the CPU kernels' reach (device, dtype, reference mode or tensor parallel)"
    lib = load()
    if lib is None or lib.qmm_a8 is None:
        return "none", "no compiled kernels: the exact path"
    isa = a8_isa(lib)
    if isa == "portable":
        return "none", "this CPU has neither VNNI nor AVX2 integer dot products: the exact path"
    return "int8", f"int weights, {isa} integer dot products: int8 activations (as llama.cpp's)"


def auto_dtype(checkpoint_dtype: str | None, quantized: bool) -> tuple[str, str, bool]:
    """`--dtype auto` on CPU: (dtype of the activations, why, whether linear weights stay bfloat16).
    int8/int4 weights: float32 activations, so the weights stay codes and lmforge's integer kernels run
    (`lmf_qmm_f32`, or `lmf_qmm_a8` with int8 activations). Float weights: the checkpoint's precision is
    never rounded (a float32 checkpoint stays float32); a 16-bit checkpoint computes in bfloat16 on a
    CPU with bf16 units. On one without them, a bf16 checkpoint keeps its linear weights in bf16 (2
    bytes a weight read at decode) and computes in float32 on lmforge's kernels (`lmf_qmm_f32` with
    bits 16: a decode step's few rows, and the whole decoder layer as one C call; above 32 rows the
    weight widened for sgemm): torch's own bf16 matmul on such a CPU has no fast path (prefill of 512
    tokens on the random 300M, AVX2 EPYC, 2 threads: 32 tok/s against llama.cpp's 154,
    `python scripts/vs_llamacpp.py`). On a CPU with bf16 units a bf16 checkpoint takes the same form, but
    steps of `QmmLinear.BF16_UNITS_ROWS` rows or more run oneDNN's bf16 GEMM on the bf16 weight (prefill,
    batched decode): decode stays on the float32 kernels, which read weights faster than torch's bf16
    matmul (random 300M, batch 1, Zen 4, 2 threads: 19.5-22.3 ms a step against 29-37 in bf16 compute).
    Without the compiled kernels, bf16 as before."""
    if quantized:
        return "float32", "int8/int4 weights: float32 activations on lmforge's integer kernels", False
    ckpt = checkpoint_dtype or "float32"
    if ckpt not in ("bfloat16", "float16"):
        return ckpt, f"{ckpt} checkpoint kept", False
    units = cpu_has_bf16()
    if ckpt == "bfloat16" and (lib := load()) is not None and lib.qmm_f32 is not None:
        how = ("CPU has bf16 units: bf16 weights, float32 activations on lmforge's kernels for a decode step's "
               "few rows, oneDNN's bf16 GEMM on the bf16 units above" if units else
               "CPU without bf16 units: bf16 weights, float32 activations on lmforge's kernels")
        return "float32", f"bfloat16 checkpoint, {how}", True
    if units:
        return "bfloat16", f"{ckpt} checkpoint, CPU has bf16 units: bf16 compute", False
    return "bfloat16", f"{ckpt} checkpoint, CPU without bf16 units: bf16 weights, float32 arithmetic in oneDNN", False