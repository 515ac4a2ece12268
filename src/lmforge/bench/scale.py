"""`lmforge bench scale`: what Ray buys on this machine, and on paper for 8 nodes.

Two halves, one report:

* data: `data prepare` MB/s with the local executor and on a local Ray cluster at 1 and N
  workers (`bench/data_scale.py`, which also checks the outputs are byte-identical);
* serve: output tok/s of `lmforge serve` under `lmforge bench serve`'s load (a `uniform` workload by
  default: every request `input_len` prompt and `output_len` output tokens, `ignore_eos`, at most
  `concurrency` in flight), as a child process: one engine without Ray (`local`: in the server's
  process, `--no-engine-process`, as each Ray actor holds its engine), then
  `--replicas N --ray-address local` for each N (a fresh local Ray cluster with every core).
  Ray's overhead is the 1-replica Ray run against the local one, both on the same cores; the
  time to get ready (model load, and cluster start for Ray) is reported apart.

On paper, 8 nodes (the arithmetic of `lmforge estimate`: measured rates times counts, the serial
part kept serial): serving replicas share nothing but the front, so 8 nodes x `replicas_per_node`
replicas give the measured tok/s per replica (1-replica Ray run) times the replica count times
the measured efficiency of going from 1 to N replicas here (capped at 1). The one HTTP front
(tokenizing, routing, SSE) is not multiplied: its ceiling is not measured here and is the first
limit a real cluster meets. On a 2-core machine the N-replica runs share the cores the 1-replica
run had to itself, so N > cores says little; the report labels the load average it ran under.

    lmforge bench scale --out runs/bench-scale                 # a random tiny model, python-docs
    lmforge bench scale --model runs/model --replicas 1 2 --num-prompts 64 --out runs/bench-scale
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.bench.data_scale import run_data_scale
from lmforge.bench.report import emit, provenance
from lmforge.bench.serve import BenchConfig, bench_serve
from lmforge.serve.testing import free_port, make_model_with_tokenizer, spawn_server, stop_server


def _serve_run(model: Path, replicas: int, ray: bool, cfg: dict[str, Any]) -> dict[str, Any]:
    """One server (local engine, or `replicas` Ray replicas), loaded, measured, stopped."""
    port = free_port()
    args = [str(model), "--device", "cpu", "--served-model-name", "bench", "--log-level", "warning"]
    # local: the engine in the server's process, as each Ray actor holds it, so the ratio prices Ray alone
    args += ["--replicas", str(replicas), "--ray-address", "local"] if ray else ["--no-engine-process"]
    t0 = time.perf_counter()
    proc = spawn_server(args, port)
    ready_s = time.perf_counter() - t0
    try:
        bench_serve(BenchConfig(f"http://127.0.0.1:{port}", num_prompts=4, workload=cfg["workload"],
                                input_len=cfg["input_len"], output_len=4, progress=False))  # warm-up
        rep = bench_serve(BenchConfig(f"http://127.0.0.1:{port}", num_prompts=cfg["num_prompts"],
                                      workload=cfg["workload"], input_len=cfg["input_len"],
                                      output_len=cfg["output_len"], max_concurrency=cfg["concurrency"],
                                      progress=False))
    finally:
        code = stop_server(proc)
    c, s = rep["client"], rep["server"]
    return {"executor": "ray" if ray else "local", "replicas": replicas, "ready_s": round(ready_s, 2),
            "completed": c["completed"], "failed": c["failed"], "duration_s": round(c["duration_s"], 3),
            "output_tok_s": round(c["output_throughput"], 1), "ttft_p50_ms": round(c["ttft_ms"]["p50"], 1),
            "prefix_cache_hit_rate": round(s["prefix_cache_hit_rate"], 4), "exit_code": code}


def eight_nodes_serve(runs: list[dict], replicas_per_node: int) -> dict[str, Any]:
    """Measured tok/s per replica x 8 x `replicas_per_node` x the measured 1 -> N efficiency (<= 1)."""
    ray_runs = sorted((r for r in runs if r["executor"] == "ray"), key=lambda r: r["replicas"])
    one, widest = ray_runs[0], ray_runs[-1]
    per_replica = one["output_tok_s"] / one["replicas"]
    efficiency = min(1.0, widest["output_tok_s"] / (per_replica * widest["replicas"])) if per_replica else 0.0
    n = 8 * replicas_per_node
    return {"nodes": 8, "replicas_per_node": replicas_per_node, "replicas": n,
            "tok_s_per_replica": round(per_replica, 1), "efficiency_1_to_n": round(efficiency, 3),
            "from_replicas": widest["replicas"], "output_tok_s": round(per_replica * n * efficiency, 1),
            "output_tok_s_linear": round(per_replica * n, 1)}


def run_scale(model: Path | None = None, inputs: Sequence[str] = ("python-docs",), workers: Sequence[int] = (1, 2),
              copies: int = 4, cores_per_node: int = 64, replicas_per_node: int = 1, num_prompts: int = 32,
              input_len: int = 64, output_len: int = 32, concurrency: int = 8, workload: str = "uniform",
              skip_data: bool = False, out: Path | None = None) -> dict[str, Any]:
    """Measure both halves; with `out`, write `bench_scale.json` and `.md` (and the data half's own
    `bench_scale_data.*`) there; return the report."""
    data = None if skip_data else run_data_scale(inputs, workers, copies, cores_per_node, out)
    cfg = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
           "concurrency": concurrency, "workload": workload}
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:  # a random tiny Llama: tok/s then mostly prices the serving path, not the math
            model = make_model_with_tokenizer(Path(tmp) / "model", Path(tmp) / "tok", hidden_size=256, layers=4,
                                              max_position_embeddings=1024)
            model_label = "random tiny Llama (hidden 256, 4 layers, 512 vocab)"
        else:
            model_label = str(model)
        runs = [_serve_run(model, 1, False, cfg)] + [_serve_run(model, n, True, cfg) for n in workers]
    local, ray1 = runs[0], next(r for r in runs[1:] if r["replicas"] == min(workers))
    report = {"model": model_label, "serve_config": cfg, "serve": runs,
              "ray_overhead_serve": round(local["output_tok_s"] / max(ray1["output_tok_s"], 1e-9), 3),
              "eight_nodes_serve": eight_nodes_serve(runs, replicas_per_node), "data": data,
              "measured_on": "this machine, shared with other jobs (busy): re-measure idle before quoting",
              "command": "lmforge bench scale", **provenance("n/a")}
    emit(report, to_markdown, out, "bench_scale")
    return report


def to_markdown(r: dict[str, Any]) -> str:
    c = r["serve_config"]
    lines = [f"# lmforge bench scale ({r['date']})", "",
             f"{r['machine']}, load average {r['load_average']}: {r['measured_on']}.", "",
             f"## serve: {r['model']}", "",
             f"{c['num_prompts']} requests, `{c['workload']}` workload, {c['input_len']} prompt + {c['output_len']} "
             f"output tokens, at most {c['concurrency']} in flight.", "",
             "| executor | replicas | output tok/s | TTFT p50 ms | prefix-cache hit rate | failed | ready s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["serve"]:
        lines.append(f"| {x['executor']} | {x['replicas']} | {x['output_tok_s']} | {x['ttft_p50_ms']} | "
                     f"{100 * x['prefix_cache_hit_rate']:.1f}% | {x['failed']} | {x['ready_s']} |")
    e = r["eight_nodes_serve"]
    lines += ["", f"Ray overhead (serve, 1 replica): the local engine (in the server's process, as in each Ray "
              f"actor) gives {r['ray_overhead_serve']}x the Ray replica's tok/s on the same cores ('ready s' "
              "includes the Ray cluster's start).", "",
              f"On paper, {e['nodes']} nodes x {e['replicas_per_node']} replica(s): {e['tok_s_per_replica']} tok/s "
              f"per replica x {e['replicas']} replicas x {e['efficiency_1_to_n']} (the measured 1 -> "
              f"{e['from_replicas']} efficiency here) = {e['output_tok_s']} tok/s "
              f"(linear: {e['output_tok_s_linear']}), "
              "an upper bound: the one HTTP front is not multiplied, and its ceiling is not measured here.", ""]
    d = r.get("data")
    if d:
        lines += ["## data prepare", "", "| executor | workers (used) | wall s | MB/s | Ray start s |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name in ("local", "ray"):
            for x in d[name]:
                lines.append(f"| {name} | {x['workers']} ({x['workers_used']}) | {x['wall_s']:.2f} | "
                             f"{x['mb_per_s']:.2f} | {x.get('ray_init_s', '-')} |")
        dn = d["eight_nodes"]
        lines += ["", f"Outputs byte-identical: {d['identical']}. On paper, 8 nodes x {dn['cores_per_node']} cores: "
                  f"{dn['mb_per_s']} MB/s (driver write kept serial), {dn['mb_per_s_no_serial']} MB/s without it.", ""]
    return "\n".join(lines)
