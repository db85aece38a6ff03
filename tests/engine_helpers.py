"""Assertions and drivers shared by the engine tests."""

from __future__ import annotations

import asyncio

from ninfer.engine.types import TokenEvent


def mixed_prompts(n: int) -> list[list[int]]:
    """Mixed lengths, so prefill chunks and decode rows of different ages share batches."""
    lengths = [3, 17, 5, 40, 9, 26, 2, 33]
    return [[(7 * i + 13 * j) % 900 + 50 for j in range(lengths[i % len(lengths)])] for i in range(n)]


def run_all(engine, requests):
    """Every request streamed concurrently; each one's events."""
    async def main():
        async def one(req):
            return [e async for e in engine.stream(req)]
        return await asyncio.gather(*(one(r) for r in requests))
    return asyncio.run(main())


def token_ids(events):
    return [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]


def assert_no_leak(engine) -> None:
    """Every page is held by a retained checkpoint or free; dropping the checkpoints frees everything."""
    pool = engine.scheduler.pages
    assert pool.used_pages == engine.cache.held_pages
    engine.cache.clear()
    assert pool.used_pages == 0
    if engine.scheduler.slots is not None:
        assert engine.scheduler.slots.used_slots == 0
