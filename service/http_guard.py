"""What every request passes before it reaches a route (README, "Security"):

0. the request line and headers are at most MAX_REQUEST_HEAD_BYTES -> 431;
1. the Host header names this daemon (DNS rebinding: a page whose name resolves to this machine
   must not be able to talk to it as its own origin) -> 421;
2. a mutating request (any method but GET, HEAD, OPTIONS) that carries an Origin header comes from
   the daemon's own origin or one listed in `allowed_origins` (cross-site requests) -> 403;
3. the bearer token: `auth_token` on mutating requests, a read token on GETs other than the probes
   when reads are protected -> 401;
4. a mutating request with a body, or with a declared content type, declares application/json (or
   application/x-ndjson, a continual job's records): a cross-site page can send text/plain or a
   form without a CORS preflight, never these -> 415;
5. its body is at most MAX_BODY_BYTES: a declared Content-Length above it is refused before a byte
   of the body is read, a chunked body is read up to the cap and no further -> 413.

The body of a mutating request is read here (bounded) and handed to the route from memory, so no
route can read an unbounded body.

`bounded_h11_protocol` is uvicorn's HTTP/1.1 protocol with a deadline on receiving each request:
uvicorn's own keep-alive timer runs only between requests, so a client that sends half a request
would otherwise hold its connection (and, with a body, a request task) forever.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .config import ServiceConfig, is_loopback_host, is_wildcard_host, normalize_origin

log = logging.getLogger("dflash.service")

MAX_BODY_BYTES = 1 << 20  # a job spec is a few hundred bytes
MAX_REQUEST_HEAD_BYTES = 16 * 1024  # request line and headers; our requests need well under 1 KiB
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# what probes, load balancers and Prometheus read without credentials; they disclose no job data
UNGUARDED_READS = frozenset({"/healthz", "/livez", "/metrics"})
JSON_MEDIA_TYPE = "application/json"
# what a body may be declared as: JSON, or newline-delimited JSON (records for a continual job);
# neither is a type a cross-site page can send without a CORS preflight
NDJSON_MEDIA_TYPE = "application/x-ndjson"
BODY_MEDIA_TYPES = frozenset({JSON_MEDIA_TYPE, NDJSON_MEDIA_TYPE})

Scope = Mapping[str, Any]
Message = dict[str, Any]


# --------------------------------------------------------------------------- headers
def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a header (names are lower case in ASGI)."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def header_count(scope: Scope, name: bytes) -> int:
    return sum(1 for key, _ in scope["headers"] if key == name)


def split_host(value: str) -> tuple[str, int | None] | None:
    """'Name:port' -> ('name', port); '[::1]:80' -> ('::1', 80); None when it is not a host."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else ""
    elif value.count(":") == 1:
        name, port_text = value.split(":")
    elif ":" in value:  # a bare IPv6 address is not a valid Host, but it names no other server
        name, port_text = value, ""
    else:
        name, port_text = value, ""
    if port_text:
        if not port_text.isdigit() or int(port_text) > 65535:
            return None
        port: int | None = int(port_text)
    else:
        port = None
    name = name.rstrip(".")
    return (name, port) if name else None


def presented_token(scope: Scope) -> bytes | None:
    """The bearer token of the Authorization header, as the bytes that were sent. Compared as bytes:
    a header is not text in any one encoding (Starlette decodes it as latin-1), and the configured
    token is compared as its UTF-8 bytes, so a non-ASCII token works when the client sends UTF-8."""
    value = header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, given = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    given = given.strip(b" \t")
    return given or None


def token_matches(scope: Scope, tokens: Iterable[str]) -> bool:
    given = presented_token(scope)
    if given is None:
        return False
    ok = False
    for token in tokens:  # every token is compared: the time taken does not say which one matched
        ok |= hmac.compare_digest(given, token.encode("utf-8"))
    return ok


