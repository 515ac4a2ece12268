"""`lmforge bench serve --against URL`: the same streamed workload against lmforge's server and another
OpenAI-compatible one, per concurrency, ratios in one report. The other server here is a stand-in
that behaves as llama.cpp's `llama-server` does where it differs from lmforge: no stream usage (tokens
are counted one a chunk), no vLLM metrics, no max_model_len in /v1/models."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread


def _other_server() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "other.gguf", "object": "model"}]}

    @app.get("/metrics")
    def metrics():
        return JSONResponse({"error": "metrics disabled"}, status_code=501)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)

        async def stream():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def servers(chat_model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256))
    other = _other_server()
    with ServerThread(build_app(eng, ServerConfig("tiny"))) as ours, ServerThread(other) as theirs:
        yield ours, theirs, other
    eng.shutdown()


def test_against_runs_one_workload_on_both_and_reports_ratios(servers, tmp_path):
    ours, theirs, other = servers
    cmd = [sys.executable, "-c", "from lmforge.bench.commands import app; app()", "serve",
           "--base-url", ours.url, "--against", theirs.url, "--concurrency", "1,4", "--num-prompts", "6",
           "--workload", "uniform", "--input-len", "24", "--output-len", "8", "--out", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "against.json").read_text())
    assert report["config"]["models"] == {"lmforge": "tiny", "against": "other.gguf"}
    for side in ("lmforge", "against"):
        for c in ("1", "4"):
            run = report["runs"][side][c]
            assert run["completed"] == 6 and run["failed"] == 0 and run["output_tokens"] == 48
            assert run["ttft_ms"]["p50"] > 0
    assert len(other.state.bodies) == 12  # 6 requests at each concurrency, the same prompts both times
    prompts = [sorted(b["prompt"] for b in other.state.bodies[i:i + 6]) for i in (0, 6)]
    assert prompts[0] == prompts[1] and len(prompts[0][0]) == 24
    r = report["ratios"]["4"]
    want = report["runs"]["lmforge"]["4"]["output_throughput"] / report["runs"]["against"]["4"]["output_throughput"]
    assert r["output_throughput"] == pytest.approx(want)
    md = (tmp_path / "against.md").read_text()
    assert "| c | lmforge tok/s | other tok/s |" in md and report["provenance"]["cpus"] >= 1
    assert "against" in proc.stdout


def test_against_refuses_a_bad_concurrency_list(servers):
    ours, theirs, _ = servers
    cmd = [sys.executable, "-c", "from lmforge.bench.commands import app; app()", "serve",
           "--base-url", ours.url, "--against", theirs.url, "--concurrency", "1,x", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--concurrency '1,x'" in proc.stderr
