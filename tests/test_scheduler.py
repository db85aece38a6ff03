"""Scheduling decisions without tensors (contract: "Execution behavior": FIFO admission with a bounded
bypass, the youngest request pauses first, restores go in arrival order)."""

from __future__ import annotations

from ninfer.engine.kv_pool import PagePool, SlotPool
from ninfer.engine.scheduler import BYPASS_LIMIT, Scheduler
from ninfer.engine.sequence import Sequence, Status
from ninfer.engine.types import EngineRequest, ResolvedSampling

SAMPLING = ResolvedSampling(0.0, 1.0, 0, 0.0, 0.0, 0.0, 0)


def seq(order: int, prompt_len: int) -> Sequence:
    return Sequence(request=EngineRequest(f"r{order}", [1] * prompt_len), order=order, sampling=SAMPLING,
                    max_tokens=10, controller=None, emit=lambda e: None, deadline=1e18)


def make(pages=8, page_size=4, lanes=4, chunk=64, slots=None):
    return Scheduler(max_concurrency=lanes, prefill_chunk=chunk, pages=PagePool(pages, page_size),
                     slots=SlotPool(slots) if slots else None)


def test_fifo_admission_in_arrival_order():
    s = make()
    s.waiting.extend([seq(1, 4), seq(2, 4), seq(3, 4)])
    assert [x.order for x in s.admit()] == [1, 2, 3]
    assert all(x.status is Status.PREFILL for x in s.resident)


def test_bounded_bypass_when_head_cannot_fit():
    s = make(pages=8, page_size=4, lanes=8, chunk=64)  # 32 tokens of KV
    head = seq(1, 40)  # needs more pages than the pool has free right now
    small = [seq(i, 2) for i in range(2, 2 + BYPASS_LIMIT + 2)]
    s.waiting.extend([head, *small])
    admitted = s.admit()
    assert head not in admitted
    assert len(admitted) == BYPASS_LIMIT  # then nobody else may overtake the head
    assert list(s.waiting)[0] is head


def test_lanes_bound_residency():
    s = make(lanes=2)
    s.waiting.extend([seq(i, 2) for i in range(1, 5)])
    assert len(s.admit()) == 2 and len(s.waiting) == 2


def test_pressure_pauses_the_youngest_and_restores_in_order():
    s = make(pages=4, page_size=4, lanes=4, slots=8)
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    s.waiting.extend([a, b, c])
    s.admit()
    for x in (a, b, c):
        unit = s.next_prefill()
        assert unit.seq is x
        x.num_computed = unit.end
        x.status = Status.DECODE
    # a needs a second page: the pool has one left; then b needs one: c (youngest) pauses
    ready, starved = s.decode_batch()
    assert c.status is Status.PAUSED and s.preemptions >= 1
    assert a in ready and not starved
    assert c.pages == [] and c.state_slot is None
    # finishing a frees room; the paused request comes back before any fresh one
    fresh = seq(4, 2)
    s.waiting.append(fresh)
    s.remove(a)
    admitted = s.admit()
    assert admitted[0] is c


def test_one_round_never_promises_more_pages_than_are_free():
    """Two paused requests with host snapshots each need 8 of the 10 free pages: restoring both in one
    admission round would make the second restore's page allocation fail (it took the engine down)."""
    s = make(pages=10, page_size=4, lanes=4, slots=8)
    paused = [seq(1, 28), seq(2, 28)]
    for x in paused:
        x.snapshot, x.num_computed, x.status = object(), 28, Status.PAUSED  # pages_for(29) = 8 each
    s.paused.extend(paused)
    fresh = seq(3, 4)  # needs 2 pages: fits beside the first restore, not if that one were forgotten
    s.waiting.append(fresh)
    assert s.admit() == [paused[0], fresh]
    assert s.paused == [paused[1]] and paused[1].status is Status.PAUSED
