"""`lmforge bench ...`: every benchmark verb in one Typer app, mounted by `lmforge.cli`.

Each verb parses its options and calls one runner of this package (`bench/serve.py`, `bench/data.py`,
`bench/engine.py`, `bench/mfu.py`, `bench/grpo.py`, `bench/parallel.py`, `bench/quant.py`), which
measures and writes JSON + Markdown. It knows nothing about how the runners measure.

    lmforge bench serve --base-url http://127.0.0.1:8000 --max-concurrency 32 --out runs/bench
    lmforge bench engine --model M --num-requests 200
    lmforge bench parallel --out runs/bench-parallel
    lmforge bench soak --minutes 30 --concurrency 32 --out runs/soak
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from lmforge.bench import engine as bench_engine
from lmforge.bench import grpo as bench_grpo
from lmforge.bench import linear as bench_linear
from lmforge.bench import lora as bench_lora
from lmforge.bench import parallel as pipeline_bench
from lmforge.bench import quant as bench_quant
from lmforge.bench import spec_decode as bench_spec_decode
from lmforge.track.short import short_mode, shrink
from lmforge.config import ConfigError
from lmforge.parallel.plots import plot_timeline
from lmforge.parallel.simulate import simulate
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.run import RunDir

app = typer.Typer(no_args_is_help=True, help="Benchmarks that write bench.json and a Markdown table.")


@app.command("serve", help="Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, "
                           "goodput; writes bench.json and bench.md. Takes `vllm bench serve`'s names too.")
def bench_serve(
    base_url: Annotated[Optional[str], typer.Option(
        help="The server, e.g. http://127.0.0.1:8000 [default: http://--host:--port, as vLLM].")] = None,
    host: Annotated[str, typer.Option(help="The server's host, when --base-url is not given (vLLM's name).")] = (
        "127.0.0.1"),
    port: Annotated[int, typer.Option(help="The server's port, when --base-url is not given (vLLM's name).")] = 8000,
    endpoint: Annotated[str, typer.Option(help="The API route (vLLM's name); completions are what is sent.")] = (
        "/v1/completions"),
    backend: Annotated[str, typer.Option(help="vLLM's client kind: vllm or openai (both: streamed completions).")] = (
        "vllm"),
    model: Annotated[Optional[str], typer.Option(help="Model id (default: the server's first).")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 100,
    request_rate: Annotated[float, typer.Option(help="Poisson arrival rate, req/s; inf = all at once.")] = math.inf,
    max_concurrency: Annotated[Optional[int], typer.Option(help="Most requests in flight.")] = None,
    workload: Annotated[str, typer.Option("--workload", "--dataset-name", help=(
        "high-variance | uniform (= vLLM's random) | shared-prefix | sharegpt (with --dataset-path).")
    )] = "high-variance",
    input_len: Annotated[int, typer.Option("--input-len", "--random-input-len",
                                           help="Prompt tokens (uniform, shared-prefix).")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", "--random-output-len",
                                            help="Output tokens (uniform, shared-prefix).")] = 128,
    range_ratio: Annotated[float, typer.Option("--random-range-ratio", help=(
        "Draw each length from [len * (1 - r), len * (1 + r)] (vLLM's name).")
    )] = 0.0,
    dataset_path: Annotated[Optional[Path], typer.Option(help="A ShareGPT JSON for --dataset-name sharegpt.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help=(
        "Folder whose tokenizer counts ShareGPT tokens [default: --model when it is a folder].")
    )] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Every output runs to its length (vLLM's --ignore-eos).")] = True,
    seed: Annotated[int, typer.Option(help="Workload and arrival seed.")] = 0,
    slo: Annotated[Optional[str], typer.Option(help="SLOs for goodput, ms: 'ttft=500,tpot=50'.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="LMFORGE_API_KEY", help="Bearer key.")] = None,
    offline_model: Annotated[Optional[Path], typer.Option(
        help="Also run the same requests through the offline engine on this model dir (HTTP cost).")] = None,
    offline_dtype: Annotated[str, typer.Option(help="dtype for --offline-model.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Write bench.json and bench.md here.")] = None,
    save_result: Annotated[bool, typer.Option(help="Write the result to --result-dir (vLLM's name).")] = False,
    result_dir: Annotated[Optional[Path], typer.Option(help="Folder for --save-result [default: .].")] = None,
    result_filename: Annotated[Optional[str], typer.Option(help="JSON file name for --save-result.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    against: Annotated[Optional[str], typer.Option(
        help="Another OpenAI-compatible server (e.g. llama-server): same workload on both, ratios.")] = None,
    against_model: Annotated[Optional[str], typer.Option(help="Model id on --against (default: its first).")] = None,
    concurrency: Annotated[str, typer.Option(help="With --against: concurrencies to run, e.g. 1,16.")] = "1,16",
) -> None:
    """Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, E2E percentiles, throughput, goodput,
    and the server's own /metrics view beside them; with --against, lmforge against another server.
    LMFORGE_SHORT=1 caps the run at 8 requests of at most 32 + 16 tokens (CI)."""
    # deferred: httpx (and the HTTP client runner) only for this verb; `lmforge --help` stays lighter
    import httpx

    from lmforge.bench.serve import BenchConfig, bench_serve as run, parse_slo, to_markdown  # deferred: same

    if backend not in ("vllm", "openai"):
        _exit(2, f"--backend {backend}: bench serve speaks OpenAI's streamed completions (vllm, openai)")
    if endpoint.rstrip("/") != "/v1/completions":
        _exit(2, f"--endpoint {endpoint}: bench serve sends streamed completions; use /v1/completions")
    base_url = (base_url or f"http://{host}:{port}").rstrip("/")
    if tokenizer is None and workload == "sharegpt" and model and Path(model).is_dir():
        tokenizer = model
    try:
        cfg = BenchConfig(base_url, model, shrink(num_prompts, 8), request_rate, max_concurrency, workload,
                          shrink(input_len, 32), shrink(output_len, 16), seed, parse_slo(slo), api_key,
                          str(offline_model) if offline_model else None, offline_dtype, progress, ignore_eos,
                          range_ratio, str(dataset_path) if dataset_path else None, tokenizer)
    except ValueError as e:
        _exit(2, str(e))
    out = _result_dir(out, save_result, result_dir, result_filename)
    if against:
        raise typer.Exit(_bench_against(cfg, against, against_model, concurrency, out))
    try:
        report = run(cfg, out, json_name=result_filename or "bench.json")
    except httpx.HTTPError as e:
        _exit(1, f"{base_url}: {type(e).__name__}: {e} (is `lmforge serve` running there? --base-url or "
                 "--host/--port name it)")
    except ValueError as e:
        _exit(2, str(e))
    typer.echo(to_markdown(report))
    raise typer.Exit(0 if report["client"]["failed"] == 0 else 1)


def _exit(code: int, message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _result_dir(out: Path | None, save_result: bool, result_dir: Path | None, result_filename: str | None) -> Path | None:
    """--out, or vLLM's --save-result [--result-dir D] [--result-filename F] (one of the two forms)."""
    if (result_dir or result_filename) and not save_result:
        _exit(2, "--result-dir and --result-filename go with --save-result")
    if save_result and out is not None:
        _exit(2, "--out and --save-result --result-dir say the same thing; pass one")
    return (result_dir or Path(".")) if save_result else out


