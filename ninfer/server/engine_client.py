"""How the router talks to the engine: in-process (tests, notebooks) or through a Ray Serve handle.

Both give one shape: `open(request)` submits and returns once the engine has accepted the request
(raising the engine's typed refusal, e.g. overload or context length, so HTTP can still answer with
its status), then the returned stream yields engine events until the FinishEvent. Closing the
stream early cancels the request inside the engine, which frees its pages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from ninfer.engine.emitter import loop_emitter
from ninfer.engine.types import (
    ContextLengthExceededError,
    EngineError,
    EngineRequest,
    EngineUnavailableError,
    FinishEvent,
)

ACCEPTED = "accepted"  # first item of every engine stream: submit succeeded


@dataclass
class EngineFailure:
    """An EngineError as plain data, so it crosses a process boundary intact (code, message, counts)."""

    code: str
    message: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: EngineError) -> "EngineFailure":
        attrs = {k: getattr(exc, k) for k in ("prompt_tokens", "max_context") if hasattr(exc, k)}
        return cls(exc.code, str(exc), attrs)

    def to_exception(self) -> EngineError:
        if self.code == ContextLengthExceededError.code:
            return ContextLengthExceededError(self.attrs["prompt_tokens"], self.attrs["max_context"])
        for kind in _error_classes():
            if kind.code == self.code:
                return kind(self.message)
        exc = EngineError(self.message)
        exc.code = self.code
        return exc


def _error_classes() -> list[type[EngineError]]:
    return [c for c in EngineError.__subclasses__() if c is not ContextLengthExceededError]


async def engine_events(engine, request: EngineRequest) -> AsyncIterator[Any]:
    """Submit to a plain Engine and yield ACCEPTED, then its events; refusals come as EngineFailure.

    Runs wherever the Engine lives (in-process, or inside the Ray engine replica). If the consumer
    stops early (client gone, generator closed or cancelled), the request is cancelled in the engine.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
        engine.submit(request, loop_emitter(loop, events.put_nowait, lambda: engine.cancel(request.request_id)))
    except EngineError as exc:
        yield EngineFailure.of(exc)
        return
    done = False
    try:
        yield ACCEPTED
        while not done:
            ev = await events.get()
            if isinstance(ev, EngineError):
                done = True
                yield EngineFailure.of(ev)
            else:
                done = isinstance(ev, FinishEvent)
                yield ev
    finally:
        if not done:
            engine.cancel(request.request_id)


class EngineClient(Protocol):
    async def open(self, request: EngineRequest) -> AsyncIterator[Any]: ...

    async def ready(self) -> bool: ...

    async def snapshot(self) -> dict[str, Any]: ...


async def _checked(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Turn EngineFailure items back into exceptions for the consumer; closing it closes the source."""
    try:
        async for item in items:
            if isinstance(item, EngineFailure):
                raise item.to_exception()
            yield item
    finally:
        await items.aclose()


async def _open(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    first = await anext(items)
    if isinstance(first, EngineFailure):
        await items.aclose()
        raise first.to_exception()
    return _checked(items)


class LocalEngineClient:
    """The engine in this process (tests, notebooks, single-process runs)."""

    def __init__(self, engine):
        self.engine = engine

    async def open(self, request: EngineRequest) -> AsyncIterator[Any]:
        return await _open(engine_events(self.engine, request))

    async def ready(self) -> bool:
        return bool(self.engine.healthy)

    async def snapshot(self) -> dict[str, Any]:
        return self.engine.snapshot()


class RayEngineClient:
    """The Engine deployment behind a Ray Serve handle (methods `stream`, `ready`, `snapshot`)."""

    def __init__(self, handle, ready_timeout_s: float = 5.0):
        self.handle = handle
        self.ready_timeout_s = ready_timeout_s

    async def open(self, request: EngineRequest) -> AsyncIterator[Any]:
        return await _open(self._stream(request))

    async def _stream(self, request: EngineRequest) -> AsyncIterator[Any]:
        response = self.handle.options(stream=True).stream.remote(request)
        finished = False
        try:
            async for item in response:
                finished = isinstance(item, (FinishEvent, EngineFailure))
                yield item
        finally:
            if not finished:  # abandoned: cancel the replica's generator, which cancels the request
                response.cancel()

    async def ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.handle.ready.remote(), self.ready_timeout_s))
        except Exception:  # an unreachable or dead engine replica is "unavailable", not a 500
            return False

    async def snapshot(self) -> dict[str, Any]:
        return await self.handle.snapshot.remote()


__all__ = ["ACCEPTED", "EngineClient", "EngineFailure", "EngineUnavailableError", "LocalEngineClient",
           "RayEngineClient", "engine_events"]

