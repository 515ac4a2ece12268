"""What keeps one client from hurting another: limits checked before any work is done for a request.

* `ServerLimits` (defined in `config.py`, with the rest of the server's settings): every limit in one
  place, with the defaults `lmforge serve` uses (docs/serving.md lists them with their flags).
* `GuardMiddleware` (pure ASGI, outermost): the keys are checked from the headers before a byte of
  the body is read (`/v1/*` the API key; `/admin/*` and the runtime LoRA endpoints their own admin
  key, off without one, and a rate per client address); a POST body is read here, in full, under a size limit (413), a per-read and
  a whole-body deadline (408, so a slow client cannot hold a connection forever), then replayed to
  the app. No handler ever sees a body larger than the limit, so nothing downstream can be made to
  allocate gigabytes. The connection-level limits (header deadline, idle timeout, connection cap,
  lingering close) are `connection.py`'s.
* `Admission`: sequences admitted but without a first token yet, checked and reserved in one
  synchronous step (no await between the check and the count, so a burst cannot slip past
  `--max-waiting`).
* `min_tokens_for`: a lower bound on a text's token count from its length alone, so a prompt that
  cannot fit the context is refused without tokenizing it.
* `check_text`: a lone UTF-16 surrogate (valid JSON, not valid Unicode text) is a 400, not a
  tokenizer exception.

Knows nothing about the engine or the OpenAI endpoints beyond their paths.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from .config import ServerLimits
from .errors import OpenAIError, bad_request

V1_PREFIX, ADMIN_PREFIX = "/v1/", "/admin/"
# /v1 paths that change what is served (vLLM's runtime LoRA endpoints): the admin key, as /admin/*
ADMIN_V1_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")


def _json_error(status: int, message: str, code: str, headers: dict[str, str] | None = None):
    body = json.dumps(OpenAIError(status, message, None, code).body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return body, head


class GuardMiddleware:
    """Keys and rates first (from the headers, before a byte of the body), then the body under a size
    limit, a per-read and a whole-body deadline; counts what it refuses. Every refusal closes the
    connection, and the lingering close (`connection.py`) lets a client still sending read it."""

    def __init__(self, app, api_key: str | None, limits: ServerLimits, max_model_len_fn, on_error=None,
                 admin_api_key: str | None = None):
        self.app, self.api_key, self.admin_api_key, self.limits = app, api_key, admin_api_key, limits
        self.max_model_len_fn, self.on_error = max_model_len_fn, on_error
        self.admin_rate = RateLimiter(limits.admin_requests_per_minute)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check_headers(scope)
        if refusal is not None:
            return await self._refuse(send, *refusal)
        if scope["method"].encode() not in BODY_METHODS:
            return await self.app(scope, receive, send)
        body = await self._read_body(scope, receive, send)
        if body is None:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect a handler may wait for

        return await self.app(scope, replay, send)

    def _check_headers(self, scope) -> tuple | None:
        """(status, message, code[, headers]) of a refusal decided from the headers alone, or None."""
        path = scope["path"]
        if path.startswith(ADMIN_PREFIX) or path.rstrip("/") in ADMIN_V1_PATHS:
            client = (scope.get("client") or ("?",))[0]
            wait = self.admin_rate.take(client)
            if wait > 0:
                return (429, f"too many admin requests from {client} (at most "
                        f"{self.limits.admin_requests_per_minute} a minute); retry in {wait:.0f} s",
                        "rate_limit_exceeded", {"retry-after": str(max(1, round(wait)))})
            if self.admin_api_key is None:
                return 403, "admin endpoints are off: start the server with --admin-api-key", "forbidden"
            if not _bearer_matches(scope, self.admin_api_key):
                return (401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>' "
                        "(--admin-api-key; the inference key does not open /admin/*)", "invalid_api_key",
                        {"www-authenticate": "Bearer"})
        elif self.api_key is not None and path.startswith(V1_PREFIX) and not _bearer_matches(scope, self.api_key):
            return (401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "invalid_api_key",
                    {"www-authenticate": "Bearer"})
        return None

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a refusal (413, 408) is sent or the client has gone."""
        limits = self.limits
        limit = limits.body_limit(self.max_model_len_fn())
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, 413, f"the request body ({int(declared)} bytes) is larger than this "
                                      f"server's limit ({limit} bytes, --max-body-bytes)", "body_too_large")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        chunks, size, more = [], 0, True
        while more:
            wait = min(limits.read_timeout_s, deadline - loop.time())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0))
            except asyncio.TimeoutError:
                which = ("--read-timeout: no byte for {:g} s".format(limits.read_timeout_s)
                         if wait == limits.read_timeout_s else
                         "--body-timeout: the whole body within {:g} s".format(limits.body_timeout_s))
                return await self._refuse(send, 408, f"the request body did not arrive in time ({which})",
                                          "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, 413, f"the request body is larger than this server's limit "
                                          f"({limit} bytes, --max-body-bytes)", "body_too_large")
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _refuse(self, send, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        if self.on_error is not None:
            self.on_error(status)
        body, head = _json_error(status, message, code, headers)
        # the rest of the body is not worth reading: close (lingering, so the client still reads this)
        head.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})
        return None


