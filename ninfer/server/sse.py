"""Server-sent event framing and the transport-level keep-alive comment."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


def data_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def named_event(event: str, payload: Any) -> bytes:
    return f"event: {event}\n".encode() + data_event(payload)


async def with_keepalive(frames: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """Pass frames through; after `interval_s` without one, emit the keep-alive comment.

    The pending `__anext__` is kept as one task across timeouts (cancelling it would end the
    source generator). Closing this generator closes the source, which is how disconnects cancel.
    """
    source = frames.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                frame = task.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        await source.aclose()
