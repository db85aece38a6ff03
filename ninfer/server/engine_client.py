"""How the router talks to the engine: in-process (tests, notebooks) or through a Ray Serve handle.

Both give one shape: `open(request)` submits and returns once the engine has accepted the request
(raising the engine's typed refusal, e.g. overload or context length, so HTTP can still answer with
its status), then the returned stream yields lists of engine events (`engine_event_batches`) until the
FinishEvent. Closing the stream early cancels the request inside the engine, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextvars
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


async def engine_event_batches(engine, request: EngineRequest) -> AsyncIterator[list[Any]]:
    """Submit to a plain Engine and yield [ACCEPTED], then lists of its events; a refusal comes as [EngineFailure].

    Each list holds every event that arrived since the consumer last asked: one while it keeps up with a step
    of one token, a speculative round's tokens together, more when the consumer lags. Each list then crosses a
    Ray hop as one object and leaves the router as one HTTP write, instead of one per token.
    Runs wherever the Engine lives (in-process, or inside the Ray engine replica). If the consumer
    stops early (client gone, generator closed or cancelled), the request is cancelled in the engine.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
        engine.submit(request, loop_emitter(loop, events.put_nowait, lambda: engine.cancel(request.request_id)))
    except EngineError as exc:
        yield [EngineFailure.of(exc)]
        return
    done = False
    try:
        yield [ACCEPTED]
        while not done:
            arrived = [await events.get()]
            while not events.empty():
                arrived.append(events.get_nowait())
            batch = []
            for ev in arrived:  # nothing follows a terminal event
                if isinstance(ev, EngineError):
                    ev = EngineFailure.of(ev)
                batch.append(ev)
                if isinstance(ev, (EngineFailure, FinishEvent)):
                    done = True
                    break
            yield batch
    finally:
        if not done:
            engine.cancel(request.request_id)


async def engine_events(engine, request: EngineRequest) -> AsyncIterator[Any]:
    """`engine_event_batches` one item at a time (the Engine deployment's `stream`, for notebooks and scripts)."""
    batches = engine_event_batches(engine, request)
    try:
        async for batch in batches:
            for item in batch:
                yield item
    finally:
        await batches.aclose()


class EngineClient(Protocol):
    async def reserve(self, request_id: str) -> None: ...  # a lifetime slot before preparation; raises EngineError

    async def release(self, request_id: str) -> None: ...  # the answer is written; does not wait for the engine

    async def open(self, request: EngineRequest) -> AsyncIterator[list[Any]]: ...

    async def ready(self) -> bool: ...

    async def snapshot(self) -> dict[str, Any]: ...


async def _checked(batches: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
    """Turn an EngineFailure back into an exception for the consumer, after the events before it; closing it
    closes the source."""
    try:
        async for batch in batches:
            failure = next((i for i, item in enumerate(batch) if isinstance(item, EngineFailure)), None)
            if failure is None:
                yield batch
                continue
            if failure:
                yield batch[:failure]
            raise batch[failure].to_exception()
    finally:
        await batches.aclose()


async def _open(batches: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
    first = (await anext(batches))[0]
    if isinstance(first, EngineFailure):
        await batches.aclose()
        raise first.to_exception()
    return _checked(batches)


class LocalEngineClient:
    """The engine in this process (tests, notebooks, single-process runs)."""

    def __init__(self, engine):
        self.engine = engine

    async def reserve(self, request_id: str) -> None:
        self.engine.reserve(request_id)

    async def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    async def open(self, request: EngineRequest) -> AsyncIterator[list[Any]]:
        return await _open(engine_event_batches(self.engine, request))

    async def ready(self) -> bool:
        return bool(self.engine.healthy)

    async def snapshot(self) -> dict[str, Any]:
        return self.engine.snapshot()


class RayEngineClient:
    """The Engine deployment behind a Ray Serve handle (methods `reserve`, `release`, `stream_batches`, `ready`,
    `snapshot`)."""

    def __init__(self, handle, ready_timeout_s: float = 5.0):
        self.handle = handle
        self.ready_timeout_s = ready_timeout_s

    async def reserve(self, request_id: str) -> None:
        failure = await self.handle.reserve.remote(request_id)
        if failure is not None:
            raise failure.to_exception()

    async def release(self, request_id: str) -> None:
        # Sent at once, nothing waits for the answer, and from an empty context: Serve cancels the calls a
        # cancelled request made (its request context marks them as children), and this one must still arrive.
        contextvars.Context().run(self.handle.release.remote, request_id)

    async def open(self, request: EngineRequest) -> AsyncIterator[list[Any]]:
        return await _open(self._stream(request))

    async def _stream(self, request: EngineRequest) -> AsyncIterator[list[Any]]:
        response = self.handle.options(stream=True).stream_batches.remote(request)
        finished = False
        try:
            async for batch in response:
                finished = isinstance(batch[-1], (FinishEvent, EngineFailure))
                yield batch
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
           "RayEngineClient", "engine_event_batches", "engine_events"]

