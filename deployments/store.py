"""The ResponseStore deployment: one actor holding stored Responses, bounded by count and bytes.

A pass-through for now: a small LRU map, so the graph has its final shape; the Responses API
(ninfer/store) replaces the map with the real store without changing the deployment.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

from ray import serve


@serve.deployment(name="ResponseStore", num_replicas=1, ray_actor_options={"num_cpus": 0.1})
class ResponseStoreDeployment:
    def __init__(self, max_records: int, max_mib: int):
        self.max_records = max_records
        self.max_bytes = max_mib * 1024 * 1024
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0

    def put(self, key: str, value: Any) -> bool:
        """Store and evict least-recently-used entries; False when one value alone exceeds the budget."""
        size = len(pickle.dumps(value))
        if size > self.max_bytes or self.max_records == 0:
            return False
        self.delete(key)
        self._items[key] = (value, size)
        self._bytes += size
        while len(self._items) > self.max_records or self._bytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self._bytes -= evicted
        return True

    def get(self, key: str) -> Any:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key][0]

    def delete(self, key: str) -> bool:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]
        return item is not None
