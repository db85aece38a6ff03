"""Randomized pressure on the engine's scheduling: small KV pools, host snapshots or replay, prefix
reuse with shared prompts, sessions, checkpoints, thinking budgets, stop strings and cancellations,
many requests at once. Whatever the interleaving, the engine stays healthy, every admitted request
ends with exactly one terminal event (its full output budget unless cancelled or at the context
ceiling), and no page, state slot or host byte is left held.

serving.md, "Execution behavior" and "--max-pending-requests": admitted requests may pause under
resource pressure and are restored later; an admitted request is never lost. The model is
FixedLogitsModel (every step emits one token, at no cost): the scheduling is what is under test.
Found this way: two snapshot restores in one admission round (the second allocation failed the
engine) and a retained prefix that kept the request reusing it out of a full pool forever.
"""

from __future__ import annotations

import random
import threading

import pytest
from engine_helpers import assert_no_leak

from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import Engine, EngineSettings
from ninfer.engine.types import EngineRequest, FinishEvent, FinishReason, SamplingParams, TokenEvent
from ninfer.models.scripted import FixedLogitsModel

PREFIXES = [[(31 * i + 7 * s) % 700 + 60 for i in range(60)] for s in range(3)]


def _scenario(seed: int) -> tuple[EngineSettings, list[tuple[EngineRequest, bool]]]:
    rng = random.Random(seed)
    concurrency = rng.choice([1, 2, 3, 4])
    settings = EngineSettings(
        max_context=rng.choice([128, 256]), max_concurrency=concurrency, prefill_chunk=rng.choice([16, 32, 64]),
        page_size=rng.choice([4, 16]), kv_capacity=rng.choice([64, 96, 160, 256, 400]),
        host_context_bytes=rng.choice([None, 0, 2000, 20000]), prefix_reuse=rng.random() < 0.7,
        max_pending_requests=32, pending_timeout_ms=600_000, eos_ids=set())  # a stall shows as a stall
    requests = []
    for i in range(rng.randint(3, 10)):
        prompt = PREFIXES[rng.randrange(3)][: rng.randint(4, 60)] + [rng.randint(60, 700) for _ in range(rng.randint(0, 20))]
        extra = {}
        if rng.random() < 0.3:
            extra.update(thinking=True, thinking_budget=rng.choice([None, 3, 10]))
        if rng.random() < 0.3 and len(prompt) > 2:
            extra["checkpoints"] = sorted({rng.randint(1, len(prompt) - 1) for _ in range(2)})
        if rng.random() < 0.3:
            extra["session_key"] = f"s{rng.randrange(2)}"
        sampling = (SamplingParams(temperature=0.0) if rng.random() < 0.5 else
                    SamplingParams(temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.5))
        request = EngineRequest(f"x{seed}-{i}", prompt, max_tokens=rng.randint(1, 80), sampling=sampling,
                                return_progress=rng.random() < 0.3, **extra)
        requests.append((request, rng.random() < 0.2))
    return settings, requests


@pytest.mark.parametrize("seed", range(16))
def test_random_pressure_loses_no_request_and_leaks_nothing(seed, qwen_tokenizer):
    settings, requests = _scenario(seed)
    engine = Engine(FixedLogitsModel(2000), qwen_tokenizer, settings, thinking=thinking_control(qwen_tokenizer)).start()
    engine.settings.eos_ids = set()
    events: dict[str, list] = {r.request_id: [] for r, _ in requests}
    finished = threading.Semaphore(0)
    submitted = 0
    try:
        for request, cancel in requests:
            def on_event(ev, rid=request.request_id):
                events[rid].append(ev)
                if isinstance(ev, (FinishEvent, Exception)):
                    finished.release()
            try:
                engine.submit(request, on_event)
            except Exception:  # refused at submission (e.g. context or thinking-budget capacity): fine
                events.pop(request.request_id)
                continue
            submitted += 1
            if cancel:
                threading.Timer(0.01 * (1 + submitted % 5), engine.cancel, args=(request.request_id,)).start()
        for _ in range(submitted):
            assert finished.acquire(timeout=60), {rid: evs[-1:] for rid, evs in events.items()}
        assert engine.healthy
        cancels = {r.request_id for r, cancel in requests if cancel}
        for request, _ in requests:
            evs = events.get(request.request_id)
            if evs is None:
                continue
            terminals = [e for e in evs if isinstance(e, (FinishEvent, Exception))]
            assert len(terminals) == 1, (request.request_id, terminals)
            last = terminals[0]
            assert isinstance(last, FinishEvent), (request.request_id, last)
            produced = sum(len(e.token_ids) for e in evs if isinstance(e, TokenEvent))
            assert last.reason in (FinishReason.LENGTH, FinishReason.CONTEXT, FinishReason.CANCELLED), last
            if last.reason is FinishReason.LENGTH:
                assert produced == request.max_tokens, (request.request_id, produced, request.max_tokens)
            if last.reason is FinishReason.CANCELLED:
                assert request.request_id in cancels
        assert engine.snapshot()["running"] == 0 and engine.host_used == 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()