def _bench_against(cfg, against: str, against_model: str | None, concurrency: str, out: Path | None) -> int:
    import httpx  # deferred: as in bench_serve

    from lmforge.bench.serve import against_markdown, bench_against  # deferred: same

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        typer.echo(f"error: --concurrency {concurrency!r}: a comma-separated list of positive integers, e.g. 1,16",
                   err=True)
        return 2
    try:
        report = bench_against(cfg, against.rstrip("/"), levels, against_model, out)
    except httpx.HTTPError as e:
        typer.echo(f"error: {type(e).__name__}: {e} (is every server up? {cfg.base_url}, {against})", err=True)
        return 1
    typer.echo(against_markdown(report))
    return 0 if all(r["failed"] == 0 for side in report["runs"].values() for r in side.values()) else 1


@app.command("soak", help="Load and faults against a real lmforge serve (hostile requests, a killed exchange-log "
                          "writer, a killed engine, a hot reload); writes soak.json and soak.md.")
def bench_soak(
    minutes: Annotated[float, typer.Option(help="Length of the loaded run with faults.")] = 30.0,
    idle_minutes: Annotated[float, typer.Option(help="Length of the idle baseline (no hostile, no faults).")] = 2.0,
    concurrency: Annotated[int, typer.Option(help="Well-behaved streaming clients.")] = 32,
    hostile: Annotated[float, typer.Option(help="Share of requests replaced by a hostile one.")] = 0.05,
    max_tokens: Annotated[int, typer.Option(help="Tokens per well-behaved request.")] = 32,
    model: Annotated[Optional[Path], typer.Option(help="Model folder (default: a tiny random Llama).")] = None,
    faults: Annotated[bool, typer.Option(help="Kill the writer and the engine, and hot-reload, mid-run.")] = True,
    out: Annotated[Optional[Path], typer.Option(help="Write soak.json and soak.md here.")] = None,
) -> None:
    from lmforge.bench.soak import SoakConfig, run_soak  # deferred: httpx, psutil and the registry, for this verb

    # LMFORGE_SHORT (CI): 15 s under load with the same three faults, 3 s idle, 4 clients
    report = run_soak(SoakConfig(shrink(minutes, 0.25), shrink(idle_minutes, 0.05), shrink(concurrency, 4), hostile,
                                 shrink(max_tokens, 8), str(model) if model else None, faults=faults), out)
    ok = report["exchange_log"]["lost_outside_drop_counter"] == 0 and report["healthy_after"]
    raise typer.Exit(0 if ok else 1)


