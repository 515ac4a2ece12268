"""Every bad request gets its answer, and no client holds the server's connections (issue 24, findings
1, 5, 6 and 7), through real sockets, async `httpx` clients and the `openai` client:

* an early refusal (413, 408, 401, 429) reaches a client that is still sending its body (lingering close);
* a body or headers trickling in are cut at a deadline, idle connections are closed, and connections
  past the cap are answered 503;
* `/admin/*` needs its own key, is off without one and is rate-limited;
* fields that would change an answer's meaning are honoured or refused with a 400 naming them.

    python -m pytest -q tests/test_serve_limits.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig, ServerLimits
from lmforge.serve.testing import ServerThread

MODEL, C, CHAT = "tiny", "/v1/completions", "/v1/chat/completions"
LIMIT = 256 * 1024
LIMITS = ServerLimits(max_body_bytes=LIMIT, read_timeout_s=1.0, body_timeout_s=2.5, header_timeout_s=1.5,
                      keep_alive_timeout_s=1.0, max_connections=24, admin_requests_per_minute=3)


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256,
                                      num_kv_blocks=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL, limits=LIMITS))) as srv:
        yield srv


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


# ---- 1. lingering close: the refusal reaches a client that is still sending ------------------------------


async def _post_big(c: httpx.AsyncClient, size: int, chunked: bool, headers: dict | None = None) -> httpx.Response:
    body = b'{"prompt": "' + b"x" * size + b'"}'
    if not chunked:
        return await c.post(C, content=body, headers={"content-type": "application/json", **(headers or {})})

    async def pieces():
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    return await c.post(C, content=pieces(), headers={"content-type": "application/json", **(headers or {})})


def test_oversize_bodies_from_concurrent_async_clients_all_read_their_413(server):
    sizes = [int(LIMIT * f) for f in (1.5, 2, 3, 5, 8, 10)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            jobs = [_post_big(c, size, chunked) for size in sizes for chunked in (False, True)]
            return await asyncio.gather(*jobs, return_exceptions=True)

    for _ in range(2):
        results = asyncio.run(main())
        lost = [r for r in results if not isinstance(r, httpx.Response)]
        assert not lost, f"{len(lost)} of {len(results)} clients lost their answer: {lost[:3]}"
        assert all(r.status_code == 413 and r.json()["error"]["code"] == "body_too_large" for r in results)
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_unauthenticated_client_still_sending_reads_its_401(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL, api_key="k", limits=LIMITS))) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                return await asyncio.gather(*(_post_big(c, int(LIMIT * 0.9), chunked) for chunked in (False, True)
                                              for _ in range(4)), return_exceptions=True)

        results = asyncio.run(main())
        assert all(isinstance(r, httpx.Response) and r.status_code == 401 for r in results), results


# ---- 7. slow and idle clients ----------------------------------------------------------------------------


def _trickle(port: int, head: bytes, body: bytes, every_s: float) -> tuple[bytes, float]:
    """Send `head` at once, then `body` a byte every `every_s`; the reply and when it came."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head)
        t0, stop = time.monotonic(), threading.Event()

        def drip():
            for b in body:
                if stop.wait(every_s):
                    return
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    return

        threading.Thread(target=drip, daemon=True).start()
        reply = _read_all(s)
        stop.set()
        return reply, time.monotonic() - t0


