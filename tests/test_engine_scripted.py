"""Engine behaviour driven by the scripted test model (contract: "Execution behavior",
"--default-thinking-budget", llama.cpp-compatible timings)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from engine_helpers import assert_no_leak

from ninfer.chat.thinking import THINKING_GUIDANCE, thinking_control
from ninfer.engine.engine import Engine, EngineSettings
from ninfer.engine.types import (
    Channel,
    ContextLengthExceededError,
    EngineRequest,
    FinishEvent,
    FinishReason,
    ProgressEvent,
    QueueTimeoutError,
    SamplingParams,
    ServerOverloadedError,
    ThinkingBudgetCapacityError,
    Timings,
    TokenEvent,
)
from ninfer.models.scripted import ScriptedModel

EOS = 248046  # <|im_end|>
THINK_END = 248069  # </think>


def make_engine(tok, scripts, start=True, **settings) -> Engine:
    model = ScriptedModel({"vocab_size": 248320, "eos": EOS, "scripts": scripts})
    base = dict(max_context=512, max_concurrency=4, page_size=4, prefill_chunk=8, eos_ids={EOS, 248044})
    engine = Engine(model, tok, EngineSettings(**{**base, **settings}), dtype=torch.float32, thinking=thinking_control(tok))
    return engine.start() if start else engine


def text_of(events, channel=None):
    return "".join(e.text for e in events if isinstance(e, TokenEvent) and (channel is None or e.channel == channel))


def finish_of(events) -> FinishEvent:
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


@pytest.fixture
def tok(qwen_tokenizer):
    return qwen_tokenizer


def test_scripted_answer_eos_and_usage(tok):
    prompt = tok.encode("Say hello")
    out = tok.encode("Hello there, friend!")
    engine = make_engine(tok, [{"trigger": prompt, "output": out + [EOS]}])
    try:
        events = engine.generate(EngineRequest("r1", prompt, max_tokens=50))
    finally:
        engine.shutdown()
    fin = finish_of(events)
    assert text_of(events) == "Hello there, friend!"
    assert fin.reason is FinishReason.STOP
    # the stop token counts in usage although its text is withheld
    assert fin.usage.completion_tokens == len(out) + 1
    assert fin.usage.prompt_tokens == len(prompt) and fin.usage.cached_tokens == 0
    assert fin.timings.prompt_n == len(prompt) and fin.timings.predicted_n == len(out) + 1
    assert_no_leak(engine)


def test_stop_string_split_across_tokens_is_found_and_withheld(tok):
    prompt = tok.encode("count")
    pieces = [tok.encode(p)[0] for p in ["one", " two", " th", "ree", " four"]]
    engine = make_engine(tok, [{"trigger": prompt, "output": pieces}])
    try:
        events = engine.generate(EngineRequest("r", prompt, max_tokens=20, stop=["three"]))
    finally:
        engine.shutdown()
    fin = finish_of(events)
    assert fin.reason is FinishReason.STOP_STRING and fin.stop_string == "three"
    assert text_of(events) == "one two "
    assert fin.usage.completion_tokens == 4  # "ree" committed, then the match


def test_stop_string_applies_to_reasoning_too(tok):
    prompt = tok.encode("think")
    out = tok.encode("I think FOO bar") + [THINK_END] + tok.encode("answer")
    engine = make_engine(tok, [{"trigger": prompt, "output": out}])
    try:
        events = engine.generate(EngineRequest("r", prompt, max_tokens=40, stop=["FOO"], thinking=True))
    finally:
        engine.shutdown()
    assert finish_of(events).reason is FinishReason.STOP_STRING
    assert text_of(events, Channel.REASONING) == "I think "
    assert text_of(events, Channel.ANSWER) == ""


def test_reasoning_and_answer_channels(tok):
    prompt = tok.encode("q")
    reasoning = tok.encode("Let me see.")
    answer = tok.encode("It is 4.")
    engine = make_engine(tok, [{"trigger": prompt, "output": reasoning + [THINK_END] + answer + [EOS]}])
    try:
        events = engine.generate(EngineRequest("r", prompt, max_tokens=40, thinking=True))
    finally:
        engine.shutdown()
    assert text_of(events, Channel.REASONING) == "Let me see."
    assert text_of(events, Channel.ANSWER) == "It is 4."
    assert finish_of(events).usage.reasoning_tokens == len(reasoning) + 1  # the close marker included


def test_thinking_budget_inserts_guidance_and_close_exactly(tok):
    prompt = tok.encode("hard question")
    rambling = tok.encode(" hmm" * 30)
    engine = make_engine(tok, [{"trigger": prompt, "output": rambling},
                               {"trigger": [THINK_END], "output": tok.encode("Done.") + [EOS]}])
    budget = 5
    try:
        events = engine.generate(EngineRequest("r", prompt, max_tokens=100, thinking=True, thinking_budget=budget))
    finally:
        engine.shutdown()
    suffix = tok.encode(THINKING_GUIDANCE) + [THINK_END]
    ids = [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]
    assert ids[:budget] == rambling[:budget]
    assert ids[budget : budget + len(suffix)] == suffix  # committed without sampling
    token_events = [e for e in events if isinstance(e, TokenEvent) and e.token_ids]
    assert [e.forced for e in token_events] == [False] * budget + [True] * len(suffix) + [False] * (
        len(token_events) - budget - len(suffix))
    assert text_of(events, Channel.REASONING) == tok.decode(rambling[:budget]) + THINKING_GUIDANCE
    assert text_of(events, Channel.ANSWER) == "Done."
    fin = finish_of(events)
    assert fin.thinking_budget_applied and fin.reason is FinishReason.STOP
    assert fin.usage.reasoning_tokens == budget + len(suffix)
    assert fin.usage.completion_tokens == budget + len(suffix) + len(tok.encode("Done.")) + 1


def test_thinking_budget_capacity_insufficient_rejected_at_preparation(tok):
    engine = make_engine(tok, [], start=False)
    suffix_len = len(tok.encode(THINKING_GUIDANCE)) + 1
    with pytest.raises(ThinkingBudgetCapacityError):
        engine.submit(EngineRequest("r", [1, 2], max_tokens=10 + suffix_len, thinking=True, thinking_budget=10),
                      lambda e: None)
    # enough for the suffix and one more token, or not past the cap at all: accepted
    engine.submit(EngineRequest("ok1", [1, 2], max_tokens=11 + suffix_len, thinking=True, thinking_budget=10),
                  lambda e: None)
    engine.submit(EngineRequest("ok2", [1, 2], max_tokens=10, thinking=True, thinking_budget=10), lambda e: None)


def test_natural_close_before_cap_means_no_insertion(tok):
    prompt = tok.encode("easy")
    out = tok.encode("ok") + [THINK_END] + tok.encode("4") + [EOS]
    engine = make_engine(tok, [{"trigger": prompt, "output": out}])
    try:
        events = engine.generate(EngineRequest("r", prompt, max_tokens=100, thinking=True, thinking_budget=40))
    finally:
        engine.shutdown()
    assert not finish_of(events).thinking_budget_applied
    assert [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids] == out


def test_max_tokens_zero_is_prompt_processing_only(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6, 7]}])
    try:
        events = engine.generate(EngineRequest("r", [5] * 20, max_tokens=0))
    finally:
        engine.shutdown()
    fin = finish_of(events)
    assert fin.reason is FinishReason.LENGTH and fin.usage.completion_tokens == 0
    assert fin.timings.predicted_n == 0 and fin.timings.as_dict()["predicted_per_second"] == 0.0


def test_max_tokens_limit_gives_length(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6] * 50}])
    try:
        fin = finish_of(engine.generate(EngineRequest("r", [5], max_tokens=7)))
    finally:
        engine.shutdown()
    assert fin.reason is FinishReason.LENGTH and fin.usage.completion_tokens == 7


def test_prompt_longer_than_context_fails_before_admission(tok):
    engine = make_engine(tok, [], start=False, max_context=16)
    with pytest.raises(ContextLengthExceededError) as err:
        engine.submit(EngineRequest("r", [1] * 17), lambda e: None)
    assert err.value.prompt_tokens == 17 and err.value.max_context == 16


def test_generation_reaching_context_ceiling_ends_with_context(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6] * 50}], max_context=16)
    try:
        fin = finish_of(engine.generate(EngineRequest("r", [5] * 10, max_tokens=100)))
    finally:
        engine.shutdown()
    assert fin.reason is FinishReason.CONTEXT and fin.usage.completion_tokens == 6


def test_pending_overflow_is_overloaded(tok):
    engine = make_engine(tok, [], start=False, max_concurrency=1, max_pending_requests=2)
    for i in range(3):
        engine.submit(EngineRequest(f"r{i}", [1]), lambda e: None)
    with pytest.raises(ServerOverloadedError):
        engine.submit(EngineRequest("r3", [1]), lambda e: None)


def test_pending_timeout_is_queue_timeout(tok):
    # one lane held by a long request; the second waits past its deadline
    engine = make_engine(tok, [{"trigger": [5], "output": [6] * 10_000}], max_concurrency=1, max_context=20_000,
                         pending_timeout_ms=200)
    got: list = []
    done = threading.Event()
    try:
        engine.submit(EngineRequest("long", [5], max_tokens=10_000), lambda e: None)
        time.sleep(0.05)
        engine.submit(EngineRequest("late", [5], max_tokens=1),
                      lambda e: (got.append(e), done.set()) if isinstance(e, Exception) else got.append(e))
        assert done.wait(5)
    finally:
        engine.cancel("long")
        engine.shutdown()
    assert isinstance(got[-1], QueueTimeoutError)


def _wait_until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_cancel_during_decode_returns_every_page(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6] * 100_000}], max_context=200_000)
    events = []
    try:
        engine.submit(EngineRequest("r", [5] * 30, max_tokens=100_000), events.append)
        assert _wait_until(lambda: sum(isinstance(e, TokenEvent) for e in events) > 3)
        engine.cancel("r")
        assert _wait_until(lambda: events and isinstance(events[-1], FinishEvent))
    finally:
        engine.shutdown()
    assert events[-1].reason is FinishReason.CANCELLED
    assert_no_leak(engine)
    assert not engine.scheduler.resident


def test_a_consumer_whose_loop_closed_cancels_its_request_and_the_engine_serves_on(tok):
    """The engine thread emits into an asyncio loop that closed under a live request, without the consumer's
    cancel (contract "Execution behavior": one request's end never fails the others). The request is cancelled,
    its pages come back, and the next request is served; before, the closed loop's RuntimeError inside the
    engine loop failed the engine and every request in it."""
    engine = make_engine(tok, [{"trigger": [5], "output": [6] * 100_000}], max_context=200_000)
    loop = asyncio.new_event_loop()
    try:
        async def first_event():
            stream = engine.stream(EngineRequest("gone", [5] * 4, max_tokens=100_000))
            return stream, await anext(stream)

        stream, _ = loop.run_until_complete(first_event())
        loop.close()  # the stream's `finally` (its cancel) never runs
        assert _wait_until(lambda: engine.counters.requests.get("cancelled", 0) == 1, timeout=30)
        assert engine.healthy
        events = engine.generate(EngineRequest("next", [5] * 4, max_tokens=3))
        assert finish_of(events).reason is FinishReason.LENGTH
    finally:
        engine.shutdown()
    assert_no_leak(engine)
    del stream


def test_cancel_during_prefill_returns_every_page(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6]}], prefill_chunk=4, max_context=100_000)
    events = []
    try:
        engine.submit(EngineRequest("r", [5] * 60_000, max_tokens=5), events.append)
        assert _wait_until(lambda: engine.counters.prefill_chunks > 2)
        engine.cancel("r")
        assert _wait_until(lambda: events and isinstance(events[-1], FinishEvent))
    finally:
        engine.shutdown()
    assert events[-1].reason is FinishReason.CANCELLED
    assert events[-1].usage.completion_tokens == 0
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen_tokenizer):
    """A real random model so sampling has a spread; the same seed gives the same tokens alone or in a batch."""
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-llama", "cpu", torch.float32, seed=3)
    tok = qwen_tokenizer

    def run(requests, concurrency):
        engine = Engine(model, tok, EngineSettings(max_context=256, max_concurrency=concurrency, page_size=4,
                                                   eos_ids=set()), dtype=torch.float32, thinking=thinking_control(tok)).start()
        try:
            async def main():
                async def one(req):
                    return [e async for e in engine.stream(req)]
                return await asyncio.gather(*(one(r) for r in requests))
            return asyncio.run(main())
        finally:
            engine.shutdown()

    def req(i, seed):
        return EngineRequest(f"r{i}", [10 + i, 20, 30 + i], max_tokens=12,
                             sampling=SamplingParams(temperature=1.5, top_k=20, seed=seed))

    def ids(events):
        return [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]

    alone = ids(run([req(0, 1234)], 1)[0])
    again = ids(run([req(0, 1234)], 1)[0])
    batched = run([req(0, 1234), req(1, 5), req(2, 6), req(3, 7)], 4)
    other_seed = ids(run([req(0, 999)], 1)[0])
    assert alone == again == ids(batched[0])
    assert alone != other_seed


def test_return_progress_events(tok):
    engine = make_engine(tok, [{"trigger": [5], "output": [6, EOS]}], prefill_chunk=8)
    try:
        events = engine.generate(EngineRequest("r", [5] * 30, max_tokens=5, return_progress=True))
    finally:
        engine.shutdown()
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert progress[0].processed == progress[0].cache == 0
    assert [p.processed for p in progress] == sorted(p.processed for p in progress)
    assert progress[-1].processed == progress[-1].total == 30
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent))
    assert events.index(progress[-1]) < first_token


def test_timings_zero_cases_are_finite():
    t = Timings(cache_n=10, prompt_n=0, prompt_ms=0.0, predicted_n=1, predicted_ms=0.0).as_dict()
    assert t["prompt_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    t = Timings(cache_n=0, prompt_n=100, prompt_ms=50.0, predicted_n=11, predicted_ms=100.0).as_dict()
    assert t["prompt_per_second"] == pytest.approx(2000.0)
    assert t["predicted_per_second"] == pytest.approx(100.0)  # 10 intervals in 100 ms
    assert t["predicted_per_token_ms"] == pytest.approx(10.0)


def test_replay_covered_entirely_by_a_retained_prefix_resumes_decoding(tok):
    """Two identical long requests in a small pool with no host budget: the paused twin's replay can
    be covered completely by the first one's retained endpoint; it must resume decoding, not crash."""
    prompt = [5] * 100  # with 256 KV slots the paused twin cannot come back until the first one ends
    for _ in range(2):
        engine = make_engine(tok, [{"trigger": [5], "output": [6] * 200}], max_concurrency=2, kv_capacity=256, page_size=1,
                             max_context=512, host_context_bytes=0)
        results: dict[str, list] = {"a": [], "b": []}
        try:
            for rid in results:
                engine.submit(EngineRequest(rid, prompt, max_tokens=150), results[rid].append)
            assert _wait_until(lambda res=results: all(r and isinstance(r[-1], FinishEvent) for r in res.values()), 30)
        finally:
            engine.shutdown()
        assert engine.healthy
        for events in results.values():
            assert finish_of(events).reason is FinishReason.LENGTH
            assert [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids] == [6] * 150
        assert_no_leak(engine)
