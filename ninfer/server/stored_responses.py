"""The stored-Response resources: retrieve, delete, list input Items, and the refusal to cancel.

Responses live in the ResponseStore (in this process, or the ResponseStore deployment under Ray)
until LRU eviction or deletion; store:false Responses never enter it.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from ninfer.protocol.errors import ProtocolError, invalid, unsupported


def response_not_found(response_id: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(f"response {response_id!r} not found (never stored, store:false, evicted or deleted)",
                         param=param, code="response_not_found", status=404)


async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    query = request.query_params
    if query.get("stream", "false").lower() != "false" or "starting_after" in query:
        raise unsupported("stream", "stream_recovery_not_supported",
                          "a finished stream cannot be replayed; retrieve the Response as JSON")
    _check_no_include(request)
    response = await request.app.state.response_store.response(response_id)
    if response is None:
        raise response_not_found(response_id)
    return JSONResponse(response)


async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not await request.app.state.response_store.delete(response_id):
        raise response_not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(response_id: str, request: Request) -> JSONResponse:
    query = request.query_params
    _check_no_include(request)
    limit = _limit(query.get("limit", "20"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order: {order!r} is not one of asc, desc", "order")
    items = await request.app.state.response_store.input_items(response_id)
    if items is None:
        raise response_not_found(response_id)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid(f"after: no input Item of {response_id!r} has the id {after!r}", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)})


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        raise invalid(f"limit: {text!r} is not an integer", "limit", "invalid_type") from None
    if not 1 <= limit <= 100:
        raise invalid("limit must be between 1 and 100", "limit")
    return limit


def _check_no_include(request: Request) -> None:
    values = [v for key in ("include", "include[]") for v in request.query_params.getlist(key)]
    if any(values):
        raise unsupported("include", "include_not_supported", "stored Responses are returned as they were created")


async def cancel_response(response_id: str, request: Request):
    if await request.app.state.response_store.response(response_id) is None:
        raise response_not_found(response_id)
    raise unsupported("response_id", "background_not_supported",
                      "only background Responses can be cancelled, and background execution is not available")
