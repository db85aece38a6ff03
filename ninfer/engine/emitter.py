"""Handing engine events from the engine thread to asyncio consumers.

Every consumer on one event loop shares that loop's mailbox: the engine thread appends (put, event) pairs, and
inside `batched()` (the engine loop wraps each iteration in it) wakes each loop it posted to once, at the end of
the block. A step that commits tokens for many requests, or several tokens of one (a speculative round), then
costs one cross-thread wake-up (a self-pipe write, and the loop's wake), not one per event, and its events
arrive together, so `engine_event_batches` hands them on as one list. Waking at the first post instead is not
enough: the self-pipe write releases the GIL, and the loop thread takes the first event alone. Posts outside
`batched()` wake the loop at once. The loop calls every put in posting order."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()
_thread = threading.local()  # .pending: the mailboxes this thread posted to inside batched(), else None


class _Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)  # the registry's value must not keep its key alive
        self.posts: deque[tuple[Callable[[object], None], object]] = deque()
        self.scheduled = False
        self.closed = False

    def post(self, put: Callable[[object], None], ev: object) -> bool:
        """Queue put(ev) on the loop (woken now, or at the end of this thread's `batched()` block); False once
        the loop is closed."""
        loop = self.loop()
        if self.closed or loop is None or loop.is_closed():  # a delivery scheduled before it closed never runs
            self.closed = True
            return False
        self.posts.append((put, ev))
        pending = getattr(_thread, "pending", None)
        if pending is not None:
            pending[self] = None
            return True
        return self.wake()

    def wake(self) -> bool:
        """Schedule a delivery unless one is pending. Lock-free under the GIL: posts are appended before
        `scheduled` is read, and `_deliver` clears `scheduled` before it drains, so a post is either drained by a
        delivery already scheduled or schedules one itself (at worst one that finds nothing)."""
        loop = self.loop()
        if self.scheduled or loop is None:
            return loop is not None
        self.scheduled = True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # "Event loop is closed": the next post reports the consumer gone
            self.closed = True
            return False
        return True

    def _deliver(self) -> None:
        self.scheduled = False
        posts = self.posts
        while posts:
            put, ev = posts.popleft()
            put(ev)


@contextmanager
def batched() -> Iterator[None]:
    """Posts from this thread inside the block wake their loops when it ends, each loop once (nested: the
    outermost block wakes)."""
    if getattr(_thread, "pending", None) is not None:
        yield
        return
    _thread.pending = {}
    try:
        yield
    finally:
        boxes, _thread.pending = _thread.pending, None
        for box in boxes:
            box.wake()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox(loop)
        return box


def loop_emitter(loop: asyncio.AbstractEventLoop, put: Callable[[object], None],
                 on_gone: Callable[[], None]) -> Callable[[object], None]:
    """An emit callable for the engine thread that hands each event to `put` on `loop` (through the loop's
    mailbox). Once that loop is closed (its consumer is gone without cancelling) later events are dropped and
    on_gone runs once, so a vanished consumer cancels its own request instead of raising inside the engine loop,
    which would fail every request."""
    box = _mailbox(loop)
    gone = False

    def emit(ev: object) -> None:
        nonlocal gone
        if gone:
            return
        if not box.post(put, ev):
            gone = True
            on_gone()

    return emit
