"""The Host check: a request is answered only for a name of this server (setting `allowed_hosts`,
docs/api.md "Allowed host names").

A browser sends the name it resolved as `Host`. A web page that rebinds its own name to 127.0.0.1
(DNS rebinding) reaches a server bound there, but its requests carry the page's name, so they are
refused here, before the key, the routes, the page's files or `/health` see them.

Starlette's `TrustedHostMiddleware` does not fit: it refuses a request without `Host` (HAProxy's
`option httpchk GET /health` is HTTP/1.0 without one; no browser sends such a request, so it
cannot be a rebinding), answers in plain text instead of an OpenAI error body, and splits
`[::1]:8080` at its first colon. This middleware keeps that rule (exact names, `*.<domain>`, `*`)
with those three differences.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Iterable

import psutil
from starlette.types import ASGIApp, Receive, Scope, Send

from edge_llm.safetext import printable
from edge_llm.server.errors import APIError, answer_from_head
from edge_llm.settings import normal_host

log = logging.getLogger(__name__)

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
_PORT = re.compile(r"(:[0-9]*)?")
_LOGGED_MAX = 32  # distinct refused names logged; beyond, refusals are only counted (/metrics)


def default_allowed_hosts(bind: str) -> tuple[str, ...]:
    """`allowed_hosts = auto`: the loopback names, and the bind address with the addresses it
    resolves to; for a wildcard bind, this machine's hostname (its first label, and that label
    with `.local` for mDNS) and every address of every network interface (psutil). No DNS query
    is made for a wildcard bind."""
    out = list(LOOPBACK)
    if bind in WILDCARD_BINDS:
        name = socket.gethostname()
        label = name.split(".")[0]
        out += [name, label, f"{label}.local"]
        for addrs in psutil.net_if_addrs().values():
            out += [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    else:
        out.append(bind)
        try:
            out += [info[4][0].split("%")[0] for info in socket.getaddrinfo(bind, None)]
        except OSError as e:  # uvicorn says so when it binds; the name itself is still allowed
            log.warning("allowed_hosts: the bind address %s does not resolve (%s)", printable(bind), e)
    normal = (normal_host(h) for h in out)
    return tuple(dict.fromkeys(h for h in normal if h is not None))


def allowed_hosts(setting: tuple[str, ...] | None, bind: str) -> tuple[str, ...]:
    """What the Host check allows: the setting's entries and the loopback names (a rebinding page
    carries its own name, never these), or `default_allowed_hosts` for `auto` (None)."""
    if setting is None:
        return default_allowed_hosts(bind)
    return tuple(dict.fromkeys((*setting, *LOOPBACK)))


def host_of(value: bytes) -> str | None:
    """The name or address of a Host header's value (`name`, `name:port`, `[v6]:port`), as
    `normal_host` spells it; None if the value is not one."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]") + 1
        if end == 0:
            return None
        name, port = text[:end], text[end:]
    else:
        name, sep, rest = text.partition(":")
        port = sep + rest
    if not name or not _PORT.fullmatch(port):
        return None
    return normal_host(name)


class HostCheck:
    """ASGI middleware: 421 for a request whose Host is not allowed, 400 for a malformed Host or
    more than one; a request without Host (or with an empty one) passes."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]):
        allowed = tuple(allowed)
        self.app = app
        self.any = "*" in allowed
        self.names = frozenset(a for a in allowed if not a.startswith("*"))
        self.suffixes = tuple(a[1:] for a in allowed if a.startswith("*."))  # ".example.com"
        self._logged: set[str] = set()

    def allows(self, host: str) -> bool:
        if host in self.names:
            return True
        is_ip = True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            is_ip = False
        return not is_ip and host.endswith(self.suffixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any or scope["type"] != "http":
            return await self.app(scope, receive, send)
        values = [v for n, v in scope.get("headers", ()) if n == b"host"]
        if not values or values == [b""]:  # HTTP/1.0 without Host: never a browser's request
            return await self.app(scope, receive, send)
        err = None
        if len(values) > 1:
            err = APIError(400, "a request must carry one Host header, not several (RFC 9112)", code="bad_host")
        elif (host := host_of(values[0])) is None:
            err = APIError(400, f"malformed Host header {printable(values[0].decode('latin-1'))!r}",
                           code="bad_host")
        elif not self.allows(host):
            self._log(host)
            err = APIError(421, f"this server does not answer for the name {host!r} (Host header): to serve "
                           "it, add it to the setting allowed_hosts (--allowed-hosts, EDGE_LLM_ALLOWED_HOSTS; "
                           "'*' allows any name)", code="host_not_allowed")
        if err is not None:
            return await answer_from_head(send, err, receive)
        return await self.app(scope, receive, send)

    def _log(self, host: str) -> None:
        if host in self._logged or len(self._logged) >= _LOGGED_MAX:
            return
        self._logged.add(host)
        log.warning("refused a request for the name %s (Host header): not in allowed_hosts; a web page "
                    "rebinding its name to this server looks like this, a client using a name of this "
                    "board not listed too (further requests for this name are not logged)", printable(host))