def test_a_body_trickling_under_the_read_timeout_is_cut_at_the_body_deadline(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    reply, took = _trickle(server.port, head, b'{"prompt": "' + b"a" * 180 + b'"}', every_s=0.25)
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply
    assert LIMITS.body_timeout_s - 0.5 < took < LIMITS.body_timeout_s + 3


def test_headers_trickling_in_are_cut_at_the_header_deadline(server):
    reply, took = _trickle(server.port, b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200,
                           every_s=0.2)
    assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply
    assert took < LIMITS.header_timeout_s + 3


def test_idle_connections_are_closed_and_the_cap_answers_503(server):
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = _read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"--max-connections" in reply
        t0 = time.monotonic()
        for s in socks:  # none of them sent a byte: each is closed at the header deadline
            s.recv(65536)  # the 408, or b"" once closed
            assert s.recv(65536) == b""
        assert time.monotonic() - t0 < LIMITS.header_timeout_s + 3
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert httpx.get(server.url + "/health").status_code == 200  # the slots are free again


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or len(first.split(b"\r\n\r\n", 1)[1]) < _content_length(first):
            first += s.recv(65536)  # headers and body may come in separate reads
        t0 = time.monotonic()
        rest = _read_all(s)  # returns when the server closes the idle connection
    assert first.startswith(b"HTTP/1.1 200") and rest == b""
    assert time.monotonic() - t0 < LIMITS.keep_alive_timeout_s + 2


# ---- 5. administration has its own key, is off without it, and is rate-limited ---------------------------


def test_admin_needs_its_own_key_and_is_rate_limited(engine):
    def reloader():  # what the registry says is what runs: nothing to change
        return {"champion": ("local", None, "unused")}

    from lmforge.serve.config import VersionsConfig

    with pytest.raises(ValueError, match="admin_api_key must differ"):
        ServerConfig(MODEL, api_key="same", admin_api_key="same")
    with ServerThread(build_app(engine, ServerConfig(MODEL, api_key="user-key", limits=LIMITS))) as srv:
        r = httpx.post(srv.url + "/admin/reload", headers={"Authorization": "Bearer user-key"})
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]  # off without a key
    config = ServerConfig(MODEL, api_key="user-key", admin_api_key="admin-key", limits=LIMITS,
                          versions=VersionsConfig(reloader=reloader))
    with ServerThread(build_app(engine, config)) as srv:
        user = httpx.post(srv.url + "/admin/reload", headers={"Authorization": "Bearer user-key"})
        assert user.status_code == 401  # the inference key does not administer
        ok = httpx.post(srv.url + "/admin/reload", headers={"Authorization": "Bearer admin-key"})
        assert ok.status_code == 200 and ok.json()["changed"] == {}, ok.text
        statuses = [httpx.post(srv.url + "/admin/reload", headers={"Authorization": "Bearer admin-key"}).status_code
                    for _ in range(3)]
        assert statuses == [200, 429, 429]  # 3 a minute, failed attempts counted too
        late = httpx.post(srv.url + "/admin/reload", headers={"Authorization": "Bearer admin-key"})
        assert int(late.headers["retry-after"]) >= 1 and late.json()["error"]["code"] == "rate_limit_exceeded"
        inference = httpx.post(srv.url + C, json={"prompt": "hi", "max_tokens": 2},
                               headers={"Authorization": "Bearer user-key"})
        assert inference.status_code == 200  # the admin rate does not touch /v1/*


# ---- 6. fields that change an answer's meaning are honoured or refused, by name ------------------------


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # tools are served (test_serve_tools.py), but none were sent
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"logit_bias": {"5": 1e30}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"user": "u" * 100_000}, "user"),
])
def test_chat_fields_that_would_be_ignored_are_refused_by_name(server, extra, param):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "hi"},  # tool messages are served, the legacy function_call is not
      {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
     "messages[1].function_call"),
])
def test_message_parts_the_model_cannot_read_are_refused_by_name(server, messages, param):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert e.value.body["param"] == param, e.value.body


def test_completions_refuse_best_of_and_accept_harmless_fields(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        tool_choice="none", extra_body={"store": False, "modalities": ["text"],
                                                                        "metadata": {"a": "b"}})
    assert ok.choices[0].message.content is not None


@pytest.mark.parametrize("score, why", [("1", "JSON number"), (float("nan"), "finite"), (True, "JSON number")])
def test_feedback_scores_must_be_real_numbers(server, score, why):
    body = json.dumps({"id": "cmpl-x", "score": score})  # NaN is written as the token NaN, which Python reads
    r = httpx.post(server.url + "/v1/feedback", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "score" and why in r.json()["error"]["message"]


def test_lingering_close_of_a_connection_the_client_already_reset_just_closes():
    """A refusal's lingering close on a socket whose client reset it meanwhile: `shutdown(SHUT_WR)` fails with
    ENOTCONN. Before, that OSError escaped `transport.close()` into the app: a 500, "Exception in ASGI
    application" and two tracebacks in the log for a client that was gone (nine in a 30-minute soak, 2026-12-06).
    Now the socket is closed and nothing is raised or left lingering."""
    from lmforge.serve.connection import LingeringTransport

    class Reset:  # an asyncio transport whose peer has reset the connection
        closed = False

        def is_closing(self) -> bool:
            return self.closed

        def can_write_eof(self) -> bool:
            return True

        def write_eof(self) -> None:
            raise OSError(107, "Transport endpoint is not connected")

        def close(self) -> None:
            self.closed = True

    class Protocol:  # a request whose body was still coming when it was refused
        limits = LIMITS

        def client_may_be_sending(self) -> bool:
            return True

    real = Reset()
    t = LingeringTransport(real, Protocol())
    t.close()  # raised OSError before the fix
    assert real.closed and not t.lingering
    t.close()  # closing twice stays a no-op
    assert real.closed
