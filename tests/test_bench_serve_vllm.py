"""`lmforge bench serve` under `vllm bench serve`'s names: --host/--port, --dataset-name random with
--random-input-len/--random-output-len, --ignore-eos, a ShareGPT --dataset-path with --tokenizer,
--save-result --result-dir; against a real server on a loopback port.

    python -m pytest -q tests/test_bench_serve_vllm.py
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from lmforge.bench.commands import app
from lmforge.bench.serve import BenchConfig, make_workload
from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread, free_port


@pytest.fixture(scope="module")
def server(chat_model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256))
    try:
        with ServerThread(build_app(engine, ServerConfig("tiny"))) as srv:
            yield srv
    finally:
        engine.shutdown()


def bench(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def test_vllm_random_dataset_names_and_save_result(server, tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_PROGRESS_S", "3600")  # off a terminal: only the final progress line
    url = urlparse(server.url)
    r = bench("--backend", "vllm", "--host", url.hostname, "--port", str(url.port), "--endpoint", "/v1/completions",
              "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "4",
              "--ignore-eos", "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
              "--result-filename", "run.json")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "run.json").read_text())
    assert (tmp_path / "run.md").is_file()
    c = report["client"]
    assert c["completed"] == 4 and c["failed"] == 0
    assert c["prompt_tokens"] == 4 * 24 and c["output_tokens"] == 4 * 6  # exactly the lengths asked for
    assert "bench serve: 4/4 req (100%)" in r.stderr


def test_sharegpt_dataset_is_sampled_as_vllm_does(server, chat_model_dir, tmp_path):
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Tell me about the city number {i} and its river, please."},
        {"from": "gpt", "value": "It has a river. " * (2 + i)}]} for i in range(6)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    convs.append({"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    r = bench("--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(data), "--tokenizer",
              str(chat_model_dir), "--num-prompts", "5", "--out", str(tmp_path / "out"), "--no-progress")
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "out" / "bench.json").read_text())["client"]
    want = make_workload(BenchConfig(server.url, num_prompts=5, workload="sharegpt", dataset_path=str(data),
                                     tokenizer=str(chat_model_dir)), 256)
    assert c["completed"] == 5 and c["output_tokens"] == sum(q.output_len for q in want)
    assert all(isinstance(q.prompt, str) and "city number" in q.prompt for q in want)  # the short pair is pruned


@pytest.mark.parametrize("args, code, says", [
    (["--dataset-name", "sharegpt"], 2, "--dataset-path"),
    (["--endpoint", "/v1/chat/completions"], 2, "use /v1/completions"),
    (["--backend", "tgi"], 2, "--backend tgi"),
    (["--result-dir", "x"], 2, "go with --save-result"),
    (["--dataset-name", "sonnet"], 2, "choose one of"),
])
def test_bad_vllm_names_exit_with_a_reason(args, code, says):
    r = bench(*args)
    assert r.exit_code == code and says in r.output, r.output


def test_no_server_names_where_it_looked():
    r = bench("--port", str(free_port()), "--num-prompts", "1", "--no-progress")
    assert r.exit_code == 1 and "is `lmforge serve` running there?" in r.output
