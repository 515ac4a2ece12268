"""Peak matmul throughput of the device a run uses: the denominator of every MFU figure.

On CUDA the peak comes from a table of NVIDIA datasheet *dense* numbers (no 2:4 sparsity), chosen
by a substring of `torch.cuda.get_device_name()`. On CPU (and on a GPU missing from the table)
there is no datasheet we can trust for "this many cores under this BLAS", so the peak is the one
`lmforge doctor` measured and saved in the hardware profile (`$LMFORGE_HOME/hardware.json`,
`LMFORGE_HOME` defaulting to `~/.cache/lmforge`). We deliberately do *not* measure on the spot
when the profile is missing: a silent multi-second benchmark inside a training step would skew
the very throughput it is meant to judge, so `peak_flops` stops and asks for `lmforge doctor`.

It knows nothing about models or token counts (see `perf/mfu.py`).

    python -c "from lmforge.perf.hardware import peak_flops; print(peak_flops('cpu', 'float32'))"
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Canonical dtype names, and the spellings people use for them.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}

# Dense peak TFLOP/s per GPU: (float32 on CUDA cores, tf32, bfloat16, float16) on tensor cores,
# FP32 accumulate. None: the dtype has no tensor-core path on that chip.
# Sources (NVIDIA datasheets and architecture whitepapers; the starred figures there are with
# 2:4 sparsity and are halved here):
#   A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), SXM and PCIe 40/80GB alike;
#   H100 datasheet (SXM / PCIe / NVL columns); H200 datasheet (SXM / NVL); GH200 datasheet;
#   L4, L40, L40S, A10, T4 product datasheets; V100 datasheet (SXM2 / PCIe / V100S);
#   "NVIDIA Ampere GA102 GPU Architecture" whitepaper (RTX 3090, RTX A6000: GeForce runs
#   FP16/BF16 with FP32 accumulate at half rate); "NVIDIA Ada GPU Architecture" whitepaper
#   (RTX 4090, RTX 6000 Ada); HGX B200 spec sheet (8-GPU totals divided by 8).
#   A10G is an AWS part with no public NVIDIA datasheet: the A10 figures are used as an upper bound.
DATASHEET_TFLOPS: dict[str, tuple[float, float | None, float | None, float | None]] = {
    "A100": (19.5, 156.0, 312.0, 312.0),
    "H100": (67.0, 494.5, 989.5, 989.5),        # device name of the SXM part: "NVIDIA H100 80GB HBM3"
    "H100 SXM": (67.0, 494.5, 989.5, 989.5),
    "H100 PCIE": (51.0, 378.0, 756.0, 756.0),
    "H100 NVL": (60.0, 417.5, 835.5, 835.5),
    "H200": (67.0, 494.5, 989.5, 989.5),
    "H200 NVL": (60.0, 417.5, 835.5, 835.5),
    "GH200": (67.0, 494.5, 989.5, 989.5),
    "L4": (30.3, 60.0, 121.0, 121.0),
    "L40": (90.5, 90.5, 181.05, 181.05),
    "L40S": (91.6, 183.0, 362.05, 362.05),
    "A10": (31.2, 62.5, 125.0, 125.0),
    "A10G": (31.2, 62.5, 125.0, 125.0),
    "T4": (8.1, None, None, 65.0),
    "V100": (15.7, None, None, 125.0),           # SXM2
    "V100 PCIE": (14.0, None, None, 112.0),
    "V100S": (16.4, None, None, 130.0),
    "RTX 3090": (35.6, 35.6, 71.0, 71.0),
    "RTX 4090": (82.6, 82.6, 165.2, 165.2),
    "RTX A6000": (38.7, 77.4, 154.8, 154.8),
    "RTX 6000 ADA": (91.1, 182.1, 364.2, 364.2),
    "B200": (75.0, 1125.0, 2250.0, 2250.0),
}
_DTYPE_COLUMN = {"float32": 0, "tf32": 1, "bfloat16": 2, "float16": 3}

# Memory bandwidth (GB/s), memory (GB) and GPU-to-GPU interconnect (GB/s per direction: NVLink
# where the part has it, else PCIe) per GPU, with the document each row comes from. NVLink
# figures in datasheets are bidirectional totals and are halved here; PCIe Gen4 x16 is 32 GB/s
# per direction, Gen5 x16 64 GB/s (PCI-SIG).
DATASHEET_MEMORY: dict[str, tuple[float, float, float, str]] = {
    "A100": (2039, 80, 300, "A100 datasheet (r4), SXM4 80GB: 2,039 GB/s HBM2e, NVLink 600 GB/s"),
    "A100 SXM4 40GB": (1555, 40, 300, "A100 datasheet (r4), SXM4 40GB: 1,555 GB/s HBM2"),
    "A100 PCIE 40GB": (1555, 40, 32, "A100 datasheet (r4), PCIe 40GB: 1,555 GB/s; PCIe Gen4"),
    "A100 80GB PCIE": (1935, 80, 32, "A100 datasheet (r4), PCIe 80GB: 1,935 GB/s; PCIe Gen4"),
    "A100 PCIE": (1935, 80, 32, "A100 datasheet (r4), PCIe 80GB: 1,935 GB/s; PCIe Gen4"),
    "H100": (3350, 80, 450, "H100 datasheet, SXM: 3.35 TB/s HBM3, NVLink 900 GB/s"),
    "H100 SXM": (3350, 80, 450, "H100 datasheet, SXM: 3.35 TB/s HBM3, NVLink 900 GB/s"),
    "H100 PCIE": (2000, 80, 64, "H100 datasheet, PCIe: 2 TB/s HBM2e; PCIe Gen5"),
    "H100 NVL": (3900, 94, 300, "H100 datasheet, NVL: 3.9 TB/s, NVLink bridge 600 GB/s"),
    "H200": (4800, 141, 450, "H200 datasheet, SXM: 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s"),
    "H200 NVL": (4800, 141, 450, "H200 datasheet, NVL: 4.8 TB/s, NVLink bridge 900 GB/s"),
    "GH200": (4000, 96, 450, "GH200 datasheet: 4 TB/s HBM3 96 GB, NVLink 900 GB/s"),
    "L4": (300, 24, 32, "L4 datasheet: 300 GB/s GDDR6; PCIe Gen4"),
    "L40": (864, 48, 32, "L40 datasheet: 864 GB/s GDDR6; PCIe Gen4"),
    "L40S": (864, 48, 32, "L40S datasheet: 864 GB/s GDDR6; PCIe Gen4"),
    "A10": (600, 24, 32, "A10 datasheet: 600 GB/s GDDR6; PCIe Gen4"),
    "A10G": (600, 24, 32, "A10 datasheet (A10G: AWS part, A10 figures as upper bound)"),
    "T4": (320, 16, 16, "T4 datasheet: 320 GB/s GDDR6; PCIe Gen3 x16"),
    "V100": (900, 32, 150, "V100 datasheet, SXM2: 900 GB/s HBM2, NVLink 300 GB/s"),
    "V100 PCIE": (900, 32, 16, "V100 datasheet, PCIe: 900 GB/s; PCIe Gen3"),
    "V100S": (1134, 32, 16, "V100S datasheet: 1,134 GB/s; PCIe Gen3"),
    "RTX 3090": (936, 24, 32, "GA102 whitepaper, RTX 3090: 936 GB/s GDDR6X; PCIe Gen4"),
    "RTX 4090": (1008, 24, 32, "Ada whitepaper, RTX 4090: 1,008 GB/s GDDR6X; PCIe Gen4"),
    "RTX A6000": (768, 48, 56, "GA102 whitepaper, RTX A6000: 768 GB/s; NVLink bridge 112 GB/s"),
    "RTX 6000 ADA": (960, 48, 32, "Ada whitepaper, RTX 6000 Ada: 960 GB/s; PCIe Gen4"),
    "B200": (8000, 180, 900, "HGX B200 spec sheet ÷ 8: 8 TB/s HBM3e, 180 GB, NVLink 1.8 TB/s"),
}


def _longest_key(gpu_name: str, table: dict) -> str | None:
    words = _normalize_gpu_name(gpu_name).split()
    hits = [k for k in table if _contains_tokens(words, k.split())]
    return max(hits, key=len) if hits else None


def datasheet_spec(gpu_name: str) -> dict | None:
    """Peaks, bandwidth, memory and interconnect of a GPU from the datasheet tables (the fields of
    `perf.estimate.Device`), or None when the GPU is not in them."""
    key = _longest_key(gpu_name, DATASHEET_TFLOPS)
    mem_key = _longest_key(gpu_name, DATASHEET_MEMORY)
    if key is None:
        return None
    peaks = {d: (t * 1e12 if t else None) for d, t in zip(_DTYPE_COLUMN, DATASHEET_TFLOPS[key])}
    bw, mem, link, source = DATASHEET_MEMORY[mem_key] if mem_key else (None, None, None, "")
    return {"name": key, "peaks": peaks, "bandwidth": bw * 1e9 if bw else None, "memory": mem * 1e9 if mem else None,
            "interconnect": link * 1e9 if link else None,
            "source": source or "NVIDIA datasheet (peaks only)", "kind": "cuda"}


class NoPeakError(RuntimeError):
    """No trustworthy peak for this device/dtype; the message says what to run."""


def lmforge_home() -> Path:
    return Path(os.environ.get("LMFORGE_HOME") or Path.home() / ".cache" / "lmforge")


def default_profile_path() -> Path:
    return lmforge_home() / "hardware.json"


def canonical_dtype(dtype: Any) -> str:
    """"bf16", "torch.bfloat16" or torch.bfloat16 -> "bfloat16"."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, tf32, bfloat16, float16")
    return DTYPE_ALIASES[key]


