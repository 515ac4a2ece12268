"""`lmforge serve` as a process: it answers 503 then 200 on /health, serves a request, and on
SIGTERM stops accepting, lets the in-flight stream end, and exits 0.

    python -m pytest -q tests/test_serve_cli.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lmforge.serve.testing import free_port


def serve_cmd(*args: str) -> list[str]:
    """The serve verb as users run it: through the `lmforge` CLI."""
    return [sys.executable, "-m", "lmforge.cli", *args]


@pytest.fixture(scope="module")
def model_dir(chat_model_dir) -> Path:
    return chat_model_dir


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


def test_sigterm_finishes_in_flight_and_exits_zero(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(serve_cmd("serve", str(model_dir), "--port", str(port), "--served-model-name", "tiny",
                                      "--dtype", "float32", "--max-model-len", "256", "--shutdown-timeout", "20",
                                      "--kv-cache-dtype", "int8"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc)
        body = {"model": "tiny", "prompt": "The city of", "max_tokens": 60, "stream": True, "ignore_eos": True}
        chunks: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                chunks.extend(line for line in r.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        while not chunks and t.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0, proc.communicate()[1]
        assert chunks[-1] == "data: [DONE]" and len(chunks) == 60 + 1  # the stream ran to its end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_model_dir_exits_with_a_reason(tmp_path):
    proc = subprocess.run(serve_cmd("serve", str(tmp_path / "missing")), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_bad_engine_option_exits_2_naming_it(model_dir):
    proc = subprocess.run(serve_cmd("serve", str(model_dir), "--kv-cache-dtype", "fp4"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "kv_cache_dtype" in proc.stderr


def test_a_model_that_cannot_fit_is_refused_before_loading(tmp_path):
    """Only a 70B-shaped config.json, no weights: the pre-flight estimate refuses it (exit 2, what would fit)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192}))
    proc = subprocess.run(serve_cmd("serve", str(tmp_path), "--device", "cpu"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "pre-flight" in proc.stderr and "weights" in proc.stderr
