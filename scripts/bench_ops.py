"""The operations targets of issue 15, measured against a real `lmforge serve --registry`:

    python scripts/bench_ops.py --out runs/bench-ops [--num-prompts 96] [--concurrency 32]

1. reload: `lmforge bench serve` at concurrency C runs while version 2 is promoted and
   `POST /admin/reload` swaps it in, then while `registry rollback` + reload swap back: failed
   requests must be 0, and the rolled-back champion's files hash byte-identically;
2. canary: a server with the challenger at 50%, 1,000 requests with random `user`s (and 50 users
   asking 5 times each): the challenger's share within +-3 points, no sticky user switching;
3. request logging (`logging`): servers without and with `--log-requests` (and with
   `--baseline-src DIR`, with `--log-requests` from another checkout: the "before" of a change) up
   at once, `bench serve` at concurrency C on each in rotating order for `--rounds` rounds: the
   throughput cost = 1 - the median per-round ratio (target <= 5%), and the HTTP process's CPU ms
   per request;
4. `log_cpu` (not in the default set): the serving process's CPU time per logged exchange
   (`ExchangeLog.add` at 100/s, then flush), which a busy neighbour does not move the way it moves
   throughput.

    python scripts/bench_ops.py --phases log_cpu,logging --baseline-src /tmp/before/src --out runs/bench-ops

Builds two tiny random models (same shapes, different weights) and a registry in a temp folder
unless `--model-a/--model-b` are given. Writes bench_ops.json and bench_ops.md with machine,
versions and load average. Loopback only (free ports unless `--port`); every loop bounded; a line on
stderr as each phase starts and ends. `LMFORGE_SHORT=1` (CI) runs the phases small (8 requests at
concurrency 4, 40 canary requests) and leaves out `logging`, whose one figure, a cost over rounds, a
short run cannot judge; the canary share is then printed, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.registry import Registry  # noqa: E402
from lmforge.bench.serve import BenchConfig, bench_serve  # noqa: E402
from lmforge.serve.testing import free_port, spawn_server, stop_server  # noqa: E402
from lmforge.track.progress import fmt_duration  # noqa: E402
from lmforge.track.short import short_mode, shrink  # noqa: E402

KEY, ADMIN_KEY = "bench-ops-key", "bench-ops-admin-key"


def start(args: list[str], port: int):
    return spawn_server([*args, "--log-level", "warning", "--api-key", KEY, "--admin-api-key", ADMIN_KEY,
                         "--max-model-len", "512"], port)


stop = stop_server


def bench(url: str, n: int, c: int, seed: int) -> dict:
    cfg = BenchConfig(url, None, n, float("inf"), c, "uniform", 64, 32, seed, {}, KEY, None, "auto", False)
    return bench_serve(cfg)["client"]


def reload(url: str) -> dict:
    r = httpx.post(url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300)
    r.raise_for_status()
    return r.json()


def phase_reload(reg_path: Path, name: str, port: int, n: int, c: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    reg = Registry(reg_path)
    proc = start(["--registry", str(reg_path), "--model", name], port)
    try:
        out = {}
        for step in ("promote", "rollback"):
            box: dict = {}
            t = threading.Thread(target=lambda: box.update(bench(url, n, c, seed=7)))
            t.start()
            time.sleep(1.0)  # requests in flight before the swap
            if step == "promote":
                reg.promote(name, 2, force=True)
            else:
                reg.rollback(name)
            swapped = reload(url)
            t.join()
            out[step] = {"reload": swapped, "completed": box.get("completed"), "failed": box.get("failed")}
        champion = reg.get(name, "champion")
        reg.verify(champion)  # raises if the files changed
        out["champion_after_rollback"] = champion.version
        out["champion_files_verified"] = True
        return out
    finally:
        stop(proc)


def phase_canary(reg_path: Path, name: str, port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    requests, users = shrink(1000, 40), shrink(50, 5)
    reg = Registry(reg_path)
    reg.set_alias(name, "challenger", 2)
    proc = start(["--registry", str(reg_path), "--model", name, "--canary", "50"], port)
    rng = random.Random(0)
    try:
        seen: dict[str, int] = {}
        switches = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            for i in range(requests):
                r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1,
                                                         "user": f"anon-{rng.random()}"})
                v = r.headers["x-lmforge-model-version"]
                seen[v] = seen.get(v, 0) + 1
            for u in range(users):
                versions = {client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1,
                                                                 "user": f"user-{u}"}).headers["x-lmforge-model-version"]
                            for _ in range(5)}
                switches += len(versions) > 1
        return {"requests": requests, "per_version": seen, "challenger_share_pct": 100 * seen.get("2", 0) / requests,
                "sticky_users": users, "users_that_switched": switches}
    finally:
        stop(proc)
        reg.delete_alias(name, "challenger")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase_logging(model: str, n: int, c: int, tmp: Path, rounds: int, baseline_src: str | None = None,
                  port: int = 8770) -> dict:
    """Servers without and with --log-requests (and, with `baseline_src`, with --log-requests running
    that checkout's code: the "before"), all up at once on their own ports, benched in turn `rounds`
    times (the order rotating each round), so a neighbour's burst on a shared machine hits every
    variant alike. Per round a throughput ratio variant / off; the cost is 1 - the median ratio.
    Also the HTTP process's own CPU time per request (its children, the engine and the writer
    process, not included): where the logging cost lands."""
    variants = {"off": ([], None), "on": (["--log-requests", "--feedback-db", str(tmp / "fb-on.db")], None)}
    if baseline_src:
        env = {**os.environ, "PYTHONPATH": baseline_src}
        variants["on_before"] = (["--log-requests", "--feedback-db", str(tmp / "fb-before.db")], env)
    procs, urls = {}, {}
    try:
        for i, (label, (extra, env)) in enumerate(variants.items()):
            variant_port = port + i if port else free_port()
            procs[label] = spawn_server([model, *extra, "--log-level", "warning", "--api-key", KEY,
                                         "--max-model-len", "512"], variant_port, env=env)
            urls[label] = f"http://127.0.0.1:{variant_port}"
            bench(urls[label], shrink(max(c, 16), 4), c, seed=1)  # warm-up
        labels = list(variants)
        tput: dict[str, list[float]] = {k: [] for k in labels}
        cpu_ms: dict[str, list[float]] = {k: [] for k in labels}
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                cpu0 = cpu_seconds(procs[label].pid)
                res = bench(urls[label], n, c, seed=3 + r)
                cpu_ms[label].append(1000 * (cpu_seconds(procs[label].pid) - cpu0) / max(res["completed"], 1))
                tput[label].append(res["output_throughput"])
    finally:
        for p in procs.values():
            stop(p)
    out: dict = {"rounds": rounds, "throughput": tput, "http_cpu_ms_per_request": cpu_ms}
    for label in labels[1:]:
        ratios = sorted(v / o for v, o in zip(tput[label], tput["off"]))
        out[label] = {"cost_pct": 100 * (1 - ratios[len(ratios) // 2]), "round_ratios": ratios,
                      "http_cpu_ms_per_request": sorted(cpu_ms[label])[len(cpu_ms[label]) // 2]}
    out["off"] = {"http_cpu_ms_per_request": sorted(cpu_ms["off"])[len(cpu_ms["off"]) // 2]}
    from lmforge.registry import FeedbackStore

    out["on"]["exchanges_stored"] = FeedbackStore(tmp / "fb-on.db").stats()["exchanges"]
    out["cost_pct"] = out["on"]["cost_pct"]
    return out


LOG_CPU_CHILD = """
import json, sys, tempfile, time
from pathlib import Path
variant, n, rate, prompt, response = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
xlog = None
if variant != "none":
    from lmforge.registry import FeedbackStore
    from lmforge.serve.exchange_log import ExchangeLog
    xlog = ExchangeLog(FeedbackStore(Path(tempfile.mkdtemp()) / "fb.db"))
