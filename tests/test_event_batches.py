"""Engine events reach the router in batches: one loop wake-up per burst (ninfer.engine.emitter), one list per
burst through `engine_event_batches` (one Ray object, one SSE write). Contract (spec/serving.md, "OpenAI Chat
Completions": streaming sends the deltas in order; prompt-progress events "may be coalesced when the consumer is
slower than prefill"): batching changes how events travel, never which tokens or in what order."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_helpers import mixed_prompts, run_all, token_ids

from ninfer.engine import emitter
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.speculative import OracleProposer
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent
from ninfer.server.engine_client import ACCEPTED, LocalEngineClient, engine_event_batches, engine_events

GREEDY = SamplingParams(temperature=0.0)


class _CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts cross-thread wake-ups."""

    def __init__(self):
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, callback, *args, context=None):
        self.wakeups += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_a_burst_of_events_wakes_the_loop_once_and_keeps_their_order():
    loop = _CountingLoop()
    try:
        got_a, got_b = [], []
        emit_a = emitter.loop_emitter(loop, got_a.append, lambda: None)
        emit_b = emitter.loop_emitter(loop, got_b.append, lambda: None)

        def engine_step(first: int) -> None:  # the engine thread commits tokens of two requests in one step
            for i in range(first, first + 50):
                (emit_a if i % 2 else emit_b)(i)

        worker = threading.Thread(target=engine_step, args=(0,))
        worker.start()
        worker.join()
        assert loop.wakeups == 1 and got_a == got_b == []  # delivered only once the loop runs
        loop.run_until_complete(asyncio.sleep(0))
        assert got_a == list(range(1, 50, 2)) and got_b == list(range(0, 50, 2))
        engine_step(50)  # the next step: one more wake-up
        loop.run_until_complete(asyncio.sleep(0))
        assert loop.wakeups == 2 and got_a[-1] == 99 and got_b[-1] == 98
    finally:
        loop.close()


def test_inside_batched_the_loop_wakes_when_the_block_ends():
    """The engine loop's iteration (`batched`): nothing is scheduled while the step commits, so the consumer's loop
    cannot take the first token alone (a self-pipe write releases the GIL); one wake-up per loop at the end."""
    loops = [_CountingLoop(), _CountingLoop()]
    try:
        got = [[], []]
        emits = [emitter.loop_emitter(loop, got[i].append, lambda: None) for i, loop in enumerate(loops)]
        with emitter.batched():
            for i in range(6):
                emits[i % 2](i)
                with emitter.batched():  # nested: the outer block wakes
                    emits[i % 2](10 + i)
            assert [loop.wakeups for loop in loops] == [0, 0]
        assert [loop.wakeups for loop in loops] == [1, 1]
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0))
        assert got == [[0, 10, 2, 12, 4, 14], [1, 11, 3, 13, 5, 15]]
    finally:
        for loop in loops:
            loop.close()


def test_events_for_a_closed_loop_report_the_consumer_gone_once():
    """A loop closed with a delivery still pending (its consumer vanished without cancelling): the next event
    finds it closed, the request is told once (Engine cancels it), later events are dropped."""
    loop = _CountingLoop()
    gone = []
    emit = emitter.loop_emitter(loop, lambda ev: None, lambda: gone.append(1))
    emit("pending")  # a delivery is scheduled, never run
    loop.close()
    for ev in range(3):
        emit(ev)
    assert gone == [1]
    late = emitter.loop_emitter(loop, lambda ev: None, lambda: gone.append(2))
    late("x")
    assert gone == [1, 2]


def _batches(engine, request) -> list[list]:
    async def collect():
        return [batch async for batch in engine_event_batches(engine, request)]
    return asyncio.run(collect())


@pytest.fixture(scope="module")
def drafted_engine(tiny_qwen_path):
    """tiny-qwen3.6 with the oracle proposing each request's own greedy continuation (every draft stands, k=3),
    and the plain output it must equal."""
    settings = EngineSettings(max_context=256, max_concurrency=4, prefill_chunk=16)
    prompts = mixed_prompts(2)
    requests = [EngineRequest(f"r{i}", p, max_tokens=24, sampling=GREEDY) for i, p in enumerate(prompts)]
    plain = load_engine(tiny_qwen_path, settings)
    try:
        base = [token_ids(ev) for ev in run_all(plain, requests)]
    finally:
        plain.shutdown()
    oracle = OracleProposer({f"b{i}": ids for i, ids in enumerate(base)}, corrupt=0.0, vocab=900, seed=3)
    engine = load_engine(tiny_qwen_path, EngineSettings(max_context=256, max_concurrency=4, prefill_chunk=16,
                                                       draft_tokens=3), proposer=oracle)
    yield engine, prompts, base
    engine.shutdown()


def test_a_speculative_round_arrives_as_one_list_and_the_stream_is_unchanged(drafted_engine):
    """Each round commits up to 4 tokens of the request at once: they come as one list, whose tokens in order are
    the plain run's; the lists end with the FinishEvent and nothing follows it."""
    engine, prompts, base = drafted_engine
    batches = _batches(engine, EngineRequest("b0", prompts[0], max_tokens=24, sampling=GREEDY))
    assert batches[0] == [ACCEPTED]
    events = [ev for batch in batches[1:] for ev in batch]
    assert [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids] == base[0]
    assert isinstance(batches[-1][-1], FinishEvent) and not any(isinstance(ev, FinishEvent) for ev in events[:-1])
    sizes = [sum(isinstance(ev, TokenEvent) and bool(ev.token_ids) for ev in batch) for batch in batches[1:]]
    assert max(sizes) >= 3, sizes  # a round's drafts and the target's token together
    assert len(batches) - 1 < len(base[0]), sizes  # fewer lists than tokens


def test_one_event_at_a_time_and_the_local_client_see_the_same_stream(drafted_engine):
    """`engine_events` (the Engine deployment's `stream`, for notebooks) flattens the lists; the in-process client
    returns the lists after ACCEPTED, as the Ray client does."""
    engine, prompts, base = drafted_engine

    async def flat():
        return [ev async for ev in engine_events(engine, EngineRequest("b1", prompts[1], max_tokens=24,
                                                                       sampling=GREEDY))]

    async def local():
        stream = await LocalEngineClient(engine).open(EngineRequest("b1", prompts[1], max_tokens=24, sampling=GREEDY))
        return [batch async for batch in stream]

    events = asyncio.run(flat())
    assert events[0] == ACCEPTED and isinstance(events[-1], FinishEvent)
    assert [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids] == base[1]
    lists = asyncio.run(local())
    assert all(isinstance(batch, list) and batch for batch in lists)
    assert [t for b in lists for ev in b if isinstance(ev, TokenEvent) for t in ev.token_ids] == base[1]


def test_a_consumer_that_stops_early_cancels_the_request(drafted_engine):
    engine, prompts, _ = drafted_engine

    async def first_tokens():
        batches = engine_event_batches(engine, EngineRequest("b0", prompts[0], max_tokens=200, sampling=GREEDY))
        async for batch in batches:
            if any(isinstance(ev, TokenEvent) and ev.token_ids for ev in batch):
                break
        await batches.aclose()

    before = engine.snapshot()["requests"].get("cancelled", 0)
    asyncio.run(first_tokens())
    for _ in range(200):
        if engine.snapshot()["requests"].get("cancelled", 0) > before and engine.snapshot()["running"] == 0:
            break
        threading.Event().wait(0.02)
    assert engine.snapshot()["requests"].get("cancelled", 0) == before + 1
