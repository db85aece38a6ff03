"""The ResponseStore deployment: one actor holding stored Responses, bounded by count and bytes.

A thin wrapper over ninfer.store.ResponseStore; every Router replica reaches it through a handle
(ninfer.store.RayResponseStore), so a Response stored by one replica continues on any other.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from ninfer.store import Continuation, NewResponse, PutResult, ResponseStore


@serve.deployment(name="ResponseStore", num_replicas=1, ray_actor_options={"num_cpus": 0.1})
class ResponseStoreDeployment:
    def __init__(self, max_records: int, max_mib: int):
        self.store = ResponseStore(max_records, max_mib * 1024 * 1024)

    def put(self, new: NewResponse) -> PutResult:
        return self.store.put(new)

    def response(self, response_id: str) -> dict[str, Any] | None:
        return self.store.response(response_id)

    def continuation(self, response_id: str) -> Continuation | None:
        return self.store.continuation(response_id)

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        return self.store.input_items(response_id)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
