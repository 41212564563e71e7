"""OpenAI-style error bodies, the handlers that produce them, the body-size limit and API keys.

Every error a client can cause is answered as `{"error": {"message", "type", "param", "code"}}`
with the matching status; nothing a client sends reaches the engine unvalidated.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edge_llm.errors import ConfigError
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
# after an answer sent before the body was read (RequestGate): what is still discarded
DRAIN_MAX = 64 * 1024 * 1024  # bytes; beyond this, the connection closes (a client still sending sees a reset)
LINGER_S = 5.0  # seconds in all
LINGER_IDLE_S = 1.0  # seconds without a byte from the client


class APIError(Exception):
    """An error answered to the client; `status` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def queue_full(queue_size: int) -> APIError:
    return APIError(503, f"server busy: the request queue is full ({queue_size} waiting); retry later",
                    "server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class NotUnicodeText(ValueError):
    """A string of a request body that is not Unicode text (a lone UTF-16 surrogate); `path` holds
    the keys and list indices from the body to it, the error's `param`."""

    def __init__(self, path: tuple[str, ...], message: str):
        super().__init__(message)
        self.path = path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None, "invalid_request"
    # a field that is a union (content: str | parts) reports one error per branch: a validator's
    # own message (value_error: "lone surrogate ...") says more than "Input should be a valid string"
    e = next((x for x in errs if x.get("type") == "value_error"), errs[0])
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"invalid JSON body: {ctx.get('error', e.get('msg'))}", None, "invalid_json"
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, NotUnicodeText):  # raised on the whole body: the place is in the error
        loc += cause.path
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more error(s))" if len(errs) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param, "invalid_value"


def install_handlers(app: FastAPI) -> None:
    """Map every failure mode to an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error: %s", exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)


class RequestGate:
    """What is answered from a request's head, before any byte of its body is read or parsed
    (docs/api.md "Errors" and "Request limits"), in this order:

    - 400 for `Content-Length` together with `Transfer-Encoding` (RFC 9112 6.1 lets a server refuse
      it; behind a proxy it is the request-smuggling shape), the connection closed at once;
    - 401 without a valid API key on a path in `keyed` (the routes declared with the key);
    - 413 for a `Content-Length` over `limit`.

    A body without `Content-Length` (chunked) is counted while it streams in: 413 past the limit.
    An early answer goes out whole at once; then the server discards what the client still sends
    (at most LINGER_S seconds, DRAIN_MAX bytes) before it closes the connection, because closing a
    socket with unread input makes the kernel send RST, and a client still sending its body would
    see a reset instead of the answer."""

    def __init__(self, app: ASGIApp, limit: int, keys: APIKeys | None = None,
                 keyed: frozenset[str] = frozenset()):
        self.app, self.limit, self.keys, self.keyed = app, limit, keys, keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", ())
        lengths = [value for name, value in headers if name == b"content-length"]
        if lengths and any(name == b"transfer-encoding" for name, _ in headers):
            log.warning("refused a request with both Content-Length and Transfer-Encoding")
            return await answer_from_head(send, bad_request(
                "a request must not carry both Content-Length and Transfer-Encoding (RFC 9112)", code="bad_framing"))
        if self.keys is not None and scope["path"] in self.keyed:
            authorization = next((v for n, v in headers if n == b"authorization"), None)
            try:
                self.keys.check(authorization)
            except APIError as e:
                return await answer_from_head(send, e, receive)
        # the HTTP parser enforces Content-Length (one value, digits only): checking it suffices
        if lengths and int(lengths[0]) > self.limit:
            return await answer_from_head(send, self._too_large(), receive)
        if lengths:
            return await self.app(scope, receive, send)
        # chunked (or no) body: read it here, so a too-large one is refused before the app sees it
        messages: list[Message] = []
        seen = 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                # the body is complete when more_body is false: nothing left to discard
                unread = receive if msg.get("more_body", False) else None
                return await answer_from_head(send, self._too_large(), unread)
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.limit} bytes (setting max_body_bytes; "
                        "an image sent as a data: URL takes 4/3 of its size)", code="body_too_large")


async def answer_from_head(send: Send, err: APIError, unread: Receive | None = None) -> None:
    """Send `err` whole, then (with `unread`: a body may still come) discard the rest of the
    request for a while; the connection closes after the answer."""
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                            *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]})
    if unread is None:
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})  # the client has it all
    await _linger(unread)
    await send({"type": "http.response.body", "body": b""})


async def _linger(receive: Receive) -> None:
    """Read and drop what the client still sends: until its body ends, LINGER_IDLE_S seconds pass
    without a byte, LINGER_S seconds in all, or DRAIN_MAX bytes."""
    loop = asyncio.get_running_loop()
    end, drained = loop.time() + LINGER_S, 0
    while drained < DRAIN_MAX:
        wait = min(LINGER_IDLE_S, end - loop.time())
        if wait <= 0:
            return
        try:
            msg = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            return
        if msg["type"] != "http.request":
            return
        drained += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


class APIKeys:
    """Keys from `api_key_file` (docs/api.md "API keys"): one per line, UTF-8, `#` comments, spaces
    and tabs around a key ignored. A key is compared as bytes with the bytes the client sent after
    `Bearer ` (its UTF-8, for a key that is not ASCII), in constant time."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys

    @classmethod
    def from_file(cls, path: str | Path | None) -> "APIKeys | None":
        if not path:
            return None
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"api_key_file {path}: {e}") from None
        keys = []
        for number, line in enumerate(data.removeprefix(_BOM).splitlines(), 1):
            key = line.strip(_OWS)
            if not key or key.startswith(b"#"):
                continue
            for problem in unsendable(key):
                log.warning("api_key_file %s, line %d: the key %s", printable(str(path)), number, problem)
            keys.append(key)
        if not keys:
            raise ConfigError(f"api_key_file {path}: no key in the file")
        return cls(keys)

    def check(self, authorization: bytes | None) -> None:
        """Raise a 401 APIError unless `Authorization: Bearer <key>` (the header's bytes as
        received) names a configured key."""
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="missing_api_key")
        scheme, _, token = authorization.partition(b" ")
        given = token.strip(_OWS)
        # compare against every key, always, so timing reveals neither which key nor how much matched
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != b"bearer" or not ok:
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")


_OWS = b" \t"  # what HTTP strips around a header value, and the key file around a key
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark some editors write first: not part of a key


def unsendable(key: bytes) -> list[str]:
    """Why clients cannot send `key` in `Authorization: Bearer <key>` (empty: they can)."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError as e:
        return [f"is not UTF-8 text (byte {e.start + 1}): clients send a key as text, none sends these bytes"]
    problems = []
    controls = sorted({f"U+{ord(c):04X}" for c in text if (ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F})
    if controls:
        problems.append(f"holds control characters ({', '.join(controls)}), which an HTTP header value "
                        "cannot carry: no client can send it")
    if text != text.strip():
        problems.append("starts or ends with a whitespace character that is not a space or tab (those "
                        "are stripped from the file's lines): easily lost when the key is copied or typed")
    if not text.isascii():
        problems.append("holds characters that are not ASCII: the server accepts their UTF-8 bytes (curl "
                        "sends them as typed), but most clients cannot send them (browsers and the page send "
                        "Latin-1 at most, the openai and httpx clients ASCII only); use an ASCII key")
    return problems
