"""Assertions shared by the engine tests."""

from __future__ import annotations


def assert_no_leak(engine) -> None:
    """Every page is held by a retained checkpoint or free; dropping the checkpoints frees everything."""
    pool = engine.scheduler.pages
    assert pool.used_pages == engine.cache.held_pages
    engine.cache.clear()
    assert pool.used_pages == 0
    if engine.scheduler.slots is not None:
        assert engine.scheduler.slots.used_slots == 0
