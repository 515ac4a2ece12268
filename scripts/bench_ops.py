"""The operations targets of issue 15, measured against a real `lmforge serve --registry`:

    python scripts/bench_ops.py --out runs/bench-ops [--num-prompts 96] [--concurrency 32]

1. reload: `lmforge bench serve` at concurrency C runs while version 2 is promoted and
   `POST /admin/reload` swaps it in, then while `registry rollback` + reload swap back: failed
   requests must be 0, and the rolled-back champion's files hash byte-identically;
2. canary: a server with the challenger at 50%, 1,000 requests with random `user`s (and 50 users
   asking 5 times each): the challenger's share within +-3 points, no sticky user switching;
3. request logging: `bench serve` at concurrency C with and without `--log-requests`: the
   throughput cost (target <= 5%).

Builds two tiny random models (same shapes, different weights) and a registry in a temp folder
unless `--model-a/--model-b` are given. Writes bench_ops.json and bench_ops.md with machine,
versions and load average. Loopback only; every loop bounded.
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
from lmforge.serve.bench import BenchConfig, bench_serve  # noqa: E402
from lmforge.serve.testing import spawn_server, stop_server  # noqa: E402

KEY = "bench-ops-key"


def start(args: list[str], port: int):
    return spawn_server([*args, "--log-level", "warning", "--api-key", KEY, "--max-model-len", "512"], port)


stop = stop_server


def bench(url: str, n: int, c: int, seed: int) -> dict:
    cfg = BenchConfig(url, None, n, float("inf"), c, "uniform", 64, 32, seed, {}, KEY, None, "auto", False)
    return bench_serve(cfg)["client"]


def reload(url: str) -> dict:
    r = httpx.post(url + "/admin/reload", headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
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
    reg = Registry(reg_path)
    reg.set_alias(name, "challenger", 2)
    proc = start(["--registry", str(reg_path), "--model", name, "--canary", "50"], port)
    rng = random.Random(0)
    try:
        seen: dict[str, int] = {}
        switches = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            for i in range(1000):
                r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1,
                                                         "user": f"anon-{rng.random()}"})
                v = r.headers["x-lmforge-model-version"]
                seen[v] = seen.get(v, 0) + 1
            for u in range(50):
                versions = {client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1,
                                                                 "user": f"user-{u}"}).headers["x-lmforge-model-version"]
                            for _ in range(5)}
                switches += len(versions) > 1
        return {"requests": 1000, "per_version": seen, "challenger_share_pct": 100 * seen.get("2", 0) / 1000,
                "sticky_users": 50, "users_that_switched": switches}
    finally:
        stop(proc)
        reg.delete_alias(name, "challenger")


def phase_logging(model: str, port: int, n: int, c: int, feedback_db: Path, rounds: int = 3) -> dict:
    """Servers with and without --log-requests, alternated `rounds` times (so a load change on a shared
    machine hits both), best throughput of each kept: the cost is 1 - on / off."""
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for label, extra in (("off", []), ("on", ["--log-requests", "--feedback-db", str(feedback_db)])):
            proc = start([model, *extra], port)
            try:
                bench(url, max(c, 16), c, seed=1)  # warm-up
                runs[label] += [bench(url, n, c, seed=3 + i)["output_throughput"] for i in range(2)]
            finally:
                stop(proc)
    out = {"off": max(runs["off"]), "on": max(runs["on"]), "runs": runs}
    out["cost_pct"] = 100 * (1 - out["on"] / out["off"])
    return out


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
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-ops"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-ops-"))
    model_a, model_b = (a.model_a, a.model_b) if a.model_a else tiny_models(tmp)
    reg_path = tmp / "registry.db"
    reg = Registry(reg_path)
    reg.add("m", model_a, notes="v1")
    reg.add("m", model_b, notes="v2")
    load_before = os.getloadavg()
    report = {"reload": phase_reload(reg_path, "m", a.port, a.num_prompts, a.concurrency),
              "canary": phase_canary(reg_path, "m", a.port),
              "logging": phase_logging(model_a, a.port, a.num_prompts, a.concurrency, tmp / "fb.db")}
    r = report
    report["targets"] = {
        "zero_failed_during_reload": r["reload"]["promote"]["failed"] == 0 and r["reload"]["rollback"]["failed"] == 0,
        "canary_within_3_points": abs(r["canary"]["challenger_share_pct"] - 50) <= 3,
        "sticky_users_never_switch": r["canary"]["users_that_switched"] == 0,
        "logging_cost_at_most_5pct": r["logging"]["cost_pct"] <= 5,
    }
    report["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    (a.out / "bench_ops.json").write_text(json.dumps(report, indent=2))
    md = [f"| check | figure | target |", "| --- | --- | --- |",
          f"| reload (promote) under bench serve c={a.concurrency} | {r['reload']['promote']['failed']} failed of "
          f"{r['reload']['promote']['completed']} completed | 0 failed |",
          f"| reload (rollback) under bench serve c={a.concurrency} | {r['reload']['rollback']['failed']} failed of "
          f"{r['reload']['rollback']['completed']} completed | 0 failed |",
          f"| canary 50% over 1,000 requests | challenger {r['canary']['challenger_share_pct']:.1f}% | 47-53% |",
          f"| sticky users (50 x 5 requests) | {r['canary']['users_that_switched']} switched | 0 |",
          f"| --log-requests at c={a.concurrency} | {r['logging']['on']:.1f} vs {r['logging']['off']:.1f} tok/s "
          f"({r['logging']['cost_pct']:+.1f}% cost) | <= 5% |",
          "", f"targets: {report['targets']}", f"load average before/after: {load_before} / {os.getloadavg()}"]
    (a.out / "bench_ops.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
