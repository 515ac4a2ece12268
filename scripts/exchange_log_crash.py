"""How many answered exchanges a `kill -9` of `lmforge serve --log-requests` loses (issue 24 finding 9,
issue 43), and what an answer costs in latency.

Per trial (`lmforge.serve.testing.kill9_trial`): a fresh server on MODEL_DIR (engine in its own process,
as by default), N completions answered by C concurrent clients, SIGKILL to the server's pid the moment
the last answer is read, its children left to finish; the answered ids found in the feedback store are
counted. Prints one line per trial and a JSON summary: `lost` per trial, and the answers' latency
(median and p99 over every trial, milliseconds).

    python scripts/exchange_log_crash.py MODEL_DIR [--trials 20] [-n 60] [--concurrency 8]

`--server-src OTHER/src` serves another checkout's code (the "before"; this script's own code stays).
Every wait is bounded; the server's children are killed if they outlive it by 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from lmforge.serve.testing import kill9_trial


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("-n", type=int, default=60, help="completions answered before the kill")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `lmforge serve` argument")
    ap.add_argument("--server-src", help="PYTHONPATH of the server (another checkout's src/)")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": a.server_src} if a.server_src else None
    lost, latency = [], []
    for t in range(a.trials):
        r = kill9_trial(a.model_dir, a.n, a.concurrency, ("--dtype", "float32", "--max-model-len", "256",
                                                          *a.serve_arg), env=env)
        lost.append(len(r["lost"]))
        latency += r["latency_s"]
        print(f"trial {t}: lost {lost[-1]} of {r['answered']} answered", flush=True)
    ms = sorted(1000 * x for x in latency)
    print(json.dumps({"n": a.n, "trials": a.trials, "concurrency": a.concurrency, "lost": lost,
                      "lost_total": sum(lost), "answered_total": a.n * a.trials,
                      "latency_ms_p50": round(statistics.median(ms), 1),
                      "latency_ms_p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1)}))


if __name__ == "__main__":
    main()
