"""Context cache (contract: "Execution behavior": prefix reuse, checkpoints, pausing and restoration;
cached-token usage fields): exact reuse never changes greedy output, and pressure never leaks."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_helpers import assert_no_leak

from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0.0)
PAGE = 4


def _ids(events):
    return [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]


def _run(engine, prompt, rid, max_tokens=8, **kw):
    events = engine.generate(EngineRequest(rid, prompt, max_tokens=max_tokens, sampling=GREEDY, **kw))
    assert isinstance(events[-1], FinishEvent)
    return _ids(events), events[-1]


def _engine(path, **kw):
    settings = dict(max_context=512, max_concurrency=2, prefill_chunk=32, page_size=PAGE)
    settings.update(kw)
    return load_engine(path, EngineSettings(**settings))


def _prompt(n, salt=0):
    return [(31 * i + 7 * salt) % 700 + 60 for i in range(n)]


@pytest.fixture(params=["tiny_llama_path", "tiny_qwen_path", "smollm2_path"])
def model_path(request):
    return request.getfixturevalue(request.param), request.param != "tiny_qwen_path"


def test_multi_turn_reuses_the_previous_endpoint_with_identical_output(model_path):
    path, attention_only = model_path
    first = _prompt(37)
    cold = _engine(path, prefix_reuse=False)
    warm = _engine(path)
    try:
        out1, fin1 = _run(warm, first, "t1")
        assert fin1.usage.cached_tokens == 0 and fin1.prefix_reuse_path == "root"
        second = first + out1 + _prompt(9, salt=3)
        expect_ids, cold_fin = _run(cold, second, "c2")
        got_ids, fin2 = _run(warm, second, "t2")
    finally:
        cold.shutdown()
        warm.shutdown()
    endpoint = len(first) + len(out1) - 1  # every computed token of turn 1
    expected = endpoint - endpoint % PAGE if attention_only else endpoint
    assert got_ids == expect_ids
    assert cold_fin.usage.cached_tokens == 0
    assert fin2.usage.cached_tokens == expected and fin2.prefix_reuse_path == "checkpoint"
    assert fin2.timings.cache_n == expected and fin2.timings.prompt_n == len(second) - expected
    assert_no_leak(warm)


def test_edited_history_falls_back_to_an_earlier_checkpoint_or_root(tiny_qwen_path):
    """Hybrid: reuse only where state was captured. The input checkpoint at 20 survives an edit after it."""
    base = _prompt(40)
    engine = _engine(tiny_qwen_path)
    cold = _engine(tiny_qwen_path, prefix_reuse=False)
    try:
        _run(engine, base, "a", checkpoints=[20])
        edited = base[:30] + [999] + base[31:]
        got, fin = _run(engine, edited, "b")
        want, _ = _run(cold, edited, "c")
        early_edit = [998] + base[1:]
        _, fin_root = _run(engine, early_edit, "d")
    finally:
        engine.shutdown()
        cold.shutdown()
    assert fin.usage.cached_tokens == 20 and got == want
    assert fin_root.usage.cached_tokens == 0 and fin_root.prefix_reuse_path == "root"
    assert_no_leak(engine)


def test_attention_models_reuse_any_page_aligned_prefix(tiny_llama_path):
    base = _prompt(50)
    engine = _engine(tiny_llama_path)
    try:
        _run(engine, base, "a")
        _, fin = _run(engine, base[:23] + [5, 6, 7], "b")
    finally:
        engine.shutdown()
    assert fin.usage.cached_tokens == 20  # 23 common tokens, whole pages only


def test_no_prefix_reuse_reads_and_writes_nothing(tiny_qwen_path):
    engine = _engine(tiny_qwen_path, prefix_reuse=False)
    try:
        out, _ = _run(engine, _prompt(30), "a", checkpoints=[10])
        _, fin = _run(engine, _prompt(30) + out + [1, 2], "b")
        assert not engine.cache.entries
    finally:
        engine.shutdown()
    assert fin.usage.cached_tokens == 0


def test_session_keeps_only_its_latest_endpoint(tiny_qwen_path):
    engine = _engine(tiny_qwen_path)
    try:
        out, _ = _run(engine, _prompt(20), "a", session_key="s")
        _run(engine, _prompt(20) + out + [3, 4], "b", session_key="s")
        _run(engine, _prompt(25, salt=1), "c", retain_endpoint=False)  # a store:false child
        kinds = [(e.kind, e.session) for e in engine.cache.entries]
    finally:
        engine.shutdown()
    assert kinds == [("endpoint", "s")]


def _storm(path, **kw):
    """4 concurrent long requests in a pool that holds about two of them."""
    prompts = [_prompt(60, salt=s) for s in range(4)]
    engine = _engine(path, max_concurrency=4, kv_capacity=160, state_slots=8, prefix_reuse=False, **kw)

    async def main():
        async def one(i):
            return [e async for e in engine.stream(EngineRequest(f"s{i}", prompts[i], max_tokens=40,
                                                                   sampling=GREEDY))]
        return await asyncio.gather(*(one(i) for i in range(4)))
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    return prompts, [_ids(r) for r in results], engine


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen_path", "smollm2_path"])
@pytest.mark.parametrize("host_budget", [None, 0], ids=["snapshot", "replay"])
def test_pressure_storm_keeps_greedy_output(fixture, host_budget, request):
    path = request.getfixturevalue(fixture)
    prompts, outputs, engine = _storm(path, host_context_bytes=host_budget)
    alone = _engine(path, prefix_reuse=False)
    try:
        expected = [_run(alone, p, f"alone{i}", max_tokens=40)[0] for i, p in enumerate(prompts)]
    finally:
        alone.shutdown()
    assert outputs == expected
    counters = engine.counters
    assert engine.scheduler.preemptions > 0
    if host_budget == 0:
        assert counters.replay_restores > 0 and counters.snapshot_restores == 0 and counters.replayed_tokens > 0
    else:
        assert counters.snapshot_restores > 0 and counters.transfer_bytes_h2d > 0
    assert engine.host_used == 0
    assert_no_leak(engine)


def test_many_snapshot_restores_at_once_never_fail_the_engine(qwen_tokenizer):
    """Eight requests in a pool that holds about one of them, with host snapshots: several paused
    requests become restorable at the same boundary. Every request still completes (serving.md: an
    admitted request may pause for resource pressure and is never lost)."""
    from ninfer.engine.engine import Engine
    from ninfer.engine.types import FinishReason
    from ninfer.models.scripted import FixedLogitsModel

    settings = EngineSettings(max_context=528, max_concurrency=8, eos_ids=set())
    engine = Engine(FixedLogitsModel(2000), qwen_tokenizer, settings, thinking=thinking_control(qwen_tokenizer)).start()
    outputs: dict[int, list] = {}

    def one(i: int) -> None:
        request = EngineRequest(f"m{i}", [100 + i] * 64, max_tokens=300, sampling=GREEDY)
        outputs[i] = engine.generate(request, timeout=120)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.healthy
        for i in range(8):
            assert outputs[i][-1].reason is FinishReason.LENGTH and len(_ids(outputs[i])) == 300, i
        assert engine.counters.snapshot_restores > 0 and engine.scheduler.preemptions > 0
        assert engine.host_used == 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()
