"""What committing each exchange before its answer costs in latency (issue 43): one in-process server with
`--log-requests`, rounds alternating between the shipped behaviour (`OpenAIServing._durable` awaits the
commit) and the wait skipped, at concurrency 1 and 8; p50 / p90 / mean latency per mode and concurrency.

    python scripts/exchange_log_durable_cost.py MODEL_DIR [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.registry import FeedbackStore
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.serving_engine import OpenAIServing
from lmforge.serve.testing import ServerThread


async def _skip(self, job) -> None:  # the answer goes out without waiting for its commit
    return None


async def burst(url: str, c: int, n: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(i: int) -> float:
            t = time.perf_counter()
            r = await client.post("/v1/completions", json={"prompt": f"q {i} a@b.example", "max_tokens": 4})
            r.raise_for_status()
            return time.perf_counter() - t

        out: list[float] = []
        for k in range(0, n, c):
            out += await asyncio.gather(*(one(k + j) for j in range(c)))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    durable = OpenAIServing._durable
    store = FeedbackStore(Path(tempfile.mkdtemp()) / "fb.db")
    app = build_app(lambda: AsyncLLMEngine(EngineConfig(model=a.model_dir, dtype="float32", max_model_len=256)),
                    ServerConfig("tiny", feedback=store, log_requests=True))
    res: dict[str, dict[int, list[float]]] = {"wait": {1: [], 8: []}, "no_wait": {1: [], 8: []}}
    with ServerThread(app) as srv:
        while httpx.get(srv.url + "/health/ready").status_code != 200:
            time.sleep(0.1)
        asyncio.run(burst(srv.url, 8, 32))  # warm-up
        for rnd in range(a.rounds):
            for mode in (("wait", "no_wait") if rnd % 2 == 0 else ("no_wait", "wait")):
                OpenAIServing._durable = durable if mode == "wait" else _skip
                for c in (1, 8):
                    res[mode][c] += asyncio.run(burst(srv.url, c, 24 if c == 1 else 48))
    OpenAIServing._durable = durable
    out = {}
    for mode, by_c in res.items():
        for c, xs in by_c.items():
            ms = sorted(1000 * x for x in xs)
            out[f"{mode}_c{c}"] = {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
                                   "p90_ms": round(ms[int(0.9 * len(ms))], 2), "mean_ms": round(statistics.mean(ms), 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