@app.command("data")
def bench_data_cmd(
    inputs: Annotated[Optional[list[str]], typer.Argument(help="Inputs to prepare (default: python-docs).")] = None,
    workers: Annotated[list[int], typer.Option("--workers", help="Worker counts to compare; repeat.")] = [1, 2],
    repeats: Annotated[int, typer.Option(help="Timed repeats per setting (best is kept).")] = 3,
    out: Annotated[Path, typer.Option(help="Folder for bench_data.json and bench_data.md.")] = Path("runs/bench-data"),
) -> None:
    """Throughput of `lmforge data prepare` per step and end to end (MB/s, CPU time) with 1 and 2
    workers; checks that the outputs are identical across worker counts."""
    from lmforge.bench.data import run_bench, to_markdown  # deferred: data.prepare and its rules, for this verb

    result = run_bench(inputs=tuple(inputs or ["python-docs"]), workers=tuple(workers), repeats=repeats, out_dir=out)
    typer.echo(to_markdown(result))
    typer.echo(f"wrote {out / 'bench_data.json'} and bench_data.md")


@app.command("load")
def bench_load_cmd(
    model: Annotated[str, typer.Argument(help="A .gguf file or a model folder, served as `lmforge serve MODEL`.")],
    against: Annotated[Optional[str], typer.Option(help="A llama-server binary: the same file through it, "
                                                        "alternating repeats.")] = None,
    repeats: Annotated[int, typer.Option(help="Starts of each server (the median is reported).")] = 3,
    threads: Annotated[Optional[int], typer.Option(help="llama-server -t (default: all cores).")] = None,
    flag: Annotated[Optional[list[str]], typer.Option("--flag", help="Extra `lmforge serve` flag (repeat; "
                                                                     "default: none, as a user runs it).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder for load.json and load.md.")] = None,
) -> None:
    """Seconds from exec to the first answered request, and peak resident memory, for `lmforge serve MODEL`
    (and llama-server on the same file with --against)."""
    from lmforge.bench.load import run  # deferred: psutil and the server helpers, for this verb

    try:
        run(model, against, shrink(repeats, 1), threads, flag or [], out)
    except (RuntimeError, FileNotFoundError) as e:
        _exit(1, str(e))


@app.command("scale")
def bench_scale_cmd(
    model: Annotated[Optional[Path], typer.Option(help="Model to serve (default: a random tiny Llama).")] = None,
    workers: Annotated[list[int], typer.Option("--workers", help="Workers / replicas to compare; repeat.")] = [1, 2],
    num_prompts: Annotated[int, typer.Option(help="Requests per serve run.")] = 32,
    output_len: Annotated[int, typer.Option(help="Output tokens per request.")] = 32,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.")] = 8,
    replicas_per_node: Annotated[int, typer.Option(help="For the 8-node estimate.")] = 1,
    skip_data: Annotated[bool, typer.Option(help="Only the serve half.")] = False,
    out: Annotated[Path, typer.Option(help="Folder for bench_scale.json and .md.")] = Path("runs/bench-scale"),
) -> None:
    """data prepare MB/s and serve tok/s, local vs Ray at 1 and N workers/replicas, and 8 nodes on paper."""
    from lmforge.bench.scale import run_scale  # deferred: data.prepare, the server and Ray load only for this verb

    run_scale(model, workers=tuple(workers), num_prompts=num_prompts, output_len=output_len, concurrency=concurrency,
              replicas_per_node=replicas_per_node, skip_data=skip_data, out=out)


app.command("engine")(bench_engine.bench_engine)
app.command("linear")(bench_linear.main)
app.command("lora", help="Multi-LoRA: N adapters mixed in one workload vs the merged model alone (tok/s ratio).")(
    bench_lora.main)
app.command("spec-decode", help="Speculative decoding (ngram, draft model) vs plain decode at batch 1 and N "
                                 "concurrent; outputs checked identical.")(bench_spec_decode.main)