t0, c0 = time.perf_counter(), time.process_time()
for i in range(n):
    if xlog is not None:
        xlog.add({"id": f"cmpl-{i}", "created": 0, "model": "m", "model_version": "1", "user": None,
                  "kind": "completion", "prompt": prompt, "response": response})
    time.sleep(max(0.0, t0 + (i + 1) / rate - time.perf_counter()))
if xlog is not None:
    xlog.flush()
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}))
"""


def phase_log_cpu(model: str, n: int, rate: float, rounds: int, baseline_src: str | None) -> dict:
    """The serving process's CPU time per logged exchange: `ExchangeLog.add` for `n` exchanges of the
    bench's shape (a 64-token prompt, a 32-token answer, decoded by the model's tokenizer) arriving at
    `rate`/s, then `flush()`, in a fresh interpreter per run; minus the same loop without a log.
    CPU time of this process only (`time.process_time`: every thread, no children), so a busy
    neighbour does not change it the way it changes throughput. With `baseline_src`, also the
    ExchangeLog of that checkout (the thread writer, which masked in-process)."""
    import subprocess

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    prompt = tok.decode([rng.randrange(261, tok.vocab_size) for _ in range(64)])
    response = tok.decode([rng.randrange(261, tok.vocab_size) for _ in range(32)])
    variants = {"none": None, "process": str(ROOT / "src")}
    if baseline_src:
        variants["thread_before"] = baseline_src
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for label, src in variants.items():
            env = {**os.environ, "PYTHONPATH": src or str(ROOT / "src")}
            out = subprocess.run([sys.executable, "-c", LOG_CPU_CHILD, label, str(n), str(rate), prompt, response],
                                 env=env, capture_output=True, text=True, timeout=600, check=True)
            cpu[label].append(json.loads(out.stdout)["cpu_s"])
    med = {k: sorted(v)[len(v) // 2] for k, v in cpu.items()}
    return {"n": n, "rate_per_s": rate, "rounds": rounds, "cpu_s": cpu,
            "us_per_exchange": {k: 1e6 * (med[k] - med["none"]) / n for k in variants if k != "none"}}


def tiny_models(root: Path) -> tuple[str, str]:
    from lmforge.model.reference import save_hf_model
    from lmforge.serve.testing import make_model_with_tokenizer

    a = make_model_with_tokenizer(root / "a", root / "tok", hidden_size=128, layers=4)
    b = root / "b"
    shutil.copytree(a, b)
    cfg = json.loads((a / "config.json").read_text())
    save_hf_model("llama", b, vocab_size=cfg["vocab_size"], hidden_size=128, layers=4, seed=1,
                  bos_token_id=0, eos_token_id=[1, 4], pad_token_id=2)
    return str(a), str(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-a")
    ap.add_argument("--model-b")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--port", type=int, default=None, help="first port of the servers (default: free ports)")
    ap.add_argument("--phases", default="reload,canary,logging", help="comma-separated subset to run")
    ap.add_argument("--rounds", type=int, default=10, help="logging phase: rounds of benching every variant")
    ap.add_argument("--baseline-src", help="logging phase: also serve --log-requests from this src folder "
                    "(e.g. an older commit's `git archive`), the 'before' of a change, in the same run")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-ops"))
    a = ap.parse_args()
    a.num_prompts, a.concurrency, a.rounds = shrink(a.num_prompts, 8), shrink(a.concurrency, 4), shrink(a.rounds, 1)
    phases = set(a.phases.split(","))
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-ops-"))
    model_a, model_b = (a.model_a, a.model_b) if a.model_a else tiny_models(tmp)
    reg_path = tmp / "registry.db"
    reg = Registry(reg_path)
    reg.add("m", model_a, notes="v1")
    reg.add("m", model_b, notes="v2")
    load_before = os.getloadavg()
    report: dict = {}
    port = lambda k: a.port + k if a.port else free_port()  # noqa: E731
    runs = {"reload": lambda: phase_reload(reg_path, "m", port(0), a.num_prompts, a.concurrency),
            "canary": lambda: phase_canary(reg_path, "m", port(0)),
            "log_cpu": lambda: phase_log_cpu(model_a, shrink(400, 40), 100.0, shrink(5, 1), a.baseline_src),
            "logging": lambda: phase_logging(model_a, a.num_prompts, a.concurrency, tmp, a.rounds, a.baseline_src,
                                             a.port + 4 if a.port else 0)}
    if short_mode() and "logging" in phases:  # its one figure is a cost over rounds: nothing a short run can judge
        print("bench_ops: LMFORGE_SHORT: the logging phase is left out (tests/test_serve_exchange_log.py runs the "
              "request log)", file=sys.stderr, flush=True)
        phases.discard("logging")
    for name, run in runs.items():
        if name in phases:
            t0 = time.monotonic()
            print(f"bench_ops: {name} ...", file=sys.stderr, flush=True)
            report[name] = run()
            print(f"bench_ops: {name} done in {fmt_duration(time.monotonic() - t0)}", file=sys.stderr, flush=True)
    r, targets, md = report, {}, ["| check | figure | target |", "| --- | --- | --- |"]
    if "reload" in r:
        targets["zero_failed_during_reload"] = r["reload"]["promote"]["failed"] == 0 and \
            r["reload"]["rollback"]["failed"] == 0
        for step in ("promote", "rollback"):
            md.append(f"| reload ({step}) under bench serve c={a.concurrency} | {r['reload'][step]['failed']} failed "
                      f"of {r['reload'][step]['completed']} completed | 0 failed |")
    if "canary" in r and not short_mode():  # 100 requests (short mode) cannot judge +-3 points
        targets["canary_within_3_points"] = abs(r["canary"]["challenger_share_pct"] - 50) <= 3
    if "canary" in r:
        targets["sticky_users_never_switch"] = r["canary"]["users_that_switched"] == 0
        cn = r["canary"]
        md += [f"| canary 50% over {cn['requests']:,} requests | challenger {cn['challenger_share_pct']:.1f}% | 47-53% |",
               f"| sticky users ({cn['sticky_users']} x 5 requests) | {cn['users_that_switched']} switched | 0 |"]
    if "logging" in r:
        lg = r["logging"]
        if not short_mode():  # one round (short mode) cannot resolve 5%
            targets["logging_cost_at_most_5pct"] = lg["cost_pct"] <= 5
        for label in [k for k in ("on", "on_before") if k in lg]:
            what = "--log-requests" + (" (baseline src)" if label == "on_before" else "")
            ratios = lg[label]["round_ratios"]
            md.append(f"| {what} at c={a.concurrency}, median of {lg['rounds']} rounds | cost {lg[label]['cost_pct']:+.1f}% "
                      f"(per-round throughput ratios {ratios[0]:.2f}..{ratios[-1]:.2f}); HTTP process "
                      f"{lg[label]['http_cpu_ms_per_request']:.2f} CPU ms/request (off: "
                      f"{lg['off']['http_cpu_ms_per_request']:.2f}) | <= 5% |")
    if "log_cpu" in r:
        for label, us in r["log_cpu"]["us_per_exchange"].items():
            md.append(f"| serving-process CPU per logged exchange ({label}), 400 at 100/s, median of 5 | "
                      f"{us:.0f} us | - |")
    report["targets"] = targets
    report["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    (a.out / "bench_ops.json").write_text(json.dumps(report, indent=2))
    md += ["", f"targets: {targets}", f"load average before/after: {load_before} / {os.getloadavg()}"]
    (a.out / "bench_ops.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
