"""Issue 43 (reliability and security, round 4), the serving side: an empty key opens nothing, no request
content reaches a log line, adapters are checked and named safely, every bad file or flag is one clear line.

    python -m pytest -q tests/test_serve_security.py
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

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


# ---- no request content in any log line -------------------------------------------------------------------


MARK = "ssn 123-45-6789 marker-7f3a"


def test_no_request_content_reaches_a_log_line(server, caplog, monkeypatch):
    """A bug on the request path raises an exception quoting the prompt: the traceback is logged (types, files,
    lines), its message only as a length and a hash; the same in the engine's step and for 4xx answers."""
    from lmforge.engine.core import EngineCore
    from lmforge.serve import serving_completions
    from lmforge.serve.serving_engine import engine_error

    def boom(self, sv, req):
        raise RuntimeError(f"cannot handle {req.prompt!r}")

    uvicorn_lines: list[str] = []  # uvicorn's logger does not propagate to caplog: a handler of its own

    class Lines(logging.Handler):
        def emit(self, record):
            uvicorn_lines.append(self.format(record))

    handler = Lines()
    logging.getLogger("uvicorn.error").addHandler(handler)
    with caplog.at_level("DEBUG"):
        for path, body in (("/v1/completions", {"model": MARK, "prompt": "x"}),
                           ("/v1/completions", {"prompt": "x", "guided_regex": f"({MARK}"}),
                           ("/v1/chat/completions", {"messages": [{"role": "tool", "content": MARK}]})):
            assert httpx.post(server.url + path, json=body).status_code in (400, 404)
        assert httpx.get(server.url + f"/v1/models/{MARK}").status_code == 404
        monkeypatch.setattr(serving_completions.OpenAIServingCompletion, "build_job", boom)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": MARK, "max_tokens": 1})
        assert r.status_code == 500 and MARK not in r.text
        engine_error(KeyError(MARK))

        class Broken:  # an engine whose step raises with a request's text in the message
            requests = {"r1": None}

            def step(self):
                raise ValueError(f"bad text {MARK}")

            def stats(self):
                return {}

            def abort_request(self, rid):
                self.requests.pop(rid, None)

        assert EngineCore(Broken()).step().failure.request_ids == ["r1"]
    # the server's log lines (not this test's own http client's), and what uvicorn's handler printed
    logged = "\n".join(caplog.handler.format(r) for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))
    deadline = time.monotonic() + 10  # uvicorn logs the exception Starlette re-raises after the 500 went out
    while not uvicorn_lines and time.monotonic() < deadline:
        time.sleep(0.05)
    logging.getLogger("uvicorn.error").removeHandler(handler)
    logged += "\n".join(uvicorn_lines)
    assert "Exception in ASGI application" in logged  # uvicorn's own line, redacted by the filter
    assert "Traceback" in logged and "RuntimeError: <message redacted:" in logged and "ValueError" in logged
    assert "123-45-6789" not in logged and "marker-7f3a" not in logged, logged


def test_redacted_traceback_keeps_the_frames_and_hides_every_message():
    from lmforge.tools.redact import describe, redacted_traceback

    try:
        try:
            int(MARK)
        except ValueError as e:
            raise RuntimeError(f"wrapping {MARK}") from e
    except RuntimeError as e:
        text = redacted_traceback(e)
    assert "marker-7f3a" not in text and text.count("<message redacted:") == 2
    assert "int(MARK)" in text and "test_serve_security.py" in text and "builtins.ValueError" in text
    assert describe(MARK) == f"{len(MARK)} chars, sha256 {__import__('hashlib').sha256(MARK.encode()).hexdigest()[:8]}"


# ---- a bad GGUF file is one line and exit 2, before anything is served -------------------------------------


def test_serve_refuses_a_corrupt_gguf_with_one_line(chat_model_dir, tmp_path):
    """Issue 43: `lmforge serve f.gguf` printed a 28-line traceback and exited 1 once the port was open."""
    from lmforge.quant.gguf_export import export_gguf

    good = export_gguf(chat_model_dir, tmp_path / "m.gguf", "q8_0")["file"]
    data = open(good, "rb").read()
    for name, blob in (("truncated", data[:len(data) // 2]), ("magic", b"GGUX" + data[4:])):
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        r = subprocess.run([sys.executable, "-m", "lmforge.cli", "serve", str(bad), "--port", str(free_port())],
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and str(bad) in lines[0] and "GGUF" in lines[0], r.stderr[-3000:]
