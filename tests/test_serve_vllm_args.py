"""vLLM's launch names on `lmforge serve` (`serve/vllm_args.py`): a vLLM launch script runs with `lmforge serve`
swapped in, each vLLM flag an alias of lmforge's own setting, and the vLLM flags that mean nothing here
refused with a reason instead of ignored.

    python -m pytest -q tests/test_serve_vllm_args.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from lmforge.engine.config import kv_budget_for_utilization
from lmforge.serve.testing import free_port
from lmforge.serve.vllm_args import chat_template_text, speculative_config

GiB = 2**30


@pytest.fixture(scope="module")
def model_dir(chat_model_dir) -> Path:
    return chat_model_dir


def test_speculative_config_maps_onto_the_speculative_flags():
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}') == {
        "speculative_method": "ngram", "num_speculative_tokens": 5, "ngram_prompt_lookup_max": 3}
    assert speculative_config('{"model": "runs/draft", "num_speculative_tokens": 4}') == {
        "speculative_method": "draft", "num_speculative_tokens": 4, "speculative_model": "runs/draft"}
    assert speculative_config('{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}')[
        "speculative_method"] == "draft"


@pytest.mark.parametrize("text, says", [
    ('{"method": "eagle", "model": "e", "num_speculative_tokens": 3}', "method 'eagle' is not implemented"),
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}', "disable_by_batch_size not"),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 3}', "ngram takes no \"model\""),
    ("ngram", "not JSON"),
])
def test_speculative_config_refuses_what_it_cannot_honour(text, says):
    with pytest.raises(ValueError, match="--speculative-config") as e:
        speculative_config(text)
    assert says in str(e.value)


def test_chat_template_is_a_file_or_the_template_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_text(str(f)) == f.read_text()
    assert chat_template_text("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="no such file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    f.write_text("line one\n{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="line 2"):
        chat_template_text(str(f))


def test_gpu_memory_utilization_budgets():
    # CPU: the share of available memory, capped at what max_num_seqs full sequences fill
    assert kv_budget_for_utilization(0.5, cuda=False, total_bytes=64 * GiB, free_bytes=10 * GiB,
                                     weights_bytes=GiB, need_bytes=20 * GiB) == 5 * GiB
    assert kv_budget_for_utilization(0.5, cuda=False, total_bytes=64 * GiB, free_bytes=10 * GiB,
                                     weights_bytes=GiB, need_bytes=GiB) == GiB
    # CUDA, as vLLM: the share of the total, less the weights, 10% of the rest kept for activations
    assert kv_budget_for_utilization(0.5, cuda=True, total_bytes=80 * GiB, free_bytes=79 * GiB,
                                     weights_bytes=10 * GiB, need_bytes=1) == int(0.9 * 30 * GiB)
    with pytest.raises(ValueError, match="is free"):
        kv_budget_for_utilization(0.9, cuda=True, total_bytes=80 * GiB, free_bytes=40 * GiB, weights_bytes=0,
                                  need_bytes=1)
    with pytest.raises(ValueError, match="does not hold the weights"):
        kv_budget_for_utilization(0.1, cuda=True, total_bytes=80 * GiB, free_bytes=80 * GiB, weights_bytes=9 * GiB,
                                  need_bytes=1)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_budget_for_utilization(1.5, cuda=False, total_bytes=1, free_bytes=1, weights_bytes=0, need_bytes=1)


@pytest.mark.parametrize("args, says", [
    (["--quantization", "awq"], "--quantization awq: lmforge reads the scheme from the checkpoint"),
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size only"),
    (["--no-enable-chunked-prefill"], "always chunks"),
    (["--tokenizer", "/elsewhere"], "the tokenizer is read from the model folder"),
    (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'], "not implemented here"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--num-speculative-tokens", "3"],
     "pass one form"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1000000"], "pass one of them"),
    (["--chat-template", "no-such-template.jinja"], "no such file"),
    (["--swap-space", "4"], "No such option"),  # a vLLM flag with no alias at all: Click's own refusal
])
def test_vllm_flags_without_a_meaning_here_are_refused(model_dir, args, says):
    from lmforge.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", str(model_dir), *args])
    assert r.exit_code == 2 and says in r.output, r.output


def test_model_names_the_folder_once(model_dir, tmp_path):
    from lmforge.cli import app

    r = CliRunner().invoke(app, ["serve", str(model_dir), "--model", str(tmp_path)])
    assert r.exit_code == 2 and "name two models" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "--model" in r.output and "no such folder" in r.output


def _kv_bytes_per_token(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def test_a_vllm_launch_script_runs_with_lmforge_serve_swapped_in(model_dir, tmp_path):
    """The flags of a typical `vllm serve` launch script, unchanged; then the openai client, tools included."""
    from openai import OpenAI

    from lmforge.tokenizer import load_tokenizer

    template = tmp_path / "template.jinja"  # only the contents: no role headers, no generation prompt
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    port = free_port()
    cmd = [sys.executable, "-m", "lmforge.cli", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
           "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--chat-template", str(template),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code", "--enable-lora",
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--enforce-eager",
           "--disable-log-requests", "--enable-chunked-prefill", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="x")
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "call f"}],
                                           tools=tools, tool_choice="auto", max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=2)
        assert r.usage.prompt_tokens == len(load_tokenizer(model_dir).encode("Hello there", add_special_tokens=False))
        c = client.completions.create(model="tiny", prompt="a b a b a b a b", max_tokens=12, temperature=0)
        assert c.usage.completion_tokens >= 1
        metrics = httpx.get(url + "/metrics").text
        assert "vllm:spec_decode_num_drafts_total" in metrics  # the ngram speculative config is on
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # 0.5 of this machine's available memory is far more than 8 sequences of 512 tokens fill: capped there
    need = 8 * 512 * _kv_bytes_per_token(model_dir)
    assert f"a KV pool of {need / GiB:.3f} GiB" in err
    assert "--trust-remote-code: accepted; nothing remote runs" in err


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import time

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
