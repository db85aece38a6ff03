"""Scheduling decisions without tensors (contract: "Execution behavior": FIFO admission with a bounded
bypass, the youngest request pauses first, restores go in arrival order)."""

from __future__ import annotations

from ninfer.engine.kv_manager import KVManager
from ninfer.engine.kv_pool import PagePool, SlotPool
from ninfer.engine.plan import RunnerOutput, StepPlan
from ninfer.engine.scheduler import BYPASS_LIMIT, Scheduler
from ninfer.engine.sequence import Sequence, Status
from ninfer.engine.types import EngineRequest, ResolvedSampling

SAMPLING = ResolvedSampling(0.0, 1.0, 0, 0.0, 0.0, 0.0, 0)


def seq(order: int, prompt_len: int) -> Sequence:
    return Sequence(request=EngineRequest(f"r{order}", [1] * prompt_len), order=order, sampling=SAMPLING,
                    max_tokens=10, controller=None, emit=lambda e: None, deadline=1e18)


def make(pages=8, page_size=4, lanes=4, chunk=64, slots=None):
    kv = KVManager(PagePool(pages, page_size), SlotPool(slots) if slots else None)
    return Scheduler(max_concurrency=lanes, prefill_chunk=chunk, kv=kv)


def admit(s: Scheduler) -> list[Sequence]:
    """One admission round (the start of Scheduler.schedule); the newly bound requests."""
    plan = StepPlan()
    s.admit(plan)
    return [a.seq for a in plan.admitted]


def test_fifo_admission_in_arrival_order():
    s = make()
    s.waiting.extend([seq(1, 4), seq(2, 4), seq(3, 4)])
    assert [x.order for x in admit(s)] == [1, 2, 3]
    assert all(x.status is Status.PREFILL for x in s.resident)


def test_bounded_bypass_when_head_cannot_fit():
    s = make(pages=8, page_size=4, lanes=8, chunk=64)  # 32 tokens of KV
    head = seq(1, 40)  # needs more pages than the pool has free right now
    small = [seq(i, 2) for i in range(2, 2 + BYPASS_LIMIT + 2)]
    s.waiting.extend([head, *small])
    admitted = admit(s)
    assert head not in admitted
    assert len(admitted) == BYPASS_LIMIT  # then nobody else may overtake the head
    assert list(s.waiting)[0] is head


def test_lanes_bound_residency():
    s = make(lanes=2)
    s.waiting.extend([seq(i, 2) for i in range(1, 5)])
    assert len(admit(s)) == 2 and len(s.waiting) == 2


def test_pressure_pauses_the_youngest_and_restores_in_order():
    s = make(pages=4, page_size=4, lanes=4, slots=8)
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    s.waiting.extend([a, b, c])
    plans = []
    for x in (a, b, c):  # each prefills its prompt in one chunk and samples a token
        plan = s.schedule()
        plans.append(plan)
        if plan.prefill is None:
            break
        assert plan.prefill.seq is x
        s.update(plan, RunnerOutput([[7]]))
        x.output_ids.append(7)
    # a needs a second page, then b: the pool runs out and c (youngest) pauses
    plan = plans[-1] if plans[-1].prefill is None else s.schedule()
    assert c.status is Status.PAUSED and s.preemptions >= 1
    assert a in [w.seq for w in plan.decode] and not plan.starved
    assert c.pages == [] and c.state_slot is None
    # finishing a frees room; the paused request comes back before any fresh one
    fresh = seq(4, 2)
    s.waiting.append(fresh)
    s.finish(a, retain=False)
    admitted = admit(s)
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
    assert admit(s) == [paused[0], fresh]
    assert s.paused == [paused[1]] and paused[1].status is Status.PAUSED


PROMPT = [5] * 40


def _with_retained(lanes: int = 2) -> Scheduler:
    """A 12-page pool (4 tokens a page) of which one retained 44-token checkpoint holds 11 pages; its
    first 32 tokens are PROMPT's, which would reuse them (8 pages) and need 3 more."""
    pool = PagePool(12, 4)
    s = Scheduler(max_concurrency=lanes, prefill_chunk=64, kv=KVManager(pool, None, prefix_reuse=True))
    s.cache.add(tuple(PROMPT[:32] + [9] * 12), pool.allocate(11), None, "endpoint")
    return s


def test_a_prefix_that_holds_the_pool_is_given_up_when_nothing_runs():
    """Keeping the checkpoint a request would reuse leaves it too few pages, and nothing else can free
    any: it waited until its queue timeout (a paused one, forever). With nothing resident, admission
    evicts the checkpoint too and the request starts from token 0."""
    s = _with_retained()
    head = Sequence(request=EngineRequest("r1", PROMPT), order=1, sampling=SAMPLING, max_tokens=10,
                    controller=None, emit=lambda e: None, deadline=1e18)
    s.waiting.append(head)
    assert admit(s) == [head]
    assert head.match is None and not s.cache.entries and s.pages.free_pages == 12


