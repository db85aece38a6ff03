"""The MediaPreprocessor deployment: CPU preparation of images and video (ninfer.media).

One replica: the payload cache, the live-bytes account and the leases live in its process, and a
release must reach the replica that holds the lease. Parallelism comes from the worker threads
inside it (--media-preprocess-threads); pillow, PyAV and numpy do their work outside the GIL.

A router calls, through its handle:
    batch = await media.prepare.remote(items, timeout_s=..., hold=True)   # PreparedBatch
    ... engine uses batch.items ...
    await media.release.remote(batch.lease)
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from ninfer.media import MediaPreprocessor, PreparedBatch


@serve.deployment(name="MediaPreprocessor", num_replicas=1, max_ongoing_requests=256,
                  ray_actor_options={"num_cpus": 0.1})
class MediaPreprocessorDeployment:
    def __init__(self, cache_mib: int = 1024, live_mib: int = 2048, threads: int = 0):
        self.media = MediaPreprocessor(cache_mib, live_mib, threads)

    async def prepare(self, items: list[Any], timeout_s: float | None = None, hold: bool = True) -> PreparedBatch:
        # a thread keeps the replica's event loop free for other requests' prepare and release calls
        return await asyncio.to_thread(self.media.prepare, items, timeout_s=timeout_s, hold=hold)

    def release(self, lease: int | None) -> bool:
        return self.media.release(lease)

    def snapshot(self) -> dict[str, int]:
        return self.media.snapshot()
