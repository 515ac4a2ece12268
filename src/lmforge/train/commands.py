"""`lmforge train`, `lmforge export` and `lmforge distill`: the command-line face of `lmforge.train`.

Parses arguments and calls `run` / `export.export_run` / `distill.distill`. `run` is where the stage is
chosen, once: GRPO (`grpo/trainer.py`), DPO (`dpo.py`, the loop with a preference loss) or the one pretrain/SFT loop (`loop.py`, which applies the
parallelism plan). Heavy imports (torch) happen only when a verb runs, so `lmforge --help` stays fast.

    lmforge train configs/tiny.yaml data.path=runs/packed train.max_steps=50 --out runs/tiny
    lmforge train configs/tiny.yaml --out runs/tiny --resume
    lmforge export runs/tiny --out models/tiny
    lmforge train configs/grpo.yaml model.init=runs/reasoning/sft-model data.path=tasks.jsonl --out runs/grpo
    lmforge train configs/dpo.yaml model.init=models/sft data.path=runs/flywheel/preferences.jsonl --out runs/dpo
    lmforge distill TEACHER --tasks tasks.jsonl --n 4 --out runs/distill
    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml --out runs/ddp
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from lmforge.config import ConfigError, load_config
from lmforge.track.short import short_mode

from .config import TrainConfig
from .guards import TrainingDiverged

app = typer.Typer(help="Train models (pretrain / SFT, full / LoRA) and export them.", no_args_is_help=True)

def run(cfg: Any, out: str | Path, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train `cfg` into `out` with the stage it names; the final record (rank 0) or {} (other ranks)."""
    if cfg.train.stage == "grpo":  # its own stage (rollouts, rewards, policy loss)
        # deferred: torch and the engine load only when a verb runs (`lmforge --help` stays fast)
        from .grpo.trainer import train_grpo

        return train_grpo(cfg, out, resume=resume, overwrite=overwrite)
    if cfg.train.stage == "dpo":  # the loop with a preference loss (dpo.py)
        from .dpo import train_dpo  # deferred: as above

        return train_dpo(cfg, out, resume=resume, overwrite=overwrite)
    # deferred: as above
    from .loop import train as train_loop

    return train_loop(cfg, out, resume=resume, overwrite=overwrite)


def main(config: str | None, overrides: list[str], out: str | None, resume: bool = False,
         overwrite: bool = False) -> dict[str, Any]:
    """`lmforge train CONFIG [KEY=VALUE ...]`: load and override the config, then `run` it."""
    cfg = load_config(TrainConfig, config, [*overrides, *_short_overrides()])
    out = out or cfg.run.out or str(Path("runs") / Path(config).stem)
    return run(cfg, out, resume=resume, overwrite=overwrite)


def _short_overrides() -> list[str]:
    """LMFORGE_SHORT=1 (CI runs the documented commands): two steps, one evaluation batch, a checkpoint at
    the end only; the config's model and data as given."""
    if not short_mode():
        return []
    return ["train.max_steps=2", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1",
            "train.ckpt_every=0"]


_TRAIN_HELP = (
    "Train from CONFIG (YAML with sections run, data, model, train, lora, sft), with dotted KEY=VALUE "
    "overrides such as train.max_steps=100 data.path=runs/packed. Writes config.yaml, metrics.jsonl, "
    "record.json, loss.png and checkpoints/ into --out. Under torchrun it trains with DDP.")


@app.command("train", help=_TRAIN_HELP)
def train(
    config: Path = typer.Argument(..., help="YAML config, e.g. configs/tiny.yaml."),
    overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Dotted overrides."),
    out: str = typer.Option(None, "--out", "-o", help="Run directory (default: run.out or runs/<config name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest valid checkpoint in --out."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out, checkpoints included."),
) -> None:
    # deferred: torch loads only when a verb runs
    from .checkpoint import CheckpointError

    try:
        record = main(str(config), list(overrides or []), out, resume=resume, overwrite=overwrite)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError, TrainingDiverged) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    if record and record.get("stage") == "grpo":
        res = record.get("results", {})
        typer.echo(f"done: {res.get('steps')} GRPO steps, rollout accuracy {res.get('accuracy_first')} -> "
                   f"{res.get('accuracy_last')}, reward {res.get('reward_first')} -> {res.get('reward_last')} "
                   f"-> {record.get('experiment_id')}")
    elif record and record.get("stage") == "dpo":
        res = record.get("results", {})
        typer.echo(f"done: {res.get('steps')} DPO steps, loss {res.get('final_train_loss')}, val loss "
                   f"{res.get('final_val_loss')} -> {record.get('experiment_id')}")
    elif record:
        res = record.get("results", {})
        typer.echo(f"done: {res.get('steps')} steps, train loss {res.get('final_train_loss')}, "
                   f"val loss {res.get('final_val_loss')}, {res.get('tokens_per_s')} tok/s, "
                   f"mfu {res.get('mfu')} -> {record.get('experiment_id')}")


