"""How the router reaches media preparation: a MediaPreprocessor in this process, or the Ray Serve
handle of the MediaPreprocessor deployment. Both give the same async prepare/release.

Errors come back as the media/ error classes (ninfer.media.errors) with their `item`, whichever
side of a process boundary they were raised on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from ninfer.media import MediaError, MediaPreprocessor, PreparedBatch


class MediaClient(Protocol):
    async def prepare(self, items: Sequence[Any], *, timeout_s: float | None, hold: bool) -> PreparedBatch: ...

    async def release(self, lease: int | None) -> None: ...


class LocalMediaClient:
    """The preprocessor in this process (tests, the in-process app); prepare runs off the event loop."""

    def __init__(self, media: MediaPreprocessor):
        self.media = media

    async def prepare(self, items: Sequence[Any], *, timeout_s: float | None, hold: bool) -> PreparedBatch:
        return await asyncio.to_thread(self.media.prepare, list(items), timeout_s=timeout_s, hold=hold)

    async def release(self, lease: int | None) -> None:
        self.media.release(lease)


class RayMediaClient:
    """The MediaPreprocessor deployment (one replica: its cache, live account and leases are there)."""

    def __init__(self, handle):
        self.handle = handle

    async def prepare(self, items: Sequence[Any], *, timeout_s: float | None, hold: bool) -> PreparedBatch:
        try:
            return await self.handle.prepare.remote(list(items), timeout_s=timeout_s, hold=hold)
        except Exception as exc:
            # Ray re-raises a replica's exception as a RayTaskError (usually also an instance of the
            # cause's class); the cause is the plain typed error, `item` included.
            cause = getattr(exc, "cause", None)
            if isinstance(cause, MediaError):
                raise cause from None
            raise

    async def release(self, lease: int | None) -> None:
        if lease is not None:
            await self.handle.release.remote(lease)
