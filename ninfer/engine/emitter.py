"""Handing engine events from the engine thread to an asyncio consumer."""

from __future__ import annotations

import asyncio
from typing import Callable


def loop_emitter(loop: asyncio.AbstractEventLoop, put: Callable[[object], None],
                 on_gone: Callable[[], None]) -> Callable[[object], None]:
    """An emit callable for the engine thread that hands each event to `put` on `loop`. Once that loop is closed
    (its consumer is gone without cancelling) later events are dropped and on_gone runs once, so a vanished
    consumer cancels its own request instead of raising inside the engine loop, which would fail every request."""
    gone = False

    def emit(ev: object) -> None:
        nonlocal gone
        if gone:
            return
        try:
            loop.call_soon_threadsafe(put, ev)
        except RuntimeError:  # "Event loop is closed"
            gone = True
            on_gone()

    return emit
