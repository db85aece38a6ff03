"""The local Response store: stored Responses and the Item history their continuations replay.

Each stored Response adds one context node (its normalized input Items and its output Items) that
points at its parent's node, so a chain shares history instead of copying it. Records are evicted
least-recently-used to stay within `max_records` and `max_bytes`; a node lives while a record or
a child node needs it, which is why deleting a Response leaves its descendants usable. Bytes are
the JSON size of what is held: record envelopes plus every live node, each counted once.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class PutResult(str, enum.Enum):
    STORED = "stored"
    TOO_LARGE = "too_large"  # this Response with its history exceeds the whole capacity
    PARENT_GONE = "parent_gone"  # the parent's history left the store: send it along (`parent_history`)


@dataclass
class NewResponse:
    """What the router hands over once a stored Response finished."""

    id: str
    response: dict[str, Any]  # the terminal Response object, as GET returns it
    input_items: list[dict[str, Any]]  # this request's normalized input Items
    output_items: list[dict[str, Any]]  # the output as a continuation replays it
    session_key: str
    preserve_thinking: bool | None
    parent_id: str | None = None
    parent_history: list[dict[str, Any]] | None = None


@dataclass
class Continuation:
    """What a previous_response_id child needs from its parent."""

    history: list[dict[str, Any]]  # every Item of the chain, oldest first
    session_key: str
    preserve_thinking: bool | None


class _Node:
    __slots__ = ("owner", "parent", "items", "input_count", "nbytes", "refs")

    def __init__(self, owner: str | None, parent: "_Node | None", items: list[dict[str, Any]], input_count: int):
        self.owner = owner  # the Response that added it; None for a detached parent history
        self.parent = parent
        self.items = items
        self.input_count = input_count
        self.nbytes = json_size(items)
        self.refs = 0

    def chain(self) -> list["_Node"]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass
class _Record:
    response: dict[str, Any]
    nbytes: int
    node: _Node
    session_key: str
    preserve_thinking: bool | None


def json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    def __init__(self, max_records: int, max_bytes: int):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._nodes: dict[str, _Node] = {}  # live nodes by the id of the Response that added them
        self._bytes = 0
        self._lock = threading.Lock()  # a Ray replica may run sync methods on worker threads

    def put(self, new: NewResponse) -> PutResult:
        with self._lock:
            parent = self._nodes.get(new.parent_id) if new.parent_id else None
            if new.parent_id and parent is None:
                if new.parent_history is None:
                    return PutResult.PARENT_GONE
                parent = _Node(None, None, new.parent_history, 0)  # detached: only this chain refers to it
            node = _Node(new.id, parent, [*new.input_items, *new.output_items], len(new.input_items))
            record = _Record(new.response, json_size(new.response), node, new.session_key, new.preserve_thinking)
            held = record.nbytes + sum(n.nbytes for n in node.chain())
            if held > self.max_bytes or self.max_records == 0:
                return PutResult.TOO_LARGE
            self._evict(new.id)
            self._records[new.id] = record
            self._bytes += record.nbytes
            self._hold(node)
            while len(self._records) > self.max_records or self._bytes > self.max_bytes:
                self._evict(next(iter(self._records)))
            return PutResult.STORED

    def response(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._touch(response_id)
            return None if record is None else record.response

    def continuation(self, response_id: str) -> Continuation | None:
        with self._lock:
            record = self._touch(response_id)
            if record is None:
                return None
            history = [item for node in record.node.chain() for item in node.items]
            return Continuation(history, record.session_key, record.preserve_thinking)

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            record = self._touch(response_id)
            return None if record is None else record.node.items[: record.node.input_count]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._evict(response_id)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"records": len(self._records), "bytes": self._bytes, "nodes": len(self._nodes)}

    # ---- bookkeeping -------------------------------------------------------------------------

    def _touch(self, response_id: str) -> _Record | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def _hold(self, node: _Node) -> None:
        """Count a new node (and, through it, its parent) as needed."""
        assert node.owner is not None
        node.refs += 1
        self._nodes[node.owner] = node
        self._bytes += node.nbytes
        parent = node.parent
        if parent is not None:
            if parent.refs == 0:  # a detached parent history enters the store with this child
                self._bytes += parent.nbytes
            parent.refs += 1

    def _evict(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self._bytes -= record.nbytes
        node: _Node | None = record.node
        while node is not None:
            node.refs -= 1
            if node.refs > 0:
                break
            self._bytes -= node.nbytes
            if node.owner is not None:
                del self._nodes[node.owner]
            node = node.parent
        return True
