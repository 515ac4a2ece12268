"""`lmforge estimate memory|kv|intensity|roofline|throughput|mfu|comm|quant`: the calculators of
`perf/estimate.py` from the terminal, each figure printed with its arithmetic.

MODEL is a preset (`llama-7b`, `llama3-8b`, `qwen2.5-7b`, `qwen2.5-1.5b`, ...), a Hugging Face
folder or a `config.json`; `--device` is `cpu` (this machine's `lmforge doctor` profile) or a GPU
from the datasheet table (`A100`, `H100 SXM`, `RTX 4090`, ...). `--json` prints the terms as
JSON; `--out DIR` also writes `estimate.json` and `estimate.md` there. Only option parsing here.

    lmforge estimate memory llama-7b --mode lora --batch 4 --grad-ckpt
    lmforge estimate roofline llama3-8b --device A100 --batch 8
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.perf.estimate import (
    comm,
    device_spec,
    fmt_bytes,
    intensity,
    kv_cache,
    memory,
    mfu_estimate,
    quant_sizes,
    roofline,
    throughput,
)
from lmforge.perf.report import report
from lmforge.track.io import atomic_write_json, atomic_write_text

app = typer.Typer(no_args_is_help=True, help="Estimate before measuring: memory, KV cache, intensity, "
                                             "roofline, throughput ceiling, MFU, communication, quantized sizes.")

Model = Annotated[str, typer.Argument(help="Preset name, HF model folder or config.json.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu (doctor profile) or a GPU name, e.g. A100.")]
Dtype = Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16.")]
Batch = Annotated[int, typer.Option("--batch", help="Sequences per step (per device).")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the terms as JSON.")]
Out = Annotated[Optional[Path], typer.Option("--out", help="Also write estimate.json and estimate.md here.")]


def _emit(make, as_json: bool, out: Path | None) -> None:
    """Run the calculator; a ValueError is the user's input: print it, exit 2."""
    try:
        est = make()
    except (ValueError, TypeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(est.to_dict(), indent=2) if as_json else est.to_text())
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "estimate.json", est.to_dict())
        atomic_write_text(out / "estimate.md", "```\n" + est.to_text() + "\n```\n")


@app.command("memory", help="Bytes per device: weights, gradients, optimizer, activations (with and without "
                            "checkpointing), KV cache; framework overhead apart.")
def memory_cmd(model: Model, mode: Annotated[str, typer.Option(help="full | lora | qlora | inference.")] = "full",
               dtype: Dtype = "bfloat16",
               optimizer: Annotated[str, typer.Option(help="adamw | adamw8bit | lion | sgd-momentum | sgd.")] = "adamw",
               batch: Batch = 1, seq_len: SeqLen = 2048,
               grad_ckpt: Annotated[bool, typer.Option("--grad-ckpt", help="Gradient checkpointing.")] = False,
               dp_shard: Annotated[int, typer.Option(help="FSDP/ZeRO-3 degree.")] = 1,
               tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
               pp: Annotated[int, typer.Option(help="Pipeline degree.")] = 1,
               lora_rank: Annotated[int, typer.Option(help="LoRA rank (lora, qlora).")] = 16,
               quant_bits: Annotated[Optional[int], typer.Option(help="4 or 8: quantized weights.")] = None,
               compute_dtype: Annotated[Optional[str], typer.Option(
                   "--compute-dtype", help="float32 | bfloat16 | float16: what matmuls and activations compute "
                                           "in (default: the weights' dtype, at most 16 bit; lmforge's "
                                           "train.dtype).")] = None,
               lora_targets: Annotated[Optional[str], typer.Option(
                   "--lora-targets", help="Comma-separated adapted modules (lora, qlora), e.g. q_proj,v_proj "
                                          "(default: all seven matmuls).")] = None,
               fused_loss: Annotated[bool, typer.Option(
                   "--fused-loss/--no-fused-loss", help="Logits a chunk at a time (lmforge's default); "
                                                        "--no-fused-loss: the whole (batch, seq, vocab) logits.")] = True,
               reference_model: Annotated[bool, typer.Option(
                   "--reference-model", help="DPO's frozen reference: a second copy of the weights.")] = False,
               device: DeviceOpt = None, as_json: AsJson = False, out: Out = None) -> None:
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets else None
    if lora_targets is not None and not targets:
        raise typer.BadParameter("give module names, e.g. --lora-targets q_proj,v_proj", param_hint="--lora-targets")

    def make():
        kind = "cpu" if device in ("cpu", "this") else "cuda"
        est = memory(model, mode=mode, dtype=dtype, optimizer=optimizer, batch=batch, seq_len=seq_len,
                     grad_ckpt=grad_ckpt, dp_shard=dp_shard, tp=tp, pp=pp, lora_rank=lora_rank,
                     quant_bits=quant_bits, device_kind=kind, compute_dtype=compute_dtype,
                     lora_targets=targets, fused_loss=fused_loss, reference_model=reference_model)
        if device:
            dev = device_spec(device)
            if dev.memory:
                need = est.total + est.overhead
                est.add("device memory", dev.memory, "B", f"{dev.name} [{dev.source}]")
                est.assumptions.append(f"{'fits' if need <= dev.memory else 'does NOT fit'}: needs "
                                       f"{fmt_bytes(need)} with overhead, the device has {fmt_bytes(dev.memory)}")
        return est
    _emit(make, as_json, out)


