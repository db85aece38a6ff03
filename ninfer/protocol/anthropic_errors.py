"""Anthropic's error shape: the same typed ProtocolError, rendered with Anthropic's status and category.

Statuses differ from the OpenAI edge only where Anthropic clients expect their own: local admission
overload is 529 (the status Anthropic SDKs and Claude Code retry as "overloaded"), and queue or media
deadlines are 504 timeouts.
"""

from __future__ import annotations

from typing import Any

from ninfer.protocol.errors import ProtocolError

OVERLOADED = 529
_STATUS_BY_CODE = {"server_overloaded": OVERLOADED, "request_queue_timeout": 504}
_CATEGORY_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}


def anthropic_status(err: ProtocolError) -> int:
    if err.code in _STATUS_BY_CODE:
        return _STATUS_BY_CODE[err.code]
    if err.code and err.code.endswith("_timeout") and err.status >= 500:  # media fetch deadlines alike
        return 504
    return err.status


def anthropic_category(status: int) -> str:
    if status in _CATEGORY_BY_STATUS:
        return _CATEGORY_BY_STATUS[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error(err: ProtocolError, request_id: str | None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body); the body is also what an SSE `error` event carries."""
    status = anthropic_status(err)
    body = {"type": "error", "error": {"type": anthropic_category(status), "message": err.message},
            "request_id": request_id}
    return status, body
