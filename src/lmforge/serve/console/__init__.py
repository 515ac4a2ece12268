"""The web console at `/ui`: one static HTML page with its JavaScript inline, no build step.

A chat box that streams from `/v1/chat/completions` (SSE read with `fetch`), thumbs up/down that
post to `/v1/feedback` (inline SVG and a word, so they render without an emoji font), and a live
panel that polls `/metrics` every 2 s and derives requests/s and tokens/s over the last minute (from
the counters' samples of that window, so one request still shows after the poll that saw it),
TTFT p50/p90 (from the histogram's buckets, as Prometheus' `histogram_quantile` does), KV usage,
queue length, the feedback histogram and traffic per version. The page knows only the public API;
this module only serves it, with the files a browser asks for on its own (`/favicon.ico`, the page's
icon, `/robots.txt`, Safari's touch icons: 204), so a browser's visit never shows up as an HTTP error
in `/metrics` (`lmforge:http_errors_total`).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response

# an anvil-grey square with a spark: the tab icon (SVG favicons: every current browser)
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32"><rect width="32" height="32" rx="6" '
               'fill="#1d2430"/><path d="M8 20h16l-3 5H11z M11 13h13l-2 5H11z" fill="#dde1e6"/>'
               '<path d="M17 4l-4 7h3l-2 6 6-8h-3l2-5z" fill="#f0a030"/></svg>')
ROBOTS_TXT = "User-agent: *\nDisallow: /\n"  # an inference API has nothing to index
STATIC_CACHE = {"Cache-Control": "public, max-age=86400"}


def mount_console(app: FastAPI) -> None:
    page = resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")

    @app.get("/ui", include_in_schema=False)
    async def ui_redirect() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui/", include_in_schema=False)
    async def ui() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/ui/favicon.svg", include_in_schema=False)
    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(FAVICON_SVG, media_type="image/svg+xml", headers=STATIC_CACHE)

    @app.get("/robots.txt", include_in_schema=False)
    async def robots() -> PlainTextResponse:
        return PlainTextResponse(ROBOTS_TXT, headers=STATIC_CACHE)

    @app.get("/apple-touch-icon.png", include_in_schema=False)
    @app.get("/apple-touch-icon-precomposed.png", include_in_schema=False)
    async def touch_icon() -> Response:  # Safari asks for these on its own; no icon is no error
        return Response(status_code=204, headers=STATIC_CACHE)
