"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the server answers with goes through `OpenAIError` or one of the handlers that
`install_error_handlers` adds, so the official `openai` client raises its typed exceptions
(`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError`, ...) with `.code`
and `.param` set. The status is also counted (`lmforge:http_errors_total{status}`) by the app.
This module knows nothing about the engine or sampling.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.tools.redact import describe, redact_exceptions, redacted_traceback

# status -> OpenAI's error `type` for that status
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               403: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
log = logging.getLogger("lmforge.serve")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param, code)


_FIELD = re.compile(r"^(?:SamplingParams|EngineConfig)\.(\w+)[=\[:]|^(structured_outputs)[.:]")


def from_value_error(e: ValueError) -> OpenAIError:
    """The engine's ValueErrors name the field (`SamplingParams.top_p=2.0: must be in (0, 1]`) or the
    numbers (`prompt (12 tokens) + max_tokens (600) = 612 > max_model_len (512)`)."""
    msg = str(e)
    m = _FIELD.match(msg)
    if m:
        return bad_request(msg, m.group(1) or m.group(2))
    if "max_model_len" in msg or "KV blocks" in msg:
        return bad_request(msg, "max_tokens", "context_length_exceeded")
    return bad_request(msg, "prompt" if "prompt" in msg else None)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json")
    param = loc[0] if loc else None
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same) > 1:  # a union field (`prompt`, `stop`, `content`): one error per accepted type
        kinds = sorted({str(p) for e in same for p in e.get("loc", ())[2:3]})
        detail = f"{param}: does not match any accepted form ({', '.join(kinds)})"
    else:
        where = ".".join(loc) or "body"
        detail = f"{where}: {first.get('msg')}"
    return bad_request(detail, param, "missing_required_parameter" if first.get("type") == "missing" else "invalid_value")


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Turn every exception into OpenAI's error JSON; `on_error(status)` counts it. An exception that reaches
    a log (Starlette re-raises a 500's to uvicorn, which logs "Exception in ASGI application") is logged with
    its messages redacted: they may quote the request."""
    redact_exceptions("uvicorn.error")  # the request paths of lmforge.serve and .engine redact at each call

    def answer(err: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = str(exc.detail)
        if exc.status_code == 400:  # FastAPI's only 400: a body json.loads raised on (bad UTF-8, nested too deep)
            detail = "the request body is not valid JSON (not UTF-8, or nested too deeply to parse)"
        response = answer(OpenAIError(exc.status_code, detail, None, code))
        response.headers.update(exc.headers or {})  # 405 carries `Allow`
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug: the traceback goes to the log (its messages redacted: they may quote the request), the client
        # learns nothing about the internals
        route = getattr(request.scope.get("route"), "path", None)  # the template: `/v1/models/{model_id:path}`
        log.error("unhandled error on %s %s:\n%s", request.method, route or f"<path: {describe(request.url.path)}>",
                  redacted_traceback(exc))
        return answer(OpenAIError(500, "internal error; the server log has the details", None, "internal_error"))


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_WHY = {400: "Invalid request (OpenAI error JSON; FastAPI's 422 is answered as 400)",
        401: "Missing or invalid API key (on /admin/*: the admin key)",
        403: "Admin endpoints are off: the server runs without --admin-api-key",
        404: "Unknown model or completion id, or a feature this server was not started with", 408: "The request body did not arrive in time", 413: "Request body too large",
        409: "The registry names no champion to load",
        429: "Waiting queue full, or too many admin requests; retry later", 500: "Internal error (no internals in the body)",
        503: "Engine loading, restarting or stopped"}


def document_errors(app: FastAPI, auth: bool) -> None:
    """Make /openapi.json say what the server really answers: each operation's error statuses with
    OpenAI's error schema, and no 422 (validation errors are 400s here)."""
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {})["OpenAIError"] = _ERROR_SCHEMA
        ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                statuses = {500}
                if method == "post":
                    statuses |= {400, 408, 413, 503}
                if path.startswith("/v1/"):
                    statuses |= {503} | ({401} if auth else set())
                if path.startswith("/v1/") and method == "post":
                    statuses |= {404, 429}
                if path.startswith("/admin/"):
                    statuses |= {401, 403, 404, 409, 429, 503}
                if path.startswith("/health"):
                    statuses |= {503}
                if path in ("/tokenize", "/detokenize", "/tokenizer_info") or path.startswith("/v1/models/"):
                    statuses |= {400, 404, 503}  # an unknown model, a model without a tokenizer, loading
                for status in sorted(statuses):
                    responses[str(status)] = {"description": _WHY[status], **ref}
                if path == "/metrics":
                    responses["200"] = {"description": "Prometheus text format",
                                        "content": {"text/plain": {"schema": {"type": "string"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
