"""What the HTTP edge owes each connection and response that Ray Serve's proxy would otherwise not give.

The contract ("Endpoints"): accepted connections use TCP keepalive and a 15-second TCP_USER_TIMEOUT, so a dead
or unacknowledging peer is cancelled within about 20 seconds (the SSE heartbeat covers the rest), even while its
request waits for admission; and every OpenAI-compatible response carries a unique x-request-id. Behind Serve the
accepted sockets and the x-request-id header belong to the proxy actor, so this middleware runs there, loaded by

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ninfer.server.proxy_edge:middlewares

(`make serve` and `ninfer serve` set it; a plain `serve run` needs it exported). In process, EdgeMiddleware calls
`tune_connection` itself.
"""

from __future__ import annotations

import logging
import socket

from starlette.middleware import Middleware

log = logging.getLogger("ninfer.server")

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "ninfer.server.proxy_edge:middlewares"

KEEPALIVE_IDLE_S = 5  # the first probe after 5 s of silence, like the SSE heartbeat
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
USER_TIMEOUT_MS = 15_000  # unacknowledged data (or probes) for 15 s closes the connection

_OPTIONS = [(socket.SOL_SOCKET, "SO_KEEPALIVE", 1), (socket.IPPROTO_TCP, "TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            (socket.IPPROTO_TCP, "TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            (socket.IPPROTO_TCP, "TCP_KEEPCNT", KEEPALIVE_PROBES),
            (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", USER_TIMEOUT_MS)]
# the options this platform names (TCP_USER_TIMEOUT and the keepalive timings are Linux's)
SOCKET_OPTIONS = [(level, getattr(socket, name), value) for level, name, value in _OPTIONS if hasattr(socket, name)]


def tune_connection(receive) -> bool:
    """Set the keepalive options on the TCP connection behind an ASGI `receive` (uvicorn's request cycle holds its
    transport); False where there is none to reach (another server, a unix socket) or the kernel refused."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        for level, option, value in SOCKET_OPTIONS:
            sock.setsockopt(level, option, value)
    except OSError as exc:
        log.debug("could not set keepalive options on %s: %s", sock, exc)
        return False
    return True


class ProxyEdge:
    """In Serve's proxy, outside its request-id middleware: tunes the connection, and drops a client-sent
    x-request-id so the proxy stamps a fresh one (two requests sending the same id get different ones)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            tune_connection(receive)
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"x-request-id"]}
        await self.app(scope, receive, send)


def middlewares() -> list[Middleware]:
    """The proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(ProxyEdge)]
