"""Guard rails around a training run: refuse what cannot fit, explain what broke, warn on what drifts.

- `preflight_train`: the memory estimate of the run (`perf.estimate.memory` with the run's real dtypes:
  `memory_args` maps the config, so it is what `lmforge estimate memory` prints for the same settings)
  against the memory the device has free, before the model is built; refuses with the remedies that
  would fit, in order (checkpointing, LoRA on a bf16 base, a smaller micro-batch with more accumulation).
- `preflight_inference` (from `perf/preflight.py`, which `serve` uses): the same for serving.
- `oom_message`: a `torch.OutOfMemoryError` (or CPU "can't allocate memory") answered with the
  estimate, the measured peak and the remedies.
- `SpikeDetector`: z-score of the loss and the gradient norm over a trailing window; a spike
  names the step and the packed rows of its batch, and may skip the update.
- `graph_breaks`: what dynamo recorded after `torch.compile` ran (count and reasons).
- `TrainingDiverged`: a NaN/Inf loss, naming the step and the last good checkpoint; `mem_bytes`:
  the memory figure of a step's metrics row.
- `set_deterministic`: `torch.use_deterministic_algorithms`, the cuDNN flags and
  `CUBLAS_WORKSPACE_CONFIG`, returned as a record.

It knows the config and the estimates, not the loop: `train/loop.py` calls each with a few lines.

    from lmforge.train.guards import preflight_train
    preflight_train(cfg, shape, seq_len=256, device=torch.device("cpu"))  # raises PreflightError
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmforge.config import ConfigError
from lmforge.perf.estimate import Estimate, ModelShape, fmt_bytes, memory
from lmforge.perf.preflight import PreflightError, available_memory, preflight_inference  # noqa: F401 (re-exported)
from lmforge.track.run import peak_memory


# ---- pre-flight ------------------------------------------------------------------------------


def shape_for(cfg: Any, vocab_size: int) -> ModelShape:
    """The model the config will build, without building it (`model.init` folder or the fields)."""
    m = cfg.model
    if m.init:
        return ModelShape.from_config(m.init)
    heads = m.num_attention_heads
    return ModelShape(hidden=m.hidden_size, layers=m.num_hidden_layers, heads=heads,
                      kv_heads=m.num_key_value_heads or heads, head_dim=m.head_dim or m.hidden_size // heads,
                      intermediate=m.intermediate_size, vocab=m.vocab_size or vocab_size,
                      tied=m.tie_word_embeddings, name=cfg.run.name or "model")


def base_kind_for(cfg: Any, device_kind: str) -> str:
    """float32 | bfloat16 | int8 | int4: how a LoRA run holds its frozen base linears (`lora.base_kind`)."""
    lora = cfg.lora
    if lora.base_quant not in (None, "none"):
        return lora.base_quant
    if lora.base_dtype != "auto":
        return lora.base_dtype
    import torch  # deferred: guards is imported by `lmforge smoke` and the CLI, which must not load torch

    from .lora import base_kind  # deferred: with torch

    return base_kind(lora, torch.device(device_kind))


def memory_args(cfg: Any, shape: ModelShape, seq_len: int, device_kind: str, **changes: Any) -> dict[str, Any]:
    """The arguments of `perf.estimate.memory` (what `lmforge estimate memory` calls) that describe this run
    as lmforge runs it: fp32 master weights and AdamW (full), or the frozen base as `lora.base_dtype` /
    `lora.base_quant` hold it with fp32 adapters and their AdamW states (LoRA); autocast in train.dtype;
    the fused loss (logits a chunk at a time; DPO's blocked log-probs alike) unless a LoRA-adapted head makes it
    fall back; for DPO, 2 x batch rows (chosen and rejected) and the reference copy (full fine-tuning without
    precomputed reference log-probs). `changes` override train fields (and
    `lora_base`, the base kind of a LoRA remedy)."""
    t = {**vars(cfg.train), **changes}
    dpo = t["stage"] == "dpo"
    kw: dict[str, Any] = dict(mode="full", dtype="float32", optimizer="adamw", batch=t["batch_size"] * (2 if dpo else 1),
                              seq_len=seq_len, grad_ckpt=t["gradient_checkpointing"],
                              fused_loss=t["fused_loss"] and not (t["method"] == "lora" and "lm_head" in
                                                                  cfg.lora.target_modules),
                              compute_dtype=t["dtype"], device_kind=device_kind)
    if t["method"] == "full":
        kw["reference_model"] = dpo and not cfg.dpo.precompute_ref_log_probs
        return kw
    kind = t.get("lora_base") or base_kind_for(cfg, device_kind)
    kw.update(mode="lora", dtype=kind, lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.target_modules))
    if kind in ("int8", "int4"):
        group = next((g for g in (64, 32, 16, 8) if shape.hidden % g == 0 and shape.intermediate % g == 0), 8)
        kw.update(mode="qlora", dtype="float32", quant_bits=int(kind[3:]), group_size=group)
    return kw


def train_estimate(cfg: Any, shape: ModelShape, seq_len: int, device_kind: str, **changes: Any) -> Estimate:
    """`perf.estimate.memory` for this run with its real dtypes (`memory_args`)."""
    return memory(shape, **memory_args(cfg, shape, seq_len, device_kind, **changes))


ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def estimate_command(shape_ref: str, kw: dict[str, Any]) -> str | None:
    """The `lmforge estimate memory` command line that prints the same estimate, or None when the run uses a
    setting the command has no option for (LoRA targets other than all seven matmuls, float32 compute, the
    unfused loss, DPO's reference copy, int4 groups other than 64)."""
    defaults = {"fused_loss": True, "reference_model": False, "group_size": 64}
    if (any(kw.get(k, v) != v for k, v in defaults.items()) or kw.get("compute_dtype") not in (None, "bfloat16")
            or kw.get("lora_targets", ALL_LINEARS) != ALL_LINEARS):
        return None
    args = [f"lmforge estimate memory {shape_ref} --mode {kw['mode']} --dtype {kw['dtype']}",
            f"--batch {kw['batch']} --seq-len {kw['seq_len']}"]
    args += ["--grad-ckpt"] if kw.get("grad_ckpt") else []
    args += [f"--lora-rank {kw['lora_rank']}"] if kw["mode"] != "full" else []
    args += [f"--quant-bits {kw['quant_bits']}"] if kw.get("quant_bits") else []
    return " ".join(args) + (" --device cpu" if kw.get("device_kind") == "cpu" else "")


def _need(est: Estimate) -> float:
    return est.total + est.overhead


def remedies(cfg: Any, shape: ModelShape, seq_len: int, device_kind: str, budget: float | None) -> list[str]:
    """What to change, in the order a practitioner tries it, each with its estimate; when `budget`
    is given, only the changes (cumulative) up to the first that fits."""
    t, tried, out = cfg.train, {}, []
    steps: list[tuple[str, dict]] = []
    if not t.gradient_checkpointing:
        steps.append(("train.gradient_checkpointing=true", {"gradient_checkpointing": True}))
    if t.method == "full":  # with a bf16 base: a float32 one under autocast also keeps bf16 casts for backward
        steps.append(("train.method=lora lora.base_dtype=bfloat16", {"method": "lora", "lora_base": "bfloat16"}))
    batch = t.batch_size
    while batch > 1:
        batch //= 2
        accum = t.grad_accum * (t.batch_size // batch)
        steps.append((f"train.batch_size={batch} train.grad_accum={accum} (same tokens per step)",
                      {"batch_size": batch}))
    for text, change in steps:
        tried.update(change)
        need = _need(train_estimate(cfg, shape, seq_len, device_kind, **tried))
        out.append(f"{text}: ~{fmt_bytes(need)}")
        if budget is not None and need <= budget:
            return out
    if budget is not None:
        out.append("a device with more memory, or train.parallel.fsdp under torchrun to shard the states")
    return out


def preflight_train(cfg: Any, shape: ModelShape, seq_len: int, device: Any, world_size: int = 1,
                    available: int | None = None) -> Estimate:
    """The run's estimate; raises `PreflightError` when it exceeds the free memory of `device`."""
    kind = getattr(device, "type", str(device).split(":")[0])
    est = train_estimate(cfg, shape, seq_len, kind)
    source = "given"
    if available is None:
        available, source = available_memory(device)
    if available is None:
        return est
    need = _need(est)
    est.add("available", available, "B", source)
    if need > available:
        fixes = remedies(cfg, shape, seq_len, kind, available)
        raise PreflightError(
            f"pre-flight: this run needs ~{fmt_bytes(need)} ({fmt_bytes(est.total)} model states + activations, "
            f"{fmt_bytes(est.overhead)} framework overhead) but {kind} has {fmt_bytes(available)} free ({source}). "
            f"Try, in order: {'; '.join(fixes)}. {_arithmetic_hint(cfg, shape, seq_len, kind)}; "
            f"train.preflight=false skips this check.")
    return est


def _arithmetic_hint(cfg: Any, shape: ModelShape, seq_len: int, kind: str) -> str:
    command = estimate_command(cfg.model.init or shape.name or "MODEL", memory_args(cfg, shape, seq_len, kind))
    return f"`{command}` shows the arithmetic" if command else "`lmforge estimate memory` shows the arithmetic"


# ---- out of memory ---------------------------------------------------------------------------


def is_oom(err: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA) or the CPU allocator's failure, which is a plain RuntimeError."""
    import torch  # deferred: guards is imported by `lmforge smoke` and the CLI, which must not load torch

    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def oom_message(err: BaseException, cfg: Any, shape: ModelShape, seq_len: int, device_kind: str,
                measured_peak: int | None, step: int) -> str:
    est = train_estimate(cfg, shape, seq_len, device_kind)
    fixes = remedies(cfg, shape, seq_len, device_kind, None)
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return (f"out of memory at step {step + 1}: {first}. Estimated ~{fmt_bytes(_need(est))} "
            f"({fmt_bytes(est.total)} + {fmt_bytes(est.overhead)} overhead; `lmforge estimate memory`), measured peak "
            f"{fmt_bytes(measured_peak) if measured_peak else 'unknown'}. Remedies, in order: {'; '.join(fixes)}.")


# ---- loss and gradient-norm spikes -----------------------------------------------------------


@dataclass
class Spike:
    step: int
    metric: str
    value: float
    zscore: float
    mean: float
    std: float
    rows: list[int] = field(default_factory=list)

    def message(self) -> str:
        rows = f"; packed rows of the batch: {self.rows}" if self.rows else ""
        return (f"{self.metric} spike at step {self.step}: {self.value:.4g} is {self.zscore:.1f} standard deviations "
                f"above the last window's mean {self.mean:.4g} (std {self.std:.3g}){rows}")


class SpikeDetector:
    """z = (x − mean) / std over the trailing `window` values of each metric, after `min_history`
    values; a non-finite value is always a spike. Spikes are kept out of the window, so one bad
    batch does not raise the bar for the next."""

    def __init__(self, zscore: float = 6.0, window: int = 50, min_history: int = 10):
        self.zscore, self.min_history = zscore, min_history
        self.history: dict[str, deque] = {}
        self.window = window

    def check(self, step: int, rows: list[int] | None = None, **values: float) -> list[Spike]:
        spikes = []
        for name, x in values.items():
            hist = self.history.setdefault(name, deque(maxlen=self.window))
            if not math.isfinite(x):
                spikes.append(Spike(step, name, x, math.inf, math.nan, math.nan, list(rows or [])))
                continue
            if len(hist) >= self.min_history:
                mean, std = statistics.fmean(hist), statistics.pstdev(hist)
                z = (x - mean) / std if std > 0 else (math.inf if x > mean * (1 + 1e-6) + 1e-12 else 0.0)
                if z > self.zscore:
                    spikes.append(Spike(step, name, x, z, mean, std, list(rows or [])))
                    continue
            hist.append(x)
        return spikes


def batch_rows(loader: Any, state: dict | None) -> list[int]:
    """Packed-split row indices of the batch a `PackedLoader` drew from `state` (its state_dict
    before `next`); [] for loaders that cannot say (SFT)."""
    order = getattr(loader, "_epoch_order", None)
    if state is None or order is None or "step" not in state:
        return []
    try:
        saved = loader.epoch
        loader.epoch = state["epoch"]
        rows = order()
        loader.epoch = saved
        lo = state["step"] * loader.global_batch
        return [int(i) for i in rows[lo:lo + loader.global_batch][loader.rank::loader.world_size]]
    except (AttributeError, TypeError, IndexError):
        return []


# ---- torch.compile graph breaks --------------------------------------------------------------


def graph_breaks() -> dict[str, Any]:
    """Graph breaks dynamo counted in this process so far: {"count", "reasons"} (most frequent first)."""
    try:
        from torch._dynamo.utils import counters  # deferred: dynamo is heavy and only compiled runs need it
    except ImportError:
        return {"count": 0, "reasons": []}
    breaks = counters.get("graph_break", {})
    reasons = sorted(breaks.items(), key=lambda kv: -kv[1])
    return {"count": int(sum(breaks.values())), "reasons": [f"{n}× {r}" for r, n in reasons[:10]]}


# ---- deterministic mode ----------------------------------------------------------------------


def set_deterministic(enabled: bool) -> dict[str, Any]:
    """Deterministic kernels (or not), returned as the record the run keeps.

    CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS initialises (PyTorch's reproducibility
    notes), so this runs first in the trainer; ":4096:8" is the value those notes give.
    """
    import torch  # deferred: as in is_oom

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {"deterministic": bool(enabled),
            "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


class TrainingOOM(ConfigError):
    """Out of memory during a step; the message has the estimate, the measured peak and the remedies
    (a ConfigError: what fixes it is a config change, and `lmforge train` prints it as one)."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


def mem_bytes(device: Any) -> int:
    """This step's memory figure for metrics.jsonl: CUDA's peak allocation on a GPU, the RSS peak on CPU."""
    mem = peak_memory()
    return mem.get("cuda_max_allocated_bytes", mem["cpu_max_rss_bytes"]) if device.type == "cuda" \
        else mem["cpu_max_rss_bytes"]
