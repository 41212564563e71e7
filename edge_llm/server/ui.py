"""The built-in page: the files of `edge_llm/server/static/` under `/ui/`, with the headers that
keep them to themselves (docs/api.md, "The page and its endpoints").

The files are public (they hold no data); what the page shows comes from the keyed API. Starlette's
`StaticFiles` serves them (path checks, ETag / Last-Modified revalidation, HEAD); this module's
`SecurityHeaders` middleware adds the security headers to every answer under `/ui/`, the two
redirects and every error response of the server.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.datastructures import MutableHeaders
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
PREFIX = "/ui"
# no inline script or style, nothing from another origin, never framed (docs/api.md)
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
           "Referrer-Policy": "no-referrer"}


class SecurityHeaders:
    """ASGI middleware: `HEADERS` on every response under `/ui` (files, 304s), on `/` (the redirect)
    and on every error response of the server (any status from 400 on, whichever layer answered:
    the Host check, the request gate, a route or Starlette's 404/405). Added outermost, so an
    error answered before the page's mount (a `/ui/` 404 is answered by the router's exception
    handler, outside the mount) carries them too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        page = path == "/" or path == PREFIX or path.startswith(PREFIX + "/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and (page or message["status"] >= 400):
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def mount_ui(app: FastAPI, static_dir: Path = STATIC_DIR) -> None:
    """`/ui/` -> index.html, `/ui/<file>` -> the folder's files, `/ui` and `/` -> redirect to `/ui/`."""
    if not (static_dir / "index.html").is_file():  # a broken install: say so once, serve the API anyway
        log.warning("the page's files are missing (no index.html in the package's static folder): /ui/ "
                    "answers 404")

    @app.get(PREFIX, include_in_schema=False)
    @app.get("/", include_in_schema=False)
    def to_ui() -> RedirectResponse:
        return RedirectResponse(PREFIX + "/", status_code=307)

    app.mount(PREFIX, StaticFiles(directory=static_dir, html=True, check_dir=False), name="ui")
