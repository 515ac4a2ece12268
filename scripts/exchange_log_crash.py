"""How many answered exchanges a `kill -9` of `lmforge serve --log-requests` loses (issue 24, finding 9).

Per trial: a fresh server on MODEL_DIR (engine in its own process, as by default), N completions
answered 200 one after another, `--wait` seconds, SIGKILL to the server's pid only, then the
writer process is left to read the pipe to its end and exit; the rows in the feedback store are
counted. Prints one line per trial and a JSON summary (`lost` per trial).

    python scripts/exchange_log_crash.py MODEL_DIR [--trials 5] [-n 20] [--wait 0]

Run it with `PYTHONPATH=OTHER/src` to measure another checkout's serve code (the "before").
Every wait is bounded; the server's children are killed if they outlive it by 30 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from lmforge.registry import FeedbackStore
from lmforge.serve.testing import free_port


def trial(model: str, n: int, wait_s: float) -> int:
    db, port = Path(tempfile.mkdtemp()) / "fb.db", free_port()
    log = tempfile.TemporaryFile("w+")  # never a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", model, "--port", str(port),
                             "--log-requests", "--feedback-db", str(db), "--dtype", "float32",
                             "--max-model-len", "256", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            log.seek(0)
            raise SystemExit(f"the server did not get ready: {log.read()[-2000:]}")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children(recursive=True)
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(n):
            c.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4}).raise_for_status()
    time.sleep(wait_s)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        p.kill()
    return n - len(list(FeedbackStore(db, create=False).exchanges()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("-n", type=int, default=20, help="completions answered before the kill")
    ap.add_argument("--wait", type=float, default=0.0, help="seconds between the last answer and the kill")
    a = ap.parse_args()
    lost = []
    for t in range(a.trials):
        lost.append(trial(a.model_dir, a.n, a.wait))
        print(f"trial {t}: lost {lost[-1]} of {a.n}", flush=True)
    print(json.dumps({"n": a.n, "trials": a.trials, "wait_s": a.wait, "lost": lost}))


if __name__ == "__main__":
    main()
