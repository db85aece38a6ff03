"""Prepared payloads by digest: an LRU bounded by bytes, a live-bytes account, single-flight builds.

Two budgets, one owner. The cache bound (--media-cache-mib) limits payloads retained for reuse;
the live bound (--media-live-mib) limits every payload anyone references (cache, request or
runtime) plus the claims of builds in progress. Evicting from the cache only drops the cache's
reference: a payload a request holds stays live, and still counts, until its last release.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer.media.errors import MediaBudgetExceededError
from ninfer.media.types import PreparedMedia

# a build gets reserve(nbytes), which sets its claim on live memory (it may be called again)
Build = Callable[[Callable[[int], None]], PreparedMedia]


@dataclass(eq=False)
class _Entry:
    payload: PreparedMedia
    refs: int = 0  # request/runtime references; the cache's own is `cached`
    cached: bool = False


@dataclass(eq=False)
class _Flight:
    """A build in progress; identical misses wait on it instead of building again."""

    done: threading.Event = field(default_factory=threading.Event)
    joiners: int = 0
    payload: PreparedMedia | None = None
    error: BaseException | None = None


class PayloadCache:
    def __init__(self, cache_bytes: int, live_bytes: int):
        self.cache_limit = cache_bytes
        self.live_limit = live_bytes
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}  # every live payload
        self._lru: OrderedDict[str, None] = OrderedDict()  # the cache-retained ones, oldest first
        self._flights: dict[str, _Flight] = {}
        self._cached_bytes = 0
        self._live_bytes = 0  # live payloads + claims of builds in progress
        self.builds = 0

    # ---- observation --------------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {"live_bytes": self._live_bytes, "cached_bytes": self._cached_bytes,
                    "live_payloads": len(self._entries), "cached_payloads": len(self._lru),
                    "builds_in_flight": len(self._flights), "builds": self.builds,
                    "live_limit_bytes": self.live_limit, "cache_limit_bytes": self.cache_limit}

    # ---- references ---------------------------------------------------------------------------

    def acquire(self, key: str, build: Build, deadline: float | None = None) -> tuple[PreparedMedia, str]:
        """The payload for `key` with one reference taken for the caller, and how it was found:
        "hit", "miss" (built here) or "joined" (waited on a concurrent identical build)."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs += 1
                self._retain(key, entry)
                return entry.payload, "hit"
            flight = self._flights.get(key)
            joining = flight is not None
            if flight is not None:
                flight.joiners += 1  # the builder takes our reference along with its own
            else:
                flight = self._flights[key] = _Flight()
                self.builds += 1
        if joining:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.payload is not None
            return flight.payload, "joined"
        return self._build(key, flight, build, deadline), "miss"

    def release(self, key: str) -> None:
        """Drop one request/runtime reference; the bytes return when nothing references it."""
        with self._cond:
            entry = self._entries[key]
            if entry.refs <= 0:
                raise RuntimeError(f"media payload {key[:12]} released more often than acquired")
            entry.refs -= 1
            if entry.refs == 0 and not entry.cached:
                self._drop(key)

    # ---- internals (call with the lock held unless said) --------------------------------------

    def _build(self, key: str, flight: _Flight, build: Build, deadline: float | None) -> PreparedMedia:
        """Runs without the lock: decoding is the slow part and other keys must proceed."""
        claim = [0]

        def reserve(nbytes: int) -> None:
            self._reserve(claim, nbytes, deadline)

        try:
            payload = build(reserve)
            reserve(payload.nbytes)  # the claim becomes exactly the payload's size
        except BaseException as exc:
            with self._cond:
                self._live_bytes -= claim[0]
                del self._flights[key]
                flight.error = exc
                self._cond.notify_all()
            flight.done.set()
            raise
        with self._cond:
            del self._flights[key]
            entry = self._entries[key] = _Entry(payload, refs=1 + flight.joiners)  # claim -> entry bytes
            self._retain(key, entry)
        flight.payload = payload
        flight.done.set()
        return payload

    def _reserve(self, claim: list[int], nbytes: int, deadline: float | None) -> None:
        """Set a build's claim to `nbytes`, evicting unreferenced cached payloads to make room.
        With a deadline it waits for releases until then; without one it rejects at once."""
        with self._cond:
            if nbytes > self.live_limit:
                raise MediaBudgetExceededError(
                    f"a prepared media payload needs {nbytes} bytes, more than the live media budget "
                    f"of {self.live_limit} bytes")
            while self._live_bytes - claim[0] + nbytes > self.live_limit:
                victim = next((k for k in self._lru if self._entries[k].refs == 0), None)
                if victim is not None:
                    self._uncache(victim)
                    continue
                left = deadline - time.monotonic() if deadline is not None else 0.0
                if left <= 0:
                    raise MediaBudgetExceededError(
                        f"the live media budget of {self.live_limit} bytes is in use by other requests")
                self._cond.wait(left)
            self._live_bytes += nbytes - claim[0]
            claim[0] = nbytes

    def _retain(self, key: str, entry: _Entry) -> None:
        """Make `key` the cache's newest entry, if it fits the cache at all."""
        size = entry.payload.nbytes
        if entry.cached:
            self._lru.move_to_end(key)
            return
        if size > self.cache_limit:
            return  # includes cache_limit 0: retention disabled
        entry.cached = True
        self._lru[key] = None
        self._cached_bytes += size
        while self._cached_bytes > self.cache_limit:
            self._uncache(next(iter(self._lru)))

    def _uncache(self, key: str) -> None:
        entry = self._entries[key]
        entry.cached = False
        del self._lru[key]
        self._cached_bytes -= entry.payload.nbytes
        if entry.refs == 0:
            self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._live_bytes -= entry.payload.nbytes
        self._cond.notify_all()  # builds waiting for room may proceed
