"""`lmforge bench load MODEL`: how long `lmforge serve MODEL` takes from exec to its first answered request,
and how much memory it holds, beside llama-server on the same file (`--against PATH/llama-server`).

Each repeat starts the server as a user would (default flags, a free loopback port), then asks a one-token
completion every 20 ms until one is answered: ready = the seconds from exec to that answer (imports, the
file's parse, weight repacking, kernel build or cache hit, engine start, the first prefill). The resident
memory of the server's whole process tree is sampled every 20 ms: the peak up to ready, and the resident
set once ready (file pages llama.cpp maps count when touched, as ours do). The server is then stopped.
Repeats alternate lmforge and llama-server so that both see the same machine; the report gives each
repeat and the median, the ratio lmforge / llama.cpp, the model file's size, and the machine, versions
and load average. Knows nothing about the engine: it runs both as subprocesses.

    lmforge bench load SmolLM2-135M-Instruct.Q4_1.gguf --against /opt/llamacpp/.../bin/llama-server --out runs/load
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from lmforge.serve.testing import free_port

from .report import emit, provenance

POLL_S = 0.02


def _tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and all its children (the server's engine process too)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _answered(port: int, path: str) -> bool:
    """Whether the server answers a one-token completion now (the model id from its /v1/models)."""
    base = f"http://127.0.0.1:{port}"
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0, "model": model}).encode()
        req = urllib.request.Request(f"{base}{path}", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, KeyError, IndexError, ValueError):
        return False


def time_to_ready(cmd: list[str], port: int, path: str = "/v1/completions", timeout: float = 300.0) -> dict:
    """Start `cmd`, poll until a one-token completion is answered; {ready_s, peak_rss_bytes, ready_rss_bytes}."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ps, peak, stop = psutil.Process(proc.pid), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(ps))
            time.sleep(POLL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        while not _answered(port, path):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before answering: "
                                   f"{(proc.stderr.read() or '').strip()[-400:]}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{cmd[0]}: no answer within {timeout:.0f} s")
            time.sleep(POLL_S)
        ready = time.perf_counter() - t0
        ready_rss = _tree_rss(ps)
    finally:
        stop.set()
        sampler.join()
        _stop(proc)
    return {"ready_s": round(ready, 3), "peak_rss_bytes": max(peak[0], ready_rss), "ready_rss_bytes": ready_rss}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _lmforge_cmd(model: str, port: int, extra: list[str]) -> list[str]:
    exe = shutil.which("lmforge") or sys.executable
    head = [exe] if exe.endswith("lmforge") else [exe, "-m", "lmforge.launch"]
    return [*head, "serve", model, "--port", str(port), *extra]


def _llama_cmd(server: str, model: str, port: int, threads: int) -> list[str]:
    return [server, "-m", model, "--port", str(port), "-t", str(threads), "--host", "127.0.0.1"]


def bench_load(model: str, against: str | None = None, repeats: int = 3, threads: int | None = None,
               extra: list[str] | None = None) -> dict:
    """Alternating repeats of lmforge (and llama-server when `against`); medians and their ratio."""
    threads = threads or os.cpu_count() or 1
    runs: dict[str, list[dict]] = {"lmforge": []}
    if against:
        runs["llama.cpp"] = []
    for i in range(repeats):
        for system in runs:
            port = free_port()
            cmd = _lmforge_cmd(model, port, extra or []) if system == "lmforge" else \
                _llama_cmd(against, model, port, threads)
            r = time_to_ready(cmd, port)
            print(f"  {system} repeat {i + 1}/{repeats}: ready {r['ready_s']:.2f} s, peak RSS "
                  f"{r['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
            runs[system].append(r)
    summary = {s: {k: statistics.median(r[k] for r in rs) for k in ("ready_s", "peak_rss_bytes", "ready_rss_bytes")}
               for s, rs in runs.items()}
    report = {"benchmark": "load", "model": model, "model_bytes": Path(model).stat().st_size if Path(model).is_file()
              else None, "lmforge_flags": extra or [], "threads": threads, "repeats": runs, "median": summary,
              "provenance": provenance("auto")}
    if against:
        report["llama_server"] = against
        report["ratio_ready_s"] = round(summary["lmforge"]["ready_s"] / summary["llama.cpp"]["ready_s"], 2)
        report["ratio_peak_rss"] = round(summary["lmforge"]["peak_rss_bytes"] / summary["llama.cpp"]["peak_rss_bytes"], 2)
    return report


def to_markdown(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    size = f", {mib(r['model_bytes'])} MiB" if r.get("model_bytes") else ""
    lines = [f"# Time to ready: {Path(r['model']).name}{size}", "",
             f"{r['provenance']['machine']}, {r['provenance']['date']}, load average "
             f"{r['provenance']['load_average']}; median of {len(r['repeats']['lmforge'])} alternating repeats; "
             f"lmforge flags: {' '.join(r['lmforge_flags']) or 'defaults'}", "",
             "| system | ready (s) | peak RSS (MiB) | RSS once ready (MiB) | repeats (s) |", "| --- | ---: | ---: | ---: | --- |"]
    for s, m in r["median"].items():
        each = ", ".join(f"{x['ready_s']:.2f}" for x in r["repeats"][s])
        lines.append(f"| {s} | {m['ready_s']:.2f} | {mib(m['peak_rss_bytes'])} | {mib(m['ready_rss_bytes'])} | {each} |")
    if "ratio_ready_s" in r:
        lines += ["", f"lmforge / llama.cpp: ready {r['ratio_ready_s']}x, peak RSS {r['ratio_peak_rss']}x"]
    return "\n".join(lines) + "\n"


def run(model: str, against: str | None, repeats: int, threads: int | None, extra: list[str], out: Path | None) -> dict:
    report = bench_load(model, against, repeats, threads, extra)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    emit(report, to_markdown, out, "load")
    return report
