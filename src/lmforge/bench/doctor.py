"""`lmforge doctor`: is this machine ready to train and serve, and how fast can it multiply?
(In `bench/` because it measures; `perf/hardware.py` reads the profile it writes.)

It checks the Python stack (torch, transformers, tokenizers, safetensors, numpy), the
accelerator (CUDA; MPS when present) and bf16 support, then *measures* the dense matmul peak
per dtype (square matmuls, FLOPs = 2·n³, warm-up, best of several timed runs, CUDA
synchronized) and the memory bandwidth (STREAM-like copy and triad on arrays far larger than
the caches), and saves them as the hardware profile that `perf.hardware.peak_flops`, every MFU
figure and the roofline of `lmforge estimate` read on CPU. It knows nothing about models, data or runs.

    python -m lmforge.bench.doctor [--quick] [--out PATH]
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Callable

import typer
from rich.console import Console
from rich.table import Table

from lmforge.perf.hardware import default_profile_path
from lmforge.track.io import atomic_write_json
from lmforge.track.short import short_mode

# Matrix sides per device kind; --quick takes the first entry only (and shorter timing).
# CPU: the peak is the best over sizes, and BLAS is fastest on cache-resident operands (n = 256 measured
# 129 GFLOP/s against 73 at n = 2048 on this 2-core EPYC): a peak from large squares alone let training
# steps of a small model (4096×256 by 256×704 matmuls) exceed it, MFU > 100%.
SIZES = {"cpu": (256, 512, 1024, 2048), "cuda": (4096, 8192), "mps": (2048, 4096)}
QUICK_SIZES = {"cpu": (256,), "cuda": (2048,), "mps": (1024,)}
DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "tf32", "bfloat16", "float16"),
          "mps": ("float32", "float16")}
STACK = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
REQUIRED = {"torch", "transformers"}  # the rest degrade single features, not the whole tool


@dataclass
class Check:
    name: str
    value: str
    status: str = "ok"  # "ok" | "warn" (works, but slower or partial) | "fail" (fix before use)
    fix: str = ""


@dataclass
class DoctorResult:
    checks: list[Check] = field(default_factory=list)
    profile: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def add(self, name: str, value: Any, status: str = "ok", fix: str = "") -> None:
        self.checks.append(Check(name, str(value), status, fix))


def cpu_bf16_flags() -> list[str]:
    """bf16 instruction-set flags from /proc/cpuinfo (x86: avx512_bf16, amx_bf16; Arm: bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(set(line.split(":", 1)[1].split()) & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return []


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(device: str, dtype: str, sizes: tuple[int, ...],
                         run_s: float = 0.1, repeats: int = 5, budget_s: float = 3.0) -> dict:
    """Best FLOP/s of `torch.matmul` on n×n operands over `sizes`.

    Each timed run repeats the matmul until it lasts ≥ `run_s` (timer resolution and launch
    overhead become noise); the best of `repeats` runs counts, since slower runs measure
    interference, not the hardware. Sizes whose projected cost (n³ scaling from the last size)
    would exceed `budget_s` are skipped, so an emulated dtype cannot stall the doctor for minutes.
    """
    import torch  # deferred: the doctor must run, and report it, when torch is missing or broken

    kind = device.split(":")[0]
    sync: Callable[[], None] = {"cuda": torch.cuda.synchronize,
                                "mps": getattr(torch, "mps", None) and torch.mps.synchronize}.get(kind) or (lambda: None)
    torch_dtype = torch.float32 if dtype == "tf32" else getattr(torch, dtype)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    best, best_n, spent, last = 0.0, 0, 0.0, None
    try:
        for n in sizes:
            if last is not None and last[1] * (n / last[0]) ** 3 * (repeats + 2) > budget_s - spent:
                break
            t_start = time.perf_counter()
            a = torch.randn(n, n, device=device, dtype=torch_dtype)
            b = torch.randn(n, n, device=device, dtype=torch_dtype)
            c = torch.empty(n, n, device=device, dtype=torch_dtype)
            torch.matmul(a, b, out=c)  # warm-up: kernel selection, allocator, thread pool
            sync()
            t0 = time.perf_counter()
            torch.matmul(a, b, out=c)
            sync()
            one = time.perf_counter() - t0
            iters = max(1, int(run_s / max(one, 1e-9)))
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(iters):
                    torch.matmul(a, b, out=c)
                sync()
                flops = 2 * n**3 * iters / (time.perf_counter() - t0)
                if flops > best:
                    best, best_n = flops, n
            last = (n, one)
            spent += time.perf_counter() - t_start
            del a, b, c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return {"flops": best, "n": best_n}


def measure_bandwidth(device: str = "cpu", n: int = 64 * 2**20, repeats: int = 5) -> dict:
    """Best bytes/s of STREAM's copy (b = a: 2 arrays moved) and triad (a = b + s·c: 3 arrays)
    over float32 arrays of `n` elements (64 Mi = 256 MB each by default: far past any L3).

    As in McCalpin's STREAM, bytes count what the kernel must read and write, not the
    write-allocate reads a CPU adds, so the figure is the bandwidth a streaming kernel sees.
    """
    import torch  # deferred: the doctor must run, and report it, when torch is missing or broken

    kind = device.split(":")[0]
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    a = torch.ones(n, device=device)
    b = torch.full((n,), 2.0, device=device)
    c = torch.full((n,), 0.5, device=device)
    kernels = {"copy": (lambda: b.copy_(a), 2), "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3)}
    out: dict = {"n": n, "dtype": "float32"}
    for name, (fn, arrays) in kernels.items():
        fn()  # warm-up: page faults, thread pool
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        out[name] = arrays * n * 4 / best
    del a, b, c
    return out


def memory_total() -> int | None:
    """Physical memory in bytes (/proc/meminfo MemTotal), None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _measure_bandwidth(r: DoctorResult, kind: str, quick: bool) -> dict | None:
    try:
        bw = measure_bandwidth(kind, n=(8 if quick else 64) * 2**20, repeats=3 if quick else 5)
    except Exception as e:  # noqa: BLE001 - out of memory on a small box: the roofline loses an axis, no more
        r.add(f"bandwidth {kind}", f"failed: {e}"[:80], "warn", "the roofline in `lmforge estimate` needs it")
        return None
    r.add(f"bandwidth {kind}", f"copy {bw['copy'] / 1e9:,.1f} GB/s, triad {bw['triad'] / 1e9:,.1f} GB/s "
                              f"({bw['n'] * 4 / 1e6:.0f} MB arrays)")
    return bw


def _check_stack(r: DoctorResult) -> dict[str, str | None]:
    r.add("python", platform.python_version(), "ok" if sys.version_info >= (3, 11) else "fail",
          "lmforge needs Python >= 3.11")
    versions: dict[str, str | None] = {}
    for name in STACK:
        try:
            importlib.import_module(name)
            versions[name] = metadata.version(name)
            r.add(name, versions[name])
        except Exception as e:  # noqa: BLE001 - a broken install raises anything; report it, don't crash
            versions[name] = None
            r.add(name, f"missing ({type(e).__name__}: {e})"[:80], "fail" if name in REQUIRED else "warn",
                  f"pip install {name}  (or `make install` from the repo)")
    return versions


def _check_cuda(r: DoctorResult, torch: Any) -> dict | None:
    has_driver_node = Path("/dev/nvidia0").exists()
    if not torch.cuda.is_available():
        if has_driver_node:
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "torch cannot initialise CUDA (driver too old, or CUDA_VISIBLE_DEVICES hides it)")
            r.add("cuda", f"NVIDIA device present but unusable: {why}", "fail",
                  "install a CUDA build of torch matching the driver (nvidia-smi shows its CUDA version)")
        else:
            r.add("cuda", "not available (CPU only)", "ok")
        return None
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    r.add("cuda", f"{count}× {name}, CUDA {torch.version.cuda}")
    r.add("gpu memory", f"{props.total_memory / 2**30:.1f} GiB")
    r.add("compute capability", f"{props.major}.{props.minor}")
    bf16 = torch.cuda.is_bf16_supported()
    r.add("bf16 (cuda)", "supported" if bf16 else "not supported (pre-Ampere): use float16",
          "ok" if bf16 else "warn")
    return {"kind": "cuda", "name": name, "count": count, "memory_bytes": props.total_memory,
            "compute_capability": f"{props.major}.{props.minor}", "bf16": bf16}


def _check_cpu_bf16(r: DoctorResult, torch: Any) -> bool:
    flags = cpu_bf16_flags()
    try:
        x = torch.randn(64, 64, dtype=torch.bfloat16)
        ran = bool(torch.isfinite((x @ x).float()).all())
    except Exception as e:  # noqa: BLE001
        r.add("bf16 (cpu)", f"matmul failed: {e}"[:80], "warn", "train on CPU in float32")
        return False
    native = f"native ({', '.join(flags)})" if flags else "emulated (no bf16 CPU instructions): slow"
    r.add("bf16 (cpu)", f"matmul runs, {native}", "ok" if flags else "warn")
    return ran


def _check_engine_kernels(r: DoctorResult) -> str:
    """The engine's compiled CPU decode-attention kernel: built (or cached) here, or why not."""
    from lmforge.engine import kernels  # deferred: loads torch; the doctor must run (and say so) without it

    status = kernels.status()
    fix = "" if status.startswith("on") else "install a C compiler (gcc or clang); the engine runs without it, slower"
    r.add("engine cpu kernels", status[:100], "ok" if status.startswith("on") else "warn", fix)
    return status


def _measure(r: DoctorResult, kind: str, quick: bool) -> dict[str, float]:
    sizes = QUICK_SIZES[kind] if quick else SIZES[kind]
    peaks: dict[str, float] = {}
    for dtype in DTYPES[kind]:
        try:
            m = measure_matmul_flops(kind, dtype, sizes, run_s=0.02 if quick else 0.1,
                                     repeats=3 if quick else 5, budget_s=1.0 if quick else 4.0)
        except Exception as e:  # noqa: BLE001
            fatal = dtype == "float32"  # float32 must work; the others are optional speed-ups
            r.add(f"matmul {kind} {dtype}", f"failed: {e}"[:80], "fail" if fatal else "warn",
                  "reinstall torch for this machine" if fatal else f"avoid {dtype} on {kind}")
            continue
        peaks[dtype] = m["flops"]
        r.add(f"matmul {kind} {dtype}", f"{m['flops'] / 1e9:,.1f} GFLOP/s (n={m['n']})")
    return peaks


def run_checks(quick: bool = False) -> DoctorResult:
    """Every check, plus the profile to save; prints nothing."""
    r = DoctorResult()
    versions = _check_stack(r)
    if versions.get("torch") is None:
        return r
    import torch  # deferred: the doctor must run, and report it, when torch is missing or broken

    devices: dict[str, dict] = {"cpu": {"kind": "cpu", "name": cpu_name(), "bf16_flags": cpu_bf16_flags()}}
    cuda = _check_cuda(r, torch)
    if cuda:
        devices["cuda"] = cuda
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        r.add("mps", "available")
        devices["mps"] = {"kind": "mps", "name": platform.machine()}
    devices["cpu"]["bf16_ran"] = _check_cpu_bf16(r, torch)
    devices["cpu"]["engine_kernels"] = _check_engine_kernels(r)
    r.add("cpu", f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    for kind, info in devices.items():
        info["peak_flops"] = _measure(r, kind, quick)
        info["sizes"] = list(QUICK_SIZES[kind] if quick else SIZES[kind])
        if kind in ("cpu", "cuda"):
            info["mem_bandwidth"] = _measure_bandwidth(r, kind, quick)
    devices["cpu"]["memory_bytes"] = memory_total()
    primary = "cuda" if cuda else "mps" if "mps" in devices else "cpu"
    r.profile = {
        "schema": 1,
        "device": primary,
        "device_name": devices[primary]["name"],
        "peak_flops": devices[primary]["peak_flops"],  # FLOP/s per dtype, for the primary device
        "devices": devices,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "versions": versions,
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "how": "best of several timed runs of torch.matmul(n×n, n×n) after a warm-up, FLOPs = 2·n³, "
               "CUDA synchronized; float32 on CUDA with TF32 off, tf32 with it on; mem_bandwidth: best of "
               "STREAM copy (2 arrays) and triad (3 arrays) over float32 arrays, bytes = arrays × n × 4",
    }
    return r


def doctor(out: Path | None = None, quick: bool = False) -> int:
    """The verb: print the table, save the profile, return 0 when nothing is broken."""
    console = Console()
    result = run_checks(quick or short_mode())  # LMFORGE_SHORT: CI runs the documented `lmforge doctor`
    table = Table(title="lmforge doctor")
    for col in ("check", "value", "status"):
        table.add_column(col)
    marks = {"ok": "[green]✓[/]", "warn": "[yellow]![/]", "fail": "[red]✗[/]"}
    for c in result.checks:
        table.add_row(c.name, c.value, marks[c.status])
    console.print(table)
    for c in result.checks:
        if c.status != "ok" and c.fix:
            console.print(f"{'✗' if c.status == 'fail' else '!'} {c.name}: {c.fix}")
    if result.profile and not result.failures:
        path = atomic_write_json(out or default_profile_path(), result.profile)
        console.print(f"hardware profile written to {path}")
    if result.failures:
        console.print(f"[red]doctor: {len(result.failures)} check(s) failed: "
                      f"{', '.join(c.name for c in result.failures)}[/]")
        return 1
    return 0


def _cli(out: Annotated[Path | None, typer.Option(
            "--out", help="where to write the hardware profile JSON [default: $LMFORGE_HOME/hardware.json]")] = None,
         quick: Annotated[bool, typer.Option(
             "--quick", help="small matrices and short timing (tests); still measured")] = False) -> None:
    raise typer.Exit(doctor(out, quick))


if __name__ == "__main__":
    typer.run(_cli)
