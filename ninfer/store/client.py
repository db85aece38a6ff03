"""How the router reaches the Response store: in this process, or through the Ray Serve handle of the
ResponseStore deployment. Both give the same async methods, mirroring ResponseStore's.
"""

from __future__ import annotations

from typing import Any, Protocol

from ninfer.store.response_store import Continuation, NewResponse, PutResult, ResponseStore


class ResponseStoreClient(Protocol):
    async def put(self, new: NewResponse) -> PutResult: ...

    async def response(self, response_id: str) -> dict[str, Any] | None: ...

    async def continuation(self, response_id: str) -> Continuation | None: ...

    async def input_items(self, response_id: str) -> list[dict[str, Any]] | None: ...

    async def delete(self, response_id: str) -> bool: ...


class LocalResponseStore:
    """The store in this process (tests, notebooks, the in-process app): plain calls, no copies."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def put(self, new: NewResponse) -> PutResult:
        return self.store.put(new)

    async def response(self, response_id: str) -> dict[str, Any] | None:
        return self.store.response(response_id)

    async def continuation(self, response_id: str) -> Continuation | None:
        return self.store.continuation(response_id)

    async def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        return self.store.input_items(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


class RayResponseStore:
    """The ResponseStore deployment (one actor, so every router replica sees the same Responses)."""

    def __init__(self, handle):
        self.handle = handle

    async def put(self, new: NewResponse) -> PutResult:
        return await self.handle.put.remote(new)

    async def response(self, response_id: str) -> dict[str, Any] | None:
        return await self.handle.response.remote(response_id)

    async def continuation(self, response_id: str) -> Continuation | None:
        return await self.handle.continuation.remote(response_id)

    async def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        return await self.handle.input_items.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.handle.delete.remote(response_id)