# --------------------------------------------------------------------------- policy
class Policy:
    """The configured rules, precomputed."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.any_host = "*" in config.allowed_hosts
        names = {"localhost", "127.0.0.1", "::1", *config.allowed_hosts}
        bind = config.host.strip().strip("[]").lower()
        if not is_wildcard_host(bind):
            names.add(bind)
        self.host_names = frozenset(names)
        self.allowed_origins = frozenset(config.allowed_origins)

    def host_allowed(self, host: str) -> bool:
        if self.any_host:
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name, _ = parsed
        return name in self.host_names or is_loopback_host(name)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        normalized = normalize_origin(origin)
        if normalized is None:  # "null" (sandboxed frames, file: pages) or garbage
            return False
        if normalized in self.allowed_origins:
            return True
        if host is None:
            return False
        parsed_host = split_host(host)
        if parsed_host is None:
            return False
        scheme, _, rest = normalized.partition("://")
        parsed_origin = split_host(rest)
        if parsed_origin is None:
            return False
        default = 80 if scheme == "http" else 443
        # the daemon's own origin: the page was served by this daemon under this very Host (behind a
        # TLS-terminating proxy the scheme is https, so either scheme counts)
        return parsed_origin[0] == parsed_host[0] and (parsed_origin[1] or default) == (parsed_host[1] or default)

    def tokens_for(self, method: str, path: str) -> list[str]:
        """The tokens of which one must be presented; empty when the request needs none."""
        if method not in SAFE_METHODS:
            return [self.config.auth_token] if self.config.auth_token is not None else []
        if self.config.reads_protected and path not in UNGUARDED_READS:
            return self.config.read_tokens()
        return []


# --------------------------------------------------------------------------- middleware
def error_body(status: int, detail: str) -> bytes:
    return json.dumps({"detail": detail}).encode()


async def send_error(send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = error_body(status, detail)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        raw_headers.append((b"www-authenticate", b"Bearer"))
    for key, value in (headers or {}).items():
        raw_headers.append((key.lower().encode(), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: streamed responses pass through untouched)."""

    def __init__(self, app, config: ServiceConfig):
        self.app = app
        self.policy = Policy(config)

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is not None:
            await send_error(send, *refusal)
            return
        if scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)

    def check(self, scope: Scope) -> tuple[int, str] | None:
        """(status, detail) of the refusal, or None when the request may proceed to its body."""
        policy = self.policy
        method, path = scope["method"], scope["path"]
        # h11 bounds a head that arrives in pieces (MAX_REQUEST_HEAD_BYTES); one that arrives in one
        # read is parsed whole, so its size is checked here
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head += sum(len(key) + len(value) + 4 for key, value in scope["headers"])
        if head > MAX_REQUEST_HEAD_BYTES:
            return 431, f"request headers of {head} bytes; at most {MAX_REQUEST_HEAD_BYTES} are accepted"
        hosts = header_count(scope, b"host")
        if hosts > 1:
            return 400, "more than one Host header"
        host_raw = header(scope, b"host")
        host = host_raw.decode("latin-1") if host_raw is not None else None
        # without a Host header (HTTP/1.0) no browser is involved: nothing to rebind
        if host is not None and not policy.host_allowed(host):
            return (
                421,
                f"this daemon does not serve Host {host[:100]!r}; it answers to localhost names, its bind "
                "address and the names in its allowed_hosts setting",
            )
        mutating = method not in SAFE_METHODS
        origin = header(scope, b"origin")
        if mutating and origin is not None and not policy.origin_allowed(origin.decode("latin-1"), host):
            return (
                403,
                f"cross-origin request from {origin.decode('latin-1')[:100]!r} refused; a browser page may "
                "send it only from the daemon's own origin or one in its allowed_origins setting",
            )
        tokens = policy.tokens_for(method, path)
        if tokens and not token_matches(scope, tokens):
            return 401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')"
        if not mutating:
            return None
        length = header(scope, b"content-length")
        has_body = header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != b"0")
        content_type = header(scope, b"content-type")
        if content_type is not None or has_body:
            media = (content_type or b"").split(b";")[0].strip().lower().decode("latin-1")
            if media not in BODY_MEDIA_TYPES:
                got = f" (got {media[:100]!r})" if media else " (no Content-Type was sent)"
                return 415, (
                    f"the body must be JSON sent with 'Content-Type: {JSON_MEDIA_TYPE}' (or {NDJSON_MEDIA_TYPE}, "
                    f"for a continual job's records){got}"
                )
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return 400, "invalid Content-Length"
            if declared > MAX_BODY_BYTES:
                return 413, f"a body of {declared} bytes; at most {MAX_BODY_BYTES} are accepted"
        return None

    async def _read_body(self, scope: Scope, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 (or when the client went away)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                # what is still on its way is discarded by the server, within the request deadline
                await send_error(send, 413, f"a body of more than {MAX_BODY_BYTES} bytes; at most that is accepted")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


# --------------------------------------------------------------------------- connections
def bounded_h11_protocol(request_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol where each request (head and body) must arrive within
    `request_timeout` seconds of the connection opening or, on a kept-alive connection, of the
    request's first bytes; a streamed response (an event stream) is not limited, since the
    request is complete by then. The idle time between requests is uvicorn's keep-alive timeout
    alone: a window armed at the previous response would close an idle connection the client
    may be reusing at that very moment (its request then meets a reset) wherever the request
    deadline is the shorter of the two."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    finished = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)

    class BoundedH11Protocol(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._request_timer is None and self._next_request_begun():
                self._arm()  # a later request on this connection, not yet whole: its own window
            self._settle()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # handles a pipelined request's bytes already read
            if not self.transport.is_closing() and self._next_request_begun():
                self._arm()
            else:
                self._disarm()  # idle until the next request's bytes: the keep-alive timeout's

        def _next_request_begun(self) -> bool:
            """Some of a request that is not yet whole has arrived (a head in part, or a body)."""
            state = self.conn.their_state
            return state not in finished and (state is not h11.IDLE or bool(self.conn.trailing_data[0]))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._request_timer = self.loop.call_later(request_timeout, self._expire)

        def _disarm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _settle(self) -> None:
            if self.conn.their_state in finished:
                self._disarm()

        def _expire(self) -> None:
            self._request_timer = None
            if not self.transport.is_closing():
                log.info(
                    "closed a connection whose request did not arrive in time",
                    extra={
                        "fields": {
                            "client": "{}:{}".format(*self.client) if self.client else "?",
                            "seconds": request_timeout,
                        }
                    },
                )
                self.transport.close()

    return BoundedH11Protocol