@app.command("mfu")
def bench_mfu_cmd(
    config: Annotated[Path, typer.Argument(help="Training YAML config, e.g. configs/quickstart.yaml.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="[KEY=VALUE]...", help="Dotted overrides.")] = None,
    steps: Annotated[int, typer.Option(help="Timed steps per rung (median; 2 warm-up steps before).")] = 6,
    max_batch: Annotated[Optional[int], typer.Option(help="Micro-batch of the last rung [default: 2 × train.batch_size].")] = None,
    skip: Annotated[Optional[list[str]], typer.Option("--skip", help="Rung numbers to skip, e.g. --skip 5.")] = None,
    out: Annotated[Path, typer.Option(help="Folder for bench_mfu.json and bench_mfu.md.")] = Path("runs/bench-mfu"),
) -> None:
    """The MFU ladder on CONFIG: float32 → bf16 autocast → fused loss → data pipeline → varlen attention →
    torch.compile → batch size; each rung a short measured run, kept only when faster; table with Δ,
    physical reason and roofline headroom."""
    from lmforge.bench.mfu import bench_mfu  # deferred: the trainer loads only for this verb

    try:
        bench_mfu(str(config), list(overrides or []), steps, out, max_batch, tuple(skip or ()))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


app.command("grpo")(bench_grpo.bench_grpo)


@app.command("parallel")
def bench_parallel(
    stages: Annotated[list[int], typer.Option("--stages", "-p", help="Pipeline stages; repeat.")] = [2, 4],
    microbatches: Annotated[list[int], typer.Option("--microbatches", "-m", help="Micro-batches; repeat.")] = [
        1, 2, 4, 8, 16],
    schedule: Annotated[list[str], typer.Option("--schedule", help="gpipe and/or 1f1b; repeat.")] = ["gpipe", "1f1b"],
    steps: Annotated[int, typer.Option(help="Timed steps per cell (after one warm-up); the median is kept.")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads per stage process.")] = 1,
    tp: Annotated[list[int], typer.Option("--tp", help="TP degrees for the bytes-per-layer table; repeat; "
                                                       "0 skips it.")] = [1, 2, 4],
    out: Annotated[Path, typer.Option(help="Run directory for bench_parallel.json/.md and timelines.")] = Path(
        "runs/bench-parallel"),
    overwrite: Annotated[bool, typer.Option(help="Replace a finished run in --out.")] = False,
) -> None:
    """Run the real pipeline (one gloo process per stage) over stages x micro-batches x schedules and
    print, per cell, the formula's bubble, the simulator's (fed with each stage's measured times) and
    the measured one (idle / stage time from every action's timestamps), with the errors; then the
    all-reduce bytes per layer of tensor parallelism at each --tp degree."""
    if short_mode():  # CI: two stages, one and two micro-batches, one timed step a cell
        stages, microbatches, steps, tp = [min(stages)], [m for m in microbatches if m <= 2] or [1], 1, tp[:2]
    spec = pipeline_bench.BenchSpec(stages=tuple(stages), microbatches=tuple(microbatches),
                                     schedules=tuple(schedule), steps=steps, threads=threads)
    rd = RunDir(out, overwrite=overwrite)
    rd.write_config(spec)
    report = pipeline_bench.bench_parallel(spec)
    md = pipeline_bench.to_markdown(report)
    degrees = tuple(n for n in tp if n > 0)
    if degrees:
        report["tp"] = pipeline_bench.tp_bytes(degrees)
        md += "\n" + pipeline_bench.tp_markdown(report["tp"])
    print(md)
    _plot_timelines(report, max(microbatches), rd.path)
    atomic_write_json(rd.path / "bench_parallel.json", report)
    atomic_write_text(rd.path / "bench_parallel.md", md)
    rd.finish(cells=len(report["cells"]), wall_s=report["wall_s"])
    print(f"wrote {rd.path}")


def _plot_timelines(report: dict, microbatches: int, folder: Path) -> None:
    """Measured beside simulated timelines, for the cells with the largest M."""
    calib = report["calibration"]
    for c in report["cells"]:
        if c["microbatches"] == microbatches:
            tag = f"{c['schedule']}-P{c['stages']}-M{c['microbatches']}"
            plot_timeline(c["timeline"], folder / f"timeline-{tag}-measured.png",
                          title=f"{tag} measured (bubble {c['bubble_measured']:.3f}, CPU/wall {c['cpu_over_wall']:.2f})")
            k = calib[str(c["stages"])]
            sim = simulate(c["schedule"], c["stages"], c["microbatches"], k["fwd_s"], k["bwd_s"], k["send_s"])
            plot_timeline(sim.events, folder / f"timeline-{tag}-simulated.png",
                          title=f"{tag} simulated from the calibration (bubble {sim.bubble:.3f})")


app.command("quant")(bench_quant.bench_quant)
