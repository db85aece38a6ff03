"""MediaPreprocessor: prepare a request's images and videos on a bounded worker pool.

One prepare() call is one request: its items run as independent acquire -> digest -> cache or
(decode -> resize -> pack) tasks. A request-level gate, sized so that the admitted requests'
largest possible payloads fit the live budget together, keeps concurrent partial builds from
starving one another. Results are held under a lease until the caller releases it, so the live
budget covers payloads the router and engine still use.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ninfer.media.cache import PayloadCache
from ninfer.media.errors import MediaBudgetExceededError, MediaError, MediaTimeoutError
from ninfer.media.fetch import Fetcher
from ninfer.media.image import prepare_image
from ninfer.media.types import MIB, MediaItem, MediaLimits, MediaStats, PreparedBatch, PreparedMedia
from ninfer.media.video import VideoConfig, prepare_video

MAX_AUTO_THREADS = 16


def media_digest(modality: str, data: bytes) -> str:
    """SHA-256 of the modality and the acquired bytes: equal bytes as image and as video differ."""
    h = hashlib.sha256(modality.encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


@dataclass
class _Done:
    payload: PreparedMedia
    how: str  # "hit" | "miss" | "joined"
    acquire_seconds: float
    work_seconds: float
    source_bytes: int


class MediaPreprocessor:
    def __init__(self, cache_mib: int = 1024, live_mib: int = 2048, threads: int = 0, *,
                 limits: MediaLimits | None = None, video: VideoConfig | None = None,
                 fetcher: Fetcher | None = None):
        self.limits = limits or MediaLimits()
        self.video = video or VideoConfig()
        self.cache = PayloadCache(cache_mib * MIB, live_mib * MIB)
        self.threads = threads or min(MAX_AUTO_THREADS, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ninfer-media")
        self._fetcher = fetcher or Fetcher(self.limits.max_item_source_bytes, self.limits.fetch_timeout_s,
                                           self.limits.fetch_connect_timeout_s)
        self.gate_permits = max(1, self.cache.live_limit // self.limits.max_request_payload_bytes)
        self._gate = threading.BoundedSemaphore(self.gate_permits)
        self._leases: dict[int, list[str]] = {}
        self._lease_ids = itertools.count(1)
        self._lock = threading.Lock()

    # ---- the API --------------------------------------------------------------------------------

    def prepare(self, items: Sequence[Any], *, timeout_s: float | None = None, hold: bool = True) -> PreparedBatch:
        """Prepare every item (MediaItem, IR ImagePart/VideoPart, or {"type", "source"}) in order.

        `timeout_s` bounds the whole call (gate wait, fetches, waiting for live memory); without it
        a full live budget rejects at once. With `hold`, the payloads stay referenced under the
        returned lease until release(lease); without, they are released before returning (token
        counting needs only the grids). Raises a MediaError subclass whose `item` names the item.
        """
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        media = [MediaItem.of(item, i) for i, item in enumerate(items)]
        stats = MediaStats(items=len(media))
        if not media:
            return PreparedBatch(None, [], stats)
        if not self._gate.acquire(timeout=_left(deadline)):
            raise MediaTimeoutError("timed out waiting for a media preparation slot")
        stats.gate_wait_seconds = time.perf_counter() - start
        try:
            done = self._run(media, deadline)
        finally:
            self._gate.release()
        payloads = [d.payload for d in done]
        try:
            self._account(stats, done)
        except MediaError:
            self._release_keys([p.digest for p in payloads])
            raise
        lease = None
        if hold:
            with self._lock:
                lease = next(self._lease_ids)
                self._leases[lease] = [p.digest for p in payloads]
        else:
            self._release_keys([p.digest for p in payloads])
        stats.wall_seconds = time.perf_counter() - start
        return PreparedBatch(lease, payloads, stats)

    def release(self, lease: int | None) -> bool:
        """Return a lease's references; False when it is unknown or already released (idempotent,
        so cancellation paths may release freely)."""
        if lease is None:
            return False
        with self._lock:
            keys = self._leases.pop(lease, None)
        if keys is None:
            return False
        self._release_keys(keys)
        return True

    def snapshot(self) -> dict[str, int]:
        """Process-level occupancy, for metrics (not for the request log)."""
        with self._lock:
            leases = len(self._leases)
        return {**self.cache.snapshot(), "leases": leases, "threads": self.threads,
                "gate_permits": self.gate_permits}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetcher.close()

    # ---- one request ----------------------------------------------------------------------------

    def _run(self, media: list[MediaItem], deadline: float | None) -> list[_Done]:
        futures = [self._pool.submit(self._one, item, deadline) for item in media]
        finished, pending = wait(futures, timeout=_left(deadline), return_when=FIRST_EXCEPTION)
        failed = any(f.exception() is not None for f in finished)
        if pending and not failed:  # the deadline passed with work still running
            self._abandon(futures)
            raise MediaTimeoutError("media preparation ran past the request deadline")
        if failed:
            for f in pending:
                f.cancel()
            wait([f for f in futures if not f.cancelled()])  # their references must be returned
            self._abandon(futures)
            first = next(i for i, f in enumerate(futures) if not f.cancelled() and f.exception() is not None)
            exc = futures[first].exception()
            if isinstance(exc, MediaError) and exc.item is None:
                exc.item = first
            raise exc
        return [f.result() for f in futures]

    def _one(self, item: MediaItem, deadline: float | None) -> _Done:
        t0 = time.perf_counter()
        data = self._fetcher.acquire(item.source, deadline)
        t1 = time.perf_counter()
        digest = media_digest(item.modality, data)
        if item.modality == "image":
            def build(reserve):
                return prepare_image(data, digest, self.limits, reserve)
        else:
            def build(reserve):
                return prepare_video(data, digest, self.limits, reserve, self.video)
        payload, how = self.cache.acquire(digest, build, deadline)
        t2 = time.perf_counter()
        return _Done(payload, how, t1 - t0, t2 - t1 if how == "miss" else 0.0, len(data))

    def _account(self, stats: MediaStats, done: list[_Done]) -> None:
        """Fill the request's stats and enforce its aggregate budgets."""
        for d in done:
            stats.acquire_seconds += d.acquire_seconds
            stats.work_seconds += d.work_seconds
            stats.cache_hits += d.how == "hit"
            stats.cache_misses += d.how == "miss"
            stats.single_flight_joins += d.how == "joined"
            stats.source_bytes += d.source_bytes
            stats.decoded_pixels += d.payload.decoded_pixels
            stats.payload_bytes += d.payload.nbytes
            stats.raw_patches += d.payload.num_patches
            stats.vision_tokens += d.payload.num_tokens
        lim = self.limits
        for have, limit, what in ((stats.source_bytes, lim.max_request_source_bytes, "source bytes"),
                                  (stats.decoded_pixels, lim.max_request_decoded_pixels, "decoded pixels"),
                                  (stats.raw_patches, lim.max_request_patches, "vision patches"),
                                  (stats.vision_tokens, lim.max_request_tokens, "vision tokens")):
            if have > limit:
                raise MediaBudgetExceededError(
                    f"the request's media need {have} {what}, more than the limit of {limit}")

    def _abandon(self, futures: list[Future]) -> None:
        """Return the references of items that succeeded (now or later) in a request that failed."""
        def give_back(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self.cache.release(f.result().payload.digest)

        for f in futures:
            f.add_done_callback(give_back)  # runs at once for finished futures

    def _release_keys(self, keys: list[str]) -> None:
        for key in keys:
            self.cache.release(key)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
