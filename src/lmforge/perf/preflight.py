"""Will it fit? The memory estimate against the memory the device has free, before anything is allocated.

- `available_memory(device)`: free bytes (CUDA `mem_get_info`; CPU MemAvailable, lowered to the
  cgroup's limit minus its usage inside a container) and where the figure comes from;
- `preflight_inference(model, dtype, max_num_seqs, max_model_len, device, kv_cache_memory_bytes)`:
  weights + the KV pool for serving; raises `PreflightError` with the `max_num_seqs` that fits.

The training pre-flight (`train/guards.py`) raises the same error. This module knows the
estimates and the devices, not the engine or the trainer.

    from lmforge.perf.preflight import preflight_inference
    preflight_inference("runs/model", "bfloat16", max_num_seqs=64, max_model_len=4096, device="cuda")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.config import ConfigError
from lmforge.perf.estimate import Estimate, ModelShape, fmt_bytes, kv_cache, memory


def _need(est: Estimate) -> float:
    return est.total + est.overhead


class PreflightError(ConfigError):
    """The run cannot fit the device; the message has the estimate and what would fit."""


# ---- memory available ------------------------------------------------------------------------


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def available_memory(device: Any) -> tuple[int | None, str]:
    """(bytes free for this process, where the figure comes from) on `device`.

    CUDA: `torch.cuda.mem_get_info` (free on the device). CPU: /proc/meminfo MemAvailable,
    lowered to the cgroup's limit minus its usage when the process runs in a container.
    """
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch  # deferred: only for a CUDA device; the calculators run without torch

        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"torch.cuda.mem_get_info ({fmt_bytes(total)} total)"
    avail, source = None, "/proc/meminfo MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None, "unknown (no /proc/meminfo)"
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None and (avail is None or limit - used < avail):
        avail, source = limit - used, "cgroup memory.max − memory.current"
    return avail, source


def preflight_inference(model: Any, dtype: str = "bfloat16", max_num_seqs: int = 128, max_model_len: int = 2048,
                        device: Any = "cpu", kv_cache_memory_bytes: int | None = None, quant_bits: int | None = None,
                        available: int | None = None) -> Estimate:
    """For `serve`: weights + the KV pool (`kv_cache_memory_bytes`, or max_num_seqs full sequences)
    against the device's free memory; raises `PreflightError` with what would fit."""
    shape = ModelShape.from_config(model)
    kind = getattr(device, "type", str(device).split(":")[0])
    est = memory(shape, mode="inference", dtype=dtype, batch=max_num_seqs, seq_len=max_model_len,
                 quant_bits=quant_bits, device_kind=kind)
    if kv_cache_memory_bytes is not None:  # the pool is sized by bytes, not by sequences
        weights = est["weights"]
        est = Estimate(est.title, [t for t in est.terms if t.name in ("parameters", "weights")], est.assumptions)
        est.add("kv cache", kv_cache_memory_bytes, "B", "kv_cache_memory_bytes")
        est.add("total", weights + kv_cache_memory_bytes, "B", "weights + kv cache")
        est.add("framework overhead", memory(shape, mode="inference", dtype=dtype, device_kind=kind).overhead, "B",
                "runtime + fragmentation")
    source = "given"
    if available is None:
        available, source = available_memory(device)
    if available is None or _need(est) <= available:
        return est
    per_seq = kv_cache(shape, max_model_len, 1, dtype)["per sequence"]
    room = available - est["weights"] - est.overhead
    fits = max(0, int(room // per_seq))
    raise PreflightError(
        f"pre-flight: serving needs ~{fmt_bytes(_need(est))} (weights {fmt_bytes(est['weights'])}, KV cache "
        f"{fmt_bytes(est['kv cache'])}) but {kind} has {fmt_bytes(available)} free ({source}). "
        + (f"Try max_num_seqs={fits} at max_model_len={max_model_len}, a shorter max_model_len, "
           if fits else "The weights alone do not fit: ")
        + "int8/int4 weights (`lmforge quantize`), or an int8 KV cache.")