def test_the_reused_prefix_is_kept_while_a_resident_request_will_free_pages():
    s = _with_retained()
    s.resident.append(seq(0, 4))  # running: it will finish and free its pages (none here, but it may)
    waiting = Sequence(request=EngineRequest("r1", PROMPT), order=1, sampling=SAMPLING, max_tokens=10,
                       controller=None, emit=lambda e: None, deadline=1e18)
    s.waiting.append(waiting)
    assert admit(s) == [] and len(s.cache.entries) == 1


def test_a_prompt_that_fills_the_whole_pool_is_admitted():
    """No room for a token past it, and none is needed: it ends at the context ceiling."""
    s = make(pages=4, page_size=4, lanes=2)
    full = seq(1, 16)
    s.waiting.append(full)
    assert admit(s) == [full]


def test_a_restore_leaves_the_older_residents_next_token_its_page():
    """The older request's decode row needs the last free page this step: restoring the paused one there would
    pause it again in the same plan (its snapshot copied in and straight back out). It stays paused, with its
    snapshot, until room frees up."""
    s = make(pages=3, page_size=4, lanes=4, slots=8)
    a = seq(1, 8)
    s.waiting.append(a)
    plan = s.schedule()
    s.update(plan, RunnerOutput([[7]]))
    a.output_ids.append(7)
    b = seq(2, 3)
    snapshot = object()
    b.snapshot, b.num_computed, b.status, b.t_paused = snapshot, 3, Status.PAUSED, 1.0
    s.paused.append(b)
    plan = s.schedule()
    assert not plan.admitted and not plan.preempted and s.paused == [b]
    assert b.lane is None and b.pages == [] and b.snapshot is snapshot and b.num_computed == 3
    assert not [op for op in plan.before if op.kind == "restore"]
    assert [w.seq for w in plan.decode] == [a]


def test_a_request_paused_mid_prompt_is_restored_with_room_for_its_next_chunk():
    """Contract, "Execution behavior": a restoration reserves room to rebuild the saved frontier and complete one
    new execution unit. A request paused with 8 of its 20 prompt tokens computed next runs an 8-token chunk, not
    one token: restored with room for its frontier alone, it was paused again in the same step, every step (a
    served tiny model logged 70 preemptions for 5 restores)."""
    s = make(pages=6, page_size=4, lanes=4, chunk=8, slots=8)
    a = _decoding(s, 8)  # holds 2 pages; its next token needs a third
    b = seq(2, 20)
    b.snapshot, b.num_computed, b.status, b.t_paused = object(), 8, Status.PAUSED, 1.0
    s.paused.append(b)
    for _ in range(3):
        plan = s.schedule()
        assert not plan.admitted and not plan.preempted and [w.seq for w in plan.decode] == [a]
        s.update(plan, RunnerOutput([[7]]))
        a.output_ids.append(7)
    assert s.preemptions == 0 and s.paused == [b]
    s.finish(a, retain=False)
    plan = s.schedule()
    assert [x.seq for x in plan.admitted] == [b] and not plan.preempted
    assert plan.prefill.seq is b and (plan.prefill.start, plan.prefill.end) == (8, 16)


def _decoding(s: Scheduler, prompt_len: int) -> Sequence:
    """A request admitted and prefilled, its first token sampled: it decodes at the next schedule."""
    x = seq(1, prompt_len)
    s.waiting.append(x)
    plan = s.schedule()
    s.update(plan, RunnerOutput([[7]]))
    x.output_ids.append(7)
    return x


def test_a_drafting_row_gets_pages_for_the_drafters_reach_while_they_are_free():
    """Speculative decoding (serving.md: --spec, --draft-tokens): a decode row's
    drafts get pages (draft_budget), and
    with a drafter that writes past the verify before the next round is planned (MTP drafting ahead: its chain
    of draft_tokens - 1 head steps from the accepted position), pages for that reach too, from free pages only."""
    s = make(pages=16, page_size=4, lanes=2)
    s.draft_tokens, s.draft_reach = 3, 2
    x = _decoding(s, 4)
    work = s.schedule().decode[0]
    assert work.draft_budget == 3
    assert len(x.pages) == s.kv.pages_for(x.num_computed + 1 + 3 + 2)  # the verify's 4 tokens, then the chain's 2


def test_the_drafters_reach_leaves_a_free_page_for_each_residents_next_token():
    """The reach is best effort: taking the pool's last free pages would pause a younger request at its next
    token, so a row reserves them only while a page per resident stays free."""
    s = make(pages=3, page_size=4, lanes=2)
    s.draft_tokens, s.draft_reach = 3, 2
    x = _decoding(s, 4)  # 1 page for the prompt, 1 for the verify's tokens 4..7: 1 left, 1 resident
    work = s.schedule().decode[0]
    assert work.draft_budget == 3
    assert len(x.pages) == 2 and s.kv.pages.free_pages == 1
