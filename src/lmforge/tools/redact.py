"""What a log line may say about a request: never its content, only a length and a short hash of it.

A prompt, a grammar, a tool schema or an adapter's path sent by a client can hold personal data and
secrets, and server logs are kept, shipped and read far more widely than the exchange log (which masks
before it writes). So every log call that can see request content names it with `describe(text)`
(`"412 chars, sha256 3f1a2b4c"`: enough to tell two requests apart or match a client's report, nothing to
read), and a logged exception goes through `redacted_traceback(exc)`: the frames (file, line, function:
code, not data) with each exception's message replaced by its description, since messages quote values
(`ValueError: invalid literal for int() with base 10: '123-45-6789'`).

Knows nothing about requests or logging setups; pure functions of strings and exceptions.

    log.error("request failed:\\n%s", redacted_traceback(e))
"""

from __future__ import annotations

import hashlib
import logging
import traceback


def describe(text: str | bytes | None) -> str:
    """`N chars, sha256 XXXXXXXX` (bytes: `N bytes, ...`): a length and the first 8 hex digits of its hash."""
    if text is None:
        return "none"
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    unit = "bytes" if isinstance(text, bytes) else "chars"
    return f"{len(text)} {unit}, sha256 {hashlib.sha256(data).hexdigest()[:8]}"


def redacted_traceback(exc: BaseException) -> str:
    """The traceback `logging` would print for `exc` (its causes and contexts first), each message replaced
    by `describe(message)`; exception types, files, lines and source lines stay."""
    chain, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    parts = []
    for e in reversed(chain):
        if parts:
            parts.append("\nThe above exception led to the following:\n\n")
        parts.append("Traceback (most recent call last):\n" if e.__traceback__ is not None else "")
        parts.extend(traceback.format_tb(e.__traceback__))
        message = str(e)
        parts.append(f"{type(e).__module__}.{type(e).__qualname__}"
                     + (f": <message redacted: {describe(message)}>\n" if message else "\n"))
    return "".join(parts).rstrip("\n")


class RedactExceptions(logging.Filter):
    """A logging filter: a record carrying an exception gets `redacted_traceback` in its text instead of the
    traceback `logging` would format (whose last line quotes the exception's message). Installed on the
    loggers a server's exceptions reach (uvicorn's "Exception in ASGI application" included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}\n{redacted_traceback(record.exc_info[1])}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def redact_exceptions(*logger_names: str) -> None:
    """Install `RedactExceptions` on each logger (once)."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactExceptions) for f in logger.filters):
            logger.addFilter(RedactExceptions())
