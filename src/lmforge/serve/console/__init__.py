"""The web console at `/ui`: one static HTML page with its JavaScript inline, no build step.

A chat box that streams from `/v1/chat/completions` (SSE read with `fetch`), thumbs up/down that
post to `/v1/feedback`, and a live panel that polls `/metrics` every 2 s and derives requests/s,
TTFT p50/p90 (from the histogram's buckets, as Prometheus' `histogram_quantile` does), KV usage,
queue length, the feedback histogram and traffic per version. The page knows only the public API;
this module only serves it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse


def mount_console(app: FastAPI) -> None:
    page = resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")

    @app.get("/ui", include_in_schema=False)
    async def ui_redirect() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui/", include_in_schema=False)
    async def ui() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})