def _bearer_matches(scope, key: str) -> bool:
    auth = (_header(scope, b"authorization") or "").strip()
    scheme, _, token = auth.partition(" ")
    # constant time: the comparison must not tell an attacker how much of a guess was right; an empty key
    # (refused by ServerConfig) never matches, so `Bearer ` with nothing after it opens nothing
    return bool(key) and scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class RateLimiter:
    """A token bucket per client address: `per_minute` requests a minute, a burst of at most that many.
    `take(client)` spends one and returns 0, or the seconds until one is free. At most `max_clients`
    addresses are remembered (the oldest forgotten), so a scan of addresses cannot grow it."""

    def __init__(self, per_minute: int, max_clients: int = 4096, clock=time.monotonic):
        self.rate, self.burst, self.max_clients, self.clock = per_minute / 60.0, float(per_minute), max_clients, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def take(self, client: str) -> float:
        now = self.clock()
        tokens, when = self.buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if len(self.buckets) >= self.max_clients:
            self.buckets.pop(next(iter(self.buckets)))
        if tokens < 1:
            self.buckets[client] = (tokens, now)
            return (1 - tokens) / self.rate
        self.buckets[client] = (tokens - 1, now)
        return 0.0


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class Admission:
    """Sequences admitted whose first token has not arrived. `reserve` checks and counts at once."""

    def __init__(self, limit: int | None):
        self.limit, self.waiting = limit, 0

    def reserve(self, sequences: int) -> Ticket:
        if self.limit is not None:
            if sequences > self.limit:
                raise bad_request(f"this request needs {sequences} sequences (prompts x n) but the server admits "
                                  f"at most {self.limit} at once (--max-waiting); send fewer prompts or a smaller n",
                                  "n", "too_many_sequences")
            if self.waiting + sequences > self.limit:
                raise OpenAIError(429, f"the server's waiting queue is full ({self.waiting} sequences waiting, "
                                  f"--max-waiting {self.limit}); retry later", None, "queue_full")
        self.waiting += sequences
        return Ticket(self, sequences)


class Ticket:
    """One request's share of `Admission.waiting`; released per sequence as first tokens arrive, and
    whatever is left when the request ends (release is idempotent)."""

    __slots__ = ("admission", "left")

    def __init__(self, admission: Admission, sequences: int):
        self.admission, self.left = admission, sequences

    def release(self, k: int | None = None) -> None:
        k = self.left if k is None else min(k, self.left)
        self.left -= k
        self.admission.waiting -= k


def max_chars_per_token(tokenizer) -> int:
    """The longest token's text, in characters. For byte-level BPE a token character stands for one
    byte and a text character is at least one byte, so len(text) / this <= the number of tokens; for
    other tokenizers byte-fallback tokens (`<0xE3>`) make this larger than needed, which only makes
    the bound looser."""
    vocab = tokenizer.get_vocab()
    return max([len(t) for t in vocab] + [1])


def min_tokens_for(text: str, chars_per_token: int) -> int:
    return -(-len(text) // chars_per_token)


def check_text(text: str, param: str) -> None:
    """JSON can carry a lone surrogate (\\ud800); UTF-8 cannot, and tokenizers refuse it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} is not valid Unicode text: a lone UTF-16 surrogate at character {e.start} "
                          f"({text[e.start]!r}); send well-formed UTF-8", param, "invalid_text") from None