def load_profile(path: str | os.PathLike | None = None) -> dict | None:
    """The hardware profile `lmforge doctor` wrote, or None when there is none yet."""
    path = Path(path) if path else default_profile_path()
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NoPeakError(f"{path} is not valid JSON ({e}); rerun `lmforge doctor` to rewrite it") from e


def _normalize_gpu_name(name: str) -> str:
    return " ".join(name.upper().replace("-", " ").replace("_", " ").split())


def datasheet_peak(gpu_name: str, dtype: str) -> float | None:
    """Dense datasheet peak in FLOP/s for `gpu_name`, or None when the GPU is not in the table.

    The longest table key found in the name wins, so "A10G" beats "A10", "L40S" beats "L40",
    "H100 PCIe" beats "H100" and "GH200" beats "H200".
    """
    dtype = canonical_dtype(dtype)
    words = _normalize_gpu_name(gpu_name).split()
    hits = [k for k in DATASHEET_TFLOPS if _contains_tokens(words, k.split())]
    if not hits:
        return None
    tflops = DATASHEET_TFLOPS[max(hits, key=len)][_DTYPE_COLUMN[dtype]]
    if tflops is None:
        raise NoPeakError(f"{gpu_name} has no tensor-core {dtype} path (datasheet); "
                          f"train in a dtype it supports, e.g. float16 or float32")
    return tflops * 1e12


