"""`lmforge eval ...`: the command-line face of `lmforge.eval`.

    lmforge eval MODEL_DIR [--suite arith --suite my.jsonl] [--out DIR] [--limit N]   # = eval run
    lmforge eval MODEL_DIR --suite gsm8k_test.jsonl       # a task file (GSM8K or prompt/answer JSONL), hashed
    lmforge eval compare RUN_A RUN_B [--allow-changed-suite]
    lmforge eval diff MODEL_A MODEL_B [--suite quant-check] --out DIR   # per sample: same/changed, ppl per category
    lmforge eval suites                                   # list the built-in suites, verify their lock
    lmforge eval make-suite perplexity PREPARED_DIR --out FILE
    lmforge eval make-suite builtins                      # regenerate the frozen built-ins (after a version bump)
    lmforge eval make-suite tasks TASKS.jsonl --out SUITE.jsonl   # freeze a task file with a header

`run` is the default verb: when the first argument is not a verb name, `run` is assumed, so
`lmforge eval MODEL_DIR ...` and `lmforge eval run MODEL_DIR ...` are the same command.
Parses arguments, calls one function, prints a table; heavy libraries load only when a verb runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from typer.core import TyperGroup

from lmforge.eval.backends import TransformerBackend
from lmforge.eval.builtin import write_builtin_suites
from lmforge.eval.compare import SuiteChangedError, compare_runs, diff_markdown, diff_models
from lmforge.eval.evaluate import evaluate, refuse_finished_run
from lmforge.eval.suites import make_perplexity_suite
from lmforge.eval.user_tasks import load_any_suite, make_task_suite
from lmforge.tasks.suite import SuiteError, builtin_names, load_suite, verify_builtin_suites
from lmforge.track.run import RunExistsError
from lmforge.track.short import short_mode, shrink


class _DefaultRun(TyperGroup):
    """A group whose default verb is `run` (click has no built-in default command)."""

    def parse_args(self, ctx, args):  # type: ignore[no-untyped-def]
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=_DefaultRun, no_args_is_help=True,
                  help="Evaluate a model on frozen suites (perplexity, generation, choice, stability) and compare runs.")


@app.callback()
def _group() -> None:
    """Evaluate a model on frozen suites and compare runs. `lmforge eval MODEL_DIR` runs `run`."""


def _fail(e: Exception) -> None:
    from rich.console import Console  # deferred: rich (~0.15 s) loads only when a verb prints

    Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _short(suite):
    """LMFORGE_SHORT (CI runs the documented commands): generations cut at 32 tokens (with 4 items a suite)."""
    if not short_mode() or "max_tokens" not in suite.settings:
        return suite
    return dataclasses.replace(suite, settings={**suite.settings, "max_tokens": min(suite.settings["max_tokens"], 32)})


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "—"
    return f"{v:,}" if isinstance(v, int) else f"{v:.{digits}f}"


@app.command(help="Score MODEL_DIR on each --suite (a built-in name, a suite .jsonl file, or a task file: GSM8K "
                  "question/answer '#### N' or prompt/answer JSONL, scored on the reasoning format's Answer: line; "
                  "default: all built-ins) and write results.json, samples.jsonl, bad_cases.jsonl, config.yaml and "
                  "record.json to --out.")
def run(
    model_dir: Path = typer.Argument(..., help="Model folder in HF layout (config.json, *.safetensors, tokenizer.json)."),
    suite: list[str] = typer.Option(None, "--suite", "-s", help="Suite name or file; repeat, or separate with commas."),
    out: Path = typer.Option(None, "--out", "-o", help="Run folder to write (default: runs/eval-MODEL_DIR_NAME)."),
    limit: int = typer.Option(None, "--limit", help="Score only the first N items of each suite (recorded)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1, ..."),
    batch_size: int = typer.Option(16, "--batch-size", help="Rows per forward pass for log-likelihoods."),
    engine: str = typer.Option("auto", "--engine", help="Generation: llm (lmforge.engine), simple (reference "
                                                        "loop), auto (llm when installed)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out."),
    executor: str = typer.Option("local", "--executor", help="Generation: local (one engine) or ray (`lmforge "
                                                              "generate`'s Ray path: --replicas engines)."),
    replicas: int = typer.Option(1, "--replicas", help="With --executor ray: engine replicas on Ray actors."),
    ray_address: str = typer.Option(None, "--ray-address", help="Ray cluster (default: a local one)."),
    quant_activations: str = typer.Option("none", "--quant-activations",
                                          help="A w8/w4 model's linears: none (exact, A16) | int8 (A8, the "
                                               "engine's integer kernels; CPU)."),
) -> None:
    from rich.console import Console  # deferred: rich (~0.15 s) loads only when a verb prints
    from rich.table import Table

    refs = [r.strip() for s in (suite or []) for r in s.split(",") if r.strip()] or builtin_names()
    limit = shrink(limit, 4)  # LMFORGE_SHORT (CI runs the documented commands): 4 items a suite
    out = out or Path("runs") / f"eval-{model_dir.resolve().name}"
    console = Console(stderr=True)
    try:
        suites = [_short(load_any_suite(r)) for r in refs]
        refuse_finished_run(out, overwrite)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json; MODEL_DIR must be a model folder in HF layout "
                                    f"(e.g. the output of `lmforge export`)")
        backend = TransformerBackend(model_dir, dtype=dtype, device=device, batch_size=batch_size, engine=engine,
                                     executor=executor, replicas=replicas, ray_address=ray_address,
                                     quant_activations=quant_activations)
        config = {"model_dir": str(model_dir), "suites": refs, "out": str(out), "limit": limit, "dtype": dtype,
                  "device": device, "batch_size": batch_size, "engine": backend.engine,
                  **({"quant_activations": quant_activations} if quant_activations != "none" else {}),
                  **({"executor": executor, "replicas": replicas} if executor != "local" else {})}
        results = evaluate(backend, suites, out, model_dir=model_dir, limit=limit, overwrite=overwrite,
                           config=config, progress=True, log=lambda name, t: console.print(
                               f"{name}: {t['metric']} {_fmt(t['value'])} ± {_fmt(t['stderr'])} (n={t['n']}, "
                               f"{t['seconds']:.1f}s)", highlight=False))
    except (SuiteError, FileNotFoundError, RunExistsError, ValueError) as e:
        _fail(e)
    table = Table(title=f"eval {model_dir} -> {out}")
    for col in ("task", "kind", "metric", "value", "± stderr", "n", "suite"):
        table.add_column(col, justify="right" if col in ("value", "± stderr", "n") else "left")
    for name, t in results["tasks"].items():
        for metric, v in t["metrics"].items():
            if metric in ("tokens", "bytes", "run_acc_min", "run_acc_max"):
                continue
            table.add_row(name, t["kind"], metric, _fmt(v["value"]), _fmt(v["stderr"]), str(t["n"]),
                          f"v{t['version']} {t['suite_sha256'][:8]}")
    Console(width=120).print(table)
    generated = any(t["kind"] in ("generate", "stability") for t in results["tasks"].values())
    if generated and results["engine"].get("generation", "").startswith("reference"):
        console.print("[yellow]note:[/yellow] generation used the reference loop (no KV cache; slow for large models)")


@app.command(help="Per sample, two models on the same items (default: the frozen quant-check suite): same / "
                  "changed greedy continuations, agreement over 32 tokens, newly wrong / right, perplexity per "
                  "category. Writes per_sample.jsonl, diff.json, diff.md and a record to --out.")
def diff(
    model_a: Path = typer.Argument(..., help="The baseline model folder (e.g. the bf16 model)."),
    model_b: Path = typer.Argument(..., help="The model to compare (e.g. its quantized folder)."),
    suite: str = typer.Option("quant-check", "--suite", help="quant-check, or a perplexity suite (name or file)."),
    out: Path = typer.Option(Path("runs/eval-diff"), "--out", "-o", help="Run folder to write."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    limit: int = typer.Option(None, "--limit", help="Only the first N items."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out."),
    quant_activations_a: str = typer.Option("none", "--quant-activations-a",
                                            help="A's quantized linears: none (exact, A16) | int8 (A8)."),
    quant_activations_b: str = typer.Option("none", "--quant-activations-b",
                                            help="B's: none | int8. One w8/w4 folder as A and B with "
                                                 "--quant-activations-b int8 measures A8 against A16."),
    kv_cache_dtype_a: str = typer.Option("auto", "--kv-cache-dtype-a",
                                         help="A's K/V cache: auto | bfloat16 | float32 | int8."),
    kv_cache_dtype_b: str = typer.Option("auto", "--kv-cache-dtype-b",
                                         help="B's. One folder as A and B with --kv-cache-dtype-b int8 measures "
                                              "the 8-bit cache's greedy agreement."),
) -> None:
    try:
        if suite == "quant-check":
            from lmforge.quant import check_suite  # deferred: lmforge.quant's __init__ loads torch

            s = check_suite.load()
        else:
            s = load_suite(suite)
        report = diff_models(model_a, model_b, s, out, dtype=dtype, limit=limit, overwrite=overwrite,
                             quant_activations=(quant_activations_a, quant_activations_b),
                             kv_cache_dtype=(kv_cache_dtype_a, kv_cache_dtype_b))
    except (SuiteError, FileNotFoundError, RunExistsError, ValueError) as e:
        _fail(e)
    typer.echo(diff_markdown(report))


@app.command(help="Print RUN_A and RUN_B (eval run folders) side by side. Refuses when a task's suite "
                  "file differs between the runs, unless --allow-changed-suite.")
def compare(
    run_a: Path = typer.Argument(..., help="The baseline eval run folder (or its results.json)."),
    run_b: Path = typer.Argument(..., help="The eval run folder to compare against it."),
    allow_changed_suite: bool = typer.Option(False, "--allow-changed-suite",
                                             help="Compare even when suite hashes differ; rows are marked."),
) -> None:
    from rich.console import Console  # deferred: rich (~0.15 s) loads only when a verb prints
    from rich.table import Table

    try:
        rows, changed = compare_runs(run_a, run_b, allow_changed_suite=allow_changed_suite)
    except (SuiteChangedError, FileNotFoundError) as e:
        _fail(e)
    title = f"{run_a}  vs  {run_b}" + ("  (SUITES CHANGED: " + ", ".join(changed) + ")" if changed else "")
    table = Table(title=title)
    for col in ("task", "metric", "A", "B", "B - A", "z", "n A/B", "suite"):
        table.add_column(col, justify="left" if col in ("task", "metric", "suite") else "right")

    def cell(c: dict | None) -> str:
        return "—" if c is None else f"{_fmt(c['value'])} ± {_fmt(c['stderr'])}"

    for r in rows:
        n = f"{r.a['n'] if r.a else '—'}/{r.b['n'] if r.b else '—'}"
        table.add_row(r.task, r.metric, cell(r.a), cell(r.b), _fmt(r.delta), _fmt(r.z, 2), n,
                      "CHANGED" if r.suite_changed else "same")
    Console(width=160).print(table)
    if changed:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] suite changed between runs for {', '.join(changed)}: "
                                   f"those rows compare different items", highlight=False)


@app.command(help="List the built-in suites and check each frozen file against suites.lock.json.")
def suites() -> None:
    from rich.console import Console  # deferred: rich (~0.15 s) loads only when a verb prints
    from rich.table import Table

    table = Table(title="built-in eval suites")
    for col in ("suite", "version", "kind", "metric", "n", "sha256", "description"):
        table.add_column(col)
    for name in builtin_names():
        s = load_suite(name)
        table.add_row(s.name, str(s.version), s.kind, s.metric, str(s.n), s.sha256[:12], s.description)
    Console(width=200).print(table)
    problems = verify_builtin_suites()
    for p in problems:
        Console(stderr=True).print(f"[red]error:[/red] {p}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(code=1)


@app.command("make-suite", help="Write a frozen suite file. KIND 'perplexity': from PREPARED_DIR/splits/val.jsonl "
                                "to --out FILE. KIND 'tasks': from a task file (GSM8K or prompt/answer JSONL) given "
                                "as the second argument, to --out FILE. KIND 'builtins': regenerate the built-in "
                                "suites and their lock (only after bumping a version in lmforge/eval/builtin.py).")
def make_suite(
    kind: str = typer.Argument(..., help="perplexity or builtins."),
    prepared_dir: Path = typer.Argument(None, help="perplexity: a prepared data folder (with splits/val.jsonl); "
                                                   "tasks: the task JSONL file."),
    out: Path = typer.Option(None, "--out", "-o", help="The suite file to write (perplexity)."),
    name: str = typer.Option(None, "--name", help="Suite name (default: val-PREPARED_DIR_NAME)."),
    version: int = typer.Option(1, "--version", help="Suite version; bump it whenever the content changes."),
    max_docs: int = typer.Option(500, "--max-docs", help="Take the first N non-empty documents."),
    max_chars: int = typer.Option(4000, "--max-chars", help="Cut each document to at most N characters."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="tasks: new tokens per answer (default 512)."),
) -> None:
    from rich.console import Console  # deferred: rich (~0.15 s) loads only when a verb prints

    console = Console()
    try:
        if kind == "builtins":
            for s in write_builtin_suites():
                console.print(f"{s.name} v{s.version}: {s.n} items, sha256 {s.sha256[:12]} -> {s.path}", highlight=False)
            return
        if kind == "tasks":
            if prepared_dir is None or out is None:
                raise SuiteError("make-suite tasks needs the task file and --out FILE")
            s = make_task_suite(prepared_dir, out, name=name, version=version,
                                **({"max_tokens": max_tokens} if max_tokens else {}))
            console.print(f"{s.name} v{s.version}: {s.n} tasks, sha256 {s.sha256} -> {out}", highlight=False)
            return
        if kind != "perplexity":
            raise SuiteError(f"KIND must be 'perplexity', 'tasks' or 'builtins', got {kind!r}")
        if prepared_dir is None or out is None:
            raise SuiteError("make-suite perplexity needs PREPARED_DIR and --out FILE")
        s = make_perplexity_suite(prepared_dir, out, name=name, version=version, max_docs=max_docs, max_chars=max_chars)
    except (SuiteError, FileNotFoundError, ValueError) as e:
        _fail(e)
    console.print(f"{s.name} v{s.version}: {s.n} documents, sha256 {s.sha256} -> {out}", highlight=False)
