"""The HTTP edge as one pure-ASGI middleware: connection keepalive, request ids, API-key check, body-size limit,
last-resort 500.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and a client
disconnect still reaches the endpoint. Order inside: id first (every answer carries it), then auth
(/health and CORS preflight stay open), then the body limit, which is enforced on the raw bytes
before anything parses JSON.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from ninfer.protocol.anthropic_errors import anthropic_error
from ninfer.protocol.errors import ProtocolError
from ninfer.server.proxy_edge import tune_connection

log = logging.getLogger("ninfer.server")

OPEN_PATHS = ("/health",)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response_parts(err: ProtocolError, path: str, request_id: str) -> tuple[int, bytes]:
    status, body = anthropic_error(err, request_id) if is_anthropic(path) else (err.status, err.openai_body())
    return status, json.dumps(body, ensure_ascii=False).encode()


class EdgeMiddleware:
    """`upstream_request_id`: behind Ray Serve's proxy, which already stamps every request and response
    with its own x-request-id; the app adopts that id instead of adding a second header."""

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int, upstream_request_id: bool = False):
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.upstream_request_id = upstream_request_id

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if not self.upstream_request_id:  # this app is the edge (in process); behind Serve, proxy_edge does it
            tune_connection(receive)
        upstream = self._upstream_id(scope)
        request_id = upstream or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        if is_anthropic(path):
            id_headers = [(b"request-id", request_id.encode())]
        else:
            id_headers = [] if upstream else [(b"x-request-id", request_id.encode())]
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), *id_headers]}
            await send(message)

        async def reject(err: ProtocolError) -> None:
            status, body = error_response_parts(err, path, request_id)
            await send_with_id({"type": "http.response.start", "status": status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send_with_id({"type": "http.response.body", "body": body})

        if not self._authorized(scope):
            await reject(ProtocolError("missing or invalid API key", code="invalid_api_key", status=401))
            return
        try:
            receive = await self._bounded_body(scope, receive)
        except ProtocolError as err:
            await reject(err)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error serving %s %s (%s)", scope.get("method"), path, request_id)
            if not started:
                await reject(ProtocolError("internal server error", code="internal_error", status=500))

    def _upstream_id(self, scope) -> str | None:
        if not self.upstream_request_id:
            return None
        for key, value in scope.get("headers", []):
            if key.lower() == b"x-request-id":
                return value.decode("latin-1")
        return None

    def _authorized(self, scope) -> bool:
        if not self.api_key or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return True
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        expected = self.api_key.encode()
        bearer = headers.get(b"authorization", b"")
        scheme, _, token = bearer.strip().partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), expected):
            return True
        return secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), expected)

    async def _bounded_body(self, scope, receive):
        """Read the whole body within the limit, then replay it; 413 without reading past the limit."""
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return receive
        limit = self.max_request_bytes
        too_large = ProtocolError(f"the request body exceeds the {limit // (1024 * 1024)} MiB limit (--max-request-mib)",
                                  code="request_too_large", status=413)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                chunks = []
                replay = [message]
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replayed():
            return replay.pop(0) if replay else await receive()

        return replayed
