"""The training pre-flight against the measured peak: full, LoRA on a float32 / bfloat16 base and QLoRA on an
int8 / int4 base, each trained 2 steps the way `lmforge train` trains (the model, `apply_lora` with the run's
`lora.base_dtype` / `lora.base_quant`, AdamW from `build_optimizer`, autocast in train.dtype, the fused loss),
in a fresh child process, its allocator peak measured as `lmforge.bench.estimate` measures it (glibc's bytes
in use, sampled every 0.5 ms, minus the bytes in use before the model is built). The estimate is the
pre-flight's own: `train.guards.train_estimate` for the same config, i.e. `lmforge estimate memory` with the
run's dtypes. Writes OUT/preflight_peaks.json and OUT/preflight_peaks.md (ratio = estimate / measured).

    python scripts/preflight_peaks.py --out runs/preflight-peaks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

RUNS = [{"method": "full", "base": None}, {"method": "lora", "base": "float32"},
        {"method": "lora", "base": "bfloat16"}, {"method": "lora", "base": "int8"}, {"method": "lora", "base": "int4"},
        {"method": "full", "base": None, "stage": "dpo"}, {"method": "lora", "base": "bfloat16", "stage": "dpo"}]
SHAPE = {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 704, "vocab": 4096, "batch": 8, "seq_len": 128}
DTYPE = "bfloat16"  # train.dtype (autocast)


def train_config(run: dict):
    from lmforge.train.config import TrainConfig  # deferred: the parent only formats the report

    cfg = TrainConfig()
    cfg.data.path = "unused"
    cfg.train.method, cfg.train.batch_size, cfg.train.dtype = run["method"], SHAPE["batch"], DTYPE
    if run.get("stage") == "dpo":  # batch_size counts pairs: the same rows as the SFT runs
        cfg.train.stage, cfg.train.batch_size, cfg.model.init = "dpo", SHAPE["batch"] // 2, "unused"
    cfg.lora.rank = 16
    cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if run["base"] in ("int8", "int4"):
        cfg.lora.base_quant = run["base"]
    elif run["base"]:
        cfg.lora.base_dtype = run["base"]
    return cfg.validate()


def child(runs: list[dict]) -> list[dict]:
    import torch

    from lmforge.bench.estimate import PeakSampler, _in_use
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer
    from lmforge.train.dpo import PreferenceLogps, dpo_loss
    from lmforge.train.fused_ce import TrainLoss
    from lmforge.train.lora import adapters_disabled, apply_lora
    from lmforge.train.optim import build_optimizer

    def train(run: dict, mc: ModelConfig, x: torch.Tensor, y: torch.Tensor) -> None:
        cfg = train_config(run)
        model = Transformer(mc).init_weights(0).train()
        if run["method"] == "lora":
            model = apply_lora(model, cfg.lora)
        opt = build_optimizer(model, cfg.train, torch.device("cpu"))
        fwd = TrainLoss(model)
        dpo = cfg.train.stage == "dpo"
        if dpo:  # DPOTrainer's step: the reference (a frozen copy, or adapters off), the policy's log-probs
            ref = None if run["method"] == "lora" else Transformer(mc).init_weights(0).eval().requires_grad_(False)
            fwd = PreferenceLogps(model)
            mask = torch.zeros_like(x)
            mask[:, x.shape[1] // 2:] = 1  # the second half of each row is its completion
        for _ in range(2):  # the first step allocates the optimizer state, the second peaks with it
            with torch.autocast("cpu", dtype=getattr(torch, DTYPE)):
                if dpo:
                    with torch.no_grad(), (contextlib.nullcontext() if ref else adapters_disabled(model)):
                        ref_logps, _ = PreferenceLogps(ref or model)(x, mask)
                    logps, lengths = fwd(x, mask)
                    loss = dpo_loss(logps, ref_logps, lengths, 0.1)[0].mean()
                else:
                    loss = fwd(x, y, None, None)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    in_use, out = _in_use(), []
    for run in runs:
        toy = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=16)
        train(run, toy, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))  # warm-up
        mc = ModelConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["intermediate"],
                         num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                         max_position_embeddings=SHAPE["seq_len"], tie_word_embeddings=True)
        ids = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq_len"] + 1))
        base = in_use()
        with PeakSampler(in_use) as sampler:
            train(run, mc, ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        out.append({"measured_bytes": sampler.peak - base, "model_config": mc.to_hf()})
    return out


def measure(runs: list[dict]) -> list[dict]:
    from lmforge.perf.estimate import ModelShape
    from lmforge.train.guards import estimate_command, memory_args, train_estimate

    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(runs)], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise RuntimeError(f"measurement child failed: {proc.stderr[-3000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = []
    for run, got in zip(runs, measured):
        shape = ModelShape.from_config(got["model_config"])
        cfg = train_config(run)
        est = train_estimate(cfg, shape, SHAPE["seq_len"], "cpu")
        rows.append({**run, **SHAPE, "dtype": DTYPE, "measured_bytes": got["measured_bytes"],
                     "estimated_bytes": est.total, "ratio": est.total / got["measured_bytes"],
                     "estimate_command": estimate_command("MODEL", memory_args(cfg, shape, SHAPE["seq_len"], "cpu")),
                     "estimate": est.to_dict()})
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["# pre-flight vs measured training peak (CPU allocator, 2 steps)", "",
             f"model: {SHAPE['layers']} layers, hidden {SHAPE['hidden']}, vocab {SHAPE['vocab']} (tied); batch "
             f"{SHAPE['batch']} x {SHAPE['seq_len']} tokens; train.dtype {DTYPE}; LoRA rank 16 on all 7 matmuls; DPO: 4 pairs = the same 8 rows", "",
             "| stage | method | base | measured MB | pre-flight MB | estimate/measured | within 15% |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r.get('stage', 'sft')} | {r['method']} | {r['base'] or 'float32 (trained)'} | "
                     f"{r['measured_bytes'] / 1e6:.1f} | "
                     f"{r['estimated_bytes'] / 1e6:.1f} | {r['ratio']:.3f} | {'yes' if abs(r['ratio'] - 1) <= 0.15 else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--out", default="runs/preflight-peaks")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    import os
    import platform

    rows = measure(RUNS)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from lmforge.track.io import atomic_write_json, atomic_write_text

    atomic_write_json(out / "preflight_peaks.json", {"command": "python scripts/preflight_peaks.py --out " + a.out,
                                                      "machine": platform.processor() or platform.machine(),
                                                      "loadavg": os.getloadavg(), "runs": rows})
    atomic_write_text(out / "preflight_peaks.md", to_markdown(rows))
    print(to_markdown(rows))


if __name__ == "__main__":
    main()