@app.command("kv", help="KV-cache bytes per token and per sequence; the most concurrent sequences for a budget.")
def kv_cmd(model: Model, seq_len: SeqLen = 4096, batch: Batch = 1, dtype: Dtype = "bfloat16",
           budget_gb: Annotated[Optional[float], typer.Option(help="Memory for the cache, GB.")] = None,
           block_size: Annotated[Optional[int], typer.Option(help="Paged blocks of this many tokens.")] = None,
           as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: kv_cache(model, seq_len, batch, dtype, budget_gb * 1e9 if budget_gb else None, block_size),
          as_json, out)


@app.command("intensity", help="FLOPs per byte of each matmul at prefill and decode, and of decode attention.")
def intensity_cmd(model: Model, batch: Batch = 1, seq_len: SeqLen = 2048, dtype: Dtype = "bfloat16",
                  as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: intensity(model, batch, seq_len, dtype), as_json, out)


@app.command("roofline", help="Ridge point, attainable FLOP/s, prefill and decode bounds in tokens/s.")
def roofline_cmd(model: Model, device: DeviceOpt = "cpu", batch: Batch = 1, seq_len: SeqLen = 2048,
                 dtype: Dtype = "bfloat16", as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: roofline(model, device, batch, seq_len, dtype), as_json, out)


@app.command("throughput", help="Decode ceiling: bandwidth ÷ bytes read per step (weights + KV) × batch.")
def throughput_cmd(model: Model, device: DeviceOpt = "cpu", batch: Batch = 1,
                   context: Annotated[int, typer.Option(help="Tokens already in each sequence's cache.")] = 1024,
                   dtype: Dtype = "bfloat16", as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: throughput(model, device, batch, context, dtype), as_json, out)


@app.command("mfu", help="MFU from a measured tokens/s: (6N + 12·L·H·Q·T) × tokens/s ÷ peak.")
def mfu_cmd(model: Model, tokens_per_s: Annotated[float, typer.Option("--tokens-per-s", help="Measured throughput.")],
            device: DeviceOpt = "cpu", seq_len: SeqLen = 2048, dtype: Dtype = "bfloat16",
            inference: Annotated[bool, typer.Option("--inference", help="2N + 4·L·H·Q·T per token.")] = False,
            devices: Annotated[int, typer.Option("--devices", help="How many devices share the tokens/s.")] = 1,
            as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: mfu_estimate(model, tokens_per_s, device, seq_len, dtype, not inference, devices), as_json, out)


@app.command("comm", help="Per-step DP all-reduce, TP per-layer all-reduces, PP sends: bytes and seconds.")
def comm_cmd(model: Model, dp: Annotated[int, typer.Option(help="Data-parallel degree.")] = 1,
             tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
             pp: Annotated[int, typer.Option(help="Pipeline degree.")] = 1,
             batch: Batch = 1, seq_len: SeqLen = 2048,
             microbatches: Annotated[int, typer.Option(help="Micro-batches per step.")] = 1,
             bandwidth_gbs: Annotated[Optional[float], typer.Option(
                 "--bandwidth", help="GB/s per device (default: the device's interconnect).")] = None,
             inter_gbs: Annotated[Optional[float], typer.Option(
                 "--inter-bandwidth", help="GB/s between nodes, for DP and PP.")] = None,
             fsdp: Annotated[bool, typer.Option("--fsdp", help="FSDP/ZeRO-3 traffic instead of DDP.")] = False,
             device: DeviceOpt = "A100", as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: comm(model, dp, tp, pp, batch, seq_len, microbatches,
                       bandwidth_gbs * 1e9 if bandwidth_gbs else None, device, fsdp=fsdp,
                       inter_bandwidth=inter_gbs * 1e9 if inter_gbs else None), as_json, out)


@app.command("quant", help="Weight bytes in bf16, int8 (per-channel scales) and int4 (group scales).")
def quant_cmd(model: Model, group_size: Annotated[int, typer.Option(help="int4 weights per scale.")] = 128,
              zero_point: Annotated[bool, typer.Option("--zero-point", help="Asymmetric: a zero per group.")] = False,
              as_json: AsJson = False, out: Out = None) -> None:
    _emit(lambda: quant_sizes(model, group_size, zero_point=zero_point), as_json, out)


def report_cmd(
    items: Annotated[list[str], typer.Argument(help="Run directories and/or `bench mfu` folders, baseline first.")],
    out: Annotated[Path, typer.Option("--out", help="Markdown file to write.")] = Path("report.md"),
    goal: Annotated[str, typer.Option(help="The optimisation goal, the report's title.")] = "",
) -> None:
    """The optimisation report (the tutorial's template): baseline, steps with Δ and physical reason,
    bottlenecks, "I expected ___, actually ___" from every estimate-vs-measurement gap > 15%, headroom."""
    try:
        typer.echo(f"report -> {report(items, out, goal)}")
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
