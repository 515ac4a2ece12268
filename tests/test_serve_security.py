"""Issue 43 (reliability and security, round 4), the serving side: an empty key opens nothing, no request
content reaches a log line, adapters are checked and named safely, every bad file or flag is one clear line.

    python -m pytest -q tests/test_serve_security.py
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.guard import _bearer_matches
from lmforge.serve.testing import ServerThread, free_port

MODEL = "tiny"


# ---- empty keys: refused at startup, never matched --------------------------------------------------------


@pytest.mark.parametrize("flag", ["--api-key", "--admin-api-key"])
def test_an_empty_key_is_refused_at_startup_naming_its_flag(chat_model_dir, flag):
    # a process with a deadline: before the fix the server started and served with the empty key
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "serve", str(chat_model_dir), flag, "",
                        "--allow-runtime-lora-updating", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and flag in r.stderr and "empty" in r.stderr, r.stderr[-2000:]


def test_an_empty_key_is_refused_by_the_config_and_never_matches():
    for field in ("api_key", "admin_api_key"):
        for value in ("", "  ", "\t"):
            with pytest.raises(ValueError, match=field):
                ServerConfig("tiny", **{field: value})
    empty_bearer = {"headers": [(b"authorization", b"Bearer ")]}
    assert not _bearer_matches(empty_bearer, "")
    assert not _bearer_matches({"headers": []}, "")
    assert _bearer_matches({"headers": [(b"authorization", b"bearer k")]}, "k")


# ---- malformed JSON is `invalid_json`, whatever breaks the parse -------------------------------------------


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256,
                                      num_kv_blocks=128))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL))) as srv:
        yield srv


@pytest.mark.parametrize("body", [
    b'{"prompt": ', b"not json", b'{"prompt": "x"} trailing',
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/feedback", "/tokenize"])
def test_malformed_json_is_invalid_json(server, path, body):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "invalid_json", (r.status_code, error)
    assert "JSON" in error["message"]
