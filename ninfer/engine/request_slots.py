"""The engine's request lifetime capacity (contract, "Execution behavior").

max_concurrency + max_pending_requests slots bound every generation request the server holds: from before its
CPU/media preparation, through admission and generation, until its response is released. The router reserves
a slot before it prepares a request (`reserve`) and releases it once the answer is written (`release`); the
request's admission deadline (--pending-timeout-ms) counts from the reservation, so preparation and media
fetches spend the same budget as the engine's FIFO wait. A request submitted without a reservation (the
engine used directly: notebooks, benchmarks) takes its slot at submit and gives it back when it finishes.

A router that dies cannot release its slots, so stale ones are dropped when capacity runs out: a reservation
never submitted once its deadline is UNCLAIMED_GRACE_S behind, a finished request's slot after RELEASE_GRACE_S.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from ninfer.engine.types import InvalidRequestError, QueueTimeoutError, ServerOverloadedError

UNCLAIMED_GRACE_S = 5.0  # past its deadline, a reservation whose request never came is dropped
RELEASE_GRACE_S = 300.0  # a finished request's reservation the router never released is dropped after this


@dataclass
class _Slot:
    deadline: float  # the admission deadline (clock seconds)
    reserved: bool  # taken by reserve(): freed by release(); else by finished()
    submitted: bool = False
    finished_at: float | None = None


class RequestSlots:
    """Thread-safe: reserve/release come from router calls, claim from submit, finished from the engine loop."""

    def __init__(self, limit: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.timeout_s = timeout_s
        self.clock = clock
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def terminal_pending(self) -> int:
        """Requests the engine finished whose answers the router has not released yet."""
        with self._lock:
            return sum(slot.finished_at is not None for slot in self._slots.values())

    def reserve(self, request_id: str) -> None:
        """Take a slot before preparation; raises ServerOverloadedError when every slot is held."""
        with self._lock:
            if request_id in self._slots:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._take(request_id, reserved=True)

    def claim(self, request_id: str) -> float:
        """The submitted request's admission deadline: its reservation's, or a new slot's for a direct submit.
        Raises QueueTimeoutError when the reservation's deadline already passed (preparation took it all)."""
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None:
                slot = self._take(request_id, reserved=False)
            elif slot.submitted:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            elif self.clock() >= slot.deadline:
                raise QueueTimeoutError(f"request was not admitted within {self.timeout_s * 1000:.0f} ms "
                                        "(its preparation used the whole wait)")
            slot.submitted = True
            return slot.deadline

    def finished(self, request_id: str) -> None:
        """The engine is done with the request: a direct submit's slot is free, a reserved one waits for release."""
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None:
                return
            if slot.reserved:
                slot.finished_at = self.clock()
            else:
                del self._slots[request_id]

    def release(self, request_id: str) -> None:
        """The router answered (or gave up on) the request; idempotent."""
        with self._lock:
            self._slots.pop(request_id, None)

    def _take(self, request_id: str, reserved: bool) -> _Slot:
        if len(self._slots) >= self.limit:
            self._drop_stale()
        if len(self._slots) >= self.limit:
            raise ServerOverloadedError(
                f"the server holds {len(self._slots)} requests, its limit of running plus pending requests")
        slot = self._slots[request_id] = _Slot(self.clock() + self.timeout_s, reserved)
        return slot

    def _drop_stale(self) -> None:
        now = self.clock()
        for request_id, slot in list(self._slots.items()):
            unclaimed = not slot.submitted and now > slot.deadline + UNCLAIMED_GRACE_S
            unreleased = slot.finished_at is not None and now > slot.finished_at + RELEASE_GRACE_S
            if unclaimed or unreleased:
                del self._slots[request_id]
