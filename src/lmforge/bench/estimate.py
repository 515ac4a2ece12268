"""The memory estimate against a measurement: train a few steps the way `lmforge train` does
(fp32 master weights, AdamW, autocast, the fused LM-head loss, optional gradient checkpointing
or LoRA) in a fresh child process and compare its peak with `estimate.memory`.

On CPU the measured peak is the allocator's: glibc's bytes in use (`mallinfo2`: arena blocks in
use + mmapped blocks), sampled every half millisecond by a thread while torch computes (its ops
release the GIL), minus the bytes in use just before the model is built. That is what CUDA's
`max_memory_allocated()` measures on a GPU: the tensors, not the libraries (the framework
overhead the estimate states apart) nor the allocator's fragmentation. The resident set's
high-water mark (VmHWM) is reported too; it also counts lazy imports and freed-but-kept pages.
A warm-up run on a one-layer toy comes first, so imports and thread pools are in the baseline.
The child runs alone so that no other test's allocations sit in its figures.

The ratio depends on the machine's allocator (0.745 on one Xeon, within 15% on the development box),
so it is measured here, not asserted by the test suite; `--out DIR` writes `estimate_check.json`
and `estimate_check.md` with the measured and estimated bytes and the ratio.

    python -m lmforge.bench.estimate --hidden 256 --layers 4 --batch 8 --seq-len 128 [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.perf.estimate import ModelShape, memory
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.train.config import LoraConfig, TrainSection
from lmforge.train.fused_ce import TrainLoss
from lmforge.train.optim import build_optimizer


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _in_use() -> Callable[[], int]:
    """Bytes malloc has handed out and not taken back (glibc >= 2.33)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd
    return in_use


class PeakSampler:
    """max(in_use()) while running, sampled by a daemon thread every `period_s`."""

    def __init__(self, in_use: Callable[[], int], period_s: float = 0.0005):
        self.in_use, self.period_s = in_use, period_s
        self.peak = in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.in_use())
            time.sleep(self.period_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.in_use())


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


DEFAULTS = {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 704, "vocab": 4096, "batch": 8, "seq_len": 128,
            "dtype": "float32", "grad_ckpt": False, "lora": False, "lora_rank": 16, "steps": 2}


def _child(runs: list[dict]) -> list[dict[str, Any]]:
    def train(r: dict, cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor) -> None:
        model = Transformer(cfg).init_weights(0).train()
        if r["lora"]:
            from lmforge.train.lora import apply_lora  # deferred: peft, imported only when LoRA is measured

            model = apply_lora(model, LoraConfig(rank=r["lora_rank"], target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        model.model.gradient_checkpointing = r["grad_ckpt"]
        opt = build_optimizer(model, TrainSection(), torch.device("cpu"))
        fwd = TrainLoss(model)
        dtype = getattr(torch, r["dtype"])
        for _ in range(r["steps"]):  # the first step allocates the optimizer state, the second peaks with it
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = fwd(x, y, None, None)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    in_use = _in_use()
    results = []
    for r in runs:
        # Warm-up on a one-layer toy: imports, thread pools and kernel caches are framework overhead.
        toy = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=16)
        train({**r, "steps": 2}, toy, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
        cfg = ModelConfig(vocab_size=r["vocab"], hidden_size=r["hidden"], intermediate_size=r["intermediate"],
                          num_hidden_layers=r["layers"], num_attention_heads=r["heads"],
                          max_position_embeddings=r["seq_len"], tie_word_embeddings=True)
        ids = torch.randint(0, r["vocab"], (r["batch"], r["seq_len"] + 1))
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        base, rss_base = in_use(), _rss("VmRSS")
        with PeakSampler(in_use) as sampler:
            train(r, cfg, x, y)
        results.append({"measured_bytes": sampler.peak - base, "rss_hwm_delta_bytes": _rss("VmHWM") - rss_base,
                        "model_config": cfg.to_hf()})
    return results


def measure_train_peaks(runs: list[dict], isolated: bool = True) -> list[dict[str, Any]]:
    """Measured peaks vs `estimate.memory` for the same runs (each a dict of `DEFAULTS` keys);
    `ratio` = estimate / measured. `isolated`: in one child process, runs in turn; otherwise in
    this process with the garbage collector paused (a collection mid-run would free unrelated
    memory and lower the delta), which saves the child's ~3 s torch import."""
    runs = [{**DEFAULTS, **r} for r in runs]
    if isolated:
        proc = subprocess.run([sys.executable, "-m", "lmforge.bench.estimate", "--child", json.dumps(runs)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement child failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        gc.collect()
        gc.disable()
        try:
            measured = _child(runs)
        finally:
            gc.enable()
    out = []
    for r, got in zip(runs, measured):
        est = memory(ModelShape.from_config(got["model_config"]), mode="lora" if r["lora"] else "full",
                     dtype="float32", batch=r["batch"], seq_len=r["seq_len"], grad_ckpt=r["grad_ckpt"],
                     lora_rank=r["lora_rank"], compute_dtype=r["dtype"], device_kind="cpu")
        out.append({**r, **got, "estimated_bytes": est.total, "ratio": est.total / got["measured_bytes"],
                    "estimate": est.to_dict()})
    return out


TARGET = 0.15  # |estimate / measured - 1| the estimate aims for


def to_markdown(runs: list[dict[str, Any]]) -> str:
    """One row per run: its shape, measured and estimated peak, and the ratio against the target."""
    lines = ["# estimate check: training peak memory, `estimate memory` vs the allocator's peak", "",
             "| layers | hidden | batch | seq | dtype | grad ckpt | LoRA | measured MB | RSS HWM delta MB | "
             "estimated MB | estimate/measured | within 15% |",
             "| ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        within = "yes" if abs(r["ratio"] - 1) <= TARGET else "NO"
        lines.append(f"| {r['layers']} | {r['hidden']} | {r['batch']} | {r['seq_len']} | {r['dtype']} | "
                     f"{r['grad_ckpt']} | {r['lora']} | {r['measured_bytes'] / 1e6:.1f} | "
                     f"{r['rss_hwm_delta_bytes'] / 1e6:.1f} | {r['estimated_bytes'] / 1e6:.1f} | "
                     f"{r['ratio']:.3f} | {within} |")
    return "\n".join(lines) + "\n"


def write_report(runs: list[dict[str, Any]], out: Path) -> None:
    """`estimate_check.json` (every run, with its estimate's terms) and `estimate_check.md` in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "estimate_check.json", {"target": TARGET, "runs": runs})
    atomic_write_text(out / "estimate_check.md", to_markdown(runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--out", type=Path, default=None, help="Also write estimate_check.json and .md here.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    (r,) = measure_train_peaks([{k: getattr(a, k) for k in DEFAULTS}])
    print(f"measured {r['measured_bytes'] / 1e6:.1f} MB (allocator peak; RSS high-water delta "
          f"{r['rss_hwm_delta_bytes'] / 1e6:.1f} MB), estimated {r['estimated_bytes'] / 1e6:.1f} MB, "
          f"estimate/measured {r['ratio']:.3f}")
    if a.out is not None:
        write_report([r], a.out)


if __name__ == "__main__":
    main()