def _contains_tokens(words: list[str], tokens: list[str]) -> bool:
    """Whole-word match, so "A10" is not found in "NVIDIA A100-SXM4-80GB"."""
    return any(words[i:i + len(tokens)] == tokens for i in range(len(words) - len(tokens) + 1))


def peak_flops(device: str, dtype: str, profile: dict | None = None,
               device_name: str | None = None) -> float:
    """Peak dense matmul FLOP/s of `device` ("cpu", "cuda", "cuda:1", "mps") in `dtype`.

    CUDA: the datasheet table by device name (`device_name` overrides the query, for
    calculations about a GPU you do not have); a GPU missing from the table falls back to the
    measured profile when the profile was measured on a GPU of the same name.
    CPU / MPS: the measured profile. `profile` defaults to `load_profile()`.
    For float32 on CUDA pass "tf32" when `torch.backends.cuda.matmul.allow_tf32` is on.
    """
    dtype = canonical_dtype(dtype)
    kind = device.split(":")[0]
    if kind == "cuda":
        if device_name is None:
            import torch  # deferred: only to name a CUDA device; the calculators run without torch

            index = int(device.split(":")[1]) if ":" in device else 0
            device_name = torch.cuda.get_device_name(index)
        peak = datasheet_peak(device_name, dtype)
        if peak is not None:
            return peak
    profile = profile if profile is not None else load_profile()
    if profile is None:
        raise NoPeakError(f"no hardware profile at {default_profile_path()}: run `lmforge doctor` "
                          f"once on this machine to measure the {kind} matmul peak")
    measured = profile.get("devices", {}).get(kind)
    if measured is None:
        raise NoPeakError(f"the hardware profile has no {kind} measurement; rerun `lmforge doctor` "
                          f"on the machine with the {kind} device")
    if kind == "cuda" and measured.get("name") != device_name:
        raise NoPeakError(f"{device_name!r} is not in the datasheet table and the profile was measured "
                          f"on {measured.get('name')!r}; run `lmforge doctor` on this machine, or add "
                          f"the GPU to DATASHEET_TFLOPS in lmforge/perf/hardware.py")
    peaks = measured.get("peak_flops", {})
    if not peaks.get(dtype):
        raise NoPeakError(f"the hardware profile has no {dtype} peak for {kind} "
                          f"(measured: {sorted(peaks)}); rerun `lmforge doctor`")
    return float(peaks[dtype])
