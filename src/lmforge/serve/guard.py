"""What keeps one client from hurting another: limits checked before any work is done for a request.

* `ServerLimits` (defined in `config.py`, with the rest of the server's settings): every limit in one
  place, with the defaults `lmforge serve` uses (docs/serving.md lists them with their flags).
* `GuardMiddleware` (pure ASGI, outermost): the API key is checked from the headers before a byte of
  the body is read; a POST body is read here, in full, under a size limit (413) and a per-read
  timeout (408, so a slow client cannot hold a connection forever), then replayed to the app. No
  handler ever sees a body larger than the limit, so nothing downstream can be made to allocate
  gigabytes.
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
from .config import ServerLimits
from .errors import OpenAIError, bad_request

AUTH_PREFIXES = ("/v1/", "/admin/")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")


def _json_error(status: int, message: str, code: str, headers: dict[str, str] | None = None):
    body = json.dumps(OpenAIError(status, message, None, code).body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return body, head


class GuardMiddleware:
    """Auth first, then the body under a size limit and a read timeout; counts what it refuses."""

    def __init__(self, app, api_key: str | None, limits: ServerLimits, max_model_len_fn, on_error=None):
        self.app, self.api_key, self.limits = app, api_key, limits
        self.max_model_len_fn, self.on_error = max_model_len_fn, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith(AUTH_PREFIXES) and not self._authorized(scope):
            return await self._refuse(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      "invalid_api_key", {"www-authenticate": "Bearer"})
        if scope["method"].encode() not in BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = self.limits.body_limit(self.max_model_len_fn())
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _drain(receive, limit)
            return await self._refuse(send, 413, f"the request body ({int(declared)} bytes) is larger than this "
                                      f"server's limit ({limit} bytes, --max-body-bytes)", "body_too_large")
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.limits.read_timeout_s)
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within "
                                          f"{self.limits.read_timeout_s:g} s (--read-timeout)", "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                if message.get("more_body", False):
                    await _drain(receive, limit)
                return await self._refuse(send, 413, f"the request body is larger than this server's limit "
                                          f"({limit} bytes, --max-body-bytes)", "body_too_large")
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect a handler may wait for

        return await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        auth = (_header(scope, b"authorization") or "").strip()
        scheme, _, token = auth.partition(" ")
        # constant time: the comparison must not tell an attacker how much of a guess was right
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _refuse(self, send, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        if self.on_error is not None:
            self.on_error(status)
        body, head = _json_error(status, message, code, headers)
        if status in (408, 413):
            head.append((b"connection", b"close"))  # the rest of the body is not worth reading
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive, limit: int, max_s: float = 1.0) -> None:
    """Read and drop what is left of a refused body, up to 2 x `limit` more bytes or `max_s` seconds,
    before the 413 goes out. The connection is closed after the reply, and a socket closed with
    unread bytes in its receive buffer sends a reset, which can destroy the reply before the client
    has read it (a client that overshoots the limit a little then sees 'connection closed' instead
    of the 413). A body far over the limit still gets its 413 after at most `max_s`."""
    deadline, left = asyncio.get_running_loop().time() + max_s, 2 * limit
    while left > 0:
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        left -= len(message.get("body", b""))


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