@app.command("export", help="Export a run's checkpoint as a Hugging Face model folder (LoRA merged) with its "
                             "tokenizer; --adapter also (or only) writes a LoRA run's adapter as a peft folder.")
def export(
    run: Path = typer.Argument(..., help="Run directory written by `lmforge train`."),
    out: Path = typer.Option(None, "--out", "-o", help="Folder to write the model into (LoRA merged)."),
    adapter: Path = typer.Option(None, "--adapter", help="Folder to write a LoRA (or LoRA DPO) run's adapter "
                                                         "into, as peft's adapter_config.json + safetensors."),
    checkpoint: str = typer.Option("last", "--checkpoint", help="last, best, or a folder name like step-00000100."),
    dtype: str = typer.Option("float32", "--dtype", help="Weights dtype: float32, bfloat16 or float16."),
    fmt: str = typer.Option("hf", "--format", help="hf (the folder) | gguf (the folder plus OUT/model-TYPE.gguf)."),
    gguf_type: str = typer.Option("bf16", "--type", help="GGUF matrices: bf16 | q8_0 | q4_0 | f32."),
) -> None:
    # deferred: torch loads only when a verb runs
    from .checkpoint import CheckpointError
    from .export import export_run
    from .lora_adapter import export_adapter

    if out is None and adapter is None:
        typer.echo("error: pass --out DIR (the merged model), --adapter DIR (a LoRA run's peft adapter), or both",
                   err=True)
        raise typer.Exit(code=2)
    try:
        if adapter is not None:
            path = export_adapter(run, adapter, checkpoint=checkpoint)
            base = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
            typer.echo(f"exported {run} -> {path} (peft adapter over {base or 'a base the run did not record'})")
        if out is not None:
            path = export_run(run, out, checkpoint=checkpoint, dtype=dtype, fmt=fmt, gguf_type=gguf_type)
            typer.echo(f"exported {run} -> {path}")
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


# `python -m lmforge.train CONFIG ...` (and torchrun): the train verb alone, no sub-command name.
train_app = typer.Typer(add_completion=False)
train_app.command(help=_TRAIN_HELP)(train)


def distill(
    teacher: Path = typer.Argument(..., help="Teacher model folder (HF layout with a chat template)."),
    tasks: Path = typer.Option(..., "--tasks", help="Task JSONL: prompt/answer rows or GSM8K question/'#### N'."),
    n: int = typer.Option(4, "--n", help="Traces sampled per task."),
    out: Path = typer.Option(..., "--out", "-o", help="Run folder: sft.jsonl, record.json, metrics.jsonl."),
    temperature: float = typer.Option(0.8, "--temperature", help="Sampling temperature."),
    max_tokens: int = typer.Option(320, "--max-tokens", help="New tokens per trace."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per task: seed * 1000003 + task index)."),
    limit: int = typer.Option(None, "--limit", help="Only the first N tasks."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out."),
    executor: str = typer.Option("local", "--executor", help="local (one engine here) or ray (`lmforge generate`'s "
                                                              "Ray path: --replicas engines)."),
    replicas: int = typer.Option(1, "--replicas", help="With --executor ray: teacher engines on Ray actors."),
    ray_address: str = typer.Option(None, "--ray-address", help="Ray cluster (default: a local one)."),
    pairs: str = typer.Option("samples", "--pairs", help="DPO pairs in OUT/preferences.jsonl: samples (a task's right "
                                                         "traces against its wrong ones) or reference (each wrong "
                                                         "trace against the task's own reasoning and answer)."),
) -> None:
    """Rejection-sample reasoning traces from TEACHER: K per task through the engine, keep the well-formed
    ones with the right answer as SFT chat rows (then `lmforge train ... train.stage=sft data.path=OUT/sft.jsonl`),
    and DPO pairs of its wrong traces against its right ones or (--pairs reference) the task's own answer
    (OUT/preferences.jsonl)."""
    from .distill import distill as run_distill  # deferred: torch and the engine load only when a verb runs

    try:
        res = run_distill(teacher, tasks, n, out, temperature=temperature, max_tokens=max_tokens, seed=seed,
                          limit=limit, dtype=dtype, overwrite=overwrite, executor=executor, replicas=replicas,
                          ray_address=ray_address, pairs=pairs)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"teacher accuracy {res['teacher_accuracy']:.3f} (pass@{n} {res[f'teacher_pass@{n}']:.3f}); kept "
               f"{res['kept']}/{res['samples']} traces ({res['kept_fraction']:.3f}) -> {out / 'sft.jsonl'}; "
               f"{res['pairs']} right/wrong pairs -> {out / 'preferences.jsonl'}")
