"""Property test of the page allocator: no leak, no double use, all-or-nothing allocation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine.kv_pool import PagePool, PoolExhausted, SlotPool

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("share"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(1, 24), script=ops)
def test_page_pool_never_leaks_or_double_allocates(num_pages, script):
    pool = PagePool(num_pages, page_size=16)
    holders: list[list[int]] = []  # each entry: one holder's reference to some pages
    for op, arg in script:
        if op == "alloc":
            free_before = pool.free_pages
            if arg > free_before:
                with pytest.raises(PoolExhausted):
                    pool.allocate(arg)
                assert pool.free_pages == free_before  # nothing taken on failure
            else:
                pages = pool.allocate(arg)
                live = {p for h in holders for p in h}
                assert not live & set(pages), "a live page was handed out again"
                holders.append(pages)
        elif op == "share" and holders:
            pages = holders[arg % len(holders)]
            pool.share(pages)
            holders.append(list(pages))
        elif op == "release" and holders:
            pool.release(holders.pop(arg % len(holders)))
        live = {p for h in holders for p in h}
        assert pool.used_pages == len(live)
        for p in live:
            assert pool.refcount(p) == sum(h.count(p) for h in holders)
    for h in holders:
        pool.release(h)
    assert pool.free_pages == num_pages


def test_double_release_is_an_error():
    pool = PagePool(2, 4)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(ValueError):
        pool.release(pages)


def test_slot_pool():
    slots = SlotPool(2)
    a, b = slots.allocate(), slots.allocate()
    with pytest.raises(PoolExhausted):
        slots.allocate()
    slots.release(a)
    with pytest.raises(ValueError):
        slots.release(a)
    assert slots.allocate() == a and b != a


def test_a_slot_traded_for_a_verify_row_leaves_the_pool_and_the_row_joins_it():
    """Speculative rollback (ModelRunner.rollback) trades a sequence's slot for the verify row holding the
    accepted state: the pool keeps as many slots, and releases follow the trade."""
    slots = SlotPool(2)
    a = slots.allocate()
    slots.exchange(a, 7)
    assert slots.members == {7, 1 - a} and slots.used_slots == 1
    with pytest.raises(ValueError):
        slots.release(a)  # the runner's now
    with pytest.raises(ValueError):
        slots.exchange(1 - a, 9)  # free: nobody holds it to trade
    with pytest.raises(ValueError):
        slots.exchange(7, 1 - a)  # already the pool's
    slots.release(7)
    assert slots.free_slots == 2 and {slots.allocate(), slots.allocate()} == {7, 1 - a}


def test_fresh_sequences_start_at_the_longest_free_run_and_grow_in_place():
    """What keeps a CPU decode row's context one run of pages (kernels.attention reads it in place)."""
    pool = PagePool(12, 4)
    a, b, c = pool.allocate(2), pool.allocate(3), pool.allocate(2)
    assert (a, b, c) == ([0, 1], [2, 3, 4], [5, 6])
    pool.release(b)  # free: 2-4 (3 pages) and 7-11 (5 pages)
    assert pool.allocate(3) == [7, 8, 9]
    assert pool.allocate(1, after=9) == [10]  # growth takes the next page while it is free
    pool.release(a)  # free: 0-4 (5 pages), 11
    assert pool.allocate(2) == [0, 1]
